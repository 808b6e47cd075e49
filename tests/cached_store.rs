//! `CachedStore`: the in-process fast path for duplicates, against the real
//! PostgreSQL (a transactional store, handlers with a `tx` parameter) and
//! against `MemoryStore` (a lease store).
//!
//! "Answered without the database" is proved by taking the database away
//! (dropping the marker table, or closing the pool) and still getting the
//! replay, while a key that is not cached then fails.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection};
use idempotent_runtime::store::{Claim, Guard, Request, Store};
use idempotent_runtime::{CachedStore, Error, MemoryStore, PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("the body failed")]
    Failed,
}

impl AppError {
    fn idem(&self) -> Option<&Error> {
        match self {
            AppError::Idem(e) => Some(e),
            _ => None,
        }
    }
}

struct Pg {
    /// The cached store the handlers use.
    store: CachedStore<PgStore>,
    /// The same table without a cache.
    plain: PgStore,
    markers: String,
    payments: String,
    runs: AtomicUsize,
}

impl Pg {
    async fn setup(capacity: usize, max_age: Option<Duration>) -> Pg {
        let pool = common::pg_pool(8).await;
        let (markers, payments) = (common::unique("cached_markers"), common::unique("cached_payments"));
        let plain = PgStore::builder(pool.clone()).table(&markers).build().unwrap();
        plain.migrate().await.unwrap();
        let ddl =
            format!("CREATE TABLE {payments} (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT)");
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        let mut store = CachedStore::new(plain.clone(), capacity);
        if let Some(max_age) = max_age {
            store = store.with_max_age(max_age);
        }
        Pg {
            store,
            plain,
            markers,
            payments,
            runs: AtomicUsize::new(0),
        }
    }

    /// The effect and the marker in one transaction; the result depends on
    /// the amount so a replay is recognisable.
    #[idempotent(key = "id", store = self.store, scope = "pay", shared_scope = true, fingerprint = "amount")]
    async fn pay(&self, id: &str, amount: i64, fail: bool, tx: &mut PgConnection) -> Result<i64, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let insert = format!("INSERT INTO {} (message_id, amount) VALUES ($1, $2)", self.payments);
        sqlx::query(AssertSqlSafe(insert))
            .bind(id)
            .bind(amount)
            .execute(&mut *tx)
            .await?;
        if fail {
            return Err(AppError::Failed);
        }
        Ok(amount * 10)
    }

    /// The same scope through the store without cache.
    #[idempotent(key = "id", store = self.plain, scope = "pay", shared_scope = true, fingerprint = "amount")]
    async fn pay_uncached(&self, id: &str, amount: i64, tx: &mut PgConnection) -> Result<i64, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let insert = format!("INSERT INTO {} (message_id, amount) VALUES ($1, $2)", self.payments);
        sqlx::query(AssertSqlSafe(insert))
            .bind(id)
            .bind(amount)
            .execute(&mut *tx)
            .await?;
        Ok(amount * 10)
    }

    /// The same scope without a fingerprint.
    #[idempotent(key = "id", store = self.store, scope = "pay", shared_scope = true)]
    async fn pay_without_fingerprint(&self, id: &str, tx: &mut PgConnection) -> Result<i64, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let insert = format!("INSERT INTO {} (message_id) VALUES ($1)", self.payments);
        sqlx::query(AssertSqlSafe(insert)).bind(id).execute(&mut *tx).await?;
        Ok(-1)
    }

    /// A one-second ttl.
    #[idempotent(key = "id", store = self.store, scope = "short", ttl = "1s")]
    async fn pay_short(&self, id: &str, tx: &mut PgConnection) -> Result<i64, AppError> {
        let n = self.runs.fetch_add(1, Ordering::SeqCst);
        let insert = format!("INSERT INTO {} (message_id) VALUES ($1)", self.payments);
        sqlx::query(AssertSqlSafe(insert)).bind(id).execute(&mut *tx).await?;
        Ok(n as i64)
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    async fn effects(&self, id: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {} WHERE message_id = $1", self.payments);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(id)
            .fetch_one(self.plain.pool())
            .await
            .unwrap()
    }

    async fn drop_markers(&self) {
        common::drop_pg_table(self.plain.pool(), &self.markers).await;
    }

    async fn teardown(self) {
        common::drop_pg_table(self.plain.pool(), &self.markers).await;
        common::drop_pg_table(self.plain.pool(), &self.payments).await;
    }
}

