//! The client API: enrollment, check-in, the global model, the stage
//! messages and the plaintext metric reports of semi-honest tasks.

use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cohort_crypto::messages::{MASKED_INPUT_HEADER_LEN, starts_masked_input, starts_unmasking};
use cohort_crypto::signature::{SIGNATURE_LEN, enrollment_statement, verify};
use serde::{Deserialize, Serialize};

use super::auth::{new_id, new_token, token_hash};
use super::error::{ApiError, ApiResult};
use super::extract::{Authenticated, LimitedBody, PeerAddress, RawBody, TaskId, decimal, json_body, limit};
use super::openapi::{Binary, Refused, RetryLater, TaskPath};
use super::ratelimit::{Call, Rate};
use super::state::AppState;
use super::{SAFETENSORS_CONTENT_TYPE, SECAGG_CONTENT_TYPE};
use crate::cluster::Whereabouts;
use crate::coordinator::{Admission, CoordinatorError, now_ms};
use crate::metrics::Upload;
use crate::round::{CheckIn, InputStep, Poll};
use crate::store::{ClientMetricsRecord, ParticipantRecord, StoreError};
use cohort_client::api::{Enrolled, ErrorBody, ErrorCode, routes};

/// An enrollment: the task's enrollment token and, for an active task (or
/// any participant that wants to be recognised by its key), an identity
/// key with its proof; the two come together or not at all.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct EnrollRequest {
    /// The token the task's administrator gave the application (64 hex
    /// digits; any other string is simply not a token: `401`). Bounded, so
    /// that every schema-valid request fits the client API's JSON limit.
    #[schema(pattern = "^[0-9a-f]{64}$", max_length = 64)]
    enrollment_token: String,
    /// The participant's Ed25519 identity public key (64 hex digits).
    #[serde(default)]
    #[schema(pattern = "^[0-9a-fA-F]{64}$")]
    identity_key: Option<String>,
    /// Its signature over the enrollment statement (128 hex digits): proof
    /// that the participant holds the key.
    #[serde(default)]
    #[schema(pattern = "^[0-9a-fA-F]{128}$")]
    identity_proof: Option<String>,
}

/// The identity key of an enrollment, checked against its proof.
fn identity_key(task: &str, request: &EnrollRequest) -> ApiResult<Option<[u8; 32]>> {
    let invalid = |message: &str| ApiError::new(ErrorCode::InvalidIdentity, message);
    let (key, proof) = match (&request.identity_key, &request.identity_proof) {
        (None, None) => return Ok(None),
        (Some(key), Some(proof)) => (key, proof),
        _ => return Err(invalid("identity_key and identity_proof come together")),
    };
    let mut public = [0u8; 32];
    hex::decode_to_slice(key, &mut public).map_err(|_| invalid("identity_key must be 64 hex digits"))?;
    let mut signature = [0u8; SIGNATURE_LEN];
    hex::decode_to_slice(proof, &mut signature)
        .map_err(|_| invalid("identity_proof must be 128 hex digits"))?;
    verify(&public, &enrollment_statement(task, &public), &signature)
        .map_err(|_| invalid("identity_proof is not a signature of the enrollment by identity_key"))?;
    Ok(Some(public))
}

