//! What a handler takes from a request before its body: the admin token,
//! a client credential, a valid task id, the peer's address; bodies read
//! within a limit; the rate limits.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, FromRequest, FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use cohort_client::api::ErrorCode;
use http_body_util::BodyExt;

use super::auth::token_hash;
use super::error::{ApiError, ApiResult};
use super::listener::SlowBody;
use super::ratelimit::Call;
use super::state::AppState;
use crate::coordinator::now_ms;
use crate::store::{ParticipantRecord, StoreError};

pub(super) fn bearer(parts: &Parts) -> Option<&str> {
    bearer_of(&parts.headers)
}

/// The bearer token of an `Authorization` header.
pub(crate) fn bearer_of(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ")
}

/// The address the listener recorded for a request's connection, from the
/// request's extensions.
pub(crate) fn peer_of(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions.get::<ConnectInfo<SocketAddr>>().map(|info| info.0.ip())
}

/// The caller is an enrolled participant with an unexpired credential.
pub struct Authenticated(pub ParticipantRecord);

impl FromRequestParts<AppState> for Authenticated {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let unauthorized = || ApiError::new(ErrorCode::Unauthorized, "a valid client credential is required");
        let token = bearer(parts).ok_or_else(unauthorized)?;
        let hash = token_hash(token);
        // Looked up already by the routing to the task's replica.
        let known = parts.extensions.remove::<crate::cluster::forward::KnownParticipant>();
        let participant = match known {
            Some(crate::cluster::forward::KnownParticipant { credential_hash, participant })
                if credential_hash == hash =>
            {
                participant
            }
            _ => match state.store.participant_by_credential(&hash).await {
                Ok(p) => p,
                Err(StoreError::NotFound(_)) => return Err(unauthorized()),
                Err(e) => return Err(e.into()),
            },
        };
        if participant.expires_at <= now_ms() {
            return Err(ApiError::new(ErrorCode::CredentialExpired, "the client credential has expired"));
        }
        Ok(Authenticated(participant))
    }
}

/// A request body, with its rejections (too large, too slow, unreadable)
/// turned into the API's JSON errors.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(request, state).await.map(RawBody).map_err(|rejection| {
            let status = rejection.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                return ApiError::with_status(status, ErrorCode::PayloadTooLarge, rejection.body_text());
            }
            too_slow(&rejection).unwrap_or_else(|| {
                ApiError::with_status(status, ErrorCode::InvalidBody, rejection.body_text())
            })
        })
    }
}

/// The `408` for a body that failed because it arrived too slowly.
fn too_slow(error: &(dyn std::error::Error + 'static)) -> Option<ApiError> {
    find_source::<SlowBody>(error).map(|slow| ApiError::new(ErrorCode::RequestTimeout, slow.to_string()))
}

/// The first error of type `E` in `error`'s chain of sources.
fn find_source<'a, E: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a E> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(found) = error.downcast_ref::<E>() {
            return Some(found);
        }
        next = error.source();
    }
    None
}

/// A request body read a frame at a time, no further than its limit: a
/// declared length over the limit is refused before anything is read, a
/// longer body as soon as it passes the limit; a body that arrives too
/// slowly is a `408`.
pub(super) struct LimitedBody {
    body: Body,
    declared: Option<usize>,
    read: usize,
    limit: usize,
}

impl LimitedBody {
    pub(super) fn new(headers: &HeaderMap, body: Body, limit: usize) -> ApiResult<Self> {
        let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|length| length > limit as u64) {
            return Err(Self::too_large(limit));
        }
        Ok(Self { body, declared: declared.map(|length| length as usize), read: 0, limit })
    }

    fn too_large(limit: usize) -> ApiError {
        ApiError::new(ErrorCode::PayloadTooLarge, format!("this message may be at most {limit} bytes"))
    }

    /// The length the request declared, if it did.
    pub(super) fn declared(&self) -> Option<usize> {
        self.declared
    }

    /// The next bytes of the body, or `None` at its end.
    pub(super) async fn next(&mut self) -> ApiResult<Option<Bytes>> {
        loop {
            let Some(frame) = self.body.frame().await else { return Ok(None) };
            let frame = frame.map_err(|error| {
                too_slow(&error).unwrap_or_else(|| {
                    ApiError::new(ErrorCode::InvalidBody, "the request body could not be read")
                })
            })?;
            // Trailers carry nothing a stage message needs.
            let Ok(data) = frame.into_data() else { continue };
            self.read += data.len();
            if self.read > self.limit {
                return Err(Self::too_large(self.limit));
            }
            return Ok(Some(data));
        }
    }
}

