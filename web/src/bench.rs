//! The browser's secure-aggregation cost, measured where it runs
//! (`web/tests/bench.mjs` calls [`bench_secagg`] in Chromium): one
//! simulated round of `clients` clients in the complete graph, so that each
//! client agrees keys with and masks against `clients − 1` neighbours (k),
//! over `dim` coordinates, every client on this one thread. A client's time
//! is what the native `cohort bench secagg` reports as `client_ms_mean`:
//! from its quantized input on, decoding, computing and encoding every
//! stage's message (`busy_ms`).

use cohort_client::protocol::graph::GraphSpec;
use cohort_client::protocol::simulation::{DropoutPlan, Simulation, Stopwatch};
use cohort_client::protocol::validation::{self, NormBound, ValidationError};
use cohort_client::protocol::{
    ClientId, MetricSet, ProtocolError, QuantizationSpec, QuantizedInput, RoundConfig, Transform, Variant,
};
use serde_json::{Value, json};
use wasm_bindgen::prelude::*;

/// A clock in milliseconds.
struct Clock(fn() -> f64);

impl Stopwatch for Clock {
    fn time<T>(&self, f: impl FnOnce() -> T) -> (T, f64) {
        let start = (self.0)();
        let result = f();
        (result, (self.0)() - start)
    }
}

/// Runs the round with `now` as the clock; returns the clients' mean,
/// fastest and slowest time and the round's.
pub fn secagg(
    clients: u32,
    dim: u32,
    threshold: u32,
    modulus_bits: u8,
    now: fn() -> f64,
) -> Result<Value, ProtocolError> {
    let config = RoundConfig {
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
    };
    // Inputs within the headroom, so that the sum does not wrap.
    let limit = ((1u64 << modulus_bits) - 1) / u64::from(clients);
    let inputs = move |id: ClientId| {
        let mut state = u64::from(id.get()).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        QuantizedInput::from_values(
            (0..dim)
                .map(|_| {
                    state =
                        state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 32) % (limit + 1)) as u32
                })
                .collect(),
        )
    };
    let simulation = Simulation {
        config,
        identities: Vec::new(),
        plan: DropoutPlan::default(),
        inputs: &inputs,
        seed: 5,
        tamper: None,
    };
    let clock = Clock(now);
    let (outcome, total_ms) = clock.time(|| simulation.run(&clock));
    let outcome = outcome?;
    let times: Vec<f64> = outcome.clients.iter().filter(|c| c.finished).map(|c| c.busy_ms).collect();
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    Ok(json!({
        "clients": clients,
        "dim": dim,
        "k": clients - 1,
        "t": threshold,
        "modulus_bits": modulus_bits,
        "survivors": outcome.aggregate.contributors.len(),
        "client_ms_mean": mean,
        "client_ms_min": times.iter().copied().fold(f64::INFINITY, f64::min),
        "client_ms_max": times.iter().copied().fold(0.0, f64::max),
        "total_ms": total_ms,
    }))
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

/// [`secagg`] timed with `performance.now()`; returns its report as JSON.
#[wasm_bindgen(js_name = benchSecagg)]
pub fn bench_secagg(clients: u32, dim: u32, threshold: u32, modulus_bits: u8) -> Result<String, JsError> {
    secagg(clients, dim, threshold, modulus_bits, performance_now)
        .map(|report| report.to_string())
        .map_err(|error| JsError::new(&error.to_string()))
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

    #[test]
    fn a_bench_round_completes_with_every_client_timed() {
        let report = secagg(5, 1000, 3, 32, now).unwrap();
        assert_eq!((report["survivors"].as_u64(), report["k"].as_u64()), (Some(5), Some(4)));
        let mean = report["client_ms_mean"].as_f64().unwrap();
        assert!(mean > 0.0 && mean <= report["client_ms_max"].as_f64().unwrap(), "{report}");
        assert!(report["total_ms"].as_f64().unwrap() >= mean, "{report}");
    }

    #[test]
    fn a_bench_proof_verifies_and_is_timed() {
        let report = prove(3000, now).unwrap();
        assert_eq!(report["dim"], 3000);
        assert!(report["prove_ms"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report["proof_bytes"].as_u64().unwrap() > 0, "{report}");
    }
}
