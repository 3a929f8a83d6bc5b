//! A blocking driver for [`Participant`]: a [`Transport`] sends the
//! requests, a [`Trainer`] computes the updates, and the enrollment is
//! kept in a state file so that a restarted client goes on where it was.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::checkpoint::Checkpoint;
use crate::data::Dataset;
use crate::model::{Differentiable, Model};
use crate::participant::{
    Action, Participant, ParticipantError, Request, Response, RoundOutcome, SavedState,
};
use crate::train::{TrainConfig, train};
use cohort_crypto::{Metric, MetricValues};

/// Sends one request and returns the coordinator's response, whatever
/// its status; `Err` means no response arrived.
pub trait Transport {
    /// Performs the request.
    fn send(&mut self, request: &Request) -> Result<Response, TransportError>;
}

/// Why no response arrived. The participant retries with backoff and gives
/// up with [`ParticipantError::Unreachable`] naming the last one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The HTTP client failed: no connection, TLS, a timeout, a body over
    /// the limit.
    #[cfg(feature = "http")]
    #[error(transparent)]
    Http(#[from] ureq::Error),
    /// A transport outside this crate failed.
    #[error("{0}")]
    Other(String),
}

/// Why a [`Trainer`] gave no update. The runner then leaves the round (the
/// coordinator counts a dropout) and goes on with the next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpdateError {
    /// The task's model is not the architecture this trainer trains.
    #[error("the task's model layout is not this client's architecture")]
    LayoutMismatch,
    /// The task's model is none of the built-in architectures.
    #[error("the task's model is not a built-in architecture: supply an update provider instead of data")]
    NotBuiltIn,
    /// There is no local data to train on.
    #[error("no training data was supplied")]
    NoData,
    /// Training itself failed.
    #[error(transparent)]
    Training(#[from] crate::train::TrainError),
    /// A metric of the round is out of its range.
    #[error(transparent)]
    Metric(#[from] cohort_crypto::quantize::QuantizeError),
    /// More examples than an update's weight can count.
    #[error("{0} local examples are more than an update's weight can count")]
    TooManyExamples(usize),
    /// A trainer outside this crate failed (the application's own, a JNI
    /// or C callback).
    #[error("{0}")]
    Application(String),
}

/// The update an application computed for a round. It is what secure
/// aggregation protects: it cannot be cloned or printed (`Debug` shows its
/// size only), and its values are wiped when it is dropped.
pub struct LocalUpdate {
    /// Local model minus global model, in the global model's layout.
    pub delta: Vec<f32>,
    /// Weight in the average: the number of local examples.
    pub examples: u32,
    /// The round's training metrics (loss, accuracy): the coordinator
    /// learns only their means over the round's survivors.
    pub metrics: MetricValues,
}

impl std::fmt::Debug for LocalUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalUpdate")
            .field("parameters", &self.delta.len())
            .field("examples", &self.examples)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl LocalUpdate {
    /// The update, its weight and its metrics, for
    /// [`Participant::submit`](crate::participant::Participant::submit)
    /// (which keeps the update in zeroizing memory).
    pub fn into_parts(mut self) -> (Vec<f32>, u32, MetricValues) {
        (std::mem::take(&mut self.delta), self.examples, self.metrics)
    }
}

impl Drop for LocalUpdate {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.delta);
    }
}

/// What a [`Trainer`] is told about the update it computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contribution {
    /// The round (an async task: the model's version) as the coordinator
    /// numbers it: for the application to show, never to seed anything.
    pub round: u64,
    /// How many masked inputs this client sent before this one, from its
    /// saved state: a value of the client's own that never repeats. The
    /// built-in trainers seed local training's randomness (the order of
    /// the examples) from it and their own seed, so that no two updates
    /// draw the same randomness, whatever rounds the coordinator
    /// announces (THREAT_MODEL claim 55).
    pub nonce: u64,
}

/// Computes a round's update from the global model.
pub trait Trainer {
    /// Trains on local data, starting from `model`.
    fn train(&mut self, contribution: Contribution, model: &Checkpoint) -> Result<LocalUpdate, UpdateError>;
}

