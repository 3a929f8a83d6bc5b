//! The coordinator's core for one task: selecting clients, running the
//! secure-aggregation round with per-stage deadlines, and turning the
//! aggregate into the next global model.
//!
//! It is synchronous and takes the time as an argument, so every rule is
//! testable without sockets or timers; the [`crate::coordinator`] actor
//! drives it: it hands out what the driver must act on
//! ([`TaskEngine::tick`]) and takes back what the driver stored
//! ([`TaskEngine::advance`]), as raft-rs's `ready()` and `advance()` do.
//! A finished round is a [`Completion`] that the driver persists first and
//! the engine adopts after: the in-memory model never runs ahead of what is
//! stored.

use std::collections::{BTreeMap, HashSet, VecDeque};

use rand::seq::SliceRandom;

use cohort_crypto::metrics::MetricSums;
use cohort_crypto::policy::TaskSecurity;
use cohort_crypto::quantize::{QuantizeError, SumSpread};
use cohort_crypto::{Aggregate, ClientId, ProtocolError, Stage, Variant};

use super::active::{ActiveRound, Group, GroupState, GroupStep, GroupSum, Place, StageHost};
use super::buffered::BufferState;
use super::completion::{Completion, PendingUnmask, encode_model};
use super::owned::{GroupAssignment, GroupKey, GroupReport};
use super::records::{
    AttemptOutcome, BufferMetrics, CheckIn, ClientMean, EngineError, FailedAttempt, RoundProgress, TaskError,
};
use super::robust::{self, GroupRule};
use super::suspects::Suspects;
use crate::checkpoint;
use crate::optimizer::OptimizerState;
use crate::privacy::{PrivacyPlan, PrivacyView};
use crate::spec::{Cadence, RingSizing, TaskPlan, TaskSpec};
use crate::store::{CheckpointRecord, RoundRecord, TaskStatus};

/// A check-in counts towards selection for this long, unless the task
/// says otherwise (`deadlines.availability_ms`).
pub const CHECK_IN_TTL_MS: i64 = 60_000;

/// Completed rounds whose members may still report metrics.
pub const REPORTABLE_ROUNDS: usize = 2;

/// What [`TaskEngine::tick`] hands its driver (raft-rs's `Ready`). One
/// tick may have several outcomes (one per group); `tick` hands them out
/// one per call, so the driver ticks until it gets [`TickOutcome::Idle`].
/// What must be stored before the engine may go on comes as
/// [`TickOutcome::Persist`], and goes back to
/// [`advance`](TaskEngine::advance) with whether it was stored: the one
/// way back from the driver, for a sync round and an async group alike.
#[derive(Debug)]
pub enum TickOutcome {
    /// Nothing the caller must act on (a stage may have advanced).
    Idle,
    /// Round `.0` was started.
    Started(u64),
    /// State to store, then to hand back to [`TaskEngine::advance`].
    Persist(Persist),
    /// A group of a round of several was given up in `stage` (too few
    /// clients, or its unmasking failed); the round goes on with the others.
    GroupAborted { round: u64, group: usize, stage: Stage },
    /// The round was aborted: none of its groups completed (the last gave
    /// up in `stage`); `attempt` says why, to be kept.
    Aborted { round: u64, stage: Stage, attempt: Box<FailedAttempt> },
    /// A group's final stage is ready to be unmasked; its result goes to
    /// [`TaskEngine::unmasked`].
    Unmask(Box<PendingUnmask>),
    /// Every group settled but the next model could not be computed; the
    /// round was abandoned (`attempt` says why, to be kept).
    Abandoned { round: u64, error: TaskError, attempt: Box<FailedAttempt> },
    /// Failed sum checks isolated these participants (a validated task):
    /// they are excluded from every later round. The driver stores them,
    /// so that a restarted coordinator still excludes them.
    Excluded { round: u64, participants: Vec<String> },
}

/// What a validated group's sum check said about its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SumCheck {
    /// The unmasked sum opened the contributors' commitments.
    Passed(Vec<String>),
    /// It did not: one of these contributors masked another vector than
    /// it committed to.
    Failed(Vec<String>),
}

impl SumCheck {
    /// A disputed noise edge (owner, verifier): a failed test of its two
    /// ends, one of which lied about the edge's noise.
    pub fn dispute((owner, verifier): &(String, String)) -> Self {
        SumCheck::Failed(vec![owner.clone(), verifier.clone()])
    }
}

/// What the engine cannot go on without until its driver stored it
/// (persist, then apply: the in-memory state never runs ahead of the
/// store). Handed back to [`TaskEngine::advance`].
#[derive(Debug)]
pub enum Persist {
    /// The masked-input stage of a group of `round` opened:
    /// `participants` are about to be asked for their masked input (see
    /// [`GroupStep::MaskedInputRequested`]). Stored, the stage is served;
    /// not stored, the round (an async group) is given up before anyone
    /// was asked, and they stay selectable for it.
    Contributors { round: u64, participants: Vec<String> },
    /// Every group of a round (or an async group) settled and some
    /// completed: the next model. Stored, the engine adopts it; not
    /// stored, the round is given up (its sums were unmasked, so privacy
    /// is spent all the same).
    Model(Box<Completion>),
}

/// How a task's rounds run, fixed when the task loads: the sync/async fork
/// is this one enum, each mode's state inside its variant (as rustls holds
/// its TLS 1.2 and 1.3 handshakes as sub-states of one state).
pub(super) enum Schedule {
    /// One round at a time, every selected client in it.
    Sync(SyncRound),
    /// FedBuff: groups open as clients are ready and are applied as they
    /// settle (see `buffered`).
    Async(BufferState),
}

/// A sync task's round.
pub(super) enum SyncRound {
    /// None runs: the next starts once enough clients checked in.
    Idle,
    /// Its groups collect, unmask and settle.
    Running(ActiveRound),
    /// Every group settled and the round's completion was handed out
    /// ([`Persist::Model`]): it is being stored.
    Persisting(ActiveRound),
}

