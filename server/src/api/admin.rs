//! The admin API: tasks (create, list, inspect, pause, resume, stop), their
//! enrollment tokens, rounds and checkpoints.

use std::collections::HashMap;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cohort_client::api::{ErrorBody, ErrorCode};
use serde::{Deserialize, Serialize};

use super::SAFETENSORS_CONTENT_TYPE;
use super::auth::{new_id, new_token, token_hash};
use super::client::ClientMetrics;
use super::error::{ApiError, ApiResult};
use super::extract::{RawBody, TaskId, decimal, is_valid_id, json_body};
use super::openapi::{Binary, Refused, RetryLater, TaskPath};
use super::projects::{Audit, Caller, DEFAULT_PROJECT, GivenName, Quotas, logged};
use super::ratelimit::Rate;
use super::state::AppState;
use crate::cluster::Whereabouts;
use crate::coordinator::{Coordinator, CoordinatorError, LiveState, now_ms};
use crate::privacy::PrivacyView;
use crate::round::{FailedAttempt, RoundMetrics, TaskEngine, TaskError};
use crate::spec::{TaskPlan, TaskSpec};
use crate::store::{
    ATTEMPTS_KEPT, ClientMetricsRecord, EnrollmentTokenRecord, Role, RoundRecord, SqlStore, StoreError,
    TaskRecord, TaskStatus,
};

/// Reply to task creation. The enrollment token is shown only here.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
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

