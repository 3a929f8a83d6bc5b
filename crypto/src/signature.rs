//! Ed25519 signatures (RFC 8032, via `ed25519-dalek`) for the active-adversary variant.
//!
//! A client's long-term identity key signs its advertised round keys and the
//! survivor list of the consistency check; peers verify with the identity
//! public keys that the round's roster binds.
//!
//! A client checks the many signatures of one stage (its neighbours' key
//! advertisements, the survivors' consistency signatures) as one batch
//! ([`verify_all`]): a random linear combination of the verification
//! equations, weighted by 128-bit scalars drawn from a hash of everything
//! in the batch. A batch passes only if every signature in it was made with
//! its signer's key (except with probability about 2^-128). The one
//! difference from checking each signature alone: a key's *holder* can
//! craft a signature with a small-order component that one check accepts
//! and the other refuses. That only lets a corrupt client make an honest
//! peer refuse the round, which the coordinator can always do by
//! withholding a message; it never lets anybody speak for a key they do not
//! hold.

use crate::error::CryptoError;
use crate::secret::Secret32;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use rand_core::CryptoRng;

/// Length of an Ed25519 signature.
pub const SIGNATURE_LEN: usize = 64;

/// A client's long-term Ed25519 signing key; zeroized on drop.
pub struct IdentityKey {
    key: SigningKey,
}

impl IdentityKey {
    /// Derives the key pair from a 32-byte RFC 8032 seed.
    pub fn from_seed(seed: &Secret32) -> Result<Self, CryptoError> {
        Ok(Self { key: SigningKey::from_bytes(seed.expose()) })
    }

    /// Draws a fresh identity.
    pub fn generate<R: CryptoRng + ?Sized>(rng: &mut R) -> Self {
        let seed = Secret32::random(rng);
        Self { key: SigningKey::from_bytes(seed.expose()) }
    }

    /// The public verification key.
    pub fn public_key(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    /// Signs `message` (deterministic, as RFC 8032 specifies).
    pub fn sign(&self, message: &[u8]) -> [u8; SIGNATURE_LEN] {
        self.key.sign(message).to_bytes()
    }
}

/// Verifies an Ed25519 signature: the cofactorless equation of RFC 8032
/// with a canonical `s`, refusing a small-order public key or `R`.
pub fn verify(
    public_key: &[u8; 32],
    message: &[u8],
    signature: &[u8; SIGNATURE_LEN],
) -> Result<(), CryptoError> {
    let key = VerifyingKey::from_bytes(public_key).map_err(|_| CryptoError)?;
    key.verify_strict(message, &Signature::from_bytes(signature)).map_err(|_| CryptoError)
}

/// One signature to check: the signer's public key, the message, the
/// signature.
pub type Signed<'a> = (&'a [u8; 32], &'a [u8], &'a [u8; SIGNATURE_LEN]);

/// Verifies every signature of `batch` at once (see the module docs);
/// fails if any one is invalid, without saying which. An empty batch
/// passes.
pub fn verify_all(batch: &[Signed<'_>]) -> Result<(), CryptoError> {
    if batch.len() == 1 {
        let (key, message, signature) = batch[0];
        return verify(key, message, signature);
    }
    let mut messages = Vec::with_capacity(batch.len());
    let mut signatures = Vec::with_capacity(batch.len());
    let mut keys = Vec::with_capacity(batch.len());
    for &(key, message, signature) in batch {
        let key = VerifyingKey::from_bytes(key).map_err(|_| CryptoError)?;
        // As `verify` does: a small-order key signs anything.
        if key.is_weak() {
            return Err(CryptoError);
        }
        keys.push(key);
        messages.push(message);
        signatures.push(Signature::from_bytes(signature));
    }
    ed25519_dalek::verify_batch(&messages, &signatures, &keys).map_err(|_| CryptoError)
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
    fn a_batch_fails_on_any_bad_signature_and_on_a_small_order_key() {
        let mut rng = ChaCha20Rng::seed_from_u64(12);
        let keys: Vec<IdentityKey> = (0..40).map(|_| IdentityKey::generate(&mut rng)).collect();
        let publics: Vec<[u8; 32]> = keys.iter().map(IdentityKey::public_key).collect();
        let messages: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 1 + usize::from(i)]).collect();
        let signatures: Vec<[u8; SIGNATURE_LEN]> =
            keys.iter().zip(&messages).map(|(key, message)| key.sign(message)).collect();
        let batch = |signatures: &[[u8; SIGNATURE_LEN]], messages: &[Vec<u8>], publics: &[[u8; 32]]| {
            let items: Vec<Signed<'_>> = publics
                .iter()
                .zip(messages)
                .zip(signatures)
                .map(|((public, message), signature)| (public, message.as_slice(), signature))
                .collect();
            verify_all(&items)
        };
        assert_eq!(batch(&signatures, &messages, &publics), Ok(()));
        assert_eq!(verify_all(&[]), Ok(()));
        for i in [0, 17, 39] {
            let mut forged = signatures.clone();
            forged[i][3] ^= 1;
            assert_eq!(batch(&forged, &messages, &publics), Err(CryptoError), "signature {i} altered");
            let mut altered = messages.clone();
            altered[i][0] ^= 1;
            assert_eq!(batch(&signatures, &altered, &publics), Err(CryptoError), "message {i} altered");
            let mut swapped = publics.clone();
            swapped.swap(i, (i + 1) % 40);
            assert_eq!(batch(&signatures, &messages, &swapped), Err(CryptoError), "keys {i} swapped");
        }
        // The identity point (a small-order key): with R also the identity
        // and s = 0 it "signs" every message; both checks refuse it.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let mut trivial = [0u8; SIGNATURE_LEN];
        trivial[0] = 1;
        assert_eq!(verify(&identity, b"anything", &trivial), Err(CryptoError));
        let mut with_weak = publics.clone();
        with_weak[5] = identity;
        let mut weak_signatures = signatures.clone();
        weak_signatures[5] = trivial;
        assert_eq!(batch(&weak_signatures, &messages, &with_weak), Err(CryptoError));
    }

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
