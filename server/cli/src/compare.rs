//! `cohort chart`: several runs' results.json in one PNG, to compare them:
//! their accuracy per round or against simulated time, or their final
//! accuracy against the privacy budget each was trained under.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde_json::Value;

use crate::chart::{Series, write_chart};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Axis {
    /// Each run's test accuracy per round.
    Round,
    /// Each run's final test accuracy against its budget ε; runs without
    /// differential privacy are drawn as a level line.
    Epsilon,
    /// Each run's test accuracy against simulated time (`simulate`'s
    /// clock), to compare schedules.
    SimSeconds,
}

#[derive(Debug, Args)]
pub struct ChartArgs {
    /// results.json files written by `demo` or `simulate`.
    #[arg(required = true)]
    results: Vec<PathBuf>,
    /// What the x axis shows.
    #[arg(long, value_enum, default_value = "round")]
    x: Axis,
    /// The chart's title.
    #[arg(long, default_value = "Test accuracy")]
    title: String,
    /// The PNG to write.
    #[arg(long)]
    out: PathBuf,
}

/// A run: its label, ε budget (none without DP), accuracy per round and
/// against simulated time (where it has a clock).
struct Run {
    label: String,
    budget: Option<f64>,
    accuracy: Vec<(f64, f64)>,
    timed: Vec<(f64, f64)>,
}

fn load(path: &PathBuf) -> Result<Run> {
    let results: Value =
        serde_json::from_slice(&std::fs::read(path).with_context(|| format!("reading {}", path.display()))?)
            .with_context(|| format!("{} is not JSON", path.display()))?;
    let rounds = results["rounds"].as_array().with_context(|| format!("{} has no rounds", path.display()))?;
    let accuracy = rounds
        .iter()
        .filter_map(|r| Some((r["round"].as_f64()?, r["accuracy"].as_f64()?)))
        .collect::<Vec<_>>();
    if accuracy.is_empty() {
        bail!("{} has no round with an accuracy", path.display());
    }
    let timed =
        rounds.iter().filter_map(|r| Some((r["sim_seconds"].as_f64()?, r["accuracy"].as_f64()?))).collect();
    let budget = results["config"]["privacy"]["epsilon_budget"].as_f64();
    let schedule = &results["config"]["schedule"];
    let label = match (budget, schedule["mode"].as_str()) {
        (Some(epsilon), _) => format!("ε = {epsilon}"),
        (None, Some("async")) => format!(
            "async, {} slots, buffers of {}",
            schedule["concurrency"].as_u64().unwrap_or(0),
            schedule["buffer_size"].as_u64().unwrap_or(0)
        ),
        (None, Some(_)) if schedule["over_selection"].as_f64().is_some_and(|f| f > 0.0) => {
            format!("sync, {:.0}% over-selection", schedule["over_selection"].as_f64().unwrap_or(0.0) * 100.0)
        }
        (None, _) => format!("no DP ({})", results["config"]["aggregation"].as_str().unwrap_or("run")),
    };
    // A demo's paced clients against the coordinator, not the simulator.
    let label = match schedule["time_scale"].as_f64() {
        Some(_) => format!("{label}, coordinator"),
        None => label,
    };
    Ok(Run { label, budget, accuracy, timed })
}

pub fn run(args: &ChartArgs) -> Result<()> {
    let runs = args.results.iter().map(load).collect::<Result<Vec<_>>>()?;
    let series: Vec<Series<'_>> = match args.x {
        Axis::Round => {
            runs.iter().map(|run| Series { label: &run.label, points: run.accuracy.clone() }).collect()
        }
        Axis::Epsilon => {
            let last = |run: &Run| run.accuracy.last().map_or(0.0, |p| p.1);
            let mut private: Vec<(f64, f64)> =
                runs.iter().filter_map(|run| Some((run.budget?, last(run)))).collect();
            if private.is_empty() {
                bail!("--x epsilon needs runs under differential privacy");
            }
            private.sort_by(|a, b| a.0.total_cmp(&b.0));
            let top = private.iter().map(|p| p.0).fold(0.0, f64::max);
            let mut series = vec![Series { label: "final accuracy under DP", points: private }];
            series.extend(
                runs.iter().filter(|run| run.budget.is_none()).map(|run| Series {
                    label: &run.label,
                    points: vec![(0.0, last(run)), (top, last(run))],
                }),
            );
            series
        }
        Axis::SimSeconds => {
            if let Some(run) = runs.iter().find(|run| run.timed.is_empty()) {
                bail!("--x sim-seconds needs runs of `cohort simulate` (the {} run has no clock)", run.label);
            }
            runs.iter().map(|run| Series { label: &run.label, points: run.timed.clone() }).collect()
        }
    };
    let x_label = match args.x {
        Axis::Round => "round",
        Axis::Epsilon => "privacy budget ε",
        Axis::SimSeconds => "simulated seconds",
    };
    write_chart(&args.out, &args.title, x_label, series)?;
    println!("Wrote {}", args.out.display());
    Ok(())
}
