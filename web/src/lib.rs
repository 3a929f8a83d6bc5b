//! `cohort-web`: the Cohort client in the browser.
//!
//! A [`WebClient`] wraps `cohort-client`'s sans-IO [`Participant`] for
//! JavaScript (wasm-bindgen). JavaScript owns the I/O and the clock, as
//! the participant's design intends: in a Web Worker it loops
//!
//! ```text
//! const action = JSON.parse(client.next(performance.now()));
//! switch (action.kind) {
//!   case "send":  fetch(base + action.path, ...) then client.handle(now, status, bytes)
//!                 (or client.transport_failed(now, String(error)));
//!   case "wait":  sleep action.ms;
//!   case "train": client.train()  (or client.submit(delta, examples, metricsJson));
//!   case "round_ended", "finished": report.
//! }
//! ```
//!
//! The secure-aggregation client, the masking, retries and stage timeouts
//! are all `cohort-client`'s; nothing protocol-related happens in
//! JavaScript, which only ever sees masked bytes. No tokio, no threads.
//!
//! The logic lives in [`Core`] (plain Rust, tested natively); [`WebClient`]
//! only converts its errors ([`WebError`]) to JavaScript exceptions, in one
//! place.

use cohort_client::checkpoint::Checkpoint;
use cohort_client::data::{DataError, Dataset};
use cohort_client::local::{LocalTraining, Pause, SettingsError};
use cohort_client::participant::{
    Action, Method, Metric, MetricValues, Participant, ParticipantConfig, ParticipantError, Policy, Request,
    Response, RoundOutcome, SavedState,
};
use cohort_client::partition::PartitionError;
use cohort_client::partition::histogram;
use cohort_client::runtime::UpdateError;
use cohort_client::train::TrainConfig;
use serde_json::{Value, json};
use std::sync::{Mutex, Once, PoisonError};
use zeroize::{Zeroize, Zeroizing};

use wasm_bindgen::prelude::*;

pub mod bench;
pub mod demo;
pub mod host;
use demo::digits_shard;