/// Enrolls a participant with the task's enrollment token; an active
/// task's participant also brings its Ed25519 identity key and proves it
/// holds it. The reply's credential is shown only here.
#[utoipa::path(
    post, path = "/v1/tasks/{id}/enroll", tag = "client", operation_id = "enroll",
    params(TaskPath),
    request_body(content = EnrollRequest),
    responses(
        (status = 201, description = "Enrolled: a credential for the client API and the task's security parameters, which the participant pins", body = Enrolled),
        (status = 400, response = Refused),
        (status = 401, description = "The enrollment token is wrong (unauthorized) or revoked (token_revoked)", body = ErrorBody),
        (status = 404, response = Refused), (status = 408, response = Refused),
        (status = 409, description = "The task is over", body = ErrorBody),
        (status = 413, response = Refused), (status = 429, response = RetryLater), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn enroll(
    State(state): State<AppState>,
    PeerAddress(address): PeerAddress,
    TaskId(id): TaskId,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Enrolled>)> {
    limit(&state, Call::Enroll, address, None)?;
    let request: EnrollRequest = json_body(&body)?;
    let task = state.store.task(&id).await?;
    // Looked up by the SHA-256 of a 256-bit random token: the hash, not the
    // token, meets the index.
    let invalid = || ApiError::new(ErrorCode::Unauthorized, "invalid enrollment token");
    let token = match state.store.enrollment_token_by_hash(&token_hash(&request.enrollment_token)).await {
        Ok(token) if token.task_id == id => token,
        Ok(_) | Err(StoreError::NotFound(_)) => return Err(invalid()),
        Err(error) => return Err(error.into()),
    };
    if token.revoked_at.is_some() {
        // Checked again where the participant is stored (a revocation
        // meanwhile): one refusal, whichever sees it.
        return Err(StoreError::Revoked.into());
    }
    let rate = token.rate.map(|(per_minute, burst)| Rate { per_minute, burst });
    state.config.limiters.check_token(&token.id, rate).map_err(ApiError::rate_limited)?;
    if task.status.is_final() {
        return Err(ApiError::new(ErrorCode::TaskInactive, format!("the task is {}", task.status.as_str())));
    }
    let identity_key = identity_key(&id, &request)?;
    // Derived when the task was loaded; an unfinished task is loaded.
    let security = state.coordinator.security(&id).await?;
    if security.variant == cohort_crypto::Variant::Active && identity_key.is_none() {
        return Err(ApiError::new(
            ErrorCode::IdentityRequired,
            "this task runs the active variant: enroll with an identity_key and its identity_proof",
        ));
    }
    let now = now_ms();
    project_enrollment_quota(&state, &task.project_id, now).await?;
    let credential = new_token();
    let participant = ParticipantRecord {
        id: new_id(),
        task_id: id,
        credential_hash: token_hash(&credential),
        enrolled_at: now,
        last_seen_at: now,
        expires_at: now + state.config.credential_ttl_ms,
        identity_key,
        token_id: Some(token.id),
    };
    state.store.add_participant(&participant).await?;
    let enrolled =
        Enrolled { participant_id: participant.id, credential, expires_at: participant.expires_at, security };
    Ok((StatusCode::CREATED, Json(enrolled)))
}

/// Refuses (`429`) an enrollment over the `enrollments_per_minute` quota
/// of the task's project: counted in the store over every task of the
/// project, so that the replicas leading them share the count (enrollments
/// at the same instant may pass it by a few).
async fn project_enrollment_quota(state: &AppState, project: &str, now: i64) -> ApiResult<()> {
    let quotas = super::projects::Quotas::of(&state.store.project(project).await?)?;
    let Some(most) = quotas.enrollments_per_minute else { return Ok(()) };
    let (recent, oldest) =
        state.store.enrollments_since(project, now - super::projects::ENROLLMENT_WINDOW_MS).await?;
    if recent < i64::from(most) {
        return Ok(());
    }
    let window = super::projects::ENROLLMENT_WINDOW_MS;
    let wait = oldest.map_or(window, |oldest| (oldest + window - now).clamp(1, window));
    Err(ApiError::new(
        ErrorCode::RateLimited,
        format!(
            "quota enrollments_per_minute: the project's tasks enrolled {recent} clients in the last minute, \
             of the {most} its limits allow; retry later"
        ),
    )
    .retry_after(std::time::Duration::from_millis(wait as u64)))
}

/// Checks in: says whether the client is selected for the round in
/// progress or, in an async task, whether to train (`train`), whether a
/// finished update joins a group (`selected`), waits, or is too stale
/// (`stale`).
#[utoipa::path(
    post, path = "/v1/checkin", tag = "client", operation_id = "checkIn",
    security(("client" = [])),
    params(("trained_on" = Option<u64>, Query, minimum = 0, maximum = 9_223_372_036_854_775_807_u64,
        description = "Async tasks: the model version a finished update was trained from"),
        ("wait_ms" = Option<u64>, Query, minimum = 0, maximum = 9_223_372_036_854_775_807_u64,
        description = "Hold the request while the answer is `wait`, up to this many milliseconds (at most 20 000): the answer comes as soon as the client is selected or told to train")),
    responses(
        (status = 200, description = "What to do next", body = CheckIn),
        (status = 400, response = Refused), (status = 401, response = Refused),
        (status = 404, response = Refused), (status = 409, response = Refused),
        (status = 429, response = RetryLater), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn check_in(
    PeerAddress(address): PeerAddress,
    Authenticated(p): Authenticated,
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
) -> ApiResult<Json<CheckIn>> {
    limit(&state, Call::CheckIn, address, Some(&p.id))?;
    let Query { trained_on, wait } = Query::parse(query.as_deref(), true)?;
    state.store.touch_participant(&p.id, now_ms()).await?;
    let answer = held(&state, &p.task_id, &p.id, wait, || {
        let (coordinator, task, id, identity) =
            (state.coordinator.clone(), p.task_id.clone(), p.id.clone(), p.identity_key);
        Box::pin(async move {
            let answer = coordinator.check_in(&task, &id, identity, trained_on).await?;
            let again = match answer {
                CheckIn::Wait { retry_after_ms } => Some(Duration::from_millis(retry_after_ms)),
                _ => None,
            };
            Ok((answer, again))
        })
    })
    .await;
    match answer {
        Ok(check_in) => Ok(Json(check_in)),
        // A stopped or completed task is no longer loaded: its clients are
        // told it is over, so that they exit cleanly.
        Err(CoordinatorError::UnknownTask) if state.store.task(&p.task_id).await?.status.is_final() => {
            Ok(Json(CheckIn::Finished))
        }
        Err(error) => Err(error.into()),
    }
}

/// A client says it is leaving: it is no longer selected, and no stage of
/// a round it is in waits for it (a tab that closes says so). A task that
/// is over has nothing to leave: `204` as well.
#[utoipa::path(
    post, path = "/v1/leave", tag = "client", operation_id = "leave",
    security(("client" = [])),
    responses(
        (status = 204, description = "Left (check in again to come back)"),
        (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 429, response = RetryLater), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn leave(
    PeerAddress(address): PeerAddress,
    Authenticated(p): Authenticated,
    State(state): State<AppState>,
) -> ApiResult<StatusCode> {
    limit(&state, Call::CheckIn, address, Some(&p.id))?;
    // A check-in of this client still held does not check it in again.
    state.holds.cancel(&p.id);
    match state.coordinator.leave(&p.task_id, &p.id).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(CoordinatorError::UnknownTask) if state.store.task(&p.task_id).await?.status.is_final() => {
            Ok(StatusCode::NO_CONTENT)
        }
        Err(error) => Err(error.into()),
    }
}

/// The query of a check-in (`trained_on=VERSION`, an async task's
/// finished update, and `wait_ms`) or of a stage message's `GET` or
/// `POST` (`wait_ms` only), each parameter at most once.
pub(crate) struct Query {
    trained_on: Option<u64>,
    /// How long to hold the request, at most [`routes::MAX_WAIT_MS`].
    pub(crate) wait: Duration,
}

impl Query {
    pub(crate) fn parse(query: Option<&str>, check_in: bool) -> ApiResult<Self> {
        let refused = || {
            ApiError::new(
                ErrorCode::InvalidRound,
                if check_in {
                    "the check-in takes two parameters, each at most once: trained_on (the model version a \
                     finished update was trained from) and wait_ms (how long to hold the request)"
                } else {
                    "a stage message's GET or POST takes one parameter: wait_ms (how long to hold the \
                     request for the next stage message)"
                },
            )
        };
        let (mut trained_on, mut wait_ms) = (None, None);
        for pair in query.unwrap_or_default().split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').ok_or_else(refused)?;
            let slot = match name {
                "trained_on" if check_in => &mut trained_on,
                "wait_ms" => &mut wait_ms,
                _ => return Err(refused()),
            };
            if slot.replace(decimal(value).ok_or_else(refused)?).is_some() {
                return Err(refused());
            }
        }
        let wait = Duration::from_millis(wait_ms.unwrap_or(0).min(routes::MAX_WAIT_MS));
        Ok(Self { trained_on, wait })
    }
}

/// An answer of the coordinator for [`held`], and how soon to ask again
/// when it is a wait.
type Asked<T> =
    std::pin::Pin<Box<dyn Future<Output = Result<(T, Option<Duration>), CoordinatorError>> + Send>>;

/// How often a held request asks again when nothing woke it: its answer
/// may change without the task's stage mark changing (a late selection,
/// an async group that fills), so a held request is never slower to hear
/// it than a client that polls.
const RECHECK: Duration = Duration::from_secs(2);

/// Asks `ask` for an answer, and while its answer is a wait (it says how
/// soon to ask again) holds the request up to `wait`: it asks again when
/// the task's stage mark changes here ([`Coordinator::stage_changes`]), when
/// the answer said to, or at the end, and answers with the last answer.
/// One request of a client that waits for its next stage replaces the
/// polls it would make, and the coordinator wakes it within a moment of
/// the change instead of at its next poll. The coordinator stopping ends
/// every hold at once; a newer held request of the same participant, or
/// its leave, ends this one before it asks again ([`Holds`]).
///
/// [`Coordinator::stage_changes`]: crate::coordinator::Coordinator::stage_changes
/// [`Holds`]: super::state::Holds
async fn held<T>(
    state: &AppState,
    task: &str,
    participant: &str,
    wait: Duration,
    mut ask: impl FnMut() -> Asked<T>,
) -> Result<T, CoordinatorError> {
    if wait.is_zero() {
        return ask().await.map(|(answer, _)| answer);
    }
    let until = tokio::time::Instant::now() + wait;
    let mut stages = state.coordinator.stage_changes(task);
    let hold = Hold { holds: &state.holds, participant, hold: state.holds.begin(participant) };
    loop {
        // Seen before asking: a change after this wakes the wait below.
        stages.borrow_and_update();
        let (answer, again) = ask().await?;
        let Some(again) = again else { return Ok(answer) };
        let now = tokio::time::Instant::now();
        if now >= until {
            return Ok(answer);
        }
        let next = now + again.clamp(Duration::from_millis(1), RECHECK);
        tokio::select! {
            changed = stages.changed() => {
                if changed.is_err() {
                    return Ok(answer);
                }
            }
            () = tokio::time::sleep_until(next.min(until)) => {}
        }
        if !hold.holds.holds(participant, hold.hold) {
            return Ok(answer);
        }
    }
}

/// A participant's held request, ended when it is dropped (answered, or
/// its client went away).
struct Hold<'a> {
    holds: &'a super::state::Holds,
    participant: &'a str,
    hold: u64,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.holds.end(self.participant, self.hold);
    }
}

