//! The client library's participant against a real coordinator over
//! HTTP on loopback: enrollment, selection, training hand-off, secure
//! aggregation, a client that vanishes mid-round, a client restarted from
//! its state file, and the typed errors.

#![allow(clippy::unwrap_used)]

use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::participant::{
    Metric, MetricValues, Participant, ParticipantConfig, ParticipantError, RoundOutcome, Stage,
};
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{LocalUpdate, RunError, Runner, Trainer, load_state};
use cohort_server::api::CreatedTask;
use cohort_tests::Serve;
use serde_json::{Value, json};

const ADMIN: &str = "admin-token-for-participant-tests";

/// Hands in a fixed update every round.
struct Fixed {
    delta: Vec<f32>,
    examples: u32,
    /// The round and the nonce of each call.
    rounds_trained: Vec<u64>,
    nonces: Vec<u64>,
}

impl Fixed {
    fn new(delta: Vec<f32>, examples: u32) -> Self {
        Self { delta, examples, rounds_trained: vec![], nonces: vec![] }
    }
}

impl Trainer for Fixed {
    fn train(
        &mut self,
        contribution: cohort_client::runtime::Contribution,
        model: &Checkpoint,
    ) -> Result<LocalUpdate, cohort_client::runtime::UpdateError> {
        assert_eq!(model.weights.len(), self.delta.len());
        self.rounds_trained.push(contribution.round);
        self.nonces.push(contribution.nonce);
        Ok(LocalUpdate {
            delta: self.delta.clone(),
            examples: self.examples,
            metrics: cohort_client::participant::MetricValues::new(),
        })
    }
}

fn spec(clients: u32, rounds: u32) -> Value {
    json!({
        "name": "participant test",
        "rounds": rounds,
        "clients_per_round": clients,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [3] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3 },
        "deadlines": { "advertise_keys_ms": 20000, "share_keys_ms": 20000, "masked_input_ms": 3000, "unmasking_ms": 20000 }
    })
}

/// Quick polling, and a policy that accepts the small task of `spec`.
fn fast(spec: &Value) -> ParticipantConfig {
    ParticipantConfig {
        poll_interval_ms: 50,
        policy: cohort_tests::policy_for(spec),
        ..ParticipantConfig::default()
    }
}

fn update(k: usize) -> Vec<f32> {
    vec![k as f32 * 0.1, -(k as f32) * 0.05, 0.25]
}

