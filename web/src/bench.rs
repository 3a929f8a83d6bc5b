//! The browser's secure-aggregation cost, measured where it runs
//! (`web/tests/bench.mjs` drives a [`BenchRound`] in Chromium): one round of
//! `clients` clients in the complete graph, so that each client agrees keys
//! with and masks against `clients − 1` neighbours (k), over `dim`
//! coordinates, every client on the page's one thread, one at a time. A
//! client's time is what the native `cohort bench secagg` reports as
//! `client_ms_mean`: from its quantized input on, decoding, computing and
//! encoding every stage's message; the page measures it around each step,
//! including the WebCrypto work a step hands to the page
//! (`web/static/webcrypto.js`) when the round runs that way. The same round
//! run both ways sends the same messages, which the page checks from each
//! client's [`BenchRound::transcript`].

use cohort_client::protocol::client::{Deferred, PendingStep, Work};
use cohort_client::protocol::graph::GraphSpec;
use cohort_client::protocol::simulation::plain_sum;
use cohort_client::protocol::validation::{self, NormBound, ValidationError};
use cohort_client::protocol::{
    Advanced, Client, ClientId, MetricSet, ProtocolError, QuantizationSpec, QuantizedInput, RoundConfig,
    ServerMessage, ServerRound, Transform, Variant,
};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use serde_json::{Value, json};
use wasm_bindgen::prelude::*;
use zeroize::Zeroize;

use crate::host;

/// The round's parameters: semi-honest, the complete graph, no transform.
fn bench_config(clients: u32, dim: u32, threshold: u32, modulus_bits: u8) -> RoundConfig {
    RoundConfig {
        session: [11; 16],
        round: 1,
        variant: Variant::SemiHonest,
        clients,
        identities: Vec::new(),
        graph: GraphSpec::Complete,
        threshold,
        vector_len: dim,
        modulus_bits,
        quantization: QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: Transform::None,
            metrics: MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        },
        model: None,
    }
}

/// Client `id`'s input, within the headroom so that the sum does not wrap.
fn bench_input(config: &RoundConfig, id: ClientId) -> QuantizedInput {
    let limit = ((1u64 << config.modulus_bits) - 1) / u64::from(config.clients);
    let mut state = u64::from(id.get()).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    QuantizedInput::from_values(
        (0..config.vector_len)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((state >> 32) % (limit + 1)) as u32
            })
            .collect(),
    )
}

