//! `cohort simulate`: the demo's training in one process, with K of N
//! clients per round and secure aggregation through the protocol core (or
//! plaintext FedAvg), no HTTP.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::data::Dataset;
use cohort_client::runtime::LocalUpdate;
use cohort_crypto::Metric;
use cohort_server::optimizer::ServerOptimizer;
use cohort_server::privacy::{PrivacyPlan, PrivacySpec, PrivacyView};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::experiment::Experiment;
use crate::progress::Progress;
use crate::results::{RoundRow, write_results};
use crate::secure_mean::{Accountant, secure_mean, simulation_spec};
use crate::training::{TrainingArgs, evaluate, prepare, quantization};

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
    let privacy = match args.training.dp.spec(per_round as f64 / args.training.clients as f64) {
        Some(privacy) => {
            let vanishing = (per_round as f64 * args.training.dropout).ceil() as u32;
            let largest = experiment.shards.iter().map(Dataset::len).max().unwrap_or(1);
            let spec = simulation_spec(
                per_round as u32,
                vanishing,
                quantization(&args.training, largest),
                experiment.model.len(),
                Some(privacy),
                args.training.rounds as u32,
            );
            let plan = spec.privacy_plan().map_err(|e| anyhow!("{e}"))?;
            plan.map(|plan| privacy_json(&privacy, &plan)).transpose()?
        }
        None => None,
    };
    write_results(&args.out, mode, &args.training, &rows, privacy)
}

/// The privacy of a run as results.json records it: what was asked and
/// the noise the coordinator derived.
pub(crate) fn privacy_json(spec: &PrivacySpec, plan: &PrivacyPlan) -> Result<serde_json::Value> {
    let mut value = serde_json::to_value(PrivacyView::of(plan, 0))?;
    value["epsilon_budget"] = serde_json::json!(spec.epsilon);
    value["bits"] = serde_json::json!(plan.modulus_bits);
    if let Some(view) = value.as_object_mut() {
        view.remove("epsilon_spent");
        view.remove("budget");
    }
    Ok(value)
}

pub(crate) fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Rounds in process: `per_round` clients sampled per round, a `dropout`
/// fraction of them vanishing after their key shares; secure aggregation
/// through the protocol core, or the plain weighted mean.
pub(crate) fn in_process(
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
    let privacy = training.dp.spec(per_round as f64 / training.clients as f64);
    if privacy.is_some() && !secure {
        bail!("differential privacy needs secure aggregation: drop --plain");
    }
    let mut accountant = Accountant::default();
    let progress = Progress::new(training.rounds);
    let mut rows = Vec::new();
    for round in 1..=training.rounds {
        let started = Instant::now();
        let model_bytes = checkpoint::encode(&layout, &weights, &Default::default())?;
        let global =
            Checkpoint { layout: layout.clone(), weights: weights.clone(), metadata: Default::default() };
        let mut clients: Vec<usize> = (0..training.clients).collect();
        let (chosen, _) = clients.partial_shuffle(&mut rng, per_round);
        let mut clients = chosen.to_vec();
        clients.sort_unstable();
        let vanishing = (per_round as f64 * training.dropout).ceil() as usize;
        let mut order: Vec<usize> = (0..per_round).collect();
        order.shuffle(&mut rng);
        let dropped = order[..vanishing].to_vec();
        progress.bar(round - 1, "training");
        let updates: Vec<LocalUpdate> = experiment
            .local_updates(round, &global, &clients, threads)
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("local training: {e}"))?;
        progress.bar(round - 1, if secure { "secure aggregation" } else { "aggregation" });
        let survivors: Vec<usize> = (0..per_round).filter(|i| !dropped.contains(i)).collect();
        let (mean, bytes_up, client_loss, masked) = if secure {
            let spec = simulation_spec(
                per_round as u32,
                vanishing as u32,
                q,
                layout.len(),
                privacy,
                training.rounds as u32,
            );
            let round = secure_mean(&updates, &dropped, &spec, training.seed() ^ round, layout.len())?;
            if let Some(plan) = round.privacy {
                accountant.release(&plan);
            }
            (round.mean, round.bytes_up, round.client_loss, Some(round.masked_input_bytes))
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
            (mean, 4.0 * layout.len() as f64 + 4.0, client_loss, None)
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
            masked_input_ratio: masked.map(|bytes| bytes as f64 / (4.0 * layout.len() as f64)),
            epsilon: accountant.epsilon(),
        };
        progress.row(&row);
        rows.push(row);
    }
    progress.finish();
    Ok(rows)
}