#[tokio::test]
async fn a_cached_duplicate_replays_without_the_database() {
    let pg = Pg::setup(100, None).await;
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    assert_eq!(pg.store.len(), 1);

    // Take the marker table away: the database can no longer answer.
    pg.drop_markers().await;
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70, "replayed from the cache");
    assert_eq!(pg.runs(), 1, "the body ran once");
    let stats = pg.store.stats();
    assert_eq!((stats.hits, stats.misses, stats.inserts), (1, 1, 1), "{stats:?}");

    // A key that is not cached does reach the database, and fails.
    let err = pg.pay("m-2", 7, false).await.unwrap_err();
    assert!(matches!(err.idem(), Some(Error::Store(_))), "{err:?}");

    // With the pool closed as well, the cached key still replays.
    pg.plain.pool().close().await;
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    assert_eq!(pg.store.stats().hits, 2);

    let pool = common::pg_pool(2).await;
    common::drop_pg_table(&pool, &pg.payments).await;
}

#[tokio::test]
async fn a_fingerprint_mismatch_on_a_cached_hit_is_key_reused() {
    let pg = Pg::setup(100, None).await;
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    pg.drop_markers().await;
    let err = pg.pay("m-1", 8, false).await.unwrap_err();
    assert!(matches!(err.idem(), Some(Error::KeyReused { .. })), "{err:?}");
    assert_eq!(pg.store.stats().hits, 1, "answered by the cache");
    assert_eq!(pg.runs(), 1);
    // The entry stays: the right fingerprint still replays.
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    pg.teardown().await;
}

#[tokio::test]
async fn failures_are_not_cached() {
    let pg = Pg::setup(100, None).await;
    let err = pg.pay("m-1", 7, true).await.unwrap_err();
    assert!(matches!(err, AppError::Failed), "{err:?}");
    assert!(pg.store.is_empty(), "a failed body leaves nothing in the cache");
    assert_eq!(pg.effects("m-1").await, 0, "rolled back");

    // The redelivery runs the body, which now succeeds and is cached.
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    assert_eq!(pg.runs(), 2);
    assert_eq!(pg.effects("m-1").await, 1);
    assert_eq!(pg.store.len(), 1);

    // A store error is not cached either.
    pg.drop_markers().await;
    assert!(pg.pay("m-2", 7, false).await.is_err());
    assert_eq!(pg.store.len(), 1);
    pg.teardown().await;
}

#[tokio::test]
async fn capacity_bounds_the_cache_and_evicts_the_least_recently_used() {
    let pg = Pg::setup(2, None).await;
    for id in ["a", "b"] {
        pg.pay(id, 1, false).await.unwrap();
    }
    pg.pay("a", 1, false).await.unwrap(); // hit: `a` becomes the most recent
    pg.pay("c", 1, false).await.unwrap(); // evicts `b`
    assert_eq!(pg.store.len(), 2);
    let stats = pg.store.stats();
    assert_eq!((stats.hits, stats.evictions), (1, 1), "{stats:?}");

    // `b` was evicted: its duplicate goes to the database, which replays it
    // (the body does not run again) and it is cached again.
    pg.pay("b", 1, false).await.unwrap();
    assert_eq!(pg.store.stats().misses, stats.misses + 1);
    assert_eq!(pg.runs(), 3);
    assert_eq!(pg.effects("b").await, 1);
    assert_eq!(pg.store.len(), 2);

    // With the table gone, exactly the two most recent keys still replay.
    pg.drop_markers().await;
    assert!(pg.pay("b", 1, false).await.is_ok());
    assert!(pg.pay("c", 1, false).await.is_ok());
    assert!(pg.pay("a", 1, false).await.is_err(), "`a` was evicted by `b`");
    pg.teardown().await;
}