/// FNV-1a, 64 bits: a client's transcript, to tell two runs' messages
/// apart (not a cryptographic digest; nothing here is adversarial).
fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(state, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn protocol(error: ProtocolError) -> JsError {
    JsError::new(&error.to_string())
}

/// One round whose clients the page drives step by step (see the module
/// documentation): `start(i)` for every client, then, while `advance()`
/// is true, `step(i, hostCrypto)` for every client, followed by the
/// `host_work` the step asks for (`hostAction(i)`, the `host*` methods,
/// as `web/static/webcrypto.js` does for a `WebClient`).
#[wasm_bindgen]
pub struct BenchRound {
    config: RoundConfig,
    server: Option<ServerRound>,
    clients: Vec<Option<Client>>,
    pending: Vec<Option<PendingStep>>,
    rngs: Vec<ChaCha20Rng>,
    outbox: Vec<Option<Vec<u8>>>,
    deliveries: Vec<Option<Vec<u8>>>,
    transcripts: Vec<u64>,
    sum_correct: Option<bool>,
    /// Agreements and key streams the page supplied, and those asked for.
    supplied: [u64; 2],
    asked: [u64; 2],
    /// Each client's count of steps that waited for the page.
    steps: Vec<u64>,
}

#[wasm_bindgen]
impl BenchRound {
    /// A round of `clients` in the complete graph over `dim` coordinates,
    /// threshold `threshold`, a ring of `modulus_bits`; the clients'
    /// generators seeded from `seed`.
    #[wasm_bindgen(constructor)]
    pub fn new(
        clients: u32,
        dim: u32,
        threshold: u32,
        modulus_bits: u8,
        seed: u32,
    ) -> Result<BenchRound, JsError> {
        let config = bench_config(clients, dim, threshold, modulus_bits);
        let server = ServerRound::new(config.clone()).map_err(protocol)?;
        let n = clients as usize;
        Ok(BenchRound {
            config,
            server: Some(server),
            clients: (0..n).map(|_| None).collect(),
            pending: (0..n).map(|_| None).collect(),
            rngs: (0..n).map(|i| ChaCha20Rng::seed_from_u64((u64::from(seed) << 32) | i as u64)).collect(),
            outbox: vec![None; n],
            deliveries: vec![None; n],
            transcripts: vec![FNV_START; n],
            sum_correct: None,
            supplied: [0; 2],
            asked: [0; 2],
            steps: vec![0; n],
        })
    }

    /// Client `index` (from 0) quantizes nothing (its input is given) and
    /// opens the round: its AdvertiseKeys goes to the outbox.
    pub fn start(&mut self, index: usize) -> Result<(), JsError> {
        let server = self.server.as_ref().ok_or_else(|| JsError::new("the round is over"))?;
        let setup = server.setup_message().encode();
        let id = ClientId::from_index(index);
        let input = bench_input(&self.config, id);
        let message = ServerMessage::decode(&setup).map_err(|e| protocol(e.into()))?;
        let (client, reply) =
            Client::start(message, id, None, input, &mut self.rngs[index]).map_err(protocol)?;
        self.clients[index] = Some(client);
        self.send(index, reply.encode());
        Ok(())
    }

    fn send(&mut self, index: usize, bytes: Vec<u8>) {
        self.transcripts[index] = fnv1a(self.transcripts[index], &bytes);
        self.outbox[index] = Some(bytes);
    }

    /// The server takes every message sent and closes the stage; `false`
    /// once the round is over (its sum checked against the inputs').
    pub fn advance(&mut self) -> Result<bool, JsError> {
        let mut server = self.server.take().ok_or_else(|| JsError::new("the round is over"))?;
        for (index, bytes) in self.outbox.iter_mut().enumerate() {
            if let Some(bytes) = bytes.take() {
                server.receive_encoded(ClientId::from_index(index), &bytes).map_err(protocol)?;
            }
        }
        match server.advance().map_err(protocol)? {
            Advanced::Done(aggregate) => {
                let inputs = |id: ClientId| bench_input(&self.config, id);
                let plain = plain_sum(&self.config, &aggregate.contributors, &inputs);
                self.sum_correct = Some(aggregate.sum == plain);
                Ok(false)
            }
            Advanced::Next(next) => {
                for (index, delivery) in self.deliveries.iter_mut().enumerate() {
                    *delivery = next.message_for(ClientId::from_index(index)).map(|m| m.encode());
                }
                self.server = Some(next);
                Ok(true)
            }
        }
    }

    /// Client `index` takes its message of this stage; with `host_crypto`
    /// its agreements and key streams go to the page. Returns the
    /// `host_work` action's JSON, or `undefined` when the step is done.
    pub fn step(&mut self, index: usize, host_crypto: bool) -> Result<Option<String>, JsError> {
        let (Some(client), Some(bytes)) = (self.clients[index].take(), self.deliveries[index].take()) else {
            return Err(JsError::new("client has no message this stage"));
        };
        let message = ServerMessage::decode(&bytes).map_err(|e| protocol(e.into()))?;
        let rng = &mut self.rngs[index];
        let deferred = if host_crypto {
            client.handle_deferred(message, rng)
        } else {
            Deferred::Done(client.handle(message, rng))
        };
        self.take(index, deferred)?;
        Ok(self.host_action(index))
    }

    fn take(&mut self, index: usize, deferred: Deferred) -> Result<(), JsError> {
        match deferred {
            Deferred::Done((client, reply)) => {
                self.clients[index] = Some(client);
                self.send(index, reply.map_err(protocol)?.encode());
            }
            Deferred::Pending(pending) => {
                match pending.work() {
                    Work::Agreements { peers, .. } => self.asked[0] += peers.len() as u64,
                    Work::KeyStreams { masks, .. } => self.asked[1] += masks.len() as u64,
                }
                self.steps[index] += 1;
                self.pending[index] = Some(pending);
            }
        }
        Ok(())
    }

    /// The `host_work` action client `index` waits on, if any.
    #[wasm_bindgen(js_name = hostAction)]
    pub fn host_action(&self, index: usize) -> Option<String> {
        self.pending[index]
            .as_ref()
            .map(|pending| host::describe(&pending.work(), self.steps[index]).to_string())
    }

    /// See `WebClient.host_step`.
    pub fn host_step(&self, index: usize) -> Option<f64> {
        self.pending[index].as_ref().map(|_| self.steps[index] as f64)
    }

    /// See `WebClient.host_secret` (a bench round's keys are not wiped
    /// on their way out).
    pub fn host_secret(&self, index: usize) -> Option<Vec<u8>> {
        host::secret(self.pending[index].as_ref().map(PendingStep::work)).map(|bytes| bytes.to_vec())
    }

    /// See `WebClient.host_peers`.
    pub fn host_peers(&self, index: usize) -> Option<Vec<u8>> {
        host::peers(self.pending[index].as_ref().map(PendingStep::work))
    }

    /// See `WebClient.host_key`.
    pub fn host_key(&self, index: usize, mask: usize) -> Option<Vec<u8>> {
        host::key(self.pending[index].as_ref().map(PendingStep::work), mask).map(|bytes| bytes.to_vec())
    }

    /// See `WebClient.agreed`.
    pub fn agreed(&mut self, index: usize, mut shared: Vec<u8>, supplied: &[u8]) -> Result<(), JsError> {
        let pending = self.pending[index].take().ok_or_else(|| JsError::new("no host work is pending"))?;
        let shared = host::agreements(&mut shared, supplied)
            .ok_or_else(|| JsError::new("agreements of the wrong length"))?;
        self.supplied[0] += shared.iter().filter(|s| s.is_some()).count() as u64;
        let deferred = pending.agreed(shared, &mut self.rngs[index]);
        self.take(index, deferred)
    }

    /// See `WebClient.add_key_stream` (as there, the stream is taken by
    /// value and wiped, so that the time is the client's).
    pub fn add_key_stream(&mut self, index: usize, mask: usize, mut stream: Vec<u32>) -> Result<(), JsError> {
        let pending = self.pending[index].as_mut().ok_or_else(|| JsError::new("no host work is pending"))?;
        let added = pending.add_key_stream(mask, &stream);
        stream.zeroize();
        added.map_err(protocol)?;
        self.supplied[1] += 1;
        Ok(())
    }

    /// See `WebClient.complete_host_work`.
    pub fn complete_host_work(&mut self, index: usize) -> Result<(), JsError> {
        let pending = self.pending[index].take().ok_or_else(|| JsError::new("no host work is pending"))?;
        let deferred = pending.complete(&mut self.rngs[index]);
        self.take(index, deferred)
    }

    /// Client `index`'s transcript: FNV-1a of every message it sent, in
    /// order, as 16 hex digits.
    pub fn transcript(&self, index: usize) -> String {
        format!("{:016x}", self.transcripts[index])
    }

    /// As JSON, the agreements and key streams the clients asked the page
    /// for and those it supplied (the rest the clients computed).
    pub fn host_counts(&self) -> String {
        json!({
            "agreements_asked": self.asked[0], "agreements_supplied": self.supplied[0],
            "key_streams_asked": self.asked[1], "key_streams_supplied": self.supplied[1],
        })
        .to_string()
    }

    /// Whether the round's sum is its contributors' inputs summed
    /// (`undefined` before the end).
    pub fn sum_correct(&self) -> Option<bool> {
        self.sum_correct
    }
}

/// One client's input-validation proof over `dim` values, as a validated
/// round with 8-bit values has it (each in [−255, 255], centred and
/// doubled), with `now` as the clock: the proving time the native
/// `cohort bench secagg --validate l2` reports as `prove_ms_mean`, and the
/// verifier's time for the one proof.
pub fn prove(dim: u32, now: fn() -> f64) -> Result<Value, ValidationError> {
    use rand_core::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(u64::from(dim));
    let values: Vec<i64> = (0..dim).map(|_| (rng.next_u64() % 511) as i64 - 255).collect();
    let norm_sq: u128 = values.iter().map(|&v| (v * v) as u128).sum();
    let bound = NormBound::new(dim as usize, norm_sq.max(1))?;
    let start = now();
    let proven = validation::prove(&bound, b"bench", &values, &mut rng)?;
    let prove_ms = now() - start;
    let start = now();
    validation::verify(&bound, b"bench", &proven.proof, &mut rng)?;
    let verify_ms = now() - start;
    Ok(json!({ "dim": dim, "prove_ms": prove_ms, "verify_ms": verify_ms, "proof_bytes": bound.proof_len() }))
}

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = performance, js_name = now)]
    fn performance_now() -> f64;
}

