//! Requests for a task that another replica leads are forwarded to it.
//!
//! Several `cohort serve` processes may share one PostgreSQL database
//! behind a load balancer; each task's rounds live in the replica that
//! holds its lease ([`crate::cluster::lease`]). A request about a task
//! (the admin API's `/admin/tasks/{id}/...`, enrollment, and every request
//! a client makes with its credential) that reaches another replica is
//! passed on to the leader unchanged, its body streamed, and the leader's
//! answer streamed back: never dropped, never redirected (a client behind
//! the balancer may not reach replicas directly, and a redirect would lose
//! its `Authorization` header). A forwarded request carries the replicas'
//! key and the client's address, so that the leader applies its rate
//! limits to the client rather than to the forwarding replica; a replica
//! forwards a request at most once. While a task is between leaders (its
//! leader died and its lease has not lapsed yet) its requests get a `503`
//! with `Retry-After`.
//!
//! A round's groups may run on other replicas than its leader (see
//! [`crate::round::owned`]): a client's stage messages go to its group's
//! owner. A replica that knows the owner forwards them there directly;
//! one that does not yet passes them to the leader, which does. A request
//! is forwarded to a group's owner at most once (it is marked
//! [`GROUP_HOP`]), so stale routes never send it round in circles.
//!
//! Replicas reach each other over plain HTTP at the URL each advertises
//! (`--public-url`): in a replica deployment, TLS ends at the balancer and
//! the replicas sit on a private network.

use std::net::IpAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use subtle::ConstantTimeEq;

use crate::api::ErrorCode;
use crate::api::auth::token_hash;
use crate::api::error::ApiError;
use crate::api::state::AppState;
use crate::cluster::{Whereabouts, affinity};
use crate::metrics::Served;
use crate::store::{ParticipantRecord, StoreError};
use cohort_client::api::routes;

/// Header carrying the replicas' key on a forwarded request.
pub const REPLICA_KEY: &str = "x-cohort-replica-key";
/// Header carrying the client's address on a forwarded request.
pub const CLIENT_ADDRESS: &str = "x-cohort-client-address";
/// Header marking a request forwarded to its group's owner.
pub const GROUP_HOP: &str = "x-cohort-group-hop";
/// Longest a forwarded request waits on the leader (for it to take the
/// next piece of the body, or to answer once it has it all): well inside a
/// lease's TTL (5 s), so that a request forwarded to a leader that stalled
/// (a long pause, a frozen container) comes back as a retryable `503`
/// before its lease lapses, and the client's retry reaches the next
/// leader; a long upload that keeps moving is not cut.
const FORWARD_ANSWER: Duration = Duration::from_millis(2_500);
/// Longest a forwarded request may take in all (a large body).
const FORWARD_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a connection to another replica may sit unused in the pool:
/// well under a replica's default header timeout (10 s,
/// `ConnectionLimits::header_timeout`), after which the replica closes it.
const POOL_IDLE: Duration = Duration::from_secs(4);
/// What a client is told to wait while a task is between leaders.
pub(crate) const BETWEEN_LEADERS: Duration = Duration::from_secs(1);

/// The HTTP client replicas forward with, and their shared key.
#[derive(Clone)]
pub struct Forwarder {
    client: Client<HttpConnector, Body>,
    /// Hex of SHA-256 over a fixed label and the admin token, which every
    /// replica of a deployment shares: proof that a forwarded request comes
    /// from a replica, without the admin token on the wire.
    key: std::sync::Arc<String>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder").finish_non_exhaustive()
    }
}

