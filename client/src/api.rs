//! The client API's wire contract, defined once for both sides: the
//! coordinator (`cohort-server`) serves it and every participant (through
//! [`crate::participant::Participant`]) speaks it. Routes, the stage
//! messages' content type, the JSON replies a participant reads and the
//! error body with its [`ErrorCode`]s.

use serde::{Deserialize, Serialize};

use cohort_crypto::policy::TaskSecurity;

/// Content type of binary stage messages.
pub const SECAGG_CONTENT_TYPE: &str = "application/x-cohort-secagg";

/// The client API's routes (axum's path syntax where a route has a
/// parameter).
pub mod routes {
    /// `POST`: enroll in a task (`{id}` is the task's id).
    pub const ENROLL: &str = "/v1/tasks/{id}/enroll";
    /// `POST`: check in; the reply is a [`CheckIn`](super::CheckIn). In an
    /// async task, a client with a finished update checks in with
    /// `?trained_on=VERSION`, the model version it trained from.
    pub const CHECK_IN: &str = "/v1/checkin";

    /// `POST`: the client leaves: it is no longer selected, and no stage of
    /// a round it is in waits for it (`204`; enroll again to come back).
    pub const LEAVE: &str = "/v1/leave";

    /// The check-in path of a client whose update, trained from model
    /// version `base`, is ready for an async task's next group.
    pub fn check_in_trained(base: u64) -> String {
        format!("{CHECK_IN}?trained_on={base}")
    }

    /// The longest a coordinator holds a request that asks it to wait
    /// (`wait_ms`), in milliseconds: inside the client library's 30 s for
    /// an answer and the 60 s that balancers and proxies allow by default.
    pub const MAX_WAIT_MS: u64 = 20_000;

    /// `path` (a check-in, or the `GET` of a stage message) asking the
    /// coordinator to hold the request for up to `wait_ms` until its answer
    /// is no longer "wait" (a round starts, the stage closes): one request
    /// where a client would otherwise poll. `0` asks for an answer at once.
    pub fn held(path: &str, wait_ms: u64) -> String {
        if wait_ms == 0 {
            return path.to_string();
        }
        let separator = if path.contains('?') { '&' } else { '?' };
        format!("{path}{separator}wait_ms={}", wait_ms.min(MAX_WAIT_MS))
    }
    /// `GET`: the current global model (safetensors).
    pub const MODEL: &str = "/v1/model";
    /// `GET`: the server message of the client's current stage; `POST`:
    /// the client's stage message.
    pub const ROUND_MESSAGE: &str = "/v1/round/message";
    /// `POST`: plaintext metrics (tasks that ask for them only).
    pub const METRICS: &str = "/v1/metrics";

    /// The enrollment path of `task`.
    pub fn enroll(task: &str) -> String {
        ENROLL.replace("{id}", task)
    }
}

/// Reply to enrollment. The credential is shown only here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Enrolled {
    /// Participant id.
    pub participant_id: String,
    /// Bearer credential for the client API.
    pub credential: String,
    /// Expiry (Unix ms).
    pub expires_at: i64,
    /// The task's security parameters, which every round repeats: the
    /// participant checks them against its policy and pins them.
    pub security: TaskSecurity,
}

/// What a client is told when it checks in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum CheckIn {
    /// Not selected (yet); check in again after this long.
    Wait {
        /// Suggested delay.
        retry_after_ms: u64,
    },
    /// Selected for the round in progress.
    Selected {
        /// Round number.
        round: u64,
        /// The client's id in this round's roster.
        client_id: u32,
        /// Attempt at this round: an aborted round runs again with the
        /// same number and a new attempt.
        #[serde(default)]
        attempt: u32,
        /// The round's session id (hex): unique to this attempt, also
        /// across restarts of the coordinator. Always sent; older
        /// coordinators did not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session: Option<String>,
        /// The task (semi-honest only) also takes each client's metrics in
        /// the clear.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        plaintext_metrics: bool,
        /// An async task's group: the weight, in (0, 1], the client
        /// multiplies its update by before it is masked (its staleness
        /// discount, (1 + s)^−a for an update s versions stale).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        staleness_weight: Option<f64>,
    },
    /// An async task: download the global model and train on it, then
    /// check in with `?trained_on=` the version downloaded.
    Train {
        /// The current model version (the model endpoint may already serve
        /// a newer one; the version downloaded is the one that counts).
        version: u64,
    },
    /// An async task refused the finished update: it is more than the
    /// task's staleness bound behind the current model. Drop it and check
    /// in again to train on the current model.
    Stale {
        /// The current model version.
        version: u64,
        /// The task's bound on staleness, in versions.
        max_staleness: u32,
    },
    /// The task is over; stop checking in.
    Finished,
}