#[test]
fn participants_train_a_task_over_http_with_a_dropout_and_a_restart() {
    let coordinator = Serve::in_process("rounds", ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } = coordinator.admin().create_task(&spec(5, 2));
    let state_dir = std::env::temp_dir().join(format!("cohort-participant-state-{}", std::process::id()));
    std::fs::create_dir_all(&state_dir).unwrap();
    let handles: Vec<_> = (0..5)
        .map(|k| {
            let (url, task, token) = (coordinator.url.clone(), task.clone(), token.clone());
            let state_file = state_dir.join(format!("client-{k}.json"));
            std::thread::spawn(move || {
                let mut trainer = Fixed::new(update(k), 10 + k as u32);
                let participant =
                    Participant::enroll(&task, &token, fast(&spec(5, 2))).with_seed([k as u8; 32]);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), Some(state_file.clone()));
                let mut outcomes = Vec::new();
                // Client 4 leaves round 1 after its shares, before its
                // masked input: its pairwise masks must be recovered.
                let vanish = |p: &Participant| k == 4 && p.posting() == Some(Stage::MaskedInputCollection);
                outcomes.push(runner.run_round_with(&mut trainer, vanish).unwrap().unwrap());
                let enrolled_as = runner.participant().saved_state().unwrap().participant_id.clone();
                if k == 0 {
                    // Client 0 restarts from its state file between rounds.
                    drop(runner);
                    let saved = load_state(&state_file).unwrap().unwrap();
                    assert_eq!(saved.participant_id, enrolled_as);
                    assert_eq!(saved.last_completed_round, 1);
                    let credential =
                        serde_json::to_value(&saved).unwrap()["credential"].as_str().unwrap().to_string();
                    assert!(credential.len() >= 32 && !format!("{saved:?}").contains(&credential));
                    let participant = Participant::resume(saved, None, fast(&spec(5, 2)));
                    runner = Runner::new(participant, HttpTransport::new(&url), Some(state_file));
                }
                while let Some(outcome) = runner.run_round(&mut trainer).unwrap() {
                    outcomes.push(outcome);
                }
                let saved = runner.participant().saved_state().unwrap();
                assert_eq!(saved.participant_id, enrolled_as);
                (
                    outcomes,
                    trainer.rounds_trained,
                    trainer.nonces,
                    saved.contributions,
                    saved.contributed_models.len(),
                )
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (k, (outcomes, rounds, nonces, contributions, models)) in results.iter().enumerate() {
        assert_eq!(rounds, &vec![1, 2], "client {k} trained in rounds {rounds:?}");
        // THREAT_MODEL claim 55: training is seeded by the client's count
        // of its masked inputs, not by the round, and each is recorded with
        // its model before it leaves (client 4's too, built and then not
        // sent), across a restart.
        assert_eq!(nonces, &vec![0, 1], "client {k}");
        assert_eq!((*contributions, *models), (2, 2), "client {k}");
        assert_eq!(outcomes.len(), 2, "client {k}: {outcomes:?}");
        let first_completed = matches!(outcomes[0], RoundOutcome::Completed(_));
        assert_eq!(first_completed, k != 4, "client {k}: {outcomes:?}");
        assert!(matches!(outcomes[1], RoundOutcome::Completed(_)), "client {k}: {outcomes:?}");
        let report = outcomes[1].report();
        assert_eq!(report.round, 2);
        // The upload carries the input's norm proof (a new active task
        // validates its inputs), so it is the larger direction here.
        assert!(report.bytes_up > 0 && report.bytes_down > 0, "{report:?}");
    }

    // FedAvg from zeros: the model is the sum of the two rounds' weighted
    // means, round 1 without client 4.
    let mean = |clients: &[usize]| -> Vec<f32> {
        let total: f32 = clients.iter().map(|&k| 10.0 + k as f32).sum();
        (0..3)
            .map(|j| clients.iter().map(|&k| update(k)[j] * (10.0 + k as f32)).sum::<f32>() / total)
            .collect()
    };
    let expected: Vec<f32> =
        mean(&[0, 1, 2, 3]).iter().zip(mean(&[0, 1, 2, 3, 4])).map(|(a, b)| a + b).collect();
    let (status, bytes) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/checkpoints/2"), &[]);
    assert_eq!(status, 200);
    let model = checkpoint::decode(&bytes).unwrap();
    for (got, want) in model.weights.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-3, "{:?} vs {expected:?}", model.weights);
    }
    let (_, rounds) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/rounds"), &[]);
    let rounds: Vec<Value> = serde_json::from_slice(&rounds).unwrap();
    assert_eq!(rounds.iter().map(|r| r["survivors"].as_i64().unwrap()).collect::<Vec<_>>(), vec![4, 5]);
    std::fs::remove_dir_all(&state_dir).unwrap();
}

