//! The coordinator service as a value: database, actor and HTTP listener
//! started together, stopped together. `cohort serve` runs one until a
//! signal; `cohort demo` and the tests run one beside their clients.

use std::net::SocketAddr;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::auth::token_hash;
use crate::coordinator::{Coordinator, CoordinatorError};
use crate::http::{ApiConfig, AppState, app};
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
}

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
    /// The address could not be bound.
    #[error("binding {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// A running coordinator.
#[derive(Debug)]
pub struct Service {
    /// Where it listens.
    pub address: SocketAddr,
    /// Its store.
    pub store: SqlStore,
    /// Its coordinator.
    pub coordinator: Coordinator,
    /// Its metrics.
    pub metrics: Metrics,
    shutdown: oneshot::Sender<()>,
    server: JoinHandle<std::io::Result<()>>,
}

impl Service {
    /// Opens the database, starts the coordinator and listens. Must be
    /// called within a tokio runtime.
    pub async fn start(config: ServiceConfig) -> Result<Self, ServiceError> {
        let store = SqlStore::connect(&config.database_url).await?;
        let metrics = Metrics::default();
        let coordinator = Coordinator::start(store.clone(), metrics.clone()).await?;
        let state = AppState {
            store: store.clone(),
            coordinator: coordinator.clone(),
            metrics: metrics.clone(),
            config: ApiConfig {
                admin_token_hash: token_hash(&config.admin_token),
                max_message_bytes: config.max_message_bytes,
                credential_ttl_ms: config.credential_ttl_ms,
            },
        };
        let listener = tokio::net::TcpListener::bind(config.bind)
            .await
            .map_err(|source| ServiceError::Bind { address: config.bind, source })?;
        let address =
            listener.local_addr().map_err(|source| ServiceError::Bind { address: config.bind, source })?;
        let (shutdown, signal) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            axum::serve(listener, app(state))
                .with_graceful_shutdown(async move {
                    let _ = signal.await;
                })
                .await
        });
        Ok(Self { address, store, coordinator, metrics, shutdown, server })
    }

    /// The base URL clients use.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Stops accepting requests and waits for those in flight.
    pub async fn stop(self) -> std::io::Result<()> {
        let _ = self.shutdown.send(());
        self.server.await.unwrap_or_else(|e| Err(std::io::Error::other(e)))
    }

    /// Runs until `signal` resolves, then stops.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) -> std::io::Result<()> {
        signal.await;
        self.stop().await
    }
}
