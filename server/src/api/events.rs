//! The admin API's server push: Server-Sent Events (`text/event-stream`)
//! that the dashboard reads instead of polling.
//!
//! * `GET /admin/tasks/{id}/events` streams one task: its live state as
//!   `task` events (the body of `GET /admin/tasks/{id}`), its completed
//!   rounds as `rounds` events (all of them first, then each new one, as
//!   in `GET /admin/tasks/{id}/rounds`), its newest attempts that ended
//!   without a model as `attempts` events whenever one more ends, and its
//!   enrollment tokens (names, rates, enrollments, revocation; never a
//!   token) as `tokens` events when they change. Like
//!   every request about a task, it is served by the replica that leads
//!   the task (forwarded there, the stream passed back as it comes), which
//!   is where the live round is; when the task's lead moves to another
//!   replica the stream says so (`moved`) and ends, and the reader
//!   connects again, to the new leader.
//! * `GET /admin/events` streams the task list as `tasks` events (the body
//!   of `GET /admin/tasks`); any replica serves it.
//!
//! **One producer, many streams.** A task's streams share one producer
//! (the task list's streams another): a task that nobody follows is not
//! read, and the first stream to follow it starts its producer, which ends
//! with its last stream. The producer reads the task when the coordinator
//! tells it that a request or a tick may have changed that task
//! ([`Coordinator::task_changes`](crate::coordinator::Coordinator::task_changes):
//! a change to another task does not wake it), at most
//! once per [`TASK_COALESCE`] ([`LIST_COALESCE`] for the list), and again
//! after [`REREAD`] without news, for what changes by the clock alone
//! (clients that stop checking in) or on another replica. It serializes
//! each event once, framed as Server-Sent Events, into shared [`Bytes`],
//! and publishes the snapshot on a [`watch`] channel, which holds only the
//! latest: a stream sends what changed since the snapshot it sent last
//! (every event, at first), so a reader that falls behind skips
//! snapshots rather than queueing them, and what a stream holds is a
//! reference to the latest snapshot and the few frames it is writing.
//! A comment line every [`KEEP_ALIVE`] keeps idle connections open through
//! proxies. A producer that cannot read the store sends an `unavailable`
//! event (the API's error body) to its streams, which end; the reader
//! connects again after `retry_after_ms`.
//!
//! **A cap.** At most `max_admin_streams` streams are open at once in a
//! process, and at most a project's `connections` quota of them for its
//! keys; one more is refused with a `429` and `Retry-After`. A stream
//! forwarded to a task's leader counts at the leader.
//!
//! **Projects.** A key follows only its project's tasks, and its task
//! list holds only them (the lists of each project are produced apart).
//! The key is checked when the stream opens: the browser's `EventSource`
//! cannot send an `Authorization` header, so the dashboard reads the
//! stream with `fetch`, which can. A stream opened with a key ends after
//! [`KEY_STREAM_LIFETIME`] with a `reauthenticate` event (and at the
//! key's expiry, if sooner), so that a revoked key reads for at most that
//! long; the reader connects again, with its key checked anew.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use http_body::Frame;
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, Sleep};
use tokio_stream::Stream;
use tokio_stream::wrappers::WatchStream;

use super::admin::{attempt_views, round_views, task_views, token_views, view};
use super::error::{ApiError, ApiResult};
use super::extract::TaskId;
use super::openapi::{Refused, RetryLater, TaskEvent, TaskListEvent, TaskPath};
use super::projects::{Caller, Identity, Quotas};
use super::state::AppState;
use crate::api::ErrorCode;
use crate::cluster::Whereabouts;

/// Least time between two reads of a task for its streams.
pub const TASK_COALESCE: Duration = Duration::from_millis(200);
/// Least time between two reads of the task list for its streams.
pub const LIST_COALESCE: Duration = Duration::from_secs(1);
/// A producer reads again after this long without news.
pub const REREAD: Duration = Duration::from_secs(5);
/// Interval of the keep-alive comments.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// The attempts an `attempts` event lists (newest first).
pub const ATTEMPTS_SHOWN: i64 = 20;
/// Admin event streams open at once, by default.
pub const DEFAULT_MAX_ADMIN_STREAMS: usize = 256;
/// What a reader is told to wait before it connects again after an
/// `unavailable` event.
const RETRY: Duration = Duration::from_secs(2);
/// What a reader refused over the cap is told to wait.
const OVER_CAP_RETRY: Duration = Duration::from_secs(5);
/// A keep-alive comment.
const COMMENT: &[u8] = b":\n\n";
/// Longest a stream opened with a project key stays open: a revoked key
/// reads no longer than this.
pub const KEY_STREAM_LIFETIME: Duration = Duration::from_secs(300);

