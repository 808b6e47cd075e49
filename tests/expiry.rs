//! Expiry operations: `purge_expired` in bounded batches, the janitor task,
//! and expiry decided by the database clock.

mod common;

use std::time::Duration;

use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::store::{Claim, Fingerprint, Guard, Request, Store};
use idempotent_runtime::{Janitor, PgStore};

async fn complete(store: &PgStore, key: &str, ttl: Duration) {
    let req = Request::new("expiry", key).unwrap().with_ttl(ttl);
    match store.claim(&req).await.unwrap() {
        Claim::Fresh(guard) => guard.complete(None).await.unwrap(),
        Claim::Done(_) => panic!("{key} was already processed"),
    }
}

async fn markers(store: &PgStore) -> i64 {
    let sql = format!("SELECT count(*) FROM {}", store.table().quoted('"'));
    sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(store.pool())
        .await
        .unwrap()
}

async fn fresh_store(batch: u32) -> (PgStore, String) {
    let table = common::unique("expiry");
    let store = PgStore::builder(common::pg_pool(4).await)
        .table(&table)
        .purge_batch(batch)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    (store, table)
}

#[tokio::test]
async fn purge_deletes_only_expired_markers_in_batches_and_counts_them() {
    let (store, table) = fresh_store(2).await;
    for i in 0..7 {
        complete(&store, &format!("old-{i}"), Duration::from_millis(1)).await;
    }
    for i in 0..3 {
        complete(&store, &format!("live-{i}"), Duration::from_secs(3600)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        store.purge_expired().await.unwrap(),
        7,
        "7 expired markers, deleted 2 at a time"
    );
    assert_eq!(markers(&store).await, 3, "live markers stay");
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    common::drop_pg_table(store.pool(), &table).await;
}

#[tokio::test]
async fn janitor_purges_periodically_until_shut_down() {
    let (store, table) = fresh_store(1000).await;
    let janitor = Janitor::spawn(store.clone(), Duration::from_millis(100)).unwrap();
    for i in 0..5 {
        complete(&store, &format!("old-{i}"), Duration::from_millis(1)).await;
    }
    complete(&store, "live", Duration::from_secs(3600)).await;
    let mut left = markers(&store).await;
    for _ in 0..50 {
        if left == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = markers(&store).await;
    }
    assert_eq!(left, 1, "the janitor deleted the expired markers and kept the live one");
    janitor.shutdown().await;
    complete(&store, "after-shutdown", Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(markers(&store).await, 2, "a stopped janitor purges nothing");
    common::drop_pg_table(store.pool(), &table).await;
}

#[tokio::test]
async fn expiry_follows_the_database_clock() {
    let (store, table) = fresh_store(1000).await;
    complete(&store, "k", Duration::from_secs(3600)).await;
    let sql = format!(
        "SELECT extract(epoch FROM expires_at - processed_at)::bigint, \
                abs(extract(epoch FROM processed_at - now()))::bigint FROM {}",
        store.table().quoted('"')
    );
    let (lifetime, skew): (i64, i64) = sqlx::query_as(AssertSqlSafe(sql))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(lifetime, 3600, "expires_at = processed_at + ttl");
    assert!(skew < 60, "processed_at is the database's now()");
    common::drop_pg_table(store.pool(), &table).await;
}

#[test]
fn janitor_outside_a_runtime_is_an_error_not_a_panic() {
    let err = Janitor::spawn(idempotent_runtime::MemoryStore::new(), Duration::from_secs(1)).unwrap_err();
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}

// ---- MySqlStore: taking over an expired marker --------------------------

/// A store on a table of its own, on connections whose session default
/// isolation is `setting`'s (the store's transactions set their own).
async fn mysql_store(setting: u8) -> (idempotent_runtime::MySqlStore, String) {
    let table = common::unique("expiry_my");
    let store = idempotent_runtime::MySqlStore::builder(common::mysql_pool_with(16, setting).await)
        .table(&table)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    (store, table)
}

/// Makes the marker of `key` (every marker, without `key`) expired a
/// second ago; how many.
async fn mysql_expire(store: &idempotent_runtime::MySqlStore, table: &str, key: Option<&str>) -> u64 {
    let sql = format!(
        "UPDATE `{table}` SET expires_at = UTC_TIMESTAMP(3) - INTERVAL 1 SECOND \
         WHERE message_id = COALESCE(?, message_id)"
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(key)
        .execute(store.pool())
        .await
        .unwrap()
        .rows_affected()
}

/// A request of `key` whose duplicates must carry `payload`.
fn my_req<'a>(key: &'a str, payload: &str) -> Request<'a> {
    Request::new("expiry", key)
        .unwrap()
        .with_fingerprint(Some(Fingerprint::from_bytes(payload.as_bytes())))
}

/// Claims `key` with `payload`: a fresh claim completes with `result`
/// after `hold` (so that concurrent claims wait on it) and gives `None`; a
/// duplicate gives the stored result.
async fn my_claim(
    store: &idempotent_runtime::MySqlStore,
    key: &str,
    payload: &str,
    result: &str,
    hold: Duration,
) -> Result<Option<String>, idempotent_runtime::Error> {
    match store.claim(&my_req(key, payload)).await? {
        Claim::Fresh(guard) => {
            tokio::time::sleep(hold).await;
            guard.complete(Some(result.to_owned())).await?;
            Ok(None)
        }
        Claim::Done(replay) => Ok(replay.json().map(str::to_owned)),
    }
}

/// An expired marker is taken over by exactly one of concurrent claims,
/// with the new claim's fingerprint, expiry and result (the old result is
/// not replayed, the old fingerprint no longer checked); a take-over that
/// rolls back leaves the marker expired for the next claim.
async fn expired_marker_is_taken_over_once_with_the_new_fingerprint_and_result(setting: u8) {
    let (store, table) = mysql_store(setting).await;
    let no_hold = Duration::ZERO;
    assert_eq!(my_claim(&store, "k", "a", "1", no_hold).await.unwrap(), None);
    assert_eq!(
        my_claim(&store, "k", "a", "1", no_hold).await.unwrap().as_deref(),
        Some("1")
    );
    assert!(matches!(
        my_claim(&store, "k", "b", "2", no_hold).await,
        Err(idempotent_runtime::Error::KeyReused { .. })
    ));

    for round in ["2", "3"] {
        assert_eq!(mysql_expire(&store, &table, Some("k")).await, 1);
        let claims = futures_util::future::join_all(
            (0..6).map(|_| my_claim(&store, "k", round, round, Duration::from_millis(100))),
        )
        .await;
        let outcomes: Vec<Option<String>> = claims.into_iter().map(Result::unwrap).collect();
        assert_eq!(
            outcomes.iter().filter(|o| o.is_none()).count(),
            1,
            "one claim takes the expired marker over: {outcomes:?}"
        );
        assert!(
            outcomes.iter().flatten().all(|o| o == round),
            "the others wait for it and replay its result: {outcomes:?}"
        );
        assert_eq!(
            my_claim(&store, "k", round, "x", no_hold).await.unwrap().as_deref(),
            Some(round),
            "the marker that took over is live, with the new result"
        );
        assert!(
            matches!(
                my_claim(&store, "k", "a", "x", no_hold).await,
                Err(idempotent_runtime::Error::KeyReused { .. })
            ),
            "the marker keeps the new fingerprint"
        );
    }

    assert_eq!(mysql_expire(&store, &table, Some("k")).await, 1);
    match store.claim(&my_req("k", "c")).await.unwrap() {
        Claim::Fresh(guard) => drop(guard),
        Claim::Done(_) => panic!("the expired marker was not taken over"),
    }
    assert_eq!(
        my_claim(&store, "k", "c", "4", no_hold).await.unwrap(),
        None,
        "a take-over that rolled back leaves the marker expired"
    );
    // A `()` handler without fingerprint takes an expired marker over too.
    assert_eq!(mysql_expire(&store, &table, Some("k")).await, 1);
    let unit = Request::new("expiry", "k").unwrap().with_unit_result(true);
    match store.claim(&unit).await.unwrap() {
        Claim::Fresh(guard) => guard.complete(None).await.unwrap(),
        Claim::Done(_) => panic!("a `()` claim did not take the expired marker over"),
    }

    let sql = format!("SELECT COUNT(*), CAST(SUM(expires_at > UTC_TIMESTAMP(3)) AS SIGNED) FROM `{table}`");
    let (rows, live): (i64, i64) = sqlx::query_as(AssertSqlSafe(sql))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!((rows, live), (1, 1), "one marker, live");
    common::drop_mysql_table(store.pool(), &table).await;
}

/// Inside batches too: each expired marker is taken over by exactly one of
/// concurrent batches, and the markers that took over are live.
async fn batch_claims_take_over_expired_markers_once(setting: u8) {
    use idempotent_runtime::batch::BatchStore;
    let (store, table) = mysql_store(setting).await;
    let fresh = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let concurrently = || {
        futures_util::future::join_all((0..3).map(|_| {
            let (store, fresh) = (store.clone(), std::sync::Arc::clone(&fresh));
            async move {
                let batch = store.begin_batch().await.unwrap();
                let calls = (0..4).map(|i| {
                    let (store, fresh) = (store.clone(), std::sync::Arc::clone(&fresh));
                    async move {
                        let key = format!("k{i}");
                        match store.claim(&my_req(&key, "p")).await? {
                            Claim::Fresh(guard) => {
                                fresh.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                guard.complete(Some("1".into())).await
                            }
                            Claim::Done(_) => Ok(()),
                        }
                    }
                });
                let outcomes = batch.run_all(calls.collect()).await;
                assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
                batch.commit().await.unwrap();
            }
        }))
    };
    let runs = || fresh.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(30), concurrently())
        .await
        .unwrap();
    assert_eq!(runs(), 4, "concurrent batches of new keys claim each once");
    for round in 2..=3 {
        assert_eq!(mysql_expire(&store, &table, None).await, 4);
        tokio::time::timeout(Duration::from_secs(30), concurrently())
            .await
            .unwrap();
        assert_eq!(runs(), 4 * round, "each expired marker is taken over by one batch");
        tokio::time::timeout(Duration::from_secs(30), concurrently())
            .await
            .unwrap();
        assert_eq!(runs(), 4 * round, "the markers that took over are live");
    }
    common::drop_mysql_table(store.pool(), &table).await;
}

