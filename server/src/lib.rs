//! The Cohort coordinator library: the task engine ([`round`]), the actor
//! that drives every task's engine ([`coordinator`]), what exists only
//! with several replicas ([`cluster`]), the HTTP API and pages ([`api`]),
//! storage ([`store`]), task specifications, server optimizers, metrics, and all
//! of it started together ([`service`]). The `cohort` command-line tool is
//! the `cohort-cli` crate, on top of this one.

pub mod api;
pub mod cluster;
pub mod coordinator;
pub mod metrics;
pub mod optimizer;
pub mod privacy;
pub mod round;
pub mod service;
pub mod spec;
pub mod store;

/// Model checkpoints (shared with clients, which read the global model).
pub use cohort_client::checkpoint;
