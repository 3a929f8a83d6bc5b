//! `cohort demo`: a coordinator on a temporary SQLite database and N
//! `cohort participate` processes that talk to it over HTTP on loopback;
//! reports every round. With `--plain` it runs the same clients with
//! plaintext FedAvg in process instead, for comparison.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use cohort_client::checkpoint;
use cohort_client::data::Dataset;
use cohort_client::model::Model;
use cohort_client::participant::Method;
use cohort_client::runtime::http::HttpTransport;
use cohort_crypto::config::active_threshold_holds;
use cohort_server::api::auth::new_token;
use cohort_server::optimizer::ServerOptimizer;
use cohort_server::service::{Service, ServiceConfig};
use cohort_server::spec::{
    AsyncSpec, GraphChoice, NormChoice, SecAggSpec, TaskMode, TaskPlan, TaskSpec, ValidationSpec,
    VariantChoice,
};
use serde_json::Value;

use crate::admin::{admin, admin_get};
use crate::datasets::write_shard;
use crate::experiment::Experiment;
use crate::progress::Progress;
use crate::results::{RoundRow, write_results};
use crate::schedule::{Clock, ScheduleArgs};
use crate::simulate::{Timing, in_process, privacy_json, schedule_json, threads};
use crate::training::{TrainingArgs, announce_updates, evaluate, prepare, quantization, threshold};

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
    /// Input validation: every client proves its update within the task's
    /// L2 bound (`l2`, the coordinator's default for an active task; not
    /// with differential privacy), or nothing is checked (`none`).
    #[arg(long, value_enum, default_value_t = DemoValidation::L2)]
    validation: DemoValidation,
    /// Clients selected per round (default: every client; with
    /// `--malicious`, the honest ones, rounded down to even).
    #[arg(long)]
    per_round: Option<u32>,
    /// Clients per secure-aggregation group, each its own protocol
    /// instance with its own threshold (default: one group; with
    /// `--malicious`, half of a round).
    #[arg(long)]
    group_size: Option<u32>,
    /// The task's schedule (`--mode async` with `--concurrency` and
    /// `--buffer-size`, or sync rounds with `--over-selection`) and, with
    /// `--speed` or `--stragglers`, each client's pace: client k takes at
    /// least its simulated training time (as in `cohort simulate`, times
    /// `--time-scale`) over each update. Each row's `sim_seconds` is then
    /// the wall time since the task was created, over the time scale.
    #[command(flatten)]
    schedule: ScheduleArgs,
    /// Wall seconds per simulated second of training, with `--speed` or
    /// `--stragglers`.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// How many of the clients cheat (a build with the `adversary`
    /// feature): they prove their honest update and mask another. The task
    /// then selects the others' number per round (rounded down to even), in
    /// two secure-aggregation groups, so that a round goes on when one
    /// group's sum check fails and the cheaters can be isolated.
    #[cfg(feature = "adversary")]
    #[arg(long, default_value_t = 0)]
    malicious: usize,
    /// What the cheating clients add to their masked input: `scaled` (half
    /// the ring on every coordinate, the largest shift of the sum) or
    /// `random`.
    #[cfg(feature = "adversary")]
    #[arg(long, default_value = "scaled")]
    attack: cohort_client::participant::adversary::Attack,
}

/// The cheating clients of a demo: how many (the last ones) and their
/// attack, with the round's selection and group size.
#[derive(Debug, Clone, Copy)]
struct Cheating {
    count: usize,
    per_round: Option<u32>,
    group_size: Option<u32>,
    #[cfg(feature = "adversary")]
    attack: cohort_client::participant::adversary::Attack,
}

impl Cheating {
    fn of(args: &DemoArgs) -> Self {
        let (per_round, group_size) = (args.per_round, args.group_size);
        #[cfg(feature = "adversary")]
        return Cheating {
            count: args.malicious.min(args.training.clients),
            per_round,
            group_size,
            attack: args.attack,
        };
        #[cfg(not(feature = "adversary"))]
        Cheating { count: 0, per_round, group_size }
    }

