//! A malicious coordinator, over real HTTP: a scripted proxy in front of a
//! real coordinator rewrites what the clients are told (the task's
//! parameters at enrollment, the round's setup, the peers' keys and
//! signatures, the survivor list, the round itself) and records every
//! request each client makes. Honest clients of the native library run
//! against it; each attack checks that the clients refuse with the rule
//! it broke, and, from the recording, that none of them sent anything the
//! attack could use: no keys, no shares, no masked input, no unmasking.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_client::participant::{
    Metric, MetricValues, Participant, ParticipantConfig, ParticipantError, Policy, PolicyViolation,
    Response, RoundOutcome, TaskSecurity,
};
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{RunError, Runner};
use cohort_crypto::{ServerMessage, Stage, Transform, Variant};
use cohort_server::api::CreatedTask;
use cohort_tests::Serve;
use cohort_tests::proxy::{
    Exchange, Proxy, Tamper, replay_round_one, rewrite_enrollment, rewrite_peer_keys, rewrite_setup,
    split_survivors, split_target,
};
use serde_json::{Value, json};

const ADMIN: &str = "admin-token-for-the-malicious-coordinator-tests";
const CLIENTS: u32 = 4;
const DIMENSION: usize = 8;

/// Every client's update: 0.01 everywhere, 3 examples, a training loss.
fn honest() -> support::Steady {
    let mut metrics = MetricValues::new();
    metrics.set(Metric::TrainLoss, 0.5).unwrap();
    support::Steady { delta: vec![0.01; DIMENSION], examples: 3, metrics }
}

/// A task of [`CLIENTS`] clients in the active variant on the complete
/// graph, threshold 3 (2t > k = 3), short deadlines.
fn spec(name: &str, rounds: u32) -> Value {
    json!({
        "name": name, "rounds": rounds, "clients_per_round": CLIENTS,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [DIMENSION] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3 },
        "deadlines": { "advertise_keys_ms": 20000, "share_keys_ms": 4000, "masked_input_ms": 4000, "unmasking_ms": 4000 },
        "checkpoint_retention": 5
    })
}

/// The parameters the honest coordinator announces for [`spec`].
fn honest_security() -> TaskSecurity {
    TaskSecurity {
        variant: Variant::Active,
        clients: CLIENTS,
        graph: cohort_crypto::policy::GraphKind::Complete,
        degree: CLIENTS - 1,
        threshold: 3,
        modulus_bits: 32,
        clip: 1.0,
        max_weight: 1 << 14,
        transform: cohort_crypto::policy::TransformKind::None,
        privacy: None,
        model_bound: true,
    }
}

/// What happened to one client: its round outcomes, then the error that
/// ended it (or `None` when it was stopped or the task ended).
type Ending = (Vec<RoundOutcome>, Option<ParticipantError>);

/// Runs [`CLIENTS`] honest clients through `proxy` until each has seen
/// `rounds` outcomes, failed, or `patience` ran out; returns their endings.
fn run_clients(proxy: &Proxy, task: &str, token: &str, rounds: usize, patience: Duration) -> Vec<Ending> {
    let policy = Policy::accepting(&honest_security());
    let config = ParticipantConfig { poll_interval_ms: 25, policy, ..ParticipantConfig::default() };
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let (url, task, token, stop) =
                (proxy.url.clone(), task.to_string(), token.to_string(), stop.clone());
            std::thread::spawn(move || {
                // The operating system's randomness: identity keys differ
                // from one enrollment to the next, as they do in use.
                let participant = Participant::enroll(&task, &token, config);
                let mut runner =
                    Runner::new(participant, HttpTransport::new(&url), None).with_interrupt(stop);
                let mut outcomes = Vec::new();
                while outcomes.len() < rounds {
                    match runner.run_round(&mut honest()) {
                        Ok(Some(outcome)) => outcomes.push(outcome),
                        Ok(None) | Err(RunError::Interrupted) => return (outcomes, None),
                        Err(RunError::Participant(error)) => return (outcomes, Some(error)),
                        Err(other) => panic!("client {k}: {other}"),
                    }
                }
                (outcomes, None)
            })
        })
        .collect();
    let deadline = Instant::now() + patience;
    while Instant::now() < deadline && !threads.iter().all(std::thread::JoinHandle::is_finished) {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn policy_rule(ending: &Ending) -> Option<&'static str> {
    match &ending.1 {
        Some(ParticipantError::Policy(violation)) => Some(violation.rule()),
        _ => None,
    }
}

