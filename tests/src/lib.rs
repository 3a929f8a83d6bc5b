//! The workspace's test kit, for the end-to-end tests in `tests/tests/`
//! (the `e2e` binary and `torchscript`) and the coordinator's integration
//! tests: one coordinator harness ([`Serve`], a process or in process), one
//! typed admin client ([`AdminClient`]), the built artifacts (the `cohort`
//! binary and the mobile library, built with a nested cargo call), and the
//! rounds, clients and policies the suites share.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod admin;
pub mod balancer;
pub mod identity;
pub mod postgres;
pub mod process;
pub mod proxy;
pub mod serve;

pub use admin::AdminClient;
pub use serve::{Serve, ServeOptions, test_certificates};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use std::process::Output;

use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::data::Dataset;
use cohort_client::model::Model;
use cohort_client::participant::{Participant, ParticipantConfig, RoundOutcome};
use cohort_client::runtime::http::HttpTransport;
use cohort_client::runtime::{self, LocalUpdate, Runner, Trainer};
use cohort_client::train::TrainConfig;
use serde_json::{Value, json};

/// The built artifacts the tests run.
#[derive(Debug)]
pub struct Artifacts {
    /// The `cohort` executable.
    pub cohort: PathBuf,
    /// `libcohort_mobile.so` (or the platform's shared library).
    pub mobile_shared: PathBuf,
    /// `libcohort_mobile.a`.
    pub mobile_static: PathBuf,
    /// The Python package's native module (`libcohort_native.so`).
    pub python_native: PathBuf,
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Builds (once per test process) the `cohort` binary and the mobile
/// library with the test profile, in the same target directory.
///
/// The call selects the whole workspace with test targets, as
/// `cargo test --workspace` (scripts/test.sh) does, so that cargo resolves
/// the same features and finds every unit already built: selecting only
/// `cohort-cli` would unify features differently and rebuild most of the
/// dependency graph a second time.
pub fn artifacts() -> &'static Artifacts {
    static ARTIFACTS: OnceLock<Artifacts> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut command = Command::new(cargo);
        // What cargo sets for this test process only: build scripts that
        // watch these (ring's watches CARGO_MANIFEST_DIR and CARGO_PKG_NAME)
        // would otherwise run again, and everything above them be rebuilt.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            let set_for_tests = ["CARGO_MANIFEST_DIR", "CARGO_MANIFEST_PATH", "CARGO_CRATE_NAME", "OUT_DIR"]
                .contains(&name.as_ref())
                || ["CARGO_PKG_", "CARGO_BIN_", "CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR"]
                    .iter()
                    .any(|prefix| name.starts_with(prefix));
            if set_for_tests {
                command.env_remove(name.as_ref());
            }
        }
        let output = command
            .current_dir(workspace_root())
            .args(["build", "--locked", "--profile", "test", "--message-format", "json-render-diagnostics"])
            .args(["--workspace", "--bins", "--lib", "--test", "torchscript"])
            // With libtorch: `participate --model net.pt` (the torchscript
            // tests), the features scripts/test.sh gives that run.
            .args(if cfg!(feature = "tch") { &["--features", TCH_FEATURES][..] } else { &[] })
            .stderr(Stdio::inherit())
            .output()
            .expect("cargo runs");
        assert!(output.status.success(), "building the artifacts failed");
        let mut cohort = None;
        let mut shared = None;
        let mut archive = None;
        let mut python_native = None;
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let Ok(message) = serde_json::from_str::<Value>(line) else { continue };
            if message["reason"] != "compiler-artifact" {
                continue;
            }
            if let Some(executable) = message["executable"].as_str() {
                if message["target"]["name"] == "cohort" {
                    cohort = Some(PathBuf::from(executable));
                }
            }
            if message["target"]["name"] == "cohort_native" {
                python_native = message["filenames"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .find(|file| file.ends_with(".so") || file.ends_with(".dylib"))
                    .map(PathBuf::from);
            }
            if message["target"]["name"] == "cohort_mobile" {
                for file in message["filenames"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                    if file.ends_with(".so") || file.ends_with(".dylib") {
                        shared = Some(PathBuf::from(file));
                    } else if file.ends_with(".a") {
                        archive = Some(PathBuf::from(file));
                    }
                }
            }
        }
        Artifacts {
            cohort: cohort.expect("the cohort binary was built"),
            mobile_shared: shared.expect("the mobile cdylib was built"),
            mobile_static: archive.expect("the mobile staticlib was built"),
            python_native: python_native.expect("the Python package's native module was built"),
        }
    })
}

