//! Support for the end-to-end tests in `tests/tests/`: they build the real
//! artifacts (the `cohort` binary, the mobile library) with a nested cargo
//! call, run `cohort serve` as a process, and drive it over HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cohort_client::participant::{Method, Request};
use cohort_client::runtime::Transport;
use cohort_client::runtime::http::HttpTransport;
use serde_json::Value;

/// The built artifacts the tests run.
#[derive(Debug)]
pub struct Artifacts {
    /// The `cohort` executable.
    pub cohort: PathBuf,
    /// `libcohort_mobile.so` (or the platform's shared library).
    pub mobile_shared: PathBuf,
    /// `libcohort_mobile.a`.
    pub mobile_static: PathBuf,
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Builds (once per test process) the `cohort` binary and the mobile
/// library with the test profile, in the same target directory.
pub fn artifacts() -> &'static Artifacts {
    static ARTIFACTS: OnceLock<Artifacts> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let output = Command::new(cargo)
            .current_dir(workspace_root())
            .args(["build", "--locked", "--profile", "test", "--message-format", "json-render-diagnostics"])
            .args(["-p", "cohort-server", "--bin", "cohort", "-p", "cohort-mobile", "--lib"])
            .stderr(Stdio::inherit())
            .output()
            .expect("cargo runs");
        assert!(output.status.success(), "building the artifacts failed");
        let mut cohort = None;
        let mut shared = None;
        let mut archive = None;
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let Ok(message) = serde_json::from_str::<Value>(line) else { continue };
            if message["reason"] != "compiler-artifact" {
                continue;
            }
            if let Some(executable) = message["executable"].as_str() {
                if message["target"]["name"] == "cohort" {
                    cohort = Some(PathBuf::from(executable));
                }
            }
            if message["target"]["name"] == "cohort_mobile" {
                for file in message["filenames"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                    if file.ends_with(".so") || file.ends_with(".dylib") {
                        shared = Some(PathBuf::from(file));
                    } else if file.ends_with(".a") {
                        archive = Some(PathBuf::from(file));
                    }
                }
            }
        }
        Artifacts {
            cohort: cohort.expect("the cohort binary was built"),
            mobile_shared: shared.expect("the mobile cdylib was built"),
            mobile_static: archive.expect("the mobile staticlib was built"),
        }
    })
}

/// A fresh scratch directory under the system's temporary directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cohort-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `cohort serve` on a free loopback port with its own SQLite file;
/// killed on drop.
#[derive(Debug)]
pub struct Serve {
    child: Child,
    /// Base URL.
    pub url: String,
    admin_token: String,
}

impl Serve {
    /// Starts the server and waits until it accepts connections.
    pub fn start(scratch: &Path, admin_token: &str) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(&artifacts().cohort)
            .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
            .arg("--database-url")
            .arg(format!("sqlite://{}", scratch.join("cohort.db").display()))
            .env("COHORT_ADMIN_TOKEN", admin_token)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "cohort serve did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Serve { child, url: format!("http://127.0.0.1:{port}"), admin_token: admin_token.into() }
    }

    /// An admin request: (status, body).
    pub fn admin(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Vec<u8>) {
        let request = Request {
            method,
            path: path.into(),
            body: body.map(|b| b.to_string().into_bytes()).unwrap_or_default(),
            content_type: Some("application/json"),
            bearer: Some(self.admin_token.clone()),
        };
        let response = HttpTransport::new(&self.url).send(&request).unwrap();
        (response.status, response.body)
    }

    /// An admin GET of JSON.
    pub fn admin_json(&self, path: &str) -> Value {
        let (status, body) = self.admin(Method::Get, path, None);
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }

    /// Creates a task; returns its id and enrollment token.
    pub fn create_task(&self, spec: Value) -> (String, String) {
        let (status, body) = self.admin(Method::Post, "/admin/tasks", Some(spec));
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        let created: Value = serde_json::from_slice(&body).unwrap();
        (created["id"].as_str().unwrap().into(), created["enrollment_token"].as_str().unwrap().into())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
