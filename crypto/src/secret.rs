//! Secret byte strings.
//!
//! [`Secret32`] holds key material and seeds. It is zeroized on drop, has no
//! `Debug`, `Clone` or `Serialize`, and compares in constant time. The bytes
//! are reachable only inside this crate.

use rand_core::CryptoRng;
use subtle::{Choice, ConstantTimeEq};
use zeroize::{Zeroize, ZeroizeOnDrop};

/// 32 bytes of secret material: a self-mask seed, an X25519 secret scalar, a
/// shared secret or a derived key.
#[derive(Zeroize, ZeroizeOnDrop)]
pub struct Secret32([u8; 32]);

impl Secret32 {
    /// Draws 32 uniformly random bytes.
    pub fn random<R: CryptoRng + ?Sized>(rng: &mut R) -> Self {
        let mut bytes = [0u8; 32];
        rng.fill_bytes(&mut bytes);
        let secret = Self(bytes);
        bytes.zeroize();
        secret
    }

    /// Takes ownership of `bytes`, wiping the caller's copy.
    pub fn from_bytes(bytes: &mut [u8; 32]) -> Self {
        let secret = Self(*bytes);
        bytes.zeroize();
        secret
    }

    pub(crate) fn expose(&self) -> &[u8; 32] {
        &self.0
    }
}

impl ConstantTimeEq for Secret32 {
    fn ct_eq(&self, other: &Self) -> Choice {
        self.0.ct_eq(&other.0)
    }
}

impl PartialEq for Secret32 {
    fn eq(&self, other: &Self) -> bool {
        self.ct_eq(other).into()
    }
}

impl Eq for Secret32 {}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    #[test]
    fn from_bytes_wipes_the_source() {
        let mut bytes = [7u8; 32];
        let secret = Secret32::from_bytes(&mut bytes);
        assert_eq!(bytes, [0u8; 32]);
        assert_eq!(secret.expose(), &[7u8; 32]);
    }

    #[test]
    fn equality_is_by_value() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let a = Secret32::random(&mut rng);
        let b = Secret32::random(&mut rng);
        let mut copy = *a.expose();
        assert!(a == Secret32::from_bytes(&mut copy));
        assert!(a != b);
    }
}
