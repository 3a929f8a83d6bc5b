//! Prometheus metrics of the coordinator, rendered in the text exposition
//! format at `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use crate::round::{ClientMean, StageMetrics as StageRecord};

#[derive(Default)]
struct Counters {
    rounds_started: u64,
    rounds_completed: u64,
    rounds_aborted: u64,
    client_messages_accepted: u64,
    client_messages_rejected: u64,
    bytes_in: u64,
    bytes_out: u64,
    last_selected: i64,
    last_survivors: i64,
    /// stage → (sum of durations in seconds, count)
    stage_seconds: BTreeMap<String, (f64, u64)>,
    /// stage → eligible clients that did not answer
    stage_dropouts: BTreeMap<String, u64>,
    /// metric → its mean over the last completed round's survivors
    client_means: BTreeMap<String, f64>,
    /// task → ε spent, for tasks under differential privacy
    epsilon_spent: BTreeMap<String, f64>,
}

/// Shared, cheaply cloned metrics registry.
#[derive(Clone, Default)]
pub struct Metrics {
    inner: Arc<Mutex<Counters>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Counters)) {
        if let Ok(mut counters) = self.inner.lock() {
            f(&mut counters);
        }
    }

    /// A round started.
    pub fn round_started(&self) {
        self.with(|c| c.rounds_started += 1);
    }

    /// A round was aborted or abandoned.
    pub fn round_aborted(&self) {
        self.with(|c| c.rounds_aborted += 1);
    }

    /// A round completed.
    pub fn round_completed(
        &self,
        selected: i64,
        survivors: i64,
        stages: &[StageRecord],
        means: &BTreeMap<String, ClientMean>,
    ) {
        self.with(|c| {
            c.rounds_completed += 1;
            c.last_selected = selected;
            c.last_survivors = survivors;
            c.client_means = means.iter().map(|(metric, mean)| (metric.clone(), mean.mean)).collect();
            for stage in stages {
                let entry = c.stage_seconds.entry(stage.stage.to_string()).or_default();
                entry.0 += stage.duration_ms as f64 / 1e3;
                entry.1 += 1;
                *c.stage_dropouts.entry(stage.stage.to_string()).or_default() += stage.dropouts as u64;
            }
        });
    }

    /// A task under differential privacy has spent `epsilon` so far.
    pub fn privacy_spent(&self, task: &str, epsilon: f64) {
        self.with(|c| {
            c.epsilon_spent.insert(task.to_string(), epsilon);
        });
    }

    /// A client message of `size` bytes was accepted or refused.
    pub fn client_message(&self, size: usize, accepted: bool) {
        self.with(|c| {
            c.bytes_in += size as u64;
            if accepted {
                c.client_messages_accepted += 1;
            } else {
                c.client_messages_rejected += 1;
            }
        });
    }

    /// `size` bytes of a client message arriving in pieces were read (the
    /// message is counted, accepted or refused, when it ends).
    pub fn bytes_in(&self, size: usize) {
        self.with(|c| c.bytes_in += size as u64);
    }

    /// `size` bytes were sent to a client.
    pub fn bytes_out(&self, size: usize) {
        self.with(|c| c.bytes_out += size as u64);
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let Ok(c) = self.inner.lock() else { return out };
        let plain: [(&str, &str, &str, String); 7] = [
            ("cohort_rounds_started_total", "counter", "Rounds started.", c.rounds_started.to_string()),
            ("cohort_rounds_completed_total", "counter", "Rounds completed.", c.rounds_completed.to_string()),
            (
                "cohort_rounds_aborted_total",
                "counter",
                "Rounds aborted or abandoned.",
                c.rounds_aborted.to_string(),
            ),
            (
                "cohort_round_selected_clients",
                "gauge",
                "Clients selected in the last completed round.",
                c.last_selected.to_string(),
            ),
            (
                "cohort_round_surviving_clients",
                "gauge",
                "Clients in the last completed round's aggregate.",
                c.last_survivors.to_string(),
            ),
            (
                "cohort_bytes_in_total",
                "counter",
                "Bytes of client stage messages received.",
                c.bytes_in.to_string(),
            ),
            (
                "cohort_bytes_out_total",
                "counter",
                "Bytes of server stage messages sent.",
                c.bytes_out.to_string(),
            ),
        ];
        for (name, kind, help, value) in plain {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_client_messages_total Client stage messages.\n# TYPE cohort_client_messages_total counter\n\
             cohort_client_messages_total{{result=\"accepted\"}} {}\ncohort_client_messages_total{{result=\"rejected\"}} {}",
            c.client_messages_accepted, c.client_messages_rejected
        );
        let _ = writeln!(
            out,
            "# HELP cohort_stage_duration_seconds Duration of completed rounds' stages.\n# TYPE cohort_stage_duration_seconds summary"
        );
        for (stage, (sum, count)) in &c.stage_seconds {
            let _ = writeln!(out, "cohort_stage_duration_seconds_sum{{stage=\"{stage}\"}} {sum}");
            let _ = writeln!(out, "cohort_stage_duration_seconds_count{{stage=\"{stage}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_stage_dropouts_total Eligible clients that did not answer a stage.\n# TYPE cohort_stage_dropouts_total counter"
        );
        for (stage, dropouts) in &c.stage_dropouts {
            let _ = writeln!(out, "cohort_stage_dropouts_total{{stage=\"{stage}\"}} {dropouts}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_round_client_metric_mean A client metric's mean over the last completed round's survivors (from its sum under the masks).\n# TYPE cohort_round_client_metric_mean gauge"
        );
        for (metric, mean) in &c.client_means {
            let _ = writeln!(out, "cohort_round_client_metric_mean{{metric=\"{metric}\"}} {mean}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_privacy_epsilon_spent The privacy budget a task under differential privacy has spent (its accountant's epsilon at the task's delta).\n# TYPE cohort_privacy_epsilon_spent gauge"
        );
        for (task, epsilon) in &c.epsilon_spent {
            let _ = writeln!(out, "cohort_privacy_epsilon_spent{{task=\"{task}\"}} {epsilon}");
        }
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
        metrics.round_completed(10, 9, &[stage], &means);
        let text = metrics.render();
        assert!(text.contains("cohort_rounds_completed_total 1\n"));
        assert!(text.contains("cohort_bytes_in_total 107\n"));
        assert!(text.contains("cohort_client_messages_total{result=\"rejected\"} 1\n"));
        assert!(text.contains("cohort_round_surviving_clients 9\n"));
        assert!(text.contains("cohort_stage_duration_seconds_sum{stage=\"share-keys\"} 1.5\n"));
        assert!(text.contains("cohort_stage_dropouts_total{stage=\"share-keys\"} 1\n"));
        assert!(text.contains("cohort_round_client_metric_mean{metric=\"train_loss\"} 0.5\n"));
        metrics.privacy_spent("t1", 1.25);
        assert!(metrics.render().contains("cohort_privacy_epsilon_spent{task=\"t1\"} 1.25\n"));
    }
}