/// Starts a coordinator with one task and the proxy scripted by `tamper`.
fn scenario(name: &str, rounds: u32, tamper: Tamper) -> (Serve, Proxy, String, String) {
    let coordinator = Serve::in_process(name, ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } =
        coordinator.admin().create_task(&spec(name, rounds));
    let proxy = Proxy::start(&coordinator.url, tamper);
    (coordinator, proxy, task, token)
}

#[test]
fn the_honest_proxy_changes_nothing_and_the_round_completes() {
    let (_coordinator, proxy, task, token) = scenario("mc-honest", 1, Box::new(|_, _| {}));
    let endings = run_clients(&proxy, &task, &token, 1, Duration::from_secs(60));
    for ending in &endings {
        assert!(ending.1.is_none(), "{:?}", ending.1);
        assert!(matches!(ending.0.as_slice(), [RoundOutcome::Completed(_)]), "{:?}", ending.0);
    }
    // The recording sees every stage of the active variant from everyone.
    let posted = proxy.posted();
    assert_eq!(posted.len(), CLIENTS as usize);
    for stages in posted.values() {
        assert_eq!(
            stages,
            &[
                Stage::AdvertiseKeys,
                Stage::ShareKeys,
                Stage::MaskedInputCollection,
                Stage::ConsistencyCheck,
                Stage::Unmasking
            ]
        );
    }
}

/// A coordinator that asks an active round's clients for their metrics in
/// the clear gets none of them: it learns only their mean, from the sum
/// under the masks.
#[test]
fn an_active_round_sends_no_metrics_in_the_clear_even_when_asked() {
    let ask = Box::new(|exchange: &Exchange, response: &mut Response| {
        if exchange.path == "/v1/checkin" {
            let mut answer: Value = serde_json::from_slice(&response.body).unwrap();
            if answer["status"] == "selected" {
                answer["plaintext_metrics"] = json!(true);
                response.body = serde_json::to_vec(&answer).unwrap();
            }
        }
    });
    let (coordinator, proxy, task, token) = scenario("mc-metrics", 1, ask);
    let endings = run_clients(&proxy, &task, &token, 1, Duration::from_secs(60));
    for ending in &endings {
        assert!(matches!(ending.0.as_slice(), [RoundOutcome::Completed(_)]), "{:?}", ending.0);
    }
    {
        let script = proxy.script.lock().unwrap();
        let asked = script.log.iter().filter(|e| {
            e.path == "/v1/checkin"
                && serde_json::from_slice::<Value>(&e.reply).unwrap()["plaintext_metrics"] == true
        });
        assert!(asked.count() >= CLIENTS as usize, "every client was asked");
        let sent: Vec<&str> =
            script.log.iter().map(|e| e.path.as_str()).filter(|p| p.contains("metrics")).collect();
        assert_eq!(sent, Vec::<&str>::new(), "no client sent its metrics in the clear");
    }
    // A client is done with the round once its last message is accepted;
    // the coordinator records the round when it has unmasked the sum.
    let path = format!("/admin/tasks/{task}/rounds");
    let mut rounds = Value::Null;
    cohort_tests::wait_for(Duration::from_secs(30), "the round's record", || {
        let (status, body) = coordinator.admin().send("GET", &path, &[]);
        assert_eq!(status, 200);
        rounds = serde_json::from_slice(&body).unwrap();
        rounds.as_array().is_some_and(|rounds| !rounds.is_empty())
    });
    let mean = &rounds[0]["metrics"]["client_means"]["train_loss"];
    assert!((mean["mean"].as_f64().unwrap() - 0.5).abs() < 1e-5, "{rounds}");
    assert_eq!(mean["clients"], CLIENTS, "{rounds}");
}

#[test]
fn a_task_announced_below_the_policy_is_refused_at_enrollment() {
    type Weaken = fn(&mut TaskSecurity);
    let attacks: [(&str, Weaken, &str); 3] = [
        ("too few clients", |s| s.clients = 3, "min_clients"),
        ("a low threshold", |s| s.threshold = 2, "min_threshold"),
        ("the semi-honest variant", |s| s.variant = Variant::SemiHonest, "variant"),
    ];
    for (k, (attack, weaken, rule)) in attacks.into_iter().enumerate() {
        let (_coordinator, proxy, task, token) =
            scenario(&format!("mc-enroll-{k}"), 1, rewrite_enrollment(weaken));
        let endings = run_clients(&proxy, &task, &token, 1, Duration::from_secs(30));
        for ending in &endings {
            assert_eq!(policy_rule(ending), Some(rule), "{attack}: {:?}", ending.1);
        }
        assert!(proxy.posted().is_empty(), "{attack}: a client took part");
        let script = proxy.script.lock().unwrap();
        assert!(
            script.log.iter().all(|e| e.path.ends_with("/enroll")),
            "{attack}: a client went on after refusing"
        );
    }
}

