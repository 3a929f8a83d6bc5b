//! Task leases: which replica leads each task, renewed beside the actor.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::GroupKey;
use crate::coordinator::actor::{Actor, load};
use crate::coordinator::{CoordinatorError, Request, Traced, now_ms};
use crate::round::TaskEngine;
use crate::store::{Fence, ReplicaRecord, SqlStore};

/// How often a replica beats its heart and renews its leases.
pub const LEASE_TICK: Duration = Duration::from_secs(1);

/// How long a lease holds after its renewal.
pub const LEASE_TTL_MS: i64 = 5_000;

/// A replica that could not renew its leases for this long drops its
/// tasks: two seconds before the leases lapse and another replica may take
/// them.
pub const RENEWAL_MARGIN_MS: i64 = 3_000;

/// This process as the other replicas sharing the database see it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Random, fresh per process.
    pub id: String,
    /// Where the other replicas reach this one (`http://host:port`).
    pub url: String,
    /// Start time (Unix ms).
    pub started_at: i64,
}

/// Which replica leads a task's rounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whereabouts {
    /// This one.
    Here,
    /// The replica at this URL.
    At(String),
    /// None at the moment (the task is finished, or its lease is between
    /// holders).
    Nowhere,
}

/// The tasks this replica leads, and the leaders of the others, as of the
/// last lease tick: read by the API on every task request.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    pub(crate) here: HashSet<String>,
    pub(crate) elsewhere: HashMap<String, String>,
    /// Participants of the groups this replica runs for other replicas'
    /// rounds.
    pub(crate) group_members_here: HashSet<String>,
    /// Participants of groups that other replicas run, with the owner's URL.
    pub(crate) group_members_elsewhere: HashMap<String, String>,
    /// The live replicas (id, URL, last heartbeat), this one included, as
    /// of the last lease tick.
    pub(crate) peers: Vec<(String, String, i64)>,
    /// Until when this replica may act on the leases it holds, on the
    /// monotonic clock: [`RENEWAL_MARGIN_MS`] after its last renewal
    /// began. `None` on SQLite, where no other process can take a lease.
    /// A replica paused past it (a long GC pause, a frozen container)
    /// serves and writes nothing for its tasks until a renewal shows it
    /// still holds them.
    pub(crate) leases_hold_until: Option<Instant>,
    /// Tasks this replica could not load, with why (until their record
    /// changes, it does not try again).
    pub(crate) unloadable: HashMap<String, String>,
    /// When each task was last seen led (by any replica), on the
    /// monotonic clock (PostgreSQL; read at every lease renewal).
    pub(crate) last_led: HashMap<String, Instant>,
    /// When this replica started, on the monotonic clock.
    pub(crate) started: Option<Instant>,
    /// Whether other replicas can lead tasks (PostgreSQL).
    pub(crate) shared: bool,
}

impl Routes {
    /// Whether this replica may still act on the leases it holds.
    pub(crate) fn leases_hold(&self) -> bool {
        self.leases_hold_until.is_none_or(|until| Instant::now() < until)
    }
}

/// What the lease keeper tells the actor.
pub(crate) enum LeaseEvent {
    /// Lead this task, loaded from the store after its lease (of this
    /// generation) was taken.
    Adopt { id: String, engine: Box<TaskEngine>, generation: i64 },
    /// Stop leading this task.
    Drop { id: String, why: &'static str },
    /// Stop leading every task (and running every group).
    DropAll {
        why: &'static str,
        /// A planned hand-back (the replica stops), not a lost lease.
        planned: bool,
    },
    /// The groups run here whose leases were renewed at `since`: those
    /// claimed before then and missing were given up or lost.
    KeepGroups { keys: HashSet<GroupKey>, since: i64 },
}

/// Keeps this replica's leases, beside the actor so that the database's
/// answers (or its silence) never hold requests up: every [`LEASE_TICK`]
/// it beats the replica's heart, renews the leases held, takes unheld
/// tasks up to a fair share (loading them from the store), and tells the
/// actor what to lead and what to drop.
pub(crate) struct LeaseKeeper {
    pub(crate) store: SqlStore,
    pub(crate) replica: Arc<Replica>,
    pub(crate) routes: Arc<RwLock<Routes>>,
    /// The generation of each lease held.
    pub(crate) held: HashMap<String, i64>,
    /// When the leases were last renewed.
    pub(crate) renewed_at: i64,
    /// Tasks that could not be loaded, with their `updated_at` then: not
    /// tried again until an administrator changes them (stops, pauses).
    pub(crate) failed_loads: HashMap<String, i64>,
}

impl LeaseKeeper {
    pub(crate) fn record(&self, now: i64) -> ReplicaRecord {
        ReplicaRecord {
            id: self.replica.id.clone(),
            url: self.replica.url.clone(),
            started_at: self.replica.started_at,
            heartbeat_at: now,
        }
    }

