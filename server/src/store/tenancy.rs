//! Projects, their API keys and the audit log.
//!
//! A change the admin API makes and its audit entry are written in one
//! transaction ([`insert_audit`] inside the change's own), so that no
//! change is ever stored without its entry, nor an entry for a change
//! that was rolled back.

use sqlx::Row;
use sqlx::any::AnyRow;

use super::sql::{classify, hash};
use super::{SqlStore, StoreError, StoreResult};

/// A project: a tenant of the coordinator.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ProjectRecord {
    /// Identifier (`default`, or 32 hex digits).
    pub id: String,
    /// Its name, unique on the coordinator.
    pub name: String,
    /// Its quotas (the operator's), as JSON.
    pub quotas: String,
    /// The limits its owners set within them, as JSON.
    pub owner_quotas: String,
    /// Creation time.
    pub created_at: i64,
}

/// What a key may do in its project, least to most.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
    strum::IntoStaticStr,
    strum::EnumString,
    strum::EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Role {
    /// Reads the project's tasks, rounds, checkpoints, tokens, events and
    /// metrics; changes nothing.
    Viewer,
    /// A viewer that also creates, pauses, resumes, stops and deletes
    /// tasks, and creates and revokes their enrollment tokens.
    Operator,
    /// An operator that also creates, lists and revokes the project's keys,
    /// sets the project's own limits within its quotas and reads its audit
    /// log.
    Owner,
}

impl Role {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// An API key of a project.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiKeyRecord {
    /// Identifier (32 hex digits; shown in the audit log as the actor).
    pub id: String,
    /// The project.
    pub project_id: String,
    /// Its name, unique within the project.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// SHA-256 of the key.
    pub key_hash: [u8; 32],
    /// Creation time.
    pub created_at: i64,
    /// It is refused from this time on, if set.
    pub expires_at: Option<i64>,
    /// When it was revoked.
    pub revoked_at: Option<i64>,
    /// Who created it: `admin`, or the id of the owner key that did.
    pub created_by: String,
}

/// One entry of the audit log.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct AuditRecord {
    /// Its place in the log: ascending, never reused (0 before it is
    /// written).
    pub seq: i64,
    /// When (Unix ms).
    pub at: i64,
    /// The project acted on; `null` for an action on none (creating a
    /// project under a name that is taken, say).
    pub project_id: Option<String>,
    /// Who: `admin` (the deployment's admin token), or a key's id.
    pub actor: String,
    /// The actor's role: `admin`, `owner`, `operator` or `viewer`.
    pub role: String,
    /// What, as `resource.verb` (`task.create`, `key.revoke`, ...).
    pub action: String,
    /// On what: the resource's path (`tasks/ID`, `projects/ID/keys/ID`).
    pub resource: String,
    /// The caller's address, where it is known.
    pub address: Option<String>,
    /// `ok`, or the refusal's error code.
    pub outcome: String,
    /// The HTTP status answered.
    pub status: i64,
    /// The refusal's message (empty when it succeeded).
    pub message: String,
}

/// Audit entries a page lists at most.
pub const AUDIT_PAGE_MAX: i64 = 500;

macro_rules! key_columns {
    () => {
        "id, project_id, name, role, key_hash, created_at, expires_at, revoked_at, created_by"
    };
}
macro_rules! audit_columns {
    () => {
        "at, project_id, actor, role, action, resource, address, outcome, status, message"
    };
}

fn key_from(row: &AnyRow) -> StoreResult<ApiKeyRecord> {
    let role: String = row.try_get("role")?;
    Ok(ApiKeyRecord {
        id: row.try_get("id")?,
        project_id: row.try_get("project_id")?,
        name: row.try_get("name")?,
        role: role.parse().map_err(|_| StoreError::Corrupt("key role"))?,
        key_hash: hash(row, "key_hash")?,
        created_at: row.try_get("created_at")?,
        expires_at: row.try_get("expires_at")?,
        revoked_at: row.try_get("revoked_at")?,
        created_by: row.try_get("created_by")?,
    })
}

fn audit_from(row: &AnyRow) -> StoreResult<AuditRecord> {
    Ok(AuditRecord {
        seq: row.try_get("seq")?,
        at: row.try_get("at")?,
        project_id: row.try_get("project_id")?,
        actor: row.try_get("actor")?,
        role: row.try_get("role")?,
        action: row.try_get("action")?,
        resource: row.try_get("resource")?,
        address: row.try_get("address")?,
        outcome: row.try_get("outcome")?,
        status: row.try_get("status")?,
        message: row.try_get("message")?,
    })
}

