//! Runs the real `cohort bench secagg` binary and checks its report.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use serde_json::Value;

fn bench(args: &[&str]) -> (bool, Value, String) {
    let output = Command::new(&cohort_tests::artifacts().cohort)
        .args(["bench", "secagg", "--json"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    let report = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    (output.status.success(), report, stderr)
}

#[test]
fn sparse_round_with_dropouts_reports_a_correct_aggregate() {
    let (ok, report, stderr) = bench(&["--clients", "60", "--dim", "2000", "--dropout", "0.2"]);
    assert!(ok, "{stderr}");
    assert_eq!(report["correct"], true);
    assert_eq!(report["clients"], 60);
    assert_eq!(report["dim"], 2000);
    assert_eq!(report["survivors"], 48);
    assert_eq!(report["graph"], "sparse");
    let k = report["k"].as_u64().unwrap();
    let t = report["t"].as_u64().unwrap();
    assert!(k < 59 && k % 2 == 0 && t >= 1 && t <= k, "k = {k}, t = {t}");
    // A survivor with no dropped neighbours before ShareKeys uploads exactly:
    // AdvertiseKeys 133 bytes (keys and the seed commitment), ShareKeys
    // 45 + 156k (a byte says it carries no norm proof, four count no noise
    // commitments), MaskedInput 41 + 4(dim + 1), Unmasking 44 + 72(k + 1):
    // a share per neighbour and its own seed share (see
    // crypto/src/messages.rs).
    let up = report["bytes_up_per_client"].as_f64().unwrap();
    assert_eq!(up, (263 + 72 + 4 * 2001 + 228 * k) as f64);
    let expansion = report["expansion"].as_f64().unwrap();
    assert!((expansion - up / 8000.0).abs() < 1e-9);
    for key in
        ["client_ms_mean", "client_ms_max", "server_ms", "total_ms", "bytes_down_per_client", "inputs_ms"]
    {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key}");
    }
    // Without --bound, OpenSSL is not run and no bound is reported.
    for key in ["openssl_ctr_rate", "keystream_bound_ms", "client_bound_ms"] {
        assert!(report.get(key).is_none(), "{key}");
    }
}

/// `--validate l2`: every client proves its input, the server verifies the
/// proofs and the sum against the commitments, and the report says what it
/// cost (docs/BENCHMARKS.md, input validation).
#[test]
fn a_validated_round_reports_what_its_proofs_cost() {
    let (ok, report, stderr) =
        bench(&["--clients", "12", "--dim", "3000", "--bits", "8", "--dropout", "0.1", "--validate", "l2"]);
    assert!(ok, "{stderr}");
    assert_eq!(report["correct"], true);
    assert_eq!(report["survivors"], 11);
    for key in ["prove_ms_mean", "verify_ms_per_client", "proof_bytes_per_client", "proof_fraction"] {
        assert!(report[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {report}");
    }
    // Without --validate these are not reported.
    let (ok, plain, stderr) = bench(&["--clients", "12", "--dim", "3000", "--bits", "8"]);
    assert!(ok, "{stderr}");
    assert!(plain.get("prove_ms_mean").is_none() && plain.get("proof_bytes_per_client").is_none(), "{plain}");
    // Under privacy (Skellam): the noise is drawn on verified edges, and the
    // sum less the inputs has the mechanism's variance.
    let (ok, private, stderr) =
        bench(&["--clients", "12", "--dim", "2000", "--validate", "l2", "--dp-noise-multiplier", "1"]);
    assert!(ok, "{stderr}");
    assert_eq!(private["correct"], true, "{private}");
    let ratio = private["noise_variance_ratio"].as_f64().unwrap();
    assert!((ratio - 1.0).abs() < 0.19, "{private}");
    assert!(private["noise_edges_ms"].as_f64().unwrap() > 0.0, "{private}");
    assert_eq!(private["modulus_bits"], 20, "{private}");
}

#[test]
fn the_bound_is_the_servers_key_stream_at_openssls_rate() {
    let args = ["--clients", "25", "--dim", "300", "--graph", "complete", "--dropout", "0.2", "--bound"];
    let (ok, report, stderr) = bench(&args);
    assert!(ok, "{stderr}");
    assert_eq!(report["correct"], true);
    // 20 survivors' self masks, and each of the 5 dropped clients' pairwise
    // masks with the 20 survivors: 120 key streams of 301 words (the update
    // and the example count).
    let keystream = report["server_keystream_bytes"].as_f64().unwrap();
    assert_eq!(keystream, (120 * 301 * 4) as f64);
    let rate = report["openssl_ctr_rate"].as_f64().unwrap();
    assert!(rate > 1e8, "OpenSSL's AES-128-CTR at {rate} B/s");
    let bound = report["keystream_bound_ms"].as_f64().unwrap();
    assert!((bound - keystream / rate * 1e3).abs() < 1e-9, "{bound}");
    assert!(report["client_bound_ms"].as_f64().unwrap() > 0.0);
    let unmasking = report["unmasking_ms"].as_f64().unwrap();
    assert!(unmasking > 0.0 && unmasking <= report["server_ms"].as_f64().unwrap());
}

#[test]
fn overridden_parameters_and_the_active_variant_are_honoured() {
    let args = [
        "--clients",
        "30",
        "--dim",
        "500",
        "--dropout",
        "0.1",
        "--k",
        "12",
        "--t",
        "7",
        "--variant",
        "active",
    ];
    let (ok, report, stderr) = bench(&args);
    assert!(ok, "{stderr}");
    assert_eq!(report["correct"], true);
    assert_eq!((report["k"].as_u64(), report["t"].as_u64()), (Some(12), Some(7)));
    assert_eq!(report["variant"], "active");
    assert_eq!(report["survivors"], 27);
}

/// A smoke test of the command's complete-graph path: `correct` is the
/// tool's own check of its sum (crypto/tests check sums directly).
#[test]
fn the_bench_runs_a_complete_graph_round_with_dropouts() {
    let (ok, report, stderr) =
        bench(&["--clients", "25", "--dim", "300", "--graph", "complete", "--dropout", "0.2"]);
    assert!(ok, "{stderr}");
    assert_eq!(report["graph"], "complete");
    assert_eq!(report["k"], 24);
    assert_eq!(report["correct"], true);
}

#[test]
fn invalid_arguments_fail_with_a_clear_message() {
    let (ok, _, stderr) = bench(&["--dropout", "1.5"]);
    assert!(!ok);
    assert!(stderr.contains("--dropout must be in [0, 1)"), "{stderr}");
    let (ok, _, stderr) = bench(&["--clients", "30", "--k", "7", "--t", "3"]);
    assert!(!ok);
    assert!(stderr.contains("graph degree 7 is invalid"), "{stderr}");
    let (ok, _, stderr) = bench(&["--clients", "30", "--k", "10"]);
    assert!(!ok);
    assert!(stderr.contains("--k needs --t"), "{stderr}");
}

/// `--bits` packs the masked input to bits + ⌈log₂ n⌉ bits per coordinate
/// (plus the weight's digits), or to the bits alone in a fitted ring;
/// `--rotate` keeps the length and the result.
#[test]
fn bits_shrink_the_upload_exactly_and_rotation_keeps_the_sum() {
    let base = ["--clients", "20", "--dim", "4000", "--graph", "complete", "--t", "11"];
    let (ok, full, stderr) = bench(&base);
    assert!(ok, "{stderr}");
    // A fitted ring keeps the ring at the bits whatever the clients.
    let fitted = ["--bits", "9", "--rotate", "--ring", "fitted"];
    for (extra, ring) in [
        (&["--bits", "8"][..], 13u64),
        (&["--bits", "8", "--rotate"][..], 13),
        (&["--bits", "4"][..], 9),
        (&fitted[..], 9),
    ] {
        let (ok, report, stderr) = bench(&[&base[..], extra].concat());
        assert!(ok, "{extra:?}: {stderr}");
        assert_eq!(report["correct"], true, "{extra:?}");
        assert_eq!(report["modulus_bits"], ring, "{extra:?}");
        // Only the masked input shrinks: 4 bytes per coordinate become
        // ring / 8, and a small ring carries the weight in more digits.
        let saved =
            full["bytes_up_per_client"].as_f64().unwrap() - report["bytes_up_per_client"].as_f64().unwrap();
        // The bench's weights go up to 4096; a digit holds 0..=L, L = ⌊(2^ring − 1) / 20⌋.
        let base = ((1u64 << ring) - 1) / 20 + 1;
        let digits = (1..).find(|d| base.pow(*d) > 4096).unwrap() as f64;
        let packed = ((4000.0 + digits) * ring as f64 / 8.0).ceil();
        assert_eq!(saved, 4.0 * 4001.0 - packed, "{extra:?}");
    }
}

/// `cohort bench load` drives real HTTP clients against a real `cohort
/// serve` process and reports what the issue asks for.
#[test]
fn the_load_bench_reports_rounds_latencies_and_server_memory() {
    let output = Command::new(&cohort_tests::artifacts().cohort)
        .args(["bench", "load", "--clients", "12", "--dim", "2000", "--rounds", "2", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!((report["clients"].as_u64(), report["dim"].as_u64()), (Some(12), Some(2000)));
    assert_eq!(report["survivors"], serde_json::json!([12, 12]));
    let round_seconds = report["round_seconds"].as_f64().unwrap();
    assert!(round_seconds > 0.0 && round_seconds < 60.0, "{round_seconds}");
    let (p50, p99) = (report["p50_ms"].as_f64().unwrap(), report["p99_ms"].as_f64().unwrap());
    assert!(p50 > 0.0 && p50 <= p99, "{p50} {p99}");
    for stage in ["advertise_keys", "share_keys", "masked_input", "unmasking"] {
        // Every client uploads once per stage and round.
        assert_eq!(report["stages"][stage]["requests"], 24, "{stage}");
    }
    let rss = report["server_peak_rss_bytes"].as_u64().unwrap();
    assert!(rss > 1 << 20 && rss < 1 << 31, "{rss}");
    // The server did the rounds' work: some CPU time, and per client and
    // round the total over the 24.
    let cpu = report["server_cpu_seconds"].as_f64().unwrap();
    assert!(cpu > 0.0, "{report}");
    let per = report["server_cpu_ms_per_client_round"].as_f64().unwrap();
    assert!((per * 24.0 - cpu * 1e3).abs() < 1e-6, "{report}");
    assert_eq!(report["group_size"], 12, "one group unless asked");
    // The clients ran below the server's priority (any user may lower its own).
    assert_eq!(report["clients_nice"], 19, "{report}");

    // The same clients in two groups of six: every input still counted.
    let output = Command::new(&cohort_tests::artifacts().cohort)
        .args([
            "bench",
            "load",
            "--clients",
            "12",
            "--group-size",
            "6",
            "--dim",
            "500",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!((report["group_size"].as_u64(), &report["survivors"]), (Some(6), &serde_json::json!([12])));
}

/// `cohort bench load --replicas 2` starts two replicas on one PostgreSQL
/// database behind HAProxy and reports what each process used; replicas
/// on SQLite are refused.
#[test]
fn the_load_bench_runs_replicas_behind_the_balancer_and_reports_each() {
    let (url, admin) = cohort_tests::postgres::postgres_database("bench_replicas");
    let output = Command::new(&cohort_tests::artifacts().cohort)
        .args(["bench", "load", "--clients", "8", "--dim", "300", "--rounds", "2", "--replicas", "2"])
        .args(["--database-url", &url, "--json"])
        .output()
        .unwrap();
    cohort_tests::postgres::drop_postgres_database(&url, &admin);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["survivors"], serde_json::json!([8, 8]), "{report}");
    let replicas = report["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{report}");
    // One of them led the task; each process's CPU time and peak memory
    // are read, and the total is theirs.
    assert_eq!(replicas.iter().filter(|r| r["leader"] == true).count(), 1, "{report}");
    assert_ne!(replicas[0]["url"], replicas[1]["url"]);
    for replica in replicas {
        assert!(replica["cpu_seconds"].as_f64().unwrap() > 0.0, "{report}");
        assert!(replica["peak_rss_bytes"].as_u64().unwrap() > 1 << 20, "{report}");
    }
    let total: f64 = replicas.iter().map(|r| r["cpu_seconds"].as_f64().unwrap()).sum();
    assert!((report["server_cpu_seconds"].as_f64().unwrap() - total).abs() < 1e-9, "{report}");
    assert!(report["balancer_cpu_seconds"].as_f64().is_some(), "{report}");

    let output = Command::new(&cohort_tests::artifacts().cohort)
        .args(["bench", "load", "--clients", "8", "--replicas", "2"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("replicas share one PostgreSQL database"), "{stderr}");
}
