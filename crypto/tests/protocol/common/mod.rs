//! Helpers shared by the integration tests: round configurations, inputs
//! and a way to run a simulated round.

#![allow(dead_code, clippy::unwrap_used)]

pub mod driver;

use std::sync::Arc;

use cohort_crypto::graph::GraphSpec;
use cohort_crypto::quantize::NormCheck;
use cohort_crypto::signature::IdentityKey;
use cohort_crypto::simulation::{DropoutPlan, NoStopwatch, Simulation, SimulationOutcome, plain_sum};
use cohort_crypto::validation::RoundValidation;
use cohort_crypto::{
    ClientId, ProtocolError, QuantizationSpec, QuantizedInput, Quantizer, RoundConfig, Variant,
};
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

pub fn id(i: u32) -> ClientId {
    ClientId::new(i).unwrap()
}

pub fn ids(list: &[u32]) -> Vec<ClientId> {
    list.iter().map(|&i| id(i)).collect()
}

pub fn config(clients: u32, threshold: u32, graph: GraphSpec, vector_len: u32, bits: u8) -> RoundConfig {
    RoundConfig {
        session: [7; 16],
        round: 1,
        variant: Variant::SemiHonest,
        clients,
        identities: Vec::new(),
        graph,
        threshold,
        vector_len,
        modulus_bits: bits,
        quantization: QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: cohort_crypto::Transform::None,
            metrics: cohort_crypto::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        },
        model: None,
    }
}

/// Identity keys for an active-variant round, written into `config`.
pub fn make_active(config: &mut RoundConfig, seed: u64) -> Vec<Arc<IdentityKey>> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let keys: Vec<Arc<IdentityKey>> =
        (0..config.clients).map(|_| Arc::new(IdentityKey::generate(&mut rng))).collect();
    config.variant = Variant::Active;
    config.identities = keys.iter().map(|key| key.public_key()).collect();
    keys
}

/// Turns `config` into a validated round: its `vector_len` is taken as the
/// update's dimension, each update is clipped to `l2_clip`, and the vector
/// becomes the quantized update followed by the blindings' tail.
pub fn validated(config: &mut RoundConfig, l2_clip: f32) {
    let quantizer = Quantizer::new(config.quantization, config.modulus_bits, config.clients).unwrap();
    let dimension = quantizer.encoded_len(config.vector_len as usize) as u32;
    config.quantization.validation = Some(NormCheck { l2_clip, dimension });
    config.vector_len = RoundValidation::new(config).unwrap().unwrap().vector_len() as u32;
}

/// Deterministic pseudo-random input of client `id`, within the headroom
/// (in a validated round, a random update in [−1, 1] quantized as the
/// round says, so within its norm bound).
pub fn input_for(config: &RoundConfig, seed: u64, id: ClientId) -> QuantizedInput {
    let limit = ((1u64 << config.modulus_bits) - 1) / u64::from(config.clients);
    let mut rng = ChaCha20Rng::seed_from_u64(seed.wrapping_mul(1_000_003) + u64::from(id.get()));
    if let Some(check) = config.quantization.validation {
        let quantizer = Quantizer::new(config.quantization, config.modulus_bits, config.clients).unwrap();
        let dimension = check.dimension as usize - quantizer.encoded_len(0);
        let update: Vec<f32> =
            (0..dimension).map(|_| (rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0).collect();
        return quantizer.encode(&update, 1, &mut rng).unwrap();
    }
    QuantizedInput::from_values(
        (0..config.vector_len).map(|_| (rng.next_u64() % (limit + 1)) as u32).collect(),
    )
}

pub fn run(
    config: &RoundConfig,
    identities: Vec<Arc<IdentityKey>>,
    plan: DropoutPlan,
    seed: u64,
) -> Result<SimulationOutcome, ProtocolError> {
    let cfg = config.clone();
    let inputs = move |id: ClientId| input_for(&cfg, seed, id);
    Simulation { config: config.clone(), identities, plan, inputs: &inputs, seed, tamper: None }
        .run(&NoStopwatch)
}

/// Runs a round and checks the aggregate against the plain sum of the
/// contributors' inputs; returns the outcome.
pub fn run_and_check(
    config: &RoundConfig,
    identities: Vec<Arc<IdentityKey>>,
    plan: DropoutPlan,
    seed: u64,
) -> Result<SimulationOutcome, ProtocolError> {
    let outcome = run(config, identities, plan, seed)?;
    let cfg = config.clone();
    let inputs = move |id: ClientId| input_for(&cfg, seed, id);
    let expected = plain_sum(config, &outcome.aggregate.contributors, &inputs);
    assert_eq!(outcome.aggregate.sum, expected, "aggregate differs from the plain sum");
    Ok(outcome)
}