/// A task id from the path: 32 lowercase hex digits, as [`new_id`](super::auth::new_id) makes
/// them. Anything else is an unknown task, answered without a database
/// query (so bytes no database column takes, such as NUL, never reach one).
pub struct TaskId(pub String);

/// A JSON request body as `T`, refused with `400 invalid_json` and serde's
/// reason. A number without a fractional part counts as an integer, as
/// JSON Schema's `integer` says (`3.0` is the integer 3, as Python's
/// `json` writes a float that holds one), so a field the document types
/// `integer` takes it; any other number stays as it was.
pub fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let invalid = |e: serde_json::Error| ApiError::new(ErrorCode::InvalidJson, e.to_string());
    let UniqueKeys(mut value) = serde_json::from_slice(body).map_err(invalid)?;
    // Every body of the API is an object: serde would also read a struct
    // from an array of its fields in order (`[null, null]` for a body whose
    // fields are all optional), which the document does not allow.
    if !value.is_object() {
        return Err(ApiError::new(ErrorCode::InvalidJson, "the body must be a JSON object"));
    }
    integral_numbers(&mut value);
    serde_json::from_value(value).map_err(invalid)
}

/// A JSON value in which no object names a key twice: read into a
/// `serde_json::Value`, a repeated key would keep its last value, so that
/// `"variant":"semi-honest","variant":"active"` would mean whichever a
/// reader of the JSON did not look at. Refused instead.
struct UniqueKeys(serde_json::Value);

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UniqueKeysVisitor).map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value whose objects name each key once")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        // JSON has no infinities or NaN; a finite f64 always converts.
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(UniqueKeys(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let UniqueKeys(value) = map.next_value()?;
            if fields.contains_key(&key) {
                return Err(serde::de::Error::custom(format!("duplicate key `{key}`")));
            }
            fields.insert(key, value);
        }
        Ok(serde_json::Value::Object(fields))
    }
}

/// Turns every number of `value` that is an integer written as a float
/// into that integer (where an `i64` or `u64` holds it).
fn integral_numbers(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Number(number) => {
            if let Some(float) = number.as_f64().filter(|f| number.is_f64() && f.fract() == 0.0) {
                // 2^63 and 2^64, exactly: an integral f64 below them
                // converts to an i64 or a u64 without rounding.
                let (two_63, two_64) = (-(i64::MIN as f64), u64::MAX as f64);
                if (-two_63..two_63).contains(&float) {
                    *number = (float as i64).into();
                } else if (0.0..two_64).contains(&float) {
                    *number = (float as u64).into();
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_numbers),
        Value::Object(fields) => fields.values_mut().for_each(integral_numbers),
        Value::Null | Value::Bool(_) | Value::String(_) => {}
    }
}

/// A number in a path or a query as the OpenAPI document writes them:
/// decimal digits without a sign or a leading zero, at most `i64::MAX`
/// (what the store keeps); `None` for anything else.
pub fn decimal(text: &str) -> Option<u64> {
    let canonical = text.bytes().all(|b| b.is_ascii_digit()) && (text == "0" || !text.starts_with('0'));
    text.parse::<u64>().ok().filter(|number| canonical && *number <= i64::MAX as u64)
}

/// Whether `id` has the form of the ids [`new_id`](super::auth::new_id) makes.
pub fn is_valid_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl<S: Send + Sync> FromRequestParts<S> for TaskId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let not_found = || ApiError::new(ErrorCode::NotFound, "task not found");
        let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|_| not_found())?;
        match params.get("id") {
            Some(id) if is_valid_id(id) => Ok(TaskId(id.clone())),
            _ => Err(not_found()),
        }
    }
}

