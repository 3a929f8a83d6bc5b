//! The coordinator's core for one task: selecting clients, running the
//! secure-aggregation round with per-stage deadlines, and turning the
//! aggregate into the next global model.
//!
//! It is synchronous and takes the time as an argument, so every rule is
//! testable without sockets or timers; the [`crate::coordinator`] actor
//! drives it. A finished round becomes a [`Completion`] that the caller
//! persists first and [`TaskEngine::commit`]s after: the in-memory model
//! never runs ahead of what is stored.

use std::collections::{BTreeMap, HashMap};

use cohort_crypto::graph::GraphSpec;
use cohort_crypto::{
    Advanced, Aggregate, ClientId, ClientMessage, ProtocolError, Quantizer, RoundConfig, ServerRound, Stage,
    Variant,
};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, ModelLayout};
use crate::optimizer::OptimizerState;
use crate::spec::TaskSpec;
use crate::store::{CheckpointRecord, RoundRecord, TaskStatus};
use cohort_crypto::policy::{GraphKind, TaskSecurity};

/// A check-in counts towards selection for this long.
pub const CHECK_IN_TTL_MS: i64 = 60_000;

/// Completed rounds whose members may still report metrics.
pub const REPORTABLE_ROUNDS: usize = 2;

/// What a client is told when it checks in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum CheckIn {
    /// Not selected (yet); check in again after this long.
    Wait {
        /// Suggested delay.
        retry_after_ms: u64,
    },
    /// Selected for the round in progress.
    Selected {
        /// Round number.
        round: u64,
        /// The client's id in this round's roster.
        client_id: u32,
        /// Attempt at this round: an aborted round runs again with the
        /// same number and a new attempt, which earlier members may join.
        attempt: u32,
        /// The round's session id (hex): unique to this attempt, also
        /// across restarts of the coordinator.
        session: String,
        /// The task (semi-honest only) also takes each client's metrics in
        /// the clear.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        plaintext_metrics: bool,
    },
    /// The task is over; stop checking in.
    Finished,
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
}

/// One stage's record in the round metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageMetrics {
    /// Stage name.
    pub stage: String,
    /// Clients allowed to send.
    pub eligible: usize,
    /// Clients that sent.
    pub received: usize,
    /// Eligible clients that did not send.
    pub dropouts: usize,
    /// How long the stage lasted.
    pub duration_ms: i64,
}

/// Metrics of one round, stored with it as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
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
    /// Upload per selected client over the float32 update's size.
    pub compression_ratio: f64,
    /// Revealed shares that did not match their owner's commitment; the
    /// round was unmasked without them.
    #[serde(default)]
    pub faulty_shares: u32,
    /// Per metric, its mean over the survivors that reported it, from the
    /// sum under the masks: never one client's value.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub client_means: BTreeMap<String, ClientMean>,
}

/// A metric's mean over a round's survivors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ClientMean {
    /// Σ of the reported values over the number of reporters.
    pub mean: f64,
    /// Survivors that reported the metric.
    pub clients: u32,
}

/// What the admin API shows of the round in progress: counts, times and
/// traffic only; nothing about any one client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundProgress {
    /// Round number.
    pub round: u64,
    /// Attempt of this round.
    pub attempt: u32,
    /// Current stage.
    pub stage: String,
    /// Clients selected.
    pub selected: usize,
    /// Clients allowed to send in the current stage.
    pub eligible: usize,
    /// Of those, clients that sent.
    pub received: usize,
    /// Round start (Unix ms).
    pub started_at: i64,
    /// Current stage's start (Unix ms).
    pub stage_started_at: i64,
    /// Current stage's deadline (Unix ms).
    pub deadline: i64,
    /// Stages closed so far.
    pub stages: Vec<StageMetrics>,
    /// Bytes received from clients so far.
    pub bytes_up: u64,
    /// Bytes sent to clients so far.
    pub bytes_down: u64,
}

/// The round in progress.
struct ActiveRound {
    number: u64,
    session: [u8; 16],
    started_at: i64,
    stage_started_at: i64,
    deadline: i64,
    roster: Vec<String>,
    ids: HashMap<String, ClientId>,
    /// `None` while the final stage is being unmasked off the runtime.
    server: Option<ServerRound>,
    metrics: RoundMetrics,
    /// This round's quantizer (its transform seed is the round's).
    quantizer: Quantizer,
    bytes_up: u64,
    bytes_down: u64,
}

/// The final stage, to be unmasked off the async runtime.
pub struct UnmaskJob {
    /// Task the round belongs to.
    pub task_id: String,
    /// Round number.
    pub round: u64,
    server: ServerRound,
}

impl UnmaskJob {
    /// Reconstructs the secrets and removes the masks (CPU-heavy).
    pub fn run(self) -> Result<Aggregate, ProtocolError> {
        match self.server.advance()? {
            Advanced::Done(aggregate) => Ok(aggregate),
            Advanced::Next(_) => Err(ProtocolError::Finished),
        }
    }
}