/// Ten participants in groups of at most five: every round runs two
/// protocol instances of five, a dropout inside a group is recovered there,
/// and the model moves by the weighted mean of every survivor of both.
#[test]
fn a_round_in_two_groups_trains_one_model_over_http() {
    let coordinator = Serve::in_process("groups", ADMIN);
    let mut grouped = spec(10, 2);
    grouped["secure_aggregation"]["group_size"] = json!(5);
    let CreatedTask { id: task, enrollment_token: token, .. } =
        coordinator.admin().create_task(&grouped.clone());
    let handles: Vec<_> = (0..10)
        .map(|k| {
            let (url, task, token, grouped) =
                (coordinator.url.clone(), task.clone(), token.clone(), grouped.clone());
            std::thread::spawn(move || {
                let mut trainer = Fixed::new(update(k), 10 + k as u32);
                let participant =
                    Participant::enroll(&task, &token, fast(&grouped)).with_seed([k as u8 + 80; 32]);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), None);
                // Client 9 leaves round 1 after its shares: its group
                // recovers its masks with the four others' shares.
                let vanish = |p: &Participant| k == 9 && p.posting() == Some(Stage::MaskedInputCollection);
                let mut outcomes = vec![runner.run_round_with(&mut trainer, vanish).unwrap().unwrap()];
                while let Some(outcome) = runner.run_round(&mut trainer).unwrap() {
                    outcomes.push(outcome);
                }
                (outcomes, runner.participant().saved_state().unwrap().security.unwrap())
            })
        })
        .collect();
    for (k, handle) in handles.into_iter().enumerate() {
        let (outcomes, pinned) = handle.join().unwrap();
        // The round size a participant pins and checks is its group's.
        assert_eq!((pinned.clients, pinned.degree, pinned.threshold), (5, 4, 3), "client {k}");
        assert_eq!(outcomes.len(), 2, "client {k}: {outcomes:?}");
        assert!(matches!(outcomes[1], RoundOutcome::Completed(_)), "client {k}: {outcomes:?}");
    }
    let (_, rounds) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/rounds"), &[]);
    let rounds: Vec<Value> = serde_json::from_slice(&rounds).unwrap();
    assert_eq!(rounds.iter().map(|r| r["survivors"].as_i64().unwrap()).collect::<Vec<_>>(), [9, 10]);
    for (round, survivors) in rounds.iter().zip([[4, 5], [5, 5]]) {
        let groups = round["metrics"]["groups"].as_array().unwrap();
        let mut counted: Vec<u64> = groups.iter().map(|g| g["survivors"].as_u64().unwrap()).collect();
        counted.sort_unstable();
        assert_eq!(counted, survivors, "{round}");
        assert!(groups.iter().all(|g| g["selected"] == 5 && g.get("failed_at").is_none()), "{round}");
    }
    let mean = |clients: &[usize]| -> Vec<f32> {
        let total: f32 = clients.iter().map(|&k| 10.0 + k as f32).sum();
        (0..3)
            .map(|j| clients.iter().map(|&k| update(k)[j] * (10.0 + k as f32)).sum::<f32>() / total)
            .collect()
    };
    let all: Vec<usize> = (0..10).collect();
    let expected: Vec<f32> = mean(&all[..9]).iter().zip(mean(&all)).map(|(a, b)| a + b).collect();
    let (status, bytes) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/checkpoints/2"), &[]);
    assert_eq!(status, 200);
    let model = checkpoint::decode(&bytes).unwrap();
    for (got, want) in model.weights.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-3, "{:?} vs {expected:?}", model.weights);
    }
}

/// Hands in client k's update with a training loss of 0.1 (k + 1).
struct Reporting(usize);

impl Trainer for Reporting {
    fn train(
        &mut self,
        _: cohort_client::runtime::Contribution,
        _: &Checkpoint,
    ) -> Result<LocalUpdate, cohort_client::runtime::UpdateError> {
        let mut metrics = MetricValues::new();
        metrics.set(Metric::TrainLoss, 0.1 * (self.0 + 1) as f64)?;
        Ok(LocalUpdate { delta: update(self.0), examples: 10, metrics })
    }
}

/// Runs `clients` participants with [`Reporting`] trainers until the task ends.
fn run_reporting(coordinator: &Serve, spec: &Value, task: &str, token: &str, clients: usize) {
    let handles: Vec<_> = (0..clients)
        .map(|k| {
            let (url, task, token, spec) =
                (coordinator.url.clone(), task.to_string(), token.to_string(), spec.clone());
            std::thread::spawn(move || {
                let participant =
                    Participant::enroll(&task, &token, fast(&spec)).with_seed([k as u8 + 40; 32]);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), None);
                let mut outcomes = Vec::new();
                while let Some(outcome) = runner.run_round(&mut Reporting(k)).unwrap() {
                    outcomes.push(outcome);
                }
                outcomes
            })
        })
        .collect();
    for handle in handles {
        let outcomes = handle.join().unwrap();
        assert!(matches!(outcomes.as_slice(), [RoundOutcome::Completed(_)]), "{outcomes:?}");
    }
}