impl SyncRound {
    fn get(&self) -> Option<&ActiveRound> {
        match self {
            SyncRound::Running(round) | SyncRound::Persisting(round) => Some(round),
            SyncRound::Idle => None,
        }
    }

    fn get_mut(&mut self) -> Option<&mut ActiveRound> {
        match self {
            SyncRound::Running(round) | SyncRound::Persisting(round) => Some(round),
            SyncRound::Idle => None,
        }
    }
}

/// One task's coordinator state.
pub struct TaskEngine {
    pub(super) task_id: String,
    /// The project the task belongs to (its metrics are labelled with it).
    project: String,
    pub(super) spec: TaskSpec,
    /// The security parameters every round repeats (derived once, at load).
    pub(super) security: TaskSecurity,
    /// The task's differential privacy: the accountant and its budget.
    privacy: Option<PrivacyPlan>,
    /// Noisy sums released by rounds that were then not stored (their
    /// completion failed): they spent privacy all the same.
    unstored_releases: u64,
    pub(super) status: TaskStatus,
    weights: Vec<f32>,
    optimizer_state: OptimizerState,
    /// The current checkpoint, encoded: shared with every download of it
    /// (a clone is a reference count, not a copy of the model).
    checkpoint_bytes: bytes::Bytes,
    pub(super) completed: u64,
    attempts: u32,
    /// Participants that checked in, with the time and the identity key
    /// they enrolled with. In the active variant only those with a key can
    /// be selected, so only those are kept.
    checked_in: BTreeMap<String, (i64, Option<[u8; 32]>)>,
    /// Participants asked for their masked input by an attempt of round
    /// `completed + 1` that did not complete: they refuse any re-run of
    /// that round, so they are not selected for it again.
    contributed: HashSet<String>,
    /// The rosters of the last completed rounds, newest last.
    pub(super) recent: VecDeque<(u64, HashSet<String>)>,
    /// Outcomes of the last tick not handed out yet.
    pub(super) pending: VecDeque<TickOutcome>,
    pub(super) rng: rand_chacha::ChaCha20Rng,
    /// Sync rounds or the async schedule, with what is in flight.
    pub(super) schedule: Schedule,
    /// The members of the last attempt that failed, and why it did: they
    /// are told so when they next ask for a stage.
    last_failure: Option<(HashSet<String>, FailedAttempt)>,
    /// Validated tasks: who the failed sum checks point at, and who was
    /// excluded (see [`super::suspects`]).
    pub(super) suspects: Suspects,
    /// A fitted ring's guide: how far the last adopted model's sums spread
    /// (the widest of its groups). Kept in memory only: after a restart the
    /// first round runs at the safe scale again.
    pub(super) spread: Option<SumSpread>,
}

impl TaskEngine {
    /// The sync round in progress, running or persisting (`None` in an
    /// async task).
    pub(super) fn round(&self) -> Option<&ActiveRound> {
        match &self.schedule {
            Schedule::Sync(round) => round.get(),
            Schedule::Async(_) => None,
        }
    }

    pub(super) fn round_mut(&mut self) -> Option<&mut ActiveRound> {
        match &mut self.schedule {
            Schedule::Sync(round) => round.get_mut(),
            Schedule::Async(_) => None,
        }
    }

    /// The sync round whose groups are still running.
    fn running_mut(&mut self) -> Option<&mut ActiveRound> {
        match &mut self.schedule {
            Schedule::Sync(SyncRound::Running(round)) => Some(round),
            _ => None,
        }
    }

    /// Ends the sync round in progress (running or persisting) and hands it
    /// back.
    fn end_round(&mut self) -> Option<ActiveRound> {
        match &mut self.schedule {
            Schedule::Sync(round) => match std::mem::replace(round, SyncRound::Idle) {
                SyncRound::Running(round) | SyncRound::Persisting(round) => Some(round),
                SyncRound::Idle => None,
            },
            Schedule::Async(_) => None,
        }
    }

    /// An async task's schedule (`None` in a sync task).
    pub(super) fn fedbuff(&self) -> Option<&BufferState> {
        match &self.schedule {
            Schedule::Async(state) => Some(state),
            Schedule::Sync(_) => None,
        }
    }

    pub(super) fn fedbuff_mut(&mut self) -> Option<&mut BufferState> {
        match &mut self.schedule {
            Schedule::Async(state) => Some(state),
            Schedule::Sync(_) => None,
        }
    }

    /// Whether the task is async.
    pub(super) fn is_async(&self) -> bool {
        matches!(self.schedule, Schedule::Async(_))
    }