/// Writes `entry` within `tx`: it commits, or rolls back, with the change
/// it records.
pub(super) async fn insert_audit(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    entry: &AuditRecord,
) -> StoreResult<()> {
    sqlx::query(concat!(
        "INSERT INTO audit_log (",
        audit_columns!(),
        ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
    ))
    .bind(entry.at)
    .bind(entry.project_id.clone())
    .bind(&entry.actor)
    .bind(&entry.role)
    .bind(&entry.action)
    .bind(&entry.resource)
    .bind(entry.address.clone())
    .bind(&entry.outcome)
    .bind(entry.status)
    .bind(&entry.message)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Writes `entry`, when there is one, within `tx`.
pub(super) async fn maybe_audit(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    entry: Option<&AuditRecord>,
) -> StoreResult<()> {
    match entry {
        Some(entry) => insert_audit(tx, entry).await,
        None => Ok(()),
    }
}

impl SqlStore {
    /// Creates a project; refused if its id or name is taken.
    pub async fn create_project(&self, project: &ProjectRecord, audit: &AuditRecord) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO projects (id, name, quotas, owner_quotas, created_at) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&project.id)
        .bind(&project.name)
        .bind(&project.quotas)
        .bind(&project.owner_quotas)
        .bind(project.created_at)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "a project of this name exists", "project"))?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    /// One project.
    pub async fn project(&self, id: &str) -> StoreResult<ProjectRecord> {
        let row =
            sqlx::query("SELECT id, name, quotas, owner_quotas, created_at FROM projects WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or(StoreError::NotFound("project"))?;
        Ok(sqlx::FromRow::from_row(&row)?)
    }

    /// Every project, oldest first.
    pub async fn projects(&self) -> StoreResult<Vec<ProjectRecord>> {
        sqlx::query("SELECT id, name, quotas, owner_quotas, created_at FROM projects ORDER BY created_at, id")
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| Ok(sqlx::FromRow::from_row(row)?))
            .collect()
    }

    /// Replaces a project's quotas (the operator's).
    pub async fn set_quotas(&self, id: &str, quotas: &str, audit: &AuditRecord) -> StoreResult<()> {
        self.set_project_column("UPDATE projects SET quotas = $1 WHERE id = $2", id, quotas, audit).await
    }

    /// Replaces the limits a project's owners set for it.
    pub async fn set_owner_quotas(&self, id: &str, quotas: &str, audit: &AuditRecord) -> StoreResult<()> {
        self.set_project_column("UPDATE projects SET owner_quotas = $1 WHERE id = $2", id, quotas, audit)
            .await
    }

    async fn set_project_column(
        &self,
        update: &'static str,
        id: &str,
        quotas: &str,
        audit: &AuditRecord,
    ) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        let updated = sqlx::query(update).bind(quotas).bind(id).execute(&mut *tx).await?;
        if updated.rows_affected() != 1 {
            return Err(StoreError::NotFound("project"));
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Adds a key; refused if its project has one of that name.
    pub async fn add_key(&self, key: &ApiKeyRecord, audit: &AuditRecord) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(concat!(
            "INSERT INTO api_keys (",
            key_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
        ))
        .bind(&key.id)
        .bind(&key.project_id)
        .bind(&key.name)
        .bind(key.role.as_str())
        .bind(key.key_hash.to_vec())
        .bind(key.created_at)
        .bind(key.expires_at)
        .bind(key.revoked_at)
        .bind(&key.created_by)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, "the project has a key of this name", "project"))?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The key with this hash.
    pub async fn key_by_hash(&self, key_hash: &[u8; 32]) -> StoreResult<ApiKeyRecord> {
        let row = sqlx::query(concat!("SELECT ", key_columns!(), " FROM api_keys WHERE key_hash = $1"))
            .bind(key_hash.to_vec())
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound("key"))?;
        key_from(&row)
    }

    /// A project's keys, oldest first.
    pub async fn keys(&self, project_id: &str) -> StoreResult<Vec<ApiKeyRecord>> {
        sqlx::query(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE project_id = $1 ORDER BY created_at, id"
        ))
        .bind(project_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(key_from)
        .collect()
    }

    /// Revokes a key of a project (once: a second call keeps the first
    /// time, and writes its own entry).
    pub async fn revoke_key(
        &self,
        project_id: &str,
        key_id: &str,
        now: i64,
        audit: &AuditRecord,
    ) -> StoreResult<ApiKeyRecord> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND project_id = $3 AND revoked_at IS NULL",
        )
        .bind(now)
        .bind(key_id)
        .bind(project_id)
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE id = $1 AND project_id = $2"
        ))
        .bind(key_id)
        .bind(project_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound("key"))?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        key_from(&row)
    }

    /// Writes an entry on its own: a refused action (nothing was changed,
    /// so there is no transaction to share).
    pub async fn audit(&self, entry: &AuditRecord) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        insert_audit(&mut tx, entry).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The log, newest first: at most `limit` entries before `before` (a
    /// `seq`; `None`: the newest), of `project` (`None`: every entry).
    pub async fn audit_log(
        &self,
        project: Option<&str>,
        before: Option<i64>,
        limit: i64,
    ) -> StoreResult<Vec<AuditRecord>> {
        let before = before.unwrap_or(i64::MAX);
        let limit = limit.clamp(1, AUDIT_PAGE_MAX);
        let rows = match project {
            Some(project) => {
                sqlx::query(concat!(
                    "SELECT seq, ",
                    audit_columns!(),
                    " FROM audit_log WHERE project_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3"
                ))
                .bind(project)
                .bind(before)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(concat!(
                    "SELECT seq, ",
                    audit_columns!(),
                    " FROM audit_log WHERE seq < $1 ORDER BY seq DESC LIMIT $2"
                ))
                .bind(before)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(audit_from).collect()
    }

    /// Enrollments into `project`'s tasks from `since` (Unix ms) on: how
    /// many, and the oldest of them.
    pub async fn enrollments_since(&self, project: &str, since: i64) -> StoreResult<(i64, Option<i64>)> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS enrolled, MIN(p.enrolled_at) AS oldest FROM participants p \
             JOIN tasks t ON t.id = p.task_id WHERE t.project_id = $1 AND p.enrolled_at >= $2",
        )
        .bind(project)
        .bind(since)
        .fetch_one(&self.pool)
        .await?;
        Ok((row.try_get("enrolled")?, row.try_get("oldest")?))
    }

    /// Registers the admin event stream `stream` of `project` on `replica`
    /// if the project's streams on the live replicas (those whose
    /// heartbeat is at or after `live_since`) number fewer than `most`;
    /// `Err(open)`, the number they hold, if not. The streams of replicas
    /// that are no longer live are deleted on the way. Concurrent calls for
    /// one project are serialized (on PostgreSQL by a lock on the
    /// project's row that does not block the key checks of inserts that
    /// refer to it; SQLite has one writer), so the quota holds exactly.
    pub async fn open_admin_stream(
        &self,
        stream: &str,
        project: &str,
        replica: &str,
        live_since: i64,
        most: u32,
        now: i64,
    ) -> StoreResult<Result<(), i64>> {
        let mut tx = self.pool.begin().await?;
        if self.backend() == super::Backend::Postgres {
            sqlx::query("SELECT id FROM projects WHERE id = $1 FOR NO KEY UPDATE")
                .bind(project)
                .execute(&mut *tx)
                .await?;
        }
        // A write first: SQLite takes its write lock here, before the count.
        sqlx::query(
            "DELETE FROM admin_streams WHERE project_id = $1 \
             AND replica_id NOT IN (SELECT id FROM replicas WHERE heartbeat_at >= $2)",
        )
        .bind(project)
        .bind(live_since)
        .execute(&mut *tx)
        .await?;
        let open: i64 = sqlx::query("SELECT COUNT(*) AS open FROM admin_streams WHERE project_id = $1")
            .bind(project)
            .fetch_one(&mut *tx)
            .await?
            .try_get("open")?;
        if open >= i64::from(most) {
            tx.rollback().await?;
            return Ok(Err(open));
        }
        sqlx::query(
            "INSERT INTO admin_streams (id, project_id, replica_id, opened_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(stream)
        .bind(project)
        .bind(replica)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Ok(()))
    }

    /// The admin event streams of `project` registered by the replicas
    /// whose heartbeat is at or after `live_since`.
    pub async fn admin_streams(&self, project: &str, live_since: i64) -> StoreResult<i64> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS open FROM admin_streams s JOIN replicas r ON r.id = s.replica_id \
             WHERE s.project_id = $1 AND r.heartbeat_at >= $2",
        )
        .bind(project)
        .bind(live_since)
        .fetch_one(&self.pool)
        .await?;
        Ok(row.try_get("open")?)
    }

    /// Forgets the admin event stream `stream` (it closed).
    pub async fn close_admin_stream(&self, stream: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM admin_streams WHERE id = $1").bind(stream).execute(&self.pool).await?;
        Ok(())
    }

    /// Deletes the entries written before `before` (Unix ms); how many.
    pub async fn prune_audit(&self, before: i64) -> StoreResult<u64> {
        let deleted =
            sqlx::query("DELETE FROM audit_log WHERE at < $1").bind(before).execute(&self.pool).await?;
        Ok(deleted.rows_affected())
    }
}
