//! Persistence: projects, their keys and audit log, tasks, participants and
//! their credentials, completed rounds, checkpoints and client metrics.
//!
//! [`SqlStore`] is the coordinator's storage, on SQLite (the default: a
//! file created and migrated on start) and PostgreSQL (`postgres://` URLs)
//! through sqlx's `Any` driver, with one migration set per backend; one
//! implementation, so no trait between it and its callers. Times are Unix milliseconds supplied
//! by the caller, so the store has no clock of its own. Credentials are kept
//! only as SHA-256 hashes.
//!
//! Completing a round writes the round record, its checkpoint and optimizer
//! state, and prunes old checkpoints in one transaction: after a crash a
//! round is either fully recorded or not at all.

pub mod credentials;
mod sql;
mod tenancy;

pub use credentials::CredentialCache;
pub use sql::{Backend, SqlStore};
pub use tenancy::{AUDIT_PAGE_MAX, ApiKeyRecord, AuditRecord, ProjectRecord, Role};

use crate::spec::{TaskSpec, VariantChoice};

/// Lifecycle of a task.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
    strum::IntoStaticStr,
    strum::EnumString,
    strum::EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum TaskStatus {
    /// Rounds are being run.
    Active,
    /// No new rounds start until resumed.
    Paused,
    /// Stopped by an administrator; final.
    Stopped,
    /// All rounds done; final.
    Completed,
    /// Stopped because the next round would exceed the task's privacy
    /// budget; final.
    BudgetSpent,
}

impl TaskStatus {
    /// The stored name (as the API writes it).
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Parses a stored name.
    pub fn parse(name: &str) -> Option<Self> {
        name.parse().ok()
    }

    /// Whether no further change of status is possible.
    pub fn is_final(self) -> bool {
        matches!(self, TaskStatus::Stopped | TaskStatus::Completed | TaskStatus::BudgetSpent)
    }
}

/// A stored name read back (a row's `status`).
impl TryFrom<String> for TaskStatus {
    type Error = strum::ParseError;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        name.parse()
    }
}

/// A stored task.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct TaskRecord {
    /// Identifier.
    pub id: String,
    /// Human-readable name.
    pub name: String,
    /// The task specification, as JSON.
    pub spec: String,
    /// Status.
    #[sqlx(try_from = "String")]
    pub status: TaskStatus,
    /// SHA-256 of the task's first enrollment token (also stored as its
    /// token named `default`, which is what enrollment checks).
    #[sqlx(try_from = "Vec<u8>")]
    pub enrollment_token_hash: [u8; 32],
    /// Creation time.
    pub created_at: i64,
    /// Last status change.
    pub updated_at: i64,
    /// The project it belongs to.
    pub project_id: String,
}

impl TaskRecord {
    /// The stored spec, read back: the one reading of it, so every reader
    /// sees the same spec with the same error. A spec stored before the
    /// variant was a choice ran semi-honest, and says so here.
    pub fn spec(&self) -> Result<TaskSpec, StoreError> {
        let mut spec: TaskSpec =
            serde_json::from_str(&self.spec).map_err(|_| StoreError::Corrupt("task spec"))?;
        spec.secure_aggregation.variant.get_or_insert(VariantChoice::SemiHonest);
        Ok(spec)
    }
}

/// Which group of which attempt of a task's round.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, sqlx::FromRow)]
pub struct GroupKey {
    /// The task.
    #[sqlx(rename = "task_id")]
    pub task: String,
    /// The round number.
    #[sqlx(try_from = "i64")]
    pub round: u64,
    /// The attempt of the round.
    #[sqlx(try_from = "i64")]
    pub attempt: u32,
    /// The group's index in the round.
    #[sqlx(rename = "group_index", try_from = "i64")]
    pub group: u32,
}

/// Where a group handed to another replica is (see
/// [`crate::round::owned`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::EnumString, strum::EnumIter)]
#[strum(serialize_all = "snake_case")]
pub enum GroupRowState {
    /// Written by the leader; its owner has not taken it up yet.
    Assigned,
    /// Its owner runs it.
    Running,
    /// Completed: the owner's report and the group's sum are stored.
    Done,
    /// Given up by its owner (its report says in which stage).
    Failed,
    /// Its owner's lease lapsed before it settled.
    Lost,
}