/// The streams of one process: the cap, and the producers running.
#[derive(Clone)]
pub struct Streams {
    open: Arc<Semaphore>,
    /// The cap on streams open at once.
    max_open: usize,
    /// Streams open per project (its keys').
    per_project: OpenPerProject,
    tasks: Feeds<String, TaskSnapshot>,
    /// The task list of one project, or of every one (`None`).
    list: Feeds<Option<String>, ListSnapshot>,
}

/// Streams open per project.
type OpenPerProject = Arc<Mutex<HashMap<String, u32>>>;

/// A project's `connections` limits: the operator's quota and its owners'
/// own.
#[derive(Debug, Clone, Copy, Default)]
struct StreamQuota {
    operator: Option<u32>,
    owners: Option<u32>,
}

impl StreamQuota {
    fn is_set(self) -> bool {
        self.operator.is_some() || self.owners.is_some()
    }
}

/// A stream's place under the caps, given back when it closes.
#[derive(Debug)]
struct Admitted {
    _open: OwnedSemaphorePermit,
    project: Option<(OpenPerProject, String)>,
    /// Its row in the shared store, where the replicas count a project's
    /// streams against its quota (see [`Streams::admit`]).
    registered: Option<(crate::store::SqlStore, String)>,
}

/// The wait between tries to delete a closed stream's row while the store
/// does not answer. It is tried until it answers; the rows of a replica
/// that stops no longer count once its heartbeat is old.
const UNREGISTER_RETRY: Duration = Duration::from_secs(1);

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some((store, id)) = self.registered.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            // Retried until the store answers, so that a stream closed
            // while it was away does not hold its project's quota.
            runtime.spawn(async move {
                while let Err(error) = store.close_admin_stream(&id).await {
                    tracing::warn!(%error, "could not forget a closed admin event stream; retrying");
                    tokio::time::sleep(UNREGISTER_RETRY).await;
                }
            });
        }
        if let Some((counts, project)) = self.project.take() {
            let mut counts = counts.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(count) = counts.get_mut(&project) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    counts.remove(&project);
                }
            }
        }
    }
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams").field("available", &self.open.available_permits()).finish_non_exhaustive()
    }
}

impl Default for Streams {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_ADMIN_STREAMS)
    }
}

impl Streams {
    /// At most `max_open` streams at once.
    pub fn new(max_open: usize) -> Self {
        Self {
            open: Arc::new(Semaphore::new(max_open)),
            max_open,
            per_project: Arc::default(),
            tasks: Feeds::default(),
            list: Feeds::default(),
        }
    }

    /// A place for one more stream of `caller`, or the refusal: over the
    /// process's cap, or over the `connections` quota of the caller's
    /// project.
    ///
    /// With replicas sharing a PostgreSQL store, a project's `connections`
    /// quota counts its streams on every live replica: each holds a row in
    /// the store while it is open ([`SqlStore::open_admin_stream`]). The
    /// quarter of the cap a project without a quota takes is a limit of
    /// this process, counted here.
    ///
    /// [`SqlStore::open_admin_stream`]: crate::store::SqlStore::open_admin_stream
    async fn admit(&self, state: &AppState, caller: &Caller) -> ApiResult<Admitted> {
        let project = match caller.project() {
            Some(id) => {
                let record = state.store.project(id).await?;
                let quota = StreamQuota {
                    operator: Quotas::operator(&record)?.connections,
                    owners: Quotas::owners(&record)?.connections,
                };
                Some((id.to_string(), quota))
            }
            None => None,
        };
        let shared_quota = match &project {
            Some((id, quota))
                if quota.is_set() && state.store.backend() == crate::store::Backend::Postgres =>
            {
                Some((id.clone(), self.most(*quota)))
            }
            _ => None,
        };
        let mut admitted = self.admit_in(project)?;
        if let Some((project, most)) = shared_quota {
            let id = super::auth::new_id();
            let now = crate::coordinator::now_ms();
            let live_since = now - crate::cluster::LEASE_TTL_MS;
            let replica = &state.coordinator.replica().id;
            // Set before the row is written: were this request dropped
            // while the transaction commits (its client gone), the row
            // would still be deleted with it. Deleting a row that was never
            // written costs one statement.
            admitted.registered = Some((state.store.clone(), id.clone()));
            let opened = state.store.open_admin_stream(&id, &project, replica, live_since, most, now).await?;
            if let Err(open) = opened {
                // Rolled back: no row to delete.
                admitted.registered = None;
                return Err(ApiError::new(
                    ErrorCode::RateLimited,
                    format!(
                        "quota connections: the project's keys hold {open} event streams open across the \
                         replicas, of the {most} its limits allow; close one or retry later"
                    ),
                )
                .retry_after(OVER_CAP_RETRY));
            }
        }
        Ok(admitted)
    }

    /// The streams a project with `quota` may hold open at once: the
    /// operator's quota, or a quarter of this process's cap where the
    /// operator set none (so that one tenant cannot hold every stream), and
    /// at most its owners' limit: an owner's limit only ever tightens.
    fn most(&self, quota: StreamQuota) -> u32 {
        let quarter = (self.max_open / 4).max(1) as u32;
        quota.operator.unwrap_or(quarter).min(quota.owners.unwrap_or(u32::MAX))
    }

