//! The duplicate fast path: a handler whose result is `()` and that has no
//! fingerprint replays `()` without reading the stored marker, on every
//! store that has a read to skip (PostgreSQL, MySQL/MariaDB, SQLite, Redis).
//!
//! Each test completes a key, then overwrites the stored result with text
//! that is not JSON. The `()` handler's duplicate still replays `Ok(())`
//! (its store did not read the result); a handler returning a value, and a
//! `()` handler with a fingerprint, still read the marker and report the
//! decode error, so the fast path is exactly as narrow as it should be.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use idempotent_runtime::sqlx;
use idempotent_runtime::store::{Claim, Guard, Request, Store};
use idempotent_runtime::{CachedStore, Error, idempotent};

#[derive(Debug, thiserror::Error)]
enum TestError {
    #[error(transparent)]
    Idem(#[from] Error),
}

struct Msg {
    id: String,
    body: String,
}

#[derive(Default)]
struct Runs(AtomicU64);

impl Runs {
    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

const UNIT: &str = "unit_replay_unit";
const VALUE: &str = "unit_replay_value";
const UNIT_FP: &str = "unit_replay_unit_fp";

#[idempotent(key = "msg.id", store = store, scope = "unit_replay_unit")]
async fn unit<S: Store>(store: &S, msg: &Msg, runs: &Runs) -> Result<(), TestError> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[idempotent(key = "msg.id", store = store, scope = "unit_replay_value")]
async fn value<S: Store>(store: &S, msg: &Msg, runs: &Runs) -> Result<u64, TestError> {
    Ok(runs.0.fetch_add(1, Ordering::SeqCst) + 7)
}

#[idempotent(key = "msg.id", store = store, scope = "unit_replay_unit_fp", fingerprint = "msg.body")]
async fn unit_with_fingerprint<S: Store>(store: &S, msg: &Msg, runs: &Runs) -> Result<(), TestError> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

fn msg(tag: &str) -> Msg {
    Msg {
        id: common::unique(tag),
        body: "body".into(),
    }
}

fn is_codec(result: &Result<impl std::fmt::Debug, TestError>) -> bool {
    matches!(result, Err(TestError::Idem(Error::Codec(_))))
}

/// The three handlers on `store`; `corrupt(scope, key)` overwrites the
/// stored result of a completed marker with text that is not JSON.
async fn scenario<S, F, Fut>(store: &S, corrupt: F)
where
    S: Store,
    F: Fn(&'static str, String) -> Fut,
    Fut: Future<Output = ()>,
{
    // `()`, no fingerprint: no read, so the corrupted result is not seen.
    let runs = Runs::default();
    let m = msg("unit");
    unit(store, &m, &runs).await.unwrap();
    corrupt(UNIT, m.id.clone()).await;
    unit(store, &m, &runs)
        .await
        .expect("a `()` duplicate replays without reading the result");
    assert_eq!(runs.get(), 1, "the duplicate did not run the body");

    // A value: the duplicate reads the result and cannot decode it.
    let runs = Runs::default();
    let m = msg("value");
    assert_eq!(value(store, &m, &runs).await.unwrap(), 7);
    assert_eq!(
        value(store, &m, &runs).await.unwrap(),
        7,
        "replayed before the corruption"
    );
    corrupt(VALUE, m.id.clone()).await;
    let replay = value(store, &m, &runs).await;
    assert!(
        is_codec(&replay),
        "a non-unit duplicate reads the stored result: {replay:?}"
    );
    assert_eq!(runs.get(), 1);

    // `()` with a fingerprint: the marker is read (for the fingerprint),
    // and the whole of it is checked.
    let runs = Runs::default();
    let m = msg("unit_fp");
    unit_with_fingerprint(store, &m, &runs).await.unwrap();
    corrupt(UNIT_FP, m.id.clone()).await;
    let replay = unit_with_fingerprint(store, &m, &runs).await;
    assert!(
        is_codec(&replay),
        "a fingerprinted duplicate reads the marker: {replay:?}"
    );
    let other = Msg {
        id: m.id.clone(),
        body: "another body".into(),
    };
    let reused = unit_with_fingerprint(store, &other, &runs).await;
    assert!(
        matches!(reused, Err(TestError::Idem(Error::KeyReused { .. }))),
        "the fingerprint is still checked: {reused:?}"
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unit_duplicate_skips_the_read() {
    let pool = common::pg_pool(4).await;
    let table = common::unique("unit_replay");
    let store = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&table)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let sql = format!("UPDATE {table} SET result = 'not json' WHERE scope = $1 AND message_id = $2");
    scenario(&store, |scope, key| {
        let (pool, sql) = (pool.clone(), sql.clone());
        async move {
            let updated = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(scope)
                .bind(key)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected();
            assert_eq!(updated, 1);
        }
    })
    .await;
    common::drop_pg_table(&pool, &table).await;
}

/// A PostgreSQL store on a new table, with its pool, whose sessions default
/// to the isolation level `setting` (`common::settings::PG_*`).
async fn pg_store(tag: &str, setting: u8) -> (sqlx::PgPool, idempotent_runtime::PgStore, String) {
    let pool = common::pg_pool_with(6, setting).await;
    let table = common::unique(tag);
    let store = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&table)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    (pool, store, table)
}

/// On PostgreSQL a `()` duplicate without fingerprint does not lock the live
/// marker (`ON CONFLICT DO UPDATE` would: a transaction id, a row lock and
/// its WAL record per duplicate), so it is answered while another
/// transaction holds the marker's row; a duplicate that reads the marker
/// still locks it, and waits. Under every session default isolation.
async fn unit_duplicate_takes_no_lock(setting: u8) {
    let (pool, store, table) = pg_store("unit_replay_lock", setting).await;
    let runs = Runs::default();
    let (u, v) = (msg("unit"), msg("value"));
    unit(&store, &u, &runs).await.unwrap();
    assert_eq!(value(&store, &v, &runs).await.unwrap(), 8);

    // Another transaction holds both markers' rows.
    let mut holder = pool.begin().await.unwrap();
    let lock = format!("SELECT 1 FROM {table} WHERE message_id IN ($1, $2) FOR UPDATE");
    let locked = sqlx::query(sqlx::AssertSqlSafe(lock))
        .bind(&u.id)
        .bind(&v.id)
        .fetch_all(&mut *holder)
        .await
        .unwrap();
    assert_eq!(locked.len(), 2);

    let wait = std::time::Duration::from_secs(10);
    tokio::time::timeout(wait, unit(&store, &u, &runs))
        .await
        .expect("a `()` duplicate does not wait for the marker's row lock")
        .unwrap();
    let reading = tokio::spawn({
        let (store, v) = (
            store.clone(),
            Msg {
                id: v.id.clone(),
                body: v.body.clone(),
            },
        );
        async move { value(&store, &v, &Runs::default()).await.unwrap() }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !reading.is_finished(),
        "a duplicate that reads the marker locks it first"
    );
    holder.rollback().await.unwrap();
    assert_eq!(tokio::time::timeout(wait, reading).await.unwrap().unwrap(), 8);
    assert_eq!(runs.get(), 2, "no body ran again");
    common::drop_pg_table(&pool, &table).await;
}

/// The `()` claim's guard leaves only live markers alone: an expired marker
/// not yet purged is taken over (the body runs again), by exactly one of
/// concurrent deliveries, and so is a new key. Under every session default
/// isolation.
async fn unit_claim_takes_over_expired_markers_once(setting: u8) {
    let (pool, store, table) = pg_store("unit_replay_expired", setting).await;
    let runs = Runs::default();
    let m = msg("unit");
    let concurrently = || futures_util::future::join_all((0..6).map(|_| unit(&store, &m, &runs)));
    for result in concurrently().await {
        result.unwrap();
    }
    assert_eq!(runs.get(), 1, "concurrent deliveries of a new key run the body once");
    unit(&store, &m, &runs).await.unwrap();
    assert_eq!(runs.get(), 1, "a live marker is a duplicate");

    let expire = format!("UPDATE {table} SET expires_at = now() - interval '1 second' WHERE message_id = $1");
    for round in 2..=3 {
        let expired = sqlx::query(sqlx::AssertSqlSafe(expire.clone()))
            .bind(&m.id)
            .execute(&pool)
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(expired, 1);
        for result in concurrently().await {
            result.unwrap();
        }
        assert_eq!(runs.get(), round, "an expired marker is taken over by one delivery");
        unit(&store, &m, &runs).await.unwrap();
        assert_eq!(runs.get(), round, "the marker that took over is live");
    }
    common::drop_pg_table(&pool, &table).await;
}

macro_rules! postgres_unit_claim_tests {
    ($($setting:ident => $lock:ident, $expired:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $lock() {
            unit_duplicate_takes_no_lock(common::settings::$setting).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $expired() {
            unit_claim_takes_over_expired_markers_once(common::settings::$setting).await;
        }
    )*};
}

postgres_unit_claim_tests! {
    PG_SERVER_DEFAULT => postgres_unit_duplicate_takes_no_lock,
        postgres_unit_claim_takes_over_expired_markers_once;
    PG_REPEATABLE_READ => postgres_repeatable_read_default_unit_duplicate_takes_no_lock,
        postgres_repeatable_read_default_unit_claim_takes_over_expired_markers_once;
    PG_SERIALIZABLE => postgres_serializable_default_unit_duplicate_takes_no_lock,
        postgres_serializable_default_unit_claim_takes_over_expired_markers_once;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_unit_duplicate_skips_the_read() {
    let pool = common::mysql_pool(4).await;
    let table = common::unique("unit_replay");
    let store = idempotent_runtime::MySqlStore::builder(pool.clone())
        .table(&table)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let sql = format!("UPDATE `{table}` SET result = 'not json' WHERE scope = ? AND message_id = ?");
    scenario(&store, |scope, key| {
        let (pool, sql) = (pool.clone(), sql.clone());
        async move {
            let updated = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(scope)
                .bind(key)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected();
            assert_eq!(updated, 1);
        }
    })
    .await;
    common::drop_mysql_table(&pool, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_unit_duplicate_skips_the_read() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_store_with(dir.path(), common::settings::LITE_WAL).await;
    store.migrate().await.unwrap();
    let table = store.table().to_string();
    let pool = store.pool().clone();
    let sql = format!("UPDATE {table} SET result = 'not json' WHERE scope = ?1 AND message_id = ?2");
    scenario(&store, |scope, key| {
        let (pool, sql) = (pool.clone(), sql.clone());
        async move {
            let updated = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(scope)
                .bind(key)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected();
            assert_eq!(updated, 1);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unit_duplicate_skips_the_read() {
    use idempotent_runtime::redis::AsyncCommands;
    let client = idempotent_runtime::redis::Client::open(common::REDIS_URL).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let prefix = format!("{}:", common::unique("unit_replay"));
    let store = idempotent_runtime::RedisStore::builder(conn.clone())
        .prefix(prefix.clone())
        .build()
        .unwrap();
    let keys = std::sync::Mutex::new(Vec::new());
    scenario(&store, |scope, key| {
        let (mut conn, redis_key) = (conn.clone(), store.redis_key(scope, &key));
        keys.lock().unwrap().push(redis_key.clone());
        async move {
            // `D{fingerprint}` then `={json}` when a result is stored.
            let stored: String = conn.get(&redis_key).await.unwrap();
            assert!(stored.starts_with('D'), "{stored}");
            let marker = stored.split('=').next().unwrap_or_default();
            let () = idempotent_runtime::redis::cmd("SET")
                .arg(&redis_key)
                .arg(format!("{marker}=not json"))
                .arg("KEEPTTL")
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    })
    .await;
    let keys = keys.into_inner().unwrap();
    let _: u64 = conn.clone().del(keys).await.unwrap();
}

/// `CachedStore` remembers that a replay to a `()` request was not read: a
/// `()` duplicate is then answered from the cache, a request that needs the
/// result goes to the store, which reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_store_does_not_replay_an_unread_result_to_others() {
    let pool = common::pg_pool(4).await;
    let table = common::unique("unit_replay_cache");
    let inner = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&table)
        .build()
        .unwrap();
    inner.migrate().await.unwrap();
    let key = common::unique("k");
    let plain = Request::new("cache_scope", &key).unwrap();
    let Claim::Fresh(guard) = inner.claim(&plain).await.unwrap() else {
        panic!("a new key is fresh")
    };
    guard.complete(Some("5".into())).await.unwrap();

    let cached = CachedStore::new(inner, 10);
    let unit = Request::new("cache_scope", &key).unwrap().with_unit_result(true);
    for _ in 0..2 {
        match cached.claim(&unit).await.unwrap() {
            Claim::Done(replay) => assert_eq!(replay.json(), None, "not read"),
            Claim::Fresh(_) => panic!("the key was completed"),
        }
    }
    assert_eq!(cached.stats().hits, 1, "the second `()` duplicate is a cache hit");
    match cached.claim(&plain).await.unwrap() {
        Claim::Done(replay) => assert_eq!(replay.json(), Some("5"), "read from the store"),
        Claim::Fresh(_) => panic!("the key was completed"),
    }
    assert_eq!(
        cached.stats().hits,
        1,
        "the unread result was not replayed from the cache"
    );
    assert_eq!(cached.stats().misses, 2);
    common::drop_pg_table(&pool, &table).await;
}