impl GroupRowState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// The state of a stored name.
    pub fn parse(name: &str) -> Option<Self> {
        name.parse().ok()
    }
}

/// A stored name read back (a row's `state`).
impl TryFrom<String> for GroupRowState {
    type Error = strum::ParseError;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        name.parse()
    }
}

/// A group of a round that its leader handed to another replica, its
/// owner.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct GroupRecord {
    /// The group.
    #[sqlx(flatten)]
    pub key: GroupKey,
    /// The replica leading the round.
    pub leader_id: String,
    /// The replica running the group.
    pub owner_id: String,
    /// Where the group's clients' stage messages go.
    pub owner_url: String,
    /// What the owner builds the group from, as JSON.
    pub assignment: String,
    /// Where the group is.
    #[sqlx(try_from = "String")]
    pub state: GroupRowState,
    /// The stage the owner last reported.
    pub stage: String,
    /// When the owner's lease on the group lapses.
    pub expires_at: i64,
    /// The owner's report once settled, as JSON.
    pub report: Option<String>,
}

/// Where a group assigned or running is served: what a replica needs, with
/// the group's roster (read once per group:
/// [`SqlStore::group_assignment`]), to route its clients' requests.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct GroupRoute {
    /// The group.
    #[sqlx(flatten)]
    pub key: GroupKey,
    /// The replica running the group.
    pub owner_id: String,
    /// Where the group's clients' stage messages go.
    pub owner_url: String,
}

/// A `cohort serve` process sharing the database.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ReplicaRecord {
    /// Random identifier, fresh per process.
    pub id: String,
    /// Where the other replicas reach it (`http://host:port`).
    pub url: String,
    /// Start time.
    pub started_at: i64,
    /// Last heartbeat.
    pub heartbeat_at: i64,
}

/// A client enrolled in a task.
#[derive(Debug, Clone, PartialEq)]
pub struct ParticipantRecord {
    /// Identifier.
    pub id: String,
    /// The task.
    pub task_id: String,
    /// SHA-256 of the client credential.
    pub credential_hash: [u8; 32],
    /// Enrollment time.
    pub enrolled_at: i64,
    /// Last check-in.
    pub last_seen_at: i64,
    /// The credential is refused after this time.
    pub expires_at: i64,
    /// Ed25519 identity public key registered at enrollment (none for
    /// participants enrolled before identities existed).
    pub identity_key: Option<[u8; 32]>,
    /// The enrollment token it enrolled with (none before tokens had ids).
    pub token_id: Option<String>,
}

/// An enrollment token of a task: one per application, named, revocable,
/// with its own rate limit.
#[derive(Debug, Clone, PartialEq)]
pub struct EnrollmentTokenRecord {
    /// Identifier.
    pub id: String,
    /// The task.
    pub task_id: String,
    /// Its name (the application it is for), unique within the task.
    pub name: String,
    /// SHA-256 of the token.
    pub token_hash: [u8; 32],
    /// Enrollments per minute, sustained, and the burst above it (`None`:
    /// the server's `enroll_per_token` limit).
    pub rate: Option<(u32, u32)>,
    /// Creation time.
    pub created_at: i64,
    /// When it was revoked.
    pub revoked_at: Option<i64>,
}

/// A completed round.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RoundRecord {
    /// The task.
    pub task_id: String,
    /// Round number, from 1.
    pub round: i64,
    /// Start time.
    pub started_at: i64,
    /// End time.
    pub finished_at: i64,
    /// Clients selected.
    pub selected: i64,
    /// Clients whose input is in the aggregate.
    pub survivors: i64,
    /// Round metrics (stage durations, dropouts, bytes...), as JSON.
    pub metrics: String,
}

/// Failed attempts kept per task (the newest).
pub const ATTEMPTS_KEPT: i64 = 500;

/// A model checkpoint with the optimizer state that goes with it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct CheckpointRecord {
    /// The task.
    pub task_id: String,
    /// The round that produced it (0: the initial model).
    pub round: i64,
    /// The model, in the safetensors format.
    pub model: Vec<u8>,
    /// The server optimizer's state, as JSON.
    pub optimizer_state: Vec<u8>,
    /// When it was written.
    pub created_at: i64,
}

