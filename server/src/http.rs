//! The coordinator's HTTP API.
//!
//! * Admin API (JSON, `Authorization: Bearer <admin token>`): create, list,
//!   inspect, pause, resume and stop tasks; list rounds with their metrics;
//!   download checkpoints (safetensors).
//! * Client API: enroll with a task's enrollment token and receive a
//!   credential; then, with `Authorization: Bearer <credential>`, check in,
//!   download the global model, fetch and post secure-aggregation stage
//!   messages (`application/x-cohort-secagg`, the versioned binary encoding of
//!   `cohort-crypto`), and report training and evaluation metrics.
//! * `/healthz`, Prometheus `/metrics`, and the OpenAPI document at
//!   `/openapi.json`.
//!
//! Every refusal is a 4xx JSON body `{"error": code, "message": text}`;
//! storage failures are a 500 that says nothing about the internals, and a
//! database that cannot be reached a 503. A `429` (rate limited) or `503`
//! carries `Retry-After` (seconds) and `retry_after_ms` in its body.
//!
//! What a client can make the server hold is bounded before it is read: a
//! stage message only from a client selected and eligible for the stage in
//! progress, at most the size the round's parameters allow; a metrics
//! report only from a member of a recent round, 4 KiB of known numeric
//! fields once per round and kind; enrollment, check-in and reports under
//! per-address and per-credential rate limits ([`crate::ratelimit`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, DefaultBodyLimit, FromRequest, FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cohort_crypto::ProtocolError;
use cohort_crypto::signature::{SIGNATURE_LEN, enrollment_statement, verify};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::auth::{new_id, new_token, token_hash, verify_token};
use crate::coordinator::{Coordinator, CoordinatorError, LiveState, now_ms};
use crate::engine::{CheckIn, EngineError, Poll, TaskEngine};
use crate::listener::SlowBody;
use crate::metrics::Metrics;
use crate::ratelimit::{Call, Limiters, Rate};
use crate::spec::{TaskSpec, VariantChoice};
use crate::store::{
    ClientMetricsRecord, EnrollmentTokenRecord, ParticipantRecord, RoundRecord, SqlStore, Store, StoreError,
    TaskRecord, TaskStatus,
};
use cohort_crypto::policy::TaskSecurity;

/// Content type of secure-aggregation stage messages.
pub const SECAGG_CONTENT_TYPE: &str = "application/x-cohort-secagg";
/// Content type of checkpoints.
pub const SAFETENSORS_CONTENT_TYPE: &str = "application/vnd.safetensors";
const JSON_LIMIT: usize = 1 << 20;
/// Largest JSON body of the client API (an enrollment, a metrics report).
pub const CLIENT_JSON_LIMIT: usize = 4 << 10;
/// How long a readiness probe waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);
/// What a client is told to wait when the database cannot be reached.
const DATABASE_RETRY: Duration = Duration::from_secs(5);

/// Server-wide settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// SHA-256 of the admin token.
    pub admin_token_hash: [u8; 32],
    /// Largest accepted stage message.
    pub max_message_bytes: usize,
    /// How long a client credential stays valid.
    pub credential_ttl_ms: i64,
    /// The browser client's build (`web/pkg`), served under `/web/pkg`.
    pub web_assets: std::path::PathBuf,
    /// The public demo task `/demo` joins, when there is one.
    pub demo_task: Option<crate::web::DemoTask>,
    /// Rate limits of the client API.
    pub limiters: Limiters,
    /// Most model parameters over all tasks that are not stopped or
    /// completed; a task that would exceed it is refused.
    pub max_total_parameters: usize,
}

