//! The participant against a scripted coordinator: no sockets, no clock.

use super::*;
use crate::checkpoint::{ModelLayout, TensorSpec};
use cohort_crypto::Quantizer;

/// The three-client semi-honest round of [`setup`].
fn round_config(round: u64) -> cohort_crypto::RoundConfig {
    use cohort_crypto::{GraphSpec, QuantizationSpec, RoundConfig, Transform, Variant};
    let quantization = QuantizationSpec {
        clip: 1.0,
        max_weight: 100,
        transform: Transform::None,
        metrics: cohort_crypto::MetricSet::NONE,
        privacy: None,
        validation: None,
        scale: None,
    };
    let vector_len = Quantizer::new(quantization, 32, 3).unwrap().encoded_len(2) as u32;
    RoundConfig {
        session: [7; 16],
        round,
        variant: Variant::SemiHonest,
        clients: 3,
        identities: Vec::new(),
        graph: GraphSpec::Complete,
        threshold: 2,
        vector_len,
        modulus_bits: 32,
        quantization,
        model: None,
    }
}

/// What the task of [`setup`]'s rounds announces at enrollment.
fn security() -> TaskSecurity {
    TaskSecurity::of_round(&round_config(1)).unwrap()
}

/// Test timings, and a policy that accepts the small semi-honest task
/// of [`setup`] (and says so).
fn config() -> ParticipantConfig {
    let policy = Policy::accepting(&security());
    assert_eq!(policy.relaxations().len(), 3, "{:?}", policy.relaxations());
    ParticipantConfig {
        max_attempts: 4,
        backoff_base_ms: 100,
        backoff_max_ms: 250,
        poll_interval_ms: 10,
        // Answers at once: these tests drive the waits themselves.
        wait_ms: 0,
        stage_timeout_ms: 1_000,
        task_missing_ms: 5_000,
        policy,
    }
}

fn enrollment_reply() -> Response {
    let security = serde_json::to_value(security()).unwrap();
    json(
        201,
        serde_json::json!({
            "participant_id": "p1", "credential": "secret-credential", "expires_at": 9, "security": security,
        }),
    )
}

fn send(participant: &mut Participant, now: u64) -> Request {
    match participant.next(now) {
        Action::Send(request) => request,
        other => panic!("expected a request, got {other:?}"),
    }
}

fn json(status: u16, body: serde_json::Value) -> Response {
    Response { status, body: body.to_string().into_bytes() }
}

fn enrolled() -> Participant {
    let mut p = Participant::enroll("task", "token", config()).with_seed([1; 32]);
    let request = send(&mut p, 0);
    assert_eq!((request.method, request.path.as_str()), (Method::Post, "/v1/tasks/task/enroll"));
    p.handle(0, enrollment_reply()).unwrap();
    p
}

/// Enrolled, selected for round 3 and handed the model.
fn training() -> Participant {
    let mut p = enrolled();
    select_and_train(&mut p, 3);
    p
}

/// Checks in, is selected for `round` and handed the model.
fn select_and_train(p: &mut Participant, round: u64) {
    assert_eq!(send(p, 0).path, "/v1/checkin");
    p.handle(0, json(200, serde_json::json!({ "status": "selected", "round": round, "client_id": 2 })))
        .unwrap();
    assert_eq!(send(p, 0).path, "/v1/model");
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let model = checkpoint::encode(&layout, &[0.5, -0.5], &Default::default()).unwrap();
    p.handle(0, Response { status: 200, body: model }).unwrap();
    match p.next(0) {
        Action::Train { round: r, model, .. } if r == round => assert_eq!(model.weights, vec![0.5, -0.5]),
        other => panic!("expected training, got {other:?}"),
    }
}

#[test]
fn failures_are_retried_with_capped_exponential_backoff() {
    let mut p = Participant::enroll("task", "token", config());
    let first = send(&mut p, 0);
    p.transport_failed(0, "connection refused").unwrap();
    assert!(matches!(p.next(50), Action::Wait(50)));
    assert_eq!(send(&mut p, 100), first, "the same request is retried");
    p.handle(100, Response { status: 503, body: vec![] }).unwrap();
    assert!(matches!(p.next(100), Action::Wait(200)));
    send(&mut p, 300);
    p.transport_failed(300, "reset").unwrap();
    assert!(matches!(p.next(300), Action::Wait(250)), "capped at backoff_max_ms");
    send(&mut p, 550);
    let error = p.transport_failed(550, "timed out").unwrap_err();
    assert_eq!(error, ParticipantError::Unreachable { attempts: 4, last: "timed out".into() });
}

#[test]
fn a_coordinator_that_does_not_know_the_task_enrolled_in_is_asked_again_for_a_bounded_time() {
    let missing = serde_json::json!({ "error": "task_not_found", "message": "task not found" });
    let mut p = enrolled();
    // More refusals than max_attempts within task_missing_ms: the check-in
    // is asked again each second (capped at backoff_max_ms here).
    for k in 0..6 {
        let now = k * 800;
        assert_eq!(send(&mut p, now).path, "/v1/checkin");
        p.handle(now, json(404, missing.clone())).unwrap();
        assert!(matches!(p.next(now), Action::Wait(250)));
    }
    // An answer in between starts the count again.
    assert_eq!(send(&mut p, 4_900).path, "/v1/checkin");
    p.handle(4_900, json(200, serde_json::json!({ "status": "wait", "retry_after_ms": 10 }))).unwrap();
    for now in [4_910, 9_000] {
        assert_eq!(send(&mut p, now).path, "/v1/checkin");
        p.handle(now, json(404, missing.clone())).unwrap();
    }
    // task_missing_ms after the first refusal of the run, it is an error.
    assert_eq!(send(&mut p, 9_910).path, "/v1/checkin");
    assert_eq!(
        p.handle(9_910, json(404, missing)).unwrap_err(),
        ParticipantError::TaskNotFound("task".into())
    );
}

