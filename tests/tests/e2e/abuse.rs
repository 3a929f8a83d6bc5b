//! `cohort serve` under abuse, as a real process over loopback: thousands
//! of idle, half-sent and slow connections; more connections than its cap;
//! floods of reports and of oversized stage messages; inputs that overflow
//! or carry NUL on SQLite and PostgreSQL; a database that goes away; and
//! SIGTERM with a request half sent. Every loop here is bounded in count
//! and time, and all traffic stays on 127.0.0.1.
//!
//! The tests run one at a time (they measure latency and memory).
//! PostgreSQL is reached at `COHORT_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cohort_tests::postgres::{Relay, drop_postgres_database, postgres_database, postgres_port};
use cohort_tests::process::{closed_by, exchange, http, json_call, read_response};
use cohort_tests::{AdminClient, Serve};
use serde_json::{Value, json};

const ADMIN: &str = "abuse-test-admin-token-0123456789";
const SECAGG: &str = "application/x-cohort-secagg";

/// One test at a time: they hold thousands of sockets and measure time
/// and memory.
/// One at a time, and beside no other heavy scenario of the binary.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    cohort_tests::exclusive()
}

/// Short timeouts, so that the test sees them act.
fn short_timeouts() -> Value {
    json!({
        "header_timeout_ms": 2000,
        "idle_timeout_ms": 3000,
        "body_min_rate": 1024,
        "body_grace_ms": 2000,
        "shutdown_grace_ms": 3000
    })
}

fn small_task(clients_per_round: u32) -> Value {
    json!({
        "name": "abuse",
        "rounds": 5,
        "clients_per_round": clients_per_round,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [8] } ] } },
        // A majority: the active variant needs 2t > n − 1.
        "secure_aggregation": { "graph": "complete", "threshold": clients_per_round / 2 + 1 }
    })
}

fn create_task(port: u16, spec: Value) -> (String, String) {
    let created = AdminClient::new(port, ADMIN).create_task(&spec);
    (created.id, created.enrollment_token)
}

fn enroll(port: u16, task: &str, token: &str) -> String {
    let path = format!("/v1/tasks/{task}/enroll");
    let body = cohort_tests::identity::fresh_enrollment(task, token);
    let (status, body) = json_call(port, "POST", &path, None, Some(body));
    assert_eq!(status, 201, "{body}");
    body["credential"].as_str().unwrap().into()
}

/// Probes `/healthz` on a fresh connection every 20 ms until stopped;
/// returns the slowest answer and the number of probes.
struct HealthProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Duration, usize)>,
}

impl HealthProbe {
    fn start(port: u16) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut slowest, mut probes) = (Duration::ZERO, 0);
            while !flag.load(Ordering::SeqCst) {
                let started = Instant::now();
                let (status, body) = http(port, "GET", "/healthz", None, "text/plain", &[]);
                assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));
                slowest = slowest.max(started.elapsed());
                probes += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            (slowest, probes)
        });
        Self { stop, thread }
    }

    fn finish(self) -> (Duration, usize) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// Opens `count` connections and sends each `prefix` (possibly nothing).
fn open(port: u16, count: usize, prefix: &[u8]) -> Vec<TcpStream> {
    (0..count)
        .map(|_| {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            if !prefix.is_empty() {
                stream.write_all(prefix).unwrap();
            }
            stream
        })
        .collect()
}

