//! `cohort participate`: one client process, the built-in trainer on a
//! local shard driven by the participant runtime.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use cohort_client::checkpoint::Checkpoint;
#[cfg(feature = "tch")]
use cohort_client::model::TorchScriptModel;
use cohort_client::participant::{Participant, ParticipantConfig, RoundOutcome, Stage};
#[cfg(feature = "tch")]
use cohort_client::runtime::LocalTrainer;
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{Contribution, LocalUpdate, Runner, Trainer, UpdateError, load_state};
use cohort_client::train::TrainConfig;
use cohort_crypto::policy::Policy;
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

use crate::datasets::read_shard;
#[cfg(feature = "tch")]
use crate::experiment::client_config;
use crate::experiment::client_trainer;
use crate::layout::{built_in, is_torchscript};
use crate::training::LocalArgs;

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
    /// Model: logreg, 2nn, cnn, or a TorchScript module saved with
    /// `torch.jit.save` (a path ending in .pt; needs the `tch` feature):
    /// its `forward` maps a batch [N, D] of flattened examples to logits
    /// [N, C], and the task's layout must be its named parameters.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    local: LocalArgs,
    /// Probability of vanishing mid-round, per round.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// The client's client policy, as JSON: any of `allow_semi_honest`,
    /// `min_clients`, `min_threshold`, `collusion` ({"corruption",
    /// "security_bits"} or null), `min_ring_bits`, `max_ring_bits`,
    /// `allow_rotation`, `allow_sketch`. Fields left out keep their
    /// defaults, which are for a coordinator the client does not trust:
    /// the active variant only, at least 10 clients, a threshold of at
    /// least 5 that withstands 5 % colluding clients.
    #[arg(long)]
    policy: Option<String>,
    /// Consecutive failed requests (no answer, or a 5xx) before the client
    /// gives up; the waits between them double up to 10 s, so the default
    /// rides out about 20 s of outage.
    #[arg(long, default_value_t = ParticipantConfig::default().max_attempts)]
    max_attempts: u32,
    /// Take at least this many seconds over each local training, waiting
    /// after it if it was faster: a slow device, for measuring schedules
    /// (`cohort demo --speed`, `--stragglers`).
    #[arg(long, value_parser = parse_pace)]
    pace: Option<f64>,
    /// Cheat (a build with the `adversary` feature, for measuring input
    /// validation): prove the honest update, then add to the masked input
    /// half the ring (`scaled`) or random ring values (`random`). An
    /// exclusion by the coordinator ends the process.
    #[cfg(feature = "adversary")]
    #[arg(long)]
    pub attack: Option<cohort_client::participant::adversary::Attack>,
}

pub fn participate(args: &ParticipateArgs) -> Result<()> {
    let train = args.local.config();
    if is_torchscript(&args.model) {
        return torchscript(args, &train);
    }
    let data = read_shard(&args.shard)?;
    let model = built_in(&args.model, data.features.ncols(), data.classes)?;
    paced(args, client_trainer(&model, data, &train, train.seed, args.index))
}

/// Runs `trainer`, paced as `--pace` asks.
fn paced(args: &ParticipateArgs, trainer: impl Trainer) -> Result<()> {
    match args.pace {
        Some(seconds) => run(args, Paced { trainer, at_least: Duration::from_secs_f64(seconds) }),
        None => run(args, trainer),
    }
}

fn parse_pace(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && (0.0..=86_400.0).contains(&seconds) => Ok(seconds),
        _ => Err(format!("expected seconds between 0 and 86400, got {text:?}")),
    }
}

/// A trainer that takes at least `at_least` over each update.
struct Paced<T> {
    trainer: T,
    at_least: Duration,
}

impl<T: Trainer> Trainer for Paced<T> {
    fn train(&mut self, contribution: Contribution, model: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        let started = Instant::now();
        let update = self.trainer.train(contribution, model);
        if let Some(rest) = self.at_least.checked_sub(started.elapsed()) {
            std::thread::sleep(rest);
        }
        update
    }
}

/// A TorchScript module saved with `torch.jit.save`, trained on libtorch.
#[cfg(feature = "tch")]
fn torchscript(args: &ParticipateArgs, train: &TrainConfig) -> Result<()> {
    let data = read_shard(&args.shard)?;
    let model = TorchScriptModel::load_best_available(&args.model, data.features.ncols(), data.classes)
        .with_context(|| format!("loading {}", args.model))?;
    paced(args, LocalTrainer { model, data, config: client_config(train, train.seed, args.index) })
}

#[cfg(not(feature = "tch"))]
fn torchscript(args: &ParticipateArgs, _: &TrainConfig) -> Result<()> {
    Err(crate::layout::no_libtorch(&args.model))
}

/// Takes part in rounds until the task is over.
fn run(args: &ParticipateArgs, mut trainer: impl Trainer) -> Result<()> {
    let transport = match &args.ca_cert {
        Some(path) => HttpTransport::with_root_certificates(&args.server, &std::fs::read(path)?)?,
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
    let config =
        ParticipantConfig { policy, max_attempts: args.max_attempts, ..ParticipantConfig::default() };
    let participant = match args.state.as_deref().map(load_state).transpose()?.flatten() {
        Some(saved) if saved.task_id == args.task => Participant::resume(saved, Some(&token), config),
        _ => Participant::enroll(&args.task, &token, config),
    };
    #[cfg(feature = "adversary")]
    let participant = match args.attack {
        Some(attack) => participant.cheating(attack),
        None => participant,
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
                    RoundOutcome::Dropped { reason, .. } => format!("dropped by the coordinator: {reason}"),
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
