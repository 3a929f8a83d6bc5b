//! `cohort bench load`: N concurrent HTTP clients of the client library
//! drive full secure rounds against a real `cohort serve` process on
//! loopback, or against R replicas on one PostgreSQL database behind
//! HAProxy; reports round times, per-stage upload latencies, and each
//! server process's CPU time and peak resident memory.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use cohort_client::participant::{Method, Participant, ParticipantConfig, Request, Response};
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{LocalUpdate, Runner, Trainer, Transport};
use cohort_server::api::auth::new_token;
use cohort_server::spec::TaskSpec;
use cohort_server::store::Backend;
use serde::Serialize;
use serde_json::{Value, json};

use crate::admin::{admin, admin_get};

#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Concurrent clients (all selected every round).
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Coordinates per update.
    #[arg(long, default_value_t = 10_000)]
    dim: usize,
    /// Rounds to run.
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// Clients per secure-aggregation group (default: all of them, one
    /// group, as the numbers in docs/BENCHMARKS.md were measured; a new
    /// task's default is 500).
    #[arg(long)]
    group_size: Option<u32>,
    /// `cohort serve` replicas sharing the database, behind HAProxy.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// The database the servers use: a fresh SQLite file by default; a
    /// PostgreSQL URL (of a fresh database: `createdb -h 127.0.0.1 NAME`)
    /// for replicas, which are then started behind HAProxy, one included.
    #[arg(long)]
    database_url: Option<String>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// How long the clients ask the coordinator to hold a check-in or a
    /// stage-message fetch while the answer is "wait" (the client
    /// library's default; at most 20 000); 0: they poll every 100 ms
    /// instead.
    #[arg(long, default_value_t = cohort_client::participant::DEFAULT_WAIT_MS)]
    wait_ms: u64,
    /// The task's input validation: `l2` (a new task's default: every
    /// client proves its update within an L2 bound, about 0.35 s of one
    /// core and 14 MB per client at 10⁵ coordinates, and the server
    /// verifies the proofs) or `none`.
    #[arg(long, value_enum, default_value_t = Validation::L2)]
    validation: Validation,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// `--validation` of `cohort bench load`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Validation {
    L2,
    None,
}

#[derive(Debug, Serialize)]
struct StageLatency {
    requests: usize,
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(Debug, Serialize)]
struct LoadReport {
    clients: usize,
    /// Clients per secure-aggregation group.
    group_size: u32,
    dim: usize,
    rounds: u32,
    /// What the clients asked the coordinator to hold their waits for.
    wait_ms: u64,
    /// The task's input validation.
    validation: Validation,
    /// Mean wall time of a round, selection to stored checkpoint.
    round_seconds: f64,
    rounds_per_second: f64,
    /// Over every stage upload (request to accepted reply; a post held
    /// for the next stage message until that came).
    p50_ms: f64,
    p99_ms: f64,
    stages: BTreeMap<&'static str, StageLatency>,
    /// The largest of the replicas'.
    server_peak_rss_bytes: u64,
    /// CPU time of the server processes over the whole run (enrollment
    /// included), user and system, all replicas together.
    server_cpu_seconds: f64,
    /// The same per client and round.
    server_cpu_ms_per_client_round: f64,
    /// Each replica's share (one entry for a single server).
    replicas: Vec<ReplicaUsage>,
    /// HAProxy's CPU time, when the replicas are behind it.
    balancer_cpu_seconds: Option<f64>,
    /// PostgreSQL's CPU time over the run (every `postgres` process of
    /// this machine, those that exited included), when the servers use it.
    database_cpu_seconds: Option<f64>,
    /// The rounds after the first (enrollment, the servers' start and the
    /// first round's check-ins left out): what a round costs once clients
    /// are enrolled. `None` for a single round.
    steady: Option<Steady>,
    /// Client requests served, all replicas together (enrollment
    /// included), per client and round.
    client_requests_per_client_round: f64,
    /// Of those, the share that reached a replica which forwarded them to
    /// another (a hop).
    forwarded_share: f64,
    /// The clients' nice value (they share the servers' cores), or `None`
    /// when it could not be lowered.
    clients_nice: Option<i32>,
    survivors: Vec<u64>,
}

