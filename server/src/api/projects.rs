//! Projects, their API keys, quotas and audit log: the tenants of a
//! shared coordinator.
//!
//! * The deployment's **admin token** (`COHORT_ADMIN_TOKEN`) creates
//!   projects, sets their quotas and acts on every project. Tasks created
//!   before projects existed are in the project `default`.
//! * A project's **owners** may hold it to lower limits of their own
//!   within those quotas (a team's budget inside what it pays for); the
//!   lower of the two holds ([`Quotas::of`]).
//! * A project's **keys** (256-bit, shown once, stored as SHA-256 hashes,
//!   revocable, with an optional expiry) carry a [`Role`]: `viewer` reads,
//!   `operator` also runs tasks and their enrollment tokens, `owner` also
//!   manages the project's keys and its own limits and reads its audit
//!   log.
//! * A key sees only its own project: any other project's task, round,
//!   checkpoint, token or event stream answers `404`, as one that does not
//!   exist; within its project a role that may not act gets `403`.
//! * Every admin action that changes something (and every checkpoint
//!   download) is written to the **audit log** with who (key id and role),
//!   what, on which resource, from which address, when and how it ended:
//!   in the same transaction as the change, or on its own when the action
//!   was refused. A request without a valid key or token has no actor and
//!   is not in the log (it changes nothing).

use std::net::IpAddr;

use axum::Json;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use cohort_client::api::{ErrorBody, ErrorCode};
use serde::{Deserialize, Serialize};

use super::auth::{new_id, token_hash, verify_token};
use super::error::{ApiError, ApiResult};
use super::extract::{PeerAddress, RawBody, bearer, is_valid_id, json_body};
use super::openapi::{Refused, RetryLater};
use super::ratelimit::Call;
use super::state::AppState;
use crate::coordinator::now_ms;
use crate::store::{AUDIT_PAGE_MAX, ApiKeyRecord, AuditRecord, ProjectRecord, Role, StoreError, TaskRecord};

/// The project tasks go to when the admin token names none, and where the
/// tasks of a deployment older than projects are.
pub const DEFAULT_PROJECT: &str = "default";
/// What a project key starts with (the rest: 64 hex digits, 256 bits).
pub const KEY_PREFIX: &str = "cohort_key_";
/// The window the `enrollments_per_minute` quota counts over, in ms.
pub(super) const ENROLLMENT_WINDOW_MS: i64 = 60_000;
/// Longest a key may be made to last: ten years, in seconds.
const MAX_KEY_LIFETIME_S: u64 = 10 * 366 * 24 * 3_600;

/// Who calls the admin API: the admin token, or a project's key.
#[derive(Clone)]
pub enum Identity {
    /// The deployment's admin token: every project.
    Admin,
    /// A key: its project, with its role.
    Key(ApiKeyRecord),
}

/// The caller of an admin request: who, and from which address.
#[derive(Clone)]
pub struct Caller {
    /// Who.
    pub identity: Identity,
    /// From where, as far as the listener (or a forwarding replica) knows.
    pub address: Option<IpAddr>,
}

impl std::fmt::Debug for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caller").field("actor", &self.actor()).field("role", &self.role_name()).finish()
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let unauthorized = |message: &str| ApiError::new(ErrorCode::Unauthorized, message);
        let Ok(PeerAddress(address)) = PeerAddress::from_request_parts(parts, state).await;
        let Some(token) = bearer(parts) else {
            return Err(unauthorized("a valid admin token or project key is required"));
        };
        if verify_token(token, &state.config.admin_token_hash) {
            return Ok(Caller { identity: Identity::Admin, address });
        }
        let well_formed = token.strip_prefix(KEY_PREFIX).is_some_and(|rest| {
            rest.len() == 64 && rest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if !well_formed {
            return Err(unauthorized("a valid admin token or project key is required"));
        }
        let key = match state.store.key_by_hash(&token_hash(token)).await {
            Ok(key) => key,
            Err(StoreError::NotFound(_)) => {
                return Err(unauthorized("a valid admin token or project key is required"));
            }
            Err(error) => return Err(error.into()),
        };
        if key.revoked_at.is_some() {
            return Err(unauthorized("the project key was revoked"));
        }
        if key.expires_at.is_some_and(|expiry| expiry <= now_ms()) {
            return Err(unauthorized("the project key has expired"));
        }
        Ok(Caller { identity: Identity::Key(key), address })
    }
}

impl Caller {
    /// The actor as the audit log names it: `admin`, or the key's id.
    pub fn actor(&self) -> &str {
        match &self.identity {
            Identity::Admin => "admin",
            Identity::Key(key) => &key.id,
        }
    }

