//! `CachedStore`: a bounded in-process cache of completed keys in front of
//! any store, so a repeated duplicate is answered without touching the
//! database (or Redis).
//!
//! # What is cached, and for how long
//!
//! Only completed keys, never claims in progress: an entry is added after
//! [`Guard::complete`] of the inner store returned `Ok` (the marker is
//! durable), or when the inner store answered [`Claim::Done`]. Inside a
//! [batch](crate::batch) both wait for the batch's commit (a marker
//! written in the batch is not durable before it), and an aborted batch
//! adds nothing: its messages run again alone, and are cached then. Failures,
//! aborted claims, `InProgress` and every other error are not cached.
//!
//! An entry lives at most `min(ttl, max_age)`, counted from the instant the
//! claim that produced it *started* (before the inner store was asked). For
//! an entry made by a completion this is never later than the expiry of the
//! database marker: every store computes the marker's expiry as "its clock at
//! the claim or at the completion, plus `ttl`", both after that instant. For
//! an entry made by a `Claim::Done` the marker's age is unknown (a replay
//! does not carry the marker's expiry), so such an entry can outlive the
//! marker by at most the marker's age when it was read, and never by more
//! than `max_age` ([`DEFAULT_CACHE_MAX_AGE`] unless set): during that window a
//! delivery of that key is still answered as a duplicate where the database
//! alone would let the expired marker be taken over. `max_age` also bounds
//! how long a marker deleted by hand keeps being replayed by this process.
//!
//! The cache is per process (and shared by the clones of one
//! `CachedStore`): other consumers keep going to the store, which stays the
//! single source of truth. Fingerprints are checked on every cached hit.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::Error;
use crate::store::{Claim, Guard, Replay, Request, Store};

/// How long a cached entry lives at most when [`CachedStore::with_max_age`]
/// was not called: five minutes (and never longer than the handler's `ttl`).
pub const DEFAULT_CACHE_MAX_AGE: Duration = Duration::from_secs(5 * 60);

/// A store that answers repeated duplicates from a bounded in-process LRU
/// cache of completed keys, and passes everything else to `inner`.
///
/// ```no_run
/// # async fn run(pool: idempotent_runtime::sqlx::PgPool) {
/// use std::time::Duration;
/// use idempotent_runtime::{CachedStore, PgStore};
///
/// // Up to 100 000 completed keys, each kept at most 10 minutes.
/// let store = CachedStore::new(PgStore::new(pool), 100_000).with_max_age(Duration::from_secs(600));
/// # }
/// ```
///
/// A handler uses it like the inner store (`store = self.store`); when the
/// inner store is transactional (`PgStore`, `SqliteStore`, `MySqlStore`) so
/// is the cached one, and handlers with a transaction parameter work
/// unchanged. A capacity of 0 disables the cache.
///
/// Cloning is cheap when the inner store's is: clones share the cache.
pub struct CachedStore<S> {
    inner: S,
    cache: Arc<Cache>,
}

impl<S> CachedStore<S> {
    /// `inner` behind a cache of at most `capacity` completed keys (least
    /// recently used evicted first), each kept at most [`DEFAULT_CACHE_MAX_AGE`].
    pub fn new(inner: S, capacity: usize) -> Self {
        CachedStore {
            inner,
            cache: Arc::new(Cache::new(capacity, DEFAULT_CACHE_MAX_AGE)),
        }
    }

