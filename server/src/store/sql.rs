//! [`SqlStore`]: the store over SQLite and PostgreSQL through sqlx's `Any`
//! driver.
//!
//! Queries use `$N` placeholders in ascending order, which both backends
//! accept; only the migrations differ (BLOB/INTEGER against BYTEA/BIGINT).

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, FromRow, Row};
use std::sync::Arc;

use crate::round::FailedAttempt;

use super::credentials::CredentialCache;
use super::tenancy::{AuditRecord, maybe_audit};
use super::{
    ATTEMPTS_KEPT, CheckpointRecord, ClientMetricsRecord, EnrollmentTokenRecord, Fence, GroupKey,
    GroupRecord, GroupRoute, GroupRowState, ParticipantRecord, ReplicaRecord, RoundRecord, StoreError,
    StoreResult, TaskRecord, TaskStatus,
};

/// Longest wait for a pooled PostgreSQL connection.
const POSTGRES_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);
/// Longest wait for SQLite's one connection.
const SQLITE_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// A pooled connection idle this long is tested before it is handed out.
const TEST_IF_IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Which database a URL selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `sqlite:` URLs.
    Sqlite,
    /// `postgres://` and `postgresql://` URLs.
    Postgres,
}

impl Backend {
    /// The backend of `url`, if it is one of ours.
    pub fn of(url: &str) -> Option<Self> {
        if url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Backend::Postgres)
        } else {
            None
        }
    }
}

/// A PostgreSQL URL that names no user, with the one libpq would take:
/// `PGUSER`, else the operating-system user (`USER`, `LOGNAME`); other
/// URLs unchanged. Without it the driver would log in as a user nobody
/// created ("anonymous").
fn with_default_user(url: &str, env: impl Fn(&str) -> Option<String>) -> StoreResult<String> {
    let Some((scheme, rest)) = url.split_once("://") else { return Ok(url.to_string()) };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    if authority.contains('@') {
        return Ok(url.to_string());
    }
    let user = ["PGUSER", "USER", "LOGNAME"]
        .into_iter()
        .find_map(|name| env(name).filter(|user| !user.is_empty()))
        .ok_or(StoreError::Config(
            "the PostgreSQL URL names no user and neither PGUSER nor USER is set: \
             write postgres://USER@HOST/DATABASE",
        ))?;
    let user = percent_encoding::utf8_percent_encode(&user, percent_encoding::NON_ALPHANUMERIC);
    Ok(format!("{scheme}://{user}@{rest}"))
}

/// Forgets a task's credentials when dropped: after a change to them
/// commits, or when the change's future is dropped during its commit.
struct Forget<'a>(&'a CredentialCache, &'a str);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.forget_task(self.1);
    }
}

/// The coordinator's storage (see [the module](super)).
#[derive(Debug, Clone)]
pub struct SqlStore {
    pub(super) pool: AnyPool,
    backend: Backend,
    /// Shared by the store's clones (see [`CredentialCache`]).
    credentials: Arc<CredentialCache>,
}

/// Maps unique-key violations to [`StoreError::Conflict`] and foreign-key
/// violations to [`StoreError::NotFound`].
pub(super) fn classify(error: sqlx::Error, conflict: &'static str, missing: &'static str) -> StoreError {
    if let sqlx::Error::Database(db) = &error {
        if db.is_unique_violation() {
            return StoreError::Conflict(conflict);
        }
        if db.is_foreign_key_violation() {
            return StoreError::NotFound(missing);
        }
    }
    StoreError::Database(error)
}

// Records whose columns map one to one onto their fields derive
// `sqlx::FromRow` (`TaskRecord`, `RoundRecord`, `CheckpointRecord`,
// `ReplicaRecord`, `GroupKey`, `GroupRecord`). The three below keep a
// mapper by hand: a participant's nullable 32-byte key, a token's rate
// split over two columns, and an attempt's JSON column of the engine's own
// type, none of which `try_from` on the `Any` driver can express.

pub(super) fn hash(row: &AnyRow, column: &str) -> StoreResult<[u8; 32]> {
    let bytes: Vec<u8> = row.try_get(column)?;
    bytes.try_into().map_err(|_| StoreError::Corrupt("hash length"))
}

fn participant_from(row: &AnyRow) -> StoreResult<ParticipantRecord> {
    Ok(ParticipantRecord {
        id: row.try_get("id")?,
        task_id: row.try_get("task_id")?,
        credential_hash: hash(row, "credential_hash")?,
        enrolled_at: row.try_get("enrolled_at")?,
        last_seen_at: row.try_get("last_seen_at")?,
        expires_at: row.try_get("expires_at")?,
        identity_key: row
            .try_get::<Option<Vec<u8>>, _>("identity_key")?
            .map(|key| key.try_into().map_err(|_| StoreError::Corrupt("identity key length")))
            .transpose()?,
        token_id: row.try_get("token_id")?,
    })
}

fn token_from(row: &AnyRow) -> StoreResult<EnrollmentTokenRecord> {
    let per_minute: Option<i64> = row.try_get("per_minute")?;
    let burst: Option<i64> = row.try_get("burst")?;
    let rate = match (per_minute, burst) {
        (Some(per_minute), Some(burst)) => Some((
            u32::try_from(per_minute).map_err(|_| StoreError::Corrupt("token rate"))?,
            u32::try_from(burst).map_err(|_| StoreError::Corrupt("token burst"))?,
        )),
        _ => None,
    };
    Ok(EnrollmentTokenRecord {
        id: row.try_get("id")?,
        task_id: row.try_get("task_id")?,
        name: row.try_get("name")?,
        token_hash: hash(row, "token_hash")?,
        rate,
        created_at: row.try_get("created_at")?,
        revoked_at: row.try_get("revoked_at")?,
    })
}

