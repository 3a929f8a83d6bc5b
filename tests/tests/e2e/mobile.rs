//! The mobile bindings against a real `cohort serve`: JVM clients through
//! JNI and a C client through `include/cohort.h` each take part in a
//! secure round with native clients, and the aggregate is the exact
//! weighted mean of everyone's update.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use cohort_client::runtime::LocalUpdate;
use cohort_server::api::CreatedTask;
use cohort_tests::{
    Serve, app_update, artifacts, assert_aggregate, checkpoint, compile_java, native_clients, native_update,
    scratch, spec, success, synthetic_update, workspace_root,
};

const ADMIN: &str = "mobile-e2e-admin-token";

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

/// Runs the JVM test program `main` (with the JNI library, checked) against
/// the task; its stdout.
fn run_java(classes: &Path, main: &str, serve: &Serve, task: &str, token: &str, dir: &Path) -> String {
    let library_dir = artifacts().mobile_shared.parent().unwrap();
    let run = cohort_tests::output_within(
        Command::new("java")
            .arg("-Xcheck:jni")
            .arg(format!("-Djava.library.path={}", library_dir.display()))
            .arg("-cp")
            .arg(classes)
            .arg(main)
            .args([&serve.url, task, token])
            .arg(dir.join("jvm"))
            .arg(serve.admin().policy_json(task)),
        cohort_tests::CLIENT_LIMIT,
    );
    success(main, &run)
}

/// The task validates its inputs (a new active task does by default): the
/// bindings' clients prove their updates through the core, or their
/// ShareKeys is refused and the round cannot complete with them.
fn assert_validated(serve: &Serve, task: &str) {
    let norm = serve.admin().task(task).spec.validation.map(|v| v.norm);
    assert_eq!(norm, Some(cohort_server::spec::NormChoice::L2));
}

#[test]
fn jvm_clients_join_a_secure_round_with_native_clients() {
    let dir = scratch("jvm");
    let classes = dir.join("classes");
    compile_java(&classes);

    let serve = Serve::in_dir(&dir, ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec(5, 3));
    assert_validated(&serve, &task);
    let natives = native_clients(&serve, &task, &token, 3);
    let stdout = run_java(&classes, "org.cohort.JvmRoundTest", &serve, &task, &token, &dir);
    println!("{stdout}");
    assert!(stdout.contains("JVM OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }

    // Client A sent its fixed update; client B trained on its data with
    // the built-in trainer, exactly as here.
    let initial = checkpoint(&serve, &task, 0);
    let app = app_update();
    let trained = synthetic_update(&initial);
    let mut updates: Vec<LocalUpdate> = (0..3).map(native_update).collect();
    updates.extend([app, trained]);
    assert_aggregate(&serve, &task, &updates);
    check_state_file(&dir.join("jvm/a"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Compiles the C round program into `dir`.
fn compile_c_client(dir: &Path) -> std::path::PathBuf {
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
        .unwrap_or_else(|e| panic!("no C compiler: {e}"));
    success("cc", &compiled);
    program
}

/// Runs the C program (with `extra` arguments) beside three native
/// clients until all of them are done.
fn run_c_client(program: &Path, serve: &Serve, task: &str, token: &str, dir: &Path, extra: &[&str]) {
    let natives = native_clients(serve, task, token, 3);
    let run = cohort_tests::output_within(
        Command::new(program)
            .args([&serve.url, task, token])
            .arg(dir.join("c-client"))
            .arg(serve.admin().policy_json(task))
            .args(extra),
        cohort_tests::CLIENT_LIMIT,
    );
    let stdout = success("the C test", &run);
    assert!(stdout.contains("C OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }
}

/// The three native clients' updates and the C client's, computed by its
/// callback for `round`.
fn c_and_natives(round: f32) -> Vec<LocalUpdate> {
    let c_update = LocalUpdate {
        delta: (0..15).map(|j| 0.03 * (j % 4) as f32 - 0.01 * round).collect(),
        examples: 9,
        metrics: cohort_client::participant::MetricValues::new(),
    };
    let mut updates: Vec<LocalUpdate> = (0..3).map(native_update).collect();
    updates.push(c_update);
    updates
}

/// The JNI binding in an async task: two JVM clients and a native one
/// fill a buffer of three; version 1 is their weighted mean.
#[test]
fn jvm_clients_take_part_in_an_async_task() {
    let dir = scratch("jvm-async");
    let classes = dir.join("classes");
    compile_java(&classes);
    let serve = Serve::in_dir(&dir, ADMIN);
    let mut spec = spec(3, 2);
    spec["mode"] = serde_json::json!("async");
    spec["async"] = serde_json::json!({ "concurrency": 3, "buffer_size": 3, "max_staleness": 1 });
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec);
    let natives = native_clients(&serve, &task, &token, 1);
    let stdout = run_java(&classes, "org.cohort.JvmAsyncTest", &serve, &task, &token, &dir);
    assert!(stdout.contains("JVM ASYNC OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }
    let jvm = |k: usize| LocalUpdate {
        delta: (0..15).map(|j| 0.01 * (k as f32 + 1.0) * ((j % 3) as f32 - 1.0)).collect(),
        examples: 8,
        metrics: cohort_client::participant::MetricValues::new(),
    };
    assert_aggregate(&serve, &task, &[native_update(0), jvm(0), jvm(1)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_c_client_joins_a_secure_round_through_the_header() {
    let dir = scratch("c");
    let program = compile_c_client(&dir);
    let serve = Serve::in_dir(&dir, ADMIN);
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec(4, 3));
    assert_validated(&serve, &task);
    run_c_client(&program, &serve, &task, &token, &dir, &[]);
    // Round 1: the callback's update for round 1.
    assert_aggregate(&serve, &task, &c_and_natives(1.0));
    check_state_file(&dir.join("c-client"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The C binding in an async task: the client trains from version 0 when
/// given a training slot, waits with its update, and joins the group of
/// four with three native clients; version 1 is their weighted mean.
#[test]
fn a_c_client_takes_part_in_an_async_task() {
    let dir = scratch("c-async");
    let program = compile_c_client(&dir);
    let serve = Serve::in_dir(&dir, ADMIN);
    let mut spec = spec(4, 3);
    spec["mode"] = serde_json::json!("async");
    spec["async"] = serde_json::json!({ "concurrency": 4, "buffer_size": 4, "max_staleness": 1 });
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec);
    run_c_client(&program, &serve, &task, &token, &dir, &["async"]);
    // Trained from version 0: the callback's round is the base version.
    assert_aggregate(&serve, &task, &c_and_natives(0.0));
    let rounds = serve.admin().rounds(&task);
    let buffer = rounds[0].metrics.buffer.as_ref().expect("an async round names its group");
    assert_eq!(buffer.staleness_histogram, [4], "{rounds:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
