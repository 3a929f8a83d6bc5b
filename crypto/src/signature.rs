//! Ed25519 signatures (RFC 8032, via `ring`) for the active-adversary variant.
//!
//! A client's long-term identity key signs its advertised round keys and the
//! survivor list of the consistency check; peers verify with the identity
//! public keys that the round's roster binds.

use crate::error::CryptoError;
use crate::secret::Secret32;
use rand_core::CryptoRng;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};

/// Length of an Ed25519 signature.
pub const SIGNATURE_LEN: usize = 64;

/// A client's long-term Ed25519 signing key.
pub struct IdentityKey {
    pair: Ed25519KeyPair,
}

impl IdentityKey {
    /// Derives the key pair from a 32-byte RFC 8032 seed.
    pub fn from_seed(seed: &Secret32) -> Result<Self, CryptoError> {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed.expose()).map_err(|_| CryptoError)?;
        Ok(Self { pair })
    }

    /// Draws a fresh identity.
    pub fn generate<R: CryptoRng + ?Sized>(rng: &mut R) -> Self {
        let seed = Secret32::random(rng);
        match Self::from_seed(&seed) {
            Ok(key) => key,
            Err(_) => unreachable!("every 32-byte string is a valid Ed25519 seed"),
        }
    }

    /// The public verification key.
    pub fn public_key(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(self.pair.public_key().as_ref());
        out
    }

    /// Signs `message`.
    pub fn sign(&self, message: &[u8]) -> [u8; SIGNATURE_LEN] {
        let mut out = [0u8; SIGNATURE_LEN];
        out.copy_from_slice(self.pair.sign(message).as_ref());
        out
    }
}

/// Verifies an Ed25519 signature.
pub fn verify(
    public_key: &[u8; 32],
    message: &[u8],
    signature: &[u8; SIGNATURE_LEN],
) -> Result<(), CryptoError> {
    UnparsedPublicKey::new(&ED25519, public_key).verify(message, signature).map_err(|_| CryptoError)
}

/// What a participant signs at enrollment to show that it holds the
/// identity key it registers for `task`: a domain label, the task id and
/// the public key.
pub fn enrollment_statement(task: &str, public_key: &[u8; 32]) -> Vec<u8> {
    let length = (task.len() as u32).to_be_bytes();
    signed_message(b"cohort/secagg/v2/enrollment", &[&length, task.as_bytes(), public_key])
}

/// Builds a signed message: a domain label followed by the parts.
pub(crate) fn signed_message(label: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut message = Vec::with_capacity(label.len() + parts.iter().map(|part| part.len()).sum::<usize>());
    message.extend_from_slice(label);
    for part in parts {
        message.extend_from_slice(part);
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    #[test]
    fn sign_and_verify() {
        let mut rng = ChaCha20Rng::seed_from_u64(11);
        let key = IdentityKey::generate(&mut rng);
        let sig = key.sign(b"message");
        assert!(verify(&key.public_key(), b"message", &sig).is_ok());
        assert_eq!(verify(&key.public_key(), b"messagf", &sig), Err(CryptoError));
        let other = IdentityKey::generate(&mut rng);
        assert_eq!(verify(&other.public_key(), b"message", &sig), Err(CryptoError));
    }
}
