//! `scripts/setup.sh` as a newcomer runs it: run twice, the second run
//! says every step had nothing to do; `--web`, the browser demo's
//! light path, says what it left out; anything else is a usage error.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use cohort_tests::{success, workspace_root};

fn setup(args: &[&str]) -> std::process::Output {
    Command::new("bash").arg(workspace_root().join("scripts/setup.sh")).args(args).output().unwrap()
}

#[test]
fn setup_says_what_it_skipped_and_web_what_it_left_out() {
    // Idempotence: once one run has set the machine up (quick when the
    // test command's own run already did, as in CI), a second run has
    // nothing left to do, whatever state the machine was in.
    success("scripts/setup.sh", &setup(&[]));
    let full = success("scripts/setup.sh", &setup(&[]));
    let steps: Vec<&str> = full.lines().filter(|l| l.starts_with("==> ")).collect();
    assert!(steps.len() >= 7, "{full}");
    assert!(steps.iter().all(|l| l.ends_with("(skipped)")), "{full}");

    let web = success("scripts/setup.sh --web", &setup(&["--web"]));
    assert!(web.contains("wasm-bindgen-cli") && web.contains("(skipped)"), "{web}");
    assert!(web.contains("--web: left out the JDK, Chromium"), "{web}");
    assert!(!web.contains("PostgreSQL is running") && !web.contains("is ready (skipped)"), "{web}");

    let wrong = setup(&["--webb"]);
    assert_eq!(wrong.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("usage: scripts/setup.sh [--web]"));
}
