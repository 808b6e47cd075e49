//! PostgreSQL variants: (a) bare transaction, (b) the article's check then
//! transaction, (c) hand-written claim-first, (d) `#[idempotent]` with
//! `PgStore`, and (d+cache) with `CachedStore<PgStore>`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool, Postgres};
use idempotent_runtime::store::TransactionalStore;
use idempotent_runtime::{CachedStore, Error, PgStore, idempotent};

use crate::harness::{BoxError, Outcome, Variant};

pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The scope every variant writes (the macro's handlers name it too); same table layout as `PgStore`'s.
const SCOPE: &str = "handle";

/// A pool and the tables this run created (dropped at the end).
pub struct PgEnv {
    pub pool: PgPool,
    tables: Mutex<Vec<String>>,
}

impl PgEnv {
    pub async fn connect(max_connections: u32) -> Result<PgEnv, BoxError> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .min_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            .connect(PG_URL)
            .await?;
        Ok(PgEnv {
            pool,
            tables: Mutex::new(Vec::new()),
        })
    }

    /// A fresh, unique table name (registered for cleanup).
    pub fn table(&self, what: &str) -> String {
        let name = crate::unique(&format!("bench_{what}"));
        self.tables.lock().unwrap().push(name.clone());
        name
    }

    /// A marker table made by `PgStore::migrate` and an effect table.
    pub async fn tables(&self, what: &str) -> Tables {
        let markers = self.table(&format!("{what}_m"));
        let payments = self.table(&format!("{what}_p"));
        let store = PgStore::builder(self.pool.clone()).table(&markers).build().unwrap();
        store.migrate().await.unwrap();
        let ddl = format!(
            "CREATE TABLE {payments} (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT NOT NULL)"
        );
        sqlx::query(AssertSqlSafe(ddl)).execute(&self.pool).await.unwrap();
        Tables {
            pool: self.pool.clone(),
            markers,
            payments,
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
}

#[derive(Clone)]
pub struct Tables {
    pub pool: PgPool,
    pub markers: String,
    pub payments: String,
}

impl Tables {
    fn effect_sql(&self) -> Arc<str> {
        format!("INSERT INTO {} (message_id, amount) VALUES ($1, $2)", self.payments).into()
    }

    pub async fn truncate(&self) {
        let sql = format!("TRUNCATE {}, {}", self.markers, self.payments);
        sqlx::query(AssertSqlSafe(sql)).execute(&self.pool).await.unwrap();
    }

    pub fn store(&self) -> PgStore {
        PgStore::builder(self.pool.clone())
            .table(&self.markers)
            .build()
            .unwrap()
    }
}

async fn effect(conn: &mut PgConnection, sql: &Arc<str>, key: &str) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(Arc::clone(sql)))
        .bind(key)
        .bind(100_i64)
        .execute(conn)
        .await?;
    Ok(())
}

// ---- (a) bare ------------------------------------------------------------

pub struct Bare {
    t: Tables,
    effect: Arc<str>,
}

