//! One-shot HTTP/1.1 exchanges with a coordinator over plain TCP, for tests
//! that send what a client library would not (see [`crate::Serve`] for the
//! coordinator itself).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

/// One HTTP/1.1 exchange over a fresh connection: (status, body).
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let (status, _, body) = exchange(port, method, path, token, content_type, body);
    (status, body)
}

/// One HTTP/1.1 exchange over a fresh connection: (status, head, body).
pub fn exchange(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: &str,
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    try_exchange(port, method, path, token, content_type, &[], body)
        .unwrap_or_else(|| panic!("no HTTP response to {method} {path}"))
}

/// [`exchange`] with `headers` added to the request, or `None` when the
/// connection closed without a response (a replica killed mid-request, a
/// balancer cutting a marked-down server's sessions): what a client
/// retries.
pub fn try_exchange(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<(u16, String, Vec<u8>)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let extra: String = headers.iter().map(|(name, value)| format!("{name}: {value}\r\n")).collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}{extra}Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).ok()?;
    stream.write_all(body).ok()?;
    try_read_response(&mut stream)
}

/// Reads a whole response from a connection the server closes after it.
pub fn read_response(stream: &mut TcpStream) -> (u16, String, Vec<u8>) {
    try_read_response(stream).unwrap_or_else(|| panic!("no HTTP response"))
}

/// [`read_response`], or `None` when the connection closed without one.
pub fn try_read_response(stream: &mut TcpStream) -> Option<(u16, String, Vec<u8>)> {
    let mut response = Vec::new();
    // A reset after a complete response (the server refused an unread
    // body) still leaves the response readable.
    let _ = stream.read_to_end(&mut response);
    let split = response.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&response[..split]).to_string();
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let mut body = response[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Some((status, head, body))
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&data[..line_end]).unwrap().trim(), 16).unwrap();
        data = &data[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// Whether the server has closed `stream` (after answering, if it did)
/// by `deadline`; returns what it sent before closing.
pub fn closed_by(stream: &mut TcpStream, deadline: std::time::Instant) -> Option<Vec<u8>> {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let left =
            deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buffer) {
            Ok(0) => return Some(received),
            Ok(n) => received.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(received),
            Err(_) => return None,
        }
    }
}

/// A JSON exchange: (status, parsed body or null).
pub fn json_call(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
    let (status, _, body) = exchange(port, method, path, token, "application/json", &bytes);
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Removes a SQLite database file and its journal files.
pub fn remove_database(path: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// One check-in and fetch of a protocol client over HTTP: its answer to
/// the stage message it was served (to post to `/v1/round/message`), or
/// `None` when it was not selected or had nothing to answer.
pub fn stage_answer(
    port: u16,
    credential: &str,
    participant: &mut cohort_crypto::testing::ProtocolClient,
) -> Option<Vec<u8>> {
    let (_, body) = json_call(port, "POST", "/v1/checkin", Some(credential), None);
    if body["status"] != "selected" {
        return None;
    }
    let client_id = body["client_id"].as_u64()? as u32;
    let (status, message) =
        http(port, "GET", "/v1/round/message", Some(credential), "application/x-cohort-secagg", &[]);
    (status == 200).then(|| participant.respond(client_id, &message))
}
