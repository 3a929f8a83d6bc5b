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

/// Longest message a refusal keeps (in characters).
pub(super) const EXCERPT_CHARS: usize = 200;

/// Bytes of a body that is not the coordinator's read for its excerpt.
const EXCERPT_BYTES: usize = 4096;

/// The refusal in `body`: the coordinator's error, or, for a body that is
/// not one (a proxy's `403` page, an error of another API's shape), code
/// `unknown` with the start of the body as its message, so that whoever
/// reads the error learns who refused. Either way the message is made
/// [`printable`]: it ends up in logs, and the coordinator may be hostile.
pub(super) fn refusal(body: &[u8]) -> ErrorBody {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(error) if error.error != ErrorCode::Unknown || !error.message.is_empty() => {
            ErrorBody { message: printable(&error.message), ..error }
        }
        _ => {
            let start = String::from_utf8_lossy(&body[..body.len().min(EXCERPT_BYTES)]);
            ErrorBody { message: printable(&start), ..ErrorBody::default() }
        }
    }
}

/// `text` as one line of at most [`EXCERPT_CHARS`] characters: control
/// characters and those that hide or reorder text (zero-width characters,
/// bidirectional overrides and isolates) dropped, runs of whitespace
/// folded to one space, and `…` where it was cut.
pub(super) fn printable(text: &str) -> String {
    let hidden = |c: char| {
        (c.is_control() && !c.is_whitespace())
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
    };
    let mut line = String::new();
    let mut kept = 0;
    for c in text.chars().filter(|c| !hidden(*c)) {
        let c = if c.is_whitespace() { ' ' } else { c };
        if c == ' ' && (line.is_empty() || line.ends_with(' ')) {
            continue;
        }
        if kept == EXCERPT_CHARS {
            line.pop();
            line.push('…');
            break;
        }
        line.push(c);
        kept += 1;
    }
    line.truncate(line.trim_end().len());
    line
}

/// What an answer of `status` that the request does not expect means: a
/// refusal, or, for a success of another kind (a web page where the API
/// should be), an answer that is not the coordinator's.
pub(super) fn rejected(status: u16, error: ErrorBody) -> ParticipantError {
    if (200..300).contains(&status) {
        let page = if error.message.is_empty() { "an empty body".to_string() } else { error.message };
        return ParticipantError::UnexpectedReply(format!(
            "HTTP {status} is not what the coordinator's API answers here: {page}"
        ));
    }
    ParticipantError::Rejected { status, code: error.error, message: error.message }
}
