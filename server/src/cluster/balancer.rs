//! The HAProxy configuration for replicas of `cohort serve` behind one
//! address: round robin for a request without the affinity cookie, the
//! replica the cookie names for one with it (see
//! [`crate::cluster::affinity`]; a cookie that names a replica that is down
//! is ignored), health checks on readiness (so that a replica that cannot
//! reach the database leaves the rotation), retries of requests that never
//! reached a replica, a request id for every request that does not bring
//! one, and the PROXY protocol (version 2), from its own source address
//! [`BALANCER_SOURCE`], so that the replicas see each client's address
//! (see [`crate::api::listener::proxy`]). docs/DEPLOYMENT.md shows it; the
//! replica tests and `cohort bench load --replicas` start HAProxy with it.

use std::fmt::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::affinity;

/// The address the balancer connects to the replicas from: the one address
/// the replicas trust to send a PROXY protocol header (`trusted_proxies`).
/// It is not the replicas' own, because they reach each other directly,
/// without a header.
pub const BALANCER_SOURCE: &str = "127.0.2.1";

/// The configuration of a balancer on `127.0.0.1:port` in front of
/// replicas on the loopback `backends` ports (each advertising
/// `http://127.0.0.1:PORT`, the default for a replica bound there).
pub fn haproxy_config(port: u16, backends: &[u16]) -> String {
    let cookie = affinity::COOKIE;
    let mut config = format!(
        "global\n    maxconn 4096\n\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 120s\n    timeout server 120s\n    \
         option redispatch\n    retries 3\n    retry-on conn-failure empty-response 503\n\n\
         frontend cohort\n    bind 127.0.0.1:{port}\n    \
         unique-id-format %{{+X}}o%ci%cp%fi%fp%Ts%rt%pid\n    \
         http-request set-header X-Request-ID %[unique-id] unless {{ req.hdr(x-request-id) -m found }}\n    \
         default_backend replicas\n\n\
         backend replicas\n    balance roundrobin\n    cookie {cookie} insert indirect preserve nocache httponly\n    \
         option httpchk GET /readyz\n    http-check expect status 200\n    \
         default-server inter 300ms fall 2 rise 2 on-marked-down shutdown-sessions \
         send-proxy-v2 check-send-proxy source {BALANCER_SOURCE}\n"
    );
    for (i, backend) in backends.iter().enumerate() {
        let name = affinity::name_of(&format!("http://127.0.0.1:{backend}"));
        let _ = writeln!(config, "    server replica{i} 127.0.0.1:{backend} check cookie {name}");
    }
    config
}

/// Writes [`haproxy_config`] to `config` and starts HAProxy on it in the
/// foreground (`-db`), its output discarded; the caller stops it.
pub fn spawn_haproxy(config: &Path, port: u16, backends: &[u16]) -> std::io::Result<Child> {
    spawn_haproxy_with(config, &haproxy_config(port, backends))
}

/// Writes `text` to `config` and starts HAProxy on it as
/// [`spawn_haproxy`] does.
pub fn spawn_haproxy_with(config: &Path, text: &str) -> std::io::Result<Child> {
    std::fs::write(config, text)?;
    Command::new(haproxy_binary())
        .args(["-db", "-f"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
}

/// Where Debian's `haproxy` package installs the binary (`scripts/setup.sh`
/// installs it), else whatever `haproxy` is on `PATH`.
fn haproxy_binary() -> &'static str {
    ["/usr/sbin/haproxy", "/usr/bin/haproxy"]
        .into_iter()
        .find(|path| Path::new(path).exists())
        .unwrap_or("haproxy")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deployment_guide_shows_the_configuration_the_tests_use() {
        let guide = include_str!("../../../docs/DEPLOYMENT.md");
        let shown = guide
            .split("```text\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("docs/DEPLOYMENT.md shows a configuration");
        assert_eq!(shown, haproxy_config(8000, &[8081, 8082, 8083]));
    }
}
