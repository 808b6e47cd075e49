//! Helpers shared by the integration tests: service URLs, unique names.
#![allow(dead_code)]

pub mod cluster;
pub mod counters;
pub mod http;
pub mod kafka;
pub mod nats;
pub mod servers;

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

/// Waits until `$cond` (an expression that may `.await`) holds, checking
/// every 50 ms; fails the test once `$within` (a `Duration`) has passed.
#[allow(unused_macros)]
macro_rules! wait_for {
    ($within:expr, $what:expr, $cond:expr) => {{
        let deadline = tokio::time::Instant::now() + $within;
        while !$cond {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }};
}
#[allow(unused_imports)]
pub(crate) use wait_for;

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

/// Deletes the Redis keys under `prefix` (a test's own).
pub async fn delete_redis_prefix(conn: &mut idempotent_runtime::redis::aio::ConnectionManager, prefix: &str) {
    let keys: Vec<String> = idempotent_runtime::redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let () = idempotent_runtime::redis::cmd("DEL")
            .arg(keys)
            .query_async(conn)
            .await
            .unwrap();
    }
}

pub async fn mysql_pool(max_connections: u32) -> sqlx::MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max_connections)
        .connect(MYSQL_URL)
        .await
        .expect("MariaDB at 127.0.0.1:3306 (run .ci/run to start it)")
}

pub async fn drop_mysql_table(pool: &sqlx::MySqlPool, table: &str) {
    // With the `{table}_keys` table that an outbox's `migrate()` creates
    // beside it (the per-ordering-key locks), where that name is one
    // MariaDB accepts (64 characters at most).
    let drop = if table.len() + "_keys".len() <= 64 {
        format!("DROP TABLE IF EXISTS `{table}`, `{table}_keys`")
    } else {
        format!("DROP TABLE IF EXISTS `{table}`")
    };
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(pool)
        .await
        .expect("drop table");
}

/// Server settings users change, to run the suites under each.
pub mod settings {
    /// PostgreSQL `default_transaction_isolation` of the pool's sessions
    /// (what `ALTER ROLE .. SET` or `postgresql.conf` would set).
    pub const PG_SERVER_DEFAULT: u8 = 0;
    pub const PG_REPEATABLE_READ: u8 = 1;
    pub const PG_SERIALIZABLE: u8 = 2;

    /// MariaDB session `transaction_isolation` (the server's default is
    /// REPEATABLE-READ).
    pub const MY_SERVER_DEFAULT: u8 = 0;
    pub const MY_READ_COMMITTED: u8 = 1;
    pub const MY_REPEATABLE_READ: u8 = 2;
    pub const MY_SERIALIZABLE: u8 = 3;

    /// SQLite journal mode.
    pub const LITE_WAL: u8 = 0;
    pub const LITE_ROLLBACK_JOURNAL: u8 = 1;
}

/// A pool whose sessions default to the isolation level `setting`
/// (`settings::PG_*`).
pub async fn pg_pool_with(max_connections: u32, setting: u8) -> PgPool {
    use std::str::FromStr;
    let mut options = sqlx::postgres::PgConnectOptions::from_str(PG_URL).expect("PG_URL");
    let level = match setting {
        settings::PG_REPEATABLE_READ => Some("repeatable read"),
        settings::PG_SERIALIZABLE => Some("serializable"),
        _ => None,
    };
    if let Some(level) = level {
        options = options.options([("default_transaction_isolation", level)]);
    }
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 (run .ci/run to start it)");
    if let Some(level) = level {
        let shown: String = sqlx::query_scalar("SHOW default_transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(shown, level, "the session default took effect");
    }
    pool
}

/// A pool whose sessions use the isolation level `setting`
/// (`settings::MY_*`).
pub async fn mysql_pool_with(max_connections: u32, setting: u8) -> sqlx::MySqlPool {
    let level = match setting {
        settings::MY_READ_COMMITTED => Some("READ COMMITTED"),
        settings::MY_REPEATABLE_READ => Some("REPEATABLE READ"),
        settings::MY_SERIALIZABLE => Some("SERIALIZABLE"),
        _ => None,
    };
    let mut options = sqlx::mysql::MySqlPoolOptions::new().max_connections(max_connections);
    if let Some(level) = level {
        options = options.after_connect(move |conn, _meta| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SET SESSION TRANSACTION ISOLATION LEVEL {level}"
                )))
                .execute(&mut *conn)
                .await?;
                Ok(())
            })
        });
    }
    let pool = options
        .connect(MYSQL_URL)
        .await
        .expect("MariaDB at 127.0.0.1:3306 (run .ci/run to start it)");
    if let Some(level) = level {
        // MariaDB's name for it (MySQL 8: `transaction_isolation`).
        let shown: String = sqlx::query_scalar("SELECT @@SESSION.tx_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(shown, level.replace(' ', "-"), "the session setting took effect");
    }
    pool
}

/// A SQLite store on a new file in `dir`, in the journal mode `setting`
/// (`settings::LITE_*`): WAL as `SqliteStore::open` sets it, or the
/// rollback journal (SQLite's default) with a busy timeout.
pub async fn sqlite_store_with(dir: &std::path::Path, setting: u8) -> idempotent_runtime::SqliteStore {
    if setting == settings::LITE_WAL {
        return idempotent_runtime::SqliteStore::open(dir.join("markers.db"))
            .await
            .expect("open SQLite");
    }
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join("markers.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Delete)
        .busy_timeout(std::time::Duration::from_secs(5));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("open SQLite");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(mode, "delete");
    idempotent_runtime::SqliteStore::new(pool)
}

/// What `tracing` writes, captured, for the tests that check an event.
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// A subscriber writing events at `level` and above into this buffer
    /// (install it with `tracing::subscriber::set_default`).
    pub fn subscriber(&self, level: tracing::Level) -> impl tracing::Subscriber + Send + Sync {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}