    /// A place for one more stream of `project` (with its `connections`
    /// quota), or of the admin token (`None`).
    fn admit_in(&self, project: Option<(String, StreamQuota)>) -> ApiResult<Admitted> {
        let open = self.open.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                ErrorCode::RateLimited,
                "too many admin event streams are open; close one or retry later",
            )
            .retry_after(OVER_CAP_RETRY)
        })?;
        let Some((project, quota)) = project else {
            return Ok(Admitted { _open: open, project: None, registered: None });
        };
        let most = self.most(quota);
        let mut counts = self.per_project.lock().unwrap_or_else(PoisonError::into_inner);
        let count = counts.entry(project.clone()).or_default();
        if *count >= most {
            return Err(ApiError::new(
                ErrorCode::RateLimited,
                format!(
                    "quota connections: the project's keys hold {count} event streams open here, of the \
                     {most} its limits allow; close one or retry later"
                ),
            )
            .retry_after(OVER_CAP_RETRY));
        }
        *count += 1;
        Ok(Admitted { _open: open, project: Some((self.per_project.clone(), project)), registered: None })
    }

    /// The event streams `project`'s keys hold open: on PostgreSQL over
    /// every live replica (as its `connections` quota counts them when one
    /// is set), else in this process.
    pub async fn open_of(&self, state: &AppState, project: &str) -> ApiResult<u32> {
        let here = || {
            let counts = self.per_project.lock().unwrap_or_else(PoisonError::into_inner);
            counts.get(project).copied().unwrap_or(0)
        };
        if state.store.backend() != crate::store::Backend::Postgres {
            return Ok(here());
        }
        let live_since = crate::coordinator::now_ms() - crate::cluster::LEASE_TTL_MS;
        let stored = state.store.admin_streams(project, live_since).await?;
        // Streams of a project without a quota have no rows: those of this
        // replica are counted here at least.
        Ok(u32::try_from(stored).unwrap_or(u32::MAX).max(here()))
    }

    /// Producers running (tasks followed, and the list if it is).
    pub fn producers(&self) -> usize {
        self.tasks.len() + self.list.len()
    }
}

