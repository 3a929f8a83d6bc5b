//! Criterion benches for the hot paths: mask PRG expansion, a client's
//! masking of its input, the server's unmasking, and a whole round.
//!
//! Run with `cargo bench -p cohort-crypto --bench primitives`; compare the PRG
//! throughput with `openssl speed -evp aes-128-ctr` (docs/BENCHMARKS.md).

#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use cohort_crypto::Secret32;
use cohort_crypto::agreement::AgreementKey;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::prg::{MaskPrg, MaskSign};
use cohort_crypto::signature::{IdentityKey, verify};
use cohort_crypto::simulation::{DropoutPlan, NoStopwatch, Simulation};
use cohort_crypto::{ClientId, QuantizationSpec, QuantizedInput, RoundConfig, Variant};
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

fn prg_expansion(c: &mut Criterion) {
    let mut group = c.benchmark_group("prg");
    for words in [1usize << 12, 1 << 18] {
        group.throughput(Throughput::Bytes((words * 4) as u64));
        let prg = MaskPrg::from_key(&[7; 16]);
        let mut target = vec![0u32; words];
        group.bench_with_input(BenchmarkId::new("aes128ctr_add", words * 4), &words, |b, _| {
            b.iter(|| prg.apply(black_box(&mut target), MaskSign::Add))
        });
    }
    group.finish();
}

/// A client's quantization of a 100 000-coordinate update (clipping,
/// scaling and stochastic rounding with ChaCha20 randomness), 16-bit levels
/// in a 32-bit ring as `cohort bench secagg` uses.
fn quantization(c: &mut Criterion) {
    use cohort_crypto::quantize::Quantizer;
    let quantizer = Quantizer::new(config(100, 4, 2, 100_000).quantization, 32, 100).unwrap();
    let update: Vec<f32> = (0..100_000).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut rng = ChaCha20Rng::seed_from_u64(4);
    let mut group = c.benchmark_group("quantize");
    group.throughput(Throughput::Elements(100_000));
    group.bench_function("encode_d100000", |b| {
        b.iter(|| black_box(quantizer.encode(black_box(&update), 1, &mut rng).unwrap()))
    });
    group.finish();
}

/// The public-key operations a client repeats per neighbour: an X25519
/// agreement (twice: envelope key and mask key) and an Ed25519 check of
/// the neighbour's signed key advertisement.
fn public_key(c: &mut Criterion) {
    let mut rng = ChaCha20Rng::seed_from_u64(2);
    let own = AgreementKey::generate(&mut rng);
    let peer = AgreementKey::generate(&mut rng).public_key();
    let identity = IdentityKey::generate(&mut rng);
    let public = identity.public_key();
    let message = [5u8; 140];
    let signature = identity.sign(&message);
    let mut group = c.benchmark_group("public_key");
    group.bench_function("x25519_agree", |b| b.iter(|| own.agree(black_box(&peer)).unwrap()));
    group.bench_function("ed25519_verify", |b| {
        b.iter(|| verify(black_box(&public), black_box(&message), black_box(&signature)).unwrap())
    });
    group.finish();
}

/// A client's masking work for D = 100 000 and k = 32 neighbours: one
/// self mask and k pairwise masks, each an X25519 agreement, an HKDF
/// derivation and an AES-CTR expansion added to the vector.
fn masking(c: &mut Criterion) {
    let mut rng = ChaCha20Rng::seed_from_u64(1);
    let own = AgreementKey::generate(&mut rng);
    let peers: Vec<[u8; 32]> = (0..32).map(|_| AgreementKey::generate(&mut rng).public_key()).collect();
    let seed = Secret32::random(&mut rng);
    let mut vector = vec![0u32; 100_000];
    let mut group = c.benchmark_group("masking");
    group.throughput(Throughput::Bytes(33 * 400_000));
    group.bench_function("d100000_k32", |b| {
        b.iter(|| {
            MaskPrg::derive(&seed, b"context", &[b"self"]).apply(&mut vector, MaskSign::Add);
            for peer in &peers {
                let shared = own.agree(peer).unwrap();
                MaskPrg::derive(&shared, b"context", &[b"pair"]).apply(&mut vector, MaskSign::Add);
            }
            black_box(&vector);
        })
    });
    group.finish();
}

fn config(clients: u32, degree: u32, threshold: u32, dim: u32) -> RoundConfig {
    RoundConfig {
        session: [3; 16],
        round: 1,
        variant: Variant::SemiHonest,
        clients,
        identities: Vec::new(),
        graph: GraphSpec::Harary { degree },
        threshold,
        vector_len: dim,
        modulus_bits: 32,
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

/// A semi-honest round in which clients `1..=dropped` vanish after ShareKeys.
fn simulation<'a>(
    config: &RoundConfig,
    dropped: u32,
    inputs: &'a (dyn Fn(ClientId) -> QuantizedInput + Sync),
) -> Simulation<'a> {
    let plan = DropoutPlan {
        after_shares: (1..=dropped).filter_map(ClientId::new).collect(),
        ..DropoutPlan::default()
    };
    Simulation { config: config.clone(), identities: Vec::new(), plan, inputs, seed: 1, tamper: None }
}

/// The server's unmasking stage alone (reconstruction of 90 seeds and 10
/// keys, removal of all masks) for 100 clients, k = 32, t = 6, D = 100 000.
fn unmasking(c: &mut Criterion) {
    let cfg = config(100, 32, 6, 100_000);
    let inputs = |_: ClientId| QuantizedInput::from_values(vec![1; 100_000]);
    let mut group = c.benchmark_group("unmasking_n100_k32_d100000");
    group.sample_size(10);
    for dropped in [0u32, 10] {
        let simulation = simulation(&cfg, dropped, &inputs);
        group.bench_function(BenchmarkId::new("dropped", dropped), |b| {
            b.iter_batched(
                || simulation.run_to_unmasking().unwrap(),
                |server| black_box(server.advance().unwrap()),
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// A whole round of 100 clients (k = 32, t = 6) over 10 000 coordinates.
fn round(c: &mut Criterion) {
    let mut group = c.benchmark_group("round_n100_k32_d10000");
    group.sample_size(10);
    let cfg = config(100, 32, 6, 10_000);
    let inputs = |_: ClientId| QuantizedInput::from_values(vec![1; 10_000]);
    for dropped in [0u32, 10] {
        let simulation = simulation(&cfg, dropped, &inputs);
        group.bench_function(BenchmarkId::new("dropped", dropped), |b| {
            b.iter(|| black_box(simulation.run(&NoStopwatch).unwrap()))
        });
    }
    group.finish();
}

criterion_group!(benches, prg_expansion, quantization, public_key, masking, unmasking, round);
criterion_main!(benches);