    /// The role as the audit log names it.
    pub fn role_name(&self) -> &'static str {
        match &self.identity {
            Identity::Admin => "admin",
            Identity::Key(key) => key.role.as_str(),
        }
    }

    /// The key's project; `None` for the admin token (every project).
    pub fn project(&self) -> Option<&str> {
        match &self.identity {
            Identity::Admin => None,
            Identity::Key(key) => Some(&key.project_id),
        }
    }

    /// Whether the caller may see `project` at all.
    pub fn sees(&self, project: &str) -> bool {
        self.project().is_none_or(|own| own == project)
    }

    /// Refuses (`403`) unless the caller's role is at least `role`.
    pub fn require(&self, role: Role) -> ApiResult<()> {
        match &self.identity {
            Identity::Admin => Ok(()),
            Identity::Key(key) if key.role >= role => Ok(()),
            Identity::Key(key) => Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "this needs a key with the {} role; this key is a {}",
                    role.as_str(),
                    key.role.as_str()
                ),
            )),
        }
    }

    /// Refuses (`403`) unless the caller holds the admin token.
    pub fn require_admin(&self) -> ApiResult<()> {
        match &self.identity {
            Identity::Admin => Ok(()),
            Identity::Key(_) => Err(ApiError::new(
                ErrorCode::Forbidden,
                "only the deployment's admin token may do this, not a project key",
            )),
        }
    }

    /// The task `id`, if the caller may see it; another project's task is
    /// `404`, as one that does not exist.
    pub async fn task(&self, state: &AppState, id: &str) -> ApiResult<TaskRecord> {
        match state.store.task(id).await {
            Ok(task) if self.sees(&task.project_id) => Ok(task),
            Ok(_) | Err(StoreError::NotFound(_)) => Err(ApiError::new(ErrorCode::NotFound, "task not found")),
            Err(error) => Err(error.into()),
        }
    }

    /// The project `id`, if the caller may see it (else `404`).
    pub async fn project_record(&self, state: &AppState, id: &str) -> ApiResult<ProjectRecord> {
        let not_found = || ApiError::new(ErrorCode::NotFound, "project not found");
        if !is_project_id(id) || !self.sees(id) {
            return Err(not_found());
        }
        match state.store.project(id).await {
            Ok(project) => Ok(project),
            Err(StoreError::NotFound(_)) => Err(not_found()),
            Err(error) => Err(error.into()),
        }
    }
}

/// Whether `id` has the form of a project id: `default`, or 32 hex digits.
pub fn is_project_id(id: &str) -> bool {
    id == DEFAULT_PROJECT || is_valid_id(id)
}

/// An admin action's audit entry, written with the change it records or,
/// when the action is refused, on its own ([`Audit::finish`]).
pub struct Audit {
    entry: AuditRecord,
    written: bool,
}

impl Audit {
    /// The entry of `caller`'s `action` on `resource`, in the caller's
    /// project until [`in_project`](Self::in_project) names the one acted on.
    pub fn new(caller: &Caller, action: &'static str, resource: impl Into<String>) -> Self {
        let entry = AuditRecord {
            seq: 0,
            at: now_ms(),
            project_id: caller.project().map(str::to_string),
            actor: caller.actor().to_string(),
            role: caller.role_name().to_string(),
            action: action.to_string(),
            resource: resource.into(),
            address: caller.address.map(|a| a.to_string()),
            outcome: "ok".into(),
            status: 200,
            message: String::new(),
        };
        Self { entry, written: false }
    }

    /// The action is on `project`.
    pub fn in_project(&mut self, project: &str) {
        self.entry.project_id = Some(project.to_string());
    }

    /// The resource, once it has an id.
    pub fn on(&mut self, resource: impl Into<String>) {
        self.entry.resource = resource.into();
    }

    /// The entry of the action succeeding with `status`, to write with the
    /// change; the change's store call then [`succeeded`](Self::succeeded).
    pub fn success(&self, status: StatusCode) -> AuditRecord {
        AuditRecord { at: now_ms(), status: i64::from(status.as_u16()), ..self.entry.clone() }
    }

    /// The change and its entry are stored: a later error is not a refusal.
    pub fn succeeded(&mut self) {
        self.written = true;
    }

    /// The entry of the action refused with `error`.
    pub fn failure(&self, error: &ApiError) -> AuditRecord {
        AuditRecord {
            at: now_ms(),
            outcome: error.code().as_str().to_string(),
            status: i64::from(error.status().as_u16()),
            message: error.message().to_string(),
            ..self.entry.clone()
        }
    }

    /// Writes the entry of an action that changes nothing (a download) on
    /// its own; the action is refused if it cannot be written.
    pub async fn write(&mut self, state: &AppState, status: StatusCode) -> ApiResult<()> {
        state.store.audit(&self.success(status)).await?;
        self.written = true;
        Ok(())
    }

