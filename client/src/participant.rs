//! The participant: takes part in a task's rounds against the coordinator's
//! client API, as a sans-IO state machine.
//!
//! [`Participant`] never touches a socket or a clock. The code that drives
//! it (the blocking [`crate::runtime`] here, a fetch loop in the browser,
//! a background thread on Android) repeats:
//!
//! 1. `participant.next(now_ms)` returns an [`Action`]: send a
//!    [`Request`], wait, train on the global model, or take note of a
//!    round's outcome;
//! 2. the driver performs it and reports back with [`Participant::handle`]
//!    (a [`Response`]), [`Participant::transport_failed`] (no response) or
//!    [`Participant::submit`] (the local update).
//!
//! The participant enrolls once (the credential is part of its
//! [`SavedState`]), checks in until selected, downloads the global model,
//! hands it to the application to train, then runs the secure-aggregation
//! client of [`cohort_crypto`] over the stage messages. Failed requests
//! and 5xx or 429 replies are retried with exponential backoff; a stage
//! that does not advance within [`ParticipantConfig::stage_timeout_ms`]
//! abandons the round (the server counts the client as a dropout).
//!
//! Before it reveals anything, the participant checks what the coordinator
//! announces against [`ParticipantConfig::policy`] (the task at enrollment,
//! each round's setup), against the task parameters it pinned at
//! enrollment, and against the rounds it already sent a masked input for;
//! see [`cohort_crypto::policy`]. A task or round below the policy ends the
//! participant with [`ParticipantError::Policy`]; a replayed round, or one
//! that is not the round announced, ends with [`RoundOutcome::Refused`].
//!
//! Round secrets (the X25519 keys, the self-mask seed, the quantized
//! update) live only in memory and are never part of the saved state: a
//! participant that restarts mid-round drops out of that round, which the
//! protocol tolerates, and joins the next one.

use std::collections::VecDeque;
use std::sync::Arc;

use chacha20::ChaCha20Rng;
use cohort_crypto::signature::{IdentityKey, enrollment_statement};
use cohort_crypto::{Client, ClientId, ClientMessage, ProtocolError, Quantizer, Secret32, ServerMessage};
use rand_core::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use crate::checkpoint::{self, Checkpoint};

pub use cohort_crypto::Stage;
pub use cohort_crypto::policy::{Collusion, Policy, PolicyViolation, TaskSecurity};
pub use cohort_crypto::{Metric, MetricValues};

/// Content type of binary stage messages.
pub const SECAGG_CONTENT_TYPE: &str = "application/x-cohort-secagg";

/// HTTP method of a [`Request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// GET.
    Get,
    /// POST.
    Post,
}

/// A request to the coordinator's client API.
#[derive(Clone, PartialEq, Eq)]
pub struct Request {
    /// Method.
    pub method: Method,
    /// Path and query, starting with `/`.
    pub path: String,
    /// Body (empty for GET).
    pub body: Vec<u8>,
    /// Content type of the body.
    pub content_type: Option<&'static str>,
    /// Bearer credential to present.
    pub bearer: Option<String>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("body_len", &self.body.len())
            .finish_non_exhaustive()
    }
}

/// The coordinator's reply to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Response {
    /// HTTP status.
    pub status: u16,
    /// Body.
    pub body: Vec<u8>,
}

/// What the driver should do next.
#[derive(Debug)]
pub enum Action {
    /// Send this request and report the outcome with
    /// [`Participant::handle`] or [`Participant::transport_failed`].
    Send(Request),
    /// Nothing to do for this many milliseconds.
    Wait(u64),
    /// Train on the round's global model and call [`Participant::submit`]
    /// with the update (a model-agnostic application may compute it any
    /// way it likes).
    Train {
        /// Round number.
        round: u64,
        /// The global model.
        model: Box<Checkpoint>,
    },
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
    Dropped(RoundReport),
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
            RoundOutcome::Completed(r) | RoundOutcome::Dropped(r) => r,
            RoundOutcome::Abandoned { report, .. } | RoundOutcome::Refused { report, .. } => report,
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

/// Retry, polling and deadline settings, and the privacy policy.
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
    /// Longest wait for the next stage message before the round is
    /// abandoned.
    pub stage_timeout_ms: u64,
    /// The tasks and rounds this participant accepts, checked at
    /// enrollment and before each round reveals anything. The default is
    /// for a coordinator the participant does not trust (see [`Policy`]).
    pub policy: Policy,
}

impl Default for ParticipantConfig {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            backoff_base_ms: 200,
            backoff_max_ms: 10_000,
            poll_interval_ms: 200,
            stage_timeout_ms: 180_000,
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
        code: String,
        /// Error message from the body.
        message: String,
    },
    /// The coordinator sent something that is not its API.
    #[error("unexpected reply from the coordinator: {0}")]
    UnexpectedReply(String),
    /// The update handed to [`Participant::submit`] does not fit the round.
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

/// What survives a restart: the enrollment, never round secrets.
#[derive(Clone, Serialize, Deserialize, Zeroize, ZeroizeOnDrop)]
pub struct SavedState {
    /// Task id.
    pub task_id: String,
    /// Participant id the coordinator assigned.
    pub participant_id: String,
    /// Bearer credential of the client API.
    credential: String,
    /// Credential expiry (Unix ms).
    pub expires_at: i64,
    /// The last round this participant completed.
    pub last_completed_round: u64,
    /// That round's session, so that a restarted client does not join it
    /// again (it may join a re-run of the same round number).
    #[serde(default)]
    pub last_session: Option<String>,
    /// The RFC 8032 seed of this participant's Ed25519 identity key (hex),
    /// whose public half it registered at enrollment: it signs the round
    /// keys and the survivor list in the active variant. Zeroized on drop,
    /// never printed. Absent only in states saved before identities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    identity_seed: Option<String>,
    /// The task's security parameters as announced at enrollment: every
    /// round must repeat them. Absent only in states saved before pinning;
    /// those pin the first round they see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[zeroize(skip)]
    pub security: Option<TaskSecurity>,
    /// The last round this participant sent a masked input for; it never
    /// takes part in that round or an earlier one again.
    #[serde(default)]
    pub last_contributed_round: u64,
}

impl SavedState {
    /// The identity key, if this enrollment has one.
    fn identity(&self) -> Option<Arc<IdentityKey>> {
        let mut seed = Zeroizing::new([0u8; 32]);
        hex::decode_to_slice(self.identity_seed.as_deref()?, &mut *seed).ok()?;
        Some(Arc::new(identity_from_seed(*seed)))
    }
}