/// `503 unavailable` (a lead moving, a database away) is asked again for
/// `task_missing_ms`, however many attempts that takes; another 5xx uses
/// the attempts up.
#[test]
fn an_unavailable_coordinator_is_asked_again_for_a_bounded_time_not_a_number_of_attempts() {
    let unavailable = serde_json::json!({ "error": "unavailable", "message": "", "retry_after_ms": 1_000 });
    let mut p = enrolled();
    for k in 0..5 {
        let now = k * 1_000;
        assert_eq!(send(&mut p, now).path, "/v1/checkin", "the same request again");
        p.handle(now, json(503, unavailable.clone())).unwrap();
        assert!(matches!(p.next(now), Action::Wait(1_000)));
    }
    assert_eq!(send(&mut p, 5_000).path, "/v1/checkin");
    let error = p.handle(5_000, json(503, unavailable.clone())).unwrap_err();
    assert!(matches!(error, ParticipantError::Unreachable { .. }), "{error:?}");
    // An answer in between starts the count again.
    let mut p = enrolled();
    send(&mut p, 0);
    p.handle(0, json(503, unavailable.clone())).unwrap();
    send(&mut p, 4_500);
    p.handle(4_500, json(200, serde_json::json!({ "status": "wait", "retry_after_ms": 10 }))).unwrap();
    send(&mut p, 4_600);
    p.handle(4_600, json(503, unavailable.clone())).unwrap();
    send(&mut p, 9_000);
    p.handle(9_000, json(503, unavailable)).unwrap();
}

#[test]
fn an_enrollment_in_a_task_that_does_not_exist_fails_at_once() {
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let missing = serde_json::json!({ "error": "task_not_found", "message": "task not found" });
    assert_eq!(p.handle(0, json(404, missing)).unwrap_err(), ParticipantError::TaskNotFound("task".into()));
    // A 404 page of a server that is not a coordinator: a wrong URL.
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let page = Response { status: 404, body: b"<h1>Not Found</h1>".to_vec() };
    let error = p.handle(0, page).unwrap_err();
    assert!(
        matches!(&error, ParticipantError::UnexpectedReply(m) if m.contains("check the server URL") && m.ends_with("<h1>Not Found</h1>")),
        "{error:?}"
    );
}

#[test]
fn a_refusal_that_is_not_the_coordinator_s_says_what_refused() {
    // A proxy in front of the coordinator refuses with a page of its own.
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let page =
        "<html>\r\n<head><title>403 Forbidden</title></head>\n\t<body>blocked by the\x07 proxy</body></html>";
    let error = p.handle(0, Response { status: 403, body: page.as_bytes().to_vec() }).unwrap_err();
    let ParticipantError::Rejected { status, code, message } = error else { panic!("{error:?}") };
    assert_eq!((status, code), (403, ErrorCode::Unknown));
    assert_eq!(
        message,
        "<html> <head><title>403 Forbidden</title></head> <body>blocked by the proxy</body></html>"
    );
    // A long page is cut; bytes that are not UTF-8 are replaced.
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let mut body = vec![0xff; 3];
    body.extend("x".repeat(1000).bytes());
    let error = p.handle(0, Response { status: 400, body }).unwrap_err();
    let ParticipantError::Rejected { message, .. } = error else { panic!("{error:?}") };
    assert_eq!(message.chars().count(), http::EXCERPT_CHARS);
    assert!(message.starts_with("\u{fffd}\u{fffd}\u{fffd}x") && message.ends_with("x…"), "{message}");
    // An error of another API's shape (no message) is quoted too.
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let other = json(403, serde_json::json!({ "error": "access_denied", "error_description": "no" }));
    let error = p.handle(0, other).unwrap_err();
    let ParticipantError::Rejected { code, message, .. } = error else { panic!("{error:?}") };
    assert_eq!(
        (code, message.as_str()),
        (ErrorCode::Unknown, r#"{"error":"access_denied","error_description":"no"}"#)
    );
    // The coordinator's own message is made printable as well: it is
    // logged, and a hostile coordinator chooses it.
    let mut p = training();
    start_round(&mut p, 3);
    send(&mut p, 0);
    let reason = "dropped\n\x1b[31mfake log line\u{202e}txt.exe\u{200b}";
    let gone = json(410, serde_json::json!({ "error": "dropped", "message": reason }));
    p.handle(0, gone).unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Dropped { reason, .. }) => {
            assert_eq!(reason, "dropped [31mfake log linetxt.exe")
        }
        other => panic!("{other:?}"),
    }
    // A success of another kind is no refusal: the answer is not the API's.
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let page = Response { status: 200, body: b"<!doctype html><p>Welcome</p>".to_vec() };
    let error = p.handle(0, page).unwrap_err();
    assert!(
        matches!(&error, ParticipantError::UnexpectedReply(m) if m.starts_with("HTTP 200 ") && m.ends_with("<p>Welcome</p>")),
        "{error:?}"
    );
}

#[test]
fn a_rate_limited_request_waits_as_told_without_using_up_attempts() {
    let mut p = enrolled();
    let limited =
        serde_json::json!({ "error": "rate_limited", "message": "slow down", "retry_after_ms": 7_000 });
    // More refusals than max_attempts: the server is there, so no failure.
    for k in 0..10 {
        let now = k * 10_000;
        let request = send(&mut p, now);
        assert_eq!(request.path, "/v1/checkin");
        p.handle(now, json(429, limited.clone())).unwrap();
        assert!(matches!(p.next(now + 1), Action::Wait(6_999)));
    }
    // A 503 that asks for longer than the backoff gets its wait.
    let unavailable = serde_json::json!({ "error": "unavailable", "message": "", "retry_after_ms": 5_000 });
    send(&mut p, 200_000);
    p.handle(200_000, json(503, unavailable)).unwrap();
    assert!(matches!(p.next(200_000), Action::Wait(5_000)));
    // A server that asks for an hour is held to five minutes.
    send(&mut p, 300_000);
    let hour = serde_json::json!({ "error": "rate_limited", "message": "", "retry_after_ms": 3_600_000 });
    p.handle(300_000, json(429, hour)).unwrap();
    assert!(matches!(p.next(300_000), Action::Wait(300_000)));
}

#[test]
fn a_success_resets_the_attempts() {
    // More failures in all than max_attempts (4), but never two in a row:
    // each is retried.
    let mut p = enrolled();
    for cycle in 0..6 {
        let now = cycle * 1_000;
        send(&mut p, now);
        assert!(p.transport_failed(now, "refused").is_ok(), "failure {} ended the participant", cycle + 1);
        send(&mut p, now + 500);
        p.handle(now + 500, json(200, serde_json::json!({ "status": "wait", "retry_after_ms": 100 })))
            .unwrap();
    }
    // The control: max_attempts failures in a row end it.
    let mut p = enrolled();
    let mut now = 0;
    for _ in 1..4 {
        send(&mut p, now);
        assert!(p.transport_failed(now, "refused").is_ok());
        now += 60_000;
    }
    send(&mut p, now);
    assert!(p.transport_failed(now, "refused").is_err(), "four failures in a row were retried");
}

