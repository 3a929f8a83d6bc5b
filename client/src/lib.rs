//! `cohort-client`: the library applications embed to take part in Cohort
//! training. This part provides the datasets (IDX: MNIST, Fashion-MNIST)
//! and the non-IID partitioners used by the demo and simulations; local
//! training and the participant runtime build on them.

pub mod checkpoint;
pub mod data;
pub mod model;
pub mod partition;
pub mod train;

pub use cohort_crypto as protocol;
