//! The end-to-end tests, one binary (one link instead of one per file):
//! each module runs the real `cohort` binary, the bindings (JVM, C, Python,
//! the browser's wasm build under Node and in Chromium) or the scripts as
//! separate processes. The TorchScript tests, which need libtorch, are the
//! separate target `torchscript` (scripts/test.sh runs it with `tch`).

#![allow(clippy::unwrap_used)]

mod abuse;
mod api_fuzz;
mod bench_cli;
mod browser;
mod buffered;
mod demo;
mod hostile_clients;
mod mobile;
mod privacy;
mod python;
mod pytorch;
mod replicas;
mod restart;
mod setup;
mod streaming;
mod tenancy;
mod web;
