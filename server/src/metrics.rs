//! Prometheus metrics of the coordinator (`prometheus-client`), exposed in
//! the OpenMetrics text format at `/metrics`. Every value is an aggregate
//! over clients: counts, byte totals, durations and means of the masked
//! sums; nothing about one client.
//!
//! Two registries: the process's (rounds, messages, bytes, stage and
//! upload durations over every task), which anyone who reaches `/metrics`
//! reads, and the tasks' (each series labelled with its `project` and
//! `task`: rounds completed and aborted, survivors, the means of client
//! metrics, the privacy spent), which only the admin token reads whole and
//! a project's key reads for its project ([`Scope`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::round::{ClientMean, StageMetrics as StageRecord};

/// The media type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: String,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum Outcome {
    accepted,
    rejected,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: Outcome,
}

/// What an upload carried.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Upload {
    /// A masked input streamed into the running sum.
    masked_input,
    /// Any other stage message (keys, shares, consistency, unmasking).
    stage_message,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UploadLabel {
    kind: Upload,
}

/// Where a replica served a client's request (one with a credential, or
/// an enrollment).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Served {
    /// Here: this replica leads the task, runs the client's group, or
    /// serves the model.
    here,
    /// Forwarded to the replica that leads the task or runs the group (a
    /// hop that the balancer's affinity saves).
    forwarded,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServedLabel {
    served: Served,
}

/// Where a client credential was looked up.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum LookupSource {
    /// This replica's memory ([`crate::store::CredentialCache`]).
    memory,
    /// The database.
    database,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: LookupSource,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskMetricLabel {
    project: String,
    task: String,
    metric: String,
}

/// A task's series: its project first (what [`Scope::Project`] filters on).
#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct TaskLabel {
    project: String,
    task: String,
}

impl TaskLabel {
    fn new(project: &str, task: &str) -> Self {
        Self { project: project.to_string(), task: task.to_string() }
    }
}

/// What a scrape of `/metrics` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// No credential: the process's series only.
    Public,
    /// The admin token: the process's and every task's.
    All,
    /// A project's key: its tasks' series only.
    Project(&'a str),
}

type FloatGauge = Gauge<f64, AtomicU64>;
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// A stage lasts from milliseconds (keys among clients on loopback) to the
/// deadlines of minutes: 5 ms to about 11 minutes.
fn stage_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

/// An upload takes from a millisecond (a key advertisement) to minutes (a
/// large masked input on a slow link): 1 ms to about 4 minutes.
fn upload_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 19))
}

struct Instruments {
    registry: Registry,
    rounds_started: Counter,
    rounds_completed: Counter,
    rounds_aborted: Counter,
    client_messages: Family<ResultLabel, Counter>,
    bytes_in: Counter,
    bytes_out: Counter,
    selected: Gauge,
    survivors: Gauge,
    stage_seconds: Histograms<StageLabel>,
    stage_dropouts: Family<StageLabel, Counter>,
    upload_seconds: Histograms<UploadLabel>,
    client_requests: Family<ServedLabel, Counter>,
    credential_lookups: Family<SourceLabel, Counter>,
    /// The tasks' series.
    tasks: Registry,
    task_rounds_completed: Family<TaskLabel, Counter>,
    task_rounds_aborted: Family<TaskLabel, Counter>,
    task_survivors: Family<TaskLabel, Gauge>,
    client_means: Family<TaskMetricLabel, FloatGauge>,
    epsilon_spent: Family<TaskLabel, FloatGauge>,
    /// The metrics whose means each task's last round carried, to remove
    /// them when the next does not.
    means_shown: std::sync::Mutex<BTreeMap<TaskLabel, Vec<String>>>,
}

