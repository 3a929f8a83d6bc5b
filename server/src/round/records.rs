//! What the engine tells the outside: a client's check-in and poll
//! answers, its refusals, and the round's records (per stage, per round,
//! in progress) for storage and the admin API; counts, times and traffic
//! only, nothing about any one client.

use std::collections::BTreeMap;

use cohort_crypto::{ProtocolError, Stage};
use serde::{Deserialize, Serialize};

use crate::store::TaskStatus;

/// What a client is told when it checks in (the client API's contract).
pub use cohort_client::api::CheckIn;

/// Why a task could not be loaded or created, or a round not turned into
/// the next model: the task's specification ([`TaskError::Spec`]), or a
/// fault of stored data or of the coordinator, never of a client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TaskError {
    /// The task's specification is invalid.
    #[error("invalid task: {0}")]
    Spec(#[from] crate::spec::SpecError),
    /// A checkpoint could not be encoded or decoded.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// The newest checkpoint has another model layout than the spec.
    #[error("the checkpoint does not match the task's model layout")]
    LayoutMismatch,
    /// Stored JSON (spec, optimizer state, round metrics) could not be read
    /// or written.
    #[error("stored JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The operating system's randomness failed.
    #[error("randomness: {0}")]
    Randomness(#[from] getrandom::Error),
    /// The completed round is not the one in progress.
    #[error("round {0} is not in progress")]
    NoSuchRound(u64),
    /// The round could not be unmasked.
    #[error("unmasking: {0}")]
    Protocol(#[from] ProtocolError),
    /// The unmasked sum could not be decoded.
    #[error("decoding the sum: {0}")]
    Quantize(#[from] cohort_crypto::quantize::QuantizeError),
    /// The server optimizer refused the step.
    #[error("optimizer: {0}")]
    Optimizer(#[from] crate::optimizer::OptimizerError),
    /// A group run by another replica could not be built from its
    /// assignment, or its stored report does not fit the round.
    #[error("every group's mean is longer than the task's group rule allows")]
    AllGroupsRejected,

    /// A completed group's report from another replica does not fit.
    #[error("group of another replica: {0}")]
    GroupReport(&'static str),
}

/// What a selected client should do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// Act on this encoded server message.
    Message(Vec<u8>),
    /// Nothing new yet: the stage is still collecting.
    Wait,
    /// The client is no longer part of the round (it missed a stage, or
    /// the round ended or was aborted).
    Dropped,
}

/// Why a client request was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The client is not in the round in progress.
    #[error("this client is not part of the round in progress")]
    NotSelected,
    /// The attempt the client was in failed; why, in words.
    #[error("{0}")]
    Failed(String),
    /// The task is not running rounds.
    #[error("the task is {}", .0.as_str())]
    Inactive(TaskStatus),
    /// The message was refused by the protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The client took no part in this round, or the round is too old or
    /// not known (reports are taken only for recent rounds).
    #[error("this client is not part of round {0}, or the round is not recent")]
    NotInRound(u64),
    /// The task takes clients' metrics only in aggregate.
    #[error("this task takes clients' metrics only in aggregate, inside the masked inputs")]
    PlaintextMetricsOff,
    /// The client's group is run by the replica at this URL (the request
    /// reached this one before its routes caught up; a retry finds it).
    #[error("this client's group is run by another replica")]
    Elsewhere(String),
    /// A masked input's bytes could not be kept where a retraction could
    /// read them back (a temporary file): it was refused, and the client
    /// may send it again.
    #[error("the server could not keep this message's bytes; send it again")]
    Spool,
    /// The participant was excluded from the task (see
    /// [`super::suspects`]).
    #[error(
        "this participant was excluded from the task: every group it was in failed its sum check until it \
         was the one suspect left (its masked input was not the vector it committed to)"
    )]
    Excluded,
}

/// How an attempt of a round ended without a new model.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
    strum::IntoStaticStr,
    strum::EnumString,
    strum::EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum AttemptOutcome {
    /// Too few clients: no group of the attempt completed; the round is
    /// retried with a fresh selection.
    Aborted,
    /// Groups completed but the next model could not be computed or
    /// stored; the round is retried.
    Abandoned,
}

impl AttemptOutcome {
    /// The outcome's name, as stored and shown.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// An attempt of a round that did not complete: where it stopped and why
/// (counts and times only, nothing about any one client).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FailedAttempt {
    /// Round number (an async task: the group's number).
    pub round: u64,
    /// Attempt of that round.
    pub attempt: u32,
    /// Aborted or abandoned.
    pub outcome: AttemptOutcome,
    /// The stage it stopped in.
    pub stage: Stage,
    /// Why, in words: answers against the threshold, clients that left,
    /// whether the deadline passed.
    pub reason: String,
    /// Clients selected.
    pub selected: usize,
    /// When it started (Unix ms).
    pub started_at: i64,
    /// When it ended (Unix ms).
    pub ended_at: i64,
    /// Its closed stages.
    pub stages: Vec<StageMetrics>,
}

/// One stage's record in the round metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StageMetrics {
    /// The stage.
    pub stage: Stage,
    /// Clients allowed to send.
    pub eligible: usize,
    /// Clients that sent.
    pub received: usize,
    /// Eligible clients that did not send.
    pub dropouts: usize,
    /// How long the stage lasted.
    pub duration_ms: i64,
}

