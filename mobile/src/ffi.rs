//! The C ABI. `include/cohort.h` is generated from this file by cbindgen
//! (a test fails when it is stale; `COHORT_BLESS=1 cargo test -p
//! cohort-mobile --test header` rewrites it).
//!
//! Conventions:
//! * a [`CohortClient`] is an opaque handle from [`cohort_client_open`],
//!   released with [`cohort_client_free`];
//! * every function returns a [`CohortStatus`]; on failure,
//!   [`cohort_last_error`] copies the message of the calling thread's last
//!   failure;
//! * the functions may be called from any thread, and
//!   [`cohort_client_pause`] from another thread stops a running
//!   [`cohort_client_participate`]; [`cohort_client_free`] must not race
//!   with any other call on the same handle;
//! * no panic unwinds into the caller: it becomes [`CohortStatus::Internal`].

use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use cohort_client::checkpoint::Checkpoint;
use cohort_client::runtime::{Contribution, LocalUpdate, Trainer, UpdateError};

use crate::{Config, Error, MobileClient, Outcome, RoundResult, TrainingData};

/// A client handle; opaque to C.
pub struct CohortClient(MobileClient);

/// Result of every call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CohortStatus {
    /// Success.
    Ok = 0,
    /// A null pointer, bad UTF-8, mismatched lengths, labels out of range…
    InvalidArgument = 1,
    /// The client is paused.
    Paused = 2,
    /// The coordinator did not answer after every retry.
    Unreachable = 3,
    /// The enrollment token or the credential was refused.
    Unauthorized = 4,
    /// No such task.
    TaskNotFound = 5,
    /// The coordinator refused a request.
    Rejected = 6,
    /// The coordinator answered something that is not its API.
    Protocol = 7,
    /// The update does not fit the round's model.
    InvalidUpdate = 8,
    /// The storage directory could not be read or written.
    Storage = 9,
    /// A bug; the message says more.
    Internal = 10,
    /// The task or a round is below the client's client policy, or changed
    /// since enrollment; nothing was revealed. The message names the rule.
    PolicyRefused = 11,
}

impl From<&Error> for CohortStatus {
    fn from(error: &Error) -> Self {
        match error {
            Error::InvalidArgument(_) => Self::InvalidArgument,
            Error::Paused => Self::Paused,
            Error::Unreachable(_) => Self::Unreachable,
            Error::Unauthorized(_) => Self::Unauthorized,
            Error::TaskNotFound(_) => Self::TaskNotFound,
            Error::Rejected { .. } => Self::Rejected,
            Error::Protocol(_) => Self::Protocol,
            Error::InvalidUpdate(_) => Self::InvalidUpdate,
            Error::Storage(_) => Self::Storage,
            Error::Internal(_) => Self::Internal,
            Error::PolicyRefused { .. } => Self::PolicyRefused,
        }
    }
}

/// How a round ended.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CohortOutcome {
    /// The update went into the round's aggregate.
    Completed = 0,
    /// The server dropped this client (too slow).
    Dropped = 1,
    /// This client gave up on the round.
    Abandoned = 2,
    /// The task is over; there will be no more rounds.
    TaskFinished = 3,
    /// This client refused the round before revealing anything (a replay,
    /// or not the round it was selected for).
    Refused = 4,
}

impl From<Outcome> for CohortOutcome {
    fn from(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Completed => Self::Completed,
            Outcome::Dropped => Self::Dropped,
            Outcome::Abandoned => Self::Abandoned,
            Outcome::TaskFinished => Self::TaskFinished,
            Outcome::Refused => Self::Refused,
        }
    }
}

/// Where and as whom to take part. Strings are NUL-terminated UTF-8;
/// `ca_certificate_pem` may be null (trust the web PKI), and so may
/// `policy_json` (the default client policy, for a coordinator the app
/// does not trust).
#[repr(C)]
#[derive(Debug)]
pub struct CohortConfig {
    /// Coordinator base URL.
    pub server_url: *const c_char,
    /// Task id.
    pub task_id: *const c_char,
    /// Enrollment token.
    pub enrollment_token: *const c_char,
    /// A directory private to the app.
    pub storage_dir: *const c_char,
    /// PEM of the CA certificate(s) to trust, or null.
    pub ca_certificate_pem: *const c_char,
    /// The client policy as JSON (e.g. `{"min_clients": 20}`; fields left
    /// out keep their defaults), or null for the default.
    pub policy_json: *const c_char,
}