    /// Restores a task from its plan, status and newest checkpoint, with
    /// the participants that earlier attempts of the next round asked for
    /// their masked input (see [`Persist::Contributors`]).
    pub fn new(
        task_id: String,
        plan: TaskPlan,
        status: TaskStatus,
        latest: &CheckpointRecord,
        contributed: impl IntoIterator<Item = String>,
    ) -> Result<Self, TaskError> {
        let security = plan.security();
        let privacy = plan.privacy().copied();
        let schedule = match plan.cadence() {
            Cadence::Sync => Schedule::Sync(SyncRound::Idle),
            Cadence::Async(schedule) => Schedule::Async(BufferState::new(schedule)),
        };
        let spec = plan.into_spec();
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
            privacy,
            unstored_releases: 0,
            status,
            weights: decoded.weights,
            optimizer_state,
            checkpoint_bytes: bytes::Bytes::from(latest.model.clone()),
            completed: latest.round as u64,
            attempts: 0,
            checked_in: BTreeMap::new(),
            contributed: contributed.into_iter().collect(),
            recent: VecDeque::new(),
            pending: VecDeque::new(),
            rng: rand_core::SeedableRng::from_seed(seed),
            schedule,
            last_failure: None,
            suspects: Suspects::default(),
            spread: None,
            spec,
            project: "default".into(),
        })
    }

    /// The engine of a task of `project`.
    pub fn with_project(mut self, project: impl Into<String>) -> Self {
        self.project = project.into();
        self
    }

    /// The project the task belongs to.
    pub fn project(&self) -> &str {
        &self.project
    }

    /// The engine with the participants the task already excluded (read
    /// back from the store): they are never selected again.
    pub fn with_exclusions(mut self, excluded: impl IntoIterator<Item = String>) -> Self {
        self.suspects = Suspects::new(excluded);
        self
    }

    /// Whether `participant` was excluded from the task.
    pub fn is_excluded(&self, participant: &str) -> bool {
        self.suspects.is_excluded(participant)
    }

    /// The participants excluded from the task, ascending.
    pub fn excluded(&self) -> Vec<String> {
        self.suspects.excluded().iter().cloned().collect()
    }

    /// Participants under suspicion (in a pool: members of failed groups,
    /// narrowed by later failures), ascending.
    pub fn suspected(&self) -> Vec<String> {
        self.suspects.suspected().into_iter().cloned().collect()
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

    /// A fingerprint of what a client waiting on this task can wait for:
    /// the task's status, the rounds (or versions) completed, and the
    /// number, attempt and each group's stage of every round or async
    /// group in progress. It changes when a round starts or ends, a
    /// group's stage closes, or a group handed to another replica is taken
    /// up there; it does not change when one more message arrives, so that
    /// clients held until it changes wake once per stage of each group,
    /// not once a message (see the client API's `wait_ms`).
    pub fn stage_mark(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        (self.status.as_str(), self.completed).hash(&mut hasher);
        match &self.schedule {
            Schedule::Sync(_) => {
                if let Some(round) = self.round() {
                    round.mark(&mut hasher);
                }
            }
            Schedule::Async(state) => state.groups.values().for_each(|flight| flight.round.mark(&mut hasher)),
        }
        hasher.finish()
    }

    /// Rounds completed so far.
    pub fn completed_rounds(&self) -> u64 {
        self.completed
    }

    /// Noisy sums released so far: every stored round and every round
    /// unmasked but then not stored.
    fn releases(&self) -> u64 {
        self.completed + self.unstored_releases
    }

    /// ε spent so far, under differential privacy.
    pub fn epsilon_spent(&self) -> Option<f64> {
        self.privacy.as_ref().map(|plan| plan.epsilon_after(self.releases()))
    }

    /// The task's privacy and what it spent, under differential privacy.
    pub fn privacy(&self) -> Option<PrivacyView> {
        self.privacy.as_ref().map(|plan| PrivacyView::of(plan, self.releases()))
    }

    /// The current global model, as a safetensors checkpoint.
    pub fn model(&self) -> &bytes::Bytes {
        &self.checkpoint_bytes
    }

    /// The current global weights.
    pub fn weights(&self) -> &[f32] {
        &self.weights
    }

    /// The round in progress and its stage (its earliest group's), if any;
    /// in an async task, the oldest group in flight.
    pub fn current_round(&self) -> Option<(u64, Stage)> {
        self.round().or_else(|| self.oldest_group()).map(|r| (r.number, r.stage()))
    }

    /// The round in progress, for the admin API: the stage of its earliest
    /// groups, with their answers, times and deadlines.
    pub fn progress(&self) -> Option<RoundProgress> {
        let round = self.round().or_else(|| self.oldest_group())?;
        let stage = round.stage();
        let in_stage: Vec<&Group> =
            round.groups.iter().filter(|g| !g.is_settled() && g.stage() == stage).collect();
        let (mut eligible, mut received, mut awaited, mut left, mut threshold) = (0, 0, 0, 0, 0);
        for group in &in_stage {
            if let GroupState::Collecting(server) = group.state() {
                eligible += server.eligible().len();
                received += server.received();
                awaited += group.awaited(server);
                left += group.left_of(server);
                threshold = server.config().threshold as usize;
            }
        }
        let (bytes_up, bytes_down) = round.bytes();
        let count = |done: bool| {
            round
                .groups
                .iter()
                .filter(|g| match g.state() {
                    GroupState::Done(_) => done,
                    GroupState::Failed { .. } => !done,
                    _ => false,
                })
                .count()
        };
        Some(RoundProgress {
            round: round.number,
            attempt: round.metrics.attempt,
            stage,
            selected: round.selected(),
            eligible,
            received,
            awaited,
            left,
            threshold,
            started_at: round.started_at,
            stage_started_at: in_stage.iter().map(|g| g.stage_started_at).min().unwrap_or(round.started_at),
            deadline: in_stage.iter().map(|g| g.deadline).min().unwrap_or(round.started_at),
            stages: round.stages(),
            bytes_up,
            bytes_down,
            groups: round.groups.len(),
            groups_completed: count(true),
            groups_failed: count(false),
        })
    }

    /// Clients that checked in recently enough to be selected for the next
    /// round (those that contributed to an earlier attempt of it are not).
    pub fn available(&self, now: i64) -> usize {
        self.selectable(now).count()
    }

    /// Why an active task cannot start its next round now: too few
    /// clients available for what a round selects, saying how many
    /// checked-in clients the round may not select because an earlier
    /// attempt of it asked them for their masked input (asked again, a
    /// second sum of the same updates could be unmasked beside the first).
    /// `None` while a round runs, or when the task is not active.
    pub fn stalled(&self, now: i64) -> Option<String> {
        if self.status != TaskStatus::Active || self.round().is_some() || self.is_async() {
            return None;
        }
        let wanted = self.spec.groups().selected() as usize;
        let available = self.available(now);
        if available >= wanted {
            return None;
        }
        // Checked in recently but not selectable: asked by an earlier attempt.
        let recent = self
            .checked_in
            .iter()
            .filter(|(id, (seen, _))| now - *seen <= self.availability_ms() && !self.suspects.is_excluded(id))
            .count();
        let excluded = recent - available;
        let mut why = format!(
            "waiting for clients: {available} available, round {} selects {wanted}",
            self.completed + 1
        );
        if excluded > 0 {
            why.push_str(&format!(
                "; {excluded} more checked in but were asked for their masked input by an earlier attempt \
                 of this round and may not take part in it again (a second sum of their updates could be \
                 unmasked beside the first): new clients must enroll"
            ));
        }
        let suspected = self.suspects.suspected().len();
        if suspected > 0 {
            why.push_str(&format!(
                "; {suspected} clients are suspects of a failed sum check (one of them masked another vector \
                 than it committed to), found across rounds of two groups or more"
            ));
        }
        Some(why)
    }

    /// The participants the next round may select, with their identity
    /// keys: checked in within the task's `deadlines.availability_ms`
    /// (default [`CHECK_IN_TTL_MS`]), and not asked for a
    /// masked input by an earlier attempt of that round.
    fn selectable(&self, now: i64) -> impl Iterator<Item = (&String, Option<[u8; 32]>)> {
        self.checked_in
            .iter()
            .filter(move |(id, (seen, _))| {
                now - *seen <= self.availability_ms()
                    && !self.contributed.contains(*id)
                    && !self.suspects.is_excluded(id)
            })
            .map(|(id, (_, identity))| (id, *identity))
    }

    /// How long a client that stopped checking in stays selectable.
    fn availability_ms(&self) -> i64 {
        i64::try_from(self.spec.deadlines.availability_ms).unwrap_or(CHECK_IN_TTL_MS)
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
            self.end_round();
            self.buffered_reset();
        }
    }

    /// Records a check-in and tells the client whether it is selected.
    /// `identity` is the key the participant enrolled with; in the active
    /// variant a participant without one is never selected.
    pub fn check_in(&mut self, participant: &str, identity: Option<[u8; 32]>, now: i64) -> CheckIn {
        self.check_in_trained(participant, identity, None, now)
    }

    /// [`check_in`](Self::check_in) of a client that, in an async task,
    /// has an update trained from model version `trained_on` (ignored in a
    /// sync task).
    pub fn check_in_trained(
        &mut self,
        participant: &str,
        identity: Option<[u8; 32]>,
        trained_on: Option<u64>,
        now: i64,
    ) -> CheckIn {
        if self.status.is_final() {
            return CheckIn::Finished;
        }
        if identity.is_some() || self.variant() == Variant::SemiHonest {
            self.checked_in.insert(participant.to_string(), (now, identity));
        }
        if self.is_async() {
            if self.status != TaskStatus::Active {
                return CheckIn::Wait { retry_after_ms: 2_000 };
            }
            return self.buffered_check_in(participant, identity, trained_on, now);
        }
        match self.round() {
            Some(round) => match round.members.get(participant) {
                // Its owner has not taken the group up yet: soon.
                Some((group, _)) if matches!(round.groups[*group].state(), GroupState::Remote(r) if !r.adopted) => {
                    CheckIn::Wait { retry_after_ms: 250 }
                }
                Some((group, id)) => CheckIn::Selected {
                    round: round.number,
                    client_id: id.get(),
                    attempt: round.metrics.attempt,
                    session: Some(hex::encode(round.groups[*group].seeds.session)),
                    plaintext_metrics: self.spec.client_metrics.plaintext,
                    staleness_weight: None,
                },
                None => CheckIn::Wait { retry_after_ms: 2_000 },
            },
            None => CheckIn::Wait { retry_after_ms: 1_000 },
        }
    }

    /// `participant` says it is leaving: it is no longer selectable, and
    /// no stage of a round or group it is in waits for it. The next
    /// [`tick`](Self::tick) closes a stage that waits for no one else, or
    /// gives the group up at once when too few are left to reach its
    /// threshold, instead of at the deadline.
    pub fn leave(&mut self, participant: &str) {
        self.checked_in.remove(participant);
        if let Some(round) = self.round_mut()
            && let Some((group, id)) = round.members.get(participant).copied()
        {
            round.groups[group].left.insert(id);
        }
        self.buffered_leave(participant);
    }

    /// Whether `participant` may report metrics for `round`: it must be in
    /// the round in progress or in one of the last
    /// [`REPORTABLE_ROUNDS`] completed rounds.
    pub fn may_report(&self, participant: &str, round: u64) -> Result<(), EngineError> {
        if !self.spec.client_metrics.plaintext {
            return Err(EngineError::PlaintextMetricsOff);
        }
        let current = self.round().is_some_and(|r| r.number == round && r.members.contains_key(participant));
        let recent =
            self.recent.iter().any(|(number, roster)| *number == round && roster.contains(participant))
                || self.in_buffered_group(participant, round);
        if current || recent { Ok(()) } else { Err(EngineError::NotInRound(round)) }
    }

    /// The earliest time (Unix ms) at which [`tick`](Self::tick) has
    /// something to do that no request brings about: a collecting stage's
    /// deadline (quinn-proto's `poll_timeout`). Everything else a tick does
    /// follows a request (a check-in that completes the cohort, the message
    /// that completes a stage, a client that leaves), which ticks the
    /// engine itself. `None` when no deadline is pending.
    pub fn next_deadline(&self) -> Option<i64> {
        if self.status != TaskStatus::Active {
            return None;
        }
        match &self.schedule {
            Schedule::Sync(SyncRound::Running(round)) => {
                round.groups.iter().filter_map(Group::deadline).min()
            }
            Schedule::Sync(_) => None,
            Schedule::Async(state) => state
                .groups
                .values()
                .flat_map(|flight| &flight.round.groups)
                .filter_map(Group::deadline)
                .min(),
        }
    }

    /// Starts a round when enough clients checked in recently, closes a
    /// group's stage when every eligible client answered or its deadline
    /// passed, and hands out what the caller must act on, one outcome per
    /// call (see [`TickOutcome`]).
    pub fn tick(&mut self, now: i64) -> TickOutcome {
        if let Some(outcome) = self.pending.pop_front() {
            return outcome;
        }
        if self.status != TaskStatus::Active {
            return TickOutcome::Idle;
        }
        if self.is_async() {
            self.buffered_tick(now);
            return self.pending.pop_front().unwrap_or(TickOutcome::Idle);
        }
        if self.round().is_none() {
            if self.completed >= u64::from(self.spec.rounds) {
                self.status = TaskStatus::Completed;
            } else if self.privacy.as_ref().is_some_and(|plan| !plan.allows(self.releases())) {
                self.status = TaskStatus::BudgetSpent;
            } else if let Some(number) = self.start_round(now) {
                return TickOutcome::Started(number);
            }
            return TickOutcome::Idle;
        }
        self.advance_groups(now);
        self.settle(now);
        self.pending.pop_front().unwrap_or(TickOutcome::Idle)
    }

    /// Closes every group's stage that is ready (see [`Group::advance`]).
    fn advance_groups(&mut self, now: i64) {
        let wanted = self.spec.inputs_per_group() as usize;
        let Self { schedule, spec, contributed, pending, task_id, .. } = self;
        let Schedule::Sync(SyncRound::Running(round)) = schedule else { return };
        let several = round.groups.len() > 1;
        for (index, group) in round.groups.iter_mut().enumerate() {
            let place = Place { task: task_id, round: round.number, index };
            let Some(step) = group.advance(place, spec, wanted, now) else { continue };
            if let GroupStep::MaskedInputRequested(participants) = &step {
                contributed.extend(participants.iter().cloned());
            }
            pending.extend(step.outcome(place, several));
        }
    }

    /// Once every group of the round is done or given up: the round's
    /// completion when some completed, else the round is aborted.
    fn settle(&mut self, now: i64) {
        let Some(round) = self.running_mut() else { return };
        if !round.groups.iter().all(Group::is_settled) {
            return;
        }
        let number = round.number;
        if round.groups.iter().any(|g| matches!(g.state(), GroupState::Done(_))) {
            if let Schedule::Sync(sync) = &mut self.schedule
                && let SyncRound::Running(round) = std::mem::replace(sync, SyncRound::Idle)
            {
                *sync = SyncRound::Persisting(round);
            }
            match self.compute(now) {
                Ok(completion) => {
                    self.pending.push_back(TickOutcome::Persist(Persist::Model(Box::new(completion))))
                }
                Err(error) => {
                    let Some(round) = self.round() else { return };
                    let attempt = Box::new(round.failed(
                        AttemptOutcome::Abandoned,
                        Stage::Unmasking,
                        error.to_string(),
                        now,
                    ));
                    self.remember_failure(&attempt);
                    self.end_round();
                    // Its groups' sums were unmasked: privacy is spent.
                    self.unstored_releases += 1;
                    self.pending.push_back(TickOutcome::Abandoned { round: number, error, attempt });
                }
            }
        } else {
            let failed = |g: &Group| match g.state() {
                GroupState::Failed { stage, .. } => Some(*stage),
                _ => None,
            };
            let stage = round.groups.iter().filter_map(failed).max().unwrap_or(Stage::AdvertiseKeys);
            let attempt = Box::new(round.failed(AttemptOutcome::Aborted, stage, round.failures(), now));
            self.remember_failure(&attempt);
            self.end_round();
            self.pending.push_back(TickOutcome::Aborted { round: number, stage, attempt });
        }
    }

    /// Keeps who was in the attempt that just failed and why, so that its
    /// members are told the reason when they next ask for a stage.
    fn remember_failure(&mut self, attempt: &FailedAttempt) {
        let members = self.round().map(|r| r.members.keys().cloned().collect()).unwrap_or_default();
        self.last_failure = Some((members, attempt.clone()));
    }

    /// The last attempt that failed since this engine was loaded.
    pub fn last_failure(&self) -> Option<&FailedAttempt> {
        self.last_failure.as_ref().map(|(_, attempt)| attempt)
    }

    fn start_round(&mut self, now: i64) -> Option<u64> {
        let window = self.availability_ms();
        self.checked_in.retain(|_, (seen, _)| now - *seen <= window);
        let groups = self.spec.groups();
        let n = groups.selected() as usize;
        let mut candidates: Vec<_> =
            self.selectable(now).map(|(id, identity)| (id.clone(), identity)).collect();
        if candidates.len() < n {
            return None;
        }
        // A random selection, seated so that no group holds more than half
        // of a set of suspects (see `suspects`).
        candidates.shuffle(&mut self.rng);
        let mut selected = self.suspects.order(
            candidates,
            |(id, _)| id.as_str(),
            groups.count as usize,
            groups.size as usize,
        );
        selected.truncate(n);
        // A selected client is busy until it checks in again (when its
        // round is over for it): one cut from this round while it still
        // trains is not selected for the next in the meantime.
        for (id, _) in &selected {
            self.checked_in.remove(id);
        }
        let number = self.completed + 1;
        let attempt = self.attempts + 1;
        // Every client of the round trains from the current model, and its
        // round configuration says which (THREAT_MODEL claim 56).
        let model = Some(self.spec.model.layout.digest(&self.weights));
        let round = ActiveRound::open(
            number,
            attempt,
            selected,
            groups,
            model,
            &self.spec,
            &self.security,
            &mut self.rng,
            self.spread.as_ref(),
            now,
        )?;
        self.attempts = attempt;
        self.schedule = Schedule::Sync(SyncRound::Running(round));
        Some(number)
    }

    /// Takes a group's unmasking result: the group's sum is decoded and
    /// kept for the round, or, if unmasking or decoding failed, the group
    /// is given up (the error is returned to be reported). When it was the
    /// last group to settle, the next [`tick`](Self::tick) hands out the
    /// round's completion.
    pub fn unmasked(
        &mut self,
        round_number: u64,
        group: usize,
        session: [u8; 16],
        result: Result<Aggregate, ProtocolError>,
        now: i64,
    ) -> Result<(), TaskError> {
        if self.is_async() {
            return self.buffered_unmasked(round_number, session, result, now);
        }
        let dimension = self.spec.model.layout.len();
        let validated = self.spec.validation.is_some();
        let round = self
            .running_mut()
            .filter(|r| r.number == round_number)
            .ok_or(TaskError::NoSuchRound(round_number))?;
        // A result of an attempt that ended meanwhile finds nothing.
        let target = round
            .groups
            .get_mut(group)
            .filter(|g| g.seeds.session == session)
            .ok_or(TaskError::NoSuchRound(round_number))?;
        let check = validated.then(|| target.sum_check(&result)).flatten();
        let disputes: Vec<SumCheck> = if validated {
            target.disputes(&result).iter().map(SumCheck::dispute).collect()
        } else {
            Vec::new()
        };
        let outcome = target.unmasked(result, dimension).ok_or(TaskError::NoSuchRound(round_number))?;
        for check in check.iter().chain(&disputes) {
            self.sum_checked(check, None);
        }
        if outcome.is_err() {
            self.given_up(round_number, group, Stage::Unmasking);
        }
        self.settle(now);
        outcome
    }

    /// Takes a validated group's sum check: its members are cleared, or
    /// suspected; the participants isolated by it are excluded, recorded
    /// with the round in progress, and handed to the driver to store.
    pub(super) fn sum_checked(&mut self, check: &SumCheck, async_group: Option<u64>) {
        let round = self.completed + 1;
        let Self { suspects, pending, schedule, .. } = self;
        let isolated = match check {
            SumCheck::Passed(members) => {
                suspects.passed(members);
                Vec::new()
            }
            SumCheck::Failed(members) => suspects.failed(members),
        };
        // The record of the sync round in progress, or of the async group.
        let metrics = match (schedule, async_group) {
            (Schedule::Sync(sync), None) => sync.get_mut().map(|r| &mut r.metrics),
            (Schedule::Async(state), Some(number)) => {
                state.groups.get_mut(&number).map(|f| &mut f.round.metrics)
            }
            _ => None,
        };
        if let Some(metrics) = metrics {
            if let SumCheck::Failed(members) = check {
                metrics.suspects.extend(members.iter().cloned());
                metrics.suspects.sort();
                metrics.suspects.dedup();
            }
            metrics.excluded.extend(isolated.iter().cloned());
        }
        if !isolated.is_empty() {
            pending.push_back(TickOutcome::Excluded { round, participants: isolated });
        }
    }

    /// A round of several groups reports group `group` of round `round`,
    /// just given up in `stage`, and goes on without it.
    fn given_up(&mut self, round: u64, group: usize, stage: Stage) {
        if self.round().is_some_and(|r| r.groups.len() > 1) {
            self.pending.push_back(TickOutcome::GroupAborted { round, group, stage });
        }
    }

    /// The key of group `group` of the round in progress while nothing of
    /// it has happened yet (just started, no client told it is selected),
    /// so that it can still be handed to another replica.
    fn untouched(&self, group: usize) -> Option<GroupKey> {
        let round = self.round()?;
        match round.groups.get(group)?.state() {
            GroupState::Collecting(server)
                if server.stage() == Stage::AdvertiseKeys && server.received() == 0 => {}
            _ => return None,
        }
        Some(GroupKey {
            task: self.task_id.clone(),
            round: round.number,
            attempt: round.metrics.attempt,
            group: u32::try_from(group).ok()?,
        })
    }

    /// What another replica needs to run group `group` of the round in
    /// progress, while nothing of it has happened yet; `None` otherwise.
    pub fn assignment(&self, group: usize) -> Option<(GroupKey, GroupAssignment)> {
        let key = self.untouched(group)?;
        let target = &self.round()?.groups[group];
        let assignment = GroupAssignment {
            roster: target.roster.clone(),
            identities: target.identities.clone(),
            seeds: target.seeds,
            model: target.model.map(hex::encode),
        };
        Some((key, assignment))
    }

    /// Hands group `key.group` of the round in progress to the replica at
    /// `owner`, once its [`assignment`](Self::assignment) is stored: the
    /// group's clients are told they are selected when the owner has taken
    /// it up ([`remote_adopted`](Self::remote_adopted)), their stage
    /// messages go to the owner, and the group settles from the owner's
    /// report ([`remote_settled`](Self::remote_settled)).
    pub fn hand_off(&mut self, key: &GroupKey, owner: &str) -> bool {
        if self.untouched(key.group as usize).as_ref() != Some(key) {
            return false;
        }
        let Some(group) = self.remote_group(key) else { return false };
        group.hand_off(owner);
        true
    }

    /// The group `key` of the round in progress (this attempt).
    fn remote_group(&mut self, key: &GroupKey) -> Option<&mut Group> {
        let round = self.round_mut().filter(|r| r.number == key.round && r.metrics.attempt == key.attempt)?;
        round.groups.get_mut(key.group as usize)
    }

    /// The participants of the round in progress in groups that other
    /// replicas run, with the owner's URL.
    pub fn remote_members(&self) -> Vec<(String, String)> {
        let Some(round) = self.round() else { return Vec::new() };
        round
            .members
            .iter()
            .filter_map(|(participant, (group, _))| {
                let group = &round.groups[*group];
                let owner =
                    group.owner.as_ref().filter(|_| matches!(group.state(), GroupState::Remote(_)))?;
                Some((participant.clone(), owner.clone()))
            })
            .collect()
    }

    /// The owner of remote group `key` took it up (and reports its stage).
    pub fn remote_adopted(&mut self, key: &GroupKey, stage: Stage) {
        if let Some(group) = self.remote_group(key) {
            group.remote_adopted(stage);
        }
    }

    /// Participants that earlier stages of remote groups asked for their
    /// masked input (read back from the store): they refuse a re-run of
    /// this round, like those of the groups run here.
    pub fn add_contributors(&mut self, round: u64, participants: impl IntoIterator<Item = String>) {
        if self.completed + 1 == round {
            self.contributed.extend(participants);
        }
    }

    /// Settles remote group `key` from its owner's `report` (with its
    /// stored sum when it completed): it completed, or it was given up in
    /// the report's stage. A report that does not fit the round gives the
    /// group up. When it was the last group to settle, the next
    /// [`tick`](Self::tick) hands out the round's outcome.
    pub fn remote_settled(&mut self, key: &GroupKey, report: &GroupReport, mean: Option<Vec<f32>>, now: i64) {
        let dimension = self.spec.model.layout.len();
        let validated = self.spec.validation.is_some();
        let Some(group) = self.remote_group(key) else { return };
        let Some(failed) = group.settle_remote(report, mean, dimension) else { return };
        // The owner's names, held to the group's roster.
        let roster: HashSet<String> = group.roster.iter().cloned().collect();
        if let Some(check) = report.sum_check(&roster).filter(|_| validated) {
            self.sum_checked(&check, None);
        }
        for check in report.disputes(&roster).iter().filter(|_| validated) {
            self.sum_checked(check, None);
        }
        if let Some(stage) = failed {
            self.given_up(key.round, key.group as usize, stage);
        }
        self.settle(now);
    }

    /// Gives up remote group `key`: its owner's lease lapsed (the owner
    /// died or was cut off) before it reported; its clients count as
    /// dropouts, from the stage it last reported.
    pub fn remote_lost(&mut self, key: &GroupKey, now: i64) {
        let Some(group) = self.remote_group(key) else { return };
        let Some(stage) = group.lose_remote() else { return };
        self.given_up(key.round, key.group as usize, stage);
        self.settle(now);
    }

    /// The number of groups of the round in progress.
    pub fn group_count(&self) -> usize {
        self.round().map_or(0, |r| r.groups.len())
    }

    /// The next model from the completed groups' sums: their weighted
    /// means added with their example counts as weights, the optimizer
    /// step, and the round's records.
    fn compute(&self, now: i64) -> Result<Completion, TaskError> {
        let round = self.round().ok_or(TaskError::NoSuchRound(self.completed + 1))?;
        self.compute_from(round, round.number, None, now)
    }

    /// The next model, version `round_number`, from `round`'s completed
    /// groups; an async task's group also records its number and its
    /// members' staleness.
    pub(super) fn compute_from(
        &self,
        round: &ActiveRound,
        round_number: u64,
        buffer: Option<(u64, Vec<u64>)>,
        now: i64,
    ) -> Result<Completion, TaskError> {
        let dimension = self.spec.model.layout.len();
        let mut done: Vec<&GroupSum> = round
            .groups
            .iter()
            .filter_map(|g| match g.state() {
                GroupState::Done(sum) => Some(sum),
                _ => None,
            })
            .collect();
        // A fitted ring's sum that wrapped throughout (its scale overshot)
        // is left out, and the next round runs at the safe scale
        // (`spread_of`). When every group's did, the round completes with
        // the model as it was: its clients contributed, so they could not
        // run the round again, and the task goes on.
        let unmasked = done.len();
        done.retain(|g| !g.mean.overflowed());
        let overflowed_groups = (unmasked - done.len()) as u32;
        let wrapped = done.is_empty();
        let rule = self.spec.validation.and_then(|v| v.group_rule);
        let completed_groups = done.len();
        if let Some(GroupRule::Norm { max }) = rule {
            done.retain(|g| robust::norm(&g.mean.mean) <= f64::from(max));
            if done.is_empty() && !wrapped {
                return Err(TaskError::AllGroupsRejected);
            }
        }
        let rejected_groups = (completed_groups - done.len()) as u32;
        let total_weight: u64 = done.iter().map(|g| g.mean.total_weight).sum();
        if total_weight == 0 && !wrapped {
            return Err(QuantizeError::NoExamples.into());
        }
        let means = || done.iter().map(|g| g.mean.mean.as_slice()).collect::<Vec<_>>();
        let mean: Vec<f32> = match (done.as_slice(), rule) {
            ([], _) => vec![0.0; dimension],
            ([only], _) => only.mean.mean.clone(),
            (groups, Some(GroupRule::Median)) if groups.len() >= 3 => robust::coordinate_median(&means()),
            (groups, Some(GroupRule::TrimmedMean { trim })) if groups.len() >= 3 => {
                robust::trimmed_mean(&means(), trim)
            }
            _ => {
                let mut sum = vec![0f64; dimension];
                for group in &done {
                    let weight = group.mean.total_weight as f64;
                    for (s, m) in sum.iter_mut().zip(&group.mean.mean) {
                        *s += f64::from(*m) * weight;
                    }
                }
                sum.iter().map(|s| (s / total_weight as f64) as f32).collect()
            }
        };
        let spread = self.spread_of(round);
        let mut client_metrics = MetricSums::default();
        done.iter().for_each(|g| client_metrics.merge(&g.mean.metrics));
        let survivors: u32 = done.iter().map(|g| g.survivors).sum();
        let mut weights = self.weights.clone();
        let mut state = self.optimizer_state.clone();
        if !wrapped {
            self.spec.optimizer.step(&mut weights, &mean, &mut state)?;
        }
        let selected = round.selected() as f64;
        let (bytes_up, bytes_down) = round.bytes();
        let mut metrics = round.metrics.clone();
        metrics.stages = round.stages();
        metrics.groups = round.group_metrics();
        metrics.bytes_up_per_client = bytes_up as f64 / selected;
        metrics.bytes_down_per_client = bytes_down as f64 / selected;
        metrics.compression_ratio = metrics.bytes_up_per_client / (4.0 * dimension as f64);
        metrics.total_examples = total_weight;
        metrics.update_norm = mean.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        metrics.epsilon = self.privacy.as_ref().map(|plan| plan.epsilon_after(self.releases() + 1));
        metrics.buffer = buffer.map(|(group, staleness)| {
            let mut histogram = vec![0; staleness.iter().max().map_or(0, |&s| s as usize + 1)];
            staleness.iter().for_each(|&s| histogram[s as usize] += 1);
            BufferMetrics { group, staleness_histogram: histogram }
        });
        let faulty_shares: Vec<(String, String)> =
            done.iter().flat_map(|g| g.faulty_shares.iter().cloned()).collect();
        metrics.faulty_shares = faulty_shares.len() as u32;
        metrics.refused_inputs = done.iter().flat_map(|g| g.refused.iter().cloned()).collect();
        metrics.rejected_groups = rejected_groups;
        metrics.overflowed_groups = overflowed_groups;
        metrics.client_means = client_metrics
            .means()
            .map(|(metric, mean, clients)| (metric.name().to_string(), ClientMean { mean, clients }))
            .collect();
        let model = encode_model(&self.task_id, &self.spec.model.layout, &weights, round_number)?;
        Ok(Completion {
            round: RoundRecord {
                task_id: self.task_id.clone(),
                round: round_number as i64,
                started_at: round.started_at,
                finished_at: now,
                selected: round.selected() as i64,
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
            spread,
        })
    }

    /// In a fitted ring, the widest spread of `round`'s completed groups'
    /// sums, for the next round's scale; `None` (the safe scale next) when
    /// one of them wrapped throughout, since its spread says nothing.
    fn spread_of(&self, round: &ActiveRound) -> Option<SumSpread> {
        if self.spec.quantization.ring != RingSizing::Fitted || self.spec.privacy.is_some() {
            return None;
        }
        let sums: Vec<(&Group, &GroupSum)> = round
            .groups
            .iter()
            .filter_map(|g| match g.state() {
                GroupState::Done(sum) => Some((g, sum)),
                _ => None,
            })
            .collect();
        if sums.iter().any(|(_, sum)| sum.mean.overflowed()) {
            return None;
        }
        sums.iter()
            .filter_map(|(group, sum)| group.quantizer.spread(&sum.mean, sum.survivors))
            .reduce(|a, b| a.widest(&b).unwrap_or(a))
    }

    /// Takes back what a [`TickOutcome::Persist`] asked the driver to
    /// store, with whether it was: the engine goes on from there (see
    /// [`Persist`]). Something that no longer fits the task (a round given
    /// up meanwhile) changes nothing.
    pub fn advance(&mut self, persisted: Persist, stored: bool) {
        match (persisted, stored) {
            (Persist::Contributors { .. }, true) => {}
            (Persist::Contributors { round, participants }, false) => {
                if let Some(state) = self.fedbuff_mut() {
                    state.withdraw(round);
                } else if self.round().is_some_and(|r| r.number == round) {
                    self.end_round();
                    for participant in &participants {
                        self.contributed.remove(participant);
                    }
                }
            }
            (Persist::Model(completion), true) => self.adopt(*completion),
            (Persist::Model(completion), false) => {
                let round = completion.round.round as u64;
                if let Some(state) = self.fedbuff_mut() {
                    state.abandon();
                } else if matches!(&self.schedule, Schedule::Sync(SyncRound::Persisting(r)) if r.number == round)
                {
                    // Its completion was computed from unmasked sums.
                    self.unstored_releases += 1;
                    self.end_round();
                }
            }
        }
    }

    /// Adopts a stored completion as the new global model.
    fn adopt(&mut self, completion: Completion) {
        self.spread = completion.spread;
        self.weights = completion.weights;
        self.optimizer_state = completion.optimizer_state;
        self.checkpoint_bytes = bytes::Bytes::from(completion.checkpoint.model);
        self.completed = completion.round.round as u64;
        self.attempts = 0;
        self.contributed.clear();
        let roster = match self.fedbuff_mut() {
            Some(state) => state.applied(),
            None => self.end_round().map(|round| (round.number, round.members.into_keys().collect())),
        };
        if let Some(roster) = roster {
            self.recent.push_back(roster);
            while self.recent.len() > REPORTABLE_ROUNDS {
                self.recent.pop_front();
            }
        }
        if self.completed >= u64::from(self.spec.rounds) {
            self.status = TaskStatus::Completed;
        }
    }
}