/// A task's changes as Server-Sent Events: `task` (its live state: the
/// round in progress with each stage's answers and durations, its status,
/// its privacy facts), `rounds` (completed rounds: every one at first,
/// then the new ones), `attempts` (the newest 20 attempts that ended
/// without a model, when one more ends), `tokens` (its enrollment tokens,
/// when they change), `moved` (another replica leads
/// the task now: connect again) and `unavailable` (the store could not be
/// read: connect again after `retry_after_ms`). Each event's data is one
/// line of JSON. The stream does not end by itself otherwise.
#[utoipa::path(
    get, path = "/admin/tasks/{id}/events", tag = "admin", operation_id = "taskEvents",
    security(("admin" = [])), params(TaskPath),
    responses(
        (status = 200, description = "The task's events, as they happen (`task`, `rounds`, `attempts`, `tokens`, `moved`, `unavailable`)",
            content_type = "text/event-stream", body = TaskEvent),
        (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 429, response = RetryLater),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn task_events(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Response> {
    // A task that does not exist (or is another project's) is refused
    // before the stream starts.
    caller.task(&state, &id).await?;
    let open = state.streams.admit(&state, &caller).await?;
    let feed = state.streams.tasks.clone();
    let snapshots = feed.subscribe(id.clone(), |sender| {
        tokio::spawn(produce_task(state.clone(), id.clone(), sender));
    });
    Ok(stream(snapshots, open, &caller))
}

/// The task list's changes as Server-Sent Events: `tasks` (every task with
/// its live state, as `GET /admin/tasks` answers) when it changed, and
/// `unavailable` (the store could not be read: connect again after
/// `retry_after_ms`). The stream does not end by itself otherwise.
#[utoipa::path(
    get, path = "/admin/events", tag = "admin", operation_id = "taskListEvents",
    security(("admin" = [])),
    responses(
        (status = 200, description = "The task list whenever it changes (`tasks`, `unavailable`)",
            content_type = "text/event-stream", body = TaskListEvent),
        (status = 401, response = Refused),
        (status = 429, response = RetryLater),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn task_list_events(
    caller: Caller,
    headers: HeaderMap,
    State(state): State<AppState>,
) -> ApiResult<Response> {
    let open = state.streams.admit(&state, &caller).await?;
    // The list asks other replicas for the tasks they lead with the
    // credential it was opened with (checked above: the admin token, or a
    // key of the project whose list it is).
    let mut authorization = headers.get(header::AUTHORIZATION).cloned();
    if let Some(value) = authorization.as_mut() {
        value.set_sensitive(true);
    }
    let feed = state.streams.list.clone();
    let scope = caller.project().map(str::to_string);
    let snapshots = feed.subscribe(scope.clone(), |sender| {
        tokio::spawn(produce_list(state.clone(), authorization, scope, sender));
    });
    Ok(stream(snapshots, open, &caller))
}

fn stream<S: Snapshot>(
    snapshots: watch::Receiver<Published<S>>,
    open: Admitted,
    caller: &Caller,
) -> Response {
    // A key's stream ends in time for its key to be checked again.
    let lifetime = match &caller.identity {
        Identity::Admin => None,
        Identity::Key(key) => {
            let mut lifetime = KEY_STREAM_LIFETIME;
            if let Some(expiry) = key.expires_at {
                let left = u64::try_from(expiry.saturating_sub(crate::coordinator::now_ms())).unwrap_or(0);
                lifetime = lifetime.min(Duration::from_millis(left));
            }
            Some(Box::pin(tokio::time::sleep(lifetime)))
        }
    };
    let body = EventBody {
        snapshots: WatchStream::new(snapshots),
        sent: None,
        queue: VecDeque::new(),
        ending: false,
        keep_alive: Box::pin(tokio::time::sleep(KEEP_ALIVE)),
        lifetime,
        _open: open,
    };
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::new(body),
    )
        .into_response()
}

/// What a producer publishes: nothing yet (before its first read), a
/// snapshot, or a last event after which its streams end.
enum Published<S> {
    Reading,
    Snapshot(Arc<S>),
    End(Bytes),
}

impl<S> Clone for Published<S> {
    fn clone(&self) -> Self {
        match self {
            Self::Reading => Self::Reading,
            Self::Snapshot(snapshot) => Self::Snapshot(snapshot.clone()),
            Self::End(last) => Self::End(last.clone()),
        }
    }
}

/// A snapshot a stream can send: the frames that changed since what it
/// sent last (every frame when it sent nothing yet).
trait Snapshot: Send + Sync + 'static {
    /// What a stream sent, in the terms of this snapshot.
    type Sent: Send + Unpin;
    /// Appends the frames to send after `sent`, and updates it.
    fn frames_after(&self, sent: &mut Option<Self::Sent>, out: &mut VecDeque<Bytes>);
}

/// One Server-Sent Event, framed: `event: NAME`, `data: JSON`.
fn frame(name: &str, json: &str) -> Bytes {
    // JSON from serde_json holds no line break, so one data line carries it.
    Bytes::from(format!("event: {name}\ndata: {json}\n\n"))
}

/// `data` as one line of JSON (the views always serialize; `null` if one
/// did not).
fn to_json(data: &impl Serialize) -> String {
    serde_json::to_string(data).unwrap_or_else(|_| "null".into())
}

/// An event and the number of times it changed.
#[derive(Clone)]
struct Versioned {
    version: u64,
    frame: Bytes,
}

/// The JSON an event was last published with, so that a producer bumps
/// the version only when it changed.
#[derive(Default)]
struct Tracked {
    json: Option<String>,
    current: Option<Versioned>,
}

impl Tracked {
    /// The event `name` with `json`, a new version if it changed.
    fn update(&mut self, name: &str, json: String) -> Versioned {
        match &self.current {
            Some(current) if self.json.as_deref() == Some(json.as_str()) => current.clone(),
            _ => {
                let version = self.current.as_ref().map_or(0, |c| c.version + 1);
                let current = Versioned { version, frame: frame(name, &json) };
                self.json = Some(json);
                self.current = Some(current.clone());
                current
            }
        }
    }
}

/// One task's events, as last read.
struct TaskSnapshot {
    task: Versioned,
    rounds: Arc<Rounds>,
    attempts: Versioned,
    tokens: Versioned,
}

/// A task's completed rounds: each one's JSON, the `rounds` event listing
/// all of them, and the one listing those the last read added.
#[derive(Default)]
struct Rounds {
    each: Vec<(i64, Bytes)>,
    all: Bytes,
    /// The newest round before the last read added some.
    added_after: i64,
    added: Bytes,
}

impl Rounds {
    fn newest(&self) -> i64 {
        self.each.last().map_or(0, |(round, _)| *round)
    }

    /// The `rounds` event listing those after `after`.
    fn after(&self, after: i64) -> Bytes {
        if after == self.added_after {
            return self.added.clone();
        }
        let listed: Vec<&[u8]> =
            self.each.iter().filter(|(round, _)| *round > after).map(|(_, json)| json.as_ref()).collect();
        rounds_frame(&listed)
    }
}

/// A `rounds` event from each round's JSON.
fn rounds_frame(each: &[&[u8]]) -> Bytes {
    let mut json = Vec::with_capacity(2 + each.iter().map(|r| r.len() + 1).sum::<usize>());
    json.push(b'[');
    for (i, round) in each.iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        json.extend_from_slice(round);
    }
    json.push(b']');
    frame("rounds", &String::from_utf8_lossy(&json))
}

