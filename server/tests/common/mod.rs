//! Test helpers shared by the API and process tests.

#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use cohort_crypto::signature::IdentityKey;
use cohort_crypto::{Client, ClientId, MetricValues, Quantizer, ServerMessage};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use serde_json::Value;

#[path = "../support/identity.rs"]
mod identity;
#[allow(unused_imports)]
pub use identity::{enrollment, fresh_enrollment, fresh_identity};

/// The protocol side of a test client: it holds a fixed update and answers
/// server messages with the `cohort-crypto` client state machine.
pub struct Participant {
    pub update: Vec<f32>,
    pub weight: u32,
    /// The metrics it reports with its update (none unless set).
    pub metrics: MetricValues,
    /// The identity key this client enrolls with.
    pub identity: Arc<IdentityKey>,
    state: Option<Client>,
    rng: ChaCha20Rng,
}

impl Participant {
    pub fn new(seed: u64, update: Vec<f32>, weight: u32) -> Self {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let identity = Arc::new(IdentityKey::generate(&mut rng));
        Self { update, weight, metrics: MetricValues::new(), identity, state: None, rng }
    }

    /// The body of this client's enrollment in `task`.
    pub fn enrollment(&self, task: &str, token: &str) -> Value {
        enrollment(task, token, &self.identity)
    }

    /// Forgets the current round (the client restarts its protocol state).
    pub fn reset(&mut self) {
        self.state = None;
    }

    /// Answers one encoded server message as client `client_id`.
    pub fn respond(&mut self, client_id: u32, bytes: &[u8]) -> Vec<u8> {
        let message = ServerMessage::decode(bytes).unwrap();
        if matches!(message, ServerMessage::Setup(_)) {
            self.state = None;
        }
        let reply = match self.state.take() {
            None => {
                let ServerMessage::Setup(config) = &message else { panic!("expected the setup") };
                let q = Quantizer::new(config.quantization, config.modulus_bits, config.clients).unwrap();
                let input =
                    q.encode_with_metrics(&self.update, self.weight, &self.metrics, &mut self.rng).unwrap();
                let me = ClientId::new(client_id).unwrap();
                let identity = Some(self.identity.clone());
                let (state, reply) = Client::start(message, me, identity, input, &mut self.rng).unwrap();
                self.state = Some(state);
                reply
            }
            Some(state) => {
                let (next, reply) = state.handle(message, &mut self.rng);
                self.state = Some(next);
                reply.unwrap()
            }
        };
        reply.encode()
    }
}

/// Σ w_k Δ_k / Σ w_k over the participants.
pub fn weighted_mean(participants: &[&Participant]) -> Vec<f32> {
    let total: f32 = participants.iter().map(|p| p.weight as f32).sum();
    (0..participants[0].update.len())
        .map(|j| participants.iter().map(|p| p.update[j] * p.weight as f32).sum::<f32>() / total)
        .collect()
}