/// Most model parameters over all unfinished tasks, by default: about
/// 0.4 GB of weights, checkpoint and optimizer state in memory per 25 M.
pub const DEFAULT_MAX_TOTAL_PARAMETERS: usize = 50_000_000;

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
    /// Storage.
    pub store: SqlStore,
    /// The round actor.
    pub coordinator: Coordinator,
    /// Metrics registry.
    pub metrics: Metrics,
    /// Settings.
    pub config: ApiConfig,
    /// Held while a task is created, so that the parameter cap holds
    /// against concurrent creations.
    pub creating: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// A refused request.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<Duration>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None }
    }

    /// A `429`: the caller should wait `wait`.
    fn rate_limited(wait: Duration) -> Self {
        let message = format!("too many requests; retry in {} ms", wait.as_millis().max(1));
        Self { retry_after: Some(wait), ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message) }
    }

    /// A `503`: the database cannot be reached.
    fn database_unavailable() -> Self {
        Self {
            retry_after: Some(DATABASE_RETRY),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the database is unavailable or overloaded; retry later",
            )
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.code, self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({ "error": self.code, "message": self.message });
        let mut response = match self.retry_after {
            Some(wait) => {
                let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
                body["retry_after_ms"] = ms.into();
                let seconds = ms.div_ceil(1000).to_string();
                (self.status, [(header::RETRY_AFTER, seconds)], Json(body)).into_response()
            }
            None => (self.status, Json(body)).into_response(),
        };
        if self.status == StatusCode::REQUEST_TIMEOUT || self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is not read: the connection cannot be reused.
            response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound(what) => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("{what} not found"))
            }
            StoreError::Conflict(why) => ApiError::new(StatusCode::CONFLICT, "conflict", why),
            other if other.is_unavailable() => {
                // One line per request would flood the log during an outage;
                // /readyz reports it at warn level.
                tracing::debug!(error = %other, "database unavailable");
                ApiError::database_unavailable()
            }
            other => {
                tracing::error!(error = %other, "storage failure");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error")
            }
        }
    }
}

impl From<CoordinatorError> for ApiError {
    fn from(error: CoordinatorError) -> Self {
        use StatusCode as S;
        match error {
            CoordinatorError::UnknownTask => {
                ApiError::new(S::NOT_FOUND, "task_not_found", "task not found or not running")
            }
            CoordinatorError::Store(e) => e.into(),
            CoordinatorError::Invalid(m) => ApiError::new(S::BAD_REQUEST, "invalid_task", m),
            CoordinatorError::Unavailable => {
                ApiError::new(S::SERVICE_UNAVAILABLE, "unavailable", "shutting down")
            }
            CoordinatorError::Engine(EngineError::NotSelected) => {
                ApiError::new(S::CONFLICT, "not_selected", "this client is not part of the round in progress")
            }
            CoordinatorError::Engine(EngineError::NotInRound(round)) => ApiError::new(
                S::CONFLICT,
                "not_in_round",
                format!("this client is not part of round {round}, or the round is not recent"),
            ),
            CoordinatorError::Engine(EngineError::PlaintextMetricsOff) => ApiError::new(
                S::FORBIDDEN,
                "plaintext_metrics_off",
                "this task takes clients' metrics only in aggregate, inside the masked inputs",
            ),
            CoordinatorError::Engine(EngineError::Inactive(status)) => {
                ApiError::new(S::CONFLICT, "task_inactive", format!("the task is {}", status.as_str()))
            }
            CoordinatorError::Engine(EngineError::Protocol(p)) => {
                let (status, code) = match &p {
                    ProtocolError::Decode(_) => (S::BAD_REQUEST, "malformed_message"),
                    ProtocolError::WrongRound => (S::CONFLICT, "wrong_round"),
                    ProtocolError::OutOfPhase { .. } => (S::CONFLICT, "out_of_phase"),
                    ProtocolError::Duplicate(_) => (S::CONFLICT, "duplicate"),
                    ProtocolError::NotEligible { .. } => (S::CONFLICT, "not_eligible"),
                    ProtocolError::Crypto(_) => (S::UNPROCESSABLE_ENTITY, "crypto_failure"),
                    _ => (S::UNPROCESSABLE_ENTITY, "invalid_message"),
                };
                ApiError::new(status, code, p.to_string())
            }
        }
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn bearer(parts: &Parts) -> Option<&str> {
    parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ")
}

/// The caller holds the admin token.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        match bearer(parts) {
            Some(token) if verify_token(token, &state.config.admin_token_hash) => Ok(Admin),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid admin token is required",
            )),
        }
    }
}

/// The caller is an enrolled participant with an unexpired credential.
pub struct Participant(pub ParticipantRecord);

impl FromRequestParts<AppState> for Participant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let unauthorized = || {
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "a valid client credential is required")
        };
        let token = bearer(parts).ok_or_else(unauthorized)?;
        let participant = match state.store.participant_by_credential(&token_hash(token)).await {
            Ok(p) => p,
            Err(StoreError::NotFound(_)) => return Err(unauthorized()),
            Err(e) => return Err(e.into()),
        };
        if participant.expires_at <= now_ms() {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "credential_expired",
                "the client credential has expired",
            ));
        }
        Ok(Participant(participant))
    }
}

