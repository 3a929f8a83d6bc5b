//! A participant that cheats, for the tests and measurements of input
//! validation (feature `adversary`, never in a default build).
//!
//! It plays every stage as an honest participant does, proves its honest
//! (clipped) update at ShareKeys, and then changes its masked vector before
//! it is sent ([`Attack::apply`]): the sum then holds another input than
//! the one it committed to. Without validation that input goes into the
//! model unchecked; with validation the group's sum check fails and the
//! coordinator's group testing isolates and excludes the participant.

pub use cohort_crypto::simulation::Attack;