/// Metrics a client reported for a round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientMetricsRecord {
    /// The task.
    pub task_id: String,
    /// The round.
    pub round: i64,
    /// The reporting participant.
    pub participant_id: String,
    /// `train` or `eval`.
    pub kind: String,
    /// The metrics, as JSON.
    pub metrics: String,
    /// When they were reported.
    pub reported_at: i64,
}

/// Why a storage operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The record does not exist.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The write conflicts with existing data (duplicate key, final state).
    #[error("conflict: {0}")]
    Conflict(&'static str),
    /// The store cannot be opened as configured (an unknown database URL,
    /// a setting the backend does not have).
    #[error("database configuration: {0}")]
    Config(&'static str),
    /// A stored value could not be read back.
    #[error("corrupt stored value: {0}")]
    Corrupt(&'static str),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("migration error: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// An enrollment with a token that was revoked before it could be
    /// stored. Nothing was written.
    #[error("the enrollment token was revoked")]
    Revoked,
    /// A write for a task by a replica whose lease on it is gone: another
    /// replica took the task over (see [`Fence`]). Nothing was written.
    #[error("the task's lease was taken over by another replica")]
    Fenced,
}

/// The lease a write for a task is made under: the writing replica and
/// the lease's generation, which grows each time another replica takes
/// the task over. A fenced write checks, in its own transaction, that the
/// task's lease row still names this replica and generation, and writes
/// nothing ([`StoreError::Fenced`]) otherwise: a leader that was paused
/// past its lease and woke up cannot store a round, an attempt or a
/// round's contributors over its successor's (the check is the write's
/// last statement; on PostgreSQL it locks the lease row until the commit,
/// so that a takeover is either before it, and the write refused, or
/// after the commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The replica's id.
    pub replica: String,
    /// The generation of its lease when it took the task.
    pub generation: i64,
}

impl StoreError {
    /// Whether the database could not be reached (as opposed to refusing
    /// or failing one operation): the caller may retry later.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            StoreError::Database(
                sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::Protocol(_)
                    | sqlx::Error::WorkerCrashed
            )
        )
    }
}

/// Result of a storage operation.
pub type StoreResult<T> = Result<T, StoreError>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::AttemptOutcome;
    use crate::spec::VariantChoice;
    use cohort_crypto::Stage;
    use strum::IntoEnumIterator;

    /// Checks that `names` are the stored names of every variant, in order,
    /// that they are the names the API writes (serde), and that they parse
    /// back.
    fn pinned<T>(names: &[&str], name: impl Fn(T) -> String, parse: impl Fn(&str) -> Option<T>)
    where
        T: IntoEnumIterator + serde::Serialize + PartialEq + std::fmt::Debug + Copy,
    {
        let stored: Vec<String> = T::iter().map(&name).collect();
        assert_eq!(stored, names, "a stored name changed: rows already written would not read back");
        for variant in T::iter() {
            assert_eq!(serde_json::to_value(variant).unwrap(), name(variant), "serde and the store disagree");
            assert_eq!(parse(&name(variant)), Some(variant));
        }
        assert_eq!(parse(&names[0].to_uppercase()), None);
    }

    #[test]
    fn stored_names_are_the_api_names_and_never_change() {
        pinned(
            &["active", "paused", "stopped", "completed", "budget_spent"],
            |s: TaskStatus| s.as_str().into(),
            TaskStatus::parse,
        );
        pinned(
            &[
                "setup",
                "advertise-keys",
                "share-keys",
                "masked-input-collection",
                "consistency-check",
                "unmasking",
                "finished",
            ],
            |s: Stage| s.to_string(),
            |name| name.parse().ok(),
        );
        pinned(&["aborted", "abandoned"], |o: AttemptOutcome| o.as_str().into(), |name| name.parse().ok());
        pinned(
            &["active", "semi-honest"],
            |v: VariantChoice| v.as_str().into(),
            |name| VariantChoice::iter().find(|v| v.as_str() == name),
        );
        let states: Vec<&str> = GroupRowState::iter().map(GroupRowState::as_str).collect();
        assert_eq!(states, ["assigned", "running", "done", "failed", "lost"]);
        for state in GroupRowState::iter() {
            assert_eq!(GroupRowState::parse(state.as_str()), Some(state));
        }
    }
}
