//! The API against its own OpenAPI document: Schemathesis (PyPI, in the
//! venv `scripts/setup.sh` makes) runs every one of its checks, in every
//! phase (examples, coverage, fuzzing, and the stateful phase that follows
//! the document's links from a created task), against a real `cohort
//! serve`, as an admin and as an enrolled participant. It must find
//! nothing: a schema-valid request refused, a schema-invalid one
//! accepted, a status code, header, content type or body the document does
//! not declare, a server error, an endpoint that ignores its credential.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use cohort_tests::Serve;
use cohort_tests::process::json_call;
use serde_json::{Value, json};

const ADMIN: &str = "admin-token-for-the-api-fuzzer";

#[test]
fn schemathesis_finds_nothing_against_the_openapi_document() {
    let config = json!({
        // Small enough that the tasks the fuzzer creates stay cheap; a spec
        // beyond it is refused with the documented 422.
        "max_total_parameters": 1_000_000,
        // The rate limits would answer most generated requests with 429
        // (documented, but it would leave the logic behind them untested).
        "rate_limits": {
            "enroll_per_address": null, "enroll_per_token": null,
            "check_in_per_address": null, "check_in_per_credential": null,
            "reports_per_address": null, "reports_per_credential": null
        }
    });
    let server = Serve::sqlite("api-fuzz", ADMIN, Some(&config));
    let port = server.port;
    // A participant's credential, so that the client API is tested past its
    // authentication.
    let spec = json!({
        "name": "fuzzed",
        "rounds": 3,
        "clients_per_round": 3,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [4] } ] } },
        "secure_aggregation": { "variant": "semi-honest", "graph": "complete" }
    });
    let (status, created) = json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec));
    assert_eq!(status, 201, "{created}");
    let enroll = format!("/v1/tasks/{}/enroll", created["id"].as_str().unwrap());
    let (status, enrolled) = json_call(
        port,
        "POST",
        &enroll,
        None,
        Some(json!({ "enrollment_token": created["enrollment_token"] })),
    );
    assert_eq!(status, 201, "{enrolled}");

    let python = cohort_tests::python();
    let schemathesis = python.parent().unwrap().join("st");
    assert!(schemathesis.exists(), "{} is missing: run scripts/setup.sh", schemathesis.display());
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("api");
    let output = Command::new(&schemathesis)
        .arg("--config-file")
        .arg(here.join("schemathesis.toml"))
        .args(["run", &format!("http://127.0.0.1:{port}/openapi.json"), "--checks", "all", "--no-color"])
        .env("SCHEMATHESIS_HOOKS", here.join("hooks.py"))
        // Its cache of findings goes to a scratch directory, not the tree.
        .current_dir(cohort_tests::scratch("api-fuzz"))
        .env("COHORT_ADMIN_TOKEN", ADMIN)
        .env("COHORT_CLIENT_CREDENTIAL", enrolled["credential"].as_str().unwrap())
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "Schemathesis found problems:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Every operation was tested, in every phase that has cases, the
    // stateful one included; all but the event streams (which do not end,
    // so that a fuzzer would wait for ever: `schemathesis.toml` leaves them
    // out, and `api::the_event_streams_push_a_round_as_it_happens` tests
    // them).
    let (_, document) = json_call(port, "GET", "/openapi.json", None, None);
    let operations: Vec<&Value> = document["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|item| item.as_object().unwrap().values())
        .collect();
    let mut streams: Vec<&str> = operations
        .iter()
        .filter(|operation| operation["responses"]["200"]["content"].get("text/event-stream").is_some())
        .map(|operation| operation["operationId"].as_str().unwrap())
        .collect();
    streams.sort_unstable();
    assert_eq!(streams, ["taskEvents", "taskListEvents"], "the event streams the configuration leaves out");
    let (all, fuzzed) = (operations.len(), operations.len() - streams.len());
    assert!(report.contains(&format!("Selected: {fuzzed}/{all}")), "{report}");
    assert!(report.contains(&format!("Tested: {fuzzed}")), "{report}");
    for phase in ["✅ Coverage", "✅ Fuzzing", "✅ Stateful", "✅ Examples"] {
        assert!(report.contains(phase), "{phase} did not pass:\n{report}");
    }
    drop(server);
}