/// Why a call of the browser client failed; JavaScript gets an `Error`
/// with this message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WebError {
    /// The task id or the enrollment token is empty.
    #[error("the task id and the enrollment token are required")]
    MissingCredentials,
    /// The client policy is not valid JSON of a policy.
    #[error("policy: {0}")]
    Policy(serde_json::Error),
    /// The saved state is not valid JSON of a saved state.
    #[error("saved state: {0}")]
    SavedState(serde_json::Error),
    /// The saved state is another task's.
    #[error("the saved state belongs to task {0}")]
    OtherTask(String),
    /// The page's examples, or the demo's digits, were refused.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The demo's shard does not exist.
    #[error("shard {shard} of {shards} does not exist")]
    NoShard {
        /// The shard asked for.
        shard: usize,
        /// The number of shards.
        shards: usize,
    },
    /// The demo's digits could not be split.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// Epochs, batch size or learning rate out of range.
    #[error(transparent)]
    TrainingConfig(#[from] SettingsError),
    /// `train` without a `train` action before it.
    #[error("train comes after a train action")]
    NoTrainAction,
    /// Local training gave no update.
    #[error(transparent)]
    Update(#[from] UpdateError),
    /// The metrics the page handed over are not a JSON object of metrics.
    #[error("metrics: {0}")]
    Metrics(serde_json::Error),
    /// A metric is out of its range.
    #[error(transparent)]
    Metric(#[from] cohort_client::participant::QuantizeError),
    /// An earlier call panicked: the client is stopped for good (reload
    /// the page; the saved state, if kept, resumes the enrollment).
    #[error("the client stopped after an internal error ({0}); reload the page")]
    Stopped(String),
    /// The participant cannot go on: refused by its policy, an unreachable
    /// coordinator, an update that does not fit the round or comes at the
    /// wrong time.
    #[error(transparent)]
    Participant(#[from] ParticipantError),
}

/// The browser client's logic, independent of wasm-bindgen.
pub struct Core {
    participant: Participant,
    request: Option<Request>,
    global: Option<Box<Checkpoint>>,
    round: u64,
    /// The client's own count of its contributions: seeds local training.
    nonce: u64,
    local: LocalTraining,
    pause: Pause,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core").field("participant", &self.participant).finish_non_exhaustive()
    }
}

impl Core {
    /// A client of `task_id`; with `saved_state` (from
    /// [`saved_state`](Self::saved_state)) it goes on as the participant
    /// it was. `policy` is the client policy as JSON (the fields of
    /// [`Policy`]; those left out keep the defaults, which are for a
    /// coordinator the client does not trust); `None`: the default.
    pub fn new(
        task_id: &str,
        enrollment_token: &str,
        saved_state: Option<&str>,
        policy: Option<&str>,
    ) -> Result<Self, WebError> {
        if task_id.is_empty() || enrollment_token.is_empty() {
            return Err(WebError::MissingCredentials);
        }
        let policy = match policy {
            Some(json) => serde_json::from_str::<Policy>(json).map_err(WebError::Policy)?,
            None => Policy::default(),
        };
        let config = ParticipantConfig { policy, ..ParticipantConfig::default() };
        let participant = match saved_state {
            Some(json) => {
                let saved: SavedState = serde_json::from_str(json).map_err(WebError::SavedState)?;
                if saved.task_id != task_id {
                    return Err(WebError::OtherTask(saved.task_id.clone()));
                }
                Participant::resume(saved, Some(enrollment_token), config)
            }
            None => Participant::enroll(task_id, enrollment_token, config),
        };
        Ok(Self {
            participant,
            request: None,
            global: None,
            round: 0,
            nonce: 0,
            local: LocalTraining::new(),
            pause: Pause::in_memory(),
        })
    }

    /// Local training examples (row-major features).
    pub fn set_training_data(
        &mut self,
        features: Vec<f32>,
        columns: usize,
        labels: Vec<u8>,
    ) -> Result<(), WebError> {
        self.local.set_data(Dataset::from_rows(features, columns, labels)?);
        Ok(())
    }

    /// Local held-out examples, on which each round's global model is
    /// evaluated.
    pub fn set_test_data(
        &mut self,
        features: Vec<f32>,
        columns: usize,
        labels: Vec<u8>,
    ) -> Result<(), WebError> {
        self.local.set_test_data(Dataset::from_rows(features, columns, labels)?);
        Ok(())
    }

    /// The demo's digits, tab `shard` of `shards` (see [`digits_shard`]):
    /// training and test data at once. Returns a summary: examples, and
    /// examples per digit.
    pub fn use_digits(
        &mut self,
        images: &[u8],
        labels: &[u8],
        shard: usize,
        shards: usize,
    ) -> Result<Value, WebError> {
        let (train, test) = digits_shard(images, labels, shard, shards)?;
        let all: Vec<usize> = (0..train.len()).collect();
        let summary = json!({
            "examples": train.len(),
            "test_examples": test.len(),
            "per_digit": histogram(&train.labels, &all, train.classes),
        });
        self.local.set_data(train);
        self.local.set_test_data(test);
        Ok(summary)
    }

    /// Local SGD settings.
    pub fn set_training_config(
        &mut self,
        epochs: u32,
        batch_size: u32,
        learning_rate: f32,
    ) -> Result<(), WebError> {
        Ok(self.local.set_config(epochs, batch_size, learning_rate)?)
    }

    /// The local SGD settings in force.
    pub fn training_config(&self) -> TrainConfig {
        self.local.config()
    }

    /// Pauses: a round under way is left (the coordinator counts a
    /// dropout) and [`next`](Self::next) answers `wait` until
    /// [`resume`](Self::resume).
    pub fn pause(&mut self) {
        // An in-memory pause cannot fail to be written.
        let _ = self.pause.pause();
        self.participant.vanish("paused by the page");
    }

    /// Lifts a pause.
    pub fn resume(&mut self) {
        let _ = self.pause.resume();
    }

    /// Whether the client is paused.
    pub fn is_paused(&self) -> bool {
        self.pause.is_paused()
    }

    /// The next action as JSON (see the crate docs); a `send` action's
    /// body is then available from [`request_body`](Self::request_body).
    pub fn next(&mut self, now: u64) -> Value {
        if self.pause.is_paused() {
            return json!({ "kind": "wait", "ms": 1000, "paused": true });
        }
        match self.participant.next(now) {
            Action::Send(request) => {
                let action = json!({
                    "kind": "send",
                    "method": match request.method { Method::Get => "GET", Method::Post => "POST" },
                    "path": request.path,
                    "content_type": request.content_type,
                    "bearer": request.bearer,
                    "stage": self.participant.posting().map(|s| s.to_string()),
                });
                self.request = Some(request);
                action
            }
            Action::Wait(ms) => json!({ "kind": "wait", "ms": ms }),
            Action::Train { round, nonce, model } => {
                let parameters = model.weights.len();
                self.round = round;
                self.nonce = nonce;
                self.global = Some(model);
                json!({ "kind": "train", "round": round, "parameters": parameters })
            }
            Action::RoundEnded(outcome) => {
                let report = *outcome.report();
                let (name, reason, rule) = match outcome {
                    RoundOutcome::Completed(_) => ("completed", None, None),
                    RoundOutcome::Dropped { reason, .. } => ("dropped", Some(reason), None),
                    RoundOutcome::Abandoned { reason, .. } => ("abandoned", Some(reason), None),
                    RoundOutcome::Refused { violation, .. } => {
                        ("refused", Some(violation.to_string()), Some(violation.rule()))
                    }
                };
                json!({
                    "kind": "round_ended", "outcome": name, "round": report.round,
                    "bytes_up": report.bytes_up, "bytes_down": report.bytes_down, "reason": reason,
                    "rule": rule,
                })
            }
            Action::HostWork => match (self.participant.host_work(), self.participant.host_step()) {
                (Some(work), Some(step)) => host::describe(&work, step),
                _ => json!({ "kind": "wait", "ms": 0 }),
            },
            Action::Finished => json!({ "kind": "finished" }),
        }
    }

    /// Whether each stage's agreements and key streams go to the page
    /// (`host_work` actions; see [`host`]).
    pub fn set_host_crypto(&mut self, on: bool) {
        self.participant.set_host_crypto(on);
    }

    /// The step number of the pending `host_work`, if any.
    pub fn host_step(&self) -> Option<u64> {
        self.participant.host_step()
    }

    /// The secret key of a `host_work` action's agreements.
    pub fn host_secret(&self) -> Option<Zeroizing<Vec<u8>>> {
        host::secret(self.participant.host_work())
    }

    /// The peers' public keys of a `host_work` action's agreements.
    pub fn host_peers(&self) -> Option<Vec<u8>> {
        host::peers(self.participant.host_work())
    }

    /// The key of mask `index` of a `host_work` action's key streams.
    pub fn host_key(&self, index: usize) -> Option<Zeroizing<Vec<u8>>> {
        host::key(self.participant.host_work(), index)
    }

    /// The page's agreements (see [`host::agreements`]); the step goes on.
    pub fn agreed(&mut self, shared: &mut [u8], supplied: &[u8]) -> Result<(), WebError> {
        let shared = host::agreements(shared, supplied)
            .ok_or(ParticipantError::OutOfOrder("agreements of the wrong length"))?;
        Ok(self.participant.agreed(shared)?)
    }

    /// The page's key stream of mask `index`, as 32-bit words; `stream`
    /// is wiped.
    pub fn add_key_stream(&mut self, index: usize, stream: &mut [u32]) -> Result<(), WebError> {
        let added = self.participant.add_key_stream(index, stream);
        stream.zeroize();
        Ok(added?)
    }

    /// Completes the step the page was asked to help with.
    pub fn complete_host_work(&mut self) -> Result<(), WebError> {
        Ok(self.participant.complete_host_work()?)
    }

    /// The body of the last `send` action.
    pub fn request_body(&self) -> Vec<u8> {
        self.request.as_ref().map(|r| r.body.clone()).unwrap_or_default()
    }

    /// Reports the response to the last `send` action.
    pub fn handle(&mut self, now: u64, status: u16, body: Vec<u8>) -> Result<(), WebError> {
        self.request = None;
        Ok(self.participant.handle(now, Response { status, body })?)
    }

    /// Reports that the last `send` action got no response.
    pub fn transport_failed(&mut self, now: u64, error: &str) -> Result<(), WebError> {
        self.request = None;
        Ok(self.participant.transport_failed(now, error)?)
    }

    /// After a `train` action: evaluates the global model on the test
    /// data, trains the task's model on the training data and hands the
    /// update to the participant. Returns a JSON report.
    pub fn train(&mut self) -> Result<Value, WebError> {
        let global = self.global.as_ref().ok_or(WebError::NoTrainAction)?;
        let model = LocalTraining::model_for(global)?;
        let update = self.local.update_with(&model, self.nonce, global)?;
        let global_accuracy = self.local.test_accuracy(&model, &global.weights);
        let local = {
            let trained: Vec<f32> = global.weights.iter().zip(&update.delta).map(|(g, d)| g + d).collect();
            self.local.test_accuracy(&model, &trained)
        };
        let (delta, examples, mut metrics) = update.into_parts();
        let report = json!({
            "round": self.round, "examples": examples, "train_loss": metrics.get(Metric::TrainLoss),
            "global_accuracy": global_accuracy, "local_accuracy": local,
        });
        // Inside the masked input with the update (the dashboard charts
        // the means): the global model's accuracy on this tab's held-out data.
        if let Some(accuracy) = global_accuracy {
            metrics.set(Metric::GlobalAccuracy, f64::from(accuracy))?;
        }
        self.participant.submit(delta, examples, metrics)?;
        self.global = None;
        Ok(report)
    }

    /// After a `train` action: hands over an update the page computed,
    /// with its metrics as a JSON object of `train_loss`, `eval_accuracy`
    /// and the like (they travel inside the masked input).
    pub fn submit(&mut self, delta: Vec<f32>, examples: u32, metrics: Option<&str>) -> Result<(), WebError> {
        let metrics = match metrics {
            None => MetricValues::new(),
            Some(json) => parse_metrics(json)?,
        };
        self.global = None;
        Ok(self.participant.submit(delta, examples, metrics)?)
    }

    /// Leaves the current round silently (a closed tab does the same).
    pub fn vanish(&mut self, reason: &str) {
        self.participant.vanish(reason);
    }

    /// The enrollment to keep (JSON; holds the credential: keep it where
    /// only this origin can read it).
    pub fn saved_state(&self) -> Option<String> {
        self.participant.saved_state().and_then(|s| serde_json::to_string(s).ok())
    }

    /// The participant id, once enrolled.
    pub fn participant_id(&self) -> Option<String> {
        self.participant.saved_state().map(|s| s.participant_id.clone())
    }

    /// The request that tells the coordinator this client is leaving, as
    /// `{method, path, bearer}` (`None` before enrollment): a closing tab
    /// sends it with a `keepalive` fetch so that no round waits for it.
    pub fn leave_request(&self) -> Option<Value> {
        self.participant
            .leave_request()
            .map(|request| json!({ "method": "POST", "path": request.path, "bearer": request.bearer }))
    }
}

/// The one conversion at the JavaScript boundary.
fn js(error: WebError) -> JsError {
    JsError::new(&error.to_string())
}

/// Stops the client for good once something panicked. The wasm build
/// aborts on a panic: the JavaScript call throws a `RuntimeError` and the
/// module's memory may be left halfway through an update, so every later
/// call is refused with the panic's message instead of running on that
/// state.
#[derive(Debug)]
pub struct Latch {
    /// The message of the panic that tripped it; `None` while untripped.
    message: Mutex<Option<String>>,
}

impl Latch {
    /// An untripped latch.
    pub const fn new() -> Self {
        Self { message: Mutex::new(None) }
    }

    /// Trips the latch; the first message is kept.
    pub fn trip(&self, message: String) {
        self.message.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(message);
    }

    /// `Ok` until the latch trips, then the stop with its message.
    pub fn check(&self) -> Result<(), WebError> {
        self.reason().map_or(Ok(()), |message| Err(WebError::Stopped(message)))
    }

    /// The message of the panic that tripped it.
    pub fn reason(&self) -> Option<String> {
        self.message.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl Default for Latch {
    fn default() -> Self {
        Self::new()
    }
}

/// The latch of this module's clients.
static LATCH: Latch = Latch::new();

/// Installs (once) the panic hook that trips [`LATCH`].
fn install_panic_hook() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            LATCH.trip(info.to_string());
            previous(info);
        }));
    });
}