/// The current global model.
#[utoipa::path(
    get, path = "/v1/model", tag = "client", operation_id = "getModel",
    security(("client" = [])),
    responses(
        (status = 200, description = "The model (safetensors)", content_type = "application/vnd.safetensors", body = Binary,
            headers(("x-cohort-round" = u64, description = "The rounds the model has seen (an async task: its version)"))),
        (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 410, description = "The task is over (`task_inactive`): check in to hear `finished`", body = ErrorBody),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn model(
    Authenticated(p): Authenticated,
    State(state): State<AppState>,
) -> ApiResult<Response> {
    // The leader has it in memory; any other replica serves the newest
    // stored checkpoint, without a hop to the leader.
    let (round, bytes) = match state.coordinator.whereabouts(&p.task_id) {
        Whereabouts::Here => {
            state.models.forget(&p.task_id);
            state.coordinator.model(&p.task_id).await?
        }
        Whereabouts::At(_) | Whereabouts::Nowhere => state.models.newest(&state.store, &p.task_id).await?,
    };
    Ok((
        [
            (header::CONTENT_TYPE, SAFETENSORS_CONTENT_TYPE.to_string()),
            (
                "x-cohort-round".parse().map_err(|_| ApiError::new(ErrorCode::Internal, "header"))?,
                round.to_string(),
            ),
        ],
        bytes,
    )
        .into_response())
}

/// The server's message for the client's current stage.
#[utoipa::path(
    get, path = "/v1/round/message", tag = "client", operation_id = "fetchMessage",
    security(("client" = [])),
    params(("wait_ms" = Option<u64>, Query, minimum = 0, maximum = 9_223_372_036_854_775_807_u64,
        description = "Hold the request while there is nothing yet, up to this many milliseconds (at most 20 000): the message comes as soon as the stage closes")),
    responses(
        (status = 200, description = "The stage message", content_type = "application/x-cohort-secagg", body = Binary),
        (status = 204, description = "Nothing yet (after holding the request up to `wait_ms`): ask again shortly"),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 409, description = "Not part of the round in progress", body = ErrorBody),
        (status = 410, description = "Dropped from the round (missed a stage, or the attempt failed), or the task is over (`task_inactive`)", body = ErrorBody),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn fetch_message(
    Authenticated(p): Authenticated,
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
) -> ApiResult<Response> {
    let Query { wait, .. } = Query::parse(query.as_deref(), false)?;
    let poll = next_message(&state, &p, wait).await?;
    Ok(match poll {
        Poll::Message(bytes) => ([(header::CONTENT_TYPE, SECAGG_CONTENT_TYPE)], bytes).into_response(),
        Poll::Wait => StatusCode::NO_CONTENT.into_response(),
        Poll::Dropped => {
            ApiError::new(ErrorCode::Dropped, "this client is no longer part of the round").into_response()
        }
    })
}

/// The participant's message for its stage in progress, the request held
/// up to `wait` while there is none yet.
async fn next_message(
    state: &AppState,
    p: &ParticipantRecord,
    wait: Duration,
) -> Result<Poll, CoordinatorError> {
    held(state, &p.task_id, &p.id, wait, || {
        let (coordinator, task, id) = (state.coordinator.clone(), p.task_id.clone(), p.id.clone());
        Box::pin(async move {
            let poll = coordinator.poll(&task, &id).await?;
            let again = matches!(poll, Poll::Wait).then_some(RECHECK);
            Ok((poll, again))
        })
    })
    .await
}

/// Stage messages declared at most this long are read whole and handed to
/// the coordinator in one piece; a longer masked input is added into the
/// running sum as it arrives ([`stream_masked_input`]).
const READ_WHOLE_UP_TO: usize = 1 << 20;
/// Bytes of a streamed masked input handed to the coordinator at a time.
const PIECE: usize = 256 << 10;

/// A stage message. Everything that can refuse it without its body is
/// checked first (credential, media type, the sender's place in the stage
/// in progress, the declared length against the round's limit); only then
/// is the body read, and no further than that limit. A masked input longer
/// than [`READ_WHOLE_UP_TO`] (or of undeclared length) is never held whole:
/// it goes into the running sum a piece at a time as it arrives.
///
/// With `wait_ms`, an accepted message's answer is the client's next stage
/// message, the request held for it until `wait_ms` after it arrived (the
/// `GET` the client would send next, in the same request); a `202` when
/// there is none by then, and always after an unmasking message (the
/// client's last of the round, which has no next). A client dropped while
/// held, or a round that ended, gets the `202` too and hears of it at its
/// fetch.
#[utoipa::path(
    post, path = "/v1/round/message", tag = "client", operation_id = "postMessage",
    security(("client" = [])),
    params(("wait_ms" = Option<u64>, Query, minimum = 0, maximum = 9_223_372_036_854_775_807_u64,
        description = "Once the message is accepted, hold the request until this many milliseconds after it arrived (at most 20 000) for the client's next stage message, and answer with it (never after an unmasking message, the round's last)")),
    request_body(content = Binary, content_type = "application/x-cohort-secagg",
        description = "The client's message for the stage in progress, at most the size the round's parameters allow"),
    responses(
        (status = 200, description = "Accepted, and the client's next stage message (with `wait_ms`)", content_type = "application/x-cohort-secagg", body = Binary),
        (status = 202, description = "Accepted (without `wait_ms`, after the round's last message, or no next message within the wait: fetch it)"),
        (status = 400, response = Refused), (status = 401, response = Refused), (status = 404, response = Refused),
        (status = 408, response = Refused),
        (status = 409, description = "Not selected, another round, out of phase, already sent, or not eligible", body = ErrorBody),
        (status = 410, description = "Dropped from the round, or the task is over (`task_inactive`)", body = ErrorBody),
        (status = 413, response = Refused), (status = 415, response = Refused),
        (status = 422, description = "A message that fails a cryptographic or protocol check", body = ErrorBody),
        (status = 503, response = RetryLater)
    )
)]
pub(super) async fn post_message(
    Authenticated(p): Authenticated,
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let Query { wait, .. } = Query::parse(query.as_deref(), false)?;
    let arrived = Instant::now();
    if accept_message(&state, &p, &headers, body, arrived).await? == Accepted::LastOfRound {
        // Nothing more of this round for the group's replica: the affinity
        // cookie names where the client's next request (its metrics, its
        // check-in) belongs, the task's leader.
        let mut response = StatusCode::ACCEPTED.into_response();
        response.extensions_mut().insert(crate::cluster::affinity::RoundDone);
        return Ok(response);
    }
    // The whole request, upload included, within the wait: a replica that
    // forwarded it gives up that long (and 2.5 s) after the body's end.
    let wait = wait.saturating_sub(arrived.elapsed());
    if wait.is_zero() {
        return Ok(StatusCode::ACCEPTED.into_response());
    }
    // Accepted, whatever happens while it is held: a client dropped
    // meanwhile, or a round that ended, is heard of at its fetch.
    Ok(match next_message(&state, &p, wait).await {
        Ok(Poll::Message(bytes)) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, SECAGG_CONTENT_TYPE)], bytes).into_response()
        }
        _ => StatusCode::ACCEPTED.into_response(),
    })
}

