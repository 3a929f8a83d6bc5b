//! An async (FedBuff) task over real HTTP: clients of different speeds
//! train at their own pace against `cohort serve`; every three finished
//! updates form a secure-aggregation group, two groups run at once, and
//! the model advances twice while a straggler is still training. The
//! straggler's update, two versions stale, is weighted 1/√3 by its client
//! and applied in the third version, which is exactly the weighted mean of
//! its group.

#![allow(clippy::unwrap_used)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use cohort_client::checkpoint::Checkpoint;
use cohort_client::participant::{Participant, ParticipantConfig, RoundOutcome};
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{Contribution, LocalUpdate, Runner, Trainer, UpdateError};
use cohort_server::api::{CreatedTask, RoundView, TaskView};
use cohort_server::store::TaskStatus;
use cohort_tests::{Fixed, Serve, checkpoint, model, native_update, scratch};
use serde_json::{Value, json};

/// Buffers of three, up to seven clients training, updates at most two
/// versions stale, three versions in all.
fn async_spec() -> Value {
    json!({
        "name": "async over HTTP",
        "rounds": 3,
        "clients_per_round": 3,
        "mode": "async",
        "async": { "concurrency": 7, "buffer_size": 3, "max_staleness": 2 },
        "model": { "architecture": "logreg", "layout": model().layout() },
        "secure_aggregation": { "graph": "complete", "threshold": 2 },
        "deadlines": { "advertise_keys_ms": 60000, "share_keys_ms": 30000, "masked_input_ms": 30000, "unmasking_ms": 30000 }
    })
}

/// A client that takes part once with `update`, training through
/// `trainer`; returns the outcome.
fn client(
    serve: &Serve,
    task: &str,
    token: &str,
    mut trainer: Box<dyn Trainer + Send>,
) -> std::thread::JoinHandle<Option<RoundOutcome>> {
    let (url, task, token) = (serve.url.clone(), task.to_string(), token.to_string());
    let policy = serde_json::from_str(&serve.admin().policy_json(&task)).unwrap();
    std::thread::spawn(move || {
        let config = ParticipantConfig { poll_interval_ms: 50, policy, ..ParticipantConfig::default() };
        let mut runner =
            Runner::new(Participant::enroll(&task, &token, config), HttpTransport::new(&url), None);
        runner.run_round(trainer.as_mut()).unwrap()
    })
}

/// A straggler: says when it starts training, then trains until the test
/// lets it finish; reports the version it trained from.
struct Straggler {
    update: LocalUpdate,
    started: mpsc::Sender<u64>,
    finish: mpsc::Receiver<()>,
}

impl Trainer for Straggler {
    fn train(&mut self, contribution: Contribution, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        self.started.send(contribution.round).unwrap();
        self.finish.recv().unwrap();
        Fixed(std::mem::replace(&mut self.update, native_update(0))).train(contribution, global)
    }
}