impl std::fmt::Debug for SavedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedState")
            .field("task_id", &self.task_id)
            .field("participant_id", &self.participant_id)
            .field("expires_at", &self.expires_at)
            .field("last_completed_round", &self.last_completed_round)
            .finish_non_exhaustive()
    }
}

/// The update of a round before the protocol starts, or the protocol.
enum Protocol {
    Pending { update: Zeroizing<Vec<f32>>, examples: u32 },
    Running(Box<Client>),
}

enum Phase {
    Enroll,
    CheckIn,
    Model {
        round: u64,
        client_id: u32,
    },
    Training {
        round: u64,
        client_id: u32,
        model: Option<Box<Checkpoint>>,
        parameters: usize,
    },
    Fetch {
        round: u64,
        client_id: u32,
        protocol: Protocol,
        since: Option<u64>,
    },
    /// `body` is the encoded message to post: unmasking shares, in the
    /// last stage, so it is wiped when dropped.
    Post {
        round: u64,
        client_id: u32,
        protocol: Protocol,
        body: Zeroizing<Vec<u8>>,
    },
    Report {
        body: Vec<u8>,
    },
    Finished,
}

/// Takes part in one task's rounds. See the [module docs](self).
pub struct Participant {
    config: ParticipantConfig,
    task_id: String,
    enrollment_token: Option<Zeroizing<String>>,
    saved: Option<SavedState>,
    phase: Phase,
    /// A seeded source of each round's generator (tests and reproducible
    /// simulations only); `None`: each round is seeded by the operating
    /// system.
    seeder: Option<ChaCha20Rng>,
    /// The generator of the round in progress: seeded afresh when the
    /// round's protocol starts and dropped, its state zeroized, when the
    /// round ends, so that no generator can recompute a past round's keys,
    /// masks or shares.
    round_rng: Option<ChaCha20Rng>,
    /// The identity seed drawn for the enrollment in flight.
    pending_identity: Option<Zeroizing<[u8; 32]>>,
    /// The current request's failed attempts.
    attempts: u32,
    wait_until: u64,
    in_flight: bool,
    report: RoundReport,
    /// The round instance (its session) this participant joined last; it
    /// never joins one twice, but joins a re-run of the same round number.
    last_joined: Option<String>,
    /// The session the last selection named, which the setup must carry.
    selected_session: Option<[u8; 16]>,
    /// The state of an enrollment whose credential expired: its pinned
    /// parameters and contributions carry over to the next enrollment.
    expired: Option<SavedState>,
    /// The application's metrics for the round in progress: they travel
    /// inside the masked input, and in the clear only to a semi-honest
    /// task that asks for them.
    metrics: MetricValues,
    /// Whether the round in progress asked for plaintext metrics too.
    plaintext_metrics: bool,
    events: VecDeque<Action>,
}

impl std::fmt::Debug for Participant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Participant").field("task_id", &self.task_id).finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Enrolled {
    participant_id: String,
    credential: String,
    expires_at: i64,
    security: TaskSecurity,
}

#[derive(Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum CheckIn {
    Wait {
        retry_after_ms: u64,
    },
    Selected {
        round: u64,
        client_id: u32,
        #[serde(default)]
        attempt: u32,
        #[serde(default)]
        session: Option<String>,
        /// The task (semi-honest only) also takes each client's metrics
        /// in the clear.
        #[serde(default)]
        plaintext_metrics: bool,
    },
    Finished,
}

#[derive(Deserialize, Default)]
struct ApiError {
    #[serde(default)]
    error: String,
    #[serde(default)]
    message: String,
    /// With a 429 or 503: how long to wait before trying again.
    #[serde(default)]
    retry_after_ms: Option<u64>,
}

/// Longest wait a server's `retry_after_ms` can impose at once.
const MAX_RETRY_AFTER_MS: u64 = 300_000;

impl Participant {
    /// A participant that enrolls in `task_id` with `enrollment_token`.
    /// Its randomness comes from the operating system.
    pub fn enroll(task_id: &str, enrollment_token: &str, config: ParticipantConfig) -> Self {
        Self::build(task_id, Some(enrollment_token), None, config)
    }

    /// A participant that goes on from a saved state; `enrollment_token`,
    /// when given, lets it enroll again if the credential has expired.
    pub fn resume(saved: SavedState, enrollment_token: Option<&str>, config: ParticipantConfig) -> Self {
        let task_id = saved.task_id.clone();
        Self::build(&task_id, enrollment_token, Some(saved), config)
    }

    /// Replaces the randomness with a seeded generator (tests and
    /// reproducible simulations only: masks must be unpredictable).
    pub fn with_seed(mut self, seed: [u8; 32]) -> Self {
        self.seeder = Some(ChaCha20Rng::from_seed(seed));
        self
    }

    fn build(
        task_id: &str,
        enrollment_token: Option<&str>,
        saved: Option<SavedState>,
        config: ParticipantConfig,
    ) -> Self {
        let phase = if saved.is_some() { Phase::CheckIn } else { Phase::Enroll };
        let last_joined = saved.as_ref().and_then(|s| s.last_session.clone());
        Self {
            config,
            task_id: task_id.to_string(),
            enrollment_token: enrollment_token.map(|t| Zeroizing::new(t.to_string())),
            saved,
            phase,
            seeder: None,
            round_rng: None,
            pending_identity: None,
            attempts: 0,
            wait_until: 0,
            in_flight: false,
            report: RoundReport::default(),
            last_joined,
            selected_session: None,
            expired: None,
            metrics: MetricValues::new(),
            plaintext_metrics: false,
            events: VecDeque::new(),
        }
    }

    /// The state to persist (after enrollment and after each round).
    pub fn saved_state(&self) -> Option<&SavedState> {
        self.saved.as_ref()
    }

    /// The task.
    pub fn task_id(&self) -> &str {
        &self.task_id
    }

    /// The protocol stage of the message about to be posted, if any: lets
    /// a driver (or a test) act at a precise point of the round.
    pub fn posting(&self) -> Option<Stage> {
        match &self.phase {
            Phase::Post { protocol: Protocol::Running(client), .. } => Some(match client.stage() {
                Stage::ShareKeys => Stage::AdvertiseKeys,
                Stage::MaskedInputCollection => Stage::ShareKeys,
                Stage::ConsistencyCheck => Stage::MaskedInputCollection,
                Stage::Unmasking => Stage::ConsistencyCheck,
                _ => Stage::Unmasking,
            }),
            _ => None,
        }
    }

