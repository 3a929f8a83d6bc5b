//! The coordinator's HTTP API and pages.
//!
//! * Admin API (JSON, `Authorization: Bearer <admin token or project key>`):
//!   create, list, inspect, pause, resume and stop tasks; list rounds with
//!   their metrics; download checkpoints (safetensors); follow a task, or
//!   the task list, as Server-Sent Events ([`events`]). Projects, their
//!   keys and roles, quotas and the audit log ([`projects`]): a key sees
//!   its own project only.
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
//! per-address and per-credential rate limits ([`ratelimit`]).
//!
//! * `state`, `error`, `extract`: what handlers share;
//! * `admin`, `client`: the two APIs' handlers, [`events`] the admin API's
//!   server push; [`pages`]: the dashboard
//!   and demo pages and the browser client's files; [`openapi`];
//! * [`auth`] (tokens and their hashes), [`ratelimit`], [`listener`] (the
//!   connections: timeouts, the cap, TLS); requests about a task that
//!   another replica leads are forwarded by [`crate::cluster::forward`];
//!   [`trace`]: request ids and spans, followed across replicas.

pub mod admin;
pub mod auth;
pub mod client;
pub mod error;
pub mod events;
pub mod extract;
pub mod listener;
pub mod openapi;
pub mod pages;
pub mod projects;
pub mod ratelimit;
pub mod state;
pub mod trace;

pub use admin::{CreatedTask, PlaintextReport, RoundView, StatusChanged, TaskView, TokenView, create};
pub use client::ClientMetrics;
pub use cohort_client::api::{Enrolled, ErrorBody, ErrorCode};
pub use error::ApiError;
pub use state::{ApiConfig, AppState, DEFAULT_MAX_TOTAL_PARAMETERS};

use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use serde_json::json;

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Content type of secure-aggregation stage messages (one definition, the
/// client library's).
pub use cohort_client::api::SECAGG_CONTENT_TYPE;
/// Content type of checkpoints.
pub const SAFETENSORS_CONTENT_TYPE: &str = "application/vnd.safetensors";
const JSON_LIMIT: usize = 1 << 20;
/// Largest JSON body of the client API (an enrollment, a metrics report).
pub const CLIENT_JSON_LIMIT: usize = 4 << 10;
/// How long a readiness probe waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);
/// What a client is told to wait when the database cannot be reached.
const DATABASE_RETRY: Duration = Duration::from_secs(5);

/// Builds the router. Each API handler is registered at the path its
/// `#[utoipa::path]` attribute names, and the OpenAPI document is put
/// together from the same attributes ([`openapi`]).
pub fn app(state: AppState) -> Router {
    // Requests about a task go to the replica that leads it.
    let to_leader = axum::middleware::from_fn_with_state(state.clone(), crate::cluster::forward::route);
    let admin = OpenApiRouter::new()
        .routes(routes!(admin::create_task, admin::list_tasks))
        .routes(routes!(admin::get_task, admin::delete_task))
        .routes(routes!(admin::pause_task))
        .routes(routes!(admin::resume_task))
        .routes(routes!(admin::stop_task))
        .routes(routes!(admin::list_rounds))
        .routes(routes!(admin::list_attempts))
        .routes(routes!(admin::get_checkpoint))
        .routes(routes!(admin::create_token, admin::list_tokens))
        .routes(routes!(admin::revoke_token))
        .routes(routes!(events::task_events))
        .routes(routes!(events::task_list_events))
        .route_layer(to_leader.clone())
        .layer(DefaultBodyLimit::max(JSON_LIMIT));
    // Projects, keys and the audit log: in the shared store, served by any
    // replica.
    let projects = OpenApiRouter::new()
        .routes(routes!(projects::create_project, projects::list_projects))
        .routes(routes!(projects::get_project))
        .routes(routes!(projects::set_quotas))
        .routes(routes!(projects::set_owner_quotas))
        .routes(routes!(projects::create_key, projects::list_keys))
        .routes(routes!(projects::revoke_key))
        .routes(routes!(projects::list_audit))
        .routes(routes!(projects::session))
        .layer(DefaultBodyLimit::max(JSON_LIMIT));
    // The client API's JSON bodies are small; enrollment's is read before
    // its token is checked, so it gets the small limit too.
    let client_json = OpenApiRouter::new()
        .routes(routes!(client::enroll))
        .routes(routes!(client::check_in))
        .routes(routes!(client::leave))
        .routes(routes!(client::model))
        .routes(routes!(client::report_metrics))
        .route_layer(to_leader.clone())
        .layer(DefaultBodyLimit::max(CLIENT_JSON_LIMIT));
    // Stage messages are read by the handler itself, after the admission
    // check, within the round's own limit.
    let messages = OpenApiRouter::new()
        .routes(routes!(client::fetch_message, client::post_message))
        .route_layer(to_leader);
    let (api, routes) = OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(ready))
        .routes(routes!(prometheus))
        .merge(admin)
        .merge(projects)
        .merge(client_json)
        .merge(messages)
        .split_for_parts();
    let document = bytes::Bytes::from(openapi::document(routes).to_string());
    let router = api
        .route(
            "/openapi.json",
            get(move || {
                let document = document.clone();
                async move { ([(header::CONTENT_TYPE, "application/json")], document) }
            }),
        )
        .merge(pages::routes())
        .fallback(|| async { ApiError::new(ErrorCode::NotFound, "no such endpoint") })
        .with_state(state);
    trace::layer(router)
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations", operation_id = "healthz",
    responses((status = 200, description = "The process answers", content_type = "text/plain", body = String)))]
