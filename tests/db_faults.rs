//! Database faults: the connection killed mid-transaction, a pool whose
//! connections are all dropped by the server, and transactions abandoned
//! mid-statement (a pool of one must keep its connection).

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use tokio::sync::{Mutex, oneshot};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

struct Consumer {
    store: PgStore,
    payments: String,
    /// When set, the body reports its backend pid here and waits for the
    /// test to kill that backend before writing its second row.
    killer: Mutex<Option<(oneshot::Sender<i32>, oneshot::Receiver<()>)>>,
}

impl Consumer {
    #[idempotent(key = "message_id", store = self.store)]
    async fn pay(&self, message_id: &str, tx: &mut PgConnection) -> Result<(), AppError> {
        let insert = format!("INSERT INTO {} (message_id) VALUES ($1)", self.payments);
        sqlx::query(AssertSqlSafe(insert.clone()))
            .bind(message_id)
            .execute(&mut *tx)
            .await?;
        if let Some((report, killed)) = self.killer.lock().await.take() {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await?;
            report.send(pid).unwrap();
            killed.await.unwrap();
        }
        sqlx::query(AssertSqlSafe(insert))
            .bind(format!("{message_id}/second-row"))
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

async fn setup() -> (Arc<Consumer>, PgPool, String, String) {
    let (markers, payments) = (common::unique("fault_markers"), common::unique("fault_payments"));
    // Named after its table, so a test can find (and kill) its connections.
    let options: sqlx::postgres::PgConnectOptions = common::PG_URL.parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&markers))
        .await
        .unwrap();
    let store = PgStore::builder(pool.clone()).table(&markers).build().unwrap();
    store.migrate().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {payments} (message_id TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let consumer = Arc::new(Consumer {
        store,
        payments: payments.clone(),
        killer: Mutex::new(None),
    });
    (consumer, pool, markers, payments)
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn connection_terminated_mid_transaction_leaves_nothing_and_the_redelivery_succeeds() {
    let (consumer, pool, markers, payments) = setup().await;
    let (report, pid) = oneshot::channel();
    let (killed, wait_killed) = oneshot::channel();
    *consumer.killer.lock().await = Some((report, wait_killed));

    let c = Arc::clone(&consumer);
    let call = tokio::spawn(async move { c.pay("m-1").await });
    let pid = pid.await.unwrap();
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(terminated);
    tokio::time::sleep(Duration::from_millis(100)).await;
    killed.send(()).unwrap();

    let err = call.await.unwrap().unwrap_err();
    assert!(matches!(err, AppError::Db(_) | AppError::Idem(_)), "{err:?}");
    assert_eq!(count(&pool, &payments).await, 0, "no partial effect");
    assert_eq!(count(&pool, &markers).await, 0, "no marker");

    consumer
        .pay("m-1")
        .await
        .expect("the redelivery succeeds on a fresh connection");
    assert_eq!(count(&pool, &payments).await, 2, "both rows of the one effect");
    consumer.pay("m-1").await.unwrap();
    assert_eq!(
        count(&pool, &payments).await,
        2,
        "and the duplicate after it is skipped"
    );
    common::drop_pg_table(&pool, &markers).await;
    common::drop_pg_table(&pool, &payments).await;
}

#[tokio::test]
async fn store_keeps_working_when_the_server_drops_all_its_connections() {
    let (consumer, pool, markers, payments) = setup().await;
    for i in 0..4 {
        consumer.pay(&format!("before-{i}")).await.unwrap();
    }
    // Kill every connection of the store's pool from a separate connection.
    let mut admin = <PgConnection as sqlx::Connection>::connect(common::PG_URL)
        .await
        .unwrap();
    let killed: i64 =
        sqlx::query_scalar("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1")
            .bind(&markers)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    assert!(killed >= 1, "the pool had open connections");
    tokio::time::sleep(Duration::from_millis(100)).await;

    // The pool notices dead connections (ping before acquire) and reconnects.
    for i in 0..4 {
        consumer.pay(&format!("after-{i}")).await.unwrap();
    }
    for i in 0..4 {
        consumer.pay(&format!("before-{i}")).await.unwrap(); // duplicates, still recognised
    }
    assert_eq!(count(&pool, &payments).await, 16);
    common::drop_pg_table(&pool, &markers).await;
    common::drop_pg_table(&pool, &payments).await;
}

/// A handler whose body runs many short statements, so that aborting its
/// task lands inside one of them most of the time.
struct Chatty {
    store: idempotent_runtime::MySqlStore,
    effects: String,
}

impl Chatty {
    #[idempotent(key = "message_id", store = self.store)]
    async fn work(&self, message_id: &str, tx: &mut sqlx::MySqlConnection) -> Result<(), AppError> {
        let insert = format!("INSERT INTO `{}` (message_id, n) VALUES (?, ?)", self.effects);
        for n in 0..20 {
            sqlx::query(AssertSqlSafe(insert.clone()))
                .bind(message_id)
                .bind(n)
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    }
}

/// The combination checker's "hung pool" (seed 4036 forced on MariaDB):
/// a task aborted while a statement of its transaction is on the wire can
/// leave sqlx a connection out of step with the server, whose ping at the
/// release never returns, so the pool's slot is never given back (sqlx
/// issue 4349). Before the fix a pool of one lost its connection after
/// about 600 aborts (within the first few when other tests ran beside it).
/// Now an abandoned connection that does not answer a ping in step is
/// closed and its slot returned, and `BEGIN` and `COMMIT` run to their end
/// in tasks of their own: after 3 000 aborts at random points the pool of
/// one still serves, and every message that committed has all of its
/// effect while the others have none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_abandoned_mid_statement_do_not_take_the_pools_connection() {
    use rand::Rng;

    let (markers, effects) = (common::unique("abandon_markers"), common::unique("abandon_effects"));
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect(common::MYSQL_URL)
        .await
        .expect("MariaDB at 127.0.0.1:3306");
    let store = idempotent_runtime::MySqlStore::builder(pool.clone())
        .table(&markers)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE `{effects}` (message_id VARCHAR(64) NOT NULL, n INT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let chatty = Arc::new(Chatty {
        store,
        effects: effects.clone(),
    });
    let mut rng = rand::rng();
    const ABORTS: usize = 3_000;
    for i in 0..ABORTS {
        let worker = Arc::clone(&chatty);
        let task = tokio::spawn(async move { worker.work(&format!("m{i}")).await });
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..3_000))).await;
        task.abort();
        let _ = task.await;
        // The abandoned connection is released in the background: a hung
        // one is replaced within the store's deadline (5 s ping, 10 s
        // connect), well inside this wait.
        if tokio::time::timeout(Duration::from_secs(25), pool.acquire())
            .await
            .is_err()
        {
            // What the server says its sessions do, for the diagnosis.
            use sqlx::Connection;
            let mut other = sqlx::MySqlConnection::connect(common::MYSQL_URL).await.unwrap();
            let sessions: Vec<(i64, String, Option<String>)> =
                sqlx::query_as("SELECT ID, COMMAND, INFO FROM information_schema.PROCESSLIST")
                    .fetch_all(&mut other)
                    .await
                    .unwrap();
            panic!(
                "after {i} aborted transactions the pool of one no longer gives its connection \
                 (server sessions: {sessions:?})"
            );
        }
    }
    // All or nothing per message, and a marker exactly for those with their
    // effect (the redelivery of the others would run them).
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, count(*) FROM `{effects}` GROUP BY message_id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let partial: Vec<_> = rows.iter().filter(|(_, n)| *n != 20).collect();
    assert!(partial.is_empty(), "messages with part of their effect: {partial:?}");
    let marked: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM `{markers}`")))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        marked,
        rows.len() as i64,
        "markers without effects or effects without markers"
    );
    common::drop_mysql_table(&pool, &effects).await;
    common::drop_mysql_table(&pool, &markers).await;
}

