//! The coordinator's integration tests, one binary (one link of the
//! coordinator and its dependencies instead of one per file): the HTTP API
//! in process, the stores on SQLite and PostgreSQL, TLS, hostile clients
//! and a malicious coordinator against the real client library.

#![allow(clippy::unwrap_used)]

mod support;

mod api;
mod checkpoint_python;
mod hostile;
mod malicious_coordinator;
mod participant;
mod store;
mod tls;
