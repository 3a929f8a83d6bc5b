//! A coordinator for a test: the one harness. It runs `cohort serve` as a
//! child process (for tests that kill, signal or measure the server, or
//! start several replicas), or the same service inside the test process
//! (for tests that configure it in code, TLS included); over SQLite (a
//! fresh file, the default) or any database URL (PostgreSQL, a relay in
//! front of it). Either way a test reaches it by [`Serve::url`] and
//! [`Serve::admin`], and it is stopped on drop.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use cohort_client::runtime::http::HttpTransport;
use cohort_server::service::{Service, ServiceConfig, TlsFiles};
use serde_json::Value;

use crate::admin::AdminClient;

/// A running coordinator (see [the module](self)).
pub struct Serve {
    backend: Backend,
    /// Base URL (`http://127.0.0.1:PORT`, or `https://` in process with
    /// TLS).
    pub url: String,
    /// Its loopback port.
    pub port: u16,
    admin_token: String,
    transport: HttpTransport,
    /// Files removed on drop: its SQLite database, its settings file.
    scratch: Vec<PathBuf>,
}

enum Backend {
    Process(Child),
    InProcess(Box<InProcess>),
}

/// The service and the runtime it runs on.
struct InProcess {
    runtime: tokio::runtime::Runtime,
    service: Option<Service>,
}

/// How to start a [`Serve`]: built from [`Serve::options`], started with
/// [`ServeOptions::start`] (a process) or
/// [`ServeOptions::start_in_process`].
#[derive(Debug, Clone)]
pub struct ServeOptions {
    admin_token: String,
    port: u16,
    database: Database,
    config: Option<Value>,
    env: Vec<(String, String)>,
    log: Option<(PathBuf, String)>,
    args: Vec<String>,
    web_assets: bool,
    /// Its log goes to the test's stderr (else nowhere, unless `log`).
    show_log: bool,
}

#[derive(Debug, Clone)]
enum Database {
    /// A fresh SQLite file at this path (removed on drop).
    Fresh(PathBuf),
    /// This URL, kept.
    Url(String),
}

impl Serve {
    /// Options for a coordinator with `admin_token` on a free port over a
    /// fresh SQLite file (see [`ServeOptions::sqlite`]).
    pub fn options(admin_token: &str) -> ServeOptions {
        let file = fresh_database(&format!("serve-{}", next_suffix()));
        ServeOptions {
            admin_token: admin_token.into(),
            port: 0,
            database: Database::Fresh(file),
            config: None,
            env: Vec::new(),
            log: None,
            args: Vec::new(),
            web_assets: false,
            show_log: false,
        }
    }

    /// `cohort serve` with its SQLite file in `scratch` (kept, so that a
    /// server started again on `scratch` finds what the first stored) and
    /// the browser client's files served.
    pub fn in_dir(scratch: &Path, admin_token: &str) -> Self {
        Self::in_dir_with(scratch, admin_token, &[])
    }

    /// [`in_dir`](Self::in_dir) with more `cohort serve` arguments.
    pub fn in_dir_with(scratch: &Path, admin_token: &str, args: &[&str]) -> Self {
        // Kept on drop: a test restarts the server on the same directory.
        let database = format!("sqlite://{}", scratch.join("cohort.db").display());
        let mut options = Self::options(admin_token).web_assets().database(&database);
        options.show_log = true;
        args.iter().fold(options, |options, arg| options.arg(arg)).start()
    }

    /// `cohort serve` on `port` (0: any free port) over `database_url`,
    /// with `config` as its settings file if given.
    pub fn start(port: u16, database_url: &str, admin_token: &str, config: Option<&Value>) -> Self {
        let options = Self::options(admin_token).port(port).database(database_url);
        match config {
            Some(config) => options.config(config).start(),
            None => options.start(),
        }
    }

    /// `cohort serve` over a fresh SQLite file named after `name`.
    pub fn sqlite(name: &str, admin_token: &str, config: Option<&Value>) -> Self {
        let options = Self::options(admin_token).sqlite(name);
        match config {
            Some(config) => options.config(config).start(),
            None => options.start(),
        }
    }

    /// The service in this process over a fresh SQLite file named after
    /// `name`, plain HTTP.
    pub fn in_process(name: &str, admin_token: &str) -> Self {
        Self::options(admin_token).sqlite(name).start_in_process(None, |_| {})
    }