/// Refused once anything panicked.
fn live() -> Result<(), JsError> {
    LATCH.check().map_err(js)
}

/// Why the clients of this module stopped (the message of the panic), or
/// `undefined` while they run. A driver that catches an exception from a
/// client asks this to tell an internal error from a refusal.
#[wasm_bindgen(js_name = stoppedReason)]
pub fn stopped_reason() -> Option<String> {
    LATCH.reason()
}

fn millis(now: f64) -> u64 {
    if now.is_finite() && now > 0.0 { now as u64 } else { 0 }
}

/// The browser client, for JavaScript: [`Core`] with exceptions.
#[wasm_bindgen]
#[derive(Debug)]
pub struct WebClient {
    core: Core,
}

#[wasm_bindgen]
impl WebClient {
    /// `new WebClient(taskId, enrollmentToken, savedState?)`.
    #[wasm_bindgen(constructor)]
    pub fn new(
        task_id: &str,
        enrollment_token: &str,
        saved_state: Option<String>,
        policy: Option<String>,
    ) -> Result<WebClient, JsError> {
        install_panic_hook();
        live()?;
        Core::new(task_id, enrollment_token, saved_state.as_deref(), policy.as_deref())
            .map(|core| WebClient { core })
            .map_err(js)
    }

    /// Local training examples: `labels.length` rows of `columns` features.
    pub fn set_training_data(
        &mut self,
        features: Vec<f32>,
        columns: usize,
        labels: Vec<u8>,
    ) -> Result<(), JsError> {
        live()?;
        self.core.set_training_data(features, columns, labels).map_err(js)
    }