    /// Writes the refusal's entry, unless the change's own was written, and
    /// hands `result` back. A key whose refusals come faster than
    /// `admin_refusals_per_key` gets `429` instead, unwritten: no key can
    /// flood the log the projects share.
    pub async fn finish<T>(self, state: &AppState, result: ApiResult<T>) -> ApiResult<T> {
        if let Err(error) = &result
            && !self.written
        {
            if self.entry.actor != "admin"
                && let Err(wait) =
                    state.config.limiters.check(Call::AdminRefusal, None, Some(&self.entry.actor))
            {
                tracing::warn!(key = %self.entry.actor, action = %self.entry.action,
                    "a key's refused admin requests are over their rate: refused without an audit entry");
                return Err(ApiError::rate_limited(wait));
            }
            let entry = self.failure(error);
            if let Err(failure) = state.store.audit(&entry).await {
                tracing::warn!(%failure, action = %entry.action, resource = %entry.resource,
                    outcome = %entry.outcome, "could not write a refused action to the audit log");
            }
        }
        result
    }
}

/// A project's limits. A field left out (or `null`) sets no limit beyond
/// the server's own.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Tasks not over (active or paused) at once.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub unfinished_tasks: Option<u32>,
    /// Model parameters over the project's unfinished tasks: its share of
    /// the server's `max_total_parameters`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub parameters: Option<u64>,
    /// Enrollments per minute, over all the project's tasks and tokens.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub enrollments_per_minute: Option<u32>,
    /// Admin event streams the project's keys hold open at once.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub connections: Option<u32>,
}

impl Quotas {
    /// The limits that hold for `project`: of each kind, the lower of the
    /// operator's quota and its owners' own.
    pub fn of(project: &ProjectRecord) -> ApiResult<Self> {
        Ok(Self::operator(project)?.lower(&Self::owners(project)?))
    }

    /// The quotas the operator (the admin token) set for `project`.
    pub fn operator(project: &ProjectRecord) -> ApiResult<Self> {
        serde_json::from_str(&project.quotas).map_err(|_| StoreError::Corrupt("project quotas").into())
    }

    /// The limits `project`'s owners set for it.
    pub fn owners(project: &ProjectRecord) -> ApiResult<Self> {
        serde_json::from_str(&project.owner_quotas)
            .map_err(|_| StoreError::Corrupt("project owner quotas").into())
    }