#[test]
fn the_credential_is_presented_but_never_printed() {
    let mut p = enrolled();
    let request = send(&mut p, 0);
    assert_eq!(request.bearer.as_deref(), Some("secret-credential"));
    assert!(!format!("{request:?}").contains("secret-credential"));
    assert!(!format!("{:?}", p.saved_state().unwrap()).contains("secret-credential"));
}

/// Enrollment registers a fresh Ed25519 identity with a proof that the
/// participant holds it; the seed stays with the enrollment (and in the
/// saved state, so that a restart keeps the identity) and is never printed.
#[test]
fn enrollment_registers_an_identity_it_keeps_and_never_prints() {
    let mut p = Participant::enroll("task", "token", config()).with_seed([1; 32]);
    let request = send(&mut p, 0);
    let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
    let mut public = [0u8; 32];
    hex::decode_to_slice(body["identity_key"].as_str().unwrap(), &mut public).unwrap();
    let mut proof = [0u8; 64];
    hex::decode_to_slice(body["identity_proof"].as_str().unwrap(), &mut proof).unwrap();
    cohort_crypto::signature::verify(&public, &enrollment_statement("task", &public), &proof).unwrap();
    // A retried enrollment registers the same key.
    p.handle(0, json(503, serde_json::json!({ "error": "unavailable", "message": "later" }))).unwrap();
    let again: serde_json::Value = serde_json::from_slice(&send(&mut p, 10_000_000).body).unwrap();
    assert_eq!(again["identity_key"], body["identity_key"]);
    p.handle(0, enrollment_reply()).unwrap();
    let saved = p.saved_state().unwrap();
    assert_eq!(saved.identity().unwrap().public_key(), public);
    let seed = saved.identity_seed.clone().unwrap();
    assert_eq!(seed.len(), 64);
    assert!(!format!("{saved:?}").contains(&seed));
    assert!(!format!("{p:?}").contains(&seed));
    let restored: SavedState = serde_json::from_str(&serde_json::to_string(saved).unwrap()).unwrap();
    assert_eq!(restored.identity().unwrap().public_key(), public);
}

#[test]
fn updates_are_checked_and_must_come_after_training() {
    let mut p = enrolled();
    assert_eq!(
        p.submit(vec![0.0; 2], 1, MetricValues::new()),
        Err(ParticipantError::OutOfOrder("submit comes after a Train action"))
    );
    let mut p = training();
    assert!(matches!(
        p.submit(vec![0.0; 3], 1, MetricValues::new()),
        Err(ParticipantError::InvalidUpdate(_))
    ));
    assert!(matches!(
        p.submit(vec![f32::NAN, 0.0], 1, MetricValues::new()),
        Err(ParticipantError::InvalidUpdate(_))
    ));
    assert!(matches!(
        p.submit(vec![0.1, 0.0], 0, MetricValues::new()),
        Err(ParticipantError::InvalidUpdate(_))
    ));
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/round/message");
}

#[test]
fn a_stalled_stage_abandons_the_round_and_the_round_is_not_rejoined() {
    let mut p = training();
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    let mut now = 0;
    loop {
        match p.next(now) {
            Action::Send(_) => p.handle(now, Response { status: 204, body: vec![] }).unwrap(),
            Action::Wait(ms) => now += ms,
            Action::RoundEnded(RoundOutcome::Abandoned { report, reason }) => {
                assert_eq!(report.round, 3);
                assert!(reason.contains("1000 ms"), "{reason}");
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(now > 1_000 && now < 1_100, "{now}");
    // Still listed for round 3 at check-in: wait for round 4 instead.
    assert_eq!(send(&mut p, now).path, "/v1/checkin");
    p.handle(now, json(200, serde_json::json!({ "status": "selected", "round": 3, "client_id": 2 })))
        .unwrap();
    assert!(matches!(p.next(now), Action::Wait(_)));
}

#[test]
fn leaving_returns_the_outcome_at_once_and_only_mid_round() {
    let mut p = enrolled();
    assert_eq!(p.leave("paused"), None);
    let mut p = training();
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    match p.leave("paused") {
        Some(RoundOutcome::Abandoned { report, reason }) => {
            assert_eq!((report.round, reason.as_str()), (3, "paused"))
        }
        other => panic!("expected the abandoned round, got {other:?}"),
    }
    // Nothing queued: the next action is the next check-in.
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
}

/// The setup of `round` for three clients over the two weights of
/// [`training`]'s model.
fn setup(round: u64) -> Vec<u8> {
    setup_of(round_config(round))
}

fn setup_of(config: cohort_crypto::RoundConfig) -> Vec<u8> {
    cohort_crypto::ServerRound::new(config).unwrap().setup_message().encode()
}

/// Trains for the round in progress and receives its setup; returns the
/// seed of the generator the round's secrets come from.
fn start_round(p: &mut Participant, round: u64) -> [u8; 32] {
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    assert_eq!(send(p, 0).path, "/v1/round/message");
    assert!(p.round_rng.is_none(), "a generator before the round's protocol started");
    p.handle(0, Response { status: 200, body: setup(round) }).unwrap();
    p.round_rng.as_ref().map(ChaCha20Rng::get_seed).expect("the round has its own generator")
}

#[test]
fn every_round_has_a_fresh_generator_that_ends_with_it() {
    static_assertions::assert_impl_all!(ChaCha20Rng: zeroize::ZeroizeOnDrop);
    let mut p = training();
    let first = start_round(&mut p, 3);
    // The coordinator drops this client: the round ends, its generator with it.
    assert_eq!(send(&mut p, 0).path, "/v1/round/message");
    p.handle(0, Response { status: 410, body: Vec::new() }).unwrap();
    assert!(matches!(p.next(0), Action::RoundEnded(RoundOutcome::Dropped { .. })));
    assert!(p.round_rng.is_none(), "the round's generator outlived the round");
    // The next round starts from a generator of its own.
    select_and_train(&mut p, 4);
    let second = start_round(&mut p, 4);
    assert_ne!(first, second, "two rounds share a generator");
}

#[test]
fn garbage_from_the_server_ends_the_round_not_the_participant() {
    let mut p = training();
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    p.handle(0, Response { status: 200, body: b"not a server message".to_vec() }).unwrap();
    assert!(matches!(p.next(0), Action::RoundEnded(RoundOutcome::Abandoned { .. })));
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    p.handle(0, Response { status: 200, body: b"{\"status\": \"dancing\"}".to_vec() }).unwrap_err();
}

#[test]
fn an_expired_credential_enrolls_again_and_a_refused_token_is_fatal() {
    let mut p = enrolled();
    send(&mut p, 0);
    p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "expired" }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/tasks/task/enroll");
    let error =
        p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "bad token" })));
    assert_eq!(error, Err(ParticipantError::Unauthorized("bad token".into())));
    // Without the enrollment token a resumed participant cannot recover.
    let saved = enrolled().saved_state().unwrap().clone();
    let mut p = Participant::resume(saved, None, config());
    send(&mut p, 0);
    assert!(matches!(p.handle(0, json(401, serde_json::json!({}))), Err(ParticipantError::Unauthorized(_))));
}