    /// Local held-out examples for evaluating each round's global model.
    pub fn set_test_data(
        &mut self,
        features: Vec<f32>,
        columns: usize,
        labels: Vec<u8>,
    ) -> Result<(), JsError> {
        live()?;
        self.core.set_test_data(features, columns, labels).map_err(js)
    }

    /// The demo's digits (IDX images and labels), tab `shard` of `shards`:
    /// sets training and test data; returns a JSON summary.
    pub fn use_digits(
        &mut self,
        images: &[u8],
        labels: &[u8],
        shard: usize,
        shards: usize,
    ) -> Result<String, JsError> {
        live()?;
        self.core.use_digits(images, labels, shard, shards).map(|v| v.to_string()).map_err(js)
    }

    /// Local SGD settings (defaults 1 epoch, batch 10, learning rate 0.05);
    /// an `undefined` one keeps its current value.
    pub fn set_training_config(
        &mut self,
        epochs: Option<u32>,
        batch_size: Option<u32>,
        learning_rate: Option<f32>,
    ) -> Result<(), JsError> {
        live()?;
        let current = self.core.training_config();
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.core
            .set_training_config(
                epochs.unwrap_or(count(current.epochs)),
                batch_size.unwrap_or(count(current.batch_size)),
                learning_rate.unwrap_or(current.learning_rate),
            )
            .map_err(js)
    }