/// A tampered round's vector length made to fit it again (a validated
/// round's vector ends with its blindings' tail, whose length follows from
/// the ring), so that it decodes and the client's policy is what refuses it.
fn keep_valid(config: &mut cohort_crypto::RoundConfig) {
    if let Ok(Some(layout)) = cohort_crypto::validation::RoundValidation::new(config) {
        config.vector_len = layout.vector_len() as u32;
    }
}

#[test]
fn a_round_that_departs_from_the_enrolled_task_is_refused_before_any_key() {
    type Change = fn(&mut cohort_crypto::RoundConfig);
    let attacks: [(&str, Change, &str); 5] = [
        // In a round of four no other active threshold is valid (2t > k + 1
        // asks for 3 of k = 3): a lower one does not even decode as a
        // round, and the client gives the round up (below).
        ("a lower threshold", |c| c.threshold = 2, "threshold"),
        (
            "the semi-honest variant",
            |c| {
                c.variant = Variant::SemiHonest;
                c.identities.clear();
            },
            "variant",
        ),
        (
            "a narrower ring",
            |c| {
                c.modulus_bits = 24;
                keep_valid(c);
            },
            "ring bits",
        ),
        (
            "compression switched on",
            |c| {
                c.quantization.transform = Transform::Rotate { block: 8, seed: [3; 32] };
                c.vector_len = 9;
                keep_valid(c);
            },
            "transform",
        ),
        ("a different clip", |c| c.quantization.clip = 100.0, "clip"),
    ];
    for (k, (attack, change, parameter)) in attacks.into_iter().enumerate() {
        let (_coordinator, proxy, task, token) = scenario(&format!("mc-setup-{k}"), 1, rewrite_setup(change));
        let endings = run_clients(&proxy, &task, &token, 1, Duration::from_secs(60));
        for ending in &endings {
            if parameter == "threshold" {
                assert!(
                    matches!(ending.0.as_slice(), [RoundOutcome::Abandoned { reason, report }]
                        if reason.contains("invalid round configuration") && report.bytes_up == 0),
                    "{attack}: {ending:?}"
                );
                continue;
            }
            let Some(ParticipantError::Policy(PolicyViolation::Changed { parameter: named, .. })) = &ending.1
            else {
                panic!("{attack}: not refused: {ending:?}");
            };
            assert_eq!(named, &parameter, "{attack}");
        }
        assert!(proxy.posted().is_empty(), "{attack}: a client sent {:?}", proxy.posted());
    }
}

#[test]
fn a_substituted_key_or_a_forged_or_missing_signature_gets_no_share() {
    type Change = fn(&mut cohort_crypto::messages::AdvertisedKeys);
    let attacks: [(&str, Change); 4] = [
        ("a substituted mask key", |p| p.mask_key = [9; 32]),
        ("a substituted cipher key", |p| p.cipher_key[0] ^= 1),
        ("a forged signature", |p| p.signature = Some([7; 64])),
        ("a missing signature", |p| p.signature = None),
    ];
    for (k, (attack, change)) in attacks.into_iter().enumerate() {
        let (_coordinator, proxy, task, token) =
            scenario(&format!("mc-keys-{k}"), 1, rewrite_peer_keys(change));
        let endings = run_clients(&proxy, &task, &token, 1, Duration::from_secs(60));
        let posted = proxy.posted();
        let credentials = proxy.credentials();
        // The client shown the altered key advertised its own keys, then
        // sent no share to anybody.
        let victims: Vec<_> =
            posted.iter().filter(|(_, stages)| stages == &&[Stage::AdvertiseKeys]).collect();
        assert_eq!(victims.len(), 1, "{attack}: {posted:?}");
        assert!(credentials.contains(victims[0].0));
        let abandoned =
            endings.iter().filter(|e| matches!(e.0.first(), Some(RoundOutcome::Abandoned { .. })));
        assert!(abandoned.count() >= 1, "{attack}: {endings:?}");
    }
}

