//! The hostile-coordinator suite against the browser client (its wasm
//! build, under Node), the JVM client (through JNI) and the Python package
//! (`import cohort`, in the PyTorch venv): the scripted proxy
//! of the native suite (`server/tests/integration/malicious_coordinator.rs`) sits in
//! front of a real `cohort serve` and rewrites what the clients are told;
//! each attack checks the refusal each client reports and, from the
//! proxy's recording, that none of them sent anything the attack could
//! use.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::{MutexGuard, Once};
use std::time::Duration;

use cohort_client::protocol::Stage;
use cohort_server::api::CreatedTask;
use cohort_tests::proxy::{
    Proxy, Tamper, replay_round_one, rewrite_enrollment, rewrite_peer_keys, rewrite_setup, split_survivors,
    split_target,
};
use cohort_tests::{Serve, artifacts, compile_java, scratch, success, workspace_root};
use serde_json::{Value, json};

const ADMIN: &str = "hostile-clients-admin-token";
const CLIENTS: usize = 4;
const ALL_STAGES: [Stage; 5] = [
    Stage::AdvertiseKeys,
    Stage::ShareKeys,
    Stage::MaskedInputCollection,
    Stage::ConsistencyCheck,
    Stage::Unmasking,
];

/// A client the project ships, run as its own process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The browser client's wasm build under Node.
    Wasm,
    /// The JVM client through JNI.
    Jvm,
    /// The Python package.
    Python,
}

/// One client's ending: its round outcomes (`(outcome, rule)`), then the
/// refusal that ended it, if any (`(message, rule)`, and the Python
/// client's exception class).
#[derive(Debug)]
struct Ending {
    outcomes: Vec<(String, Option<String>)>,
    error: Option<String>,
    rule: Option<String>,
    exception: Option<String>,
}

/// One scenario at a time: each runs four clients and a coordinator.
fn exclusive() -> MutexGuard<'static, ()> {
    cohort_tests::exclusive()
}

/// The wasm package and the Java classes, built once.
fn built(kind: Kind) -> PathBuf {
    static JAVA: Once = Once::new();
    let classes = std::env::temp_dir().join(format!("cohort-hostile-classes-{}", std::process::id()));
    match kind {
        Kind::Wasm => cohort_tests::web_package(),
        Kind::Jvm => JAVA.call_once(|| compile_java(&classes)),
        Kind::Python => drop(cohort_tests::python_package()),
    }
    classes
}

fn spec(name: &str, rounds: u32) -> Value {
    json!({
        "name": name, "rounds": rounds, "clients_per_round": CLIENTS,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [8] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3 },
        "deadlines": { "advertise_keys_ms": 30000, "share_keys_ms": 5000, "masked_input_ms": 5000, "unmasking_ms": 5000 },
        "checkpoint_retention": 5
    })
}

/// A coordinator with one task, behind a proxy scripted by `tamper`.
struct Scenario {
    serve: Serve,
    proxy: Proxy,
    task: String,
    token: String,
    dir: PathBuf,
}

impl Scenario {
    fn start(name: &str, rounds: u32, tamper: Tamper) -> Self {
        let dir = scratch(name);
        let serve = Serve::in_dir(&dir, ADMIN);
        let CreatedTask { id: task, enrollment_token: token, .. } =
            serve.admin().create_task(&spec(name, rounds));
        let proxy = Proxy::start(&serve.url, tamper);
        Scenario { serve, proxy, task, token, dir }
    }

