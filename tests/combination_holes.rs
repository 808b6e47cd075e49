//! Regressions of the holes found where features meet (issue 27): each
//! test turns on two features that held alone and lost effects together.
//!
//! - A `CachedStore` in front of a batch's store learnt that a key was done
//!   when its member completed, before the batch committed: after an
//!   aborted batch, the one-by-one rerun was answered from the cache and
//!   the effect was gone.
//! - `PgStore` forced `synchronous_commit` on only when its first claim saw
//!   it off: a session whose setting changed later committed claims
//!   without a durable flush.
//! - A handler that swallows a PostgreSQL error and returns `Ok` (the
//!   "already done" reading of a unique violation) leaves the transaction
//!   aborted; `COMMIT` then answers `ROLLBACK` without an error, and the
//!   claim (alone or the whole batch) was reported committed.
//!
//! The broker-level holes (RabbitMQ confirms with several publishes in
//! flight, batch members kept alive on JetStream and Redis Streams) are
//! tested beside their adapters; the combination checker
//! (`combinations.rs`) runs them all together.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use idempotent_runtime::batch::BatchStore;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{CachedStore, Error, PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// How long a hanging body runs before it is cancelled.
const HANG: std::time::Duration = std::time::Duration::from_millis(300);

struct Svc {
    store: CachedStore<PgStore>,
    effects: String,
    runs: AtomicU64,
}

impl Svc {
    /// Inserts the effect; hangs when told to (to be cancelled mid-body).
    #[idempotent(key = "id", store = self.store, scope = "holes.cached")]
    async fn pay(&self, id: &str, hang: bool, tx: &mut PgConnection) -> Result<(), AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id) VALUES ($1)",
            self.effects
        )))
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if hang {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn effects_of(&self, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {} WHERE message_id = $1",
            self.effects
        )))
        .bind(id)
        .fetch_one(self.store.inner().pool())
        .await
        .unwrap()
    }
}

async fn effects_table(pool: &PgPool, extra: &str) -> String {
    let effects = common::unique("holes_e");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (message_id TEXT NOT NULL{extra})"
    )))
    .execute(pool)
    .await
    .unwrap();
    effects
}

async fn pg_store(pool: &PgPool) -> PgStore {
    let store = PgStore::builder(pool.clone())
        .table(&common::unique("holes_m"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    store
}

async fn drop_tables(pool: &PgPool, tables: &[&str]) {
    for table in tables {
        common::drop_pg_table(pool, table).await;
    }
}

/// Hole 1: a member completes, another is cancelled with its claim open,
/// the batch cannot commit. The rerun of the first message alone must run
/// its body (nothing of the batch took effect), not be answered from the
/// cache as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_batch_leaves_nothing_in_the_cache() {
    let pool = common::pg_pool(4).await;
    let inner = pg_store(&pool).await;
    let svc = Svc {
        store: CachedStore::new(inner.clone(), 1_000),
        effects: effects_table(&pool, "").await,
        runs: AtomicU64::new(0),
    };
    let (first, second) = (common::unique("k"), common::unique("k"));

    let batch = inner.begin_batch().await.unwrap();
    batch.run(svc.pay(&first, false)).await.unwrap();
    let cancelled = tokio::time::timeout(HANG, batch.run(svc.pay(&second, true))).await;
    assert!(cancelled.is_err(), "the hanging body was cancelled");
    assert!(matches!(batch.commit().await, Err(Error::BatchAborted)));
    assert_eq!(svc.effects_of(&first).await, 0, "the aborted batch had no effect");
    assert_eq!(svc.store.len(), 0, "the cache learnt a key its batch never committed");

    // The rerun, one message per transaction, as the consumers do.
    svc.pay(&first, false).await.unwrap();
    svc.pay(&second, false).await.unwrap();
    assert_eq!(svc.effects_of(&first).await, 1, "the rerun was answered from the cache");
    assert_eq!(svc.effects_of(&second).await, 1);
    assert_eq!(svc.runs.load(Ordering::SeqCst), 4);

    // Committed now: a duplicate is answered from the cache.
    svc.pay(&first, false).await.unwrap();
    assert_eq!(svc.runs.load(Ordering::SeqCst), 4);
    assert_eq!(svc.store.stats().hits, 1);
    drop_tables(&pool, &[&svc.effects, &inner.table().to_string()]).await;
}

/// Hole 1, the other way in: inside a batch a duplicate of a key the same
/// batch claimed is answered from its uncommitted marker; the cache must
/// not remember that answer unless the batch commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_inside_an_aborted_batch_is_not_cached() {
    let pool = common::pg_pool(4).await;
    let inner = pg_store(&pool).await;
    let svc = Svc {
        store: CachedStore::new(inner.clone(), 1_000),
        effects: effects_table(&pool, "").await,
        runs: AtomicU64::new(0),
    };
    let (key, other) = (common::unique("k"), common::unique("k"));
    let batch = inner.begin_batch().await.unwrap();
    batch.run(svc.pay(&key, false)).await.unwrap();
    // Answered as a duplicate from the batch's own (uncommitted) marker.
    batch.run(svc.pay(&key, false)).await.unwrap();
    assert_eq!(svc.runs.load(Ordering::SeqCst), 1);
    assert!(
        tokio::time::timeout(HANG, batch.run(svc.pay(&other, true)))
            .await
            .is_err()
    );
    assert!(matches!(batch.commit().await, Err(Error::BatchAborted)));
    assert_eq!(svc.store.len(), 0, "the cache learnt an uncommitted duplicate");
    svc.pay(&key, false).await.unwrap();
    assert_eq!(svc.effects_of(&key).await, 1);
    drop_tables(&pool, &[&svc.effects, &inner.table().to_string()]).await;
}

