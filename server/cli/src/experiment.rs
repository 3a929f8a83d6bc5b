//! Federated experiments: a dataset split among simulated clients, each
//! with the built-in trainer. `cohort demo` (client processes over HTTP)
//! and `cohort simulate` (in process) share this, so that both train the
//! same clients the same way: client `k` trains with the seed
//! `seed ⊕ k·φ` mixed with the round number.

use std::path::PathBuf;

use cohort_client::checkpoint::Checkpoint;
use cohort_client::data::Dataset;

use crate::datasets::{DatasetError, load_dataset};
use cohort_client::model::Model;
use cohort_client::partition::{PartitionError, Scheme, partition, summary};
use cohort_client::runtime::{LocalTrainer, LocalUpdate, UpdateError, local_update};
use cohort_client::train::TrainConfig;

/// What an experiment trains on and how.
#[derive(Debug, Clone, PartialEq)]
pub struct ExperimentSetup {
    /// `fashion-mnist` or `mnist`.
    pub dataset: String,
    /// Where the dataset lives (default: its usual place).
    pub data_dir: Option<PathBuf>,
    /// How the training set is split.
    pub partition: Scheme,
    /// Clients.
    pub clients: usize,
    /// `logreg`, `2nn` or `cnn`.
    pub model: String,
    /// Local training.
    pub train: TrainConfig,
    /// Seed of the partition and of local training.
    pub seed: u64,
}

/// Why an experiment cannot start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExperimentError {
    /// The dataset could not be loaded.
    #[error(transparent)]
    Data(#[from] DatasetError),
    /// The dataset could not be split.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// The model does not exist or does not fit the data.
    #[error("unknown model {0:?} for this dataset (expected logreg, 2nn or cnn)")]
    Model(String),
}

/// An experiment ready to run.
#[derive(Debug, Clone)]
pub struct Experiment {
    /// The model.
    pub model: Model,
    /// Each client's local data.
    pub shards: Vec<Dataset>,
    /// The held-out test set.
    pub test: Dataset,
    /// The label histogram of every client, printable.
    pub summary: String,
    setup: ExperimentSetup,
}

impl Experiment {
    /// Loads and splits the data.
    pub fn prepare(setup: &ExperimentSetup) -> Result<Self, ExperimentError> {
        let (train, test) = load_dataset(&setup.dataset, setup.data_dir.as_deref())?;
        let model = Model::by_name(&setup.model, train.features.ncols(), train.classes)
            .ok_or_else(|| ExperimentError::Model(setup.model.clone()))?;
        let parts = partition(&train.labels, train.classes, setup.clients, setup.partition, setup.seed)?;
        let summary = summary(&train.labels, &parts, train.classes);
        let shards = parts.iter().map(|indices| train.subset(indices)).collect();
        Ok(Self { model, shards, test, summary, setup: setup.clone() })
    }

    /// Client `k`'s update, trained on its shard from `global`; `nonce`
    /// counts the updates it trained before, as a deployed client's counts
    /// the masked inputs it built ([`Contribution::nonce`]), so that a
    /// simulation draws what the same clients over HTTP draw.
    ///
    /// [`Contribution::nonce`]: cohort_client::runtime::Contribution::nonce
    fn update(&self, k: usize, nonce: u64, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        let config = client_config(&self.setup.train, self.setup.seed, k);
        local_update(&self.model, &self.shards[k], &config, nonce, global)
    }

    /// Trains the `selected` clients (each with its nonce) from `global`,
    /// on up to `threads` threads; returns their updates in the order given.
    pub fn local_updates(
        &self,
        global: &Checkpoint,
        selected: &[(usize, u64)],
        threads: usize,
    ) -> Vec<Result<LocalUpdate, UpdateError>> {
        let jobs: Vec<(usize, u64, &Checkpoint)> =
            selected.iter().map(|&(k, nonce)| (k, nonce, global)).collect();
        self.local_updates_from(&jobs, threads)
    }

    /// Trains each client `k` of `jobs` (with its nonce) from its own base
    /// model, on up to `threads` threads; returns the updates in the order
    /// given.
    pub fn local_updates_from(
        &self,
        jobs: &[(usize, u64, &Checkpoint)],
        threads: usize,
    ) -> Vec<Result<LocalUpdate, UpdateError>> {
        let chunk = jobs.len().div_ceil(threads.clamp(1, jobs.len().max(1))).max(1);
        let mut results: Vec<Option<Result<LocalUpdate, UpdateError>>> = jobs.iter().map(|_| None).collect();
        std::thread::scope(|scope| {
            for (chunk, out) in jobs.chunks(chunk).zip(results.chunks_mut(chunk)) {
                scope.spawn(move || {
                    for (&(k, nonce, base), slot) in chunk.iter().zip(out) {
                        *slot = Some(self.update(k, nonce, base));
                    }
                });
            }
        });
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(UpdateError::Application("not trained".into()))))
            .collect()
    }
}

/// The trainer of client `k` of an experiment seeded with `seed`.
pub fn client_trainer(
    model: &Model,
    data: Dataset,
    train: &TrainConfig,
    seed: u64,
    k: usize,
) -> LocalTrainer {
    LocalTrainer { model: model.clone(), data, config: client_config(train, seed, k) }
}

/// Client `k`'s local training settings: its own seed.
pub(crate) fn client_config(train: &TrainConfig, seed: u64, k: usize) -> TrainConfig {
    TrainConfig { seed: seed ^ (k as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15), ..*train }
}
