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
//! 2. the README's "Train your own PyTorch model", as written: its
//!    `train.py` and the shell block that runs twelve of them against a
//!    task for the script's model;
//! 3. three Python clients take part in an async task;
//! 4. Ctrl-C stops a Python client at once and its leave request reaches
//!    the coordinator;
//! 5. Python clients train over TLS with a private CA in a task with
//!    differential privacy: they add the task's noise and count the ε they
//!    spent as the coordinator does;
//! 6. a client that cannot take part raises the exception that says why
//!    (an unknown task, a wrong token, no coordinator, a page or a proxy's
//!    refusal where the coordinator should be);
//! 7. Flower-style `NumPyClient` objects take part unchanged
//!    (`cohort.flower`);
//! 8. the package's pytest suite (python/tests) passes.
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

/// Runs `python/tests/SCRIPT` with `args` (the package of this checkout,
/// within [`cohort_tests::CLIENT_LIMIT`]); it must succeed, and the last
/// line it prints is its JSON report.
fn python_report(script: &str, args: &[&dyn AsRef<std::ffi::OsStr>]) -> Value {
    let output = cohort_tests::output_within(
        python_command()
            .arg(workspace_root().join("python/tests").join(script))
            .args(args.iter().map(|arg| arg.as_ref())),
        cohort_tests::CLIENT_LIMIT,
    );
    let stdout = success(script, &output);
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
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

/// The block fenced by `fence` after the README's `marker`.
fn readme_block(marker: &str, fence: &str) -> String {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let after = readme.split(marker).nth(1).unwrap_or_else(|| panic!("the README marks no {marker}"));
    let block = after.split(fence).nth(1).unwrap();
    block.split("\n```").next().unwrap().to_string()
}

/// The README's "Train your own PyTorch model", as a newcomer runs it:
/// its `train.py`, and its shell block (shards, a task for the script's
/// model, twelve copies of the script) on a coordinator with `$URL` and
/// `$COHORT_ADMIN_TOKEN`, `cohort` on the `PATH`. Every round completes
/// with the clients the task asks for, and the model moves.
#[test]
fn the_readme_pytorch_federation_trains_as_written() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-readme");
    std::fs::write(dir.join("train.py"), readme_block("<!-- train.py", "```python\n")).unwrap();
    let federation = readme_block("<!-- pytorch-federation.sh", "```sh\n");
    let serve = Serve::in_dir(&dir, ADMIN);
    let cohort_bin = artifacts().cohort.parent().unwrap().to_path_buf();
    let venv = cohort_tests::torch_python().parent().unwrap().parent().unwrap().to_path_buf();
    let path = format!("{}:{}", cohort_bin.display(), std::env::var("PATH").unwrap_or_default());
    let log = dir.join("federation.log");
    let mut run = Command::new("bash")
        .args(["-e", "-c", &federation])
        .env("URL", &serve.url)
        .env("COHORT_ADMIN_TOKEN", ADMIN)
        .env("PATH", path)
        .env("COHORT_TORCH_VENV", venv)
        // The package of this checkout, not the one setup.sh installed.
        .env("PYTHONPATH", cohort_tests::python_package())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let (status, _) = finish(&mut run, Duration::from_secs(600), "the README's PyTorch federation");
    let output = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{status:?}: {output}");
    assert!(!output.contains("Traceback"), "{output}");
    let created: Value = serde_json::from_slice(&std::fs::read(dir.join("task.json")).unwrap()).unwrap();
    let task = created["id"].as_str().unwrap();
    let rounds = serve.admin().rounds(task);
    assert_eq!(rounds.len(), 3, "{rounds:?}");
    assert!(rounds.iter().all(|round| round.survivors >= 10), "{rounds:?}");
    // Python's logging: each client says which rounds it took part in.
    let logged = output.matches(" completed (").count();
    let survived: usize = rounds.iter().map(|round| round.survivors as usize).sum();
    assert_eq!(logged, survived, "{output}");
    let initial = checkpoint(&serve, task, 0);
    let last = checkpoint(&serve, task, 3);
    assert_ne!(initial.weights, last.weights, "the model did not move");
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
    let clients = dir.join("clients");
    let endings = python_report(
        "hostile_clients.py",
        &[&serve.url, &task, &token, &clients, &policy, &"3", &"1", &"120000"],
    );
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

/// Over TLS with a private CA (`ca_cert`), in a task with differential
/// privacy: three Python clients pin the task's noise at enrollment, add
/// their shares of it, and each counts the ε its contribution spent (at
/// its budget's δ, here the task's) just as the coordinator does. The model moves by the clients' mean update
/// (0.01 everywhere) plus noise no smaller than the plan's: the sum
/// carries noise of standard deviation at least z·C on every coordinate,
/// the mean of three a third of that.
#[test]
fn python_clients_train_over_tls_under_differential_privacy() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-tls-dp");
    let (ca, files) = cohort_tests::test_certificates();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let serve = Serve::options(ADMIN).sqlite("python-tls-dp").start_in_process(Some((files, ca)), |_| {});
    assert!(serve.url.starts_with("https://"), "{}", serve.url);
    const PARAMETERS: usize = 4096;
    let (z, clip) = (1.0, 1.0);
    let spec = json!({
        "name": "python over TLS under DP", "rounds": 1, "clients_per_round": 3,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [PARAMETERS] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 2 },
        "privacy": { "mechanism": "skellam", "noise_multiplier": z, "epsilon": 50.0, "delta": 1e-5, "clip_norm": clip }
    });
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec);
    // The clients' budget is at the task's δ, so that their ε and the
    // coordinator's are the same number (the default budget's δ, 10⁻⁶, is
    // stricter than this task's).
    let mut policy: Value = serde_json::from_str(&serve.admin().policy_json(&task)).unwrap();
    policy["budget"] = json!({ "epsilon": 30.0, "delta": 1e-5 });
    let policy = policy.to_string();
    let clients = dir.join("clients");
    let endings = python_report(
        "hostile_clients.py",
        &[&serve.url, &task, &token, &clients, &policy, &"3", &"1", &"120000", &ca_file],
    );
    // A client is done once its unmasking shares are in; the round is
    // stored (and its ε counted) a moment later.
    wait_for(Duration::from_secs(60), "round 1 to be stored", || !serve.admin().rounds(&task).is_empty());
    let view = serve.admin().task(&task);
    let privacy = view.live.privacy.expect("a task under DP shows its privacy");
    assert_eq!(privacy.noise_multiplier, z);
    assert!(privacy.epsilon_spent > 0.0 && privacy.epsilon_spent < 50.0, "{privacy:?}");
    for ending in endings.as_array().unwrap() {
        assert_eq!(ending["outcomes"], json!([{ "outcome": "completed", "rule": null }]), "{endings}");
        let spent = ending["privacy_spent"].as_f64().unwrap_or_else(|| panic!("no ε counted: {endings}"));
        assert!((spent - privacy.epsilon_spent).abs() <= 1e-9 * spent, "{spent} vs {privacy:?}");
    }
    // Each client handed in the model plus 0.01: what is left is noise.
    let initial = checkpoint(&serve, &task, 0);
    let after = checkpoint(&serve, &task, 1);
    let residual: Vec<f64> =
        after.weights.iter().zip(&initial.weights).map(|(a, b)| f64::from(a - b) - 0.01).collect();
    let n = residual.len() as f64;
    let mean = residual.iter().sum::<f64>() / n;
    let sd = (residual.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    let floor = z * clip / 3.0;
    println!("noise on the mean: sd {sd:.4} (at least {floor:.4}), mean {mean:.5}");
    assert!(sd >= 0.95 * floor && sd <= 3.0 * floor, "sd {sd}, floor {floor}");
    // Unbiased: the mean of 4 096 residuals is within 5 standard errors of 0.
    assert!(mean.abs() <= 5.0 * sd / n.sqrt(), "mean {mean}, sd {sd}");
    assert_eq!(serve.admin().rounds(&task)[0].survivors, 3);
    drop(serve);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A client that cannot take part raises the exception that says why,
/// each also the built-in exception a Python programmer catches: against
/// a real coordinator, a task that does not exist (`TaskNotFoundError`, a
/// `LookupError`) and a wrong enrollment token (`UnauthorizedError`, a
/// `PermissionError`); a port where nothing listens, after `max_attempts`
/// (`UnreachableError`, a `ConnectionError`); a web page where the API
/// should be (`ProtocolError`); a proxy that refuses with its own page
/// (`RejectedError` with the status, and the page's text in the message).
#[test]
fn a_python_client_that_cannot_take_part_raises_the_exception_that_says_why() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-errors");
    let serve = Serve::in_dir(&dir, ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } =
        serve.admin().create_task(&cohort_tests::spec(3, 2));
    let states = dir.join("states");
    let cases = python_report("coordinator_errors.py", &[&serve.url, &task, &token, &states]);
    let raised = |case: &str| {
        let case = &cases[case];
        assert_eq!(case["builtin"], true, "{cases}");
        (case["exception"].as_str().unwrap_or_default(), case["message"].as_str().unwrap_or_default())
    };
    let (exception, message) = raised("task_not_found");
    assert_eq!(exception, "TaskNotFoundError", "{cases}");
    assert!(message.contains(&"0".repeat(32)), "{message}");
    let (exception, message) = raised("unauthorized");
    assert_eq!(exception, "UnauthorizedError", "{cases}");
    assert!(message.contains("invalid enrollment token"), "{message}");
    let (exception, message) = raised("unreachable");
    assert_eq!(exception, "UnreachableError", "{cases}");
    assert!(message.contains("after 2 attempts"), "{message}");
    assert_eq!(raised("protocol").0, "ProtocolError", "{cases}");
    let (exception, message) = raised("rejected");
    assert_eq!(exception, "RejectedError", "{cases}");
    assert_eq!((&cases["rejected"]["status"], &cases["rejected"]["code"]), (&json!(403), &json!("unknown")));
    assert!(message.contains("403 Forbidden") && message.contains("denied by policy"), "{message}");
    drop(serve);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Flower users' code, unchanged: three objects shaped like Flower's
/// `NumPyClient` (Flower is not installed) take part in a task through
/// `cohort.flower.run_numpy_client`. `fit` gets the global model's arrays
/// and a config with the round and what the caller gave; its update goes
/// into the aggregate, its loss into the round's masked metric means, and
/// a metric Cohort does not aggregate is dropped with a warning.
#[test]
fn flower_numpy_clients_take_part_unchanged() {
    let _one = cohort_tests::exclusive();
    let dir = scratch("python-flower");
    let serve = Serve::in_dir(&dir, ADMIN);
    let spec = cohort_tests::spec(3, 2);
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec);
    let policy = serve.admin().policy_json(&task);
    let shapes: Vec<&Value> =
        spec["model"]["layout"]["tensors"].as_array().unwrap().iter().map(|t| &t["shape"]).collect();
    let (clients, shapes) = (dir.join("clients"), json!(shapes).to_string());
    let report =
        python_report("flower_clients.py", &[&serve.url, &task, &token, &clients, &policy, &"3", &shapes]);
    for client in report["clients"].as_array().unwrap() {
        assert_eq!(client["outcomes"], json!(["completed"]), "{report}");
        assert_eq!(client["configs"], json!([{ "lr": 0.1, "server_round": 1 }]), "{report}");
    }
    let warnings = report["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 3, "one warning per client: {report}");
    assert!(
        warnings.iter().all(|w| w.as_str().unwrap().contains("'learning_rate_used' is not sent")),
        "{report}"
    );
    let update = || fixed_update(cohort_tests::model().len());
    assert_aggregate(&serve, &task, &[update(), update(), update()]);
    let rounds = serve.admin().rounds(&task);
    let loss = &rounds[0].metrics.client_means["train_loss"];
    assert_eq!(loss.clients, 3, "{rounds:?}");
    assert!((loss.mean - 0.5).abs() < 1e-3, "{rounds:?}");
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
