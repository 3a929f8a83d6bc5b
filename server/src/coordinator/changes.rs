//! Change counters for the admin API's event streams: one per task and one
//! for everything (the task list), so that a change to one task wakes the
//! streams of that task and of the list, not those of every task.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use tokio::sync::watch;

/// The counters, shared by the actor (which bumps them) and its handles
/// (which subscribe). Once closed (the actor stopped), every receiver's
/// `changed()` fails, and so does that of one subscribed later.
#[derive(Debug)]
pub(crate) struct Changes {
    senders: Mutex<Option<Senders>>,
}

#[derive(Debug)]
struct Senders {
    all: watch::Sender<u64>,
    tasks: HashMap<String, watch::Sender<u64>>,
}

fn bump(sender: &watch::Sender<u64>) {
    sender.send_modify(|count| *count = count.wrapping_add(1));
}

impl Default for Changes {
    fn default() -> Self {
        let senders = Senders { all: watch::Sender::new(0), tasks: HashMap::new() };
        Self { senders: Mutex::new(Some(senders)) }
    }
}

impl Changes {
    fn with<T>(&self, f: impl FnOnce(&mut Senders) -> T) -> Option<T> {
        self.senders.lock().unwrap_or_else(PoisonError::into_inner).as_mut().map(f)
    }

    /// Told of every change.
    pub(crate) fn subscribe_all(&self) -> watch::Receiver<u64> {
        self.with(|senders| senders.all.subscribe()).unwrap_or_else(closed)
    }

    /// Told of the changes of `task`.
    pub(crate) fn subscribe(&self, task: &str) -> watch::Receiver<u64> {
        self.with(|senders| {
            senders.tasks.entry(task.to_string()).or_insert_with(|| watch::Sender::new(0)).subscribe()
        })
        .unwrap_or_else(closed)
    }

    /// `task` may have changed.
    pub(crate) fn task(&self, task: &str) {
        self.with(|senders| {
            bump(&senders.all);
            if let Some(sender) = senders.tasks.get(task) {
                if sender.receiver_count() == 0 {
                    senders.tasks.remove(task);
                } else {
                    bump(sender);
                }
            }
        });
    }

    /// Any task may have changed.
    pub(crate) fn all(&self) {
        self.with(|senders| {
            bump(&senders.all);
            senders.tasks.retain(|_, sender| sender.receiver_count() > 0);
            senders.tasks.values().for_each(bump);
        });
    }

    /// The actor stopped: every receiver is told so.
    pub(crate) fn close(&self) {
        self.senders.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// How many tasks have a counter (for tests).
    #[cfg(test)]
    fn counters(&self) -> usize {
        self.with(|senders| senders.tasks.len()).unwrap_or(0)
    }
}

/// A receiver whose sender is gone.
fn closed() -> watch::Receiver<u64> {
    watch::Sender::new(0).subscribe()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_wakes_its_task_and_the_list_and_no_other_task() {
        let changes = Changes::default();
        let mut all = changes.subscribe_all();
        let mut a = changes.subscribe("a");
        let b = changes.subscribe("b");
        changes.task("a");
        assert!(all.has_changed().unwrap() && a.has_changed().unwrap());
        assert!(!b.has_changed().unwrap(), "a change to task a woke task b");
        all.mark_unchanged();
        a.mark_unchanged();
        changes.all();
        assert!(all.has_changed().unwrap() && a.has_changed().unwrap() && b.has_changed().unwrap());
    }

    #[test]
    fn counters_nobody_follows_are_dropped() {
        let changes = Changes::default();
        let a = changes.subscribe("a");
        drop(changes.subscribe("b"));
        changes.all();
        assert_eq!(changes.counters(), 1);
        drop(a);
        changes.task("a");
        assert_eq!(changes.counters(), 0);
    }

    #[test]
    fn once_closed_every_receiver_fails_and_so_does_a_new_one() {
        let changes = Changes::default();
        let all = changes.subscribe_all();
        let a = changes.subscribe("a");
        changes.close();
        assert!(all.has_changed().is_err() && a.has_changed().is_err());
        assert!(changes.subscribe("a").has_changed().is_err());
        assert!(changes.subscribe_all().has_changed().is_err());
        changes.task("a");
    }
}