/// Creates a task from a [`TaskSpec`].
#[utoipa::path(
    post, path = "/admin/tasks", tag = "admin", operation_id = "createTask",
    security(("admin" = [])),
    request_body(content = TaskSpec, description = "The task. Fields are checked one by one as the schema says, and \
        together: e.g. a threshold at most the degree, a model no larger than secure aggregation carries, a \
        sparse degree that is even; a spec that breaks such a rule is refused with `400 invalid_task` and a \
        message naming the field.",
        example = json!({
            "name": "digits",
            "rounds": 20,
            "clients_per_round": 10,
            "model": {
                "architecture": "logistic",
                "layout": { "tensors": [ { "name": "weight", "shape": [10, 784] }, { "name": "bias", "shape": [10] } ] },
                "init": { "kind": "fan_in", "seed": 7 }
            },
            "quantization": { "bits": 8, "rotate": true }
        })),
    responses(
        (status = 201, description = "Created: its id and its first enrollment token", body = CreatedTask,
            links(
                ("getTask" = (operation_id = "getTask", parameters(("id" = "$response.body#/id")))),
                ("pauseTask" = (operation_id = "pauseTask", parameters(("id" = "$response.body#/id")))),
                ("resumeTask" = (operation_id = "resumeTask", parameters(("id" = "$response.body#/id")))),
                ("stopTask" = (operation_id = "stopTask", parameters(("id" = "$response.body#/id")))),
                ("listRounds" = (operation_id = "listRounds", parameters(("id" = "$response.body#/id")))),
                ("listAttempts" = (operation_id = "listAttempts", parameters(("id" = "$response.body#/id")))),
                ("getCheckpoint" = (operation_id = "getCheckpoint", parameters(("id" = "$response.body#/id"), ("round" = "latest")))),
                ("createToken" = (operation_id = "createToken", parameters(("id" = "$response.body#/id")))),
                ("listTokens" = (operation_id = "listTokens", parameters(("id" = "$response.body#/id")))),
                ("revokeDefaultToken" = (operation_id = "revokeToken", parameters(("id" = "$response.body#/id"), ("token" = "$response.body#/id")))),
                ("enroll" = (operation_id = "enroll", parameters(("id" = "$response.body#/id"))))
            )),
        (status = 400, response = Refused), (status = 401, response = Refused),
        (status = 403, response = Refused), (status = 404, response = Refused),
        (status = 408, response = Refused), (status = 413, response = Refused),
        (status = 422, description = "The coordinator holds as many parameters as it may (capacity_exceeded), or the \
            project as many unfinished tasks or parameters as its quotas allow (quota_exceeded)", body = ErrorBody),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn create_task(
    caller: Caller,
    State(state): State<AppState>,
    query: Result<axum::extract::Query<CreateQuery>, axum::extract::rejection::QueryRejection>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<CreatedTask>)> {
    let mut audit = Audit::new(&caller, "task.create", "tasks");
    let result = async {
        let query = query.map_err(|_| {
            ApiError::new(ErrorCode::InvalidQuery, "the only query parameter is project, a project's id")
        })?;
        let project = match (caller.project(), query.0.project) {
            (Some(own), None) => own.to_string(),
            (None, requested) => requested.unwrap_or_else(|| DEFAULT_PROJECT.to_string()),
            (Some(_), Some(requested)) => requested,
        };
        let project = caller.project_record(&state, &project).await?;
        audit.in_project(&project.id);
        caller.require(Role::Operator)?;
        let spec: TaskSpec = json_body(&body)?;
        let plan =
            TaskPlan::for_new_task(spec).map_err(|e| ApiError::new(ErrorCode::InvalidTask, e.to_string()))?;
        let _creating = state.creating.lock().await;
        let requested = plan.spec().model.layout.len();
        // Counted from the store: the tasks of every replica sharing it.
        let (mut loaded, mut ours, mut ours_unfinished) = (0usize, 0usize, 0u32);
        for task in state.store.tasks().await?.iter().filter(|task| !task.status.is_final()) {
            let parameters = task.spec()?.model.layout.len();
            loaded = loaded.saturating_add(parameters);
            if task.project_id == project.id {
                ours = ours.saturating_add(parameters);
                ours_unfinished += 1;
            }
        }
        let quotas = Quotas::of(&project)?;
        if let Some(most) = quotas.unfinished_tasks
            && ours_unfinished >= most
        {
            return Err(ApiError::new(
                ErrorCode::QuotaExceeded,
                format!(
                    "quota unfinished_tasks: the project has {ours_unfinished} unfinished tasks of the {most} \
                     its limits allow; stop one first"
                ),
            ));
        }
        if let Some(most) = quotas.parameters
            && (ours.saturating_add(requested) as u64) > most
        {
            return Err(ApiError::new(
                ErrorCode::QuotaExceeded,
                format!(
                    "quota parameters: the model has {requested} parameters and the project's unfinished \
                     tasks already hold {ours} of the {most} its limits allow"
                ),
            ));
        }
        if loaded.saturating_add(requested) > state.config.max_total_parameters {
            // What the other projects hold is theirs: a key is told only
            // that the server is full.
            let message = match caller.project() {
                None => format!(
                    "the model has {requested} parameters and unfinished tasks already hold {loaded} of the \
                     server's {}; stop a task or raise max_total_parameters",
                    state.config.max_total_parameters
                ),
                Some(_) => format!(
                    "the model has {requested} parameters, more than the server has room for now; stop one \
                     of the project's tasks or ask the operators"
                ),
            };
            return Err(ApiError::new(ErrorCode::CapacityExceeded, message));
        }
        let created = create(&state.store, &state.coordinator, plan, &project.id, Some(&mut audit)).await?;
        Ok((StatusCode::CREATED, Json(created)))
    }
    .await;
    audit.finish(&state, result).await
}

/// Query of task creation.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct CreateQuery {
    /// The project the task belongs to: the admin token's choice (default
    /// `default`); a key's is its own project.
    #[param(pattern = "^(default|[0-9a-f]{32})$")]
    project: Option<String>,
}

