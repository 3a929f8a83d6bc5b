//! `cohort serve`: the coordinator as a long-running service.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use std::time::Duration;

use cohort_server::api::auth::new_token;
use cohort_server::api::listener::ConnectionLimits;
use cohort_server::api::pages as web;
use cohort_server::api::ratelimit::RateLimits;
use cohort_server::service::{Service, ServiceConfig, TlsFiles};
use serde::Deserialize;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long)]
    bind: Option<SocketAddr>,
    /// Database: a `sqlite://FILE` (created and migrated on start) or a
    /// `postgres://` URL.
    #[arg(long)]
    database_url: Option<String>,
    /// JSON settings file (keys: bind, database_url, admin_token,
    /// max_message_bytes, credential_ttl_days, tls_cert, tls_key,
    /// web_assets, demo, max_connections, max_connections_per_address,
    /// trusted_proxies, trusted_http_proxies, header_timeout_ms,
    /// idle_timeout_ms, body_min_rate, body_grace_ms, shutdown_grace_ms,
    /// rate_limits, max_total_parameters, max_admin_streams,
    /// audit_retention_days, public_url;
    /// see the README).
    /// Flags take precedence.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (leaf first)...
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// ...and this PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The browser client's build, served to the /demo page (default
    /// web/pkg, which scripts/build-web.sh writes).
    #[arg(long)]
    web_assets: Option<PathBuf>,
    /// Run a public demo task that the /demo page joins without a token
    /// (its enrollment token is served to anyone who opens the page).
    #[arg(long)]
    demo: bool,
    /// Where the other replicas sharing the database reach this one
    /// (`http://host:port`; default: http:// and the bound address). Set it
    /// when binding an unspecified address such as 0.0.0.0.
    #[arg(long)]
    public_url: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    bind: Option<SocketAddr>,
    database_url: Option<String>,
    admin_token: Option<String>,
    max_message_bytes: Option<usize>,
    credential_ttl_days: Option<u32>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    web_assets: Option<PathBuf>,
    demo: Option<bool>,
    max_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    trusted_proxies: Option<Vec<ipnet::IpNet>>,
    trusted_http_proxies: Option<Vec<ipnet::IpNet>>,
    header_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    body_min_rate: Option<u64>,
    body_grace_ms: Option<u64>,
    shutdown_grace_ms: Option<u64>,
    rate_limits: Option<RateLimits>,
    max_total_parameters: Option<usize>,
    max_admin_streams: Option<usize>,
    audit_retention_days: Option<u32>,
    public_url: Option<String>,
}

impl FileConfig {
    /// The connection limits: the defaults, with what the file sets.
    fn connections(&self) -> ConnectionLimits {
        let defaults = ConnectionLimits::default();
        let ms = |value: Option<u64>, default: Duration| value.map_or(default, Duration::from_millis);
        ConnectionLimits {
            max_connections: self.max_connections.unwrap_or(defaults.max_connections),
            max_connections_per_address: self
                .max_connections_per_address
                .unwrap_or(defaults.max_connections_per_address),
            header_timeout: ms(self.header_timeout_ms, defaults.header_timeout),
            idle_timeout: ms(self.idle_timeout_ms, defaults.idle_timeout),
            body_min_rate: self.body_min_rate.unwrap_or(defaults.body_min_rate),
            body_grace: ms(self.body_grace_ms, defaults.body_grace),
            shutdown_grace: ms(self.shutdown_grace_ms, defaults.shutdown_grace),
        }
    }
}