impl Bare {
    pub fn new(t: Tables) -> Self {
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
    t: Tables,
    effect: Arc<str>,
    check: Arc<str>,
    mark: Arc<str>,
}

impl Article {
    pub fn new(t: Tables) -> Self {
        Article {
            effect: t.effect_sql(),
            check: format!("SELECT 1 FROM {} WHERE scope = $1 AND message_id = $2", t.markers).into(),
            mark: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at) \
                 VALUES ($1, $2, now(), now() + interval '7 days')",
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
            // A concurrent duplicate passed the check too: it loses here.
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

// ---- (c) hand-written claim-first, and (s) the same with `PgStore`'s statements ----

pub struct ClaimFirst {
    t: Tables,
    effect: Arc<str>,
    claim: Arc<str>,
    /// `tx.rollback().await` on a duplicate instead of dropping the
    /// transaction (sqlx then queues the ROLLBACK with the connection's
    /// release).
    explicit_rollback: bool,
    /// (s): `PgStore`'s `BEGIN` and claim statement (four parameters).
    store_statements: bool,
}

impl ClaimFirst {
    pub fn new(t: Tables, explicit_rollback: bool) -> Self {
        ClaimFirst {
            effect: t.effect_sql(),
            claim: format!(
                "INSERT INTO {} (scope, message_id, processed_at, expires_at) \
                 VALUES ($1, $2, now(), now() + interval '7 days') \
                 ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1",
                t.markers
            )
            .into(),
            t,
            explicit_rollback,
            store_statements: false,
        }
    }

    /// (s): (c) with exactly what `PgStore` sends for a `()` handler
    /// without fingerprint: `BEGIN`, its claim statement (`INSERT .. SELECT
    /// .. WHERE <at read committed> AND NOT EXISTS (live marker) ON
    /// CONFLICT DO UPDATE .. WHERE expired`, four parameters), the
    /// effect, `COMMIT`; a duplicate's transaction is
    /// dropped. (d) against (s) is the cost of the macro and the runtime;
    /// (s) against (c) the cost of the statement.
    pub fn store_statements(t: Tables) -> Self {
        ClaimFirst {
            claim: format!(
                "INSERT INTO {t} AS m (scope, message_id, processed_at, expires_at, fingerprint) \
                 SELECT $1, $2, now(), now() + $3 * interval '1 millisecond', $4 \
                 WHERE CASE current_setting('transaction_isolation') WHEN 'read committed' THEN true \
                     ELSE ('idempotent: claim not at read committed: ' \
                         || current_setting('transaction_isolation'))::boolean END \
                 AND NOT EXISTS (SELECT FROM {t} l \
                     WHERE l.scope = $1 AND l.message_id = $2 AND l.expires_at > now()) \
                 ON CONFLICT (scope, message_id) DO UPDATE \
                 SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, \
                     fingerprint = EXCLUDED.fingerprint, result = NULL \
                 WHERE m.expires_at <= now() \
                 RETURNING true",
                t = t.markers
            )
            .into(),
            store_statements: true,
            ..ClaimFirst::new(t, false)
        }
    }
}

impl Variant for ClaimFirst {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut tx = self.t.pool.begin().await?;
        let mut claim = sqlx::query(AssertSqlSafe(Arc::clone(&self.claim)))
            .bind(SCOPE)
            .bind(&key);
        if self.store_statements {
            let ttl_ms = i64::try_from(idempotent_runtime::DEFAULT_TTL.as_millis())?;
            claim = claim.bind(ttl_ms).bind(None::<&str>);
        }
        if claim.fetch_optional(&mut *tx).await?.is_none() {
            if self.explicit_rollback {
                tx.rollback().await?;
            }
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

// ---- (d) the macro, with any transactional Postgres store ----------------------

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

pub struct Msg {
    pub key: String,
    pub ran: AtomicBool,
}

impl Msg {
    pub fn new(key: String) -> Msg {
        Msg {
            key,
            ran: AtomicBool::new(false),
        }
    }

    pub fn outcome(&self) -> Outcome {
        if self.ran.load(Ordering::Relaxed) {
            Outcome::Fresh
        } else {
            Outcome::Duplicate
        }
    }
}

pub struct Macro<S> {
    t: Tables,
    effect: Arc<str>,
    pub store: S,
}

impl<S> Macro<S>
where
    S: TransactionalStore<Database = Postgres> + 'static,
{
    pub fn new(t: Tables, store: S) -> Self {
        Macro {
            effect: t.effect_sql(),
            t,
            store,
        }
    }

    #[idempotent(key = "msg.key", store = self.store, scope = "handle")]
    async fn handle(&self, msg: &Msg, tx: &mut PgConnection) -> Result<(), BenchError> {
        msg.ran.store(true, Ordering::Relaxed);
        effect(tx, &self.effect, &msg.key).await?;
        Ok(())
    }
}

impl<S> Variant for Macro<S>
where
    S: TransactionalStore<Database = Postgres> + 'static,
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

// ---- (e) batch transactions ------------------------------------------------------

/// The (d) handler run `size` deliveries per transaction: one
/// [`Batch`](idempotent_runtime::batch::Batch), the handlers together in
/// `Batch::run_all` (one claim statement), one commit; a batch that cannot commit runs its deliveries again one by
/// one, as the consumers' batch mode does.
pub struct Batched {
    inner: Macro<PgStore>,
    size: usize,
}

impl Batched {
    pub fn new(t: Tables, size: usize) -> Self {
        let store = t.store();
        Batched {
            inner: Macro::new(t, store),
            size,
        }
    }
}

impl Variant for Batched {
    fn batch(&self) -> usize {
        self.size
    }
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        self.inner.deliver(key).await
    }
    async fn deliver_batch(&self, keys: Vec<String>) -> Result<Vec<Outcome>, BoxError> {
        use idempotent_runtime::batch::BatchStore;
        let batch = self.inner.store.begin_batch().await?;
        let msgs: Vec<Msg> = keys.into_iter().map(Msg::new).collect();
        let outcomes = batch
            .run_all(msgs.iter().map(|msg| self.inner.handle(msg)).collect())
            .await;
        let failed = outcomes.iter().any(Result::is_err);
        if !failed && batch.commit().await.is_ok() {
            return Ok(msgs.iter().map(Msg::outcome).collect());
        }
        // Not committed: each delivery again in its own transaction.
        let mut outcomes = Vec::with_capacity(msgs.len());
        for msg in msgs {
            outcomes.push(self.inner.deliver(msg.key).await?);
        }
        Ok(outcomes)
    }
    async fn reset(&self) {
        self.inner.t.truncate().await;
    }
}

pub fn cached(t: &Tables, capacity: usize) -> CachedStore<PgStore> {
    CachedStore::new(t.store(), capacity)
}

// ---- the marker table as it grows -------------------------------------------------

/// A `PgStore` marker table already holding `rows` live markers (of another
/// scope), filled with one `INSERT .. SELECT generate_series` before the
/// primary key and the expiry index are built. Returns the tables and the
/// fill time.
pub async fn prefilled(env: &PgEnv, what: &str, rows: u64, expired: bool) -> (Tables, Duration) {
    let markers = env.table(&format!("{what}_m"));
    let payments = env.table(&format!("{what}_p"));
    let pool = &env.pool;
    let exec = |sql: String| async move {
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
    };
    exec(format!(
        "CREATE TABLE {markers} (scope TEXT NOT NULL, message_id TEXT NOT NULL, \
         processed_at TIMESTAMPTZ NOT NULL DEFAULT now(), expires_at TIMESTAMPTZ NOT NULL, \
         fingerprint TEXT, result TEXT)"
    ))
    .await;
    let started = Instant::now();
    if rows > 0 {
        let expires = if expired {
            "now() - interval '1 day'"
        } else {
            "now() + interval '7 days'"
        };
        exec(format!(
            "INSERT INTO {markers} (scope, message_id, processed_at, expires_at) \
             SELECT 'fill', 'fill-' || g, now(), {expires} FROM generate_series(1, {rows}) g"
        ))
        .await;
    }
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET maintenance_work_mem = '256MB'")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {markers} ADD PRIMARY KEY (scope, message_id)"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE INDEX {markers}_expires_at_idx ON {markers} (expires_at)"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("RESET maintenance_work_mem")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    exec(format!("VACUUM ANALYZE {markers}")).await;
    let fill = started.elapsed();
    exec(format!(
        "CREATE TABLE {payments} (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT NOT NULL)"
    ))
    .await;
    (
        Tables {
            pool: pool.clone(),
            markers,
            payments,
        },
        fill,
    )
}

/// Adds `rows` expired markers to an existing table (with its indexes).
pub async fn add_expired(t: &Tables, rows: u64, tag: &str) -> Duration {
    let started = Instant::now();
    let sql = format!(
        "INSERT INTO {} (scope, message_id, processed_at, expires_at) \
         SELECT 'old', '{tag}-' || g, now() - interval '8 days', now() - interval '1 day' FROM generate_series(1, {rows}) g",
        t.markers
    );
    sqlx::query(AssertSqlSafe(sql)).execute(&t.pool).await.unwrap();
    sqlx::query(AssertSqlSafe(format!("ANALYZE {}", t.markers)))
        .execute(&t.pool)
        .await
        .unwrap();
    started.elapsed()
}

pub async fn relation_size(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT pg_total_relation_size('{table}')")))
        .fetch_one(pool)
        .await
        .unwrap()
}
