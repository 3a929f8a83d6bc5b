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
    /// Seed for inputs, keys and the choice of dropouts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
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
    client_ms_mean: f64,
    client_ms_max: f64,
    server_ms: f64,
    total_ms: f64,
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
    let builder = RoundBuilder {
        quantization: &settings,
        metrics: MetricSet::NONE,
        variant,
        graph,
        threshold: params.threshold,
        dimension: args.dim as usize,
        privacy: None,
    };
    let public_keys = identities.iter().map(|key| key.public_key()).collect();
    let BuiltRound { config, quantizer } = builder.build(1, args.clients, public_keys, &mut seed_rng)?;
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
        let mut rng = ChaCha20Rng::seed_from_u64(seed ^ (u64::from(id.get()) << 20) ^ 0x1f2e3d);
        let update: Vec<f32> =
            (0..dim).map(|_| (rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0).collect();
        let weight = 1 + (rng.next_u32() % 600);
        match quantizer.encode(&update, weight, &mut rng) {
            Ok(input) => input,
            Err(error) => unreachable!("bench updates are finite and weights in range: {error}"),
        }
    };

    let threads = args.threads.unwrap_or_else(rayon::current_num_threads);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    let simulation =
        Simulation { config: config.clone(), identities, plan, inputs: &inputs, seed: args.seed };
    let start = Instant::now();
    let outcome = pool.install(|| simulation.run(&WallClock)).context("the round failed")?;
    let total_ms = start.elapsed().as_secs_f64() * 1e3;

    let expected = pool.install(|| plain_sum(&config, &outcome.aggregate.contributors, &inputs));
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
        client_ms_mean: finished.iter().map(|c| c.busy_ms).sum::<f64>() / count,
        client_ms_max: finished.iter().map(|c| c.busy_ms).fold(0.0, f64::max),
        server_ms: outcome.server_ms,
        total_ms,
        bytes_up_per_client: bytes_up,
        bytes_down_per_client: finished.iter().map(|c| c.bytes_down as f64).sum::<f64>() / count,
        expansion: bytes_up / (f64::from(args.dim) * 4.0),
        correct: outcome.aggregate.sum == expected,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    if !report.correct {
        bail!("the aggregate differs from the plain sum of the survivors' inputs");
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "secure aggregation: {} clients, dim {}, {} graph (k = {}, t = {}), {} variant",
        r.clients, r.dim, r.graph, r.k, r.t, r.variant
    );
    println!("  dropout            {:.1} % ({} survivors)", r.dropout * 100.0, r.survivors);
    println!("  client time        mean {:.1} ms, max {:.1} ms", r.client_ms_mean, r.client_ms_max);
    println!("  server time        {:.1} ms", r.server_ms);
    println!("  total (wall)       {:.1} ms on {} threads", r.total_ms, r.threads);
    println!(
        "  bytes per client   up {:.0}, down {:.0} (expansion {:.3}x over f32)",
        r.bytes_up_per_client, r.bytes_down_per_client, r.expansion
    );
    println!("  aggregate correct  {}", r.correct);
}
