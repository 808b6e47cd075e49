//! SQLite variants, on a temporary database file (WAL, `synchronous =
//! NORMAL`, as `SqliteStore::open` sets up). SQLite has one writer: the
//! hand-written variants queue for it in-process like `SqliteStore` does
//! (a one-permit semaphore, then `BEGIN IMMEDIATE`), otherwise they would
//! spend their time in SQLite's busy handler.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use idempotent_runtime::sqlx::{self, AssertSqlSafe, Sqlite, SqliteConnection, SqlitePool};
use idempotent_runtime::{SqliteStore, idempotent};
use tokio::sync::Semaphore;

use crate::harness::{BoxError, Outcome, Variant};
use crate::pg::{BenchError, Msg};

const SCOPE: &str = "handle";
const WEEK_MS: i64 = 7 * 24 * 3600 * 1000;

pub struct LiteEnv {
    _dir: tempfile::TempDir,
    pool: SqlitePool,
    writer: Arc<Semaphore>,
}

impl LiteEnv {
    pub async fn open() -> LiteEnv {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("bench.db")).await.unwrap();
        let pool = store.pool().clone();
        LiteEnv {
            _dir: dir,
            pool,
            writer: Arc::new(Semaphore::new(1)),
        }
    }

    /// A marker table made by `SqliteStore::migrate` and an effect table.
    pub async fn tables(&self, what: &str) -> LiteTables {
        let markers = crate::unique(&format!("bench_{what}_m"));
        let payments = crate::unique(&format!("bench_{what}_p"));
        let store = SqliteStore::builder(self.pool.clone()).table(&markers).build().unwrap();
        store.migrate().await.unwrap();
        let ddl = format!(
            "CREATE TABLE {payments} (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL, amount INTEGER NOT NULL)"
        );
        sqlx::query(AssertSqlSafe(ddl)).execute(&self.pool).await.unwrap();
        LiteTables {
            pool: self.pool.clone(),
            writer: Arc::clone(&self.writer),
            markers,
            payments,
            store,
        }
    }
}

#[derive(Clone)]
pub struct LiteTables {
    pool: SqlitePool,
    writer: Arc<Semaphore>,
    markers: String,
    payments: String,
    pub store: SqliteStore,
}

impl LiteTables {
    fn effect_sql(&self) -> Arc<str> {
        format!("INSERT INTO {} (message_id, amount) VALUES (?1, ?2)", self.payments).into()
    }

    async fn truncate(&self) {
        let _writer = self.writer.acquire().await.unwrap();
        for t in [&self.markers, &self.payments] {
            sqlx::query(AssertSqlSafe(format!("DELETE FROM {t}")))
                .execute(&self.pool)
                .await
                .unwrap();
        }
    }

    async fn begin(&self) -> Result<(sqlx::Transaction<'static, Sqlite>, tokio::sync::SemaphorePermit<'_>), BoxError> {
        let permit = self.writer.acquire().await?;
        Ok((self.pool.begin_with("BEGIN IMMEDIATE").await?, permit))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn effect(conn: &mut SqliteConnection, sql: &Arc<str>, key: &str) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(Arc::clone(sql)))
        .bind(key)
        .bind(100_i64)
        .execute(conn)
        .await?;
    Ok(())
}

pub struct Bare {
    t: LiteTables,
    effect: Arc<str>,
}

impl Bare {
    pub fn new(t: LiteTables) -> Self {
        Bare {
            effect: t.effect_sql(),
            t,
        }
    }
}

impl Variant for Bare {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let (mut tx, _writer) = self.t.begin().await?;
        effect(&mut tx, &self.effect, &key).await?;
        tx.commit().await?;
        Ok(Outcome::Fresh)
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}

pub struct Article {
    t: LiteTables,
    effect: Arc<str>,
    check: Arc<str>,
    mark: Arc<str>,
}

impl Article {
    pub fn new(t: LiteTables) -> Self {
        Article {
            effect: t.effect_sql(),
            check: format!("SELECT 1 FROM {} WHERE scope = ?1 AND message_id = ?2", t.markers).into(),
            mark: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at) VALUES (?1, ?2, ?3, ?4)",
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
        let (mut tx, _writer) = self.t.begin().await?;
        effect(&mut tx, &self.effect, &key).await?;
        let now = now_ms();
        let marked = sqlx::query(AssertSqlSafe(Arc::clone(&self.mark)))
            .bind(SCOPE)
            .bind(&key)
            .bind(now)
            .bind(now + WEEK_MS)
            .execute(&mut *tx)
            .await;
        match marked {
            Ok(_) => {}
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

pub struct ClaimFirst {
    t: LiteTables,
    effect: Arc<str>,
    claim: Arc<str>,
    /// (s): `SqliteStore`'s claim statement (the clock read in SQL).
    store_statement: bool,
}

impl ClaimFirst {
    pub fn new(t: LiteTables) -> Self {
        ClaimFirst {
            effect: t.effect_sql(),
            claim: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at) VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1",
                t.markers
            )
            .into(),
            t,
            store_statement: false,
        }
    }

    /// (s): (c) with exactly the claim statement `SqliteStore` sends for a
    /// `()` handler without fingerprint (`ON CONFLICT DO UPDATE .. WHERE
    /// expired`, the clock read in SQL, four parameters). (d) against (s) is
    /// the cost of the macro and the runtime; (s) against (c) the cost of
    /// the statement.
    pub fn store_statements(t: LiteTables) -> Self {
        let now = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
        ClaimFirst {
            claim: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at, fingerprint) \
                 VALUES (?1, ?2, {now}, {now} + ?3, ?4) \
                 ON CONFLICT (scope, message_id) DO UPDATE \
                 SET processed_at = excluded.processed_at, expires_at = excluded.expires_at, \
                     fingerprint = excluded.fingerprint, result = NULL \
                 WHERE expires_at <= excluded.processed_at \
                 RETURNING 1",
                t.markers
            )
            .into(),
            store_statement: true,
            ..ClaimFirst::new(t)
        }
    }
}

impl Variant for ClaimFirst {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let (mut tx, _writer) = self.t.begin().await?;
        let claim = sqlx::query_scalar::<_, i32>(AssertSqlSafe(Arc::clone(&self.claim)))
            .bind(SCOPE)
            .bind(&key);
        let claim = if self.store_statement {
            claim.bind(WEEK_MS).bind(None::<&str>)
        } else {
            let now = now_ms();
            claim.bind(now).bind(now + WEEK_MS)
        };
        if claim.fetch_optional(&mut *tx).await?.is_none() {
            tx.rollback().await?;
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

pub struct Macro {
    t: LiteTables,
    effect: Arc<str>,
}

impl Macro {
    pub fn new(t: LiteTables) -> Self {
        Macro {
            effect: t.effect_sql(),
            t,
        }
    }

    #[idempotent(key = "msg.key", store = self.t.store, scope = "handle")]
    async fn handle(&self, msg: &Msg, tx: &mut SqliteConnection) -> Result<(), BenchError> {
        msg.ran.store(true, Ordering::Relaxed);
        effect(tx, &self.effect, &msg.key).await?;
        Ok(())
    }
}

impl Variant for Macro {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let msg = Msg::new(key);
        self.handle(&msg).await?;
        Ok(msg.outcome())
    }
    async fn reset(&self) {
        self.t.truncate().await;
    }
}
