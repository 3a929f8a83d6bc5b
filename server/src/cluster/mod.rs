//! Replicas: several processes sharing one PostgreSQL database.
//!
//! Several processes (replicas) may share one database. Each task's rounds
//! are led by one of them, which holds the task's lease in the store
//! (`task_leases`): every [`LEASE_TICK`] a replica beats its heart,
//! renews the leases it holds, drops the tasks whose lease it lost, and
//! takes unheld ones up to its fair share (the unfinished tasks over the
//! live replicas). A lease lapses [`LEASE_TTL_MS`] after its last renewal,
//! so a replica that dies, or is cut off from the database, hands its
//! tasks on within seconds; one cut off stops leading them before its
//! leases can lapse. [`Coordinator::whereabouts`](crate::coordinator::Coordinator::whereabouts) tells the API which
//! replica to forward a task's requests to. On SQLite one process holds
//! the database (its file is locked) and so every task: it takes the
//! leases once at start and never renews them.
//!
//! A round of several groups is divided between the live replicas: its
//! leader hands each group it does not run itself to another replica as a
//! row in the store ([`crate::round::owned`]); the owner claims it (a
//! `GroupWatcher` looks for new ones every [`GROUP_TICK`]), holds it
//! with a lease renewed beside its task leases, serves the group's stage
//! messages (the API forwards them there, see
//! [`Coordinator::group_whereabouts`](crate::coordinator::Coordinator::group_whereabouts)) and stores the group's report; the
//! leader's watcher reads the reports back and settles the groups. A group
//! whose owner's lease lapses is given up: its clients count as dropouts.
//!
//! * [`lease`]: this replica, its task leases and where each task is led
//!   (`Routes`);
//! * [`groups`]: a round's groups handed to other replicas, run there and
//!   settled (the sans-IO half of a group run here is
//!   [`crate::round::owned`]);
//! * [`forward`]: requests about a task another replica leads;
//! * [`affinity`]: the cookie that lets a balancer send a client's
//!   requests to the replica that serves them, without a hop;
//! * [`balancer`]: the HAProxy configuration that puts replicas behind one
//!   address (docs/DEPLOYMENT.md shows it; tests and `cohort bench load`
//!   start HAProxy with it).

pub mod affinity;
pub mod balancer;
pub mod forward;
pub mod groups;
pub mod lease;

pub use crate::store::GroupKey;
pub use groups::{GROUP_TICK, PEER_FRESH_MS};
pub use lease::{LEASE_TICK, LEASE_TTL_MS, RENEWAL_MARGIN_MS, Replica, Whereabouts};