    /// Runs [`CLIENTS`] clients of `kind` through the proxy until each has
    /// seen `rounds` outcomes, ended, or `patience` ran out.
    fn run(&self, kind: Kind, rounds: usize, patience: Duration) -> Vec<Ending> {
        let policy = self.serve.admin().policy_json(&self.task);
        let (clients, rounds, patience) =
            (CLIENTS.to_string(), rounds.to_string(), patience.as_millis().to_string());
        let output = match kind {
            Kind::Wasm => cohort_tests::output_within(
                Command::new("node").arg(workspace_root().join("web/tests/hostile.mjs")).args([
                    &self.proxy.url,
                    &self.task,
                    &self.token,
                    &policy,
                    &clients,
                    &rounds,
                    &patience,
                ]),
                cohort_tests::CLIENT_LIMIT,
            ),
            Kind::Jvm => {
                let library_dir = artifacts().mobile_shared.parent().unwrap();
                cohort_tests::output_within(
                    Command::new("java")
                        .arg("-Xcheck:jni")
                        .arg(format!("-Djava.library.path={}", library_dir.display()))
                        .arg("-cp")
                        .arg(built(Kind::Jvm))
                        .arg("org.cohort.HostileClients")
                        .args([&self.proxy.url, &self.task, &self.token])
                        .arg(self.dir.join("jvm"))
                        .args([&policy, &clients, &rounds, &patience]),
                    cohort_tests::CLIENT_LIMIT,
                )
            }
            Kind::Python => cohort_tests::output_within(
                cohort_tests::python_command()
                    .arg(workspace_root().join("python/tests/hostile_clients.py"))
                    .args([&self.proxy.url, &self.task, &self.token])
                    .arg(self.dir.join("python"))
                    .args([&policy, &clients, &rounds, &patience]),
                cohort_tests::CLIENT_LIMIT,
            ),
        };
        let stdout = success(&format!("the {kind:?} clients"), &output);
        let endings: Vec<Value> = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
        println!("{kind:?}: {endings:?}");
        let text = |v: &Value| v.as_str().map(str::to_string);
        endings
            .iter()
            .map(|e| Ending {
                outcomes: e["outcomes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|o| (o["outcome"].as_str().unwrap().to_string(), text(&o["rule"])))
                    .collect(),
                error: text(&e["error"]),
                rule: text(&e["rule"]),
                exception: text(&e["exception"]),
            })
            .collect()
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Every attack against clients of `kind`.
fn attacks(kind: Kind) {
    let _one = exclusive();
    built(kind);
    let name = |attack: &str| format!("hostile-{kind:?}-{attack}").to_lowercase();

    // The honest proxy changes nothing: every client completes, and the
    // recording sees all five stages from each.
    let scenario = Scenario::start(&name("honest"), 1, Box::new(|_, _| {}));
    let endings = scenario.run(kind, 1, Duration::from_secs(90));
    for ending in &endings {
        assert_eq!(ending.outcomes, [("completed".to_string(), None)], "{kind:?}: {ending:?}");
    }
    let posted = scenario.proxy.posted();
    assert_eq!(posted.len(), CLIENTS, "{kind:?}: {posted:?}");
    assert!(posted.values().all(|stages| stages == &ALL_STAGES), "{kind:?}: {posted:?}");
    drop(scenario);

    // A task announced below the policy: refused at enrollment, nothing
    // sent after it.
    let scenario = Scenario::start(&name("below-policy"), 1, rewrite_enrollment(|s| s.clients = 3));
    for ending in scenario.run(kind, 1, Duration::from_secs(60)) {
        assert_eq!(ending.rule.as_deref(), Some("min_clients"), "{kind:?}: {ending:?}");
        if kind == Kind::Python {
            assert_eq!(ending.exception.as_deref(), Some("PolicyError"), "{ending:?}");
        }
    }
    assert!(scenario.proxy.posted().is_empty(), "{kind:?}");
    let script = scenario.proxy.script.lock().unwrap();
    assert!(script.log.iter().all(|e| e.path.ends_with("/enroll")), "{kind:?}: a client went on");
    drop(script);
    drop(scenario);

    // A round that lowers the pinned threshold, or switches compression
    // on: refused before any key.
    let lower: Tamper = rewrite_setup(|c| c.threshold = 2);
    let rotate: Tamper = rewrite_setup(|c| {
        c.quantization.transform = cohort_client::protocol::Transform::Rotate { block: 8, seed: [3; 32] };
    });
    // (In a round of four no other active threshold is valid: a lower one
    // does not decode as a round, and the client gives the round up.)
    for (attack, tamper) in [("threshold", lower), ("rotate", rotate)] {
        let scenario = Scenario::start(&name(attack), 1, tamper);
        for ending in scenario.run(kind, 1, Duration::from_secs(60)) {
            if attack == "threshold" {
                assert!(
                    ending.rule.is_none() && ending.outcomes.first().is_some_and(|(o, _)| o == "abandoned"),
                    "{kind:?} {attack}: {ending:?}"
                );
            } else {
                assert_eq!(ending.rule.as_deref(), Some("pinned"), "{kind:?} {attack}: {ending:?}");
                if kind == Kind::Python {
                    assert_eq!(ending.exception.as_deref(), Some("PolicyError"), "{ending:?}");
                }
            }
        }
        assert!(scenario.proxy.posted().is_empty(), "{kind:?} {attack}: {:?}", scenario.proxy.posted());
    }

    // A substituted key or a forged signature shown to one client: it
    // advertised its keys and sent no share to anybody.
    for (attack, tamper) in [
        ("key", rewrite_peer_keys(|p| p.mask_key = [9; 32])),
        ("signature", rewrite_peer_keys(|p| p.signature = Some([7; 64]))),
    ] {
        let scenario = Scenario::start(&name(attack), 1, tamper);
        let endings = scenario.run(kind, 1, Duration::from_secs(60));
        let posted = scenario.proxy.posted();
        let victims: Vec<_> =
            posted.iter().filter(|(_, stages)| stages == &&[Stage::AdvertiseKeys]).collect();
        assert_eq!(victims.len(), 1, "{kind:?} {attack}: {posted:?}");
        assert!(
            endings.iter().any(|e| e.outcomes.first().is_some_and(|(o, _)| o == "abandoned")),
            "{kind:?} {attack}: {endings:?}"
        );
    }

    // The both-shares attack: the client told a different survivor list
    // signs it and reveals no unmasking share.
    let scenario = Scenario::start(&name("survivors"), 1, split_survivors());
    scenario.run(kind, 1, Duration::from_secs(60));
    let posted = scenario.proxy.posted();
    let target = split_target(&scenario.proxy, CLIENTS);
    assert_eq!(posted[&target], ALL_STAGES[..4], "{kind:?}: {posted:?}");
    drop(scenario);

    // A re-run of round 1 announced as round 2: every client refuses it
    // (rule replay) and sends nothing after round 1's five messages.
    let scenario = Scenario::start(&name("replay"), 2, replay_round_one());
    let endings = scenario.run(kind, 2, Duration::from_secs(90));
    for ending in &endings {
        assert_eq!(ending.error, None, "{kind:?}: {ending:?}");
        let outcomes: Vec<(&str, Option<&str>)> =
            ending.outcomes.iter().map(|(o, r)| (o.as_str(), r.as_deref())).collect();
        assert_eq!(outcomes, [("completed", None), ("refused", Some("replay"))], "{kind:?}: {ending:?}");
    }
    assert!(scenario.proxy.posted().values().all(|stages| stages == &ALL_STAGES), "{kind:?}");
}

#[test]
fn wasm_clients_refuse_every_attack_of_a_malicious_coordinator() {
    attacks(Kind::Wasm);
}

#[test]
fn jvm_clients_refuse_every_attack_of_a_malicious_coordinator() {
    attacks(Kind::Jvm);
}

#[test]
fn python_clients_refuse_every_attack_of_a_malicious_coordinator() {
    attacks(Kind::Python);
}
