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
//! An event is sent when what it shows changed: the coordinator tells the
//! streams when it served a request or a tick that may change a task
//! ([`Coordinator::changes`](crate::round::Coordinator::changes)); a
//! stream then reads the task again and sends it if it differs from what
//! it sent last. Bursts are coalesced (at most one read per
//! [`TASK_COALESCE`] for a task, [`LIST_COALESCE`] for the list), and a
//! stream also reads again after [`REREAD`] without news, for what
//! changes by the clock alone (clients that stop checking in) or on
//! another replica. A comment line every [`KEEP_ALIVE`] keeps idle
//! connections open through proxies. A stream that cannot read the store
//! sends an `unavailable` event (the API's error body) and ends; the reader
//! connects again after `retry_after_ms`.
//!
//! The admin token is checked when the stream opens: the browser's
//! `EventSource` cannot send an `Authorization` header, so the dashboard
//! reads the stream with `fetch`, which can.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::admin::{attempt_views, round_views, task_views, token_views, view};
use super::error::{ApiError, ApiResult};
use super::extract::{Admin, TaskId};
use super::openapi::{Refused, RetryLater, TaskPath};
use super::state::AppState;
use crate::round::coordinator::Whereabouts;
use crate::store::Store;

/// Least time between two reads of a task for its stream.
pub const TASK_COALESCE: Duration = Duration::from_millis(200);
/// Least time between two reads of the task list for its stream.
pub const LIST_COALESCE: Duration = Duration::from_secs(1);
/// A stream reads again after this long without news.
pub const REREAD: Duration = Duration::from_secs(5);
/// Interval of the keep-alive comments.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// The attempts an `attempts` event lists (newest first).
pub const ATTEMPTS_SHOWN: i64 = 20;
/// What a reader is told to wait before it connects again after an
/// `unavailable` event.
const RETRY: Duration = Duration::from_secs(2);