impl Forwarder {
    /// A forwarder for the replicas that share `admin_token`.
    pub fn new(admin_token: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(3)));
        // A replica closes a keep-alive connection that has carried no
        // new request head for its header timeout (10 s by default); a
        // pooled connection reused just as that happens fails the request
        // sent on it. Idle connections are dropped well before.
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector);
        let key = hex::encode(token_hash(&format!("cohort replica forwarding\0{admin_token}")));
        Self { client, key: std::sync::Arc::new(key) }
    }

    /// The key as the header a forwarded request carries (hex, so always
    /// a valid value), marked sensitive.
    fn key_header(&self) -> HeaderValue {
        let mut value = HeaderValue::from_str(&self.key).unwrap_or(HeaderValue::from_static(""));
        value.set_sensitive(true);
        value
    }

    /// Whether `headers` carry this deployment's replica key.
    pub fn vouched(&self, headers: &HeaderMap) -> bool {
        headers.get(REPLICA_KEY).is_some_and(|value| bool::from(value.as_bytes().ct_eq(self.key.as_bytes())))
    }

    /// The client address a forwarding replica vouched for, if any.
    pub fn client_address(&self, headers: &HeaderMap) -> Option<IpAddr> {
        if !self.vouched(headers) {
            return None;
        }
        headers.get(CLIENT_ADDRESS)?.to_str().ok()?.parse().ok()
    }

    /// Sends `request` to the replica at `base` and streams its answer back.
    async fn forward(&self, base: &str, client: Option<IpAddr>, request: Request) -> Response {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let Some(uri) = at(base, path) else {
            return unavailable("the task's replica has an unusable address");
        };
        parts.uri = uri;
        parts.version = axum::http::Version::HTTP_11;
        for hop in [header::HOST, header::CONNECTION, header::TRANSFER_ENCODING, header::UPGRADE] {
            parts.headers.remove(hop);
        }
        // The client is named below, vouched for by the key; what a proxy
        // before this replica wrote is not passed on, so that a replica
        // that trusts another's address as an HTTP proxy reads nothing.
        parts.headers.remove(crate::api::listener::forwarded::X_FORWARDED_FOR);
        parts.headers.insert(REPLICA_KEY, self.key_header());
        if let Some(address) = client.and_then(|a| HeaderValue::from_str(&a.to_string()).ok()) {
            parts.headers.insert(CLIENT_ADDRESS, address);
        }
        // A request that asks to be held (`wait_ms`) may take that long
        // more before its answer.
        let allowance = FORWARD_ANSWER + held_for(&parts.method, &parts.uri);
        let progress = std::sync::Arc::new(Progress::new());
        let body = Body::new(Sent { inner: body, progress: progress.clone() });
        // The leader must take the body as it comes and answer once it has
        // it: a leader that takes nothing (or does not answer) for
        // FORWARD_ANSWER (and the hold the request asks for), while the
        // client is not the one holding the body back, is given up on.
        let answered = async {
            loop {
                tokio::time::sleep(FORWARD_ANSWER / 10).await;
                if progress.stalled_for() > allowance {
                    break;
                }
            }
        };
        let request =
            tokio::time::timeout(FORWARD_TIMEOUT, self.client.request(Request::from_parts(parts, body)));
        tokio::select! {
            response = request => match response {
                Ok(Ok(response)) => response.map(Body::new),
                Ok(Err(error)) => {
                    let error = chain(&error);
                    tracing::warn!(%error, leader = base, "a request could not be forwarded to the task's replica");
                    unavailable("the replica leading this task did not answer; retry")
                }
                Err(_) => unavailable("the replica leading this task did not answer in time; retry"),
            },
            () = answered => {
                tracing::warn!(leader = base, "the task's replica did not answer a forwarded request in time");
                unavailable("the replica leading this task did not answer in time; retry")
            }
        }
    }

    /// `GET` of `path` from the replica at `base` with `authorization`,
    /// as JSON.
    pub(crate) async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        base: &str,
        path: &str,
        authorization: Option<&HeaderValue>,
    ) -> Option<T> {
        let mut request = Request::get(at(base, path)?).body(Body::empty()).ok()?;
        if let Some(value) = authorization {
            request.headers_mut().insert(header::AUTHORIZATION, value.clone());
        }
        request.headers_mut().insert(REPLICA_KEY, self.key_header());
        let response = tokio::time::timeout(FORWARD_ANSWER, self.client.request(request)).await.ok()?.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = http_body_util::BodyExt::collect(response.into_body()).await.ok()?.to_bytes();
        serde_json::from_slice(&body).ok()
    }
}

/// `error` and each of its sources, `: `-separated (hyper's own say only
/// which step failed).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// How a forwarded request's body moves: when the leader last took a
/// piece of it, and whether the client is the one holding it back.
struct Progress {
    started: std::time::Instant,
    /// Milliseconds from `started` to the last piece taken (or the start).
    last_ms: std::sync::atomic::AtomicU64,
    /// The body waits for the client, not for the leader.
    waiting_on_client: std::sync::atomic::AtomicBool,
}