/// What [`accept_message`] accepted.
#[derive(Debug, PartialEq, Eq)]
enum Accepted {
    /// A message after which the client has more to send in the round.
    Stage,
    /// An unmasking message: the client's last of the round.
    LastOfRound,
}

/// Reads and hands the coordinator the stage message of [`post_message`],
/// which `arrived` then.
async fn accept_message(
    state: &AppState,
    p: &ParticipantRecord,
    headers: &HeaderMap,
    body: Body,
    arrived: Instant,
) -> ApiResult<Accepted> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type != SECAGG_CONTENT_TYPE {
        return Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            format!("stage messages must be sent as {SECAGG_CONTENT_TYPE}"),
        ));
    }
    let admission = state.coordinator.admit(&p.task_id, &p.id).await?;
    let mut body = LimitedBody::new(headers, body, admission.limit.min(state.config.max_message_bytes))?;
    let streamed = body.declared().is_none_or(|length| length > READ_WHOLE_UP_TO);
    // A body read whole is read into room for its declared length (within
    // the round's limit, checked above), not grown a frame at a time.
    let mut first = Vec::with_capacity(match body.declared() {
        Some(length) if !streamed => length,
        _ => MASKED_INPUT_HEADER_LEN,
    });
    let mut ended = false;
    while streamed && first.len() < MASKED_INPUT_HEADER_LEN && !ended {
        match body.next().await? {
            Some(bytes) => first.extend_from_slice(&bytes),
            None => ended = true,
        }
    }
    if streamed && !ended && starts_masked_input(&first) {
        stream_masked_input(state, &admission, first, body).await?;
        state.metrics.upload(Upload::masked_input, arrived.elapsed());
        return Ok(Accepted::Stage);
    }
    while let Some(bytes) = body.next().await? {
        first.extend_from_slice(&bytes);
    }
    let kind = if starts_masked_input(&first) { Upload::masked_input } else { Upload::stage_message };
    let accepted = if starts_unmasking(&first) { Accepted::LastOfRound } else { Accepted::Stage };
    state.coordinator.receive(&admission, first).await?;
    state.metrics.upload(kind, arrived.elapsed());
    Ok(accepted)
}