#[tokio::test]
async fn entries_expire_with_the_marker_ttl() {
    let pg = Pg::setup(100, None).await;
    assert_eq!(pg.pay_short("m-1").await.unwrap(), 0);
    assert_eq!(pg.pay_short("m-1").await.unwrap(), 0);
    assert_eq!(pg.store.stats().hits, 1);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Both the cache entry and the marker are past their ttl: processed again.
    assert_eq!(pg.pay_short("m-1").await.unwrap(), 1);
    let stats = pg.store.stats();
    assert_eq!((stats.hits, stats.expirations), (1, 1), "{stats:?}");
    assert_eq!(pg.effects("m-1").await, 2);
    pg.teardown().await;
}

#[tokio::test]
async fn entries_expire_after_max_age_and_then_ask_the_database() {
    let pg = Pg::setup(100, Some(Duration::from_millis(200))).await;
    assert_eq!(pg.store.max_age(), Duration::from_millis(200));
    pg.pay("m-1", 7, false).await.unwrap();
    pg.pay("m-1", 7, false).await.unwrap();
    assert_eq!(pg.store.stats().hits, 1);
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The cache entry is gone, the marker (7 days) is not: the database replays.
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    let stats = pg.store.stats();
    assert_eq!((stats.hits, stats.misses, stats.expirations), (1, 2, 1), "{stats:?}");
    assert_eq!(pg.runs(), 1);
    pg.teardown().await;
}

#[tokio::test]
async fn a_replay_from_the_database_is_cached() {
    let pg = Pg::setup(100, None).await;
    // Processed by another consumer (no cache): the marker is only in the table.
    assert_eq!(pg.pay_uncached("m-1", 7).await.unwrap(), 70);
    assert!(pg.store.is_empty());
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70, "replayed by the database");
    assert_eq!(pg.store.len(), 1);
    pg.drop_markers().await;
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70, "then by the cache");
    let err = pg.pay("m-1", 9, false).await.unwrap_err();
    assert!(matches!(err.idem(), Some(Error::KeyReused { .. })), "{err:?}");
    assert_eq!(pg.runs(), 1);
    pg.teardown().await;
}

#[tokio::test]
async fn a_replay_learnt_without_fingerprint_does_not_answer_a_fingerprinted_call() {
    let pg = Pg::setup(100, None).await;
    assert_eq!(pg.pay_uncached("m-1", 7).await.unwrap(), 70);
    // Learnt by a call without fingerprint: the stored fingerprint is unknown.
    assert_eq!(pg.pay_without_fingerprint("m-1").await.unwrap(), 70);
    assert_eq!(pg.store.len(), 1);
    // A fingerprinted call must not trust it: it asks the database, which
    // knows the marker's fingerprint.
    let err = pg.pay("m-1", 8, false).await.unwrap_err();
    assert!(matches!(err.idem(), Some(Error::KeyReused { .. })), "{err:?}");
    assert_eq!(pg.store.stats().hits, 0);
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    // Now the fingerprint is known, and cached.
    pg.drop_markers().await;
    assert_eq!(pg.pay("m-1", 7, false).await.unwrap(), 70);
    assert!(matches!(
        pg.pay("m-1", 8, false).await.unwrap_err().idem(),
        Some(Error::KeyReused { .. })
    ));
    assert_eq!(pg.runs(), 1);
    pg.teardown().await;
}