/// Builds the browser package (`scripts/build-web.sh`: the wasm32 build and
/// wasm-bindgen into `web/pkg`) once per test process, so that no test
/// rewrites `web/pkg` while another one serves or loads it.
pub fn web_package() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let built = Command::new("bash").arg(workspace_root().join("scripts/build-web.sh")).output().unwrap();
        success("scripts/build-web.sh", &built);
    });
}

/// One heavy scenario at a time in the end-to-end binary (Chromium tabs,
/// the hostile-client suites, thousands of sockets, three replicas behind
/// HAProxy): they hold this lock, so that on two cores they never run beside
/// each other, while lighter tests go on in the other test thread.
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The features of the libtorch run of the workspace (scripts/test.sh).
pub const TCH_FEATURES: &str = "cohort-client/tch,cohort-cli/tch,cohort-tests/tch";

/// The Python of the venv `scripts/setup.sh` makes (safetensors, NumPy,
/// dp-accounting), or `COHORT_PYTHON`.
pub fn python() -> PathBuf {
    let path = std::env::var_os("COHORT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/cohort-venv/bin/python"));
    assert!(path.exists(), "{} is missing: run scripts/setup.sh (or set COHORT_PYTHON)", path.display());
    path
}

/// The Python of the PyTorch venv `scripts/setup.sh` makes (torch, NumPy,
/// safetensors, pytest), or `COHORT_TORCH_VENV`'s.
pub fn torch_python() -> PathBuf {
    let venv = std::env::var_os("COHORT_TORCH_VENV")
        .map_or_else(|| PathBuf::from("/var/tmp/cohort-torch-venv"), PathBuf::from);
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup.sh (or set COHORT_TORCH_VENV)",
        python.display()
    );
    python
}

/// The `cohort` Python package as this test process built it: the sources
/// of `python/python/cohort` with the native module built beside the
/// `cohort` binary (not the copy `scripts/setup.sh` installed in the venv,
/// which may be older), assembled once per process in a directory to put
/// on `PYTHONPATH`.
pub fn python_package() -> &'static Path {
    static PACKAGE: OnceLock<PathBuf> = OnceLock::new();
    PACKAGE.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("cohort-python-package-{}", std::process::id()));
        let package = root.join("cohort");
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&package).unwrap();
        let sources = workspace_root().join("python/python/cohort");
        for entry in std::fs::read_dir(&sources).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                std::fs::copy(&path, package.join(path.file_name().unwrap())).unwrap();
            }
        }
        std::fs::copy(&artifacts().python_native, package.join("_native.abi3.so")).unwrap();
        root
    })
}

/// A command that runs the PyTorch venv's Python with the `cohort` package
/// of [`python_package`] first on its path.
pub fn python_command() -> Command {
    let mut command = Command::new(torch_python());
    command.env("PYTHONPATH", python_package()).env("PYTHONDONTWRITEBYTECODE", "1");
    command
}

