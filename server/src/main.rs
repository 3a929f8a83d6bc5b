//! `cohort`: the Cohort command-line tool.

mod bench;
mod serve;

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
    /// Runs the coordinator service.
    Serve(serve::ServeArgs),
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
        Command::Serve(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init();
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            runtime.block_on(serve::serve(args))
        }
    }
}
