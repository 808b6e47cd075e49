//! PostgreSQL's partitioned marker layout (`PgStore::builder(..)
//! .partitioned(period)`) beyond the conformance suite: the janitor creating
//! upcoming partitions and dropping expired ones while live markers stay,
//! claims beyond the horizon creating their partition, duplicates meeting
//! across a partition boundary, and the layout checks of `migrate`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::sqlx::{self, PgPool};
use idempotent_runtime::store::{Claim, Guard, Request, Store};
use idempotent_runtime::{Error, Janitor, PgStore};

const SECOND: Duration = Duration::from_secs(1);

async fn partitioned_store(pool: PgPool, horizon: Duration) -> (PgStore, String) {
    let table = common::unique("part");
    let store = PgStore::builder(pool)
        .table(&table)
        .partitioned(SECOND)
        .partition_horizon(horizon)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    (store, table)
}

/// The partitions of `table`: (name, seconds from the database's now to
/// their upper bound).
async fn partitions(pool: &PgPool, table: &str) -> Vec<(String, f64)> {
    sqlx::query_as(
        "SELECT c.relname::text, extract(epoch FROM substring(pg_get_expr(c.relpartbound, c.oid) \
           FROM 'TO \\(''([^'']*)''\\)')::timestamptz - now())::float8 \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1) ORDER BY 2",
    )
    .bind(format!("\"{table}\""))
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn markers(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM \"{table}\"")))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Claims `key` and commits it with `result`; panics if it was not fresh.
async fn process(store: &PgStore, key: &str, ttl: Duration, result: &str) {
    let req = Request::new("part", key).unwrap().with_ttl(ttl);
    match store.claim(&req).await.unwrap() {
        Claim::Fresh(guard) => guard.complete(Some(result.to_owned())).await.unwrap(),
        Claim::Done(_) => panic!("{key} was already processed"),
    }
}

/// The result a duplicate of `key` replays; panics if the claim was fresh.
async fn replayed(store: &PgStore, key: &str, ttl: Duration) -> Option<String> {
    let req = Request::new("part", key).unwrap().with_ttl(ttl);
    match store.claim(&req).await.unwrap() {
        Claim::Done(replay) => replay.json().map(str::to_owned),
        Claim::Fresh(_) => panic!("{key} ran a second time"),
    }
}

#[tokio::test]
async fn migrate_creates_the_partitions_up_to_the_horizon() {
    let pool = common::pg_pool(4).await;
    let (_store, table) = partitioned_store(pool.clone(), Duration::from_secs(4)).await;
    let parts = partitions(&pool, &table).await;
    // One per second from now to now + 4 s: 5 (or 6 when a second boundary
    // passed between the bounds' computation and this query).
    assert!((5..=6).contains(&parts.len()), "{parts:?}");
    assert!(
        parts.iter().all(|(name, _)| name.starts_with(&format!("{table}_"))),
        "{parts:?}"
    );
    assert!(
        parts.last().unwrap().1 >= 4.0,
        "the last one covers now + 4 s: {parts:?}"
    );
    common::drop_pg_table(&pool, &table).await;
}

#[tokio::test]
async fn janitor_creates_upcoming_partitions_and_drops_expired_ones_keeping_live_markers() {
    let pool = common::pg_pool(4).await;
    let (store, table) = partitioned_store(pool.clone(), Duration::from_secs(3)).await;
    for i in 0..5 {
        process(&store, &format!("short-{i}"), Duration::from_millis(500), "short").await;
    }
    for i in 0..3 {
        process(&store, &format!("live-{i}"), Duration::from_secs(3600), "live").await;
    }
    assert_eq!(markers(&pool, &table).await, 8);
    let janitor = Janitor::spawn(store.clone(), Duration::from_millis(200)).unwrap();
    // The short markers' partitions end within 2 s; give a loaded machine
    // time to run the janitor after that.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while markers(&pool, &table).await > 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expired partitions were not dropped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let parts = partitions(&pool, &table).await;
    janitor.shutdown().await;
    assert!(
        parts.iter().all(|(_, upper)| *upper > -1.0),
        "no partition stays long after its end: {parts:?}"
    );
    assert!(
        parts.iter().any(|(_, upper)| *upper >= 3.0),
        "the janitor keeps creating partitions up to the horizon: {parts:?}"
    );
    assert!(
        parts.iter().any(|(_, upper)| *upper >= 3500.0),
        "the live markers' partition stays"
    );
    assert_eq!(markers(&pool, &table).await, 3, "the live markers stay");
    for i in 0..3 {
        assert_eq!(
            replayed(&store, &format!("live-{i}"), Duration::from_secs(3600))
                .await
                .as_deref(),
            Some("live")
        );
    }
    // An expired key whose marker went with its partition is processed again.
    process(&store, "short-0", Duration::from_secs(60), "again").await;
    common::drop_pg_table(&pool, &table).await;
}