/// What a task's stream sent.
struct TaskSent {
    task: u64,
    round: i64,
    attempts: u64,
    tokens: u64,
}

impl Snapshot for TaskSnapshot {
    type Sent = TaskSent;

    fn frames_after(&self, sent: &mut Option<TaskSent>, out: &mut VecDeque<Bytes>) {
        let newest = self.rounds.newest();
        match sent {
            // The first snapshot: every event, the rounds all of them (none,
            // for a new task).
            None => {
                out.extend([
                    self.task.frame.clone(),
                    self.rounds.all.clone(),
                    self.attempts.frame.clone(),
                    self.tokens.frame.clone(),
                ]);
            }
            Some(sent) => {
                if self.task.version != sent.task {
                    out.push_back(self.task.frame.clone());
                }
                if newest > sent.round {
                    out.push_back(self.rounds.after(sent.round));
                }
                if self.attempts.version != sent.attempts {
                    out.push_back(self.attempts.frame.clone());
                }
                if self.tokens.version != sent.tokens {
                    out.push_back(self.tokens.frame.clone());
                }
            }
        }
        *sent = Some(TaskSent {
            task: self.task.version,
            round: newest,
            attempts: self.attempts.version,
            tokens: self.tokens.version,
        });
    }
}

/// The task list, as last read.
struct ListSnapshot {
    tasks: Versioned,
}

impl Snapshot for ListSnapshot {
    type Sent = u64;

    fn frames_after(&self, sent: &mut Option<u64>, out: &mut VecDeque<Bytes>) {
        if *sent != Some(self.tasks.version) {
            out.push_back(self.tasks.frame.clone());
        }
        *sent = Some(self.tasks.version);
    }
}

/// Where a producer publishes.
type Sender<S> = Arc<watch::Sender<Published<S>>>;

/// The producers running, by what they follow.
struct Feeds<K, S> {
    senders: Arc<Mutex<HashMap<K, Sender<S>>>>,
}

impl<K, S> Clone for Feeds<K, S> {
    fn clone(&self) -> Self {
        Self { senders: self.senders.clone() }
    }
}

impl<K, S> Default for Feeds<K, S> {
    fn default() -> Self {
        Self { senders: Arc::default() }
    }
}

impl<K: Hash + Eq + Clone, S> Feeds<K, S> {
    /// Follows `key`'s producer, started with `start` if none runs.
    fn subscribe(&self, key: K, start: impl FnOnce(Producer<K, S>)) -> watch::Receiver<Published<S>> {
        let mut senders = self.senders.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = senders.get(&key) {
            // A new receiver has seen nothing: mark the latest unseen, so
            // that the stream sends it at once.
            let mut receiver = sender.subscribe();
            receiver.mark_changed();
            return receiver;
        }
        let (sender, receiver) = watch::channel(Published::Reading);
        let sender = Arc::new(sender);
        senders.insert(key.clone(), sender.clone());
        drop(senders);
        start(Producer { feeds: self.clone(), key, sender });
        receiver
    }

    fn len(&self) -> usize {
        self.senders.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// A producer's side of its feed.
struct Producer<K: Hash + Eq, S> {
    feeds: Feeds<K, S>,
    key: K,
    sender: Sender<S>,
}

impl<K: Hash + Eq, S> Producer<K, S> {
    fn publish(&self, snapshot: S) {
        self.sender.send_replace(Published::Snapshot(Arc::new(snapshot)));
    }

    /// Publishes a last event and stops.
    fn end(self, last: Bytes) {
        self.sender.send_replace(Published::End(last));
    }

    /// Whether the producer stops: its last stream has gone (checked
    /// under the lock that new streams subscribe under, so none is lost).
    fn unfollowed(&self) -> bool {
        let mut senders = self.feeds.senders.lock().unwrap_or_else(PoisonError::into_inner);
        if self.sender.receiver_count() > 0 {
            return false;
        }
        if senders.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.sender)) {
            senders.remove(&self.key);
        }
        true
    }

    /// Waits for news (or [`REREAD`]), then until `coalesce` after
    /// `read_at`. `false` when the producer stops: its streams have gone or
    /// the coordinator stopped.
    async fn next_change(
        &self,
        changes: &mut watch::Receiver<u64>,
        read_at: Instant,
        coalesce: Duration,
    ) -> bool {
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                    break;
                }
                () = tokio::time::sleep_until(read_at + REREAD) => break,
                () = self.sender.closed() => if self.unfollowed() { return false },
            }
        }
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(read_at + coalesce) => return true,
                () = self.sender.closed() => if self.unfollowed() { return false },
            }
        }
    }
}

impl<K: Hash + Eq, S> Drop for Producer<K, S> {
    fn drop(&mut self) {
        // However the producer stops, a new stream starts a new one.
        let mut senders = self.feeds.senders.lock().unwrap_or_else(PoisonError::into_inner);
        if senders.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.sender)) {
            senders.remove(&self.key);
        }
    }
}

