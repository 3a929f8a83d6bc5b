//! The Cohort coordinator: server optimizers, model checkpoints, storage,
//! and (in the binary) the `cohort` command-line tool.

pub mod auth;
pub mod coordinator;
pub mod engine;
pub mod http;
pub mod listener;
pub mod metrics;
pub mod openapi;
pub mod optimizer;
pub mod ratelimit;
pub mod service;
pub mod spec;
pub mod store;
pub mod web;

/// Model checkpoints (shared with clients, which read the global model).
pub use cohort_client::checkpoint;
