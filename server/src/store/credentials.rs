//! A replica's memory of client credentials: the participant a credential
//! hash named, so that a client's requests within a round do not each
//! cost a database query, and the last check-in time it wrote, so that
//! `last_seen_at` is written once per [`TOUCH_EVERY`] and not on every
//! check-in.
//!
//! A credential is refused once its participant's `expires_at` has passed
//! or its enrollment token is revoked (which moves `expires_at` to the
//! revocation's time), and a task's deletion removes its participants. A
//! remembered record must never outlive such a change, on any replica:
//!
//! - **Closed until told otherwise.** A cache remembers nothing until the
//!   service opens it: [`CredentialCache::open`] on SQLite, where one
//!   process holds the database (its lock file), and on PostgreSQL only
//!   while the replica listens for the other replicas' changes and hears
//!   them ([`listen`]: it opens the cache once it has heard a notification
//!   it sent itself, and sends one every few seconds). A listener that
//!   fails, or stops hearing itself, closes the cache (and forgets
//!   everything) until it listens again.
//! - **Told of every change.** Revoking a token and deleting a task forget
//!   the task's credentials here once their transaction commits, and on
//!   PostgreSQL the same transaction sends a notification on
//!   [`CHANNEL`] that every listening replica receives once it commits.
//! - **No stale read put back.** A change bumps the cache's generation; a
//!   record read from the database is remembered only if no change was
//!   heard between the read's start and its insertion, so a read that
//!   raced a revocation is used once (as it would have been without a
//!   cache) and not kept.
//! - **Kept at most [`TTL`]**, whatever was heard: a bound on the harm of
//!   a notification that never came.
//!
//! Natural expiry needs none of this: the handlers check the record's
//! `expires_at` against the clock on every request.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

use super::ParticipantRecord;

/// The PostgreSQL notification channel of credential changes; the payload
/// is the task's id.
pub const CHANNEL: &str = "cohort_credentials";

/// How long a remembered participant is used before it is read again.
pub const TTL: Duration = Duration::from_secs(60);

/// How often a participant's `last_seen_at` is written at most (per
/// replica): a check-in within this long of the last one written is not
/// written.
pub const TOUCH_EVERY: Duration = Duration::from_secs(30);

/// Credentials remembered at most; past it, the expired ones go, and then
/// everything (a replica serving this many clients reads them again).
const CAPACITY: usize = 200_000;

/// See [the module](self).
#[derive(Debug, Default)]
pub struct CredentialCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Whether records may be remembered.
    open: bool,
    /// Bumped by every change heard, and by opening and closing.
    generation: u64,
    by_hash: HashMap<[u8; 32], Remembered>,
    /// A participant's last `last_seen_at` written from here, with when.
    touched: HashMap<String, Instant>,
    /// Lookups answered from memory and from the database.
    counters: Option<Counters>,
}

/// See [`CredentialCache::count_into`].
#[derive(Debug)]
struct Counters {
    memory: Counter,
    database: Counter,
}

#[derive(Debug)]
struct Remembered {
    participant: ParticipantRecord,
    read_at: Instant,
}

impl CredentialCache {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts remembering (forgetting anything from before).
    pub fn open(&self) {
        let mut inner = self.lock();
        inner.forget_all();
        inner.open = true;
    }