impl Progress {
    fn new() -> Self {
        Self {
            started: std::time::Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
            waiting_on_client: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn moved(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last_ms.store(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// How long the leader has taken nothing and not answered (zero while
    /// the client holds the body back: its own rate limits apply).
    fn stalled_for(&self) -> Duration {
        if self.waiting_on_client.load(std::sync::atomic::Ordering::Relaxed) {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(std::sync::atomic::Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }
}

/// A forwarded request's body, which records its [`Progress`].
struct Sent {
    inner: Body,
    progress: std::sync::Arc<Progress>,
}

impl http_body::Body for Sent {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        let pending = polled.is_pending();
        self.progress.waiting_on_client.store(pending, std::sync::atomic::Ordering::Relaxed);
        if !pending {
            self.progress.moved();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// How long a request (`method` on `uri`) asks to be held: the `wait_ms`
/// of a check-in or of a stage message's `GET` or `POST`, at most
/// [`routes::MAX_WAIT_MS`]; zero for any other request, whatever its query.
fn held_for(method: &axum::http::Method, uri: &Uri) -> Duration {
    let check_in = match (method, uri.path()) {
        (&axum::http::Method::POST, routes::CHECK_IN) => true,
        (&axum::http::Method::GET | &axum::http::Method::POST, routes::ROUND_MESSAGE) => false,
        _ => return Duration::ZERO,
    };
    // Read as the handler reads it: a query it refuses holds nothing.
    crate::api::client::Query::parse(uri.query(), check_in).map_or(Duration::ZERO, |query| query.wait)
}

/// `path` (with its query) at the replica whose URL is `base`.
fn at(base: &str, path: &str) -> Option<Uri> {
    format!("{}{path}", base.trim_end_matches('/')).parse().ok()
}

/// A `503` with `Retry-After` in the API's error form.
fn unavailable(message: &str) -> Response {
    ApiError::new(ErrorCode::Unavailable, message).retry_after(BETWEEN_LEADERS).into_response()
}

/// A participant the routing looked up by its credential, handed to the
/// handler's [`Authenticated`](crate::api::extract::Authenticated) extractor so
/// that it is not looked up twice.
#[derive(Clone)]
pub(crate) struct KnownParticipant {
    pub(crate) credential_hash: [u8; 32],
    pub(crate) participant: ParticipantRecord,
}

/// What a request is about: a task named in its path (the admin API,
/// enrollment), or the participant whose credential it carries (a
/// client's other requests).
enum Subject {
    Task(String),
    Participant(KnownParticipant),
}

impl Subject {
    fn task(&self) -> &str {
        match self {
            Subject::Task(id) => id,
            Subject::Participant(known) => &known.participant.task_id,
        }
    }
}

/// The subject of a request; `None` when it names no task or its
/// credential is unknown (the handler refuses it); the store's error when
/// the store cannot say.
async fn subject_of(
    state: &AppState,
    path: &str,
    headers: &HeaderMap,
) -> Result<Option<Subject>, StoreError> {
    let credential_hash = {
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match segments.as_slice() {
            ["admin", "tasks", id, ..] | ["v1", "tasks", id, "enroll"] => {
                return Ok(crate::api::extract::is_valid_id(id).then(|| Subject::Task(id.to_string())));
            }
            _ if [routes::CHECK_IN, routes::LEAVE, routes::MODEL, routes::METRICS, routes::ROUND_MESSAGE]
                .contains(&path) =>
            {
                match crate::api::extract::bearer_of(headers) {
                    Some(credential) => token_hash(credential),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        }
    };
    match state.store.participant_by_credential(&credential_hash).await {
        Ok(participant) => Ok(Some(Subject::Participant(KnownParticipant { credential_hash, participant }))),
        Err(StoreError::NotFound(_)) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Middleware: serves a task's requests here when this replica leads it,
/// forwards them to the replica that does, and answers `503` while
/// nobody does.
pub(crate) async fn route(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let subject = match subject_of(&state, request.uri().path(), request.headers()).await {
        Ok(Some(subject)) => subject,
        Ok(None) => return next.run(request).await,
        // The database cannot say which task: the handler could not either.
        Err(error) => return ApiError::from(error).into_response(),
    };
    let task = subject.task().to_string();
    // Any replica serves a model download of a task led elsewhere from
    // the store (and of a task between leaders, below).
    if matches!(subject, Subject::Participant(_))
        && request.uri().path() == routes::MODEL
        && matches!(state.coordinator.whereabouts(&task), Whereabouts::At(_))
    {
        return serve_here(&state, request, subject, next).await;
    }
    if let Subject::Participant(known) = &subject
        && request.uri().path() == routes::ROUND_MESSAGE
        && let Some(group) = state.coordinator.group_whereabouts(&known.participant.id)
    {
        match group {
            Whereabouts::At(url) if !request.headers().contains_key(GROUP_HOP) => {
                // The client is the one a replica vouched for, else the
                // connection's peer.
                let client = state
                    .forwarder
                    .client_address(request.headers())
                    .or_else(|| crate::api::extract::peer_of(request.extensions()));
                let mut request = request;
                request.headers_mut().insert(GROUP_HOP, HeaderValue::from_static("1"));
                state.metrics.client_request(Served::forwarded);
                return state.forwarder.forward(&url, client, request).await;
            }
            Whereabouts::Here => return serve_here(&state, request, subject, next).await,
            // Forwarded to an owner that no longer runs the group: its
            // task's routes say what happened to it.
            Whereabouts::At(_) | Whereabouts::Nowhere => {}
        }
    }
    match state.coordinator.whereabouts(&task) {
        Whereabouts::Here => serve_here(&state, request, subject, next).await,
        Whereabouts::At(url) if !state.forwarder.vouched(request.headers()) => {
            // Not vouched for: the client is the connection's peer.
            let client = crate::api::extract::peer_of(request.extensions());
            if request.uri().path().starts_with("/v1/") {
                state.metrics.client_request(Served::forwarded);
            }
            state.forwarder.forward(&url, client, request).await
        }
        // Forwarded once already: the leader moved meanwhile.
        Whereabouts::At(_) => unavailable("this task's leader is changing; retry"),
        Whereabouts::Nowhere => match state.store.task(&task).await {
            Ok(record) if record.status.is_final() => {
                // Its model is served no more: the copy kept here goes.
                state.models.forget(&task);
                match subject {
                    // A client's round requests about a task that is over:
                    // it is told so (it checks in next, and hears `finished`).
                    Subject::Participant(_)
                        if ![routes::CHECK_IN, routes::LEAVE].contains(&request.uri().path()) =>
                    {
                        ApiError::with_status(StatusCode::GONE, ErrorCode::TaskInactive, "the task is over")
                            .into_response()
                    }
                    subject => serve_here(&state, request, subject, next).await,
                }
            }
            // The model of a task between leaders (or whose leader this
            // replica has not heard of yet) is in the store.
            Ok(_) if matches!(subject, Subject::Participant(_)) && request.uri().path() == routes::MODEL => {
                serve_here(&state, request, subject, next).await
            }
            // Led by nobody for longer than a lease takes to pass on: no
            // replica can load it, and any may serve what needs no leader.
            Ok(_)
                if state.coordinator.unled_for(&task, UNLED_AFTER)
                    && served_without_leader(&subject, &request) =>
            {
                serve_here(&state, request, subject, next).await
            }
            Ok(_) => unavailable("this task's rounds are moving to another replica; retry"),
            Err(StoreError::NotFound(_)) => next.run(request).await,
            Err(error) => ApiError::from(error).into_response(),
        },
    }
}

/// A task that this replica has not seen led by any replica for this long
/// (or since it started) is one that no replica can load (a lead passes on
/// within a lease's TTL, 5 s, and this replica reads the leases every
/// second): its admin requests that need no leader are served by any
/// replica. Before that they get a `503`, which a balancer retries on
/// another replica (a task created a moment ago is known to its leader
/// first).
const UNLED_AFTER: Duration = Duration::from_secs(10);

/// Whether any replica may serve `request` about a task that no replica
/// leads (one that no replica can load, see [`UNLED_AFTER`]): the admin
/// API's reads (from the store), and stopping and deleting it, which only
/// write the store (a leader that appears drops a task it finds stopped).
/// Pausing, resuming and everything a client asks need the leader.
fn served_without_leader(subject: &Subject, request: &Request) -> bool {
    if !matches!(subject, Subject::Task(_)) || !request.uri().path().starts_with("/admin/") {
        return false;
    }
    let path = request.uri().path();
    match *request.method() {
        axum::http::Method::GET => !path.ends_with("/events"),
        axum::http::Method::DELETE => true,
        axum::http::Method::POST => path.ends_with("/stop"),
        _ => false,
    }
}

/// Serves a request here, handing the participant the routing looked up
/// to the handler. A client's answer (an enrollment's too) names, in the
/// affinity cookie, the replica its next request belongs at (see
/// [`crate::cluster::affinity`]).
async fn serve_here(state: &AppState, mut request: Request, subject: Subject, next: Next) -> Response {
    let client = request.uri().path().starts_with("/v1/");
    let task = subject.task().to_string();
    let participant = match subject {
        Subject::Participant(known) => {
            let id = known.participant.id.clone();
            request.extensions_mut().insert(known);
            Some(id)
        }
        Subject::Task(_) => None,
    };
    if client {
        state.metrics.client_request(Served::here);
    }
    let mut response = next.run(request).await;
    // A client done with its group for the round goes back to the leader.
    let participant = participant.filter(|_| response.extensions().get::<affinity::RoundDone>().is_none());
    if client && let Some(url) = state.coordinator.next_replica(&task, participant.as_deref()) {
        response.headers_mut().append(header::SET_COOKIE, affinity::set_cookie(&url));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forwarded_request_is_given_the_hold_it_asks_for_and_no_more() {
        use axum::http::Method;
        let held = |method: Method, uri: &str| held_for(&method, &uri.parse().unwrap());
        assert_eq!(held(Method::GET, "http://r/v1/round/message"), Duration::ZERO);
        assert_eq!(held(Method::GET, "http://r/v1/round/message?wait_ms=5000"), Duration::from_secs(5));
        assert_eq!(
            held(Method::POST, "http://r/v1/checkin?trained_on=3&wait_ms=900000"),
            Duration::from_secs(20)
        );
        assert_eq!(held(Method::POST, "http://r/v1/checkin?wait_ms=x"), Duration::ZERO);
        // A stage message's post is held for the next one once accepted.
        assert_eq!(held(Method::POST, "http://r/v1/round/message?wait_ms=5000"), Duration::from_secs(5));
        assert_eq!(held(Method::POST, "http://r/v1/round/message?trained_on=1"), Duration::ZERO);
        // Only those are held: an enrollment or an admin request that
        // names a wait is not given longer before the forwarding replica
        // gives up on it.
        assert_eq!(held(Method::POST, "http://r/v1/tasks/t/enroll?wait_ms=5000"), Duration::ZERO);
        assert_eq!(held(Method::GET, "http://r/v1/checkin?wait_ms=5000"), Duration::ZERO);
        assert_eq!(held(Method::GET, "http://r/admin/tasks?wait_ms=100"), Duration::ZERO);
    }

    #[test]
    fn only_a_replica_of_the_deployment_may_vouch_for_a_client_address() {
        let ours = Forwarder::new("admin-token-of-this-deployment");
        let theirs = Forwarder::new("admin-token-of-another-deployment");
        let headers = |key: Option<&str>| {
            let mut headers = HeaderMap::new();
            headers.insert(CLIENT_ADDRESS, HeaderValue::from_static("203.0.113.7"));
            if let Some(key) = key {
                headers.insert(REPLICA_KEY, HeaderValue::from_str(key).unwrap());
            }
            headers
        };
        let vouched = headers(Some(&ours.key));
        assert!(ours.vouched(&vouched));
        assert_eq!(ours.client_address(&vouched), Some("203.0.113.7".parse().unwrap()));
        // A client that names an address itself, or another deployment's
        // replica, is taken at its connection's address.
        for forged in
            [headers(None), headers(Some(&theirs.key)), headers(Some("")), headers(Some(&ours.key[1..]))]
        {
            assert!(!ours.vouched(&forged));
            assert_eq!(ours.client_address(&forged), None);
        }
        // The key is not the admin token, nor its hash as the API stores it.
        assert!(!ours.key.contains("admin-token"));
        assert_ne!(*ours.key, hex::encode(token_hash("admin-token-of-this-deployment")));
        // It is sent as itself, and kept out of logs.
        assert!(ours.vouched(&HeaderMap::from_iter([(REPLICA_KEY.parse().unwrap(), ours.key_header())])));
        assert!(ours.key_header().is_sensitive());
    }
}
