//! Retention at scale (issue 13, part 3): `PgStore`'s plain marker table,
//! purged by batched `DELETE`, against the partitioned layout
//! (`.partitioned(1 day)`, or `--period-days=N`), whose janitor drops whole
//! expired partitions.
//!
//! ```text
//! cargo bench --bench retention                                 # 10 M markers per layout
//! cargo bench --bench retention -- --markers=1000000 --secs=5   # quicker
//! cargo bench --bench retention -- --period-days=7              # weekly partitions
//! ```
//!
//! On PostgreSQL (postgres://postgres@127.0.0.1:5432/test), each layout in
//! its own table:
//!
//! 1. fill: `--markers` markers per layout with `INSERT .. SELECT
//!    generate_series`, half of them expired (expiries spread over the two
//!    periods before the current one: for daily partitions the two days
//!    before today, UTC) and half live (expiring within the next 6 days and
//!    an hour); `VACUUM ANALYZE`;
//! 2. claim throughput: fresh claims/s with 8 concurrent callers (claim,
//!    store a result, commit), `--secs` seconds per layout, the layouts
//!    interleaved over 3 rounds so load from other processes hits both;
//! 3. purge: `PgStore::purge_expired` on each (the janitor's call): time,
//!    markers removed, WAL written (`pg_current_wal_lsn` before and after:
//!    server-wide, so it includes other sessions' writes) and the table's
//!    size before and after;
//! 4. claim throughput again, one round each, after the purge.
//!
//! Prints markdown tables; the tables are dropped at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::PgStore;
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgPool};
use idempotent_runtime::store::{Claim, Guard, Request, Store};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const CALLERS: usize = 8;
const DAY: u64 = 86_400;

struct Layout {
    name: String,
    store: PgStore,
    partitioned: bool,
    /// Seconds per partition (also what the expired half is spread over).
    period: i64,
}

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let prefix = format!("--{name}=");
    std::env::args()
        .find_map(|arg| arg.strip_prefix(&prefix).map(str::to_owned))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn layout(pool: &PgPool, partitioned: bool, period_days: u64) -> Layout {
    let (name, table) = if partitioned {
        (
            format!("partitioned ({period_days} d)"),
            format!("bench_retention_part_{}", std::process::id()),
        )
    } else {
        (
            "DELETE (plain table)".to_owned(),
            format!("bench_retention_plain_{}", std::process::id()),
        )
    };
    sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS \"{table}\"")))
        .execute(pool)
        .await
        .expect("drop");
    let mut builder = PgStore::builder(pool.clone()).table(&table);
    if partitioned {
        builder = builder.partitioned(Duration::from_secs(period_days * DAY));
    }
    let store = builder.build().expect("store");
    store.migrate().await.expect("migrate");
    Layout {
        name,
        store,
        partitioned,
        period: (period_days * DAY) as i64,
    }
}

/// `markers` markers, half expired over the two periods before the current
/// one (UTC), half live over the next 6 days.
async fn fill(layout: &Layout, markers: u64) {
    let pool = layout.store.pool();
    let t = layout.store.table().quoted('"');
    let p = layout.period;
    if layout.partitioned {
        // The two past periods' partitions, named as the store names them,
        // so its janitor finds and drops them.
        for periods_ago in 1..=2i64 {
            let (lower, suffix): (i64, String) = sqlx::query_as(
                "SELECT extract(epoch FROM d)::bigint, to_char(d AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISS') \
                 FROM (SELECT to_timestamp((floor(extract(epoch FROM now()) / $2)::bigint - $1) * $2) AS d) x",
            )
            .bind(periods_ago)
            .bind(p)
            .fetch_one(pool)
            .await
            .expect("bounds");
            let child = format!("\"{}_{suffix}\"", layout.store.table().table());
            sqlx::query(AssertSqlSafe(format!(
                "CREATE TABLE IF NOT EXISTS {child} PARTITION OF {t} FOR VALUES FROM (to_timestamp({lower})) \
                 TO (to_timestamp({}))",
                lower + p
            )))
            .execute(pool)
            .await
            .expect("past partition");
        }
    }
    let half = markers / 2;
    let expired = format!(
        "INSERT INTO {t} (scope, message_id, processed_at, expires_at, fingerprint, result) \
         SELECT 'bench', 'old-' || i, m - interval '9 days', \
                m + (i::float8 / $1) * interval '{span} seconds', NULL, '{{\"ok\":true}}' \
         FROM generate_series(0, $1 - 1) AS i, \
              (SELECT to_timestamp((floor(extract(epoch FROM now()) / {p})::bigint - 2) * {p}) AS m) x",
        span = 2 * p - 1
    );
    let live = format!(
        "INSERT INTO {t} (scope, message_id, processed_at, expires_at, fingerprint, result) \
         SELECT 'bench', 'live-' || i, now(), now() + interval '1 hour' + (i::float8 / $1) * interval '6 days', \
                NULL, '{{\"ok\":true}}' \
         FROM generate_series(0, $1 - 1) AS i"
    );
    for statement in [expired, live] {
        sqlx::query(AssertSqlSafe(statement))
            .bind(half as i64)
            .execute(pool)
            .await
            .expect("fill");
    }
    sqlx::query(AssertSqlSafe(format!("VACUUM ANALYZE {t}")))
        .execute(pool)
        .await
        .expect("vacuum");
}