/// The clients' losses reach the coordinator as their mean, from the sum
/// under the masks; only a semi-honest task that asks for them also gets
/// each client's in the clear, after the round, labelled as plaintext.
#[test]
fn metrics_travel_masked_and_in_the_clear_only_when_a_semi_honest_task_asks() {
    let coordinator = Serve::in_process("metrics", ADMIN);
    let mut plaintext = spec(4, 1);
    plaintext["secure_aggregation"]["variant"] = json!("semi-honest");
    plaintext["client_metrics"] = json!({ "plaintext": true });
    for (spec, in_the_clear) in [(spec(4, 1), false), (plaintext, true)] {
        let CreatedTask { id: task, enrollment_token: token, .. } =
            coordinator.admin().create_task(&spec.clone());
        run_reporting(&coordinator, &spec, &task, &token, 4);
        let (_, rounds) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/rounds"), &[]);
        let rounds: Value = serde_json::from_slice(&rounds).unwrap();
        let mean = &rounds[0]["metrics"]["client_means"]["train_loss"];
        assert!((mean["mean"].as_f64().unwrap() - 0.25).abs() < 1e-5, "{rounds}");
        assert_eq!(mean["clients"], 4, "{rounds}");
        let reports = &rounds[0]["plaintext_client_metrics"];
        if in_the_clear {
            let mut losses: Vec<f64> = reports
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["metrics"]["train_loss"].as_f64().unwrap())
                .collect();
            losses.sort_by(f64::total_cmp);
            assert_eq!(losses, [0.1, 0.2, 0.30000000000000004, 0.4], "{rounds}");
            assert!(reports.as_array().unwrap().iter().all(|r| r["metrics"]["bytes_up"].as_u64() > Some(0)));
        } else {
            assert!(reports.is_null(), "{rounds}");
        }
    }
}

#[test]
fn refusals_and_outages_are_typed_errors() {
    let coordinator = Serve::in_process("errors", ADMIN);
    let CreatedTask { id: task, enrollment_token: _, .. } = coordinator.admin().create_task(&spec(4, 1));
    let mut trainer = Fixed::new(vec![0.0; 3], 1);
    let run = |participant: Participant, url: &str, trainer: &mut Fixed| {
        Runner::new(participant, HttpTransport::new(url), None).run_round(trainer)
    };

    let wrong_token = Participant::enroll(&task, "not-the-token", fast(&spec(4, 1)));
    let error = run(wrong_token, &coordinator.url, &mut trainer).unwrap_err();
    assert!(matches!(error, RunError::Participant(ParticipantError::Unauthorized(_))), "{error}");

    let unknown_task = Participant::enroll("no-such-task", "token", fast(&spec(4, 1)));
    let error = run(unknown_task, &coordinator.url, &mut trainer).unwrap_err();
    assert!(matches!(error, RunError::Participant(ParticipantError::TaskNotFound(_))), "{error}");

    // Nothing listens on this port: a bounded number of tries, then an error.
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let config = ParticipantConfig { max_attempts: 3, backoff_base_ms: 10, ..fast(&spec(4, 1)) };
    let offline = Participant::enroll(&task, "token", config);
    let error = run(offline, &format!("http://{unused}"), &mut trainer).unwrap_err();
    assert!(
        matches!(error, RunError::Participant(ParticipantError::Unreachable { attempts: 3, .. })),
        "{error}"
    );
    assert!(trainer.rounds_trained.is_empty());
}

/// 8-bit values, rotated, bit-packed: the round still yields the weighted
/// mean (within the quantization step), the upload shrinks, and the round
/// metrics say by how much.
#[test]
fn compressed_updates_aggregate_over_http() {
    let quantization = json!({ "bits": 8, "rotate": true, "clip": 0.5, "max_weight": 64 });
    let delta = |k: usize, i: usize| ((i * (k + 1)) as f32 * 0.01).sin() * 0.1;
    // Four clients, 8 bits over [−0.5, 0.5] scaled by w/W: a step of about
    // 0.004 per client value, averaged; the rotation spreads the error.
    let metrics = compressed_round("rotated", quantization, delta, 0.01);
    assert_eq!(metrics["modulus_bits"], 10, "8 bits plus 2 bits of headroom for 4 clients");
    let ratio = metrics["compression_ratio"].as_f64().unwrap();
    // A 10-bit ring is 0.3125 of float32; the protocol adds about 1.1 kB
    // per client here (keys, commitment and signatures, envelopes, shares).
    assert!(ratio > 0.3 && ratio < 0.38, "upload over float32: {ratio}");
}