/// Waits until `done` holds, asking every 100 ms; fails the test, naming
/// `what`, after `limit`.
pub fn wait_for(limit: std::time::Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A fresh scratch directory under the system's temporary directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cohort-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The client policy that accepts the task `spec` would create (new tasks
/// run the active variant unless they say otherwise), weakened from the
/// default only where the small test task needs it.
pub fn policy_for(spec: &Value) -> cohort_client::participant::Policy {
    let mut spec: cohort_server::spec::TaskSpec = serde_json::from_value(spec.clone()).unwrap();
    spec.secure_aggregation.default_for_new_task();
    spec.accepting_policy().unwrap()
}

/// The client policy for a small test task (the complete graph, active
/// variant): the default, with the minimums lowered to the task's size,
/// threshold and collusion margin (2t − k − 1 = 2t − n on the complete
/// graph), and without the collusion bound, which a round of a handful of
/// clients cannot meet (5 % of them rounds up to one client of the
/// coordinator's own; the margin is that rule's exact form). JSON, as the
/// bindings take it.
pub fn policy_json(spec: &Value) -> String {
    let sa = &spec["secure_aggregation"];
    assert_eq!(sa["graph"], "complete", "policy_json covers the complete graph");
    let (clients, threshold) =
        (spec["clients_per_round"].as_u64().unwrap(), sa["threshold"].as_u64().unwrap());
    let margin = (2 * threshold).saturating_sub(clients).max(1);
    json!({ "min_clients": clients, "min_threshold": threshold, "min_collusion_margin": margin, "collusion": null })
        .to_string()
}

// Rounds shared by the binding tests: a 15-parameter logistic regression,
// native clients with fixed updates, and the exact aggregate.

/// The task's model: logistic regression, 4 features, 3 classes (15
/// parameters), which the built-in trainer recognises.
pub fn model() -> Model {
    Model::by_name("logreg", 4, 3).unwrap()
}

pub fn spec(clients: u32, threshold: u32) -> Value {
    json!({
        "name": "mobile bindings",
        "rounds": 2,
        "clients_per_round": clients,
        "model": { "architecture": "logreg", "layout": model().layout() },
        "secure_aggregation": { "graph": "complete", "threshold": threshold },
        "deadlines": { "advertise_keys_ms": 60000, "share_keys_ms": 60000, "masked_input_ms": 60000, "unmasking_ms": 60000 }
    })
}

/// A trainer that hands in a fixed update.
pub struct Fixed(pub LocalUpdate);

impl Trainer for Fixed {
    fn train(
        &mut self,
        _: cohort_client::runtime::Contribution,
        _: &Checkpoint,
    ) -> Result<LocalUpdate, cohort_client::runtime::UpdateError> {
        // A test's known update: copied on purpose (LocalUpdate is not Clone).
        let LocalUpdate { delta, examples, metrics } = &self.0;
        Ok(LocalUpdate { delta: delta.clone(), examples: *examples, metrics: *metrics })
    }
}

/// Native client k's update of [`model`].
pub fn native_update(k: usize) -> LocalUpdate {
    native_update_of(k, 15)
}

/// Native client k's update of a model with `parameters` weights.
pub fn native_update_of(k: usize, parameters: usize) -> LocalUpdate {
    let delta =
        (0..parameters).map(|j| 0.01 * (k as f32 + 1.0) * if j % 2 == 0 { 1.0 } else { -1.0 }).collect();
    LocalUpdate { delta, examples: 10 + k as u32, metrics: cohort_client::participant::MetricValues::new() }
}

/// Native clients, each taking part in one round with `native_update(k)`.
pub fn native_clients(
    serve: &Serve,
    task: &str,
    token: &str,
    count: usize,
) -> Vec<std::thread::JoinHandle<()>> {
    native_clients_with(serve, task, token, (0..count).map(native_update).collect())
}

/// Native clients, client k taking part in one round with `updates[k]`.
pub fn native_clients_with(
    serve: &Serve,
    task: &str,
    token: &str,
    updates: Vec<LocalUpdate>,
) -> Vec<std::thread::JoinHandle<()>> {
    configured_clients(
        serve,
        task,
        token,
        updates,
        ParticipantConfig { poll_interval_ms: 50, ..Default::default() },
    )
}

/// [`native_clients_with`], each client polling for its next message every
/// `poll_interval_ms` instead of asking the coordinator to hold its
/// requests (slow clients make each stage last that long).
pub fn native_clients_polling(
    serve: &Serve,
    task: &str,
    token: &str,
    updates: Vec<LocalUpdate>,
    poll_interval_ms: u64,
) -> Vec<std::thread::JoinHandle<()>> {
    let config = ParticipantConfig { poll_interval_ms, wait_ms: 0, ..Default::default() };
    configured_clients(serve, task, token, updates, config)
}

/// A native client thread per update, each with `config` and the task's
/// policy, that must complete one round.
fn configured_clients(
    serve: &Serve,
    task: &str,
    token: &str,
    updates: Vec<LocalUpdate>,
    config: ParticipantConfig,
) -> Vec<std::thread::JoinHandle<()>> {
    updates
        .into_iter()
        .enumerate()
        .map(|(k, update)| {
            let (url, task, token) = (serve.url.clone(), task.to_string(), token.to_string());
            let policy = serde_json::from_str(&serve.admin().policy_json(&task)).unwrap();
            let config = ParticipantConfig { policy, ..config };
            std::thread::spawn(move || {
                let participant = Participant::enroll(&task, &token, config);
                let mut runner = Runner::new(participant, HttpTransport::new(&url), None);
                let outcome = runner.run_round(&mut Fixed(update)).unwrap();
                assert!(
                    matches!(outcome, Some(RoundOutcome::Completed(_))),
                    "native client {k}: {outcome:?}"
                );
            })
        })
        .collect()
}

/// A checkpoint of the task, from the admin API. A client's round ends
/// when its last stage message is accepted, before the coordinator has
/// unmasked and stored the round: a round not stored yet is waited for (at
/// most 30 s).
pub fn checkpoint(serve: &Serve, task: &str, round: u64) -> Checkpoint {
    let path = format!("/admin/tasks/{task}/checkpoints/{round}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let admin = serve.admin();
    let (mut status, mut bytes) = admin.send("GET", &path, &[]);
    while status == 404 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        (status, bytes) = admin.send("GET", &path, &[]);
    }
    assert_eq!(status, 200, "checkpoint {round}");
    checkpoint::decode(&bytes).unwrap()
}

/// Where the end-to-end tests leave what a person may want to look at
/// (screenshots): `$CARGO_TARGET_DIR/artifacts/NAME`.
pub fn artifact_dir(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let dir = target.join("artifacts").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Round 1's model must be the initial one plus the weighted mean of
/// `updates`, and every selected client a survivor.
pub fn assert_aggregate(serve: &Serve, task: &str, updates: &[LocalUpdate]) {
    let initial = checkpoint(serve, task, 0);
    let after = checkpoint(serve, task, 1);
    let total: f32 = updates.iter().map(|u| u.examples as f32).sum();
    for (j, (got, start)) in after.weights.iter().zip(&initial.weights).enumerate() {
        let mean: f32 = updates.iter().map(|u| u.delta[j] * u.examples as f32).sum::<f32>() / total;
        assert!((got - start - mean).abs() < 1e-3, "parameter {j}: {got} vs {}", start + mean);
    }
    let rounds = serve.admin().rounds(task);
    assert_eq!(rounds[0].survivors, updates.len() as i64, "{rounds:?}");
}

/// Compiles the Java bindings and their test programs into `classes`,
/// warnings as errors.
pub fn compile_java(classes: &Path) {
    let java = workspace_root().join("mobile/java");
    let mut sources: Vec<_> = ["src/org/cohort", "test/org/cohort"]
        .iter()
        .flat_map(|d| std::fs::read_dir(java.join(d)).into_iter().flatten())
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    sources.sort();
    let compiled = Command::new("javac")
        .args(["-Xlint:all", "-Werror", "-d"])
        .arg(classes)
        .args(&sources)
        .output()
        .unwrap_or_else(|e| panic!("javac (Java 17) is not installed: {e}"));
    success("javac", &compiled);
}

/// Runs `command` to its end, as `Command::output` does, but for at most
/// `limit`: past it the process is killed and the test fails with what the
/// process printed, so that a client waiting for a round that never comes
/// fails the test instead of hanging it.
pub fn output_within(command: &mut Command, limit: std::time::Duration) -> Output {
    use std::io::Read;
    let what = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what} could not start: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    let Some(status) = status else {
        panic!(
            "{what} ran past {limit:?} and was killed:\n{}\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        );
    };
    Output { status, stdout, stderr }
}

/// How long one client program of an end-to-end test (a browser step, the
/// wasm clients under Node, a JVM or C client) may run.
pub const CLIENT_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// The stdout of a process that must have succeeded.
pub fn success(what: &str, output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The update an app computes itself in the binding tests (mirrored in
/// `JvmRoundTest.java` and `web/tests/round.mjs`): 7 examples.
pub fn app_update() -> LocalUpdate {
    LocalUpdate {
        delta: (0..15).map(|j| 0.02 * ((j % 5) as f32 - 2.0)).collect(),
        examples: 7,
        metrics: cohort_client::participant::MetricValues::new(),
    }
}

/// The update of a client that trains the task's model with the built-in
/// trainer on the synthetic data the binding tests supply (30 rows, 4
/// features, 3 classes; 2 epochs, batch 5, learning rate 0.1), as its
/// first contribution (nonce 0).
pub fn synthetic_update(initial: &Checkpoint) -> LocalUpdate {
    let rows = 30;
    let labels: Vec<u8> = (0..rows).map(|i| (i % 3) as u8).collect();
    let features =
        ndarray::Array2::from_shape_fn((rows, 4), |(i, j)| ((i % 3 * 5 + j * 3 + i) % 7) as f32 / 7.0);
    let data = Dataset { features, labels, shape: [1, 4], classes: 3 };
    let config = TrainConfig { epochs: 2, batch_size: 5, learning_rate: 0.1, ..TrainConfig::default() };
    let trained = runtime::local_update(&model(), &data, &config, 0, initial).unwrap();
    assert!(trained.delta.iter().any(|v| v.abs() > 1e-3), "training moved the model");
    trained
}