    /// Stops remembering, and forgets everything.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.forget_all();
        inner.open = false;
    }

    /// Whether records are remembered.
    pub fn is_open(&self) -> bool {
        self.lock().open
    }

    /// Counts each lookup of a credential in `memory` (answered here) or
    /// `database` (read from the store).
    pub fn count_into(&self, memory: Counter, database: Counter) {
        self.lock().counters = Some(Counters { memory, database });
    }

    /// The participant of a credential hash, if remembered and fresh.
    pub(crate) fn participant(&self, credential_hash: &[u8; 32]) -> Option<ParticipantRecord> {
        let inner = self.lock();
        let found = inner
            .by_hash
            .get(credential_hash)
            .filter(|remembered| inner.open && remembered.read_at.elapsed() < TTL)
            .map(|remembered| remembered.participant.clone());
        if let Some(counters) = &inner.counters {
            if found.is_some() { &counters.memory } else { &counters.database }.inc();
        }
        found
    }

    /// The generation to hand back to [`remember`](Self::remember) with a
    /// record read after this call.
    pub(crate) fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Remembers a record read since `generation`, unless a change was
    /// heard meanwhile.
    pub(crate) fn remember(&self, generation: u64, participant: &ParticipantRecord) {
        let mut inner = self.lock();
        if !inner.open || inner.generation != generation {
            return;
        }
        if inner.by_hash.len() >= CAPACITY {
            inner.by_hash.retain(|_, remembered| remembered.read_at.elapsed() < TTL);
            if inner.by_hash.len() >= CAPACITY {
                inner.by_hash.clear();
            }
        }
        let remembered = Remembered { participant: participant.clone(), read_at: Instant::now() };
        inner.by_hash.insert(participant.credential_hash, remembered);
    }

    /// Forgets every credential of `task` (a token of it revoked, or the
    /// task deleted), and when any participant's check-in was last written
    /// (a deleted participant's next one is refused; changes are rare).
    pub fn forget_task(&self, task: &str) {
        let mut inner = self.lock();
        inner.generation = inner.generation.wrapping_add(1);
        inner.by_hash.retain(|_, remembered| remembered.participant.task_id != task);
        inner.touched.clear();
    }

    /// Whether a check-in of `participant` now should be written: none
    /// was written from here within [`TOUCH_EVERY`]. Always while the
    /// cache is closed.
    pub(crate) fn needs_touch(&self, participant: &str) -> bool {
        let inner = self.lock();
        !inner.open || inner.touched.get(participant).is_none_or(|at| at.elapsed() >= TOUCH_EVERY)
    }

    /// A check-in of `participant` was written.
    pub(crate) fn touched(&self, participant: &str) {
        let mut inner = self.lock();
        if !inner.open {
            return;
        }
        if inner.touched.len() >= CAPACITY {
            inner.touched.retain(|_, at| at.elapsed() < TOUCH_EVERY);
            if inner.touched.len() >= CAPACITY {
                inner.touched.clear();
            }
        }
        inner.touched.insert(participant.to_string(), Instant::now());
    }
}

impl Inner {
    fn forget_all(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        self.by_hash.clear();
        self.touched.clear();
    }
}

/// How long a listener that failed waits before it listens again.
pub const RELISTEN_AFTER: Duration = Duration::from_secs(1);

/// How often a listener checks that it still hears: it sends itself a
/// notification, and stops (closing the cache) if that does not come back
/// within [`PROBE_WITHIN`].
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// See [`PROBE_EVERY`].
pub const PROBE_WITHIN: Duration = Duration::from_secs(3);

/// The prefix of a listener's own notifications (a task id is 32 hex
/// digits, so none starts with it).
const PROBE: &str = "probe:";

/// Keeps `cache` open while a PostgreSQL connection to `url` listens on
/// [`CHANNEL`] and hears it, forgetting each task named by a
/// notification. The cache opens only once the listener heard a
/// notification it sent itself (a `LISTEN` that succeeds without being
/// heard, as through a pooler in transaction mode, leaves it closed), and
/// closes whenever the connection fails or a later such probe is not heard
/// within [`PROBE_WITHIN`]; then it listens again after
/// [`RELISTEN_AFTER`]. Ends once the cache is found dropped (or when the
/// task running it is aborted, as the service does when it stops).
pub async fn listen(url: String, cache: Weak<CredentialCache>) {
    loop {
        if cache.upgrade().is_none() {
            return;
        }
        let error = match connect(&url).await {
            Ok(mut listener) => {
                // A lost connection is reported at once, not after a
                // reconnection inside `try_recv` that would hide it.
                listener.eager_reconnect(false);
                match listener.listen(CHANNEL).await {
                    Ok(()) => follow(&mut listener, &cache).await,
                    Err(error) => Some(error),
                }
            }
            Err(error) => Some(error),
        };
        if let Some(cache) = cache.upgrade() {
            cache.close();
        }
        match error {
            Some(error) => tracing::warn!(%error, "credential notifications lost; listening again"),
            None => return,
        }
        tokio::time::sleep(RELISTEN_AFTER).await;
    }
}

/// The PostgreSQL application name of a listener's connection (as
/// `pg_stat_activity` shows it).
pub const APPLICATION_NAME: &str = "cohort-credentials";

/// A listener on `url`, named [`APPLICATION_NAME`].
async fn connect(url: &str) -> Result<sqlx::postgres::PgListener, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(options.application_name(APPLICATION_NAME));
    sqlx::postgres::PgListener::connect_with(&pool).await
}