/// The network address of the caller, where the listener recorded it, or
/// the one a forwarding replica vouched for ([`crate::cluster::forward`]).
pub struct PeerAddress(pub Option<IpAddr>);

impl FromRequestParts<AppState> for PeerAddress {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let connection = peer_of(&parts.extensions);
        Ok(PeerAddress(state.forwarder.client_address(&parts.headers).or(connection)))
    }
}

pub(super) fn limit(
    state: &AppState,
    call: Call,
    address: Option<IpAddr>,
    participant: Option<&str>,
) -> ApiResult<()> {
    state.config.limiters.check(call, address, participant).map_err(ApiError::rate_limited)
}

#[cfg(test)]
mod tests {
    use super::{decimal, json_body};

    #[test]
    fn numbers_in_paths_and_queries_are_plain_decimals() {
        assert_eq!(decimal("0"), Some(0));
        assert_eq!(decimal("42"), Some(42));
        assert_eq!(decimal("9223372036854775807"), Some(i64::MAX as u64));
        for bad in ["", "+5", "-1", "05", "00", "1.0", "1e3", " 1", "9223372036854775808", "x"] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        count: u32,
        big: u64,
        share: f64,
        items: Vec<i64>,
    }

    #[test]
    fn a_key_named_twice_in_any_object_is_refused() {
        // A struct is not read from an array of its fields, nor from any
        // other value than an object.
        for not_an_object in ["[1, 2, 0.5, []]", "[]", "null", "3", "\"x\""] {
            let error = json_body::<Body>(not_an_object.as_bytes()).unwrap_err();
            assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST, "{not_an_object}");
        }
        let error = json_body::<Body>(br#"{"count": 1, "count": 2, "big": 2, "share": 0.5, "items": []}"#)
            .unwrap_err();
        assert!(error.to_string().contains("duplicate key `count`"), "{error}");
        let nested = br#"{"a": [{"b": 1, "c": {"d": true, "d": false}}]}"#;
        let error = json_body::<serde_json::Value>(nested).unwrap_err();
        assert!(error.to_string().contains("duplicate key `d`"), "{error}");
        // The same key in sibling objects, and every kind of value, pass.
        let fine = br#"{"a": [{"k": 1}, {"k": -2.5}], "b": {"k": null}, "c": "s", "d": false, "e": 18446744073709551615}"#;
        let value = json_body::<serde_json::Value>(fine).unwrap();
        let _array_inside = json_body::<serde_json::Value>(br#"{"a": [[1], [2]]}"#).unwrap();
        assert_eq!(value, serde_json::from_slice::<serde_json::Value>(fine).unwrap());
    }

    #[test]
    fn an_integer_written_as_a_float_is_the_integer_and_nothing_else_changes() {
        let body: Body =
            json_body(br#"{"count": 3.0, "big": 1e15, "share": 2.0, "items": [-4.0, 5]}"#).unwrap();
        assert_eq!(body, Body { count: 3, big: 1_000_000_000_000_000, share: 2.0, items: vec![-4, 5] });
        let share: Body = json_body(br#"{"count": 1, "big": 2, "share": 0.1, "items": []}"#).unwrap();
        assert_eq!(share.share, 0.1);
        for refused in [
            r#"{"count": 3.5, "big": 1, "share": 0, "items": []}"#,
            r#"{"count": 4294967296.0, "big": 1, "share": 0, "items": []}"#,
            r#"{"count": 1, "big": 1e20, "share": 0, "items": []}"#,
            r#"{"count": -1.0, "big": 1, "share": 0, "items": []}"#,
            r#"{"count": 1, "big": 1, "share": 0, "items": [], "more": 1}"#,
            r#"{"count": 1"#,
        ] {
            let error = json_body::<Body>(refused.as_bytes()).unwrap_err();
            assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST, "{refused}");
        }
    }
}