struct Sleeper {
    store: idempotent_runtime::MySqlStore,
}

impl Sleeper {
    #[idempotent(key = "message_id", store = self.store)]
    async fn work(&self, message_id: &str, tx: &mut sqlx::MySqlConnection) -> Result<(), AppError> {
        sqlx::query("SELECT SLEEP(60)").execute(&mut *tx).await?;
        Ok(())
    }
}

/// A transaction abandoned during a long statement: its connection cannot
/// answer until the statement ends, so the store gives it 5 s, then closes
/// it and lets the pool open a proper one (with the pool's `after_connect`,
/// which the test's hook marks), instead of holding the pool's slot for the
/// minute the statement would take.
#[tokio::test]
async fn a_transaction_abandoned_in_a_long_statement_frees_its_slot_within_seconds() {
    let markers = common::unique("sleeper_markers");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(40))
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                sqlx::query("SET @after_connect = 'ran'").execute(conn).await?;
                Ok(())
            })
        })
        .connect(common::MYSQL_URL)
        .await
        .expect("MariaDB at 127.0.0.1:3306");
    let store = idempotent_runtime::MySqlStore::builder(pool.clone())
        .table(&markers)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let sleeper = Arc::new(Sleeper { store });
    let worker = Arc::clone(&sleeper);
    let task = tokio::spawn(async move { worker.work("slow").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    task.abort();
    let _ = task.await;
    let started = std::time::Instant::now();
    let mut conn = pool.acquire().await.expect("the pool's one connection");
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(30),
        "the slot came back after {waited:?}: held until the statement ended"
    );
    let mark: Option<String> = sqlx::query_scalar("SELECT @after_connect")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(
        mark.as_deref(),
        Some("ran"),
        "the pool handed out a connection its after_connect never ran on"
    );
    drop(conn);
    common::drop_mysql_table(&pool, &markers).await;
}