/// The built-in trainer: one of the [`Model`]s (or, with the `tch`
/// feature, a `TorchModel` or a user's `TorchScriptModel`) on a local
/// [`Dataset`].
#[derive(Debug, Clone)]
pub struct LocalTrainer<M = Model> {
    /// Architecture; must match the task's layout.
    pub model: M,
    /// Local examples.
    pub data: Dataset,
    /// Hyper-parameters; the seed is mixed with the contribution's nonce.
    pub config: TrainConfig,
}

impl<M: Differentiable> Trainer for LocalTrainer<M> {
    fn train(&mut self, contribution: Contribution, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        local_update(&self.model, &self.data, &self.config, contribution.nonce, global)
    }
}

/// What the built-in trainer computes: `model` trained on `data` from the
/// global model, with the seed of `config` mixed with `nonce`. A client
/// passes its [`Contribution::nonce`], never a number the coordinator
/// chose: the same model served twice under new round numbers would
/// otherwise give the same update twice. A simulation, whose coordinator
/// is the experiment itself, passes the round.
pub fn local_update<M: Differentiable + ?Sized>(
    model: &M,
    data: &Dataset,
    config: &TrainConfig,
    nonce: u64,
    global: &Checkpoint,
) -> Result<LocalUpdate, UpdateError> {
    if global.layout != model.layout() {
        return Err(UpdateError::LayoutMismatch);
    }
    let mut params = global.weights.clone();
    let config = TrainConfig { seed: config.seed ^ nonce.wrapping_mul(0x9e37_79b9_7f4a_7c15), ..*config };
    let report = train(model, &mut params, &global.weights, data.features.view(), &data.labels, &config)?;
    let delta = params.iter().zip(&global.weights).map(|(local, global)| local - global).collect();
    let mut metrics = MetricValues::new();
    // A diverged loss is not a reason to lose the round.
    if report.loss.is_finite() {
        metrics.set(Metric::TrainLoss, f64::from(report.loss))?;
    }
    let examples =
        u32::try_from(report.examples).map_err(|_| UpdateError::TooManyExamples(report.examples))?;
    Ok(LocalUpdate { delta, examples, metrics })
}

/// Drives a [`Participant`] with blocking I/O.
pub struct Runner<T: Transport> {
    participant: Participant,
    transport: T,
    state_file: Option<PathBuf>,
    clock: Instant,
    interrupt: Option<Arc<AtomicBool>>,
}

impl<T: Transport> std::fmt::Debug for Runner<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("participant", &self.participant).finish_non_exhaustive()
    }
}