    /// The next action, as JSON; `now` in milliseconds (`performance.now()`).
    pub fn next(&mut self, now: f64) -> Result<String, JsError> {
        live()?;
        Ok(self.core.next(millis(now)).to_string())
    }

    /// The body of the last `send` action.
    pub fn request_body(&self) -> Result<Vec<u8>, JsError> {
        live()?;
        Ok(self.core.request_body())
    }

    /// Reports the response to the last `send` action.
    pub fn handle(&mut self, now: f64, status: u16, body: Vec<u8>) -> Result<(), JsError> {
        live()?;
        self.core.handle(millis(now), status, body).map_err(js)
    }

    /// Reports that the last `send` action got no response.
    pub fn transport_failed(&mut self, now: f64, error: &str) -> Result<(), JsError> {
        live()?;
        self.core.transport_failed(millis(now), error).map_err(js)
    }

    /// Trains on the local data after a `train` action; returns a JSON report.
    pub fn train(&mut self) -> Result<String, JsError> {
        live()?;
        self.core.train().map(|report| report.to_string()).map_err(js)
    }

    /// Hands over an update the page computed, after a `train` action,
    /// with its metrics as JSON (`{"train_loss": 0.4}`) or `undefined`.
    pub fn submit(&mut self, delta: Vec<f32>, examples: u32, metrics: Option<String>) -> Result<(), JsError> {
        live()?;
        self.core.submit(delta, examples, metrics.as_deref()).map_err(js)
    }

    /// Leaves the current round silently.
    pub fn vanish(&mut self, reason: &str) -> Result<(), JsError> {
        live()?;
        self.core.vanish(reason);
        Ok(())
    }

    /// Pauses: a round under way is left and `next` answers `wait` (with
    /// `paused: true`) until `resume`.
    pub fn pause(&mut self) -> Result<(), JsError> {
        live()?;
        self.core.pause();
        Ok(())
    }

    /// Lifts a pause.
    pub fn resume(&mut self) -> Result<(), JsError> {
        live()?;
        self.core.resume();
        Ok(())
    }

    /// Whether the client is paused.
    pub fn is_paused(&self) -> bool {
        self.core.is_paused()
    }

    /// Whether each stage's X25519 agreements and mask key streams come
    /// to the page as `host_work` actions (`web/static/webcrypto.js`
    /// computes them with WebCrypto); off until set.
    pub fn set_host_crypto(&mut self, on: bool) -> Result<(), JsError> {
        live()?;
        self.core.set_host_crypto(on);
        Ok(())
    }

    /// The `step` of the `host_work` action still pending, if any: work
    /// for another step (one a pause or a leave ended) is not handed back.
    pub fn host_step(&self) -> Result<Option<f64>, JsError> {
        live()?;
        Ok(self.core.host_step().map(|step| step as f64))
    }

    /// After a `host_work` action for agreements: this client's secret
    /// key (32 bytes; wipe it once imported).
    pub fn host_secret(&self) -> Result<Option<js_sys::Uint8Array>, JsError> {
        live()?;
        Ok(host::to_js(self.core.host_secret()))
    }

    /// After a `host_work` action for agreements: the peers' public keys,
    /// 32 bytes each.
    pub fn host_peers(&self) -> Result<Option<Vec<u8>>, JsError> {
        live()?;
        Ok(self.core.host_peers())
    }