    /// The admin API of this coordinator.
    pub fn admin(&self) -> AdminClient {
        if self.url.starts_with("https://") {
            AdminClient::over(self.transport.clone(), &self.admin_token)
        } else {
            AdminClient::new(self.port, &self.admin_token)
        }
    }

    /// A client transport to this coordinator (trusting its test CA, if
    /// any).
    pub fn transport(&self) -> HttpTransport {
        self.transport.clone()
    }

    /// The SQLite file it was started on, if it was given a fresh one.
    pub fn database_file(&self) -> Option<&Path> {
        self.scratch.iter().find(|path| path.extension().is_some_and(|e| e == "db")).map(PathBuf::as_path)
    }

    /// Whether the process has exited (`None` while it runs; always `None`
    /// in process).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        match &mut self.backend {
            Backend::Process(child) => child.try_wait().unwrap(),
            Backend::InProcess(_) => None,
        }
    }

    /// Kills it without a graceful shutdown, like a crash (SIGKILL; a
    /// process only).
    pub fn kill(mut self) {
        let Backend::Process(child) = &mut self.backend else {
            panic!("a coordinator in the test process is stopped, not killed");
        };
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Sends SIGTERM (a process only).
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (`TERM`, `STOP`, `CONT`, ...; a process
    /// only).
    pub fn signal(&self, name: &str) {
        let status =
            Command::new("kill").args([&format!("-{name}"), &self.pid().to_string()]).status().unwrap();
        assert!(status.success(), "kill -{name}");
    }

    /// Resident memory now and at its peak, in KiB (from /proc; a process
    /// only).
    pub fn memory_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    fn pid(&self) -> u32 {
        match &self.backend {
            Backend::Process(child) => child.id(),
            Backend::InProcess(_) => {
                panic!("a coordinator in the test process has no process of its own")
            }
        }
    }
}

impl ServeOptions {
    /// Listen on `port` (0, the default: any free port).
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// A fresh SQLite file named after `name` (in the temporary
    /// directory, removed on drop), so that a test's file is found by its
    /// name.
    pub fn sqlite(mut self, name: &str) -> Self {
        self.database = Database::Fresh(fresh_database(name));
        self
    }

    /// Use `url` (SQLite or PostgreSQL) instead of a fresh SQLite file.
    pub fn database(mut self, url: &str) -> Self {
        self.database = Database::Url(url.into());
        self
    }

    /// The settings file `cohort serve --config` reads (a process only).
    pub fn config(mut self, settings: &Value) -> Self {
        self.config = Some(settings.clone());
        self
    }

    /// An environment variable of the process.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Its log (stderr) written to `file` at the levels `filter` sets
    /// (`RUST_LOG` syntax; a process only).
    pub fn log(mut self, file: &Path, filter: &str) -> Self {
        self.log = Some((file.into(), filter.into()));
        self
    }

    /// One more `cohort serve` argument.
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Serve the browser client's files (`web/pkg`).
    pub fn web_assets(mut self) -> Self {
        self.web_assets = true;
        self
    }

    fn database_url(&self) -> (String, Vec<PathBuf>) {
        match &self.database {
            Database::Fresh(file) => {
                crate::process::remove_database(file);
                (format!("sqlite://{}", file.display()), vec![file.clone()])
            }
            Database::Url(url) => (url.clone(), Vec::new()),
        }
    }

    /// Starts `cohort serve` and waits for it to say where it listens: a
    /// server that could not bind fails here, rather than the test talking
    /// to whatever holds the port.
    pub fn start(self) -> Serve {
        let (database_url, mut scratch) = self.database_url();
        let mut command = Command::new(&crate::artifacts().cohort);
        command
            .args(["serve", "--bind", &format!("127.0.0.1:{}", self.port), "--database-url", &database_url])
            .env("COHORT_ADMIN_TOKEN", &self.admin_token)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .args(&self.args);
        if self.web_assets {
            command.arg("--web-assets").arg(crate::workspace_root().join("web/pkg"));
        }
        // Every process trusts the balancer's source address, as a
        // deployment behind HAProxy does (docs/DEPLOYMENT.md), unless its
        // settings say otherwise; no other test connects from there.
        let mut settings = self.config.clone().unwrap_or_else(|| serde_json::json!({}));
        if let Some(settings) = settings.as_object_mut() {
            settings.entry("trusted_proxies").or_insert_with(|| {
                serde_json::json!([format!("{}/32", cohort_server::cluster::balancer::BALANCER_SOURCE)])
            });
        }
        let path =
            std::env::temp_dir().join(format!("cohort-serve-{}-{}.json", std::process::id(), next_suffix()));
        std::fs::write(&path, settings.to_string()).unwrap();
        command.arg("--config").arg(&path);
        scratch.push(path);
        match &self.log {
            Some((file, filter)) => {
                command.stderr(std::fs::File::create(file).unwrap()).env("RUST_LOG", filter);
            }
            None if self.show_log => {
                command.stderr(Stdio::inherit());
            }
            None => {
                command.stderr(Stdio::null());
            }
        }
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        let mut child = command.spawn().unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let url = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|line| line.split_once("listening on ").map(|(_, url)| url.trim().to_string()))
            .unwrap_or_else(|| {
                panic!("cohort serve did not start on port {}: {:?}", self.port, child.wait())
            });
        // Keep draining, so that the server never writes into a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Serve::new(Backend::Process(child), url, self.admin_token, HttpTransport::new, scratch)
    }

    /// Starts the service in this process on its own runtime, with `tls`
    /// (the files and the PEM of the CA that issued them, which its
    /// transports trust) if given, and `configure` applied to its settings
    /// last (limits, timeouts).
    pub fn start_in_process(
        self,
        tls: Option<(TlsFiles, String)>,
        configure: impl FnOnce(&mut ServiceConfig),
    ) -> Serve {
        assert!(self.config.is_none() && self.log.is_none(), "settings in process are set by `configure`");
        let (database_url, scratch) = self.database_url();
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (tls, ca) = match tls {
            Some((files, ca)) => (Some(files), Some(ca)),
            None => (None, None),
        };
        let mut config = ServiceConfig {
            max_message_bytes: 1 << 20,
            credential_ttl_ms: 3_600_000,
            tls,
            web_assets: crate::workspace_root().join("web/pkg"),
            ..ServiceConfig::new(
                SocketAddr::from(([127, 0, 0, 1], self.port)),
                database_url,
                &self.admin_token,
            )
        };
        configure(&mut config);
        let service = runtime.block_on(Service::start(config)).unwrap();
        let url = service.url();
        let transport = move |url: &str| match &ca {
            Some(ca) => HttpTransport::with_root_certificates(url, ca.as_bytes()).unwrap(),
            None => HttpTransport::new(url),
        };
        let backend = Backend::InProcess(Box::new(InProcess { runtime, service: Some(service) }));
        Serve::new(backend, url, self.admin_token, transport, scratch)
    }
}