async fn healthz() -> &'static str {
    "ok"
}

/// The readiness probe's answer.
#[derive(serde::Serialize, utoipa::ToSchema)]
struct Ready {
    /// `ready`.
    status: &'static str,
    /// `ok`.
    database: &'static str,
}

/// Readiness: the database answers.
#[utoipa::path(get, path = "/readyz", tag = "operations", operation_id = "readyz",
    responses(
        (status = 200, description = "Ready: the database answers", body = Ready),
        (status = 503, description = "Not ready: the database does not answer (the refusal, with `status` and `database` beside it)", body = ErrorBody)
    ))]
async fn ready(State(state): State<AppState>) -> Response {
    match tokio::time::timeout(READY_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => Json(Ready { status: "ready", database: "ok" }).into_response(),
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
    let mut body = json!(ErrorBody {
        error: ErrorCode::Unavailable,
        message: "the database is unavailable; retry later".into(),
        retry_after_ms: Some(DATABASE_RETRY.as_millis() as u64),
    });
    body["status"] = "unavailable".into();
    body["database"] = "unreachable".into();
    let retry_after = DATABASE_RETRY.as_secs().to_string();
    (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, retry_after)], Json(body)).into_response()
}

/// The coordinator's metrics in the OpenMetrics text format (which
/// Prometheus scrapes), with histograms of stage durations and uploads.
/// Without a credential: this process's series over every task. With the
/// admin token: those and every task's series, labelled with its `project`
/// and `task`. With a project key: that project's tasks' series only.
#[utoipa::path(get, path = "/metrics", tag = "operations", operation_id = "metrics",
    security((), ("admin" = [])),
    responses(
        (status = 200, description = "OpenMetrics text exposition",
            content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8", body = String),
        (status = 401, response = openapi::Refused), (status = 503, response = openapi::RetryLater)
    ))]
async fn prometheus(
    State(state): State<AppState>,
    mut parts: axum::http::request::Parts,
) -> Result<Response, ApiError> {
    use crate::metrics::Scope;
    use axum::extract::FromRequestParts;
    let caller = match extract::bearer_of(&parts.headers) {
        None => None,
        Some(_) => Some(projects::Caller::from_request_parts(&mut parts, &state).await?),
    };
    let scope = match caller.as_ref().map(|caller| caller.project()) {
        None => Scope::Public,
        Some(None) => Scope::All,
        Some(Some(project)) => Scope::Project(project),
    };
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], state.metrics.render(scope)).into_response())
}
