//! The coordinator service as a value: database, actor and HTTP listener
//! started together, stopped together. `cohort serve` runs one until a
//! signal; `cohort demo` and the tests run one beside their clients.

use std::net::SocketAddr;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::api::auth::token_hash;
use crate::api::listener::ConnectionLimits;
use crate::api::ratelimit::{Limiters, RateLimits};
use crate::api::{ApiConfig, AppState, app};
use crate::cluster::Replica;
use crate::coordinator::{Coordinator, CoordinatorError};
use crate::metrics::Metrics;
use crate::store::{SqlStore, StoreError};

/// What a service needs.
#[derive(Clone)]
pub struct ServiceConfig {
    /// Address to listen on (port 0: any free port).
    pub bind: SocketAddr,
    /// `sqlite://FILE` or `postgres://...`.
    pub database_url: String,
    /// Bearer token of the admin API.
    pub admin_token: String,
    /// Largest accepted request body.
    pub max_message_bytes: usize,
    /// Lifetime of client credentials.
    pub credential_ttl_ms: i64,
    /// Terminate TLS with this certificate chain and key (PEM).
    pub tls: Option<TlsFiles>,
    /// The browser client's build directory (see [`crate::api::pages`]).
    pub web_assets: std::path::PathBuf,
    /// Run a public demo task for the `/demo` page (see [`crate::api::pages`]).
    pub demo: bool,
    /// Connection limits and timeouts (see [`crate::api::listener`]).
    pub connections: ConnectionLimits,
    /// The balancers whose connections begin with a PROXY protocol header
    /// naming the client (see [`crate::api::listener::proxy`]); empty, no
    /// header is read.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// The HTTP reverse proxies whose requests name the client in
    /// `X-Forwarded-For` (see [`crate::api::listener::forwarded`]); empty,
    /// the header is never read.
    pub trusted_http_proxies: Vec<ipnet::IpNet>,
    /// Rate limits of the client API (see [`crate::api::ratelimit`]).
    pub rate_limits: RateLimits,
    /// Most model parameters over all unfinished tasks.
    pub max_total_parameters: usize,
    /// Admin event streams open at once (see [`crate::api::events`]).
    pub max_admin_streams: usize,
    /// How long the audit log keeps an entry (see [`crate::api::projects`]).
    pub audit_retention_ms: i64,
    /// Where the other replicas sharing the database reach this one
    /// (default: `http://` and the bound address; set it when binding an
    /// unspecified address such as 0.0.0.0).
    pub public_url: Option<String>,
}

impl ServiceConfig {
    /// A service on `bind` over `database_url` with every other setting at
    /// its default.
    pub fn new(bind: SocketAddr, database_url: impl Into<String>, admin_token: impl Into<String>) -> Self {
        Self {
            bind,
            database_url: database_url.into(),
            admin_token: admin_token.into(),
            max_message_bytes: 256 << 20,
            credential_ttl_ms: 30 * 86_400_000,
            tls: None,
            web_assets: crate::api::pages::default_assets_dir(),
            demo: false,
            connections: ConnectionLimits::default(),
            trusted_proxies: Vec::new(),
            trusted_http_proxies: Vec::new(),
            rate_limits: RateLimits::default(),
            max_total_parameters: crate::api::DEFAULT_MAX_TOTAL_PARAMETERS,
            max_admin_streams: crate::api::events::DEFAULT_MAX_ADMIN_STREAMS,
            audit_retention_ms: DEFAULT_AUDIT_RETENTION_DAYS * 86_400_000,
            public_url: None,
        }
    }
}

/// A PEM certificate chain (leaf first) and its private key.
#[derive(Clone)]
pub struct TlsFiles {
    /// The certificate chain.
    pub certificate_chain: Vec<u8>,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub private_key: zeroize::Zeroizing<Vec<u8>>,
}

impl TlsFiles {
    /// The rustls server configuration (TLS 1.2 and 1.3, ring, HTTP/1.1
    /// and HTTP/2 by ALPN).
    fn server_config(&self) -> Result<rustls::ServerConfig, ServiceError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let tls = |message: String| ServiceError::Tls(message);
        let chain = CertificateDer::pem_slice_iter(&self.certificate_chain)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls(format!("certificate chain: {e}")))?;
        if chain.is_empty() {
            return Err(tls("no certificate in the chain file".into()));
        }
        let key =
            PrivateKeyDer::from_pem_slice(&self.private_key).map_err(|e| tls(format!("private key: {e}")))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| tls(format!("certificate and key: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// How often rate limiters forget clients that went quiet, and the audit
/// log its entries past their retention.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);
/// How long the audit log keeps an entry, by default: 400 days, a year and
/// a margin for the audits that look a year back.
pub const DEFAULT_AUDIT_RETENTION_DAYS: i64 = 400;

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig").field("bind", &self.bind).finish_non_exhaustive()
    }
}