    /// Of each kind, the lower of the two limits (either, where only one is
    /// set).
    pub fn lower(&self, other: &Self) -> Self {
        fn min<T: Ord + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        }
        Self {
            unfinished_tasks: min(self.unfinished_tasks, other.unfinished_tasks),
            parameters: min(self.parameters, other.parameters),
            enrollments_per_minute: min(self.enrollments_per_minute, other.enrollments_per_minute),
            connections: min(self.connections, other.connections),
        }
    }

    /// Each limit set here with its name and value, as a count.
    fn named(&self) -> [(&'static str, Option<u64>); 4] {
        [
            ("unfinished_tasks", self.unfinished_tasks.map(u64::from)),
            ("parameters", self.parameters),
            ("enrollments_per_minute", self.enrollments_per_minute.map(u64::from)),
            ("connections", self.connections.map(u64::from)),
        ]
    }

    /// Refuses (`422 quota_exceeded`, the quota named) owners' limits above
    /// the operator's `ceiling`: within it an owner may only tighten.
    fn within(&self, ceiling: &Self) -> ApiResult<()> {
        for ((name, own), (_, most)) in self.named().into_iter().zip(ceiling.named()) {
            if let (Some(own), Some(most)) = (own, most)
                && own > most
            {
                return Err(ApiError::new(
                    ErrorCode::QuotaExceeded,
                    format!(
                        "quota {name}: the project's owners may set at most the operator's {most}, not {own}"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check(&self) -> ApiResult<()> {
        if self.enrollments_per_minute == Some(0) {
            return Err(ApiError::new(
                ErrorCode::InvalidProjectRequest,
                "enrollments_per_minute must be at least 1 (leave it out for no limit)",
            ));
        }
        Ok(())
    }
}

/// What a project uses of its quotas.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    /// Tasks not over.
    pub unfinished_tasks: u32,
    /// Model parameters over its unfinished tasks.
    pub parameters: u64,
    /// Tasks in all, over or not.
    pub tasks: u32,
    /// Keys not revoked.
    pub keys: u32,
    /// Enrollments into its tasks in the last minute.
    pub enrollments_per_minute: u32,
    /// Admin event streams its keys hold open (on PostgreSQL, over every
    /// live replica, exactly where a `connections` quota is set).
    pub connections: u32,
}

/// A project as the admin API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProjectView {
    /// Identifier (`default`, or 32 hex digits).
    pub id: String,
    /// Its name.
    pub name: String,
    /// Creation (Unix ms).
    pub created_at: i64,
    /// Its quotas, as the operator (the admin token) set them.
    pub quotas: Quotas,
    /// The limits its owners set within them.
    pub owner_quotas: Quotas,
    /// The limits that hold: of each kind, the lower of the two (for
    /// `connections` where the operator set none, also at most a quarter
    /// of each process's `max_admin_streams`).
    pub effective_quotas: Quotas,
    /// What it uses of them.
    pub usage: Usage,
}

/// The project `record` with what it uses.
pub(super) async fn project_view(state: &AppState, record: ProjectRecord) -> ApiResult<ProjectView> {
    let mut views = project_views(state, vec![record]).await?;
    views.pop().ok_or_else(|| StoreError::NotFound("project").into())
}

/// The projects `records` with what each uses, from one read of the tasks
/// (the list of every project does not read them once per project).
pub(super) async fn project_views(
    state: &AppState,
    records: Vec<ProjectRecord>,
) -> ApiResult<Vec<ProjectView>> {
    let tasks = state.store.tasks().await?;
    let mut views = Vec::with_capacity(records.len());
    for record in records {
        let (quotas, owner_quotas) = (Quotas::operator(&record)?, Quotas::owners(&record)?);
        let mut usage = Usage::default();
        for task in tasks.iter().filter(|task| task.project_id == record.id) {
            usage.tasks += 1;
            if !task.status.is_final() {
                usage.unfinished_tasks += 1;
                usage.parameters += task.spec()?.model.layout.len() as u64;
            }
        }
        usage.keys =
            state.store.keys(&record.id).await?.iter().filter(|key| key.revoked_at.is_none()).count() as u32;
        let (enrolled, _) =
            state.store.enrollments_since(&record.id, now_ms() - ENROLLMENT_WINDOW_MS).await?;
        usage.enrollments_per_minute = u32::try_from(enrolled).unwrap_or(u32::MAX);
        usage.connections = state.streams.open_of(state, &record.id).await?;
        views.push(ProjectView {
            id: record.id,
            name: record.name,
            created_at: record.created_at,
            effective_quotas: quotas.lower(&owner_quotas),
            quotas,
            owner_quotas,
            usage,
        });
    }
    Ok(views)
}

/// A request for a project.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewProject {
    /// Its name, unique on the coordinator.
    name: GivenName,
    /// Its limits (default: none beyond the server's).
    #[serde(default)]
    quotas: Quotas,
}

/// The `{project}` of a path.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct ProjectPath {
    /// The project's id.
    #[param(pattern = "^(default|[0-9a-f]{32})$")]
    project: String,
}

/// A name a person gives (an application's enrollment token, a project, a
/// key): 1 to 200 characters, not all white space, no control characters;
/// kept without the white space around it.
#[derive(Deserialize)]
#[serde(transparent)]
pub(super) struct GivenName(String);

impl utoipa::PartialSchema for GivenName {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(200))
            .pattern(Some(
                "^[^\\u0000-\\u001F\\u007F-\\u009F]*[^\\s\\u0000-\\u001F\\u007F-\\u009F][^\\u0000-\\u001F\\u007F-\\u009F]*$",
            ))
            .description(Some("1 to 200 characters, not all white space, no control characters"))
            .into()
    }
}

impl utoipa::ToSchema for GivenName {}

impl GivenName {
    /// The name, trimmed, or the refusal with `invalid`.
    pub(super) fn checked(&self, invalid: ErrorCode) -> ApiResult<String> {
        let trimmed = self.0.trim();
        if trimmed.is_empty() || !crate::spec::name_fits(&self.0) {
            return Err(ApiError::new(
                invalid,
                "name must be 1 to 200 characters, not all white space, without control characters",
            ));
        }
        Ok(trimmed.to_string())
    }
}

/// The `project` path parameter.
fn project_param(params: &std::collections::HashMap<String, String>) -> String {
    params.get("project").cloned().unwrap_or_default()
}

/// A path parameter as the audit log names it: itself when it has the
/// form of an id, else a placeholder (the log keeps no text a caller
/// chose).
pub(super) fn logged(part: &str, well_formed: bool) -> &str {
    if well_formed { part } else { "(malformed)" }
}

