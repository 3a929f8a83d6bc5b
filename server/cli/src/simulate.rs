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
use cohort_server::round::suspects::Suspects;
use cohort_server::spec::{AsyncSpec, GroupRule, TaskPlan, TaskSpec};
use rand::RngExt;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use serde_json::{Map, Value, json};

use crate::experiment::Experiment;
use crate::progress::Progress;
use crate::results::{RoundRow, write_results};
use crate::schedule::{Clock, ScheduleArgs};
use crate::secure_mean::{FittedSum, GroupOutcome, SecureMean, secure_group, secure_mean, simulation_spec};
use crate::training::{TrainingArgs, announce_updates, evaluate, prepare, quantization};
use cohort_crypto::SumSpread;
use cohort_crypto::simulation::Attack;

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
    #[command(flatten)]
    adversity: AdversityArgs,
}

/// Cheating clients, input validation and robust rules in the secure
/// rounds of `cohort simulate` (sync mode).
#[derive(Debug, Args)]
pub(crate) struct AdversityArgs {
    /// Input validation: every update proven, in zero knowledge, within
    /// the L2 clip (`l2`; a failed sum check leaves its group out, and its
    /// cheater is found across rounds and excluded, as by the coordinator),
    /// or nothing checked (`none`).
    #[arg(long, value_enum, default_value_t = crate::demo::DemoValidation::None)]
    validation: crate::demo::DemoValidation,
    /// Clients per secure-aggregation group (default: one group a round).
    #[arg(long)]
    group_size: Option<usize>,
    /// Fraction of the clients that cheat: each proves its honest update
    /// and adds `--attack` to its masked input.
    #[arg(long, default_value_t = 0.0)]
    malicious: f64,
    /// What a cheater adds: half the ring on every coordinate (`scaled`)
    /// or random ring values (`random`).
    #[arg(long, default_value = "scaled")]
    attack: Attack,
    /// A robust rule across each round's group means: `norm:MAX` (a group
    /// whose mean is longer is left out), `median` (coordinate-wise) or
    /// `trimmed:T` (trimmed mean, T in [0, 0.5)).
    #[arg(long, value_parser = parse_rule)]
    group_rule: Option<GroupRule>,
}

fn parse_rule(text: &str) -> Result<GroupRule, String> {
    let number = |v: &str| v.parse::<f32>().map_err(|e| format!("{text}: {e}"));
    match text.split_once(':') {
        None if text == "median" => Ok(GroupRule::Median),
        Some(("norm", max)) => Ok(GroupRule::Norm { max: number(max)? }),
        Some(("trimmed", trim)) => Ok(GroupRule::TrimmedMean { trim: number(trim)? }),
        _ => Err(format!("unknown group rule {text:?} (norm:MAX, median, trimmed:T)")),
    }
}

/// The adversity of a run, settled: which clients cheat and how, whether
/// inputs are validated, the groups and their rule.
#[derive(Debug, Clone, Default)]
pub(crate) struct Adversity {
    cheaters: BTreeSet<usize>,
    attack: Option<Attack>,
    validated: bool,
    group_size: Option<usize>,
    rule: Option<GroupRule>,
}

impl Adversity {
    fn of(args: &AdversityArgs, clients: usize, seed: u64) -> Result<Self> {
        if !(0.0..=0.5).contains(&args.malicious) {
            bail!("--malicious is a fraction of the clients, at most 0.5");
        }
        let count = (args.malicious * clients as f64).round() as usize;
        let mut all: Vec<usize> = (0..clients).collect();
        all.shuffle(&mut ChaCha20Rng::seed_from_u64(seed ^ 0xbad_c11e));
        Ok(Self {
            cheaters: all[..count].iter().copied().collect(),
            attack: (count > 0).then_some(args.attack),
            validated: args.validation == crate::demo::DemoValidation::L2,
            group_size: args.group_size,
            rule: args.group_rule,
        })
    }

    /// Whether the rounds run as plain groups of the protocol (the
    /// simulation's path before any of this).
    fn is_none(&self) -> bool {
        self.attack.is_none() && !self.validated && self.group_size.is_none() && self.rule.is_none()
    }

    fn json(&self) -> Value {
        json!({
            "malicious": self.cheaters.len(),
            "attack": self.attack.map(Attack::name),
            "validation": if self.validated { "l2" } else { "none" },
            "group_size": self.group_size,
            "group_rule": self.rule,
        })
    }
}