    /// What to do next, at time `now` (ms on any monotonic clock).
    pub fn next(&mut self, now: u64) -> Action {
        if let Some(event) = self.events.pop_front() {
            return event;
        }
        if matches!(self.phase, Phase::Finished) {
            return Action::Finished;
        }
        if self.in_flight {
            // The driver asked again without reporting: resend.
            self.in_flight = false;
        }
        if now < self.wait_until {
            return Action::Wait(self.wait_until - now);
        }
        let bearer = self.saved.as_ref().map(|s| s.credential.clone());
        let request = match &mut self.phase {
            Phase::Enroll => {
                let Some(token) = &self.enrollment_token else {
                    self.phase = Phase::Finished;
                    return Action::Finished;
                };
                // A fresh identity for each enrollment; its seed is kept
                // with the enrollment once the coordinator accepts it.
                let seeder = &mut self.seeder;
                let seed = self.pending_identity.get_or_insert_with(|| fresh_seed(seeder));
                let key = identity_from_seed(**seed);
                let public = key.public_key();
                let proof = key.sign(&enrollment_statement(&self.task_id, &public));
                let body = serde_json::json!({
                    "enrollment_token": token.as_str(),
                    "identity_key": hex::encode(public),
                    "identity_proof": hex::encode(proof),
                })
                .to_string();
                post_json(format!("/v1/tasks/{}/enroll", self.task_id), body.into_bytes(), None)
            }
            Phase::CheckIn => post_json("/v1/checkin".into(), Vec::new(), bearer),
            Phase::Model { .. } => get("/v1/model", bearer),
            Phase::Training { round, model, .. } => {
                return match model.take() {
                    Some(model) => Action::Train { round: *round, model },
                    // Waiting for `submit`.
                    None => Action::Wait(self.config.poll_interval_ms),
                };
            }
            Phase::Fetch { since, .. } => {
                let started = *since.get_or_insert(now);
                if now.saturating_sub(started) > self.config.stage_timeout_ms {
                    let reason = format!("no stage message within {} ms", self.config.stage_timeout_ms);
                    self.abandon(reason);
                    return self.next(now);
                }
                get("/v1/round/message", bearer)
            }
            Phase::Post { body, .. } => Request {
                method: Method::Post,
                path: "/v1/round/message".into(),
                body: body.to_vec(),
                content_type: Some(SECAGG_CONTENT_TYPE),
                bearer,
            },
            Phase::Report { body, .. } => post_json("/v1/metrics".into(), body.clone(), bearer),
            Phase::Finished => return Action::Finished,
        };
        self.in_flight = true;
        self.count_up(request.body.len());
        Action::Send(request)
    }

    fn count_up(&mut self, bytes: usize) {
        if matches!(self.phase, Phase::Model { .. } | Phase::Fetch { .. } | Phase::Post { .. }) {
            self.report.bytes_up += bytes as u64;
        }
    }

    /// The request of the last [`Action::Send`] got no response (connection
    /// refused, reset, timed out). Schedules a retry, or fails once the
    /// attempts are spent.
    pub fn transport_failed(&mut self, now: u64, error: &str) -> Result<(), ParticipantError> {
        self.in_flight = false;
        self.retry(now, error)
    }

    fn retry(&mut self, now: u64, error: &str) -> Result<(), ParticipantError> {
        self.attempts += 1;
        if self.attempts >= self.config.max_attempts {
            return Err(ParticipantError::Unreachable { attempts: self.attempts, last: error.to_string() });
        }
        let delay = self
            .config
            .backoff_base_ms
            .saturating_mul(1 << (self.attempts - 1).min(20))
            .min(self.config.backoff_max_ms);
        self.wait_until = now + delay;
        Ok(())
    }

    /// Handles the response to the last [`Action::Send`].
    pub fn handle(&mut self, now: u64, response: Response) -> Result<(), ParticipantError> {
        if !std::mem::take(&mut self.in_flight) {
            return Err(ParticipantError::OutOfOrder("a response without a request"));
        }
        let status = response.status;
        if status == 429 || status >= 500 {
            let asked =
                serde_json::from_slice::<ApiError>(&response.body).ok().and_then(|e| e.retry_after_ms);
            if status == 429 {
                // Rate limited: the server is there and says when to come
                // back; that is no failed attempt.
                let wait = asked.unwrap_or(self.config.backoff_base_ms).min(MAX_RETRY_AFTER_MS);
                self.wait_until = now + wait;
                return Ok(());
            }
            self.retry(now, &format!("HTTP {status}"))?;
            if let Some(asked) = asked {
                self.wait_until = self.wait_until.max(now + asked.min(MAX_RETRY_AFTER_MS));
            }
            return Ok(());
        }
        let retried = std::mem::take(&mut self.attempts) > 0;
        if matches!(self.phase, Phase::Model { .. } | Phase::Fetch { .. } | Phase::Post { .. }) {
            self.report.bytes_down += response.body.len() as u64;
        }
        let error = || serde_json::from_slice::<ApiError>(&response.body).unwrap_or_default();
        if status == 401 {
            return self.unauthorized(error().message);
        }
        match std::mem::replace(&mut self.phase, Phase::Finished) {
            Phase::Enroll => match status {
                201 => {
                    let enrolled: Enrolled = parse_json(&response.body)?;
                    let expired = self.expired.take();
                    // A renewed enrollment keeps what the first one pinned.
                    if let Some(pinned) = expired.as_ref().and_then(|e| e.security) {
                        pinned.compare(&enrolled.security).map_err(ParticipantError::Policy)?;
                    }
                    self.config.policy.check(&enrolled.security).map_err(ParticipantError::Policy)?;
                    self.saved = Some(SavedState {
                        task_id: self.task_id.clone(),
                        participant_id: enrolled.participant_id,
                        credential: enrolled.credential,
                        expires_at: enrolled.expires_at,
                        last_completed_round: expired.as_ref().map_or(0, |e| e.last_completed_round),
                        last_session: expired.as_ref().and_then(|e| e.last_session.clone()),
                        identity_seed: self.pending_identity.take().map(|seed| hex::encode(*seed)),
                        security: Some(enrolled.security),
                        last_contributed_round: expired.as_ref().map_or(0, |e| e.last_contributed_round),
                    });
                    self.phase = Phase::CheckIn;
                }
                404 => return Err(ParticipantError::TaskNotFound(self.task_id.clone())),
                409 => {} // The task is over: stay finished.
                _ => return Err(rejected(status, error())),
            },
            Phase::CheckIn => match status {
                200 => match parse_json::<CheckIn>(&response.body)? {
                    CheckIn::Wait { retry_after_ms } => {
                        self.wait_until = now + retry_after_ms;
                        self.phase = Phase::CheckIn;
                    }
                    CheckIn::Selected { round, client_id, attempt, session, plaintext_metrics } => {
                        let instance = session.unwrap_or_else(|| format!("{round}/{attempt}"));
                        if self.last_joined.as_deref() == Some(instance.as_str()) {
                            // This round is over for us; wait for the next.
                            self.wait_until = now + self.config.poll_interval_ms * 5;
                            self.phase = Phase::CheckIn;
                        } else {
                            self.report = RoundReport { round, ..RoundReport::default() };
                            self.selected_session = session_id(&instance);
                            self.plaintext_metrics = plaintext_metrics;
                            self.last_joined = Some(instance);
                            self.phase = Phase::Model { round, client_id };
                        }
                    }
                    CheckIn::Finished => {}
                },
                404 => return Err(ParticipantError::TaskNotFound(self.task_id.clone())),
                _ => return Err(rejected(status, error())),
            },
            Phase::Model { round, client_id } => match status {
                200 => {
                    let model = checkpoint::decode(&response.body)
                        .map_err(|e| ParticipantError::UnexpectedReply(format!("global model: {e}")))?;
                    let parameters = model.weights.len();
                    let model = Some(Box::new(model));
                    self.phase = Phase::Training { round, client_id, model, parameters };
                }
                _ => self.abandon(error().message),
            },
            Phase::Fetch { round, client_id, protocol, since } => match status {
                200 => self.on_server_message(round, client_id, protocol, &response.body)?,
                204 => {
                    self.wait_until = now + self.config.poll_interval_ms;
                    self.phase = Phase::Fetch { round, client_id, protocol, since };
                }
                410 => self.end_round(RoundOutcome::Dropped(self.report)),
                _ => self.abandon(error().message),
            },
            Phase::Post { round, client_id, protocol, body } => match status {
                202 => self.after_post(round, client_id, protocol),
                // A retried post whose first try arrived.
                409 if retried && error().error == "duplicate" => self.after_post(round, client_id, protocol),
                410 => self.end_round(RoundOutcome::Dropped(self.report)),
                // The message belongs to a stage that closed meanwhile.
                409 if error().error == "out_of_phase" || error().error == "not_selected" => {
                    self.end_round(RoundOutcome::Dropped(self.report))
                }
                _ => {
                    drop(body);
                    self.abandon(error().message)
                }
            },
            Phase::Report { .. } => {
                // Metrics are best effort: a refusal does not fail the round.
                self.phase = Phase::CheckIn;
            }
            Phase::Training { .. } => return Err(ParticipantError::OutOfOrder("no request while training")),
            Phase::Finished => {}
        }
        Ok(())
    }

