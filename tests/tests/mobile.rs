//! The mobile bindings against a real `cohort serve`: JVM clients through
//! JNI and a C client through `include/cohort.h` each take part in a
//! secure round with native clients, and the aggregate is the exact
//! weighted mean of everyone's update.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::data::Dataset;
use cohort_client::model::Model;
use cohort_client::participant::{Method, Participant, ParticipantConfig, RoundOutcome};
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{self, LocalUpdate, Runner, Trainer};
use cohort_client::train::TrainConfig;
use cohort_tests::{Serve, artifacts, scratch, workspace_root};
use serde_json::{Value, json};

const ADMIN: &str = "mobile-e2e-admin-token";

/// The task's model: logistic regression, 4 features, 3 classes (15
/// parameters), which the built-in trainer recognises.
fn model() -> Model {
    Model::by_name("logreg", 4, 3).unwrap()
}

fn spec(clients: u32, threshold: u32) -> Value {
    json!({
        "name": "mobile bindings",
        "rounds": 2,
        "clients_per_round": clients,
        "model": { "architecture": "logreg", "layout": model().layout() },
        "secure_aggregation": { "graph": "complete", "threshold": threshold },
        "deadlines": { "advertise_keys_ms": 60000, "share_keys_ms": 60000, "masked_input_ms": 60000, "unmasking_ms": 60000 }
    })
}

struct Fixed(LocalUpdate);

impl Trainer for Fixed {
    fn train(&mut self, _: u64, _: &Checkpoint) -> Result<LocalUpdate, String> {
        Ok(self.0.clone())
    }
}

fn native_update(k: usize) -> LocalUpdate {
    let delta = (0..15).map(|j| 0.01 * (k as f32 + 1.0) * if j % 2 == 0 { 1.0 } else { -1.0 }).collect();
    LocalUpdate { delta, examples: 10 + k as u32, metrics: None }
}

/// Native clients, each taking part in one round with `native_update(k)`.
fn native_clients(serve: &Serve, task: &str, token: &str, count: usize) -> Vec<std::thread::JoinHandle<()>> {
    (0..count)
        .map(|k| {
            let (url, task, token) = (serve.url.clone(), task.to_string(), token.to_string());
            std::thread::spawn(move || {
                let config = ParticipantConfig { poll_interval_ms: 50, ..ParticipantConfig::default() };
                let participant = Participant::enroll(&task, &token, config);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), None);
                let outcome = runner.run_round(&mut Fixed(native_update(k))).unwrap();
                assert!(
                    matches!(outcome, Some(RoundOutcome::Completed(_))),
                    "native client {k}: {outcome:?}"
                );
            })
        })
        .collect()
}

fn checkpoint(serve: &Serve, task: &str, round: u64) -> Checkpoint {
    let (status, bytes) = serve.admin(Method::Get, &format!("/admin/tasks/{task}/checkpoints/{round}"), None);
    assert_eq!(status, 200, "checkpoint {round}");
    checkpoint::decode(&bytes).unwrap()
}

/// Round 1's model must be the initial one plus the weighted mean of
/// `updates`, and every selected client a survivor.
fn assert_aggregate(serve: &Serve, task: &str, updates: &[LocalUpdate]) {
    let initial = checkpoint(serve, task, 0);
    let after = checkpoint(serve, task, 1);
    let total: f32 = updates.iter().map(|u| u.examples as f32).sum();
    for (j, (got, start)) in after.weights.iter().zip(&initial.weights).enumerate() {
        let mean: f32 = updates.iter().map(|u| u.delta[j] * u.examples as f32).sum::<f32>() / total;
        assert!((got - start - mean).abs() < 1e-3, "parameter {j}: {got} vs {}", start + mean);
    }
    let rounds = serve.admin_json(&format!("/admin/tasks/{task}/rounds"));
    assert_eq!(rounds[0]["survivors"], json!(updates.len()), "{rounds}");
}

fn success(what: &str, output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn check_state_file(dir: &Path) {
    let state = dir.join(cohort_mobile_state_file());
    let metadata = std::fs::metadata(&state).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(metadata.permissions().mode() & 0o777, 0o600, "{}", state.display());
    }
    assert!(metadata.len() > 0);
}