#[test]
fn idle_half_sent_and_slow_connections_are_closed_while_health_holds() {
    let _serial = serial();
    let descriptors = cohort_server::api::listener::raise_descriptor_limit();
    assert!(descriptors >= 8192, "this test needs 8192 file descriptors, the limit is {descriptors}");
    // Every connection comes from 127.0.0.1: no per-address cap below the
    // global one.
    let mut config = short_timeouts();
    config["max_connections_per_address"] = json!(8192);
    let server = Serve::sqlite("abuse-connections", ADMIN, Some(&config));
    let port = server.port;
    let probe = HealthProbe::start(port);
    let started = Instant::now();

    // COHORT_ABUSE_IDLE raises the idle count for a larger measurement
    // (docs/BENCHMARKS.md); the total must stay under the connection cap.
    let idle_count: usize =
        std::env::var("COHORT_ABUSE_IDLE").ok().and_then(|n| n.parse().ok()).unwrap_or(2000);
    const HALF_HEADER: usize = 1000;
    const SLOW_BODY: usize = 500;
    let mut idle = open(port, idle_count, b"");
    let mut half = open(port, HALF_HEADER, b"POST /v1/checkin HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ");
    let slow_head = format!(
        "POST /v1/tasks/{}/enroll HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{{\"enrollment_token\": \"",
        "0".repeat(32)
    );
    let mut slow = open(port, SLOW_BODY, slow_head.as_bytes());
    let opened = started.elapsed();
    let (rss_held, _) = server.memory_kib();

    // Every one of them is closed within its timeout (plus scheduling
    // slack); the slow bodies get a 408 first.
    let deadline = Instant::now() + Duration::from_secs(10);
    for stream in idle.iter_mut().chain(half.iter_mut()) {
        assert!(closed_by(stream, deadline).is_some(), "an idle or half-sent connection stayed open");
    }
    for stream in &mut slow {
        let received = closed_by(stream, deadline).expect("a slow body's connection stayed open");
        let text = String::from_utf8_lossy(&received);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("request_timeout"), "{text}");
    }
    let all_closed = started.elapsed();
    drop((idle, half, slow));

    let (slowest, probes) = probe.finish();
    assert!(probes > 50, "only {probes} health probes");
    // Not a speed goal (docs/BENCHMARKS.md records the latency): a probe
    // queued behind the held connections would wait for their header
    // timeout (2 s), so any answer well inside it shows health was never
    // blocked by them, on a busy 2-core machine too.
    assert!(
        slowest < Duration::from_millis(1000),
        "/healthz took {slowest:?} at worst: it waited behind held connections"
    );

    // SIGTERM with a request half sent and idle connections open: the
    // process exits within the shutdown grace.
    let _idle = open(port, 500, b"");
    let mut pending = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // Enrollment reads its body: this request is in flight when the signal comes.
    let half_body = format!(
        "POST /v1/tasks/{}/enroll HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{{\"half",
        "0".repeat(32)
    );
    pending.write_all(half_body.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut server = server;
    let signalled = Instant::now();
    server.terminate();
    let exit = loop {
        if let Some(status) = server.exited() {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "cohort serve did not exit within 5 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let shutdown = signalled.elapsed();
    assert!(exit.success(), "{exit:?}");
    println!(
        "connections: {} held (opened in {opened:?}), all closed after {all_closed:?}; server RSS while held {:.1} MiB; \
         /healthz slowest {slowest:?} over {probes} probes; exit {shutdown:?} after SIGTERM",
        idle_count + HALF_HEADER + SLOW_BODY,
        rss_held as f64 / 1024.0
    );
}

#[test]
fn connections_over_the_cap_get_a_503_and_service_comes_back() {
    let _serial = serial();
    let mut config = short_timeouts();
    config["max_connections"] = json!(64);
    let server = Serve::sqlite("abuse-cap", ADMIN, Some(&config));
    let port = server.port;
    let held = open(port, 64, b"");
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        let mut extra = TcpStream::connect(("127.0.0.1", port)).unwrap();
        extra.write_all(b"GET /admin/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        extra.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let (status, head, body) = read_response(&mut extra);
        assert_eq!(status, 503, "{head}");
        assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"], "overloaded");
    }
    // The idle connections time out (they sent nothing: at the header
    // timeout); the server answers again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if read_response(&mut stream).0 == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the server did not come back after its idle connections closed");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(held);
    drop(server);
}

/// A connection to the server on 127.0.0.1:`port` from the loopback
/// address `source` (Linux answers on all of 127.0.0.0/8).
fn connect_from(source: [u8; 4], port: u16) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket.bind(&std::net::SocketAddr::from((source, 0)).into()).unwrap();
    socket.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into()).unwrap();
    socket.into()
}