    /// The task's selection per round and its group size, as asked; by
    /// default every client in one group, or, with cheaters, two groups of
    /// half the honest clients each.
    fn selection(self, clients: usize) -> (u32, Option<u32>) {
        let honest = (clients - self.count) as u32;
        let per_round = self.per_round.unwrap_or(if self.count == 0 { honest } else { honest / 2 * 2 });
        let group_size = self.group_size.or((self.count > 0).then_some(per_round / 2));
        (per_round.clamp(1, clients as u32), group_size.filter(|&size| size < per_round))
    }

    /// The `cohort participate` arguments of client `k` of `clients`.
    fn args(self, k: usize, clients: usize) -> Vec<String> {
        #[cfg(feature = "adversary")]
        if k >= clients - self.count {
            return vec!["--attack".into(), self.attack.name().into()];
        }
        let _ = (k, clients);
        Vec::new()
    }

    fn is_cheater(self, k: usize, clients: usize) -> bool {
        k >= clients - self.count
    }
}

/// The demo task's input validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DemoValidation {
    /// Every update proven within an L2 bound.
    L2,
    /// No validation.
    None,
}

/// How the demo's task schedules its clients, and how fast each trains.
struct DemoSchedule {
    asynchronous: Option<AsyncSpec>,
    over_selection: f64,
    /// Each client's least seconds per update, when paced.
    paces: Option<Vec<f64>>,
    time_scale: f64,
}

impl DemoSchedule {
    fn of(args: &DemoArgs, experiment: &Experiment) -> Result<Self> {
        let asynchronous = args.schedule.async_spec(args.training.clients)?;
        if !(args.time_scale.is_finite() && args.time_scale > 0.0 && args.time_scale <= 100.0) {
            bail!("--time-scale must be above 0 and at most 100");
        }
        let paced = args.schedule.speed.is_some() || args.schedule.stragglers.is_some();
        if args.plain && (paced || asynchronous.is_some() || args.schedule.over_selection != 0.0) {
            bail!(
                "--plain runs every client in process: the schedule flags are for the coordinator over HTTP \
                 (cohort simulate schedules clients in process)"
            );
        }
        if asynchronous.is_some() && (args.per_round.is_some() || args.group_size.is_some()) {
            bail!("an async task's groups are its buffers: --buffer-size, not --per-round or --group-size");
        }
        let paces = paced.then(|| {
            let sizes: Vec<usize> = experiment.shards.iter().map(Dataset::len).collect();
            let clock = Clock::new(&args.schedule, &sizes, args.training.local.epochs, args.training.seed());
            (0..sizes.len()).map(|k| clock.training(k) * args.time_scale).collect()
        });
        Ok(Self {
            asynchronous,
            over_selection: args.schedule.over_selection,
            paces,
            time_scale: args.time_scale,
        })
    }
}

pub fn demo(args: &DemoArgs) -> Result<()> {
    let experiment = prepare(&args.training)?;
    let schedule = DemoSchedule::of(args, &experiment)?;
    announce_updates(&args.training, !args.plain, validates(args.validation, &args.training));
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let (rows, privacy) = if args.plain {
        println!("Plaintext FedAvg in process (baseline), {} rounds:", args.training.rounds);
        let sizes: Vec<usize> = experiment.shards.iter().map(Dataset::len).collect();
        let timing =
            Timing { clock: Clock::uniform(&sizes, args.training.local.epochs), over_selection: 0.0 };
        (
            in_process(
                &experiment,
                &args.training,
                args.training.clients,
                false,
                threads(),
                &timing,
                &Default::default(),
            )?
            .0,
            None,
        )
    } else {
        secure_over_http(&experiment, &args.training, args.validation, Cheating::of(args), &schedule)?
    };
    let mode = if args.plain { "plain" } else { "secure" };
    let mut config = serde_json::Map::new();
    if !args.plain {
        let validated = validates(args.validation, &args.training);
        config.insert("validation".into(), Value::from(if validated { "l2" } else { "none" }));
        let mut recorded = schedule_json(&args.schedule, schedule.asynchronous.as_ref(), None, None);
        if schedule.paces.is_some() {
            recorded["time_scale"] = Value::from(schedule.time_scale);
        }
        config.insert("schedule".into(), recorded);
        let cheating = Cheating::of(args);
        if cheating.count > 0 {
            config.insert("malicious".into(), Value::from(cheating.count));
            #[cfg(feature = "adversary")]
            config.insert("attack".into(), Value::from(cheating.attack.name()));
        }
    }
    if let Some(privacy) = privacy {
        config.insert("privacy".into(), privacy);
    }
    write_results(&args.out, mode, &args.training, &rows, config, validates(args.validation, &args.training))
}