fn cohort_mobile_state_file() -> &'static str {
    // cohort_mobile::STATE_FILE, spelled out: this crate does not link the
    // bindings, it loads them the way an app does.
    "cohort-state.json"
}

#[test]
fn jvm_clients_join_a_secure_round_with_native_clients() {
    let dir = scratch("jvm");
    let classes = dir.join("classes");
    let java = workspace_root().join("mobile/java");
    let mut sources: Vec<_> = ["src/org/cohort", "test/org/cohort"]
        .iter()
        .flat_map(|d| std::fs::read_dir(java.join(d)).unwrap())
        .map(|entry| entry.unwrap().path())
        .collect();
    sources.sort();
    let compiled = Command::new("javac")
        .args(["-Xlint:all", "-Werror", "-d"])
        .arg(&classes)
        .args(&sources)
        .output()
        .expect("javac (Java 17) is installed");
    success("javac", &compiled);

    let serve = Serve::start(&dir, ADMIN);
    let (task, token) = serve.create_task(spec(5, 3));
    let natives = native_clients(&serve, &task, &token, 3);
    let library_dir = artifacts().mobile_shared.parent().unwrap();
    let run = Command::new("java")
        .arg("-Xcheck:jni")
        .arg(format!("-Djava.library.path={}", library_dir.display()))
        .arg("-cp")
        .arg(&classes)
        .arg("org.cohort.JvmRoundTest")
        .args([&serve.url, &task, &token])
        .arg(dir.join("jvm"))
        .output()
        .unwrap();
    let stdout = success("the JVM test", &run);
    println!("{stdout}");
    assert!(stdout.contains("JVM OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }

    // Client A sent its fixed update; client B trained on its data with
    // the built-in trainer, exactly as here.
    let initial = checkpoint(&serve, &task, 0);
    let app = LocalUpdate {
        delta: (0..15).map(|j| 0.02 * ((j % 5) as f32 - 2.0)).collect(),
        examples: 7,
        metrics: None,
    };
    let rows = 30;
    let labels: Vec<u8> = (0..rows).map(|i| (i % 3) as u8).collect();
    let features =
        ndarray::Array2::from_shape_fn((rows, 4), |(i, j)| ((i % 3 * 5 + j * 3 + i) % 7) as f32 / 7.0);
    let data = Dataset { features, labels, shape: [1, 4], classes: 3 };
    let config = TrainConfig { epochs: 2, batch_size: 5, learning_rate: 0.1, ..TrainConfig::default() };
    let trained = runtime::local_update(&model(), &data, &config, 1, &initial).unwrap();
    assert!(trained.delta.iter().any(|v| v.abs() > 1e-3), "training moved the model");
    let mut updates: Vec<LocalUpdate> = (0..3).map(native_update).collect();
    updates.extend([app, trained]);
    assert_aggregate(&serve, &task, &updates);
    check_state_file(&dir.join("jvm/a"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_c_client_joins_a_secure_round_through_the_header() {
    let dir = scratch("c");
    let program = dir.join("round");
    let mobile = workspace_root().join("mobile");
    let compiled = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(mobile.join("include"))
        .arg(mobile.join("tests/c/round.c"))
        .arg(&artifacts().mobile_static)
        // The system libraries Rust's std needs on Linux
        // (`--print native-static-libs`).
        .args(["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc", "-o"])
        .arg(&program)
        .output()
        .expect("a C compiler is installed");
    success("cc", &compiled);

    let serve = Serve::start(&dir, ADMIN);
    let (task, token) = serve.create_task(spec(4, 2));
    let natives = native_clients(&serve, &task, &token, 3);
    let run =
        Command::new(&program).args([&serve.url, &task, &token]).arg(dir.join("c-client")).output().unwrap();
    let stdout = success("the C test", &run);
    assert!(stdout.contains("C OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }
    let c_update = LocalUpdate {
        delta: (0..15).map(|j| 0.03 * (j % 4) as f32 - 0.01).collect(),
        examples: 9,
        metrics: None,
    };
    let mut updates: Vec<LocalUpdate> = (0..3).map(native_update).collect();
    updates.push(c_update);
    assert_aggregate(&serve, &task, &updates);
    check_state_file(&dir.join("c-client"));
    std::fs::remove_dir_all(&dir).unwrap();
}
