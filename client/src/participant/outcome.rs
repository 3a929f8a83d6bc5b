//! What the participant tells its driver: the next action, how a round
//! ended, its settings, and why it cannot go on.

use super::http::Request;
use super::{Checkpoint, Policy, PolicyViolation};

/// What the driver should do next.
#[derive(Debug)]
pub enum Action {
    /// Send this request and report the outcome with
    /// [`Participant::handle`](super::Participant::handle) or [`Participant::transport_failed`](super::Participant::transport_failed).
    Send(Request),
    /// Nothing to do for this many milliseconds.
    Wait(u64),
    /// Train on the round's global model and call [`Participant::submit`](super::Participant::submit)
    /// with the update (a model-agnostic application may compute it any
    /// way it likes).
    Train {
        /// Round number (an async task: the model's version), as the
        /// coordinator numbers it.
        round: u64,
        /// How many masked inputs this participant sent before: a value of
        /// the client's own, never the coordinator's, for seeding local
        /// training's randomness (the built-in trainers do).
        nonce: u64,
        /// The global model.
        model: Box<Checkpoint>,
    },
    /// The stage's agreements or key streams are the driver's to compute
    /// (a participant with
    /// [`set_host_crypto`](super::Participant::set_host_crypto) on): see
    /// [`Participant::host_work`](super::Participant::host_work).
    HostWork,
    /// A round this participant was selected for is over for it.
    RoundEnded(RoundOutcome),
    /// The task is over; nothing more to do.
    Finished,
}

/// How a round ended for this participant.
#[derive(Debug, Clone, PartialEq)]
pub enum RoundOutcome {
    /// Every stage went through; the update is in the aggregate unless the
    /// round failed on the server.
    Completed(RoundReport),
    /// The server dropped this client from the round (it was too slow, or
    /// the round ended without it).
    Dropped {
        /// What the round's numbers were so far.
        report: RoundReport,
        /// What the coordinator said: the attempt's failure (answers against
        /// the threshold, clients that left) when it was aborted.
        reason: String,
    },
    /// This client gave up on the round.
    Abandoned {
        /// What the round's numbers were so far.
        report: RoundReport,
        /// Why.
        reason: String,
    },
    /// This client refused the round's setup before it revealed anything:
    /// the round replays one it already contributed to, or is not the round
    /// it was selected for (see [`PolicyViolation::round_only`]). Rules
    /// about the task itself end the participant instead, with
    /// [`ParticipantError::Policy`].
    Refused {
        /// What the round's numbers were so far.
        report: RoundReport,
        /// The rule the setup broke.
        violation: PolicyViolation,
    },
}

impl RoundOutcome {
    /// The round's numbers.
    pub fn report(&self) -> &RoundReport {
        match self {
            RoundOutcome::Completed(r) => r,
            RoundOutcome::Dropped { report, .. }
            | RoundOutcome::Abandoned { report, .. }
            | RoundOutcome::Refused { report, .. } => report,
        }
    }
}

/// Traffic of one round, as measured by the participant (HTTP bodies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoundReport {
    /// Round number.
    pub round: u64,
    /// Bytes sent.
    pub bytes_up: u64,
    /// Bytes received, the global model included.
    pub bytes_down: u64,
}

/// Retry, polling and deadline settings, and the client policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParticipantConfig {
    /// Attempts per request before giving up with
    /// [`ParticipantError::Unreachable`].
    pub max_attempts: u32,
    /// First retry delay; doubles per attempt.
    pub backoff_base_ms: u64,
    /// Longest retry delay.
    pub backoff_max_ms: u64,
    /// Delay between polls while a stage is collecting.
    pub poll_interval_ms: u64,
    /// How long the coordinator may hold a check-in or the request for
    /// the next stage message until its answer is no longer "wait"
    /// (`wait_ms`, at most [`MAX_WAIT_MS`](crate::api::routes::MAX_WAIT_MS)):
    /// one held request instead of a poll every `poll_interval_ms`, and
    /// the answer as soon as the round starts or the stage closes. A stage
    /// message's post asks for the same hold, and its answer carries the
    /// next stage message: one request a stage instead of a post and a
    /// fetch. A coordinator from before held requests answers a stage
    /// message's `GET` and `POST` at once and refuses a check-in's
    /// `wait_ms`; the participant then checks in again without it and
    /// polls as before. `0` never asks for a hold. The transport must wait
    /// this long for an answer and more (the HTTP transport waits 30 s).
    /// A request in flight is not cut short: a pause, a leave or an
    /// interrupt takes effect once it returns, so the default
    /// ([`DEFAULT_WAIT_MS`], 5 s) keeps them prompt while a client that
    /// waits sends one request where it would send 25 polls.
    pub wait_ms: u64,
    /// Longest wait for the next stage message before the round is
    /// abandoned.
    pub stage_timeout_ms: u64,
    /// How long a coordinator that answers that it does not know the task
    /// this participant enrolled in is asked again before that is
    /// [`ParticipantError::TaskNotFound`] (a replica that just lost the
    /// task's lead may say so while another takes it over), and one that
    /// answers `503 unavailable` before that is
    /// [`ParticipantError::Unreachable`] (however many attempts that is).
    pub task_missing_ms: u64,
    /// The tasks and rounds this participant accepts, checked at
    /// enrollment and before each round reveals anything. The default is
    /// for a coordinator the participant does not trust (see [`Policy`]).
    pub policy: Policy,
}

/// How long a participant asks the coordinator to hold its waits by
/// default (see [`ParticipantConfig::wait_ms`]).
pub const DEFAULT_WAIT_MS: u64 = 5_000;

impl Default for ParticipantConfig {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            backoff_base_ms: 200,
            backoff_max_ms: 10_000,
            poll_interval_ms: 200,
            wait_ms: DEFAULT_WAIT_MS,
            stage_timeout_ms: 180_000,
            task_missing_ms: 60_000,
            policy: Policy::default(),
        }
    }
}

/// Why the participant cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ParticipantError {
    /// The coordinator did not answer (or answered 5xx/429) on every try.
    #[error("the coordinator is unreachable after {attempts} attempts: {last}")]
    Unreachable {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// The enrollment token or the credential was refused.
    #[error("the coordinator refused the credentials: {0}")]
    Unauthorized(String),
    /// The task does not exist.
    #[error("task {0} not found")]
    TaskNotFound(String),
    /// The coordinator refused a request this client should not have made.
    #[error("the coordinator refused the request ({status} {code}): {message}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// Error code from the body.
        code: crate::api::ErrorCode,
        /// Error message from the body.
        message: String,
    },
    /// The coordinator sent something that is not its API.
    #[error("unexpected reply from the coordinator: {0}")]
    UnexpectedReply(String),
    /// The update handed to [`Participant::submit`](super::Participant::submit) does not fit the round.
    #[error("invalid update: {0}")]
    InvalidUpdate(String),
    /// A call came at the wrong time (e.g. `submit` without a `Train`).
    #[error("out of order: {0}")]
    OutOfOrder(&'static str),
    /// The task (at enrollment) or a round announced security parameters
    /// that [`ParticipantConfig::policy`] does not accept, or that differ
    /// from those pinned at enrollment. Nothing was revealed; the
    /// participant stops. [`PolicyViolation::rule`] names the rule.
    #[error("refused by the client's policy (rule {rule}): {violation}", rule = .0.rule(), violation = .0)]
    Policy(PolicyViolation),
}
