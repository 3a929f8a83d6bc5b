//! AES-256-GCM envelopes that carry Shamir shares from one client to another
//! through the server.
//!
//! Each envelope key is derived for exactly one (round, sender, receiver)
//! triple and seals exactly one message, so a fixed all-zero nonce is safe;
//! the associated data binds the round context and both identities.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use zeroize::Zeroizing;

use crate::error::CryptoError;
use crate::secret::Secret32;

/// Length of the authentication tag appended to every envelope.
pub const TAG_LEN: usize = 16;

/// A single-use AES-256-GCM key.
pub struct EnvelopeKey(Secret32);

impl EnvelopeKey {
    /// Wraps 32 bytes of derived key material.
    pub fn new(key: Secret32) -> Self {
        Self(key)
    }

    fn cipher(&self) -> Aes256Gcm {
        // A 32-byte slice is always a valid AES-256 key.
        match Aes256Gcm::new_from_slice(self.0.expose()) {
            Ok(cipher) => cipher,
            Err(_) => unreachable!("AES-256 keys are 32 bytes"),
        }
    }

    /// Encrypts and authenticates `plaintext` with associated data `aad`.
    /// Consumes the key: it must never seal a second message.
    pub fn seal(self, aad: &[u8], plaintext: &[u8]) -> Vec<u8> {
        let nonce = Nonce::from([0u8; 12]);
        match self.cipher().encrypt(&nonce, Payload { msg: plaintext, aad }) {
            Ok(ciphertext) => ciphertext,
            // Only inputs longer than 2^36 bytes can fail.
            Err(_) => unreachable!("share envelopes are a few hundred bytes"),
        }
    }

    /// Authenticates and decrypts an envelope.
    pub fn open(self, aad: &[u8], ciphertext: &[u8]) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
        let nonce = Nonce::from([0u8; 12]);
        self.cipher()
            .decrypt(&nonce, Payload { msg: ciphertext, aad })
            .map(Zeroizing::new)
            .map_err(|_| CryptoError)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> EnvelopeKey {
        EnvelopeKey::new(Secret32::from_bytes(&mut [byte; 32]))
    }

    #[test]
    fn round_trip_and_tamper_detection() {
        let sealed = key(9).seal(b"aad", b"share bytes");
        assert_eq!(sealed.len(), 11 + TAG_LEN);
        assert_eq!(key(9).open(b"aad", &sealed).unwrap().as_slice(), b"share bytes");
        assert_eq!(key(9).open(b"other", &sealed).err(), Some(CryptoError));
        assert_eq!(key(8).open(b"aad", &sealed).err(), Some(CryptoError));
        let mut flipped = sealed.clone();
        flipped[0] ^= 1;
        assert_eq!(key(9).open(b"aad", &flipped).err(), Some(CryptoError));
    }
}
