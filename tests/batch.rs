//! Batch transactions (`idempotent_runtime::batch`) on the real databases:
//! PostgreSQL, MariaDB and SQLite.
//!
//! The same `#[idempotent]` handler runs inside a `Batch`: its effects and
//! markers commit together with the batch, a failing body is undone alone
//! (its savepoint and its marker), a duplicate inside the batch or of a
//! committed message is answered as usual, nothing is visible before the
//! commit, and a batch that cannot commit (a panic or a cancellation with a
//! claim open, a rollback) leaves no effect and no marker, so its messages
//! can run again. Broker consumers in batch mode are tested in
//! `broker_conformance.rs` and `chaos.rs`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use idempotent_runtime::batch::BatchStore;
use idempotent_runtime::{Error, idempotent, sqlx};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("the body failed on purpose")]
    Failed,
}

struct Msg {
    id: String,
    amount: i64,
    fail: bool,
    panic: bool,
    /// The body never ends (to be cancelled mid-body).
    hang: bool,
}

fn msg(id: &str, amount: i64) -> Msg {
    Msg {
        id: id.to_owned(),
        amount,
        fail: false,
        panic: false,
        hang: false,
    }
}

/// Generates the suite for one backend: `$store` with transactions on
/// `$conn`, an effect `INSERT` written with `$insert` (`{}` for the table).
macro_rules! suite {
    ($module:ident, $store:ty, $conn:ty, $insert:literal, $setup:expr, $teardown:expr) => {
        mod $module {
            use super::*;

            struct Service {
                store: $store,
                other: $store,
                effects: String,
                runs: AtomicU64,
            }

            impl Service {
                /// Inserts the effect, then fails or panics when the message
                /// says so (after the insert, so the undo is observable).
                #[idempotent(key = "msg.id", store = self.store, scope = "batch.pay")]
                async fn pay(&self, msg: &Msg, tx: &mut $conn) -> Result<i64, AppError> {
                    self.runs.fetch_add(1, Ordering::SeqCst);
                    let insert = format!($insert, self.effects);
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(&msg.id)
                        .bind(msg.amount)
                        .execute(&mut *tx)
                        .await?;
                    if msg.panic {
                        panic!("the body panicked on purpose");
                    }
                    if msg.hang {
                        std::future::pending::<()>().await;
                    }
                    if msg.fail {
                        return Err(AppError::Failed);
                    }
                    Ok(msg.amount * 2)
                }

                /// The same on another marker table: not the batch's store.
                #[idempotent(key = "msg.id", store = self.other, scope = "batch.other")]
                async fn elsewhere(&self, msg: &Msg, tx: &mut $conn) -> Result<(), AppError> {
                    let insert = format!($insert, self.effects);
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(&msg.id)
                        .bind(msg.amount)
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                }

                async fn count(&self, what: &str) -> i64 {
                    let sql = match what {
                        "effects" => format!("SELECT COUNT(*) FROM {}", self.effects),
                        _ => format!("SELECT COUNT(*) FROM {}", self.store.table()),
                    };
                    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                        .fetch_one(self.store.pool())
                        .await
                        .unwrap()
                }

                async fn effects_of(&self, id: &str) -> i64 {
                    let sql = format!("SELECT COUNT(*) FROM {} WHERE message_id = '{id}'", self.effects);
                    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                        .fetch_one(self.store.pool())
                        .await
                        .unwrap()
                }

                /// Effects written through the other store (its database).
                async fn effects_elsewhere(&self, id: &str) -> i64 {
                    let sql = format!("SELECT COUNT(*) FROM {} WHERE message_id = '{id}'", self.effects);
                    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                        .fetch_one(self.other.pool())
                        .await
                        .unwrap()
                }

                fn runs(&self) -> u64 {
                    self.runs.load(Ordering::SeqCst)
                }
            }

            async fn service() -> (Service, impl std::any::Any) {
                let (store, other, effects, keep) = $setup.await;
                (
                    Service {
                        store,
                        other,
                        effects,
                        runs: AtomicU64::new(0),
                    },
                    keep,
                )
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_commits_its_messages_together_and_undoes_a_failure_alone() {
                let (svc, keep) = service().await;
                let batch = svc.store.begin_batch().await.unwrap();
                assert_eq!(batch.run(svc.pay(&msg("k1", 1))).await.unwrap(), 2);
                assert_eq!(batch.run(svc.pay(&msg("k2", 2))).await.unwrap(), 4);
                // A duplicate inside the batch replays the first run's result.
                assert_eq!(batch.run(svc.pay(&msg("k1", 1))).await.unwrap(), 2);
                // A failing body: its effect and its marker are undone.
                let failing = Msg {
                    fail: true,
                    ..msg("k3", 3)
                };
                assert!(matches!(
                    batch.run(svc.pay(&failing)).await,
                    Err(AppError::Failed)
                ));
                assert_eq!(batch.run(svc.pay(&msg("k4", 4))).await.unwrap(), 8);
                assert_eq!(svc.runs(), 4, "the in-batch duplicate did not run");
                assert!(!batch.is_aborted());
                assert_eq!(batch.fresh_claims(), 4);
                // Nothing is visible before the commit.
                assert_eq!((svc.count("effects").await, svc.count("markers").await), (0, 0));
                batch.commit().await.unwrap();

                assert_eq!(svc.count("effects").await, 3, "k1, k2, k4");
                assert_eq!(svc.count("markers").await, 3, "no marker for the failed k3");
                for id in ["k1", "k2", "k4"] {
                    assert_eq!(svc.effects_of(id).await, 1, "{id} once");
                }
                assert_eq!(svc.effects_of("k3").await, 0);
                // The failed message runs again and is processed; the others
                // are duplicates of the batch's commit.
                assert_eq!(svc.pay(&msg("k3", 3)).await.unwrap(), 6);
                assert_eq!(svc.pay(&msg("k2", 2)).await.unwrap(), 4);
                assert_eq!(svc.effects_of("k3").await, 1);
                assert_eq!(svc.count("effects").await, 4);
                assert_eq!(svc.runs(), 5);
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn without_savepoints_a_failure_rolls_the_whole_batch_back() {
                let (svc, keep) = service().await;
                // Without savepoints: the batch's messages commit together
                // when none fails.
                let batch = svc.store.begin_batch().await.unwrap();
                batch.set_savepoints(false);
                let msgs = [msg("s1", 1), msg("s2", 2), msg("s1", 1)];
                let outcomes = batch.run_all(msgs.iter().map(|m| svc.pay(m)).collect()).await;
                let values: Vec<Option<i64>> = outcomes.iter().map(|o| o.as_ref().ok().copied()).collect();
                assert_eq!(
                    values,
                    [Some(2), Some(4), Some(2)],
                    "s1 again replays its first run"
                );
                batch.commit().await.unwrap();
                assert_eq!((svc.effects_of("s1").await, svc.effects_of("s2").await), (1, 1));

                // One body fails: nothing of the batch may commit (there is
                // no savepoint to undo it alone), not even the members
                // before it.
                let batch = svc.store.begin_batch().await.unwrap();
                batch.set_savepoints(false);
                let failing = Msg {
                    fail: true,
                    ..msg("s4", 4)
                };
                let msgs = [msg("s3", 3), failing, msg("s5", 5), msg("s2", 2)];
                let outcomes = batch.run_all(msgs.iter().map(|m| svc.pay(m)).collect()).await;
                assert!(matches!(outcomes[1], Err(AppError::Failed)), "{:?}", outcomes[1]);
                assert!(
                    batch.is_aborted(),
                    "a failure without a savepoint aborts the batch"
                );
                assert!(matches!(batch.commit().await, Err(Error::BatchAborted)));
                for id in ["s3", "s4", "s5"] {
                    assert_eq!(svc.effects_of(id).await, 0, "{id} rolled back with the batch");
                }
                assert_eq!(svc.count("markers").await, 2, "s1 and s2 only");
                // Run again one by one, as the consumers do: each once.
                for m in [msg("s3", 3), msg("s4", 4), msg("s5", 5), msg("s2", 2)] {
                    svc.pay(&m).await.unwrap();
                }
                for id in ["s1", "s2", "s3", "s4", "s5"] {
                    assert_eq!(svc.effects_of(id).await, 1, "{id} once");
                }
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn calls_run_together_and_a_repeated_key_replays_its_first_run() {
                let (svc, keep) = service().await;
                // A key already committed: a duplicate inside the batch.
                assert_eq!(svc.pay(&msg("t0", 5)).await.unwrap(), 10);
                let batch = svc.store.begin_batch().await.unwrap();
                let failing = Msg {
                    fail: true,
                    ..msg("t3", 3)
                };
                let msgs = [
                    msg("t1", 1),
                    msg("t2", 2),
                    msg("t1", 1),
                    failing,
                    msg("t0", 5),
                    msg("t4", 4),
                ];
                let outcomes = batch.run_all(msgs.iter().map(|m| svc.pay(m)).collect()).await;
                let values: Vec<Option<i64>> = outcomes.iter().map(|o| o.as_ref().ok().copied()).collect();
                assert_eq!(values, [Some(2), Some(4), Some(2), None, Some(10), Some(8)]);
                assert!(matches!(outcomes[3], Err(AppError::Failed)));
                assert_eq!(svc.runs(), 5, "t0 earlier, then t1, t2, t3, t4 once each");
                assert_eq!(batch.fresh_claims(), 4);
                assert_eq!(svc.count("effects").await, 1, "only t0 before the commit");
                batch.commit().await.unwrap();
                for (id, n) in [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 0), ("t4", 1)] {
                    assert_eq!(svc.effects_of(id).await, n, "{id}");
                }
                assert_eq!(svc.count("markers").await, 4, "no marker for the failed t3");
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panic_with_a_claim_open_aborts_the_batch_and_nothing_takes_effect() {
                let (svc, keep) = service().await;
                let batch = svc.store.begin_batch().await.unwrap();
                batch.run(svc.pay(&msg("p1", 1))).await.unwrap();
                let panicking = Msg {
                    panic: true,
                    ..msg("p2", 2)
                };
                let caught = std::panic::AssertUnwindSafe(batch.run(svc.pay(&panicking)))
                    .catch_unwind()
                    .await;
                assert!(caught.is_err(), "the body panicked");
                assert!(batch.is_aborted());
                // Nothing more joins an aborted batch.
                let refused = batch.run(svc.pay(&msg("p3", 3))).await;
                assert!(
                    matches!(refused, Err(AppError::Idem(Error::BatchAborted))),
                    "{refused:?}"
                );
                assert!(matches!(batch.commit().await, Err(Error::BatchAborted)));
                assert_eq!(svc.effects_of("p1").await, 0, "the batch's p1 rolled back");
                assert_eq!(svc.effects_of("p2").await, 0);
                assert_eq!(svc.effects_of("p3").await, 0);
                svc.pay(&msg("p3", 3)).await.unwrap();
                // Both can run again.
                svc.pay(&msg("p1", 1)).await.unwrap();
                svc.pay(&msg("p2", 2)).await.unwrap();
                assert_eq!(svc.count("effects").await, 3);
                assert_eq!(svc.count("markers").await, 3);
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_cancelled_with_its_claim_open_aborts_the_batch() {
                let (svc, keep) = service().await;
                let batch = svc.store.begin_batch().await.unwrap();
                batch.run(svc.pay(&msg("c1", 1))).await.unwrap();
                // Cancelled mid-body: the claim's savepoint cannot be undone.
                let hanging = Msg {
                    hang: true,
                    ..msg("c2", 2)
                };
                let cancelled = tokio::time::timeout(Duration::from_millis(200), batch.run(svc.pay(&hanging))).await;
                assert!(cancelled.is_err(), "the call was cancelled");
                assert!(batch.is_aborted());
                assert!(matches!(batch.commit().await, Err(Error::BatchAborted)));
                assert_eq!((svc.count("effects").await, svc.count("markers").await), (0, 0));
                svc.pay(&msg("c1", 1)).await.unwrap();
                svc.pay(&msg("c2", 2)).await.unwrap();
                assert_eq!(svc.count("effects").await, 2);
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rolled_back_batch_leaves_nothing_and_its_messages_run_again() {
                let (svc, keep) = service().await;
                let batch = svc.store.begin_batch().await.unwrap();
                batch.run(svc.pay(&msg("r1", 1))).await.unwrap();
                batch.run(svc.pay(&msg("r2", 2))).await.unwrap();
                batch.rollback().await;
                assert_eq!((svc.count("effects").await, svc.count("markers").await), (0, 0));
                assert_eq!(svc.pay(&msg("r1", 1)).await.unwrap(), 2);
                assert_eq!(svc.runs(), 3, "r1 ran again");
                assert_eq!(svc.count("effects").await, 1);
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_duplicate_of_a_committed_message_is_answered_inside_a_batch() {
                let (svc, keep) = service().await;
                assert_eq!(svc.pay(&msg("d1", 5)).await.unwrap(), 10);
                let batch = svc.store.begin_batch().await.unwrap();
                assert_eq!(batch.run(svc.pay(&msg("d1", 5))).await.unwrap(), 10);
                assert_eq!(batch.fresh_claims(), 0);
                batch.commit().await.unwrap();
                assert_eq!(svc.runs(), 1);
                assert_eq!(svc.effects_of("d1").await, 1);
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn calls_on_another_store_keep_their_own_transaction() {
                let (svc, keep) = service().await;
                let batch = svc.store.begin_batch().await.unwrap();
                batch.run(svc.pay(&msg("o1", 1))).await.unwrap();
                batch.run(svc.elsewhere(&msg("o2", 2))).await.unwrap();
                // Committed on its own, before the batch.
                assert_eq!(svc.effects_elsewhere("o2").await, 1);
                assert_eq!(svc.effects_of("o1").await, 0);
                batch.commit().await.unwrap();
                assert_eq!(svc.effects_of("o1").await, 1);
                $teardown(&svc.store, &svc.other, &svc.effects, keep).await;
            }
        }
    };
}

// ---- PostgreSQL ---------------------------------------------------------

async fn pg_setup() -> (idempotent_runtime::PgStore, idempotent_runtime::PgStore, String, ()) {
    pg_setup_with(common::settings::PG_SERVER_DEFAULT).await
}

/// The stores on a pool whose sessions default to the isolation `setting`
/// (`common::settings::PG_*`).
async fn pg_setup_with(setting: u8) -> (idempotent_runtime::PgStore, idempotent_runtime::PgStore, String, ()) {
    pg_setup_on(common::pg_pool_with(8, setting).await).await
}

/// The stores and the effect table on `pool`.
async fn pg_setup_on(pool: sqlx::PgPool) -> (idempotent_runtime::PgStore, idempotent_runtime::PgStore, String, ()) {
    let (markers, other, effects) = (
        common::unique("batch_m"),
        common::unique("batch_o"),
        common::unique("batch_e"),
    );
    let store = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&markers)
        .build()
        .unwrap();
    let other = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&other)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    other.migrate().await.unwrap();
    let ddl = format!("CREATE TABLE {effects} (message_id TEXT NOT NULL, amount BIGINT NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    (store, other, effects, ())
}

async fn pg_teardown(
    store: &idempotent_runtime::PgStore,
    other: &idempotent_runtime::PgStore,
    effects: &str,
    _keep: impl std::any::Any,
) {
    for table in [store.table().to_string(), other.table().to_string(), effects.to_owned()] {
        common::drop_pg_table(store.pool(), &table).await;
    }
}

suite!(
    postgres,
    idempotent_runtime::PgStore,
    sqlx::PgConnection,
    "INSERT INTO {} (message_id, amount) VALUES ($1, $2)",
    pg_setup(),
    pg_teardown
);

// ---- MariaDB ------------------------------------------------------------

async fn mysql_setup() -> (
    idempotent_runtime::MySqlStore,
    idempotent_runtime::MySqlStore,
    String,
    (),
) {
    let pool = common::mysql_pool(8).await;
    let (markers, other, effects) = (
        common::unique("batch_m"),
        common::unique("batch_o"),
        common::unique("batch_e"),
    );
    let store = idempotent_runtime::MySqlStore::builder(pool.clone())
        .table(&markers)
        .build()
        .unwrap();
    let other = idempotent_runtime::MySqlStore::builder(pool.clone())
        .table(&other)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    other.migrate().await.unwrap();
    let ddl = format!("CREATE TABLE {effects} (message_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    (store, other, effects, ())
}

async fn mysql_teardown(
    store: &idempotent_runtime::MySqlStore,
    other: &idempotent_runtime::MySqlStore,
    effects: &str,
    _keep: impl std::any::Any,
) {
    for table in [store.table().to_string(), other.table().to_string(), effects.to_owned()] {
        common::drop_mysql_table(store.pool(), &table).await;
    }
}

suite!(
    mysql,
    idempotent_runtime::MySqlStore,
    sqlx::MySqlConnection,
    "INSERT INTO {} (message_id, amount) VALUES (?, ?)",
    mysql_setup(),
    mysql_teardown
);

// ---- SQLite -------------------------------------------------------------

async fn sqlite_setup() -> (
    idempotent_runtime::SqliteStore,
    idempotent_runtime::SqliteStore,
    String,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_runtime::SqliteStore::open(dir.path().join("markers.db"))
        .await
        .unwrap();
    // Another store is another database file: the batch holds its file's
    // write lock until it ends.
    let other = idempotent_runtime::SqliteStore::open(dir.path().join("other.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    other.migrate().await.unwrap();
    let effects = "effects".to_owned();
    let ddl = format!("CREATE TABLE {effects} (message_id TEXT NOT NULL, amount INTEGER NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(ddl.clone()))
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(other.pool())
        .await
        .unwrap();
    (store, other, effects, dir)
}

async fn sqlite_teardown(
    _store: &idempotent_runtime::SqliteStore,
    _other: &idempotent_runtime::SqliteStore,
    _effects: &str,
    keep: impl std::any::Any,
) {
    drop(keep); // the temporary directory
}

suite!(
    sqlite,
    idempotent_runtime::SqliteStore,
    sqlx::SqliteConnection,
    "INSERT INTO {} (message_id, amount) VALUES (?1, ?2)",
    sqlite_setup(),
    sqlite_teardown
);

// ---- across batches ----------------------------------------------------------------

/// The service of the PostgreSQL tests below: the store, the effects table
/// and a count of the bodies run.
type PgSvc = std::sync::Arc<(idempotent_runtime::PgStore, String, AtomicU64)>;

/// A handler's body: counts the run and inserts the effect.
async fn record(svc: &PgSvc, msg: &Msg, tx: &mut sqlx::PgConnection) -> Result<(), AppError> {
    svc.2.fetch_add(1, Ordering::SeqCst);
    let insert = format!("INSERT INTO {} (message_id, amount) VALUES ($1, $2)", svc.1);
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Two batches claiming one key: the second waits for the first's commit,
/// then answers a duplicate (PostgreSQL; MariaDB behaves alike, SQLite runs
/// one write transaction at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_claimed_in_an_open_batch_waits_for_its_commit_in_another() {
    let (store, other, effects, ()) = pg_setup().await;
    let svc = std::sync::Arc::new((store.clone(), effects.clone(), AtomicU64::new(0)));

    #[idempotent(key = "msg.id", store = &svc.0, scope = "batch.across")]
    async fn pay(svc: &PgSvc, msg: &Msg, tx: &mut sqlx::PgConnection) -> Result<i64, AppError> {
        record(svc, msg, tx).await?;
        Ok(msg.amount)
    }

    let first = store.begin_batch().await.unwrap();
    assert_eq!(first.run(pay(&svc, &msg("x1", 7))).await.unwrap(), 7);
    let second_svc = std::sync::Arc::clone(&svc);
    let second_store = store.clone();
    let second = tokio::spawn(async move {
        let batch = second_store.begin_batch().await.unwrap();
        let replayed = batch.run(pay(&second_svc, &msg("x1", 7))).await.unwrap();
        batch.commit().await.unwrap();
        replayed
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the second batch waits on the first's marker");
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), 7, "then replays its result");
    assert_eq!(svc.2.load(Ordering::SeqCst), 1, "the body ran once");
    pg_teardown(&store, &other, &effects, ()).await;
}

/// Two batches claiming the same keys in opposite orders: the batch's one
/// claim statement takes its markers in key order, so neither deadlocks;
/// the second waits for the first's commit and answers duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_claiming_the_same_keys_do_not_deadlock() {
    concurrent_batches_on_the_same_keys(common::settings::PG_SERVER_DEFAULT).await;
}

/// The same where the sessions default to Repeatable Read or Serializable:
/// a batch begins at Read Committed like a claim, so the second batch waits
/// for the first and replays instead of failing with 40001.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_on_the_same_keys_under_stricter_session_isolation() {
    concurrent_batches_on_the_same_keys(common::settings::PG_REPEATABLE_READ).await;
    concurrent_batches_on_the_same_keys(common::settings::PG_SERIALIZABLE).await;
}

async fn concurrent_batches_on_the_same_keys(setting: u8) {
    let (store, other, effects, ()) = pg_setup_with(setting).await;
    let svc = std::sync::Arc::new((store.clone(), effects.clone(), AtomicU64::new(0)));

    #[idempotent(key = "msg.id", store = &svc.0, scope = "batch.order")]
    async fn pay(svc: &PgSvc, msg: &Msg, tx: &mut sqlx::PgConnection) -> Result<(), AppError> {
        record(svc, msg, tx).await?;
        // Keep the batch open a while, so the other one meets its markers.
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }

    let run = |reverse: bool| {
        let (svc, store) = (std::sync::Arc::clone(&svc), store.clone());
        tokio::spawn(async move {
            let mut ids: Vec<String> = (0..20).map(|i| format!("o{i:02}")).collect();
            if reverse {
                ids.reverse();
            }
            let msgs: Vec<Msg> = ids.iter().map(|id| msg(id, 1)).collect();
            let batch = store.begin_batch().await.unwrap();
            let outcomes = batch.run_all(msgs.iter().map(|m| pay(&svc, m)).collect()).await;
            assert!(outcomes.iter().all(Result::is_ok), "no claim failed");
            batch.commit().await
        })
    };
    let (first, second) = (run(false), run(true));
    let both = tokio::time::timeout(Duration::from_secs(20), async { (first.await, second.await) })
        .await
        .expect("no deadlock");
    both.0.unwrap().unwrap();
    both.1.unwrap().unwrap();
    assert_eq!(svc.2.load(Ordering::SeqCst), 20, "each body once");
    let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(DISTINCT message_id) FROM {effects}"
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(count, 20);
    pg_teardown(&store, &other, &effects, ()).await;
}

/// Returns `()` and has no fingerprint: reads nothing back.
#[idempotent(key = "msg.id", store = &svc.0, scope = "batch.nolock.unit")]
async fn pay_unit(svc: &PgSvc, msg: &Msg, tx: &mut sqlx::PgConnection) -> Result<(), AppError> {
    record(svc, msg, tx).await
}

/// Returns a value: its duplicate reads the marker.
#[idempotent(key = "msg.id", store = &svc.0, scope = "batch.nolock.value")]
async fn pay_value(svc: &PgSvc, msg: &Msg, tx: &mut sqlx::PgConnection) -> Result<i64, AppError> {
    record(svc, msg, tx).await?;
    Ok(msg.amount)
}

/// The batch's one claim statement leaves the live marker of a request
/// that reads nothing back unlocked (no transaction id, row lock or WAL
/// record per duplicate), so a batch of such duplicates is answered while
/// another transaction holds their rows; the duplicates of a handler that
/// reads its marker still lock it first, and wait. Under every session
/// default isolation.
async fn batch_unit_duplicates_take_no_lock(setting: u8) {
    let (store, other, effects, ()) = pg_setup_with(setting).await;
    let svc: PgSvc = std::sync::Arc::new((store.clone(), effects.clone(), AtomicU64::new(0)));
    let (u1, u2, v1, v2) = (msg("u1", 1), msg("u2", 2), msg("v1", 3), msg("v2", 4));
    pay_unit(&svc, &u1).await.unwrap();
    pay_unit(&svc, &u2).await.unwrap();
    assert_eq!(pay_value(&svc, &v1).await.unwrap(), 3);
    assert_eq!(pay_value(&svc, &v2).await.unwrap(), 4);

    let mut holder = store.pool().begin().await.unwrap();
    let lock = format!(
        "SELECT 1 FROM {} WHERE message_id IN ('u1', 'u2', 'v1', 'v2') FOR UPDATE",
        store.table()
    );
    let locked = sqlx::query(sqlx::AssertSqlSafe(lock))
        .fetch_all(&mut *holder)
        .await
        .unwrap();
    assert_eq!(locked.len(), 4);

    let wait = Duration::from_secs(10);
    let u3 = msg("u3", 5);
    let batch = store.begin_batch().await.unwrap();
    let outcomes = tokio::time::timeout(
        wait,
        batch.run_all(vec![pay_unit(&svc, &u1), pay_unit(&svc, &u2), pay_unit(&svc, &u3)]),
    )
    .await
    .expect("`()` duplicates in a batch do not wait for their markers' row locks");
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(batch.fresh_claims(), 1, "u3 only");
    tokio::time::timeout(wait, batch.commit()).await.unwrap().unwrap();

    let reading = tokio::spawn({
        let (svc, store) = (std::sync::Arc::clone(&svc), store.clone());
        async move {
            let (v1, v2) = (msg("v1", 3), msg("v2", 4));
            let batch = store.begin_batch().await.unwrap();
            let outcomes = batch.run_all(vec![pay_value(&svc, &v1), pay_value(&svc, &v2)]).await;
            batch.commit().await.unwrap();
            outcomes.into_iter().map(Result::unwrap).collect::<Vec<i64>>()
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reading.is_finished(),
        "the duplicates of a handler that reads its marker lock it first"
    );
    holder.rollback().await.unwrap();
    assert_eq!(tokio::time::timeout(wait, reading).await.unwrap().unwrap(), vec![3, 4]);
    assert_eq!(svc.2.load(Ordering::SeqCst), 5, "no body ran again");
    pg_teardown(&store, &other, &effects, ()).await;
}

/// The guard leaves only live markers alone: expired markers not yet
/// purged are taken over by the batch statement, each by exactly one of
/// concurrent batches, and so are new keys. Under every session default
/// isolation.
async fn batch_claims_take_over_expired_markers_once(setting: u8) {
    let (store, other, effects, ()) = pg_setup_with(setting).await;
    let svc: PgSvc = std::sync::Arc::new((store.clone(), effects.clone(), AtomicU64::new(0)));
    let ids: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
    let concurrently = || {
        futures_util::future::join_all((0..4).map(|_| {
            let (svc, store, ids) = (std::sync::Arc::clone(&svc), store.clone(), ids.clone());
            async move {
                let msgs: Vec<Msg> = ids.iter().map(|id| msg(id, 1)).collect();
                let batch = store.begin_batch().await.unwrap();
                let outcomes = batch.run_all(msgs.iter().map(|m| pay_unit(&svc, m)).collect()).await;
                assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
                batch.commit().await.unwrap();
            }
        }))
    };
    tokio::time::timeout(Duration::from_secs(20), concurrently())
        .await
        .unwrap();
    assert_eq!(
        svc.2.load(Ordering::SeqCst),
        4,
        "concurrent batches of new keys run each body once"
    );

    let expire = format!("UPDATE {} SET expires_at = now() - interval '1 second'", store.table());
    for round in 2..=3 {
        let expired = sqlx::query(sqlx::AssertSqlSafe(expire.clone()))
            .execute(store.pool())
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(expired, 4);
        tokio::time::timeout(Duration::from_secs(20), concurrently())
            .await
            .unwrap();
        assert_eq!(
            svc.2.load(Ordering::SeqCst),
            4 * round,
            "each expired marker is taken over by one batch"
        );
        tokio::time::timeout(Duration::from_secs(20), concurrently())
            .await
            .unwrap();
        assert_eq!(
            svc.2.load(Ordering::SeqCst),
            4 * round,
            "the markers that took over are live"
        );
    }
    pg_teardown(&store, &other, &effects, ()).await;
}

macro_rules! pg_batch_claim_tests {
    ($($setting:ident => $lock:ident, $expired:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $lock() {
            batch_unit_duplicates_take_no_lock(common::settings::$setting).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $expired() {
            batch_claims_take_over_expired_markers_once(common::settings::$setting).await;
        }
    )*};
}

pg_batch_claim_tests! {
    PG_SERVER_DEFAULT => batch_unit_duplicates_take_no_lock_server_default,
        batch_claims_take_over_expired_markers_once_server_default;
    PG_REPEATABLE_READ => batch_unit_duplicates_take_no_lock_repeatable_read_default,
        batch_claims_take_over_expired_markers_once_repeatable_read_default;
    PG_SERIALIZABLE => batch_unit_duplicates_take_no_lock_serializable_default,
        batch_claims_take_over_expired_markers_once_serializable_default;
}

/// Counts, in its own transaction (the batch's), the sequential scans of
/// the marker table so far.
#[idempotent(key = "msg.id", store = &svc.0, scope = "batch.plan.probe")]
async fn seq_scans_so_far(svc: &PgSvc, msg: &Msg, tx: &mut sqlx::PgConnection) -> Result<i64, AppError> {
    let _ = msg;
    let scans: i64 = sqlx::query_scalar("SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = to_regclass($1)")
        .bind(svc.0.table().to_string())
        .fetch_one(&mut *tx)
        .await?;
    Ok(scans)
}

/// A batch looks its keys up in the marker table's primary key, however
/// the table has grown since its statements were prepared: PostgreSQL
/// plans a prepared statement once for good after five runs, and a plan
/// made while the table was small hashed the whole table for every batch
/// (measured: 80 ms a batch at 200 000 markers, the end-to-end benchmark's
/// batches falling to a third of a consumer without idempotency). Both of
/// the batch's statements run here: the claim, and the read of the
/// duplicates' stored results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_probes_its_keys_whatever_the_table_grew_to_since_its_statements_were_planned() {
    // One connection: every batch runs the same prepared statements.
    let (store, other, effects, ()) = pg_setup_on(common::pg_pool(1).await).await;
    let (pool, markers) = (store.pool().clone(), store.table().to_string());
    let svc: PgSvc = std::sync::Arc::new((store.clone(), effects.clone(), AtomicU64::new(0)));

    // Batches of 32: 16 new keys whose duplicates read nothing back (the
    // claim's guard looks each up), 16 duplicates whose stored results are
    // read (from the second batch on).
    let run = |round: usize, probe: Option<Msg>| {
        let svc = std::sync::Arc::clone(&svc);
        let store = store.clone();
        async move {
            let units: Vec<Msg> = (0..16).map(|i| msg(&format!("u{round}-{i}"), 1)).collect();
            let values: Vec<Msg> = (0..16).map(|i| msg(&format!("v{i}"), i)).collect();
            let mut calls: Vec<_> = units
                .iter()
                .map(|m| pay_unit(&svc, m).map(|r| r.map(|()| -1)).boxed())
                .collect();
            calls.extend(values.iter().map(|m| pay_value(&svc, m).boxed()));
            calls.extend(probe.iter().map(|m| seq_scans_so_far(&svc, m).boxed()));
            let batch = store.begin_batch().await.unwrap();
            let outcomes = batch.run_all(calls).await;
            batch.commit().await.unwrap();
            let results: Vec<i64> = outcomes.into_iter().map(Result::unwrap).collect();
            assert_eq!(results[16..32], (0..16).collect::<Vec<i64>>());
            results.get(32).copied()
        }
    };
    for round in 0..8 {
        run(round, None).await;
    }
    let fill = format!(
        "INSERT INTO {markers} (scope, message_id, expires_at) \
         SELECT 'batch.plan.fill', 'f' || g, now() + interval '1 hour' FROM generate_series(1, 20000) g"
    );
    sqlx::query(sqlx::AssertSqlSafe(fill)).execute(&pool).await.unwrap();
    // The connection's counts so far go to the server's totals: the
    // transaction's own view then counts only the batch's scans.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&pool)
        .await
        .unwrap();
    let scans = run(8, Some(msg("probe", 0))).await;
    assert_eq!(
        scans,
        Some(0),
        "the batch's claim and read scanned the whole marker table instead of probing its primary key"
    );
    assert_eq!(svc.2.load(Ordering::SeqCst), 16 * 9 + 16, "each body ran once");
    pg_teardown(&store, &other, &effects, ()).await;
}

// ---- a batch whose transaction InnoDB rolled back (issue #43, hole 1) ----

/// A batch member's handler becomes a deadlock victim and swallows the
/// error (a best-effort statistics update), returning `Ok`: InnoDB rolled
/// the whole batch's transaction back (every member's marker and effect)
/// and the session went on in autocommit. The batch must not report a
/// commit: `commit` is `Err(BatchAborted)` with nothing of any member
/// committed, and the members then run alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_batch_whose_transaction_a_deadlock_rolled_back_reports_no_commit() {
    struct Svc {
        store: idempotent_runtime::MySqlStore,
        effects: String,
        stats: String,
        go: tokio::sync::Notify,
        swallowed: std::sync::Mutex<Vec<String>>,
    }
    impl Svc {
        #[idempotent(key = "msg.id", store = self.store, scope = "batch.deadlock")]
        async fn pay(&self, msg: &Msg, fight: bool, tx: &mut sqlx::MySqlConnection) -> Result<(), AppError> {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (message_id, amount) VALUES (?, ?)",
                self.effects
            )))
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
            if !fight {
                return Ok(());
            }
            let bump = format!("UPDATE {} SET n = n + 1 WHERE id = ?", self.stats);
            let first = sqlx::query(sqlx::AssertSqlSafe(bump.clone()))
                .bind(1)
                .execute(&mut *tx)
                .await;
            self.go.notify_one();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let second = sqlx::query(sqlx::AssertSqlSafe(bump)).bind(2).execute(&mut *tx).await;
            // Best effort: the statistics' errors are not the message's.
            for outcome in [first, second] {
                if let Err(error) = outcome {
                    self.swallowed.lock().unwrap().push(error.to_string());
                }
            }
            Ok(())
        }
    }
    let (store, other, effects, keep) = mysql_setup().await;
    let (stats, filler) = (common::unique("batch_s"), common::unique("batch_f"));
    for ddl in [
        format!("CREATE TABLE {stats} (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE=InnoDB"),
        format!("INSERT INTO {stats} VALUES (1, 0), (2, 0)"),
        format!("CREATE TABLE {filler} (id INT PRIMARY KEY, v BIGINT NOT NULL) ENGINE=InnoDB"),
        format!("INSERT INTO {filler} SELECT seq, 0 FROM seq_1_to_500"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(store.pool())
            .await
            .unwrap();
    }
    let svc = std::sync::Arc::new(Svc {
        store,
        effects,
        stats: stats.clone(),
        go: tokio::sync::Notify::new(),
        swallowed: std::sync::Mutex::default(),
    });
    // The opponent: heavier than the batch (InnoDB rolls the lighter back),
    // holding the second statistics row, then asking for the first.
    let mut opponent = svc.store.pool().begin().await.unwrap();
    for sql in [
        format!("UPDATE {filler} SET v = v + 1"),
        format!("UPDATE {stats} SET n = n + 1 WHERE id = 2"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut *opponent)
            .await
            .unwrap();
    }
    let opponent = {
        let (svc, first) = (
            std::sync::Arc::clone(&svc),
            format!("UPDATE {stats} SET n = n + 1 WHERE id = 1"),
        );
        tokio::spawn(async move {
            svc.go.notified().await;
            sqlx::query(sqlx::AssertSqlSafe(first))
                .execute(&mut *opponent)
                .await
                .unwrap();
            opponent.rollback().await.unwrap();
        })
    };

    let (innocent, victim, after) = (common::unique("in"), common::unique("vi"), common::unique("af"));
    let batch = svc.store.begin_batch().await.unwrap();
    let first = batch.run(svc.pay(&msg(&innocent, 1), false)).await;
    let second = batch.run(svc.pay(&msg(&victim, 2), true)).await;
    let third = batch.run(svc.pay(&msg(&after, 3), false)).await;
    opponent.await.unwrap();
    let swallowed = svc.swallowed.lock().unwrap().clone();
    assert!(
        swallowed.len() == 1 && swallowed[0].contains("1213"),
        "the batch was the deadlock's victim: {swallowed:?}"
    );
    assert!(first.is_ok(), "{first:?}");
    assert!(second.is_ok(), "the handler swallowed the deadlock: {second:?}");
    assert!(
        third.is_err(),
        "a member after the rollback does not run in autocommit: {third:?}"
    );
    let committed = batch.commit().await;
    assert!(matches!(committed, Err(Error::BatchAborted)), "{committed:?}");
    let count = |sql: String| async {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(svc.store.pool())
            .await
            .unwrap();
        n
    };
    let table = svc.store.table().to_string();
    for id in [&innocent, &victim, &after] {
        let effects = count(format!(
            "SELECT COUNT(*) FROM {} WHERE message_id = '{id}'",
            svc.effects
        ))
        .await;
        assert_eq!(effects, 0, "{id}: no effect");
        let markers = count(format!("SELECT COUNT(*) FROM {table} WHERE message_id = '{id}'")).await;
        assert_eq!(markers, 0, "{id}: no marker");
    }
    // The rerun, one per transaction.
    for (id, amount) in [(&innocent, 1), (&victim, 2), (&after, 3)] {
        svc.pay(&msg(id, amount), false).await.unwrap();
        let effects = count(format!(
            "SELECT COUNT(*) FROM {} WHERE message_id = '{id}'",
            svc.effects
        ))
        .await;
        assert_eq!(effects, 1, "{id}");
    }
    let svc = std::sync::Arc::into_inner(svc).unwrap();
    for table in [stats, filler] {
        common::drop_mysql_table(svc.store.pool(), &table).await;
    }
    mysql_teardown(&svc.store, &other, &svc.effects, keep).await;
}