/// A request body, with its rejections (too large, too slow, unreadable)
/// turned into the API's JSON errors.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(request, state).await.map(RawBody).map_err(|rejection| {
            let status = rejection.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                return ApiError::new(status, "payload_too_large", rejection.body_text());
            }
            too_slow(&rejection)
                .unwrap_or_else(|| ApiError::new(status, "invalid_body", rejection.body_text()))
        })
    }
}

/// The `408` for a body that failed because it arrived too slowly.
fn too_slow(error: &(dyn std::error::Error + 'static)) -> Option<ApiError> {
    find_source::<SlowBody>(error)
        .map(|slow| ApiError::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", slow.to_string()))
}

/// The first error of type `E` in `error`'s chain of sources.
fn find_source<'a, E: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a E> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(found) = error.downcast_ref::<E>() {
            return Some(found);
        }
        next = error.source();
    }
    None
}

/// Reads at most `limit` bytes of `body`: a declared length over the limit
/// is refused before anything is read, a longer body as soon as it passes
/// the limit.
async fn read_limited(headers: &HeaderMap, body: Body, limit: usize) -> ApiResult<Bytes> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("this message may be at most {limit} bytes"),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, limit).await.map_err(|error| {
        if find_source::<http_body_util::LengthLimitError>(&error).is_some() {
            return too_large();
        }
        too_slow(&error).unwrap_or_else(|| {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", "the request body could not be read")
        })
    })
}

/// A task id from the path: 32 lowercase hex digits, as [`new_id`] makes
/// them. Anything else is an unknown task, answered without a database
/// query (so bytes no database column takes, such as NUL, never reach one).
pub struct TaskId(pub String);

/// Whether `id` has the form of the ids [`new_id`] makes.
pub fn is_valid_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl<S: Send + Sync> FromRequestParts<S> for TaskId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", "task not found");
        let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|_| not_found())?;
        match params.get("id") {
            Some(id) if is_valid_id(id) => Ok(TaskId(id.clone())),
            _ => Err(not_found()),
        }
    }
}

/// The network address of the caller, where the listener recorded it.
pub struct PeerAddress(pub Option<IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for PeerAddress {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(PeerAddress(parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|info| info.0.ip())))
    }
}

fn limit(state: &AppState, call: Call, address: Option<IpAddr>, participant: Option<&str>) -> ApiResult<()> {
    state.config.limiters.check(call, address, participant).map_err(ApiError::rate_limited)
}

/// Builds the router.
pub fn app(state: AppState) -> Router {
    let admin = Router::new()
        .route("/admin/tasks", post(create_task).get(list_tasks))
        .route("/admin/tasks/{id}", get(get_task))
        .route("/admin/tasks/{id}/pause", post(pause_task))
        .route("/admin/tasks/{id}/resume", post(resume_task))
        .route("/admin/tasks/{id}/stop", post(stop_task))
        .route("/admin/tasks/{id}/rounds", get(list_rounds))
        .route("/admin/tasks/{id}/checkpoints/{round}", get(get_checkpoint))
        .route("/admin/tasks/{id}/tokens", post(create_token).get(list_tokens))
        .route("/admin/tasks/{id}/tokens/{token}/revoke", post(revoke_token))
        .layer(DefaultBodyLimit::max(JSON_LIMIT));
    // The client API's JSON bodies are small; enrollment's is read before
    // its token is checked, so it gets the small limit too.
    let client_json = Router::new()
        .route("/v1/tasks/{id}/enroll", post(enroll))
        .route("/v1/checkin", post(check_in))
        .route("/v1/model", get(model))
        .route("/v1/metrics", post(report_metrics))
        .layer(DefaultBodyLimit::max(CLIENT_JSON_LIMIT));
    // Stage messages are read by the handler itself, after the admission
    // check, within the round's own limit.
    let messages = Router::new().route("/v1/round/message", get(fetch_message).post(post_message));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(prometheus))
        .route("/openapi.json", get(|| async { Json(crate::openapi::document()) }))
        .merge(admin)
        .merge(client_json)
        .merge(messages)
        .merge(crate::web::routes())
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
        .with_state(state)
}

/// Readiness: the database answers.
async fn ready(State(state): State<AppState>) -> Response {
    match tokio::time::timeout(READY_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => Json(json!({ "status": "ready", "database": "ok" })).into_response(),
        Ok(Err(error)) => {
            tracing::warn!(%error, "not ready: the database failed");
            not_ready()
        }
        Err(_) => {
            tracing::warn!(
                timeout_ms = READY_TIMEOUT.as_millis() as u64,
                "not ready: the database did not answer"
            );
            not_ready()
        }
    }
}

