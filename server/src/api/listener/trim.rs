//! Giving freed memory back to the system after many connections close.
//!
//! glibc's malloc returns freed memory to the system only from the top of
//! each arena: memory that thousands of connections or event streams used,
//! freed below allocations that live on, stays resident. Measured on
//! `cohort serve`: 2 000 admin event streams closed left RSS 44 MiB above
//! where it started, for as long as the process ran; `malloc_trim(0)`,
//! which hands every free page of every arena back, brought it to within
//! 4 MiB. (jemalloc with background purging also gave it back, but held
//! 5 MiB more while the streams were open; mimalloc kept it all and
//! started 13 MiB higher.) So the listener trims once a burst of
//! connections has closed: when the connections served have fallen by
//! [`TRIM_AFTER`] since their last high point, checked every
//! [`CHECK_EVERY`]. Elsewhere than glibc this does nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

/// How many connections must have closed since the last high point.
pub(super) const TRIM_AFTER: usize = 256;
/// How often the connections served are counted.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(2);

/// When to trim, from the connections served now.
#[derive(Debug, Default)]
pub(super) struct Trigger {
    high: usize,
}

impl Trigger {
    /// Whether to trim now that `served` connections are open.
    pub(super) fn trim_at(&mut self, served: usize) -> bool {
        if self.high >= served + TRIM_AFTER {
            self.high = served;
            return true;
        }
        self.high = self.high.max(served);
        false
    }
}

/// Counts the connections that `permits` (of `max_connections`) serves
/// every [`CHECK_EVERY`] and trims after a burst has closed; runs until
/// aborted.
pub(super) async fn after_bursts(permits: Arc<Semaphore>, max_connections: usize) {
    let mut trigger = Trigger::default();
    let mut every = tokio::time::interval(CHECK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let served = max_connections.saturating_sub(permits.available_permits());
        if trigger.trim_at(served) {
            // The trim walks every arena under its lock: off the runtime's
            // workers.
            let _ = tokio::task::spawn_blocking(give_back).await;
        }
    }
}

/// Hands the allocator's free pages back to the system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn give_back() {
    // SAFETY: malloc_trim takes no pointer and touches only the allocator's
    // own state, under the allocator's locks; any thread may call it at any
    // time.
    let released = unsafe { libc::malloc_trim(0) } == 1;
    tracing::debug!(released, "freed memory handed back to the system");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn give_back() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_follows_a_burst_of_closed_connections_once() {
        let mut trigger = Trigger::default();
        // Connections come and go a few at a time: no trim.
        for served in [0, 10, 200, 150, 240, 100] {
            assert!(!trigger.trim_at(served), "{served}");
        }
        // A burst of 2 000 opens, then closes.
        assert!(!trigger.trim_at(2000));
        assert!(!trigger.trim_at(1800), "fewer than 256 closed");
        assert!(trigger.trim_at(12));
        // Once: the high point is where the trim left it.
        assert!(!trigger.trim_at(12));
        assert!(!trigger.trim_at(0));
        assert!(!trigger.trim_at(255));
        assert!(!trigger.trim_at(0), "255 closed");
        assert!(!trigger.trim_at(256));
        assert!(trigger.trim_at(0), "256 closed since the last high point");
    }
}