/// Metrics of one round, stored with it as JSON (a field a record stored
/// before it existed reads as its default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(default)]
pub struct RoundMetrics {
    /// Attempt number of this round (1 unless earlier attempts were aborted).
    pub attempt: u32,
    /// Neighbours per client.
    pub degree: u32,
    /// Threshold.
    pub threshold: u32,
    /// Per-stage records.
    pub stages: Vec<StageMetrics>,
    /// Bytes received from clients, per selected client.
    pub bytes_up_per_client: f64,
    /// Bytes sent to clients, per selected client.
    pub bytes_down_per_client: f64,
    /// Σ of the survivors' example counts.
    pub total_examples: u64,
    /// L2 norm of the mean update.
    pub update_norm: f64,
    /// Bits of the ring the masked inputs lived in.
    pub modulus_bits: u8,
    /// A fitted ring's scale (steps per unit of the weighted sum; the
    /// lowest of the round's groups'): the sum wrapped where it strayed
    /// beyond ±2^(b−1)/scale. Absent in the exact ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring_scale: Option<f64>,
    /// Groups whose sum, in a fitted ring, wrapped throughout (a scale that
    /// overshot) and was left out; when every group's did, the round kept
    /// the model as it was and the next runs at the safe scale.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overflowed_groups: u32,
    /// Upload per selected client over the float32 update's size.
    pub compression_ratio: f64,
    /// Revealed shares that did not match their owner's commitment; the
    /// round was unmasked without them.
    #[serde(default)]
    pub faulty_shares: u32,
    /// Participants left out of the round because their input's norm proof
    /// did not verify (a task with `validation`): named, since the proof
    /// was theirs to make.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_inputs: Vec<String>,
    /// Groups whose means the task's group rule left out of the round's
    /// sum (`validation.group_rule`: a mean longer than its `max`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rejected_groups: u32,
    /// Members of the round's groups whose unmasked sum did not open their
    /// members' commitments (a validated task): each group's sum was
    /// withheld, and one of them masked another vector than it committed
    /// to. Later rounds split them up until the cheater is alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspects: Vec<String>,
    /// Participants this round isolated as cheaters: excluded from every
    /// later round of the task.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded: Vec<String>,
    /// Per metric, its mean over the survivors that reported it, from the
    /// sum under the masks: never one client's value.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub client_means: BTreeMap<String, ClientMean>,
    /// The round's secure-aggregation groups, each its own protocol
    /// instance; `stages` adds theirs up.
    pub groups: Vec<GroupMetrics>,
    /// Under differential privacy, ε spent by the task up to and including
    /// this round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    /// An async task's applied group: its number and its updates' staleness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<BufferMetrics>,
}

/// The group an async task applied as one model version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BufferMetrics {
    /// The group's number (its protocol instance's round number).
    pub group: u64,
    /// How many of its updates were 0, 1, 2, … versions stale.
    pub staleness_histogram: Vec<u64>,
}

/// One secure-aggregation group of a round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GroupMetrics {
    /// Clients in the group.
    pub selected: usize,
    /// Survivors whose inputs are in the group's sum (0 unless it completed).
    pub survivors: u32,
    /// The stage the group was given up in, if it was: its clients count as
    /// dropouts and nothing of it is in the round's sum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_at: Option<Stage>,
    /// The replica that ran the group, when not the round's leader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// A metric's mean over a round's survivors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClientMean {
    /// Σ of the reported values over the number of reporters.
    pub mean: f64,
    /// Survivors that reported the metric.
    pub clients: u32,
}

/// What the admin API shows of the round in progress: counts, times and
/// traffic only; nothing about any one client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RoundProgress {
    /// Round number.
    pub round: u64,
    /// Attempt of this round.
    pub attempt: u32,
    /// Current stage.
    pub stage: Stage,
    /// Clients selected.
    pub selected: usize,
    /// Clients allowed to send in the current stage, over the groups in it.
    pub eligible: usize,
    /// Of those, clients that sent.
    pub received: usize,
    /// Of those, clients the stage still waits for (neither sent nor left).
    #[serde(default)]
    pub awaited: usize,
    /// Of those, clients that said they left.
    #[serde(default)]
    pub left: usize,
    /// Answers a group needs in each stage (its threshold): a stage with
    /// fewer than this sent plus awaited gives its group up at once.
    #[serde(default)]
    pub threshold: usize,
    /// Round start (Unix ms).
    pub started_at: i64,
    /// Current stage's start (Unix ms; the earliest group's).
    pub stage_started_at: i64,
    /// Current stage's deadline (Unix ms; the earliest group's).
    pub deadline: i64,
    /// Stages closed so far.
    pub stages: Vec<StageMetrics>,
    /// Bytes received from clients so far.
    pub bytes_up: u64,
    /// Bytes sent to clients so far.
    pub bytes_down: u64,
    /// Secure-aggregation groups of the round.
    #[serde(default)]
    pub groups: usize,
    /// Of those, groups unmasked so far.
    #[serde(default)]
    pub groups_completed: usize,
    /// Of those, groups given up (too few clients).
    #[serde(default)]
    pub groups_failed: usize,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}
