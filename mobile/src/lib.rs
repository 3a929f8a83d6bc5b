//! `cohort-mobile`: workspace member reserved for the mobile layer of Cohort.
//!
//! It currently re-exports the protocol core; see `docs/` and the issue
//! tracker for the planned scope.

pub use cohort_crypto as protocol;
