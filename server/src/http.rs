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
//! storage failures are a 500 that says nothing about the internals.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cohort_crypto::ProtocolError;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::auth::{new_id, new_token, token_hash, verify_token};
use crate::coordinator::{Coordinator, CoordinatorError, LiveState, now_ms};
use crate::engine::{CheckIn, EngineError, Poll, TaskEngine};
use crate::metrics::Metrics;
use crate::spec::TaskSpec;
use crate::store::{
    ClientMetricsRecord, ParticipantRecord, RoundRecord, SqlStore, Store, StoreError, TaskRecord, TaskStatus,
};

/// Content type of secure-aggregation stage messages.
pub const SECAGG_CONTENT_TYPE: &str = "application/x-cohort-secagg";
/// Content type of checkpoints.
pub const SAFETENSORS_CONTENT_TYPE: &str = "application/vnd.safetensors";
const JSON_LIMIT: usize = 1 << 20;

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
}

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
}

/// A refused request.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into() }
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
        (self.status, Json(json!({ "error": self.code, "message": self.message }))).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound(what) => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("{what} not found"))
            }
            StoreError::Conflict(why) => ApiError::new(StatusCode::CONFLICT, "conflict", why),
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

/// A request body, with its rejections (too large, unreadable) turned
/// into the API's JSON errors.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(request, state).await.map(RawBody).map_err(|rejection| {
            let status = rejection.status();
            let code =
                if status == StatusCode::PAYLOAD_TOO_LARGE { "payload_too_large" } else { "invalid_body" };
            ApiError::new(status, code, rejection.body_text())
        })
    }
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
        .layer(DefaultBodyLimit::max(JSON_LIMIT));
    let client_json = Router::new()
        .route("/v1/tasks/{id}/enroll", post(enroll))
        .route("/v1/checkin", post(check_in))
        .route("/v1/metrics", post(report_metrics))
        .route("/v1/model", get(model))
        .layer(DefaultBodyLimit::max(JSON_LIMIT));
    let messages = Router::new()
        .route("/v1/round/message", get(fetch_message).post(post_message))
        .layer(DefaultBodyLimit::max(state.config.max_message_bytes));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(prometheus))
        .route("/openapi.json", get(|| async { Json(crate::openapi::document()) }))
        .merge(admin)
        .merge(client_json)
        .merge(messages)
        .merge(crate::web::routes())
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
        .with_state(state)
}

async fn prometheus(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}

/// Reply to task creation. The enrollment token is shown only here.
#[derive(Debug, Serialize, Deserialize)]
pub struct CreatedTask {
    /// Task id.
    pub id: String,
    /// Token clients present to enroll.
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
    let spec: TaskSpec = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    let created = create(&state.store, &state.coordinator, spec).await?;
    Ok((StatusCode::CREATED, Json(created)))
}

/// Validates `spec`, stores the task with its initial checkpoint and
/// starts running it.
pub async fn create(store: &SqlStore, coordinator: &Coordinator, spec: TaskSpec) -> ApiResult<CreatedTask> {
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
    let spec: serde_json::Value = serde_json::from_str(&task.spec).unwrap_or(serde_json::Value::Null);
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

async fn get_task(
    _: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<TaskView>> {
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
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    change_status(&state, &id, TaskStatus::Paused).await
}

async fn resume_task(
    _: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    change_status(&state, &id, TaskStatus::Active).await
}

async fn stop_task(
    _: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
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
    /// Round metrics.
    pub metrics: serde_json::Value,
    /// Metrics clients reported for this round.
    pub client_metrics: Vec<serde_json::Value>,
}

async fn list_rounds(
    _: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<RoundView>>> {
    state.store.task(&id).await?;
    let mut views = Vec::new();
    for RoundRecord { round, started_at, finished_at, selected, survivors, metrics, .. } in
        state.store.rounds(&id).await?
    {
        let client_metrics = state
            .store
            .client_metrics(&id, round)
            .await?
            .into_iter()
            .map(|m| json!({ "kind": m.kind, "metrics": serde_json::from_str::<serde_json::Value>(&m.metrics).unwrap_or_default() }))
            .collect();
        views.push(RoundView {
            round,
            started_at,
            finished_at,
            selected,
            survivors,
            metrics: serde_json::from_str(&metrics).unwrap_or_default(),
            client_metrics,
        });
    }
    Ok(Json(views))
}

async fn get_checkpoint(
    _: Admin,
    State(state): State<AppState>,
    Path((id, round)): Path<(String, String)>,
) -> ApiResult<Response> {
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
}

async fn enroll(
    State(state): State<AppState>,
    Path(id): Path<String>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Enrolled>)> {
    let request: EnrollRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    let task = state.store.task(&id).await?;
    if !verify_token(&request.enrollment_token, &task.enrollment_token_hash) {
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "invalid enrollment token"));
    }
    if task.status.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "task_inactive",
            format!("the task is {}", task.status.as_str()),
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
    };
    state.store.add_participant(&participant).await?;
    let enrolled =
        Enrolled { participant_id: participant.id, credential, expires_at: participant.expires_at };
    Ok((StatusCode::CREATED, Json(enrolled)))
}

async fn check_in(Participant(p): Participant, State(state): State<AppState>) -> ApiResult<Json<CheckIn>> {
    state.store.touch_participant(&p.id, now_ms()).await?;
    Ok(Json(state.coordinator.check_in(&p.task_id, &p.id).await?))
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

async fn post_message(
    Participant(p): Participant,
    State(state): State<AppState>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> ApiResult<StatusCode> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type != SECAGG_CONTENT_TYPE {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("stage messages must be sent as {SECAGG_CONTENT_TYPE}"),
        ));
    }
    state.coordinator.receive(&p.task_id, &p.id, body.to_vec()).await?;
    Ok(StatusCode::ACCEPTED)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsReport {
    round: i64,
    kind: String,
    metrics: serde_json::Map<String, serde_json::Value>,
}

async fn report_metrics(
    Participant(p): Participant,
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> ApiResult<StatusCode> {
    let report: MetricsReport = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    if report.kind != "train" && report.kind != "eval" {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_kind",
            "kind must be \"train\" or \"eval\"",
        ));
    }
    if report.round < 1 {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_round", "round must be at least 1"));
    }
    let metrics = serde_json::to_string(&report.metrics)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    state
        .store
        .add_client_metrics(&ClientMetricsRecord {
            task_id: p.task_id,
            round: report.round,
            participant_id: p.id,
            kind: report.kind,
            metrics,
            reported_at: now_ms(),
        })
        .await?;
    Ok(StatusCode::CREATED)
}
