//! `cohort._native`: the Python package's native module, a thin layer over
//! [`cohort_mobile::MobileClient`] (the same safe core as the JVM and C
//! bindings: enrollment kept in a storage directory, pause and resume, one
//! blocking round per call).
//!
//! One round, `NativeClient.participate`: the participant runs on a
//! thread of its own and never touches Python; the calling thread waits
//! for it without the GIL, wakes every 100 ms to let Python handle signals
//! (Ctrl-C), and runs the application's training callback itself when the
//! participant asks for an update, so that a `KeyboardInterrupt` in the
//! middle of training stops at once. The global model crosses to Python as
//! one NumPy array that owns a copy of the weights (no further copy); the
//! local weights cross back as one copy of the application's contiguous
//! `float32` tensors, into zeroizing memory, and the update (local minus
//! global) is computed here against the participant's own copy of the
//! global model. Clipping, quantization, masking, the proof and every
//! request happen with the GIL released.
//!
//! Errors are raised as the classes of `cohort._errors`, one per kind of
//! [`cohort_mobile::Error`]; the package's `__init__` imports that module
//! first.

// PyO3's `#[pymodule]`, `#[pyclass]` and `#[pymethods]` expand to unsafe
// code (the CPython calling convention); this crate writes none itself.
#![allow(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use cohort_client::checkpoint::Checkpoint;
use cohort_client::protocol::{Metric, MetricValues};
use cohort_client::runtime::{Contribution, LocalUpdate, Trainer, UpdateError};
use cohort_mobile::{Config, Error, MobileClient, Outcome, RoundResult, panic_message};
use numpy::{PyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use zeroize::Zeroizing;

/// How often the waiting thread lets Python look at its signals.
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// The Python exception for `error`: an instance of the class of
/// `cohort._errors` named after its kind, with the kind's fields as
/// attributes (`status` and `code` of a refusal, `rule` of a policy).
fn raise(py: Python<'_>, error: &Error) -> PyErr {
    let class = match error {
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::Paused => "PausedError",
        Error::Unreachable(_) => "UnreachableError",
        Error::Unauthorized(_) => "UnauthorizedError",
        Error::TaskNotFound(_) => "TaskNotFoundError",
        Error::Rejected { .. } => "RejectedError",
        Error::Protocol(_) => "ProtocolError",
        Error::InvalidUpdate(_) => "InvalidUpdateError",
        Error::Storage(_) => "StorageError",
        Error::PolicyRefused { .. } => "PolicyError",
        _ => "InternalError",
    };
    let build = || -> PyResult<PyErr> {
        let exception = py.import("cohort._errors")?.getattr(class)?.call1((error.to_string(),))?;
        match error {
            Error::Rejected { status, code, .. } => {
                exception.setattr("status", status)?;
                exception.setattr("code", code)?;
            }
            Error::PolicyRefused { rule, .. } => exception.setattr("rule", rule)?,
            _ => {}
        }
        Ok(PyErr::from_value(exception))
    };
    build().unwrap_or_else(|e| e)
}

/// What the participant's thread asks of the calling thread.
enum Ask {
    /// Train from these weights and answer with the update.
    Train { contribution: Contribution, weights: Vec<f32>, layout: Vec<(String, Vec<usize>)> },
    /// The round is over for this client.
    Done(Result<RoundResult, Error>),
}

/// The participant's side of a round's callback: hands the model to the
/// calling thread and waits for its update, or gives up when the client is
/// paused or left meanwhile (from the training function itself, another
/// thread or a signal handler), so that no lock waits for training.
struct Relay {
    ask: mpsc::Sender<Ask>,
    answers: mpsc::Receiver<Result<Trained, String>>,
    client: Arc<MobileClient>,
}

/// The application's answer: its local weights (not yet the update).
struct Trained {
    weights: Zeroizing<Vec<f32>>,
    examples: u32,
    metrics: MetricValues,
}

impl Trainer for Relay {
    fn train(&mut self, contribution: Contribution, model: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        let weights = model.weights.clone();
        let layout = model.layout.tensors.iter().map(|t| (t.name.clone(), t.shape.clone())).collect();
        self.ask
            .send(Ask::Train { contribution, weights, layout })
            .map_err(|_| UpdateError::Application("the Python side is gone".into()))?;
        let mut trained = loop {
            match self.answers.recv_timeout(SIGNAL_POLL) {
                Ok(answer) => break answer.map_err(UpdateError::Application)?,
                Err(mpsc::RecvTimeoutError::Timeout) if self.client.is_paused() => {
                    return Err(UpdateError::Application("paused or left during training".into()));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(UpdateError::Application("the Python side is gone".into()));
                }
            }
        };
        // The update is computed here, in place, against the participant's
        // own copy of the global model: the application may have changed
        // the arrays it was given.
        trained.weights.iter_mut().zip(&model.weights).for_each(|(local, global)| *local -= global);
        let delta = std::mem::take(&mut *trained.weights);
        Ok(LocalUpdate { delta, examples: trained.examples, metrics: trained.metrics })
    }
}

/// A participant of one task, for the `cohort` package. See the module
/// docs; the Python class `cohort.Client` is the interface meant for
/// applications.
#[pyclass(frozen, module = "cohort._native")]
struct NativeClient {
    inner: Arc<MobileClient>,
    /// A round runs: `participate` is not reentrant.
    busy: AtomicBool,
}

/// Lowers the busy flag when `participate` returns, however it returns.
struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

#[pymethods]
impl NativeClient {
    /// Opens the client: creates `storage_dir` if needed and resumes the
    /// enrollment kept there. Nothing is sent yet.
    #[new]
    #[pyo3(signature = (server_url, task_id, enrollment_token, storage_dir, ca_certificate_pem=None, policy_json=None, max_attempts=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        server_url: String,
        task_id: String,
        enrollment_token: String,
        storage_dir: PathBuf,
        ca_certificate_pem: Option<Vec<u8>>,
        policy_json: Option<String>,
        max_attempts: Option<u32>,
    ) -> PyResult<Self> {
        let config = Config {
            server_url,
            task_id,
            enrollment_token,
            storage_dir,
            ca_certificate_pem,
            policy_json,
            max_attempts,
        };
        let inner = py.detach(|| MobileClient::open(config)).map_err(|e| raise(py, &e))?;
        Ok(Self { inner: Arc::new(inner), busy: AtomicBool::new(false) })
    }

    /// Takes part in the next round this client is selected for; blocks
    /// until it ends. `train(round, nonce, weights, layout)` is called on
    /// this thread with the global model's flat `float32` weights and its
    /// layout (a list of `(name, shape)`), and returns
    /// `(tensors, examples, metrics)`: the local weights after training, a
    /// list of C-contiguous `float32` arrays in the layout's order and
    /// shapes, the number of local examples, and a dict of the round's
    /// metrics by name (or `None`). Returns
    /// `(outcome, round, bytes_up, bytes_down, reason)`.
    ///
    /// An exception in `train`, or a signal's (Ctrl-C's
    /// `KeyboardInterrupt`), leaves the round (a dropout), tells the
    /// coordinator this client leaves, and is raised here.
    fn participate(&self, py: Python<'_>, train: Bound<'_, PyAny>) -> PyResult<Py<PyTuple>> {
        if self.busy.swap(true, Ordering::SeqCst) {
            return Err(raise(
                py,
                &Error::InvalidArgument(
                    "a round is already running on this client (participate is not reentrant)".into(),
                ),
            ));
        }
        let _busy = Busy(&self.busy);
        let (ask, mut asked) = mpsc::channel::<Ask>();
        let (answer, answers) = mpsc::channel::<Result<Trained, String>>();
        let client = Arc::clone(&self.inner);
        let done = ask.clone();
        // Not a scoped thread: after a second Ctrl-C this call returns
        // while the participant finishes leaving on its own.
        std::thread::spawn(move || {
            let mut relay = Relay { ask, answers, client: Arc::clone(&client) };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                client.participate(Some(&mut relay))
            }))
            .unwrap_or_else(|panic| Err(Error::Internal(panic_message(&*panic))));
            let _ = done.send(Ask::Done(result));
        });
        loop {
            let (next, receiver) = py.detach(move || (asked.recv_timeout(SIGNAL_POLL), asked));
            asked = receiver;
            let failure = match next {
                Ok(Ask::Done(result)) => {
                    return result.map_err(|e| raise(py, &e)).and_then(|r| round_tuple(py, &r));
                }
                Ok(Ask::Train { contribution, weights, layout }) => {
                    match call_train(py, &train, contribution, weights, &layout) {
                        Ok(update) => {
                            let _ = answer.send(Ok(update));
                            continue;
                        }
                        Err(error) => error,
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => match py.check_signals() {
                    Ok(()) => continue,
                    Err(error) => error,
                },
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(raise(py, &Error::Internal("the participant's thread ended".into())));
                }
            };
            // Stop: the participant's thread gets no update, leaves the
            // round and returns; then the coordinator is told. That is
            // waited for while Python may still interrupt the wait (a
            // second Ctrl-C): the leave then goes on in its thread.
            let _ = answer.send(Err("stopped by the application".into()));
            let (left, mut leaving) = mpsc::channel::<bool>();
            let client = Arc::clone(&self.inner);
            std::thread::spawn(move || {
                let _ = left.send(client.leave());
            });
            loop {
                let (next, receiver) = py.detach(move || (leaving.recv_timeout(SIGNAL_POLL), leaving));
                leaving = receiver;
                match next {
                    Err(mpsc::RecvTimeoutError::Timeout) if py.check_signals().is_ok() => {}
                    _ => break,
                }
            }
            return Err(failure);
        }
    }

    /// Pauses: a running `participate` leaves its round and returns
    /// `PausedError` once the request in flight returns (at most 5 s; a
    /// training function that is running finishes first), and so does every later one until `resume`, also
    /// after a restart (the pause is kept in the storage directory).
    fn pause(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.pause().map_err(|e| raise(py, &e))
    }

    /// Lifts a pause.
    fn resume(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.resume().map_err(|e| raise(py, &e))
    }

    /// Whether the client is paused.
    #[getter]
    fn paused(&self) -> bool {
        self.inner.is_paused()
    }

    /// Stops a running `participate` (which returns `PausedError`) and
    /// tells the coordinator that this client leaves (it is not selected
    /// until it takes part again); whether the coordinator acknowledged it.
    fn leave(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.leave())
    }

    /// The participant id the coordinator assigned, once enrolled.
    #[getter]
    fn participant_id(&self) -> Option<String> {
        self.inner.participant_id()
    }

    /// The last round this client completed (0 before any).
    #[getter]
    fn last_completed_round(&self) -> u64 {
        self.inner.last_completed_round()
    }

    /// In a task with differential privacy, the ε this client's
    /// contributions have spent by its own accounting against its policy's
    /// budget (at the budget's δ, no amplification by sampling); `None`
    /// before its first contribution to such a task, or without a budget.
    #[getter]
    fn privacy_spent(&self) -> Option<f64> {
        self.inner.privacy_spent()
    }

    /// The global model of the last round this client trained in, flat.
    fn global_model<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<f32>>> {
        self.inner.global_model().map(|weights| PyArray1::from_vec(py, weights))
    }
}

