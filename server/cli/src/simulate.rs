//! `cohort simulate`: the demo's training in one process, with secure
//! aggregation through the protocol core (or plaintext FedAvg), no HTTP,
//! on a simulated clock: synchronous rounds of K of N clients, or buffered
//! asynchronous aggregation (one secure-aggregation group per buffer).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use cohort_client::checkpoint::{self, Checkpoint, ModelLayout};
use cohort_client::data::Dataset;
use cohort_client::runtime::LocalUpdate;
use cohort_crypto::Metric;
use cohort_server::optimizer::ServerOptimizer;
use cohort_server::privacy::{PrivacyPlan, PrivacySpec, PrivacyView};
use cohort_server::spec::{AsyncSpec, TaskPlan, TaskSpec};
use rand::RngExt;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use serde_json::{Map, Value, json};

use crate::experiment::Experiment;
use crate::progress::Progress;
use crate::results::{RoundRow, write_results};
use crate::schedule::{Clock, ScheduleArgs};
use crate::secure_mean::{secure_mean, simulation_spec};
use crate::training::{TrainingArgs, announce_updates, evaluate, prepare, quantization};

#[derive(Debug, Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    training: TrainingArgs,
    /// Clients selected per round (sync; default: all).
    #[arg(long)]
    clients_per_round: Option<usize>,
    /// Plaintext FedAvg instead of secure aggregation.
    #[arg(long)]
    plain: bool,
    #[command(flatten)]
    schedule: ScheduleArgs,
    /// Worker threads for local training and for secure aggregation's
    /// clients and unmasking (default: one per core).
    #[arg(long)]
    threads: Option<std::num::NonZeroUsize>,
    /// Where results.json and accuracy.png go.
    #[arg(long, default_value = "cohort-simulate")]
    out: PathBuf,
}

pub fn simulate(args: &SimulateArgs) -> Result<()> {
    let buffered_spec = args.schedule.async_spec(args.training.clients)?;
    let experiment = prepare(&args.training)?;
    announce_updates(&args.training, !args.plain);
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let sizes: Vec<usize> = experiment.shards.iter().map(Dataset::len).collect();
    let clock = Clock::new(&args.schedule, &sizes, args.training.local.epochs, args.training.seed());
    let mode = if args.plain { "plain" } else { "secure" };
    let threads = args.threads.map_or_else(threads, std::num::NonZeroUsize::get);
    let mut config = Map::new();
    // Secure aggregation's data-parallel steps (rayon) run on this pool, local
    // training on as many scoped threads.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    let rows = pool.install(|| -> Result<Vec<RoundRow>> {
        Ok(match buffered_spec {
            Some(spec) => {
                if args.clients_per_round.is_some() {
                    bail!("--clients-per-round is for --mode sync: an async buffer is --buffer-size clients");
                }
                if args.training.dp.spec(1.0).is_some() {
                    bail!("differential privacy is accounted for synchronous rounds only: drop --mode async");
                }
                println!(
                    "{mode} buffered asynchronous aggregation in process: {} of {} clients training at once, \
                     buffers of {}, staleness at most {}:",
                    spec.concurrency, args.training.clients, spec.buffer_size, spec.max_staleness
                );
                let run = buffered(&experiment, &args.training, &spec, !args.plain, threads, &clock)?;
                println!(
                    "{} updates refused as staler than {} versions (their clients re-based).",
                    run.stale, spec.max_staleness
                );
                config.insert("schedule".into(), schedule_json(&args.schedule, Some(&spec), Some(run.stale)));
                run.rows
            }
            None => {
                let per_round = args.clients_per_round.unwrap_or(args.training.clients);
                if per_round < 2 || per_round > args.training.clients {
                    bail!("--clients-per-round must be between 2 and --clients");
                }
                let timing = Timing { clock, over_selection: args.schedule.over_selection };
                let selected = timing.selected(per_round, args.training.clients)?;
                println!(
                    "{mode} aggregation in process, {selected} of {} clients selected per round, {per_round} awaited:",
                    args.training.clients
                );
                let rows = in_process(&experiment, &args.training, per_round, !args.plain, threads, &timing)?;
                if let Some(asked) = &args.training.dp.spec(selected as f64 / args.training.clients as f64) {
                    let task = round_task(&experiment, &args.training, selected, selected - per_round);
                    let plan = TaskPlan::new(task).map_err(|e| anyhow!("{e}"))?;
                    if let Some(plan) = plan.privacy() {
                        config.insert("privacy".into(), privacy_json(asked, plan)?);
                    }
                }
                config.insert("schedule".into(), schedule_json(&args.schedule, None, None));
                rows
            }
        })
    })?;
    write_results(&args.out, mode, &args.training, &rows, config)
}

