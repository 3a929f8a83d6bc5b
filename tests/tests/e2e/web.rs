//! The browser client's wasm build, run under Node, against a real
//! `cohort serve`: two wasm clients and three native clients complete a
//! secure round, and the aggregate is the exact weighted mean.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use cohort_client::runtime::LocalUpdate;
use cohort_server::api::CreatedTask;
use cohort_tests::{
    Serve, app_update, assert_aggregate, checkpoint, native_clients, native_update, scratch, spec, success,
    synthetic_update, workspace_root,
};

#[test]
fn wasm_clients_join_a_secure_round_with_native_clients() {
    // The same build the browser loads: wasm32 with Debian's toolchain,
    // then wasm-bindgen (both installed by scripts/setup.sh).
    cohort_tests::web_package();

    let dir = scratch("web");
    let serve = Serve::in_dir(&dir, "web-e2e-admin-token");
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec(5, 3));
    let natives = native_clients(&serve, &task, &token, 3);
    let run = cohort_tests::output_within(
        Command::new("node").arg(workspace_root().join("web/tests/round.mjs")).args([
            &serve.url,
            &task,
            &token,
            &serve.admin().policy_json(&task),
        ]),
        cohort_tests::CLIENT_LIMIT,
    );
    let stdout = success("the wasm clients", &run);
    println!("{stdout}");
    assert!(stdout.contains("WEB OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }
    let initial = checkpoint(&serve, &task, 0);
    let app = app_update();
    let mut updates: Vec<LocalUpdate> = (0..3).map(native_update).collect();
    updates.extend([app, synthetic_update(&initial)]);
    assert_aggregate(&serve, &task, &updates);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The browser build in an async task: two wasm clients and a native one
/// fill a buffer of three; version 1 is their weighted mean.
#[test]
fn wasm_clients_take_part_in_an_async_task() {
    cohort_tests::web_package();
    let dir = scratch("web-async");
    let serve = Serve::in_dir(&dir, "web-async-admin-token");
    let mut spec = spec(3, 2);
    spec["mode"] = serde_json::json!("async");
    spec["async"] = serde_json::json!({ "concurrency": 3, "buffer_size": 3, "max_staleness": 1 });
    let CreatedTask { id: task, enrollment_token: token, .. } = serve.admin().create_task(&spec);
    let natives = native_clients(&serve, &task, &token, 1);
    let run = cohort_tests::output_within(
        Command::new("node").arg(workspace_root().join("web/tests/async.mjs")).args([
            &serve.url,
            &task,
            &token,
            &serve.admin().policy_json(&task),
        ]),
        cohort_tests::CLIENT_LIMIT,
    );
    let stdout = success("the wasm clients", &run);
    assert!(stdout.contains("ASYNC WEB OK"), "{stdout}");
    for native in natives {
        native.join().unwrap();
    }
    let wasm = |scale: f32| LocalUpdate {
        delta: (0..15).map(|j| scale * ((j % 5) as f32 - 2.0)).collect(),
        examples: 7,
        metrics: cohort_client::participant::MetricValues::new(),
    };
    assert_aggregate(&serve, &task, &[native_update(0), wasm(0.02), wasm(-0.01)]);
}