/// `GET path` on a fresh connection from `source`: (status, head, body).
fn get_from(source: [u8; 4], port: u16, path: &str, token: Option<&str>) -> (u16, String, Vec<u8>) {
    let mut stream = connect_from(source, port);
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let head = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    read_response(&mut stream)
}

/// `POST path` with a JSON `body` on a fresh connection from `source`:
/// the status.
fn post_from(source: [u8; 4], port: u16, path: &str, body: &Value) -> u16 {
    let mut stream = connect_from(source, port);
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    read_response(&mut stream).0
}

/// `count` silent connections from `source`.
fn hold_from(source: [u8; 4], port: u16, count: usize) -> Vec<TcpStream> {
    (0..count).map(|_| connect_from(source, port)).collect()
}

/// Asserts that `(status, head, body)` is the canned refusal over a cap.
#[track_caller]
fn assert_overloaded((status, head, body): (u16, String, Vec<u8>)) {
    assert_eq!(status, 503, "{head}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"], "overloaded");
}

#[test]
fn one_address_is_refused_beyond_its_cap_while_another_is_served() {
    let _serial = serial();
    // Timeouts longer than the test: the held connections stay held.
    let config = json!({ "max_connections": 64, "max_connections_per_address": 8 });
    let server = Serve::sqlite("abuse-per-address", ADMIN, Some(&config));
    let port = server.port;
    let held = hold_from([127, 0, 0, 1], port, 8);
    // The listener counts the held connections as it accepts them, in
    // the background.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        assert_overloaded(get_from([127, 0, 0, 1], port, "/admin/tasks", Some(ADMIN)));
        let (status, head, _) = get_from([127, 0, 0, 2], port, "/admin/tasks", Some(ADMIN));
        assert_eq!(status, 200, "another address is served: {head}");
    }
    // The capped address's probes are still answered (from the reserve).
    let (status, _, body) = get_from([127, 0, 0, 1], port, "/healthz", None);
    assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));
    // A connection given back makes room for the address again.
    drop(held.into_iter().next());
    let deadline = Instant::now() + Duration::from_secs(5);
    while get_from([127, 0, 0, 1], port, "/admin/tasks", Some(ADMIN)).0 != 200 {
        assert!(Instant::now() < deadline, "the address was not served again after closing a connection");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(server);
}

/// The flood the old default per-token burst (5 000) let through: 5 000
/// enrollments with one task's token from three addresses, against the
/// server's default limits. The token admits its burst of 1 000, and what
/// its rate (ten a second) refills while the flood runs; the rest get
/// `429`.
#[test]
fn a_flood_of_enrollments_from_three_addresses_is_held_to_the_token_burst() {
    let _serial = serial();
    let server = Serve::sqlite("abuse-enroll-flood", ADMIN, None);
    let port = server.port;
    let (task, token) = create_task(port, small_task(4));
    let path = format!("/v1/tasks/{task}/enroll");
    let started = Instant::now();
    let mut statuses = std::collections::BTreeMap::new();
    for k in 0..5_000u32 {
        let source = [127, 0, 0, 1 + (k % 3) as u8];
        let status = post_from(source, port, &path, &cohort_tests::identity::fresh_enrollment(&task, &token));
        *statuses.entry(status).or_insert(0u32) += 1;
    }
    let refilled = (started.elapsed().as_secs_f64() * 10.0).ceil() as u32;
    let admitted = statuses.get(&201).copied().unwrap_or(0);
    println!("enrollment flood: 5000 from three addresses in {:?}: {statuses:?}", started.elapsed());
    assert!((1_000..=1_000 + refilled).contains(&admitted), "{statuses:?} ({refilled} refilled)");
    assert_eq!(statuses.get(&429).copied().unwrap_or(0), 5_000 - admitted, "{statuses:?}");
    drop(server);
}

