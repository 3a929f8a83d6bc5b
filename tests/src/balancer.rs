//! HAProxy in front of replicas of `cohort serve`, for the tests that go
//! through a load balancer (Debian's `haproxy`, which `scripts/setup.sh`
//! installs), started with its own configuration on a free loopback port.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use cohort_server::cluster::balancer::spawn_haproxy;

use crate::process::json_call;

/// HAProxy in front of the replicas, round robin with readiness checks;
/// killed on drop.
pub struct Balancer {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
    config: PathBuf,
}

impl Balancer {
    /// HAProxy on a free port in front of `backends`, its configuration
    /// in `scratch`; returns once it answers `/readyz`.
    pub fn start(scratch: &Path, backends: &[u16]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let config = scratch.join("haproxy.cfg");
        let child = spawn_haproxy(&config, port, backends)
            .unwrap_or_else(|e| panic!("starting HAProxy (scripts/setup.sh installs it): {e}"));
        let balancer = Self { child, port, config };
        let deadline = Instant::now() + Duration::from_secs(20);
        let up = || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && json_call(port, "GET", "/readyz", None, None).0 == 200
        };
        while !up() {
            assert!(Instant::now() < deadline, "HAProxy did not come up on port {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
        balancer
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}
