//! The protocol core's integration tests, one binary (as cargo's own
//! `tests/testsuite`), so that a test run links the crate's tests once:
//! whole rounds with and without dropouts, the invariants under
//! misbehaving peers, properties over random rounds, known answers, what
//! clients retain, and how secrets are kept.

#![allow(clippy::unwrap_used)]

mod common;
mod deferred;
mod invariants;
mod known_answers;
mod private_validation;
mod properties;
mod retention;
mod rounds;
mod secrets;
mod validation;