/// Adds a masked input into the running sum as its body arrives, in
/// pieces of [`PIECE`] bytes: each is handed to the coordinator, and the
/// next read only once it was added, so an upload holds about one piece of
/// memory however long it is and however many arrive at once. A body that
/// breaks off, or a request dropped mid-body, takes back out what it added
/// ([`Abandon`]); a refusal by the coordinator has done so already.
async fn stream_masked_input(
    state: &AppState,
    admission: &Admission,
    mut first: Vec<u8>,
    mut body: LimitedBody,
) -> ApiResult<()> {
    let coordinator = &state.coordinator;
    let mut piece = first.split_off(MASKED_INPUT_HEADER_LEN);
    let upload = coordinator.input(admission, InputStep::Begin(first)).await?;
    let mut guard = Abandon { state, admission, upload, armed: true };
    piece.reserve(PIECE);
    loop {
        let next = body.next().await?;
        if piece.len() >= PIECE || (next.is_none() && !piece.is_empty()) {
            let full = std::mem::replace(&mut piece, Vec::with_capacity(PIECE));
            let added = coordinator.input(admission, InputStep::Piece(upload, full)).await;
            guard.armed = added.is_ok();
            added?;
        }
        match next {
            Some(bytes) => piece.extend_from_slice(&bytes),
            None => break,
        }
    }
    let finished = coordinator.input(admission, InputStep::Finish(upload)).await;
    // Finished, or refused (and taken back out by the coordinator).
    guard.armed = false;
    finished.map(drop).map_err(Into::into)
}

