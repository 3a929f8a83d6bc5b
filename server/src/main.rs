//! `cohort`: the Cohort command-line tool.

mod bench;
mod demo;
mod load;
mod plot;
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
    /// A full federated training with secure aggregation: a coordinator on
    /// a temporary SQLite database and client processes over loopback HTTP.
    Demo(demo::DemoArgs),
    /// The same training in process, with many clients and no HTTP.
    Simulate(demo::SimulateArgs),
    /// Runs the coordinator service.
    Serve(serve::ServeArgs),
    /// Takes part in a task as one client, training on a local data shard.
    Participate(demo::ParticipateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Runs one full secure-aggregation round in process and reports costs.
    Secagg(bench::SecaggArgs),
    /// Drives N concurrent HTTP clients through secure rounds against a
    /// `cohort serve` process and reports latencies and server memory.
    Load(load::LoadArgs),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(BenchCommand::Secagg(args)) => bench::secagg(&args),
        Command::Bench(BenchCommand::Load(args)) => load::load(&args),
        Command::Demo(args) => {
            // The demo's coordinator reports trouble only.
            init_logging("warn");
            demo::demo(&args)
        }
        Command::Simulate(args) => demo::simulate(&args),
        Command::Participate(args) => demo::participate(&args),
        Command::Serve(args) => {
            init_logging("info");
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let result = runtime.block_on(serve::serve(args));
            // An unmasking job still running must not hold up the exit.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            result
        }
    }
}

/// Logs to stderr at `default` level unless RUST_LOG says otherwise;
/// colours only on a terminal.
fn init_logging(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