/// The schedule of a run as results.json records it.
fn schedule_json(schedule: &ScheduleArgs, buffered: Option<&AsyncSpec>, stale: Option<u64>) -> Value {
    let mut value = json!({
        "mode": if buffered.is_some() { "async" } else { "sync" },
        "speed": schedule.speed.map(|sigma| format!("lognormal:{sigma}")),
        "stragglers": schedule.stragglers.map(|(f, x)| format!("{f}:{x}")),
        "examples_per_second": schedule.examples_per_second,
    });
    match buffered {
        Some(spec) => {
            value["concurrency"] = json!(spec.concurrency);
            value["buffer_size"] = json!(spec.buffer_size);
            value["max_staleness"] = json!(spec.max_staleness);
            value["staleness_exponent"] = json!(spec.staleness_exponent);
            value["stale_updates_refused"] = json!(stale);
        }
        None => value["over_selection"] = json!(schedule.over_selection),
    }
    value
}

/// The privacy of a run as results.json records it: what was asked and
/// the noise the coordinator derived.
pub(crate) fn privacy_json(spec: &PrivacySpec, plan: &PrivacyPlan) -> Result<Value> {
    let mut value = serde_json::to_value(PrivacyView::of(plan, 0))?;
    value["epsilon_budget"] = json!(spec.epsilon);
    value["bits"] = json!(plan.modulus_bits);
    if let Some(view) = value.as_object_mut() {
        view.remove("epsilon_spent");
        view.remove("budget");
    }
    Ok(value)
}

/// The task an in-process group of `n` clients runs, `late` of them cut
/// as stragglers: its dropout, quantization and privacy (the same each
/// round).
fn round_task(experiment: &Experiment, training: &TrainingArgs, n: usize, late: usize) -> TaskSpec {
    let vanishing = late as u32 + ((n - late) as f64 * training.dropout).ceil() as u32;
    let largest = experiment.shards.iter().map(Dataset::len).max().unwrap_or(1);
    simulation_spec(
        n as u32,
        vanishing,
        quantization(training, largest),
        experiment.model.len(),
        training.dp.spec(n as f64 / training.clients as f64),
        training.rounds as u32,
    )
}

pub(crate) fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The simulated clock of synchronous rounds, and their over-selection.
pub(crate) struct Timing {
    pub(crate) clock: Clock,
    pub(crate) over_selection: f64,
}

impl Timing {
    /// Clients selected for rounds that await `per_round`.
    fn selected(&self, per_round: usize, clients: usize) -> Result<usize> {
        let selected = (per_round as f64 * (1.0 + self.over_selection)).ceil() as usize;
        if selected > clients {
            bail!(
                "{per_round} clients per round with over-selection select {selected}, more than the {clients}"
            );
        }
        Ok(selected)
    }
}

