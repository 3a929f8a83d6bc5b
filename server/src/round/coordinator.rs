//! The coordinator actor: the single owner of the round state of every
//! task this process leads.
//!
//! HTTP handlers send requests over a bounded channel and await the reply
//! on a oneshot; a timer ticks every engine so stages close at their
//! deadlines; unmasking runs on the blocking thread pool and reports back
//! through the same channel. Completed rounds are written to the store
//! before the engine adopts them.
//!
//! Several processes (replicas) may share one database. Each task's rounds
//! are led by one of them, which holds the task's lease in the store
//! (`task_leases`): every [`LEASE_TICK`] a replica beats its heart,
//! renews the leases it holds, drops the tasks whose lease it lost, and
//! takes unheld ones up to its fair share (the unfinished tasks over the
//! live replicas). A lease lapses [`LEASE_TTL_MS`] after its last renewal,
//! so a replica that dies, or is cut off from the database, hands its
//! tasks on within seconds; one cut off stops leading them before its
//! leases can lapse. [`Coordinator::whereabouts`] tells the API which
//! replica to forward a task's requests to. On SQLite one process holds
//! the database (its file is locked) and so every task: it takes the
//! leases once at start and never renews them.
//!
//! A round of several groups is divided between the live replicas: its
//! leader hands each group it does not run itself to another replica as a
//! row in the store ([`crate::round::owned`]); the owner claims it (a
//! [`GroupWatcher`] looks for new ones every [`GROUP_TICK`]), holds it
//! with a lease renewed beside its task leases, serves the group's stage
//! messages (the API forwards them there, see
//! [`Coordinator::group_whereabouts`]) and stores the group's report; the
//! leader's watcher reads the reports back and settles the groups. A group
//! whose owner's lease lapses is given up: its clients count as dropouts.

use cohort_crypto::policy::TaskSecurity;
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cohort_crypto::{Aggregate, ProtocolError, Stage};
use tokio::sync::{mpsc, oneshot, watch};

use crate::metrics::Metrics;
use crate::round::owned::{GroupAssignment, GroupKey, GroupReport, OwnedGroup, OwnedStep};
use crate::round::{
    CheckIn, Completion, EngineError, FailedAttempt, InputStep, PendingUnmask, Poll, RoundProgress,
    TaskEngine, TaskError, TickOutcome,
};
use crate::spec::TaskSpec;
use crate::store::{
    AttemptRecord, Fence, GroupRecord, GroupRowState, ReplicaRecord, SqlStore, Store, StoreError, TaskStatus,
};

/// Requests waiting for the actor at most.
const QUEUE: usize = 1024;
/// How often stage deadlines are checked.
const TICK: Duration = Duration::from_millis(100);
/// How often a replica beats its heart and renews its leases.
pub const LEASE_TICK: Duration = Duration::from_secs(1);
/// How long a lease holds after its renewal.
pub const LEASE_TTL_MS: i64 = 5_000;
/// A replica that could not renew its leases for this long drops its
/// tasks: two seconds before the leases lapse and another replica may take
/// them.
pub const RENEWAL_MARGIN_MS: i64 = 3_000;
/// Groups are handed only to replicas that beat their heart this
/// recently (the leader reads the heartbeats once a second, each a second
/// apart, so a live replica's is up to about two seconds old, more on a
/// busy machine): one that died is still live for the task leases' fair
/// share for a while, but is not given groups once it missed two or three
/// beats, before a round whose group it lost (at [`LEASE_TTL_MS`]) ends.
pub const PEER_FRESH_MS: i64 = 3_500;
/// How often a replica looks for groups handed to it, for the reports of
/// the groups it handed out, and refreshes where groups' clients go.
pub const GROUP_TICK: Duration = Duration::from_millis(200);

/// This process as the other replicas sharing the database see it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Random, fresh per process.
    pub id: String,
    /// Where the other replicas reach this one (`http://host:port`).
    pub url: String,
    /// Start time (Unix ms).
    pub started_at: i64,
}

/// Which replica leads a task's rounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whereabouts {
    /// This one.
    Here,
    /// The replica at this URL.
    At(String),
    /// None at the moment (the task is finished, or its lease is between
    /// holders).
    Nowhere,
}

/// The tasks this replica leads, and the leaders of the others, as of the
/// last lease tick: read by the API on every task request.
#[derive(Debug, Default)]
struct Routes {
    here: HashSet<String>,
    elsewhere: HashMap<String, String>,
    /// Participants of the groups this replica runs for other replicas'
    /// rounds.
    group_members_here: HashSet<String>,
    /// Participants of groups that other replicas run, with the owner's URL.
    group_members_elsewhere: HashMap<String, String>,
    /// The live replicas (id, URL, last heartbeat), this one included, as
    /// of the last lease tick.
    peers: Vec<(String, String, i64)>,
    /// Until when this replica may act on the leases it holds, on the
    /// monotonic clock: [`RENEWAL_MARGIN_MS`] after its last renewal
    /// began. `None` on SQLite, where no other process can take a lease.
    /// A replica paused past it (a long GC pause, a frozen container)
    /// serves and writes nothing for its tasks until a renewal shows it
    /// still holds them.
    leases_hold_until: Option<Instant>,
    /// Tasks this replica could not load, with why (until their record
    /// changes, it does not try again).
    unloadable: HashMap<String, String>,
    /// When each task was last seen led (by any replica), on the
    /// monotonic clock (PostgreSQL; read at every lease renewal).
    last_led: HashMap<String, Instant>,
    /// When this replica started, on the monotonic clock.
    started: Option<Instant>,
    /// Whether other replicas can lead tasks (PostgreSQL).
    shared: bool,
}