/// What [`cohort_client_participate`] did.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CohortRoundResult {
    /// How the round ended.
    pub outcome: CohortOutcome,
    /// Round number (0 when the task was over).
    pub round: u64,
    /// Bytes sent.
    pub bytes_up: u64,
    /// Bytes received.
    pub bytes_down: u64,
}

/// Computes the app's update for a round: `global` holds the global model
/// (`parameters` values); write the update (local − global) to `delta`
/// (`parameters` values, zeroed) and its weight, the number of local
/// examples, to `examples`. Return 0 on success; anything else abandons
/// the round. Called on the thread of [`cohort_client_participate`].
pub type CohortTrainFn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        round: u64,
        global: *const f32,
        parameters: usize,
        delta: *mut f32,
        examples: *mut u32,
    ) -> i32,
>;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Runs `body`, catching panics, and records the failure for
/// [`cohort_last_error`].
fn guard(body: impl FnOnce() -> Result<(), Error>) -> CohortStatus {
    let result = catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|panic| Err(Error::Internal(format!("panic: {}", crate::panic_message(&*panic)))));
    match result {
        Ok(()) => CohortStatus::Ok,
        Err(error) => {
            let status = CohortStatus::from(&error);
            LAST_ERROR.with(|last| *last.borrow_mut() = error.to_string());
            status
        }
    }
}

fn null(what: &str) -> Error {
    Error::InvalidArgument(format!("{what} is null"))
}

/// # Safety
/// `pointer` is null or a NUL-terminated string valid for this call.
unsafe fn string(pointer: *const c_char, what: &str) -> Result<String, Error> {
    if pointer.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string
    // that outlives this call.
    let text = unsafe { CStr::from_ptr(pointer) };
    text.to_str().map(str::to_owned).map_err(|_| Error::InvalidArgument(format!("{what} is not UTF-8")))
}

/// # Safety
/// `client` is null or a live handle from [`cohort_client_open`].
unsafe fn handle<'a>(client: *const CohortClient) -> Result<&'a MobileClient, Error> {
    // SAFETY: the caller promises a live handle (or null, which `as_ref`
    // turns into `None`); handles are only ever shared, never mutated
    // through, so a shared reference is sound.
    unsafe { client.as_ref() }.map(|c| &c.0).ok_or_else(|| null("the client handle"))
}

/// Opens a client (nothing is sent yet) and stores its handle in `out`.
///
/// # Safety
/// `config` points to a valid [`CohortConfig`] whose strings live for the
/// call; `out` points to writable storage for a handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_open(
    config: *const CohortConfig,
    out: *mut *mut CohortClient,
) -> CohortStatus {
    guard(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller promises a valid config or null.
        let config = unsafe { config.as_ref() }.ok_or_else(|| null("config"))?;
        // SAFETY: the caller promises NUL-terminated strings for all four.
        let (server_url, task_id, enrollment_token, storage_dir) = unsafe {
            (
                string(config.server_url, "server_url")?,
                string(config.task_id, "task_id")?,
                string(config.enrollment_token, "enrollment_token")?,
                string(config.storage_dir, "storage_dir")?,
            )
        };
        let ca_certificate_pem = if config.ca_certificate_pem.is_null() {
            None
        } else {
            // SAFETY: non-null, so a NUL-terminated string by contract.
            Some(unsafe { string(config.ca_certificate_pem, "ca_certificate_pem") }?.into_bytes())
        };
        let policy_json = if config.policy_json.is_null() {
            None
        } else {
            // SAFETY: non-null, so a NUL-terminated string by contract.
            Some(unsafe { string(config.policy_json, "policy_json") }?)
        };
        let client = MobileClient::open(Config {
            server_url,
            task_id,
            enrollment_token,
            storage_dir: PathBuf::from(storage_dir),
            ca_certificate_pem,
            policy_json,
            max_attempts: None,
        })?;
        let handle = Box::into_raw(Box::new(CohortClient(client)));
        // SAFETY: `out` is non-null and writable by contract.
        unsafe { out.write(handle) };
        Ok(())
    })
}

/// Releases a handle (null is ignored). Must not race with other calls on it.
///
/// # Safety
/// `client` is null or a live handle from [`cohort_client_open`], not used
/// again afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_free(client: *mut CohortClient) {
    if !client.is_null() {
        // SAFETY: the handle came from `Box::into_raw` in
        // `cohort_client_open` and is released exactly once.
        let client = unsafe { Box::from_raw(client) };
        // Dropping only frees memory and closes sockets; never panics
        // through here in practice, but keep the promise regardless.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(client)));
    }
}

