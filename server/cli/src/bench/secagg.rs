//! `cohort bench secagg`: one full secure-aggregation round in process.
//!
//! Clients quantize a random update, run every stage through the binary
//! encoding, and a fraction of them vanish after ShareKeys so that the server
//! must reconstruct their keys and remove their pairwise masks.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::params::{Adversary, DerivedParameters, ParameterTarget, derive_complete, derive_sparse};
use cohort_crypto::signature::IdentityKey;
use cohort_crypto::simulation::{DropoutPlan, Simulation, Stopwatch, plain_sum};
use cohort_crypto::{ClientId, MetricSet, QuantizedInput, Variant};
use cohort_server::round::{BuiltRound, RoundBuilder};
use cohort_server::spec::QuantizationConfig;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GraphKind {
    /// Every client is every other client's neighbour (SecAgg).
    Complete,
    /// Random k-regular graph (SecAgg+).
    Sparse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VariantArg {
    /// Honest-but-curious server.
    SemiHonest,
    /// Malicious server: signed keys and a consistency check.
    Active,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ValidateArg {
    /// Every client proves its quantized vector within an L2 bound.
    L2,
}

#[derive(Debug, Args)]
pub struct SecaggArgs {
    /// Clients selected for the round (n).
    #[arg(long, default_value_t = 100)]
    clients: u32,
    /// Coordinates of each client's update (the masked vector has one more:
    /// the example count).
    #[arg(long, default_value_t = 10_000)]
    dim: u32,
    /// Fraction of clients that vanish after ShareKeys.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Communication graph.
    #[arg(long, value_enum, default_value_t = GraphKind::Sparse)]
    graph: GraphKind,
    /// Neighbours per client; overrides the derived value (sparse graph).
    #[arg(long)]
    k: Option<u32>,
    /// Threshold; overrides the derived value.
    #[arg(long)]
    t: Option<u32>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Adversary model.
    #[arg(long, value_enum, default_value_t = VariantArg::SemiHonest)]
    variant: VariantArg,
    /// Dropout rate the derived k and t must tolerate.
    #[arg(long, default_value_t = 0.33)]
    target_dropout: f64,
    /// Fraction of colluding clients the derived k and t must tolerate.
    #[arg(long, default_value_t = 0.05)]
    corruption: f64,
    /// Bits of the ring Z_{2^b} the masked vectors live in.
    #[arg(long, default_value_t = 32)]
    modulus_bits: u8,
    /// Bits per client value (4 to 16): the ring gets bits + ⌈log₂ N⌉
    /// bits (overrides --modulus-bits) and the upload is packed to that.
    #[arg(long)]
    bits: Option<u8>,
    /// Randomized Hadamard rotation of every update before quantization.
    #[arg(long)]
    rotate: bool,
    /// With --bits and --rotate: `fitted` keeps the ring at --bits bits
    /// whatever N (a round at the scale that cannot wrap, a task's first),
    /// `exact` (the default) adds ⌈log₂ N⌉.
    #[arg(long, value_enum, default_value_t = crate::training::RingArg::Exact)]
    ring: crate::training::RingArg,
    /// Seed for inputs, keys and the choice of dropouts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Input validation: every client clips its update, commits to its
    /// quantized vector and proves it within the round's norm bound; the
    /// server verifies every proof and checks the unmasked sum against the
    /// commitments.
    #[arg(long, value_enum)]
    validate: Option<ValidateArg>,
    /// The L2 clip of `--validate l2` (default √(dim/3), about the norm of
    /// the bench's updates, uniform in [−1, 1]; with `--dp-noise-multiplier`
    /// the privacy clip, default 1).
    #[arg(long)]
    l2_clip: Option<f32>,
    /// Distributed differential privacy (Skellam) at this noise multiplier:
    /// each client clips its update to the L2 clip and adds its share of the
    /// noise (with `--validate`, on edges its neighbours verify; the
    /// aggregate is then correct when the sum less the inputs has the
    /// noise's variance).
    #[arg(long)]
    dp_noise_multiplier: Option<f64>,
    /// The ring's bits under `--dp-noise-multiplier`.
    #[arg(long, default_value_t = 20)]
    dp_bits: u8,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Also measure this machine's AES-128-CTR rate with `openssl speed`
    /// on the bench's threads and print the time the server's key stream
    /// takes at that rate: the bound its unmasking works against.
    #[arg(long)]
    bound: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    clients: u32,
    dim: u32,
    dropout: f64,
    graph: &'static str,
    variant: &'static str,
    k: u32,
    t: u32,
    modulus_bits: u8,
    threads: usize,
    survivors: usize,
    /// Making and quantizing every client's update, before the round (wall
    /// time on the bench's threads); not in the client or round times.
    inputs_ms: f64,
    client_ms_mean: f64,
    client_ms_max: f64,
    server_ms: f64,
    /// The part of `server_ms` spent unmasking (reconstruction and mask
    /// removal); the rest is mostly adding the masked inputs into the sum.
    unmasking_ms: f64,
    /// Key stream the server expanded to unmask (bytes).
    server_keystream_bytes: f64,
    /// `openssl speed -multi THREADS -evp aes-128-ctr` (bytes per second),
    /// with `--bound`.
    #[serde(skip_serializing_if = "Option::is_none")]
    openssl_ctr_rate: Option<f64>,
    /// The server's key stream at that rate (ms), with `--bound`.
    #[serde(skip_serializing_if = "Option::is_none")]
    keystream_bound_ms: Option<f64>,
    /// A client's own bound (ms), with `--bound`: its key stream (a self
    /// mask and one pairwise mask per neighbour) at OpenSSL's rate on one
    /// core, plus its 2k X25519 agreements (envelope and mask keys) at the
    /// time one takes here.
    #[serde(skip_serializing_if = "Option::is_none")]
    client_bound_ms: Option<f64>,
    total_ms: f64,
    /// With `--validate`: one client's proving time on one core (the mean
    /// over up to 8 clients' inputs, proven outside the round; the round's
    /// client times include it).
    #[serde(skip_serializing_if = "Option::is_none")]
    prove_ms_mean: Option<f64>,
    /// With `--validate`: the server's time closing ShareKeys, where it
    /// verifies every proof in one batch, per proof.
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_ms_per_client: Option<f64>,
    /// With `--validate`: the commitment and proof a client sends, plus the
    /// blindings' digits its masked vector carries, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    proof_bytes_per_client: Option<f64>,
    /// With `--validate`: `proof_bytes_per_client` over the bytes of the
    /// masked input without the blindings' digits.
    #[serde(skip_serializing_if = "Option::is_none")]
    proof_fraction: Option<f64>,
    /// With `--validate` and `--dp-noise-multiplier`: one client's time to
    /// draw and commit the noise of its six edges (its own three and the
    /// three it verifies), on one core; inside the clients' times.
    #[serde(skip_serializing_if = "Option::is_none")]
    noise_edges_ms: Option<f64>,
    /// With `--dp-noise-multiplier` and `--validate`: the variance per
    /// coordinate of the sum less the survivors' inputs (their noise, drawn
    /// on the edges), over what the mechanism promises.
    #[serde(skip_serializing_if = "Option::is_none")]
    noise_variance_ratio: Option<f64>,
    bytes_up_per_client: f64,
    bytes_down_per_client: f64,
    expansion: f64,
    correct: bool,
}

struct WallClock;

impl Stopwatch for WallClock {
    fn time<T>(&self, f: impl FnOnce() -> T) -> (T, f64) {
        let start = Instant::now();
        let value = f();
        (value, start.elapsed().as_secs_f64() * 1e3)
    }
}

fn parameters(args: &SecaggArgs) -> Result<DerivedParameters> {
    let adversary = match args.variant {
        VariantArg::SemiHonest => Adversary::SemiHonest,
        VariantArg::Active => Adversary::SemiMalicious,
    };
    let target = ParameterTarget {
        dropout: args.target_dropout,
        corruption: args.corruption,
        adversary,
        ..ParameterTarget::default()
    };
    let derived = match args.graph {
        GraphKind::Complete => derive_complete(args.clients, &target),
        GraphKind::Sparse => derive_sparse(args.clients, &target),
    };
    let degree = match (args.graph, args.k) {
        (GraphKind::Complete, Some(_)) => bail!("--k applies to the sparse graph only"),
        (_, Some(k)) => k.min(args.clients.saturating_sub(1)),
        (_, None) => {
            derived.as_ref().map(|p| p.degree).map_err(|e| anyhow::anyhow!("{e}; pass --k and --t"))?
        }
    };
    let threshold = match args.t {
        Some(t) => t,
        None if args.k.is_none() => derived.map(|p| p.threshold).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => bail!("--k needs --t as well"),
    };
    Ok(DerivedParameters { degree, threshold })
}

pub fn secagg(args: &SecaggArgs) -> Result<()> {
    if !(0.0..1.0).contains(&args.dropout) {
        bail!("--dropout must be in [0, 1)");
    }
    let params = parameters(args)?;
    let mut seed_rng = ChaCha20Rng::seed_from_u64(args.seed);
    let graph = if params.is_complete(args.clients) {
        GraphSpec::Complete
    } else {
        GraphSpec::Harary { degree: params.degree }
    };
    // The same rules as a task's quantization settings.
    let settings = QuantizationConfig {
        clip: 1.0,
        modulus_bits: args.modulus_bits,
        bits: args.bits,
        ring: args.ring.into(),
        rotate: args.rotate,
        sketch: None,
        max_weight: 1 << 12,
    };
    let (variant, identities) = match args.variant {
        VariantArg::SemiHonest => (Variant::SemiHonest, Vec::new()),
        VariantArg::Active => {
            let keys: Vec<_> = (0..args.clients)
                .map(|_| std::sync::Arc::new(IdentityKey::generate(&mut seed_rng)))
                .collect();
            (Variant::Active, keys)
        }
    };
    let privacy = match args.dp_noise_multiplier {
        None => None,
        Some(z) => {
            let spec = cohort_server::privacy::PrivacySpec {
                mechanism: cohort_crypto::dp::Mechanism::Skellam,
                epsilon: None,
                delta: 1e-5,
                clip_norm: args.l2_clip.unwrap_or(1.0),
                noise_multiplier: Some(z),
                sample_rate: None,
                bits: args.dp_bits,
            };
            let plan = spec
                .plan(args.clients, params.threshold, args.dim as usize, 1, args.validate.is_some())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            Some((plan.params, plan.modulus_bits))
        }
    };
    let builder = RoundBuilder {
        quantization: &settings,
        metrics: MetricSet::NONE,
        variant,
        graph,
        threshold: params.threshold,
        dimension: args.dim as usize,
        privacy,
        validation: args.validate.map(|ValidateArg::L2| match privacy {
            Some((params, _)) => params.clip_norm,
            None => args.l2_clip.unwrap_or((f64::from(args.dim) / 3.0).sqrt() as f32),
        }),
    };
    let public_keys = identities.iter().map(|key| key.public_key()).collect();
    let BuiltRound { config, quantizer } =
        builder.build(1, args.clients, public_keys, None, &mut seed_rng)?;
    let modulus_bits = config.modulus_bits;
    config.validate().context("invalid round parameters")?;

    // ⌊dropout · n⌋ clients, chosen at random, vanish after ShareKeys.
    let mut order: Vec<u32> = (1..=args.clients).collect();
    order.shuffle(&mut seed_rng);
    let dropped = (args.dropout * f64::from(args.clients)).floor() as usize;
    let plan = DropoutPlan {
        after_shares: order[..dropped].iter().filter_map(|&i| ClientId::new(i)).collect(),
        ..DropoutPlan::default()
    };

    let dim = args.dim as usize;
    let seed = args.seed;
    let inputs = move |id: ClientId| -> QuantizedInput {
        let seed = seed ^ (u64::from(id.get()) << 20) ^ 0x1f2e3d;
        // The update stands for a client's training: a fast generator makes
        // it, so the round's time is the protocol's. Its quantization (in the
        // client's time) draws from a ChaCha20 generator, as a client does.
        let mut synthetic = SmallRng::seed_from_u64(seed);
        let update: Vec<f32> =
            (0..dim).map(|_| (synthetic.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0).collect();
        let weight = 1 + (synthetic.next_u32() % 600);
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        match quantizer.encode(&update, weight, &mut rng) {
            Ok(input) => input,
            Err(error) => unreachable!("bench updates are finite and weights in range: {error}"),
        }
    };

    let threads = args.threads.unwrap_or_else(rayon::current_num_threads);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    // Every client's quantized input is made before the round starts (as a
    // client has its update before it checks in); each is taken once.
    let start = Instant::now();
    let prepared: Vec<std::sync::Mutex<Option<QuantizedInput>>> = pool.install(|| {
        use rayon::prelude::*;
        (1..=args.clients)
            .into_par_iter()
            .map(|i| std::sync::Mutex::new(ClientId::new(i).map(&inputs)))
            .collect()
    });
    let inputs_ms = start.elapsed().as_secs_f64() * 1e3;
    let take_input = |id: ClientId| -> QuantizedInput {
        let taken = prepared.get(id.get() as usize - 1).and_then(|slot| slot.lock().ok()?.take());
        taken.unwrap_or_else(|| inputs(id))
    };
    let simulation = Simulation {
        config: config.clone(),
        identities,
        plan,
        inputs: &take_input,
        seed: args.seed,
        tamper: None,
    };
    let start = Instant::now();
    let outcome = pool.install(|| simulation.run(&WallClock)).context("the round failed")?;
    let total_ms = start.elapsed().as_secs_f64() * 1e3;

    let expected = pool.install(|| plain_sum(&config, &outcome.aggregate.contributors, &inputs));
    // A validated private round's sum carries the survivors' edge noise,
    // drawn inside the protocol (without validation the noise is in the
    // inputs themselves): its variance per coordinate against (z·Δ₂)²/m per
    // survivor.
    let noise_variance_ratio = privacy.filter(|_| args.validate.is_some()).map(|(params, bits)| {
        let modulus = config.modulus_mask();
        let noise: Vec<f64> = outcome
            .aggregate
            .sum
            .iter()
            .zip(&expected)
            .map(|(&s, &p)| cohort_crypto::quantize::lift(s.wrapping_sub(p) & modulus, bits) as f64)
            .collect();
        let m = noise.len() as f64;
        let mean = noise.iter().sum::<f64>() / m;
        let variance = noise.iter().map(|e| (e - mean).powi(2)).sum::<f64>() / (m - 1.0);
        let promised =
            outcome.aggregate.contributors.len() as f64 * params.local_variance(outcome.aggregate.sum.len());
        // Six standard errors of a sample variance over m coordinates.
        (variance / promised, 6.0 * (2.0 / m).sqrt())
    });
    let server_keystream_bytes = outcome.aggregate.masks_removed as f64 * f64::from(config.vector_len) * 4.0;
    let openssl_ctr_rate = if args.bound { Some(openssl_ctr_rate(threads)?) } else { None };
    let neighbours = if params.is_complete(args.clients) { args.clients - 1 } else { params.degree };
    let client_bound_ms = openssl_ctr_rate.map(|rate| {
        let keystream = f64::from(neighbours + 1) * f64::from(config.vector_len) * 4.0;
        keystream / (rate / threads as f64) * 1e3 + 2.0 * f64::from(neighbours) * agreement_ms()
    });
    let validation = validation_costs(&config, &outcome, &inputs)?;
    let finished: Vec<_> = outcome.clients.iter().filter(|c| c.finished).collect();
    let count = finished.len().max(1) as f64;
    let bytes_up = finished.iter().map(|c| c.bytes_up as f64).sum::<f64>() / count;
    let report = Report {
        clients: args.clients,
        dim: args.dim,
        dropout: args.dropout,
        graph: match args.graph {
            GraphKind::Complete => "complete",
            GraphKind::Sparse if params.is_complete(args.clients) => "complete",
            GraphKind::Sparse => "sparse",
        },
        variant: match args.variant {
            VariantArg::SemiHonest => "semi-honest",
            VariantArg::Active => "active",
        },
        k: params.degree,
        t: params.threshold,
        modulus_bits,
        threads,
        survivors: outcome.aggregate.contributors.len(),
        inputs_ms,
        client_ms_mean: finished.iter().map(|c| c.busy_ms).sum::<f64>() / count,
        client_ms_max: finished.iter().map(|c| c.busy_ms).fold(0.0, f64::max),
        server_ms: outcome.server_ms,
        unmasking_ms: outcome.unmasking_ms,
        server_keystream_bytes,
        openssl_ctr_rate,
        keystream_bound_ms: openssl_ctr_rate.map(|rate| server_keystream_bytes / rate * 1e3),
        client_bound_ms,
        total_ms,
        prove_ms_mean: validation.map(|v| v.prove_ms_mean),
        verify_ms_per_client: validation.map(|v| v.verify_ms_per_client),
        proof_bytes_per_client: validation.map(|v| v.proof_bytes),
        proof_fraction: validation.map(|v| v.proof_fraction),
        noise_edges_ms: validation.and_then(|v| v.noise_edges_ms),
        noise_variance_ratio: noise_variance_ratio.map(|(ratio, _)| ratio),
        bytes_up_per_client: bytes_up,
        bytes_down_per_client: finished.iter().map(|c| c.bytes_down as f64).sum::<f64>() / count,
        expansion: bytes_up / (f64::from(args.dim) * 4.0),
        // A validated private round: the noise has its variance, within six
        // standard errors of its estimate (2.7 % at m = 10⁵).
        correct: match noise_variance_ratio {
            None => outcome.aggregate.sum == expected,
            Some((ratio, tolerance)) => (ratio - 1.0).abs() < tolerance,
        },
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    if !report.correct {
        bail!("the aggregate differs from the plain sum of the survivors' inputs (and their noise)");
    }
    Ok(())
}

#[derive(Clone, Copy)]
struct ValidationCosts {
    noise_edges_ms: Option<f64>,
    prove_ms_mean: f64,
    verify_ms_per_client: f64,
    proof_bytes: f64,
    proof_fraction: f64,
}

/// What validation cost in a validated round: up to 8 clients' inputs
/// proven again here on this thread (the round's own proofs ran on the
/// bench's threads, inside the clients' times), the server's batch
/// verification (its ShareKeys close), and the bytes.
fn validation_costs(
    config: &cohort_crypto::RoundConfig,
    outcome: &cohort_crypto::simulation::SimulationOutcome,
    inputs: &dyn Fn(ClientId) -> QuantizedInput,
) -> Result<Option<ValidationCosts>> {
    use cohort_crypto::validation::{self, RoundValidation};
    let Some(layout) = RoundValidation::new(config)? else {
        return Ok(None);
    };
    let mut rng = ChaCha20Rng::seed_from_u64(9);
    let sample: Vec<ClientId> = (1..=config.clients.min(8)).filter_map(ClientId::new).collect();
    let start = Instant::now();
    for &id in &sample {
        let centred = layout.centred(inputs(id).values());
        validation::prove(layout.bound(), b"bench", &centred, &mut rng)?;
    }
    let prove_ms_mean = start.elapsed().as_secs_f64() * 1e3 / sample.len() as f64;
    let proofs = outcome.clients.iter().filter(|c| c.bytes_up > 0).count().max(1);
    let verify_ms_per_client = outcome.advance_ms.get(1).copied().unwrap_or(0.0) / proofs as f64;
    let tail_bytes = (layout.tail_len() * usize::from(config.modulus_bits)).div_ceil(8);
    // A private round's client also sends the commitments to the three
    // edges it verifies and digests of its own three (each with its two
    // ids and length).
    let edges = validation::noise::NOISE_VERIFIERS * 2;
    let noise_bytes = match layout.edge_variance() {
        Some(_) => {
            4 + validation::noise::NOISE_VERIFIERS
                * (12 + validation::Commitment::encoded_len(layout.bound()) + 12 + 32)
        }
        None => 0,
    };
    let proof_bytes = (layout.bound().proof_len() + tail_bytes + noise_bytes) as f64;
    let noise_edges_ms = layout.edge_variance().map(|variance| {
        let start = Instant::now();
        for edge in 0..edges {
            let mut seed = [edge as u8; 32];
            let seed = cohort_crypto::Secret32::from_bytes(&mut seed);
            let noise = validation::noise::EdgeNoise::derive(&seed, layout.bound(), variance);
            std::hint::black_box(noise.commit(layout.bound()).is_ok());
        }
        start.elapsed().as_secs_f64() * 1e3
    });
    let masked_bytes = (layout.dimension() * usize::from(config.modulus_bits)).div_ceil(8) as f64;
    Ok(Some(ValidationCosts {
        noise_edges_ms,
        prove_ms_mean,
        verify_ms_per_client,
        proof_bytes,
        proof_fraction: proof_bytes / masked_bytes,
    }))
}

/// This machine's AES-128-CTR rate on `threads` cores, in bytes per second,
/// as `openssl speed -multi THREADS -evp aes-128-ctr` measures it on 16 KiB
/// buffers (the last `+F` line of its machine-readable output is the total).
fn openssl_ctr_rate(threads: usize) -> Result<f64> {
    let output = std::process::Command::new("openssl")
        .args(["speed", "-mr", "-seconds", "2", "-bytes", "16384", "-evp", "aes-128-ctr"])
        .args(["-multi", &threads.to_string()])
        .output()
        .context("running `openssl speed` (is OpenSSL installed?)")?;
    if !output.status.success() {
        bail!("`openssl speed` failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    parse_openssl_rate(&String::from_utf8_lossy(&output.stdout))
        .context("`openssl speed` printed no +F line for AES-128-CTR")
}

/// One X25519 agreement's time here (ms), the mean of 1000 after a warm-up.
fn agreement_ms() -> f64 {
    use cohort_crypto::agreement::AgreementKey;
    let mut rng = ChaCha20Rng::seed_from_u64(5);
    let own = AgreementKey::generate(&mut rng);
    let peers: Vec<[u8; 32]> = (0..1100).map(|_| AgreementKey::generate(&mut rng).public_key()).collect();
    let agree_all = |peers: &[[u8; 32]]| {
        for peer in peers {
            std::hint::black_box(own.agree(std::hint::black_box(peer)).is_ok());
        }
    };
    agree_all(&peers[..100]);
    let start = Instant::now();
    agree_all(&peers[100..]);
    start.elapsed().as_secs_f64() * 1e3 / 1000.0
}

/// The total rate in `openssl speed -mr` output: the last line
/// `+F:<index>:AES-128-CTR:<bytes per second>` (with `-multi`, the children's
/// lines come first, prefixed `Got:`, then the total).
fn parse_openssl_rate(output: &str) -> Option<f64> {
    output
        .lines()
        .filter_map(|line| line.strip_prefix("+F:"))
        .filter_map(|rest| rest.rsplit(':').next()?.trim().parse::<f64>().ok())
        .next_back()
}

fn print_table(r: &Report) {
    println!(
        "secure aggregation: {} clients, dim {}, {} graph (k = {}, t = {}), {} variant",
        r.clients, r.dim, r.graph, r.k, r.t, r.variant
    );
    println!("  dropout            {:.1} % ({} survivors)", r.dropout * 100.0, r.survivors);
    println!(
        "  inputs             {:.1} ms to make and quantize every update, before the round",
        r.inputs_ms
    );
    println!("  client time        mean {:.1} ms, max {:.1} ms", r.client_ms_mean, r.client_ms_max);
    println!("  server time        {:.1} ms ({:.1} ms unmasking)", r.server_ms, r.unmasking_ms);
    println!("  server key stream  {:.2} GB", r.server_keystream_bytes / 1e9);
    if let (Some(rate), Some(bound)) = (r.openssl_ctr_rate, r.keystream_bound_ms) {
        println!(
            "  key-stream bound   {bound:.1} ms at OpenSSL's {:.2} GB/s on {} threads: server time {:.2}x, unmasking {:.2}x",
            rate / 1e9,
            r.threads,
            r.server_ms / bound,
            r.unmasking_ms / bound
        );
    }
    if let Some(bound) = r.client_bound_ms {
        println!(
            "  client bound       {bound:.2} ms (key stream on one core + agreements): client mean {:.2}x",
            r.client_ms_mean / bound
        );
    }
    println!("  total (wall)       {:.1} ms on {} threads", r.total_ms, r.threads);
    println!(
        "  bytes per client   up {:.0}, down {:.0} (expansion {:.3}x over f32)",
        r.bytes_up_per_client, r.bytes_down_per_client, r.expansion
    );
    if let (Some(prove), Some(verify), Some(bytes), Some(fraction)) =
        (r.prove_ms_mean, r.verify_ms_per_client, r.proof_bytes_per_client, r.proof_fraction)
    {
        println!(
            "  validation         prove {prove:.1} ms (one core), verify {verify:.2} ms per client (batch), {bytes:.0} bytes ({:.1} % of the masked input)",
            fraction * 100.0
        );
    }
    if let Some(ms) = r.noise_edges_ms {
        println!("  noise edges        {ms:.1} ms a client (six edges drawn and committed, one core)");
    }
    if let Some(ratio) = r.noise_variance_ratio {
        println!("  noise variance     {ratio:.4} of the mechanism's");
    }
    println!("  aggregate correct  {}", r.correct);
}

#[cfg(test)]
mod tests {
    use super::parse_openssl_rate;

    #[test]
    fn the_openssl_rate_is_the_total_line_of_its_machine_readable_output() {
        let multi = "Forked child 0\nGot: +H:16384 from 0\nGot: +F:25:AES-128-CTR:9121628160.00 from 0\n\
                     Got: +F:25:AES-128-CTR:9350316032.00 from 1\n+H:16384\n+F:25:AES-128-CTR:18471944192.00\n";
        assert_eq!(parse_openssl_rate(multi), Some(18_471_944_192.0));
        let single = "+DT:AES-128-CTR:1:16384\n+R:577186:AES-128-CTR:1.000000\n+H:16384\n+F:25:AES-128-CTR:9456615424.00\n";
        assert_eq!(parse_openssl_rate(single), Some(9_456_615_424.0));
        assert_eq!(parse_openssl_rate("+H:16384\n"), None);
    }
}
