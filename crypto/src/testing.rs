//! Test support (feature `test-support`): a protocol client that answers a
//! coordinator's stage messages with a fixed update, for the tests of the
//! crates built on this one (the coordinator's engine, its HTTP API, the
//! process-level tests). Not for production: it panics on any protocol
//! error, which is what a test wants to see.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::signature::IdentityKey;
use crate::{Client, ClientId, MetricValues, Quantizer, ServerMessage};

/// The protocol side of a test client: it holds a fixed update and answers
/// server messages with the [`Client`] state machine.
pub struct ProtocolClient {
    /// The update it contributes.
    pub update: Vec<f32>,
    /// Its example count.
    pub weight: u32,
    /// The metrics it reports with its update (none unless set).
    pub metrics: MetricValues,
    /// The identity key this client enrolls with.
    pub identity: Arc<IdentityKey>,
    state: Option<Client>,
    rng: ChaCha20Rng,
}

impl core::fmt::Debug for ProtocolClient {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ProtocolClient").field("weight", &self.weight).finish_non_exhaustive()
    }
}

impl ProtocolClient {
    /// A client whose identity key and randomness come from `seed`.
    pub fn new(seed: u64, update: Vec<f32>, weight: u32) -> Self {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let identity = Arc::new(IdentityKey::generate(&mut rng));
        Self { update, weight, metrics: MetricValues::new(), identity, state: None, rng }
    }

    /// Forgets the current round (the client restarts its protocol state).
    pub fn reset(&mut self) {
        self.state = None;
    }

    /// Answers one encoded server message as client `client_id`.
    ///
    /// # Panics
    /// On a message that does not decode, or that the protocol refuses.
    pub fn respond(&mut self, client_id: u32, bytes: &[u8]) -> Vec<u8> {
        self.try_respond(client_id, bytes).unwrap()
    }

    /// [`respond`](Self::respond), with the protocol's refusal as an error
    /// (the client then leaves the round, as a real one would).
    ///
    /// # Panics
    /// On a message that does not decode, or a setup it cannot start from.
    pub fn try_respond(&mut self, client_id: u32, bytes: &[u8]) -> Result<Vec<u8>, crate::ProtocolError> {
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
                reply?
            }
        };
        Ok(reply.encode())
    }
}

/// Σ w_k Δ_k / Σ w_k over the clients.
///
/// # Panics
/// When `clients` is empty.
pub fn weighted_mean(clients: &[&ProtocolClient]) -> Vec<f32> {
    let total: f32 = clients.iter().map(|c| c.weight as f32).sum();
    (0..clients[0].update.len())
        .map(|j| clients.iter().map(|c| c.update[j] * c.weight as f32).sum::<f32>() / total)
        .collect()
}

/// A consistency-check signature over `survivors`, as client `signer` of
/// the round with identity key `identity` makes it: what a coordinator's own
/// (corrupt) clients hand it for any list it likes, in the adversary
/// model's replays against the real clients.
pub fn sign_survivor_list(
    identity: &IdentityKey,
    context: &crate::RoundContext,
    signer: ClientId,
    survivors: &[ClientId],
) -> [u8; crate::signature::SIGNATURE_LEN] {
    identity.sign(&crate::derive::consistency_statement(context, signer, survivors))
}
