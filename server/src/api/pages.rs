//! The browser pages: the admin dashboard (`/admin`), the in-tab training
//! demo (`/demo`), their scripts (`/web/*`, compiled into the binary) and
//! the browser client's build (`/web/pkg/*`: the wasm-bindgen output and
//! the demo's digits, read from the directory `scripts/build-web.sh`
//! writes).
//!
//! With `cohort serve --demo` the coordinator also runs a public demo task
//! (MNIST digits, logistic regression, three clients per round): `/demo`
//! opened without a task joins it, its enrollment token coming from
//! `GET /demo/task`. Anyone who can reach the page can enroll in that task
//! and only that task; each start replaces it with a fresh one.
//!
//! Every response carries a strict Content-Security-Policy: scripts only
//! from this origin (plus WebAssembly compilation), requests only to this
//! origin, no framing. The pages render server data as text, never as
//! markup.

use std::path::{Path as FsPath, PathBuf};

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Router, middleware};

use cohort_client::model::Model;

use super::admin::create;
use super::error::ApiError;
use super::state::{AppState, DemoTask};
use crate::coordinator::Coordinator;
use crate::spec::{TaskPlan, TaskSpec};
use crate::store::{SqlStore, TaskStatus};
use cohort_client::api::ErrorCode;

/// Name of the public demo task.
pub const DEMO_TASK_NAME: &str = "browser demo (cohort serve --demo)";

/// The demo task's specification: MNIST digits (784 inputs, 10 classes),
/// logistic regression, three tabs per round, a long run of rounds. The
/// threshold of 2 survives one tab that closes after sharing its keys (a
/// survivor's seed is rebuilt from its own share and its other
/// neighbour's); a closing tab says it leaves, so no stage waits for it,
/// and one that vanishes silently costs seconds, not minutes: the
/// deadlines are short, and a tab that stopped checking in is no longer
/// selected after 6 s. Every tab's update is in every round it completes
/// (no over-selection: with three tabs it would cut one tab's update from
/// each round or need a fourth tab).
pub fn demo_spec() -> TaskSpec {
    let logreg = Model::by_name("logreg", 784, 10).unwrap_or_else(|| unreachable!("logreg is built in"));
    let spec = serde_json::json!({
        "name": DEMO_TASK_NAME,
        "rounds": 1000,
        "clients_per_round": 3,
        "model": {
            "architecture": "logreg",
            "layout": logreg.layout(),
            "init": { "kind": "fan_in", "seed": 1 },
        },
        "secure_aggregation": { "graph": "complete", "threshold": 2 },
        "deadlines": {
            "advertise_keys_ms": 20_000, "share_keys_ms": 8_000,
            "masked_input_ms": 15_000, "unmasking_ms": 8_000,
            "availability_ms": 6_000,
        },
        "checkpoint_retention": 5,
    });
    serde_json::from_value(spec).unwrap_or_else(|e| unreachable!("the demo spec is well-formed: {e}"))
}

/// Stops the demo tasks of earlier starts (their tokens were never kept)
/// and creates a fresh one.
pub async fn start_demo_task(store: &SqlStore, coordinator: &Coordinator) -> Result<DemoTask, ApiError> {
    for task in store.tasks().await? {
        // The demo's tasks are the admin token's, in the project `default`;
        // another project's task of that name is its own.
        if task.name == DEMO_TASK_NAME
            && task.project_id == super::projects::DEFAULT_PROJECT
            && !task.status.is_final()
        {
            coordinator.set_status(&task.id, TaskStatus::Stopped, None).await?;
        }
    }
    let plan = TaskPlan::for_new_task(demo_spec())
        .map_err(|e| ApiError::new(ErrorCode::InvalidTask, e.to_string()))?;
    let clients_per_round = plan.spec().groups().selected();
    let created = create(store, coordinator, plan, super::projects::DEFAULT_PROJECT, None).await?;
    tracing::info!(task = %created.id, "public demo task started");
    Ok(DemoTask::new(created.id, created.enrollment_token, clients_per_round))
}

/// Files of `web/static`, served at `/web/{name}`.
const STATIC_FILES: &[(&str, &str, &str)] = &[
    ("admin.js", "text/javascript", include_str!("../../../web/static/admin.js")),
    ("chart.js", "text/javascript", include_str!("../../../web/static/chart.js")),
    ("demo.js", "text/javascript", include_str!("../../../web/static/demo.js")),
    ("driver.js", "text/javascript", include_str!("../../../web/static/driver.js")),
    ("webcrypto.js", "text/javascript", include_str!("../../../web/static/webcrypto.js")),
    ("worker.js", "text/javascript", include_str!("../../../web/static/worker.js")),
    ("style.css", "text/css", include_str!("../../../web/static/style.css")),
];
const ADMIN_PAGE: &str = include_str!("../../../web/static/admin.html");
const DEMO_PAGE: &str = include_str!("../../../web/static/demo.html");