/// Why the API refused a request: the stable `error` field of every
/// refusal's body. A participant matches these, never the message.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::EnumIter, strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// A body that is not valid for the endpoint.
    InvalidBody,
    /// JSON that does not parse or has unknown fields.
    InvalidJson,
    /// A task specification the coordinator refuses.
    InvalidTask,
    /// An enrollment's identity key or proof is malformed or wrong.
    InvalidIdentity,
    /// An active task's enrollment without an identity key.
    IdentityRequired,
    /// A metrics report that is malformed.
    InvalidMetrics,
    /// The participant was excluded from the task: the sums of groups it
    /// was in did not match their members' commitments until it was the
    /// one suspect left (a validated task). It is never selected again.
    Excluded,
    /// A round number that is not valid here.
    InvalidRound,
    /// A query string the endpoint does not take.
    InvalidQuery,
    /// An enrollment-token request that is malformed.
    InvalidTokenRequest,
    /// A project, key or quota request that is malformed.
    InvalidProjectRequest,
    /// No credential or token, or a wrong one.
    Unauthorized,
    /// The credential has expired: enroll again.
    CredentialExpired,
    /// The enrollment token was revoked.
    TokenRevoked,
    /// The caller's key may not do this: its role is too low, or only the
    /// deployment's admin token may.
    Forbidden,
    /// No such record.
    NotFound,
    /// No such task, or it is not running.
    TaskNotFound,
    /// The task is paused, stopped or completed.
    TaskInactive,
    /// The write conflicts with what is stored.
    Conflict,
    /// The client is not part of the round in progress.
    NotSelected,
    /// The client is not part of that round, or it is not recent.
    NotInRound,
    /// The task takes metrics only in aggregate.
    PlaintextMetricsOff,
    /// The client missed a stage and is no longer in the round.
    Dropped,
    /// A stage message that does not decode.
    MalformedMessage,
    /// A stage message of another round.
    WrongRound,
    /// A stage message for a stage that is not collecting.
    OutOfPhase,
    /// The client already sent this stage's message.
    Duplicate,
    /// The client may not send in this stage.
    NotEligible,
    /// A stage message that fails a cryptographic check.
    CryptoFailure,
    /// A stage message the protocol refuses otherwise.
    InvalidMessage,
    /// A body of the wrong content type.
    UnsupportedMediaType,
    /// A body over the endpoint's limit.
    PayloadTooLarge,
    /// The body did not arrive in time.
    RequestTimeout,
    /// Too many requests: wait `retry_after_ms`.
    RateLimited,
    /// The coordinator holds as many tasks or parameters as it may.
    CapacityExceeded,
    /// The project holds as many unfinished tasks or parameters as its
    /// quota allows (the message names the quota).
    QuotaExceeded,
    /// The database cannot be reached, or the coordinator is shutting
    /// down: retry later.
    Unavailable,
    /// The coordinator failed.
    Internal,
    /// A code this build does not know (from a newer coordinator).
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// Every code, derived from the enum (the OpenAPI document lists them;
    /// a test checks each against its serialized name).
    pub fn all() -> impl Iterator<Item = ErrorCode> {
        <Self as strum::IntoEnumIterator>::iter()
    }

    /// The code as it travels in the `error` field.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// The HTTP status of a refusal with this code: one table for the
    /// coordinator. The one exception is `task_inactive`, a `409` for an
    /// enrollment or an admin change, and a `410` for a round request about
    /// a task that is over.
    pub fn status(self) -> u16 {
        use ErrorCode::*;
        match self {
            InvalidBody
            | InvalidJson
            | InvalidTask
            | InvalidIdentity
            | IdentityRequired
            | InvalidMetrics
            | InvalidRound
            | InvalidQuery
            | InvalidTokenRequest
            | InvalidProjectRequest
            | MalformedMessage => 400,
            Unauthorized | CredentialExpired | TokenRevoked => 401,
            PlaintextMetricsOff | Excluded | Forbidden => 403,
            NotFound | TaskNotFound => 404,
            RequestTimeout => 408,
            TaskInactive | Conflict | NotSelected | NotInRound | WrongRound | OutOfPhase | Duplicate
            | NotEligible => 409,
            Dropped => 410,
            PayloadTooLarge => 413,
            UnsupportedMediaType => 415,
            CryptoFailure | InvalidMessage | CapacityExceeded | QuotaExceeded => 422,
            RateLimited => 429,
            Internal | Unknown => 500,
            Unavailable => 503,
        }
    }
}

