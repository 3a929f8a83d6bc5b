//! X25519 key agreement (RFC 7748, via `x25519-dalek`).

use rand_core::CryptoRng;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use crate::error::CryptoError;
use crate::secret::Secret32;

/// An X25519 secret key and its public key.
///
/// The secret is zeroized on drop. It can be exported only as a
/// [`Secret32`], to be Shamir-shared.
pub struct AgreementKey {
    secret: StaticSecret,
    public: [u8; 32],
}

impl AgreementKey {
    /// Draws a fresh key pair.
    pub fn generate<R: CryptoRng + ?Sized>(rng: &mut R) -> Self {
        Self::from_static(StaticSecret::random_from_rng(rng))
    }

    /// Rebuilds a key pair from its 32-byte secret (for example after Shamir
    /// reconstruction).
    pub fn from_secret(secret: &Secret32) -> Self {
        Self::from_static(StaticSecret::from(*secret.expose()))
    }

    fn from_static(secret: StaticSecret) -> Self {
        let public = PublicKey::from(&secret).to_bytes();
        Self { secret, public }
    }

    /// The public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// The secret scalar as shareable secret bytes.
    pub fn export_secret(&self) -> Secret32 {
        let mut bytes = Zeroizing::new(self.secret.to_bytes());
        Secret32::from_bytes(&mut bytes)
    }

    /// X25519 with `their_public`. Fails on a non-contributory result (a
    /// low-order peer key), which would make the shared secret predictable.
    pub fn agree(&self, their_public: &[u8; 32]) -> Result<Secret32, CryptoError> {
        let shared = self.secret.diffie_hellman(&PublicKey::from(*their_public));
        if !shared.was_contributory() {
            return Err(CryptoError);
        }
        let mut bytes = Zeroizing::new(shared.to_bytes());
        Ok(Secret32::from_bytes(&mut bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    #[test]
    fn both_sides_agree() {
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let a = AgreementKey::generate(&mut rng);
        let b = AgreementKey::generate(&mut rng);
        let ab = a.agree(&b.public_key()).unwrap();
        let ba = b.agree(&a.public_key()).unwrap();
        assert!(ab == ba);
    }

    #[test]
    fn low_order_points_are_rejected() {
        let mut rng = ChaCha20Rng::seed_from_u64(4);
        let a = AgreementKey::generate(&mut rng);
        // The identity (u = 0) and u = 1 are of low order on Curve25519.
        assert_eq!(a.agree(&[0u8; 32]).err(), Some(CryptoError));
        let mut one = [0u8; 32];
        one[0] = 1;
        assert_eq!(a.agree(&one).err(), Some(CryptoError));
    }

    #[test]
    fn exported_secret_rebuilds_the_same_key() {
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let a = AgreementKey::generate(&mut rng);
        let rebuilt = AgreementKey::from_secret(&a.export_secret());
        assert_eq!(rebuilt.public_key(), a.public_key());
    }
}