    /// After a `host_work` action for key streams: the AES-128 key of
    /// mask `index` (wipe it once imported).
    pub fn host_key(&self, index: usize) -> Result<Option<js_sys::Uint8Array>, JsError> {
        live()?;
        Ok(host::to_js(self.core.host_key(index)))
    }

    /// The agreements: 32 bytes per peer, and a byte per peer, non-zero
    /// where the page computed it (the client computes the others).
    pub fn agreed(&mut self, shared: Vec<u8>, supplied: &[u8]) -> Result<(), JsError> {
        let mut shared = Zeroizing::new(shared);
        live()?;
        self.core.agreed(&mut shared, supplied).map_err(js)
    }

    /// The key stream of mask `index`: AES-128-CTR of zeros, a 128-bit
    /// big-endian counter from zero, as little-endian 32-bit words.
    pub fn add_key_stream(&mut self, index: usize, stream: Vec<u32>) -> Result<(), JsError> {
        let mut stream = Zeroizing::new(stream);
        live()?;
        self.core.add_key_stream(index, &mut stream).map_err(js)
    }

    /// Completes the step of the last `host_work` action, computing what
    /// the page left out.
    pub fn complete_host_work(&mut self) -> Result<(), JsError> {
        live()?;
        self.core.complete_host_work().map_err(js)
    }

    /// The enrollment to keep across page loads (holds the credential).
    pub fn saved_state(&self) -> Result<Option<String>, JsError> {
        live()?;
        Ok(self.core.saved_state())
    }

    /// The participant id, once enrolled.
    pub fn participant_id(&self) -> Result<Option<String>, JsError> {
        live()?;
        Ok(self.core.participant_id())
    }

    /// The request that tells the coordinator this client is leaving
    /// (JSON `{method, path, bearer}`; `undefined` before enrollment).
    pub fn leave_request(&self) -> Result<Option<String>, JsError> {
        live()?;
        Ok(self.core.leave_request().map(|request| request.to_string()))
    }
}

