//! The admin API, called from the command-line tool.

use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use cohort_client::api::ErrorBody;
use cohort_client::participant::{Method, Request};
use cohort_client::runtime::Transport;
use cohort_client::runtime::http::HttpTransport;
use serde_json::Value;

/// How long a call is asked again while the coordinator answers `503` or
/// `429` (both say when to come back).
const RETRY_FOR: Duration = Duration::from_secs(30);

/// One admin API call; the body of a 2xx reply, an error otherwise. A
/// `503` or `429` is asked again for up to [`RETRY_FOR`].
pub(crate) fn admin(
    transport: &mut HttpTransport,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Vec<u8>> {
    let request = Request {
        method,
        path: path.into(),
        body: body.map(|b| b.to_string().into_bytes()).unwrap_or_default(),
        content_type: Some("application/json"),
        bearer: Some(token.into()),
    };
    let started = Instant::now();
    let response = loop {
        let response = transport.send(&request).map_err(|e| anyhow!("admin API: {e}"))?;
        // A replica between leaders of the task, a database that is away,
        // a rate limit: asked again after the wait the answer names.
        if matches!(response.status, 429 | 503) && started.elapsed() < RETRY_FOR {
            let asked =
                serde_json::from_slice::<ErrorBody>(&response.body).ok().and_then(|e| e.retry_after_ms);
            std::thread::sleep(Duration::from_millis(asked.unwrap_or(1_000).clamp(100, 5_000)));
            continue;
        }
        break response;
    };
    if !(200..300).contains(&response.status) {
        bail!("admin API {path}: HTTP {} {}", response.status, String::from_utf8_lossy(&response.body));
    }
    Ok(response.body)
}

/// A `GET` of the admin API, its JSON reply parsed.
pub(crate) fn admin_get<T: serde::de::DeserializeOwned>(
    transport: &mut HttpTransport,
    token: &str,
    path: &str,
) -> Result<T> {
    let body = admin(transport, token, Method::Get, path, None)?;
    serde_json::from_slice(&body).map_err(|e| anyhow!("admin API {path}: {e}"))
}