#[test]
fn a_task_below_the_policy_is_refused_at_enrollment_and_nothing_is_kept() {
    // The default policy: the small semi-honest task is below it.
    let strict = ParticipantConfig { policy: Policy::default(), ..config() };
    let mut p = Participant::enroll("task", "token", strict);
    send(&mut p, 0);
    let refused = p.handle(0, enrollment_reply());
    assert_eq!(refused, Err(ParticipantError::Policy(PolicyViolation::SemiHonest)));
    let message = refused.unwrap_err().to_string();
    assert!(message.contains("rule variant"), "{message}");
    assert!(p.saved_state().is_none());
    assert!(matches!(p.next(0), Action::Finished));
    // A reply without the task's parameters is no enrollment.
    let mut p = Participant::enroll("task", "token", config());
    send(&mut p, 0);
    let bare = serde_json::json!({ "participant_id": "p1", "credential": "c", "expires_at": 9 });
    assert!(matches!(p.handle(0, json(201, bare)), Err(ParticipantError::UnexpectedReply(_))));
}

#[test]
fn a_round_that_changes_a_pinned_parameter_is_refused_before_anything_is_drawn() {
    let mut p = training();
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    let mut changed = round_config(3);
    changed.modulus_bits = 24;
    let refused = p.handle(0, Response { status: 200, body: setup_of(changed) });
    let Err(ParticipantError::Policy(PolicyViolation::Changed { parameter: "ring bits", .. })) = refused
    else {
        panic!("not refused: {refused:?}");
    };
    assert!(p.round_rng.is_none(), "the round's secrets were drawn");
    assert!(matches!(p.next(0), Action::Finished), "the participant went on");
    assert_eq!(p.saved_state().unwrap().last_contributed_round, 0);
}

#[test]
fn a_round_replayed_or_not_as_selected_is_refused_and_the_next_one_joined() {
    let mut p = training();
    p.saved.as_mut().unwrap().last_contributed_round = 3;
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    p.handle(0, Response { status: 200, body: setup(3) }).unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Refused { report, violation }) => {
            assert_eq!(report.round, 3);
            assert_eq!(violation, PolicyViolation::Replayed { round: 3, last: 3 });
            assert_eq!(violation.rule(), "replay");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(p.round_rng.is_none());
    // Selected for round 4 but handed round 3's setup.
    select_and_train(&mut p, 4);
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    p.handle(0, Response { status: 200, body: setup(3) }).unwrap();
    assert!(matches!(
        p.next(0),
        Action::RoundEnded(RoundOutcome::Refused {
            violation: PolicyViolation::WrongRound { expected: 4, got: 3 },
            ..
        })
    ));
    // A setup whose session is not the one of the selection.
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    let selected = serde_json::json!({
        "status": "selected", "round": 5, "client_id": 2, "session": hex::encode([8u8; 16]),
    });
    p.handle(0, json(200, selected)).unwrap();
    send(&mut p, 0);
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let model = checkpoint::encode(&layout, &[0.5, -0.5], &Default::default()).unwrap();
    p.handle(0, Response { status: 200, body: model }).unwrap();
    assert!(matches!(p.next(0), Action::Train { round: 5, .. }));
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    p.handle(0, Response { status: 200, body: setup(5) }).unwrap();
    assert!(matches!(
        p.next(0),
        Action::RoundEnded(RoundOutcome::Refused { violation: PolicyViolation::WrongSession, .. })
    ));
    // Round 6, as selected: the participant advertises its keys.
    select_and_train(&mut p, 6);
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    p.handle(0, Response { status: 200, body: setup(6) }).unwrap();
    assert_eq!(p.posting(), Some(Stage::AdvertiseKeys));
}

#[test]
fn a_renewed_enrollment_keeps_the_pinned_parameters_and_contributions() {
    let mut p = enrolled();
    p.saved.as_mut().unwrap().record_contribution(7, Some([9; 16]), None);
    send(&mut p, 0);
    p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "expired" }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/tasks/task/enroll");
    p.handle(0, enrollment_reply()).unwrap();
    let renewed = p.saved_state().unwrap();
    assert_eq!((renewed.last_contributed_round, renewed.contributions), (7, 1));
    assert!(renewed.contributed_to(&[9; 16]), "the models contributed to carry over");
    // Debug shows the counts (never the credential or the identity seed).
    let shown = format!("{renewed:?}");
    assert!(shown.contains("contributions: 1") && !shown.contains("secret-credential"), "{shown}");
    // A renewal that announces other parameters is refused.
    send(&mut p, 0);
    p.handle(0, json(401, serde_json::json!({ "error": "unauthorized", "message": "expired" }))).unwrap();
    send(&mut p, 0);
    let mut other = security();
    other.modulus_bits = 16;
    let reply = serde_json::json!({
        "participant_id": "p2", "credential": "c2", "expires_at": 9, "security": serde_json::to_value(other).unwrap(),
    });
    let refused = p.handle(0, json(201, reply));
    assert!(
        matches!(
            refused,
            Err(ParticipantError::Policy(PolicyViolation::Changed { parameter: "ring bits", .. }))
        ),
        "{refused:?}"
    );
}

#[test]
fn a_response_without_a_request_is_refused() {
    let mut p = Participant::enroll("task", "token", config());
    assert!(matches!(p.handle(0, Response::default()), Err(ParticipantError::OutOfOrder(_))));
}

