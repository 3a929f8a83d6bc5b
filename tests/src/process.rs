//! `cohort serve` as a real process, and one-shot HTTP/1.1 exchanges with
//! it over plain TCP: for tests that kill, signal or measure the server.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
    try_exchange(port, method, path, token, content_type, body)
        .unwrap_or_else(|| panic!("no HTTP response to {method} {path}"))
}

/// [`exchange`], or `None` when the connection closed without a response
/// (a replica killed mid-request, a balancer cutting a marked-down
/// server's sessions): what a client retries.
pub fn try_exchange(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: &str,
    body: &[u8],
) -> Option<(u16, String, Vec<u8>)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
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
    try_json_call(port, method, path, token, body)
        .unwrap_or_else(|| panic!("no HTTP response to {method} {path}"))
}

/// [`json_call`], or `None` when the connection closed without a response
/// (see [`try_exchange`]).
pub fn try_json_call(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Option<(u16, Value)> {
    let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
    let (status, _, body) = try_exchange(port, method, path, token, "application/json", &bytes)?;
    Some((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// A `cohort serve` process; killed on drop.
pub struct ServeProcess {
    pub child: Child,
    pub port: u16,
    config: Option<PathBuf>,
}

impl ServeProcess {
    /// Starts `cohort serve` on `port` (0: any free port) over
    /// `database_url`, with `config` as its settings file if given, and
    /// waits for it to say where it listens: a server that could not bind
    /// fails here, rather than the test talking to whatever holds the port.
    pub fn start(port: u16, database_url: &str, admin_token: &str, config: Option<&Value>) -> Self {
        Self::start_with_env(port, database_url, admin_token, config, &[])
    }

    /// [`ServeProcess::start`] with `env` set for the process.
    pub fn start_with_env(
        port: u16,
        database_url: &str,
        admin_token: &str,
        config: Option<&Value>,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn(port, database_url, admin_token, config, env, Stdio::null())
    }

    /// [`ServeProcess::start`] with its log (stderr) written to `log` at
    /// the levels `filter` sets (`RUST_LOG` syntax).
    pub fn start_logged(port: u16, database_url: &str, admin_token: &str, log: &Path, filter: &str) -> Self {
        let file = std::fs::File::create(log).unwrap();
        Self::spawn(port, database_url, admin_token, None, &[("RUST_LOG", filter)], Stdio::from(file))
    }

    fn spawn(
        port: u16,
        database_url: &str,
        admin_token: &str,
        config: Option<&Value>,
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Self {
        let config = config.map(|settings| {
            let path = std::env::temp_dir().join(format!(
                "cohort-serve-{}-{}.json",
                std::process::id(),
                rand_suffix()
            ));
            std::fs::write(&path, settings.to_string()).unwrap();
            path
        });
        let mut command = Command::new(&crate::artifacts().cohort);
        command
            .args(["serve", "--bind", &format!("127.0.0.1:{port}"), "--database-url", database_url])
            .env("COHORT_ADMIN_TOKEN", admin_token)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .envs(env.iter().copied());
        if let Some(path) = &config {
            command.arg("--config").arg(path);
        }
        let mut child = command.spawn().unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let listening = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|line| {
                line.split_once("listening on http://127.0.0.1:").map(|(_, p)| p.trim().to_string())
            })
            .unwrap_or_else(|| panic!("cohort serve did not start on port {port}: {:?}", child.wait()));
        // Keep draining, so that the server never writes into a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, port: listening.parse().unwrap(), config }
    }

    /// A SQLite-backed server on a fresh file named after `name`.
    pub fn sqlite(name: &str, admin_token: &str, config: Option<&Value>) -> (Self, PathBuf) {
        let database = std::env::temp_dir().join(format!("cohort-{name}-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&database);
        (Self::start(0, &format!("sqlite://{}", database.display()), admin_token, config), database)
    }

    /// Kills the process (SIGKILL: no graceful shutdown, like a crash).
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (`TERM`, `STOP`, `CONT`, ...).
    pub fn signal(&self, name: &str) {
        let status =
            Command::new("kill").args([&format!("-{name}"), &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill -{name}");
    }

    /// Resident memory now and at its peak, in KiB (from /proc).
    pub fn memory_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(path) = &self.config {
            let _ = std::fs::remove_file(path);
        }
    }
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