impl Default for Instruments {
    fn default() -> Self {
        let mut instruments = Self {
            registry: Registry::default(),
            rounds_started: Counter::default(),
            rounds_completed: Counter::default(),
            rounds_aborted: Counter::default(),
            client_messages: Family::default(),
            bytes_in: Counter::default(),
            bytes_out: Counter::default(),
            selected: Gauge::default(),
            survivors: Gauge::default(),
            stage_seconds: Family::new_with_constructor(stage_buckets),
            stage_dropouts: Family::default(),
            upload_seconds: Family::new_with_constructor(upload_buckets),
            client_requests: Family::default(),
            credential_lookups: Family::default(),
            tasks: Registry::default(),
            task_rounds_completed: Family::default(),
            task_rounds_aborted: Family::default(),
            task_survivors: Family::default(),
            client_means: Family::default(),
            epsilon_spent: Family::default(),
            means_shown: Default::default(),
        };
        let r = &mut instruments.registry;
        r.register("cohort_rounds_started", "Rounds started", instruments.rounds_started.clone());
        r.register("cohort_rounds_completed", "Rounds completed", instruments.rounds_completed.clone());
        r.register(
            "cohort_rounds_aborted",
            "Rounds aborted or abandoned",
            instruments.rounds_aborted.clone(),
        );
        r.register(
            "cohort_round_selected_clients",
            "Clients selected in the last completed round",
            instruments.selected.clone(),
        );
        r.register(
            "cohort_round_surviving_clients",
            "Clients in the last completed round's aggregate",
            instruments.survivors.clone(),
        );
        r.register("cohort_client_messages", "Client stage messages", instruments.client_messages.clone());
        r.register(
            "cohort_bytes_in",
            "Bytes of client stage messages received",
            instruments.bytes_in.clone(),
        );
        r.register("cohort_bytes_out", "Bytes of server stage messages sent", instruments.bytes_out.clone());
        r.register_with_unit(
            "cohort_stage_duration",
            "Duration of completed rounds' stages",
            Unit::Seconds,
            instruments.stage_seconds.clone(),
        );
        r.register(
            "cohort_stage_dropouts",
            "Eligible clients that did not answer a stage",
            instruments.stage_dropouts.clone(),
        );
        r.register_with_unit(
            "cohort_upload_duration",
            "Time from an accepted upload's arrival to its acceptance (its body read, checked and, for a \
             masked input, added into the running sum)",
            Unit::Seconds,
            instruments.upload_seconds.clone(),
        );
        r.register(
            "cohort_client_requests",
            "Client requests about a task (with a credential, or an enrollment) that reached this replica, by \
             where they were served: here, or forwarded to the replica that leads the task or runs the \
             client's group",
            instruments.client_requests.clone(),
        );
        r.register(
            "cohort_credential_lookups",
            "Client credentials looked up, by where the answer came from: this replica's memory, or the \
             database",
            instruments.credential_lookups.clone(),
        );
        let r = &mut instruments.tasks;
        r.register(
            "cohort_task_rounds_completed",
            "A task's rounds completed by this replica",
            instruments.task_rounds_completed.clone(),
        );
        r.register(
            "cohort_task_rounds_aborted",
            "A task's rounds aborted or abandoned on this replica",
            instruments.task_rounds_aborted.clone(),
        );
        r.register(
            "cohort_task_round_surviving_clients",
            "Clients in a task's last completed round's aggregate",
            instruments.task_survivors.clone(),
        );
        r.register(
            "cohort_round_client_metric_mean",
            "A client metric's mean over a task's last completed round's survivors (from its sum under the \
             masks)",
            instruments.client_means.clone(),
        );
        r.register(
            "cohort_privacy_epsilon_spent",
            "The privacy budget a task under differential privacy has spent (its accountant's epsilon at the \
             task's delta)",
            instruments.epsilon_spent.clone(),
        );
        instruments
    }
}

/// Shared, cheaply cloned metrics registry.
#[derive(Clone, Default)]
pub struct Metrics {
    inner: Arc<Instruments>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A round started.
    pub fn round_started(&self) {
        self.inner.rounds_started.inc();
    }

    /// A round of `project`'s `task` was aborted or abandoned.
    pub fn round_aborted(&self, project: &str, task: &str) {
        self.process_round_aborted();
        self.inner.task_rounds_aborted.get_or_create(&TaskLabel::new(project, task)).inc();
    }

    /// A round was aborted or abandoned, of a task whose project is not
    /// known here any more: counted for the process only.
    pub fn process_round_aborted(&self) {
        self.inner.rounds_aborted.inc();
    }

    /// A round of `project`'s `task` completed.
    pub fn round_completed(
        &self,
        (project, task): (&str, &str),
        selected: i64,
        survivors: i64,
        stages: &[StageRecord],
        means: &BTreeMap<String, ClientMean>,
    ) {
        let m = &self.inner;
        let label = TaskLabel::new(project, task);
        m.rounds_completed.inc();
        m.selected.set(selected);
        m.survivors.set(survivors);
        m.task_rounds_completed.get_or_create(&label).inc();
        m.task_survivors.get_or_create(&label).set(survivors);
        // The task's last round's means only: a metric it did not carry
        // is gone.
        let mut shown = m.means_shown.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for metric in shown.remove(&label).unwrap_or_default() {
            m.client_means.remove(&TaskMetricLabel { project: project.into(), task: task.into(), metric });
        }
        for (metric, mean) in means {
            let series =
                TaskMetricLabel { project: project.into(), task: task.into(), metric: metric.clone() };
            m.client_means.get_or_create(&series).set(mean.mean);
        }
        shown.insert(label, means.keys().cloned().collect());
        drop(shown);
        for stage in stages {
            let label = StageLabel { stage: stage.stage.to_string() };
            m.stage_seconds.get_or_create(&label).observe(stage.duration_ms as f64 / 1e3);
            m.stage_dropouts.get_or_create(&label).inc_by(stage.dropouts as u64);
        }
    }