/// A `503` in the API's error form, with the readiness fields.
fn not_ready() -> Response {
    let body = json!({
        "status": "unavailable",
        "database": "unreachable",
        "error": "unavailable",
        "message": "the database is unavailable; retry later",
        "retry_after_ms": DATABASE_RETRY.as_millis() as u64,
    });
    let retry_after = DATABASE_RETRY.as_secs().to_string();
    (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, retry_after)], Json(body)).into_response()
}

async fn prometheus(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}

/// Reply to task creation. The enrollment token is shown only here.
#[derive(Debug, Serialize, Deserialize)]
pub struct CreatedTask {
    /// Task id.
    pub id: String,
    /// Token clients present to enroll: the task's first, named `default`,
    /// whose id is the task's (more with `POST /admin/tasks/{id}/tokens`).
    pub enrollment_token: String,
    /// Neighbours per client.
    pub degree: u32,
    /// Secure-aggregation threshold.
    pub threshold: u32,
}

async fn create_task(
    _: Admin,
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<CreatedTask>)> {
    let mut spec: TaskSpec = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    spec.secure_aggregation.default_for_new_task();
    spec.validate().map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_task", e.to_string()))?;
    let _creating = state.creating.lock().await;
    let requested = spec.model.layout.len();
    let loaded = state.coordinator.loaded_parameters().await?;
    if loaded.saturating_add(requested) > state.config.max_total_parameters {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "capacity_exceeded",
            format!(
                "the model has {requested} parameters and unfinished tasks already hold {loaded} of the \
                 server's {}; stop a task or raise max_total_parameters",
                state.config.max_total_parameters
            ),
        ));
    }
    let created = create(&state.store, &state.coordinator, spec).await?;
    Ok((StatusCode::CREATED, Json(created)))
}

/// Validates `spec`, stores the task with its initial checkpoint and
/// starts running it.
pub async fn create(
    store: &SqlStore,
    coordinator: &Coordinator,
    mut spec: TaskSpec,
) -> ApiResult<CreatedTask> {
    spec.secure_aggregation.default_for_new_task();
    let derived =
        spec.validate().map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_task", e.to_string()))?;
    let now = now_ms();
    let id = new_id();
    let enrollment_token = new_token();
    let initial = TaskEngine::initial_checkpoint(&id, &spec, now)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_task", e))?;
    let spec_json = serde_json::to_string(&spec)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_task", e.to_string()))?;
    let record = TaskRecord {
        id: id.clone(),
        name: spec.name.clone(),
        spec: spec_json,
        status: TaskStatus::Active,
        enrollment_token_hash: token_hash(&enrollment_token),
        created_at: now,
        updated_at: now,
    };
    store.create_task(&record, &initial).await?;
    coordinator.load(&id).await?;
    tracing::info!(task = %id, name = %spec.name, "task created");
    Ok(CreatedTask { id, enrollment_token, degree: derived.degree, threshold: derived.threshold })
}

/// A request for an enrollment token.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewToken {
    /// The application it is for; unique within the task.
    name: String,
    /// Its own enrollment rate (default: the server's `enroll_per_token`).
    #[serde(default)]
    rate: Option<Rate>,
}

/// An enrollment token as the admin API shows it; the token itself only
/// in the answer that created it.
#[derive(Debug, Serialize, Deserialize)]
pub struct TokenView {
    /// Identifier (the first token's is the task's id).
    pub id: String,
    /// The application it is for.
    pub name: String,
    /// The token: shown once, at creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Its own enrollment rate; `null`: the server's `enroll_per_token`.
    pub rate: Option<Rate>,
    /// Creation (Unix ms).
    pub created_at: i64,
    /// Revocation (Unix ms), if revoked.
    pub revoked_at: Option<i64>,
    /// Participants enrolled with it.
    pub enrolled: i64,
}

impl TokenView {
    fn of(token: EnrollmentTokenRecord, enrolled: i64) -> Self {
        TokenView {
            id: token.id,
            name: token.name,
            token: None,
            rate: token.rate.map(|(per_minute, burst)| Rate { per_minute, burst }),
            created_at: token.created_at,
            revoked_at: token.revoked_at,
            enrolled,
        }
    }
}