/// Creates a project (the admin token only).
#[utoipa::path(
    post, path = "/admin/projects", tag = "projects", operation_id = "createProject",
    security(("admin" = [])),
    request_body(content = NewProject, example = json!({ "name": "acme", "quotas": { "unfinished_tasks": 5, "parameters": 10000000 } })),
    responses(
        (status = 201, description = "Created", body = ProjectView,
            links(
                ("getProject" = (operation_id = "getProject", parameters(("project" = "$response.body#/id")))),
                ("createKey" = (operation_id = "createKey", parameters(("project" = "$response.body#/id")))),
                ("listKeys" = (operation_id = "listKeys", parameters(("project" = "$response.body#/id")))),
                ("setQuotas" = (operation_id = "setQuotas", parameters(("project" = "$response.body#/id"))))
            )),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 403, response = Refused),
        (status = 408, response = Refused),
        (status = 409, description = "A project of this name exists", body = ErrorBody),
        (status = 413, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn create_project(
    caller: Caller,
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<ProjectView>)> {
    let mut audit = Audit::new(&caller, "project.create", "projects");
    let result = async {
        caller.require_admin()?;
        let request: NewProject = json_body(&body)?;
        let name = request.name.checked(ErrorCode::InvalidProjectRequest)?;
        request.quotas.check()?;
        let record = ProjectRecord {
            id: new_id(),
            name,
            quotas: serde_json::to_string(&request.quotas)
                .map_err(|_| StoreError::Corrupt("project quotas"))?,
            owner_quotas: "{}".into(),
            created_at: now_ms(),
        };
        // The project's entry only if it is created: a refusal (a name
        // taken) is on no project.
        let entry = AuditRecord {
            project_id: Some(record.id.clone()),
            resource: format!("projects/{}", record.id),
            ..audit.success(StatusCode::CREATED)
        };
        state.store.create_project(&record, &entry).await?;
        audit.succeeded();
        tracing::info!(project = %record.id, name = %record.name, "project created");
        Ok((StatusCode::CREATED, Json(project_view(&state, record).await?)))
    }
    .await;
    audit.finish(&state, result).await
}

/// The projects the caller sees: every one for the admin token, its own
/// for a key.
#[utoipa::path(
    get, path = "/admin/projects", tag = "projects", operation_id = "listProjects",
    security(("admin" = [])),
    responses(
        (status = 200, description = "The projects, with their quotas and use", body = [ProjectView]),
        (status = 401, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_projects(
    caller: Caller,
    State(state): State<AppState>,
) -> ApiResult<Json<Vec<ProjectView>>> {
    let projects = state.store.projects().await?.into_iter().filter(|p| caller.sees(&p.id)).collect();
    Ok(Json(project_views(&state, projects).await?))
}

/// One project, with its quotas and use.
#[utoipa::path(
    get, path = "/admin/projects/{project}", tag = "projects", operation_id = "getProject",
    security(("admin" = [])), params(ProjectPath),
    responses(
        (status = 200, description = "The project", body = ProjectView),
        (status = 401, response = Refused), (status = 404, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn get_project(
    caller: Caller,
    State(state): State<AppState>,
    Path(params): Path<std::collections::HashMap<String, String>>,
) -> ApiResult<Json<ProjectView>> {
    let record = caller.project_record(&state, &project_param(&params)).await?;
    Ok(Json(project_view(&state, record).await?))
}

/// Sets a project's quotas (the admin token only): what is running keeps
/// running; what would exceed them is refused from now on. Limits its
/// owners set above the new quotas stay stored, and the lower (the
/// operator's) holds.
#[utoipa::path(
    put, path = "/admin/projects/{project}/quotas", tag = "projects", operation_id = "setQuotas",
    security(("admin" = [])), params(ProjectPath),
    request_body(content = Quotas, example = json!({ "unfinished_tasks": 10, "enrollments_per_minute": 600 })),
    responses(
        (status = 200, description = "The project with its new quotas", body = ProjectView),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 403, response = Refused),
        (status = 404, response = Refused), (status = 408, response = Refused), (status = 413, response = Refused),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn set_quotas(
    caller: Caller,
    State(state): State<AppState>,
    Path(params): Path<std::collections::HashMap<String, String>>,
    RawBody(body): RawBody,
) -> ApiResult<Json<ProjectView>> {
    put_quotas(caller, &state, &project_param(&params), &body, Setter::Operator).await
}

/// Whose limits a request sets.
#[derive(Clone, Copy)]
enum Setter {
    /// The operator's quotas (the admin token).
    Operator,
    /// The project's owners' own limits, within the operator's.
    Owners,
}

/// Sets the quotas of the project `id` that `setter` holds, from `body`:
/// the request checked, the change and its audit entry written together.
async fn put_quotas(
    caller: Caller,
    state: &AppState,
    id: &str,
    body: &[u8],
    setter: Setter,
) -> ApiResult<Json<ProjectView>> {
    let (path, action) = match setter {
        Setter::Operator => ("quotas", "project.quotas"),
        Setter::Owners => ("owner-quotas", "project.owner_quotas"),
    };
    let resource = format!("projects/{}/{path}", logged(id, is_project_id(id)));
    let mut audit = Audit::new(&caller, action, resource);
    let result = async {
        let record = caller.project_record(state, id).await?;
        audit.in_project(&record.id);
        match setter {
            Setter::Operator => caller.require_admin()?,
            Setter::Owners => caller.require(Role::Owner)?,
        }
        let quotas: Quotas = json_body(body)?;
        quotas.check()?;
        if let Setter::Owners = setter {
            quotas.within(&Quotas::operator(&record)?)?;
        }
        let json = serde_json::to_string(&quotas).map_err(|_| StoreError::Corrupt("project quotas"))?;
        let entry = audit.success(StatusCode::OK);
        let record = match setter {
            Setter::Operator => {
                state.store.set_quotas(&record.id, &json, &entry).await?;
                ProjectRecord { quotas: json, ..record }
            }
            Setter::Owners => {
                state.store.set_owner_quotas(&record.id, &json, &entry).await?;
                ProjectRecord { owner_quotas: json, ..record }
            }
        };
        audit.succeeded();
        tracing::info!(project = %record.id, action, "project quotas set");
        Ok(Json(project_view(state, record).await?))
    }
    .await;
    audit.finish(state, result).await
}

/// Sets the limits a project's owners hold it to, within the operator's
/// quotas (an `owner` key of the project, or the admin token): each at
/// most the operator's quota of its kind (`422 quota_exceeded` names the
/// first above it), a field left out sets none of the owners'. What is
/// running keeps running; what would exceed them is refused from now on.
#[utoipa::path(
    put, path = "/admin/projects/{project}/owner-quotas", tag = "projects", operation_id = "setOwnerQuotas",
    security(("admin" = [])), params(ProjectPath),
    request_body(content = Quotas, example = json!({ "unfinished_tasks": 2, "parameters": 1000000 })),
    responses(
        (status = 200, description = "The project with its owners' new limits", body = ProjectView),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 403, response = Refused),
        (status = 404, response = Refused), (status = 408, response = Refused), (status = 413, response = Refused),
        (status = 422, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn set_owner_quotas(
    caller: Caller,
    State(state): State<AppState>,
    Path(params): Path<std::collections::HashMap<String, String>>,
    RawBody(body): RawBody,
) -> ApiResult<Json<ProjectView>> {
    put_quotas(caller, &state, &project_param(&params), &body, Setter::Owners).await
}

/// A request for a project key.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewKey {
    /// Who or what it is for; unique within the project.
    name: GivenName,
    /// What it may do.
    role: Role,
    /// How long it works, in seconds from now (at most ten years); default:
    /// until it is revoked.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 316_224_000)]
    expires_in_s: Option<u64>,
}

/// A project key as the admin API shows it; the key itself only in the
/// answer that created it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KeyView {
    /// Identifier: the actor the audit log names.
    pub id: String,
    /// The project.
    pub project: String,
    /// Who or what it is for.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// The key (`Authorization: Bearer <key>`): shown once, at creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Creation (Unix ms).
    pub created_at: i64,
    /// When it stops working (Unix ms), if it does.
    pub expires_at: Option<i64>,
    /// Revocation (Unix ms), if revoked.
    pub revoked_at: Option<i64>,
    /// Who created it: `admin`, or the owner key's id.
    pub created_by: String,
}

impl KeyView {
    fn of(key: ApiKeyRecord) -> Self {
        Self {
            id: key.id,
            project: key.project_id,
            name: key.name,
            role: key.role,
            key: None,
            created_at: key.created_at,
            expires_at: key.expires_at,
            revoked_at: key.revoked_at,
            created_by: key.created_by,
        }
    }
}

/// A fresh project key: the prefix and 256 random bits.
fn new_key() -> String {
    format!("{KEY_PREFIX}{}", super::auth::new_token())
}

/// Creates a key of a project (the admin token, or an owner key of the
/// project).
#[utoipa::path(
    post, path = "/admin/projects/{project}/keys", tag = "projects", operation_id = "createKey",
    security(("admin" = [])), params(ProjectPath),
    request_body(content = NewKey, example = json!({ "name": "ci pipeline", "role": "operator" })),
    responses(
        (status = 201, description = "Created; the key is shown only here", body = KeyView,
            links(("revokeKey" = (operation_id = "revokeKey", parameters(("project" = "$request.path.project"), ("key" = "$response.body#/id")))))),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 403, response = Refused),
        (status = 404, response = Refused), (status = 408, response = Refused),
        (status = 409, description = "The project has a key of this name", body = ErrorBody),
        (status = 413, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn create_key(
    caller: Caller,
    State(state): State<AppState>,
    Path(params): Path<std::collections::HashMap<String, String>>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<KeyView>)> {
    let project = project_param(&params);
    let resource = format!("projects/{}/keys", logged(&project, is_project_id(&project)));
    let mut audit = Audit::new(&caller, "key.create", resource);
    let result = async {
        let record = caller.project_record(&state, &project).await?;
        audit.in_project(&record.id);
        caller.require(Role::Owner)?;
        let request: NewKey = json_body(&body)?;
        let name = request.name.checked(ErrorCode::InvalidProjectRequest)?;
        let now = now_ms();
        if request.expires_in_s.is_some_and(|s| !(1..=MAX_KEY_LIFETIME_S).contains(&s)) {
            return Err(ApiError::new(
                ErrorCode::InvalidProjectRequest,
                format!("expires_in_s must be 1 to {MAX_KEY_LIFETIME_S} seconds (ten years)"),
            ));
        }
        let expires_at = request.expires_in_s.map(|s| now.saturating_add((s as i64).saturating_mul(1000)));
        let key = new_key();
        let record = ApiKeyRecord {
            id: new_id(),
            project_id: record.id,
            name,
            role: request.role,
            key_hash: token_hash(&key),
            created_at: now,
            expires_at,
            revoked_at: None,
            created_by: caller.actor().to_string(),
        };
        audit.on(format!("projects/{}/keys/{}", record.project_id, record.id));
        state.store.add_key(&record, &audit.success(StatusCode::CREATED)).await?;
        audit.succeeded();
        tracing::info!(project = %record.project_id, key = %record.id, role = record.role.as_str(), "project key created");
        Ok((StatusCode::CREATED, Json(KeyView { key: Some(key), ..KeyView::of(record) })))
    }
    .await;
    audit.finish(&state, result).await
}

/// A project's keys, never the keys themselves (the admin token, or an
/// owner key of the project).
#[utoipa::path(
    get, path = "/admin/projects/{project}/keys", tag = "projects", operation_id = "listKeys",
    security(("admin" = [])), params(ProjectPath),
    responses(
        (status = 200, description = "The keys, oldest first", body = [KeyView]),
        (status = 401, response = Refused), (status = 403, response = Refused), (status = 404, response = Refused),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_keys(
    caller: Caller,
    State(state): State<AppState>,
    Path(params): Path<std::collections::HashMap<String, String>>,
) -> ApiResult<Json<Vec<KeyView>>> {
    let record = caller.project_record(&state, &project_param(&params)).await?;
    caller.require(Role::Owner)?;
    Ok(Json(state.store.keys(&record.id).await?.into_iter().map(KeyView::of).collect()))
}

/// Revokes a key: every request with it is refused from now on, on every
/// replica (the admin token, or an owner key of the project).
#[utoipa::path(
    post, path = "/admin/projects/{project}/keys/{key}/revoke", tag = "projects", operation_id = "revokeKey",
    security(("admin" = [])),
    params(ProjectPath, ("key" = String, Path, description = "The key's id", pattern = "^[0-9a-f]{32}$")),
    responses(
        (status = 200, description = "Revoked", body = KeyView),
        (status = 401, response = Refused), (status = 403, response = Refused), (status = 404, response = Refused),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn revoke_key(
    caller: Caller,
    State(state): State<AppState>,
    Path(params): Path<std::collections::HashMap<String, String>>,
) -> ApiResult<Json<KeyView>> {
    let project = project_param(&params);
    let key_id = params.get("key").cloned().unwrap_or_default();
    let resource = format!(
        "projects/{}/keys/{}",
        logged(&project, is_project_id(&project)),
        logged(&key_id, is_valid_id(&key_id))
    );
    let mut audit = Audit::new(&caller, "key.revoke", resource);
    let result = async {
        let record = caller.project_record(&state, &project).await?;
        audit.in_project(&record.id);
        caller.require(Role::Owner)?;
        if !is_valid_id(&key_id) {
            return Err(ApiError::new(ErrorCode::NotFound, "key not found"));
        }
        let revoked =
            state.store.revoke_key(&record.id, &key_id, now_ms(), &audit.success(StatusCode::OK)).await?;
        audit.succeeded();
        tracing::info!(project = %record.id, key = %revoked.id, "project key revoked");
        Ok(Json(KeyView::of(revoked)))
    }
    .await;
    audit.finish(&state, result).await
}

/// Query of the audit log.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct AuditQuery {
    /// Only this project's entries (a key: its own project's, always).
    #[param(pattern = "^(default|[0-9a-f]{32})$")]
    project: Option<String>,
    /// Entries before this one (its `seq`): the next page.
    #[param(minimum = 1)]
    before: Option<i64>,
    /// The most entries to list (default 100).
    #[param(minimum = 1, maximum = 500)]
    limit: Option<i64>,
}

/// A page of the audit log.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditPage {
    /// Entries, newest first.
    pub entries: Vec<AuditRecord>,
    /// `before` for the next (older) page; `null` on the last.
    pub next_before: Option<i64>,
}

/// The audit log, newest first: every admin action that changed something
/// (and every checkpoint download) or was refused, with who, what, on
/// which resource, from where, when and how it ended. The admin token
/// reads every project's (or one, with `project`); an owner key its own
/// project's.
#[utoipa::path(
    get, path = "/admin/audit", tag = "projects", operation_id = "listAudit",
    security(("admin" = [])), params(AuditQuery),
    responses(
        (status = 200, description = "A page of entries, newest first", body = AuditPage),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 403, response = Refused),
        (status = 404, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn list_audit(
    caller: Caller,
    State(state): State<AppState>,
    query: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<AuditPage>> {
    let bad = || {
        ApiError::new(
            ErrorCode::InvalidQuery,
            format!(
                "the query parameters are project, before (at least 1) and limit (1 to {AUDIT_PAGE_MAX})"
            ),
        )
    };
    let Query(query) = query.map_err(|_| bad())?;
    let limit = query.limit.unwrap_or(100);
    if !(1..=AUDIT_PAGE_MAX).contains(&limit) || query.before.is_some_and(|b| b < 1) {
        return Err(bad());
    }
    let project = match (caller.project(), query.project.as_deref()) {
        (None, requested) => requested.map(str::to_string),
        (Some(own), None) => Some(own.to_string()),
        (Some(own), Some(requested)) if own == requested => Some(own.to_string()),
        (Some(_), Some(_)) => return Err(ApiError::new(ErrorCode::NotFound, "project not found")),
    };
    if let Some(project) = &project {
        caller.project_record(&state, project).await?;
    }
    caller.require(Role::Owner)?;
    let entries = state.store.audit_log(project.as_deref(), query.before, limit).await?;
    let next_before = (entries.len() as i64 == limit).then(|| entries.last().map(|e| e.seq)).flatten();
    Ok(Json(AuditPage { entries, next_before }))
}

/// Who the caller is, for the dashboard's sign-in.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Session {
    /// `admin`, or the key's id.
    pub actor: String,
    /// `admin`, `owner`, `operator` or `viewer`.
    pub role: String,
    /// The key's project (`null` for the admin token: every project).
    pub project: Option<ProjectView>,
    /// The key's name (`null` for the admin token).
    pub name: Option<String>,
    /// When the key stops working, if it does.
    pub expires_at: Option<i64>,
}

/// Who the caller is: the admin token, or a key with its project and role.
#[utoipa::path(
    get, path = "/admin/session", tag = "projects", operation_id = "getSession",
    security(("admin" = [])),
    responses(
        (status = 200, description = "The caller", body = Session),
        (status = 401, response = Refused), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn session(caller: Caller, State(state): State<AppState>) -> ApiResult<Json<Session>> {
    let project = match caller.project() {
        Some(id) => Some(project_view(&state, state.store.project(id).await?).await?),
        None => None,
    };
    let (name, expires_at) = match &caller.identity {
        Identity::Admin => (None, None),
        Identity::Key(key) => (Some(key.name.clone()), key.expires_at),
    };
    Ok(Json(Session {
        actor: caller.actor().to_string(),
        role: caller.role_name().to_string(),
        project,
        name,
        expires_at,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of tokens, projects and keys are one schema, with the
    /// bounds the server checks.
    #[test]
    fn a_given_name_is_documented_with_its_bounds_and_checked_alike() {
        let schema = serde_json::to_value(<GivenName as utoipa::PartialSchema>::schema()).unwrap();
        assert_eq!(
            (schema["type"].as_str(), schema["minLength"].as_u64()),
            (Some("string"), Some(1)),
            "{schema}"
        );
        assert_eq!(schema["maxLength"].as_u64(), Some(200), "{schema}");
        let pattern = schema["pattern"].as_str().unwrap_or_else(|| panic!("{schema}"));
        assert!(pattern.starts_with("^[^\\u0000-\\u001F"), "{pattern}");
        let name = |text: &str| GivenName(text.into()).checked(ErrorCode::InvalidProjectRequest);
        assert_eq!(name("  acme ").unwrap(), "acme");
        for refused in ["", "   ", "a\u{7}b", &"x".repeat(201)] {
            let error = name(refused).unwrap_err();
            assert_eq!(error.code(), ErrorCode::InvalidProjectRequest, "{refused:?}");
        }
        assert_eq!(name(&"é".repeat(200)).unwrap().chars().count(), 200);
    }

    #[test]
    fn only_ids_are_written_to_the_log_as_given() {
        assert_eq!(logged("0123456789abcdef0123456789abcdef", true), "0123456789abcdef0123456789abcdef");
        assert_eq!(logged("\n forged entry", false), "(malformed)");
        assert!(is_project_id("default") && is_project_id(&"a".repeat(32)));
        assert!(!is_project_id("Default") && !is_project_id(&"A".repeat(32)) && !is_project_id(""));
    }
}
