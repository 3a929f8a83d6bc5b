//! The client API as the participant speaks it: requests and responses
//! (the replies' types are the shared contract's, [`crate::api`]).

pub(super) use crate::api::{CheckIn, Enrolled, ErrorBody, ErrorCode, SECAGG_CONTENT_TYPE, routes};

use super::ParticipantError;

/// HTTP method of a [`Request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// GET.
    Get,
    /// POST.
    Post,
}

/// A request to the coordinator's client API.
#[derive(Clone, PartialEq, Eq)]
pub struct Request {
    /// Method.
    pub method: Method,
    /// Path and query, starting with `/`.
    pub path: String,
    /// Body (empty for GET).
    pub body: Vec<u8>,
    /// Content type of the body.
    pub content_type: Option<&'static str>,
    /// Bearer credential to present.
    pub bearer: Option<String>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("body_len", &self.body.len())
            .finish_non_exhaustive()
    }
}

/// The coordinator's reply to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Response {
    /// HTTP status.
    pub status: u16,
    /// Body.
    pub body: Vec<u8>,
}

/// Longest wait a server's `retry_after_ms` can impose at once.
pub(super) const MAX_RETRY_AFTER_MS: u64 = 300_000;

pub(super) fn get(path: &str, bearer: Option<String>) -> Request {
    Request { method: Method::Get, path: path.into(), body: Vec::new(), content_type: None, bearer }
}

pub(super) fn post_json(path: String, body: Vec<u8>, bearer: Option<String>) -> Request {
    Request { method: Method::Post, path, body, content_type: Some("application/json"), bearer }
}

pub(super) fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ParticipantError> {
    serde_json::from_slice(body).map_err(|e| ParticipantError::UnexpectedReply(e.to_string()))
}

pub(super) fn rejected(status: u16, error: ErrorBody) -> ParticipantError {
    ParticipantError::Rejected { status, code: error.error, message: error.message }
}