/// Why the service did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// The database could not be opened or migrated.
    #[error("opening the database: {0}")]
    Store(#[from] StoreError),
    /// The coordinator could not load its tasks.
    #[error("starting the coordinator: {0}")]
    Coordinator(#[from] CoordinatorError),
    /// The public demo task could not be created.
    #[error("starting the demo task: {0}")]
    Demo(#[from] crate::api::ApiError),
    /// The TLS certificate or key is unusable.
    #[error("TLS: {0}")]
    Tls(String),
    /// A limit is out of range.
    #[error(transparent)]
    Limits(#[from] crate::api::listener::LimitsError),
    /// `trusted_proxies` or `trusted_http_proxies` trusts too much.
    #[error(transparent)]
    Proxies(#[from] crate::api::listener::proxy::ProxiesError),
    /// `max_admin_streams` is zero.
    #[error("max_admin_streams must be positive")]
    NoAdminStreams,
    /// Another process already serves this SQLite database.
    #[error(
        "{0} is already served by another cohort serve process: SQLite is for a single process; \
         run replicas on PostgreSQL (--database-url postgres://...)"
    )]
    SqliteInUse(String),
    /// The SQLite database's lock file could not be opened.
    #[error("locking {path}: {source}")]
    Lock {
        /// The lock file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The address could not be bound.
    #[error("binding {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// The API's state for `config`: what [`Service::start`] serves, and what
/// tests that drive the router without sockets (`oneshot`) build it from.
pub fn app_state(
    store: SqlStore,
    coordinator: Coordinator,
    metrics: Metrics,
    config: &ServiceConfig,
    demo_task: Option<crate::api::state::DemoTask>,
) -> AppState {
    AppState::new(crate::api::state::Shared {
        store,
        coordinator,
        metrics,
        config: ApiConfig {
            admin_token_hash: token_hash(&config.admin_token),
            max_message_bytes: config.max_message_bytes,
            credential_ttl_ms: config.credential_ttl_ms,
            web_assets: config.web_assets.clone(),
            demo_task,
            limiters: Limiters::new(&config.rate_limits),
            max_total_parameters: config.max_total_parameters,
        },
        creating: Default::default(),
        forwarder: crate::cluster::forward::Forwarder::new(&config.admin_token),
        streams: crate::api::events::Streams::new(config.max_admin_streams),
        models: Default::default(),
        holds: Default::default(),
    })
}

/// A running coordinator.
#[derive(Debug)]
pub struct Service {
    /// Where it listens.
    pub address: SocketAddr,
    scheme: &'static str,
    /// Its store.
    pub store: SqlStore,
    /// Its coordinator.
    pub coordinator: Coordinator,
    /// Its metrics.
    pub metrics: Metrics,
    shutdown: oneshot::Sender<()>,
    server: JoinHandle<std::io::Result<()>>,
    pruner: JoinHandle<()>,
    /// On PostgreSQL: the listener that keeps the credential cache open.
    credentials: Option<JoinHandle<()>>,
    /// Held while the service runs: the SQLite database's lock.
    _sqlite_lock: Option<std::fs::File>,
}

impl Service {
    /// Opens the database, starts the coordinator and listens. Must be
    /// called within a tokio runtime.
    pub async fn start(config: ServiceConfig) -> Result<Self, ServiceError> {
        config.connections.validate().map_err(ServiceError::Limits)?;
        let proxies = crate::api::listener::Proxies {
            protocol: crate::api::listener::TrustedProxies::checked(config.trusted_proxies.iter().copied())?,
            http: crate::api::listener::TrustedProxies::checked_as(
                "trusted_http_proxies",
                config.trusted_http_proxies.iter().copied(),
            )?,
        };
        if config.max_admin_streams == 0 {
            return Err(ServiceError::NoAdminStreams);
        }
        let sqlite_lock = lock_sqlite(&config.database_url)?;
        let store = SqlStore::connect(&config.database_url).await?;
        // The replica remembers its clients' credentials while it can hear
        // every change to them (store::credentials).
        let credentials = store.keep_credentials(&config.database_url)?.map(tokio::spawn);
        let metrics = Metrics::default();
        metrics.count_credential_lookups(store.credentials());
        let listener = crate::api::listener::bind(config.bind, config.connections.max_connections)
            .map_err(|source| ServiceError::Bind { address: config.bind, source })?;
        let address =
            listener.local_addr().map_err(|source| ServiceError::Bind { address: config.bind, source })?;
        let tls = config.tls.as_ref().map(TlsFiles::server_config).transpose()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let replica = Replica {
            id: crate::api::auth::new_id(),
            url: config.public_url.clone().unwrap_or_else(|| default_public_url(scheme, address)),
            started_at: crate::coordinator::now_ms(),
        };
        // On PostgreSQL the leases are renewed on a connection of their
        // own: requests queued for the pool under load must not hold a
        // renewal up until the replica gives its tasks away.
        let lease_store = match store.backend() {
            crate::store::Backend::Postgres => SqlStore::connect_dedicated(&config.database_url).await?,
            crate::store::Backend::Sqlite => store.clone(),
        };
        let coordinator = Coordinator::start(store.clone(), lease_store, metrics.clone(), replica).await?;
        let demo_task = if config.demo {
            Some(crate::api::pages::start_demo_task(&store, &coordinator).await?)
        } else {
            None
        };
        let state = app_state(store.clone(), coordinator.clone(), metrics.clone(), &config, demo_task);
        let limiters = state.config.limiters.clone();
        let (audit_store, retention) = (store.clone(), config.audit_retention_ms);
        let pruner = tokio::spawn(async move {
            let mut every = tokio::time::interval(PRUNE_EVERY);
            loop {
                every.tick().await;
                limiters.prune();
                // Every replica prunes; the deletes are idempotent.
                match audit_store.prune_audit(crate::coordinator::now_ms().saturating_sub(retention)).await {
                    Ok(0) => {}
                    Ok(pruned) => tracing::info!(pruned, "audit log entries past their retention deleted"),
                    Err(error) => tracing::warn!(%error, "could not prune the audit log"),
                }
            }
        });
        let (shutdown, signal) = oneshot::channel::<()>();
        let router = app(state);
        let server = tokio::spawn(crate::api::listener::serve(
            listener,
            router,
            tls.map(std::sync::Arc::new),
            config.connections,
            proxies,
            signal,
        ));
        Ok(Self {
            address,
            scheme,
            store,
            coordinator,
            metrics,
            shutdown,
            server,
            pruner,
            credentials,
            _sqlite_lock: sqlite_lock,
        })
    }

    /// The base URL clients use.
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.address)
    }

    /// Stops accepting connections, lets requests in flight finish within
    /// the shutdown grace and cuts the rest.
    pub async fn stop(self) -> std::io::Result<()> {
        self.coordinator.shutdown().await;
        let _ = self.shutdown.send(());
        self.pruner.abort();
        if let Some(credentials) = &self.credentials {
            credentials.abort();
            // Nobody listens any more: nothing may be remembered.
            self.store.credentials().close();
        }
        self.server.await.unwrap_or_else(|e| Err(std::io::Error::other(e)))
    }

    /// Runs until `signal` resolves, then stops.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) -> std::io::Result<()> {
        signal.await;
        self.stop().await
    }
}

/// The URL other replicas reach this one at when none is configured: the
/// bound address, or loopback for an unspecified one (one machine only).
fn default_public_url(scheme: &str, address: SocketAddr) -> String {
    if address.ip().is_unspecified() {
        tracing::warn!(%address, "bound to an unspecified address: other replicas will look for this one on loopback; set --public-url");
        let loopback = SocketAddr::from(([127, 0, 0, 1], address.port()));
        return format!("{scheme}://{loopback}");
    }
    format!("{scheme}://{address}")
}

/// SQLite serves one process: a second `cohort serve` on the same file is
/// refused while the first holds an exclusive lock on `FILE.lock` (released
/// by the operating system when the process ends, however it ends).
fn lock_sqlite(url: &str) -> Result<Option<std::fs::File>, ServiceError> {
    let Some(rest) = url.strip_prefix("sqlite:") else { return Ok(None) };
    let path = rest.trim_start_matches("//");
    let path = path.split('?').next().unwrap_or(path);
    if path.is_empty() || path.contains(":memory:") {
        return Ok(None);
    }
    let lock_path = format!("{path}.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|source| ServiceError::Lock { path: lock_path.clone(), source })?;
    match fs4::FileExt::try_lock(&file) {
        Ok(()) => Ok(Some(file)),
        Err(fs4::TryLockError::WouldBlock) => Err(ServiceError::SqliteInUse(path.to_string())),
        Err(fs4::TryLockError::Error(source)) => Err(ServiceError::Lock { path: lock_path, source }),
    }
}