fn round_tuple(py: Python<'_>, result: &RoundResult) -> PyResult<Py<PyTuple>> {
    let outcome = match result.outcome {
        Outcome::Completed => "completed",
        Outcome::Dropped => "dropped",
        Outcome::Abandoned => "abandoned",
        Outcome::TaskFinished => "task_finished",
        Outcome::Refused => "refused",
    };
    Ok(PyTuple::new(
        py,
        [
            outcome.into_pyobject(py)?.into_any(),
            result.round.into_pyobject(py)?.into_any(),
            result.bytes_up.into_pyobject(py)?.into_any(),
            result.bytes_down.into_pyobject(py)?.into_any(),
            result.reason.clone().into_pyobject(py)?.into_any(),
        ],
    )?
    .unbind())
}

/// Calls the application's `train` and reads its answer: the local
/// weights in the layout's order, the examples and the metrics.
fn call_train(
    py: Python<'_>,
    train: &Bound<'_, PyAny>,
    contribution: Contribution,
    weights: Vec<f32>,
    layout: &[(String, Vec<usize>)],
) -> PyResult<Trained> {
    let parameters = weights.len();
    let weights = PyArray1::from_vec(py, weights);
    let tensors = PyList::empty(py);
    for (name, shape) in layout {
        tensors.append((name, PyTuple::new(py, shape)?))?;
    }
    let answer = train.call1((contribution.round, contribution.nonce, weights, tensors))?;
    let (local, examples, metrics): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) = answer
        .extract()
        .map_err(|_| PyTypeError::new_err("train must return a tuple (tensors, examples, metrics)"))?;
    let invalid = |message: String| raise(py, &Error::InvalidUpdate(message));
    let local =
        local.cast::<PyList>().map_err(|_| invalid("the local weights must be a list of arrays".into()))?;
    if local.len() != layout.len() {
        return Err(invalid(format!("{} tensors for a model of {}", local.len(), layout.len())));
    }
    let mut flat = Vec::with_capacity(parameters);
    for (array, (name, shape)) in local.iter().zip(layout) {
        let array: PyReadonlyArrayDyn<'_, f32> = array
            .extract()
            .map_err(|_| invalid(format!("tensor {name}: {}, not a float32 array", array.get_type())))?;
        if array.shape() != shape.as_slice() {
            return Err(invalid(format!(
                "tensor {name} has shape {:?}, the model's is {shape:?}",
                array.shape()
            )));
        }
        // as_slice also takes Fortran order, which would be read scrambled.
        let values = array
            .as_slice()
            .ok()
            .filter(|_| array.is_c_contiguous())
            .ok_or_else(|| invalid(format!("tensor {name} is not contiguous in C order")))?;
        flat.extend_from_slice(values);
    }
    let examples: u32 = examples
        .extract()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| invalid("examples must be an integer from 1 to 4294967295".into()))?;
    let mut values = MetricValues::new();
    if !metrics.is_none() {
        let metrics = metrics.cast::<PyDict>().map_err(|_| invalid("metrics must be a dict".into()))?;
        for (name, value) in metrics.iter() {
            let name: String = name.extract().map_err(|_| invalid("metric names must be strings".into()))?;
            let metric = Metric::from_name(&name).ok_or_else(|| {
                invalid(format!(
                    "unknown metric {name:?}: the metrics are {}",
                    Metric::ALL.map(Metric::name).join(", ")
                ))
            })?;
            let value: f64 =
                value.extract().map_err(|_| invalid(format!("metric {name} is not a number")))?;
            values.set(metric, value).map_err(|e| invalid(format!("metric {name}: {e}")))?;
        }
    }
    Ok(Trained { weights: Zeroizing::new(flat), examples, metrics: values })
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<NativeClient>()?;
    module.add("PROTOCOL_VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