/// Synchronous rounds in process: `per_round` clients awaited per round
/// (more selected with over-selection; the slowest are cut, as dropouts
/// after their key shares), a `dropout` fraction of the others vanishing
/// too; secure aggregation through the protocol core, or the plain
/// weighted mean. Each round lasts, on the simulated clock, until the
/// last awaited client finished training.
pub(crate) fn in_process(
    experiment: &Experiment,
    training: &TrainingArgs,
    per_round: usize,
    secure: bool,
    threads: usize,
    timing: &Timing,
) -> Result<Vec<RoundRow>> {
    let layout = experiment.model.layout();
    let mut weights = layout.fan_in_init(training.seed());
    let mut rng = ChaCha20Rng::seed_from_u64(training.seed() ^ 0x5e1e_c7ed);
    let n = timing.selected(per_round, training.clients)?;
    let task = round_task(experiment, training, n, n - per_round);
    if task.privacy.is_some() && !secure {
        bail!("differential privacy needs secure aggregation: drop --plain");
    }
    let privacy = TaskPlan::new(task.clone()).map_err(|e| anyhow!("{e}"))?.privacy().copied();
    let progress = Progress::new(training.rounds);
    let mut rows = Vec::new();
    let mut now = 0.0;
    // How many updates each client trained: what its training is seeded with.
    let mut trained = vec![0u64; training.clients];
    for round in 1..=training.rounds {
        let started = Instant::now();
        let model_bytes = checkpoint::encode(&layout, &weights, &Default::default())?;
        let global =
            Checkpoint { layout: layout.clone(), weights: weights.clone(), metadata: Default::default() };
        let mut clients: Vec<usize> = (0..training.clients).collect();
        let (chosen, _) = clients.partial_shuffle(&mut rng, n);
        let mut clients = chosen.to_vec();
        clients.sort_unstable();
        // The awaited are the first to finish; the round ends with the last of them.
        let mut by_time: Vec<usize> = (0..n).collect();
        by_time.sort_by(|&a, &b| {
            timing.clock.training(clients[a]).total_cmp(&timing.clock.training(clients[b]))
        });
        let (awaited, late) = by_time.split_at(per_round);
        now += awaited.iter().map(|&i| timing.clock.training(clients[i])).fold(0.0, f64::max);
        let vanishing = (per_round as f64 * training.dropout).ceil() as usize;
        let mut order = awaited.to_vec();
        order.shuffle(&mut rng);
        let mut dropped = order[..vanishing].to_vec();
        dropped.extend_from_slice(late);
        progress.bar(round - 1, "training");
        let selected: Vec<(usize, u64)> = clients.iter().map(|&k| (k, trained[k])).collect();
        clients.iter().for_each(|&k| trained[k] += 1);
        let updates: Vec<LocalUpdate> = experiment
            .local_updates(&global, &selected, threads)
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("local training: {e}"))?;
        progress.bar(round - 1, if secure { "secure aggregation" } else { "aggregation" });
        let survivors: Vec<usize> = (0..n).filter(|i| !dropped.contains(i)).collect();
        let aggregate =
            aggregate(&updates, &dropped, &survivors, secure.then_some(&task), training.seed() ^ round)?;
        ServerOptimizer::default().step(
            &mut weights,
            &aggregate.mean,
            &mut ServerOptimizer::default().initial_state(layout.len()),
        )?;
        let (accuracy, loss) = evaluate(experiment, &weights);
        let row = RoundRow {
            round,
            accuracy,
            loss,
            client_loss: aggregate.client_loss,
            seconds: started.elapsed().as_secs_f64(),
            sim_seconds: Some(now),
            bytes_up_per_client: aggregate.bytes_up,
            bytes_down_per_client: model_bytes.len() as f64,
            survivors: survivors.len() as u64,
            compression_ratio: aggregate.bytes_up / (4.0 * layout.len() as f64),
            masked_input_ratio: aggregate.masked.map(|bytes| bytes as f64 / (4.0 * layout.len() as f64)),
            epsilon: privacy.as_ref().map(|plan| plan.epsilon_after(round)),
            staleness: None,
        };
        progress.row(&row);
        rows.push(row);
    }
    progress.finish();
    Ok(rows)
}

/// What one group's aggregation produced.
struct GroupMean {
    mean: Vec<f32>,
    bytes_up: f64,
    client_loss: Option<f64>,
    /// The masked input's size, under secure aggregation.
    masked: Option<usize>,
}

/// The survivors' weighted mean: through secure aggregation of the task
/// `secure` (the `dropped` vanishing after their key shares), or in the
/// clear without it.
fn aggregate(
    updates: &[LocalUpdate],
    dropped: &[usize],
    survivors: &[usize],
    secure: Option<&TaskSpec>,
    seed: u64,
) -> Result<GroupMean> {
    let dimension = updates.first().map_or(0, |u| u.delta.len());
    if let Some(task) = secure {
        let round = secure_mean(updates, dropped, task, seed, dimension)?;
        return Ok(GroupMean {
            mean: round.mean,
            bytes_up: round.bytes_up,
            client_loss: round.client_loss,
            masked: Some(round.masked_input_bytes),
        });
    }
    let losses: Vec<f64> =
        survivors.iter().filter_map(|&i| updates[i].metrics.get(Metric::TrainLoss)).collect();
    let client_loss = (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64);
    let total: f64 = survivors.iter().map(|&i| f64::from(updates[i].examples)).sum();
    let mean = (0..dimension)
        .map(|j| {
            let sum: f64 = survivors
                .iter()
                .map(|&i| f64::from(updates[i].delta[j]) * f64::from(updates[i].examples))
                .sum();
            (sum / total) as f32
        })
        .collect();
    Ok(GroupMean { mean, bytes_up: 4.0 * dimension as f64 + 4.0, client_loss, masked: None })
}