#[tokio::test]
async fn purge_counts_the_markers_of_the_dropped_partitions() {
    let pool = common::pg_pool(4).await;
    let (store, table) = partitioned_store(pool.clone(), Duration::from_secs(3)).await;
    for i in 0..4 {
        process(&store, &format!("old-{i}"), Duration::from_millis(100), "old").await;
    }
    process(&store, "live", Duration::from_secs(600), "live").await;
    // The expired markers' partitions (upper bound at most 1.1 s ahead).
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert_eq!(store.purge_expired().await.unwrap(), 4);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    assert_eq!(markers(&pool, &table).await, 1);
    common::drop_pg_table(&pool, &table).await;
}

#[tokio::test]
async fn a_claim_beyond_the_horizon_creates_its_partition() {
    let pool = common::pg_pool(4).await;
    let (store, table) = partitioned_store(pool.clone(), Duration::from_secs(2)).await;
    let before = partitions(&pool, &table).await.len();
    process(&store, "far", Duration::from_secs(24 * 3600), "far").await;
    let parts = partitions(&pool, &table).await;
    assert!(parts.len() > before, "{parts:?}");
    assert!(parts.iter().any(|(_, upper)| *upper > 24.0 * 3600.0), "{parts:?}");
    assert_eq!(
        replayed(&store, "far", Duration::from_secs(24 * 3600)).await.as_deref(),
        Some("far")
    );
    common::drop_pg_table(&pool, &table).await;
}

/// The first claim holds its transaction open while duplicates arrive over
/// 1.5 s, so their own expiries fall in later partitions than the first
/// marker's: each must wait for the first claim and replay its result, not
/// insert a second marker into its own partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_across_a_partition_boundary_wait_and_replay() {
    let pool = common::pg_pool(12).await;
    let (store, table) = partitioned_store(pool.clone(), Duration::from_secs(5)).await;
    let ttl = Duration::from_secs(4);
    let req = Request::new("part", "boundary").unwrap().with_ttl(ttl);
    let Claim::Fresh(guard) = store.claim(&req).await.unwrap() else {
        panic!("the first claim is fresh")
    };
    let second = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT floor(extract(epoch FROM clock_timestamp()))::bigint")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let first_second = second(pool.clone()).await;
    let mut duplicates = Vec::new();
    for _ in 0..7 {
        let store = store.clone();
        duplicates.push(tokio::spawn(async move { replayed(&store, "boundary", ttl).await }));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        second(pool.clone()).await > first_second,
        "the duplicates spanned a partition boundary"
    );
    guard.complete(Some("first".into())).await.unwrap();
    for duplicate in duplicates {
        assert_eq!(duplicate.await.unwrap().as_deref(), Some("first"));
    }
    assert_eq!(markers(&pool, &table).await, 1, "one marker for the key");
    common::drop_pg_table(&pool, &table).await;
}