/// Both take-over tests under each session default isolation.
macro_rules! mysql_take_over_tests {
    ($($setting:ident => $single:ident, $batch:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $single() {
            expired_marker_is_taken_over_once_with_the_new_fingerprint_and_result(common::settings::$setting).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $batch() {
            batch_claims_take_over_expired_markers_once(common::settings::$setting).await;
        }
    )*};
}

mysql_take_over_tests! {
    MY_SERVER_DEFAULT => mysql_expired_marker_is_taken_over_once_with_the_new_fingerprint_and_result,
        mysql_batch_claims_take_over_expired_markers_once;
    MY_READ_COMMITTED => mysql_read_committed_session_expired_marker_is_taken_over_once,
        mysql_read_committed_session_batch_claims_take_over_expired_markers_once;
    MY_REPEATABLE_READ => mysql_repeatable_read_session_expired_marker_is_taken_over_once,
        mysql_repeatable_read_session_batch_claims_take_over_expired_markers_once;
    MY_SERIALIZABLE => mysql_serializable_session_expired_marker_is_taken_over_once,
        mysql_serializable_session_batch_claims_take_over_expired_markers_once;
}

// ---- a marker lives its whole ttl from its commit (issue #43, hole 7) ----
//
// Expiry is computed by the database clock when the claim is made, which
// can be long before the claim is seen: a claim that waited on a key held
// by a claim that then rolled back (PostgreSQL's `now()` is the
// transaction's start, MariaDB's `UTC_TIMESTAMP(3)` the statement's), or a
// batch member whose batch commits later. The marker must still live its
// whole ttl once committed.

/// How long the marker of `key` has left, in milliseconds, by the
/// database clock: one query per backend.
type Remaining = Box<dyn Fn(String) -> std::pin::Pin<Box<dyn std::future::Future<Output = i64> + Send>> + Send + Sync>;

/// The ttl of these tests, and how long the first claim holds the key.
const SHORT_TTL: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(2);

/// Claims `key` with [`SHORT_TTL`]; completes a fresh claim at once.
async fn claim_and_complete<S: Store>(store: &S, key: &str) -> bool {
    let req = Request::new("expiry.wait", key).unwrap().with_ttl(SHORT_TTL);
    match store.claim(&req).await.unwrap() {
        Claim::Fresh(guard) => {
            guard.complete(None).await.unwrap();
            true
        }
        Claim::Done(_) => false,
    }
}

/// A claim waits [`HOLD`] on a claim of the same key that then rolls back:
/// once committed its marker still has (nearly) its whole ttl, and a
/// redelivery [`HOLD`] later is a duplicate.
async fn a_claim_that_waited_gets_its_whole_ttl<S: Store + Clone + Send + Sync + 'static>(
    store: S,
    remaining: Remaining,
) {
    let key = common::unique("waited");
    let req = Request::new("expiry.wait", &key).unwrap().with_ttl(SHORT_TTL);
    let Claim::Fresh(first) = store.claim(&req).await.unwrap() else {
        panic!("a new key is fresh");
    };
    let waiting = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move { claim_and_complete(&store, &key).await })
    };
    tokio::time::sleep(HOLD).await;
    assert!(!waiting.is_finished(), "the second claim waits for the first");
    first.abort().await;
    assert!(
        waiting.await.unwrap(),
        "the first rolled back: the second claim is fresh"
    );
    let left = remaining(key.clone()).await;
    assert!(
        left > SHORT_TTL.as_millis() as i64 - 500,
        "the marker lives its whole ttl from its commit: {left} ms left of {SHORT_TTL:?}"
    );
    tokio::time::sleep(HOLD).await;
    assert!(
        !claim_and_complete(&store, &key).await,
        "{HOLD:?} after the commit, within the ttl, the redelivery is a duplicate"
    );
}