/// An event stream's body.
type EventStream = Sse<axum::response::sse::KeepAliveStream<ReceiverStream<Result<Event, Infallible>>>>;

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
            content_type = "text/event-stream", body = String),
        (status = 401, response = Refused), (status = 404, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn task_events(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<EventStream> {
    // A task that does not exist is refused before the stream starts.
    state.store.task(&id).await?;
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(follow_task(state, id, tx));
    Ok(stream(rx))
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
            content_type = "text/event-stream", body = String),
        (status = 401, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn task_list_events(
    _: Admin,
    headers: HeaderMap,
    State(state): State<AppState>,
) -> EventStream {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(follow_tasks(state, headers.get(header::AUTHORIZATION).cloned(), tx));
    stream(rx)
}

fn stream(rx: mpsc::Receiver<Result<Event, Infallible>>) -> EventStream {
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
}

/// Why a stream stops.
enum Stop {
    /// The reader went away (or the coordinator stopped).
    Gone,
}

/// Sends `name` with `data` as JSON unless it equals `last` (then nothing;
/// `last` is updated). `Err` once the reader is gone.
async fn send_changed(
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    name: &str,
    data: &impl Serialize,
    last: &mut Option<String>,
) -> Result<(), Stop> {
    let json = to_json(data);
    if last.as_deref() == Some(json.as_str()) {
        return Ok(());
    }
    send(tx, name, &json).await?;
    *last = Some(json);
    Ok(())
}

async fn send(tx: &mpsc::Sender<Result<Event, Infallible>>, name: &str, json: &str) -> Result<(), Stop> {
    tx.send(Ok(Event::default().event(name).data(json))).await.map_err(|_| Stop::Gone)
}

/// Sends `name` with `data` as JSON.
async fn send_json(
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    name: &str,
    data: &impl Serialize,
) -> Result<(), Stop> {
    send(tx, name, &to_json(data)).await
}

/// `data` as one line of JSON (the views always serialize; `null` if one
/// did not).
fn to_json(data: &impl Serialize) -> String {
    serde_json::to_string(data).unwrap_or_else(|_| "null".into())
}

/// Sends `unavailable` with `error`'s body and a retry hint.
async fn unavailable(tx: &mpsc::Sender<Result<Event, Infallible>>, error: ApiError) {
    tracing::warn!(%error, "an admin event stream stops: the store could not be read");
    let _ = send_json(tx, "unavailable", &error.body(RETRY)).await;
}

/// Waits for news (or [`REREAD`]), then at least `coalesce` since the
/// last read. `Err` when the reader is gone or the coordinator stopped.
async fn next_change(
    changes: &mut tokio::sync::watch::Receiver<u64>,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    read_at: tokio::time::Instant,
    coalesce: Duration,
) -> Result<(), Stop> {
    tokio::select! {
        changed = changes.changed() => changed.map_err(|_| Stop::Gone)?,
        () = tokio::time::sleep(REREAD) => {}
        () = tx.closed() => return Err(Stop::Gone),
    }
    tokio::select! {
        () = tokio::time::sleep_until(read_at + coalesce) => Ok(()),
        () = tx.closed() => Err(Stop::Gone),
    }
}

/// What a task's stream sent last.
#[derive(Default)]
struct Sent {
    /// The task's view, as sent.
    task: Option<String>,
    /// The newest round sent.
    round: i64,
    /// The leader's last failure when the attempts were sent.
    attempts_key: Option<String>,
    /// The tokens, as sent.
    tokens: Option<String>,
}

async fn follow_task(state: AppState, id: String, tx: mpsc::Sender<Result<Event, Infallible>>) {
    let mut changes = state.coordinator.changes();
    let mut sent = Sent::default();
    loop {
        let read_at = tokio::time::Instant::now();
        changes.mark_unchanged();
        match send_task(&state, &id, &tx, &mut sent).await {
            Ok(Next::Follow) => {}
            Ok(Next::Moved) | Err(Stop::Gone) => return,
        }
        if next_change(&mut changes, &tx, read_at, TASK_COALESCE).await.is_err() {
            return;
        }
    }
}

/// Whether a task's stream goes on.
enum Next {
    Follow,
    /// It told the reader that another replica leads the task now.
    Moved,
}

/// One read of the task: its view, new rounds, new attempts, its tokens.
async fn send_task(
    state: &AppState,
    id: &str,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    sent: &mut Sent,
) -> Result<Next, Stop> {
    if let Whereabouts::At(url) = state.coordinator.whereabouts(id) {
        send_json(tx, "moved", &serde_json::json!({ "leader": url })).await?;
        return Ok(Next::Moved);
    }
    // The first read sends every event, whether or not it changed.
    let first = sent.task.is_none();
    let read = async {
        let task = state.store.task(id).await?;
        let current = view(state, &task).await?;
        let rounds = if current.completed_rounds as i64 > sent.round || first {
            Some(round_views(state, &task, sent.round).await?)
        } else {
            None
        };
        // The attempts change when one more ends, which the leader's last
        // failure tells.
        let key = to_json(&current.last_failure);
        let attempts = if sent.attempts_key.as_deref() != Some(key.as_str()) {
            Some(attempt_views(state, id, ATTEMPTS_SHOWN).await?)
        } else {
            None
        };
        let tokens = token_views(state, id).await?;
        Ok::<_, ApiError>((current, rounds, attempts, key, tokens))
    };
    let (current, rounds, attempts, key, tokens) = match read.await {
        Ok(read) => read,
        Err(error) => {
            unavailable(tx, error).await;
            return Err(Stop::Gone);
        }
    };
    send_changed(tx, "task", &current, &mut sent.task).await?;
    if let Some(rounds) = rounds {
        // The first event lists every round (none, for a new task).
        if !rounds.is_empty() || first {
            sent.round = rounds.last().map_or(sent.round, |r| r.round);
            send_json(tx, "rounds", &rounds).await?;
        }
    }
    if let Some(attempts) = attempts {
        send_json(tx, "attempts", &attempts).await?;
        sent.attempts_key = Some(key);
    }
    send_changed(tx, "tokens", &tokens, &mut sent.tokens).await?;
    Ok(Next::Follow)
}

async fn follow_tasks(
    state: AppState,
    authorization: Option<HeaderValue>,
    tx: mpsc::Sender<Result<Event, Infallible>>,
) {
    let mut changes = state.coordinator.changes();
    let mut last = None;
    loop {
        let read_at = tokio::time::Instant::now();
        changes.mark_unchanged();
        match task_views(&state, authorization.as_ref()).await {
            Ok(tasks) => {
                if send_changed(&tx, "tasks", &tasks, &mut last).await.is_err() {
                    return;
                }
            }
            Err(error) => return unavailable(&tx, error).await,
        }
        if next_change(&mut changes, &tx, read_at, LIST_COALESCE).await.is_err() {
            return;
        }
    }
}
