//! Kills a real `cohort serve` process (SIGKILL) in the middle of a round
//! (and, in the second test, at random moments, repeatedly), restarts it on
//! the same SQLite file, and checks that nothing completed was lost
//! (rounds, checkpoints, credentials) and that training goes on to the end.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use cohort_crypto::testing::{ProtocolClient, weighted_mean};
use cohort_server::api::{CreatedTask, RoundView};
use cohort_tests::identity::Enrollment;
use cohort_tests::process::{http, json_call, stage_answer};
use cohort_tests::{AdminClient, Serve};
use serde_json::json;

const ADMIN: &str = "restart-test-admin-token-0123456789";
const SECAGG: &str = "application/x-cohort-secagg";

/// `cohort serve` on `port` (0: any free port) over the SQLite file.
fn start(port: u16, database: &std::path::Path) -> Serve {
    Serve::start(port, &format!("sqlite://{}", database.display()), ADMIN, None)
}

struct Device {
    credential: String,
    participant: ProtocolClient,
}

impl Device {
    /// One check-in, fetch and answer; returns whether it answered.
    fn step(&mut self, port: u16) -> bool {
        let Some(reply) = stage_answer(port, &self.credential, &mut self.participant) else { return false };
        let (status, body) = http(port, "POST", "/v1/round/message", Some(&self.credential), SECAGG, &reply);
        assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
        true
    }
}

/// Enrolls protocol clients `ids` in `task`.
fn enroll(port: u16, task: &str, token: &str, ids: std::ops::Range<u32>) -> Vec<Device> {
    ids.map(|i| {
        let participant = ProtocolClient::new(u64::from(i), vec![0.1 * i as f32, -0.2, 0.05], i + 1);
        let path = format!("/v1/tasks/{task}/enroll");
        let (status, body) = json_call(port, "POST", &path, None, Some(participant.enrollment(task, token)));
        assert_eq!(status, 201, "{body}");
        Device { credential: body["credential"].as_str().unwrap().to_string(), participant }
    })
    .collect()
}

fn rounds(port: u16, task: &str) -> Vec<RoundView> {
    AdminClient::new(port, ADMIN).rounds(task)
}

