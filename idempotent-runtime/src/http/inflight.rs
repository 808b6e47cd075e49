//! The keys this process is running a request for, so that a second
//! request with a key in flight is answered at once (409) or waits for the
//! first in memory, rather than holding a database connection blocked on
//! the first request's marker. The store stays the authority: across
//! processes the store's claim decides (see the module `http`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OwnedMutexGuard;

type Slots = Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>;

/// The registry, shared by the clones of one layer.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    slots: Slots,
}

/// A key held by this request until dropped.
#[derive(Debug)]
pub(crate) struct Held {
    inflight: Arc<Inflight>,
    id: String,
    lock: Option<OwnedMutexGuard<()>>,
}

impl Inflight {
    fn slot(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Arc::clone(slots.entry(id.to_owned()).or_default())
    }

    /// Holds `id`, or `None` when another request holds it and `wait` is
    /// `None` or runs out first.
    pub(crate) async fn hold(self: &Arc<Self>, id: String, wait: Option<Duration>) -> Option<Held> {
        let slot = self.slot(&id);
        let mut held = Held {
            inflight: Arc::clone(self),
            id,
            lock: None,
        };
        held.lock = match wait {
            None => Arc::clone(&slot).try_lock_owned().ok(),
            Some(limit) => tokio::time::timeout(limit, Arc::clone(&slot).lock_owned()).await.ok(),
        };
        drop(slot);
        // Dropping `held` without its lock forgets the slot if unused.
        held.lock.is_some().then_some(held)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().map(|slots| slots.len()).unwrap_or(0)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        drop(self.lock.take());
        let mut slots = self
            .inflight
            .slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Only the map holds it: nobody holds or waits for the key.
        if slots.get(&self.id).is_some_and(|slot| Arc::strong_count(slot) == 1) {
            slots.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
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
}