pub async fn serve(args: ServeArgs) -> Result<()> {
    let file: FileConfig = match &args.config {
        Some(path) => serde_json::from_slice(
            &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("parsing {}", path.display()))?,
        None => FileConfig::default(),
    };
    let connections = file.connections();
    let bind = args.bind.or(file.bind).unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080)));
    let database_url =
        args.database_url.or(file.database_url).unwrap_or_else(|| "sqlite://cohort.db".to_string());
    let admin_token = match std::env::var("COHORT_ADMIN_TOKEN").ok().or(file.admin_token) {
        Some(token) if token.len() >= 16 => token,
        Some(_) => anyhow::bail!("the admin token must be at least 16 characters"),
        None => {
            let token = new_token();
            eprintln!(
                "No admin token configured (COHORT_ADMIN_TOKEN or admin_token in --config); generated one:"
            );
            eprintln!("  admin token: {token}");
            token
        }
    };
    let tls = match (args.tls_cert.or(file.tls_cert), args.tls_key.or(file.tls_key)) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            certificate_chain: std::fs::read(&cert).with_context(|| format!("reading {}", cert.display()))?,
            private_key: zeroize::Zeroizing::new(
                std::fs::read(&key).with_context(|| format!("reading {}", key.display()))?,
            ),
        }),
        (None, None) => None,
        _ => anyhow::bail!("TLS needs both a certificate chain and a private key"),
    };
    let web_assets = args.web_assets.or(file.web_assets).unwrap_or_else(web::default_assets_dir);
    if !web::assets_present(&web_assets) {
        tracing::warn!(
            dir = %web_assets.display(),
            "no browser client build here: /demo cannot train until scripts/build-web.sh has run"
        );
    }
    let demo = args.demo || file.demo.unwrap_or(false);
    let defaults = ServiceConfig::new(bind, database_url.clone(), admin_token);
    let service = Service::start(ServiceConfig {
        max_message_bytes: file.max_message_bytes.unwrap_or(defaults.max_message_bytes),
        credential_ttl_ms: i64::from(file.credential_ttl_days.unwrap_or(30)) * 86_400_000,
        tls,
        web_assets,
        demo,
        connections,
        trusted_proxies: file.trusted_proxies.clone().unwrap_or_default(),
        trusted_http_proxies: file.trusted_http_proxies.clone().unwrap_or_default(),
        rate_limits: file.rate_limits.unwrap_or_default(),
        max_total_parameters: file.max_total_parameters.unwrap_or(defaults.max_total_parameters),
        max_admin_streams: file.max_admin_streams.unwrap_or(defaults.max_admin_streams),
        audit_retention_ms: file
            .audit_retention_days
            .map_or(defaults.audit_retention_ms, |days| i64::from(days.max(1)) * 86_400_000),
        public_url: args.public_url.or(file.public_url),
        ..defaults
    })
    .await?;
    tracing::info!(
        address = %service.address,
        database = %redact(&database_url),
        replica = %service.coordinator.replica().url,
        "coordinator listening"
    );
    println!("cohort serve: listening on {}", service.url());
    if cohort_server::store::Backend::of(&database_url) == Some(cohort_server::store::Backend::Postgres) {
        // The balancer's `cookie` for this replica (docs/DEPLOYMENT.md).
        let url = &service.coordinator.replica().url;
        let name = cohort_server::cluster::affinity::name_of(url);
        println!("cohort serve: replica {url}, balancer affinity name {name}");
    }
    println!("cohort serve: dashboard at {}/admin", service.url());
    if demo {
        println!("cohort serve: public demo task at {}/demo (open it in three or more tabs)", service.url());
    }
    service.run_until(shutdown()).await?;
    Ok(())
}

/// The database URL without a password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://***@{}", &url[..scheme], &url[at + 1..]),
        _ => url.to_string(),
    }
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        if let Ok(mut signal) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            signal.recv().await;
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limits the README shows are the defaults.
    #[test]
    fn the_readme_limits_are_the_defaults() {
        let readme = include_str!("../../../README.md");
        let block = readme
            .split("```json\n")
            .skip(1)
            .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
            .find(|block| block.contains("\"rate_limits\""))
            .expect("the README shows the limits");
        let file: FileConfig = serde_json::from_str(block).expect("the README's limits parse");
        assert_eq!(file.rate_limits, Some(RateLimits::default()));
        assert_eq!(file.max_total_parameters, Some(cohort_server::api::DEFAULT_MAX_TOTAL_PARAMETERS));
        assert_eq!(file.max_admin_streams, Some(cohort_server::api::events::DEFAULT_MAX_ADMIN_STREAMS));
        assert_eq!(
            file.audit_retention_days.map(i64::from),
            Some(cohort_server::service::DEFAULT_AUDIT_RETENTION_DAYS)
        );
        // The default cap depends on the machine's descriptor limit; the
        // README shows the most it can be.
        let shown = ConnectionLimits {
            max_connections: ConnectionLimits::default().max_connections,
            ..file.connections()
        };
        assert_eq!(shown, ConnectionLimits::default());
        assert_eq!(file.max_connections, Some(8192));
    }
}
