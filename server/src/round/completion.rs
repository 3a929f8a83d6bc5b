//! The end of a round: each group's final stage unmasked off the runtime,
//! and the groups' sums turned into the next model and its records.

use std::collections::BTreeMap;

use cohort_crypto::{Advanced, Aggregate, ProtocolError, ServerRound};

use super::records::{ClientMean, StageMetrics};
use crate::checkpoint::{self, ModelLayout};
use crate::optimizer::OptimizerState;
use crate::store::{CheckpointRecord, RoundRecord};

/// A group's final stage, to be unmasked off the async runtime.
pub struct PendingUnmask {
    /// Task the round belongs to.
    pub task_id: String,
    /// Round number.
    pub round: u64,
    /// The group of the round (see [`super::TaskEngine::unmasked`]).
    pub group: usize,
    /// The group's session id: unique to its attempt, so that a result
    /// that comes back after its attempt ended is never taken for the
    /// next attempt's group.
    pub session: [u8; 16],
    pub(super) server: ServerRound,
}

impl PendingUnmask {
    /// Reconstructs the secrets and removes the masks (CPU-heavy).
    pub fn run(self) -> Result<Aggregate, ProtocolError> {
        match self.server.advance()? {
            Advanced::Done(aggregate) => Ok(aggregate),
            Advanced::Next(_) => Err(ProtocolError::Finished),
        }
    }
}

/// A computed round, to persist before the engine adopts it (see
/// [`Persist::Model`](super::Persist::Model)).
#[derive(Debug, Clone)]
pub struct Completion {
    /// The round record.
    pub round: RoundRecord,
    /// The new checkpoint.
    pub checkpoint: CheckpointRecord,
    pub(super) weights: Vec<f32>,
    pub(super) optimizer_state: OptimizerState,
    pub(super) stages: Vec<StageMetrics>,
    pub(super) faulty_shares: Vec<(String, String)>,
    pub(super) client_means: BTreeMap<String, ClientMean>,
    /// A fitted ring's spread of this model's sums (the widest of its
    /// groups', at the largest group's size).
    pub(super) spread: Option<cohort_crypto::SumSpread>,
}

impl Completion {
    /// The means of the clients' metrics.
    pub fn client_means(&self) -> &BTreeMap<String, ClientMean> {
        &self.client_means
    }

    /// The round's per-stage records.
    pub fn stages(&self) -> &[StageMetrics] {
        &self.stages
    }

    /// Revealed shares that did not match their owner's commitment and were
    /// corrected without: (owner, holder) client ids.
    pub fn faulty_shares(&self) -> &[(String, String)] {
        &self.faulty_shares
    }
}

impl core::fmt::Debug for PendingUnmask {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PendingUnmask")
            .field("task_id", &self.task_id)
            .field("round", &self.round)
            .field("group", &self.group)
            .finish()
    }
}

pub(super) fn encode_model(
    task_id: &str,
    layout: &ModelLayout,
    weights: &[f32],
    round: u64,
) -> Result<Vec<u8>, crate::checkpoint::CheckpointError> {
    let metadata = BTreeMap::from([
        ("cohort.task".to_string(), task_id.to_string()),
        ("cohort.round".to_string(), round.to_string()),
    ]);
    checkpoint::encode(layout, weights, &metadata)
}
