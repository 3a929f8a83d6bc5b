//! The coordinator's core for one task: selecting clients, running the
//! secure-aggregation round with per-stage deadlines, and turning the
//! aggregate into the next global model.
//!
//! It is synchronous and takes the time as an argument, so every rule is
//! testable without sockets or timers; the [`super::coordinator`] actor
//! drives it. A finished round becomes a [`Completion`] that the caller
//! persists first and [`TaskEngine::commit`]s after: the in-memory model
//! never runs ahead of what is stored.

use std::collections::{BTreeMap, HashSet, VecDeque};

use cohort_crypto::policy::TaskSecurity;
use cohort_crypto::{Advanced, Aggregate, ClientId, ClientMessage, ProtocolError, Stage, Variant};

use super::active::{ActiveRound, RoundState, deadline_for, select};
use super::completion::{Completion, PendingUnmask, encode_model};
use super::records::{CheckIn, ClientMean, EngineError, Poll, RoundProgress, StageMetrics, TaskError};
use crate::checkpoint;
use crate::optimizer::OptimizerState;
use crate::spec::TaskSpec;
use crate::store::{CheckpointRecord, RoundRecord, TaskStatus};

/// A check-in counts towards selection for this long.
pub const CHECK_IN_TTL_MS: i64 = 60_000;

/// Completed rounds whose members may still report metrics.
pub const REPORTABLE_ROUNDS: usize = 2;

/// What [`TaskEngine::tick`] did.
#[derive(Debug)]
pub enum TickOutcome {
    /// Nothing the caller must act on (a stage may have advanced).
    Idle,
    /// Round `.0` was started.
    Started(u64),
    /// The masked-input stage of `round` opened: `participants` are about
    /// to be asked for their masked input. Each of them refuses every
    /// later attempt of this round number (a client sends one masked
    /// input per round), so the caller records them durably before the
    /// stage is served, and [`withdraw`](TaskEngine::withdraw)s the round
    /// if it cannot.
    MaskedInputRequested { round: u64, participants: Vec<String> },
    /// The round was aborted (too few clients) in `stage`.
    Aborted { round: u64, stage: Stage },
    /// The final stage is ready to be unmasked.
    Unmask(Box<PendingUnmask>),
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
    /// Participants asked for their masked input by an attempt of round
    /// `completed + 1` that did not complete: they refuse any re-run of
    /// that round, so they are not selected for it again.
    contributed: HashSet<String>,
    pub(super) round: Option<ActiveRound>,
    /// The rosters of the last completed rounds, newest last.
    recent: VecDeque<(u64, HashSet<String>)>,
    rng: rand_chacha::ChaCha20Rng,
}

