//! What a run leaves behind: one row per round, printed and written to
//! `results.json`, and the accuracy chart.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::chart::{Series, write_accuracy_chart};
use crate::training::TrainingArgs;

/// One row of the per-round table and of results.json.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RoundRow {
    pub(crate) round: u64,
    pub(crate) accuracy: f64,
    pub(crate) loss: f64,
    /// The clients' mean training loss, from its sum under the masks.
    pub(crate) client_loss: Option<f64>,
    pub(crate) seconds: f64,
    /// The simulated time at which this round's model existed (`simulate`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) sim_seconds: Option<f64>,
    pub(crate) bytes_up_per_client: f64,
    pub(crate) bytes_down_per_client: f64,
    pub(crate) survivors: u64,
    /// Upload per client over the float32 update's size.
    pub(crate) compression_ratio: f64,
    /// The masked input alone (bit-packed, without key shares) over the
    /// float32 update's size, where measured (`simulate`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) masked_input_ratio: Option<f64>,
    /// Under differential privacy, ε spent up to and including this round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) epsilon: Option<f64>,
    /// Async: how many of the applied buffer's updates were 0, 1, 2, …
    /// versions stale.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) staleness: Option<Vec<u64>>,
}

/// Writes results.json (with `extra` in its config: `privacy`, the noise
/// and budget of a run under differential privacy; `schedule`, the
/// simulated clock's) and the chart.
pub(crate) fn write_results(
    out: &Path,
    mode: &str,
    training: &TrainingArgs,
    rows: &[RoundRow],
    extra: Map<String, Value>,
) -> Result<()> {
    let mut results = json!({
        "config": {
            "aggregation": mode,
            "dataset": training.dataset,
            "partition": training.partition.to_string(),
            "model": training.model,
            "clients": training.clients,
            "rounds": training.rounds,
            "epochs": training.local.epochs,
            "batch_size": training.local.batch_size,
            "lr": decimal(training.local.lr),
            "momentum": decimal(training.local.momentum),
            "prox_mu": decimal(training.local.prox_mu),
            "dropout": training.dropout,
            "bits": training.bits,
            "rotate": training.rotate,
            "clip": decimal(training.clip),
            "seed": training.seed(),
        },
        "rounds": rows,
    });
    for (key, value) in extra {
        results["config"][key] = value;
    }
    let json_path = out.join("results.json");
    std::fs::write(&json_path, serde_json::to_vec_pretty(&results)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let png_path = out.join("accuracy.png");
    let points = rows.iter().map(|r| (r.round as f64, r.accuracy)).collect();
    let title = format!("{} {} - TEST ACCURACY", training.dataset, training.model);
    write_accuracy_chart(&png_path, &title, &[Series { label: mode, points }])?;
    if let Some(last) = rows.last() {
        println!("Final test accuracy {:.2}% after {} rounds.", last.accuracy * 100.0, last.round);
        if let Some(epsilon) = last.epsilon {
            println!("Privacy spent: ε = {epsilon:.3} at δ = {}.", results["config"]["privacy"]["delta"]);
        }
    }
    println!("Wrote {} and {}", json_path.display(), png_path.display());
    Ok(())
}

/// An `f32` flag as the user wrote it (0.05, not 0.05000000074505806):
/// its shortest decimal form, read as the JSON number.
fn decimal(value: f32) -> f64 {
    value.to_string().parse().unwrap_or(f64::from(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_recorded_as_written() {
        assert_eq!(json!(decimal(0.05)).to_string(), "0.05");
        assert_eq!(json!(decimal(1.0)).to_string(), "1.0");
        assert_eq!(json!(decimal(3e-4)).to_string(), "0.0003");
    }
}