/// A new enrollment token for an application of an unfinished task.
async fn create_token(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<TokenView>)> {
    let invalid = |message: &str| ApiError::new(StatusCode::BAD_REQUEST, "invalid_token_request", message);
    let request: NewToken = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    let name = request.name.trim();
    if name.is_empty() || name.len() > crate::spec::MAX_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(invalid("name must be 1 to 200 bytes without control characters"));
    }
    if request.rate.is_some_and(|rate| rate.per_minute == 0 || rate.burst == 0) {
        return Err(invalid(
            "rate.per_minute and rate.burst must be at least 1 (leave rate out for the default)",
        ));
    }
    let task = state.store.task(&id).await?;
    if task.status.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "task_inactive",
            format!("the task is {}", task.status.as_str()),
        ));
    }
    let token = new_token();
    let record = EnrollmentTokenRecord {
        id: new_id(),
        task_id: id,
        name: name.to_string(),
        token_hash: token_hash(&token),
        rate: request.rate.map(|rate| (rate.per_minute, rate.burst)),
        created_at: now_ms(),
        revoked_at: None,
    };
    state.store.add_enrollment_token(&record).await?;
    tracing::info!(task = %record.task_id, token = %record.id, name = %record.name, "enrollment token created");
    let view = TokenView { token: Some(token), ..TokenView::of(record, 0) };
    Ok((StatusCode::CREATED, Json(view)))
}

/// A task's enrollment tokens (never the tokens themselves).
async fn list_tokens(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<Vec<TokenView>>> {
    state.store.task(&id).await?;
    let tokens = state.store.enrollment_tokens(&id).await?;
    Ok(Json(tokens.into_iter().map(|(token, enrolled)| TokenView::of(token, enrolled)).collect()))
}

/// Revokes a token: it enrolls nobody more, and the credentials it issued
/// end now.
async fn revoke_token(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    Path(params): Path<HashMap<String, String>>,
) -> ApiResult<Json<TokenView>> {
    let token_id = params
        .get("token")
        .filter(|t| is_valid_id(t))
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", "enrollment token not found"))?;
    let revoked = state.store.revoke_enrollment_token(&id, token_id, now_ms()).await?;
    tracing::info!(task = %id, token = %revoked.id, "enrollment token revoked");
    let enrolled = state
        .store
        .enrollment_tokens(&id)
        .await?
        .into_iter()
        .find(|(token, _)| token.id == revoked.id)
        .map_or(0, |(_, enrolled)| enrolled);
    Ok(Json(TokenView::of(revoked, enrolled)))
}

/// A task as the admin API shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct TaskView {
    /// Id.
    pub id: String,
    /// Name.
    pub name: String,
    /// Status.
    pub status: TaskStatus,
    /// Rounds completed.
    pub completed_rounds: u64,
    /// Rounds to run.
    pub rounds: u32,
    /// Round in progress.
    pub current_round: Option<u64>,
    /// Its stage.
    pub stage: Option<String>,
    /// Its progress: counts per stage, deadlines and traffic.
    pub progress: Option<crate::engine::RoundProgress>,
    /// Clients that checked in recently enough to be selected.
    pub available_clients: usize,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// The specification.
    pub spec: serde_json::Value,
}

async fn view(state: &AppState, task: TaskRecord) -> ApiResult<TaskView> {
    let mut spec: serde_json::Value = serde_json::from_str(&task.spec).unwrap_or(serde_json::Value::Null);
    // A spec stored before the variant was a choice ran semi-honest.
    if let Some(secure_aggregation) = spec.get_mut("secure_aggregation").and_then(|v| v.as_object_mut()) {
        secure_aggregation.entry("variant").or_insert_with(|| VariantChoice::SemiHonest.as_str().into());
    }
    let rounds = spec["rounds"].as_u64().unwrap_or(0) as u32;
    let live = match state.coordinator.live(&task.id).await {
        Ok(live) => live,
        Err(CoordinatorError::UnknownTask) => LiveState {
            status: task.status,
            completed_rounds: state.store.rounds(&task.id).await?.len() as u64,
            current_round: None,
            stage: None,
            progress: None,
            available_clients: 0,
        },
        Err(e) => return Err(e.into()),
    };
    Ok(TaskView {
        id: task.id,
        name: task.name,
        status: live.status,
        completed_rounds: live.completed_rounds,
        rounds,
        current_round: live.current_round,
        stage: live.stage,
        progress: live.progress,
        available_clients: live.available_clients,
        created_at: task.created_at,
        spec,
    })
}