/// Takes an upload's bytes back out of the sum unless it was finished or
/// refused: its body broke off, or its request was dropped (the client's
/// connection closed) while it was being read.
struct Abandon<'a> {
    state: &'a AppState,
    admission: &'a Admission,
    upload: u64,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.state.coordinator.abandon_input(self.admission, self.upload);
        }
    }
}

/// What a client reports for a round: a fixed set of numbers, each
/// optional and each within its range.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientMetrics {
    /// Mean training loss over the local epochs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub train_loss: Option<f64>,
    /// Training accuracy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub train_accuracy: Option<f64>,
    /// Loss of the global model on local data, before training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub global_loss: Option<f64>,
    /// Accuracy of the global model on local data, before training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub global_accuracy: Option<f64>,
    /// Loss on local held-out data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub eval_loss: Option<f64>,
    /// Accuracy on local held-out data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub eval_accuracy: Option<f64>,
    /// Local examples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<u32>,
    /// Bytes the client sent in the round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(maximum = 1_099_511_627_776_u64)]
    pub bytes_up: Option<u64>,
    /// Bytes the client received in the round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(maximum = 1_099_511_627_776_u64)]
    pub bytes_down: Option<u64>,
}

/// Largest loss accepted in a report.
const MAX_LOSS: f64 = 1e9;
/// Largest byte count accepted in a report (1 TiB).
const MAX_REPORTED_BYTES: u64 = 1 << 40;