#[tokio::test]
async fn forget_and_clear_drop_entries() {
    let pg = Pg::setup(100, None).await;
    pg.pay("a", 1, false).await.unwrap();
    pg.pay("b", 1, false).await.unwrap();
    assert!(pg.store.forget("pay", "a"));
    assert!(!pg.store.forget("pay", "a"));
    assert_eq!(pg.store.len(), 1);
    pg.store.clear();
    assert!(pg.store.is_empty());
    pg.teardown().await;
}

#[tokio::test]
async fn concurrent_duplicates_apply_the_effect_once() {
    let pg = Arc::new(Pg::setup(1000, None).await);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let pg = Arc::clone(&pg);
        tasks.push(tokio::spawn(
            async move { pg.pay(&format!("m-{}", i % 8), 5, false).await },
        ));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap(), 50);
    }
    assert_eq!(pg.runs(), 8);
    for i in 0..8 {
        assert_eq!(pg.effects(&format!("m-{i}")).await, 1);
    }
    Arc::into_inner(pg).unwrap().teardown().await;
}

#[tokio::test]
async fn zero_capacity_passes_everything_through() {
    let pg = Pg::setup(0, None).await;
    pg.pay("a", 1, false).await.unwrap();
    pg.pay("a", 1, false).await.unwrap();
    assert!(pg.store.is_empty());
    assert_eq!(pg.store.stats().hits, 0);
    assert_eq!(pg.runs(), 1);
    pg.teardown().await;
}

// ---- MemoryStore (a lease store) ----------------------------------------

struct Mem {
    store: CachedStore<MemoryStore>,
    runs: AtomicUsize,
}

impl Mem {
    #[idempotent(key = "id", store = self.store, fingerprint = "amount")]
    async fn pay(&self, id: &str, amount: i64, fail: bool) -> Result<i64, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if fail {
            return Err(AppError::Failed);
        }
        Ok(amount * 10)
    }
}

#[tokio::test]
async fn memory_store_duplicates_are_answered_by_the_cache() {
    let mem = Mem {
        store: CachedStore::new(MemoryStore::new(), 10),
        runs: AtomicUsize::new(0),
    };
    assert!(mem.pay("a", 3, true).await.is_err());
    assert!(mem.store.is_empty());
    assert_eq!(mem.pay("a", 3, false).await.unwrap(), 30);
    assert_eq!(mem.store.inner().len(), 1);
    assert_eq!(mem.pay("a", 3, false).await.unwrap(), 30);
    assert!(matches!(
        mem.pay("a", 4, false).await.unwrap_err().idem(),
        Some(Error::KeyReused { .. })
    ));
    assert_eq!(mem.store.stats().hits, 2);
    assert_eq!(mem.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn claims_in_progress_are_never_cached() {
    let store = CachedStore::new(MemoryStore::new(), 10);
    let req = Request::new("scope", "k").unwrap();
    let Claim::Fresh(guard) = store.claim(&req).await.unwrap() else {
        panic!("fresh")
    };
    // A concurrent claim sees the lease, not a cached answer.
    let err = store.claim(&req).await.unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err:?}");
    assert!(store.is_empty());
    guard.abort().await;
    assert!(store.is_empty());
    let Claim::Fresh(guard) = store.claim(&req).await.unwrap() else {
        panic!("fresh again after abort")
    };
    guard.complete(Some("42".into())).await.unwrap();
    assert_eq!(store.len(), 1);
    let Claim::Done(replay) = store.claim(&req).await.unwrap() else {
        panic!("done")
    };
    assert_eq!(replay.json(), Some("42"));
    assert_eq!(store.stats().hits, 1);
}

#[tokio::test]
async fn clones_share_the_cache() {
    let store = CachedStore::new(MemoryStore::new(), 10);
    let clone = store.clone();
    let req = Request::new("scope", "k").unwrap();
    let Claim::Fresh(guard) = store.claim(&req).await.unwrap() else {
        panic!("fresh")
    };
    guard.complete(None).await.unwrap();
    assert!(matches!(clone.claim(&req).await.unwrap(), Claim::Done(_)));
    assert_eq!(clone.stats().hits, 1);
}