    fn unauthorized(&mut self, message: String) -> Result<(), ParticipantError> {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        if matches!(phase, Phase::Enroll) || self.enrollment_token.is_none() {
            return Err(ParticipantError::Unauthorized(message));
        }
        // The credential expired: enroll again, losing the current round
        // but keeping what this enrollment pinned.
        self.expired = self.saved.take();
        self.phase = Phase::Enroll;
        Ok(())
    }

    /// Hands over the local update after an [`Action::Train`]: `update` is
    /// the model delta (local − global), `examples` its weight in the
    /// average, `metrics` the round's training metrics (loss, accuracy).
    /// The metrics the round has room for travel inside the masked input,
    /// so the coordinator learns only their sums over the survivors; only
    /// a semi-honest task that asks for them also gets them in the clear,
    /// with the bytes this client sent and received.
    pub fn submit(
        &mut self,
        update: Vec<f32>,
        examples: u32,
        metrics: MetricValues,
    ) -> Result<(), ParticipantError> {
        let update = Zeroizing::new(update);
        let Phase::Training { round, client_id, model: None, parameters } = self.phase else {
            return Err(ParticipantError::OutOfOrder("submit comes after a Train action"));
        };
        if update.len() != parameters {
            return Err(ParticipantError::InvalidUpdate(format!(
                "{} values for a model of {parameters} parameters",
                update.len()
            )));
        }
        if examples == 0 || update.iter().any(|v| !v.is_finite()) {
            return Err(ParticipantError::InvalidUpdate("non-finite values or no examples".into()));
        }
        self.metrics = metrics;
        let protocol = Protocol::Pending { update, examples };
        self.phase = Phase::Fetch { round, client_id, protocol, since: None };
        Ok(())
    }

    /// Gives up on the current round without telling the server, as a
    /// client that loses its connection would (the round ends with
    /// [`RoundOutcome::Abandoned`]); then checks in for the next round.
    pub fn vanish(&mut self, reason: &str) {
        if !matches!(self.phase, Phase::Enroll | Phase::CheckIn | Phase::Report { .. } | Phase::Finished) {
            self.in_flight = false;
            self.metrics = MetricValues::new();
            self.abandon(reason.to_string());
        }
    }

    /// Leaves the current round at once, as [`vanish`](Self::vanish) does,
    /// and returns its outcome here instead of through [`next`](Self::next);
    /// `None` when no round was under way. For drivers that stop (an
    /// application pausing) rather than go on to the next round.
    pub fn leave(&mut self, reason: &str) -> Option<RoundOutcome> {
        self.vanish(reason);
        let position = self.events.iter().rposition(|e| matches!(e, Action::RoundEnded(_)))?;
        match self.events.remove(position) {
            Some(Action::RoundEnded(outcome)) => Some(outcome),
            _ => None,
        }
    }

    fn on_server_message(
        &mut self,
        round: u64,
        client_id: u32,
        protocol: Protocol,
        bytes: &[u8],
    ) -> Result<(), ParticipantError> {
        let message = match ServerMessage::decode(bytes) {
            Ok(message) => message,
            Err(e) => {
                self.abandon(format!("undecodable server message: {e}"));
                return Ok(());
            }
        };
        let step = match protocol {
            Protocol::Pending { update, examples } => {
                if let Err(violation) = self.admit(round, client_id, &message) {
                    drop(update);
                    if violation.round_only() {
                        self.end_round(RoundOutcome::Refused { report: self.report, violation });
                        return Ok(());
                    }
                    self.round_rng = None;
                    self.metrics = MetricValues::new();
                    return Err(ParticipantError::Policy(violation));
                }
                // Every round starts from a fresh generator.
                self.round_rng = None;
                let seeder = &mut self.seeder;
                let rng = self.round_rng.get_or_insert_with(|| round_generator(seeder));
                let identity = self.saved.as_ref().and_then(SavedState::identity);
                start(message, client_id, identity, (&update, examples, &self.metrics), rng)
            }
            Protocol::Running(client) => {
                let seeder = &mut self.seeder;
                let rng = self.round_rng.get_or_insert_with(|| round_generator(seeder));
                let (client, reply) = client.handle(message, rng);
                let client = Box::new(client);
                reply.map(|reply| (client, reply)).map_err(|e| e.to_string())
            }
        };
        match step {
            Ok((client, reply)) => {
                if matches!(reply, ClientMessage::MaskedInput { .. })
                    && let Some(saved) = &mut self.saved
                {
                    // Recorded (and saved by the driver) before it is sent.
                    saved.last_contributed_round = saved.last_contributed_round.max(round);
                }
                let body = Zeroizing::new(reply.encode());
                self.phase = Phase::Post { round, client_id, protocol: Protocol::Running(client), body };
            }
            Err(e) => self.abandon(format!("protocol: {e}")),
        }
        Ok(())
    }

