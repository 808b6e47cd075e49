//! Expiry operations: `purge_expired` in bounded batches, the janitor task,
//! and expiry decided by the database clock.

mod common;

use std::time::Duration;

use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::store::{Claim, Guard, Request, Store};
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
