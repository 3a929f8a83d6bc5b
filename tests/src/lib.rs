//! End-to-end tests for Cohort live in `tests/tests/`; they run the real
//! `cohort` binary as a separate process.
