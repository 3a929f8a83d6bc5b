//! The coordinator actor: the single owner of every task's round state.
//!
//! HTTP handlers send requests over a bounded channel and await the reply
//! on a oneshot; a timer ticks every engine so stages close at their
//! deadlines; unmasking runs on the blocking thread pool and reports back
//! through the same channel. Completed rounds are written to the store
//! before the engine adopts them.

use cohort_crypto::policy::TaskSecurity;
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cohort_crypto::{Aggregate, ProtocolError, Stage};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::round::{CheckIn, EngineError, Poll, RoundProgress, TaskEngine, TaskError, TickOutcome};
use crate::spec::TaskSpec;
use crate::store::{SqlStore, Store, StoreError, TaskStatus};

/// Requests waiting for the actor at most.
const QUEUE: usize = 1024;
/// How often stage deadlines are checked.
const TICK: Duration = Duration::from_millis(100);

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// Why the coordinator refused a request.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// No such task, or it is not loaded.
    #[error("task not found")]
    UnknownTask,
    /// The engine refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Storage failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The task could not be loaded (its spec or its stored state).
    #[error(transparent)]
    Task(#[from] TaskError),
    /// The actor is gone (shutting down).
    #[error("the coordinator is shutting down")]
    Unavailable,
}

/// A task's live state, as the admin API shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LiveState {
    /// Status.
    pub status: TaskStatus,
    /// Rounds completed.
    pub completed_rounds: u64,
    /// Round in progress.
    pub current_round: Option<u64>,
    /// Its stage.
    pub stage: Option<Stage>,
    /// Its progress.
    pub progress: Option<RoundProgress>,
    /// Clients that checked in recently enough to be selected.
    pub available_clients: usize,
}

enum Request {
    Load {
        id: String,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    SetStatus {
        id: String,
        status: TaskStatus,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    Live {
        id: String,
        reply: oneshot::Sender<Result<LiveState, CoordinatorError>>,
    },
    CheckIn {
        task: String,
        participant: String,
        identity: Option<[u8; 32]>,
        reply: oneshot::Sender<Result<CheckIn, CoordinatorError>>,
    },
    Poll {
        task: String,
        participant: String,
        reply: oneshot::Sender<Result<Poll, CoordinatorError>>,
    },
    Receive {
        task: String,
        participant: String,
        body: Vec<u8>,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    Model {
        task: String,
        reply: oneshot::Sender<Result<(u64, Vec<u8>), CoordinatorError>>,
    },
    Admit {
        task: String,
        participant: String,
        reply: oneshot::Sender<Result<usize, CoordinatorError>>,
    },
    MayReport {
        task: String,
        participant: String,
        round: u64,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    LoadedParameters {
        reply: oneshot::Sender<Result<usize, CoordinatorError>>,
    },
    Security {
        task: String,
        reply: oneshot::Sender<Result<TaskSecurity, CoordinatorError>>,
    },
    Unmasked {
        task: String,
        round: u64,
        result: Result<Aggregate, ProtocolError>,
    },
}

/// A handle to the coordinator actor; cheap to clone.
#[derive(Clone, Debug)]
pub struct Coordinator {
    tx: mpsc::Sender<Request>,
}

impl Coordinator {
    /// Loads every unfinished task from the store and starts the actor.
    /// Rounds that were in flight when the process stopped are not
    /// resumed: their tasks restart from the last completed round.
    pub async fn start(store: SqlStore, metrics: Metrics) -> Result<Self, CoordinatorError> {
        let mut engines = HashMap::new();
        for task in store.tasks().await? {
            if task.status.is_final() {
                continue;
            }
            engines.insert(task.id.clone(), load(&store, &task.id).await?);
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let actor = Actor { store, engines, metrics, tx: tx.clone() };
        tokio::spawn(actor.run(rx));
        Ok(Self { tx })
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, CoordinatorError>>) -> Request,
    ) -> Result<T, CoordinatorError> {
        let (reply, response) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| CoordinatorError::Unavailable)?;
        response.await.map_err(|_| CoordinatorError::Unavailable)?
    }

    /// Starts running a task that was just stored.
    pub async fn load(&self, id: &str) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::Load { id: id.to_string(), reply }).await
    }

    /// Pauses, resumes or stops a task (persisted first).
    pub async fn set_status(&self, id: &str, status: TaskStatus) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::SetStatus { id: id.to_string(), status, reply }).await
    }

    /// The live state of a loaded task.
    pub async fn live(&self, id: &str) -> Result<LiveState, CoordinatorError> {
        self.ask(|reply| Request::Live { id: id.to_string(), reply }).await
    }

    /// A client checks in.
    pub async fn check_in(
        &self,
        task: &str,
        participant: &str,
        identity: Option<[u8; 32]>,
    ) -> Result<CheckIn, CoordinatorError> {
        self.ask(|reply| Request::CheckIn {
            task: task.into(),
            participant: participant.into(),
            identity,
            reply,
        })
        .await
    }

    /// The server message a selected client should act on.
    pub async fn poll(&self, task: &str, participant: &str) -> Result<Poll, CoordinatorError> {
        self.ask(|reply| Request::Poll { task: task.into(), participant: participant.into(), reply }).await
    }

    /// A client's stage message.
    pub async fn receive(
        &self,
        task: &str,
        participant: &str,
        body: Vec<u8>,
    ) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::Receive { task: task.into(), participant: participant.into(), body, reply })
            .await
    }

    /// Whether a client may post a stage message now, and its size limit
    /// (see [`TaskEngine::admit`]).
    pub async fn admit(&self, task: &str, participant: &str) -> Result<usize, CoordinatorError> {
        self.ask(|reply| Request::Admit { task: task.into(), participant: participant.into(), reply }).await
    }

    /// Whether a client may report metrics for `round` (see
    /// [`TaskEngine::may_report`]).
    pub async fn may_report(
        &self,
        task: &str,
        participant: &str,
        round: u64,
    ) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::MayReport {
            task: task.into(),
            participant: participant.into(),
            round,
            reply,
        })
        .await
    }

    /// Model parameters over every loaded (unfinished) task.
    pub async fn loaded_parameters(&self) -> Result<usize, CoordinatorError> {
        self.ask(|reply| Request::LoadedParameters { reply }).await
    }

    /// The security parameters of a loaded task's rounds (see
    /// [`TaskEngine::security`]), derived when the task was loaded.
    pub async fn security(&self, task: &str) -> Result<TaskSecurity, CoordinatorError> {
        self.ask(|reply| Request::Security { task: task.into(), reply }).await
    }

    /// The current global model (round, safetensors bytes).
    pub async fn model(&self, task: &str) -> Result<(u64, Vec<u8>), CoordinatorError> {
        self.ask(|reply| Request::Model { task: task.into(), reply }).await
    }
}

