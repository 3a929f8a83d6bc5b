//! Masked inputs longer than the coordinator reads whole are added into
//! the running sum as their bodies arrive: a real `cohort serve` process,
//! protocol clients over loopback, and uploads that break off half way
//! (the connection closes mid-body). What they added is taken back out,
//! the clients' retries are accepted, and the round's model is exactly the
//! mean of the whole inputs.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use cohort_crypto::testing::{ProtocolClient, weighted_mean};
use cohort_server::api::CreatedTask;
use cohort_tests::identity::Enrollment;
use cohort_tests::process::{http, json_call, stage_answer};
use cohort_tests::{AdminClient, Serve};
use serde_json::json;

const ADMIN: &str = "streaming-test-admin-token-0123456789";
const SECAGG: &str = "application/x-cohort-secagg";
/// Parameters: a masked input of well over 1 MiB at any width.
const DIM: usize = 600_000;

struct Device {
    credential: String,
    participant: ProtocolClient,
    /// Masked inputs still to break off before one is sent whole.
    breaks: usize,
}

impl Device {
    /// One check-in, fetch and answer; returns whether it answered.
    fn step(&mut self, port: u16, streamed: &mut usize) -> bool {
        let Some(reply) = stage_answer(port, &self.credential, &mut self.participant) else { return false };
        if reply.len() > 1 << 20 {
            *streamed += 1;
            for _ in 0..std::mem::take(&mut self.breaks) {
                break_off(port, &self.credential, &reply);
            }
        }
        let (status, body) = http(port, "POST", "/v1/round/message", Some(&self.credential), SECAGG, &reply);
        assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
        true
    }
}

/// Posts `reply` with its full length declared, sends a little more than
/// half of it, and closes the connection.
fn break_off(port: u16, credential: &str, reply: &[u8]) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "POST /v1/round/message HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {credential}\r\n\
         Content-Type: {SECAGG}\r\nContent-Length: {}\r\n\r\n",
        reply.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&reply[..reply.len() / 2 + 12_345]).unwrap();
    stream.flush().unwrap();
    // Let the server add what arrived before the connection goes.
    std::thread::sleep(Duration::from_millis(300));
    drop(stream);
}

#[test]
fn uploads_that_break_off_are_taken_back_out_and_the_round_is_the_mean_of_whole_inputs() {
    let database = std::env::temp_dir().join(format!("cohort-streaming-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&database);
    let server = Serve::start(0, &format!("sqlite://{}", database.display()), ADMIN, None);
    let port = server.port;
    let spec = json!({
        "name": "streaming",
        "rounds": 1,
        "clients_per_round": 4,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [DIM] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3 }
    });
    let CreatedTask { id: task, enrollment_token: token, .. } =
        AdminClient::new(port, ADMIN).create_task(&spec);
    let mut devices: Vec<Device> = (0..4u32)
        .map(|i| {
            let update = (0..DIM).map(|j| ((j * 7 + i as usize) % 13) as f32 * 0.01 - 0.06).collect();
            let participant = ProtocolClient::new(u64::from(i) + 40, update, i + 1);
            let path = format!("/v1/tasks/{task}/enroll");
            let (status, body) =
                json_call(port, "POST", &path, None, Some(participant.enrollment(&task, &token)));
            assert_eq!(status, 201, "{body}");
            // Two clients break off first: one once, one twice.
            let breaks = [1, 0, 2, 0][i as usize];
            Device { credential: body["credential"].as_str().unwrap().to_string(), participant, breaks }
        })
        .collect();

    let rounds = || AdminClient::new(port, ADMIN).rounds(&task);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut streamed = 0;
    while rounds().is_empty() {
        for device in devices.iter_mut() {
            device.step(port, &mut streamed);
        }
        assert!(Instant::now() < deadline, "the round did not complete");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(streamed, 4, "every masked input was long enough to be streamed");
    assert!(devices.iter().all(|d| d.breaks == 0));
    let round = &rounds()[0];
    assert_eq!(round.survivors, 4, "{round:?}");

    // The model is the mean of the four whole inputs: nothing of the
    // broken-off halves is left in the sum.
    let (status, bytes) =
        http(port, "GET", &format!("/admin/tasks/{task}/checkpoints/latest"), Some(ADMIN), "", &[]);
    assert_eq!(status, 200);
    let model = cohort_client::checkpoint::decode(&bytes).unwrap();
    let mean = weighted_mean(&devices.iter().map(|d| &d.participant).collect::<Vec<_>>());
    let worst = model.weights.iter().zip(&mean).map(|(w, m)| (w - m).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-3, "the model is off the mean by up to {worst}");
    drop(server);
    let _ = std::fs::remove_file(&database);
}
