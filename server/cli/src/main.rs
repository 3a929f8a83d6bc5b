//! `cohort`: the Cohort command-line tool, one module per command
//! (`serve`, `demo`, `simulate`, `participate`, `partition`, `layout`, `privacy`, `chart`, `bench`) on top of the
//! coordinator library (`cohort-server`) and the client library
//! (`cohort-client`). The pieces the commands share have modules of their
//! own: the run's flags and experiment (`training`, `experiment`), the
//! in-process secure mean, the per-round table, results and chart, and the
//! admin API client.

mod admin;
mod bench;
mod chart;
mod compare;
mod datasets;
mod demo;
mod experiment;
mod layout;
mod participate;
mod partition;
mod privacy;
mod progress;
mod results;
mod schedule;
mod secure_mean;
mod serve;
mod simulate;
mod training;

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
    Simulate(simulate::SimulateArgs),
    /// Runs the coordinator service.
    Serve(serve::ServeArgs),
    /// Takes part in a task as one client, training on a local data shard.
    Participate(participate::ParticipateArgs),
    /// Splits a dataset among N clients, one shard directory each, for
    /// `participate --shard`.
    Partition(partition::PartitionArgs),
    /// The `model` object of a task spec for a built-in architecture or a
    /// TorchScript module (its named parameters).
    Layout(layout::LayoutArgs),
    /// The privacy accountant: ε of the Poisson-sampled Gaussian mechanism
    /// over rounds, or the noise multiplier for a budget.
    Privacy(privacy::PrivacyArgs),
    /// Several runs' results.json in one chart: accuracy per round, or
    /// final accuracy against the privacy budget.
    Chart(compare::ChartArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(command) => bench::run(command),
        Command::Demo(args) => {
            // The demo's coordinator reports trouble only.
            init_logging("warn");
            demo::demo(&args)
        }
        Command::Simulate(args) => simulate::simulate(&args),
        Command::Participate(args) => participate::participate(&args),
        Command::Partition(args) => partition::run(&args),
        Command::Layout(args) => layout::run(&args),
        Command::Privacy(args) => privacy::run(&args),
        Command::Chart(args) => compare::run(&args),
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
