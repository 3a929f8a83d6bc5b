//! Enrollment bodies with an Ed25519 identity key and its proof, as the
//! client library sends them.

use cohort_crypto::signature::{IdentityKey, enrollment_statement};
use cohort_crypto::testing::ProtocolClient;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use serde_json::{Value, json};

/// The body of an enrollment in `task` with `token` under `identity`.
pub fn enrollment(task: &str, token: &str, identity: &IdentityKey) -> Value {
    let public = identity.public_key();
    json!({
        "enrollment_token": token,
        "identity_key": hex::encode(public),
        "identity_proof": hex::encode(identity.sign(&enrollment_statement(task, &public))),
    })
}

/// A fresh identity key from the operating system's randomness.
pub fn fresh_identity() -> IdentityKey {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).unwrap();
    IdentityKey::generate(&mut ChaCha20Rng::from_seed(seed))
}

/// The body of an enrollment under a fresh identity.
pub fn fresh_enrollment(task: &str, token: &str) -> Value {
    enrollment(task, token, &fresh_identity())
}

/// The enrollment body of a protocol test client.
pub trait Enrollment {
    /// The body of this client's enrollment in `task` with `token`.
    fn enrollment(&self, task: &str, token: &str) -> Value;
}

impl Enrollment for ProtocolClient {
    fn enrollment(&self, task: &str, token: &str) -> Value {
        enrollment(task, token, &self.identity)
    }
}