/// Why a runner stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The participant cannot go on.
    #[error(transparent)]
    Participant(#[from] ParticipantError),
    /// The state file could not be written or read.
    #[error("state file {}: {message}", path.display())]
    State {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The interrupt flag was raised; a round under way was left (the
    /// server counts this client as a dropout).
    #[error("interrupted by the application")]
    Interrupted,
}

impl<T: Transport> Runner<T> {
    /// A runner; with `state_file`, the enrollment is saved there after it
    /// happens and after every completed round.
    pub fn new(participant: Participant, transport: T, state_file: Option<PathBuf>) -> Self {
        Self { participant, transport, state_file, clock: Instant::now(), interrupt: None }
    }

    /// Makes the runner stop with [`RunError::Interrupted`] soon after
    /// `flag` is raised (from any thread): before its next request, or
    /// within 50 ms of a wait. The flag is only read, never cleared.
    pub fn with_interrupt(mut self, flag: Arc<AtomicBool>) -> Self {
        self.interrupt = Some(flag);
        self
    }

    fn interrupted(&self) -> bool {
        self.interrupt.as_ref().is_some_and(|flag| flag.load(Ordering::SeqCst))
    }

    /// The participant.
    pub fn participant(&self) -> &Participant {
        &self.participant
    }

    fn now(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// Takes part until one round this client was selected for ends;
    /// `None` when the task is over.
    pub fn run_round(&mut self, trainer: &mut dyn Trainer) -> Result<Option<RoundOutcome>, RunError> {
        self.run_round_with(trainer, |_| false)
    }

    /// As [`run_round`](Self::run_round); `vanish` is asked before every
    /// request and, when it says so, the client silently leaves the round
    /// (dropout experiments).
    pub fn run_round_with(
        &mut self,
        trainer: &mut dyn Trainer,
        mut vanish: impl FnMut(&Participant) -> bool,
    ) -> Result<Option<RoundOutcome>, RunError> {
        loop {
            if self.interrupted() {
                self.participant.leave("interrupted by the application");
                self.save()?;
                return Err(RunError::Interrupted);
            }
            // Saved when it changes: after enrolling, and before a masked
            // input is sent (the contribution must outlive a crash).
            let progress =
                |p: &Participant| p.saved_state().map(|s| (s.last_contributed_round, s.expires_at));
            let had_state = progress(&self.participant);
            match self.participant.next(self.now()) {
                Action::Send(request) => {
                    if vanish(&self.participant) {
                        self.participant.vanish("left the round on purpose");
                        continue;
                    }
                    match self.transport.send(&request) {
                        Ok(response) => self.participant.handle(self.now(), response)?,
                        Err(error) => self.participant.transport_failed(self.now(), &error.to_string())?,
                    }
                    if progress(&self.participant) != had_state {
                        self.save()?;
                    }
                }
                Action::Wait(ms) => self.sleep(Duration::from_millis(ms.min(1_000))),
                Action::Train { round, nonce, model } => {
                    match trainer.train(Contribution { round, nonce }, &model) {
                        Ok(update) => {
                            let (delta, examples, metrics) = update.into_parts();
                            if let Err(refused) = self.participant.submit(delta, examples, metrics) {
                                // An update that does not fit (no examples,
                                // non-finite values): leave the round rather
                                // than wait in it for an update that will not
                                // come, and say why.
                                self.participant.leave(&format!("the update was refused: {refused}"));
                                return Err(refused.into());
                            }
                        }
                        Err(reason) => self.participant.vanish(&format!("local training failed: {reason}")),
                    }
                }
                // Not asked for here: this driver leaves every step's work
                // to the participant.
                Action::HostWork => self.participant.complete_host_work()?,
                Action::RoundEnded(outcome) => {
                    self.save()?;
                    return Ok(Some(outcome));
                }
                Action::Finished => return Ok(None),
            }
        }
    }

    /// Tells the coordinator that this client leaves the task for now (it
    /// is not selected again until it checks in again), as a process that
    /// stops for good does. Sends one request and does not retry; `false`
    /// when there was nothing to send (not enrolled) or no answer came.
    pub fn leave(&mut self) -> bool {
        let Some(request) = self.participant.leave_request() else {
            return false;
        };
        self.transport.send(&request).is_ok_and(|response| (200..300).contains(&response.status))
    }

    /// Sleeps, waking early when interrupted.
    fn sleep(&self, duration: Duration) {
        if self.interrupt.is_none() {
            return std::thread::sleep(duration);
        }
        let until = Instant::now() + duration;
        while !self.interrupted() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }

    fn save(&self) -> Result<(), RunError> {
        match (&self.state_file, self.participant.saved_state()) {
            (Some(path), Some(state)) => save_state(path, state),
            _ => Ok(()),
        }
    }
}

/// Writes the state file atomically, readable by its owner only.
pub fn save_state(path: &Path, state: &SavedState) -> Result<(), RunError> {
    let error =
        |e: &dyn std::fmt::Display| RunError::State { path: path.to_path_buf(), message: e.to_string() };
    let json = zeroize::Zeroizing::new(serde_json::to_vec(state).map_err(|e| error(&e))?);
    let temporary = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(&temporary).map_err(|e| error(&e))?;
    std::io::Write::write_all(&mut file, &json).map_err(|e| error(&e))?;
    file.sync_all().map_err(|e| error(&e))?;
    std::fs::rename(&temporary, path).map_err(|e| error(&e))
}

/// Reads a state file written by [`save_state`]; `None` if there is none.
pub fn load_state(path: &Path) -> Result<Option<SavedState>, RunError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => zeroize::Zeroizing::new(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(RunError::State { path: path.to_path_buf(), message: e.to_string() }),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| RunError::State { path: path.to_path_buf(), message: format!("corrupt: {e}") })
}

/// The blocking HTTP(S) transport: ureq over rustls, with the web PKI's
/// root certificates or a given one.
#[cfg(feature = "http")]
pub mod http {
    use std::time::Duration;

    use super::{Transport, TransportError};
    use crate::participant::{Method, Request, Response};

    /// Largest response body accepted (a model checkpoint).
    const MAX_BODY_BYTES: u64 = 1 << 30;

    /// Why CA certificates were refused.
    #[derive(Debug, thiserror::Error)]
    #[non_exhaustive]
    pub enum CertificateError {
        /// The PEM data does not parse.
        #[error("CA certificate: {0}")]
        Pem(ureq::Error),
        /// The PEM data holds no certificate.
        #[error("CA certificate: no certificate in the PEM data")]
        None,
    }

    /// Talks to a coordinator at a base URL (`http://host:port`).
    #[derive(Debug, Clone)]
    pub struct HttpTransport {
        agent: ureq::Agent,
        base: String,
    }

    impl HttpTransport {
        /// A transport for `base_url`, trusting the web PKI's roots for
        /// `https`.
        pub fn new(base_url: &str) -> Self {
            Self::with_tls(base_url, ureq::tls::TlsConfig::default())
        }

        /// A transport that trusts only the CA certificate(s) in `pem`.
        pub fn with_root_certificates(base_url: &str, pem: &[u8]) -> Result<Self, CertificateError> {
            let certificates = ureq::tls::parse_pem(pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                    Ok(_) => None,
                    Err(e) => Some(Err(CertificateError::Pem(e))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if certificates.is_empty() {
                return Err(CertificateError::None);
            }
            let roots = ureq::tls::RootCerts::Specific(std::sync::Arc::new(certificates));
            Ok(Self::with_tls(base_url, ureq::tls::TlsConfig::builder().root_certs(roots).build()))
        }

        fn with_tls(base_url: &str, tls: ureq::tls::TlsConfig) -> Self {
            let agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_connect(Some(Duration::from_secs(10)))
                .timeout_global(Some(Duration::from_secs(120)))
                // The coordinator holds a request at most
                // `routes::MAX_WAIT_MS` (20 s, see `ParticipantConfig::wait_ms`)
                // and otherwise answers at once: a reply later than this
                // comes from one that stalled, and the request is better
                // retried (through a balancer, on another replica).
                .timeout_recv_response(Some(Duration::from_secs(30)))
                .tls_config(tls)
                .build()
                .into();
            Self { agent, base: base_url.trim_end_matches('/').to_string() }
        }
    }

    impl Transport for HttpTransport {
        fn send(&mut self, request: &Request) -> Result<Response, TransportError> {
            let url = format!("{}{}", self.base, request.path);
            let bearer = request.bearer.as_ref().map(|b| format!("Bearer {b}"));
            let result = match request.method {
                Method::Get => {
                    let mut builder = self.agent.get(&url);
                    if let Some(bearer) = &bearer {
                        builder = builder.header("authorization", bearer);
                    }
                    builder.call()
                }
                Method::Post => {
                    let mut builder = self.agent.post(&url);
                    if let Some(bearer) = &bearer {
                        builder = builder.header("authorization", bearer);
                    }
                    if let Some(content_type) = request.content_type {
                        builder = builder.header("content-type", content_type);
                    }
                    builder.send(&request.body[..])
                }
            };
            let mut response = result?;
            let status = response.status().as_u16();
            let body = response.body_mut().with_config().limit(MAX_BODY_BYTES).read_to_vec()?;
            Ok(Response { status, body })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_update_is_neither_printed_nor_cloned() {
        static_assertions::assert_not_impl_any!(LocalUpdate: Clone);
        let mut metrics = MetricValues::new();
        metrics.set(Metric::TrainLoss, 0.777).unwrap();
        let update = LocalUpdate { delta: vec![0.123_456, -9.875], examples: 7, metrics };
        let printed = format!("{update:?}");
        assert!(printed.contains("parameters: 2") && printed.contains("train_loss"), "{printed}");
        assert!(
            !printed.contains("0.123") && !printed.contains("9.875") && !printed.contains("0.777"),
            "{printed}"
        );
        let (delta, examples, metrics) = update.into_parts();
        assert_eq!(
            (delta, examples, metrics.get(Metric::TrainLoss)),
            (vec![0.123_456, -9.875], 7, Some(0.777))
        );
    }
    use crate::participant::{Action, ParticipantConfig, Response};

    /// A task the default policy accepts, as an enrollment reply carries it.
    fn security() -> serde_json::Value {
        serde_json::json!({
            "variant": "active", "clients": 10, "graph": "complete", "degree": 9, "threshold": 7,
            "modulus_bits": 32, "clip": 1.0, "max_weight": 64, "transform": { "kind": "none" },
        })
    }

    /// Enrolls, then is told to wait at every check-in.
    struct NeverSelected;

    impl Transport for NeverSelected {
        fn send(&mut self, request: &crate::participant::Request) -> Result<Response, TransportError> {
            let (status, body) = if request.path.ends_with("/enroll") {
                (
                    201,
                    serde_json::json!({ "participant_id": "p1", "credential": "c", "expires_at": 0, "security": security() }),
                )
            } else {
                (200, serde_json::json!({ "status": "wait", "retry_after_ms": 60_000 }))
            };
            Ok(Response { status, body: body.to_string().into_bytes() })
        }
    }

    struct NoTraining;

    impl Trainer for NoTraining {
        fn train(&mut self, _: Contribution, _: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
            Err(UpdateError::Application("not selected, so never called".into()))
        }
    }

    #[test]
    fn raising_the_interrupt_flag_stops_a_waiting_runner() {
        let flag = Arc::new(AtomicBool::new(false));
        let participant = Participant::enroll("task", "token", ParticipantConfig::default());
        let mut runner = Runner::new(participant, NeverSelected, None).with_interrupt(flag.clone());
        let raiser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            flag.store(true, Ordering::SeqCst);
        });
        let started = Instant::now();
        let result = runner.run_round(&mut NoTraining);
        assert!(matches!(result, Err(RunError::Interrupted)), "{result:?}");
        // The check-in asked for a minute's wait; the flag cut it short.
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        raiser.join().unwrap();
        assert_eq!(runner.participant().saved_state().unwrap().participant_id, "p1");
    }

    #[test]
    fn the_state_file_holds_the_enrollment_only_and_is_private() {
        let mut participant = Participant::enroll("task", "token", ParticipantConfig::default());
        let Action::Send(_) = participant.next(0) else { panic!("expected the enrollment request") };
        let reply = serde_json::json!({
            "participant_id": "p7", "credential": "c-secret", "expires_at": 42, "security": security(),
        });
        participant.handle(0, Response { status: 201, body: reply.to_string().into_bytes() }).unwrap();
        let path = std::env::temp_dir().join(format!("cohort-state-{}.json", std::process::id()));
        save_state(&path, participant.saved_state().unwrap()).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let mut keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "contributions",
                "credential",
                "expires_at",
                "identity_seed",
                "last_completed_round",
                "last_contributed_round",
                "last_session",
                "participant_id",
                "security",
                "task_id"
            ]
        );
        assert_eq!(json["security"], security(), "the pinned parameters round-trip");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        }
        let loaded = load_state(&path).unwrap().unwrap();
        assert_eq!((loaded.participant_id.as_str(), loaded.expires_at), ("p7", 42));
        std::fs::write(&path, b"{not json").unwrap();
        assert!(matches!(load_state(&path), Err(RunError::State { .. })));
        std::fs::remove_file(&path).unwrap();
        assert!(load_state(&path).unwrap().is_none());
    }
}
