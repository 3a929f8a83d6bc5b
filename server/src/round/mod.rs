//! Rounds: one task's engine (selection, the secure-aggregation stages with
//! their deadlines, the aggregate turned into the next model), sans-IO:
//! no tokio, no store, no URLs. The actor that drives every task's engine
//! is [`crate::coordinator`].
//!
//! * [`engine`]: [`TaskEngine`], one task's state, synchronous and given
//!   the time, so that every rule is testable without sockets or timers;
//! * `active`: the round in progress: selection, its secure-aggregation
//!   groups (each its own protocol instance), their state and their stage
//!   deadlines;
//! * [`builder`]: [`RoundBuilder`], the one place a round's public
//!   parameters are built from task settings;
//! * [`owned`]: a group of another replica's round, run here (replicas
//!   on PostgreSQL), and what leader and owner exchange through the store;
//! * `completion`: a group's final stage unmasked off the runtime, and the
//!   groups' sums turned into a checkpoint and round record;
//! * `buffered`: async tasks (FedBuff): groups that open as clients are
//!   ready and whose sums are applied as they settle;
//! * [`suspects`]: the group testing that finds, across rounds, a client
//!   whose input failed its group's sum check (validated tasks);
//! * [`records`]: what the engine answers clients and shows the admin API.

mod active;
mod buffered;
pub mod builder;
mod completion;
pub mod engine;
pub mod owned;
pub mod records;
pub mod robust;
pub mod suspects;
#[cfg(test)]
mod tests;

pub use active::{Group, GroupStep, InputStep, StageHost};
pub use buffered::{BufferView, GroupInFlight, READY_TTL_MS};
pub use builder::{BuiltRound, RoundBuilder, RoundSeeds};
pub use completion::{Completion, PendingUnmask};
pub use engine::{CHECK_IN_TTL_MS, Persist, REPORTABLE_ROUNDS, SumCheck, TaskEngine, TickOutcome};
pub use records::{
    AttemptOutcome, BufferMetrics, CheckIn, ClientMean, EngineError, FailedAttempt, GroupMetrics, Poll,
    RoundMetrics, RoundProgress, StageMetrics, TaskError,
};
