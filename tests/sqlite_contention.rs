//! SQLite has one writer at a time. Several independent stores (separate
//! pools, as separate processes would have) hammering one database file
//! must never surface `SQLITE_BUSY`: the claim queues in-process and
//! retries across pools.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_runtime::sqlx::{self, SqliteConnection};
use idempotent_runtime::{SqliteStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "id", store = store)]
async fn apply(store: &SqliteStore, id: u32, tx: &mut SqliteConnection) -> Result<(), AppError> {
    sqlx::query("INSERT INTO effects (id) VALUES (?1)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    // Hold the write lock a little, as a real effect would.
    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn independent_stores_on_one_file_never_leak_sqlite_busy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.db");
    let first = SqliteStore::open(&path).await.unwrap();
    first.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id INTEGER NOT NULL)")
        .execute(first.pool())
        .await
        .unwrap();
    let mut stores = vec![first];
    for _ in 0..3 {
        stores.push(SqliteStore::open(&path).await.unwrap());
    }

    let failures = Arc::new(AtomicU32::new(0));
    let mut calls = Vec::new();
    for round in 0..3 {
        for id in 0..100u32 {
            let store = stores[(id as usize + round) % stores.len()].clone();
            let failures = Arc::clone(&failures);
            calls.push(tokio::spawn(async move {
                if let Err(error) = apply(&store, id).await {
                    eprintln!("{error}");
                    failures.fetch_add(1, Ordering::SeqCst);
                }
            }));
        }
    }
    for call in calls {
        call.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::SeqCst), 0, "no call failed (no SQLITE_BUSY)");
    let (rows, distinct): (i64, i64) = sqlx::query_as("SELECT count(*), count(DISTINCT id) FROM effects")
        .fetch_one(stores[0].pool())
        .await
        .unwrap();
    assert_eq!((rows, distinct), (100, 100), "each effect once");
}

/// With the busy timeout off, every lock conflict reaches the store as
/// `SQLITE_BUSY` at `BEGIN IMMEDIATE`: the store's own retry absorbs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_is_retried_even_without_a_busy_timeout() {
    use idempotent_runtime::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("nowait.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::ZERO);
    let mut stores = Vec::new();
    for _ in 0..4 {
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options.clone())
            .await
            .unwrap();
        stores.push(SqliteStore::new(pool));
    }
    stores[0].migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id INTEGER NOT NULL)")
        .execute(stores[0].pool())
        .await
        .unwrap();

    let calls: Vec<_> = (0..200u32)
        .map(|id| {
            let store = stores[id as usize % 4].clone();
            tokio::spawn(async move { apply(&store, id / 2).await })
        })
        .collect();
    for call in calls {
        call.await.unwrap().expect("no SQLITE_BUSY reached the caller");
    }
    let (rows, distinct): (i64, i64) = sqlx::query_as("SELECT count(*), count(DISTINCT id) FROM effects")
        .fetch_one(stores[0].pool())
        .await
        .unwrap();
    assert_eq!((rows, distinct), (100, 100));
}
