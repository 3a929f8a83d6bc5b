//! The browser pages: the admin dashboard (`/admin`), the in-tab training
//! demo (`/demo`), their scripts (`/web/*`, compiled into the binary) and
//! the browser client's build (`/web/pkg/*`: the wasm-bindgen output and
//! the demo's digits, read from the directory `scripts/build-web.sh`
//! writes).
//!
//! Every response carries a strict Content-Security-Policy: scripts only
//! from this origin (plus WebAssembly compilation), requests only to this
//! origin, no framing. The pages render server data as text, never as
//! markup.

use std::path::{Path as FsPath, PathBuf};

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Router, middleware};

use crate::http::AppState;

/// Files of `web/static`, served at `/web/{name}`.
const STATIC_FILES: &[(&str, &str, &str)] = &[
    ("admin.js", "text/javascript", include_str!("../../web/static/admin.js")),
    ("chart.js", "text/javascript", include_str!("../../web/static/chart.js")),
    ("demo.js", "text/javascript", include_str!("../../web/static/demo.js")),
    ("driver.js", "text/javascript", include_str!("../../web/static/driver.js")),
    ("worker.js", "text/javascript", include_str!("../../web/static/worker.js")),
    ("style.css", "text/css", include_str!("../../web/static/style.css")),
];
const ADMIN_PAGE: &str = include_str!("../../web/static/admin.html");
const DEMO_PAGE: &str = include_str!("../../web/static/demo.html");

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

async fn static_file(Path(name): Path<String>) -> Response {
    match STATIC_FILES.iter().find(|(file, ..)| *file == name) {
        Some((_, content_type, body)) => ([(header::CONTENT_TYPE, *content_type)], *body).into_response(),
        None => not_found(&name),
    }
}

async fn pkg_file(State(state): State<AppState>, Path(name): Path<String>) -> Response {
    // Only the known names: nothing else in (or beyond) the directory.
    let Some((file, content_type)) = PKG_FILES.iter().find(|(file, _)| *file == name) else {
        return not_found(&name);
    };
    let path = state.config.web_assets.join(file);
    match tokio::fs::read(&path).await {
        Ok(bytes) => ([(header::CONTENT_TYPE, *content_type)], bytes).into_response(),
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