#[test]
fn silent_connections_are_closed_at_the_header_timeout_not_the_idle_timeout() {
    let _serial = serial();
    let config = json!({ "header_timeout_ms": 1000, "idle_timeout_ms": 20000 });
    let server = Serve::sqlite("abuse-silent", ADMIN, Some(&config));
    let port = server.port;
    let started = Instant::now();
    let mut silent = open(port, 100, b"");
    let mut half = open(port, 20, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    let deadline = started + Duration::from_secs(5);
    let mut first_closed = None;
    for stream in &mut silent {
        let received = closed_by(stream, deadline).expect("a silent connection outlived the header timeout");
        assert!(received.is_empty(), "{}", String::from_utf8_lossy(&received));
        first_closed.get_or_insert_with(|| started.elapsed());
    }
    for stream in &mut half {
        assert!(closed_by(stream, deadline).is_some(), "half a request head outlived the header timeout");
    }
    let (first, last) = (first_closed.unwrap(), started.elapsed());
    assert!(first >= Duration::from_millis(900), "closed before the header timeout: {first:?}");
    // The server still serves.
    assert_eq!(http(port, "GET", "/healthz", None, "text/plain", &[]).0, 200);
    println!(
        "silent connections: 120 (100 silent, 20 half a head) closed {first:?} to {last:?} after they were opened (header timeout 1 s, idle timeout 20 s)"
    );
    drop(server);
}

#[test]
fn health_and_readiness_answer_while_the_connection_cap_is_full() {
    let _serial = serial();
    let config = json!({ "max_connections": 32, "max_connections_per_address": 16 });
    let server = Serve::sqlite("abuse-probes", ADMIN, Some(&config));
    let port = server.port;
    // Two addresses take the whole cap between them.
    let _held = [hold_from([127, 0, 0, 1], port, 16), hold_from([127, 0, 0, 2], port, 16)];
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..20 {
        // A third address, under its own cap, finds the global cap full...
        assert_overloaded(get_from([127, 0, 0, 3], port, "/admin/tasks", Some(ADMIN)));
        // ...but its probes, and the capped addresses' probes, are answered.
        for source in [[127, 0, 0, 3], [127, 0, 0, 1]] {
            let (status, _, body) = get_from(source, port, "/healthz", None);
            assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));
            let (status, head, body) = get_from(source, port, "/readyz", None);
            assert_eq!(status, 200, "{head}");
            let body: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body["status"], "ready");
        }
    }
    drop(server);
}

/// Sends a request head declaring `length` bytes of body and at most
/// `send` of them, then reads the answer: (status, body, bytes sent).
fn oversized(
    port: u16,
    path: &str,
    credential: &str,
    content_type: &str,
    length: u64,
    send: usize,
) -> (u16, Value, usize) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {credential}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    // The server answers (and closes) before taking the body: read while
    // writing, so that the answer is seen before the connection is reset.
    let mut reader = stream.try_clone().unwrap();
    let answer = std::thread::spawn(move || read_response(&mut reader));
    let chunk = vec![0u8; 1 << 16];
    let mut sent = 0;
    while sent < send && !answer.is_finished() {
        if stream.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    let _ = stream.shutdown(Shutdown::Write);
    let (status, _, body) = answer.join().unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null), sent)
}

