//! The coordinator: the single owner of the round state of every task
//! this process leads.
//!
//! HTTP handlers hold a [`Coordinator`], a cheap handle that sends
//! requests over a bounded channel to the actor (`actor`) and awaits the
//! reply on a oneshot; the actor ticks the engines at the earliest stage
//! deadline they report, so stages close on time; unmasking runs on the blocking thread pool and reports back
//! through the same channel. Completed rounds are written to the store
//! before the engine adopts them.
//!
//! What exists only with several replicas (leases, groups handed to other
//! replicas, forwarding) is in [`crate::cluster`].

pub(crate) mod actor;
mod changes;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cohort_crypto::policy::TaskSecurity;
use cohort_crypto::{Aggregate, ProtocolError, Stage};
use tokio::sync::{mpsc, oneshot, watch};

use crate::cluster::groups::{GroupEvent, GroupWatcher};
use crate::cluster::lease::{LeaseEvent, LeaseKeeper, Routes};
use crate::cluster::{GroupKey, Replica, Whereabouts};
use crate::metrics::Metrics;
use crate::round::{CheckIn, EngineError, InputStep, Poll, RoundProgress, TaskError};
use crate::store::{AuditRecord, SqlStore, StoreError, TaskStatus};
use actor::Actor;
use changes::Changes;

/// Requests waiting for the actor at most.
const QUEUE: usize = 1024;

/// The actor ticks every engine at the earliest stage deadline they report
/// ([`TaskEngine::next_deadline`](crate::round::TaskEngine::next_deadline)),
/// and at least this often (a task taken over or resumed starts its round
/// at the next check-in or, with none, within this).
pub(crate) const IDLE_TICK: Duration = Duration::from_secs(1);
/// The least wait between two ticks: a deadline an engine cannot act on
/// (its lease does not hold) must not spin the actor.
pub(crate) const MIN_TICK: Duration = Duration::from_millis(10);

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

/// A task's live state, as the admin API shows it (flattened into the
/// task's view).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct LiveState {
    pub status: TaskStatus,
    pub completed_rounds: u64,
    /// The round in progress.
    pub current_round: Option<u64>,
    /// The stage of the round in progress.
    pub stage: Option<Stage>,
    /// The round's progress: counts per stage, deadlines and traffic.
    pub progress: Option<RoundProgress>,
    /// Clients that checked in recently enough to be selected for the next
    /// round (not those an earlier attempt of it asked for a masked input).
    pub available_clients: usize,
    /// Differential privacy: the noise every round carries and the ε the
    /// task spent (absent for a task without DP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<crate::privacy::PrivacyView>,
    /// An async task's schedule: the model version, the groups in flight
    /// and how stale the applied updates were (absent for a sync task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<crate::round::BufferView>,
    /// The last attempt that ended without a new model since the leader
    /// loaded the task, and why (`GET /admin/tasks/{id}/attempts` lists
    /// them all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<crate::round::FailedAttempt>,
    /// Why the task makes no progress, when it should: too few clients
    /// for a round (and how many may not take part in it again), or no
    /// replica leading it (and why, when this replica could not load it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stalled: Option<String>,
    /// A validated task: participants in a group whose sum check failed
    /// (one of them masked another vector than it committed to), narrowed
    /// by later failures; later rounds split them up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspected: Vec<String>,
    /// Participants the failed sum checks isolated: never selected again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded: Vec<String>,
}