async fn list_tasks(_: Admin, State(state): State<AppState>) -> ApiResult<Json<Vec<TaskView>>> {
    let mut views = Vec::new();
    for task in state.store.tasks().await? {
        views.push(view(&state, task).await?);
    }
    Ok(Json(views))
}

async fn get_task(_: Admin, State(state): State<AppState>, TaskId(id): TaskId) -> ApiResult<Json<TaskView>> {
    let task = state.store.task(&id).await?;
    Ok(Json(view(&state, task).await?))
}

async fn change_status(state: &AppState, id: &str, status: TaskStatus) -> ApiResult<Json<serde_json::Value>> {
    state.store.task(id).await?;
    state.coordinator.set_status(id, status).await?;
    Ok(Json(json!({ "id": id, "status": status })))
}

async fn pause_task(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<serde_json::Value>> {
    change_status(&state, &id, TaskStatus::Paused).await
}

async fn resume_task(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<serde_json::Value>> {
    change_status(&state, &id, TaskStatus::Active).await
}

async fn stop_task(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<serde_json::Value>> {
    change_status(&state, &id, TaskStatus::Stopped).await
}

/// A completed round as the admin API shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct RoundView {
    /// Round number.
    pub round: i64,
    /// Start (Unix ms).
    pub started_at: i64,
    /// End (Unix ms).
    pub finished_at: i64,
    /// Clients selected.
    pub selected: i64,
    /// Clients in the aggregate.
    pub survivors: i64,
    /// Round metrics, with `client_means`: each client metric's mean over
    /// the survivors, from its sum under the masks.
    pub metrics: serde_json::Value,
    /// Only for a task with `client_metrics.plaintext` (semi-honest): what
    /// each client reported in the clear, one entry per client and kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plaintext_client_metrics: Option<Vec<serde_json::Value>>,
}

async fn list_rounds(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<Vec<RoundView>>> {
    let task = state.store.task(&id).await?;
    let plaintext =
        serde_json::from_str::<TaskSpec>(&task.spec).is_ok_and(|spec| spec.client_metrics.plaintext);
    let mut views = Vec::new();
    for RoundRecord { round, started_at, finished_at, selected, survivors, metrics, .. } in
        state.store.rounds(&id).await?
    {
        let plaintext_client_metrics = if plaintext {
            let reports = state.store.client_metrics(&id, round).await?;
            Some(reports
                .into_iter()
                .map(|m| json!({ "kind": m.kind, "metrics": serde_json::from_str::<serde_json::Value>(&m.metrics).unwrap_or_default() }))
                .collect())
        } else {
            None
        };
        views.push(RoundView {
            round,
            started_at,
            finished_at,
            selected,
            survivors,
            metrics: serde_json::from_str(&metrics).unwrap_or_default(),
            plaintext_client_metrics,
        });
    }
    Ok(Json(views))
}

async fn get_checkpoint(
    _: Admin,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    Path(params): Path<HashMap<String, String>>,
) -> ApiResult<Response> {
    let round = params.get("round").map(String::as_str).unwrap_or_default();
    let record = if round == "latest" {
        state.store.latest_checkpoint(&id).await?
    } else {
        let number: i64 = round.parse().map_err(|_| {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_round", "round must be a number or \"latest\"")
        })?;
        state.store.checkpoint(&id, number).await?
    };
    let disposition = format!("attachment; filename=\"{id}-round-{}.safetensors\"", record.round);
    Ok((
        [
            (header::CONTENT_TYPE, SAFETENSORS_CONTENT_TYPE.to_string()),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        record.model,
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnrollRequest {
    enrollment_token: String,
    /// The participant's Ed25519 identity public key (64 hex digits).
    #[serde(default)]
    identity_key: Option<String>,
    /// Its signature over [`enrollment_statement`] (128 hex digits): proof
    /// that the participant holds the key.
    #[serde(default)]
    identity_proof: Option<String>,
}

/// The identity key of an enrollment, checked against its proof.
fn identity_key(task: &str, request: &EnrollRequest) -> ApiResult<Option<[u8; 32]>> {
    let invalid = |message: &str| ApiError::new(StatusCode::BAD_REQUEST, "invalid_identity", message);
    let (key, proof) = match (&request.identity_key, &request.identity_proof) {
        (None, None) => return Ok(None),
        (Some(key), Some(proof)) => (key, proof),
        _ => return Err(invalid("identity_key and identity_proof come together")),
    };
    let mut public = [0u8; 32];
    hex::decode_to_slice(key, &mut public).map_err(|_| invalid("identity_key must be 64 hex digits"))?;
    let mut signature = [0u8; SIGNATURE_LEN];
    hex::decode_to_slice(proof, &mut signature)
        .map_err(|_| invalid("identity_proof must be 128 hex digits"))?;
    verify(&public, &enrollment_statement(task, &public), &signature)
        .map_err(|_| invalid("identity_proof is not a signature of the enrollment by identity_key"))?;
    Ok(Some(public))
}

/// Reply to enrollment. The credential is shown only here.
#[derive(Debug, Serialize, Deserialize)]
pub struct Enrolled {
    /// Participant id.
    pub participant_id: String,
    /// Bearer credential for the client API.
    pub credential: String,
    /// Expiry (Unix ms).
    pub expires_at: i64,
    /// The task's security parameters, which every round repeats: the
    /// participant checks them against its policy and pins them.
    pub security: TaskSecurity,
}

async fn enroll(
    State(state): State<AppState>,
    PeerAddress(address): PeerAddress,
    TaskId(id): TaskId,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Enrolled>)> {
    limit(&state, Call::Enroll, address, None)?;
    let request: EnrollRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    let task = state.store.task(&id).await?;
    // Looked up by the SHA-256 of a 256-bit random token: the hash, not the
    // token, meets the index.
    let invalid = || ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "invalid enrollment token");
    let token = match state.store.enrollment_token_by_hash(&token_hash(&request.enrollment_token)).await {
        Ok(token) if token.task_id == id => token,
        Ok(_) | Err(StoreError::NotFound(_)) => return Err(invalid()),
        Err(error) => return Err(error.into()),
    };
    if token.revoked_at.is_some() {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "token_revoked",
            "this enrollment token was revoked",
        ));
    }
    let rate = token.rate.map(|(per_minute, burst)| Rate { per_minute, burst });
    state.config.limiters.check_token(&token.id, rate).map_err(ApiError::rate_limited)?;
    if task.status.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "task_inactive",
            format!("the task is {}", task.status.as_str()),
        ));
    }
    let identity_key = identity_key(&id, &request)?;
    // Derived when the task was loaded; an unfinished task is loaded.
    let security = state.coordinator.security(&id).await?;
    if security.variant == cohort_crypto::Variant::Active && identity_key.is_none() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "identity_required",
            "this task runs the active variant: enroll with an identity_key and its identity_proof",
        ));
    }
    let now = now_ms();
    let credential = new_token();
    let participant = ParticipantRecord {
        id: new_id(),
        task_id: id,
        credential_hash: token_hash(&credential),
        enrolled_at: now,
        last_seen_at: now,
        expires_at: now + state.config.credential_ttl_ms,
        identity_key,
        token_id: Some(token.id),
    };
    state.store.add_participant(&participant).await?;
    let enrolled =
        Enrolled { participant_id: participant.id, credential, expires_at: participant.expires_at, security };
    Ok((StatusCode::CREATED, Json(enrolled)))
}

