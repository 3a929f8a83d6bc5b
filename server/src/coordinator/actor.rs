//! The actor: serves the handles' requests one at a time, ticks the
//! engines, and persists what they complete before they adopt it.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cohort_crypto::{Aggregate, ProtocolError};
use tokio::sync::mpsc;

use tracing::Instrument;

use super::changes::Changes;
use super::{Admission, CoordinatorError, IDLE_TICK, LiveState, MIN_TICK, Request, Shown, Traced, now_ms};
use crate::cluster::groups::GroupEvent;
use crate::cluster::lease::Routes;
use crate::cluster::{GroupKey, Replica};
use crate::metrics::Metrics;
use crate::round::owned::OwnedGroup;
use crate::round::{
    Completion, EngineError, FailedAttempt, InputStep, PendingUnmask, Persist, Poll, StageHost, TaskEngine,
    TaskError, TickOutcome,
};
use crate::spec::TaskPlan;
use crate::store::{AuditRecord, Fence, SqlStore, StoreError, TaskStatus};

pub(crate) async fn load(store: &SqlStore, id: &str) -> Result<TaskEngine, CoordinatorError> {
    let task = store.task(id).await?;
    let plan = TaskPlan::new(task.spec()?).map_err(TaskError::from)?;
    let latest = store.latest_checkpoint(id).await?;
    let contributed = store.contributors(id, latest.round + 1).await?;
    let excluded = store.exclusions(id).await?;
    Ok(TaskEngine::new(task.id, plan, task.status, &latest, contributed)?
        .with_exclusions(excluded)
        .with_project(task.project_id))
}

pub(crate) struct Actor {
    pub(crate) store: SqlStore,
    pub(crate) engines: HashMap<String, TaskEngine>,
    pub(crate) metrics: Metrics,
    pub(crate) tx: mpsc::Sender<Traced>,
    pub(crate) routes: Arc<RwLock<Routes>>,
    pub(crate) replica: Arc<Replica>,
    /// The groups this replica runs for other replicas' rounds.
    pub(crate) owned: HashMap<GroupKey, OwnedGroup>,
    /// Their participants.
    pub(crate) owned_members: HashMap<String, GroupKey>,
    /// Remote groups whose masked-input requests were read back.
    pub(crate) contributors_read: HashSet<GroupKey>,
    /// The lease each task led here is written under.
    pub(crate) fences: HashMap<String, Fence>,
    /// Counts the changes of what the admin API shows, per task (see
    /// [`Coordinator::changes`](super::Coordinator::changes)).
    pub(crate) changes: Arc<Changes>,
    /// Counts the changes of each task's [stage mark](TaskEngine::stage_mark)
    /// here (its engine's and those of the groups run here for it), which
    /// wake the client requests held until their answer may differ.
    pub(crate) stages: Arc<Changes>,
    /// Each task's last stage mark here.
    pub(crate) marks: HashMap<String, u64>,
}

impl Drop for Actor {
    /// However the actor stops, the event streams are told.
    fn drop(&mut self) {
        self.changes.close();
        self.stages.close();
    }
}

