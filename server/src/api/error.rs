//! The API's one error form: a status, a stable [`ErrorCode`] and a
//! message, as the contract's [`ErrorBody`] `{"error": code, "message":
//! text}`, with `Retry-After` where the client should come back.

use std::time::Duration;

use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use cohort_client::api::{ErrorBody, ErrorCode};
use cohort_crypto::ProtocolError;

use super::DATABASE_RETRY;
use crate::coordinator::CoordinatorError;
use crate::round::{EngineError, TaskError};
use crate::store::StoreError;

/// A refused request.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
    retry_after: Option<Duration>,
}

impl ApiError {
    /// A refusal with `code`, at its status ([`ErrorCode::status`]).
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let status = StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self::with_status(status, code, message)
    }

    /// A refusal with `code` at another status than its own: a body
    /// rejection's (axum's), or a round request's `410` for a finished task.
    pub(crate) fn with_status(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None }
    }

    /// Tells the client to retry after `wait` (`Retry-After` and
    /// `retry_after_ms`).
    pub(crate) fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// A `429`: the caller should wait `wait`.
    pub(super) fn rate_limited(wait: Duration) -> Self {
        let message = format!("too many requests; retry in {} ms", wait.as_millis().max(1));
        Self::new(ErrorCode::RateLimited, message).retry_after(wait)
    }

    /// A `503`: the database cannot be reached.
    fn database_unavailable() -> Self {
        Self::new(ErrorCode::Unavailable, "the database is unavailable or overloaded; retry later")
            .retry_after(DATABASE_RETRY)
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable reason.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The explanation.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The body the refusal is sent with, its retry hint `retry` unless it
    /// has one of its own.
    pub(super) fn body(&self, retry: Duration) -> ErrorBody {
        let retry_after_ms = u64::try_from(self.retry_after.unwrap_or(retry).as_millis()).unwrap_or(u64::MAX);
        ErrorBody {
            error: self.code,
            message: self.message.clone(),
            retry_after_ms: Some(retry_after_ms.max(1)),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.code, self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after_ms =
            self.retry_after.map(|wait| u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1));
        let body = ErrorBody { error: self.code, message: self.message, retry_after_ms };
        let mut response = match retry_after_ms {
            Some(ms) => {
                let seconds = ms.div_ceil(1000).to_string();
                (self.status, [(header::RETRY_AFTER, seconds)], Json(body)).into_response()
            }
            None => (self.status, Json(body)).into_response(),
        };
        if self.status == StatusCode::REQUEST_TIMEOUT || self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is not read: the connection cannot be reused.
            response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound(what) => ApiError::new(ErrorCode::NotFound, format!("{what} not found")),
            StoreError::Conflict(why) => ApiError::new(ErrorCode::Conflict, why),
            StoreError::Revoked => {
                ApiError::new(ErrorCode::TokenRevoked, "this enrollment token was revoked")
            }
            other if other.is_unavailable() => {
                // One line per request would flood the log during an outage;
                // /readyz reports it at warn level.
                tracing::debug!(error = %other, "database unavailable");
                ApiError::database_unavailable()
            }
            other => {
                tracing::error!(error = %other, "storage failure");
                ApiError::new(ErrorCode::Internal, "internal error")
            }
        }
    }
}

impl From<CoordinatorError> for ApiError {
    fn from(error: CoordinatorError) -> Self {
        match error {
            // The task exists (the routing found it) but this replica does
            // not run it (any more): its lead is moving, which a retry
            // outlives. A task that does not exist is the store's 404.
            CoordinatorError::UnknownTask => ApiError::new(
                ErrorCode::Unavailable,
                "this replica does not lead the task (its lead is moving); retry",
            )
            .retry_after(crate::cluster::forward::BETWEEN_LEADERS),
            CoordinatorError::Store(e) => e.into(),
            CoordinatorError::Task(e) => e.into(),
            CoordinatorError::Unavailable => ApiError::new(ErrorCode::Unavailable, "shutting down"),
            CoordinatorError::Engine(EngineError::NotSelected) => {
                ApiError::new(ErrorCode::NotSelected, "this client is not part of the round in progress")
            }
            // Gone, as a client dropped from a round is told, with the
            // reason its attempt failed.
            CoordinatorError::Engine(EngineError::Failed(reason)) => {
                ApiError::new(ErrorCode::Dropped, reason)
            }
            CoordinatorError::Engine(EngineError::NotInRound(round)) => ApiError::new(
                ErrorCode::NotInRound,
                format!("this client is not part of round {round}, or the round is not recent"),
            ),
            CoordinatorError::Engine(EngineError::PlaintextMetricsOff) => ApiError::new(
                ErrorCode::PlaintextMetricsOff,
                "this task takes clients' metrics only in aggregate, inside the masked inputs",
            ),
            CoordinatorError::Engine(error @ EngineError::Excluded) => {
                ApiError::new(ErrorCode::Excluded, error.to_string())
            }
            CoordinatorError::Engine(EngineError::Inactive(status)) => {
                ApiError::new(ErrorCode::TaskInactive, format!("the task is {}", status.as_str()))
            }
            CoordinatorError::Engine(EngineError::Elsewhere(_)) => ApiError::new(
                ErrorCode::Unavailable,
                "this client's group is run by another replica that is not reachable yet; retry",
            )
            .retry_after(std::time::Duration::from_millis(500)),
            CoordinatorError::Engine(EngineError::Spool) => ApiError::new(
                ErrorCode::Unavailable,
                "the server could not keep this message's bytes; send it again",
            )
            .retry_after(crate::cluster::forward::BETWEEN_LEADERS),
            CoordinatorError::Engine(EngineError::Protocol(p)) => {
                let code = match &p {
                    ProtocolError::Decode(_) => ErrorCode::MalformedMessage,
                    ProtocolError::WrongRound => ErrorCode::WrongRound,
                    ProtocolError::OutOfPhase { .. } => ErrorCode::OutOfPhase,
                    ProtocolError::Duplicate(_) => ErrorCode::Duplicate,
                    ProtocolError::NotEligible { .. } => ErrorCode::NotEligible,
                    ProtocolError::Crypto(_) => ErrorCode::CryptoFailure,
                    _ => ErrorCode::InvalidMessage,
                };
                ApiError::new(code, p.to_string())
            }
        }
    }
}

impl From<TaskError> for ApiError {
    fn from(error: TaskError) -> Self {
        match error {
            TaskError::Spec(e) => ApiError::new(ErrorCode::InvalidTask, e.to_string()),
            other => {
                tracing::error!(error = %other, "task fault");
                ApiError::new(ErrorCode::Internal, "internal error")
            }
        }
    }
}

pub(super) type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::SpecError;

    #[test]
    fn a_bad_spec_is_the_callers_error_and_any_other_task_fault_the_servers() {
        let error = ApiError::from(CoordinatorError::Task(TaskError::Spec(SpecError::field(
            "rounds",
            "rounds must be > 0",
        ))));
        assert_eq!((error.status(), error.code), (StatusCode::BAD_REQUEST, ErrorCode::InvalidTask));
        assert!(error.message.contains("rounds must be > 0"), "{error}");
        for fault in [TaskError::LayoutMismatch, TaskError::NoSuchRound(3)] {
            let error = ApiError::from(fault);
            assert_eq!(
                (error.status(), error.code),
                (StatusCode::INTERNAL_SERVER_ERROR, ErrorCode::Internal)
            );
            // The internals stay in the log.
            assert_eq!(error.message, "internal error");
        }
    }
}
