//! MariaDB / MySQL variants (issue 12): (a) bare transaction, (b) the
//! article's check then transaction, (c) hand-written claim-first, (d)
//! `#[idempotent]` with `MySqlStore`, and the section that compares them.
//!
//! Every marker table is made by `MySqlStore::migrate` (the store's
//! layout), with an outbox table of its own so that nothing is left behind:
//! all of them are dropped at the end of the section.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::sqlx::mysql::MySqlPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, MySql, MySqlConnection, MySqlPool};
use idempotent_runtime::store::TransactionalStore;
use idempotent_runtime::{MySqlStore, idempotent};

use crate::harness::{BoxError, Outcome, Variant};
use crate::pg::{BenchError, Msg};

pub const MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";
/// The scope every variant writes (the macro's handler names it too).
const SCOPE: &str = "handle";
/// What `MySqlStore` sends to begin its transaction (`BEGIN_READ_COMMITTED`
/// in `store/mysql/mod.rs`): READ COMMITTED for this transaction only.
const BEGIN_READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// A pool and the tables this run created (dropped at the end).
pub struct MyEnv {
    pub pool: MySqlPool,
    tables: Mutex<Vec<String>>,
}

impl MyEnv {
    pub async fn connect(max_connections: u32) -> Result<MyEnv, BoxError> {
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections)
            .min_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            .connect(MYSQL_URL)
            .await?;
        Ok(MyEnv {
            pool,
            tables: Mutex::new(Vec::new()),
        })
    }

    /// A fresh, unique table name (registered for cleanup).
    fn table(&self, what: &str) -> String {
        let name = crate::unique(&format!("bench_{what}"));
        self.tables.lock().unwrap().push(name.clone());
        name
    }

    /// A marker table (and its outbox table) made by `MySqlStore::migrate`,
    /// and an effect table.
    pub async fn tables(&self, what: &str) -> MyTables {
        let markers = self.table(&format!("{what}_m"));
        let outbox = self.table(&format!("{what}_o"));
        let payments = self.table(&format!("{what}_p"));
        let store = MySqlStore::builder(self.pool.clone())
            .table(&markers)
            .outbox_table(&outbox)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let ddl = format!(
            "CREATE TABLE {payments} (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             message_id VARBINARY(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB"
        );
        sqlx::query(AssertSqlSafe(ddl)).execute(&self.pool).await.unwrap();
        MyTables {
            pool: self.pool.clone(),
            markers,
            payments,
            store,
        }
    }

    pub async fn cleanup(&self) {
        let tables = std::mem::take(&mut *self.tables.lock().unwrap());
        for table in tables {
            let _ = sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                .execute(&self.pool)
                .await;
        }
    }

    /// `VERSION()`, `innodb_flush_log_at_trx_commit` and the default
    /// isolation level.
    pub async fn server(&self) -> (String, String, String) {
        let version = sqlx::query_scalar::<_, String>("SELECT VERSION()")
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|_| "?".into());
        let flush = sqlx::query_scalar::<_, i64>("SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)")
            .fetch_one(&self.pool)
            .await
            .map_or_else(|_| "?".into(), |v| v.to_string());
        // MySQL 8 and MariaDB 11.1+ name it `transaction_isolation`; older
        // MariaDB, `tx_isolation`.
        let mut isolation = "?".to_owned();
        for variable in ["@@transaction_isolation", "@@tx_isolation"] {
            let sql = format!("SELECT CAST({variable} AS CHAR)");
            if let Ok(level) = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql))
                .fetch_one(&self.pool)
                .await
            {
                isolation = level.replace('-', " ");
                break;
            }
        }
        (version, flush, isolation)
    }
}

#[derive(Clone)]
pub struct MyTables {
    pool: MySqlPool,
    markers: String,
    payments: String,
    /// A `MySqlStore` on the marker table.
    pub store: MySqlStore,
}

impl MyTables {
    fn effect_sql(&self) -> Arc<str> {
        format!("INSERT INTO {} (message_id, amount) VALUES (?, ?)", self.payments).into()
    }

    async fn truncate(&self) {
        for table in [&self.markers, &self.payments] {
            sqlx::query(AssertSqlSafe(format!("TRUNCATE TABLE {table}")))
                .execute(&self.pool)
                .await
                .unwrap();
        }
    }
}

async fn effect(conn: &mut MySqlConnection, sql: &Arc<str>, key: &str) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(Arc::clone(sql)))
        .bind(key)
        .bind(100_i64)
        .execute(conn)
        .await?;
    Ok(())
}

// ---- (a) bare ------------------------------------------------------------

pub struct Bare {
    t: MyTables,
    effect: Arc<str>,
}

impl Bare {
    pub fn new(t: MyTables) -> Self {
        Bare {
            effect: t.effect_sql(),
            t,
        }
    }
}

impl Variant for Bare {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut tx = self.t.pool.begin().await?;
        effect(&mut tx, &self.effect, &key).await?;
        tx.commit().await?;
        Ok(Outcome::Fresh)
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}

// ---- (b) the article: check, then effect + marker ---------------------------

pub struct Article {
    t: MyTables,
    effect: Arc<str>,
    check: Arc<str>,
    mark: Arc<str>,
}