/// Applies notifications until the connection fails or stops hearing its
/// own probes (the error), or the cache is found dropped (`None`); opens
/// the cache once the first probe is heard.
async fn follow(
    listener: &mut sqlx::postgres::PgListener,
    cache: &Weak<CredentialCache>,
) -> Option<sqlx::Error> {
    let mut opened = false;
    // The probe awaited (its payload, when it was sent), and when the last
    // one was heard.
    let mut awaited: Option<(String, Instant)> = None;
    let mut heard: Option<Instant> = None;
    loop {
        if awaited.as_ref().is_some_and(|(_, sent)| sent.elapsed() >= PROBE_WITHIN) {
            return Some(sqlx::Error::Protocol("the listener did not hear its own notification".into()));
        }
        if awaited.is_none() && heard.is_none_or(|heard| heard.elapsed() >= PROBE_EVERY) {
            let payload = format!("{PROBE}{}", crate::api::auth::new_id());
            let sent = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(CHANNEL)
                .bind(&payload)
                .execute(&mut *listener)
                .await;
            if let Err(error) = sent {
                return Some(error);
            }
            awaited = Some((payload, Instant::now()));
        }
        // Waits at most a second, so that a probe's deadline is kept;
        // sqlx's buffered reads keep a message read in part.
        let received = tokio::time::timeout(Duration::from_secs(1), listener.try_recv()).await;
        let cache = cache.upgrade()?;
        match received {
            Err(_) => {}
            Ok(Ok(Some(notification))) => {
                let payload = notification.payload();
                if awaited.as_ref().is_some_and(|(awaited, _)| awaited == payload) {
                    awaited = None;
                    heard = Some(Instant::now());
                    if !std::mem::replace(&mut opened, true) {
                        // Anything remembered before this point may have
                        // missed a notification: `open` starts afresh.
                        cache.open();
                    }
                } else if !payload.starts_with(PROBE) {
                    cache.forget_task(payload);
                }
            }
            // The connection was lost: notifications may have been missed.
            Ok(Ok(None)) => return Some(sqlx::Error::PoolClosed),
            Ok(Err(error)) => return Some(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn participant(id: &str, task: &str, hash: u8) -> ParticipantRecord {
        ParticipantRecord {
            id: id.into(),
            task_id: task.into(),
            credential_hash: [hash; 32],
            enrolled_at: 1,
            last_seen_at: 1,
            expires_at: i64::MAX,
            identity_key: None,
            token_id: None,
        }
    }

    #[test]
    fn a_closed_cache_remembers_nothing_and_always_writes_check_ins() {
        let cache = CredentialCache::default();
        let p = participant("p", "t", 1);
        cache.remember(cache.generation(), &p);
        assert_eq!(cache.participant(&[1; 32]), None);
        cache.touched("p");
        assert!(cache.needs_touch("p"));
        cache.open();
        cache.remember(cache.generation(), &p);
        assert_eq!(cache.participant(&[1; 32]), Some(p.clone()));
        // Closing forgets, and opening again starts empty.
        cache.close();
        assert_eq!(cache.participant(&[1; 32]), None);
        cache.open();
        assert_eq!(cache.participant(&[1; 32]), None);
    }

    #[test]
    fn a_change_forgets_its_task_and_a_read_that_raced_it_is_not_kept() {
        let cache = CredentialCache::default();
        cache.open();
        let (a, b) = (participant("a", "t1", 1), participant("b", "t2", 2));
        cache.remember(cache.generation(), &a);
        cache.remember(cache.generation(), &b);
        cache.touched("a");
        cache.touched("b");
        assert!(!cache.needs_touch("a"));
        cache.forget_task("t1");
        assert_eq!(cache.participant(&[1; 32]), None);
        assert_eq!(cache.participant(&[2; 32]), Some(b));
        assert!(cache.needs_touch("a"), "a forgotten task's check-ins are written again");
        assert!(cache.needs_touch("b"), "whatever the task: a participant remembered by none is too");
        // A read begun before a change and finished after it.
        let before = cache.generation();
        cache.forget_task("t1");
        cache.remember(before, &a);
        assert_eq!(cache.participant(&[1; 32]), None);
        // A change to another task also refuses it: generations are not per
        // task, so no read can miss its own task's change.
        let before = cache.generation();
        cache.forget_task("t9");
        cache.remember(before, &a);
        assert_eq!(cache.participant(&[1; 32]), None);
        cache.remember(cache.generation(), &a);
        assert_eq!(cache.participant(&[1; 32]), Some(a));
    }

    #[test]
    fn a_full_cache_makes_room() {
        let cache = CredentialCache::default();
        cache.open();
        for n in 0..CAPACITY as u32 {
            let mut p = participant(&n.to_string(), "t", 0);
            p.credential_hash[..4].copy_from_slice(&n.to_le_bytes());
            cache.remember(cache.generation(), &p);
        }
        assert_eq!(cache.lock().by_hash.len(), CAPACITY);
        let last = participant("last", "t", 0xff);
        cache.remember(cache.generation(), &last);
        assert_eq!(cache.participant(&[0xff; 32]), Some(last));
        assert_eq!(cache.lock().by_hash.len(), 1, "nothing had expired: all went");
    }
}