impl GroupStep {
    /// What a step of group `place` comes to for the engine's driver (a
    /// group given up is reported only in a round of `several`).
    pub(super) fn outcome(self, place: Place<'_>, several: bool) -> Option<TickOutcome> {
        match self {
            GroupStep::Next(_) => None,
            GroupStep::MaskedInputRequested(participants) => {
                Some(TickOutcome::Persist(Persist::Contributors { round: place.round, participants }))
            }
            GroupStep::Unmask(job) => Some(TickOutcome::Unmask(job)),
            GroupStep::Failed(stage) => {
                several.then_some(TickOutcome::GroupAborted { round: place.round, group: place.index, stage })
            }
        }
    }
}

/// A client of the task's sync round or async groups.
impl StageHost for TaskEngine {
    /// The group of the round in progress (or the async group) that
    /// `participant` is in; an inactive task, or a client that is in none,
    /// is refused (told why, when the attempt it was in failed).
    fn seat(&mut self, participant: &str) -> Result<(&mut Group, ClientId), EngineError> {
        if self.status != TaskStatus::Active {
            return Err(EngineError::Inactive(self.status));
        }
        if self.is_async() {
            return self.buffered_member(participant).ok_or(EngineError::NotSelected);
        }
        let member = self.round().and_then(|round| round.members.get(participant).copied());
        let Some((group, id)) = member else {
            return Err(match &self.last_failure {
                Some((members, attempt)) if members.contains(participant) => EngineError::Failed(format!(
                    "round {} (attempt {}) was {}: {}",
                    attempt.round,
                    attempt.attempt,
                    attempt.outcome.as_str(),
                    attempt.reason
                )),
                _ => EngineError::NotSelected,
            });
        };
        let round = self.round_mut().ok_or(EngineError::NotSelected)?;
        Ok((&mut round.groups[group], id))
    }
}
