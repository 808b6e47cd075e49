//! What the end of a `PgStore` claim's transaction costs since every commit
//! forces `synchronous_commit` back on and checks that the body left the
//! transaction usable (issue 27, holes 3 and 5), side by side with the plain
//! `COMMIT` it replaced, in one run:
//!
//! - (p) `BEGIN`, one marker `INSERT`, `COMMIT` (sqlx's `Transaction::commit`);
//! - (p2) the same again: the A/A control, for the run's noise;
//! - (n) `BEGIN`, the same `INSERT`, then the store's end: one simple query
//!   `SELECT set_config('synchronous_commit', 'on', true) WHERE
//!   current_setting('synchronous_commit') = 'off'; COMMIT; BEGIN`, and the
//!   transaction dropped (its `ROLLBACK` goes out with the connection's
//!   release).
//!
//! - (q) the same check as a prepared statement of its own, then sqlx's
//!   plain `COMMIT` (the store's end since 2026-12-04, `CHECK_BEFORE_COMMIT`): one more round trip, no parsing, no trailing `BEGIN`
//!   and no `ROLLBACK` at the release;
//!
//! - (r) a prepared `SELECT 1` then sqlx's plain `COMMIT`: the abort check
//!   of hole 5 alone (an aborted transaction refuses any statement), so
//!   q/r is what forcing `synchronous_commit` adds to it (hole 3's own
//!   cost) and r/p what the abort check's round trip costs;
//!
//! - (o) the end the stores could have with their own transaction
//!   handling (no sqlx `Transaction`): `BEGIN` on a pool connection, the
//!   same `INSERT`, then `SELECT set_config(..) WHERE ..; COMMIT` in one
//!   simple query, and nothing at the release (no empty transaction to roll
//!   back); a connection left unfinished would be closed instead of
//!   released (`close_on_drop`), which never happens here.
//!
//! The rest of the claim's path did not change, so (n)/(p) is the change's
//! whole cost, and (o)/(p) what is left of it without the `BEGIN` and
//! `ROLLBACK` of the empty transaction. Interleaved repetitions at concurrency 1 and 8; the median
//! of each variant's rate and the ratio of medians are printed.
//!
//! `cargo bench --bench commit_end -- [reps] [seconds per run]`
//! (defaults 9 and 1.0).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgPool};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The store's end of a claim until 2026-12-04 (`COMMIT_DURABLE` was in
/// `idempotent-runtime/src/store/postgres/mod.rs`).
const COMMIT_DURABLE: &str = "SELECT set_config('synchronous_commit', 'on', true) \
     WHERE current_setting('synchronous_commit') = 'off'; COMMIT; BEGIN";

/// (o)'s end: the same checks, no new transaction after the commit.
const COMMIT_OWN: &str = "SELECT set_config('synchronous_commit', 'on', true) \
     WHERE current_setting('synchronous_commit') = 'off'; COMMIT";

/// (q)'s check, as a prepared statement of its own before a plain
/// `COMMIT`: an aborted transaction refuses it (25P02) as it refuses (n)'s.
const CHECK_PREPARED: &str = "SELECT set_config('synchronous_commit', 'on', true) \
     WHERE current_setting('synchronous_commit') = 'off'";

/// (r)'s check: the abort check alone.
const CHECK_ABORT_ONLY: &str = "SELECT 1";

#[derive(Clone, Copy, PartialEq)]
enum End {
    Plain,
    Durable,
    Own,
    Prepared,
    AbortOnly,
}

/// The marker `INSERT` of every variant.
fn insert(table: &str) -> String {
    format!("INSERT INTO {table} (scope, message_id, expires_at) VALUES ($1, $2, now() + interval '1 day')")
}

async fn one(pool: &PgPool, table: &str, key: &str, end: End) -> Result<(), sqlx::Error> {
    if end == End::Own {
        return own(pool, table, key).await;
    }
    let mut tx = pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await?;
    sqlx::query(AssertSqlSafe(insert(table)))
        .bind("bench")
        .bind(key)
        .execute(&mut *tx)
        .await?;
    if end == End::Plain {
        return tx.commit().await;
    }
    if end == End::Prepared || end == End::AbortOnly {
        let check = if end == End::Prepared {
            CHECK_PREPARED
        } else {
            CHECK_ABORT_ONLY
        };
        sqlx::query(check).execute(&mut *tx).await?;
        return tx.commit().await;
    }
    sqlx::raw_sql(AssertSqlSafe(COMMIT_DURABLE)).execute(&mut *tx).await?;
    drop(tx);
    Ok(())
}

/// (o): the transaction on a pool connection, closed rather than released
/// when it did not end.
async fn own(pool: &PgPool, table: &str, key: &str) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let ended = async {
        sqlx::raw_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await?;
        sqlx::query(AssertSqlSafe(insert(table)))
            .bind("bench")
            .bind(key)
            .execute(&mut *conn)
            .await?;
        sqlx::raw_sql(COMMIT_OWN).execute(&mut *conn).await.map(|_| ())
    }
    .await;
    if ended.is_err() {
        conn.close_on_drop();
    }
    ended
}

/// Transactions per second of `end` at `concurrency`, for `secs`.
async fn rate(pool: &PgPool, table: &Arc<str>, end: End, concurrency: usize, secs: f64) -> f64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (pool, table, done) = (pool.clone(), Arc::clone(table), Arc::clone(&done));
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let key = NEXT.fetch_add(1, Ordering::Relaxed).to_string();
                    one(&pool, &table, &key, end).await.expect("transaction");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with('-'));
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(9);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1.0);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(PG_URL)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432");
    let table: Arc<str> = format!("bench_commit_end_{}", std::process::id()).into();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {table} (scope TEXT NOT NULL, message_id TEXT NOT NULL, \
         processed_at TIMESTAMPTZ NOT NULL DEFAULT now(), expires_at TIMESTAMPTZ NOT NULL, \
         PRIMARY KEY (scope, message_id))"
    )))
    .execute(&pool)
    .await
    .expect("table");
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&pool)
        .await
        .expect("version");
    println!("PostgreSQL {version}; {reps} interleaved repetitions of {secs} s per variant and concurrency");
    println!(
        "| concurrency | (p) plain COMMIT /s | (p2) A/A /s | (n) durable, checked /s | (q) prepared check, then COMMIT /s | (r) SELECT 1, then COMMIT /s | (o) own transaction /s | p2/p | n/p | q/p | r/p | q/r | o/p |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for concurrency in [1, 8] {
        let (mut p, mut p2, mut n, mut q, mut r, mut o) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            p.push(rate(&pool, &table, End::Plain, concurrency, secs).await);
            n.push(rate(&pool, &table, End::Durable, concurrency, secs).await);
            q.push(rate(&pool, &table, End::Prepared, concurrency, secs).await);
            r.push(rate(&pool, &table, End::AbortOnly, concurrency, secs).await);
            o.push(rate(&pool, &table, End::Own, concurrency, secs).await);
            p2.push(rate(&pool, &table, End::Plain, concurrency, secs).await);
        }
        let (p, p2, n, q, r, o) = (median(p), median(p2), median(n), median(q), median(r), median(o));
        println!(
            "| {concurrency} | {p:.0} | {p2:.0} | {n:.0} | {q:.0} | {r:.0} | {o:.0} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            p2 / p,
            n / p,
            q / p,
            r / p,
            q / r,
            o / p
        );
    }
    sqlx::query(AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .expect("drop");
}
