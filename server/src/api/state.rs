//! What every handler can reach: the store, the round actor, metrics and
//! the server-wide settings.

use super::ratelimit::Limiters;
use crate::coordinator::Coordinator;
use crate::metrics::Metrics;
use crate::store::SqlStore;

/// Server-wide settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// SHA-256 of the admin token.
    pub admin_token_hash: [u8; 32],
    /// Largest accepted stage message.
    pub max_message_bytes: usize,
    /// How long a client credential stays valid.
    pub credential_ttl_ms: i64,
    /// The browser client's build (`web/pkg`), served under `/web/pkg`.
    pub web_assets: std::path::PathBuf,
    /// The public demo task `/demo` joins, when there is one.
    pub demo_task: Option<DemoTask>,
    /// Rate limits of the client API.
    pub limiters: Limiters,
    /// Most model parameters over all tasks that are not stopped or
    /// completed; a task that would exceed it is refused.
    pub max_total_parameters: usize,
}

/// Most model parameters over all unfinished tasks, by default: about
/// 0.4 GB of weights, checkpoint and optimizer state in memory per 25 M.
pub const DEFAULT_MAX_TOTAL_PARAMETERS: usize = 50_000_000;

/// What every handler can reach: one shared [`Shared`], so that the
/// clones axum makes for every request and layer cost one reference count
/// each.
#[derive(Clone, Debug)]
pub struct AppState(std::sync::Arc<Shared>);