/// CPU used from the moment every client finished its first round to the
/// end, per client and round, in milliseconds.
#[derive(Debug, Serialize)]
struct Steady {
    rounds: u32,
    /// The servers, all replicas together.
    server_cpu_ms_per_client_round: f64,
    /// Each replica's, in the order of `replicas`.
    replica_cpu_ms_per_client_round: Vec<f64>,
    balancer_cpu_ms_per_client_round: Option<f64>,
    database_cpu_ms_per_client_round: Option<f64>,
    /// Servers, balancer and database together: everything the service
    /// runs on.
    all_cpu_ms_per_client_round: f64,
}

/// The CPU seconds the service's processes had used at one moment.
#[derive(Debug, Clone)]
struct CpuSample {
    replicas: Vec<f64>,
    balancer: Option<f64>,
    database: Option<f64>,
}

impl CpuSample {
    fn take(replicas: &[u32], balancer: Option<u32>, database: bool) -> Self {
        Self {
            replicas: replicas.iter().map(|&pid| cpu_seconds(pid).unwrap_or(0.0)).collect(),
            balancer: balancer.and_then(cpu_seconds),
            database: database.then(postgres_cpu_seconds).flatten(),
        }
    }
}

/// What one `cohort serve` process used.
#[derive(Debug, Serialize)]
struct ReplicaUsage {
    url: String,
    /// Client requests it served, and those it forwarded to another.
    client_requests: u64,
    forwarded_requests: u64,
    /// Whether it led the task (selected its rounds' clients, handed out
    /// their groups and added the groups' sums).
    leader: bool,
    cpu_seconds: f64,
    cpu_ms_per_client_round: f64,
    peak_rss_bytes: u64,
}

/// The nice value of the client threads.
const CLIENT_NICE: i32 = 19;

/// Upload latencies by stage, shared by the client threads.
type Latencies = Arc<Mutex<BTreeMap<&'static str, Vec<f64>>>>;

/// A transport that times every stage upload.
struct Timed {
    inner: HttpTransport,
    latencies: Latencies,
}

fn stage_of(body: &[u8]) -> &'static str {
    // Messages start with a 2-byte magic, the version and the kind.
    match body.get(3) {
        Some(0x11) => "advertise_keys",
        Some(0x12) => "share_keys",
        Some(0x13) => "masked_input",
        Some(0x14) => "consistency",
        Some(0x15) => "unmasking",
        _ => "other",
    }
}

impl Transport for Timed {
    fn send(&mut self, request: &Request) -> Result<Response, cohort_client::runtime::TransportError> {
        let path = request.path.split('?').next().unwrap_or_default();
        let timed = request.method == Method::Post && path == cohort_client::api::routes::ROUND_MESSAGE;
        let start = Instant::now();
        let response = self.inner.send(request)?;
        // Accepted (`202`), or accepted and answered with the next stage
        // message it asked to be held for (`200`): then the time includes
        // the hold, until the stage closed.
        if timed && matches!(response.status, 200 | 202) {
            let ms = start.elapsed().as_secs_f64() * 1e3;
            if let Ok(mut latencies) = self.latencies.lock() {
                latencies.entry(stage_of(&request.body)).or_default().push(ms);
            }
        }
        Ok(response)
    }
}

/// A fixed pseudo-random update.
struct Synthetic {
    delta: Vec<f32>,
}

impl Trainer for Synthetic {
    fn train(
        &mut self,
        _: cohort_client::runtime::Contribution,
        _: &cohort_client::checkpoint::Checkpoint,
    ) -> Result<LocalUpdate, cohort_client::runtime::UpdateError> {
        Ok(LocalUpdate {
            delta: self.delta.clone(),
            examples: 10,
            metrics: cohort_client::participant::MetricValues::new(),
        })
    }
}