async fn load(store: &SqlStore, id: &str) -> Result<TaskEngine, CoordinatorError> {
    let task = store.task(id).await?;
    let spec: TaskSpec = serde_json::from_str(&task.spec).map_err(TaskError::from)?;
    let latest = store.latest_checkpoint(id).await?;
    let contributed = store.contributors(id, latest.round + 1).await?;
    Ok(TaskEngine::new(task.id, spec, task.status, &latest, contributed)?)
}

struct Actor {
    store: SqlStore,
    engines: HashMap<String, TaskEngine>,
    metrics: Metrics,
    tx: mpsc::Sender<Request>,
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::Receiver<Request>) {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                request = rx.recv() => match request {
                    Some(request) => self.handle(request).await,
                    None => return,
                },
                _ = ticker.tick() => {
                    let ids: Vec<String> = self.engines.keys().cloned().collect();
                    for id in ids {
                        self.tick(&id).await;
                    }
                }
            }
        }
    }

    fn engine(&mut self, id: &str) -> Result<&mut TaskEngine, CoordinatorError> {
        self.engines.get_mut(id).ok_or(CoordinatorError::UnknownTask)
    }

    async fn handle(&mut self, request: Request) {
        match request {
            Request::Load { id, reply } => {
                let result = match load(&self.store, &id).await {
                    Ok(engine) => {
                        self.engines.insert(id, engine);
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(result);
            }
            Request::SetStatus { id, status, reply } => {
                let result = self.set_status(&id, status).await;
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
                    }
                });
                let _ = reply.send(result);
            }
            Request::CheckIn { task, participant, identity, reply } => {
                let now = now_ms();
                let result = self.engine(&task).map(|engine| engine.check_in(&participant, identity, now));
                let _ = reply.send(result);
                // A check-in may complete the cohort: start the round now.
                self.tick(&task).await;
            }
            Request::Poll { task, participant, reply } => {
                let result = self.engine(&task).and_then(|e| e.poll(&participant).map_err(Into::into));
                if let Ok(Poll::Message(bytes)) = &result {
                    self.metrics.bytes_out(bytes.len());
                }
                let _ = reply.send(result);
            }
            Request::Receive { task, participant, body, reply } => {
                let size = body.len();
                let result =
                    self.engine(&task).and_then(|e| e.receive(&participant, &body).map_err(Into::into));
                self.metrics.client_message(size, result.is_ok());
                let _ = reply.send(result);
                self.tick(&task).await;
            }
            Request::Model { task, reply } => {
                let result = self.engine(&task).map(|e| (e.completed_rounds(), e.model().to_vec()));
                let _ = reply.send(result);
            }
            Request::Admit { task, participant, reply } => {
                let result = self.engine(&task).and_then(|e| e.admit(&participant).map_err(Into::into));
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
            Request::LoadedParameters { reply } => {
                let _ = reply.send(Ok(self.engines.values().map(TaskEngine::parameters).sum()));
            }
            Request::Security { task, reply } => {
                let _ = reply.send(self.engine(&task).map(|engine| engine.security()));
            }
            Request::Unmasked { task, round, result } => self.finish_round(&task, round, result).await,
        }
    }

    async fn set_status(&mut self, id: &str, status: TaskStatus) -> Result<(), CoordinatorError> {
        self.store.set_task_status(id, status, now_ms()).await?;
        if let Ok(engine) = self.engine(id) {
            engine.set_status(status);
        }
        if status.is_final() {
            self.engines.remove(id);
        }
        Ok(())
    }

    async fn tick(&mut self, id: &str) {
        let now = now_ms();
        let Ok(engine) = self.engine(id) else { return };
        let before = engine.status();
        let outcome = engine.tick(now);
        let after = engine.status();
        match outcome {
            TickOutcome::Idle => {}
            TickOutcome::Started(round) => {
                self.metrics.round_started();
                tracing::info!(task = id, round, "round started");
            }
            TickOutcome::MaskedInputRequested { round, participants } => {
                // Recorded before any of them can fetch the stage (this
                // actor serves the fetches), so that a restart still knows
                // who refuses a re-run of this round.
                if let Err(error) = self.store.record_contributors(id, round as i64, &participants, now).await
                {
                    self.metrics.round_aborted();
                    tracing::error!(task = id, round, %error, "could not record the round's contributors; the round is abandoned");
                    if let Ok(engine) = self.engine(id) {
                        engine.withdraw(round, &participants);
                    }
                }
            }
            TickOutcome::Aborted { round, stage } => {
                self.metrics.round_aborted();
                tracing::warn!(task = id, round, %stage, "round aborted: too few clients");
            }
            TickOutcome::Unmask(job) => {
                let tx = self.tx.clone();
                let (task, round) = (job.task_id.clone(), job.round);
                tokio::task::spawn_blocking(move || {
                    let result = job.run();
                    let _ = tx.blocking_send(Request::Unmasked { task, round, result });
                });
            }
        }
        if before != after && after == TaskStatus::Completed {
            self.complete_task(id).await;
        }
    }

    async fn finish_round(&mut self, id: &str, round: u64, result: Result<Aggregate, ProtocolError>) {
        let now = now_ms();
        let Ok(engine) = self.engine(id) else { return };
        let completion = match engine.complete(round, result, now) {
            Ok(completion) => completion,
            Err(error) => {
                self.metrics.round_aborted();
                tracing::warn!(task = id, round, %error, "round abandoned");
                return;
            }
        };
        for (owner, holder) in completion.faulty_shares() {
            tracing::warn!(
                task = id,
                round,
                owner,
                holder,
                "a revealed share did not match its owner's commitment; the round was unmasked without it"
            );
        }
        let retention = engine.retention();
        match self.store.complete_round(&completion.round, &completion.checkpoint, retention).await {
            Ok(()) => {
                let survivors = completion.round.survivors;
                let selected = completion.round.selected;
                let stages = completion.stages().to_vec();
                let means = completion.client_means().clone();
                if let Ok(engine) = self.engine(id) {
                    engine.commit(completion);
                    let completed = engine.status() == TaskStatus::Completed;
                    self.metrics.round_completed(selected, survivors, &stages, &means);
                    tracing::info!(task = id, round, survivors, "round completed");
                    if completed {
                        self.complete_task(id).await;
                    }
                }
            }
            Err(error) => {
                self.metrics.round_aborted();
                tracing::error!(task = id, round, %error, "could not store the round; it will be run again");
                if let Ok(engine) = self.engine(id) {
                    engine.abandon(round);
                }
            }
        }
    }

    async fn complete_task(&mut self, id: &str) {
        if let Err(error) = self.store.set_task_status(id, TaskStatus::Completed, now_ms()).await {
            tracing::error!(task = id, %error, "could not mark the task completed");
        }
        tracing::info!(task = id, "task completed");
    }
}