    pub(crate) async fn run(mut self, tx: mpsc::Sender<Traced>) {
        let mut ticker = tokio::time::interval(LEASE_TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            for event in self.tick().await {
                if tx.send(Request::Lease(event).into()).await.is_err() {
                    return;
                }
            }
        }
    }

    /// One renewal. The leases must be renewed within
    /// [`RENEWAL_MARGIN_MS`] of the last renewal, or every task is dropped:
    /// a replica that cannot reach the database stops leading before its
    /// leases can lapse (at [`LEASE_TTL_MS`]), so that two replicas never
    /// lead one task.
    pub(crate) async fn tick(&mut self) -> Vec<LeaseEvent> {
        let now = now_ms();
        let began = Instant::now();
        let budget = (self.renewed_at + RENEWAL_MARGIN_MS - now).max(100);
        match tokio::time::timeout(Duration::from_millis(budget as u64), self.renew(now)).await {
            Ok(Ok(events)) => {
                self.renewed_at = now;
                self.hold_until(began);
                events
            }
            failed => {
                match failed {
                    Ok(Err(error)) => tracing::warn!(%error, "could not renew the task leases"),
                    _ => tracing::warn!("the database did not answer the lease renewal in time"),
                }
                if now_ms() - self.renewed_at >= RENEWAL_MARGIN_MS && !self.held.is_empty() {
                    self.held.clear();
                    vec![LeaseEvent::DropAll {
                        planned: false,
                        why: "the leases could not be renewed in time (the database cannot be reached)",
                    }]
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// Lets the replica act on its leases until [`RENEWAL_MARGIN_MS`]
    /// after `began`, when the renewal that succeeded began: the leases it
    /// wrote hold [`LEASE_TTL_MS`] from a moment after `began`, which
    /// leaves two seconds for the replicas' clocks to disagree.
    pub(crate) fn hold_until(&self, began: Instant) {
        let until = began + Duration::from_millis(RENEWAL_MARGIN_MS as u64);
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).leases_hold_until =
            Some(until);
    }

    pub(crate) async fn renew(&mut self, now: i64) -> Result<Vec<LeaseEvent>, CoordinatorError> {
        let until = now + LEASE_TTL_MS;
        let mut events = Vec::new();
        self.store.heartbeat(&self.record(now)).await?;
        let tasks = self.store.tasks().await?;
        let unfinished: HashSet<String> =
            tasks.iter().filter(|t| !t.status.is_final()).map(|t| t.id.clone()).collect();
        // The tasks the actor took itself (created here) are held too.
        let here = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner).here.clone();
        let mut renewing: Vec<String> = self.held.keys().cloned().collect();
        renewing.extend(here.into_iter().filter(|id| !self.held.contains_key(id)));
        // Renew what is held; drop what was lost or finished.
        for id in renewing {
            let generation = if unfinished.contains(&id) {
                self.store.acquire_lease(&id, &self.replica.id, now, until).await?
            } else {
                None
            };
            match (generation, self.held.get(&id).copied()) {
                (Some(renewed), Some(before)) if renewed == before => {}
                (Some(renewed), None) => {
                    self.held.insert(id, renewed);
                }
                _ => {
                    self.held.remove(&id);
                    // Off the routes at once (the actor applies the drop
                    // after the requests queued before it): nothing is
                    // served or written for the task from now on.
                    self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).here.remove(&id);
                    events.push(LeaseEvent::Drop { id, why: "its lease was lost or the task finished" });
                }
            }
        }
        // Keep the groups run here for other replicas' rounds.
        let keys = self.store.renew_groups(&self.replica.id, now, until).await?;
        events.push(LeaseEvent::KeepGroups { keys: keys.into_iter().collect(), since: now });
        // Take unheld tasks up to a fair share of them.
        let peers = self.store.replicas(now - LEASE_TTL_MS).await?;
        let live = peers.len().max(1);
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).peers =
            peers.into_iter().map(|r| (r.id, r.url, r.heartbeat_at)).collect();
        let fair = unfinished.len().div_ceil(live);
        let holders: HashMap<String, String> =
            self.store.leases(now).await?.into_iter().map(|(task, holder)| (task, holder.url)).collect();
        let updated: HashMap<&str, i64> = tasks.iter().map(|t| (t.id.as_str(), t.updated_at)).collect();
        self.failed_loads.retain(|id, at| updated.get(id.as_str()) == Some(at));
        let mut free: Vec<&String> = unfinished
            .iter()
            .filter(|id| {
                !self.held.contains_key(*id)
                    && !holders.contains_key(*id)
                    && !self.failed_loads.contains_key(*id)
            })
            .collect();
        free.sort();
        // Held only once the renewal succeeds whole (its events reach the
        // actor): a lease taken by a renewal that fails later lapses.
        let mut adopted = Vec::new();
        for id in free {
            if self.held.len() + adopted.len() >= fair {
                break;
            }
            let Some(generation) = self.store.acquire_lease(id, &self.replica.id, now, until).await? else {
                continue;
            };
            let fence = Fence { replica: self.replica.id.clone(), generation };
            match adopt(&self.store, id, &fence).await {
                Ok(engine) => {
                    adopted.push((id.clone(), generation));
                    events.push(LeaseEvent::Adopt { id: id.clone(), engine: Box::new(engine), generation });
                }
                Err(error @ (CoordinatorError::Store(_) | CoordinatorError::Unavailable)) => {
                    // The database failed, not the task: tried again next time.
                    tracing::warn!(task = %id, %error, "could not load the task; trying again");
                    let _ = self.store.release_lease(id, &self.replica.id).await;
                }
                Err(error) => {
                    tracing::error!(task = %id, %error, "could not load the task; it can be stopped and deleted through the admin API");
                    let _ = self.store.release_lease(id, &self.replica.id).await;
                    self.failed_loads.insert(id.clone(), updated.get(id.as_str()).copied().unwrap_or(0));
                    self.routes
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .unloadable
                        .insert(id.clone(), format!("this replica could not load the task: {error}"));
                }
            }
        }
        self.held.extend(adopted);
        let seen = Instant::now();
        let mut routes = self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        routes.unloadable.retain(|id, _| self.failed_loads.contains_key(id));
        for task in holders.keys().chain(self.held.keys()) {
            routes.last_led.insert(task.clone(), seen);
        }
        routes.last_led.retain(|task, _| unfinished.contains(task));
        routes.elsewhere = holders
            .into_iter()
            .filter(|(task, url)| !self.held.contains_key(task) && *url != self.replica.url)
            .collect();
        Ok(events)
    }
}

/// Loads a task whose lease was just taken: the groups that an earlier
/// leader handed out are deleted first (their owners stop running them),
/// since the task restarts from its last stored round.
async fn adopt(store: &SqlStore, id: &str, fence: &Fence) -> Result<TaskEngine, CoordinatorError> {
    store.delete_groups(id, Some(fence)).await?;
    load(store, id).await
}

impl Actor {
    /// Acts on the lease keeper's news.
    pub(crate) fn apply(&mut self, event: LeaseEvent) {
        match event {
            LeaseEvent::Adopt { id, engine, generation } => {
                tracing::info!(task = %id, generation, "leading the task");
                self.engines.insert(id.clone(), *engine);
                self.fences.insert(id.clone(), Fence { replica: self.replica.id.clone(), generation });
                self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).here.insert(id);
            }
            LeaseEvent::Drop { id, why } => self.drop_task(&id, why, false),
            LeaseEvent::DropAll { why, planned } => {
                for id in self.engines.keys().cloned().collect::<Vec<_>>() {
                    self.drop_task(&id, why, planned);
                }
                for key in self.owned.keys().cloned().collect::<Vec<_>>() {
                    self.disown(&key, why);
                }
            }
            LeaseEvent::KeepGroups { keys, since } => {
                let gone: Vec<GroupKey> = self
                    .owned
                    .iter()
                    .filter(|(key, group)| group.claimed_at < since && !keys.contains(*key))
                    .map(|(key, _)| key.clone())
                    .collect();
                for key in gone {
                    self.disown(&key, "its lease lapsed, or its round was given up or taken over");
                }
            }
        }
    }

    /// Takes the lease of a task just created here and loads it.
    pub(crate) async fn take(&mut self, id: &str, now: i64) -> Result<bool, CoordinatorError> {
        let Some(generation) =
            self.store.acquire_lease(id, &self.replica.id, now, now + LEASE_TTL_MS).await?
        else {
            return Ok(false);
        };
        let fence = Fence { replica: self.replica.id.clone(), generation };
        match adopt(&self.store, id, &fence).await {
            Ok(engine) => {
                self.apply(LeaseEvent::Adopt { id: id.to_string(), engine: Box::new(engine), generation });
                Ok(true)
            }
            Err(error) => {
                let _ = self.store.release_lease(id, &self.replica.id).await;
                Err(error)
            }
        }
    }

    pub(crate) async fn give_up_leases(&mut self) {
        self.apply(LeaseEvent::DropAll { why: "the replica is stopping", planned: true });
        if let Err(error) = self.store.remove_replica(&self.replica.id).await {
            tracing::warn!(%error, "could not give up the leases; they lapse by themselves");
        }
    }
}