    /// Sets how long an entry is kept at most (besides the handler's `ttl`).
    /// Starts from an empty cache: call it when building the store, before
    /// cloning it.
    pub fn with_max_age(self, max_age: Duration) -> Self {
        let capacity = self.cache.capacity;
        CachedStore {
            inner: self.inner,
            cache: Arc::new(Cache::new(capacity, max_age)),
        }
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The most completed keys the cache holds.
    pub fn capacity(&self) -> usize {
        self.cache.capacity
    }

    /// The longest an entry is kept (besides the handler's `ttl`).
    pub fn max_age(&self) -> Duration {
        self.cache.max_age
    }

    /// How many keys the cache holds now (expired entries included until
    /// they are looked up, evicted or purged).
    pub fn len(&self) -> usize {
        self.cache.lock().map.len()
    }

    /// `true` when the cache holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the cached entry of `(scope, key)`, if any; returns whether
    /// there was one. Use it after deleting that marker from the store by
    /// hand, so this process stops replaying it at once.
    pub fn forget(&self, scope: &str, key: &str) -> bool {
        self.cache.lock().remove(&cache_id(scope, key))
    }

    /// Empties the cache (the store's markers are untouched).
    pub fn clear(&self) {
        self.cache.lock().clear();
    }

    /// Counters since the cache was created.
    pub fn stats(&self) -> CacheStats {
        let counters = &self.cache.counters;
        CacheStats {
            hits: counters.hits.load(Ordering::Relaxed),
            misses: counters.misses.load(Ordering::Relaxed),
            inserts: counters.inserts.load(Ordering::Relaxed),
            evictions: counters.evictions.load(Ordering::Relaxed),
            expirations: counters.expirations.load(Ordering::Relaxed),
        }
    }
}

impl<S: Clone> Clone for CachedStore<S> {
    fn clone(&self) -> Self {
        CachedStore {
            inner: self.inner.clone(),
            cache: Arc::clone(&self.cache),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedStore")
            .field("inner", &self.inner)
            .field("capacity", &self.cache.capacity)
            .field("max_age", &self.cache.max_age)
            .field("len", &self.len())
            .finish()
    }
}

/// Counters of a [`CachedStore`]'s cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Claims answered from the cache, without the inner store.
    pub hits: u64,
    /// Claims passed to the inner store.
    pub misses: u64,
    /// Entries added (after a completion or a `Claim::Done`).
    pub inserts: u64,
    /// Entries dropped to make room (least recently used first).
    pub evictions: u64,
    /// Entries dropped because they reached `min(ttl, max_age)`.
    pub expirations: u64,
}

impl<S: Store> Store for CachedStore<S> {
    type Guard = CachedGuard<S::Guard>;

    fn namespace(&self) -> Option<&'static str> {
        self.inner.namespace()
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<Self::Guard>, Error> {
        if self.cache.capacity == 0 {
            return Ok(match self.inner.claim(req).await? {
                Claim::Fresh(guard) => Claim::Fresh(CachedGuard {
                    inner: guard,
                    fill: None,
                }),
                Claim::Done(replay) => Claim::Done(replay),
            });
        }
        let started = Instant::now();
        let id = cache_id(req.scope(), req.key());
        if let Some(hit) = self.cache.lookup(&id, req, started) {
            let (fingerprint, result) = hit;
            self.cache.counters.hits.fetch_add(1, Ordering::Relaxed);
            req.check_fingerprint(fingerprint.as_deref())?;
            tracing::trace!(target: "idempotent", scope = req.scope(), "duplicate answered from the cache");
            return Ok(Claim::Done(Replay::new(result)));
        }
        self.cache.counters.misses.fetch_add(1, Ordering::Relaxed);
        let expires_at = started.checked_add(req.ttl().min(self.cache.max_age));
        match self.inner.claim(req).await? {
            Claim::Fresh(guard) => {
                let fill = expires_at.map(|expires_at| Fill {
                    cache: Arc::clone(&self.cache),
                    id,
                    // The marker holds exactly this request's fingerprint.
                    fingerprint: Known::Yes(req.fingerprint().map(|f| f.as_str().to_owned())),
                    expires_at,
                });
                Ok(Claim::Fresh(CachedGuard { inner: guard, fill }))
            }
            Claim::Done(replay) => {
                if let Some(expires_at) = expires_at {
                    // The inner store checked the stored fingerprint against
                    // this request's: equal when the request has one,
                    // unknown otherwise.
                    let fingerprint = match req.fingerprint() {
                        Some(f) => Known::Yes(Some(f.as_str().to_owned())),
                        None => Known::No,
                    };
                    let entry = Entry {
                        fingerprint,
                        // A request that needs no read (a `()` result,
                        // no fingerprint) may get a replay the inner
                        // store did not read: unknown for others.
                        result: if req.needs_read() {
                            Known::Yes(replay.json().map(str::to_owned))
                        } else {
                            Known::No
                        },
                        expires_at,
                    };
                    // Inside a batch the marker may be one this batch wrote
                    // and has not committed: cached after its commit.
                    let cache = Arc::clone(&self.cache);
                    crate::store::when_committed(move || cache.insert(id, entry));
                }
                Ok(Claim::Done(replay))
            }
        }
    }
}

#[cfg(feature = "sqlx")]
impl<S: crate::store::TransactionalStore> crate::store::TransactionalStore for CachedStore<S> {
    type Database = S::Database;
}

#[cfg(feature = "sqlx")]
impl<S: crate::store::StagesOutbox> crate::store::StagesOutbox for CachedStore<S> {}

/// The inner store's outbox: a duplicate answered from the cache stages
/// nothing, as one answered by the store.
#[cfg(feature = "sqlx")]
impl<S: crate::outbox::OutboxStore> crate::outbox::OutboxStore for CachedStore<S> {
    type Batch = S::Batch;