/// Metrics from a JSON object of metric names and numbers.
fn parse_metrics(json: &str) -> Result<MetricValues, WebError> {
    serde_json::from_str(json).map_err(WebError::Metrics)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_client::checkpoint;
    use cohort_client::model::Model;

    fn send(core: &mut Core, now: u64) -> Value {
        let action = core.next(now);
        assert_eq!(action["kind"], "send", "{action}");
        action
    }

    /// A check-in as the browser client sends it: asking to be held for
    /// the library's default wait.
    fn check_in() -> String {
        cohort_client::api::routes::held(
            cohort_client::api::routes::CHECK_IN,
            cohort_client::participant::DEFAULT_WAIT_MS,
        )
    }

    /// A client enrolled as `p1` and selected for `round` as `client_id`.
    fn selected(round: u64, client_id: u32) -> Core {
        let mut core = Core::new("task", "token", None, None).unwrap();
        send(&mut core, 0);
        let enrolled =
            json!({ "participant_id": "p1", "credential": "c", "expires_at": 0, "security": security() });
        core.handle(0, 201, enrolled.to_string().into_bytes()).unwrap();
        send(&mut core, 0);
        let selected = json!({ "status": "selected", "round": round, "client_id": client_id });
        core.handle(0, 200, selected.to_string().into_bytes()).unwrap();
        core
    }

    /// A task the default policy accepts, as an enrollment reply carries it.
    fn security() -> Value {
        json!({
            "variant": "active", "clients": 10, "graph": "complete", "degree": 9, "threshold": 7,
            "modulus_bits": 32, "clip": 1.0, "max_weight": 64, "transform": { "kind": "none" },
        })
    }

    #[test]
    fn the_policy_is_the_pages_to_set_and_a_task_below_it_is_refused() {
        assert!(
            Core::new("task", "token", None, Some("{\"min_clients\": \"ten\"}"))
                .unwrap_err()
                .to_string()
                .contains("policy")
        );
        let mut core = Core::new("task", "token", None, Some(r#"{"min_clients": 20}"#)).unwrap();
        send(&mut core, 0);
        let enrolled =
            json!({ "participant_id": "p9", "credential": "c", "expires_at": 0, "security": security() });
        let refused = core.handle(0, 201, enrolled.to_string().into_bytes()).unwrap_err();
        assert!(matches!(refused, WebError::Participant(ParticipantError::Policy(_))), "{refused:?}");
        assert!(refused.to_string().contains("rule min_clients"), "{refused}");
        assert!(core.saved_state().is_none());
    }

    #[test]
    fn a_client_enrolls_trains_and_resumes_from_its_saved_state() {
        let mut core = Core::new("task", "token", None, None).unwrap();
        let enroll = send(&mut core, 0);
        assert_eq!(
            (enroll["method"].as_str(), enroll["path"].as_str()),
            (Some("POST"), Some("/v1/tasks/task/enroll"))
        );
        assert!(String::from_utf8(core.request_body()).unwrap().contains("token"));
        let enrolled = json!({ "participant_id": "p9", "credential": "c-secret", "expires_at": 0, "security": security() });
        core.handle(0, 201, enrolled.to_string().into_bytes()).unwrap();
        let checkin = send(&mut core, 0);
        assert_eq!(
            (checkin["path"].as_str(), checkin["bearer"].as_str()),
            (Some(check_in().as_str()), Some("c-secret"))
        );
        core.handle(
            0,
            200,
            json!({ "status": "selected", "round": 1, "client_id": 3 }).to_string().into_bytes(),
        )
        .unwrap();
        assert_eq!(send(&mut core, 0)["path"], "/v1/model");
        let model = Model::by_name("logreg", 4, 3).unwrap();
        let bytes =
            checkpoint::encode(&model.layout(), &vec![0.0; model.len()], &Default::default()).unwrap();
        core.handle(0, 200, bytes).unwrap();
        let train = core.next(0);
        assert_eq!((train["kind"].as_str(), train["parameters"].as_u64()), (Some("train"), Some(15)));
        assert!(matches!(core.train(), Err(WebError::Update(UpdateError::NoData))), "no training data yet");
        core.set_training_data((0..24).map(|i| (i % 5) as f32 / 5.0).collect(), 4, vec![0, 1, 2, 0, 1, 2])
            .unwrap();
        assert_eq!(core.train().unwrap()["examples"], 6, "the model waited for the data");
        let saved = core.saved_state().unwrap();
        assert!(saved.contains("c-secret") && saved.contains("p9"));
        let resumed = Core::new("task", "token", Some(&saved), None).unwrap();
        assert_eq!(resumed.participant_id().as_deref(), Some("p9"));
        assert!(
            matches!(Core::new("other", "token", Some(&saved), None), Err(WebError::OtherTask(task)) if task == "task")
        );
        assert!(matches!(Core::new("task", "token", Some("{}"), None), Err(WebError::SavedState(_))));
    }

    #[test]
    fn training_reports_accuracy_and_submits_the_update() {
        let mut core = selected(2, 1);
        send(&mut core, 0);
        let model = Model::by_name("logreg", 4, 3).unwrap();
        let bytes =
            checkpoint::encode(&model.layout(), &vec![0.0; model.len()], &Default::default()).unwrap();
        core.handle(0, 200, bytes).unwrap();
        assert_eq!(core.next(0)["kind"], "train");
        let features: Vec<f32> = (0..60).map(|i| if i % 4 == (i / 4) % 3 { 1.0 } else { 0.0 }).collect();
        let labels: Vec<u8> = (0..15).map(|i| (i % 3) as u8).collect();
        core.set_training_data(features.clone(), 4, labels.clone()).unwrap();
        core.set_test_data(features, 4, labels).unwrap();
        core.set_training_config(20, 5, 0.5).unwrap();
        assert_eq!((core.training_config().epochs, core.training_config().batch_size), (20, 5));
        let report = core.train().unwrap();
        assert_eq!((report["round"].as_u64(), report["examples"].as_u64()), (Some(2), Some(15)));
        // Zeros predict class 0 for everything: a third right; training
        // separates the one-hot classes.
        assert!((report["global_accuracy"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-6, "{report}");
        assert!(report["local_accuracy"].as_f64().unwrap() > 0.99, "{report}");
        // The participant now fetches the round's first server message.
        let fetch = send(&mut core, 0);
        assert_eq!(fetch["method"], "GET");
        assert!(matches!(core.train(), Err(WebError::NoTrainAction)), "one update per round");
    }

    #[test]
    fn a_tripped_latch_refuses_every_call_with_the_first_panic() {
        let latch = Latch::new();
        assert!(latch.check().is_ok() && latch.reason().is_none());
        latch.trip("index out of bounds".into());
        latch.trip("a later panic".into());
        let stopped = latch.check().unwrap_err();
        assert!(
            matches!(&stopped, WebError::Stopped(message) if message == "index out of bounds"),
            "{stopped:?}"
        );
        assert!(stopped.to_string().contains("reload the page"), "{stopped}");
        // The module's own latch is untouched by this one.
        assert!(LATCH.check().is_ok());
    }

    #[test]
    fn a_paused_client_leaves_its_round_and_waits_until_resumed() {
        let mut core = selected(4, 2);
        core.pause();
        assert!(core.is_paused());
        for now in [0, 5_000] {
            let action = core.next(now);
            assert_eq!((action["kind"].as_str(), action["paused"].as_bool()), (Some("wait"), Some(true)));
        }
        core.resume();
        // The round it was selected for was left: it ends as abandoned.
        let ended = core.next(10_000);
        assert_eq!(
            (ended["kind"].as_str(), ended["round"].as_u64()),
            (Some("round_ended"), Some(4)),
            "{ended}"
        );
        assert_eq!(send(&mut core, 10_000)["path"], check_in().as_str());
    }

    #[test]
    fn bad_data_is_refused() {
        let mut core = Core::new("task", "token", None, None).unwrap();
        assert!(matches!(
            core.set_training_data(vec![0.0; 5], 2, vec![0, 1]),
            Err(WebError::Data(DataError::Shape { .. }))
        ));
        assert!(matches!(
            core.set_training_data(vec![f32::INFINITY; 2], 2, vec![0]),
            Err(WebError::Data(DataError::NonFinite))
        ));
        assert!(matches!(core.set_training_config(1, 0, 0.1), Err(WebError::TrainingConfig(_))));
        assert!(matches!(Core::new("", "token", None, None), Err(WebError::MissingCredentials)));
        assert!(
            matches!(core.submit(vec![0.0], 1, None), Err(WebError::Participant(_))),
            "submit needs a train action"
        );
        let parsed = parse_metrics(r#"{"eval_accuracy": 1, "train_loss": 1e9}"#).unwrap();
        // Written back in the vector's order, the loss capped as `set` caps it.
        assert_eq!(serde_json::to_string(&parsed).unwrap(), r#"{"train_loss":4096.0,"eval_accuracy":1.0}"#);
        for bad in [r#"{"f1": 0.5}"#, r#"{"train_loss": "x"}"#, r#"{"eval_accuracy": 2}"#, "[]"] {
            assert!(matches!(parse_metrics(bad), Err(WebError::Metrics(_))), "{bad}");
        }
    }

    /// IDX images (`rows` of 2×2) and labels: digit `i % 10` for row `i`.
    fn digits(rows: u32) -> (Vec<u8>, Vec<u8>) {
        let mut images = vec![0, 0, 8, 3];
        for d in [rows, 2, 2] {
            images.extend_from_slice(&d.to_be_bytes());
        }
        let mut labels = vec![0, 0, 8, 1];
        labels.extend_from_slice(&rows.to_be_bytes());
        for i in 0..rows {
            images.extend([(i % 256) as u8; 4]);
            labels.push((i % 10) as u8);
        }
        (images, labels)
    }

    #[test]
    fn tabs_get_disjoint_skewed_shards_that_hold_every_digit_and_the_same_test_set() {
        let (images, labels) = digits(700);
        let shards: Vec<(Dataset, Dataset)> =
            (0..5).map(|shard| digits_shard(&images, &labels, shard, 5).unwrap()).collect();
        let (a, test_a) = &shards[0];
        let b = &shards[1].0;
        assert!(shards.iter().all(|(_, test)| test == test_a));
        assert_eq!(test_a.len(), 100, "a seventh of each digit is held out");
        assert_eq!(shards.iter().map(|(train, _)| train.len()).sum::<usize>(), 600, "all of the rest, once");
        let mut largest_shares = Vec::new();
        for (train, _) in &shards {
            let mut per_digit = [0usize; 10];
            train.labels.iter().for_each(|&l| per_digit[usize::from(l)] += 1);
            assert!(per_digit.iter().all(|&n| n >= 3), "every tab holds every digit: {per_digit:?}");
            largest_shares.push(*per_digit.iter().max().unwrap() as f64 / train.len() as f64);
        }
        // Label skew: a tab's commonest digit is well above a tenth.
        let mean_largest = largest_shares.iter().sum::<f64>() / 5.0;
        assert!(mean_largest > 0.2, "{largest_shares:?}");
        assert_eq!(&digits_shard(&images, &labels, 0, 5).unwrap().0, a, "deterministic");
        assert!(matches!(
            digits_shard(&images, &labels, 5, 5),
            Err(WebError::NoShard { shard: 5, shards: 5 })
        ));
        assert!(matches!(digits_shard(&images[..20], &labels, 0, 5), Err(WebError::Data(_))));

        let mut core = Core::new("task", "token", None, None).unwrap();
        let summary = core.use_digits(&images, &labels, 1, 5).unwrap();
        assert_eq!(summary["examples"].as_u64(), Some(b.len() as u64));
        let per_digit: u64 =
            summary["per_digit"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum();
        assert_eq!(per_digit, b.len() as u64);
    }
}
