//! The Cohort coordinator: server optimizers, model checkpoints, storage,
//! and (in the binary) the `cohort` command-line tool.

pub mod auth;
pub mod checkpoint;
pub mod engine;
pub mod optimizer;
pub mod spec;
pub mod store;