fn attempt_from(row: &AnyRow) -> StoreResult<FailedAttempt> {
    let number = |column: &'static str| -> StoreResult<u64> {
        u64::try_from(row.try_get::<i64, _>(column)?).map_err(|_| StoreError::Corrupt(column))
    };
    let outcome: String = row.try_get("outcome")?;
    let stage: String = row.try_get("stage")?;
    let stages: String = row.try_get("stages")?;
    Ok(FailedAttempt {
        round: number("round")?,
        attempt: u32::try_from(number("attempt")?).map_err(|_| StoreError::Corrupt("attempt"))?,
        outcome: outcome.parse().map_err(|_| StoreError::Corrupt("attempt outcome"))?,
        stage: stage.parse().map_err(|_| StoreError::Corrupt("attempt stage"))?,
        reason: row.try_get("reason")?,
        selected: number("selected")? as usize,
        started_at: row.try_get("started_at")?,
        ended_at: row.try_get("ended_at")?,
        stages: serde_json::from_str(&stages).map_err(|_| StoreError::Corrupt("attempt stages"))?,
    })
}

/// The columns of a [`GroupRecord`].
macro_rules! group_columns {
    () => {
        "task_id, round, attempt, group_index, leader_id, owner_id, owner_url, assignment, state, stage, \
         expires_at, report"
    };
}

/// A query over the `Any` driver.
type AnyQuery<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>;

/// Binds a group's key (task, round, attempt, group) to the next four
/// placeholders of `query`.
fn bind_group<'q>(query: AnyQuery<'q>, key: &'q GroupKey) -> AnyQuery<'q> {
    query.bind(&key.task).bind(key.round as i64).bind(i64::from(key.attempt)).bind(i64::from(key.group))
}

// Column lists as macros, so that every query stays a static string.
macro_rules! task_columns {
    () => {
        "id, name, spec, status, enrollment_token_hash, created_at, updated_at, project_id"
    };
}
macro_rules! participant_columns {
    () => {
        "id, task_id, credential_hash, enrolled_at, last_seen_at, expires_at, identity_key, token_id"
    };
}
macro_rules! token_columns {
    () => {
        "id, task_id, name, token_hash, per_minute, burst, created_at, revoked_at"
    };
}
macro_rules! round_columns {
    () => {
        "task_id, round, started_at, finished_at, selected, survivors, metrics"
    };
}
macro_rules! checkpoint_columns {
    () => {
        "task_id, round, model, optimizer_state, created_at"
    };
}

impl SqlStore {
    /// Connects to `url` and applies pending migrations. A SQLite file is
    /// created if missing.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::open(url, None).await
    }

    /// A PostgreSQL connection of its own, for work that must not queue
    /// behind requests for the shared pool (the lease renewals of
    /// [`crate::coordinator`]); `url` was [`connect`](Self::connect)ed
    /// (and migrated) first. SQLite is one process and one connection: it
    /// has no such second store.
    pub async fn connect_dedicated(url: &str) -> StoreResult<Self> {
        Self::open(url, Some(1)).await
    }

    /// The pool for `url`, of `dedicated` connections (not migrating) or
    /// the backend's default (migrating).
    async fn open(url: &str, dedicated: Option<u32>) -> StoreResult<Self> {
        sqlx::any::install_default_drivers();
        let backend = Backend::of(url)
            .ok_or(StoreError::Config("the database URL must start with sqlite: or postgres://"))?;
        let url = match backend {
            Backend::Sqlite if !url.contains('?') && !url.contains(":memory:") => format!("{url}?mode=rwc"),
            Backend::Sqlite => url.to_string(),
            Backend::Postgres => with_default_user(url, |name| std::env::var(name).ok())?,
        };
        let connections = match (backend, dedicated) {
            (Backend::Sqlite, Some(_)) => {
                return Err(StoreError::Config("SQLite has one connection, the shared one"));
            }
            // SQLite serialises writers anyway; one connection avoids "database is locked".
            (Backend::Sqlite, None) => 1,
            (Backend::Postgres, None) => 8,
            (Backend::Postgres, Some(connections)) => connections,
        };
        // A PostgreSQL server that went away fails requests within seconds
        // (a 503 with Retry-After) rather than after sqlx's default 30 s.
        // SQLite is a local file: a wait for its one connection is load,
        // not an outage, and keeps the default.
        let acquire_timeout = match backend {
            Backend::Sqlite => SQLITE_ACQUIRE_TIMEOUT,
            Backend::Postgres => POSTGRES_ACQUIRE_TIMEOUT,
        };
        // A connection is tested (a round trip) only when it sat idle for
        // a while, not before every query: under load every query used to
        // cost two round trips. One that broke since its last use fails
        // its query, which the caller sees as a store error (a `503`).
        let pool = AnyPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(acquire_timeout)
            .test_before_acquire(false)
            .before_acquire(|connection, meta| {
                Box::pin(async move {
                    if meta.idle_for >= TEST_IF_IDLE_FOR {
                        sqlx::Connection::ping(connection).await?;
                    }
                    Ok(true)
                })
            })
            .connect(&url)
            .await?;
        match (backend, dedicated) {
            (_, Some(_)) => {}
            (Backend::Sqlite, None) => sqlx::migrate!("migrations/sqlite").run(&pool).await?,
            (Backend::Postgres, None) => sqlx::migrate!("migrations/postgres").run(&pool).await?,
        }
        Ok(Self { pool, backend, credentials: Arc::default() })
    }

    /// The replica's memory of client credentials, closed (remembering
    /// nothing) until the service opens it: see [`CredentialCache`].
    pub fn credentials(&self) -> &Arc<CredentialCache> {
        &self.credentials
    }

    /// On PostgreSQL, the task that keeps [`credentials`](Self::credentials)
    /// open while this replica hears the others' credential changes (run
    /// it for as long as the store is used); on SQLite, where this process
    /// is the database's only user, the cache is opened and there is no
    /// such task.
    pub fn keep_credentials(&self, url: &str) -> StoreResult<Option<impl Future<Output = ()> + use<>>> {
        match self.backend {
            Backend::Sqlite => {
                self.credentials.open();
                Ok(None)
            }
            Backend::Postgres => {
                let url = with_default_user(url, |name| std::env::var(name).ok())?;
                Ok(Some(super::credentials::listen(url, Arc::downgrade(&self.credentials))))
            }
        }
    }

    /// Commits `tx`, a change to `task`'s credentials: on PostgreSQL it
    /// first tells the other replicas (delivered once `tx` commits), and
    /// this replica forgets them after the commit, or if this future is
    /// dropped while it commits.
    async fn commit_credential_change(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Any>,
        task: &str,
    ) -> StoreResult<()> {
        if self.backend == Backend::Postgres {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(super::credentials::CHANNEL)
                .bind(task)
                .execute(&mut *tx)
                .await?;
        }
        let _forget = Forget(&self.credentials, task);
        tx.commit().await?;
        Ok(())
    }

    /// Runs a trivial query: whether the database answers.
    pub async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// The database in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Within `tx`, refuses with [`StoreError::Fenced`] unless the task's
    /// lease still names `fence`'s replica and generation. Called last,
    /// just before the commit: on PostgreSQL the lease row stays locked
    /// from the check to the commit, so that a takeover cannot slip in
    /// between them, and only that long (a takeover, or the holder's own
    /// renewal, never waits for a large checkpoint to be written).
    async fn check_fence(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        task_id: &str,
        fence: Option<&Fence>,
    ) -> StoreResult<()> {
        let Some(fence) = fence else { return Ok(()) };
        let statement = match self.backend {
            Backend::Postgres => {
                "SELECT generation FROM task_leases \
                 WHERE task_id = $1 AND replica_id = $2 AND generation = $3 FOR UPDATE"
            }
            // One process holds a SQLite file, and its writes are serial.
            Backend::Sqlite => {
                "SELECT generation FROM task_leases WHERE task_id = $1 AND replica_id = $2 AND generation = $3"
            }
        };
        let held = sqlx::query(statement)
            .bind(task_id)
            .bind(&fence.replica)
            .bind(fence.generation)
            .fetch_optional(&mut **tx)
            .await?;
        if held.is_some() { Ok(()) } else { Err(StoreError::Fenced) }
    }
}