/// A child process (a server or the balancer), killed on drop.
struct ServerProcess(Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Peak resident set of a process (Linux: VmHWM), in bytes.
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// CPU time a process has used, user and system, all its threads (those
/// that exited included), in seconds: fields 14 and 15 of
/// `/proc/PID/stat`, in clock ticks of `USER_HZ`, which Linux fixes at 100
/// in its ABI on every architecture.
fn cpu_seconds(pid: u32) -> Option<f64> {
    parse_cpu_seconds(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_cpu_seconds(stat: &str) -> Option<f64> {
    parse_stat(stat).map(|stat| stat.cpu_seconds)
}

/// The fields of `/proc/PID/stat` this bench reads.
#[derive(Debug, PartialEq)]
struct Stat<'a> {
    command: &'a str,
    parent: u32,
    /// User and system time (fields 14 and 15), in seconds.
    cpu_seconds: f64,
    /// The same of its children that exited and were waited for (16, 17).
    children_cpu_seconds: f64,
}

fn parse_stat(stat: &str) -> Option<Stat<'_>> {
    // The command name (field 2) is in parentheses and may hold spaces.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let field = |field: usize| fields.get(field - 3)?.parse::<u64>().ok();
    Some(Stat {
        command: stat.get(open + 1..close)?,
        parent: u32::try_from(field(4)?).ok()?,
        cpu_seconds: (field(14)? + field(15)?) as f64 / 100.0,
        children_cpu_seconds: (field(16)? + field(17)?) as f64 / 100.0,
    })
}

/// CPU time of PostgreSQL on this machine, in seconds: every `postgres`
/// process's own, and the postmaster's exited children's (backends that
/// ended: a replica's pooled connections come and go).
fn postgres_cpu_seconds() -> Option<f64> {
    let mut total = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let Some(stat) = parse_stat(&text) else { continue };
        if stat.command != "postgres" {
            continue;
        }
        let parent = std::fs::read_to_string(format!("/proc/{}/stat", stat.parent)).unwrap_or_default();
        let postmaster = parse_stat(&parent).is_none_or(|parent| parent.command != "postgres");
        let children = if postmaster { stat.children_cpu_seconds } else { 0.0 };
        *total.get_or_insert(0.0) += stat.cpu_seconds + children;
    }
    total
}