#[test]
fn floods_of_reports_and_oversized_messages_are_refused_with_memory_bounded() {
    let _serial = serial();
    let server = Serve::sqlite("abuse-floods", ADMIN, None);
    let database = server.database_file().unwrap().to_path_buf();
    let port = server.port;
    // Twenty enrolled clients; no round starts (fifty are needed).
    let (task, token) = create_task(port, small_task(50));
    let credentials: Vec<String> = (0..20).map(|_| enroll(port, &task, &token)).collect();
    for credential in &credentials {
        assert_eq!(json_call(port, "POST", "/v1/checkin", Some(credential), None).0, 200);
    }
    let database_before = std::fs::metadata(&database).unwrap().len();
    let (rss_before, _) = server.memory_kib();

    // Four 200 MB stage messages at once from clients that are not
    // selected: refused before the body is read.
    let posts: Vec<_> = credentials[..4]
        .iter()
        .cloned()
        .map(|credential| {
            std::thread::spawn(move || {
                oversized(port, "/v1/round/message", &credential, SECAGG, 200_000_000, 200_000_000)
            })
        })
        .collect();
    for post in posts {
        let (status, body, sent) = post.join().unwrap();
        assert_eq!((status, body["error"].as_str()), (409, Some("not_selected")), "{body}");
        assert!(sent < 50_000_000, "{sent} bytes were taken before the refusal");
    }
    // A 1 MB metrics report: refused on its declared length.
    let (status, body, _) =
        oversized(port, "/v1/metrics", &credentials[4], "application/json", 1 << 20, 1 << 20);
    assert_eq!((status, body["error"].as_str()), (413, Some("payload_too_large")), "{body}");

    // Every client floods reports for rounds it never took part in, up
    // to round 2^62: refused (malformed, plaintext reports off, or rate
    // limited).
    let floods: Vec<_> = credentials
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, credential)| {
            std::thread::spawn(move || {
                let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
                for k in 0..100u64 {
                    let round = 1 + (k * 0x9e37_79b9 + i as u64) % (1 << 62);
                    let report =
                        json!({ "round": round, "kind": "train", "metrics": { "train_loss": 8.3e29 } });
                    *statuses
                        .entry(json_call(port, "POST", "/v1/metrics", Some(&credential), Some(report)).0)
                        .or_default() += 1;
                    let report = json!({ "round": round, "kind": "eval", "metrics": { "eval_loss": 0.5 } });
                    *statuses
                        .entry(json_call(port, "POST", "/v1/metrics", Some(&credential), Some(report)).0)
                        .or_default() += 1;
                }
                statuses
            })
        })
        .collect();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for flood in floods {
        for (status, count) in flood.join().unwrap() {
            *statuses.entry(status).or_default() += count;
        }
    }
    assert_eq!(statuses.values().sum::<usize>(), 4000);
    assert!(statuses.keys().all(|s| [400, 403, 409, 429].contains(s)), "{statuses:?}");
    assert!(statuses.get(&429).is_some_and(|n| *n > 3000), "the per-credential limit holds: {statuses:?}");

    let (rss_after, peak) = server.memory_kib();
    let database_after = std::fs::metadata(&database).unwrap().len();
    assert!(database_after <= database_before + (64 << 10), "{database_before} -> {database_after} bytes");
    assert!(peak < rss_before + 64 * 1024, "peak RSS {peak} KiB against {rss_before} KiB before the floods");
    println!(
        "floods: 4 × 200 MB stage posts and 4000 reports refused ({statuses:?}); RSS {:.1} -> {:.1} MiB, \
         peak {:.1} MiB; database {database_before} -> {database_after} bytes",
        rss_before as f64 / 1024.0,
        rss_after as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    drop(server);
}