/// A computed round, to persist before [`TaskEngine::commit`].
#[derive(Debug, Clone)]
pub struct Completion {
    /// The round record.
    pub round: RoundRecord,
    /// The new checkpoint.
    pub checkpoint: CheckpointRecord,
    weights: Vec<f32>,
    optimizer_state: OptimizerState,
    stages: Vec<StageMetrics>,
    faulty_shares: Vec<(String, String)>,
    client_means: BTreeMap<String, ClientMean>,
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

/// What [`TaskEngine::tick`] did.
#[derive(Debug, Default)]
pub struct TickOutcome {
    /// A round was started.
    pub started: Option<u64>,
    /// A round was aborted (too few clients), with the failing stage.
    pub aborted: Option<(u64, String)>,
    /// The final stage is ready to be unmasked.
    pub unmask: Option<UnmaskJob>,
}

impl core::fmt::Debug for UnmaskJob {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("UnmaskJob").field("task_id", &self.task_id).field("round", &self.round).finish()
    }
}

/// One task's coordinator state.
pub struct TaskEngine {
    task_id: String,
    spec: TaskSpec,
    /// The security parameters every round repeats (derived once, at load).
    security: TaskSecurity,
    status: TaskStatus,
    weights: Vec<f32>,
    optimizer_state: OptimizerState,
    checkpoint_bytes: Vec<u8>,
    completed: u64,
    attempts: u32,
    /// Participants that checked in, with the time and the identity key
    /// they enrolled with. In the active variant only those with a key can
    /// be selected, so only those are kept.
    checked_in: BTreeMap<String, (i64, Option<[u8; 32]>)>,
    round: Option<ActiveRound>,
    /// The rosters of the last completed rounds, newest last.
    recent: std::collections::VecDeque<(u64, std::collections::HashSet<String>)>,
    rng: rand_chacha::ChaCha20Rng,
}

fn stage_name(stage: Stage) -> String {
    stage.to_string()
}