    /// A task under differential privacy has spent `epsilon` so far.
    pub fn privacy_spent(&self, project: &str, task: &str, epsilon: f64) {
        self.inner.epsilon_spent.get_or_create(&TaskLabel::new(project, task)).set(epsilon);
    }

    /// Removes every series of a deleted task.
    pub fn forget_task(&self, project: &str, task: &str) {
        let m = &self.inner;
        let label = TaskLabel::new(project, task);
        m.task_rounds_completed.remove(&label);
        m.task_rounds_aborted.remove(&label);
        m.task_survivors.remove(&label);
        m.epsilon_spent.remove(&label);
        let shown = m.means_shown.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&label);
        for metric in shown.unwrap_or_default() {
            m.client_means.remove(&TaskMetricLabel { project: project.into(), task: task.into(), metric });
        }
    }

    /// A client message of `size` bytes was accepted or refused.
    pub fn client_message(&self, size: usize, accepted: bool) {
        self.bytes_in(size);
        let result = if accepted { Outcome::accepted } else { Outcome::rejected };
        self.inner.client_messages.get_or_create(&ResultLabel { result }).inc();
    }

    /// `size` bytes of a client message arriving in pieces were read (the
    /// message is counted, accepted or refused, when it ends).
    pub fn bytes_in(&self, size: usize) {
        self.inner.bytes_in.inc_by(size as u64);
    }

    /// `size` bytes were sent to a client.
    pub fn bytes_out(&self, size: usize) {
        self.inner.bytes_out.inc_by(size as u64);
    }

    /// An upload of `kind` was accepted `took` after it arrived.
    pub fn upload(&self, kind: Upload, took: Duration) {
        self.inner.upload_seconds.get_or_create(&UploadLabel { kind }).observe(took.as_secs_f64());
    }

    /// Counts `cache`'s lookups in `cohort_credential_lookups`.
    pub fn count_credential_lookups(&self, cache: &crate::store::CredentialCache) {
        let counter = |source| self.inner.credential_lookups.get_or_create(&SourceLabel { source }).clone();
        cache.count_into(counter(LookupSource::memory), counter(LookupSource::database));
    }

    /// A client's request reached this replica and was `served`.
    pub fn client_request(&self, served: Served) {
        self.inner.client_requests.get_or_create(&ServedLabel { served }).inc();
    }

    /// The OpenMetrics text exposition ([`CONTENT_TYPE`]) of what `scope`
    /// reads.
    pub fn render(&self, scope: Scope<'_>) -> String {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::new();
        // Writing into a String cannot fail.
        match scope {
            Scope::Public => {
                let _ = encode_registry(&mut out, &self.inner.registry);
            }
            Scope::All => {
                let _ = encode_registry(&mut out, &self.inner.registry);
                let _ = encode_registry(&mut out, &self.inner.tasks);
            }
            Scope::Project(project) => {
                let mut tasks = String::new();
                let _ = encode_registry(&mut tasks, &self.inner.tasks);
                // Every task series is labelled `project` first; a project
                // id is `default` or hex, so it needs no escaping.
                let ours = format!("{{project=\"{project}\",");
                for line in tasks.lines().filter(|line| line.starts_with('#') || line.contains(&ours)) {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        let _ = encode_eof(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_in_the_exposition_format() {
        let metrics = Metrics::default();
        metrics.round_started();
        metrics.client_message(100, true);
        metrics.client_message(7, false);
        let stage = StageRecord {
            stage: cohort_crypto::Stage::ShareKeys,
            eligible: 10,
            received: 9,
            dropouts: 1,
            duration_ms: 1500,
        };
        let means = BTreeMap::from([("train_loss".to_string(), ClientMean { mean: 0.5, clients: 9 })]);
        metrics.round_completed(("p1", "t1"), 10, 9, &[stage], &means);
        metrics.upload(Upload::masked_input, Duration::from_millis(3));
        metrics.client_request(Served::here);
        metrics.client_request(Served::here);
        metrics.client_request(Served::forwarded);
        let text = metrics.render(Scope::All);
        assert!(text.contains("cohort_client_requests_total{served=\"here\"} 2\n"), "{text}");
        assert!(text.contains("cohort_client_requests_total{served=\"forwarded\"} 1\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(text.contains("# TYPE cohort_rounds_completed counter\ncohort_rounds_completed_total 1\n"));
        assert!(text.contains("cohort_bytes_in_total 107\n"));
        assert!(text.contains("cohort_client_messages_total{result=\"rejected\"} 1\n"));
        assert!(text.contains("cohort_round_surviving_clients 9\n"));
        assert!(text.contains("# TYPE cohort_stage_duration_seconds histogram\n"), "{text}");
        assert!(text.contains("cohort_stage_duration_seconds_sum{stage=\"share-keys\"} 1.5\n"), "{text}");
        assert!(text.contains("cohort_stage_duration_seconds_count{stage=\"share-keys\"} 1\n"), "{text}");
        // 1.5 s falls in the bucket up to 0.005 · 2⁹ = 2.56 s, not in the one up to 1.28 s.
        assert!(
            text.contains("cohort_stage_duration_seconds_bucket{le=\"1.28\",stage=\"share-keys\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("cohort_stage_duration_seconds_bucket{le=\"2.56\",stage=\"share-keys\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("cohort_upload_duration_seconds_bucket{le=\"0.004\",kind=\"masked_input\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("cohort_upload_duration_seconds_bucket{le=\"0.002\",kind=\"masked_input\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("cohort_stage_dropouts_total{stage=\"share-keys\"} 1\n"));
        assert!(text.contains(
            "cohort_round_client_metric_mean{project=\"p1\",task=\"t1\",metric=\"train_loss\"} 0.5\n"
        ));
        metrics.privacy_spent("p1", "t1", 1.25);
        assert!(
            metrics
                .render(Scope::All)
                .contains("cohort_privacy_epsilon_spent{project=\"p1\",task=\"t1\"} 1.25\n")
        );
        // A later round without the metric no longer shows its mean.
        metrics.round_completed(("p1", "t1"), 10, 10, &[], &BTreeMap::new());
        let text = metrics.render(Scope::All);
        assert!(!text.contains("cohort_round_client_metric_mean{"), "{text}");
        assert!(text.contains("cohort_rounds_completed_total 2\n"), "{text}");
        assert!(
            text.contains("cohort_task_rounds_completed_total{project=\"p1\",task=\"t1\"} 2\n"),
            "{text}"
        );
    }

    #[test]
    fn a_scrape_reads_only_what_its_scope_may() {
        let metrics = Metrics::default();
        let means = BTreeMap::from([("loss".to_string(), ClientMean { mean: 0.25, clients: 4 })]);
        metrics.round_completed(("p1", "a"), 5, 4, &[], &means);
        metrics.round_completed(("p2", "b"), 5, 5, &[], &means);
        metrics.round_aborted("p2", "b");
        // Anyone: the process's series, no task's.
        let public = metrics.render(Scope::Public);
        assert!(public.contains("cohort_rounds_completed_total 2\n"), "{public}");
        assert!(!public.contains("task=") && !public.contains("project="), "{public}");
        assert!(public.ends_with("# EOF\n") && public.matches("# EOF").count() == 1, "{public}");
        // A project: its own tasks' series only.
        let p1 = metrics.render(Scope::Project("p1"));
        assert!(
            p1.contains("cohort_round_client_metric_mean{project=\"p1\",task=\"a\",metric=\"loss\"} 0.25\n"),
            "{p1}"
        );
        assert!(p1.contains("cohort_task_round_surviving_clients{project=\"p1\",task=\"a\"} 4\n"), "{p1}");
        assert!(!p1.contains("p2") && !p1.contains("task=\"b\""), "{p1}");
        assert!(!p1.contains("cohort_bytes_in"), "the process's series are not a project's: {p1}");
        assert!(p1.ends_with("# EOF\n") && p1.matches("# EOF").count() == 1, "{p1}");
        // The admin token: everything.
        let all = metrics.render(Scope::All);
        assert!(all.contains("cohort_task_rounds_aborted_total{project=\"p2\",task=\"b\"} 1\n"), "{all}");
        assert!(all.contains("task=\"a\"") && all.contains("cohort_bytes_in"), "{all}");
        assert_eq!(all.matches("# EOF").count(), 1);
        // A deleted task's series are gone.
        metrics.forget_task("p1", "a");
        assert!(!metrics.render(Scope::All).contains("task=\"a\""));
    }
}