/// An async task's participant: trains from the version it downloaded,
/// checks in with it until a group takes the update, and scales the
/// update by the staleness weight the group names.
fn async_trained(p: &mut Participant, served_version: &str) {
    assert_eq!(send(p, 0).path, "/v1/checkin");
    p.handle(0, json(200, serde_json::json!({ "status": "train", "version": 4 }))).unwrap();
    assert_eq!(send(p, 0).path, "/v1/model");
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let metadata =
        std::collections::BTreeMap::from([("cohort.round".to_string(), served_version.to_string())]);
    let model = checkpoint::encode(&layout, &[0.5, -0.5], &metadata).unwrap();
    p.handle(0, Response { status: 200, body: model }).unwrap();
}

#[test]
fn an_async_participant_trains_waits_with_its_update_and_joins_a_group_weighted() {
    let mut p = enrolled();
    // The model served is newer than the version named: it counts.
    async_trained(&mut p, "5");
    assert!(matches!(p.next(0), Action::Train { round: 5, .. }));
    p.submit(vec![0.4, -0.2], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?trained_on=5");
    p.handle(0, json(200, serde_json::json!({ "status": "wait", "retry_after_ms": 500 }))).unwrap();
    assert!(matches!(p.next(0), Action::Wait(500)));
    assert_eq!(send(&mut p, 500).path, "/v1/checkin?trained_on=5");
    let selected = serde_json::json!({
        "status": "selected", "round": 3, "client_id": 2, "session": hex::encode([7u8; 16]),
        "staleness_weight": 0.5,
    });
    p.handle(500, json(200, selected)).unwrap();
    match &p.phase {
        Phase::Fetch {
            round: 3, client_id: 2, protocol: Protocol::Pending { update, examples: 5 }, ..
        } => {
            assert_eq!(update.as_slice(), &[0.2, -0.1]);
        }
        _ => panic!("not in the group's round"),
    }
    assert_eq!(send(&mut p, 500).path, "/v1/round/message");
    p.handle(500, Response { status: 200, body: setup(3) }).unwrap();
    assert_eq!(p.posting(), Some(Stage::AdvertiseKeys));
}

#[test]
fn an_async_participant_drops_a_stale_update_and_refuses_a_weight_above_one() {
    let mut p = enrolled();
    async_trained(&mut p, "4");
    assert!(matches!(p.next(0), Action::Train { round: 4, .. }));
    p.submit(vec![0.4, -0.2], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?trained_on=4");
    p.handle(0, json(200, serde_json::json!({ "status": "stale", "version": 7, "max_staleness": 2 })))
        .unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Abandoned { reason, .. }) => {
            assert!(reason.contains("behind"), "{reason}")
        }
        other => panic!("expected the update dropped, got {other:?}"),
    }
    // It checks in afresh, without an update.
    async_trained(&mut p, "7");
    assert!(matches!(p.next(0), Action::Train { round: 7, .. }));
    p.submit(vec![0.4, -0.2], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?trained_on=7");
    let inflated = serde_json::json!({
        "status": "selected", "round": 9, "client_id": 1, "session": hex::encode([8u8; 16]),
        "staleness_weight": 2.0,
    });
    p.handle(0, json(200, inflated)).unwrap();
    assert!(matches!(p.next(0), Action::RoundEnded(RoundOutcome::Abandoned { .. })));
    assert_eq!(send(&mut p, 0).path, "/v1/checkin", "nothing of the update is sent");
}

/// THREAT_MODEL claim 48: an async participant masks an update into at
/// most one group. Offered a group it already took part in (here the one
/// its saved state names, as after a restart), it drops the update and
/// sends nothing of it; the next group takes its next update.
#[test]
fn an_async_participant_never_masks_an_update_into_a_group_it_already_joined() {
    let mut p = enrolled();
    let joined = hex::encode([7u8; 16]);
    p.last_joined = Some(joined.clone());
    async_trained(&mut p, "5");
    assert!(matches!(p.next(0), Action::Train { round: 5, .. }));
    p.submit(vec![0.4, -0.2], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?trained_on=5");
    let again = serde_json::json!({
        "status": "selected", "round": 3, "client_id": 2, "session": joined, "staleness_weight": 1.0,
    });
    p.handle(0, json(200, again)).unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Abandoned { reason, .. }) => {
            assert!(reason.contains("group 3"), "{reason}")
        }
        other => panic!("expected the update dropped, got {other:?}"),
    }
    assert_eq!(send(&mut p, 0).path, "/v1/checkin", "nothing of the update is sent");
    // A group it has not joined takes the next update.
    p.handle(0, json(200, serde_json::json!({ "status": "train", "version": 6 }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/model");
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let metadata = std::collections::BTreeMap::from([("cohort.round".to_string(), "6".to_string())]);
    p.handle(
        0,
        Response { status: 200, body: checkpoint::encode(&layout, &[0.5, -0.5], &metadata).unwrap() },
    )
    .unwrap();
    assert!(matches!(p.next(0), Action::Train { round: 6, .. }));
    p.submit(vec![0.4, -0.2], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?trained_on=6");
    let fresh = serde_json::json!({
        "status": "selected", "round": 4, "client_id": 1, "session": hex::encode([8u8; 16]), "staleness_weight": 1.0,
    });
    p.handle(0, json(200, fresh)).unwrap();
    assert!(matches!(p.phase, Phase::Fetch { round: 4, .. }));
}

/// The digest of the model [`select_and_train`] and [`async_trained`]
/// serve, whatever version label it carries.
fn served_digest() -> [u8; 16] {
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    Checkpoint { layout, weights: vec![0.5, -0.5], metadata: Default::default() }.digest()
}

/// THREAT_MODEL claim 55: a participant that sent an update of a model
/// never trains on that model again, in a sync round or an async task, and
/// under any round number or version label; it sends nothing for it and
/// waits before it checks in again. A model that differs in one weight is
/// trained, and the trainer is handed the client's own count of its
/// contributions, not the coordinator's round.
#[test]
fn a_model_already_contributed_to_is_refused_under_any_round_or_version() {
    let mut p = enrolled();
    p.saved.as_mut().unwrap().record_contribution(3, Some(served_digest()), None);
    let refused = |p: &mut Participant| match p.next(0) {
        Action::RoundEnded(RoundOutcome::Refused {
            violation: PolicyViolation::ModelReused { digest },
            ..
        }) => {
            assert_eq!(digest, hex::encode(served_digest()));
            assert!(matches!(p.next(0), Action::Wait(50)), "it waits before checking in again");
        }
        other => panic!("expected the model refused, got {other:?}"),
    };
    // A sync round.
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    p.handle(0, json(200, serde_json::json!({ "status": "selected", "round": 4, "client_id": 2 }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/model");
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let relabelled = std::collections::BTreeMap::from([("cohort.round".to_string(), "4".to_string())]);
    let model = checkpoint::encode(&layout, &[0.5, -0.5], &relabelled).unwrap();
    p.handle(0, Response { status: 200, body: model }).unwrap();
    refused(&mut p);
    // An async task serving it as a new version, −0 for 0 changes nothing.
    p.wait_until = 0;
    async_trained(&mut p, "9");
    refused(&mut p);
    assert_eq!(p.saved_state().unwrap().contributions, 1, "a refusal is no contribution");
    // One weight one ulp away is another model.
    p.wait_until = 0;
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    p.handle(0, json(200, serde_json::json!({ "status": "selected", "round": 6, "client_id": 2 }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/model");
    let nudged = [0.5, f32::from_bits((-0.5f32).to_bits() + 1)];
    p.handle(0, Response { status: 200, body: checkpoint::encode(&layout, &nudged, &relabelled).unwrap() })
        .unwrap();
    assert!(matches!(p.next(0), Action::Train { round: 6, nonce: 1, .. }));
    assert_ne!(p.trained_on, Some(served_digest()));
}

/// The ledger keeps the last MODEL_LEDGER models, and a contribution
/// without a known model still counts.
#[test]
fn the_model_ledger_is_bounded_and_keeps_the_latest() {
    let mut p = enrolled();
    let saved = p.saved.as_mut().unwrap();
    for k in 0..=MODEL_LEDGER as u64 {
        let mut digest = [0u8; 16];
        digest[..8].copy_from_slice(&k.to_le_bytes());
        saved.record_contribution(k + 1, Some(digest), None);
    }
    saved.record_contribution(MODEL_LEDGER as u64 + 5, None, Some(1.5));
    assert_eq!(saved.contributed_models.len(), MODEL_LEDGER);
    assert_eq!(saved.contributions, MODEL_LEDGER as u64 + 2);
    assert_eq!(saved.last_contributed_round, MODEL_LEDGER as u64 + 5);
    assert_eq!(saved.privacy_spent, Some(1.5));
    assert!(!saved.contributed_to(&[0; 16]), "the oldest is forgotten");
    let mut newest = [0u8; 16];
    newest[..8].copy_from_slice(&(MODEL_LEDGER as u64).to_le_bytes());
    assert!(saved.contributed_to(&newest));
    let restored: SavedState = serde_json::from_str(&serde_json::to_string(&*saved).unwrap()).unwrap();
    assert!(restored.contributed_to(&newest) && restored.contributions == saved.contributions);
}

/// Enrolled in a sync task whose rounds name their model.
fn enrolled_bound() -> Participant {
    let bound = cohort_crypto::RoundConfig { model: Some(served_digest()), ..round_config(1) };
    let security = TaskSecurity::of_round(&bound).unwrap();
    assert!(security.model_bound);
    let mut p = Participant::enroll("task", "token", config()).with_seed([1; 32]);
    send(&mut p, 0);
    let reply = serde_json::json!({
        "participant_id": "p1", "credential": "secret-credential", "expires_at": 9,
        "security": serde_json::to_value(security).unwrap(),
    });
    p.handle(0, json(201, reply)).unwrap();
    p
}

/// THREAT_MODEL claim 56: a sync round names the digest of the model its
/// clients train from, in the round context every client checks. A client
/// served one model and shown a round that names another refuses it before
/// anything is drawn; one that enrolled in a task whose rounds name their
/// model refuses a round that names none (the coordinator switching it to
/// the async flow) as a change of the task; the round naming the model it
/// was served is joined.
#[test]
fn a_round_that_names_another_model_or_none_is_refused() {
    let mut p = enrolled_bound();
    select_and_train(&mut p, 3);
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/round/message");
    let other = cohort_crypto::RoundConfig { model: Some([9; 16]), ..round_config(3) };
    p.handle(0, Response { status: 200, body: setup_of(other) }).unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Refused {
            violation: PolicyViolation::WrongModel { announced, served },
            ..
        }) => {
            assert_eq!((announced, served), (hex::encode([9u8; 16]), hex::encode(served_digest())));
        }
        other => panic!("expected the round refused, got {other:?}"),
    }
    assert!(p.round_rng.is_none(), "nothing of the round was drawn");
    // The next round names the model served: joined.
    p.wait_until = 0;
    select_and_train(&mut p, 4);
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    let named = cohort_crypto::RoundConfig { model: Some(served_digest()), ..round_config(4) };
    p.handle(0, Response { status: 200, body: setup_of(named) }).unwrap();
    assert_eq!(p.posting(), Some(Stage::AdvertiseKeys));
    // A round that names no model, in a task pinned to name it: refused
    // as a changed task.
    let mut p = enrolled_bound();
    select_and_train(&mut p, 3);
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    let refused = p.handle(0, Response { status: 200, body: setup(3) });
    assert!(
        matches!(
            refused,
            Err(ParticipantError::Policy(PolicyViolation::Changed { parameter: "model binding", .. }))
        ),
        "{refused:?}"
    );
}

/// THREAT_MODEL claim 57: in a task with differential privacy the
/// participant accounts what its own contributions spend (at the noise it
/// pinned, no amplification) and, before it trains for a contribution that
/// would exceed its budget, stops with `BudgetSpent`: nothing is trained or
/// sent, and the participant is done with the task. The ε a contribution
/// brings is kept in the saved state when its masked input is sent.
#[test]
fn a_private_task_is_left_before_the_clients_own_budget_is_exceeded() {
    use cohort_crypto::dp::accountant::client_epsilon;
    use cohort_crypto::dp::{DpParams, Mechanism};
    use cohort_crypto::policy::TransformKind;
    let params = DpParams {
        mechanism: Mechanism::Skellam,
        clip_norm: 1.0,
        noise_multiplier: 1.0,
        scale: 100.0,
        noise_shares: 2,
    };
    let private = TaskSecurity {
        privacy: Some(params),
        transform: TransformKind::Rotate { block: 2 },
        max_weight: 1,
        ..security()
    };
    // The served model has 2 weights: one rotation block.
    let spent = |k| client_epsilon(&params, 2, k, 1e-6).epsilon;
    let mut config = config();
    config.policy.budget = Some(PrivacyBudget { epsilon: spent(2), delta: 1e-6 });
    let mut p = Participant::enroll("task", "token", config).with_seed([1; 32]);
    send(&mut p, 0);
    let reply = serde_json::json!({
        "participant_id": "p1", "credential": "secret-credential", "expires_at": 9,
        "security": serde_json::to_value(private).unwrap(),
    });
    p.handle(0, json(201, reply)).unwrap();
    // One contribution was sent: the second fits, and says what it spends.
    p.saved.as_mut().unwrap().record_contribution(2, Some([3; 16]), Some(spent(1)));
    select_and_train(&mut p, 3);
    assert_eq!(p.spending, Some(spent(2)));
    p.saved.as_mut().unwrap().record_contribution(3, p.trained_on.take(), p.spending.take());
    assert_eq!(p.saved_state().unwrap().privacy_spent, Some(spent(2)));
    p.vanish("the test moves on");
    assert!(matches!(p.next(0), Action::RoundEnded(_)));
    // The third would exceed the budget: refused before training.
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    p.handle(0, json(200, serde_json::json!({ "status": "selected", "round": 4, "client_id": 2 }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/model");
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let model = checkpoint::encode(&layout, &[0.25, -0.5], &Default::default()).unwrap();
    let refused = p.handle(0, Response { status: 200, body: model });
    match refused {
        Err(ParticipantError::Policy(PolicyViolation::BudgetSpent { budget, would_spend, .. })) => {
            assert_eq!((budget, would_spend), (spent(2), spent(3)));
        }
        other => panic!("expected the budget to stop the participant, got {other:?}"),
    }
    assert!(matches!(p.next(0), Action::Finished), "nothing to train, nothing more to do");
    assert_eq!(p.saved_state().unwrap().contributions, 2);
}

/// A stage message the coordinator already holds (a balancer sent it
/// again after its first answer was lost) counts as delivered: the round
/// goes on, it is not abandoned.
#[test]
fn a_post_the_coordinator_already_has_is_delivered() {
    let mut p = training();
    start_round(&mut p, 3);
    let post = send(&mut p, 0);
    assert_eq!((post.method, post.path.as_str()), (Method::Post, "/v1/round/message"));
    let duplicate =
        serde_json::json!({ "error": "duplicate", "message": "this stage's message was received" });
    p.handle(0, json(409, duplicate)).unwrap();
    let mut now = 0;
    let next = loop {
        match p.next(now) {
            Action::Send(request) => break request,
            Action::Wait(ms) => now += ms.max(1),
            other => panic!("the round did not go on: {other:?}"),
        }
    };
    assert_eq!((next.method, next.path.as_str()), (Method::Get, "/v1/round/message"));
}

/// With `wait_ms`, the participant asks the coordinator to hold its
/// check-ins (async ones too) and its requests for the next stage message
/// (fetches, and posts: see the test below), and nothing else; the wait
/// asked for is capped at what a coordinator grants.
#[test]
fn a_participant_asks_to_be_held_where_it_would_poll() {
    let mut config = config();
    config.wait_ms = 15_000;
    let mut p = Participant::enroll("task", "token", config).with_seed([1; 32]);
    assert_eq!(send(&mut p, 0).path, "/v1/tasks/task/enroll");
    p.handle(0, enrollment_reply()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?wait_ms=15000");
    p.handle(0, json(200, serde_json::json!({ "status": "selected", "round": 3, "client_id": 2 }))).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/model");
    let layout = ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![2] }] };
    let model = checkpoint::encode(&layout, &[0.5, -0.5], &Default::default()).unwrap();
    p.handle(0, Response { status: 200, body: model }).unwrap();
    let Action::Train { .. } = p.next(0) else { panic!("no training") };
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/round/message?wait_ms=15000");
    // A coordinator from before held requests refuses a check-in's wait:
    // the participant asks again without it, and polls from then on.
    let mut p = enrolled();
    p.config.wait_ms = 15_000;
    assert_eq!(send(&mut p, 0).path, "/v1/checkin?wait_ms=15000");
    let refused =
        serde_json::json!({ "error": "invalid_round", "message": "the check-in takes one parameter" });
    p.handle(0, json(400, refused)).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/checkin");
    p.handle(0, json(200, serde_json::json!({ "status": "wait", "retry_after_ms": 10 }))).unwrap();
    assert_eq!(send(&mut p, 20).path, "/v1/checkin");
    assert_eq!(
        crate::api::routes::held("/v1/checkin?trained_on=4", 60_000),
        "/v1/checkin?trained_on=4&wait_ms=20000"
    );
    assert_eq!(crate::api::routes::held("/v1/checkin", 0), "/v1/checkin");
}

/// With `wait_ms`, a stage message's post asks to be held for the next
/// stage message: a `200` carries it (no fetch follows), a `202` says
/// there is none yet (the participant fetches it, held too).
#[test]
fn a_post_asks_for_the_next_stage_message_in_the_same_request() {
    let mut p = training();
    p.config.wait_ms = 15_000;
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    assert_eq!(send(&mut p, 0).path, "/v1/round/message?wait_ms=15000");
    p.handle(0, Response { status: 200, body: setup(3) }).unwrap();
    let post = send(&mut p, 0);
    assert_eq!((post.method, post.path.as_str()), (Method::Post, "/v1/round/message?wait_ms=15000"));
    // Accepted, nothing yet: fetched next.
    p.handle(0, Response { status: 202, body: Vec::new() }).unwrap();
    let fetch = send(&mut p, 0);
    assert_eq!((fetch.method, fetch.path.as_str()), (Method::Get, "/v1/round/message?wait_ms=15000"));
    // The same post answered with a body: that body is the next stage
    // message (here one that does not decode, which ends the round).
    let mut p = training();
    p.config.wait_ms = 15_000;
    start_round_held(&mut p, 3);
    assert_eq!(send(&mut p, 0).method, Method::Post);
    p.handle(0, Response { status: 200, body: b"not a server message".to_vec() }).unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Abandoned { reason, .. }) => {
            assert!(reason.contains("undecodable server message"), "{reason}");
        }
        other => panic!("the post's answer was not taken as the next message: {other:?}"),
    }
}

/// A post refused because its stage has closed may be the retry of one
/// that was accepted and whose answer was lost (held until the stage
/// closed): the participant fetches, and the fetch says whether it is
/// still in the round.
#[test]
fn a_post_after_its_stage_closed_asks_whether_the_first_try_arrived() {
    let out_of_phase =
        || json(409, serde_json::json!({ "error": "out_of_phase", "message": "that stage has closed" }));
    // The first try arrived: the fetch brings the next stage's message.
    let mut p = training();
    start_round(&mut p, 3);
    assert_eq!(send(&mut p, 0).method, Method::Post);
    p.handle(0, out_of_phase()).unwrap();
    let fetch = send(&mut p, 0);
    assert_eq!((fetch.method, fetch.path.as_str()), (Method::Get, "/v1/round/message"));
    p.handle(0, Response { status: 200, body: b"not a server message".to_vec() }).unwrap();
    match p.next(0) {
        Action::RoundEnded(RoundOutcome::Abandoned { reason, .. }) => {
            assert!(reason.contains("undecodable server message"), "{reason}");
        }
        other => panic!("the fetch's answer was not taken as the next message: {other:?}"),
    }
    // It did not: the coordinator dropped the client, and the fetch says so.
    let mut p = training();
    start_round(&mut p, 3);
    send(&mut p, 0);
    p.handle(0, out_of_phase()).unwrap();
    assert_eq!(send(&mut p, 0).method, Method::Get);
    p.handle(0, Response { status: 410, body: Vec::new() }).unwrap();
    assert!(matches!(p.next(0), Action::RoundEnded(RoundOutcome::Dropped { .. })));
}

/// [`start_round`] for a participant whose fetches are held.
fn start_round_held(p: &mut Participant, round: u64) {
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    assert_eq!(send(p, 0).path, format!("/v1/round/message?wait_ms={}", p.config.wait_ms));
    p.handle(0, Response { status: 200, body: setup(round) }).unwrap();
}

/// Runs round 3 of [`setup`] with this participant as client 2 beside two
/// clients of the core; with `host`, the participant leaves its
/// agreements and key streams to the driver (this test, computing them
/// with the core's primitives as a page would with WebCrypto). Returns
/// every message the participant posted and the host work it was asked
/// for.
fn round_with_host(host: bool) -> (Vec<Vec<u8>>, Vec<&'static str>) {
    use cohort_crypto::agreement::x25519;
    use cohort_crypto::prg::{MaskPrg, MaskSign};
    use cohort_crypto::{Advanced, ClientId, QuantizedInput, ServerMessage, ServerRound};
    let config = round_config(3);
    let mut server = ServerRound::new(config.clone()).unwrap();
    let mut p = training();
    p.set_host_crypto(host);
    p.submit(vec![0.1, 0.0], 5, MetricValues::new()).unwrap();
    send(&mut p, 0);
    p.handle(0, Response { status: 200, body: setup(3) }).unwrap();
    let mut others: Vec<(ClientId, Client, ChaCha20Rng)> = [1u32, 3]
        .into_iter()
        .map(|i| {
            let id = ClientId::new(i).unwrap();
            let mut rng = ChaCha20Rng::from_seed([i as u8; 32]);
            let input = QuantizedInput::from_values(vec![i; config.vector_len as usize]);
            let (client, message) = Client::start(server.setup_message(), id, None, input, &mut rng).unwrap();
            server.receive(id, message).unwrap();
            (id, client, rng)
        })
        .collect();
    let (mut posted, mut asked, mut steps) = (Vec::new(), Vec::new(), Vec::new());
    let me = ClientId::new(2).unwrap();
    loop {
        // The participant's post; with host work first.
        let request = loop {
            match p.next(0) {
                Action::Send(request) => break request,
                Action::HostWork => {}
                other => panic!("expected a post or host work, got {other:?}"),
            }
            steps.push(p.host_step().unwrap());
            match p.host_work().unwrap() {
                Work::Agreements { secret, peers } => {
                    let secret = secret.bytes();
                    asked.push("agreements");
                    let shared = peers
                        .iter()
                        .map(|public| Some(cohort_crypto::Secret32::from_bytes(&mut x25519(&secret, public))))
                        .collect();
                    p.agreed(shared).unwrap();
                }
                Work::KeyStreams { masks, words } => {
                    asked.push("key_streams");
                    let streams: Vec<Vec<u32>> = masks
                        .iter()
                        .map(|mask| {
                            let mut stream = vec![0u32; words];
                            MaskPrg::from_key(mask.key()).apply(&mut stream, MaskSign::Add);
                            stream
                        })
                        .collect();
                    // Agreements for this step are refused, the step kept.
                    assert!(p.agreed(Vec::new()).is_err() && p.host_step() == steps.last().copied());
                    for (i, stream) in streams.iter().enumerate() {
                        p.add_key_stream(i, stream).unwrap();
                    }
                    p.complete_host_work().unwrap();
                }
            }
        };
        server.receive_encoded(me, &request.body).unwrap();
        posted.push(request.body);
        server = match server.advance().unwrap() {
            Advanced::Next(next) => next,
            Advanced::Done(aggregate) => {
                assert_eq!(aggregate.contributors.len(), 3);
                // Each step that waited for the driver had a number of its own.
                assert!(steps.windows(2).all(|w| w[0] < w[1]), "{steps:?}");
                return (posted, asked);
            }
        };
        for (id, client, rng) in &mut others {
            let taken = std::mem::replace(client, Client::Aborted);
            let (next, reply) = taken.handle(server.message_for(*id).unwrap(), rng);
            *client = next;
            server.receive(*id, reply.unwrap()).unwrap();
        }
        let message: ServerMessage = server.message_for(me).unwrap();
        p.handle(0, Response { status: 200, body: message.encode() }).unwrap();
    }
}

#[test]
fn a_participant_that_leaves_its_crypto_to_the_driver_posts_the_same_messages() {
    let (in_place, none) = round_with_host(false);
    let (hosted, asked) = round_with_host(true);
    assert!(none.is_empty());
    // The share stage's agreements, then the masking stage's and its key
    // streams.
    assert_eq!(asked, ["agreements", "agreements", "key_streams"]);
    assert_eq!(in_place.len(), 4, "keys, shares, masked input, unmasking");
    assert_eq!(in_place, hosted);
}

#[test]
fn host_work_calls_out_of_turn_are_refused() {
    let mut p = training();
    p.set_host_crypto(true);
    assert!(p.host_work().is_none());
    assert!(matches!(p.complete_host_work(), Err(ParticipantError::OutOfOrder(_))));
    assert!(matches!(p.agreed(Vec::new()), Err(ParticipantError::OutOfOrder(_))));
    assert!(matches!(p.add_key_stream(0, &[1, 2]), Err(ParticipantError::OutOfOrder(_))));
    assert_eq!(p.host_step(), None);
}