/// Stores the task `plan` makes, in `project`, with its initial checkpoint
/// and starts running it; `audit`, the admin action's entry, is written
/// with it.
pub async fn create(
    store: &SqlStore,
    coordinator: &Coordinator,
    plan: TaskPlan,
    project: &str,
    mut audit: Option<&mut Audit>,
) -> ApiResult<CreatedTask> {
    let spec = plan.spec();
    let derived = plan.derived();
    let now = now_ms();
    let id = new_id();
    let enrollment_token = new_token();
    let invalid = |e: TaskError| ApiError::new(ErrorCode::InvalidTask, e.to_string());
    let initial = TaskEngine::initial_checkpoint(&id, spec, now).map_err(invalid)?;
    // A spec that parsed serializes; a failure is the coordinator's.
    let spec_json = serde_json::to_string(spec).map_err(TaskError::from)?;
    // All or nothing: the task must load from what would be stored (its
    // spec read back as written, its initial checkpoint) before anything
    // is stored.
    if serde_json::from_str::<TaskSpec>(&spec_json).ok().as_ref() != Some(spec) {
        return Err(ApiError::new(ErrorCode::InvalidTask, "the spec does not read back as it was written"));
    }
    TaskEngine::new(id.clone(), plan.clone(), TaskStatus::Active, &initial, []).map_err(invalid)?;
    let record = TaskRecord {
        id: id.clone(),
        name: spec.name.clone(),
        spec: spec_json,
        status: TaskStatus::Active,
        enrollment_token_hash: token_hash(&enrollment_token),
        created_at: now,
        updated_at: now,
        project_id: project.to_string(),
    };
    if let Some(audit) = audit.as_deref_mut() {
        audit.on(format!("tasks/{id}"));
    }
    let entry = audit.as_deref().map(|audit| audit.success(StatusCode::CREATED));
    store.create_task(&record, &initial, entry.as_ref()).await?;
    if let Some(audit) = audit.as_deref_mut() {
        audit.succeeded();
    }
    if let Err(error) = coordinator.load(&id).await {
        // Not left behind half made: a task nobody can run is deleted, and
        // the log says so.
        let error = ApiError::from(error);
        let entry = audit.as_deref().map(|audit| audit.failure(&error));
        if let Err(cleanup) = store.delete_task(&id, entry.as_ref()).await {
            tracing::error!(task = %id, %cleanup, "could not delete a task that failed to load");
        }
        return Err(error);
    }
    tracing::info!(task = %id, name = %spec.name, project, "task created");
    Ok(CreatedTask { id, enrollment_token, degree: derived.degree, threshold: derived.threshold })
}

/// A request for an enrollment token.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewToken {
    /// The application it is for; unique within the task.
    name: GivenName,
    /// Its own enrollment rate (default: the server's `enroll_per_token`).
    #[serde(default)]
    rate: Option<Rate>,
}

/// An enrollment token as the admin API shows it; the token itself only
/// in the answer that created it.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
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
#[utoipa::path(
    post, path = "/admin/tasks/{id}/tokens", tag = "admin", operation_id = "createToken",
    security(("admin" = [])), params(TaskPath),
    request_body(content = NewToken),
    responses(
        (status = 201, description = "Created; the token is shown only here", body = TokenView,
            links(("revokeToken" = (operation_id = "revokeToken", parameters(("id" = "$request.path.id"), ("token" = "$response.body#/id")))))),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 403, response = Refused),
        (status = 404, response = Refused), (status = 408, response = Refused),
        (status = 409, description = "The task is over, or the name is taken", body = ErrorBody),
        (status = 413, response = Refused), (status = 429, response = RetryLater),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn create_token(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<TokenView>)> {
    let mut audit = Audit::new(&caller, "token.create", format!("tasks/{id}/tokens"));
    let result = async {
        let task = caller.task(&state, &id).await?;
        audit.in_project(&task.project_id);
        caller.require(Role::Operator)?;
        new_token_for(&state, task, &body, &mut audit).await
    }
    .await;
    audit.finish(&state, result).await
}

async fn new_token_for(
    state: &AppState,
    task: TaskRecord,
    body: &[u8],
    audit: &mut Audit,
) -> ApiResult<(StatusCode, Json<TokenView>)> {
    let invalid = |message: &str| ApiError::new(ErrorCode::InvalidTokenRequest, message);
    let request: NewToken = json_body(body)?;
    let name = request.name.checked(ErrorCode::InvalidTokenRequest)?;
    if request.rate.is_some_and(|rate| rate.per_minute == 0 || rate.burst == 0) {
        return Err(invalid(
            "rate.per_minute and rate.burst must be at least 1 (leave rate out for the default)",
        ));
    }
    if task.status.is_final() {
        return Err(ApiError::new(ErrorCode::TaskInactive, format!("the task is {}", task.status.as_str())));
    }
    let token = new_token();
    let record = EnrollmentTokenRecord {
        id: new_id(),
        task_id: task.id,
        name,
        token_hash: token_hash(&token),
        rate: request.rate.map(|rate| (rate.per_minute, rate.burst)),
        created_at: now_ms(),
        revoked_at: None,
    };
    audit.on(format!("tasks/{}/tokens/{}", record.task_id, record.id));
    state.store.add_enrollment_token(&record, Some(&audit.success(StatusCode::CREATED))).await?;
    audit.succeeded();
    tracing::info!(task = %record.task_id, token = %record.id, name = %record.name, "enrollment token created");
    let view = TokenView { token: Some(token), ..TokenView::of(record, 0) };
    Ok((StatusCode::CREATED, Json(view)))
}