/// The `unavailable` event with `error`'s body and a retry hint.
fn unavailable(error: ApiError) -> Bytes {
    tracing::warn!(%error, "admin event streams stop: the store could not be read");
    frame("unavailable", &to_json(&error.body(RETRY)))
}

/// What a task's producer last published, to tell what changed.
#[derive(Default)]
struct TaskState {
    task: Tracked,
    rounds: Arc<Rounds>,
    /// The attempts, with the leader's last failure when they were read.
    attempts: Option<(String, Versioned)>,
    tokens: Tracked,
}

async fn produce_task(state: AppState, id: String, producer: Producer<String, TaskSnapshot>) {
    let mut changes = state.coordinator.task_changes(&id);
    let mut last = TaskState::default();
    loop {
        let read_at = Instant::now();
        changes.mark_unchanged();
        if let Whereabouts::At(url) = state.coordinator.whereabouts(&id) {
            return producer.end(frame("moved", &to_json(&serde_json::json!({ "leader": url }))));
        }
        match read_task(&state, &id, &mut last).await {
            Ok(snapshot) => producer.publish(snapshot),
            Err(error) => return producer.end(unavailable(error)),
        }
        if !producer.next_change(&mut changes, read_at, TASK_COALESCE).await {
            return;
        }
    }
}

/// One read of the task: its view, new rounds, new attempts, its tokens.
async fn read_task(state: &AppState, id: &str, last: &mut TaskState) -> ApiResult<TaskSnapshot> {
    let first = last.task.current.is_none();
    let task = state.store.task(id).await?;
    let current = view(state, &task).await?;
    let newest = last.rounds.newest();
    if current.live.completed_rounds as i64 > newest || first {
        let added = round_views(state, &task, newest).await?;
        if !added.is_empty() || first {
            let added: Vec<(i64, Bytes)> = added.iter().map(|r| (r.round, Bytes::from(to_json(r)))).collect();
            let added_frame = rounds_frame(&added.iter().map(|(_, json)| json.as_ref()).collect::<Vec<_>>());
            let mut each = last.rounds.each.clone();
            each.extend(added);
            let all = rounds_frame(&each.iter().map(|(_, json)| json.as_ref()).collect::<Vec<_>>());
            last.rounds = Arc::new(Rounds { each, all, added_after: newest, added: added_frame });
        }
    }
    // The attempts change when one more ends, which the leader's last
    // failure tells; each read of them is sent.
    let key = to_json(&current.live.last_failure);
    let attempts = match last.attempts.take() {
        Some((read_at, attempts)) if read_at == key => attempts,
        before => {
            let views = attempt_views(state, id, ATTEMPTS_SHOWN).await?;
            let version = before.map_or(0, |(_, attempts)| attempts.version + 1);
            Versioned { version, frame: frame("attempts", &to_json(&views)) }
        }
    };
    last.attempts = Some((key, attempts.clone()));
    let tokens = token_views(state, id).await?;
    Ok(TaskSnapshot {
        task: last.task.update("task", to_json(&current)),
        rounds: last.rounds.clone(),
        attempts,
        tokens: last.tokens.update("tokens", to_json(&tokens)),
    })
}

async fn produce_list(
    state: AppState,
    authorization: Option<HeaderValue>,
    project: Option<String>,
    producer: Producer<Option<String>, ListSnapshot>,
) {
    let mut changes = state.coordinator.changes();
    let mut tasks = Tracked::default();
    loop {
        let read_at = Instant::now();
        changes.mark_unchanged();
        match task_views(&state, authorization.as_ref(), project.as_deref()).await {
            Ok(views) => producer.publish(ListSnapshot { tasks: tasks.update("tasks", to_json(&views)) }),
            Err(error) => return producer.end(unavailable(error)),
        }
        if !producer.next_change(&mut changes, read_at, LIST_COALESCE).await {
            return;
        }
    }
}

/// A stream's response body: the frames its snapshots call for, and a
/// keep-alive comment when there were none for [`KEEP_ALIVE`].
struct EventBody<S: Snapshot> {
    snapshots: WatchStream<Published<S>>,
    sent: Option<S::Sent>,
    /// Frames of the snapshot being written (at most four, shared).
    queue: VecDeque<Bytes>,
    /// The last event is queued: end after it.
    ending: bool,
    keep_alive: Pin<Box<Sleep>>,
    /// When a key's stream ends (`None`: the admin token's, never).
    lifetime: Option<Pin<Box<Sleep>>>,
    _open: Admitted,
}