async fn check_in(
    PeerAddress(address): PeerAddress,
    Participant(p): Participant,
    State(state): State<AppState>,
) -> ApiResult<Json<CheckIn>> {
    limit(&state, Call::CheckIn, address, Some(&p.id))?;
    state.store.touch_participant(&p.id, now_ms()).await?;
    match state.coordinator.check_in(&p.task_id, &p.id, p.identity_key).await {
        Ok(check_in) => Ok(Json(check_in)),
        // A stopped or completed task is no longer loaded: its clients are
        // told it is over, so that they exit cleanly.
        Err(CoordinatorError::UnknownTask) if state.store.task(&p.task_id).await?.status.is_final() => {
            Ok(Json(CheckIn::Finished))
        }
        Err(error) => Err(error.into()),
    }
}

async fn model(Participant(p): Participant, State(state): State<AppState>) -> ApiResult<Response> {
    let (round, bytes) = state.coordinator.model(&p.task_id).await?;
    Ok((
        [
            (header::CONTENT_TYPE, SAFETENSORS_CONTENT_TYPE.to_string()),
            (
                "x-cohort-round"
                    .parse()
                    .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "header"))?,
                round.to_string(),
            ),
        ],
        bytes,
    )
        .into_response())
}

async fn fetch_message(Participant(p): Participant, State(state): State<AppState>) -> ApiResult<Response> {
    Ok(match state.coordinator.poll(&p.task_id, &p.id).await? {
        Poll::Message(bytes) => ([(header::CONTENT_TYPE, SECAGG_CONTENT_TYPE)], bytes).into_response(),
        Poll::Wait => StatusCode::NO_CONTENT.into_response(),
        Poll::Dropped => {
            ApiError::new(StatusCode::GONE, "dropped", "this client is no longer part of the round")
                .into_response()
        }
    })
}