impl TaskEngine {
    /// Restores a task from its spec, status and newest checkpoint.
    pub fn new(
        task_id: String,
        spec: TaskSpec,
        status: TaskStatus,
        latest: &CheckpointRecord,
    ) -> Result<Self, String> {
        let security = spec.security().map_err(|e| e.to_string())?;
        let decoded = checkpoint::decode(&latest.model).map_err(|e| e.to_string())?;
        if decoded.layout != spec.model.layout {
            return Err("the checkpoint does not match the task's model layout".into());
        }
        let optimizer_state: OptimizerState =
            serde_json::from_slice(&latest.optimizer_state).map_err(|e| e.to_string())?;
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| e.to_string())?;
        Ok(Self {
            task_id,
            security,
            status,
            weights: decoded.weights,
            optimizer_state,
            checkpoint_bytes: latest.model.clone(),
            completed: latest.round as u64,
            attempts: 0,
            checked_in: BTreeMap::new(),
            round: None,
            recent: std::collections::VecDeque::new(),
            rng: rand_core::SeedableRng::from_seed(seed),
            spec,
        })
    }

    /// The initial checkpoint of a new task (round 0).
    pub fn initial_checkpoint(task_id: &str, spec: &TaskSpec, now: i64) -> Result<CheckpointRecord, String> {
        let weights = spec.initial_weights();
        let model = encode_model(task_id, &spec.model.layout, &weights, 0)?;
        let state = spec.optimizer.initial_state(weights.len());
        Ok(CheckpointRecord {
            task_id: task_id.to_string(),
            round: 0,
            model,
            optimizer_state: serde_json::to_vec(&state).map_err(|e| e.to_string())?,
            created_at: now,
        })
    }

    /// The task's status.
    pub fn status(&self) -> TaskStatus {
        self.status
    }

    /// Completed-round checkpoints to keep.
    pub fn retention(&self) -> u32 {
        self.spec.checkpoint_retention
    }

    /// Rounds completed so far.
    pub fn completed_rounds(&self) -> u64 {
        self.completed
    }

    /// The current global model, as a safetensors checkpoint.
    pub fn model(&self) -> &[u8] {
        &self.checkpoint_bytes
    }

    /// Parameters of the task's model.
    pub fn parameters(&self) -> usize {
        self.weights.len()
    }

    /// The current global weights.
    pub fn weights(&self) -> &[f32] {
        &self.weights
    }

    /// The round in progress and its stage, if any.
    pub fn current_round(&self) -> Option<(u64, Stage)> {
        self.round.as_ref().map(|r| (r.number, r.server.as_ref().map_or(Stage::Unmasking, |s| s.stage())))
    }

    /// The round in progress, for the admin API.
    pub fn progress(&self) -> Option<RoundProgress> {
        let round = self.round.as_ref()?;
        let (stage, eligible, received) = match &round.server {
            Some(server) => (server.stage(), server.eligible().len(), server.received()),
            None => (Stage::Unmasking, 0, 0),
        };
        Some(RoundProgress {
            round: round.number,
            attempt: round.metrics.attempt,
            stage: stage_name(stage),
            selected: round.roster.len(),
            eligible,
            received,
            started_at: round.started_at,
            stage_started_at: round.stage_started_at,
            deadline: round.deadline,
            stages: round.metrics.stages.clone(),
            bytes_up: round.bytes_up,
            bytes_down: round.bytes_down,
        })
    }

    /// Clients that checked in recently enough to be selected.
    pub fn available(&self, now: i64) -> usize {
        self.checked_in.values().filter(|(seen, _)| now - *seen <= CHECK_IN_TTL_MS).count()
    }

    /// The protocol variant of the task's rounds.
    pub fn variant(&self) -> Variant {
        self.security.variant
    }

    /// The security parameters every round of the task announces, which
    /// participants pin at enrollment.
    pub fn security(&self) -> TaskSecurity {
        self.security
    }

    /// Changes the status (pause, resume, stop). A paused or stopped task
    /// abandons its round in progress.
    pub fn set_status(&mut self, status: TaskStatus) {
        self.status = status;
        if status != TaskStatus::Active {
            self.round = None;
        }
    }

    /// Records a check-in and tells the client whether it is selected.
    /// `identity` is the key the participant enrolled with; in the active
    /// variant a participant without one is never selected.
    pub fn check_in(&mut self, participant: &str, identity: Option<[u8; 32]>, now: i64) -> CheckIn {
        if self.status.is_final() {
            return CheckIn::Finished;
        }
        if identity.is_some() || self.variant() == Variant::SemiHonest {
            self.checked_in.insert(participant.to_string(), (now, identity));
        }
        match &self.round {
            Some(round) => match round.ids.get(participant) {
                Some(id) => CheckIn::Selected {
                    round: round.number,
                    client_id: id.get(),
                    attempt: round.metrics.attempt,
                    session: hex::encode(round.session),
                    plaintext_metrics: self.spec.client_metrics.plaintext,
                },
                None => CheckIn::Wait { retry_after_ms: 2_000 },
            },
            None => CheckIn::Wait { retry_after_ms: 1_000 },
        }
    }

    fn selected(&self, participant: &str) -> Result<(&ActiveRound, ClientId), EngineError> {
        if self.status != TaskStatus::Active {
            return Err(EngineError::Inactive(self.status));
        }
        let round = self.round.as_ref().ok_or(EngineError::NotSelected)?;
        let id = *round.ids.get(participant).ok_or(EngineError::NotSelected)?;
        Ok((round, id))
    }

    /// The message a selected client should act on now.
    pub fn poll(&mut self, participant: &str) -> Result<Poll, EngineError> {
        let (round, id) = self.selected(participant)?;
        let Some(server) = round.server.as_ref() else {
            return Ok(Poll::Wait);
        };
        if server.has_received(id) {
            return Ok(Poll::Wait);
        }
        let Some(message) = server.message_for(id) else {
            return Ok(Poll::Dropped);
        };
        let bytes = message.encode();
        if let Some(round) = self.round.as_mut() {
            round.bytes_down += bytes.len() as u64;
        }
        Ok(Poll::Message(bytes))
    }

    /// Whether `participant` may post a stage message now, and the largest
    /// body it may send: checked before the body is read, so a client that
    /// is not selected, not eligible for the stage or already answered is
    /// refused without the server reading (or holding) its message.
    pub fn admit(&self, participant: &str) -> Result<usize, EngineError> {
        let (round, id) = self.selected(participant)?;
        let server = round
            .server
            .as_ref()
            .ok_or(ProtocolError::OutOfPhase { expected: Stage::Finished, got: Stage::Unmasking })?;
        if !server.is_eligible(id) {
            return Err(ProtocolError::NotEligible { client: id, stage: server.stage() }.into());
        }
        if server.has_received(id) {
            return Err(ProtocolError::Duplicate(id).into());
        }
        Ok(server.max_message_len())
    }

    /// Whether `participant` may report metrics for `round`: it must be in
    /// the round in progress or in one of the last
    /// [`REPORTABLE_ROUNDS`] completed rounds.
    pub fn may_report(&self, participant: &str, round: u64) -> Result<(), EngineError> {
        if !self.spec.client_metrics.plaintext {
            return Err(EngineError::PlaintextMetricsOff);
        }
        let current =
            self.round.as_ref().is_some_and(|r| r.number == round && r.ids.contains_key(participant));
        let recent =
            self.recent.iter().any(|(number, roster)| *number == round && roster.contains(participant));
        if current || recent { Ok(()) } else { Err(EngineError::NotInRound(round)) }
    }

    /// Accepts a client's encoded stage message.
    pub fn receive(&mut self, participant: &str, bytes: &[u8]) -> Result<(), EngineError> {
        let (_, id) = self.selected(participant)?;
        let message = ClientMessage::decode(bytes).map_err(ProtocolError::from)?;
        let round = self.round.as_mut().ok_or(EngineError::NotSelected)?;
        let server = round
            .server
            .as_mut()
            .ok_or(ProtocolError::OutOfPhase { expected: Stage::Finished, got: message.stage() })?;
        server.receive(id, message)?;
        round.bytes_up += bytes.len() as u64;
        Ok(())
    }

    /// Starts a round when enough clients checked in recently, and closes a
    /// stage when every eligible client answered or its deadline passed.
    pub fn tick(&mut self, now: i64) -> TickOutcome {
        let mut outcome = TickOutcome::default();
        if self.status != TaskStatus::Active {
            return outcome;
        }
        if self.round.is_none() {
            if self.completed >= u64::from(self.spec.rounds) {
                self.status = TaskStatus::Completed;
            } else if let Some(number) = self.start_round(now) {
                outcome.started = Some(number);
            }
            return outcome;
        }
        let wanted = self.spec.clients_per_round as usize;
        let Some(round) = self.round.as_mut() else { return outcome };
        // A stage closes when every eligible client answered or its deadline
        // passed; the masked-input stage also closes once enough inputs
        // arrived, so that over-selected stragglers do not hold it up.
        let ready = round.server.as_ref().is_some_and(|s| {
            s.is_complete()
                || now >= round.deadline
                || (s.stage() == Stage::MaskedInputCollection && s.received() >= wanted)
        });
        if !ready {
            return outcome;
        }
        let Some(server) = round.server.take() else { return outcome };
        let stage = server.stage();
        round.metrics.stages.push(StageMetrics {
            stage: stage_name(stage),
            eligible: server.eligible().len(),
            received: server.received(),
            dropouts: server.eligible().len() - server.received(),
            duration_ms: now - round.stage_started_at,
        });
        round.stage_started_at = now;
        if stage == Stage::Unmasking {
            if server.has_quorum() {
                outcome.unmask =
                    Some(UnmaskJob { task_id: self.task_id.clone(), round: round.number, server });
            } else {
                outcome.aborted = Some((round.number, stage_name(stage)));
                self.round = None;
            }
            return outcome;
        }
        match server.advance() {
            Ok(Advanced::Next(next)) => {
                round.deadline = now + deadline_for(&self.spec, next.stage());
                round.server = Some(next);
            }
            Ok(Advanced::Done(_)) | Err(_) => {
                outcome.aborted = Some((round.number, stage_name(stage)));
                self.round = None;
            }
        }
        outcome
    }

    fn start_round(&mut self, now: i64) -> Option<u64> {
        use rand_core::Rng;
        self.checked_in.retain(|_, (seen, _)| now - *seen <= CHECK_IN_TTL_MS);
        let n = self.spec.selected_per_round() as usize;
        if self.checked_in.len() < n {
            return None;
        }
        let mut candidates: Vec<(String, Option<[u8; 32]>)> =
            self.checked_in.iter().map(|(id, (_, identity))| (id.clone(), *identity)).collect();
        for i in (1..candidates.len()).rev() {
            let j = (self.rng.next_u64() % (i as u64 + 1)) as usize;
            candidates.swap(i, j);
        }
        candidates.truncate(n);
        let variant = self.variant();
        let identities = match variant {
            Variant::Active => candidates.iter().filter_map(|(_, identity)| *identity).collect(),
            Variant::SemiHonest => Vec::new(),
        };
        let candidates: Vec<String> = candidates.into_iter().map(|(id, _)| id).collect();
        let mut session = [0u8; 16];
        self.rng.fill_bytes(&mut session);
        let mut transform_seed = [0u8; 32];
        self.rng.fill_bytes(&mut transform_seed);
        let q = self.spec.quantization;
        let metrics = self.spec.client_metrics.aggregate;
        let quantizer = q.quantizer(n as u32, transform_seed, metrics).ok()?;
        let modulus_bits = self.security.modulus_bits;
        let quantization = q.round_spec(transform_seed, metrics).ok()?;
        let config = RoundConfig {
            session,
            round: self.completed + 1,
            variant,
            clients: n as u32,
            identities,
            graph: match self.security.graph {
                GraphKind::Complete => GraphSpec::Complete,
                GraphKind::Sparse => GraphSpec::Harary { degree: self.security.degree },
            },
            threshold: self.security.threshold,
            vector_len: quantizer.encoded_len(self.spec.model.layout.len()) as u32,
            modulus_bits,
            quantization,
        };
        let server = ServerRound::new(config).ok()?;
        self.attempts += 1;
        let ids = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((p.clone(), ClientId::new(i as u32 + 1)?)));
        let number = self.completed + 1;
        self.round = Some(ActiveRound {
            number,
            session,
            started_at: now,
            stage_started_at: now,
            deadline: now + deadline_for(&self.spec, Stage::AdvertiseKeys),
            ids: ids.collect(),
            roster: candidates,
            server: Some(server),
            quantizer,
            metrics: RoundMetrics {
                modulus_bits,
                attempt: self.attempts,
                degree: self.security.degree,
                threshold: self.security.threshold,
                ..RoundMetrics::default()
            },
            bytes_up: 0,
            bytes_down: 0,
        });
        Some(number)
    }

    /// Turns the unmasked sum into the next model. Nothing changes until
    /// [`commit`](Self::commit); on error the round is abandoned.
    pub fn complete(
        &mut self,
        round_number: u64,
        result: Result<Aggregate, ProtocolError>,
        now: i64,
    ) -> Result<Completion, String> {
        let outcome = self.compute(round_number, result, now);
        if outcome.is_err() {
            self.abandon(round_number);
        }
        outcome
    }

    fn compute(
        &self,
        round_number: u64,
        result: Result<Aggregate, ProtocolError>,
        now: i64,
    ) -> Result<Completion, String> {
        let round =
            self.round.as_ref().filter(|r| r.number == round_number).ok_or("no such round in progress")?;
        let aggregate = result.map_err(|e| e.to_string())?;
        let survivors = aggregate.contributors.len() as u32;
        let dimension = self.spec.model.layout.len();
        let mean = round.quantizer.decode(&aggregate.sum, survivors, dimension).map_err(|e| e.to_string())?;
        let mut weights = self.weights.clone();
        let mut state = self.optimizer_state.clone();
        self.spec.optimizer.step(&mut weights, &mean.mean, &mut state).map_err(|e| e.to_string())?;
        let selected = round.roster.len() as f64;
        let mut metrics = round.metrics.clone();
        metrics.bytes_up_per_client = round.bytes_up as f64 / selected;
        metrics.bytes_down_per_client = round.bytes_down as f64 / selected;
        metrics.compression_ratio = metrics.bytes_up_per_client / (4.0 * dimension as f64);
        metrics.total_examples = mean.total_weight;
        metrics.update_norm = mean.mean.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        metrics.faulty_shares = aggregate.faulty_shares.len() as u32;
        metrics.client_means = mean
            .metrics
            .means()
            .map(|(metric, mean, clients)| (metric.name().to_string(), ClientMean { mean, clients }))
            .collect();
        let name = |id: cohort_crypto::ClientId| {
            round.roster.get(id.get() as usize - 1).cloned().unwrap_or_default()
        };
        let faulty_shares =
            aggregate.faulty_shares.iter().map(|fault| (name(fault.owner), name(fault.holder))).collect();
        let model = encode_model(&self.task_id, &self.spec.model.layout, &weights, round_number)?;
        Ok(Completion {
            round: RoundRecord {
                task_id: self.task_id.clone(),
                round: round_number as i64,
                started_at: round.started_at,
                finished_at: now,
                selected: round.roster.len() as i64,
                survivors: i64::from(survivors),
                metrics: serde_json::to_string(&metrics).map_err(|e| e.to_string())?,
            },
            checkpoint: CheckpointRecord {
                task_id: self.task_id.clone(),
                round: round_number as i64,
                model,
                optimizer_state: serde_json::to_vec(&state).map_err(|e| e.to_string())?,
                created_at: now,
            },
            weights,
            optimizer_state: state,
            stages: metrics.stages.clone(),
            client_means: metrics.client_means.clone(),
            faulty_shares,
        })
    }

    /// Adopts a persisted completion as the new global model.
    pub fn commit(&mut self, completion: Completion) {
        self.weights = completion.weights;
        self.optimizer_state = completion.optimizer_state;
        self.checkpoint_bytes = completion.checkpoint.model;
        self.completed = completion.round.round as u64;
        self.attempts = 0;
        if let Some(round) = self.round.take() {
            self.recent.push_back((round.number, round.roster.into_iter().collect()));
            while self.recent.len() > REPORTABLE_ROUNDS {
                self.recent.pop_front();
            }
        }
        if self.completed >= u64::from(self.spec.rounds) {
            self.status = TaskStatus::Completed;
        }
    }

    /// Gives up on a round (its completion could not be computed or stored).
    pub fn abandon(&mut self, round_number: u64) {
        if self.round.as_ref().is_some_and(|r| r.number == round_number) {
            self.round = None;
        }
    }
}