impl<S: Snapshot> http_body::Body for EventBody<S> {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            // A key's stream past its lifetime sends nothing more than the
            // request to sign in again, whenever its reader comes back.
            if !this.ending
                && let Some(lifetime) = this.lifetime.as_mut()
                && lifetime.as_mut().poll(cx).is_ready()
            {
                this.queue.clear();
                this.queue.push_back(frame("reauthenticate", "{}"));
                this.ending = true;
            }
            if let Some(next) = this.queue.pop_front() {
                this.keep_alive.as_mut().reset(Instant::now() + KEEP_ALIVE);
                return Poll::Ready(Some(Ok(Frame::data(next))));
            }
            if this.ending {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.snapshots).poll_next(cx) {
                Poll::Ready(Some(Published::Reading)) => continue,
                Poll::Ready(Some(Published::Snapshot(snapshot))) => {
                    snapshot.frames_after(&mut this.sent, &mut this.queue);
                    continue;
                }
                Poll::Ready(Some(Published::End(last))) => {
                    this.queue.push_back(last);
                    this.ending = true;
                    continue;
                }
                // The producer stopped (the coordinator did).
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => {}
            }
            if this.keep_alive.as_mut().poll(cx).is_ready() {
                this.keep_alive.as_mut().reset(Instant::now() + KEEP_ALIVE);
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(COMMENT)))));
            }
            return Poll::Pending;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn versioned(version: u64, text: &'static str) -> Versioned {
        Versioned { version, frame: Bytes::from_static(text.as_bytes()) }
    }

    fn rounds(newest: i64, added_after: i64) -> Arc<Rounds> {
        let each: Vec<(i64, Bytes)> =
            (1..=newest).map(|round| (round, Bytes::from(format!("{{\"round\":{round}}}")))).collect();
        let listed = |after: i64| {
            let pieces: Vec<&[u8]> =
                each.iter().filter(|(r, _)| *r > after).map(|(_, j)| j.as_ref()).collect();
            rounds_frame(&pieces)
        };
        Arc::new(Rounds { all: listed(0), added: listed(added_after), added_after, each })
    }

    fn snapshot(task: u64, rounds: Arc<Rounds>, attempts: u64, tokens: u64) -> TaskSnapshot {
        TaskSnapshot {
            task: versioned(task, "task"),
            rounds,
            attempts: versioned(attempts, "attempts"),
            tokens: versioned(tokens, "tokens"),
        }
    }

    fn text(frames: &VecDeque<Bytes>) -> Vec<String> {
        frames.iter().map(|f| String::from_utf8_lossy(f).into_owned()).collect()
    }

    #[test]
    fn a_stream_sends_every_event_first_then_only_what_changed() {
        let mut sent = None;
        let mut out = VecDeque::new();
        snapshot(0, rounds(0, 0), 0, 0).frames_after(&mut sent, &mut out);
        assert_eq!(text(&out), ["task", "event: rounds\ndata: []\n\n", "attempts", "tokens"]);
        out.clear();
        // Nothing changed: nothing is sent.
        snapshot(0, rounds(0, 0), 0, 0).frames_after(&mut sent, &mut out);
        assert!(out.is_empty());
        // The view and one round changed.
        snapshot(1, rounds(1, 0), 0, 0).frames_after(&mut sent, &mut out);
        assert_eq!(text(&out), ["task", "event: rounds\ndata: [{\"round\":1}]\n\n"]);
        out.clear();
        // A reader that missed a snapshot (rounds 2 and 3 were added one
        // at a time) gets both rounds it has not seen.
        snapshot(1, rounds(3, 2), 0, 1).frames_after(&mut sent, &mut out);
        assert_eq!(text(&out), ["event: rounds\ndata: [{\"round\":2},{\"round\":3}]\n\n", "tokens"]);
    }

    #[test]
    fn a_shared_snapshot_is_not_copied_per_stream() {
        let shared = snapshot(0, rounds(2, 1), 0, 0);
        let (mut one, mut other) = (VecDeque::new(), VecDeque::new());
        shared.frames_after(&mut None, &mut one);
        shared.frames_after(&mut None, &mut other);
        for (a, b) in one.iter().zip(&other) {
            assert_eq!(a.as_ptr(), b.as_ptr(), "both streams send the same bytes");
        }
    }

    #[test]
    fn the_list_is_sent_when_its_version_changes() {
        let mut tracked = Tracked::default();
        let (mut sent, mut out) = (None, VecDeque::new());
        let first = ListSnapshot { tasks: tracked.update("tasks", "[]".into()) };
        first.frames_after(&mut sent, &mut out);
        let same = ListSnapshot { tasks: tracked.update("tasks", "[]".into()) };
        same.frames_after(&mut sent, &mut out);
        let changed = ListSnapshot { tasks: tracked.update("tasks", "[1]".into()) };
        changed.frames_after(&mut sent, &mut out);
        assert_eq!(text(&out), ["event: tasks\ndata: []\n\n", "event: tasks\ndata: [1]\n\n"]);
    }

    #[tokio::test]
    async fn streams_share_one_producer_which_stops_with_its_last_stream() {
        let feeds: Feeds<String, ListSnapshot> = Feeds::default();
        let (started, mut producers) = tokio::sync::mpsc::unbounded_channel();
        let subscribe = |feeds: &Feeds<String, ListSnapshot>| {
            let started = started.clone();
            feeds.subscribe("task".into(), move |producer| {
                let _ = started.send(producer);
            })
        };
        let one = subscribe(&feeds);
        let two = subscribe(&feeds);
        let producer = producers.try_recv().unwrap();
        assert!(producers.try_recv().is_err(), "one producer for both streams");
        producer.publish(ListSnapshot { tasks: versioned(0, "tasks") });
        assert!(matches!(&*two.borrow(), Published::Snapshot(_)));
        drop((one, two));
        // No news, and no reread due: only the streams' going stops it.
        let (_coordinator, mut changes) = watch::channel(0u64);
        let goes_on = producer.next_change(&mut changes, Instant::now(), Duration::ZERO).await;
        assert!(!goes_on, "the producer stops without streams");
        assert_eq!(feeds.len(), 0);
        drop(producer);
        let _three = subscribe(&feeds);
        assert!(producers.try_recv().is_ok(), "a new stream starts a new producer");
    }

    #[test]
    fn streams_over_the_cap_are_refused_with_a_retry_hint() {
        let streams = Streams::new(2);
        let held = [streams.admit_in(None).unwrap(), streams.admit_in(None).unwrap()];
        let refused = streams.admit_in(None).unwrap_err();
        assert_eq!(refused.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.body(Duration::ZERO).retry_after_ms, Some(5000));
        drop(held);
        assert!(streams.admit_in(None).is_ok());
    }

    fn quota(operator: Option<u32>, owners: Option<u32>) -> StreamQuota {
        StreamQuota { operator, owners }
    }

    #[test]
    fn a_project_without_a_quota_takes_a_quarter_of_the_cap() {
        let streams = Streams::new(8);
        // Without the operator's quota, an owners' limit above the quarter
        // does not loosen it; one below tightens it.
        for owners in [None, Some(u32::MAX)] {
            let unset = || Some(("acme".to_string(), quota(None, owners)));
            let held = [streams.admit_in(unset()).unwrap(), streams.admit_in(unset()).unwrap()];
            assert!(streams.admit_in(unset()).unwrap_err().message().starts_with("quota connections"));
            // The admin token is held to the cap only.
            let admin: Vec<_> = (0..6).map(|_| streams.admit_in(None).unwrap()).collect();
            drop((held, admin));
        }
        let tight = || Some(("acme".to_string(), quota(None, Some(1))));
        let held = streams.admit_in(tight()).unwrap();
        assert!(streams.admit_in(tight()).is_err());
        drop(held);
        // The operator's quota may exceed the quarter; the owners' limit
        // still holds under it.
        assert_eq!(streams.most(quota(Some(6), None)), 6);
        assert_eq!(streams.most(quota(Some(6), Some(3))), 3);
        assert_eq!(streams.most(quota(Some(6), Some(9))), 6);
    }

    /// A key's stream past its lifetime sends the request to sign in again
    /// and ends, even with a newer snapshot waiting (its reader came back
    /// after the key may have been revoked).
    #[tokio::test]
    async fn a_key_s_stream_past_its_lifetime_sends_nothing_but_reauthenticate() {
        use http_body_util::BodyExt;
        let (sender, receiver) = watch::channel(Published::Snapshot(Arc::new(ListSnapshot {
            tasks: versioned(0, "event: tasks\ndata: [\"secret\"]\n\n"),
        })));
        let body = EventBody {
            snapshots: WatchStream::new(receiver),
            sent: None,
            queue: VecDeque::new(),
            ending: false,
            keep_alive: Box::pin(tokio::time::sleep(KEEP_ALIVE)),
            lifetime: Some(Box::pin(tokio::time::sleep(Duration::ZERO))),
            _open: Streams::new(1).admit_in(None).unwrap(),
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        let sent = body.collect().await.unwrap().to_bytes();
        assert_eq!(sent, frame("reauthenticate", "{}"));
        drop(sender);
    }

    #[test]
    fn a_projects_streams_are_held_to_its_connections_quota() {
        let streams = Streams::new(10);
        let acme = || Some(("acme".to_string(), quota(Some(2), None)));
        let held = [streams.admit_in(acme()).unwrap(), streams.admit_in(acme()).unwrap()];
        let refused = streams.admit_in(acme()).unwrap_err();
        assert_eq!(refused.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert!(refused.message().starts_with("quota connections"), "{refused}");
        // Another project, and the admin token, are not counted against it.
        let other = streams.admit_in(Some(("other".to_string(), quota(Some(1), None)))).unwrap();
        let admin = streams.admit_in(None).unwrap();
        drop(held);
        let again = streams.admit_in(acme()).unwrap();
        assert_eq!(streams.per_project.lock().unwrap().get("acme"), Some(&1));
        drop((again, other, admin));
        assert!(streams.per_project.lock().unwrap().is_empty(), "closed streams give their place back");
    }
}