/// The coordinator's storage: every query, on SQLite and PostgreSQL alike.
impl SqlStore {
    /// Creates a task with its initial checkpoint (round 0) and its first
    /// enrollment token, named `default`, whose id is the task's.
    pub async fn create_task(
        &self,
        task: &TaskRecord,
        initial: &CheckpointRecord,
        audit: Option<&AuditRecord>,
    ) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(concat!(
            "INSERT INTO tasks (",
            task_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
        ))
        .bind(&task.id)
        .bind(&task.name)
        .bind(&task.spec)
        .bind(task.status.as_str())
        .bind(task.enrollment_token_hash.to_vec())
        .bind(task.created_at)
        .bind(task.updated_at)
        .bind(&task.project_id)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "a task with this id exists", "project"))?;
        insert_token(
            &mut tx,
            &EnrollmentTokenRecord {
                id: task.id.clone(),
                task_id: task.id.clone(),
                name: "default".into(),
                token_hash: task.enrollment_token_hash,
                rate: None,
                created_at: task.created_at,
                revoked_at: None,
            },
        )
        .await?;
        sqlx::query(concat!(
            "INSERT INTO checkpoints (",
            checkpoint_columns!(),
            ") VALUES ($1, $2, $3, $4, $5)"
        ))
        .bind(&task.id)
        .bind(0i64)
        .bind(initial.model.clone())
        .bind(initial.optimizer_state.clone())
        .bind(initial.created_at)
        .execute(&mut *tx)
        .await?;
        maybe_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    /// One task.
    pub async fn task(&self, id: &str) -> StoreResult<TaskRecord> {
        let row = sqlx::query(concat!("SELECT ", task_columns!(), " FROM tasks WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound("task"))?;
        Ok(TaskRecord::from_row(&row)?)
    }

    /// All tasks, oldest first.
    pub async fn tasks(&self) -> StoreResult<Vec<TaskRecord>> {
        sqlx::query(concat!("SELECT ", task_columns!(), " FROM tasks ORDER BY created_at, id"))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| Ok(TaskRecord::from_row(row)?))
            .collect()
    }

    /// Changes a task's status; refused once the task is stopped or
    /// completed. Fenced by `fence` when it is given (the task's leader).
    pub async fn set_task_status(
        &self,
        id: &str,
        status: TaskStatus,
        now: i64,
        fence: Option<&Fence>,
        audit: Option<&AuditRecord>,
    ) -> StoreResult<()> {
        let current = self.task(id).await?;
        if current.status.is_final() && current.status != status {
            return Err(StoreError::Conflict("the task has ended"));
        }
        let mut tx = self.pool.begin().await?;
        // The status guard makes a concurrent final transition win.
        let updated =
            sqlx::query("UPDATE tasks SET status = $1, updated_at = $2 WHERE id = $3 AND status = $4")
                .bind(status.as_str())
                .bind(now)
                .bind(id)
                .bind(current.status.as_str())
                .execute(&mut *tx)
                .await?;
        if updated.rows_affected() != 1 {
            return Err(StoreError::Conflict("the task changed concurrently"));
        }
        maybe_audit(&mut tx, audit).await?;
        self.check_fence(&mut tx, id, fence).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Deletes a task and everything stored for it: participants, tokens,
    /// rounds, attempts, checkpoints, metrics, leases and groups.
    pub async fn delete_task(&self, id: &str, audit: Option<&AuditRecord>) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        // Children before their parents (no table cascades); participants
        // before the tokens they enrolled with.
        for statement in [
            "DELETE FROM client_metrics WHERE task_id = $1",
            "DELETE FROM round_contributors WHERE task_id = $1",
            "DELETE FROM participant_exclusions WHERE task_id = $1",
            "DELETE FROM round_groups WHERE task_id = $1",
            "DELETE FROM round_attempts WHERE task_id = $1",
            "DELETE FROM rounds WHERE task_id = $1",
            "DELETE FROM checkpoints WHERE task_id = $1",
            "DELETE FROM task_leases WHERE task_id = $1",
            "DELETE FROM participants WHERE task_id = $1",
            "DELETE FROM enrollment_tokens WHERE task_id = $1",
        ] {
            sqlx::query(statement).bind(id).execute(&mut *tx).await?;
        }
        let deleted = sqlx::query("DELETE FROM tasks WHERE id = $1").bind(id).execute(&mut *tx).await?;
        if deleted.rows_affected() == 0 {
            return Err(StoreError::NotFound("task"));
        }
        maybe_audit(&mut tx, audit).await?;
        self.commit_credential_change(tx, id).await?;
        Ok(())
    }

    /// Enrolls a participant, unless the enrollment token it names was
    /// revoked ([`StoreError::Revoked`]). The token's row is read under a
    /// share lock (PostgreSQL; SQLite runs one transaction at a time), so
    /// a revocation either comes first and is seen here, or waits for this
    /// enrollment and then ends its credential with the others': none
    /// slips between the two.
    pub async fn add_participant(&self, p: &ParticipantRecord) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        if let Some(token) = &p.token_id {
            let statement = match self.backend {
                Backend::Postgres => {
                    "SELECT revoked_at FROM enrollment_tokens WHERE id = $1 AND task_id = $2 FOR SHARE"
                }
                Backend::Sqlite => "SELECT revoked_at FROM enrollment_tokens WHERE id = $1 AND task_id = $2",
            };
            let row = sqlx::query(statement).bind(token).bind(&p.task_id).fetch_optional(&mut *tx).await?;
            let revoked_at: Option<i64> = match &row {
                Some(row) => row.try_get("revoked_at")?,
                None => None,
            };
            if revoked_at.is_some() {
                return Err(StoreError::Revoked);
            }
        }
        sqlx::query(concat!(
            "INSERT INTO participants (",
            participant_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
        ))
        .bind(&p.id)
        .bind(&p.task_id)
        .bind(p.credential_hash.to_vec())
        .bind(p.enrolled_at)
        .bind(p.last_seen_at)
        .bind(p.expires_at)
        .bind(p.identity_key.map(|key| key.to_vec()))
        .bind(p.token_id.clone())
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "participant or credential exists", "task"))?;
        tx.commit().await?;
        Ok(())
    }

    /// The participant holding a credential with this hash.
    pub async fn participant_by_credential(
        &self,
        credential_hash: &[u8; 32],
    ) -> StoreResult<ParticipantRecord> {
        if let Some(participant) = self.credentials.participant(credential_hash) {
            return Ok(participant);
        }
        let generation = self.credentials.generation();
        let row = sqlx::query(concat!(
            "SELECT ",
            participant_columns!(),
            " FROM participants WHERE credential_hash = $1"
        ))
        .bind(credential_hash.to_vec())
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound("participant"))?;
        let participant = participant_from(&row)?;
        self.credentials.remember(generation, &participant);
        Ok(participant)
    }

    /// Adds an enrollment token; refused if the task has one of that name.
    pub async fn add_enrollment_token(
        &self,
        token: &EnrollmentTokenRecord,
        audit: Option<&AuditRecord>,
    ) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        insert_token(&mut tx, token).await?;
        maybe_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The token with this hash.
    pub async fn enrollment_token_by_hash(
        &self,
        token_hash: &[u8; 32],
    ) -> StoreResult<EnrollmentTokenRecord> {
        let row = sqlx::query(concat!(
            "SELECT ",
            token_columns!(),
            " FROM enrollment_tokens WHERE token_hash = $1"
        ))
        .bind(token_hash.to_vec())
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound("enrollment token"))?;
        token_from(&row)
    }

    /// A task's tokens, oldest first, each with the number of participants
    /// enrolled with it.
    pub async fn enrollment_tokens(&self, task_id: &str) -> StoreResult<Vec<(EnrollmentTokenRecord, i64)>> {
        let tokens: Vec<EnrollmentTokenRecord> = sqlx::query(concat!(
            "SELECT ",
            token_columns!(),
            " FROM enrollment_tokens WHERE task_id = $1 ORDER BY created_at, id"
        ))
        .bind(task_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(token_from)
        .collect::<StoreResult<_>>()?;
        let counts = sqlx::query(
            "SELECT token_id, COUNT(*) AS enrolled FROM participants WHERE task_id = $1 GROUP BY token_id",
        )
        .bind(task_id)
        .fetch_all(&self.pool)
        .await?;
        let mut enrolled = std::collections::HashMap::new();
        for row in &counts {
            let token: Option<String> = row.try_get("token_id")?;
            let count: i64 = row.try_get("enrolled")?;
            enrolled.insert(token, count);
        }
        Ok(tokens
            .into_iter()
            .map(|token| {
                let count = enrolled.get(&Some(token.id.clone())).copied().unwrap_or(0);
                (token, count)
            })
            .collect())
    }

    /// Revokes a token (once; a second call keeps the first time) and ends
    /// the credentials it issued, so that their holders must enroll again.
    pub async fn revoke_enrollment_token(
        &self,
        task_id: &str,
        token_id: &str,
        now: i64,
        audit: Option<&AuditRecord>,
    ) -> StoreResult<EnrollmentTokenRecord> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE enrollment_tokens SET revoked_at = $1 WHERE id = $2 AND task_id = $3 AND revoked_at IS NULL",
        )
        .bind(now)
        .bind(token_id)
        .bind(task_id)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE participants SET expires_at = $1 WHERE token_id = $2 AND task_id = $3 AND expires_at > $1")
            .bind(now)
            .bind(token_id)
            .bind(task_id)
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(concat!(
            "SELECT ",
            token_columns!(),
            " FROM enrollment_tokens WHERE id = $1 AND task_id = $2"
        ))
        .bind(token_id)
        .bind(task_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound("enrollment token"))?;
        maybe_audit(&mut tx, audit).await?;
        self.commit_credential_change(tx, task_id).await?;
        token_from(&row)
    }

    /// Records a check-in: written unless this replica wrote one of the
    /// participant's within [`TOUCH_EVERY`](super::credentials::TOUCH_EVERY)
    /// (while its credential cache is open), so `last_seen_at` is exact to
    /// that much.
    pub async fn touch_participant(&self, id: &str, now: i64) -> StoreResult<()> {
        if !self.credentials.needs_touch(id) {
            return Ok(());
        }
        let updated = sqlx::query("UPDATE participants SET last_seen_at = $1 WHERE id = $2")
            .bind(now)
            .bind(id)
            .execute(&self.pool)
            .await?;
        if updated.rows_affected() != 1 {
            return Err(StoreError::NotFound("participant"));
        }
        self.credentials.touched(id);
        Ok(())
    }

    /// Participants of a task.
    pub async fn participants(&self, task_id: &str) -> StoreResult<Vec<ParticipantRecord>> {
        sqlx::query(concat!(
            "SELECT ",
            participant_columns!(),
            " FROM participants WHERE task_id = $1 ORDER BY enrolled_at, id"
        ))
        .bind(task_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(participant_from)
        .collect()
    }

    /// Atomically records a completed round and its checkpoint, then keeps
    /// only the newest `retain` checkpoints (and always the initial one).
    /// Refused if the round is already recorded or does not follow the last.
    /// Fenced by `fence` when it is given (see [`Fence`]).
    pub async fn complete_round(
        &self,
        round: &RoundRecord,
        checkpoint: &CheckpointRecord,
        retain: u32,
        fence: Option<&Fence>,
    ) -> StoreResult<()> {
        if checkpoint.task_id != round.task_id || checkpoint.round != round.round {
            return Err(StoreError::Conflict("the checkpoint belongs to another round"));
        }
        let mut tx = self.pool.begin().await?;
        let last: Option<i64> = sqlx::query("SELECT MAX(round) AS last FROM rounds WHERE task_id = $1")
            .bind(&round.task_id)
            .fetch_one(&mut *tx)
            .await?
            .try_get("last")?;
        if round.round != last.unwrap_or(0) + 1 {
            return Err(StoreError::Conflict("rounds must be recorded once, in order"));
        }
        sqlx::query(concat!(
            "INSERT INTO rounds (",
            round_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7)"
        ))
        .bind(&round.task_id)
        .bind(round.round)
        .bind(round.started_at)
        .bind(round.finished_at)
        .bind(round.selected)
        .bind(round.survivors)
        .bind(&round.metrics)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "round already recorded", "task"))?;
        sqlx::query(concat!(
            "INSERT INTO checkpoints (",
            checkpoint_columns!(),
            ") VALUES ($1, $2, $3, $4, $5)"
        ))
        .bind(&checkpoint.task_id)
        .bind(checkpoint.round)
        .bind(checkpoint.model.clone())
        .bind(checkpoint.optimizer_state.clone())
        .bind(checkpoint.created_at)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "checkpoint already recorded", "task"))?;
        sqlx::query("DELETE FROM round_contributors WHERE task_id = $1 AND round <= $2")
            .bind(&round.task_id)
            .bind(round.round)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM checkpoints WHERE task_id = $1 AND round > 0 AND round <= $2")
            .bind(&round.task_id)
            .bind(round.round - i64::from(retain.max(1)))
            .execute(&mut *tx)
            .await?;
        self.check_fence(&mut tx, &round.task_id, fence).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records that an attempt of round `round` asks `participants` for
    /// their masked input (before they are asked). Each of them refuses
    /// every later attempt of that round; a round's records go when the
    /// round completes. Fenced by `fence` when it is given.
    pub async fn record_contributors(
        &self,
        task_id: &str,
        round: i64,
        participants: &[String],
        now: i64,
        fence: Option<&Fence>,
    ) -> StoreResult<()> {
        let participants =
            serde_json::to_string(participants).map_err(|_| StoreError::Corrupt("round contributors"))?;
        let statement = "INSERT INTO round_contributors (task_id, round, participants, recorded_at) \
                         VALUES ($1, $2, $3, $4)";
        self.insert_fenced(statement, "round contributors", task_id, round, &[participants], now, fence).await
    }

    /// Runs the insert `statement` once for each of `values`, bound as
    /// (`task_id`, `round`, value, `now`), in one transaction fenced by
    /// `fence` when it is given.
    #[allow(clippy::too_many_arguments)]
    async fn insert_fenced(
        &self,
        statement: &'static str,
        what: &'static str,
        task_id: &str,
        round: i64,
        values: &[String],
        now: i64,
        fence: Option<&Fence>,
    ) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        for value in values {
            sqlx::query(statement)
                .bind(task_id)
                .bind(round)
                .bind(value)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, what, "task"))?;
        }
        self.check_fence(&mut tx, task_id, fence).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records participants a validated task excluded in `round` (see
    /// `round::suspects`); one already recorded stays as it was. Fenced by
    /// `fence` when it is given.
    pub async fn record_exclusions(
        &self,
        task_id: &str,
        round: i64,
        participants: &[String],
        now: i64,
        fence: Option<&Fence>,
    ) -> StoreResult<()> {
        let statement = "INSERT INTO participant_exclusions (task_id, round, participant_id, excluded_at) \
                         VALUES ($1, $2, $3, $4) ON CONFLICT (task_id, participant_id) DO NOTHING";
        self.insert_fenced(statement, "participant exclusion", task_id, round, participants, now, fence).await
    }

    /// The participants a task excluded, ascending.
    pub async fn exclusions(&self, task_id: &str) -> StoreResult<Vec<String>> {
        let rows = sqlx::query(
            "SELECT participant_id FROM participant_exclusions WHERE task_id = $1 ORDER BY participant_id",
        )
        .bind(task_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|row| Ok(row.try_get("participant_id")?)).collect()
    }

    /// Every participant an attempt of `round` asked for its masked input,
    /// sorted, each once (none once the round has completed).
    pub async fn contributors(&self, task_id: &str, round: i64) -> StoreResult<Vec<String>> {
        let rows =
            sqlx::query("SELECT participants FROM round_contributors WHERE task_id = $1 AND round = $2")
                .bind(task_id)
                .bind(round)
                .fetch_all(&self.pool)
                .await?;
        let mut all = Vec::new();
        for row in &rows {
            let listed: String = row.try_get("participants")?;
            let listed: Vec<String> =
                serde_json::from_str(&listed).map_err(|_| StoreError::Corrupt("round contributors"))?;
            all.extend(listed);
        }
        all.sort();
        all.dedup();
        Ok(all)
    }

    /// Completed rounds of a task, in order.
    pub async fn rounds(&self, task_id: &str) -> StoreResult<Vec<RoundRecord>> {
        sqlx::query(concat!("SELECT ", round_columns!(), " FROM rounds WHERE task_id = $1 ORDER BY round"))
            .bind(task_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| Ok(RoundRecord::from_row(row)?))
            .collect()
    }

    /// Records an attempt that ended without a new model; only the newest
    /// [`ATTEMPTS_KEPT`] of a task are kept. Fenced by `fence` when it is
    /// given.
    pub async fn record_attempt(
        &self,
        task_id: &str,
        a: &FailedAttempt,
        fence: Option<&Fence>,
    ) -> StoreResult<()> {
        let stages = serde_json::to_string(&a.stages).map_err(|_| StoreError::Corrupt("attempt stages"))?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(concat!(
            "INSERT INTO round_attempts (task_id, round, attempt, outcome, stage, reason, selected, ",
            "started_at, ended_at, stages) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
        ))
        .bind(task_id)
        .bind(a.round as i64)
        .bind(i64::from(a.attempt))
        .bind(a.outcome.as_str())
        .bind(a.stage.to_string())
        .bind(&a.reason)
        .bind(a.selected as i64)
        .bind(a.started_at)
        .bind(a.ended_at)
        .bind(stages)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "round attempt", "task"))?;
        sqlx::query(concat!(
            "DELETE FROM round_attempts WHERE task_id = $1 AND ended_at < (SELECT ended_at FROM ",
            "round_attempts WHERE task_id = $1 ORDER BY ended_at DESC LIMIT 1 OFFSET $2)"
        ))
        .bind(task_id)
        .bind(ATTEMPTS_KEPT - 1)
        .execute(&mut *tx)
        .await?;
        self.check_fence(&mut tx, task_id, fence).await?;
        tx.commit().await?;
        Ok(())
    }

    /// A task's failed attempts, newest first, at most `limit`.
    pub async fn attempts(&self, task_id: &str, limit: i64) -> StoreResult<Vec<FailedAttempt>> {
        sqlx::query(concat!(
            "SELECT task_id, round, attempt, outcome, stage, reason, selected, started_at, ended_at, stages ",
            "FROM round_attempts WHERE task_id = $1 ORDER BY ended_at DESC, round DESC, attempt DESC LIMIT $2"
        ))
        .bind(task_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(attempt_from)
        .collect()
    }

    /// The newest checkpoint of a task.
    pub async fn latest_checkpoint(&self, task_id: &str) -> StoreResult<CheckpointRecord> {
        let row = sqlx::query(concat!(
            "SELECT ",
            checkpoint_columns!(),
            " FROM checkpoints WHERE task_id = $1 ORDER BY round DESC LIMIT 1"
        ))
        .bind(task_id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound("checkpoint"))?;
        Ok(CheckpointRecord::from_row(&row)?)
    }

    /// The round of the newest checkpoint of a task.
    pub async fn latest_checkpoint_round(&self, task_id: &str) -> StoreResult<u64> {
        let round: Option<i64> = sqlx::query_scalar("SELECT MAX(round) FROM checkpoints WHERE task_id = $1")
            .bind(task_id)
            .fetch_one(&self.pool)
            .await?;
        let round = round.ok_or(StoreError::NotFound("checkpoint"))?;
        u64::try_from(round).map_err(|_| StoreError::NotFound("checkpoint"))
    }

    /// The checkpoint of one round.
    pub async fn checkpoint(&self, task_id: &str, round: i64) -> StoreResult<CheckpointRecord> {
        let row = sqlx::query(concat!(
            "SELECT ",
            checkpoint_columns!(),
            " FROM checkpoints WHERE task_id = $1 AND round = $2"
        ))
        .bind(task_id)
        .bind(round)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound("checkpoint"))?;
        Ok(CheckpointRecord::from_row(&row)?)
    }

    /// Rounds that still have a checkpoint, ascending.
    pub async fn checkpoint_rounds(&self, task_id: &str) -> StoreResult<Vec<i64>> {
        sqlx::query("SELECT round FROM checkpoints WHERE task_id = $1 ORDER BY round")
            .bind(task_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| row.try_get("round").map_err(StoreError::from))
            .collect()
    }

    /// Records a client's metrics; refused if already reported.
    pub async fn add_client_metrics(&self, m: &ClientMetricsRecord) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO client_metrics (task_id, round, participant_id, kind, metrics, reported_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&m.task_id)
        .bind(m.round)
        .bind(&m.participant_id)
        .bind(&m.kind)
        .bind(&m.metrics)
        .bind(m.reported_at)
        .execute(&self.pool)
        .await
        .map_err(|e| classify(e, "metrics already reported for this round", "task or participant"))?;
        Ok(())
    }

    /// Client metrics of one round.
    pub async fn client_metrics(&self, task_id: &str, round: i64) -> StoreResult<Vec<ClientMetricsRecord>> {
        let rows = sqlx::query(
            "SELECT task_id, round, participant_id, kind, metrics, reported_at FROM client_metrics \
             WHERE task_id = $1 AND round = $2 ORDER BY participant_id, kind",
        )
        .bind(task_id)
        .bind(round)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(ClientMetricsRecord {
                    task_id: row.try_get("task_id")?,
                    round: row.try_get("round")?,
                    participant_id: row.try_get("participant_id")?,
                    kind: row.try_get("kind")?,
                    metrics: row.try_get("metrics")?,
                    reported_at: row.try_get("reported_at")?,
                })
            })
            .collect()
    }

    /// Registers a starting replica. Another registered at the same URL
    /// is removed with its leases (the new one bound its address, so it is
    /// gone), and on SQLite, which one process serves at a time, every
    /// other one is.
    pub async fn register_replica(&self, replica: &ReplicaRecord) -> StoreResult<()> {
        // A replica that took over another's address replaces it: that one
        // is gone (the address was free to bind), and its leases with it.
        // On SQLite, which one process serves at a time, every other
        // replica is gone.
        let others = match self.backend {
            Backend::Sqlite => "SELECT id FROM replicas WHERE id <> $2 OR url = $1",
            Backend::Postgres => "SELECT id FROM replicas WHERE id <> $2 AND url = $1",
        };
        let mut tx = self.pool.begin().await?;
        let gone: Vec<String> = sqlx::query(others)
            .bind(&replica.url)
            .bind(&replica.id)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|row| row.try_get("id"))
            .collect::<Result<_, _>>()?;
        for id in &gone {
            delete_replica(&mut tx, id).await?;
        }
        tx.commit().await?;
        self.heartbeat(replica).await
    }

    /// Registers a replica, or beats its heart (`heartbeat_at`) if it is.
    pub async fn heartbeat(&self, replica: &ReplicaRecord) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO replicas (id, url, started_at, heartbeat_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, heartbeat_at = excluded.heartbeat_at",
        )
        .bind(&replica.id)
        .bind(&replica.url)
        .bind(replica.started_at)
        .bind(replica.heartbeat_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Removes a replica that stops, with the leases it holds.
    pub async fn remove_replica(&self, id: &str) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        delete_replica(&mut tx, id).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Replicas whose last heartbeat is at or after `since`.
    pub async fn replicas(&self, since: i64) -> StoreResult<Vec<ReplicaRecord>> {
        sqlx::query(
            "SELECT id, url, started_at, heartbeat_at FROM replicas WHERE heartbeat_at >= $1 ORDER BY id",
        )
        .bind(since)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| Ok(ReplicaRecord::from_row(row)?))
        .collect()
    }

    /// Takes or renews `replica`'s lease on a task until `expires_at`: taken
    /// when nobody holds it or its holder's lease ended before `now`,
    /// renewed when `replica` holds it. Returns the lease's generation
    /// (raised at every change of holder), or `None` when another replica
    /// holds it.
    pub async fn acquire_lease(
        &self,
        task_id: &str,
        replica: &str,
        now: i64,
        expires_at: i64,
    ) -> StoreResult<Option<i64>> {
        // One statement, so that two replicas racing for an expired lease
        // cannot both win: the row lock (PostgreSQL) or the single writer
        // (SQLite) orders them, and the loser's condition fails.
        let row = sqlx::query(
            "INSERT INTO task_leases (task_id, replica_id, generation, expires_at) VALUES ($1, $2, 1, $3) \
             ON CONFLICT (task_id) DO UPDATE SET \
                 generation = CASE WHEN task_leases.replica_id = excluded.replica_id \
                     THEN task_leases.generation ELSE task_leases.generation + 1 END, \
                 replica_id = excluded.replica_id, \
                 expires_at = excluded.expires_at \
             WHERE task_leases.replica_id = excluded.replica_id OR task_leases.expires_at < $4 \
             RETURNING generation",
        )
        .bind(task_id)
        .bind(replica)
        .bind(expires_at)
        .bind(now)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| classify(e, "lease", "task"))?;
        Ok(row.map(|row| row.try_get("generation")).transpose()?)
    }

    /// Gives a lease up (if `replica` holds it).
    pub async fn release_lease(&self, task_id: &str, replica: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM task_leases WHERE task_id = $1 AND replica_id = $2")
            .bind(task_id)
            .bind(replica)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Every lease that holds at `now`: (task, holder).
    pub async fn leases(&self, now: i64) -> StoreResult<Vec<(String, ReplicaRecord)>> {
        let rows = sqlx::query(
            "SELECT l.task_id, r.id, r.url, r.started_at, r.heartbeat_at \
             FROM task_leases l JOIN replicas r ON r.id = l.replica_id \
             WHERE l.expires_at >= $1 ORDER BY l.task_id",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|row| Ok((row.try_get("task_id")?, ReplicaRecord::from_row(row)?))).collect()
    }

    /// Stores the groups a leader hands to other replicas for a round, in
    /// place of every group row of their tasks. Fenced by `fence` when it
    /// is given.
    pub async fn assign_groups(&self, groups: &[GroupRecord], fence: Option<&Fence>) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        let mut tasks: Vec<&str> = groups.iter().map(|g| g.key.task.as_str()).collect();
        tasks.dedup();
        for task in &tasks {
            sqlx::query("DELETE FROM round_groups WHERE task_id = $1").bind(*task).execute(&mut *tx).await?;
        }
        for g in groups {
            let insert = sqlx::query(concat!(
                "INSERT INTO round_groups (",
                group_columns!(),
                ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, NULL)"
            ));
            bind_group(insert, &g.key)
                .bind(&g.leader_id)
                .bind(&g.owner_id)
                .bind(&g.owner_url)
                .bind(&g.assignment)
                .bind(g.state.as_str())
                .bind(&g.stage)
                .bind(g.expires_at)
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, "group", "task"))?;
        }
        for task in tasks {
            self.check_fence(&mut tx, task, fence).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Takes up the groups assigned to `owner` whose lease holds at `now`:
    /// they run, held until `until`.
    pub async fn claim_groups(&self, owner: &str, now: i64, until: i64) -> StoreResult<Vec<GroupRecord>> {
        sqlx::query(concat!(
            "UPDATE round_groups SET state = 'running', expires_at = $1 \
             WHERE owner_id = $2 AND state = 'assigned' AND expires_at >= $3 RETURNING ",
            group_columns!()
        ))
        .bind(until)
        .bind(owner)
        .bind(now)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| Ok(GroupRecord::from_row(row)?))
        .collect()
    }

    /// Renews `owner`'s leases on the groups it runs that still hold at
    /// `now`, until `until`; returns those groups. A group missing from the
    /// answer was given up, lost or deleted: the owner stops running it.
    pub async fn renew_groups(&self, owner: &str, now: i64, until: i64) -> StoreResult<Vec<GroupKey>> {
        sqlx::query(
            "UPDATE round_groups SET expires_at = $1 \
             WHERE owner_id = $2 AND state = 'running' AND expires_at >= $3 \
             RETURNING task_id, round, attempt, group_index",
        )
        .bind(until)
        .bind(owner)
        .bind(now)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| Ok(GroupKey::from_row(row)?))
        .collect()
    }

    /// Records the stage a running group of `owner` is in.
    pub async fn group_stage(&self, key: &GroupKey, owner: &str, stage: &str) -> StoreResult<()> {
        let update = sqlx::query(
            "UPDATE round_groups SET stage = $1 WHERE owner_id = $2 AND state = 'running' \
             AND task_id = $3 AND round = $4 AND attempt = $5 AND group_index = $6",
        )
        .bind(stage)
        .bind(owner);
        bind_group(update, key).execute(&self.pool).await?;
        Ok(())
    }

    /// Settles a running group of `owner` whose lease holds at `now`: done
    /// with its `report` and its sum's bytes, or failed (no `mean`).
    /// `false` when the group was not `owner`'s to settle any more.
    pub async fn settle_group(
        &self,
        key: &GroupKey,
        owner: &str,
        now: i64,
        report: &str,
        mean: Option<&[u8]>,
    ) -> StoreResult<bool> {
        let state = if mean.is_some() { GroupRowState::Done } else { GroupRowState::Failed };
        let update = sqlx::query(
            "UPDATE round_groups SET state = $1, report = $2, mean = $3 \
             WHERE owner_id = $4 AND state = 'running' AND expires_at >= $5 \
             AND task_id = $6 AND round = $7 AND attempt = $8 AND group_index = $9",
        )
        .bind(state.as_str())
        .bind(report)
        .bind(mean.unwrap_or_default().to_vec())
        .bind(owner)
        .bind(now);
        let done = bind_group(update, key).execute(&self.pool).await?;
        Ok(done.rows_affected() == 1)
    }

    /// The groups of the rounds `leader` leads, after marking lost those
    /// whose owner's lease lapsed before `now`. Read several times a second,
    /// and the leader made their assignments: each record's `assignment`
    /// is left empty.
    pub async fn led_groups(&self, leader: &str, now: i64) -> StoreResult<Vec<GroupRecord>> {
        // One statement each: an owner's settle and the leader's marking
        // lost cannot both win (the row lock orders them).
        sqlx::query(
            "UPDATE round_groups SET state = 'lost' \
             WHERE leader_id = $1 AND state IN ('assigned', 'running') AND expires_at < $2",
        )
        .bind(leader)
        .bind(now)
        .execute(&self.pool)
        .await?;
        sqlx::query(
            "SELECT task_id, round, attempt, group_index, leader_id, owner_id, owner_url, '' AS assignment, \
             state, stage, expires_at, report FROM round_groups WHERE leader_id = $1 \
             ORDER BY task_id, round, attempt, group_index",
        )
        .bind(leader)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| Ok(GroupRecord::from_row(row)?))
        .collect()
    }

    /// The stored sum of a completed group.
    pub async fn group_mean(&self, key: &GroupKey) -> StoreResult<Vec<u8>> {
        let select = sqlx::query(
            "SELECT mean FROM round_groups WHERE state = 'done' \
             AND task_id = $1 AND round = $2 AND attempt = $3 AND group_index = $4",
        );
        let row =
            bind_group(select, key).fetch_optional(&self.pool).await?.ok_or(StoreError::NotFound("group"))?;
        Ok(row.try_get("mean")?)
    }

    /// The groups assigned or running whose lease holds at `now`, for
    /// routing their clients' requests to their owners: every replica
    /// reads them several times a second, so without their assignments
    /// (a roster each), which [`group_assignment`](Self::group_assignment)
    /// reads once per group.
    pub async fn group_routes(&self, now: i64) -> StoreResult<Vec<GroupRoute>> {
        sqlx::query(
            "SELECT task_id, round, attempt, group_index, owner_id, owner_url FROM round_groups \
             WHERE state IN ('assigned', 'running') AND expires_at >= $1 \
             ORDER BY task_id, round, attempt, group_index",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| Ok(GroupRoute::from_row(row)?))
        .collect()
    }

    /// A group's assignment (JSON), whatever its state.
    pub async fn group_assignment(&self, key: &GroupKey) -> StoreResult<String> {
        let select = sqlx::query(
            "SELECT assignment FROM round_groups \
             WHERE task_id = $1 AND round = $2 AND attempt = $3 AND group_index = $4",
        );
        let row =
            bind_group(select, key).fetch_optional(&self.pool).await?.ok_or(StoreError::NotFound("group"))?;
        Ok(row.try_get("assignment")?)
    }

    /// Deletes every group row of a task. Fenced by `fence` when it is
    /// given.
    pub async fn delete_groups(&self, task_id: &str, fence: Option<&Fence>) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM round_groups WHERE task_id = $1").bind(task_id).execute(&mut *tx).await?;
        self.check_fence(&mut tx, task_id, fence).await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Deletes a replica and the leases it holds, within `tx`; the groups it