pub(crate) enum Request {
    Load {
        id: String,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    SetStatus {
        id: String,
        status: TaskStatus,
        audit: Option<AuditRecord>,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    Live {
        id: String,
        reply: oneshot::Sender<Result<LiveState, CoordinatorError>>,
    },
    Leave {
        task: String,
        participant: String,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    CheckIn {
        task: String,
        participant: String,
        identity: Option<[u8; 32]>,
        trained_on: Option<u64>,
        reply: oneshot::Sender<Result<CheckIn, CoordinatorError>>,
    },
    Poll {
        task: String,
        participant: String,
        reply: oneshot::Sender<Result<Poll, CoordinatorError>>,
    },
    Receive {
        admission: Admission,
        body: Vec<u8>,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    Input {
        admission: Admission,
        step: InputStep,
        reply: oneshot::Sender<Result<u64, CoordinatorError>>,
    },
    Model {
        task: String,
        reply: oneshot::Sender<Result<(u64, bytes::Bytes), CoordinatorError>>,
    },
    Admit {
        task: String,
        participant: String,
        reply: oneshot::Sender<Result<Admission, CoordinatorError>>,
    },
    MayReport {
        task: String,
        participant: String,
        round: u64,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    Security {
        task: String,
        reply: oneshot::Sender<Result<TaskSecurity, CoordinatorError>>,
    },
    Unmasked {
        task: String,
        round: u64,
        group: usize,
        session: [u8; 16],
        result: Result<Aggregate, ProtocolError>,
    },
    /// A group run here for another replica's round was unmasked.
    OwnedUnmasked {
        key: GroupKey,
        result: Result<Aggregate, ProtocolError>,
    },
    /// From the group watcher.
    Groups(GroupEvent),
    Shutdown {
        reply: oneshot::Sender<()>,
    },
    /// From the lease keeper.
    Lease(LeaseEvent),
}

/// A request with the span of the HTTP request that sent it (none for the
/// lease keeper's and the group watcher's news), which the actor enters
/// while it serves it: its log lines carry the request's id.
pub(crate) struct Traced(Request, tracing::Span);

impl From<Request> for Traced {
    fn from(request: Request) -> Self {
        Traced(request, tracing::Span::current())
    }
}

/// A task's status, completed rounds, and round and stage in progress.
type Shown = (TaskStatus, u64, Option<(u64, Stage)>);

impl Request {
    /// The task this request is about, when it is about one task led here
    /// (the lease keeper's and the group watcher's news may be about any).
    fn task(&self) -> Option<&str> {
        match self {
            Request::Load { id, .. } | Request::SetStatus { id, .. } | Request::Live { id, .. } => Some(id),
            Request::Leave { task, .. }
            | Request::CheckIn { task, .. }
            | Request::Poll { task, .. }
            | Request::Model { task, .. }
            | Request::Admit { task, .. }
            | Request::MayReport { task, .. }
            | Request::Security { task, .. }
            | Request::Unmasked { task, .. } => Some(task),
            Request::Receive { admission, .. } | Request::Input { admission, .. } => Some(&admission.task),
            Request::Lease(LeaseEvent::Adopt { id, .. } | LeaseEvent::Drop { id, .. }) => Some(id),
            Request::OwnedUnmasked { .. }
            | Request::Groups(_)
            | Request::Lease(_)
            | Request::Shutdown { .. } => None,
        }
    }

    /// Whether serving this request may change what the admin API shows
    /// (queries do not; nor does a piece of a masked input before its end,
    /// nor what only concerns groups run here for other replicas' rounds,
    /// whose tasks are shown by their leaders: the lease keeper's periodic
    /// list of them would otherwise wake every stream every second).
    fn changes_state(&self) -> bool {
        !matches!(
            self,
            Request::Live { .. }
                | Request::Poll { .. }
                | Request::Model { .. }
                | Request::Admit { .. }
                | Request::MayReport { .. }
                | Request::Security { .. }
                | Request::Shutdown { .. }
                | Request::Input { step: InputStep::Begin(_) | InputStep::Piece(..), .. }
                | Request::Lease(LeaseEvent::KeepGroups { .. })
                | Request::Groups(GroupEvent::Own { .. })
        )
    }
}

/// A client let in to post a stage message ([`Coordinator::admit`]): the
/// largest body it may send, and where its group runs, so that the message,
/// and every piece of a masked input, goes to that group without the
/// client being looked up again. A group that has settled or moved since
/// refuses the message as its engine would.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The task.
    pub task: String,
    /// The participant.
    pub participant: String,
    /// The largest body it may send.
    pub limit: usize,
    /// The group run here for another replica's round that the client is
    /// in; `None`: the task's own engine.
    pub(crate) owned: Option<GroupKey>,
}

/// A handle to the coordinator actor; cheap to clone.
#[derive(Clone, Debug)]
pub struct Coordinator {
    tx: mpsc::Sender<Traced>,
    changes: Arc<Changes>,
    /// See [`stage_changes`](Self::stage_changes).
    stages: Arc<Changes>,
    routes: Arc<RwLock<Routes>>,
    replica: Arc<Replica>,
    /// The lease keeper and the group watcher (PostgreSQL only).
    keeper: Option<[tokio::task::AbortHandle; 2]>,
}

impl Coordinator {
    /// Registers `replica`, takes the leases of the unfinished tasks it
    /// can (all of them when it is the only replica), loads them from the
    /// store and starts the actor. Rounds that were in flight when their
    /// leader stopped are not resumed: their tasks restart from the last
    /// completed round.
    ///
    /// The leases are kept through `lease_store`: on PostgreSQL a
    /// connection of its own ([`SqlStore::connect_dedicated`]), so that
    /// renewals never queue behind requests.
    pub async fn start(
        store: SqlStore,
        lease_store: SqlStore,
        metrics: Metrics,
        replica: Replica,
    ) -> Result<Self, CoordinatorError> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let changes = Arc::new(Changes::default());
        let stages = Arc::new(Changes::default());
        let routes = Arc::new(RwLock::new(Routes {
            started: Some(Instant::now()),
            shared: lease_store.backend() == crate::store::Backend::Postgres,
            ..Routes::default()
        }));
        let replica = Arc::new(replica);
        let mut actor = Actor {
            store: store.clone(),
            engines: HashMap::new(),
            metrics,
            tx: tx.clone(),
            routes: routes.clone(),
            replica: replica.clone(),
            owned: HashMap::new(),
            owned_members: HashMap::new(),
            contributors_read: HashSet::new(),
            fences: HashMap::new(),
            changes: changes.clone(),
            stages: stages.clone(),
            marks: HashMap::new(),
        };
        let mut keeper = LeaseKeeper {
            store: lease_store,
            replica: replica.clone(),
            routes: routes.clone(),
            held: HashMap::new(),
            renewed_at: now_ms(),
            failed_loads: HashMap::new(),
        };
        keeper.store.register_replica(&keeper.record(now_ms())).await?;
        // The first renewal before anything is served: a lone replica
        // leads every unfinished task from its first request on.
        let began = Instant::now();
        for event in keeper.renew(now_ms()).await? {
            actor.apply(event);
        }
        keeper.renewed_at = now_ms();
        if keeper.store.backend() == crate::store::Backend::Postgres {
            keeper.hold_until(began);
        }
        tokio::spawn(actor.run(rx));
        // On SQLite this process holds the database file's lock: no other
        // replica can start, so nothing can take a lease over, and the
        // first renewal's leases are kept without renewing them (the
        // keeper would only queue for the one connection under load).
        let keeper = match keeper.store.backend() {
            crate::store::Backend::Postgres => {
                let watcher = GroupWatcher {
                    store,
                    replica: replica.clone(),
                    routes: routes.clone(),
                    seen: HashMap::new(),
                    rosters: HashMap::new(),
                    routed: Vec::new(),
                };
                let watcher = tokio::spawn(watcher.run(tx.clone())).abort_handle();
                let keeper = tokio::spawn(keeper.run(tx.clone())).abort_handle();
                Some([keeper, watcher])
            }
            crate::store::Backend::Sqlite => None,
        };
        Ok(Self { tx, changes, stages, routes, replica, keeper })
    }

    /// A receiver that is told when a task this replica leads may have
    /// changed as the admin API shows it: a client checked in, sent, left
    /// or dropped out, a stage closed, a round started or completed, a
    /// status or a lease changed. It counts changes (coalesced: a slow
    /// reader sees the latest count), and its `changed()` fails once the
    /// coordinator has stopped. The admin API's event streams wait on it.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe_all()
    }

    /// As [`changes`](Self::changes), for the changes of one task only: a
    /// change to another task does not wake it.
    pub fn task_changes(&self, task: &str) -> watch::Receiver<u64> {
        self.changes.subscribe(task)
    }

    /// Told when what a client of `task` waits for here may have changed:
    /// a round started or ended, a group's stage closed, a group was taken
    /// up (see [`TaskEngine::stage_mark`](crate::round::TaskEngine::stage_mark)),
    /// the task left this replica, or its rounds stopped. Fails once the
    /// coordinator stops. One more message of a stage does not wake it.
    pub fn stage_changes(&self, task: &str) -> watch::Receiver<u64> {
        self.stages.subscribe(task)
    }

    /// This replica.
    pub fn replica(&self) -> &Replica {
        &self.replica
    }

    /// Which replica leads `task`, as of the last lease tick. A task led
    /// here whose lease this replica cannot show it still holds (it was
    /// paused past [`RENEWAL_MARGIN_MS`](crate::cluster::RENEWAL_MARGIN_MS)) is led nowhere until a renewal
    /// says.
    pub fn whereabouts(&self, task: &str) -> Whereabouts {
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if routes.here.contains(task) {
            if routes.leases_hold() { Whereabouts::Here } else { Whereabouts::Nowhere }
        } else if let Some(url) = routes.elsewhere.get(task) {
            Whereabouts::At(url.clone())
        } else {
            Whereabouts::Nowhere
        }
    }

    /// Where the group of `participant` runs, when it is in a group of a
    /// round in progress that is not run by the round's leader: here, or
    /// at another replica. `None` for every other participant (its
    /// requests go where its task's are).
    pub fn group_whereabouts(&self, participant: &str) -> Option<Whereabouts> {
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if routes.group_members_here.contains(participant) {
            return Some(if routes.leases_hold() { Whereabouts::Here } else { Whereabouts::Nowhere });
        }
        routes
            .group_members_elsewhere
            .get(participant)
            .filter(|url| **url != self.replica.url)
            .map(|url| Whereabouts::At(url.clone()))
    }

    /// Where the next request of a client of `task` belongs in a
    /// deployment of several replicas (`None` on SQLite, where there is
    /// one): the owner of `participant`'s group while a replica other than
    /// the leader runs it (this one included), else the task's leader (this
    /// replica, when it leads the task or does not know who does). The affinity cookie names it (see
    /// [`crate::cluster::affinity`]).
    pub fn next_replica(&self, task: &str, participant: Option<&str>) -> Option<String> {
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !routes.shared {
            return None;
        }
        // In a group run here: here.
        if participant.is_some_and(|p| routes.group_members_here.contains(p)) {
            return Some(self.replica.url.clone());
        }
        let owner = participant.and_then(|p| routes.group_members_elsewhere.get(p));
        let leader = routes.elsewhere.get(task).filter(|_| !routes.here.contains(task));
        Some(owner.or(leader).unwrap_or(&self.replica.url).clone())
    }

    /// Whether no replica has led `task` for longer than `limit` (as far as
    /// this replica has seen since it started). On SQLite, where this
    /// process is the only replica, a task it does not lead is led by
    /// nobody.
    pub fn unled_for(&self, task: &str, limit: Duration) -> bool {
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !routes.shared {
            return true;
        }
        let since = routes.last_led.get(task).copied().or(routes.started);
        since.is_some_and(|since| since.elapsed() > limit)
    }

    /// Why this replica could not load `task`, if it tried and failed.
    pub fn load_failure(&self, task: &str) -> Option<String> {
        self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner).unloadable.get(task).cloned()
    }

    /// Gives up every lease and stops the actor, so that the other
    /// replicas take the tasks over at once.
    pub async fn shutdown(&self) {
        for task in self.keeper.iter().flatten() {
            task.abort();
        }
        let (reply, done) = oneshot::channel();
        if self.tx.send(Request::Shutdown { reply }.into()).await.is_ok() {
            let _ = done.await;
        }
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, CoordinatorError>>) -> Request,
    ) -> Result<T, CoordinatorError> {
        let (reply, response) = oneshot::channel();
        self.tx.send(make(reply).into()).await.map_err(|_| CoordinatorError::Unavailable)?;
        response.await.map_err(|_| CoordinatorError::Unavailable)?
    }