/// A ring fitted to the sum: 9 bits whatever the clients, the first
/// round at the scale at which no sum of four can wrap, and the weighted
/// mean within that scale's rounding.
#[test]
fn a_fitted_ring_aggregates_over_http() {
    let quantization = json!({ "bits": 9, "ring": "fitted", "rotate": true, "clip": 0.5, "max_weight": 64 });
    let delta = |k: usize, i: usize| ((i * (k + 1)) as f32 * 0.01).sin() * 0.1;
    // A step of 1/125.5 per unit of the weighted sum: the mean's error is
    // about one step times W/Σw = 64/140 per coordinate, 0.004.
    let metrics = compressed_round("fitted", quantization, delta, 0.03);
    assert_eq!(metrics["modulus_bits"], 9, "no headroom for the clients");
    assert_eq!(metrics["ring_scale"].as_f64(), Some((255.0 / 4.0 - 1.0) / 0.5));
    let ratio = metrics["compression_ratio"].as_f64().unwrap();
    assert!(ratio > 9.0 / 32.0 && ratio < 0.35, "upload over float32: {ratio}");
}

/// A count sketch of 5 × 400 buckets stands in for a 5000-coordinate
/// update that has a few large coordinates: the heavy ones come back.
#[test]
fn sketched_updates_aggregate_over_http() {
    let quantization = json!({ "sketch": { "rows": 5, "columns": 400, "top_k": 3 }, "max_weight": 64 });
    let delta = |k: usize, i: usize| match i {
        17 => 0.5,
        2_000 => -0.3 - k as f32 * 0.01,
        4_999 => 0.2,
        _ => 0.0,
    };
    let metrics = compressed_round("sketched", quantization, delta, 1e-3);
    let ratio = metrics["compression_ratio"].as_f64().unwrap();
    // 2000 32-bit buckets are 0.4 of float32, plus the protocol's 1.1 kB.
    assert!(ratio < 0.47, "2000 buckets for 5000 coordinates: {ratio}");
}

/// One round of four clients with `quantization`; checks the model against
/// the exact weighted mean and returns the round's metrics.
fn compressed_round(
    name: &str,
    quantization: Value,
    delta: fn(usize, usize) -> f32,
    tolerance: f32,
) -> Value {
    let coordinator = Serve::in_process(name, ADMIN);
    let mut spec = spec(4, 1);
    spec["model"]["layout"]["tensors"][0]["shape"] = json!([5000]);
    spec["quantization"] = quantization;
    // The compression alone: a norm proof's few kilobytes would swamp a
    // model of 5 000 parameters (validated rounds are tested elsewhere).
    spec["validation"] = json!({ "norm": "none" });
    let config = fast(&spec);
    let CreatedTask { id: task, enrollment_token: token, .. } = coordinator.admin().create_task(&spec);
    let delta = move |k: usize| -> Vec<f32> { (0..5000).map(|i| delta(k, i)).collect() };
    let handles: Vec<_> = (0..4)
        .map(|k| {
            let (url, task, token) = (coordinator.url.clone(), task.clone(), token.clone());
            std::thread::spawn(move || {
                let mut trainer = Fixed::new(delta(k), 20 + 10 * k as u32);
                let participant = Participant::enroll(&task, &token, config).with_seed([40 + k as u8; 32]);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), None);
                let outcome = runner.run_round(&mut trainer).unwrap().unwrap();
                assert!(matches!(outcome, RoundOutcome::Completed(_)), "{outcome:?}");
                assert!(runner.run_round(&mut trainer).unwrap().is_none());
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    let total: f32 = (0..4).map(|k| 20.0 + 10.0 * k as f32).sum();
    let (_, bytes) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/checkpoints/1"), &[]);
    let model = checkpoint::decode(&bytes).unwrap();
    let mut worst = 0.0f32;
    for i in 0..5000 {
        let expected: f32 = (0..4).map(|k| delta(k)[i] * (20.0 + 10.0 * k as f32)).sum::<f32>() / total;
        worst = worst.max((model.weights[i] - expected).abs());
    }
    assert!(worst < tolerance, "{name}: largest error {worst}");
    let (_, rounds) = coordinator.admin().send("GET", &format!("/admin/tasks/{task}/rounds"), &[]);
    let rounds: Vec<Value> = serde_json::from_slice(&rounds).unwrap();
    rounds[0]["metrics"].clone()
}
