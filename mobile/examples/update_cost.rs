//! One native participant through `MobileClient` (the core the JVM, C and
//! Python clients share) that hands in a fixed pseudo-random update, and
//! prints a JSON line per round with what the round cost this process: the
//! native side of `python/bench/update_cost.py`, which runs the same
//! measurement from Python.
//!
//! ```text
//! update_cost URL TASK TOKEN STATE_DIR POLICY_JSON
//! ```

use std::path::PathBuf;
use std::time::Instant;

use cohort_client::checkpoint::Checkpoint;
use cohort_client::participant::MetricValues;
use cohort_client::runtime::{Contribution, LocalUpdate, Trainer, UpdateError};
use cohort_mobile::{Config, MobileClient, Outcome};

/// CPU time of this process (all threads), user and system, in seconds:
/// fields 14 and 15 of `/proc/self/stat`, in ticks of 1/100 s.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    // After the name, field 3 (the state) comes first: field k is at k - 3.
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |field: usize| fields.get(field - 3).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (ticks(14) + ticks(15)) as f64 / 100.0
}

/// The application's side: the update of `python/bench/update_cost.py`
/// (local weights = global + delta, a fixed delta).
struct Fixed {
    delta: Vec<f32>,
    handed_at: Option<(Instant, f64)>,
}

impl Trainer for Fixed {
    fn train(&mut self, _: Contribution, model: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        self.handed_at = Some((Instant::now(), cpu_seconds()));
        if model.weights.len() != self.delta.len() {
            return Err(UpdateError::LayoutMismatch);
        }
        Ok(LocalUpdate { delta: self.delta.clone(), examples: 10, metrics: MetricValues::new() })
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, task, token, state, policy] = args.as_slice() else {
        return Err("usage: update_cost URL TASK TOKEN STATE_DIR POLICY_JSON".into());
    };
    let client = MobileClient::open(Config {
        server_url: url.clone(),
        task_id: task.clone(),
        enrollment_token: token.clone(),
        storage_dir: PathBuf::from(state),
        ca_certificate_pem: None,
        policy_json: Some(policy.clone()),
        max_attempts: None,
    })?;
    let mut trainer = Fixed { delta: Vec::new(), handed_at: None };
    loop {
        let (start, start_cpu) = (Instant::now(), cpu_seconds());
        if trainer.delta.is_empty() {
            // Sized on the first model: one more round trip than needed,
            // outside any measured round.
            let size = std::env::var("UPDATE_COST_DIM")?.parse::<usize>()?;
            trainer.delta = (0..size).map(|i| ((i % 97) as f32 - 48.0) * 1e-4).collect();
        }
        let result = client.participate(Some(&mut trainer))?;
        if result.outcome == Outcome::TaskFinished {
            return Ok(());
        }
        let (end, end_cpu) = (Instant::now(), cpu_seconds());
        let (handed, handed_cpu) = trainer.handed_at.take().unwrap_or((start, start_cpu));
        println!(
            "{{\"round\": {}, \"outcome\": \"{:?}\", \"round_cpu_s\": {:.2}, \"after_handoff_cpu_s\": {:.2}, \"after_handoff_wall_s\": {:.3}}}",
            result.round,
            result.outcome,
            end_cpu - start_cpu,
            end_cpu - handed_cpu,
            (end - handed).as_secs_f64()
        );
    }
}