impl Routes {
    /// Whether this replica may still act on the leases it holds.
    fn leases_hold(&self) -> bool {
        self.leases_hold_until.is_none_or(|until| Instant::now() < until)
    }
}

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
    /// Differential privacy: the noise and ε spent.
    pub privacy: Option<crate::privacy::PrivacyView>,
    /// An async task's schedule: its version, groups in flight and the
    /// staleness of the updates applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<super::BufferView>,
    /// The last attempt that ended without a new model, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<super::FailedAttempt>,
    /// Why no round can start now, when one should.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stalled: Option<String>,
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
        task: String,
        participant: String,
        body: Vec<u8>,
        reply: oneshot::Sender<Result<(), CoordinatorError>>,
    },
    Input {
        task: String,
        participant: String,
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
        reply: oneshot::Sender<Result<usize, CoordinatorError>>,
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

/// A task's status, completed rounds, and round and stage in progress.
type Shown = (String, TaskStatus, u64, Option<(u64, Stage)>);

impl Request {
    /// Whether serving this request may change what the admin API shows
    /// (queries do not; nor does a piece of a masked input before its end).
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
        )
    }
}

/// What the lease keeper tells the actor.
enum LeaseEvent {
    /// Lead this task, loaded from the store after its lease (of this
    /// generation) was taken.
    Adopt { id: String, engine: Box<TaskEngine>, generation: i64 },
    /// Stop leading this task.
    Drop { id: String, why: &'static str },
    /// Stop leading every task (and running every group).
    DropAll {
        why: &'static str,
        /// A planned hand-back (the replica stops), not a lost lease.
        planned: bool,
    },
    /// The groups run here whose leases were renewed at `since`: those
    /// claimed before then and missing were given up or lost.
    KeepGroups { keys: HashSet<GroupKey>, since: i64 },
}

/// What the group watcher tells the actor.
enum GroupEvent {
    /// Run this group, just claimed (with its task's spec, or why it could
    /// not be read).
    Own { record: Box<GroupRecord>, spec: Box<Result<TaskSpec, String>> },
    /// Groups of rounds led here changed state (settled ones with their
    /// stored sum, when they completed).
    Changed(Vec<(GroupRecord, Option<Vec<u8>>)>),
}

/// A handle to the coordinator actor; cheap to clone.
#[derive(Clone, Debug)]
pub struct Coordinator {
    tx: mpsc::Sender<Request>,
    changes: watch::Receiver<u64>,
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
        let (changes, changes_rx) = watch::channel(0);
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
            changes,
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
                };
                let watcher = tokio::spawn(watcher.run(tx.clone())).abort_handle();
                let keeper = tokio::spawn(keeper.run(tx.clone())).abort_handle();
                Some([keeper, watcher])
            }
            crate::store::Backend::Sqlite => None,
        };
        Ok(Self { tx, changes: changes_rx, routes, replica, keeper })
    }

    /// A receiver that is told when a task this replica leads may have
    /// changed as the admin API shows it: a client checked in, sent, left
    /// or dropped out, a stage closed, a round started or completed, a
    /// status or a lease changed. It counts changes (coalesced: a slow
    /// reader sees the latest count), and its `changed()` fails once the
    /// coordinator has stopped. The admin API's event streams wait on it.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// This replica.
    pub fn replica(&self) -> &Replica {
        &self.replica
    }

    /// Which replica leads `task`, as of the last lease tick. A task led
    /// here whose lease this replica cannot show it still holds (it was
    /// paused past [`RENEWAL_MARGIN_MS`]) is led nowhere until a renewal
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
        if self.tx.send(Request::Shutdown { reply }).await.is_ok() {
            let _ = done.await;
        }
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

    /// A client says it is leaving (see [`TaskEngine::leave`]).
    pub async fn leave(&self, task: &str, participant: &str) -> Result<(), CoordinatorError> {
        self.ask(|reply| Request::Leave { task: task.into(), participant: participant.into(), reply }).await
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

    /// A step of a client's masked input arriving in pieces (see
    /// [`InputStep`]); `Begin` answers with the upload's number. The reply
    /// to a piece comes once it is in the sum, so a request body is read
    /// no faster than the actor adds it.
    pub async fn input(
        &self,
        task: &str,
        participant: &str,
        step: InputStep,
    ) -> Result<u64, CoordinatorError> {
        self.ask(|reply| Request::Input { task: task.into(), participant: participant.into(), step, reply })
            .await
    }

    /// Tells the actor, without waiting for it, that `upload` of a client's
    /// masked input broke off: what it added is taken back out. For a
    /// request dropped mid-body (its connection closed), from a guard's
    /// `drop`.
    pub fn abandon_input(&self, task: &str, participant: &str, upload: u64) {
        let (reply, _) = oneshot::channel();
        let step = InputStep::Abort(upload);
        let request = Request::Input { task: task.into(), participant: participant.into(), step, reply };
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

    /// The security parameters of a loaded task's rounds (see
    /// [`TaskEngine::security`]), derived when the task was loaded.
    pub async fn security(&self, task: &str) -> Result<TaskSecurity, CoordinatorError> {
        self.ask(|reply| Request::Security { task: task.into(), reply }).await
    }

    /// The current global model (round, safetensors bytes).
    pub async fn model(&self, task: &str) -> Result<(u64, bytes::Bytes), CoordinatorError> {
        self.ask(|reply| Request::Model { task: task.into(), reply }).await
    }
}

/// Keeps this replica's leases, beside the actor so that the database's
/// answers (or its silence) never hold requests up: every [`LEASE_TICK`]
/// it beats the replica's heart, renews the leases held, takes unheld
/// tasks up to a fair share (loading them from the store), and tells the
/// actor what to lead and what to drop.
struct LeaseKeeper {
    store: SqlStore,
    replica: Arc<Replica>,
    routes: Arc<RwLock<Routes>>,
    /// The generation of each lease held.
    held: HashMap<String, i64>,
    /// When the leases were last renewed.
    renewed_at: i64,
    /// Tasks that could not be loaded, with their `updated_at` then: not
    /// tried again until an administrator changes them (stops, pauses).
    failed_loads: HashMap<String, i64>,
}

impl LeaseKeeper {
    fn record(&self, now: i64) -> ReplicaRecord {
        ReplicaRecord {
            id: self.replica.id.clone(),
            url: self.replica.url.clone(),
            started_at: self.replica.started_at,
            heartbeat_at: now,
        }
    }

    async fn run(mut self, tx: mpsc::Sender<Request>) {
        let mut ticker = tokio::time::interval(LEASE_TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            for event in self.tick().await {
                if tx.send(Request::Lease(event)).await.is_err() {
                    return;
                }
            }
        }
    }

    /// One renewal. The leases must be renewed within
    /// [`RENEWAL_MARGIN_MS`] of the last renewal, or every task is dropped:
    /// a replica that cannot reach the database stops leading before its
    /// leases can lapse (at [`LEASE_TTL_MS`]), so that two replicas never
    /// lead one task.
    async fn tick(&mut self) -> Vec<LeaseEvent> {
        let now = now_ms();
        let began = Instant::now();
        let budget = (self.renewed_at + RENEWAL_MARGIN_MS - now).max(100);
        match tokio::time::timeout(Duration::from_millis(budget as u64), self.renew(now)).await {
            Ok(Ok(events)) => {
                self.renewed_at = now;
                self.hold_until(began);
                events
            }
            failed => {
                match failed {
                    Ok(Err(error)) => tracing::warn!(%error, "could not renew the task leases"),
                    _ => tracing::warn!("the database did not answer the lease renewal in time"),
                }
                if now_ms() - self.renewed_at >= RENEWAL_MARGIN_MS && !self.held.is_empty() {
                    self.held.clear();
                    vec![LeaseEvent::DropAll {
                        planned: false,
                        why: "the leases could not be renewed in time (the database cannot be reached)",
                    }]
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// Lets the replica act on its leases until [`RENEWAL_MARGIN_MS`]
    /// after `began`, when the renewal that succeeded began: the leases it
    /// wrote hold [`LEASE_TTL_MS`] from a moment after `began`, which
    /// leaves two seconds for the replicas' clocks to disagree.
    fn hold_until(&self, began: Instant) {
        let until = began + Duration::from_millis(RENEWAL_MARGIN_MS as u64);
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).leases_hold_until =
            Some(until);
    }

    async fn renew(&mut self, now: i64) -> Result<Vec<LeaseEvent>, CoordinatorError> {
        let until = now + LEASE_TTL_MS;
        let mut events = Vec::new();
        self.store.heartbeat(&self.record(now)).await?;
        let tasks = self.store.tasks().await?;
        let unfinished: HashSet<String> =
            tasks.iter().filter(|t| !t.status.is_final()).map(|t| t.id.clone()).collect();
        // The tasks the actor took itself (created here) are held too.
        let here = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner).here.clone();
        let mut renewing: Vec<String> = self.held.keys().cloned().collect();
        renewing.extend(here.into_iter().filter(|id| !self.held.contains_key(id)));
        // Renew what is held; drop what was lost or finished.
        for id in renewing {
            let generation = if unfinished.contains(&id) {
                self.store.acquire_lease(&id, &self.replica.id, now, until).await?
            } else {
                None
            };
            match (generation, self.held.get(&id).copied()) {
                (Some(renewed), Some(before)) if renewed == before => {}
                (Some(renewed), None) => {
                    self.held.insert(id, renewed);
                }
                _ => {
                    self.held.remove(&id);
                    // Off the routes at once (the actor applies the drop
                    // after the requests queued before it): nothing is
                    // served or written for the task from now on.
                    self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).here.remove(&id);
                    events.push(LeaseEvent::Drop { id, why: "its lease was lost or the task finished" });
                }
            }
        }
        // Keep the groups run here for other replicas' rounds.
        let keys = self.store.renew_groups(&self.replica.id, now, until).await?;
        events.push(LeaseEvent::KeepGroups { keys: keys.into_iter().collect(), since: now });
        // Take unheld tasks up to a fair share of them.
        let peers = self.store.replicas(now - LEASE_TTL_MS).await?;
        let live = peers.len().max(1);
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).peers =
            peers.into_iter().map(|r| (r.id, r.url, r.heartbeat_at)).collect();
        let fair = unfinished.len().div_ceil(live);
        let holders: HashMap<String, String> =
            self.store.leases(now).await?.into_iter().map(|(task, holder)| (task, holder.url)).collect();
        let updated: HashMap<&str, i64> = tasks.iter().map(|t| (t.id.as_str(), t.updated_at)).collect();
        self.failed_loads.retain(|id, at| updated.get(id.as_str()) == Some(at));
        let mut free: Vec<&String> = unfinished
            .iter()
            .filter(|id| {
                !self.held.contains_key(*id)
                    && !holders.contains_key(*id)
                    && !self.failed_loads.contains_key(*id)
            })
            .collect();
        free.sort();
        // Held only once the renewal succeeds whole (its events reach the
        // actor): a lease taken by a renewal that fails later lapses.
        let mut adopted = Vec::new();
        for id in free {
            if self.held.len() + adopted.len() >= fair {
                break;
            }
            let Some(generation) = self.store.acquire_lease(id, &self.replica.id, now, until).await? else {
                continue;
            };
            let fence = Fence { replica: self.replica.id.clone(), generation };
            match adopt(&self.store, id, &fence).await {
                Ok(engine) => {
                    adopted.push((id.clone(), generation));
                    events.push(LeaseEvent::Adopt { id: id.clone(), engine: Box::new(engine), generation });
                }
                Err(error @ (CoordinatorError::Store(_) | CoordinatorError::Unavailable)) => {
                    // The database failed, not the task: tried again next time.
                    tracing::warn!(task = %id, %error, "could not load the task; trying again");
                    let _ = self.store.release_lease(id, &self.replica.id).await;
                }
                Err(error) => {
                    tracing::error!(task = %id, %error, "could not load the task; it can be stopped and deleted through the admin API");
                    let _ = self.store.release_lease(id, &self.replica.id).await;
                    self.failed_loads.insert(id.clone(), updated.get(id.as_str()).copied().unwrap_or(0));
                    self.routes
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .unloadable
                        .insert(id.clone(), format!("this replica could not load the task: {error}"));
                }
            }
        }
        self.held.extend(adopted);
        let seen = Instant::now();
        let mut routes = self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        routes.unloadable.retain(|id, _| self.failed_loads.contains_key(id));
        for task in holders.keys().chain(self.held.keys()) {
            routes.last_led.insert(task.clone(), seen);
        }
        routes.last_led.retain(|task, _| unfinished.contains(task));
        routes.elsewhere = holders
            .into_iter()
            .filter(|(task, url)| !self.held.contains_key(task) && *url != self.replica.url)
            .collect();
        Ok(events)
    }
}

/// Loads a task whose lease was just taken: the groups that an earlier
/// leader handed out are deleted first (their owners stop running them),
/// since the task restarts from its last stored round.
async fn adopt(store: &SqlStore, id: &str, fence: &Fence) -> Result<TaskEngine, CoordinatorError> {
    store.delete_groups(id, Some(fence)).await?;
    load(store, id).await
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
    routes: Arc<RwLock<Routes>>,
    replica: Arc<Replica>,
    /// The groups this replica runs for other replicas' rounds.
    owned: HashMap<GroupKey, OwnedGroup>,
    /// Their participants.
    owned_members: HashMap<String, GroupKey>,
    /// Remote groups whose masked-input requests were read back.
    contributors_read: HashSet<GroupKey>,
    /// The lease each task led here is written under.
    fences: HashMap<String, Fence>,
    /// Counts the changes of what the admin API shows (see
    /// [`Coordinator::changes`]).
    changes: watch::Sender<u64>,
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::Receiver<Request>) {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                request = rx.recv() => match request {
                    Some(request) => {
                        let changes = request.changes_state();
                        if self.handle(request).await.is_break() {
                            return;
                        }
                        if changes {
                            self.changed();
                        }
                    }
                    None => return,
                },
                _ = ticker.tick() => {
                    // A stage that closes at its deadline, a round that
                    // starts: what a tick changed, the admin API is told.
                    let before = self.shown();
                    let ids: Vec<String> = self.engines.keys().cloned().collect();
                    for id in ids {
                        self.tick(&id).await;
                    }
                    let keys: Vec<GroupKey> = self.owned.keys().cloned().collect();
                    for key in keys {
                        self.tick_owned(&key).await;
                    }
                    if self.shown() != before {
                        self.changed();
                    }
                }
            }
        }
    }

    /// Tells the admin API's streams that something changed.
    fn changed(&self) {
        self.changes.send_modify(|count| *count = count.wrapping_add(1));
    }

    /// What a tick can change of the tasks led here, as the admin API
    /// shows it: each task's status, completed rounds, and the round and
    /// stage in progress.
    fn shown(&self) -> Vec<Shown> {
        let mut shown: Vec<_> = self
            .engines
            .iter()
            .map(|(id, engine)| {
                (id.clone(), engine.status(), engine.completed_rounds(), engine.current_round())
            })
            .collect();
        shown.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        shown
    }

    /// Acts on the lease keeper's news.
    fn apply(&mut self, event: LeaseEvent) {
        match event {
            LeaseEvent::Adopt { id, engine, generation } => {
                tracing::info!(task = %id, generation, "leading the task");
                self.engines.insert(id.clone(), *engine);
                self.fences.insert(id.clone(), Fence { replica: self.replica.id.clone(), generation });
                self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).here.insert(id);
            }
            LeaseEvent::Drop { id, why } => self.drop_task(&id, why, false),
            LeaseEvent::DropAll { why, planned } => {
                for id in self.engines.keys().cloned().collect::<Vec<_>>() {
                    self.drop_task(&id, why, planned);
                }
                for key in self.owned.keys().cloned().collect::<Vec<_>>() {
                    self.disown(&key, why);
                }
            }
            LeaseEvent::KeepGroups { keys, since } => {
                let gone: Vec<GroupKey> = self
                    .owned
                    .iter()
                    .filter(|(key, group)| group.claimed_at < since && !keys.contains(*key))
                    .map(|(key, _)| key.clone())
                    .collect();
                for key in gone {
                    self.disown(&key, "its lease lapsed, or its round was given up or taken over");
                }
            }
        }
    }

    /// Whether rounds are divided between replicas: on PostgreSQL (on
    /// SQLite one process runs everything).
    fn divides(&self) -> bool {
        self.store.backend() == crate::store::Backend::Postgres
    }

    /// Stops running group `key` for another replica's round.
    fn disown(&mut self, key: &GroupKey, why: &str) {
        let Some(group) = self.owned.remove(key) else { return };
        tracing::info!(task = %key.task, round = key.round, group = key.group, why, "no longer running the group");
        let mut routes = self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        for participant in group.roster() {
            self.owned_members.remove(participant);
            routes.group_members_here.remove(participant);
        }
    }

    /// Starts running a group claimed for another replica's round.
    async fn own(&mut self, record: GroupRecord, spec: Result<TaskSpec, String>, now: i64) {
        let key = record.key.clone();
        let opened = spec
            .map_err(|error| {
                tracing::error!(task = %key.task, %error, "could not read the spec of a group's task");
                TaskError::GroupReport("the task's spec could not be read")
            })
            .and_then(|spec| {
                let assignment: GroupAssignment = serde_json::from_str(&record.assignment)?;
                OwnedGroup::open(key.clone(), assignment, spec, now)
            });
        match opened {
            Ok(group) => {
                let mut routes = self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
                for participant in group.roster() {
                    self.owned_members.insert(participant.clone(), key.clone());
                    routes.group_members_here.insert(participant.clone());
                }
                drop(routes);
                tracing::info!(task = %key.task, round = key.round, group = key.group, "running a group for the round's leader");
                self.owned.insert(key, group);
            }
            Err(error) => {
                tracing::error!(task = %key.task, round = key.round, group = key.group, %error, "could not run a group handed here; giving it up");
                let report = GroupReport::unbuilt();
                self.settle_owned(&key, &report, None).await;
            }
        }
    }

    /// Closes the stages of a group run here that are ready and acts on
    /// what that comes to.
    async fn tick_owned(&mut self, key: &GroupKey) {
        if !self.leases_hold() {
            return;
        }
        let now = now_ms();
        while let Some(step) = self.owned.get_mut(key).and_then(|group| group.tick(now)) {
            match step {
                OwnedStep::Stage(stage) => self.report_stage(key, stage).await,
                OwnedStep::MaskedInputRequested(participants) => {
                    let round = key.round as i64;
                    match self.store.record_contributors(&key.task, round, &participants, now, None).await {
                        Ok(()) => self.report_stage(key, Stage::MaskedInputCollection).await,
                        Err(error) => {
                            tracing::error!(task = %key.task, round, %error, "could not record the group's contributors; the group is given up");
                            if let Some(report) = self.owned.get(key).map(OwnedGroup::fail) {
                                self.settle_owned(key, &report, None).await;
                            }
                        }
                    }
                }
                OwnedStep::Unmask(job) => {
                    let key = key.clone();
                    self.unmask(*job, move |result| Request::OwnedUnmasked { key, result });
                }
                OwnedStep::Settled(report, mean) => {
                    self.settle_owned(key, &report, mean.as_deref()).await;
                }
            }
        }
    }

    /// Unmasks `job` on the blocking thread pool and hands its result back
    /// to the actor as the request `answer` makes of it.
    fn unmask(
        &self,
        job: PendingUnmask,
        answer: impl FnOnce(Result<Aggregate, ProtocolError>) -> Request + Send + 'static,
    ) {
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            let _ = tx.blocking_send(answer(job.run()));
        });
    }

    /// Tells the round's leader which stage a group run here is in.
    async fn report_stage(&mut self, key: &GroupKey, stage: Stage) {
        if let Err(error) = self.store.group_stage(key, &self.replica.id, &stage_name(stage)).await {
            tracing::debug!(%error, "could not record a group's stage");
        }
    }

    /// Stores a settled group's report (and sum) for the round's leader and
    /// stops running it.
    async fn settle_owned(&mut self, key: &GroupKey, report: &GroupReport, mean: Option<&[f32]>) {
        let stored = match serde_json::to_string(report) {
            Ok(json) => {
                let bytes = mean.map(GroupReport::encode_mean);
                self.store.settle_group(key, &self.replica.id, now_ms(), &json, bytes.as_deref()).await
            }
            Err(_) => Err(StoreError::Corrupt("group report")),
        };
        match stored {
            Ok(true) => {
                tracing::info!(task = %key.task, round = key.round, group = key.group, survivors = report.survivors, "group settled")
            }
            Ok(false) => {
                tracing::warn!(task = %key.task, round = key.round, group = key.group, "the group was no longer this replica's to settle")
            }
            Err(error) => {
                tracing::error!(task = %key.task, round = key.round, group = key.group, %error, "could not store the group's report; its lease lapses and the leader gives it up")
            }
        }
        self.disown(key, "it settled");
    }

    /// Hands the groups of a round just started to the live replicas, in
    /// turn from this one's place (rotated by the round number so that
    /// every replica leads its share): the groups this replica does not
    /// run are stored for their owners to claim, then marked remote in
    /// the engine. When they cannot be stored, this replica runs them all.
    async fn divide(&mut self, id: &str, round: u64, now: i64) {
        let me = self.replica.id.clone();
        let peers: Vec<(String, String)> = {
            let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            let fresh =
                |(id, _, heartbeat): &&(String, String, i64)| *id == me || now - heartbeat <= PEER_FRESH_MS;
            routes.peers.iter().filter(fresh).map(|(id, url, _)| (id.clone(), url.clone())).collect()
        };
        let divides = self.divides();
        let Some(engine) = self.engines.get(id) else { return };
        let count = engine.group_count();
        if !divides || count < 2 || peers.len() < 2 {
            return;
        }
        let start = peers.iter().position(|(peer, _)| *peer == me).unwrap_or(0);
        let mut records = Vec::new();
        for group in 0..count {
            let (owner_id, owner_url) = &peers[(start + group + round as usize) % peers.len()];
            if *owner_id == me {
                continue;
            }
            let Some((key, assignment)) = engine.assignment(group) else { continue };
            let Ok(assignment) = serde_json::to_string(&assignment) else { continue };
            records.push(GroupRecord {
                key,
                leader_id: me.clone(),
                owner_id: owner_id.clone(),
                owner_url: owner_url.clone(),
                assignment,
                state: GroupRowState::Assigned,
                stage: stage_name(Stage::AdvertiseKeys),
                expires_at: now + LEASE_TTL_MS,
                report: None,
            });
        }
        if records.is_empty() {
            return;
        }
        match self.store.assign_groups(&records, self.fences.get(id)).await {
            Ok(()) => {}
            Err(StoreError::Fenced) => {
                self.drop_task(id, "another replica took its lease over", false);
                return;
            }
            Err(error) => {
                tracing::warn!(task = id, round, %error, "could not hand groups to other replicas; running them here");
                return;
            }
        }
        let Ok(engine) = self.engine(id) else { return };
        for record in &records {
            engine.hand_off(&record.key, &record.owner_url);
        }
        let members = engine.remote_members();
        self.routes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .group_members_elsewhere
            .extend(members);
        tracing::info!(
            task = id,
            round,
            handed = records.len(),
            groups = count,
            "groups handed to other replicas"
        );
    }

    /// Acts on the watcher's news of the groups of rounds led here.
    async fn groups_changed(&mut self, changed: Vec<(GroupRecord, Option<Vec<u8>>)>) {
        let now = now_ms();
        let mut ticked = HashSet::new();
        for (record, mean) in changed {
            let key = record.key.clone();
            if !self.engines.contains_key(&key.task) {
                continue;
            }
            let stage = parse_stage(&record.stage).unwrap_or(Stage::AdvertiseKeys);
            // Once a group may have asked for masked inputs (it reached that
            // stage, or settled or was lost), who it asked is read back once.
            let asked = match record.state {
                GroupRowState::Assigned => false,
                GroupRowState::Running => stage >= Stage::MaskedInputCollection,
                GroupRowState::Done | GroupRowState::Failed | GroupRowState::Lost => true,
            };
            if asked && self.contributors_read.insert(key.clone()) {
                self.read_contributors(&key).await;
            }
            let Ok(engine) = self.engine(&key.task) else { continue };
            match record.state {
                GroupRowState::Assigned => {}
                GroupRowState::Running => engine.remote_adopted(&key, stage),
                GroupRowState::Done | GroupRowState::Failed => {
                    let report: Option<GroupReport> =
                        record.report.as_deref().and_then(|json| serde_json::from_str(json).ok());
                    let mean = mean.and_then(|bytes| GroupReport::decode_mean(&bytes).ok());
                    match report {
                        Some(report) => engine.remote_settled(&key, &report, mean, now),
                        None => engine.remote_lost(&key, now),
                    }
                }
                GroupRowState::Lost => {
                    tracing::warn!(task = %key.task, round = key.round, group = key.group, owner = %record.owner_url, "the replica running a group stopped renewing it; the group is given up");
                    engine.remote_lost(&key, now);
                }
            }
            ticked.insert(key.task);
        }
        for task in ticked {
            self.tick(&task).await;
        }
    }

    /// Reads back who a remote group asked for its masked input.
    async fn read_contributors(&mut self, key: &GroupKey) {
        match self.store.contributors(&key.task, key.round as i64).await {
            Ok(participants) => {
                if let Ok(engine) = self.engine(&key.task) {
                    engine.add_contributors(key.round, participants);
                }
            }
            Err(error) => tracing::warn!(task = %key.task, %error, "could not read a group's contributors"),
        }
    }

    /// Deletes a task's group rows once its round ended (PostgreSQL): the
    /// groups' sums do not outlive the round.
    async fn forget_groups(&mut self, id: &str) {
        if !self.divides() {
            return;
        }
        self.contributors_read.retain(|key| key.task != id);
        // Only the task's leader deletes its rows, under its lease: a
        // stale leader must not wipe its successor's round.
        let Some(fence) = self.fences.get(id).cloned() else { return };
        match self.store.delete_groups(id, Some(&fence)).await {
            Ok(()) => {}
            Err(StoreError::Fenced) => self.drop_task(id, "another replica took its lease over", false),
            Err(error) => {
                tracing::warn!(task = id, %error, "could not delete the round's group rows; the next round replaces them")
            }
        }
    }

    /// Takes the lease of a task just created here and loads it.
    async fn take(&mut self, id: &str, now: i64) -> Result<bool, CoordinatorError> {
        let Some(generation) =
            self.store.acquire_lease(id, &self.replica.id, now, now + LEASE_TTL_MS).await?
        else {
            return Ok(false);
        };
        let fence = Fence { replica: self.replica.id.clone(), generation };
        match adopt(&self.store, id, &fence).await {
            Ok(engine) => {
                self.apply(LeaseEvent::Adopt { id: id.to_string(), engine: Box::new(engine), generation });
                Ok(true)
            }
            Err(error) => {
                let _ = self.store.release_lease(id, &self.replica.id).await;
                Err(error)
            }
        }
    }

    /// Stops leading `id`: its round in progress is abandoned. A lease
    /// lost is a warning; a `planned` hand-back (the task was stopped, the
    /// replica stops) is not.
    fn drop_task(&mut self, id: &str, why: &str, planned: bool) {
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

    async fn give_up_leases(&mut self) {
        self.apply(LeaseEvent::DropAll { why: "the replica is stopping", planned: true });
        if let Err(error) = self.store.remove_replica(&self.replica.id).await {
            tracing::warn!(%error, "could not give up the leases; they lapse by themselves");
        }
    }

    /// The engine of a task led here, while this replica can show it
    /// still holds the task's lease (see [`Routes::leases_hold`]).
    fn engine(&mut self, id: &str) -> Result<&mut TaskEngine, CoordinatorError> {
        if !self.leads(id) {
            return Err(CoordinatorError::UnknownTask);
        }
        self.engines.get_mut(id).ok_or(CoordinatorError::UnknownTask)
    }

    fn leases_hold(&self) -> bool {
        self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner).leases_hold()
    }

    /// Whether this replica may act for `id` now: its routes still list
    /// it (the lease keeper takes a lost lease off them at once) and its
    /// leases hold on the monotonic clock.
    fn leads(&self, id: &str) -> bool {
        let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        routes.here.contains(id) && routes.leases_hold()
    }

    /// The group run here for another replica's round that `participant`
    /// of `task` is in (while the group's lease holds).
    fn owned_group(&mut self, task: &str, participant: &str) -> Option<&mut OwnedGroup> {
        if !self.leases_hold() {
            return None;
        }
        let key = self.owned_members.get(participant).filter(|key| key.task == task)?;
        self.owned.get_mut(key)
    }

    /// Closes what a client's message may have completed: the stage of the
    /// group run here for another replica (`owned`), or of the task.
    async fn tick_after(&mut self, task: &str, owned: Option<GroupKey>) {
        match owned {
            Some(key) => self.tick_owned(&key).await,
            None => self.tick(task).await,
        }
    }

    /// Serves one request; `Break` once the actor must stop (shutdown).
    async fn handle(&mut self, request: Request) -> ControlFlow<()> {
        match request {
            Request::Load { id, reply } => {
                // A task just created: this replica leads it.
                // Taken by another replica's renewal first: it loaded the
                // task, which is as good.
                let result = self.take(&id, now_ms()).await.map(drop);
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
                        privacy: engine.privacy(),
                        buffer: engine.buffer(now_ms()),
                        last_failure: engine.last_failure().cloned(),
                        stalled: engine.stalled(now_ms()),
                    }
                });
                let _ = reply.send(result);
            }
            Request::CheckIn { task, participant, identity, trained_on, reply } => {
                let now = now_ms();
                let result = self
                    .engine(&task)
                    .map(|engine| engine.check_in_trained(&participant, identity, trained_on, now));
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
                let result = match self.owned_group(&task, &participant) {
                    Some(group) => group.poll(&participant).map_err(Into::into),
                    None => self.engine(&task).and_then(|e| e.poll(&participant).map_err(Into::into)),
                };
                if let Ok(Poll::Message(bytes)) = &result {
                    self.metrics.bytes_out(bytes.len());
                }
                let _ = reply.send(result);
            }
            Request::Receive { task, participant, body, reply } => {
                let size = body.len();
                let (result, owned) = match self.owned_group(&task, &participant) {
                    Some(group) => {
                        (group.receive(&participant, &body).map_err(Into::into), Some(group.key().clone()))
                    }
                    None => (
                        self.engine(&task).and_then(|e| e.receive(&participant, &body).map_err(Into::into)),
                        None,
                    ),
                };
                self.metrics.client_message(size, result.is_ok());
                let _ = reply.send(result);
                self.tick_after(&task, owned).await;
            }
            Request::Input { task, participant, step, reply } => {
                let (read, finishing) = match &step {
                    InputStep::Begin(bytes) | InputStep::Piece(_, bytes) => (bytes.len(), false),
                    InputStep::Finish(_) => (0, true),
                    InputStep::Abort(_) => (0, false),
                };
                let (result, owned) = match self.owned_group(&task, &participant) {
                    Some(group) => {
                        (group.input(&participant, step).map_err(Into::into), Some(group.key().clone()))
                    }
                    None => (
                        self.engine(&task).and_then(|e| e.input(&participant, step).map_err(Into::into)),
                        None,
                    ),
                };
                self.metrics.bytes_in(read);
                if finishing || result.is_err() {
                    self.metrics.client_message(0, result.is_ok());
                }
                let ended = finishing && result.is_ok();
                let _ = reply.send(result);
                if ended {
                    self.tick_after(&task, owned).await;
                }
            }
            Request::Model { task, reply } => {
                let result = self.engine(&task).map(|e| (e.completed_rounds(), e.model().clone()));
                let _ = reply.send(result);
            }
            Request::Admit { task, participant, reply } => {
                let result = match self.owned_group(&task, &participant) {
                    Some(group) => group.admit(&participant).map_err(Into::into),
                    None => self.engine(&task).and_then(|e| e.admit(&participant).map_err(Into::into)),
                };
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
            Request::Groups(GroupEvent::Own { record, spec }) => self.own(*record, *spec, now_ms()).await,
            Request::Groups(GroupEvent::Changed(changed)) => self.groups_changed(changed).await,
            Request::OwnedUnmasked { key, result } => {
                if let Some((report, mean)) = self.owned.get(&key).map(|group| group.unmasked(result)) {
                    self.settle_owned(&key, &report, mean.as_deref()).await;
                }
            }
            Request::Unmasked { task, round, group, result } => {
                let now = now_ms();
                if let Ok(engine) = self.engine(&task)
                    && let Err(error) = engine.unmasked(round, group, result, now)
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
    async fn set_status(&mut self, id: &str, status: TaskStatus) -> Result<(), CoordinatorError> {
        let leading = self.engine(id).is_ok();
        if !leading && !status.is_final() {
            // Over already (the store says so), or led elsewhere (retry).
            return Err(match self.store.task(id).await?.status.is_final() {
                true => StoreError::Conflict("the task has ended").into(),
                false => CoordinatorError::UnknownTask,
            });
        }
        let fence = if leading { self.fences.get(id).cloned() } else { None };
        match self.store.set_task_status(id, status, now_ms(), fence.as_ref()).await {
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
    async fn tick(&mut self, id: &str) {
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

    async fn act(&mut self, id: &str, outcome: TickOutcome, now: i64) {
        match outcome {
            TickOutcome::Idle => {}
            TickOutcome::Started(round) => {
                self.metrics.round_started();
                tracing::info!(task = id, round, "round started");
                self.divide(id, round, now).await;
            }
            TickOutcome::MaskedInputRequested { round, participants } => {
                // Recorded before any of them can fetch the stage (this
                // actor serves the fetches), so that a restart still knows
                // who refuses a re-run of this round.
                let fence = self.fences.get(id);
                let recorded =
                    self.store.record_contributors(id, round as i64, &participants, now, fence).await;
                if let Err(StoreError::Fenced) = recorded {
                    self.metrics.round_aborted();
                    self.drop_task(id, "another replica took its lease over", false);
                } else if let Err(error) = recorded {
                    self.metrics.round_aborted();
                    tracing::error!(task = id, round, %error, "could not record the round's contributors; the round is abandoned");
                    if let Ok(engine) = self.engine(id) {
                        engine.withdraw(round, &participants);
                    }
                    self.forget_groups(id).await;
                }
            }
            TickOutcome::GroupAborted { round, group, stage } => {
                tracing::warn!(task = id, round, group, %stage, "group given up: too few clients; the round goes on without it");
            }
            TickOutcome::Aborted { round, stage, attempt } => {
                self.metrics.round_aborted();
                tracing::warn!(task = id, round, %stage, reason = attempt.reason, "round aborted: too few clients");
                self.record_attempt(id, &attempt).await;
                self.forget_groups(id).await;
            }
            TickOutcome::Abandoned { round, error, attempt } => {
                self.metrics.round_aborted();
                tracing::warn!(task = id, round, %error, "round abandoned");
                self.record_attempt(id, &attempt).await;
                self.forget_groups(id).await;
            }
            TickOutcome::Unmask(job) => {
                let (task, round, group) = (job.task_id.clone(), job.round, job.group);
                self.unmask(*job, move |result| Request::Unmasked { task, round, group, result });
            }
            TickOutcome::Completed(completion) => self.store_round(id, *completion).await,
        }
    }

    /// Keeps a failed attempt for the admin API and the dashboard (best
    /// effort: a store that fails here loses the record, not the task).
    async fn record_attempt(&mut self, id: &str, attempt: &FailedAttempt) {
        let record = AttemptRecord {
            task_id: id.to_string(),
            round: attempt.round as i64,
            attempt: i64::from(attempt.attempt),
            outcome: attempt.outcome.as_str().to_string(),
            stage: attempt.stage.to_string(),
            reason: attempt.reason.clone(),
            selected: attempt.selected as i64,
            started_at: attempt.started_at,
            ended_at: attempt.ended_at,
            stages: serde_json::to_string(&attempt.stages).unwrap_or_else(|_| "[]".into()),
        };
        match self.store.record_attempt(&record, self.fences.get(id)).await {
            Ok(()) => {}
            Err(StoreError::Fenced) => self.drop_task(id, "another replica took its lease over", false),
            Err(error) => {
                tracing::warn!(task = id, round = attempt.round, %error, "could not record the failed attempt")
            }
        }
    }

    /// Persists a completed round, then lets the engine adopt it.
    async fn store_round(&mut self, id: &str, completion: Completion) {
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
                if let Ok(engine) = self.engine(id) {
                    engine.commit(completion);
                    if let Some(epsilon) = engine.epsilon_spent() {
                        self.metrics.privacy_spent(id, epsilon);
                    }
                    self.metrics.round_completed(selected, survivors, &stages, &means);
                    tracing::info!(task = id, round, survivors, "round completed");
                }
                self.forget_groups(id).await;
            }
            Err(StoreError::Fenced) => {
                self.metrics.round_aborted();
                self.drop_task(id, "another replica took its lease over; its round is not stored", false);
            }
            Err(StoreError::Conflict(reason)) => {
                // Another replica recorded this round while it led the
                // task: this engine's model is stale. Reload it from the
                // store (the lease keeper drops it if the lease is lost).
                self.metrics.round_aborted();
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
                self.metrics.round_aborted();
                tracing::error!(task = id, round, %error, "could not store the round; it will be run again");
                if let Ok(engine) = self.engine(id) {
                    engine.abandon(round);
                }
            }
        }
    }

    async fn complete_task(&mut self, id: &str, status: TaskStatus) {
        if let Err(error) = self.store.set_task_status(id, status, now_ms(), self.fences.get(id)).await {
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

/// A stage's stored name (as the API writes it).
fn stage_name(stage: Stage) -> String {
    serde_json::to_value(stage).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// The stage of a stored name.
fn parse_stage(name: &str) -> Option<Stage> {
    serde_json::from_value(serde_json::Value::String(name.to_string())).ok()
}

/// Looks for the groups other replicas hand to this one and for the
/// reports of the groups this one handed out, and refreshes where the
/// clients of groups run elsewhere go: every [`GROUP_TICK`], on the
/// request pool (PostgreSQL only).
struct GroupWatcher {
    store: SqlStore,
    replica: Arc<Replica>,
    routes: Arc<RwLock<Routes>>,
    /// The state and stage last told the actor, per group of a round led here.
    seen: HashMap<GroupKey, (GroupRowState, String)>,
    /// The rosters of the groups routed, parsed once.
    rosters: HashMap<GroupKey, Vec<String>>,
}

impl GroupWatcher {
    async fn run(mut self, tx: mpsc::Sender<Request>) {
        let mut ticker = tokio::time::interval(GROUP_TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match self.tick().await {
                Ok(events) => {
                    for event in events {
                        if tx.send(Request::Groups(event)).await.is_err() {
                            return;
                        }
                    }
                }
                Err(error) => tracing::debug!(%error, "could not read the round groups"),
            }
        }
    }

    async fn tick(&mut self) -> Result<Vec<GroupEvent>, StoreError> {
        let now = now_ms();
        let mut events = Vec::new();
        for record in self.store.claim_groups(&self.replica.id, now, now + LEASE_TTL_MS).await? {
            let spec = match self.store.task(&record.key.task).await {
                Ok(task) => serde_json::from_str::<TaskSpec>(&task.spec).map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            };
            events.push(GroupEvent::Own { record: Box::new(record), spec: Box::new(spec) });
        }
        let mut changed = Vec::new();
        let led = self.store.led_groups(&self.replica.id, now).await?;
        let keys: HashSet<GroupKey> = led.iter().map(|r| r.key.clone()).collect();
        self.seen.retain(|key, _| keys.contains(key));
        for record in led {
            let now_seen = (record.state, record.stage.clone());
            if self.seen.get(&record.key) == Some(&now_seen) {
                continue;
            }
            let mean = match record.state {
                GroupRowState::Done => Some(self.store.group_mean(&record.key).await?),
                _ => None,
            };
            self.seen.insert(record.key.clone(), now_seen);
            changed.push((record, mean));
        }
        if !changed.is_empty() {
            events.push(GroupEvent::Changed(changed));
        }
        let routed = self.store.group_routes(now).await?;
        let live: HashSet<&GroupKey> = routed.iter().map(|r| &r.key).collect();
        self.rosters.retain(|key, _| live.contains(key));
        let mut elsewhere = HashMap::new();
        for record in routed.iter().filter(|r| r.owner_id != self.replica.id) {
            let roster = self.rosters.entry(record.key.clone()).or_insert_with(|| {
                serde_json::from_str::<GroupAssignment>(&record.assignment)
                    .map(|a| a.roster)
                    .unwrap_or_default()
            });
            elsewhere.extend(roster.iter().map(|p| (p.clone(), record.owner_url.clone())));
        }
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).group_members_elsewhere =
            elsewhere;
        Ok(events)
    }
}
