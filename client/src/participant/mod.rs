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

use chacha20::ChaCha20Rng;
use cohort_crypto::Client;
use cohort_crypto::client::{PendingStep, Work};
use cohort_crypto::signature::enrollment_statement;
use rand_core::SeedableRng;
use zeroize::Zeroizing;

use crate::checkpoint::{self, Checkpoint};

pub use cohort_crypto::Stage;
pub use cohort_crypto::policy::{Collusion, Policy, PolicyViolation, PrivacyBudget, TaskSecurity};
pub use cohort_crypto::quantize::QuantizeError;
pub use cohort_crypto::{Metric, MetricValues};

#[cfg(feature = "adversary")]
pub mod adversary;
mod http;
mod outcome;
mod round;
mod state;
#[cfg(test)]
mod tests;

pub use http::{Method, Request, Response};
pub use outcome::{Action, DEFAULT_WAIT_MS, ParticipantConfig, ParticipantError, RoundOutcome, RoundReport};
pub use state::SavedState;

use http::*;
use state::*;

/// The update of a round before the protocol starts, or the protocol.
enum Protocol {
    Pending { update: Zeroizing<Vec<f32>>, examples: u32 },
    Running(Box<Client>),
}

impl Protocol {
    /// Whether the client has a stage message to send after the one it
    /// has just made (false after the round's last, its unmasking).
    fn goes_on(&self) -> bool {
        matches!(self, Protocol::Running(client) if !matches!(**client, Client::Finished))
    }
}

/// What the model being downloaded and trained is for.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// The round the client was selected for, and its id in the roster.
    Round { round: u64, client_id: u32 },
    /// An async task: the update joins the next group that forms; `base`
    /// is the version of the model downloaded (0 until it is).
    Buffer { base: u64 },
}

/// How often a coordinator that does not know the task enrolled in is
/// asked again.
const TASK_MISSING_RETRY_MS: u64 = 1_000;