/// Overflowing and NUL-carrying inputs against one running server.
fn refuses_overflow_and_nul(port: u16) {
    let mut spec = small_task(4);
    spec["deadlines"] = json!({ "advertise_keys_ms": i64::MAX });
    let (status, body) = json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec));
    assert_eq!((status, body["error"].as_str()), (400, Some("invalid_task")), "{body}");
    let mut spec = small_task(4);
    spec["rounds"] = json!(u32::MAX);
    assert_eq!(json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec)).0, 400);
    let mut spec = small_task(4);
    spec["name"] = json!("a\u{0}b");
    let (status, body) = json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec));
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].as_str().unwrap().contains("control characters"), "{body}");
    // About the largest layout the protocol takes (room left for the
    // example count and the metrics) is over the parameter cap: refused
    // before anything is allocated.
    let mut spec = small_task(4);
    spec["model"]["layout"]["tensors"][0]["shape"] = json!([(1u64 << 27) - 64]);
    let (status, body) = json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec));
    assert_eq!((status, body["error"].as_str()), (422, Some("capacity_exceeded")), "{body}");

    // A shape whose element count wraps around 64 bits is too large, not small.
    let mut spec = small_task(4);
    spec["model"]["layout"]["tensors"][0]["shape"] = json!([(1u64 << 62) + 1, 4]);
    let (status, body) = json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec));
    assert_eq!((status, body["error"].as_str()), (400, Some("invalid_task")), "{body}");

    // A τ whose square is infinite in f32 (schema-valid before it was
    // bounded) is refused, and nothing of it is stored.
    let tasks_before = json_call(port, "GET", "/admin/tasks", Some(ADMIN), None).1;
    for kind in ["fedadam", "fedyogi"] {
        let mut spec = small_task(4);
        spec["optimizer"] =
            json!({ "kind": kind, "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 2e19 });
        let (status, body) = json_call(port, "POST", "/admin/tasks", Some(ADMIN), Some(spec));
        assert_eq!((status, body["error"].as_str()), (400, Some("invalid_task")), "{body}");
    }
    // A key named twice is refused, whichever value comes last.
    let twice = br#"{"name": "abuse", "rounds": 5, "clients_per_round": 4,
        "model": {"architecture": "linear", "layout": {"tensors": [{"name": "w", "shape": [8]}]}},
        "secure_aggregation": {"graph": "complete", "threshold": 3, "variant": "semi-honest", "variant": "active"}}"#;
    let (status, body) = http(port, "POST", "/admin/tasks", Some(ADMIN), "application/json", twice);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, body["error"].as_str()), (400, Some("invalid_json")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("duplicate key `variant`"), "{body}");
    assert_eq!(json_call(port, "GET", "/admin/tasks", Some(ADMIN), None).1, tasks_before);

    let (task, token) = create_task(port, small_task(4));
    let enroll = format!("/v1/tasks/{task}/enroll");
    let twice = format!(r#"{{"enrollment_token": "{}", "enrollment_token": "{token}"}}"#, "0".repeat(64));
    let (status, body) = http(port, "POST", &enroll, None, "application/json", twice.as_bytes());
    assert_eq!(status, 400, "a wrong then a right token: {}", String::from_utf8_lossy(&body));
    for path in [
        "/admin/tasks/%00".to_string(),
        format!("/admin/tasks/{}%00", &task[..31]),
        "/admin/tasks/%00/rounds".to_string(),
        "/admin/tasks/x%00y/checkpoints/latest".to_string(),
    ] {
        let (status, body) = json_call(port, "GET", &path, Some(ADMIN), None);
        assert_eq!((status, body["error"].as_str()), (404, Some("not_found")), "{path}: {body}");
    }
    let (status, body) =
        json_call(port, "POST", "/v1/tasks/%00/enroll", None, Some(json!({ "enrollment_token": token })));
    assert_eq!((status, body["error"].as_str()), (404, Some("not_found")), "{body}");
    let (status, body) = json_call(
        port,
        "POST",
        &format!("/v1/tasks/{task}/enroll"),
        None,
        Some(json!({ "enrollment_token": "a\u{0}" })),
    );
    assert_eq!(status, 401, "{body}");
    assert_eq!(json_call(port, "GET", "/readyz", None, None).0, 200);
}

#[test]
fn overflow_and_nul_inputs_are_refused_on_sqlite_and_postgresql() {
    let _serial = serial();
    let server = Serve::sqlite("abuse-inputs", ADMIN, None);
    refuses_overflow_and_nul(server.port);
    drop(server);

    let (url, admin) = postgres_database("inputs");
    // A URL that names no user takes PGUSER, as libpq does (when the test
    // database's URL names a user without a password).
    let (scheme, rest) = url.split_once("://").unwrap();
    let server = match rest.split_once('@') {
        Some((user, place)) if !user.contains(':') => {
            Serve::options(ADMIN).database(&format!("{scheme}://{place}")).env("PGUSER", user).start()
        }
        _ => Serve::start(0, &url, ADMIN, None),
    };
    refuses_overflow_and_nul(server.port);
    drop(server);
    drop_postgres_database(&url, &admin);
}