    /// Checks a round's setup against the selection, the contributions
    /// made so far, the parameters pinned at enrollment and the policy,
    /// before anything of the round is drawn or revealed. A state saved
    /// before pinning pins this round's parameters.
    fn admit(&mut self, round: u64, client_id: u32, message: &ServerMessage) -> Result<(), PolicyViolation> {
        let ServerMessage::Setup(config) = message else {
            return Ok(()); // `start` refuses anything but a setup.
        };
        if config.round != round {
            return Err(PolicyViolation::WrongRound { expected: round, got: config.round });
        }
        if self.selected_session.is_some_and(|session| session != config.session) {
            return Err(PolicyViolation::WrongSession);
        }
        let Some(saved) = &mut self.saved else {
            return Err(PolicyViolation::Invalid("a round before enrollment".into()));
        };
        let last = saved.last_contributed_round;
        if last > 0 && config.round <= last {
            return Err(PolicyViolation::Replayed { round: config.round, last });
        }
        let announced = TaskSecurity::of_round(config)?;
        saved.security.get_or_insert(announced).compare(&announced)?;
        self.config.policy.check(&announced)?;
        if config.variant == cohort_crypto::Variant::Active {
            let listed = (client_id as usize).checked_sub(1).and_then(|i| config.identities.get(i));
            let ours = saved.identity().map(|key| key.public_key());
            if ours.is_none() || listed != ours.as_ref() {
                return Err(PolicyViolation::NotOurIdentity);
            }
        }
        Ok(())
    }

    fn after_post(&mut self, round: u64, client_id: u32, protocol: Protocol) {
        if matches!(&protocol, Protocol::Running(client) if matches!(**client, Client::Finished)) {
            if let Some(saved) = &mut self.saved {
                saved.last_completed_round = round;
                saved.last_session.clone_from(&self.last_joined);
            }
            self.end_round(RoundOutcome::Completed(self.report));
        } else {
            self.phase = Phase::Fetch { round, client_id, protocol, since: None };
        }
    }

    fn abandon(&mut self, reason: String) {
        self.end_round(RoundOutcome::Abandoned { report: self.report, reason });
    }

    /// Queues the outcome, then the plaintext metrics report if the round
    /// asked for one, ran the semi-honest variant, and the update went
    /// through.
    fn end_round(&mut self, outcome: RoundOutcome) {
        // The round's generator goes with it (zeroized on drop).
        self.round_rng = None;
        let report = *outcome.report();
        let metrics = std::mem::take(&mut self.metrics);
        let semi_honest = self
            .saved
            .as_ref()
            .and_then(|saved| saved.security)
            .is_some_and(|security| security.variant == cohort_crypto::Variant::SemiHonest);
        self.phase = match &outcome {
            RoundOutcome::Completed(_) if self.plaintext_metrics && semi_honest && !metrics.is_empty() => {
                let mut fields = match serde_json::to_value(metrics) {
                    Ok(serde_json::Value::Object(fields)) => fields,
                    _ => serde_json::Map::new(),
                };
                fields.insert("bytes_up".into(), report.bytes_up.into());
                fields.insert("bytes_down".into(), report.bytes_down.into());
                let body = serde_json::json!({ "round": report.round, "kind": "train", "metrics": fields });
                Phase::Report { body: body.to_string().into_bytes() }
            }
            _ => Phase::CheckIn,
        };
        self.plaintext_metrics = false;
        self.events.push_back(Action::RoundEnded(outcome));
    }
}

/// Quantizes the update for the round's parameters and opens the protocol.
fn start(
    setup: ServerMessage,
    client_id: u32,
    identity: Option<Arc<IdentityKey>>,
    (update, examples, metrics): (&[f32], u32, &MetricValues),
    rng: &mut ChaCha20Rng,
) -> Result<(Box<Client>, ClientMessage), String> {
    let ServerMessage::Setup(config) = &setup else {
        return Err(format!("expected the setup, got the {} message", setup.stage()));
    };
    let quantizer = Quantizer::new(config.quantization, config.modulus_bits, config.clients)
        .map_err(|e| e.to_string())?;
    let input = quantizer.encode_with_metrics(update, examples, metrics, rng).map_err(|e| e.to_string())?;
    let me = ClientId::new(client_id).ok_or("the coordinator assigned client id 0")?;
    Client::start(setup, me, identity, input, rng)
        .map(|(client, reply)| (Box::new(client), reply))
        .map_err(|e: ProtocolError| e.to_string())
}

/// 32 fresh secret bytes: from the operating system, or from `seeder`
/// where one was set.
fn fresh_seed(seeder: &mut Option<ChaCha20Rng>) -> Zeroizing<[u8; 32]> {
    let mut seed = Zeroizing::new([0u8; 32]);
    match seeder {
        Some(seeder) => seeder.fill_bytes(&mut *seed),
        None => fill_from_os(&mut seed),
    }
    seed
}

/// A fresh generator for a round (see [`fresh_seed`]).
fn round_generator(seeder: &mut Option<ChaCha20Rng>) -> ChaCha20Rng {
    ChaCha20Rng::from_seed(*fresh_seed(seeder))
}

/// The Ed25519 identity key of an RFC 8032 seed (the copy is wiped).
fn identity_from_seed(mut seed: [u8; 32]) -> IdentityKey {
    match IdentityKey::from_seed(&Secret32::from_bytes(&mut seed)) {
        Ok(key) => key,
        Err(_) => unreachable!("every 32-byte string is a valid Ed25519 seed"),
    }
}

fn fill_from_os(seed: &mut [u8; 32]) {
    // Without the operating system's randomness no mask can be secret.
    getrandom::fill(seed).unwrap_or_else(|e| panic!("no operating-system randomness: {e}"));
}

