//! The Python package (`import cohort`, built from `python/`) against a
//! real `cohort serve`:
//!
//! 1. four Python processes train a PyTorch 2NN of their own on
//!    Fashion-MNIST shards from `cohort partition`, beside two native
//!    `cohort participate` processes and one wasm client (the browser
//!    client's build under Node, with a fixed update), in an active,
//!    validated task; one Python client kills itself in the middle of round
//!    1's training. Round 1 completes without it (a dropout at the key
//!    advertisement, once its deadline has passed), and its model is the
//!    initial one plus the weighted mean of the six survivors' updates,
//!    within quantization.
//!    Restarted on the same state directory, the client goes on as the same
//!    participant and takes part in round 2 with everyone;
//! 2. the README's "Train your own PyTorch model" example, as written,
//!    trains in a federation with native clients;
//! 3. three Python clients take part in an async task;
//! 4. Ctrl-C stops a Python client at once and its leave request reaches
//!    the coordinator;
//! 5. the package's pytest suite (python/tests) passes.
//!
//! The hostile-coordinator suite runs Python clients too
//! (`hostile_clients.rs`).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_client::data::load_idx;
use cohort_client::model::Model;
use cohort_client::runtime::{Contribution, LocalTrainer, LocalUpdate, Trainer};
use cohort_client::train::TrainConfig;
use cohort_server::api::CreatedTask;
use cohort_tests::{
    Serve, artifacts, assert_aggregate, checkpoint, python_command, scratch, success, wait_for,
    workspace_root,
};
use serde_json::{Value, json};

const ADMIN: &str = "python-e2e-admin-token";
/// Shards are cut this many ways (about 3 000 images each).
const SHARDS: usize = 20;
/// `cohort participate`'s training seed (its default).
const SEED: u64 = 1;

fn two_nn() -> Model {
    Model::by_name("2nn", 784, 10).unwrap()
}

fn partition(dir: &Path) -> PathBuf {
    let shards = dir.join("shards");
    let output = Command::new(&artifacts().cohort)
        .args(["partition", "--dataset", "fashion-mnist", "--clients", &SHARDS.to_string()])
        .args(["--partition", "dirichlet:0.5", "--seed", "3", "--out"])
        .arg(&shards)
        .output()
        .unwrap();
    success("cohort partition", &output);
    shards
}

fn task_spec(rounds: u32, clients: u32, threshold: u32) -> Value {
    json!({
        "name": "python clients",
        "rounds": rounds,
        "clients_per_round": clients,
        "model": { "architecture": "2nn", "layout": two_nn().layout(), "init": { "kind": "fan_in", "seed": 5 } },
        "secure_aggregation": { "graph": "complete", "threshold": threshold },
        "deadlines": { "advertise_keys_ms": 45000, "share_keys_ms": 60000, "masked_input_ms": 60000, "unmasking_ms": 60000 }
    })
}