/// A batch member claimed [`HOLD`] before its batch commits (and, on
/// PostgreSQL, one claimed after that long in the batch's transaction):
/// once committed their markers have (nearly) their whole ttl.
async fn a_batch_member_gets_its_whole_ttl_from_the_commit<S>(store: S, remaining: Remaining)
where
    S: Store + idempotent_runtime::batch::BatchStore + Clone + Send + Sync + 'static,
{
    let (early, late) = (common::unique("early"), common::unique("late"));
    let batch = store.begin_batch().await.unwrap();
    assert!(batch.run(claim_and_complete(&store, &early)).await);
    tokio::time::sleep(HOLD).await;
    assert!(batch.run(claim_and_complete(&store, &late)).await);
    batch.commit().await.unwrap();
    for key in [early, late] {
        let left = remaining(key.clone()).await;
        assert!(
            left > SHORT_TTL.as_millis() as i64 - 500,
            "{key}: the marker lives its whole ttl from the batch's commit: {left} ms left of {SHORT_TTL:?}"
        );
    }
}

fn pg_remaining(store: &PgStore) -> Remaining {
    let (pool, table) = (store.pool().clone(), store.table().quoted('"'));
    Box::new(move |key| {
        let (pool, table) = (pool.clone(), table.clone());
        Box::pin(async move {
            let sql = format!(
                "SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint FROM {table} \
                 WHERE message_id = $1"
            );
            sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(key)
                .fetch_one(&pool)
                .await
                .unwrap()
        })
    })
}