/// A stage message. Everything that can refuse it without its body is
/// checked first (credential, media type, the sender's place in the stage
/// in progress, the declared length against the round's limit); only then
/// is the body read, and no further than that limit.
async fn post_message(
    Participant(p): Participant,
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type != SECAGG_CONTENT_TYPE {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("stage messages must be sent as {SECAGG_CONTENT_TYPE}"),
        ));
    }
    let allowed = state.coordinator.admit(&p.task_id, &p.id).await?;
    let body = read_limited(&headers, body, allowed.min(state.config.max_message_bytes)).await?;
    state.coordinator.receive(&p.task_id, &p.id, body.to_vec()).await?;
    Ok(StatusCode::ACCEPTED)
}

/// What a client reports for a round: a fixed set of numbers, each
/// optional and each within its range.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientMetrics {
    /// Mean training loss over the local epochs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_loss: Option<f64>,
    /// Training accuracy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_accuracy: Option<f64>,
    /// Loss of the global model on local data, before training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_loss: Option<f64>,
    /// Accuracy of the global model on local data, before training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_accuracy: Option<f64>,
    /// Loss on local held-out data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Accuracy on local held-out data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Local examples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<u32>,
    /// Bytes the client sent in the round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_up: Option<u64>,
    /// Bytes the client received in the round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_down: Option<u64>,
}

/// Largest loss accepted in a report.
const MAX_LOSS: f64 = 1e9;
/// Largest byte count accepted in a report (1 TiB).
const MAX_REPORTED_BYTES: u64 = 1 << 40;

impl ClientMetrics {
    /// Checks every value against its range.
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("train_loss", self.train_loss),
            ("global_loss", self.global_loss),
            ("eval_loss", self.eval_loss),
        ] {
            if value.is_some_and(|v| !(0.0..=MAX_LOSS).contains(&v)) {
                return Err(format!("{name} must be between 0 and {MAX_LOSS}"));
            }
        }
        for (name, value) in [
            ("train_accuracy", self.train_accuracy),
            ("global_accuracy", self.global_accuracy),
            ("eval_accuracy", self.eval_accuracy),
        ] {
            if value.is_some_and(|v| !(0.0..=1.0).contains(&v)) {
                return Err(format!("{name} must be between 0 and 1"));
            }
        }
        for (name, value) in [("bytes_up", self.bytes_up), ("bytes_down", self.bytes_down)] {
            if value.is_some_and(|v| v > MAX_REPORTED_BYTES) {
                return Err(format!("{name} must be at most {MAX_REPORTED_BYTES}"));
            }
        }
        Ok(())
    }
}

/// The kind of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ReportKind {
    Train,
    Eval,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsReport {
    round: u64,
    kind: ReportKind,
    metrics: ClientMetrics,
}

/// A client's metrics for a round it took part in (the round in progress
/// or one of the last completed ones), once per round and kind.
async fn report_metrics(
    PeerAddress(address): PeerAddress,
    Participant(p): Participant,
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> ApiResult<StatusCode> {
    limit(&state, Call::Report, address, Some(&p.id))?;
    let report: MetricsReport = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    if report.round < 1 || report.round > i64::MAX as u64 {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_round",
            "round must be between 1 and 2^63 - 1",
        ));
    }
    report.metrics.validate().map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, "invalid_metrics", m))?;
    state.coordinator.may_report(&p.task_id, &p.id, report.round).await?;
    let metrics = serde_json::to_string(&report.metrics)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    let kind = match report.kind {
        ReportKind::Train => "train",
        ReportKind::Eval => "eval",
    };
    state
        .store
        .add_client_metrics(&ClientMetricsRecord {
            task_id: p.task_id,
            round: report.round as i64,
            participant_id: p.id,
            kind: kind.into(),
            metrics,
            reported_at: now_ms(),
        })
        .await?;
    Ok(StatusCode::CREATED)
}