/// A value of a metrics report out of its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{metric} must be between 0 and {max}")]
pub struct MetricRangeError {
    /// The metric, as the report names it.
    pub metric: &'static str,
    /// Its largest accepted value.
    pub max: f64,
}

impl ClientMetrics {
    /// Checks every value against its range.
    pub fn validate(&self) -> Result<(), MetricRangeError> {
        for (metric, value) in [
            ("train_loss", self.train_loss),
            ("global_loss", self.global_loss),
            ("eval_loss", self.eval_loss),
        ] {
            if value.is_some_and(|v| !(0.0..=MAX_LOSS).contains(&v)) {
                return Err(MetricRangeError { metric, max: MAX_LOSS });
            }
        }
        for (metric, value) in [
            ("train_accuracy", self.train_accuracy),
            ("global_accuracy", self.global_accuracy),
            ("eval_accuracy", self.eval_accuracy),
        ] {
            if value.is_some_and(|v| !(0.0..=1.0).contains(&v)) {
                return Err(MetricRangeError { metric, max: 1.0 });
            }
        }
        for (metric, value) in [("bytes_up", self.bytes_up), ("bytes_down", self.bytes_down)] {
            if value.is_some_and(|v| v > MAX_REPORTED_BYTES) {
                return Err(MetricRangeError { metric, max: MAX_REPORTED_BYTES as f64 });
            }
        }
        Ok(())
    }
}

