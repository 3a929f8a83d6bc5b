//! The admin API, called from the command-line tool.

use anyhow::{Result, anyhow, bail};
use cohort_client::participant::{Method, Request};
use cohort_client::runtime::Transport;
use cohort_client::runtime::http::HttpTransport;
use serde_json::Value;

/// One admin API call; the body of a 2xx reply, an error otherwise.
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
    let response = transport.send(&request).map_err(|e| anyhow!("admin API: {e}"))?;
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