/// Files the browser client's build directory may serve.
const PKG_FILES: &[(&str, &str)] = &[
    ("cohort_web.js", "text/javascript"),
    ("cohort_web_bg.wasm", "application/wasm"),
    ("digits-images.idx", "application/octet-stream"),
    ("digits-labels.idx", "application/octet-stream"),
];

const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self' 'wasm-unsafe-eval'; \
    worker-src 'self'; connect-src 'self'; style-src 'self'; img-src 'self'; \
    base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Where the browser client's build is, when `cohort serve` is given none:
/// `web/pkg` under the working directory.
pub fn default_assets_dir() -> PathBuf {
    PathBuf::from("web/pkg")
}

/// The pages' routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/admin") }))
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .route("/admin", get(|| async { page(ADMIN_PAGE) }))
        .route("/demo", get(|| async { page(DEMO_PAGE) }))
        .route("/demo/task", get(demo_task))
        .route("/web/{name}", get(static_file))
        .route("/web/pkg/{name}", get(pkg_file))
        .layer(middleware::map_response(security_headers))
}

async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn page(html: &'static str) -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response()
}

fn not_found(what: &str) -> Response {
    (StatusCode::NOT_FOUND, format!("{what} not found\n")).into_response()
}

/// `GET /demo/task`'s query: `join=true` from a page that is about to
/// join, which is then dealt a shard of the digits.
#[derive(serde::Deserialize)]
struct DemoQuery {
    #[serde(default)]
    join: bool,
}

/// The public demo task: its id and enrollment token, how many clients a
/// round selects and how many are available now (for the page's "2 of 3
/// devices" line; absent when another replica leads the task); to a page
/// that joins, the shard of the digits it trains on (`shard` of `shards`,
/// one per tab of a round, dealt in turn). Without one, `204 No Content`:
/// the page then shows its join form, and a bare `/demo` logs no failed
/// request in the browser's console.
async fn demo_task(State(state): State<AppState>, Query(query): Query<DemoQuery>) -> Response {
    let Some(task) = &state.config.demo_task else { return StatusCode::NO_CONTENT.into_response() };
    let available = state.coordinator.live(&task.id).await.ok().map(|live| live.available_clients);
    let mut answer = serde_json::json!({
        "task": task.id,
        "enrollment_token": task.enrollment_token,
        "clients_per_round": task.clients_per_round,
        "available": available,
    });
    if query.join {
        answer["shard"] = task.deal_shard().into();
        answer["shards"] = task.clients_per_round.into();
    }
    Json(answer).into_response()
}

async fn static_file(Path(name): Path<String>) -> Response {
    match STATIC_FILES.iter().find(|(file, ..)| *file == name) {
        Some((_, content_type, body)) => ([(header::CONTENT_TYPE, *content_type)], *body).into_response(),
        None => not_found(&name),
    }
}

async fn pkg_file(State(state): State<AppState>, Path(name): Path<String>, headers: HeaderMap) -> Response {
    // Only the known names: nothing else in (or beyond) the directory.
    let Some((file, content_type)) = PKG_FILES.iter().find(|(file, _)| *file == name) else {
        return not_found(&name);
    };
    let path = state.config.web_assets.join(file);
    // Revalidation (the pages are `no-cache`): a tab that has the build
    // already, say the 7.85 MB of digits, gets a 304 instead.
    let tag = tokio::fs::metadata(&path).await.ok().map(|metadata| {
        let modified = metadata
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        format!("\"{:x}-{modified:x}\"", metadata.len())
    });
    if let Some(tag) = &tag
        && headers.get(header::IF_NONE_MATCH).is_some_and(|v| v.as_bytes() == tag.as_bytes())
    {
        return (StatusCode::NOT_MODIFIED, [(header::ETAG, tag.clone())]).into_response();
    }
    match tokio::fs::read(&path).await {
        Ok(bytes) => {
            let mut response = ([(header::CONTENT_TYPE, *content_type)], bytes).into_response();
            if let Some(tag) = tag.and_then(|t| HeaderValue::from_str(&t).ok()) {
                response.headers_mut().insert(header::ETAG, tag);
            }
            response
        }
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "browser client build missing");
            (
                StatusCode::NOT_FOUND,
                format!("{file} is not built here: run scripts/build-web.sh (or pass --web-assets)\n"),
            )
                .into_response()
        }
    }
}

/// Whether `dir` holds a complete browser client build.
pub fn assets_present(dir: &FsPath) -> bool {
    PKG_FILES.iter().all(|(file, _)| dir.join(file).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_task_is_valid_and_its_token_is_not_printed() {
        let spec = demo_spec();
        let derived = spec.validate().unwrap();
        assert_eq!((spec.clients_per_round, derived.threshold), (3, 2));
        assert_eq!(spec.model.layout.len(), 7850);
        let task = DemoTask::new("t".into(), "secret-token".into(), 3);
        assert!(!format!("{task:?}").contains("secret-token"));
        let dealt: Vec<u32> = (0..7).map(|_| task.deal_shard()).collect();
        assert_eq!(dealt, [0, 1, 2, 0, 1, 2, 0]);
    }
}