/// A table whose rows record, at `COMMIT` (a deferred constraint trigger
/// fires there, after everything the claim and its body did), the
/// `synchronous_commit` the commit runs with.
async fn commit_setting_log(pool: &PgPool) -> (String, String) {
    let (effects, log) = (common::unique("holes_sc_e"), common::unique("holes_sc_l"));
    for ddl in [
        format!("CREATE TABLE {effects} (message_id TEXT NOT NULL)"),
        format!("CREATE TABLE {log} (message_id TEXT NOT NULL, setting TEXT NOT NULL)"),
        format!(
            "CREATE FUNCTION {log}_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO {log} VALUES (NEW.message_id, current_setting('synchronous_commit')); RETURN NULL; END $$"
        ),
        format!(
            "CREATE CONSTRAINT TRIGGER {log}_t AFTER INSERT ON {effects} DEFERRABLE INITIALLY DEFERRED \
             FOR EACH ROW EXECUTE FUNCTION {log}_f()"
        ),
    ] {
        sqlx::query(AssertSqlSafe(ddl)).execute(pool).await.unwrap();
    }
    (effects, log)
}

#[idempotent(key = "id", store = store, scope = "holes.durable")]
async fn record(store: &PgStore, effects: &str, id: &str, tx: &mut PgConnection) -> Result<(), AppError> {
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {effects} (message_id) VALUES ($1)")))
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn commit_settings(pool: &PgPool, log: &str) -> Vec<(String, String)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, setting FROM {log} ORDER BY message_id"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Hole 3: the session's `synchronous_commit` turns `off` after the store's
/// first claim (a session `SET` on the pool's one connection, as a pool
/// configured differently, `ALTER ROLE` or `ALTER DATABASE` would do for
/// new sessions). Every later claim, alone or in a batch, still commits
/// with `synchronous_commit = on`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_is_durable_whatever_the_session_says_now() {
    let setup = common::pg_pool(2).await;
    let (effects, log) = commit_setting_log(&setup).await;
    let pool = common::pg_pool(1).await;
    let store = pg_store(&pool).await;
    let id = |n: u32| format!("{n:02}");

    record(&store, &effects, &id(1)).await.unwrap();
    sqlx::query("SET synchronous_commit = off")
        .execute(&pool)
        .await
        .unwrap();
    let session: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(session, "off", "the pool's one session has it off now");
    record(&store, &effects, &id(2)).await.unwrap();
    let batch = store.begin_batch().await.unwrap();
    batch.run(record(&store, &effects, &id(3))).await.unwrap();
    batch.run(record(&store, &effects, &id(4))).await.unwrap();
    batch.commit().await.unwrap();
    // A stronger setting than `on` is left as it is.
    sqlx::query("SET synchronous_commit = remote_apply")
        .execute(&pool)
        .await
        .unwrap();
    record(&store, &effects, &id(5)).await.unwrap();
    let session: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(session, "remote_apply", "the session's own setting is untouched");

    let expected: Vec<(String, String)> = [(1, "on"), (2, "on"), (3, "on"), (4, "on"), (5, "remote_apply")]
        .into_iter()
        .map(|(n, setting)| (id(n), setting.to_owned()))
        .collect();
    assert_eq!(commit_settings(&setup, &log).await, expected);
    drop(pool);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {effects}; DROP TABLE {log}; DROP FUNCTION {log}_f()"
    )))
    .execute(&setup)
    .await
    .unwrap();
    common::drop_pg_table(&setup, &store.table().to_string()).await;
}

