//! Helpers shared by the integration tests: service URLs, unique names.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, PgPool};

/// PostgreSQL of the machine (trust auth).
pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// MariaDB of the machine (root, no password).
pub const MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";
/// Redis of the machine.
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";

/// A name no other test (or test run) uses: `prefix_<pid>_<time>_<n>`.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000_000,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

pub async fn pg_pool(max_connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(PG_URL)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 (run .ci/run to start it)")
}

pub async fn drop_pg_table(pool: &PgPool, table: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(pool)
        .await
        .expect("drop table");
}

pub async fn mysql_pool(max_connections: u32) -> sqlx::MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max_connections)
        .connect(MYSQL_URL)
        .await
        .expect("MariaDB at 127.0.0.1:3306 (run .ci/run to start it)")
}

pub async fn drop_mysql_table(pool: &sqlx::MySqlPool, table: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{table}`")))
        .execute(pool)
        .await
        .expect("drop table");
}