impl Article {
    pub fn new(t: MyTables) -> Self {
        Article {
            effect: t.effect_sql(),
            check: format!("SELECT 1 FROM {} WHERE scope = ? AND message_id = ?", t.markers).into(),
            mark: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL 7 DAY)",
                t.markers
            )
            .into(),
            t,
        }
    }
}

impl Variant for Article {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let seen: Option<i32> = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.check)))
            .bind(SCOPE)
            .bind(&key)
            .fetch_optional(&self.t.pool)
            .await?;
        if seen.is_some() {
            return Ok(Outcome::Duplicate);
        }
        let mut tx = self.t.pool.begin().await?;
        effect(&mut tx, &self.effect, &key).await?;
        let marked = sqlx::query(AssertSqlSafe(Arc::clone(&self.mark)))
            .bind(SCOPE)
            .bind(&key)
            .execute(&mut *tx)
            .await;
        match marked {
            Ok(_) => {}
            // A concurrent duplicate passed the check too: it loses here
            // (ER_DUP_ENTRY), and its dropped transaction rolls back.
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => return Ok(Outcome::Duplicate),
            Err(e) => return Err(e.into()),
        }
        tx.commit().await?;
        Ok(Outcome::Fresh)
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}

// ---- (c) hand-written claim-first ---------------------------------------------

pub struct ClaimFirst {
    t: MyTables,
    effect: Arc<str>,
    claim: Arc<str>,
}

impl ClaimFirst {
    pub fn new(t: MyTables) -> Self {
        ClaimFirst {
            effect: t.effect_sql(),
            // Affected rows: 1 inserted, 0 for an existing marker (which a
            // concurrent claim's uncommitted row makes this wait for).
            claim: format!(
                "INSERT IGNORE INTO {} (scope, message_id, processed_at, expires_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL 7 DAY)",
                t.markers
            )
            .into(),
            t,
        }
    }
}

impl Variant for ClaimFirst {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut tx = self.t.pool.begin_with(BEGIN_READ_COMMITTED).await?;
        let claimed = sqlx::query(AssertSqlSafe(Arc::clone(&self.claim)))
            .bind(SCOPE)
            .bind(&key)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if claimed == 0 {
            // The dropped transaction's ROLLBACK goes with the pool's
            // release ping.
            return Ok(Outcome::Duplicate);
        }
        effect(&mut tx, &self.effect, &key).await?;
        tx.commit().await?;
        Ok(Outcome::Fresh)
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}

// ---- (s) by hand, with the statement `MySqlStore` sends ------------------------

/// (c) with exactly what `MySqlStore` sends for a `()` handler without
/// fingerprint: its `BEGIN`, its claim statement (`INSERT .. ON DUPLICATE KEY
/// UPDATE` whose update clause only reports an expired marker, four
/// parameters, the outcome read from `last_insert_id`), the effect,
/// `COMMIT`. (d) against (s) is the cost of the macro and the runtime; (s)
/// against (c) the cost of the statement.
pub struct StoreStatements {
    t: MyTables,
    effect: Arc<str>,
    claim: Arc<str>,
}

impl StoreStatements {
    pub fn new(t: MyTables) -> Self {
        let expired = "expires_at <= UTC_TIMESTAMP(3)";
        StoreStatements {
            effect: t.effect_sql(),
            claim: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at, fingerprint) \
                 VALUES (?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL ? MICROSECOND, ?) \
                 ON DUPLICATE KEY UPDATE \
                 fingerprint = IF(LAST_INSERT_ID(IF({expired}, 2, 1)) = 0, NULL, fingerprint)",
                t.markers
            )
            .into(),
            t,
        }
    }
}

impl Variant for StoreStatements {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut tx = self.t.pool.begin_with(BEGIN_READ_COMMITTED).await?;
        let ttl_micros = i64::try_from(idempotent_runtime::DEFAULT_TTL.as_micros())?;
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.claim)))
            .bind(SCOPE)
            .bind(&key)
            .bind(ttl_micros)
            .bind(None::<&str>)
            .execute(&mut *tx)
            .await?;
        match done.last_insert_id() {
            0 => {}
            1 => return Ok(Outcome::Duplicate),
            _ => return Err("an expired marker: not in this benchmark".into()),
        }
        effect(&mut tx, &self.effect, &key).await?;
        tx.commit().await?;
        Ok(Outcome::Fresh)
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}

// ---- (d) the macro, with any transactional MySQL store ----------------------

pub struct Macro<S> {
    t: MyTables,
    effect: Arc<str>,
    pub store: S,
}

impl<S> Macro<S>
where
    S: TransactionalStore<Database = MySql> + 'static,
{
    pub fn new(t: MyTables, store: S) -> Self {
        Macro {
            effect: t.effect_sql(),
            t,
            store,
        }
    }

    #[idempotent(key = "msg.key", store = self.store, scope = "handle")]
    async fn handle(&self, msg: &Msg, tx: &mut MySqlConnection) -> Result<(), BenchError> {
        msg.ran.store(true, Ordering::Relaxed);
        effect(tx, &self.effect, &msg.key).await?;
        Ok(())
    }
}

impl<S> Variant for Macro<S>
where
    S: TransactionalStore<Database = MySql> + 'static,
{
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let msg = Msg::new(key);
        self.handle(&msg).await?;
        Ok(msg.outcome())
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}