impl AppState {
    /// Shares `shared` between the handlers.
    pub fn new(shared: Shared) -> Self {
        Self(std::sync::Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
#[derive(Debug)]
pub struct Shared {
    /// Storage.
    pub store: SqlStore,
    /// The round actor.
    pub coordinator: Coordinator,
    /// Metrics registry.
    pub metrics: Metrics,
    /// Settings.
    pub config: ApiConfig,
    /// Held while a task is created, so that the parameter cap holds
    /// against concurrent creations.
    pub creating: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Passes requests for tasks that other replicas lead on to them.
    pub forwarder: crate::cluster::forward::Forwarder,
    /// The admin event streams: their cap and their producers.
    pub streams: super::events::Streams,
    /// The newest stored model of each task this replica served without
    /// leading it (see [`StoredModels`]).
    pub models: StoredModels,
    /// Each participant's held request (see [`Holds`]).
    pub holds: Holds,
}

/// Each participant's held request (a check-in, or a stage message's `GET`
/// or accepted `POST`, with `wait_ms`): one at a time on this replica. A
/// newer one, or the participant's leave, ends the older at its next wake
/// (at most 2 s later) before it asks the coordinator again, so that one
/// credential cannot keep many requests asking, and a held check-in does
/// not check a client in again after it left. (With replicas, a client may
/// hold one on its task's leader and one on its group's replica.)
#[derive(Clone, Debug, Default)]
pub struct Holds {
    current: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u64>>>,
    next: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Holds {
    /// A held request of `participant` begins: the one before it ends.
    pub fn begin(&self, participant: &str) -> u64 {
        let hold = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(participant.to_string(), hold);
        hold
    }

    /// Whether `hold` is still `participant`'s held request.
    pub fn holds(&self, participant: &str, hold: u64) -> bool {
        self.lock().get(participant) == Some(&hold)
    }

    /// `hold` ended (its answer went, or its client went away).
    pub fn end(&self, participant: &str, hold: u64) {
        let mut current = self.lock();
        if current.get(participant) == Some(&hold) {
            current.remove(participant);
        }
    }

    /// `participant` leaves: its held request ends.
    pub fn cancel(&self, participant: &str) {
        self.lock().remove(participant);
    }

    /// How many participants have a held request (for tests).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none has.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, u64>> {
        self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The newest checkpoint of each task whose model a replica serves without
/// leading the task: its round and its bytes, read from the store once per
/// round. A replica serves a model download itself rather than forwarding
/// it to the leader (the largest body a client fetches, once a round). The
/// leader stores a round's checkpoint before it adopts the round's model,
/// so the newest stored model is the leader's, or the next one a moment
/// early, and the `x-cohort-round` header says which. The clients of a
/// round ask for it together: one of them reads it, the others wait for
/// that read. At most [`MAX_STORED_MODELS`] tasks' models are kept (the
/// least recently served goes first), and a task's goes once it is over.
#[derive(Clone, Debug, Default)]
pub struct StoredModels {
    models: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, StoredModel>>>,
    /// Counts the times a model was served, to order them by use.
    served: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// The most tasks whose model a replica keeps.
pub const MAX_STORED_MODELS: usize = 64;

#[derive(Debug, Default)]
struct StoredModel {
    /// The round and the bytes, once read.
    model: Option<(u64, bytes::Bytes)>,
    /// Held while one request reads the model from the store.
    reading: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// When it was last served (the count of models served then).
    used: u64,
}

impl StoredModels {
    /// The newest stored model of `task`: its round and its bytes.
    pub async fn newest(
        &self,
        store: &crate::store::SqlStore,
        task: &str,
    ) -> crate::store::StoreResult<(u64, bytes::Bytes)> {
        // A round stored between the two reads may delete the checkpoint
        // just found (a retention of one): read the newest again.
        for _ in 0..3 {
            let round = store.latest_checkpoint_round(task).await?;
            if let Some(model) = self.kept(task, round) {
                return Ok(model);
            }
            let reading = self.lock().entry(task.to_string()).or_default().reading.clone();
            let _reading = reading.lock().await;
            // Another request may have read it meanwhile.
            if let Some(model) = self.kept(task, round) {
                return Ok(model);
            }
            match store.checkpoint(task, round as i64).await {
                Ok(record) => {
                    let model = (round, bytes::Bytes::from(record.model));
                    self.keep(task, model.clone());
                    return Ok(model);
                }
                Err(crate::store::StoreError::NotFound(_)) => continue,
                Err(error) => return Err(error),
            }
        }
        Err(crate::store::StoreError::NotFound("checkpoint"))
    }

    /// The model kept for `task` if it is of `round` or newer.
    fn kept(&self, task: &str, round: u64) -> Option<(u64, bytes::Bytes)> {
        let mut models = self.lock();
        let entry = models.get_mut(task)?;
        let model = entry.model.clone().filter(|(kept, _)| *kept >= round)?;
        entry.used = self.served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(model)
    }

    /// Keeps `model` for `task` unless a newer one is kept, and the newest
    /// [`MAX_STORED_MODELS`] tasks' models only.
    fn keep(&self, task: &str, model: (u64, bytes::Bytes)) {
        let mut models = self.lock();
        let entry = models.entry(task.to_string()).or_default();
        if entry.model.as_ref().is_none_or(|(kept, _)| *kept < model.0) {
            entry.model = Some(model);
        }
        entry.used = self.served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        while models.len() > MAX_STORED_MODELS {
            let Some(oldest) = models.iter().min_by_key(|(_, m)| m.used).map(|(task, _)| task.clone()) else {
                break;
            };
            models.remove(&oldest);
        }
    }

    /// Forgets `task` (it is over, or led here now).
    pub fn forget(&self, task: &str) {
        self.lock().remove(task);
    }

    /// How many tasks' models are kept (for tests).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no model is kept.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, StoredModel>> {
        self.models.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The public demo task: its id and its (deliberately public) enrollment
/// token.
#[derive(Clone)]
pub struct DemoTask {
    /// Task id.
    pub id: String,
    /// Enrollment token, handed to every page that asks.
    pub enrollment_token: String,
    /// Clients a round selects (the page's "2 of 3 devices"), and the
    /// number of shards the demo's digits are split into.
    pub clients_per_round: u32,
    /// The shard the next joining page trains on: pages are dealt the
    /// shards in turn, so that the first tabs of a round hold different
    /// digits and together all of them.
    pub next_shard: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl DemoTask {
    /// The public demo task `id` with its token, `clients_per_round`
    /// tabs a round and its shards not yet dealt.
    pub fn new(id: String, enrollment_token: String, clients_per_round: u32) -> Self {
        Self { id, enrollment_token, clients_per_round, next_shard: Default::default() }
    }

    /// The shard for a page that joins now.
    pub fn deal_shard(&self) -> u32 {
        self.next_shard.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.clients_per_round.max(1)
    }
}

impl std::fmt::Debug for DemoTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DemoTask").field("id", &self.id).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{MAX_STORED_MODELS, StoredModels};

    #[test]
    fn the_newest_model_is_kept_for_the_tasks_served_last() {
        let models = StoredModels::default();
        models.keep("a", (2, Bytes::from_static(b"two")));
        // An older read that finishes late does not replace it.
        models.keep("a", (1, Bytes::from_static(b"one")));
        assert_eq!(models.kept("a", 2), Some((2, Bytes::from_static(b"two"))));
        // A newer one is in the store: read it.
        assert_eq!(models.kept("a", 3), None);
        // One newer than the store said a moment ago is served.
        assert_eq!(models.kept("a", 1).map(|m| m.0), Some(2));
        assert_eq!(models.kept("b", 0), None);
        for i in 0..MAX_STORED_MODELS {
            models.keep(&format!("t{i}"), (0, Bytes::from_static(b"zero")));
        }
        assert_eq!(models.len(), MAX_STORED_MODELS);
        assert_eq!(models.kept("a", 0), None, "the task served longest ago went");
        assert!(models.kept("t0", 0).is_some());
        models.keep("c", (0, Bytes::new()));
        assert_eq!(models.kept("t1", 0), None, "t0 was served again since");
        models.forget("c");
        assert_eq!(models.len(), MAX_STORED_MODELS - 1);
    }
}
