//! What a run leaves behind: one row per round, printed and written to
//! `results.json`, and the accuracy chart.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::chart::{Panel, Scale, Series, write_panels};
use crate::training::{CompressionArgs, TrainingArgs};

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
    /// In a fitted ring, the coordinates of the round's sums that wrapped
    /// (`simulate`, which holds every input, alone can count them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) wrapped: Option<u64>,
    /// In a fitted ring, the round's scale (steps per unit of the weighted
    /// sum; the lowest of its groups').
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ring_scale: Option<f64>,
}

/// Writes results.json (with `extra` in its config: `privacy`, the noise
/// and budget of a run under differential privacy; `schedule`, the
/// simulated clock's) and the chart; `validated`: the run proved its
/// inputs (so kept the exact ring).
pub(crate) fn write_results(
    out: &Path,
    mode: &str,
    training: &TrainingArgs,
    rows: &[RoundRow],
    extra: Map<String, Value>,
    validated: bool,
) -> Result<()> {
    // Compression applies to secure aggregation without DP (whose plan,
    // under `privacy`, sets its own clip, rotation and ring).
    let compression = (mode == "secure" && training.dp.spec(1.0).is_none()).then_some(&training.compression);
    let ring = compression.and_then(|c| c.ring(training.clients as u32, validated));
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
            "bits": ring.map(|(_, bits)| bits),
            "ring": ring.map(|(ring, _)| ring),
            "rotate": compression.map(CompressionArgs::rotate),
            "clip": compression.map(|c| decimal(c.clip())),
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
    let title = format!(
        "{} {}, {} clients, {} aggregation",
        training.dataset, training.model, training.clients, mode
    );
    write_panels(&png_path, &title, &panels(rows))?;
    if let Some(last) = rows.last() {
        println!("Final test accuracy {:.2}% after {} rounds.", last.accuracy * 100.0, last.round);
        if let Some(epsilon) = last.epsilon {
            println!("Privacy spent: ε = {epsilon:.3} at δ = {}.", results["config"]["privacy"]["delta"]);
        }
    }
    println!("Wrote {} and {}", json_path.display(), png_path.display());
    Ok(())
}

/// The run's chart: the global model's test accuracy and loss per round,
/// the clients' mean training loss where measured, ε spent under
/// differential privacy, and accuracy against simulated time where the
/// run has a clock.
fn panels(rows: &[RoundRow]) -> Vec<Panel<'static>> {
    let per_round = |value: fn(&RoundRow) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter().filter_map(|r| Some((r.round as f64, value(r)?))).collect()
    };
    let mut panels = vec![Panel {
        title: "Global model on the held-out test set",
        x_label: "round",
        y_label: "test accuracy",
        scale: Scale::Percent,
        series: vec![Series {
            label: "test accuracy after the round",
            points: per_round(|r| Some(r.accuracy)),
        }],
    }];
    let mut losses =
        vec![Series { label: "test loss of the global model", points: per_round(|r| Some(r.loss)) }];
    let client_loss = per_round(|r| r.client_loss);
    if !client_loss.is_empty() {
        losses
            .push(Series { label: "clients' mean training loss (from the masked sum)", points: client_loss });
    }
    panels.push(Panel {
        title: "Loss",
        x_label: "round",
        y_label: "loss",
        scale: Scale::FromZero,
        series: losses,
    });
    let epsilon = per_round(|r| r.epsilon);
    if !epsilon.is_empty() {
        panels.push(Panel {
            title: "Privacy spent",
            x_label: "round",
            y_label: "ε",
            scale: Scale::FromZero,
            series: vec![Series { label: "ε spent up to the round", points: epsilon }],
        });
    }
    let timed: Vec<(f64, f64)> = rows.iter().filter_map(|r| Some((r.sim_seconds?, r.accuracy))).collect();
    if !timed.is_empty() {
        panels.push(Panel {
            title: "Test accuracy against simulated time",
            x_label: "simulated seconds",
            y_label: "test accuracy",
            scale: Scale::Percent,
            series: vec![Series { label: "test accuracy when the model existed", points: timed }],
        });
    }
    panels
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