pub fn simulate(args: &SimulateArgs) -> Result<()> {
    let buffered_spec = args.schedule.async_spec(args.training.clients)?;
    let experiment = prepare(&args.training)?;
    let validated = args.adversity.validation == crate::demo::DemoValidation::L2;
    announce_updates(&args.training, !args.plain, validated);
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
                    "{mode} buffered asynchronous aggregation in process: {} training slots for {} clients, \
                     buffers of {}, staleness at most {}:",
                    spec.concurrency, args.training.clients, spec.buffer_size, spec.max_staleness
                );
                let run = buffered(&experiment, &args.training, &spec, !args.plain, threads, &clock)?;
                println!(
                    "{} updates refused as staler than {} versions (their clients re-based); {:.1} clients \
                     trained at once on average (slots: {}, held for {} versions).",
                    run.stale,
                    spec.max_staleness,
                    run.training_at_once,
                    spec.concurrency,
                    spec.slot_lag()
                );
                let schedule =
                    schedule_json(&args.schedule, Some(&spec), Some(run.stale), Some(run.training_at_once));
                config.insert("schedule".into(), schedule);
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
                let adversity = Adversity::of(&args.adversity, args.training.clients, args.training.seed())?;
                if !adversity.is_none() {
                    if args.plain {
                        bail!("--malicious, --validation, --group-size and --group-rule need secure aggregation");
                    }
                    if adversity.validated
                        && args.training.dp.spec(1.0).is_some_and(|dp| dp.mechanism != cohort_crypto::dp::Mechanism::Skellam)
                    {
                        bail!("input validation under differential privacy needs --mechanism skellam");
                    }
                    config.insert("adversity".into(), adversity.json());
                }
                let (rows, training_at_once) =
                    in_process(&experiment, &args.training, per_round, !args.plain, threads, &timing, &adversity)?;
                println!("{training_at_once:.1} clients trained at once on average ({selected} selected a round).");
                if let Some(asked) = &args.training.dp.spec(selected as f64 / args.training.clients as f64) {
                    let task = round_task(&experiment, &args.training, selected, selected - per_round, false);
                    let plan = TaskPlan::new(task).map_err(|e| anyhow!("{e}"))?;
                    if let Some(plan) = plan.privacy() {
                        config.insert("privacy".into(), privacy_json(asked, plan)?);
                    }
                }
                config.insert(
                    "schedule".into(),
                    schedule_json(&args.schedule, None, None, Some(training_at_once)),
                );
                rows
            }
        })
    })?;
    write_results(&args.out, mode, &args.training, &rows, config, validated)
}