    /// Starts running a task that was just stored.
    pub async fn load(&self, id: &str) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::Load { id: id.to_string(), reply }).await
    }

    /// Pauses, resumes or stops a task (persisted first, with `audit`,
    /// the admin action's entry, in the same transaction).
    pub async fn set_status(
        &self,
        id: &str,
        status: TaskStatus,
        audit: Option<AuditRecord>,
    ) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::SetStatus { id: id.to_string(), status, audit, reply }).await
    }

    /// The live state of a loaded task.
    pub async fn live(&self, id: &str) -> Result<LiveState, CoordinatorError> {
        self.ask(|reply| Request::Live { id: id.to_string(), reply }).await
    }

    /// A client checks in; in an async task, `trained_on` is the model
    /// version its finished update was trained from.
    pub async fn check_in(
        &self,
        task: &str,
        participant: &str,
        identity: Option<[u8; 32]>,
        trained_on: Option<u64>,
    ) -> Result<CheckIn, CoordinatorError> {
        self.ask(|reply| Request::CheckIn {
            task: task.into(),
            participant: participant.into(),
            identity,
            trained_on,
            reply,
        })
        .await
    }

    /// A client says it is leaving (see [`TaskEngine::leave`](crate::round::TaskEngine::leave)).
    pub async fn leave(&self, task: &str, participant: &str) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::Leave { task: task.into(), participant: participant.into(), reply }).await
    }

    /// The server message a selected client should act on.
    pub async fn poll(&self, task: &str, participant: &str) -> Result<Poll, CoordinatorError> {
        self.ask(|reply| Request::Poll { task: task.into(), participant: participant.into(), reply }).await
    }

    /// A client's stage message, posted under its `admission`.
    pub async fn receive(&self, admission: &Admission, body: Vec<u8>) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::Receive { admission: admission.clone(), body, reply }).await
    }

    /// A step of a client's masked input arriving in pieces (see
    /// [`InputStep`]), posted under its `admission`; `Begin` answers with
    /// the upload's number. The reply to a piece comes once it is in the
    /// sum, so a request body is read no faster than the actor adds it.
    pub async fn input(&self, admission: &Admission, step: InputStep) -> Result<u64, CoordinatorError> {
        self.ask(|reply| Request::Input { admission: admission.clone(), step, reply }).await
    }

    /// Tells the actor, without waiting for it, that `upload` of a client's
    /// masked input broke off: what it added is taken back out. For a
    /// request dropped mid-body (its connection closed), from a guard's
    /// `drop`.
    pub fn abandon_input(&self, admission: &Admission, upload: u64) {
        let (reply, _) = oneshot::channel();
        let step = InputStep::Abort(upload);
        let request: Traced = Request::Input { admission: admission.clone(), step, reply }.into();
        let tx = self.tx.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = tx.send(request).await;
                });
            }
            // No runtime (shutting down): the stage's close takes it out.
            Err(_) => {
                let _ = tx.try_send(request);
            }
        }
    }

    /// Whether a client may post a stage message now: its
    /// [`Admission`], with its size limit (see
    /// [`StageHost::admit`](crate::round::StageHost::admit)).
    pub async fn admit(&self, task: &str, participant: &str) -> Result<Admission, CoordinatorError> {
        self.ask(|reply| Request::Admit { task: task.into(), participant: participant.into(), reply }).await
    }

    /// Whether a client may report metrics for `round` (see
    /// [`TaskEngine::may_report`](crate::round::TaskEngine::may_report)).
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

    /// The security parameters of a loaded task's rounds (see
    /// [`TaskEngine::security`](crate::round::TaskEngine::security)), derived when the task was loaded.
    pub async fn security(&self, task: &str) -> Result<TaskSecurity, CoordinatorError> {
        self.ask(|reply| Request::Security { task: task.into(), reply }).await
    }

    /// The current global model (round, safetensors bytes).
    pub async fn model(&self, task: &str) -> Result<(u64, bytes::Bytes), CoordinatorError> {
        self.ask(|reply| Request::Model { task: task.into(), reply }).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_a_view_shows_counts_as_a_change() {
        let (reply, _) = oneshot::channel();
        let leave = Request::Leave { task: "t".into(), participant: "p".into(), reply };
        assert!(leave.changes_state(), "a client leaving changes the round's progress");
        let (reply, _) = oneshot::channel();
        assert!(!Request::Live { id: "t".into(), reply }.changes_state(), "a query");
        let kept = Request::Lease(LeaseEvent::KeepGroups { keys: HashSet::new(), since: 0 });
        assert!(!kept.changes_state(), "the groups run here for other replicas are no task's view");
        let dropped = Request::Lease(LeaseEvent::Drop { id: "t".into(), why: "test" });
        assert!(dropped.changes_state(), "a task no longer led here");
    }
}