/// A `cohort participate` process on shard `k` (one epoch a round).
fn native(serve: &Serve, task: &str, token: &str, policy: &str, shards: &Path, k: usize) -> Child {
    Command::new(&artifacts().cohort)
        .args(["participate", "--server", &serve.url, "--task", task, "--model", "2nn"])
        .args(["--index", &k.to_string(), "--epochs", "1", "--policy", policy])
        .arg("--shard")
        .arg(shards.join(k.to_string()))
        .env("COHORT_ENROLLMENT_TOKEN", token)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// What `cohort participate --index k --epochs 1` sends first (nonce 0):
/// the built-in trainer with its settings, recomputed here.
fn native_update(shards: &Path, k: usize, initial: &cohort_client::checkpoint::Checkpoint) -> LocalUpdate {
    let shard = shards.join(k.to_string());
    let data = load_idx(&shard.join("images.idx"), &shard.join("labels.idx"), 10).unwrap();
    let config = TrainConfig {
        epochs: 1,
        batch_size: 32,
        learning_rate: 0.05,
        seed: SEED ^ (k as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ..TrainConfig::default()
    };
    let mut trainer = LocalTrainer { model: two_nn(), data, config };
    trainer.train(Contribution { round: 1, nonce: 0 }, initial).unwrap()
}

/// A Python client of `python/tests/federated_client.py` on shard `k`.
fn python_client(
    serve: &Serve,
    task: &str,
    token: &str,
    policy: &str,
    dir: &Path,
    k: usize,
    die: bool,
) -> Child {
    let mut command = python_command();
    command
        .arg(workspace_root().join("python/tests/federated_client.py"))
        .args([&serve.url, task, token])
        .arg(dir.join(format!("state-{k}")))
        .arg(dir.join("shards").join(k.to_string()))
        .arg(dir.join(format!("out-{k}")))
        .arg(policy)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if die {
        command.args(["--die-in-round", "1"]);
    }
    command.spawn().unwrap()
}

/// The update a Python client saved for `round`.
fn saved_update(dir: &Path, k: usize, round: u64) -> LocalUpdate {
    let path = dir.join(format!("out-{k}/update-{round}.npz"));
    let script = "import sys, numpy as np\nz = np.load(sys.argv[1])\nsys.stdout.buffer.write(np.asarray(z['examples'], '<u4').tobytes() + z['delta'].astype('<f4').tobytes())";
    let output = python_command().args(["-c", script]).arg(&path).output().unwrap();
    assert!(output.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&output.stderr));
    let bytes = output.stdout.as_slice();
    let examples = u32::from_le_bytes(bytes[..4].try_into().unwrap());
    let delta = bytes[4..].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    LocalUpdate { delta, examples, metrics: cohort_client::participant::MetricValues::new() }
}

/// What the fixed-update drivers (`web/tests/hostile.mjs`,
/// `python/tests/hostile_clients.py`) hand in: 0.01 for every parameter, at
/// weight 3.
fn fixed_update(parameters: usize) -> LocalUpdate {
    LocalUpdate {
        delta: vec![0.01; parameters],
        examples: 3,
        metrics: cohort_client::participant::MetricValues::new(),
    }
}

/// Waits for a process to end within `limit`; its exit status and stdout.
fn finish(child: &mut Child, limit: Duration, what: &str) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stdout = String::new();
            if let Some(mut out) = child.stdout.take() {
                std::io::Read::read_to_string(&mut out, &mut stdout).unwrap();
            }
            return (status, stdout);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn python_clients_train_a_pytorch_model_beside_native_ones_and_survive_a_kill() {
    let _one = cohort_tests::exclusive();
    cohort_tests::web_package();
    let dir = scratch("python-federation");
    let shards = partition(&dir);
    let serve = Serve::in_dir(&dir, ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } =
        serve.admin().create_task(&task_spec(2, 7, 4));
    let view = serve.admin().task(&task);
    assert_eq!(view.spec.validation.map(|v| v.norm), Some(cohort_server::spec::NormChoice::L2));
    let policy = serve.admin().policy_json(&task);

    let mut pythons: Vec<Child> =
        (0..3).map(|k| python_client(&serve, &task, &token, &policy, &dir, k, false)).collect();
    let mut dying = python_client(&serve, &task, &token, &policy, &dir, 3, true);
    let mut natives: Vec<Child> =
        (4..6).map(|k| native(&serve, &task, &token, &policy, &shards, k)).collect();
    // The browser client's wasm build under Node, handing in 0.01 for every
    // parameter with a weight of 3 (web/tests/hostile.mjs, one client).
    let mut wasm = Command::new("node")
        .arg(workspace_root().join("web/tests/hostile.mjs"))
        .args([&serve.url, &task, &token, &policy, "1", "2", "600000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();

    // The dying client is killed by its own hand in round 1's training.
    let (status, _) = finish(&mut dying, Duration::from_secs(300), "the dying Python client");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status:?}");
    let state: Value =
        serde_json::from_slice(&std::fs::read(dir.join("state-3/cohort-state.json")).unwrap()).unwrap();
    let before = state["participant_id"].as_str().unwrap().to_string();
    // Round 1 goes on without it: stored once its key advertisement's
    // deadline has passed. (A client restarted before that would simply
    // take its seat again: it had sent nothing of the round.)
    wait_for(Duration::from_secs(300), "round 1 to be stored", || !serve.admin().rounds(&task).is_empty());
    // Restarted on the same state directory: it resumes its enrollment.
    let mut restarted = python_client(&serve, &task, &token, &policy, &dir, 3, false);

    for (k, client) in pythons.iter_mut().chain([&mut restarted]).enumerate() {
        let (status, stdout) = finish(client, Duration::from_secs(600), "a Python client");
        assert!(status.success(), "Python client {k}: {status:?}");
        let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
        let rounds: Vec<u64> = report["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o[1] == "completed")
            .map(|o| o[0].as_u64().unwrap())
            .collect();
        if k == 3 {
            assert_eq!(report["participant"], json!(before), "the restarted client enrolled again");
            assert_eq!(rounds, [2], "the restarted client: {report}");
        } else {
            assert_eq!(rounds, [1, 2], "Python client {k}: {report}");
        }
    }
    for native in &mut natives {
        let (status, _) = finish(native, Duration::from_secs(300), "a native client");
        assert!(status.success(), "{status:?}");
    }
    let (status, stdout) = finish(&mut wasm, Duration::from_secs(300), "the wasm client");
    assert!(status.success(), "{status:?}");
    let endings: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
    let completed = json!({ "outcome": "completed", "rule": null });
    assert_eq!(endings[0]["outcomes"], json!([completed, completed]), "the wasm client: {endings}");

    // Round 1: the six survivors' updates, and the killed client a dropout
    // at the key advertisement.
    let initial = checkpoint(&serve, &task, 0);
    let mut updates: Vec<LocalUpdate> = (0..3).map(|k| saved_update(&dir, k, 1)).collect();
    updates.extend((4..6).map(|k| native_update(&shards, k, &initial)));
    updates.push(fixed_update(two_nn().len()));
    assert_aggregate(&serve, &task, &updates);
    let rounds = serve.admin().rounds(&task);
    let dropouts: Vec<usize> = rounds[0].metrics.stages.iter().map(|s| s.dropouts).collect();
    assert_eq!(dropouts.first(), Some(&1), "{rounds:?}");
    assert_eq!(rounds[1].survivors, 7, "round 2 with the restarted client: {rounds:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The ```python block after the README's `train.py` marker.
fn readme_example() -> String {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let after =
        readme.split("<!-- train.py").nth(1).unwrap_or_else(|| panic!("the README marks no train.py"));
    let block = after.split("```python\n").nth(1).unwrap();
    block.split("\n```").next().unwrap().to_string()
}

#[test]
fn the_readme_pytorch_example_trains_in_a_federation() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-readme");
    let shards = partition(&dir);
    std::fs::write(dir.join("train.py"), readme_example()).unwrap();
    let serve = Serve::in_dir(&dir, ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } =
        serve.admin().create_task(&task_spec(1, 4, 3));
    let policy = serve.admin().policy_json(&task);
    let mut examples: Vec<Child> = (0..2)
        .map(|k| {
            python_command()
                .arg(dir.join("train.py"))
                .arg(shards.join(k.to_string()))
                .env("COHORT_SERVER", &serve.url)
                .env("COHORT_TASK", &task)
                .env("COHORT_ENROLLMENT_TOKEN", &token)
                .env("COHORT_POLICY", &policy)
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut natives: Vec<Child> =
        (2..4).map(|k| native(&serve, &task, &token, &policy, &shards, k)).collect();
    for example in &mut examples {
        let (status, _) = finish(example, Duration::from_secs(300), "the README example");
        let mut stderr = String::new();
        std::io::Read::read_to_string(example.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        assert!(status.success(), "{status:?}: {stderr}");
        // Python's logging: the round it took part in.
        assert!(stderr.contains("round 1 completed"), "{stderr}");
    }
    for native in &mut natives {
        assert!(finish(native, Duration::from_secs(120), "a native client").0.success());
    }
    let rounds = serve.admin().rounds(&task);
    assert_eq!(rounds[0].survivors, 4, "{rounds:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An async task (FedBuff): three Python clients fill a buffer of three,
/// each trained from version 0; version 1 is their weighted mean.
#[test]
fn python_clients_take_part_in_an_async_task() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-async");
    let serve = Serve::in_dir(&dir, ADMIN);
    let mut spec = cohort_tests::spec(3, 2);
    spec["mode"] = json!("async");
    spec["async"] = json!({ "concurrency": 3, "buffer_size": 3, "max_staleness": 1 });
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec);
    let policy = serve.admin().policy_json(&task);
    // Three clients that hand in the global model plus 0.01, at weight 3.
    let output = cohort_tests::output_within(
        python_command()
            .arg(workspace_root().join("python/tests/hostile_clients.py"))
            .args([&serve.url, &task, &token])
            .arg(dir.join("clients"))
            .args([&policy, "3", "1", "120000"]),
        cohort_tests::CLIENT_LIMIT,
    );
    let stdout = success("three Python clients", &output);
    let endings: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
    for ending in endings.as_array().unwrap() {
        assert_eq!(ending["outcomes"], json!([{ "outcome": "completed", "rule": null }]), "{endings}");
    }
    let update = || fixed_update(cohort_tests::model().len());
    assert_aggregate(&serve, &task, &[update(), update(), update()]);
    let rounds = serve.admin().rounds(&task);
    let buffer = rounds[0].metrics.buffer.as_ref().expect("an async round names its group");
    assert_eq!(buffer.staleness_histogram, [3], "{rounds:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Ctrl-C: a Python client waiting to be selected stops at once with
/// `KeyboardInterrupt`, and its leave request reaches the coordinator,
/// which no longer counts it as available.
#[test]
fn ctrl_c_stops_a_python_client_and_tells_the_coordinator() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-interrupt");
    let serve = Serve::in_dir(&dir, ADMIN);
    // Three a round: two clients wait for selection as long as it takes.
    let CreatedTask { id: task, enrollment_token: token, .. } =
        serve.admin().create_task(&cohort_tests::spec(3, 2));
    let policy = serve.admin().policy_json(&task);
    let script = "import cohort, json, sys\n\
        url, task, token, state, policy = sys.argv[1:6]\n\
        client = cohort.Client(url, task, token, state, policy=json.loads(policy))\n\
        client.train(lambda model, round: cohort.Update(list(model.numpy().values()), 1))\n\
        client.run()\n";
    let mut clients: Vec<Child> = (0..2)
        .map(|k| {
            python_command()
                .args(["-c", script, &serve.url, &task, &token])
                .arg(dir.join(format!("state-{k}")))
                .arg(&policy)
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let available = || serve.admin().task(&task).live.available_clients;
    wait_for(Duration::from_secs(60), "both clients to check in", || available() == 2);
    let pid = clients[0].id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let started = Instant::now();
    let (status, _) = finish(&mut clients[0], Duration::from_secs(10), "the interrupted client");
    let mut stderr = String::new();
    std::io::Read::read_to_string(clients[0].stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success() && stderr.contains("KeyboardInterrupt"), "{status:?}: {stderr}");
    println!("stopped {} ms after Ctrl-C", started.elapsed().as_millis());
    wait_for(Duration::from_secs(60), "the leave request to reach the coordinator", || available() == 1);
    let _ = clients[1].kill();
    let _ = clients[1].wait();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_python_package_unit_tests_pass() {
    let _one = cohort_tests::exclusive();
    let output = python_command()
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(workspace_root().join("python/tests"))
        .output()
        .unwrap();
    let stdout = success("pytest python/tests", &output);
    println!("{stdout}");
    assert!(stdout.contains(" passed"), "{stdout}");
}