    fn outbox_waker(&self) -> Arc<tokio::sync::Notify> {
        self.inner.outbox_waker()
    }

    fn take_batch(
        &self,
        limit: u32,
        lease: std::time::Duration,
    ) -> impl Future<Output = Result<Self::Batch, Error>> + Send {
        self.inner.take_batch(limit, lease)
    }

    fn pending(&self) -> impl Future<Output = Result<(u64, Option<std::time::Duration>), Error>> + Send {
        self.inner.pending()
    }
}

impl<S: crate::janitor::PurgeExpired> crate::janitor::PurgeExpired for CachedStore<S> {
    /// Drops the cache's expired entries, then purges the inner store;
    /// returns how many markers the inner store deleted.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, Error>> + Send {
        let dropped = self.cache.lock().purge(Instant::now());
        self.cache.counters.expirations.fetch_add(dropped, Ordering::Relaxed);
        self.inner.purge_expired()
    }

    /// The inner store's lock. The cache belongs to this process, so its
    /// expired entries are dropped here as well, in every round, whoever
    /// holds the lock.
    fn try_lock_janitor(&self) -> impl Future<Output = Result<Option<crate::janitor::JanitorLock>, Error>> + Send {
        let dropped = self.cache.lock().purge(Instant::now());
        self.cache.counters.expirations.fetch_add(dropped, Ordering::Relaxed);
        self.inner.try_lock_janitor()
    }
}

/// The claim of a [`CachedStore`]: the inner store's guard, and what to
/// cache once it completes.
pub struct CachedGuard<G> {
    inner: G,
    fill: Option<Fill>,
}

struct Fill {
    cache: Arc<Cache>,
    id: String,
    fingerprint: Known,
    expires_at: Instant,
}

impl<G: fmt::Debug> fmt::Debug for CachedGuard<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedGuard")
            .field("inner", &self.inner)
            .field("caches", &self.fill.is_some())
            .finish()
    }
}

impl<G: Guard> Guard for CachedGuard<G> {
    async fn complete(self, result: Option<String>) -> Result<(), Error> {
        let CachedGuard { inner, fill } = self;
        let Some(fill) = fill else {
            return inner.complete(result).await;
        };
        let cached = result.clone();
        inner.complete(result).await?;
        // Durable now (inside a batch, once the batch commits): later
        // duplicates can be answered from memory.
        crate::store::when_committed(move || {
            fill.cache.insert(
                fill.id,
                Entry {
                    fingerprint: fill.fingerprint,
                    result: Known::Yes(cached),
                    expires_at: fill.expires_at,
                },
            )
        });
        Ok(())
    }

    fn abort(self) -> impl Future<Output = ()> + Send {
        self.inner.abort()
    }
}

#[cfg(feature = "sqlx")]
impl<G: crate::store::TransactionGuard> crate::store::TransactionGuard for CachedGuard<G> {
    type Database = G::Database;

    fn transaction(&mut self) -> &mut sqlx::Transaction<'static, Self::Database> {
        self.inner.transaction()
    }

    fn stage(&mut self, outbox: crate::outbox::Outbox) -> impl Future<Output = Result<(), crate::Error>> + Send {
        self.inner.stage(outbox)
    }
}

