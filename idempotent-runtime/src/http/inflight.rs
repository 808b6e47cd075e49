//! The keys this process is running a request for, so that a second
//! request with a key in flight is answered at once (409) or waits for the
//! first in memory, rather than holding a database connection blocked on
//! the first request's marker. The store stays the authority: across
//! processes the store's claim decides (see the module `http`).
//!
//! Each key's entry counts the requests that hold it or wait for it, and
//! is removed when the last of them is done with it, whatever point of its
//! life a request is dropped at (waiting, handed the key but not yet
//! polled, running): the count is taken and given back under the map's
//! lock, never inferred from who else still holds the entry's mutex.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::OwnedMutexGuard;

/// A key's entry: the mutex its holder holds, and how many requests hold
/// it or wait for it.
#[derive(Debug)]
struct Slot {
    lock: Arc<tokio::sync::Mutex<()>>,
    users: usize,
}

/// The registry, shared by the clones of one layer.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    slots: Mutex<HashMap<String, Slot>>,
}

/// A request's place among a key's users, given back when dropped (the
/// entry goes with the last one).
#[derive(Debug)]
struct User {
    inflight: Arc<Inflight>,
    id: String,
}

/// A key held by this request until dropped.
#[derive(Debug)]
pub(crate) struct Held {
    // Fields drop in order: the key's mutex is released before the request
    // stops counting as a user, so an entry never goes while held.
    _lock: OwnedMutexGuard<()>,
    _user: User,
}

impl Inflight {
    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts a request as a user of `id`; the entry's mutex.
    fn join(self: &Arc<Self>, id: String) -> (User, Arc<tokio::sync::Mutex<()>>) {
        let mut slots = self.slots();
        let slot = slots.entry(id.clone()).or_insert_with(|| Slot {
            lock: Arc::default(),
            users: 0,
        });
        slot.users += 1;
        let lock = Arc::clone(&slot.lock);
        drop(slots);
        let user = User {
            inflight: Arc::clone(self),
            id,
        };
        (user, lock)
    }

    /// Holds `id`, or `None` when another request holds it and `wait` is
    /// `None` or runs out first.
    pub(crate) async fn hold(self: &Arc<Self>, id: String, wait: Option<Duration>) -> Option<Held> {
        // `user` is given back however this ends: refused, timed out, or
        // dropped while waiting (even once handed the key, not yet polled).
        let (user, lock) = self.join(id);
        let guard = match wait {
            None => lock.try_lock_owned().ok(),
            Some(limit) => tokio::time::timeout(limit, lock.lock_owned()).await.ok(),
        }?;
        Some(Held {
            _lock: guard,
            _user: user,
        })
    }

    /// How many keys are held or waited for.
    pub(crate) fn len(&self) -> usize {
        self.slots().len()
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let mut slots = self.inflight.slots();
        if let Some(slot) = slots.get_mut(&self.id) {
            slot.users = slot.users.saturating_sub(1);
            if slot.users == 0 {
                slots.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future as _;

    use super::*;

    #[tokio::test]
    async fn a_held_key_refuses_or_waits_and_is_forgotten_when_free() {
        let inflight = Arc::new(Inflight::default());
        let first = inflight.hold("k".into(), None).await.expect("free key");
        assert!(inflight.hold("k".into(), None).await.is_none());
        assert!(
            inflight
                .hold("k".into(), Some(Duration::from_millis(20)))
                .await
                .is_none()
        );
        assert!(inflight.hold("other".into(), None).await.is_some());
        let waiter = {
            let inflight = Arc::clone(&inflight);
            tokio::spawn(async move { inflight.hold("k".into(), Some(Duration::from_secs(10))).await.is_some() })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(first);
        assert!(waiter.await.unwrap());
        assert_eq!(inflight.len(), 0);
    }

    /// A waiter handed the key by its holder and dropped before it was
    /// polled again gives its place back: the entry goes.
    #[tokio::test]
    async fn a_waiter_dropped_once_handed_the_key_leaves_no_entry() {
        let inflight = Arc::new(Inflight::default());
        for round in 0..1000 {
            let first = inflight.hold("k".into(), None).await.expect("free key");
            let mut waiter = Box::pin(inflight.hold("k".into(), Some(Duration::from_secs(10))));
            let pending =
                std::future::poll_fn(|cx| std::task::Poll::Ready(waiter.as_mut().poll(cx).is_pending())).await;
            assert!(pending);
            drop(first);
            assert_eq!(inflight.len(), 1, "round {round}: the waiter still counts");
            drop(waiter);
            assert_eq!(inflight.len(), 0, "round {round}");
        }
    }
}