/// The schedule of a run as results.json records it.
/// With the simulator's outcome of the run, when there is one: the
/// updates refused as stale (async) and the clients training at once.
pub(crate) fn schedule_json(
    schedule: &ScheduleArgs,
    buffered: Option<&AsyncSpec>,
    stale: Option<u64>,
    training_at_once: Option<f64>,
) -> Value {
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
            value["slot_lag"] = json!(spec.slot_lag());
            value["staleness_exponent"] = json!(spec.staleness_exponent);
            value["stale_updates_refused"] = json!(stale);
        }
        None => value["over_selection"] = json!(schedule.over_selection),
    }
    if let Some(at_once) = training_at_once {
        value["training_at_once"] = json!(at_once);
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
fn round_task(
    experiment: &Experiment,
    training: &TrainingArgs,
    n: usize,
    late: usize,
    validated: bool,
) -> TaskSpec {
    let vanishing = late as u32 + ((n - late) as f64 * training.dropout).ceil() as u32;
    let largest = experiment.shards.iter().map(Dataset::len).max().unwrap_or(1);
    simulation_spec(
        n as u32,
        vanishing,
        quantization(training, largest, validated),
        experiment.model.len(),
        training.dp.spec(n as f64 / training.clients as f64),
        training.rounds as u32,
        validated,
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
/// last awaited client finished training. Also returns the clients
/// training at once on average: every selected client's training time
/// (the cut ones train to the end, unaware), over the run's.
pub(crate) fn in_process(
    experiment: &Experiment,
    training: &TrainingArgs,
    per_round: usize,
    secure: bool,
    threads: usize,
    timing: &Timing,
    adversity: &Adversity,
) -> Result<(Vec<RoundRow>, f64)> {
    let layout = experiment.model.layout();
    let mut trained_seconds = 0.0;
    let mut weights = layout.fan_in_init(training.seed());
    let mut rng = ChaCha20Rng::seed_from_u64(training.seed() ^ 0x5e1e_c7ed);
    let n = timing.selected(per_round, training.clients)?;
    // Each group is its own protocol instance over `size` clients.
    let size = adversity.group_size.unwrap_or(n).clamp(2, n);
    let task = match adversity.group_size {
        Some(_) => {
            let late = (n - per_round).min(size.saturating_sub(2));
            round_task(experiment, training, size, late, adversity.validated)
        }
        None => round_task(experiment, training, n, n - per_round, adversity.validated),
    };
    let mut suspects = Suspects::default();
    if task.privacy.is_some() && !secure {
        bail!("differential privacy needs secure aggregation: drop --plain");
    }
    let privacy = TaskPlan::new(task.clone()).map_err(|e| anyhow!("{e}"))?.privacy().copied();
    let progress = Progress::new(training.rounds);
    let mut rows = Vec::new();
    let mut now = 0.0;
    // How many updates each client trained: what its training is seeded with.
    let mut trained = vec![0u64; training.clients];
    // A fitted ring's guide, as the coordinator keeps it.
    let mut spread: Option<SumSpread> = None;
    for round in 1..=training.rounds {
        let started = Instant::now();
        let model_bytes = checkpoint::encode(&layout, &weights, &Default::default())?;
        let global =
            Checkpoint { layout: layout.clone(), weights: weights.clone(), metadata: Default::default() };
        let mut clients: Vec<usize> = (0..training.clients).collect();
        let clients = if adversity.is_none() {
            let (chosen, _) = clients.partial_shuffle(&mut rng, n);
            let mut chosen = chosen.to_vec();
            chosen.sort_unstable();
            chosen
        } else {
            // Seated as the coordinator seats them: excluded clients left
            // out, suspects split across groups.
            clients.shuffle(&mut rng);
            let names: Vec<String> = clients.iter().map(usize::to_string).collect();
            let ordered = suspects.order(names, String::as_str, n.div_ceil(size), size);
            let mut chosen: Vec<usize> = ordered.iter().filter_map(|c| c.parse().ok()).take(n).collect();
            if chosen.len() < n {
                bail!("round {round}: {} clients left to select, {n} wanted", chosen.len());
            }
            chosen.truncate(n);
            chosen
        };
        // The awaited are the first to finish; the round ends with the last of them.
        let mut by_time: Vec<usize> = (0..n).collect();
        by_time.sort_by(|&a, &b| {
            timing.clock.training(clients[a]).total_cmp(&timing.clock.training(clients[b]))
        });
        let (awaited, late) = by_time.split_at(per_round);
        now += awaited.iter().map(|&i| timing.clock.training(clients[i])).fold(0.0, f64::max);
        trained_seconds += clients.iter().map(|&k| timing.clock.training(k)).sum::<f64>();
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
        let aggregate = if adversity.is_none() {
            let task = secure.then_some(&task);
            aggregate(&updates, &dropped, &survivors, task, training.seed() ^ round, spread.as_ref())?
        } else {
            let seed = training.seed() ^ round;
            let run = adversarial_round(
                &updates,
                &clients,
                &dropped,
                &task,
                seed,
                size,
                adversity,
                &mut suspects,
                spread.as_ref(),
            )?;
            if !run.suspects.is_empty() {
                progress.println(&format!(
                    "Round {round}: {} group(s) failed the sum check ({} suspects){}.",
                    run.failed_groups,
                    run.suspects.len(),
                    if run.excluded.is_empty() {
                        String::new()
                    } else {
                        format!("; excluded client(s) {}", run.excluded.join(", "))
                    }
                ));
            }
            run.mean
        };
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
            wrapped: aggregate.fitted.as_ref().map(|fitted| fitted.wrapped),
            ring_scale: aggregate.fitted.as_ref().map(|fitted| fitted.scale),
        };
        if let Some(fitted) = aggregate.fitted {
            spread = fitted.spread;
        }
        progress.row(&row);
        rows.push(row);
    }
    progress.finish();
    if adversity.validated {
        let excluded: BTreeSet<usize> = suspects.excluded().iter().filter_map(|c| c.parse().ok()).collect();
        let honest = excluded.difference(&adversity.cheaters).count();
        println!(
            "Excluded {} of the {} cheating clients, and {honest} honest clients; {} clients still suspected.",
            excluded.intersection(&adversity.cheaters).count(),
            adversity.cheaters.len(),
            suspects.suspected().len()
        );
    }
    Ok((rows, if now > 0.0 { trained_seconds / now } else { 0.0 }))
}

/// What a round of several groups, some with cheaters, produced.
struct AdversarialRound {
    mean: GroupMean,
    failed_groups: usize,
    suspects: Vec<String>,
    excluded: Vec<String>,
}

/// A round of groups of `size` over the `clients` (in seat order; their
/// `updates` alike), the `dropped` positions vanishing after their key
/// shares; each group through the protocol core, its cheaters changing
/// their masked input. A validated group whose sum check fails is left
/// out and feeds `suspects`; the groups' means are combined as the
/// coordinator does (weighted, or by the rule).
#[allow(clippy::too_many_arguments)]
fn adversarial_round(
    updates: &[LocalUpdate],
    clients: &[usize],
    dropped: &[usize],
    task: &TaskSpec,
    seed: u64,
    size: usize,
    adversity: &Adversity,
    suspects: &mut Suspects,
    spread: Option<&SumSpread>,
) -> Result<AdversarialRound> {
    let dimension = updates.first().map_or(0, |u| u.delta.len());
    let mut done: Vec<SecureMean> = Vec::new();
    let (mut failed_groups, mut named, mut excluded) = (0, Vec::new(), Vec::new());
    for (g, start) in (0..clients.len()).step_by(size).enumerate() {
        let end = (start + size).min(clients.len());
        let members = &clients[start..end];
        let group_dropped: Vec<usize> =
            dropped.iter().filter(|&&i| (start..end).contains(&i)).map(|i| i - start).collect();
        let cheaters: Vec<usize> =
            (0..members.len()).filter(|&i| adversity.cheaters.contains(&members[i])).collect();
        let attack = adversity.attack.unwrap_or(Attack::Scaled);
        let group_seed = seed ^ (g as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        match secure_group(
            &updates[start..end],
            &group_dropped,
            task,
            group_seed,
            dimension,
            &cheaters,
            attack,
            spread,
        )? {
            GroupOutcome::Done(mean) => {
                if adversity.validated {
                    let survivors: Vec<String> = (0..members.len())
                        .filter(|i| !group_dropped.contains(i))
                        .map(|i| members[i].to_string())
                        .collect();
                    suspects.passed(&survivors);
                }
                done.push(mean);
            }
            GroupOutcome::Mismatch(contributors) => {
                failed_groups += 1;
                let names: Vec<String> = contributors.iter().map(|&i| members[i].to_string()).collect();
                excluded.extend(suspects.failed(&names));
                named.extend(names);
            }
        }
    }
    if done.is_empty() {
        bail!("every group of the round failed its sum check");
    }
    let total: u64 = done.iter().map(|g| g.weight).sum();
    let kept: Vec<&SecureMean> = match adversity.rule {
        Some(GroupRule::Norm { max }) => {
            done.iter().filter(|g| cohort_server::round::robust::norm(&g.mean) <= f64::from(max)).collect()
        }
        _ => done.iter().collect(),
    };
    if kept.is_empty() {
        bail!("the group rule left every group out");
    }
    let means: Vec<&[f32]> = kept.iter().map(|g| g.mean.as_slice()).collect();
    let mean = match adversity.rule {
        Some(GroupRule::Median) if kept.len() >= 3 => cohort_server::round::robust::coordinate_median(&means),
        Some(GroupRule::TrimmedMean { trim }) if kept.len() >= 3 => {
            cohort_server::round::robust::trimmed_mean(&means, trim)
        }
        _ => {
            let weight: u64 = kept.iter().map(|g| g.weight).sum();
            (0..dimension)
                .map(|j| {
                    let sum: f64 = kept.iter().map(|g| f64::from(g.mean[j]) * g.weight as f64).sum();
                    (sum / weight.max(1) as f64) as f32
                })
                .collect()
        }
    };
    let losses: Vec<f64> = done.iter().filter_map(|g| g.client_loss).collect();
    Ok(AdversarialRound {
        mean: GroupMean {
            mean,
            bytes_up: done.iter().map(|g| g.bytes_up * g.weight as f64).sum::<f64>() / total.max(1) as f64,
            client_loss: (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64),
            masked: done.first().map(|g| g.masked_input_bytes),
            fitted: done.iter().filter_map(|g| g.fitted.clone()).reduce(FittedSum::combine),
        },
        failed_groups,
        suspects: named,
        excluded,
    })
}

/// What one group's aggregation produced.
struct GroupMean {
    mean: Vec<f32>,
    bytes_up: f64,
    client_loss: Option<f64>,
    /// The masked input's size, under secure aggregation.
    masked: Option<usize>,
    /// In a fitted ring: the round's scale, its sums' spread and wraps.
    fitted: Option<FittedSum>,
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
    spread: Option<&SumSpread>,
) -> Result<GroupMean> {
    let dimension = updates.first().map_or(0, |u| u.delta.len());
    if let Some(task) = secure {
        let mut round = secure_mean(updates, dropped, task, seed, dimension, spread)?;
        if round.fitted.as_ref().is_some_and(|fitted| fitted.overflowed) {
            // As the coordinator does: the sum is not used, and the round
            // runs again at the safe scale.
            round = secure_mean(updates, dropped, task, seed, dimension, None)?;
        }
        return Ok(GroupMean {
            mean: round.mean,
            bytes_up: round.bytes_up,
            client_loss: round.client_loss,
            masked: Some(round.masked_input_bytes),
            fitted: round.fitted,
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
    Ok(GroupMean { mean, bytes_up: 4.0 * dimension as f64 + 4.0, client_loss, masked: None, fitted: None })
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
    /// Clients training at once, on average over the run (the finished
    /// trainings' simulated seconds over the run's): above the
    /// concurrency when slow clients train on without a slot.
    pub(crate) training_at_once: f64,
}

/// Buffered asynchronous aggregation in process (FedBuff): `concurrency`
/// clients train at once, each from the model version current when it
/// started; a finished update joins the buffer, and every `buffer_size`
/// of them are one secure-aggregation group whose mean (each update
/// weighted by its client for its staleness, (1 + s)^−a) is applied at
/// once as the next version. A client whose base lags more than the
/// spec's slot lag (⌈C / K⌉ versions) no longer holds a training slot, so
/// a new client starts in its place; its update still counts if it
/// arrives at most `max_staleness` versions stale, and is refused (its
/// client re-bases) otherwise. `training.rounds` versions in all.
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
    let task = round_task(experiment, training, k, 0, false);
    let mut rng = ChaCha20Rng::seed_from_u64(training.seed() ^ 0xa5_7a1e);
    let mut weights = layout.fan_in_init(training.seed());
    let mut bases: BTreeMap<u64, Checkpoint> = BTreeMap::new();
    let mut state = Schedule {
        version: 0,
        now: 0.0,
        jobs: Vec::new(),
        buffer: Vec::new(),
        stale: 0,
        trained_seconds: 0.0,
    };
    let progress = Progress::new(training.rounds);
    let mut rows = Vec::new();
    let mut groups = 0u64;
    let mut spread: Option<SumSpread> = None;
    // How many updates each client trained: what its training is seeded with.
    let mut trained = vec![0u64; training.clients];
    bases.insert(0, checkpoint_of(&layout, &weights));
    state.fill(concurrency, training.clients, clock, &mut rng);
    while state.version < training.rounds {
        let Some(job) = state.next_finished() else { bail!("no client is training: the schedule stalled") };
        state.trained_seconds += clock.training(job.client);
        if !spec.fresh(job.base, state.version) {
            // A stale update is refused; its slot was given away long ago.
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
        let task = secure.then_some(&task);
        let aggregate =
            aggregate(&updates, &dropped, &survivors, task, training.seed() ^ groups, spread.as_ref())?;
        ServerOptimizer::default().step(
            &mut weights,
            &aggregate.mean,
            &mut ServerOptimizer::default().initial_state(layout.len()),
        )?;
        state.version += 1;
        bases.insert(state.version, checkpoint_of(&layout, &weights));
        state.evict(spec);
        state.fill(concurrency, training.clients, clock, &mut rng);
        // The bases of every update that may still be applied.
        let version = state.version;
        let in_use: BTreeSet<u64> = (state.jobs.iter().map(|(job, _)| job).chain(&state.buffer))
            .map(|job| job.base)
            .filter(|&base| spec.fresh(base, version))
            .collect();
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
            wrapped: aggregate.fitted.as_ref().map(|fitted| fitted.wrapped),
            ring_scale: aggregate.fitted.as_ref().map(|fitted| fitted.scale),
        };
        if let Some(fitted) = aggregate.fitted {
            spread = fitted.spread;
        }
        progress.row(&row);
        rows.push(row);
    }
    progress.finish();
    let training_at_once = if state.now > 0.0 { state.trained_seconds / state.now } else { 0.0 };
    Ok(Buffered { rows, stale: state.stale, training_at_once })
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
    /// The simulated seconds of every finished training, refused or not.
    trained_seconds: f64,
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

    /// Frees the slots of clients whose base lags more than the spec's
    /// slot lag: they train on, and their update counts if it is still
    /// fresh when it arrives.
    fn evict(&mut self, spec: &AsyncSpec) {
        for (job, slot) in &mut self.jobs {
            if !spec.holds_slot(job.base, self.version) {
                *slot = false;
            }
        }
    }
}