/// A task's enrollment tokens (never the tokens themselves).
#[utoipa::path(
    get, path = "/admin/tasks/{id}/tokens", tag = "admin", operation_id = "listTokens",
    security(("admin" = [])), params(TaskPath),
    responses(
        (status = 200, description = "The tokens, with how many enrolled with each", body = [TokenView]),
        (status = 401, response = Refused), (status = 404, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_tokens(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<Vec<TokenView>>> {
    caller.task(&state, &id).await?;
    Ok(Json(token_views(&state, &id).await?))
}

/// The task's enrollment tokens: names, rates, enrollments, revocation.
pub(super) async fn token_views(state: &AppState, id: &str) -> ApiResult<Vec<TokenView>> {
    let tokens = state.store.enrollment_tokens(id).await?;
    Ok(tokens.into_iter().map(|(token, enrolled)| TokenView::of(token, enrolled)).collect())
}

/// Revokes a token: it enrolls nobody more, and the credentials it issued
/// end now.
#[utoipa::path(
    post, path = "/admin/tasks/{id}/tokens/{token}/revoke", tag = "admin", operation_id = "revokeToken",
    security(("admin" = [])),
    params(TaskPath,
        ("token" = String, Path, description = "The token's id (the first token's is the task's)", pattern = "^[0-9a-f]{32}$")),
    responses(
        (status = 200, description = "Revoked", body = TokenView),
        (status = 401, response = Refused), (status = 403, response = Refused), (status = 404, response = Refused),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn revoke_token(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    Path(params): Path<HashMap<String, String>>,
) -> ApiResult<Json<TokenView>> {
    let token_id = params.get("token").cloned().unwrap_or_default();
    let resource = format!("tasks/{id}/tokens/{}", logged(&token_id, is_valid_id(&token_id)));
    let mut audit = Audit::new(&caller, "token.revoke", resource);
    let result = async {
        let task = caller.task(&state, &id).await?;
        audit.in_project(&task.project_id);
        caller.require(Role::Operator)?;
        if !is_valid_id(&token_id) {
            return Err(ApiError::new(ErrorCode::NotFound, "enrollment token not found"));
        }
        let entry = audit.success(StatusCode::OK);
        let revoked = state.store.revoke_enrollment_token(&id, &token_id, now_ms(), Some(&entry)).await?;
        audit.succeeded();
        Ok(revoked)
    }
    .await;
    let revoked = audit.finish(&state, result).await?;
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

/// A task as the admin API shows it: what is stored and its live state.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskView {
    pub id: String,
    pub name: String,
    /// Rounds to run.
    pub rounds: u32,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// The specification.
    pub spec: TaskSpec,
    /// The URL of the replica that leads the task's rounds (none when the
    /// task is finished or between leaders).
    #[serde(default)]
    pub leader: Option<String>,
    /// The project it belongs to.
    #[serde(default)]
    pub project: String,
    #[serde(flatten)]
    pub live: LiveState,
}

/// A task as the admin API shows it: from the actor when it is led here,
/// else from the store.
pub(super) async fn view(state: &AppState, task: &TaskRecord) -> ApiResult<TaskView> {
    let spec = task.spec()?;
    let live = match state.coordinator.live(&task.id).await {
        Ok(live) => live,
        Err(CoordinatorError::UnknownTask) => {
            let completed_rounds = state.store.rounds(&task.id).await?.len() as u64;
            let privacy = TaskPlan::new(spec.clone())
                .ok()
                .and_then(|plan| plan.privacy().map(|plan| PrivacyView::of(plan, completed_rounds)));
            LiveState {
                status: task.status,
                completed_rounds,
                current_round: None,
                stage: None,
                progress: None,
                available_clients: 0,
                privacy,
                buffer: None,
                last_failure: None,
                stalled: (!task.status.is_final()).then(|| {
                    state.coordinator.load_failure(&task.id).unwrap_or_else(|| {
                        "no replica leads the task at the moment (its lead is moving, or no replica \
                         could load it)"
                            .into()
                    })
                }),
                suspected: Vec::new(),
                excluded: state.store.exclusions(&task.id).await?,
            }
        }
        Err(e) => return Err(e.into()),
    };
    let leader = match state.coordinator.whereabouts(&task.id) {
        Whereabouts::Here => Some(state.coordinator.replica().url.clone()),
        Whereabouts::At(url) => Some(url),
        Whereabouts::Nowhere => None,
    };
    Ok(TaskView {
        id: task.id.clone(),
        name: task.name.clone(),
        rounds: spec.rounds,
        created_at: task.created_at,
        spec,
        leader,
        project: task.project_id.clone(),
        live,
    })
}

/// Every task the caller sees (a key: its project's); a task another
/// replica leads is shown as that replica sees it (its live round), or
/// from the store if it does not answer.
#[utoipa::path(
    get, path = "/admin/tasks", tag = "admin", operation_id = "listTasks",
    security(("admin" = [])),
    responses(
        (status = 200, description = "Every task, with its live state", body = [TaskView]),
        (status = 401, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_tasks(
    caller: Caller,
    headers: HeaderMap,
    State(state): State<AppState>,
) -> ApiResult<Json<Vec<TaskView>>> {
    Ok(Json(task_views(&state, headers.get(header::AUTHORIZATION), caller.project()).await?))
}

/// The tasks of `project` (`None`: every task); a task another replica
/// leads is asked of it (with the request's `authorization`), or read from
/// the store if it does not answer.
pub(super) async fn task_views(
    state: &AppState,
    authorization: Option<&axum::http::HeaderValue>,
    project: Option<&str>,
) -> ApiResult<Vec<TaskView>> {
    let mut views = Vec::new();
    for task in state.store.tasks().await?.into_iter().filter(|t| project.is_none_or(|p| p == t.project_id)) {
        if let Whereabouts::At(url) = state.coordinator.whereabouts(&task.id) {
            let path = format!("/admin/tasks/{}", task.id);
            if let Some(remote) = state.forwarder.get_json::<TaskView>(&url, &path, authorization).await {
                views.push(remote);
                continue;
            }
        }
        views.push(view(state, &task).await?);
    }
    Ok(views)
}

/// One task with its live state.
#[utoipa::path(
    get, path = "/admin/tasks/{id}", tag = "admin", operation_id = "getTask",
    security(("admin" = [])), params(TaskPath),
    responses(
        (status = 200, description = "The task", body = TaskView),
        (status = 401, response = Refused), (status = 404, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn get_task(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<TaskView>> {
    let task = caller.task(&state, &id).await?;
    Ok(Json(view(&state, &task).await?))
}

/// Deletes a task that is over (stopped, completed or out of budget) with
/// everything stored for it: its participants' credentials stop working,
/// its checkpoints and round records are gone. A task still running must
/// be stopped first; so can one that no replica is able to load.
#[utoipa::path(
    delete, path = "/admin/tasks/{id}", tag = "admin", operation_id = "deleteTask",
    security(("admin" = [])), params(TaskPath),
    responses(
        (status = 204, description = "Deleted"),
        (status = 401, response = Refused), (status = 403, response = Refused), (status = 404, response = Refused),
        (status = 409, description = "The task is not over: stop it first", body = ErrorBody),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn delete_task(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<StatusCode> {
    let mut audit = Audit::new(&caller, "task.delete", format!("tasks/{id}"));
    let result = async {
        let task = caller.task(&state, &id).await?;
        audit.in_project(&task.project_id);
        caller.require(Role::Operator)?;
        if !task.status.is_final() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                "the task is not over: stop it before deleting it",
            ));
        }
        state.store.delete_task(&id, Some(&audit.success(StatusCode::NO_CONTENT))).await?;
        audit.succeeded();
        state.metrics.forget_task(&task.project_id, &id);
        tracing::info!(task = %id, "task deleted");
        Ok(StatusCode::NO_CONTENT)
    }
    .await;
    audit.finish(&state, result).await
}

/// A task's new status.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StatusChanged {
    /// The task's id.
    pub id: String,
    /// Its status now.
    pub status: TaskStatus,
}

/// What pause, resume and stop answer (for the document).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // Only its description is used.
enum StatusChangeResponses {
    /// The task's new status
    #[response(status = 200)]
    Changed(StatusChanged),
    #[response(status = 401)]
    Unauthorized(#[ref_response] Refused),
    #[response(status = 403)]
    Forbidden(#[ref_response] Refused),
    #[response(status = 404)]
    NotFound(#[ref_response] Refused),
    /// The task is over (stopped or completed)
    #[response(status = 409)]
    Over(ErrorBody),
    #[response(status = 503)]
    Unavailable(#[ref_response] RetryLater),
}

async fn change_status(
    caller: &Caller,
    state: &AppState,
    id: &str,
    action: &'static str,
    status: TaskStatus,
) -> ApiResult<Json<StatusChanged>> {
    let mut audit = Audit::new(caller, action, format!("tasks/{id}"));
    let result = async {
        let task = caller.task(state, id).await?;
        audit.in_project(&task.project_id);
        caller.require(Role::Operator)?;
        state.coordinator.set_status(id, status, Some(audit.success(StatusCode::OK))).await?;
        audit.succeeded();
        Ok(Json(StatusChanged { id: id.to_string(), status }))
    }
    .await;
    audit.finish(state, result).await
}

/// Pauses a task: no new round starts; the one in progress runs to its end.
#[utoipa::path(
    post, path = "/admin/tasks/{id}/pause", tag = "admin", operation_id = "pauseTask",
    security(("admin" = [])), params(TaskPath),
    responses(StatusChangeResponses)
)]
pub(super) async fn pause_task(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<StatusChanged>> {
    change_status(&caller, &state, &id, "task.pause", TaskStatus::Paused).await
}

/// Resumes a paused task.
#[utoipa::path(
    post, path = "/admin/tasks/{id}/resume", tag = "admin", operation_id = "resumeTask",
    security(("admin" = [])), params(TaskPath),
    responses(StatusChangeResponses)
)]
pub(super) async fn resume_task(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<StatusChanged>> {
    change_status(&caller, &state, &id, "task.resume", TaskStatus::Active).await
}

/// Stops a task for good.
#[utoipa::path(
    post, path = "/admin/tasks/{id}/stop", tag = "admin", operation_id = "stopTask",
    security(("admin" = [])), params(TaskPath),
    responses(StatusChangeResponses)
)]
pub(super) async fn stop_task(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<StatusChanged>> {
    change_status(&caller, &state, &id, "task.stop", TaskStatus::Stopped).await
}

/// A completed round as the admin API shows it.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
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
    pub metrics: RoundMetrics,
    /// Only for a task with `client_metrics.plaintext` (semi-honest): what
    /// each client reported in the clear, one entry per client and kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plaintext_client_metrics: Option<Vec<PlaintextReport>>,
    /// The earlier attempts of this round that ended without a model, each
    /// with the stage it stopped in and why (a sync task's; the newest 500
    /// of a task are kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_attempts: Vec<FailedAttempt>,
}

/// What one client reported in the clear for a round (a task with
/// `client_metrics.plaintext`).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlaintextReport {
    /// What the numbers are of (`train` or `eval`).
    pub kind: String,
    /// The numbers.
    pub metrics: ClientMetrics,
}

/// The task's completed rounds with their metrics.
#[utoipa::path(
    get, path = "/admin/tasks/{id}/rounds", tag = "admin", operation_id = "listRounds",
    security(("admin" = [])), params(TaskPath),
    responses(
        (status = 200, description = "Completed rounds, oldest first", body = [RoundView]),
        (status = 401, response = Refused), (status = 404, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_rounds(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
) -> ApiResult<Json<Vec<RoundView>>> {
    let task = caller.task(&state, &id).await?;
    Ok(Json(round_views(&state, &task, 0).await?))
}

/// `task`'s completed rounds after round `after`, oldest first.
pub(super) async fn round_views(
    state: &AppState,
    task: &TaskRecord,
    after: i64,
) -> ApiResult<Vec<RoundView>> {
    let id = task.id.as_str();
    let spec = task.spec()?;
    let plaintext = spec.client_metrics.plaintext;
    // An async task's attempts are numbered by group, not by version.
    let mut failed: HashMap<i64, Vec<FailedAttempt>> = HashMap::new();
    if spec.mode == crate::spec::TaskMode::Sync {
        for attempt in state.store.attempts(id, ATTEMPTS_KEPT).await?.into_iter().rev() {
            failed.entry(attempt.round as i64).or_default().push(attempt);
        }
    }
    let mut views = Vec::new();
    for RoundRecord { round, started_at, finished_at, selected, survivors, metrics, .. } in
        state.store.rounds(id).await?.into_iter().filter(|r| r.round > after)
    {
        let plaintext_client_metrics = if plaintext {
            let reports = state.store.client_metrics(id, round).await?;
            let read = |m: ClientMetricsRecord| {
                let metrics =
                    serde_json::from_str(&m.metrics).map_err(|_| StoreError::Corrupt("client metrics"))?;
                Ok::<_, StoreError>(PlaintextReport { kind: m.kind, metrics })
            };
            Some(reports.into_iter().map(read).collect::<Result<_, _>>()?)
        } else {
            None
        };
        views.push(RoundView {
            round,
            started_at,
            finished_at,
            selected,
            survivors,
            metrics: serde_json::from_str(&metrics).map_err(|_| StoreError::Corrupt("round metrics"))?,
            plaintext_client_metrics,
            failed_attempts: failed.remove(&round).unwrap_or_default(),
        });
    }
    Ok(views)
}

/// Query of the attempts list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct AttemptsQuery {
    /// The most attempts to list (default 100).
    #[param(minimum = 1, maximum = 500)]
    limit: Option<i64>,
}

/// The task's attempts that ended without a new model, newest first (at
/// most `limit`, default 100; the newest 500 are kept).
#[utoipa::path(
    get, path = "/admin/tasks/{id}/attempts", tag = "admin", operation_id = "listAttempts",
    security(("admin" = [])), params(TaskPath, AttemptsQuery),
    responses(
        (status = 200, description = "Attempts, newest first, with the stage they stopped in and why", body = [FailedAttempt]),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_attempts(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    query: Result<axum::extract::Query<AttemptsQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<Vec<FailedAttempt>>> {
    let limit = query.ok().map(|q| q.0.limit).ok_or_else(bad_limit)?.unwrap_or(100);
    if !(1..=ATTEMPTS_KEPT).contains(&limit) {
        return Err(bad_limit());
    }
    caller.task(&state, &id).await?;
    Ok(Json(attempt_views(&state, &id, limit).await?))
}

/// The task's newest `limit` attempts that ended without a new model.
pub(super) async fn attempt_views(state: &AppState, id: &str, limit: i64) -> ApiResult<Vec<FailedAttempt>> {
    Ok(state.store.attempts(id, limit).await?)
}

fn bad_limit() -> ApiError {
    ApiError::new(
        ErrorCode::InvalidQuery,
        format!("the only query parameter is limit, between 1 and {ATTEMPTS_KEPT}"),
    )
}

/// A checkpoint: the model after a completed round (0: the initial one).
#[utoipa::path(
    get, path = "/admin/tasks/{id}/checkpoints/{round}", tag = "admin", operation_id = "getCheckpoint",
    security(("admin" = [])),
    params(TaskPath,
        ("round" = String, Path, description = "A round number, or `latest`", pattern = "^(latest|0|[1-9][0-9]{0,17})$")),
    responses(
        (status = 200, description = "The checkpoint (safetensors)", content_type = "application/vnd.safetensors", body = Binary,
            headers(("Content-Disposition" = String, description = "attachment; its file name"))),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn get_checkpoint(
    caller: Caller,
    State(state): State<AppState>,
    TaskId(id): TaskId,
    Path(params): Path<HashMap<String, String>>,
) -> ApiResult<Response> {
    let round = params.get("round").map(String::as_str).unwrap_or_default();
    let well_formed = round == "latest" || decimal(round).is_some();
    let resource = format!("tasks/{id}/checkpoints/{}", logged(round, well_formed));
    let mut audit = Audit::new(&caller, "checkpoint.download", resource);
    let result = async {
        let task = caller.task(&state, &id).await?;
        audit.in_project(&task.project_id);
        let record = if round == "latest" {
            state.store.latest_checkpoint(&id).await?
        } else {
            let number = decimal(round).ok_or_else(|| {
                ApiError::new(ErrorCode::InvalidRound, "round must be a number or \"latest\"")
            })?;
            state.store.checkpoint(&id, number as i64).await?
        };
        audit.on(format!("tasks/{id}/checkpoints/{}", record.round));
        audit.write(&state, StatusCode::OK).await?;
        Ok(record)
    }
    .await;
    let record = audit.finish(&state, result).await?;
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
