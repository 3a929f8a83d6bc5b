//! `cohort-client`: workspace member reserved for the client layer of Cohort.
//!
//! It currently re-exports the protocol core; see `docs/` and the issue
//! tracker for the planned scope.

pub use cohort_crypto as protocol;
