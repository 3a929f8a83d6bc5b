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

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
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