/// Supplies local training data: `rows × columns` features, row major,
/// and `rows` labels (classes 0–255). Copied; the buffers may be freed
/// after the call.
///
/// # Safety
/// `client` is a live handle; `features` points to `rows * columns`
/// floats and `labels` to `rows` integers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_set_training_data(
    client: *const CohortClient,
    features: *const f32,
    rows: usize,
    columns: usize,
    labels: *const i32,
) -> CohortStatus {
    guard(|| {
        // SAFETY: live handle by contract.
        let client = unsafe { handle(client) }?;
        if features.is_null() || labels.is_null() {
            return Err(null("features or labels"));
        }
        let count =
            rows.checked_mul(columns).ok_or_else(|| Error::InvalidArgument("too many features".into()))?;
        // SAFETY: non-null, and the caller promises `rows * columns` and
        // `rows` readable values that are not written during the call.
        let (features, labels) = unsafe {
            (std::slice::from_raw_parts(features, count), std::slice::from_raw_parts(labels, rows))
        };
        client.set_training_data(TrainingData::new(features.to_vec(), columns, labels)?);
        Ok(())
    })
}

/// Sets local training's epochs, batch size and learning rate.
///
/// # Safety
/// `client` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_set_training_config(
    client: *const CohortClient,
    epochs: u32,
    batch_size: u32,
    learning_rate: f32,
) -> CohortStatus {
    // SAFETY: live handle by contract.
    guard(|| unsafe { handle(client) }?.set_training_config(epochs, batch_size, learning_rate))
}

/// The app's callback as a [`Trainer`].
struct CallbackTrainer {
    train: unsafe extern "C" fn(*mut c_void, u64, *const f32, usize, *mut f32, *mut u32) -> i32,
    user_data: *mut c_void,
}

impl Trainer for CallbackTrainer {
    fn train(&mut self, contribution: Contribution, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        let round = contribution.round;
        let parameters = global.weights.len();
        let mut delta = vec![0.0f32; parameters];
        let mut examples = 0u32;
        // SAFETY: the callback's contract: it reads `parameters` floats
        // from `global` and writes `parameters` floats to `delta` and one
        // u32 to `examples`, all of which are valid for the call.
        let code = unsafe {
            (self.train)(
                self.user_data,
                round,
                global.weights.as_ptr(),
                parameters,
                delta.as_mut_ptr(),
                &mut examples,
            )
        };
        if code != 0 {
            return Err(UpdateError::Application(format!("the update callback returned {code}")));
        }
        Ok(LocalUpdate { delta, examples, metrics: cohort_client::participant::MetricValues::new() })
    }
}

/// Takes part in the next round this client is selected for; blocks until
/// it ends. With `train` null, trains the task's model on the data of
/// [`cohort_client_set_training_data`]; otherwise `train` computes the
/// update. `out` receives the outcome ([`CohortOutcome::TaskFinished`]
/// when the task is over).
///
/// # Safety
/// `client` is a live handle; `out` points to writable storage; `train`,
/// if not null, honours [`CohortTrainFn`]'s contract with `user_data`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_participate(
    client: *const CohortClient,
    train: CohortTrainFn,
    user_data: *mut c_void,
    out: *mut CohortRoundResult,
) -> CohortStatus {
    guard(|| {
        // SAFETY: live handle by contract.
        let client = unsafe { handle(client) }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let mut callback = train.map(|train| CallbackTrainer { train, user_data });
        let result: RoundResult = client.participate(callback.as_mut().map(|c| c as &mut dyn Trainer))?;
        let result = CohortRoundResult {
            outcome: result.outcome.into(),
            round: result.round,
            bytes_up: result.bytes_up,
            bytes_down: result.bytes_down,
        };
        // SAFETY: `out` is non-null and writable by contract.
        unsafe { out.write(result) };
        Ok(())
    })
}

/// Pauses the client, persistently; a running participate call returns
/// [`CohortStatus::Paused`] soon after.
///
/// # Safety
/// `client` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_pause(client: *const CohortClient) -> CohortStatus {
    // SAFETY: live handle by contract.
    guard(|| unsafe { handle(client) }?.pause())
}

/// Lifts a pause.
///
/// # Safety
/// `client` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_resume(client: *const CohortClient) -> CohortStatus {
    // SAFETY: live handle by contract.
    guard(|| unsafe { handle(client) }?.resume())
}