impl TaskEngine {
    /// Restores a task from its spec, status and newest checkpoint, with
    /// the participants that earlier attempts of the next round asked for
    /// their masked input (see [`TickOutcome::MaskedInputRequested`]).
    pub fn new(
        task_id: String,
        spec: TaskSpec,
        status: TaskStatus,
        latest: &CheckpointRecord,
        contributed: impl IntoIterator<Item = String>,
    ) -> Result<Self, TaskError> {
        let security = spec.security()?;
        let decoded = checkpoint::decode(&latest.model)?;
        if decoded.layout != spec.model.layout {
            return Err(TaskError::LayoutMismatch);
        }
        let optimizer_state: OptimizerState = serde_json::from_slice(&latest.optimizer_state)?;
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed)?;
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
            contributed: contributed.into_iter().collect(),
            round: None,
            recent: VecDeque::new(),
            rng: rand_core::SeedableRng::from_seed(seed),
            spec,
        })
    }

    /// The initial checkpoint of a new task (round 0).
    pub fn initial_checkpoint(
        task_id: &str,
        spec: &TaskSpec,
        now: i64,
    ) -> Result<CheckpointRecord, TaskError> {
        let weights = spec.initial_weights();
        let model = encode_model(task_id, &spec.model.layout, &weights, 0)?;
        let state = spec.optimizer.initial_state(weights.len());
        Ok(CheckpointRecord {
            task_id: task_id.to_string(),
            round: 0,
            model,
            optimizer_state: serde_json::to_vec(&state)?,
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
        self.round.as_ref().map(|r| (r.number, r.state.stage()))
    }

    /// The round in progress, for the admin API.
    pub fn progress(&self) -> Option<RoundProgress> {
        let round = self.round.as_ref()?;
        let (stage, eligible, received) = match &round.state {
            RoundState::Collecting(server) => (server.stage(), server.eligible().len(), server.received()),
            RoundState::Unmasking => (Stage::Unmasking, 0, 0),
        };
        Some(RoundProgress {
            round: round.number,
            attempt: round.metrics.attempt,
            stage,
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

    /// Clients that checked in recently enough to be selected for the next
    /// round (those that contributed to an earlier attempt of it are not).
    pub fn available(&self, now: i64) -> usize {
        self.selectable(now).count()
    }

    /// The participants the next round may select, with their identity
    /// keys: checked in within [`CHECK_IN_TTL_MS`], and not asked for a
    /// masked input by an earlier attempt of that round.
    fn selectable(&self, now: i64) -> impl Iterator<Item = (&String, Option<[u8; 32]>)> {
        self.checked_in
            .iter()
            .filter(move |(id, (seen, _))| now - *seen <= CHECK_IN_TTL_MS && !self.contributed.contains(*id))
            .map(|(id, (_, identity))| (id, *identity))
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
                    session: Some(hex::encode(round.session)),
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
        let RoundState::Collecting(server) = &round.state else {
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
        let RoundState::Collecting(server) = &round.state else {
            return Err(ProtocolError::OutOfPhase { expected: Stage::Finished, got: Stage::Unmasking }.into());
        };
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
        let RoundState::Collecting(server) = &mut round.state else {
            return Err(ProtocolError::OutOfPhase { expected: Stage::Finished, got: message.stage() }.into());
        };
        server.receive(id, message)?;
        round.bytes_up += bytes.len() as u64;
        Ok(())
    }

    /// Starts a round when enough clients checked in recently, and closes a
    /// stage when every eligible client answered or its deadline passed.
    pub fn tick(&mut self, now: i64) -> TickOutcome {
        if self.status != TaskStatus::Active {
            return TickOutcome::Idle;
        }
        if self.round.is_none() {
            if self.completed >= u64::from(self.spec.rounds) {
                self.status = TaskStatus::Completed;
            } else if let Some(number) = self.start_round(now) {
                return TickOutcome::Started(number);
            }
            return TickOutcome::Idle;
        }
        let wanted = self.spec.clients_per_round as usize;
        let Some(round) = self.round.as_mut() else { return TickOutcome::Idle };
        // A stage closes when every eligible client answered or its deadline
        // passed; the masked-input stage also closes once enough inputs
        // arrived, so that over-selected stragglers do not hold it up.
        let ready = round.state.collecting().is_some_and(|s| {
            s.is_complete()
                || now >= round.deadline
                || (s.stage() == Stage::MaskedInputCollection && s.received() >= wanted)
        });
        if !ready {
            return TickOutcome::Idle;
        }
        let RoundState::Collecting(server) = std::mem::replace(&mut round.state, RoundState::Unmasking)
        else {
            return TickOutcome::Idle;
        };
        let stage = server.stage();
        round.metrics.stages.push(StageMetrics {
            stage,
            eligible: server.eligible().len(),
            received: server.received(),
            dropouts: server.eligible().len() - server.received(),
            duration_ms: now - round.stage_started_at,
        });
        round.stage_started_at = now;
        if stage == Stage::Unmasking {
            if server.has_quorum() {
                return TickOutcome::Unmask(Box::new(PendingUnmask {
                    task_id: self.task_id.clone(),
                    round: round.number,
                    server,
                }));
            }
            let aborted = TickOutcome::Aborted { round: round.number, stage };
            self.round = None;
            return aborted;
        }
        match server.advance() {
            Ok(Advanced::Next(next)) => {
                round.deadline = now + deadline_for(&self.spec, next.stage());
                let asked = (next.stage() == Stage::MaskedInputCollection).then(|| {
                    let name = |id: &ClientId| round.roster.get(id.get() as usize - 1).cloned();
                    next.eligible().iter().filter_map(name).collect::<Vec<_>>()
                });
                round.state = RoundState::Collecting(next);
                match asked {
                    Some(participants) => {
                        self.contributed.extend(participants.iter().cloned());
                        TickOutcome::MaskedInputRequested { round: round.number, participants }
                    }
                    None => TickOutcome::Idle,
                }
            }
            Ok(Advanced::Done(_)) | Err(_) => {
                let aborted = TickOutcome::Aborted { round: round.number, stage };
                self.round = None;
                aborted
            }
        }
    }

    fn start_round(&mut self, now: i64) -> Option<u64> {
        self.checked_in.retain(|_, (seen, _)| now - *seen <= CHECK_IN_TTL_MS);
        let n = self.spec.selected_per_round() as usize;
        let candidates: Vec<_> = self.selectable(now).map(|(id, identity)| (id.clone(), identity)).collect();
        if candidates.len() < n {
            return None;
        }
        let selected = select(candidates, n, &mut self.rng);
        let number = self.completed + 1;
        let attempt = self.attempts + 1;
        let round =
            ActiveRound::open(number, attempt, selected, &self.spec, &self.security, &mut self.rng, now)?;
        self.attempts = attempt;
        self.round = Some(round);
        Some(number)
    }

    /// Turns the unmasked sum into the next model. Nothing changes until
    /// [`commit`](Self::commit); on error the round is abandoned.
    pub fn complete(
        &mut self,
        round_number: u64,
        result: Result<Aggregate, ProtocolError>,
        now: i64,
    ) -> Result<Completion, TaskError> {
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
    ) -> Result<Completion, TaskError> {
        let round = self
            .round
            .as_ref()
            .filter(|r| r.number == round_number)
            .ok_or(TaskError::NoSuchRound(round_number))?;
        let aggregate = result?;
        let survivors = aggregate.contributors.len() as u32;
        let dimension = self.spec.model.layout.len();
        let mean = round.quantizer.decode(&aggregate.sum, survivors, dimension)?;
        let mut weights = self.weights.clone();
        let mut state = self.optimizer_state.clone();
        self.spec.optimizer.step(&mut weights, &mean.mean, &mut state)?;
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
                metrics: serde_json::to_string(&metrics)?,
            },
            checkpoint: CheckpointRecord {
                task_id: self.task_id.clone(),
                round: round_number as i64,
                model,
                optimizer_state: serde_json::to_vec(&state)?,
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
        self.contributed.clear();
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

    /// Gives up on a round whose masked-input request could not be
    /// recorded (see [`TickOutcome::MaskedInputRequested`]). Nobody was
    /// asked, so those participants stay selectable for the round.
    pub fn withdraw(&mut self, round_number: u64, asked: &[String]) {
        if self.round.as_ref().is_some_and(|r| r.number == round_number) {
            self.round = None;
            for participant in asked {
                self.contributed.remove(participant);
            }
        }
    }
}
