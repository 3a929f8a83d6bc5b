//! `cohort`: the Cohort command-line tool.

mod bench;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Cohort: federated learning with secure aggregation.
#[derive(Debug, Parser)]
#[command(name = "cohort", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Runs one full secure-aggregation round in process and reports costs.
    Secagg(bench::SecaggArgs),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(BenchCommand::Secagg(args)) => bench::secagg(&args),
    }
}