/// One map key per `(scope, key)`: the scope's length says where it ends, so
/// no two pairs share an id.
fn cache_id(scope: &str, key: &str) -> String {
    let mut id = String::with_capacity(scope.len() + key.len() + 8);
    id.push_str(&scope.len().to_string());
    id.push(':');
    id.push_str(scope);
    id.push(':');
    id.push_str(key);
    id
}

/// Whether the fingerprint (or result) stored with the marker is known.
#[derive(Clone)]
enum Known {
    /// The marker holds exactly this fingerprint (`None`: no fingerprint).
    Yes(Option<String>),
    /// Not known: learnt from a replay to a request without fingerprint (or
    /// with a `()` result, for the result); a request that needs it must ask
    /// the inner store, which checks the fingerprint and reads the result.
    No,
}

struct Entry {
    fingerprint: Known,
    /// The stored result; `No` when learnt from a replay the inner store
    /// was allowed not to read (a `()` handler's).
    result: Known,
    expires_at: Instant,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
    evictions: AtomicU64,
    expirations: AtomicU64,
}

struct Cache {
    capacity: usize,
    max_age: Duration,
    lru: Mutex<Lru>,
    counters: Counters,
}

impl Cache {
    fn new(capacity: usize, max_age: Duration) -> Self {
        Cache {
            capacity,
            max_age,
            lru: Mutex::new(Lru::default()),
            counters: Counters::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lru> {
        // Every update of the list is completed before the lock is released
        // and nothing in it panics, so a poisoned lock holds a sound list.
        self.lru.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The live entry of `id` (marked most recently used), unless its
    /// fingerprint is unknown while `req` has one.
    fn lookup(&self, id: &str, req: &Request<'_>, now: Instant) -> Option<(Option<String>, Option<String>)> {
        let mut lru = self.lock();
        let slot = *lru.map.get(id)?;
        if lru.nodes[slot].entry.expires_at <= now {
            lru.unlink(slot);
            lru.release(slot);
            drop(lru);
            self.counters.expirations.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let entry = &lru.nodes[slot].entry;
        let fingerprint = match (&entry.fingerprint, req.fingerprint()) {
            (Known::Yes(stored), _) => stored.clone(),
            (Known::No, None) => None,
            (Known::No, Some(_)) => return None,
        };
        let result = match (&entry.result, req.unit_result()) {
            (Known::Yes(result), _) => result.clone(),
            // `()` replays `()` whatever was stored.
            (Known::No, true) => None,
            (Known::No, false) => return None,
        };
        lru.touch(slot);
        Some((fingerprint, result))
    }

    fn insert(&self, id: String, entry: Entry) {
        if self.capacity == 0 {
            return;
        }
        let evicted = self.lock().insert(id, entry, self.capacity);
        self.counters.inserts.fetch_add(1, Ordering::Relaxed);
        if evicted {
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }
}

const NIL: usize = usize::MAX;

/// An LRU list in a slab: `map` finds a node, `head` is the most recently
/// used, `tail` the next to evict.
struct Lru {
    map: HashMap<Arc<str>, usize>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
}

struct Node {
    id: Arc<str>,
    entry: Entry,
    prev: usize,
    next: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Lru {
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }
}

impl Lru {
    fn unlink(&mut self, slot: usize) {
        let (prev, next) = (self.nodes[slot].prev, self.nodes[slot].next);
        match prev {
            NIL => self.head = next,
            prev => self.nodes[prev].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.nodes[next].prev = prev,
        }
        self.nodes[slot].prev = NIL;
        self.nodes[slot].next = NIL;
    }

    fn push_front(&mut self, slot: usize) {
        self.nodes[slot].prev = NIL;
        self.nodes[slot].next = self.head;
        match self.head {
            NIL => self.tail = slot,
            head => self.nodes[head].prev = slot,
        }
        self.head = slot;
    }

    fn touch(&mut self, slot: usize) {
        if self.head != slot {
            self.unlink(slot);
            self.push_front(slot);
        }
    }

    /// Forgets an unlinked node: out of the map, its slot reusable.
    fn release(&mut self, slot: usize) {
        let id = Arc::clone(&self.nodes[slot].id);
        self.map.remove(&id);
        // Drop the entry's strings now rather than when the slot is reused.
        self.nodes[slot].entry.result = Known::No;
        self.nodes[slot].entry.fingerprint = Known::No;
        self.free.push(slot);
    }

    /// Adds or replaces `id`'s entry as the most recently used; returns
    /// whether the least recently used entry was evicted to make room.
    fn insert(&mut self, id: String, entry: Entry, capacity: usize) -> bool {
        if let Some(&slot) = self.map.get(id.as_str()) {
            self.nodes[slot].entry = entry;
            self.touch(slot);
            return false;
        }
        let mut evicted = false;
        if self.map.len() >= capacity && self.tail != NIL {
            let tail = self.tail;
            self.unlink(tail);
            self.release(tail);
            evicted = true;
        }
        let id: Arc<str> = Arc::from(id);
        let node = Node {
            id: Arc::clone(&id),
            entry,
            prev: NIL,
            next: NIL,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.map.insert(id, slot);
        self.push_front(slot);
        evicted
    }

    fn remove(&mut self, id: &str) -> bool {
        let Some(&slot) = self.map.get(id) else {
            return false;
        };
        self.unlink(slot);
        self.release(slot);
        true
    }

    /// Drops every expired entry; returns how many.
    fn purge(&mut self, now: Instant) -> u64 {
        let expired: Vec<usize> = self
            .map
            .values()
            .copied()
            .filter(|&slot| self.nodes[slot].entry.expires_at <= now)
            .collect();
        for &slot in &expired {
            self.unlink(slot);
            self.release(slot);
        }
        expired.len() as u64
    }

    fn clear(&mut self) {
        *self = Lru::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(result: &str, expires_in: Duration) -> Entry {
        Entry {
            fingerprint: Known::Yes(None),
            result: Known::Yes(Some(result.to_owned())),
            expires_at: Instant::now() + expires_in,
        }
    }

    fn order(lru: &Lru) -> Vec<String> {
        let mut out = Vec::new();
        let mut at = lru.head;
        while at != NIL {
            out.push(lru.nodes[at].id.to_string());
            at = lru.nodes[at].next;
        }
        out
    }

    #[test]
    fn least_recently_used_is_evicted_first() {
        let hour = Duration::from_secs(3600);
        let mut lru = Lru::default();
        assert!(!lru.insert("a".into(), entry("1", hour), 3));
        assert!(!lru.insert("b".into(), entry("2", hour), 3));
        assert!(!lru.insert("c".into(), entry("3", hour), 3));
        assert_eq!(order(&lru), ["c", "b", "a"]);
        let a = lru.map["a"];
        lru.touch(a);
        assert_eq!(order(&lru), ["a", "c", "b"]);
        assert!(lru.insert("d".into(), entry("4", hour), 3));
        assert_eq!(order(&lru), ["d", "a", "c"]);
        assert!(!lru.map.contains_key("b"));
        assert!(lru.remove("a"));
        assert!(!lru.remove("a"));
        assert_eq!(order(&lru), ["d", "c"]);
        // Freed slots are reused.
        assert!(!lru.insert("e".into(), entry("5", hour), 3));
        assert_eq!(lru.nodes.len(), 3);
        assert_eq!(order(&lru), ["e", "d", "c"]);
        assert!(!lru.insert("e".into(), entry("6", hour), 3));
        assert_eq!(lru.map.len(), 3);
    }

    #[test]
    fn purge_drops_only_expired_entries() {
        let mut lru = Lru::default();
        lru.insert("old".into(), entry("1", Duration::ZERO), 10);
        lru.insert("new".into(), entry("2", Duration::from_secs(60)), 10);
        assert_eq!(lru.purge(Instant::now()), 1);
        assert_eq!(order(&lru), ["new"]);
    }

    #[test]
    fn ids_do_not_collide() {
        assert_ne!(cache_id("a:b", "c"), cache_id("a", "b:c"));
    }
}