/// Steps every device until `done` holds (bounded in steps and time).
fn run_until(port: u16, devices: &mut [Device], mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    for _ in 0..2_000 {
        if done() {
            return;
        }
        for device in devices.iter_mut() {
            device.step(port);
        }
        assert!(Instant::now() < deadline, "training did not progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("training did not progress");
}

fn latest_checkpoint(port: u16, task: &str) -> Vec<u8> {
    let (status, bytes) =
        http(port, "GET", &format!("/admin/tasks/{task}/checkpoints/latest"), Some(ADMIN), "", &[]);
    assert_eq!(status, 200);
    bytes
}

#[test]
fn training_survives_a_crash_mid_round() {
    let database = std::env::temp_dir().join(format!("cohort-restart-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&database);
    let server = start(0, &database);
    let port = server.port;

    let spec = json!({
        "name": "restart",
        "rounds": 3,
        "clients_per_round": 6,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [3] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 4 },
        "optimizer": { "kind": "fedavgm", "learning_rate": 1.0, "momentum": 0.5 }
    });
    let CreatedTask { id: task, enrollment_token: token, .. } =
        AdminClient::new(port, ADMIN).create_task(&spec);
    let mut devices = enroll(port, &task, &token, 0..6);

    // Round 1 completes.
    run_until(port, &mut devices, || rounds(port, &task).len() == 1);
    let checkpoint_1 = latest_checkpoint(port, &task);

    // Round 2 starts; crash after its first stage, before anybody was asked
    // for a masked input (those would refuse its re-run, see the next test).
    let mut answered = 0;
    run_until(port, &mut devices, || {
        answered += 1;
        answered > 1
    });
    let (_, live) = json_call(port, "GET", &format!("/admin/tasks/{task}"), Some(ADMIN), None);
    assert_eq!(live["current_round"], 2, "{live}");
    server.kill();

    // Restart: the completed round, its checkpoint and the credentials are there.
    let server = start(port, &database);
    assert_eq!(rounds(port, &task).len(), 1);
    assert_eq!(latest_checkpoint(port, &task), checkpoint_1);
    let (_, live) = json_call(port, "GET", &format!("/admin/tasks/{task}"), Some(ADMIN), None);
    assert_eq!((live["completed_rounds"].as_u64(), live["status"].as_str()), (Some(1), Some("active")));
    for device in &devices {
        let (status, _) = json_call(port, "POST", "/v1/checkin", Some(&device.credential), None);
        assert_eq!(status, 200);
    }

    // Training continues from round 2 to the end.
    for device in devices.iter_mut() {
        device.participant.reset();
    }
    run_until(port, &mut devices, || rounds(port, &task).len() == 3);
    let numbers: Vec<i64> = rounds(port, &task).iter().map(|r| r.round).collect();
    assert_eq!(numbers, [1, 2, 3]);
    let (_, live) = json_call(port, "GET", &format!("/admin/tasks/{task}"), Some(ADMIN), None);
    assert_eq!(live["status"], "completed");
    // Three FedAvgM steps with momentum 0.5 on the same mean update Δ:
    // w = Δ (1 + 1.5 + 1.75).
    let mean = weighted_mean(&devices.iter().map(|d| &d.participant).collect::<Vec<_>>());
    let model = cohort_client::checkpoint::decode(&latest_checkpoint(port, &task)).unwrap();
    for (w, d) in model.weights.iter().zip(&mean) {
        assert!((w - 4.25 * d).abs() < 1e-4, "{:?} vs {mean:?}", model.weights);
    }
    drop(server);
    let _ = std::fs::remove_file(&database);
}

/// A crash after the clients were asked for their masked input: each of
/// them refuses a re-run of that round (one masked input per round number),
/// so the restarted coordinator, which recorded them before asking, never
/// selects them for it; fresh clients complete the round, and everybody
/// takes part in the next.
#[test]
fn a_round_rerun_after_a_crash_leaves_out_those_asked_for_their_masked_input() {
    let database = std::env::temp_dir().join(format!("cohort-rerun-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&database);
    let server = start(0, &database);
    let port = server.port;
    let spec = json!({
        "name": "rerun",
        "rounds": 2,
        "clients_per_round": 4,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [3] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3 }
    });
    let CreatedTask { id: task, enrollment_token: token, .. } =
        AdminClient::new(port, ADMIN).create_task(&spec);
    let mut first = enroll(port, &task, &token, 0..4);

    // Keys, shares, then every masked input: the round is past the point
    // where its members committed to it. Crash.
    let view = |port: u16| json_call(port, "GET", &format!("/admin/tasks/{task}"), Some(ADMIN), None).1;
    run_until(port, &mut first, || view(port)["stage"] == "consistency-check");
    let live = view(port);
    assert_eq!(
        (live["current_round"].as_u64(), live["completed_rounds"].as_u64()),
        (Some(1), Some(0)),
        "{live}"
    );
    server.kill();

    // After the restart none of the four is selectable for round 1.
    let server = start(port, &database);
    for device in &first {
        let (status, body) = json_call(port, "POST", "/v1/checkin", Some(&device.credential), None);
        assert_eq!((status, body["status"].as_str()), (200, Some("wait")), "{body}");
    }
    let live = view(port);
    assert_eq!(
        (live["available_clients"].as_u64(), live["current_round"].as_u64()),
        (Some(0), None),
        "{live}"
    );

    // Four fresh clients run round 1 again, the first four checking in
    // all along; the model is the fresh clients' mean alone.
    let mut fresh = enroll(port, &task, &token, 4..8);
    let mut everybody: Vec<Device> = first.into_iter().chain(fresh.drain(..)).collect();
    run_until(port, &mut everybody, || rounds(port, &task).len() == 1);
    let fresh = &everybody[4..];
    let round_1 = cohort_client::checkpoint::decode(&latest_checkpoint(port, &task)).unwrap();
    let mean = weighted_mean(&fresh.iter().map(|d| &d.participant).collect::<Vec<_>>());
    for (w, d) in round_1.weights.iter().zip(&mean) {
        assert!((w - d).abs() < 1e-4, "{:?} vs {mean:?}", round_1.weights);
    }

    // Round 2 is a new round number: any four of the eight may take part.
    for device in everybody.iter_mut() {
        device.participant.reset();
    }
    run_until(port, &mut everybody, || rounds(port, &task).len() == 2);
    assert_eq!(view(port)["status"], "completed");
    drop(server);
    let _ = std::fs::remove_file(&database);
}

/// Hands in the same update every round, whatever the model.
struct Steady {
    examples: u32,
    /// How long a round's training takes.
    takes: Duration,
}

impl cohort_client::runtime::Trainer for Steady {
    fn train(
        &mut self,
        _: cohort_client::runtime::Contribution,
        model: &cohort_client::checkpoint::Checkpoint,
    ) -> Result<cohort_client::runtime::LocalUpdate, cohort_client::runtime::UpdateError> {
        let delta = (0..model.weights.len()).map(|i| 0.01 * (i as f32 + 1.0)).collect();
        std::thread::sleep(self.takes);
        Ok(cohort_client::runtime::LocalUpdate {
            delta,
            examples: self.examples,
            metrics: cohort_client::participant::MetricValues::new(),
        })
    }
}

/// Every completed round with its checkpoint bytes.
fn completed(port: u16, task: &str) -> Vec<(i64, Vec<u8>)> {
    rounds(port, task)
        .iter()
        .map(|r| {
            let round = r.round;
            let path = format!("/admin/tasks/{task}/checkpoints/{round}");
            let (status, bytes) = http(port, "GET", &path, Some(ADMIN), "", &[]);
            assert_eq!(status, 200, "checkpoint of round {round}");
            (round, bytes)
        })
        .collect()
}

/// The client library's participants train while the coordinator is
/// SIGKILLed at seeded random moments, four times: every completed round
/// and checkpoint survives each crash, and training reaches the end. A
/// crash after a round asked its members for their masked input takes
/// those members out of that round's re-run (each refuses it), so the
/// population is large enough for four such crashes in one round.
#[test]
fn training_survives_repeated_crashes_at_random_points() {
    use cohort_client::participant::{Participant as Client, ParticipantConfig};
    use cohort_client::runtime::Runner;
    use cohort_client::runtime::http::HttpTransport;
    use rand_core::{Rng, SeedableRng};

    let database = std::env::temp_dir().join(format!("cohort-crashes-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&database);
    let mut server = start(0, &database);
    let port = server.port;
    let rounds_wanted = 6;
    let (crashes_wanted, per_round) = (4, 4);
    let population = per_round * (crashes_wanted + 1);
    let spec = json!({
        "name": "crashes",
        "rounds": rounds_wanted,
        "clients_per_round": per_round,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [8] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3 },
        "deadlines": { "advertise_keys_ms": 4000, "share_keys_ms": 4000, "masked_input_ms": 4000, "unmasking_ms": 4000 },
        "checkpoint_retention": 20
    });
    let CreatedTask { id: task, enrollment_token: token, .. } =
        AdminClient::new(port, ADMIN).create_task(&spec);

    // Patient clients: they ride out a restart with retries.
    let config = ParticipantConfig {
        max_attempts: 200,
        backoff_base_ms: 20,
        backoff_max_ms: 200,
        poll_interval_ms: 50,
        stage_timeout_ms: 8_000,
        policy: cohort_tests::policy_for(&spec),
        ..ParticipantConfig::default()
    };
    let mut clients: Vec<_> = (0..population as u32)
        .map(|k| {
            let (task, token) = (task.clone(), token.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let url = format!("http://127.0.0.1:{port}");
                let participant = Client::enroll(&task, &token, config).with_seed([k as u8 + 1; 32]);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), None);
                // A second of training a round, as a device takes: the
                // rounds last long enough for the crashes to land in them.
                let mut trainer = Steady { examples: 5 + k, takes: Duration::from_secs(1) };
                while runner.run_round(&mut trainer).map_err(|e| format!("client {k}: {e}"))?.is_some() {}
                Ok(())
            })
        })
        .collect();
    // A client that stopped before the end says why.
    fn check_clients(clients: &mut Vec<std::thread::JoinHandle<Result<(), String>>>) {
        let (finished, running): (Vec<_>, Vec<_>) = clients.drain(..).partition(|c| c.is_finished());
        *clients = running;
        for client in finished {
            client.join().unwrap().unwrap();
        }
    }

    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(2026);
    let mut crashes = 0;
    while crashes < crashes_wanted {
        std::thread::sleep(Duration::from_millis(200 + rng.next_u64() % 1_800));
        let before = completed(port, &task);
        server.kill();
        crashes += 1;
        server = start(port, &database);
        let after = completed(port, &task);
        assert!(after.len() >= before.len(), "crash {crashes}: rounds lost");
        assert_eq!(
            &after[..before.len()],
            &before[..],
            "crash {crashes}: a stored round or checkpoint changed"
        );
        if after.len() == rounds_wanted {
            break;
        }
    }
    assert!(crashes >= 2, "training ended before the coordinator crashed twice");
    let deadline = Instant::now() + Duration::from_secs(120);
    while completed(port, &task).len() < rounds_wanted {
        assert!(Instant::now() < deadline, "training did not finish after the crashes");
        check_clients(&mut clients);
        std::thread::sleep(Duration::from_millis(200));
    }
    for client in clients {
        client.join().unwrap().unwrap();
    }
    let numbers: Vec<i64> = completed(port, &task).iter().map(|(r, _)| *r).collect();
    assert_eq!(numbers, (1..=rounds_wanted as i64).collect::<Vec<_>>());
    // Every client sends the same update: each round adds it once (FedAvg).
    let model = cohort_client::checkpoint::decode(&latest_checkpoint(port, &task)).unwrap();
    for (i, w) in model.weights.iter().enumerate() {
        let expected = rounds_wanted as f32 * 0.01 * (i as f32 + 1.0);
        assert!((w - expected).abs() < 1e-4, "{:?}", model.weights);
    }
    drop(server);
    let _ = std::fs::remove_file(&database);
}
