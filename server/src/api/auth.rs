//! Tokens and credentials: random 256-bit secrets, shown once, stored
//! only as SHA-256 hashes, compared in constant time.

use subtle::ConstantTimeEq;

/// A fresh random token: 32 bytes from the operating system, hex-encoded.
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).unwrap_or_else(|e| panic!("the operating system's RNG failed: {e}"));
    let token = hex::encode(bytes);
    zeroize::Zeroize::zeroize(&mut bytes);
    token
}

/// SHA-256 of a token, the form in which it is stored.
pub fn token_hash(token: &str) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// Whether `presented` is the token whose hash is `expected`, in constant time.
pub fn verify_token(presented: &str, expected: &[u8; 32]) -> bool {
    token_hash(presented).ct_eq(expected).into()
}

/// A random identifier (128 bits, hex).
pub fn new_id() -> String {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).unwrap_or_else(|e| panic!("the operating system's RNG failed: {e}"));
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_verify_only_against_their_hash() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(verify_token(&a, &token_hash(&a)));
        assert!(!verify_token(&b, &token_hash(&a)));
        assert!(!verify_token("", &token_hash(&a)));
    }
}