/// The kind of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum ReportKind {
    /// After local training.
    Train,
    /// On local held-out data.
    Eval,
}

/// One report.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct MetricsReport {
    /// The round it is about.
    #[schema(minimum = 1, maximum = 9_223_372_036_854_775_807_u64)]
    round: u64,
    /// After training, or on held-out data.
    kind: ReportKind,
    /// The numbers.
    metrics: ClientMetrics,
}

/// A client's metrics for a round it took part in (the round in progress
/// or one of the last completed ones), once per round and kind: only for a
/// semi-honest task with `client_metrics.plaintext` (every task gets the
/// means from the masked sums).
#[utoipa::path(
    post, path = "/v1/metrics", tag = "client", operation_id = "reportMetrics",
    security(("client" = [])),
    request_body(content = MetricsReport),
    responses(
        (status = 201, description = "Recorded"),
        (status = 400, response = Refused), (status = 401, response = Refused),
        (status = 403, description = "The task takes metrics only in aggregate", body = ErrorBody),
        (status = 404, response = Refused), (status = 408, response = Refused),
        (status = 409, description = "Not part of that round, or already reported", body = ErrorBody),
        (status = 410, description = "The task is over (`task_inactive`)", body = ErrorBody),
        (status = 413, response = Refused), (status = 429, response = RetryLater), (status = 503, response = RetryLater)
    )
)]
pub(super) async fn report_metrics(
    PeerAddress(address): PeerAddress,
    Authenticated(p): Authenticated,
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> ApiResult<StatusCode> {
    limit(&state, Call::Report, address, Some(&p.id))?;
    let report: MetricsReport = json_body(&body)?;
    if report.round < 1 || report.round > i64::MAX as u64 {
        return Err(ApiError::new(ErrorCode::InvalidRound, "round must be between 1 and 2^63 - 1"));
    }
    report.metrics.validate().map_err(|e| ApiError::new(ErrorCode::InvalidMetrics, e.to_string()))?;
    state.coordinator.may_report(&p.task_id, &p.id, report.round).await?;
    let metrics = serde_json::to_string(&report.metrics)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, e.to_string()))?;
    let kind = match report.kind {
        ReportKind::Train => "train",
        ReportKind::Eval => "eval",
    };
    state
        .store
        .add_client_metrics(&ClientMetricsRecord {
            task_id: p.task_id,
            round: report.round as i64,
            participant_id: p.id,
            kind: kind.into(),
            metrics,
            reported_at: now_ms(),
        })
        .await?;
    Ok(StatusCode::CREATED)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Query;

    fn check_in(query: &str) -> Option<(Option<u64>, Duration)> {
        Query::parse(Some(query), true).ok().map(|q| (q.trained_on, q.wait))
    }

    #[test]
    fn the_check_in_query_is_a_version_and_a_wait_or_nothing() {
        let ms = Duration::from_millis;
        assert!(Query::parse(None, true).is_ok_and(|q| q.trained_on.is_none() && q.wait.is_zero()));
        assert_eq!(check_in(""), Some((None, ms(0))));
        assert_eq!(check_in("trained_on=12"), Some((Some(12), ms(0))));
        assert_eq!(check_in("wait_ms=500&trained_on=0"), Some((Some(0), ms(500))));
        // A longer wait is cut to what a coordinator grants.
        assert_eq!(check_in("trained_on=3&wait_ms=999999"), Some((Some(3), ms(20_000))));
        for bad in [
            "trained_on=",
            "trained_on=-1",
            "trained_on=x",
            "round=3",
            "trained_on=1&x=2",
            "trained_on=99999999999999999999",
            "trained_on=1&trained_on=1",
            "wait_ms",
            "wait_ms=1&wait_ms=1",
            "wait_ms=0x10",
        ] {
            assert_eq!(check_in(bad), None, "{bad}");
        }
        // A stage message's GET takes the wait only.
        assert!(Query::parse(Some("wait_ms=100"), false).is_ok_and(|q| q.wait == ms(100)));
        assert!(Query::parse(Some("trained_on=1"), false).is_err());
    }
}
