//! `cohort bench`: the in-process protocol round (`secagg`) and the HTTP
//! load test against a `cohort serve` process (`load`).

mod load;
mod secagg;

use anyhow::Result;
use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Runs one full secure-aggregation round in process and reports costs.
    Secagg(secagg::SecaggArgs),
    /// Drives N concurrent HTTP clients through secure rounds against a
    /// `cohort serve` process and reports latencies and server memory.
    Load(load::LoadArgs),
}

/// Runs the benchmark `command` asks for.
pub fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Secagg(args) => secagg::secagg(&args),
        BenchCommand::Load(args) => load::load(&args),
    }
}
