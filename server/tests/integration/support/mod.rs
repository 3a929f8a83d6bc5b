//! A coordinator in the test process, listening on a free loopback port,
//! for tests that talk to it over real HTTP(S) with the client library.

#![allow(dead_code, clippy::unwrap_used)]

pub mod proxy;

use std::net::SocketAddr;
use std::path::PathBuf;

use cohort_client::participant::{Method, Request, Response};
use cohort_client::runtime::Transport;
use cohort_client::runtime::http::HttpTransport;
use cohort_server::service::{Service, ServiceConfig, TlsFiles};
use serde_json::Value;

/// A client that hands in the same update every round, whatever the model.
pub struct Steady {
    pub delta: Vec<f32>,
    pub examples: u32,
    pub metrics: cohort_client::participant::MetricValues,
}

impl cohort_client::runtime::Trainer for Steady {
    fn train(
        &mut self,
        _: cohort_client::runtime::Contribution,
        _: &cohort_client::checkpoint::Checkpoint,
    ) -> Result<cohort_client::runtime::LocalUpdate, cohort_client::runtime::UpdateError> {
        Ok(cohort_client::runtime::LocalUpdate {
            delta: self.delta.clone(),
            examples: self.examples,
            metrics: self.metrics,
        })
    }
}

/// A running coordinator on its own runtime; stopped and its SQLite file
/// removed on drop.
pub struct Coordinator {
    runtime: tokio::runtime::Runtime,
    service: Option<Service>,
    /// Base URL (`http://` or `https://`).
    pub url: String,
    database: PathBuf,
    admin_token: String,
    transport: HttpTransport,
}

impl Coordinator {
    /// Plain HTTP, 1 MiB stage messages.
    pub fn start(name: &str, admin_token: &str) -> Self {
        Self::start_with(name, admin_token, 1 << 20, None)
    }

    /// With a message size limit and, optionally, TLS (the files and the
    /// PEM of the CA that issued them, which the admin client trusts).
    pub fn start_with(
        name: &str,
        admin_token: &str,
        max_message_bytes: usize,
        tls: Option<(TlsFiles, String)>,
    ) -> Self {
        Self::start_configured(name, admin_token, max_message_bytes, tls, |_| {})
    }

    /// As [`start_with`](Self::start_with), with `configure` applied to the
    /// service's settings last (limits, timeouts).
    pub fn start_configured(
        name: &str,
        admin_token: &str,
        max_message_bytes: usize,
        tls: Option<(TlsFiles, String)>,
        configure: impl FnOnce(&mut ServiceConfig),
    ) -> Self {
        let database = std::env::temp_dir().join(format!("cohort-test-{name}-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&database);
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (tls, ca) = match tls {
            Some((files, ca)) => (Some(files), Some(ca)),
            None => (None, None),
        };
        let mut config = ServiceConfig {
            max_message_bytes,
            credential_ttl_ms: 3_600_000,
            tls,
            web_assets: std::path::PathBuf::from("web/pkg"),
            ..ServiceConfig::new(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                format!("sqlite://{}", database.display()),
                admin_token,
            )
        };
        configure(&mut config);
        let service = runtime.block_on(Service::start(config)).unwrap();
        let url = service.url();
        let transport = match ca {
            Some(ca) => HttpTransport::with_root_certificates(&url, ca.as_bytes()).unwrap(),
            None => HttpTransport::new(&url),
        };
        Self { runtime, service: Some(service), url, database, admin_token: admin_token.into(), transport }
    }

    /// A transport to this coordinator (trusting its CA, if any).
    pub fn transport(&self) -> HttpTransport {
        self.transport.clone()
    }

    /// An admin request with a raw body.
    pub fn admin_raw(&self, method: Method, path: &str, body: Vec<u8>) -> Response {
        let request = Request {
            method,
            path: path.into(),
            body,
            content_type: Some("application/json"),
            bearer: Some(self.admin_token.clone()),
        };
        self.transport().send(&request).unwrap()
    }

    /// An admin request with an optional JSON body: (status, body).
    pub fn admin(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Vec<u8>) {
        let response =
            self.admin_raw(method, path, body.map(|b| b.to_string().into_bytes()).unwrap_or_default());
        (response.status, response.body)
    }

    /// Creates a task; returns its id and enrollment token.
    pub fn create_task(&self, spec: Value) -> (String, String) {
        let (status, body) = self.admin(Method::Post, "/admin/tasks", Some(spec));
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        let created: Value = serde_json::from_slice(&body).unwrap();
        (created["id"].as_str().unwrap().into(), created["enrollment_token"].as_str().unwrap().into())
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        if let Some(service) = self.service.take() {
            let _ = self.runtime.block_on(service.stop());
        }
        let _ = std::fs::remove_file(&self.database);
    }
}

/// The client policy that accepts the task `spec` would create (new tasks
/// run the active variant unless they say otherwise), weakened from the
/// default only where the small test task needs it.
pub fn policy_for(spec: &Value) -> cohort_client::participant::Policy {
    let mut spec: cohort_server::spec::TaskSpec = serde_json::from_value(spec.clone()).unwrap();
    spec.secure_aggregation.default_for_new_task();
    spec.accepting_policy().unwrap()
}