/// Writes whether the client is paused to `out`.
///
/// # Safety
/// `client` is a live handle; `out` points to a writable bool.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_is_paused(
    client: *const CohortClient,
    out: *mut bool,
) -> CohortStatus {
    guard(|| {
        // SAFETY: live handle by contract.
        let paused = unsafe { handle(client) }?.is_paused();
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: non-null and writable by contract.
        unsafe { out.write(paused) };
        Ok(())
    })
}

/// Copies the global model of the last round this client trained in into
/// `buffer` (up to `capacity` floats) and its length into `length`;
/// `length` is 0 before any round. When `capacity` is too small nothing
/// is copied and the status is [`CohortStatus::InvalidArgument`], with
/// `length` telling the size needed.
///
/// # Safety
/// `client` is a live handle; `buffer` has room for `capacity` floats (or
/// is null with `capacity` 0); `length` points to a writable size.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_global_model(
    client: *const CohortClient,
    buffer: *mut f32,
    capacity: usize,
    length: *mut usize,
) -> CohortStatus {
    guard(|| {
        // SAFETY: live handle by contract.
        let model = unsafe { handle(client) }?.global_model().unwrap_or_default();
        if length.is_null() {
            return Err(null("length"));
        }
        // SAFETY: non-null and writable by contract.
        unsafe { length.write(model.len()) };
        if model.len() > capacity || (buffer.is_null() && !model.is_empty()) {
            return Err(Error::InvalidArgument(format!("the model has {} values", model.len())));
        }
        // SAFETY: `buffer` has room for `capacity >= model.len()` floats
        // and cannot overlap the freshly allocated `model`.
        unsafe { std::ptr::copy_nonoverlapping(model.as_ptr(), buffer, model.len()) };
        Ok(())
    })
}

/// Copies the calling thread's last error message into `buffer`
/// (truncated to `capacity - 1` bytes, always NUL-terminated when
/// `capacity > 0`) and returns its full length in bytes.
///
/// # Safety
/// `buffer` has room for `capacity` bytes, or is null with `capacity` 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_last_error(buffer: *mut c_char, capacity: usize) -> usize {
    LAST_ERROR.with(|last| {
        let last = last.borrow();
        if !buffer.is_null() && capacity > 0 {
            let copied = last.len().min(capacity - 1);
            // SAFETY: `buffer` has room for `capacity > copied` bytes and
            // does not overlap the thread-local string.
            unsafe {
                std::ptr::copy_nonoverlapping(last.as_ptr().cast::<c_char>(), buffer, copied);
                buffer.add(copied).write(0);
            }
        }
        last.len()
    })
}

/// The name of a status, as a static NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn cohort_status_name(status: CohortStatus) -> *const c_char {
    let name: &'static CStr = match status {
        CohortStatus::Ok => c"ok",
        CohortStatus::InvalidArgument => c"invalid_argument",
        CohortStatus::Paused => c"paused",
        CohortStatus::Unreachable => c"unreachable",
        CohortStatus::Unauthorized => c"unauthorized",
        CohortStatus::TaskNotFound => c"task_not_found",
        CohortStatus::Rejected => c"rejected",
        CohortStatus::Protocol => c"protocol",
        CohortStatus::InvalidUpdate => c"invalid_update",
        CohortStatus::Storage => c"storage",
        CohortStatus::Internal => c"internal",
        CohortStatus::PolicyRefused => c"policy_refused",
    };
    name.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let status = guard(|| panic!("boom"));
        assert_eq!(status, CohortStatus::Internal);
        let mut buffer = [0 as c_char; 8];
        // SAFETY: the buffer has room for 8 bytes.
        let length = unsafe { cohort_last_error(buffer.as_mut_ptr(), buffer.len()) };
        assert_eq!(length, "internal error: panic: boom".len());
        // SAFETY: cohort_last_error NUL-terminated the buffer.
        let copied = unsafe { CStr::from_ptr(buffer.as_ptr()) };
        assert_eq!(copied.to_str().unwrap(), "interna");
    }

    #[test]
    fn null_pointers_are_invalid_arguments() {
        let mut out = std::ptr::null_mut();
        // SAFETY: null config is part of the contract's checked cases.
        assert_eq!(unsafe { cohort_client_open(std::ptr::null(), &mut out) }, CohortStatus::InvalidArgument);
        // SAFETY: a null handle is checked.
        assert_eq!(unsafe { cohort_client_pause(std::ptr::null()) }, CohortStatus::InvalidArgument);
        // SAFETY: null is ignored.
        unsafe { cohort_client_free(std::ptr::null_mut()) };
    }
}