/// The codes a coordinator sends: every variant but [`ErrorCode::Unknown`],
/// which only a client reading a newer coordinator's code ever holds.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for ErrorCode {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(
                ErrorCode::all().filter(|code| *code != ErrorCode::Unknown).map(ErrorCode::as_str),
            ))
            .description(Some("The stable reason: clients match this, never the message"))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for ErrorCode {}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The body of every refusal: `{"error": code, "message": text}`, with
/// `retry_after_ms` where the client should come back (a `429` or `503`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// The stable code.
    pub error: ErrorCode,
    /// A human-readable explanation (never matched on).
    #[serde(default)]
    pub message: String,
    /// How long to wait before trying again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl Default for ErrorBody {
    fn default() -> Self {
        Self { error: ErrorCode::Unknown, message: String::new(), retry_after_ms: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_serializes_as_its_name_and_back() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::all() {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, code.as_str(), "{code:?}");
            assert_eq!(serde_json::from_value::<ErrorCode>(json).unwrap(), code);
            assert!(seen.insert(code.as_str()), "{code:?} repeats a name");
        }
        assert_eq!(seen.len(), 39, "every variant, the unknown one included");
    }

    /// The statuses clients and the API document rely on: retryable
    /// refusals are 429 and 503 and nothing else; a client's own mistakes
    /// are 4xx; only the coordinator's failures are 5xx.
    #[test]
    fn every_code_has_the_status_clients_rely_on() {
        for code in ErrorCode::all() {
            let status = code.status();
            let retryable = matches!(code, ErrorCode::RateLimited | ErrorCode::Unavailable);
            assert_eq!(matches!(status, 429 | 503), retryable, "{code:?}: {status}");
            let server = matches!(code, ErrorCode::Internal | ErrorCode::Unknown | ErrorCode::Unavailable);
            assert_eq!(status >= 500, server, "{code:?}: {status}");
            assert!((400..600).contains(&status), "{code:?}: {status}");
        }
        let pinned = [
            (ErrorCode::InvalidJson, 400),
            (ErrorCode::CredentialExpired, 401),
            (ErrorCode::PlaintextMetricsOff, 403),
            (ErrorCode::Excluded, 403),
            (ErrorCode::NotFound, 404),
            (ErrorCode::RequestTimeout, 408),
            (ErrorCode::NotSelected, 409),
            (ErrorCode::Dropped, 410),
            (ErrorCode::PayloadTooLarge, 413),
            (ErrorCode::UnsupportedMediaType, 415),
            (ErrorCode::CapacityExceeded, 422),
            (ErrorCode::InvalidProjectRequest, 400),
            (ErrorCode::Forbidden, 403),
            (ErrorCode::QuotaExceeded, 422),
        ];
        for (code, status) in pinned {
            assert_eq!(code.status(), status, "{code:?}");
        }
    }

    #[test]
    fn an_unknown_code_or_a_bare_body_still_parses() {
        let body: ErrorBody =
            serde_json::from_str(r#"{"error": "quota_exhausted", "message": "m", "extra": 1}"#).unwrap();
        assert_eq!((body.error, body.message.as_str(), body.retry_after_ms), (ErrorCode::Unknown, "m", None));
        let body: ErrorBody =
            serde_json::from_str(r#"{"error": "rate_limited", "retry_after_ms": 250}"#).unwrap();
        assert_eq!((body.error, body.retry_after_ms), (ErrorCode::RateLimited, Some(250)));
    }

    #[test]
    fn check_in_replies_round_trip_and_older_replies_parse() {
        let selected = CheckIn::Selected {
            round: 3,
            client_id: 2,
            attempt: 1,
            session: Some("ab".into()),
            plaintext_metrics: false,
            staleness_weight: None,
        };
        let json = serde_json::to_value(&selected).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"status": "selected", "round": 3, "client_id": 2, "attempt": 1, "session": "ab"})
        );
        assert_eq!(serde_json::from_value::<CheckIn>(json).unwrap(), selected);
        let older: CheckIn =
            serde_json::from_str(r#"{"status": "selected", "round": 1, "client_id": 4}"#).unwrap();
        assert_eq!(
            older,
            CheckIn::Selected {
                round: 1,
                client_id: 4,
                attempt: 0,
                session: None,
                plaintext_metrics: false,
                staleness_weight: None
            }
        );
        let train = serde_json::to_value(CheckIn::Train { version: 7 }).unwrap();
        assert_eq!(train, serde_json::json!({"status": "train", "version": 7}));
        let stale: CheckIn =
            serde_json::from_str(r#"{"status": "stale", "version": 9, "max_staleness": 2}"#).unwrap();
        assert_eq!(stale, CheckIn::Stale { version: 9, max_staleness: 2 });
        assert_eq!(routes::check_in_trained(4), "/v1/checkin?trained_on=4");
        assert_eq!(routes::enroll("t-1"), "/v1/tasks/t-1/enroll");
    }
}