/// How long `stage` may collect messages.
fn deadline_for(spec: &TaskSpec, stage: Stage) -> i64 {
    let d = spec.deadlines;
    let ms = match stage {
        Stage::AdvertiseKeys => d.advertise_keys_ms,
        Stage::ShareKeys => d.share_keys_ms,
        Stage::MaskedInputCollection => d.masked_input_ms,
        _ => d.unmasking_ms,
    };
    // Specs bound deadlines to a day; never let a stored value overflow.
    i64::try_from(ms).unwrap_or(i64::MAX / 4).min(crate::spec::MAX_DEADLINE_MS as i64)
}

fn encode_model(task_id: &str, layout: &ModelLayout, weights: &[f32], round: u64) -> Result<Vec<u8>, String> {
    let metadata = BTreeMap::from([
        ("cohort.task".to_string(), task_id.to_string()),
        ("cohort.round".to_string(), round.to_string()),
    ]);
    checkpoint::encode(layout, weights, &metadata).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::VariantChoice;
    use crate::spec::tests::small_spec;
    use cohort_crypto::ServerMessage;
    use cohort_crypto::testing::ProtocolClient;

    /// A named participant that answers the engine with the protocol
    /// client shared with the integration tests.
    struct NamedClient {
        name: String,
        protocol: ProtocolClient,
    }

    impl NamedClient {
        fn new(i: usize, update: Vec<f32>, weight: u32) -> Self {
            Self { name: format!("p{i}"), protocol: ProtocolClient::new(i as u64, update, weight) }
        }

        /// Polls once and answers; returns whether it sent something.
        fn step(&mut self, engine: &mut TaskEngine) -> bool {
            let identity = Some(self.protocol.identity.public_key());
            let CheckIn::Selected { client_id, .. } = engine.check_in(&self.name, identity, 0) else {
                return false;
            };
            let Ok(Poll::Message(bytes)) = engine.poll(&self.name) else { return false };
            let reply = self.protocol.respond(client_id, &bytes);
            engine.receive(&self.name, &reply).unwrap();
            true
        }
    }

    fn engine(spec: TaskSpec) -> TaskEngine {
        let initial = TaskEngine::initial_checkpoint("t", &spec, 0).unwrap();
        TaskEngine::new("t".into(), spec, TaskStatus::Active, &initial).unwrap()
    }

    fn participants(n: usize) -> Vec<NamedClient> {
        (0..n)
            .map(|i| NamedClient::new(i, vec![0.1 * i as f32, -0.2, 0.3, 0.05], 10 * (i as u32 + 1)))
            .collect()
    }

    /// Runs stages until the engine hands out the unmasking job; clients in
    /// `vanish_after_shares` stop answering after ShareKeys.
    fn run_round(
        engine: &mut TaskEngine,
        clients: &mut [NamedClient],
        vanish: &[usize],
        now: &mut i64,
    ) -> Option<UnmaskJob> {
        let mut stage = 0;
        loop {
            for (i, client) in clients.iter_mut().enumerate() {
                if stage >= 2 && vanish.contains(&i) {
                    continue;
                }
                client.step(engine);
            }
            *now += 10;
            let mut outcome = engine.tick(*now);
            if outcome.unmask.is_none()
                && outcome.aborted.is_none()
                && engine.current_round().map(|r| r.1) == Some(Stage::MaskedInputCollection)
                && stage >= 2
            {
                // Somebody is missing: let the deadline pass.
                *now += 400_000;
                outcome = engine.tick(*now);
            }
            if let Some(job) = outcome.unmask {
                return Some(job);
            }
            if outcome.aborted.is_some() {
                return None;
            }
            stage += 1;
            assert!(stage < 10, "the round does not progress");
        }
    }

    /// The weighted mean update of the `included` clients.
    fn weighted_mean(clients: &[NamedClient], included: &[usize]) -> Vec<f32> {
        cohort_crypto::testing::weighted_mean(
            &included.iter().map(|&i| &clients[i].protocol).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn a_round_updates_the_model_with_the_weighted_mean() {
        let mut engine = engine(small_spec());
        let mut clients = participants(6);
        let mut now = 0;
        for c in &clients {
            assert_eq!(engine.check_in(&c.name, None, now), CheckIn::Wait { retry_after_ms: 1_000 });
        }
        assert_eq!(engine.tick(now).started, Some(1));
        let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
        assert_eq!(job.round, 1);
        let completion = engine.complete(1, job.run(), now).unwrap();
        assert_eq!(completion.round.survivors, 6);
        let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        assert_eq!(metrics["stages"].as_array().unwrap().len(), 4);
        assert_eq!(metrics["total_examples"], 210);
        assert!(metrics["bytes_up_per_client"].as_f64().unwrap() > 0.0);
        engine.commit(completion);
        assert_eq!(engine.completed_rounds(), 1);
        let expected = weighted_mean(&clients, &[0, 1, 2, 3, 4, 5]);
        for (w, e) in engine.weights().iter().zip(&expected) {
            assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", engine.weights());
        }
        let checkpoint = checkpoint::decode(engine.model()).unwrap();
        assert_eq!(checkpoint.weights, engine.weights());
        assert_eq!(checkpoint.metadata["cohort.round"], "1");
    }

    /// An active task selects only participants with an identity key, binds
    /// their keys in the roster, and its round (signed keys, the consistency
    /// check) gives the same mean.
    #[test]
    fn an_active_round_binds_the_selected_identity_keys() {
        let mut spec = small_spec();
        spec.secure_aggregation.variant = Some(VariantChoice::Active);
        let mut engine = engine(spec);
        let mut clients = participants(6);
        let mut now = 0;
        // Without an identity key a participant of an active task is never selected.
        engine.check_in("keyless", None, now);
        assert_eq!(engine.available(now), 0);
        for c in &clients {
            engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now);
        }
        assert_eq!(engine.tick(now).started, Some(1));
        let Ok(Poll::Message(setup)) = engine.poll(&clients[0].name) else { panic!("no setup") };
        let Ok(ServerMessage::Setup(config)) = ServerMessage::decode(&setup) else { panic!("not a setup") };
        assert_eq!(config.variant, Variant::Active);
        let mut expected: Vec<[u8; 32]> = clients.iter().map(|c| c.protocol.identity.public_key()).collect();
        let mut roster = config.identities.clone();
        expected.sort_unstable();
        roster.sort_unstable();
        assert_eq!(roster, expected);
        assert_eq!(engine.check_in("keyless", None, now), CheckIn::Wait { retry_after_ms: 2_000 });
        let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
        let completion = engine.complete(1, job.run(), now).unwrap();
        assert_eq!(completion.round.survivors, 6);
        let stages: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        // The consistency check is the active variant's fifth stage.
        assert_eq!(stages["stages"].as_array().unwrap().len(), 5);
        engine.commit(completion);
        let expected = weighted_mean(&clients, &[0, 1, 2, 3, 4, 5]);
        for (w, e) in engine.weights().iter().zip(&expected) {
            assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", engine.weights());
        }
    }

    #[test]
    fn a_client_that_vanishes_is_recovered_after_the_deadline() {
        let mut engine = engine(small_spec());
        let mut clients = participants(6);
        let mut now = 0;
        for c in &clients {
            engine.check_in(&c.name, None, now);
        }
        engine.tick(now);
        let job = run_round(&mut engine, &mut clients, &[2], &mut now).unwrap();
        let completion = engine.complete(1, job.run(), now).unwrap();
        assert_eq!(completion.round.survivors, 5);
        let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        assert_eq!(metrics["stages"][2]["dropouts"], 1);
        engine.commit(completion);
        let expected = weighted_mean(&clients, &[0, 1, 3, 4, 5]);
        for (w, e) in engine.weights().iter().zip(&expected) {
            assert!((w - e).abs() < 1e-4);
        }
    }

    #[test]
    fn a_round_below_threshold_is_aborted_and_retried_without_changing_the_model() {
        let mut spec = small_spec();
        spec.secure_aggregation.threshold = Some(5);
        let mut engine = engine(spec);
        let mut clients = participants(6);
        let mut now = 0;
        for c in &clients {
            engine.check_in(&c.name, None, now);
        }
        engine.tick(now);
        assert!(run_round(&mut engine, &mut clients, &[0, 1], &mut now).is_none());
        assert_eq!(engine.current_round(), None);
        assert_eq!(engine.completed_rounds(), 0);
        assert!(engine.weights().iter().all(|w| *w == 0.0));
        // Fresh clients check in; the round is attempted again.
        let mut fresh = participants(6);
        for c in fresh.iter_mut() {
            c.protocol.reset();
            engine.check_in(&c.name, None, now);
        }
        assert_eq!(engine.tick(now).started, Some(1));
        let job = run_round(&mut engine, &mut fresh, &[], &mut now).unwrap();
        let completion = engine.complete(1, job.run(), now).unwrap();
        let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        assert_eq!(metrics["attempt"], 2);
    }

    #[test]
    fn strangers_garbage_and_inactive_tasks_are_refused() {
        let mut engine = engine(small_spec());
        let clients = participants(7);
        for c in &clients[..6] {
            engine.check_in(&c.name, None, 0);
        }
        assert_eq!(engine.tick(0).started, Some(1));
        assert_eq!(engine.check_in("p6", None, 0), CheckIn::Wait { retry_after_ms: 2_000 });
        assert_eq!(engine.poll("p6"), Err(EngineError::NotSelected));
        assert!(matches!(
            engine.receive("p0", b"junk"),
            Err(EngineError::Protocol(ProtocolError::Decode(_)))
        ));
        engine.set_status(TaskStatus::Paused);
        assert_eq!(engine.poll("p0"), Err(EngineError::Inactive(TaskStatus::Paused)));
        assert_eq!(engine.current_round(), None);
        assert!(engine.tick(1).started.is_none());
        engine.set_status(TaskStatus::Stopped);
        assert_eq!(engine.check_in("p0", None, 2), CheckIn::Finished);
    }

    #[test]
    fn the_task_completes_after_its_rounds() {
        let mut spec = small_spec();
        spec.rounds = 2;
        let mut engine = engine(spec);
        let mut now = 0;
        for round in 1..=2 {
            let mut clients = participants(6);
            for c in &clients {
                engine.check_in(&c.name, None, now);
            }
            assert_eq!(engine.tick(now).started, Some(round));
            let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
            let completion = engine.complete(round, job.run(), now).unwrap();
            engine.commit(completion);
        }
        assert_eq!(engine.status(), TaskStatus::Completed);
        assert_eq!(engine.check_in("p0", None, now), CheckIn::Finished);
    }

    #[test]
    fn over_selection_closes_the_masked_input_stage_without_waiting_for_stragglers() {
        let mut spec = small_spec();
        spec.clients_per_round = 5;
        spec.over_selection = 0.2;
        assert_eq!(spec.selected_per_round(), 6);
        let mut engine = engine(spec);
        let mut clients = participants(6);
        let mut now = 0;
        for c in &clients {
            engine.check_in(&c.name, None, now);
        }
        assert_eq!(engine.tick(now).started, Some(1));
        // Keys and shares from everybody.
        for _ in 0..2 {
            for c in clients.iter_mut() {
                c.step(&mut engine);
            }
            now += 10;
            engine.tick(now);
        }
        assert_eq!(engine.current_round(), Some((1, Stage::MaskedInputCollection)));
        // Five of six masked inputs: enough, long before the deadline.
        for c in clients.iter_mut().skip(1) {
            c.step(&mut engine);
        }
        now += 10;
        engine.tick(now);
        assert_eq!(engine.current_round(), Some((1, Stage::Unmasking)));
        for c in clients.iter_mut().skip(1) {
            c.step(&mut engine);
        }
        now += 10;
        let job = engine.tick(now).unmask.unwrap();
        let completion = engine.complete(1, job.run(), now).unwrap();
        assert_eq!(completion.round.survivors, 5);
        assert_eq!(completion.round.selected, 6);
        engine.commit(completion);
        let expected = weighted_mean(&clients, &[1, 2, 3, 4, 5]);
        for (w, e) in engine.weights().iter().zip(&expected) {
            assert!((w - e).abs() < 1e-4);
        }
    }

    #[test]
    fn stage_messages_are_admitted_only_from_eligible_senders_within_the_round_size() {
        let mut engine = engine(small_spec());
        let mut clients = participants(7);
        for c in &clients[..6] {
            engine.check_in(&c.name, None, 0);
        }
        assert_eq!(engine.admit("p0"), Err(EngineError::NotSelected), "no round yet");
        engine.tick(0);
        assert_eq!(engine.admit("p6"), Err(EngineError::NotSelected));
        let (round, _) = engine.round.as_ref().map(|r| (r.number, ())).unwrap();
        assert_eq!(round, 1);
        let keys = engine.admit("p0").unwrap();
        let config = engine.round.as_ref().unwrap().server.as_ref().unwrap().config().clone();
        assert_eq!(keys, ClientMessage::max_encoded_len(&config, Stage::AdvertiseKeys));
        assert!(clients[0].step(&mut engine));
        assert!(matches!(engine.admit("p0"), Err(EngineError::Protocol(ProtocolError::Duplicate(_)))));
        // p5 never advertises keys: it is not eligible for the next stage.
        for c in clients[1..5].iter_mut() {
            c.step(&mut engine);
        }
        engine.tick(400_000);
        assert_eq!(engine.current_round(), Some((1, Stage::ShareKeys)));
        assert!(matches!(engine.admit("p5"), Err(EngineError::Protocol(ProtocolError::NotEligible { .. }))));
        // The share stage's limit also takes a late key advertisement.
        let shares = engine.admit("p0").unwrap();
        assert_eq!(shares, ClientMessage::max_encoded_len(&config, Stage::ShareKeys).max(keys));
        engine.set_status(TaskStatus::Paused);
        assert_eq!(engine.admit("p0"), Err(EngineError::Inactive(TaskStatus::Paused)));
    }

    #[test]
    fn only_members_of_a_recent_round_may_report() {
        let mut spec = small_spec();
        spec.rounds = 4;
        // Plaintext reports: a semi-honest task that asks for them only.
        assert_eq!(engine(spec.clone()).may_report("p0", 1), Err(EngineError::PlaintextMetricsOff));
        spec.client_metrics.plaintext = true;
        spec.secure_aggregation.variant = Some(crate::spec::VariantChoice::SemiHonest);
        let mut engine = engine(spec);
        let mut now = 0;
        assert_eq!(engine.may_report("p0", 1), Err(EngineError::NotInRound(1)));
        for round in 1..=4u64 {
            // Members p0..p5 in odd rounds, q0..q5 in even ones.
            let prefix = if round % 2 == 1 { "p" } else { "q" };
            // The last round's clients are no longer available.
            now += CHECK_IN_TTL_MS + 1;
            let mut clients = participants(6);
            for c in clients.iter_mut() {
                c.name = format!("{prefix}{}", &c.name[1..]);
                engine.check_in(&c.name, None, now);
            }
            engine.tick(now);
            assert_eq!(engine.may_report(&format!("{prefix}0"), round), Ok(()), "the round in progress");
            let other = if prefix == "p" { "q0" } else { "p0" };
            assert_eq!(engine.may_report(other, round), Err(EngineError::NotInRound(round)));
            let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
            let completion = engine.complete(round, job.run(), now).unwrap();
            engine.commit(completion);
            assert_eq!(engine.may_report(&format!("{prefix}3"), round), Ok(()), "just finished");
            assert_eq!(
                engine.may_report(&format!("{prefix}3"), round + 1),
                Err(EngineError::NotInRound(round + 1))
            );
        }
        // The last two rounds are remembered; older ones are not.
        assert_eq!(engine.may_report("q1", 4), Ok(()));
        assert_eq!(engine.may_report("p1", 3), Ok(()));
        assert_eq!(engine.may_report("q1", 2), Err(EngineError::NotInRound(2)));
        assert_eq!(engine.may_report("p1", 1), Err(EngineError::NotInRound(1)));
    }

    #[test]
    fn stale_check_ins_do_not_count() {
        let mut engine = engine(small_spec());
        for i in 0..6 {
            engine.check_in(&format!("p{i}"), None, 0);
        }
        assert!(engine.tick(CHECK_IN_TTL_MS + 1).started.is_none());
    }
}