/// A client training, on the simulated clock.
#[derive(Debug, Clone, Copy)]
struct Job {
    client: usize,
    /// The model version it trains from.
    base: u64,
    /// When it finishes.
    done_at: f64,
}

/// A buffered asynchronous run: its rows (one per applied buffer) and the
/// updates refused as too stale.
pub(crate) struct Buffered {
    pub(crate) rows: Vec<RoundRow>,
    pub(crate) stale: u64,
}

/// Buffered asynchronous aggregation in process (FedBuff): `concurrency`
/// clients train at once, each from the model version current when it
/// started; a finished update joins the buffer, and every `buffer_size`
/// of them are one secure-aggregation group whose mean (each update
/// weighted by its client for its staleness, (1 + s)^−a) is applied at
/// once as the next version. A client whose base falls more than
/// `max_staleness` versions behind no longer holds a training slot (its
/// update will be refused, and it re-bases when it next checks in), so a
/// new client starts in its place. `training.rounds` versions in all.
pub(crate) fn buffered(
    experiment: &Experiment,
    training: &TrainingArgs,
    spec: &AsyncSpec,
    secure: bool,
    threads: usize,
    clock: &Clock,
) -> Result<Buffered> {
    let layout = experiment.model.layout();
    let (k, concurrency) = (spec.buffer_size as usize, spec.concurrency as usize);
    let task = round_task(experiment, training, k, 0);
    let mut rng = ChaCha20Rng::seed_from_u64(training.seed() ^ 0xa5_7a1e);
    let mut weights = layout.fan_in_init(training.seed());
    let mut bases: BTreeMap<u64, Checkpoint> = BTreeMap::new();
    let mut state = Schedule { version: 0, now: 0.0, jobs: Vec::new(), buffer: Vec::new(), stale: 0 };
    let progress = Progress::new(training.rounds);
    let mut rows = Vec::new();
    let mut groups = 0u64;
    // How many updates each client trained: what its training is seeded with.
    let mut trained = vec![0u64; training.clients];
    bases.insert(0, checkpoint_of(&layout, &weights));
    state.fill(concurrency, training.clients, clock, &mut rng);
    while state.version < training.rounds {
        let Some(job) = state.next_finished() else { bail!("no client is training: the schedule stalled") };
        if !spec.fresh(job.base, state.version) {
            // A stale update is refused; the slot was already given away.
            state.stale += 1;
            continue;
        }
        state.buffer.push(job);
        state.fill(concurrency, training.clients, clock, &mut rng);
        if state.buffer.len() < k {
            continue;
        }
        let started = Instant::now();
        groups += 1;
        let members = std::mem::take(&mut state.buffer);
        let staleness: Vec<u64> = members.iter().map(|job| state.version - job.base).collect();
        progress.bar(state.version, "training");
        let jobs: Vec<(usize, u64, &Checkpoint)> = members
            .iter()
            .map(|job| {
                let base = bases.get(&job.base).context("a base model was pruned too early")?;
                let nonce = trained[job.client];
                trained[job.client] += 1;
                Ok((job.client, nonce, base))
            })
            .collect::<Result<_>>()?;
        let mut updates: Vec<LocalUpdate> = experiment
            .local_updates_from(&jobs, threads)
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("local training: {e}"))?;
        for (update, &s) in updates.iter_mut().zip(&staleness) {
            let weight = spec.weight(s);
            update.delta.iter_mut().for_each(|v| *v *= weight);
        }
        progress.bar(state.version, if secure { "secure aggregation" } else { "aggregation" });
        let vanishing = (k as f64 * training.dropout).ceil() as usize;
        let mut order: Vec<usize> = (0..k).collect();
        order.shuffle(&mut rng);
        let dropped = order[..vanishing].to_vec();
        let survivors: Vec<usize> = (0..k).filter(|i| !dropped.contains(i)).collect();
        let aggregate =
            aggregate(&updates, &dropped, &survivors, secure.then_some(&task), training.seed() ^ groups)?;
        ServerOptimizer::default().step(
            &mut weights,
            &aggregate.mean,
            &mut ServerOptimizer::default().initial_state(layout.len()),
        )?;
        state.version += 1;
        bases.insert(state.version, checkpoint_of(&layout, &weights));
        state.evict(spec);
        state.fill(concurrency, training.clients, clock, &mut rng);
        // A client whose slot was given away is refused: only the others train.
        let holding = state.jobs.iter().filter(|(_, slot)| *slot).map(|(job, _)| job);
        let in_use: BTreeSet<u64> = holding.chain(&state.buffer).map(|job| job.base).collect();
        bases.retain(|version, _| *version == state.version || in_use.contains(version));
        let (accuracy, loss) = evaluate(experiment, &weights);
        let mut histogram = vec![0u64; staleness.iter().max().map_or(0, |&s| s as usize + 1)];
        staleness.iter().for_each(|&s| histogram[s as usize] += 1);
        let model_bytes = checkpoint::encode(&layout, &weights, &Default::default())?.len();
        let row = RoundRow {
            round: state.version,
            accuracy,
            loss,
            client_loss: aggregate.client_loss,
            seconds: started.elapsed().as_secs_f64(),
            sim_seconds: Some(state.now),
            bytes_up_per_client: aggregate.bytes_up,
            bytes_down_per_client: model_bytes as f64,
            survivors: survivors.len() as u64,
            compression_ratio: aggregate.bytes_up / (4.0 * layout.len() as f64),
            masked_input_ratio: aggregate.masked.map(|bytes| bytes as f64 / (4.0 * layout.len() as f64)),
            epsilon: None,
            staleness: Some(histogram),
        };
        progress.row(&row);
        rows.push(row);
    }
    progress.finish();
    Ok(Buffered { rows, stale: state.stale })
}