/// The 16-byte session of a selection (hex), if it names one.
fn session_id(instance: &str) -> Option<[u8; 16]> {
    let mut session = [0u8; 16];
    hex::decode_to_slice(instance, &mut session).ok().map(|()| session)
}

fn get(path: &str, bearer: Option<String>) -> Request {
    Request { method: Method::Get, path: path.into(), body: Vec::new(), content_type: None, bearer }
}

fn post_json(path: String, body: Vec<u8>, bearer: Option<String>) -> Request {
    Request { method: Method::Post, path, body, content_type: Some("application/json"), bearer }
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ParticipantError> {
    serde_json::from_slice(body).map_err(|e| ParticipantError::UnexpectedReply(e.to_string()))
}

fn rejected(status: u16, error: ApiError) -> ParticipantError {
    ParticipantError::Rejected { status, code: error.error, message: error.message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{ModelLayout, TensorSpec};

    /// The three-client semi-honest round of [`setup`].
    fn round_config(round: u64) -> cohort_crypto::RoundConfig {
        use cohort_crypto::{GraphSpec, QuantizationSpec, RoundConfig, Transform, Variant};
        let quantization = QuantizationSpec {
            clip: 1.0,
            max_weight: 100,
            transform: Transform::None,
            metrics: cohort_crypto::MetricSet::NONE,
        };
        let vector_len = Quantizer::new(quantization, 32, 3).unwrap().encoded_len(2) as u32;
        RoundConfig {
            session: [7; 16],
            round,
            variant: Variant::SemiHonest,
            clients: 3,
            identities: Vec::new(),
            graph: GraphSpec::Complete,
            threshold: 2,
            vector_len,
            modulus_bits: 32,
            quantization,
        }
    }

    /// What the task of [`setup`]'s rounds announces at enrollment.
    fn security() -> TaskSecurity {
        TaskSecurity::of_round(&round_config(1)).unwrap()
    }

    /// Test timings, and a policy that accepts the small semi-honest task
    /// of [`setup`] (and says so).
    fn config() -> ParticipantConfig {
        let policy = Policy::accepting(&security());
        assert_eq!(policy.relaxations().len(), 3, "{:?}", policy.relaxations());
        ParticipantConfig {
            max_attempts: 4,
            backoff_base_ms: 100,
            backoff_max_ms: 250,
            poll_interval_ms: 10,
            stage_timeout_ms: 1_000,
            policy,
        }
    }

    fn enrollment_reply() -> Response {
        let security = serde_json::to_value(security()).unwrap();
        json(
            201,
            serde_json::json!({
                "participant_id": "p1", "credential": "secret-credential", "expires_at": 9, "security": security,
            }),
        )
    }

    fn send(participant: &mut Participant, now: u64) -> Request {
        match participant.next(now) {
            Action::Send(request) => request,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    fn json(status: u16, body: serde_json::Value) -> Response {
        Response { status, body: body.to_string().into_bytes() }
    }

    fn enrolled() -> Participant {
        let mut p = Participant::enroll("task", "token", config()).with_seed([1; 32]);
        let request = send(&mut p, 0);
        assert_eq!((request.method, request.path.as_str()), (Method::Post, "/v1/tasks/task/enroll"));
        p.handle(0, enrollment_reply()).unwrap();
        p
    }

    /// Enrolled, selected for round 3 and handed the model.
    fn training() -> Participant {
        let mut p = enrolled();
        select_and_train(&mut p, 3);
        p
    }

    /// Checks in, is selected for `round` and handed the model.
    fn select_and_train(p: &mut Participant, round: u64) {
        assert_eq!(send(p, 0).path, "/v1/checkin");
        p.handle(0, json(200, serde_json::json!({ "status": "selected", "round": round, "client_id": 2 })))
            .unwrap();
        assert_eq!(send(p, 0).path, "/v1/model");
        let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
        let model = checkpoint::encode(&layout, &[0.5, -0.5], &Default::default()).unwrap();
        p.handle(0, Response { status: 200, body: model }).unwrap();
        match p.next(0) {
            Action::Train { round: r, model } if r == round => assert_eq!(model.weights, vec![0.5, -0.5]),
            other => panic!("expected training, got {other:?}"),
        }
    }

    #[test]
    fn failures_are_retried_with_capped_exponential_backoff() {
        let mut p = Participant::enroll("task", "token", config());
        let first = send(&mut p, 0);
        p.transport_failed(0, "connection refused").unwrap();
        assert!(matches!(p.next(50), Action::Wait(50)));
        assert_eq!(send(&mut p, 100), first, "the same request is retried");
        p.handle(100, Response { status: 503, body: vec![] }).unwrap();
        assert!(matches!(p.next(100), Action::Wait(200)));
        send(&mut p, 300);
        p.transport_failed(300, "reset").unwrap();
        assert!(matches!(p.next(300), Action::Wait(250)), "capped at backoff_max_ms");
        send(&mut p, 550);
        let error = p.transport_failed(550, "timed out").unwrap_err();
        assert_eq!(error, ParticipantError::Unreachable { attempts: 4, last: "timed out".into() });
    }

    #[test]
    fn a_rate_limited_request_waits_as_told_without_using_up_attempts() {
        let mut p = enrolled();
        let limited =
            serde_json::json!({ "error": "rate_limited", "message": "slow down", "retry_after_ms": 7_000 });
        // More refusals than max_attempts: the server is there, so no failure.
        for k in 0..10 {
            let now = k * 10_000;
            let request = send(&mut p, now);
            assert_eq!(request.path, "/v1/checkin");
            p.handle(now, json(429, limited.clone())).unwrap();
            assert!(matches!(p.next(now + 1), Action::Wait(6_999)));
        }
        // A 503 that asks for longer than the backoff gets its wait, and
        // still counts as a failed attempt.
        let unavailable =
            serde_json::json!({ "error": "unavailable", "message": "", "retry_after_ms": 5_000 });
        send(&mut p, 200_000);
        p.handle(200_000, json(503, unavailable)).unwrap();
        assert!(matches!(p.next(200_000), Action::Wait(5_000)));
        // A server that asks for an hour is held to five minutes.
        send(&mut p, 300_000);
        let hour = serde_json::json!({ "error": "rate_limited", "message": "", "retry_after_ms": 3_600_000 });
        p.handle(300_000, json(429, hour)).unwrap();
        assert!(matches!(p.next(300_000), Action::Wait(300_000)));
    }

    #[test]
    fn a_success_resets_the_attempts() {
        // More failures in all than max_attempts, but never two in a row.
        let mut p = enrolled();
        for cycle in 0..6 {
            let now = cycle * 1_000;
            send(&mut p, now);
            p.transport_failed(now, "refused").unwrap();
            send(&mut p, now + 500);
            p.handle(now + 500, json(200, serde_json::json!({ "status": "wait", "retry_after_ms": 100 })))
                .unwrap();
        }
    }

    #[test]
    fn the_credential_is_presented_but_never_printed() {
        let mut p = enrolled();
        let request = send(&mut p, 0);
        assert_eq!(request.bearer.as_deref(), Some("secret-credential"));
        assert!(!format!("{request:?}").contains("secret-credential"));
        assert!(!format!("{:?}", p.saved_state().unwrap()).contains("secret-credential"));
    }

    /// Enrollment registers a fresh Ed25519 identity with a proof that the
    /// participant holds it; the seed stays with the enrollment (and in the
    /// saved state, so that a restart keeps the identity) and is never printed.
    #[test]
    fn enrollment_registers_an_identity_it_keeps_and_never_prints() {
        let mut p = Participant::enroll("task", "token", config()).with_seed([1; 32]);
        let request = send(&mut p, 0);
        let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
        let mut public = [0u8; 32];
        hex::decode_to_slice(body["identity_key"].as_str().unwrap(), &mut public).unwrap();
        let mut proof = [0u8; 64];
        hex::decode_to_slice(body["identity_proof"].as_str().unwrap(), &mut proof).unwrap();
        cohort_crypto::signature::verify(&public, &enrollment_statement("task", &public), &proof).unwrap();
        // A retried enrollment registers the same key.
        p.handle(0, json(503, serde_json::json!({ "error": "unavailable", "message": "later" }))).unwrap();
        let again: serde_json::Value = serde_json::from_slice(&send(&mut p, 10_000_000).body).unwrap();
        assert_eq!(again["identity_key"], body["identity_key"]);
        p.handle(0, enrollment_reply()).unwrap();
        let saved = p.saved_state().unwrap();
        assert_eq!(saved.identity().unwrap().public_key(), public);
        let seed = saved.identity_seed.clone().unwrap();
        assert_eq!(seed.len(), 64);
        assert!(!format!("{saved:?}").contains(&seed));
        assert!(!format!("{p:?}").contains(&seed));
        let restored: SavedState = serde_json::from_str(&serde_json::to_string(saved).unwrap()).unwrap();
        assert_eq!(restored.identity().unwrap().public_key(), public);
    }

    #[test]
    fn updates_are_checked_and_must_come_after_training() {
        let mut p = enrolled();
        assert_eq!(
            p.submit(vec![0.0; 2], 1, MetricValues::new()),
            Err(ParticipantError::OutOfOrder("submit comes after a Train action"))
        );
        let mut p = training();
        assert!(matches!(
            p.submit(vec![0.0; 3], 1, MetricValues::new()),
            Err(ParticipantError::InvalidUpdate(_))
        ));
        assert!(matches!(
            p.submit(vec![f32::NAN, 0.0], 1, MetricValues::new()),
            Err(ParticipantError::InvalidUpdate(_))
        ));
        assert!(matches!(
            p.submit(vec![0.1, 0.0], 0, MetricValues::new()),
            Err(ParticipantError::InvalidUpdate(_))
        ));
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        assert_eq!(send(&mut p, 0).path, "/v1/round/message");
    }

    #[test]
    fn a_stalled_stage_abandons_the_round_and_the_round_is_not_rejoined() {
        let mut p = training();
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        let mut now = 0;
        loop {
            match p.next(now) {
                Action::Send(_) => p.handle(now, Response { status: 204, body: vec![] }).unwrap(),
                Action::Wait(ms) => now += ms,
                Action::RoundEnded(RoundOutcome::Abandoned { report, reason }) => {
                    assert_eq!(report.round, 3);
                    assert!(reason.contains("1000 ms"), "{reason}");
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(now > 1_000 && now < 1_100, "{now}");
        // Still listed for round 3 at check-in: wait for round 4 instead.
        assert_eq!(send(&mut p, now).path, "/v1/checkin");
        p.handle(now, json(200, serde_json::json!({ "status": "selected", "round": 3, "client_id": 2 })))
            .unwrap();
        assert!(matches!(p.next(now), Action::Wait(_)));
    }

    #[test]
    fn leaving_returns_the_outcome_at_once_and_only_mid_round() {
        let mut p = enrolled();
        assert_eq!(p.leave("paused"), None);
        let mut p = training();
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        match p.leave("paused") {
            Some(RoundOutcome::Abandoned { report, reason }) => {
                assert_eq!((report.round, reason.as_str()), (3, "paused"))
            }
            other => panic!("expected the abandoned round, got {other:?}"),
        }
        // Nothing queued: the next action is the next check-in.
        assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    }

    /// The setup of `round` for three clients over the two weights of
    /// [`training`]'s model.
    fn setup(round: u64) -> Vec<u8> {
        setup_of(round_config(round))
    }

    fn setup_of(config: cohort_crypto::RoundConfig) -> Vec<u8> {
        cohort_crypto::ServerRound::new(config).unwrap().setup_message().encode()
    }

    /// Trains for the round in progress and receives its setup; returns the
    /// seed of the generator the round's secrets come from.
    fn start_round(p: &mut Participant, round: u64) -> [u8; 32] {
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        assert_eq!(send(p, 0).path, "/v1/round/message");
        assert!(p.round_rng.is_none(), "a generator before the round's protocol started");
        p.handle(0, Response { status: 200, body: setup(round) }).unwrap();
        p.round_rng.as_ref().map(ChaCha20Rng::get_seed).expect("the round has its own generator")
    }

    #[test]
    fn every_round_has_a_fresh_generator_that_ends_with_it() {
        static_assertions::assert_impl_all!(ChaCha20Rng: zeroize::ZeroizeOnDrop);
        let mut p = training();
        let first = start_round(&mut p, 3);
        // The coordinator drops this client: the round ends, its generator with it.
        assert_eq!(send(&mut p, 0).path, "/v1/round/message");
        p.handle(0, Response { status: 410, body: Vec::new() }).unwrap();
        assert!(matches!(p.next(0), Action::RoundEnded(RoundOutcome::Dropped(_))));
        assert!(p.round_rng.is_none(), "the round's generator outlived the round");
        // The next round starts from a generator of its own.
        select_and_train(&mut p, 4);
        let second = start_round(&mut p, 4);
        assert_ne!(first, second, "two rounds share a generator");
    }

    #[test]
    fn garbage_from_the_server_ends_the_round_not_the_participant() {
        let mut p = training();
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        send(&mut p, 0);
        p.handle(0, Response { status: 200, body: b"not a server message".to_vec() }).unwrap();
        assert!(matches!(p.next(0), Action::RoundEnded(RoundOutcome::Abandoned { .. })));
        assert_eq!(send(&mut p, 0).path, "/v1/checkin");
        p.handle(0, Response { status: 200, body: b"{\"status\": \"dancing\"}".to_vec() }).unwrap_err();
    }

    #[test]
    fn an_expired_credential_enrolls_again_and_a_refused_token_is_fatal() {
        let mut p = enrolled();
        send(&mut p, 0);
        p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "expired" }))).unwrap();
        assert_eq!(send(&mut p, 0).path, "/v1/tasks/task/enroll");
        let error =
            p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "bad token" })));
        assert_eq!(error, Err(ParticipantError::Unauthorized("bad token".into())));
        // Without the enrollment token a resumed participant cannot recover.
        let saved = enrolled().saved_state().unwrap().clone();
        let mut p = Participant::resume(saved, None, config());
        send(&mut p, 0);
        assert!(matches!(
            p.handle(0, json(401, serde_json::json!({}))),
            Err(ParticipantError::Unauthorized(_))
        ));
    }

    #[test]
    fn a_task_below_the_policy_is_refused_at_enrollment_and_nothing_is_kept() {
        // The default policy: the small semi-honest task is below it.
        let strict = ParticipantConfig { policy: Policy::default(), ..config() };
        let mut p = Participant::enroll("task", "token", strict);
        send(&mut p, 0);
        let refused = p.handle(0, enrollment_reply());
        assert_eq!(refused, Err(ParticipantError::Policy(PolicyViolation::SemiHonest)));
        let message = refused.unwrap_err().to_string();
        assert!(message.contains("rule variant"), "{message}");
        assert!(p.saved_state().is_none());
        assert!(matches!(p.next(0), Action::Finished));
        // A reply without the task's parameters is no enrollment.
        let mut p = Participant::enroll("task", "token", config());
        send(&mut p, 0);
        let bare = serde_json::json!({ "participant_id": "p1", "credential": "c", "expires_at": 9 });
        assert!(matches!(p.handle(0, json(201, bare)), Err(ParticipantError::UnexpectedReply(_))));
    }

    #[test]
    fn a_round_that_changes_a_pinned_parameter_is_refused_before_anything_is_drawn() {
        let mut p = training();
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        send(&mut p, 0);
        let mut changed = round_config(3);
        changed.modulus_bits = 24;
        let refused = p.handle(0, Response { status: 200, body: setup_of(changed) });
        let Err(ParticipantError::Policy(PolicyViolation::Changed { parameter: "ring bits", .. })) = refused
        else {
            panic!("not refused: {refused:?}");
        };
        assert!(p.round_rng.is_none(), "the round's secrets were drawn");
        assert!(matches!(p.next(0), Action::Finished), "the participant went on");
        assert_eq!(p.saved_state().unwrap().last_contributed_round, 0);
    }

    #[test]
    fn a_round_replayed_or_not_as_selected_is_refused_and_the_next_one_joined() {
        let mut p = training();
        p.saved.as_mut().unwrap().last_contributed_round = 3;
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        send(&mut p, 0);
        p.handle(0, Response { status: 200, body: setup(3) }).unwrap();
        match p.next(0) {
            Action::RoundEnded(RoundOutcome::Refused { report, violation }) => {
                assert_eq!(report.round, 3);
                assert_eq!(violation, PolicyViolation::Replayed { round: 3, last: 3 });
                assert_eq!(violation.rule(), "replay");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(p.round_rng.is_none());
        // Selected for round 4 but handed round 3's setup.
        select_and_train(&mut p, 4);
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        send(&mut p, 0);
        p.handle(0, Response { status: 200, body: setup(3) }).unwrap();
        assert!(matches!(
            p.next(0),
            Action::RoundEnded(RoundOutcome::Refused {
                violation: PolicyViolation::WrongRound { expected: 4, got: 3 },
                ..
            })
        ));
        // A setup whose session is not the one of the selection.
        assert_eq!(send(&mut p, 0).path, "/v1/checkin");
        let selected = serde_json::json!({
            "status": "selected", "round": 5, "client_id": 2, "session": hex::encode([8u8; 16]),
        });
        p.handle(0, json(200, selected)).unwrap();
        send(&mut p, 0);
        let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
        let model = checkpoint::encode(&layout, &[0.5, -0.5], &Default::default()).unwrap();
        p.handle(0, Response { status: 200, body: model }).unwrap();
        assert!(matches!(p.next(0), Action::Train { round: 5, .. }));
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        send(&mut p, 0);
        p.handle(0, Response { status: 200, body: setup(5) }).unwrap();
        assert!(matches!(
            p.next(0),
            Action::RoundEnded(RoundOutcome::Refused { violation: PolicyViolation::WrongSession, .. })
        ));
        // Round 6, as selected: the participant advertises its keys.
        select_and_train(&mut p, 6);
        p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
        send(&mut p, 0);
        p.handle(0, Response { status: 200, body: setup(6) }).unwrap();
        assert_eq!(p.posting(), Some(Stage::AdvertiseKeys));
    }

    #[test]
    fn a_renewed_enrollment_keeps_the_pinned_parameters_and_contributions() {
        let mut p = enrolled();
        p.saved.as_mut().unwrap().last_contributed_round = 7;
        send(&mut p, 0);
        p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "expired" }))).unwrap();
        assert_eq!(send(&mut p, 0).path, "/v1/tasks/task/enroll");
        p.handle(0, enrollment_reply()).unwrap();
        assert_eq!(p.saved_state().unwrap().last_contributed_round, 7);
        // A renewal that announces other parameters is refused.
        send(&mut p, 0);
        p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "expired" }))).unwrap();
        send(&mut p, 0);
        let mut other = security();
        other.modulus_bits = 16;
        let reply = serde_json::json!({
            "participant_id": "p2", "credential": "c2", "expires_at": 9, "security": serde_json::to_value(other).unwrap(),
        });
        let refused = p.handle(0, json(201, reply));
        assert!(
            matches!(
                refused,
                Err(ParticipantError::Policy(PolicyViolation::Changed { parameter: "ring bits", .. }))
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn a_response_without_a_request_is_refused() {
        let mut p = Participant::enroll("task", "token", config());
        assert!(matches!(p.handle(0, Response::default()), Err(ParticipantError::OutOfOrder(_))));
    }
}
