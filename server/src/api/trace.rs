//! Request ids and request spans, so that one request can be followed
//! through the log of every replica it crosses.
//!
//! Every request gets an id in `x-request-id`: the one it came with when
//! that is a short token (at most [`MAX_ID_LEN`] characters of
//! `[A-Za-z0-9._-]`, as a balancer or a forwarding replica sets it),
//! otherwise a fresh random one. The answer carries it back, and a
//! request forwarded to another replica keeps the header, so the leader
//! logs it under the same id. Each request runs in a `request` span
//! (method, path, id) that every log line of its handler carries, and the
//! coordinator's actor enters the span of the request it serves. Only the
//! path is recorded: no query, header or body, so no credential or
//! token reaches the log.

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue};
use tower_http::request_id::PropagateRequestIdLayer;
use tower_http::trace::{DefaultOnFailure, DefaultOnResponse, TraceLayer};
use tracing::Level;

/// The header that carries a request's id.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// The longest id taken from a request.
pub const MAX_ID_LEN: usize = 64;

/// Whether `value` is an id this API keeps as it is.
fn acceptable(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_ID_LEN
        && bytes.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A fresh id: 64 random bits in hex.
fn fresh() -> HeaderValue {
    let mut bytes = [0u8; 8];
    // Not a secret: an id that repeats only confuses the log.
    let _ = getrandom::fill(&mut bytes);
    HeaderValue::from_str(&hex::encode(bytes)).unwrap_or(HeaderValue::from_static("0"))
}

/// Gives `request` an acceptable id (its own, or a fresh one).
async fn set_id(mut request: Request) -> Request {
    if !request.headers().get(REQUEST_ID).is_some_and(acceptable) {
        request.headers_mut().insert(REQUEST_ID, fresh());
    }
    request
}

/// The span a request runs in. Its level is `ERROR` so that it is enabled
/// whenever any line in it is logged (a span below the log's level would
/// leave a warning without its request); spans print no lines of their
/// own, only their fields on the lines within them.
fn span(request: &Request) -> tracing::Span {
    let id = request.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("");
    tracing::error_span!("request", method = %request.method(), path = %request.uri().path(), id = %id)
}

/// Wraps `router` so that every request has an id, runs in its span and
/// answers with its id. Responses are logged at debug level (failures
/// too: a replica between leaders answers many `503`s, which the
/// balancer retries).
pub fn layer(router: Router) -> Router {
    router
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(span)
                .on_request(())
                .on_response(DefaultOnResponse::new().level(Level::DEBUG))
                .on_failure(DefaultOnFailure::new().level(Level::DEBUG)),
        )
        .layer(axum::middleware::map_request(set_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_tokens_are_kept_and_anything_else_is_replaced() {
        for kept in ["a1b2c3", "req-7.x_9", &"x".repeat(MAX_ID_LEN)] {
            assert!(acceptable(&HeaderValue::from_str(kept).unwrap()), "{kept}");
        }
        for refused in ["", "has space", "semi;colon", "new\tline", &"x".repeat(MAX_ID_LEN + 1)] {
            assert!(!acceptable(&HeaderValue::from_str(refused).unwrap()), "{refused:?}");
        }
        let id = fresh();
        assert!(acceptable(&id) && id.len() == 16, "{id:?}");
        assert_ne!(fresh(), fresh());
    }
}