/// runs lapse at once.
async fn delete_replica(tx: &mut sqlx::Transaction<'_, sqlx::Any>, id: &str) -> StoreResult<()> {
    sqlx::query("DELETE FROM task_leases WHERE replica_id = $1").bind(id).execute(&mut **tx).await?;
    sqlx::query(
        "UPDATE round_groups SET expires_at = 0 WHERE owner_id = $1 AND state IN ('assigned', 'running')",
    )
    .bind(id)
    .execute(&mut **tx)
    .await?;
    sqlx::query("DELETE FROM replicas WHERE id = $1").bind(id).execute(&mut **tx).await?;
    Ok(())
}

async fn insert_token(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    token: &EnrollmentTokenRecord,
) -> StoreResult<()> {
    sqlx::query(concat!(
        "INSERT INTO enrollment_tokens (",
        token_columns!(),
        ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
    ))
    .bind(&token.id)
    .bind(&token.task_id)
    .bind(&token.name)
    .bind(token.token_hash.to_vec())
    .bind(token.rate.map(|(per_minute, _)| i64::from(per_minute)))
    .bind(token.rate.map(|(_, burst)| i64::from(burst)))
    .bind(token.created_at)
    .bind(token.revoked_at)
    .execute(&mut **tx)
    .await
    .map_err(|e| classify(e, "the task has a token of this name", "task"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn a_postgres_url_without_a_user_takes_the_one_libpq_would() {
        let url = "postgres://127.0.0.1:5432/db?sslmode=disable";
        let both = [("PGUSER", "pg-user"), ("USER", "os")];
        assert_eq!(
            with_default_user(url, env(&both)).unwrap(),
            "postgres://pg%2Duser@127.0.0.1:5432/db?sslmode=disable"
        );
        assert_eq!(
            with_default_user(url, env(&[("USER", "os")])).unwrap(),
            "postgres://os@127.0.0.1:5432/db?sslmode=disable"
        );
        assert_eq!(
            with_default_user("postgresql://h/db", env(&[("PGUSER", ""), ("LOGNAME", "l")])).unwrap(),
            "postgresql://l@h/db"
        );
        // A URL that names a user (with or without a password) is kept.
        for named in ["postgres://me@h/db", "postgres://me:secret@h:5/db", "postgres://me@h"] {
            assert_eq!(with_default_user(named, env(&both)).unwrap(), named);
        }
        let error = with_default_user("postgres://h/db", env(&[])).unwrap_err();
        assert!(error.to_string().contains("postgres://USER@HOST/DATABASE"), "{error}");
    }
}