impl Serve {
    fn new(
        backend: Backend,
        url: String,
        admin_token: String,
        transport: impl FnOnce(&str) -> HttpTransport,
        scratch: Vec<PathBuf>,
    ) -> Self {
        let port = url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a URL with a port");
        Self { transport: transport(&url), backend, url, port, admin_token, scratch }
    }
}

/// A fresh private CA (its certificate's PEM) and the files of a server
/// certificate it signed for `localhost` and 127.0.0.1: what
/// [`ServeOptions::start_in_process`] takes to serve over TLS, with the
/// PEM its clients trust.
pub fn test_certificates() -> (String, TlsFiles) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let leaf = params.signed_by(&key, &issuer).unwrap();
    let files = TlsFiles {
        certificate_chain: leaf.pem().into_bytes(),
        private_key: zeroize::Zeroizing::new(key.serialize_pem().into_bytes()),
    };
    (ca.pem(), files)
}

/// Where the fresh SQLite file named after `name` goes.
fn fresh_database(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cohort-{name}-{}.db", std::process::id()))
}

fn next_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Drop for Serve {
    fn drop(&mut self) {
        match &mut self.backend {
            Backend::Process(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Backend::InProcess(served) => {
                if let Some(service) = served.service.take() {
                    let _ = served.runtime.block_on(service.stop());
                }
            }
        }
        for path in &self.scratch {
            crate::process::remove_database(path);
        }
    }
}