/// Whether the demo's task validates its inputs: as asked, and under
/// differential privacy only with the Skellam mechanism (whose noise is
/// split over verified edges; the discrete Gaussian's parts do not add up
/// exactly, so a run with it goes without validation, and says so).
fn validates(validation: DemoValidation, training: &TrainingArgs) -> bool {
    validation == DemoValidation::L2
        && training.dp.spec(1.0).is_none_or(|dp| dp.mechanism == cohort_crypto::dp::Mechanism::Skellam)
}

/// The task the demo's coordinator runs.
fn demo_spec(
    training: &TrainingArgs,
    model: &Model,
    largest_shard: usize,
    validation: DemoValidation,
    cheating: Cheating,
    schedule: &DemoSchedule,
) -> Result<TaskSpec> {
    let (per_round, group_size) = match &schedule.asynchronous {
        Some(_) if cheating.count > 0 => {
            bail!("cheating clients are isolated across sync rounds: drop --mode async")
        }
        // Each buffer is the task's one group.
        Some(buffered) => (buffered.buffer_size, None),
        None => cheating.selection(training.clients),
    };
    // Each group is its own protocol instance, with its own threshold; an
    // over-selected round's group holds every selected client.
    let selected = (f64::from(per_round) * (1.0 + schedule.over_selection)).ceil() as u32;
    if selected as usize > training.clients {
        bail!(
            "{per_round} clients a round with {} over-selection select {selected}, more than the {} clients: \
             pass a smaller --per-round",
            schedule.over_selection,
            training.clients
        );
    }
    let n = group_size.unwrap_or(selected);
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
        clients_per_round: per_round,
        over_selection: schedule.over_selection,
        secure_aggregation: SecAggSpec {
            // The active variant needs a threshold above half of the n
            // holders of a seed's shares; a dropout rate that leaves fewer survivors than
            // that runs semi-honest (the demo's coordinator is this process).
            variant: Some(if active_threshold_holds(threshold, n - 1) {
                VariantChoice::Active
            } else {
                VariantChoice::SemiHonest
            }),
            graph: GraphChoice::Complete,
            threshold: Some(threshold),
            group_size,
            ..SecAggSpec::default()
        },
        quantization: quantization(training, largest_shard, validates(validation, training)),
        deadlines: cohort_server::spec::StageDeadlines {
            // Local training happens before the keys are advertised.
            advertise_keys_ms: 600_000,
            share_keys_ms: 60_000,
            // Waits for the vanished clients' inputs that never come.
            masked_input_ms: if training.dropout > 0.0 { 3_000 } else { 60_000 },
            unmasking_ms: 60_000,
            ..Default::default()
        },
        optimizer: ServerOptimizer::default(),
        checkpoint_retention: training.rounds as u32 + 1,
        client_metrics: Default::default(),
        // Every client takes part in every round: no amplification.
        privacy: training.dp.spec(1.0),
        mode: if schedule.asynchronous.is_some() { TaskMode::Async } else { TaskMode::Sync },
        asynchronous: schedule.asynchronous,
        // Not with differential privacy, which it does not combine with yet.
        validation: Some(ValidationSpec {
            norm: if validates(validation, training) { NormChoice::L2 } else { NormChoice::None },
            l2_clip: None,
            group_rule: None,
        }),
    };
    spec.validate().map_err(|e| anyhow!("{e}"))?;
    Ok(spec)
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