/// Concurrent first deliveries of a key, started together just before a
/// partition boundary: exactly one is fresh, the others replay its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_racing_a_partition_boundary_run_once() {
    let pool = common::pg_pool(20).await;
    let (store, table) = partitioned_store(pool.clone(), Duration::from_secs(5)).await;
    let ttl = Duration::from_millis(1500);
    for round in 0..4 {
        // Start about 20 ms before the next second of the database clock.
        let to_next: f64 = sqlx::query_scalar(
            "SELECT 1 - (extract(epoch FROM clock_timestamp()) - floor(extract(epoch FROM clock_timestamp())))::float8",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_secs_f64((to_next - 0.02).max(0.0))).await;
        let key = format!("race-{round}");
        let start = Arc::new(tokio::sync::Barrier::new(12));
        let calls: Vec<_> = (0..12)
            .map(|i| {
                let (store, key, start) = (store.clone(), key.clone(), Arc::clone(&start));
                tokio::spawn(async move {
                    start.wait().await;
                    let req = Request::new("part", &key).unwrap().with_ttl(ttl);
                    match store.claim(&req).await.unwrap() {
                        Claim::Fresh(guard) => {
                            tokio::time::sleep(Duration::from_millis(30)).await;
                            guard.complete(Some(format!("run {i}"))).await.unwrap();
                            (true, format!("run {i}"))
                        }
                        Claim::Done(replay) => (false, replay.json().unwrap_or_default().to_owned()),
                    }
                })
            })
            .collect();
        let outcomes: Vec<(bool, String)> = futures_util::future::join_all(calls)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let fresh: Vec<_> = outcomes.iter().filter(|(fresh, _)| *fresh).collect();
        assert_eq!(fresh.len(), 1, "round {round}: {outcomes:?}");
        assert!(
            outcomes.iter().all(|(_, result)| *result == fresh[0].1),
            "round {round}: every duplicate replays the one run: {outcomes:?}"
        );
    }
    common::drop_pg_table(&pool, &table).await;
}

#[tokio::test]
async fn migrate_refuses_a_table_of_the_other_layout_or_period() {
    let pool = common::pg_pool(4).await;
    let plain_table = common::unique("plain");
    let plain = PgStore::builder(pool.clone()).table(&plain_table).build().unwrap();
    plain.migrate().await.unwrap();
    let on_plain = PgStore::builder(pool.clone())
        .table(&plain_table)
        .partitioned(SECOND)
        .partition_horizon(SECOND)
        .build()
        .unwrap();
    let err = on_plain.migrate().await.unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("not partitioned")),
        "{err}"
    );

    let (_part, part_table) = partitioned_store(pool.clone(), Duration::from_secs(2)).await;
    let unpartitioned = PgStore::builder(pool.clone()).table(&part_table).build().unwrap();
    let err = unpartitioned.migrate().await.unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("is partitioned")),
        "{err}"
    );
    let other_period = PgStore::builder(pool.clone())
        .table(&part_table)
        .partitioned(Duration::from_secs(60))
        .build()
        .unwrap();
    let err = other_period.migrate().await.unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m.contains("every 1 s")), "{err}");

    let err = PgStore::builder(pool.clone())
        .partition_horizon(SECOND)
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("partitioned(period)")),
        "{err}"
    );
    common::drop_pg_table(&pool, &plain_table).await;
    common::drop_pg_table(&pool, &part_table).await;
}

/// Claims beyond the horizon that need the same new partition, all at once,
/// on sessions defaulting to Repeatable Read, after concurrent migrations:
/// one creates it, the others see it once they get the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_and_partition_creations_do_not_collide() {
    let pool = common::pg_pool_with(20, common::settings::PG_REPEATABLE_READ).await;
    let table = common::unique("partrr");
    let store = PgStore::builder(pool.clone())
        .table(&table)
        .partitioned(SECOND)
        .partition_horizon(Duration::from_secs(2))
        .build()
        .unwrap();
    let migrations: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for migration in futures_util::future::join_all(migrations).await {
        migration.unwrap().unwrap();
    }
    let start = Arc::new(tokio::sync::Barrier::new(12));
    let claims: Vec<_> = (0..12)
        .map(|i| {
            let (store, start) = (store.clone(), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                process(&store, &format!("far-{i}"), Duration::from_secs(3600), "far").await;
            })
        })
        .collect();
    for claim in futures_util::future::join_all(claims).await {
        claim.unwrap();
    }
    assert_eq!(markers(&pool, &table).await, 12);
    common::drop_pg_table(&pool, &table).await;
}
