//! `MemoryStore`: an in-process store for tests and for handlers without a
//! database. It cannot join a transaction; it follows the lease semantics of
//! the other non-transactional stores.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::Error;
use crate::store::{Claim, Guard, Replay, Request, Store};

/// An in-process store: markers live in a map inside the process.
///
/// A claim is a lease held by the running call; a concurrent duplicate gets
/// [`Error::InProgress`]. The lease never expires while its holder is alive
/// (in one process a live holder is known to be running); it is released
/// when the body fails, panics or is cancelled. Completed markers expire
/// after the handler's `ttl`. Markers are lost with the process, so this
/// store gives idempotency within one process only.
///
/// Cloning is cheap and clones share the markers.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    entries: Mutex<HashMap<(String, String), Entry>>,
    next_token: AtomicU64,
    /// Each store is a namespace of its own (its markers are its own).
    namespace: &'static str,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            entries: Mutex::default(),
            next_token: AtomicU64::new(0),
            namespace: crate::scope::unique_namespace("memory"),
        }
    }
}

enum Entry {
    Leased {
        token: u64,
    },
    Done {
        expires_at: Instant,
        fingerprint: Option<String>,
        result: Option<String>,
    },
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes completed markers past their expiry; returns how many.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        let now = Instant::now();
        let mut entries = self.inner.lock();
        let before = entries.len();
        entries.retain(|_, entry| !matches!(entry, Entry::Done { expires_at, .. } if *expires_at <= now));
        Ok((before - entries.len()) as u64)
    }

    /// How many markers (leases and completed) the store holds.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    /// `true` when the store holds no marker.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, HashMap<(String, String), Entry>> {
        // A panic while holding this lock cannot leave the map half-updated
        // (every update is a single insert or remove), so poison is ignored.
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn release(&self, id: &(String, String), token: u64) {
        let mut entries = self.lock();
        if matches!(entries.get(id), Some(Entry::Leased { token: held }) if *held == token) {
            entries.remove(id);
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").field("markers", &self.len()).finish()
    }
}

impl Store for MemoryStore {
    type Guard = MemoryGuard;

    fn namespace(&self) -> Option<&'static str> {
        Some(self.inner.namespace)
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<MemoryGuard>, Error> {
        let id = (req.scope().to_owned(), req.key().to_owned());
        let mut entries = self.inner.lock();
        match entries.get(&id) {
            Some(Entry::Done {
                expires_at,
                fingerprint,
                result,
            }) if *expires_at > Instant::now() => {
                req.check_fingerprint(fingerprint.as_deref())?;
                return Ok(Claim::Done(Replay::new(result.clone())));
            }
            Some(Entry::Leased { .. }) => return Err(req.in_progress()),
            Some(Entry::Done { .. }) | None => {}
        }
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        entries.insert(id.clone(), Entry::Leased { token });
        Ok(Claim::Fresh(MemoryGuard {
            store: Arc::clone(&self.inner),
            id,
            token,
            ttl: req.ttl(),
            fingerprint: req.fingerprint().map(|f| f.as_str().to_owned()),
            open: true,
        }))
    }
}

/// The lease of a [`MemoryStore`] claim; released on drop.
pub struct MemoryGuard {
    store: Arc<Inner>,
    id: (String, String),
    token: u64,
    ttl: Duration,
    fingerprint: Option<String>,
    open: bool,
}

impl std::fmt::Debug for MemoryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryGuard")
            .field("scope", &self.id.0)
            .field("key", &self.id.1)
            .finish_non_exhaustive()
    }
}

impl Guard for MemoryGuard {
    async fn complete(mut self, result: Option<String>) -> Result<(), Error> {
        self.open = false;
        let mut entries = self.store.lock();
        match entries.get(&self.id) {
            Some(Entry::Leased { token }) if *token == self.token => {
                let expires_at = Instant::now().checked_add(self.ttl).unwrap_or_else(far_future);
                let fingerprint = self.fingerprint.take();
                entries.insert(
                    std::mem::take(&mut self.id),
                    Entry::Done {
                        expires_at,
                        fingerprint,
                        result,
                    },
                );
                Ok(())
            }
            _ => Err(Error::Store("the lease was lost before the handler completed".into())),
        }
    }

    async fn abort(self) {
        drop(self);
    }
}

impl Drop for MemoryGuard {
    fn drop(&mut self) {
        if self.open {
            self.store.release(&self.id, self.token);
        }
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}