/// The demo proper: a coordinator and N client processes over loopback.
fn secure_over_http(
    experiment: &Experiment,
    training: &TrainingArgs,
    validation: DemoValidation,
    cheating: Cheating,
    schedule: &DemoSchedule,
) -> Result<(Vec<RoundRow>, Option<Value>)> {
    let work = std::env::temp_dir().join(format!("cohort-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let result = run_coordinator_and_clients(experiment, training, &work, validation, cheating, schedule);
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
    validation: DemoValidation,
    cheating: Cheating,
    schedule: &DemoSchedule,
) -> Result<(Vec<RoundRow>, Option<Value>)> {
    for (k, shard) in experiment.shards.iter().enumerate() {
        write_shard(&work.join(format!("shard-{k}")), shard)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let admin_token = new_token();
    let database = work.join("cohort.db");
    let defaults = ServiceConfig::new(
        ([127, 0, 0, 1], 0).into(),
        format!("sqlite://{}", database.display()),
        &admin_token,
    );
    let service = runtime.block_on(Service::start(ServiceConfig {
        credential_ttl_ms: 86_400_000,
        // Every client is a local process: one address standing for many
        // hosts, so none is held back before the cap.
        connections: cohort_server::api::listener::ConnectionLimits {
            max_connections_per_address: usize::MAX,
            ..defaults.connections
        },
        ..defaults
    }))?;
    let url = service.url();
    let largest = experiment.shards.iter().map(Dataset::len).max().unwrap_or(1);
    let spec = demo_spec(training, &experiment.model, largest, validation, cheating, schedule)?;
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
    match spec.validation_clip() {
        Some(clip) => {
            println!("Input validation: every update is proven, in zero knowledge, within L2 norm {clip}.")
        }
        None => println!("No input validation."),
    }
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
            .args(cheating.args(k, training.clients))
            .args(
                schedule
                    .paces
                    .as_ref()
                    .map(|paces| ["--pace".to_string(), format!("{:.3}", paces[k])])
                    .into_iter()
                    .flatten(),
            )
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
    if cheating.count > 0 {
        println!(
            "The last {} of them cheat: each proves its honest update and masks another.",
            cheating.count
        );
    }
    match &schedule.asynchronous {
        Some(buffered) => println!(
            "Async (FedBuff): {} training slots, every {} finished updates are one group and one model \
             version; updates at most {} versions stale count, and a slow client gives up its slot after {}.",
            buffered.concurrency,
            buffered.buffer_size,
            buffered.max_staleness,
            buffered.slot_lag()
        ),
        None if spec.selected_per_round() != spec.clients_per_round => println!(
            "Rounds select {} clients in groups of {} and go on without the slowest once {} have trained.",
            spec.selected_per_round(),
            spec.groups().size,
            spec.clients_per_round
        ),
        None if spec.clients_per_round as usize != training.clients
            || spec.secure_aggregation.group_size.is_some() =>
        {
            println!(
                "Rounds select {} clients in groups of {}.",
                spec.clients_per_round,
                spec.secure_aggregation.group_size.unwrap_or(spec.clients_per_round)
            )
        }
        None => {}
    }
    if let Some(paces) = &schedule.paces {
        let mut sorted = paces.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "Each client takes at least its simulated training time over an update: median {:.1} s, slowest {:.1} s.",
            sorted[sorted.len() / 2],
            sorted[sorted.len() - 1]
        );
    }
    let mut created_at = None::<i64>;

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
        // The task before its rounds: a task seen final has stored all of them.
        let view: Value = admin_get(&mut transport, &admin_token, &format!("/admin/tasks/{task}"))?;
        let rounds: Vec<Value> =
            admin_get(&mut transport, &admin_token, &format!("/admin/tasks/{task}/rounds"))?;
        if last_finished.is_none() {
            last_finished = view["created_at"].as_i64();
            created_at = last_finished;
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
                sim_seconds: schedule
                    .paces
                    .as_ref()
                    .map(|_| (finished - created_at.unwrap_or(finished)) as f64 / 1e3 / schedule.time_scale),
                bytes_up_per_client: metrics["bytes_up_per_client"].as_f64().unwrap_or_default(),
                bytes_down_per_client: metrics["bytes_down_per_client"].as_f64().unwrap_or_default()
                    + previous_model.len() as f64,
                survivors: record["survivors"].as_u64().unwrap_or_default(),
                compression_ratio: metrics["compression_ratio"].as_f64().unwrap_or_default(),
                masked_input_ratio: None,
                epsilon: metrics["epsilon"].as_f64(),
                staleness: metrics["buffer"]["staleness_histogram"]
                    .as_array()
                    .map(|counts| counts.iter().filter_map(Value::as_u64).collect()),
                wrapped: None,
                ring_scale: metrics["ring_scale"].as_f64(),
            };
            progress.row(&row);
            let named = |field: &str| -> Vec<String> {
                metrics[field]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            };
            let (suspects, excluded) = (named("suspects"), named("excluded"));
            if !suspects.is_empty() {
                progress.println(&format!(
                    "Round {round}: a group's sum did not match its members' commitments and was left out \
                     ({} suspects){}.",
                    suspects.len(),
                    if excluded.is_empty() {
                        String::new()
                    } else {
                        format!("; excluded {}", excluded.join(", "))
                    }
                ));
            }
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
        if view["status"].as_str() == Some("budget_spent") && rounds.len() <= rows.len() {
            progress.finish();
            println!(
                "The privacy budget is spent: the coordinator stopped the task after {} rounds.",
                rows.len()
            );
            break;
        }
        for (k, child) in clients.0.iter_mut().enumerate() {
            if let Some(status) = child.try_wait()? {
                // A cheater ends when the coordinator excludes it.
                if !status.success() && !cheating.is_cheater(k, training.clients) {
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
    let plan = TaskPlan::new(spec.clone()).map_err(|e| anyhow!("{e}"))?;
    let privacy = match (&spec.privacy, plan.privacy()) {
        (Some(asked), Some(plan)) => Some(privacy_json(asked, plan)?),
        _ => None,
    };
    Ok((rows, privacy))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cheating(count: usize, per_round: Option<u32>, group_size: Option<u32>) -> Cheating {
        Cheating {
            count,
            per_round,
            group_size,
            #[cfg(feature = "adversary")]
            attack: cohort_client::participant::adversary::Attack::Scaled,
        }
    }

    #[test]
    fn rounds_select_every_client_or_two_groups_of_the_honest_ones() {
        assert_eq!(cheating(0, None, None).selection(10), (10, None));
        // One cheater of ten: two groups of four, so that a round goes on
        // when one group's sum check fails, and nine clients fill it once
        // the cheater is excluded.
        assert_eq!(cheating(1, None, None).selection(10), (8, Some(4)));
        assert_eq!(cheating(2, None, None).selection(10), (8, Some(4)));
        // The honest baseline of the same rounds, as asked.
        assert_eq!(cheating(0, Some(8), Some(4)).selection(10), (8, Some(4)));
        // A group as large as the round is one group.
        assert_eq!(cheating(0, Some(8), Some(8)).selection(10), (8, None));
        assert_eq!(cheating(0, Some(40), None).selection(10), (10, None));
        assert!(!cheating(1, None, None).is_cheater(8, 10));
        assert!(cheating(1, None, None).is_cheater(9, 10));
    }
}