#[test]
fn survivor_lists_that_differ_between_clients_get_no_unmasking_share() {
    // The both-shares attack: tell one client that another survivor
    // dropped out, so that it would reveal that client's mask-key shares
    // while the others reveal its self-mask shares.
    let (_coordinator, proxy, task, token) = scenario("mc-survivors", 1, split_survivors());
    let endings = run_clients(&proxy, &task, &token, 1, Duration::from_secs(60));
    let posted = proxy.posted();
    let target = split_target(&proxy, CLIENTS as usize);
    // The client told a different list signed it and stopped there.
    assert_eq!(
        posted[&target],
        [Stage::AdvertiseKeys, Stage::ShareKeys, Stage::MaskedInputCollection, Stage::ConsistencyCheck],
        "{posted:?}"
    );
    // No client unmasks with a signature set that includes a list it did
    // not sign: every honest client that unmasked saw t signatures over
    // the full list, which the target never signed.
    for (bearer, stages) in &posted {
        if stages.contains(&Stage::Unmasking) {
            assert_ne!(bearer, &target);
        }
    }
    assert!(endings.iter().all(|e| e.1.is_none()), "{endings:?}");
}

#[test]
fn a_round_replayed_from_an_earlier_round_or_another_task_is_refused() {
    // Round 1 runs honestly; the proxy keeps its setup and, in round 2,
    // announces a re-run of round 1.
    let (_coordinator, proxy, task, token) = scenario("mc-replay", 2, replay_round_one());
    let endings = run_clients(&proxy, &task, &token, 2, Duration::from_secs(60));
    for (outcomes, error) in &endings {
        assert!(error.is_none(), "{error:?}");
        assert!(matches!(outcomes[0], RoundOutcome::Completed(_)), "{outcomes:?}");
        assert!(
            matches!(
                &outcomes[1],
                RoundOutcome::Refused { violation: PolicyViolation::Replayed { round: 1, last: 1 }, .. }
            ),
            "{outcomes:?}"
        );
    }
    // Nothing after round 1's five messages.
    for stages in proxy.posted().values() {
        assert_eq!(stages.len(), 5, "{stages:?}");
    }

    // Another task's round: clients of task B are served task A's setup.
    let coordinator = Serve::in_process("mc-other-task", ADMIN);
    let CreatedTask { id: task_a, enrollment_token: token_a, .. } =
        coordinator.admin().create_task(&spec("mc-task-a", 1));
    let CreatedTask { id: task_b, enrollment_token: token_b, .. } =
        coordinator.admin().create_task(&spec("mc-task-b", 1));
    let recorded: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
    let record = recorded.clone();
    let proxy_a = Proxy::start(
        &coordinator.url,
        Box::new(move |exchange, response| {
            if exchange.path == "/v1/round/message" && response.status == 200 {
                if let Ok(ServerMessage::Setup(_)) = ServerMessage::decode(&response.body) {
                    record.lock().unwrap().get_or_insert_with(|| response.body.clone());
                }
            }
        }),
    );
    let endings = run_clients(&proxy_a, &task_a, &token_a, 1, Duration::from_secs(60));
    assert!(endings.iter().all(|e| matches!(e.0.as_slice(), [RoundOutcome::Completed(_)])), "{endings:?}");
    let other = recorded.lock().unwrap().clone().unwrap();
    let ServerMessage::Setup(other_config) = ServerMessage::decode(&other).unwrap() else { unreachable!() };
    let proxy_b = Proxy::start(
        &coordinator.url,
        Box::new(move |exchange, response| {
            if exchange.path == "/v1/round/message" && response.status == 200 {
                if let Ok(ServerMessage::Setup(_)) = ServerMessage::decode(&response.body) {
                    response.body = other.clone();
                }
            }
            if exchange.path == "/v1/checkin" && response.status == 200 {
                let mut reply: Value = serde_json::from_slice(&response.body).unwrap();
                if reply["status"] == "selected" {
                    reply["session"] = json!(hex::encode(other_config.session));
                    response.body = reply.to_string().into_bytes();
                }
            }
        }),
    );
    let endings = run_clients(&proxy_b, &task_b, &token_b, 1, Duration::from_secs(30));
    for (outcomes, error) in &endings {
        assert!(error.is_none(), "{error:?}");
        assert!(
            matches!(
                &outcomes[..],
                [RoundOutcome::Refused { violation: PolicyViolation::NotOurIdentity, .. }]
            ),
            "{outcomes:?}"
        );
    }
    assert!(proxy_b.posted().is_empty(), "{:?}", proxy_b.posted());
}