/// The value of the sample `series` (name and labels, as written) in a
/// metrics exposition; 0 when it is absent.
fn counter(exposition: &str, series: &str) -> u64 {
    exposition
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok())
        .map_or(0, |value| value as u64)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn load(args: &LoadArgs) -> Result<()> {
    if args.clients < 3 || args.dim == 0 || args.rounds == 0 {
        bail!("needs at least 3 clients, 1 coordinate and 1 round");
    }
    let work = std::env::temp_dir().join(format!("cohort-load-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let database_url =
        args.database_url.clone().unwrap_or_else(|| format!("sqlite://{}", work.join("load.db").display()));
    let postgres = Backend::of(&database_url) == Some(Backend::Postgres);
    if args.replicas == 0 || (args.replicas > 1 && !postgres) {
        bail!("replicas share one PostgreSQL database: pass --database-url postgres://… (a fresh database)");
    }
    let admin_token = new_token();
    let exe = std::env::current_exe().context("locating the cohort binary")?;
    let free_port = || -> Result<u16> { Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()) };
    // Every client connects from 127.0.0.1: one address standing for many
    // hosts, so no address is held back before the cap. The balancer names
    // each client in a PROXY protocol header, from the address the replicas
    // trust to send one.
    let settings = work.join("serve.json");
    let balancer = format!("{}/32", cohort_server::cluster::balancer::BALANCER_SOURCE);
    std::fs::write(
        &settings,
        json!({ "max_connections_per_address": usize::MAX, "trusted_proxies": [balancer] }).to_string(),
    )?;
    let mut servers = Vec::with_capacity(args.replicas);
    for _ in 0..args.replicas {
        let port = free_port()?;
        let child = Command::new(&exe)
            .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
            .arg("--database-url")
            .arg(&database_url)
            .arg("--config")
            .arg(&settings)
            .env("COHORT_ADMIN_TOKEN", &admin_token)
            // Under this load every request waits for a pooled SQLite
            // connection (the credential lookup); sqlx warns about each one.
            .env("RUST_LOG", "warn,sqlx::pool=error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting cohort serve")?;
        servers.push((format!("http://127.0.0.1:{port}"), ServerProcess(child)));
    }
    // Ready: the process answers /readyz (its database too). One that
    // could not start (a bad URL, say) says why on stderr and exits: no
    // need to wait out the deadline for it.
    let ready = |url: &str, process: &mut ServerProcess| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut transport = HttpTransport::new(url);
        while admin(&mut transport, &admin_token, Method::Get, "/readyz", None).is_err() {
            if let Some(status) = process.0.try_wait()? {
                bail!("{url} exited ({status}) before it was ready");
            }
            if Instant::now() > deadline {
                bail!("{url} was not ready within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    };
    for (url, process) in &mut servers {
        ready(url, process)?;
    }
    // On PostgreSQL the clients reach the replicas through HAProxy, one
    // replica included, so that the numbers of R = 1, 2, 3 compare.
    let balancer = if postgres {
        let port = free_port()?;
        let backends: Vec<u16> =
            servers.iter().filter_map(|(url, _)| url.rsplit(':').next()?.parse().ok()).collect();
        let child =
            cohort_server::cluster::balancer::spawn_haproxy(&work.join("haproxy.cfg"), port, &backends)
                .context("starting HAProxy (scripts/setup.sh installs it)")?;
        let mut balancer = ServerProcess(child);
        let url = format!("http://127.0.0.1:{port}");
        ready(&url, &mut balancer)?;
        Some((url, balancer))
    } else {
        None
    };
    let url = balancer.as_ref().map_or_else(|| servers[0].0.clone(), |(url, _)| url.clone());
    let mut transport = HttpTransport::new(&url);
    // SecAgg+ with derived k and t where they exist (large cohorts); the
    // complete graph with a majority threshold for small ones.
    let group_size = args.group_size.unwrap_or(args.clients as u32);
    let secure_aggregation = if group_size > 200 {
        json!({ "graph": "sparse", "group_size": group_size })
    } else {
        json!({ "graph": "complete", "threshold": group_size / 2 + 1, "group_size": group_size })
    };
    let spec = json!({
        "name": "load",
        "secure_aggregation": secure_aggregation,
        "rounds": args.rounds,
        "clients_per_round": args.clients,
        "model": { "architecture": "synthetic", "layout": { "tensors": [ { "name": "w", "shape": [args.dim] } ] } },
        "deadlines": { "advertise_keys_ms": 300000, "share_keys_ms": 300000, "masked_input_ms": 300000, "unmasking_ms": 300000 },
        "checkpoint_retention": 1,
        "validation": { "norm": args.validation },
    });
    // The clients' policy: the default, lowered only where this task is
    // below it (the majority threshold of a small complete graph).
    let mut task_spec: TaskSpec = serde_json::from_value(spec.clone())?;
    task_spec.secure_aggregation.default_for_new_task();
    let policy = task_spec.accepting_policy().map_err(|e| anyhow!("{e}"))?;
    let created: Value = serde_json::from_slice(&admin(
        &mut transport,
        &admin_token,
        Method::Post,
        "/admin/tasks",
        Some(spec),
    )?)?;
    let task = created["id"].as_str().context("task id")?.to_string();
    // An enrollment token of its own, whose burst admits every client at
    // once (the server's default per-token burst is far smaller).
    let burst = u32::try_from(args.clients).unwrap_or(u32::MAX);
    let bench_token = json!({ "name": "bench", "rate": { "per_minute": 60_000, "burst": burst } });
    let created: Value = serde_json::from_slice(&admin(
        &mut transport,
        &admin_token,
        Method::Post,
        &format!("/admin/tasks/{task}/tokens"),
        Some(bench_token),
    )?)?;
    let token = created["token"].as_str().context("token")?.to_string();
    // The replica that created the task leads it.
    let view: Value = admin_get(&mut transport, &admin_token, &format!("/admin/tasks/{task}"))?;
    let leader = view["leader"].as_str().unwrap_or_default().to_string();

    // The clients share this machine's cores with the servers; in a
    // deployment they are elsewhere. Their threads run at the lowest
    // priority (threads inherit the nice value of the thread that spawns
    // them, and `renice -p` sets the main thread's), so that a thousand
    // busy clients cannot starve a server of the CPU it needs to keep its
    // leases and its deadlines.
    // The service's CPU is sampled again once every client has finished
    // its first round, by a thread started before the clients are niced,
    // so that it is not itself starved of the moment.
    let first_rounds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let replica_pids: Vec<u32> = servers.iter().map(|(_, process)| process.0.id()).collect();
    let balancer_pid = balancer.as_ref().map(|(_, process)| process.0.id());
    let monitor = {
        let (first_rounds, clients, replica_pids) =
            (first_rounds.clone(), args.clients, replica_pids.clone());
        std::thread::spawn(move || -> Option<CpuSample> {
            loop {
                match first_rounds.load(std::sync::atomic::Ordering::SeqCst) {
                    // Every client is past its first round.
                    n if n == clients => return Some(CpuSample::take(&replica_pids, balancer_pid, postgres)),
                    // Some client failed or the run is over: no sample.
                    n if n > clients => return None,
                    _ => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })
    };
    let started_cpu = CpuSample::take(&replica_pids, balancer_pid, postgres);
    let clients_niced = Command::new("renice")
        .args(["-n", &CLIENT_NICE.to_string(), "-p", &std::process::id().to_string()])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !clients_niced {
        eprintln!(
            "cohort bench load: could not lower the clients' priority (renice); they compete with the servers"
        );
    }
    let latencies: Latencies = Arc::default();
    let started = Instant::now();
    let config = ParticipantConfig {
        poll_interval_ms: 100,
        wait_ms: args.wait_ms,
        max_attempts: 20,
        stage_timeout_ms: args.timeout * 1000,
        policy,
        ..ParticipantConfig::default()
    };
    let done = crate::progress::counter(args.clients as u64, "clients done");
    let clients: Vec<_> = (0..args.clients)
        .map(|k| {
            let (url, task, token, latencies) = (url.clone(), task.clone(), token.clone(), latencies.clone());
            let (done, first_rounds) = (done.clone(), first_rounds.clone());
            let delta =
                (0..args.dim).map(|i| (((i * 31 + k * 17) % 1000) as f32 / 1000.0 - 0.5) * 0.2).collect();
            std::thread::Builder::new().stack_size(1 << 20).spawn(move || -> Result<(), String> {
                let transport = Timed { inner: HttpTransport::new(&url), latencies };
                let mut runner = Runner::new(Participant::enroll(&task, &token, config), transport, None);
                let mut trainer = Synthetic { delta };
                let mut first = true;
                while runner.run_round(&mut trainer).map_err(|e| e.to_string())?.is_some() {
                    if std::mem::take(&mut first) {
                        first_rounds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                done.inc(1);
                Ok(())
            })
        })
        .collect::<std::io::Result<_>>()?;
    let mut failures = Vec::new();
    for client in clients {
        match client.join() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => failures.push(error),
            Err(_) => failures.push("a client thread panicked".into()),
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let ended_cpu = CpuSample::take(&replica_pids, balancer_pid, postgres);
    // Past the count: a monitor still waiting gives up.
    first_rounds.fetch_add(args.clients + 1, std::sync::atomic::Ordering::SeqCst);
    let after_first = monitor.join().map_err(|_| anyhow!("the CPU monitor panicked"))?;
    done.finish_and_clear();
    if let Some(first) = failures.first() {
        bail!("{} clients failed; the first: {first}", failures.len());
    }
    let path = format!("/admin/tasks/{task}/rounds");
    let rounds: Vec<Value> = admin_get(&mut transport, &admin_token, &path)?;
    if rounds.len() != args.rounds as usize {
        bail!("{} of {} rounds completed", rounds.len(), args.rounds);
    }
    let per_client_round = |seconds: f64| seconds * 1e3 / (args.clients as f64 * f64::from(args.rounds));
    let replicas: Vec<ReplicaUsage> = servers
        .iter()
        .zip(&ended_cpu.replicas)
        .map(|((url, process), &cpu_seconds)| {
            let scrape = admin(&mut HttpTransport::new(url), &admin_token, Method::Get, "/metrics", None)
                .map(|body| String::from_utf8_lossy(&body).into_owned())
                .unwrap_or_default();
            ReplicaUsage {
                client_requests: counter(&scrape, "cohort_client_requests_total{served=\"here\"}"),
                forwarded_requests: counter(&scrape, "cohort_client_requests_total{served=\"forwarded\"}"),
                leader: *url == leader || servers.len() == 1,
                url: url.clone(),
                cpu_seconds,
                cpu_ms_per_client_round: per_client_round(cpu_seconds),
                peak_rss_bytes: peak_rss(process.0.id()).unwrap_or(0),
            }
        })
        .collect();
    let balancer_cpu_seconds = ended_cpu.balancer;
    let database_cpu_seconds = ended_cpu.database.zip(started_cpu.database).map(|(end, start)| end - start);
    let steady = after_first.filter(|_| args.rounds > 1).map(|mark| {
        let per = |seconds: f64| seconds * 1e3 / (args.clients as f64 * f64::from(args.rounds - 1));
        let used = |end: Option<f64>, start: Option<f64>| end.zip(start).map(|(end, start)| per(end - start));
        let replica: Vec<f64> =
            ended_cpu.replicas.iter().zip(&mark.replicas).map(|(end, start)| per(end - start)).collect();
        let server: f64 = replica.iter().sum();
        let balancer = used(ended_cpu.balancer, mark.balancer);
        let database = used(ended_cpu.database, mark.database);
        Steady {
            rounds: args.rounds - 1,
            server_cpu_ms_per_client_round: server,
            replica_cpu_ms_per_client_round: replica,
            balancer_cpu_ms_per_client_round: balancer,
            database_cpu_ms_per_client_round: database,
            all_cpu_ms_per_client_round: server + balancer.unwrap_or(0.0) + database.unwrap_or(0.0),
        }
    });
    drop(balancer);
    drop(servers);
    let _ = std::fs::remove_dir_all(&work);
    let server_cpu_seconds: f64 = replicas.iter().map(|r| r.cpu_seconds).sum();
    let served: u64 = replicas.iter().map(|r| r.client_requests).sum();
    let forwarded: u64 = replicas.iter().map(|r| r.forwarded_requests).sum();
    let server_peak_rss_bytes = replicas.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0);

    let durations: Vec<f64> = rounds
        .iter()
        .map(|r| {
            (r["finished_at"].as_i64().unwrap_or(0) - r["started_at"].as_i64().unwrap_or(0)) as f64 / 1e3
        })
        .collect();
    let round_seconds = durations.iter().sum::<f64>() / durations.len() as f64;
    let latencies = latencies.lock().map_err(|_| anyhow!("latencies poisoned"))?;
    let mut all: Vec<f64> = latencies.values().flatten().copied().collect();
    all.sort_by(f64::total_cmp);
    let stages = latencies
        .iter()
        .map(|(stage, values)| {
            let mut values = values.clone();
            values.sort_by(f64::total_cmp);
            let summary = StageLatency {
                requests: values.len(),
                p50_ms: percentile(&values, 50.0),
                p99_ms: percentile(&values, 99.0),
            };
            (*stage, summary)
        })
        .collect();
    let report = LoadReport {
        clients: args.clients,
        group_size,
        dim: args.dim,
        rounds: args.rounds,
        wait_ms: args.wait_ms,
        validation: args.validation,
        round_seconds,
        rounds_per_second: f64::from(args.rounds) / elapsed,
        p50_ms: percentile(&all, 50.0),
        p99_ms: percentile(&all, 99.0),
        stages,
        server_peak_rss_bytes,
        server_cpu_seconds,
        server_cpu_ms_per_client_round: per_client_round(server_cpu_seconds),
        replicas,
        balancer_cpu_seconds,
        database_cpu_seconds,
        steady,
        client_requests_per_client_round: served as f64 / (args.clients as f64 * f64::from(args.rounds)),
        forwarded_share: if served == 0 { 0.0 } else { forwarded as f64 / served as f64 },
        clients_nice: clients_niced.then_some(CLIENT_NICE),
        survivors: rounds.iter().map(|r| r["survivors"].as_u64().unwrap_or(0)).collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "cohort bench load: {} clients in groups of {}, {} coordinates, {} rounds, {} replica(s), \
             validation {}, holds of {} ms",
            report.clients,
            report.group_size,
            report.dim,
            report.rounds,
            report.replicas.len(),
            if report.validation == Validation::L2 { "l2" } else { "none" },
            report.wait_ms
        );
        println!(
            "  round time        {:.2} s (mean), {:.3} rounds/s overall",
            report.round_seconds, report.rounds_per_second
        );
        println!("  stage uploads     p50 {:.1} ms, p99 {:.1} ms", report.p50_ms, report.p99_ms);
        for (stage, s) in &report.stages {
            println!(
                "    {stage:<16} p50 {:>8.1} ms  p99 {:>8.1} ms  ({} requests)",
                s.p50_ms, s.p99_ms, s.requests
            );
        }
        println!("  server peak RSS   {:.1} MiB", report.server_peak_rss_bytes as f64 / (1 << 20) as f64);
        println!(
            "  server CPU        {:.2} s ({:.2} ms per client and round)",
            report.server_cpu_seconds, report.server_cpu_ms_per_client_round
        );
        if report.replicas.len() > 1 || report.balancer_cpu_seconds.is_some() {
            for replica in &report.replicas {
                println!(
                    "    {:<22} CPU {:.2} s ({:.2} ms per client and round), peak RSS {:.1} MiB{}",
                    replica.url,
                    replica.cpu_seconds,
                    replica.cpu_ms_per_client_round,
                    replica.peak_rss_bytes as f64 / (1 << 20) as f64,
                    if replica.leader { ", leader" } else { "" }
                );
            }
        }
        println!(
            "  client requests   {:.1} per client and round, {:.1} % forwarded to another replica",
            report.client_requests_per_client_round,
            report.forwarded_share * 100.0
        );
        if let Some(seconds) = report.balancer_cpu_seconds {
            println!("  HAProxy CPU       {seconds:.2} s");
        }
        if let Some(seconds) = report.database_cpu_seconds {
            println!("  PostgreSQL CPU    {seconds:.2} s (every postgres process here)");
        }
        if let Some(steady) = &report.steady {
            let ms = |value: Option<f64>| value.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
            println!(
                "  after round 1     {} round(s), ms of CPU per client and round: servers {:.2} ({}), \
                 HAProxy {}, PostgreSQL {}; all {:.2}",
                steady.rounds,
                steady.server_cpu_ms_per_client_round,
                steady
                    .replica_cpu_ms_per_client_round
                    .iter()
                    .map(|v| format!("{v:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                ms(steady.balancer_cpu_ms_per_client_round),
                ms(steady.database_cpu_ms_per_client_round),
                steady.all_cpu_ms_per_client_round
            );
        }
        println!("  survivors         {:?}", report.survivors);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        // A line of /proc/PID/stat whose command name holds a space and a
        // parenthesis: utime 1234 and stime 56 ticks.
        let stat = "4242 (cohort (x) y) S 1 4242 4242 0 -1 4194304 9 0 0 0 1234 56 0 0 20 0 9 0 77 0 0";
        assert_eq!(parse_cpu_seconds(stat), Some(12.9));
        assert_eq!(parse_cpu_seconds("4242 (cohort) S 1 2"), None);
        let postmaster = "77 (postgres) S 1 77 77 0 -1 4194560 9 0 0 0 300 100 2500 500 20 0 1 0 5 0 0";
        assert_eq!(
            parse_stat(postmaster),
            Some(Stat { command: "postgres", parent: 1, cpu_seconds: 4.0, children_cpu_seconds: 30.0 })
        );
        assert_eq!(parse_cpu_seconds("garbage"), None);
        let exposition = "# TYPE cohort_client_requests counter\n\
                          cohort_client_requests_total{served=\"here\"} 1200\n\
                          cohort_client_requests_total{served=\"forwarded\"} 3\n# EOF\n";
        assert_eq!(counter(exposition, "cohort_client_requests_total{served=\"here\"}"), 1200);
        assert_eq!(counter(exposition, "cohort_client_requests_total{served=\"forwarded\"}"), 3);
        assert_eq!(counter(exposition, "cohort_rounds_started_total"), 0);
        // This process has used some CPU time.
        assert!(cpu_seconds(std::process::id()).is_some_and(|s| s >= 0.0));
    }
}