fn checkpoint_of(layout: &ModelLayout, weights: &[f32]) -> Checkpoint {
    Checkpoint { layout: layout.clone(), weights: weights.to_vec(), metadata: Default::default() }
}

/// The asynchronous schedule's state on the simulated clock.
struct Schedule {
    version: u64,
    now: f64,
    /// Clients training, the ones holding a slot and the ones whose slot
    /// was given away (their update will be refused) alike.
    jobs: Vec<(Job, bool)>,
    /// Finished updates waiting for the buffer to fill.
    buffer: Vec<Job>,
    stale: u64,
}

impl Schedule {
    /// Starts clients until `concurrency` hold a slot: each drawn at
    /// random from those neither training nor waiting in the buffer.
    fn fill(&mut self, concurrency: usize, clients: usize, clock: &Clock, rng: &mut ChaCha20Rng) {
        while self.jobs.iter().filter(|(_, slot)| *slot).count() < concurrency {
            let busy: BTreeSet<usize> = self
                .jobs
                .iter()
                .map(|(job, _)| job.client)
                .chain(self.buffer.iter().map(|job| job.client))
                .collect();
            let idle: Vec<usize> = (0..clients).filter(|k| !busy.contains(k)).collect();
            if idle.is_empty() {
                return;
            }
            let client = idle[rng.random_range(0..idle.len())];
            let job = Job { client, base: self.version, done_at: self.now + clock.training(client) };
            self.jobs.push((job, true));
        }
    }

    /// The next client to finish (the clock moves to it).
    fn next_finished(&mut self) -> Option<Job> {
        let next = (0..self.jobs.len()).min_by(|&a, &b| {
            let (a, b) = (&self.jobs[a].0, &self.jobs[b].0);
            a.done_at.total_cmp(&b.done_at).then(a.client.cmp(&b.client))
        })?;
        let (job, _) = self.jobs.swap_remove(next);
        self.now = self.now.max(job.done_at);
        Some(job)
    }

    /// Frees the slots of clients whose base is more than `max_staleness`
    /// versions old: their update can no longer be accepted.
    fn evict(&mut self, spec: &AsyncSpec) {
        for (job, slot) in &mut self.jobs {
            if !spec.fresh(job.base, self.version) {
                *slot = false;
            }
        }
    }
}
