//! Database faults: the connection killed mid-transaction, and a pool whose
//! connections are all dropped by the server.

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