impl Actor {
    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Traced>) {
        // The idle tick is due at a fixed time, so that a steady stream of
        // requests cannot put it off.
        let mut idle_at = tokio::time::Instant::now() + IDLE_TICK;
        loop {
            let wake = self.next_deadline().map_or(idle_at, |at| at.min(idle_at));
            tokio::select! {
                request = rx.recv() => match request {
                    Some(Traced(request, span)) => {
                        let changes = request.changes_state();
                        let task = request.task().map(str::to_owned);
                        if self.handle(request).instrument(span).await.is_break() {
                            return;
                        }
                        // A query (a poll, an admission, a piece of a
                        // masked input) closes no stage; a deadline that
                        // does is the tick's, below.
                        match (changes, task) {
                            (false, _) => {}
                            (true, Some(task)) => {
                                self.changes.task(&task);
                                self.restage(&task);
                            }
                            (true, None) => {
                                self.changes.all();
                                self.restage_all();
                            }
                        }
                    }
                    None => return,
                },
                () = tokio::time::sleep_until(wake) => {
                    // A stage that closes at its deadline: what a tick
                    // changed, the admin API is told.
                    let before = self.shown();
                    let ids: Vec<String> = self.engines.keys().cloned().collect();
                    for id in ids {
                        self.tick(&id).await;
                    }
                    let keys: Vec<GroupKey> = self.owned.keys().cloned().collect();
                    for key in keys {
                        self.tick_owned(&key).await;
                    }
                    idle_at = tokio::time::Instant::now() + IDLE_TICK;
                    let after = self.shown();
                    let keys = before.keys().chain(after.keys());
                    for task in keys.filter(|task| before.get(*task) != after.get(*task)) {
                        self.changes.task(task);
                    }
                    self.restage_all();
                }
            }
        }
    }

    /// When the earliest stage deadline of the tasks led here and the groups
    /// run here is due (1 ms after it, since a stage closes once the time is
    /// past its deadline), at least [`MIN_TICK`] from now.
    fn next_deadline(&self) -> Option<tokio::time::Instant> {
        // One read of the routes per wait (this runs after every request).
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !routes.leases_hold() {
            return None;
        }
        let led = self.engines.iter().filter(|(id, _)| routes.here.contains(*id)).map(|(_, engine)| engine);
        let earliest = led
            .filter_map(TaskEngine::next_deadline)
            .chain(self.owned.values().filter_map(OwnedGroup::next_deadline))
            .min();
        let wait = Duration::from_millis(u64::try_from(earliest? + 1 - now_ms()).unwrap_or(0));
        Some(tokio::time::Instant::now() + wait.max(MIN_TICK))
    }

    /// The stage mark of `task` here: its engine's and those of the groups
    /// run here for it; `None` when neither is here.
    fn stage_mark(&self, task: &str) -> Option<u64> {
        use std::hash::{Hash, Hasher};
        let engine = self.engines.get(task).map(TaskEngine::stage_mark);
        let mut owned = self.owned.iter().filter(|(key, _)| key.task == task).peekable();
        if engine.is_none() && owned.peek().is_none() {
            return None;
        }
        let mut hasher = std::hash::DefaultHasher::new();
        engine.hash(&mut hasher);
        let mut groups: Vec<(&GroupKey, u64)> = owned
            .map(|(key, group)| {
                let mut hasher = std::hash::DefaultHasher::new();
                group.mark(&mut hasher);
                (key, hasher.finish())
            })
            .collect();
        groups.sort_unstable_by_key(|(key, _)| (key.round, key.attempt, key.group));
        groups.iter().for_each(|(_, mark)| mark.hash(&mut hasher));
        Some(hasher.finish())
    }

    /// Wakes the client requests held on `task` when its stage mark
    /// changed (or it left this replica).
    fn restage(&mut self, task: &str) {
        let mark = self.stage_mark(task);
        if mark == self.marks.get(task).copied() {
            return;
        }
        match mark {
            Some(mark) => self.marks.insert(task.to_string(), mark),
            None => self.marks.remove(task),
        };
        self.stages.task(task);
    }

    /// [`restage`](Self::restage) for every task here or marked before.
    fn restage_all(&mut self) {
        let mut tasks: HashSet<String> = self.marks.keys().cloned().collect();
        tasks.extend(self.engines.keys().cloned());
        tasks.extend(self.owned.keys().map(|key| key.task.clone()));
        for task in tasks {
            self.restage(&task);
        }
    }

    /// What a tick can change of the tasks led here, as the admin API
    /// shows it: each task's status, completed rounds, and the round and
    /// stage in progress.
    pub(crate) fn shown(&self) -> HashMap<String, Shown> {
        self.engines
            .iter()
            .map(|(id, engine)| {
                (id.clone(), (engine.status(), engine.completed_rounds(), engine.current_round()))
            })
            .collect()
    }

    /// Stops leading `id`: its round in progress is abandoned. A lease
    /// lost is a warning; a `planned` hand-back (the task was stopped, the
    /// replica stops) is not.
    pub(crate) fn drop_task(&mut self, id: &str, why: &str, planned: bool) {
        self.fences.remove(id);
        if self.engines.remove(id).is_some() {
            if planned {
                tracing::info!(task = id, why, "no longer leading the task");
            } else {
                tracing::warn!(task = id, why, "no longer leading the task");
            }
        }
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).here.remove(id);
    }

    /// Counts an aborted round of the task `id` (its own series only while
    /// its engine, which knows its project, is here).
    fn round_aborted(&self, id: &str) {
        match self.engines.get(id) {
            Some(engine) => self.metrics.round_aborted(engine.project(), id),
            None => self.metrics.process_round_aborted(),
        }
    }

    /// The engine of a task led here, while this replica can show it
    /// still holds the task's lease (see [`Routes::leases_hold`]).
    pub(crate) fn engine(&mut self, id: &str) -> Result<&mut TaskEngine, CoordinatorError> {
        if !self.leads(id) {
            return Err(CoordinatorError::UnknownTask);
        }
        self.engines.get_mut(id).ok_or(CoordinatorError::UnknownTask)
    }

    pub(crate) fn leases_hold(&self) -> bool {
        self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner).leases_hold()
    }

    /// Whether this replica may act for `id` now: its routes still list
    /// it (the lease keeper takes a lost lease off them at once) and its
    /// leases hold on the monotonic clock.
    pub(crate) fn leads(&self, id: &str) -> bool {
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        routes.here.contains(id) && routes.leases_hold()
    }

    /// Where `participant` of `task` sends its stage messages: the group
    /// run here for another replica's round that it is in (while the
    /// group's lease holds), or the task's engine. With the group's key,
    /// for an [`Admission`].
    pub(crate) fn host(
        &mut self,
        task: &str,
        participant: &str,
    ) -> Result<(&mut dyn StageHost, Option<GroupKey>), CoordinatorError> {
        let owned = self
            .owned_members
            .get(participant)
            .filter(|key| key.task == task && self.leases_hold() && self.owned.contains_key(*key))
            .cloned();
        Ok(match owned {
            Some(key) => (self.admitted_group(&key)?, Some(key)),
            None => (self.engine(task)?, None),
        })
    }

    /// The host that `admission` let the client in to: its message and
    /// every piece of it go there without the client being looked up
    /// again.
    pub(crate) fn admitted(&mut self, admission: &Admission) -> Result<&mut dyn StageHost, CoordinatorError> {
        match &admission.owned {
            Some(key) => self.admitted_group(key),
            None => Ok(self.engine(&admission.task)?),
        }
    }

    /// The group `key` run here, while its lease holds; a group settled or
    /// given up since refuses its clients as the engine does.
    fn admitted_group(&mut self, key: &GroupKey) -> Result<&mut dyn StageHost, CoordinatorError> {
        if !self.leases_hold() {
            return Err(EngineError::NotSelected.into());
        }
        match self.owned.get_mut(key) {
            Some(group) => Ok(group),
            None => Err(EngineError::NotSelected.into()),
        }
    }

    /// Closes what a client's message may have completed: the stage of the
    /// group run here for another replica (`owned`), or of the task.
    pub(crate) async fn tick_after(&mut self, task: &str, owned: Option<GroupKey>) {
        match owned {
            Some(key) => self.tick_owned(&key).await,
            None => self.tick(task).await,
        }
    }

    /// Unmasks `job` on the blocking thread pool and hands its result back
    /// to the actor as the request `answer` makes of it.
    pub(crate) fn unmask(
        &self,
        job: PendingUnmask,
        answer: impl FnOnce(Result<Aggregate, ProtocolError>) -> Request + Send + 'static,
    ) {
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            let _ = tx.blocking_send(answer(job.run()).into());
        });
    }

    /// Serves one request; `Break` once the actor must stop (shutdown).
    pub(crate) async fn handle(&mut self, request: Request) -> ControlFlow<()> {
        match request {
            Request::Load { id, reply } => {
                // A task just created: this replica leads it.
                // Taken by another replica's renewal first: it loaded the
                // task, which is as good.
                let result = self.take(&id, now_ms()).await.map(drop);
                let _ = reply.send(result);
            }
            Request::SetStatus { id, status, audit, reply } => {
                let result = self.set_status(&id, status, audit.as_ref()).await;
                let _ = reply.send(result);
            }
            Request::Live { id, reply } => {
                let result = self.engine(&id).map(|engine| {
                    let progress = engine.progress();
                    LiveState {
                        status: engine.status(),
                        completed_rounds: engine.completed_rounds(),
                        current_round: progress.as_ref().map(|p| p.round),
                        stage: progress.as_ref().map(|p| p.stage),
                        progress,
                        available_clients: engine.available(now_ms()),
                        privacy: engine.privacy(),
                        buffer: engine.buffer(now_ms()),
                        last_failure: engine.last_failure().cloned(),
                        stalled: engine.stalled(now_ms()),
                        suspected: engine.suspected(),
                        excluded: engine.excluded(),
                    }
                });
                let _ = reply.send(result);
            }
            Request::CheckIn { task, participant, identity, trained_on, reply } => {
                let now = now_ms();
                let result = self.engine(&task).and_then(|engine| {
                    if engine.is_excluded(&participant) {
                        return Err(EngineError::Excluded.into());
                    }
                    Ok(engine.check_in_trained(&participant, identity, trained_on, now))
                });
                let _ = reply.send(result);
                // A check-in may complete the cohort: start the round now.
                self.tick(&task).await;
            }
            Request::Leave { task, participant, reply } => {
                let result = self.engine(&task).map(|engine| engine.leave(&participant));
                let _ = reply.send(result);
                // The stage may wait for no one else now, or be unable to
                // reach its threshold: close it at once.
                self.tick(&task).await;
            }
            Request::Poll { task, participant, reply } => {
                let result =
                    self.host(&task, &participant).and_then(|(host, _)| Ok(host.poll(&participant)?));
                if let Ok(Poll::Message(bytes)) = &result {
                    self.metrics.bytes_out(bytes.len());
                }
                let _ = reply.send(result);
            }
            Request::Receive { admission, body, reply } => {
                let size = body.len();
                let result = self
                    .admitted(&admission)
                    .and_then(|host| Ok(host.receive(&admission.participant, &body)?));
                self.metrics.client_message(size, result.is_ok());
                let _ = reply.send(result);
                self.tick_after(&admission.task, admission.owned).await;
            }
            Request::Input { admission, step, reply } => {
                let (read, finishing) = match &step {
                    InputStep::Begin(bytes) | InputStep::Piece(_, bytes) => (bytes.len(), false),
                    InputStep::Finish(_) => (0, true),
                    InputStep::Abort(_) => (0, false),
                };
                let result =
                    self.admitted(&admission).and_then(|host| Ok(host.input(&admission.participant, step)?));
                self.metrics.bytes_in(read);
                if finishing || result.is_err() {
                    self.metrics.client_message(0, result.is_ok());
                }
                let ended = finishing && result.is_ok();
                let _ = reply.send(result);
                if ended {
                    self.tick_after(&admission.task, admission.owned).await;
                }
            }
            Request::Model { task, reply } => {
                let result = self.engine(&task).map(|e| (e.completed_rounds(), e.model().clone()));
                let _ = reply.send(result);
            }
            Request::Admit { task, participant, reply } => {
                let result = self.host(&task, &participant).and_then(|(host, owned)| {
                    let limit = host.admit(&participant)?;
                    Ok(Admission { task: task.clone(), participant: participant.clone(), limit, owned })
                });
                if result.is_err() {
                    // Refused before its body was read: a rejected message all the same.
                    self.metrics.client_message(0, false);
                }
                let _ = reply.send(result);
            }
            Request::MayReport { task, participant, round, reply } => {
                let result =
                    self.engine(&task).and_then(|e| e.may_report(&participant, round).map_err(Into::into));
                let _ = reply.send(result);
            }
            Request::Security { task, reply } => {
                let _ = reply.send(self.engine(&task).map(|engine| engine.security()));
            }
            Request::Shutdown { reply } => {
                self.give_up_leases().await;
                let _ = reply.send(());
                return ControlFlow::Break(());
            }
            Request::Lease(event) => self.apply(event),
            Request::Groups(GroupEvent::Own { record, plan }) => self.own(*record, *plan, now_ms()).await,
            Request::Groups(GroupEvent::Changed(changed)) => self.groups_changed(changed).await,
            Request::OwnedUnmasked { key, result } => {
                if let Some((report, mean)) = self.owned.get(&key).map(|group| group.unmasked(result)) {
                    self.settle_owned(&key, &report, mean.as_deref()).await;
                }
            }
            Request::Unmasked { task, round, group, session, result } => {
                let now = now_ms();
                if let Ok(engine) = self.engine(&task)
                    && let Err(error) = engine.unmasked(round, group, session, result, now)
                {
                    tracing::warn!(task, round, group, %error, "a group could not be unmasked; the round goes on without it");
                }
                self.tick(&task).await;
            }
        }
        ControlFlow::Continue(())
    }

    /// Changes a task's status: as its leader, under its lease; a task that
    /// nobody leads can only be stopped (the API serves that anywhere once
    /// no replica has led the task for a while; a leader that appears
    /// drops a stopped task).
    pub(crate) async fn set_status(
        &mut self,
        id: &str,
        status: TaskStatus,
        audit: Option<&AuditRecord>,
    ) -> Result<(), CoordinatorError> {
        let leading = self.engine(id).is_ok();
        if !leading && !status.is_final() {
            // Over already (the store says so), or led elsewhere (retry).
            return Err(match self.store.task(id).await?.status.is_final() {
                true => StoreError::Conflict("the task has ended").into(),
                false => CoordinatorError::UnknownTask,
            });
        }
        let fence = if leading { self.fences.get(id).cloned() } else { None };
        match self.store.set_task_status(id, status, now_ms(), fence.as_ref(), audit).await {
            Err(StoreError::Fenced) => {
                self.drop_task(id, "another replica took its lease over", false);
                return Err(CoordinatorError::UnknownTask);
            }
            other => other?,
        }
        if let Ok(engine) = self.engine(id) {
            engine.set_status(status);
        }
        if status != TaskStatus::Active {
            self.forget_groups(id).await;
        }
        if status.is_final() {
            self.drop_task(id, "it was stopped", true);
            let _ = self.store.release_lease(id, &self.replica.id).await;
        }
        Ok(())
    }

    /// Ticks a task's engine and acts on every outcome it hands out.
    pub(crate) async fn tick(&mut self, id: &str) {
        let now = now_ms();
        let Ok(engine) = self.engine(id) else { return };
        let before = engine.status();
        loop {
            let Ok(engine) = self.engine(id) else { return };
            match engine.tick(now) {
                TickOutcome::Idle => break,
                outcome => self.act(id, outcome, now).await,
            }
        }
        let Ok(engine) = self.engine(id) else { return };
        let status = engine.status();
        if before != status && matches!(status, TaskStatus::Completed | TaskStatus::BudgetSpent) {
            self.complete_task(id, status).await;
        }
    }

    pub(crate) async fn act(&mut self, id: &str, outcome: TickOutcome, now: i64) {
        match outcome {
            TickOutcome::Idle => {}
            TickOutcome::Started(round) => {
                self.metrics.round_started();
                tracing::info!(task = id, round, "round started");
                self.divide(id, round, now).await;
            }
            TickOutcome::Persist(Persist::Contributors { round, participants }) => {
                // Recorded before any of them can fetch the stage (this
                // actor serves the fetches), so that a restart still knows
                // who refuses a re-run of this round.
                let fence = self.fences.get(id);
                let recorded =
                    self.store.record_contributors(id, round as i64, &participants, now, fence).await;
                if let Err(StoreError::Fenced) = recorded {
                    self.round_aborted(id);
                    self.drop_task(id, "another replica took its lease over", false);
                    return;
                }
                if let Err(error) = &recorded {
                    self.round_aborted(id);
                    tracing::error!(task = id, round, %error, "could not record the round's contributors; the round is abandoned");
                }
                if let Ok(engine) = self.engine(id) {
                    engine.advance(Persist::Contributors { round, participants }, recorded.is_ok());
                }
                if recorded.is_err() {
                    self.forget_groups(id).await;
                }
            }
            TickOutcome::GroupAborted { round, group, stage } => {
                tracing::warn!(task = id, round, group, %stage, "group given up: too few clients; the round goes on without it");
            }
            TickOutcome::Aborted { round, stage, attempt } => {
                self.round_aborted(id);
                tracing::warn!(task = id, round, %stage, reason = attempt.reason, "round aborted: too few clients");
                self.record_attempt(id, &attempt).await;
                self.forget_groups(id).await;
            }
            TickOutcome::Abandoned { round, error, attempt } => {
                self.round_aborted(id);
                tracing::warn!(task = id, round, %error, "round abandoned");
                self.record_attempt(id, &attempt).await;
                self.forget_groups(id).await;
            }
            TickOutcome::Unmask(job) => {
                let (task, round, group, session) = (job.task_id.clone(), job.round, job.group, job.session);
                self.unmask(*job, move |result| Request::Unmasked { task, round, group, session, result });
            }
            TickOutcome::Persist(Persist::Model(completion)) => self.store_round(id, completion).await,
            TickOutcome::Excluded { round, participants } => {
                // Excluded at once in memory (the safe side); stored so that
                // a restart still excludes them. A store that fails here
                // loses the record, not the exclusion, until a restart.
                for participant in &participants {
                    tracing::warn!(task = id, round, participant, "excluded: isolated by failed sum checks");
                }
                match self
                    .store
                    .record_exclusions(id, round as i64, &participants, now, self.fences.get(id))
                    .await
                {
                    Ok(()) => {}
                    Err(StoreError::Fenced) => {
                        self.drop_task(id, "another replica took its lease over", false)
                    }
                    Err(error) => {
                        tracing::error!(task = id, round, %error, "could not record the exclusions")
                    }
                }
            }
        }
    }

    /// Keeps a failed attempt for the admin API and the dashboard (best
    /// effort: a store that fails here loses the record, not the task).
    pub(crate) async fn record_attempt(&mut self, id: &str, attempt: &FailedAttempt) {
        match self.store.record_attempt(id, attempt, self.fences.get(id)).await {
            Ok(()) => {}
            Err(StoreError::Fenced) => self.drop_task(id, "another replica took its lease over", false),
            Err(error) => {
                tracing::warn!(task = id, round = attempt.round, %error, "could not record the failed attempt")
            }
        }
    }

    /// Persists a completed round, then lets the engine adopt it.
    pub(crate) async fn store_round(&mut self, id: &str, completion: Box<Completion>) {
        let round = completion.round.round as u64;
        for (owner, holder) in completion.faulty_shares() {
            tracing::warn!(
                task = id,
                round,
                owner,
                holder,
                "a revealed share did not match its owner's commitment; the round was unmasked without it"
            );
        }
        let Ok(engine) = self.engine(id) else { return };
        let retention = engine.retention();
        let fence = self.fences.get(id);
        match self.store.complete_round(&completion.round, &completion.checkpoint, retention, fence).await {
            Ok(()) => {
                let survivors = completion.round.survivors;
                let selected = completion.round.selected;
                let stages = completion.stages().to_vec();
                let means = completion.client_means().clone();
                let metrics = self.metrics.clone();
                if let Ok(engine) = self.engine(id) {
                    engine.advance(Persist::Model(completion), true);
                    if let Some(epsilon) = engine.epsilon_spent() {
                        metrics.privacy_spent(engine.project(), id, epsilon);
                    }
                    metrics.round_completed((engine.project(), id), selected, survivors, &stages, &means);
                    tracing::info!(task = id, round, survivors, "round completed");
                }
                self.forget_groups(id).await;
            }
            Err(StoreError::Fenced) => {
                self.round_aborted(id);
                self.drop_task(id, "another replica took its lease over; its round is not stored", false);
            }
            Err(StoreError::Conflict(reason)) => {
                // Another replica recorded this round while it led the
                // task: this engine's model is stale. Reload it from the
                // store (the lease keeper drops it if the lease is lost).
                self.round_aborted(id);
                tracing::warn!(
                    task = id,
                    round,
                    reason,
                    "the round was recorded elsewhere; reloading the task"
                );
                match load(&self.store, id).await {
                    Ok(engine) => {
                        self.engines.insert(id.to_string(), engine);
                    }
                    Err(_) => self.drop_task(id, "its round was recorded by another replica", false),
                }
            }
            Err(error) => {
                self.round_aborted(id);
                tracing::error!(task = id, round, %error, "could not store the round; it will be run again");
                if let Ok(engine) = self.engine(id) {
                    engine.advance(Persist::Model(completion), false);
                }
            }
        }
    }

    pub(crate) async fn complete_task(&mut self, id: &str, status: TaskStatus) {
        if let Err(error) = self.store.set_task_status(id, status, now_ms(), self.fences.get(id), None).await
        {
            tracing::error!(task = id, %error, status = status.as_str(), "could not mark the task final");
        }
        let _ = self.store.release_lease(id, &self.replica.id).await;
        match status {
            TaskStatus::BudgetSpent => {
                tracing::info!(task = id, "the next round would exceed the privacy budget: task stopped")
            }
            _ => tracing::info!(task = id, "task completed"),
        }
    }
}