/// The article's "idempotent by design" insert, written so that a unique
/// violation means "already done": the error is swallowed and the body
/// returns `Ok`. On PostgreSQL the failed statement aborts the whole
/// transaction.
#[idempotent(key = "id", store = store, scope = "holes.swallow")]
async fn insert_or_already_done(
    store: &PgStore,
    effects: &str,
    id: &str,
    order: &str,
    tx: &mut PgConnection,
) -> Result<(), AppError> {
    let inserted = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {effects} (message_id, order_id) VALUES ($1, $2)"
    )))
    .bind(id)
    .bind(order)
    .execute(&mut *tx)
    .await;
    match inserted {
        Err(sqlx::Error::Database(db)) if db.is_unique_violation() => Ok(()),
        other => other.map(drop).map_err(AppError::from),
    }
}

async fn markers_of(pool: &PgPool, store: &PgStore, id: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {} WHERE message_id = $1",
        store.table()
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn rows_of(pool: &PgPool, effects: &str, id: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {effects} WHERE message_id = $1"
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Hole 5, one message: the handler returns `Ok` over an aborted
/// transaction. The call reports `TransactionAborted` (nothing committed)
/// instead of `Ok` for a marker that was never written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_error_is_not_reported_as_a_commit() {
    let pool = common::pg_pool(4).await;
    let store = pg_store(&pool).await;
    let effects = effects_table(&pool, ", order_id TEXT NOT NULL UNIQUE").await;
    let order = common::unique("order");
    let (first, second) = (common::unique("k"), common::unique("k"));

    insert_or_already_done(&store, &effects, &first, &order).await.unwrap();
    let swallowed = insert_or_already_done(&store, &effects, &second, &order).await;
    assert!(
        matches!(swallowed, Err(AppError::Idem(Error::TransactionAborted))),
        "{swallowed:?}"
    );
    assert_eq!(markers_of(&pool, &store, &second).await, 0);
    assert_eq!(rows_of(&pool, &effects, &first).await, 1);
    // The store and its connections are fine afterwards.
    let third = common::unique("k");
    insert_or_already_done(&store, &effects, &third, &common::unique("order"))
        .await
        .unwrap();
    assert_eq!(markers_of(&pool, &store, &third).await, 1);
    drop_tables(&pool, &[&effects, &store.table().to_string()]).await;
}

/// Hole 5, in a batch: one member swallows a unique violation, which
/// aborts the batch's transaction. The batch must not report a commit
/// (every member would be acknowledged with nothing committed); run alone,
/// the innocent member commits and the guilty one reports
/// `TransactionAborted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_member_that_swallows_an_error_cannot_make_the_batch_report_a_commit() {
    let pool = common::pg_pool(4).await;
    let store = pg_store(&pool).await;
    let effects = effects_table(&pool, ", order_id TEXT NOT NULL UNIQUE").await;
    let taken = common::unique("order");
    insert_or_already_done(&store, &effects, &common::unique("k"), &taken)
        .await
        .unwrap();
    let (innocent, guilty) = (common::unique("k"), common::unique("k"));

    let batch = store.begin_batch().await.unwrap();
    batch
        .run(insert_or_already_done(
            &store,
            &effects,
            &innocent,
            &common::unique("order"),
        ))
        .await
        .unwrap();
    // Returns Ok: the body swallowed the violation.
    batch
        .run(insert_or_already_done(&store, &effects, &guilty, &taken))
        .await
        .unwrap();
    assert!(matches!(batch.commit().await, Err(Error::BatchAborted)));
    assert_eq!(rows_of(&pool, &effects, &innocent).await, 0);

    // The rerun, one per transaction.
    let order = common::unique("order");
    insert_or_already_done(&store, &effects, &innocent, &order)
        .await
        .unwrap();
    let alone = insert_or_already_done(&store, &effects, &guilty, &taken).await;
    assert!(
        matches!(alone, Err(AppError::Idem(Error::TransactionAborted))),
        "{alone:?}"
    );
    assert_eq!(rows_of(&pool, &effects, &innocent).await, 1);
    assert_eq!(markers_of(&pool, &store, &innocent).await, 1);
    assert_eq!(markers_of(&pool, &store, &guilty).await, 0);
    drop_tables(&pool, &[&effects, &store.table().to_string()]).await;
}