fn mysql_remaining(store: &idempotent_runtime::MySqlStore) -> Remaining {
    let (pool, table) = (store.pool().clone(), store.table().quoted('`'));
    Box::new(move |key| {
        let (pool, table) = (pool.clone(), table.clone());
        Box::pin(async move {
            let sql = format!(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(3), expires_at) / 1000 AS SIGNED) FROM {table} \
                 WHERE message_id = ?"
            );
            sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(key)
                .fetch_one(&pool)
                .await
                .unwrap()
        })
    })
}

fn sqlite_remaining(store: &idempotent_runtime::SqliteStore) -> Remaining {
    let (pool, table) = (store.pool().clone(), store.table().quoted('"'));
    Box::new(move |key| {
        let (pool, table) = (pool.clone(), table.clone());
        Box::pin(async move {
            let sql = format!(
                "SELECT expires_at - CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) FROM {table} \
                 WHERE message_id = ?1"
            );
            sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(key)
                .fetch_one(&pool)
                .await
                .unwrap()
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_claim_that_waited_gets_its_whole_ttl() {
    let (store, table) = fresh_store(1000).await;
    a_claim_that_waited_gets_its_whole_ttl(store.clone(), pg_remaining(&store)).await;
    common::drop_pg_table(store.pool(), &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_batch_member_gets_its_whole_ttl_from_the_commit() {
    let (store, table) = fresh_store(1000).await;
    a_batch_member_gets_its_whole_ttl_from_the_commit(store.clone(), pg_remaining(&store)).await;
    common::drop_pg_table(store.pool(), &table).await;
}

/// A `PgStore` with the partitioned marker layout (partitions of a second).
/// Its claims never join a batch (each takes its own transaction), so only
/// the wait applies.
async fn partitioned_store() -> (PgStore, String) {
    let table = common::unique("expiry_part");
    let store = PgStore::builder(common::pg_pool(4).await)
        .table(&table)
        .partitioned(Duration::from_secs(1))
        .partition_horizon(Duration::from_secs(10))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    (store, table)
}

/// Drops a partitioned marker table (its partitions go with it).
async fn drop_partitioned(store: &PgStore, table: &str) {
    let sql = format!("DROP TABLE IF EXISTS \"{table}\" CASCADE");
    let _ = sqlx::query(AssertSqlSafe(sql)).execute(store.pool()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_partitioned_a_claim_that_waited_gets_its_whole_ttl() {
    let (store, table) = partitioned_store().await;
    a_claim_that_waited_gets_its_whole_ttl(store.clone(), pg_remaining(&store)).await;
    drop_partitioned(&store, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_claim_that_waited_gets_its_whole_ttl() {
    let (store, table) = mysql_store(common::settings::MY_SERVER_DEFAULT).await;
    a_claim_that_waited_gets_its_whole_ttl(store.clone(), mysql_remaining(&store)).await;
    common::drop_mysql_table(store.pool(), &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_batch_member_gets_its_whole_ttl_from_the_commit() {
    let (store, table) = mysql_store(common::settings::MY_SERVER_DEFAULT).await;
    a_batch_member_gets_its_whole_ttl_from_the_commit(store.clone(), mysql_remaining(&store)).await;
    common::drop_mysql_table(store.pool(), &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_claim_that_waited_gets_its_whole_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_runtime::SqliteStore::open(dir.path().join("m.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    a_claim_that_waited_gets_its_whole_ttl(store.clone(), sqlite_remaining(&store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_batch_member_gets_its_whole_ttl_from_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_runtime::SqliteStore::open(dir.path().join("m.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    a_batch_member_gets_its_whole_ttl_from_the_commit(store.clone(), sqlite_remaining(&store)).await;
}