#[test]
fn a_database_outage_fails_requests_fast_with_503_and_readiness_reports_it() {
    let _serial = serial();
    let (url, admin) = postgres_database("outage");
    let upstream = postgres_port(&url);
    let mut relay = Relay::start(0, upstream);
    let relayed = relay.url_for(&url);
    let server = Serve::start(0, &relayed, ADMIN, None);
    let port = server.port;
    let (task, token) = create_task(port, small_task(4));
    let credential = enroll(port, &task, &token);
    let (status, body) = json_call(port, "GET", "/readyz", None, None);
    assert_eq!((status, body["status"].as_str()), (200, Some("ready")));

    relay.cut();
    let mut slowest = Duration::ZERO;
    for (method, path, token) in
        [("POST", "/v1/checkin", Some(credential.as_str())), ("GET", "/admin/tasks", Some(ADMIN))]
    {
        let started = Instant::now();
        let (status, head, body) = exchange(port, method, path, token, "application/json", &[]);
        slowest = slowest.max(started.elapsed());
        assert_eq!(status, 503, "{method} {path}: {}", String::from_utf8_lossy(&body));
        assert!(head.to_ascii_lowercase().contains("retry-after: 5"), "{head}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"], "unavailable");
    }
    assert!(slowest < Duration::from_secs(5), "a request took {slowest:?} during the outage");
    let (status, body) = json_call(port, "GET", "/readyz", None, None);
    assert_eq!((status, body["database"].as_str()), (503, Some("unreachable")), "{body}");
    assert_eq!(http(port, "GET", "/healthz", None, "text/plain", &[]).0, 200, "liveness is not readiness");

    // The database comes back (on the same address): so does the service.
    let relay = Relay::start(relay.port, upstream);
    let deadline = Instant::now() + Duration::from_secs(15);
    while json_call(port, "GET", "/readyz", None, None).0 != 200 {
        assert!(Instant::now() < deadline, "readiness did not recover");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The replica gave its task up when it could not renew the lease; it
    // takes it back at its next renewal, and until then a participant is
    // told to come back (as it would be while another replica takes over).
    let recovered = Instant::now();
    let (status, body) = loop {
        let (status, body) = json_call(port, "POST", "/v1/checkin", Some(&credential), None);
        if status != 503 {
            break (status, body);
        }
        assert!(body["retry_after_ms"].as_u64().is_some_and(|ms| ms <= 5_000), "{body}");
        assert!(recovered.elapsed() < Duration::from_secs(10), "the task was not taken back: {body}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!((status, body["status"].as_str()), (200, Some("wait")), "{body}");
    println!(
        "database outage: requests answered 503 within {slowest:?}; the task was led again {:?} after readiness",
        recovered.elapsed()
    );
    drop(server);
    drop(relay);
    drop_postgres_database(&url, &admin);
}

/// An admin event stream on `path`: the connection, its request sent.
fn open_stream(port: u16, path: &str) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN}\r\n\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// Reads `stream` until `needle` has come (within 30 s); what it read.
fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    use std::io::Read;
    // A deadline for the whole read, not each read: a stream's keep-alive
    // comments (every 15 s) would otherwise keep a stream that never sends
    // the needle waiting for ever.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    let mut buffer = [0u8; 16 << 10];
    while !String::from_utf8_lossy(&seen).contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no {needle:?} within 30 s; the stream sent: {}",
            String::from_utf8_lossy(&seen)
        );
        stream.set_read_timeout(Some(left)).unwrap();
        let n = stream.read(&mut buffer).unwrap_or_else(|e| {
            panic!("{e}: no {needle:?}; the stream sent: {}", String::from_utf8_lossy(&seen))
        });
        assert!(n > 0, "the stream ended before {needle:?}: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buffer[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// A mebibyte in the KiB that /proc reports.
const MIB: u64 = 1024;

#[test]
fn admin_event_streams_share_their_snapshots_and_give_their_memory_back() {
    let _serial = serial();
    const STREAMS: usize = 2000;
    let descriptors = cohort_server::api::listener::raise_descriptor_limit();
    assert!(descriptors >= 4096, "this test needs 4096 file descriptors, the limit is {descriptors}");
    // All streams come from 127.0.0.1, and the cap is raised to measure 2 000.
    let config = json!({ "max_admin_streams": STREAMS, "max_connections_per_address": 8192 });
    let server = Serve::sqlite("abuse-streams", ADMIN, Some(&config));
    let port = server.port;
    let (task, token) = create_task(port, small_task(4));
    let paths = [format!("/admin/tasks/{task}/events"), "/admin/events".to_string()];
    let first_event = ["event: tokens", "event: tasks"];
    // A warm-up: what the first streams allocate once (the runtime's
    // worker buffers, the store's statements) is not what streams hold.
    for _ in 0..2 {
        let mut warm: Vec<TcpStream> = (0..100).map(|i| open_stream(port, &paths[i % 2])).collect();
        for (i, stream) in warm.iter_mut().enumerate() {
            read_until(stream, first_event[i % 2]);
        }
        drop(warm);
        // The server gives their places back as it sees them close.
        std::thread::sleep(Duration::from_secs(3));
    }
    let (before, _) = server.memory_kib();

    // Half of them follow the task, half the list; half of each read
    // their first events, the other half never read a byte.
    let started = Instant::now();
    let mut streams: Vec<TcpStream> = (0..STREAMS).map(|i| open_stream(port, &paths[i % 2])).collect();
    for (i, stream) in streams.iter_mut().enumerate() {
        if (i / 2) % 2 == 0 {
            read_until(stream, first_event[i % 2]);
        }
    }
    let opened = started.elapsed();
    // One more is refused: every one of them is open, and the cap holds.
    // Read within a deadline: were it admitted, its stream would never end.
    let mut extra = open_stream(port, "/admin/events");
    let answer = read_until(&mut extra, "\"error\":\"rate_limited\"");
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 5"), "{answer}");
    drop(extra);
    // The task changes while they are open: the readers see it.
    enroll(port, &task, &token);
    for stream in streams.iter_mut().step_by(4).take(50) {
        read_until(stream, "\"enrolled\":1");
    }
    // Past a reread (5 s), so that every producer has read again.
    std::thread::sleep(Duration::from_secs(6));
    let (open, peak) = server.memory_kib();

    drop(streams);
    // The server notices each closed connection and drops its stream.
    let closed = Instant::now();
    let after = loop {
        std::thread::sleep(Duration::from_millis(500));
        let (now, _) = server.memory_kib();
        if now <= before + 20 * MIB || closed.elapsed() > Duration::from_secs(15) {
            break now;
        }
    };
    let settled = closed.elapsed();
    // And streams open again up to the cap.
    let mut again = open_stream(port, &paths[0]);
    read_until(&mut again, first_event[0]);
    drop(again);
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "admin streams: {STREAMS} open in {opened:?} (half the task's, half the list's; half never read); \
         server RSS {:.1} MiB before, {:.1} MiB open (+{:.1} MiB, {:.1} KiB a stream), peak {:.1} MiB, \
         {:.1} MiB {settled:?} after they closed",
        mib(before),
        mib(open),
        mib(open.saturating_sub(before)),
        open.saturating_sub(before) as f64 / STREAMS as f64,
        mib(peak),
        mib(after)
    );
    // The bounds are 60 and 20 MiB, as /proc reports RSS (in KiB); the
    // streams take 44 to 48 MiB on one kind of machine this runs on and 51
    // to 54 MiB on another, most of it hyper's two 8 KiB buffers per
    // connection (docs/BENCHMARKS.md, "Under abuse").
    assert!(open <= before + 60 * MIB, "{STREAMS} streams took {:.1} MiB", mib(open - before));
    assert!(
        after <= before + 20 * MIB,
        "{:.1} MiB stayed in use after the streams closed",
        mib(after - before)
    );
    drop(server);
}