enum Phase {
    Enroll,
    CheckIn,
    Model {
        slot: Slot,
    },
    Training {
        slot: Slot,
        model: Option<Box<Checkpoint>>,
        parameters: usize,
    },
    /// An async task's finished update, trained from version `base`,
    /// waiting for a group: the client checks in with it until a group
    /// takes it or the coordinator says it is too stale.
    Ready {
        base: u64,
        protocol: Protocol,
    },
    Fetch {
        round: u64,
        client_id: u32,
        protocol: Protocol,
        since: Option<u64>,
    },
    /// A stage's agreements or key streams, left to the host
    /// ([`Participant::set_host_crypto`]).
    HostWork {
        round: u64,
        client_id: u32,
        pending: Box<PendingStep>,
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
    /// Since when the coordinator says it does not know the task enrolled
    /// in (see [`ParticipantConfig::task_missing_ms`]).
    task_missing_since: Option<u64>,
    /// Since when the coordinator answers `503 unavailable`.
    unavailable_since: Option<u64>,
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
    /// The digest of the model the update in progress is trained from:
    /// recorded in the saved state when its masked input is sent.
    trained_on: Option<[u8; 16]>,
    /// The ε this participant will have spent once the update in progress
    /// is sent (a task with differential privacy).
    spending: Option<f64>,
    events: VecDeque<Action>,
    /// Whether a stage's agreements and key streams go to the host
    /// ([`Participant::set_host_crypto`]).
    host_crypto: bool,
    /// How many steps have waited for host work: names the one pending.
    host_steps: u64,
    /// A cheating participant's attack (feature `adversary`: tests and
    /// measurements).
    #[cfg(feature = "adversary")]
    attack: Option<adversary::Attack>,
}

impl std::fmt::Debug for Participant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Participant").field("task_id", &self.task_id).finish_non_exhaustive()
    }
}

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
            task_missing_since: None,
            unavailable_since: None,
            wait_until: 0,
            in_flight: false,
            report: RoundReport::default(),
            last_joined,
            selected_session: None,
            expired: None,
            metrics: MetricValues::new(),
            plaintext_metrics: false,
            trained_on: None,
            spending: None,
            events: VecDeque::new(),
            host_crypto: false,
            host_steps: 0,
            #[cfg(feature = "adversary")]
            attack: None,
        }
    }

    /// Whether the participant leaves each stage's X25519 agreements and
    /// mask key streams to its driver (off by default): [`next`](Self::next) then returns
    /// [`Action::HostWork`] where the step needs them, and the driver
    /// computes what [`host_work`](Self::host_work) names (the browser with
    /// WebCrypto), hands it back ([`agreed`](Self::agreed),
    /// [`add_key_stream`](Self::add_key_stream)) and calls
    /// [`complete_host_work`](Self::complete_host_work), which computes
    /// anything left out. The messages sent are those of the default,
    /// which computes everything in place (see
    /// [`cohort_crypto::client::PendingStep`]).
    pub fn set_host_crypto(&mut self, on: bool) {
        self.host_crypto = on;
    }

    /// The work the driver was asked for with [`Action::HostWork`], while
    /// it is pending.
    pub fn host_work(&self) -> Option<Work<'_>> {
        match &self.phase {
            Phase::HostWork { pending, .. } => Some(pending.work()),
            _ => None,
        }
    }

    /// Which step the pending host work is (a number that changes with
    /// every step that waits for the driver), while there is one: a
    /// driver whose work outlived its step (a pause, a leave) can tell.
    pub fn host_step(&self) -> Option<u64> {
        matches!(self.phase, Phase::HostWork { .. }).then_some(self.host_steps)
    }

    /// Hands the driver's agreements back, one per peer of
    /// [`Work::Agreements`] in order (`None` for one it has not
    /// computed), and goes on with the step. Refused, the step kept, when
    /// it waits for key streams.
    pub fn agreed(&mut self, shared: Vec<Option<cohort_crypto::Secret32>>) -> Result<(), ParticipantError> {
        if !matches!(self.host_work(), Some(Work::Agreements { .. })) {
            return Err(ParticipantError::OutOfOrder("agreements without a step that waits for them"));
        }
        self.continue_host_work(|pending, rng| pending.agreed(shared, rng))
    }

    /// Adds the driver's key stream of mask `index` of
    /// [`Work::KeyStreams`] (little-endian 32-bit words) to the input.
    pub fn add_key_stream(&mut self, index: usize, stream: &[u32]) -> Result<(), ParticipantError> {
        match &mut self.phase {
            Phase::HostWork { pending, .. } => pending
                .add_key_stream(index, stream)
                .map_err(|_| ParticipantError::OutOfOrder("a key stream the step does not take")),
            _ => Err(ParticipantError::OutOfOrder("a key stream without host work")),
        }
    }

    /// Completes the pending step, computing what the driver left out.
    pub fn complete_host_work(&mut self) -> Result<(), ParticipantError> {
        self.continue_host_work(|pending, rng| pending.complete(rng))
    }

    /// A participant that cheats with `attack` in every round (feature
    /// `adversary`: the tests and measurements of input validation).
    #[cfg(feature = "adversary")]
    pub fn cheating(mut self, attack: adversary::Attack) -> Self {
        self.attack = Some(attack);
        self
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
                post_json(routes::enroll(&self.task_id), body.into_bytes(), None)
            }
            Phase::CheckIn => {
                post_json(routes::held(routes::CHECK_IN, self.config.wait_ms), Vec::new(), bearer)
            }
            Phase::Ready { base, .. } => post_json(
                routes::held(&routes::check_in_trained(*base), self.config.wait_ms),
                Vec::new(),
                bearer,
            ),
            Phase::Model { .. } => get(routes::MODEL, bearer),
            Phase::Training { slot, model, .. } => {
                let round = match *slot {
                    Slot::Round { round, .. } => round,
                    Slot::Buffer { base } => base,
                };
                let nonce = self.saved.as_ref().map_or(0, |saved| saved.contributions);
                return match model.take() {
                    Some(model) => Action::Train { round, nonce, model },
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
                get(&routes::held(routes::ROUND_MESSAGE, self.config.wait_ms), bearer)
            }
            Phase::Post { body, protocol, .. } => Request {
                method: Method::Post,
                // Asks for the next stage message in the same request,
                // unless this message is the round's last.
                path: if protocol.goes_on() {
                    routes::held(routes::ROUND_MESSAGE, self.config.wait_ms)
                } else {
                    routes::ROUND_MESSAGE.into()
                },
                body: body.to_vec(),
                content_type: Some(SECAGG_CONTENT_TYPE),
                bearer,
            },
            Phase::Report { body, .. } => post_json(routes::METRICS.into(), body.clone(), bearer),
            Phase::HostWork { .. } => return Action::HostWork,
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

    /// The coordinator does not know the task this participant enrolled
    /// in: asked again in `phase` (a replica that
    /// lost the task's lead may answer so while another takes it over),
    /// every [`TASK_MISSING_RETRY_MS`] until
    /// [`ParticipantConfig::task_missing_ms`] have passed since it first
    /// said so.
    fn task_missing(&mut self, now: u64, phase: Phase) -> Result<(), ParticipantError> {
        if self.window_closed(now, |p| &mut p.task_missing_since).is_some() {
            return Err(ParticipantError::TaskNotFound(self.task_id.clone()));
        }
        self.phase = phase;
        self.wait_until = now + TASK_MISSING_RETRY_MS.min(self.config.backoff_max_ms);
        Ok(())
    }

    /// The coordinator answered `503 unavailable` (its lead of the task is
    /// moving between replicas, or its database is away): the request is
    /// sent again after the wait it asks for (at least the first backoff),
    /// for up to [`ParticipantConfig::task_missing_ms`] since the first
    /// such answer in a row, whatever `max_attempts` is; then
    /// [`ParticipantError::Unreachable`].
    fn unavailable(&mut self, now: u64, asked: Option<u64>) -> Result<(), ParticipantError> {
        if let Some(lasted) = self.window_closed(now, |p| &mut p.unavailable_since) {
            return Err(ParticipantError::Unreachable {
                attempts: self.attempts + 1,
                last: format!("HTTP 503: unavailable for {lasted} ms"),
            });
        }
        let wait = asked.unwrap_or(0).max(self.config.backoff_base_ms).min(MAX_RETRY_AFTER_MS);
        self.wait_until = now + wait;
        Ok(())
    }

    /// Starts the window `since` picks at `now` if it is not open yet;
    /// how long it has lasted once that reaches
    /// [`ParticipantConfig::task_missing_ms`].
    fn window_closed(&mut self, now: u64, since: impl Fn(&mut Self) -> &mut Option<u64>) -> Option<u64> {
        let lasted = now.saturating_sub(*since(self).get_or_insert(now));
        (lasted >= self.config.task_missing_ms).then_some(lasted)
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
        let refusal = serde_json::from_slice::<ErrorBody>(&response.body).ok();
        if status == 503 && refusal.as_ref().is_some_and(|e| e.error == ErrorCode::Unavailable) {
            // A lead moving between replicas, a database away: asked again
            // for a bounded time, not a number of attempts.
            return self.unavailable(now, refusal.and_then(|e| e.retry_after_ms));
        }
        self.unavailable_since = None;
        if status == 429 || status >= 500 {
            let asked = refusal.and_then(|e| e.retry_after_ms);
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
        if status != 404 {
            self.task_missing_since = None;
        }
        self.attempts = 0;
        if matches!(self.phase, Phase::Model { .. } | Phase::Fetch { .. } | Phase::Post { .. }) {
            self.report.bytes_down += response.body.len() as u64;
        }
        let error = || http::refusal(&response.body);
        if status == 401 {
            return self.unauthorized(error().message);
        }
        if status == 400
            && self.config.wait_ms > 0
            && matches!(self.phase, Phase::CheckIn | Phase::Ready { .. })
            && error().error == ErrorCode::InvalidRound
        {
            // A coordinator from before held requests refuses a check-in's
            // `wait_ms`: ask it again without one, and poll from now on.
            self.config.wait_ms = 0;
            return Ok(());
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
                        contributions: expired.as_ref().map_or(0, |e| e.contributions),
                        contributed_models: expired
                            .as_ref()
                            .map(|e| e.contributed_models.clone())
                            .unwrap_or_default(),
                        privacy_spent: expired.as_ref().and_then(|e| e.privacy_spent),
                    });
                    self.phase = Phase::CheckIn;
                }
                // Not the coordinator's 404 (a web server's or a proxy's
                // page): the server URL is wrong, not the task.
                404 if error().error == ErrorCode::Unknown => {
                    return Err(ParticipantError::UnexpectedReply(format!(
                        "HTTP 404 from a server that is not a Cohort coordinator (check the server URL): {}",
                        error().message
                    )));
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
                    CheckIn::Selected { round, client_id, attempt, session, plaintext_metrics, .. } => {
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
                            self.phase = Phase::Model { slot: Slot::Round { round, client_id } };
                        }
                    }
                    CheckIn::Train { .. } => self.phase = Phase::Model { slot: Slot::Buffer { base: 0 } },
                    // Only a client with an update hears this; this one has none.
                    CheckIn::Stale { .. } => self.phase = Phase::CheckIn,
                    CheckIn::Finished => {}
                },
                404 => return self.task_missing(now, Phase::CheckIn),
                _ => return Err(rejected(status, error())),
            },
            Phase::Ready { base, protocol } => match status {
                200 => self.on_ready_reply(now, base, protocol, parse_json::<CheckIn>(&response.body)?)?,
                404 => return self.task_missing(now, Phase::Ready { base, protocol }),
                _ => return Err(rejected(status, error())),
            },
            Phase::Model { slot } => match status {
                200 => {
                    let model = checkpoint::decode(&response.body)
                        .map_err(|e| ParticipantError::UnexpectedReply(format!("global model: {e}")))?;
                    let slot = match slot {
                        Slot::Round { .. } => slot,
                        // The version it trains from is the one it got.
                        Slot::Buffer { .. } => Slot::Buffer {
                            base: model
                                .metadata
                                .get("cohort.round")
                                .and_then(|v| v.parse().ok())
                                .ok_or_else(|| {
                                    ParticipantError::UnexpectedReply("a model without its version".into())
                                })?,
                        },
                    };
                    if let Slot::Buffer { base } = slot {
                        self.report = RoundReport { round: base, ..RoundReport::default() };
                    }
                    let digest = model.digest();
                    if self.saved.as_ref().is_some_and(|saved| saved.contributed_to(&digest)) {
                        // Nothing of this round is drawn or sent: wait for
                        // a model this client has not sent an update of.
                        let violation = PolicyViolation::ModelReused { digest: hex::encode(digest) };
                        self.end_round(RoundOutcome::Refused { report: self.report, violation });
                        self.wait_until = now + self.config.poll_interval_ms * 5;
                        return Ok(());
                    }
                    // The client's own privacy budget: no training for an
                    // update it could not send.
                    if let Some(saved) = &self.saved
                        && let Some(security) = &saved.security
                    {
                        self.spending = self
                            .config
                            .policy
                            .check_budget(security, model.weights.len(), saved.contributions)
                            .map_err(ParticipantError::Policy)?;
                    }
                    self.trained_on = Some(digest);
                    let parameters = model.weights.len();
                    let model = Some(Box::new(model));
                    self.phase = Phase::Training { slot, model, parameters };
                }
                _ => self.abandon(error().message),
            },
            Phase::Fetch { round, client_id, protocol, since } => match status {
                200 => self.on_server_message(round, client_id, protocol, &response.body)?,
                204 => {
                    self.wait_until = now + self.config.poll_interval_ms;
                    self.phase = Phase::Fetch { round, client_id, protocol, since };
                }
                410 => self.end_round(RoundOutcome::Dropped { report: self.report, reason: error().message }),
                _ => self.abandon(error().message),
            },
            Phase::Post { round, client_id, protocol, body } => match status {
                // Accepted, with the next stage message (the post asked
                // to be held for it): as a fetch would have brought it.
                200 if protocol.goes_on() => {
                    self.on_server_message(round, client_id, protocol, &response.body)?;
                }
                // Accepted; a body after the round's last message, which
                // asks for nothing, is ignored.
                200 | 202 => self.after_post(round, client_id, protocol),
                // The message arrived already: a retried post whose first
                // try arrived, or one a balancer sent again after its first
                // answer was lost.
                409 if error().error == ErrorCode::Duplicate => self.after_post(round, client_id, protocol),
                410 => self.end_round(RoundOutcome::Dropped { report: self.report, reason: error().message }),
                // The stage closed meanwhile: either this message missed
                // it, or it is a retry of one that was accepted and whose
                // answer (held until the stage closed) was lost. The fetch
                // tells which: the next stage's message, or `410`. After
                // the round's last message there is nothing to fetch.
                409 if error().error == ErrorCode::OutOfPhase && protocol.goes_on() => {
                    self.after_post(round, client_id, protocol);
                }
                409 if matches!(error().error, ErrorCode::OutOfPhase | ErrorCode::NotSelected) => {
                    self.end_round(RoundOutcome::Dropped { report: self.report, reason: error().message })
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
            phase @ Phase::HostWork { .. } => {
                self.phase = phase;
                return Err(ParticipantError::OutOfOrder("no request while the host computes"));
            }
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
        let Phase::Training { slot, model: None, parameters } = self.phase else {
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
        self.phase = match slot {
            Slot::Round { round, client_id } => Phase::Fetch { round, client_id, protocol, since: None },
            Slot::Buffer { base } => Phase::Ready { base, protocol },
        };
        Ok(())
    }

    /// An async task's reply to a check-in with a finished update: a group
    /// took it (weighted for its staleness), wait for one, or it is stale.
    fn on_ready_reply(
        &mut self,
        now: u64,
        base: u64,
        protocol: Protocol,
        reply: CheckIn,
    ) -> Result<(), ParticipantError> {
        match reply {
            CheckIn::Wait { retry_after_ms } => {
                self.wait_until = now + retry_after_ms;
                self.phase = Phase::Ready { base, protocol };
            }
            CheckIn::Selected { round, client_id, attempt, session, plaintext_metrics, staleness_weight } => {
                let instance = session.unwrap_or_else(|| format!("{round}/{attempt}"));
                let Protocol::Pending { mut update, examples } = protocol else {
                    return Err(ParticipantError::OutOfOrder("an update already in a protocol"));
                };
                let weight = staleness_weight.unwrap_or(1.0);
                if self.last_joined.as_deref() == Some(instance.as_str()) || !(weight > 0.0 && weight <= 1.0)
                {
                    // A group it already took part in, or a weight that is
                    // no discount: nothing of this update is sent.
                    self.metrics = MetricValues::new();
                    let reason =
                        format!("the coordinator offered group {round} with staleness weight {weight}");
                    self.end_round(RoundOutcome::Abandoned { report: self.report, reason });
                    return Ok(());
                }
                update.iter_mut().for_each(|v| *v *= weight as f32);
                // The model's download counts towards this group.
                self.report.round = round;
                self.selected_session = session_id(&instance);
                self.plaintext_metrics = plaintext_metrics;
                self.last_joined = Some(instance);
                let protocol = Protocol::Pending { update, examples };
                self.phase = Phase::Fetch { round, client_id, protocol, since: None };
            }
            CheckIn::Stale { version, max_staleness } => {
                drop(protocol);
                self.metrics = MetricValues::new();
                let reason = format!(
                    "the update trained from version {base} is more than {max_staleness} behind version {version}"
                );
                self.end_round(RoundOutcome::Abandoned { report: self.report, reason });
            }
            CheckIn::Train { .. } => {
                // The coordinator no longer waits for this update: train again.
                drop(protocol);
                self.metrics = MetricValues::new();
                self.phase = Phase::Model { slot: Slot::Buffer { base: 0 } };
            }
            CheckIn::Finished => {}
        }
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

    /// The request that tells the coordinator this participant is leaving
    /// (`POST /v1/leave`): it is no longer selected, and no stage of a
    /// round it is in waits for it, so a round it leaves goes on (or is
    /// given up) at once instead of at its deadline. `None` before it
    /// enrolled. A driver sends it as it stops for good (a closing browser
    /// tab: a `keepalive` fetch); the reply does not matter. Checking in
    /// again makes the participant selectable again.
    pub fn leave_request(&self) -> Option<Request> {
        let bearer = self.saved.as_ref().map(|s| s.credential.clone())?;
        Some(http::post_json(routes::LEAVE.to_string(), Vec::new(), Some(bearer)))
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
}