/// Fresh claims per second with `CALLERS` concurrent callers for `secs`.
async fn claims(store: &PgStore, secs: u64, run: &str) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let (store, done, run) = (store.clone(), Arc::clone(&done), run.to_owned());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let key = format!("fresh-{run}-{caller}-{n}");
                    n += 1;
                    let req = Request::new("bench", &key).expect("key");
                    match store.claim(&req).await.expect("claim") {
                        Claim::Fresh(guard) => guard.complete(Some("{\"ok\":true}".into())).await.expect("commit"),
                        Claim::Done(_) => panic!("{key} was not fresh"),
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("caller");
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Bytes of the marker table with its indexes (all partitions).
async fn size(layout: &Layout) -> i64 {
    let t = layout.store.table().quoted('"');
    sqlx::query_scalar(
        "SELECT CASE WHEN c.relkind = 'p' \
           THEN (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree(c.oid)) \
           ELSE pg_total_relation_size(c.oid) END::bigint \
         FROM pg_class c WHERE c.oid = to_regclass($1)",
    )
    .bind(t)
    .fetch_one(layout.store.pool())
    .await
    .expect("size")
}

struct Purge {
    elapsed: Duration,
    markers: u64,
    wal: i64,
    before: i64,
    after: i64,
}

async fn purge(layout: &Layout) -> Purge {
    let pool = layout.store.pool();
    let before = size(layout).await;
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
        .expect("lsn");
    let start = Instant::now();
    let markers = layout.store.purge_expired().await.expect("purge");
    let elapsed = start.elapsed();
    let wal: i64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
        .bind(lsn)
        .fetch_one(pool)
        .await
        .expect("wal");
    Purge {
        elapsed,
        markers,
        wal,
        before,
        after: size(layout).await,
    }
}

fn mb(bytes: i64) -> String {
    format!("{:.0}", bytes as f64 / 1_048_576.0)
}

#[tokio::main]
async fn main() {
    let markers: u64 = arg("markers", 10_000_000);
    let period_days: u64 = arg("period-days", 1);
    let secs: u64 = arg("secs", 10);
    let pool = PgPoolOptions::new()
        .max_connections(CALLERS as u32 + 2)
        .connect(PG_URL)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432");
    let layouts = [
        layout(&pool, false, period_days).await,
        layout(&pool, true, period_days).await,
    ];
    println!("retention: {markers} markers per layout (half expired), {CALLERS} callers, {secs} s per claim run\n");
    for layout in &layouts {
        let start = Instant::now();
        fill(layout, markers).await;
        println!(
            "filled {}: {:.0} s, {} MB",
            layout.name,
            start.elapsed().as_secs_f64(),
            mb(size(layout).await)
        );
    }

    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..3 {
        for (i, layout) in layouts.iter().enumerate() {
            rates[i].push(claims(&layout.store, secs, &format!("r{round}")).await);
        }
    }
    println!("\nfresh claims/s, {CALLERS} callers, interleaved rounds:\n");
    println!("| layout | round 1 | round 2 | round 3 | median |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let mut medians = [0.0; 2];
    for (i, layout) in layouts.iter().enumerate() {
        let mut sorted = rates[i].clone();
        sorted.sort_by(f64::total_cmp);
        medians[i] = sorted[1];
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} |",
            layout.name, rates[i][0], rates[i][1], rates[i][2], medians[i]
        );
    }
    println!(
        "\npartitioned / DELETE claim throughput: {:.2}",
        medians[1] / medians[0]
    );

    println!("\npurge of the expired half (`purge_expired`):\n");
    println!("| layout | time s | markers removed | WAL MB | table MB before | after |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let mut purges = Vec::new();
    for layout in &layouts {
        let p = purge(layout).await;
        println!(
            "| {} | {:.2} | {} | {} | {} | {} |",
            layout.name,
            p.elapsed.as_secs_f64(),
            p.markers,
            mb(p.wal),
            mb(p.before),
            mb(p.after)
        );
        purges.push(p);
    }
    println!(
        "\nDELETE / partitioned purge time: {:.0}x, WAL: {:.0}x",
        purges[0].elapsed.as_secs_f64() / purges[1].elapsed.as_secs_f64().max(1e-6),
        purges[0].wal as f64 / (purges[1].wal.max(1) as f64)
    );

    println!("\nfresh claims/s after the purge:\n");
    println!("| layout | claims/s |");
    println!("| --- | ---: |");
    for layout in &layouts {
        println!(
            "| {} | {:.0} |",
            layout.name,
            claims(&layout.store, secs, "after").await
        );
    }
    for layout in &layouts {
        sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE {}",
            layout.store.table().quoted('"')
        )))
        .execute(&pool)
        .await
        .expect("drop");
    }
}