fn wait_for_versions(serve: &Serve, task: &str, versions: u64) -> TaskView {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let view = serve.admin().task(task);
        if view.live.completed_rounds >= versions {
            return view;
        }
        assert!(Instant::now() < deadline, "{versions} versions not reached: {view:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn groups_overlap_and_the_model_advances_while_a_straggler_trains() {
    let dir = scratch("buffered");
    let serve = Serve::in_dir(&dir, "buffered-admin-token");
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&async_spec());

    // The straggler takes the first training slot, from version 0.
    let (started_tx, started) = mpsc::channel();
    let (finish, finish_rx) = mpsc::channel();
    let straggler_update = native_update(6);
    let expected_straggler = native_update(6);
    let straggler = client(
        &serve,
        &task,
        &token,
        Box::new(Straggler { update: straggler_update, started: started_tx, finish: finish_rx }),
    );
    assert_eq!(
        started.recv_timeout(Duration::from_secs(60)).unwrap(),
        0,
        "the straggler trains from version 0"
    );

    // Six fast clients fill six more slots at once: two buffers, two
    // groups in flight together, two versions, while the straggler trains.
    let fast: Vec<_> =
        (0..6).map(|k| client(&serve, &task, &token, Box::new(Fixed(native_update(k))))).collect();
    for handle in fast {
        assert!(matches!(handle.join().unwrap(), Some(RoundOutcome::Completed(_))));
    }
    let view = wait_for_versions(&serve, &task, 2);
    let buffer = view.live.buffer.as_ref().expect("an async task shows its buffer");
    assert_eq!(buffer.training, 1, "only the straggler still trains: {view:?}");
    assert_eq!(buffer.staleness_histogram, [6], "{view:?}");
    let rounds = serve.admin().rounds(&task);
    let (first, second) = (&rounds[0], &rounds[1]);
    assert!(
        first.started_at < second.finished_at && second.started_at < first.finished_at,
        "the two groups ran at the same time: {rounds:?}"
    );
    let group = |round: &RoundView| round.metrics.buffer.as_ref().map(|b| b.group);
    assert_ne!(group(first), group(second));

    // The straggler finishes, two versions behind (within the bound);
    // two fresh clients, trained from version 2, complete its group.
    finish.send(()).unwrap();
    let late: Vec<_> =
        (7..9).map(|k| client(&serve, &task, &token, Box::new(Fixed(native_update(k))))).collect();
    for handle in late.into_iter().chain([straggler]) {
        assert!(matches!(handle.join().unwrap(), Some(RoundOutcome::Completed(_))));
    }
    let view = wait_for_versions(&serve, &task, 3);
    assert_eq!(view.live.status, TaskStatus::Completed, "{view:?}");
    let rounds = serve.admin().rounds(&task);
    let histogram = rounds[2].metrics.buffer.as_ref().map(|b| b.staleness_histogram.clone());
    assert_eq!(histogram, Some(vec![2, 0, 1]), "{rounds:?}");

    // Version 3 = version 2 + the group's mean, the straggler's update
    // scaled by 1/√3 before it was masked.
    let (before, after) = (checkpoint(&serve, &task, 2), checkpoint(&serve, &task, 3));
    let members =
        [(native_update(7), 1.0f32), (native_update(8), 1.0), (expected_straggler, 3f32.sqrt().recip())];
    let total: f32 = members.iter().map(|(u, _)| u.examples as f32).sum();
    for (j, (got, start)) in after.weights.iter().zip(&before.weights).enumerate() {
        let mean: f32 = members.iter().map(|(u, w)| u.delta[j] * w * u.examples as f32).sum::<f32>() / total;
        assert!((got - start - mean).abs() < 1e-3, "parameter {j}: {got} vs {}", start + mean);
    }
}

#[test]
fn an_async_task_refuses_bad_schedules_and_queries_with_a_reason() {
    let dir = scratch("buffered-bad");
    let serve = Serve::in_dir(&dir, "buffered-bad-admin-token");
    for (change, reason) in [
        (json!({ "concurrency": 2, "buffer_size": 3, "max_staleness": 2 }), "never fills"),
        (json!({ "concurrency": 7, "buffer_size": 3, "max_staleness": 0 }), "max_staleness must be"),
    ] {
        let mut spec = async_spec();
        spec["async"] = change;
        let (status, body) = serve.admin().send("POST", "/admin/tasks", spec.to_string().as_bytes());
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!((status, body["error"].as_str()), (400, Some("invalid_task")), "{body}");
        assert!(body["message"].as_str().unwrap().contains(reason), "{body}");
    }
    let mut spec = async_spec();
    spec["mode"] = json!("sync");
    let (status, _) = serve.admin().send("POST", "/admin/tasks", spec.to_string().as_bytes());
    assert_eq!(status, 400, "async parameters without mode async");
    // A check-in's only parameter is the version an update was trained from.
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&async_spec());
    let enrollment = cohort_tests::identity::fresh_enrollment(&task, &token);
    let mut transport = HttpTransport::new(&serve.url);
    use cohort_client::participant::{Method, Request};
    use cohort_client::runtime::Transport as _;
    let enrolled = transport
        .send(&Request {
            method: Method::Post,
            path: format!("/v1/tasks/{task}/enroll"),
            body: enrollment.to_string().into_bytes(),
            content_type: Some("application/json"),
            bearer: None,
        })
        .unwrap();
    assert_eq!(enrolled.status, 201);
    let credential =
        serde_json::from_slice::<Value>(&enrolled.body).unwrap()["credential"].as_str().unwrap().to_string();
    let mut check_in = |path: &str| {
        let response = transport
            .send(&Request {
                method: Method::Post,
                path: path.into(),
                body: Vec::new(),
                content_type: Some("application/json"),
                bearer: Some(credential.clone()),
            })
            .unwrap();
        (response.status, serde_json::from_slice::<Value>(&response.body).unwrap())
    };
    let (status, body) = check_in("/v1/checkin?trained_on=x");
    assert_eq!((status, body["error"].as_str()), (400, Some("invalid_round")), "{body}");
    assert_eq!(check_in("/v1/checkin?round=1").0, 400);
    assert_eq!(check_in("/v1/checkin").1, json!({ "status": "train", "version": 0 }));
    // An update from a version that does not exist yet is refused as stale.
    assert_eq!(check_in("/v1/checkin?trained_on=5").1["status"], "stale");
}