/// [`prove`] timed with `performance.now()`; returns its report as JSON.
#[wasm_bindgen(js_name = benchProve)]
pub fn bench_prove(dim: u32) -> Result<String, JsError> {
    prove(dim, performance_now)
        .map(|report| report.to_string())
        .map_err(|error| JsError::new(&error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> f64 {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        START.get_or_init(std::time::Instant::now).elapsed().as_secs_f64() * 1e3
    }

    /// Runs a bench round the way the page does, the host's work done by
    /// `host` (here: nothing, or the agreements of every other peer and
    /// the odd masks' key streams from the core's own PRG); returns each
    /// client's transcript.
    fn run(host_crypto: bool, host: impl Fn(&mut BenchRound, usize)) -> Vec<String> {
        let mut round = BenchRound::new(5, 1001, 3, 20, 7).unwrap();
        (0..5).for_each(|i| round.start(i).unwrap());
        let mut pending_steps = 0;
        while round.advance().unwrap() {
            for i in 0..5 {
                let mut action = round.step(i, host_crypto).unwrap();
                while let Some(json) = action {
                    assert!(json.contains("host_work") && !json.contains("key\""), "{json}");
                    pending_steps += 1;
                    host(&mut round, i);
                    action = round.host_action(i);
                }
            }
        }
        assert_eq!(round.sum_correct(), Some(true));
        assert_eq!(pending_steps, if host_crypto { 15 } else { 0 });
        let counts: Value = serde_json::from_str(&round.host_counts()).unwrap();
        // Each of 5 clients: 4 cipher and 4 mask agreements, 5 masks.
        let asked = if host_crypto { [40, 25] } else { [0, 0] };
        assert_eq!([&counts["agreements_asked"], &counts["key_streams_asked"]], asked, "{counts}");
        (0..5).map(|i| round.transcript(i)).collect()
    }

    #[test]
    fn a_bench_round_sends_the_same_messages_with_or_without_the_host() {
        use cohort_client::protocol::agreement::x25519;
        use cohort_client::protocol::prg::{MaskPrg, MaskSign};
        let in_place = run(false, |_, _| unreachable!("no host work"));
        let left_to_the_core = run(true, |round, i| round.complete_host_work(i).unwrap());
        let helped = run(true, |round, i| {
            if let Some(peers) = round.host_peers(i) {
                // Every other agreement from the page.
                let secret: [u8; 32] = round.host_secret(i).unwrap().try_into().unwrap();
                let count = peers.len() / 32;
                let mut shared = vec![0u8; peers.len()];
                let supplied: Vec<u8> = (0..count).map(|j| (j % 2) as u8).collect();
                for j in (0..count).filter(|j| j % 2 == 1) {
                    let public: [u8; 32] = peers[32 * j..32 * j + 32].try_into().unwrap();
                    shared[32 * j..32 * j + 32].copy_from_slice(&x25519(&secret, &public));
                }
                round.agreed(i, shared, &supplied).unwrap();
            } else {
                for mask in (0..).step_by(2) {
                    let Some(key) = round.host_key(i, mask) else { break };
                    let mut stream = vec![0u32; 1001];
                    MaskPrg::from_key(&key.try_into().unwrap()).apply(&mut stream, MaskSign::Add);
                    round.add_key_stream(i, mask, stream).unwrap();
                }
                round.complete_host_work(i).unwrap();
            }
        });
        assert_eq!(in_place, left_to_the_core);
        assert_eq!(in_place, helped);
        // A transcript tells clients (and so runs) apart.
        assert!((1..5).all(|i| in_place[i] != in_place[0]), "{in_place:?}");
    }

    #[test]
    fn a_bench_proof_verifies_and_is_timed() {
        let report = prove(3000, now).unwrap();
        assert_eq!(report["dim"], 3000);
        assert!(report["prove_ms"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report["proof_bytes"].as_u64().unwrap() > 0, "{report}");
    }
}
