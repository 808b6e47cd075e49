//! `SqliteStore`: markers in a SQLite table, claimed inside the handler's
//! `BEGIN IMMEDIATE` transaction.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Sqlite, SqlitePool};
use tokio::sync::Semaphore;

use crate::Error;
use crate::backoff::Backoff;
use crate::store::sql::{
    ClaimSql, DEFAULT_OUTBOX_RETENTION, MarkerSql, OutboxParts, SqlGuard, SqlStoreBuilder, claim_in_running_batch, ddl,
    delete_in_batches, replay, sql_backend,
};
use crate::store::sqlite::outbox::{SqliteOutboxSql, stage_outbox};
use crate::store::tx::Tx;
use crate::store::{Claim, Replay, Request, Store, TransactionalStore};

pub(crate) mod outbox;

/// The database clock in milliseconds since the Unix epoch.
pub(crate) const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// How long a claim keeps retrying when another process holds the database's
/// write lock past the pool's busy timeout.
const BUSY_RETRY_FOR: Duration = Duration::from_secs(60);

/// The wait between two tries at SQLite's write lock: 2 ms doubling up to
/// 100 ms.
const BUSY_BACKOFF: Backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));

/// A SQLite store: the marker is inserted in the same `BEGIN IMMEDIATE`
/// transaction as the handler's effect, so both commit or neither does.
///
/// SQLite has one writer at a time. Calls through one store (and its clones)
/// queue for the write lock in order inside the process; contention with
/// other processes is retried, so `SQLITE_BUSY` does not reach the caller.
///
/// A handler that ends the claim's transaction itself (`ROLLBACK`,
/// `COMMIT`), or whose statement made SQLite roll it back (some I/O errors,
/// `SQLITE_FULL`), and returns `Ok` gets [`Error::TransactionAborted`]:
/// nothing more is written or committed in autocommit.
///
/// Cloning is cheap: clones share the pool and the writer queue.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    writer: Arc<Semaphore>,
    sql: Arc<SqliteSql>,
    outbox: Arc<SqliteOutbox>,
    /// The Kafka offsets table (offsets-in-the-database mode).
    #[cfg(feature = "kafka")]
    kafka_offsets: Arc<crate::store::kafka_offsets::OffsetSql>,
}

/// The store's outbox table (statements in `outbox.rs`).
type SqliteOutbox = OutboxParts<SqliteOutboxSql>;

fn sqlite_outbox(settings: &(crate::table::TableName, Duration)) -> SqliteOutbox {
    OutboxParts::new(
        settings,
        '"',
        include_str!("../../../sql/sqlite_outbox.sql"),
        SqliteOutboxSql::new,
    )
}

#[derive(Debug)]
struct SqliteSql {
    table: crate::table::TableName,
    namespace: &'static str,
    claim: Arc<str>,
    /// Reads, completes and undoes one marker.
    marker: MarkerSql,
    purge: Arc<str>,
    ddl: Vec<String>,
    purge_batch: i64,
}

/// Configures a [`SqliteStore`]: see [`SqlStoreBuilder`](crate::store::SqlStoreBuilder).
pub type SqliteStoreBuilder = SqlStoreBuilder<SqlitePool>;

impl SqlStoreBuilder<SqlitePool> {
    /// The store, or [`Error::Config`] for an invalid setting.
    pub fn build(self) -> Result<SqliteStore, Error> {
        let outbox = self.outbox_settings()?;
        #[cfg(feature = "kafka")]
        let kafka_offsets = self.kafka_offsets_settings()?;
        #[cfg(feature = "kafka")]
        let offsets_schema = kafka_offsets.schema().is_some();
        #[cfg(not(feature = "kafka"))]
        let offsets_schema = false;
        let (pool, table, purge_batch) = self.into_parts()?;
        if table.schema().is_some() || outbox.0.schema().is_some() || offsets_schema {
            return Err(Error::Config(format!(
                "invalid table name {:?}: SQLite stores take a plain table name",
                table.to_string()
            )));
        }
        let mut store = SqliteStore::assemble(pool, table, purge_batch);
        store.outbox = Arc::new(sqlite_outbox(&outbox));
        #[cfg(feature = "kafka")]
        {
            store.kafka_offsets = crate::store::kafka_offsets::OffsetSql::sqlite(&kafka_offsets);
        }
        Ok(store)
    }
}

impl SqliteStore {
    fn assemble(pool: SqlitePool, table: crate::table::TableName, purge_batch: u32) -> SqliteStore {
        let t = table.quoted('"');
        let sql = SqliteSql {
            claim: format!(
                "INSERT INTO {t} (scope, message_id, processed_at, expires_at, fingerprint) \
                 VALUES (?1, ?2, {NOW_MS}, {NOW_MS} + ?3, ?4) \
                 ON CONFLICT (scope, message_id) DO UPDATE \
                 SET processed_at = excluded.processed_at, expires_at = excluded.expires_at, \
                     fingerprint = excluded.fingerprint, result = NULL \
                 WHERE expires_at <= excluded.processed_at \
                 RETURNING 1"
            )
            .into(),
            marker: MarkerSql::new(&t, |n| format!("?{n}"), |ttl| format!("{NOW_MS} + {ttl}")),
            purge: format!(
                "DELETE FROM {t} WHERE (scope, message_id) IN (\
                 SELECT scope, message_id FROM {t} WHERE expires_at <= {NOW_MS} LIMIT ?1)"
            )
            .into(),
            ddl: ddl(include_str!("../../../sql/sqlite.sql"), &table, '"'),
            purge_batch: i64::from(purge_batch),
            namespace: namespace(&pool, &table),
            table,
        };
        SqliteStore {
            pool,
            writer: Arc::new(Semaphore::new(1)),
            sql: Arc::new(sql),
            outbox: Arc::new(sqlite_outbox(&(
                crate::table::TableName::outbox(),
                DEFAULT_OUTBOX_RETENTION,
            ))),
            #[cfg(feature = "kafka")]
            kafka_offsets: crate::store::kafka_offsets::OffsetSql::sqlite(&crate::table::TableName::kafka_offsets()),
        }
    }

    /// A store on `pool` with the default table, `processed_messages`.
    ///
    /// For concurrent callers the pool should use WAL and a busy timeout, as
    /// [`SqliteStore::open`] sets up.
    pub fn new(pool: SqlitePool) -> Self {
        SqliteStore::assemble(
            pool,
            crate::table::TableName::default(),
            crate::store::sql::DEFAULT_PURGE_BATCH,
        )
    }

    /// A builder to set the table name and purge batch size.
    pub fn builder(pool: SqlitePool) -> SqliteStoreBuilder {
        SqlStoreBuilder::new(pool)
    }

    /// Opens (creating it if missing) the database file at `path` with the
    /// settings a consumer wants (WAL journal, `synchronous = FULL`, a
    /// 5-second busy timeout, foreign keys on), and a store on it with the
    /// default table. Call [`migrate`](Self::migrate) next.
    ///
    /// `synchronous = FULL` makes each commit durable before the handler
    /// returns, so the broker is never acknowledged for an effect that a
    /// power loss could still roll back (in WAL mode, `NORMAL` only
    /// survives application crashes).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?;
        Ok(SqliteStore::new(pool))
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The marker table.
    pub fn table(&self) -> &crate::table::TableName {
        &self.sql.table
    }

    /// The Kafka offsets table's statements (offsets-in-the-database mode).
    #[cfg(feature = "kafka")]
    pub(crate) fn kafka_offsets(&self) -> &Arc<crate::store::kafka_offsets::OffsetSql> {
        &self.kafka_offsets
    }

    /// The Kafka offsets table's DDL, run by `migrate` (none without the
    /// `kafka` feature).
    fn kafka_offsets_ddl(&self) -> &[String] {
        #[cfg(feature = "kafka")]
        {
            &self.kafka_offsets.ddl
        }
        #[cfg(not(feature = "kafka"))]
        {
            &[]
        }
    }

    pub(crate) fn outbox(&self) -> &SqliteOutbox {
        &self.outbox
    }

    /// Creates the marker table and its `expires_at` index if they do not
    /// exist (the DDL of `sql/sqlite.sql`).
    ///
    /// With the `kafka` feature it also creates the Kafka offsets table
    /// (`sql/sqlite_kafka_offsets.sql`, default `idempotent_kafka_offsets`), where a
    /// consumer in offsets-in-the-database mode keeps its partitions' offsets.
    pub async fn migrate(&self) -> Result<(), Error> {
        let (mut tx, _writer) = self.begin_immediate().await?;
        for statement in self
            .sql
            .ddl
            .iter()
            .chain(&self.outbox.ddl)
            .chain(self.kafka_offsets_ddl())
        {
            sqlx::query(AssertSqlSafe(statement.as_str())).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Deletes expired markers in batches of the configured size, each in
    /// its own short write transaction; returns how many were deleted.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        self.purge_in_batches(&self.sql.purge, None).await
    }

    /// Runs the bounded `DELETE` `purge` (with `before`, when given, then
    /// the batch size) until it deletes less than a batch, each run in its
    /// own short write transaction; returns how many rows it deleted.
    pub(crate) async fn purge_in_batches(&self, purge: &str, before: Option<i64>) -> Result<u64, Error> {
        let batch = self.sql.purge_batch;
        delete_in_batches(batch as u64, || async move {
            let (mut tx, _writer) = self.begin_immediate().await?;
            let query = sqlx::query(AssertSqlSafe(purge));
            let query = match before {
                Some(before) => query.bind(before),
                None => query,
            };
            let deleted = query.bind(batch).execute(&mut *tx).await?.rows_affected();
            tx.commit().await?;
            Ok(deleted)
        })
        .await
    }

    /// Takes this process's writer turn, then SQLite's write lock
    /// (`BEGIN IMMEDIATE`), retrying while another process holds it.
    pub(crate) async fn begin_immediate(&self) -> Result<(Tx<Sqlite>, tokio::sync::OwnedSemaphorePermit), Error> {
        let writer = Arc::clone(&self.writer)
            .acquire_owned()
            .await
            .map_err(|_| Error::Config("the SQLite writer queue was closed".into()))?;
        let deadline = tokio::time::Instant::now() + BUSY_RETRY_FOR;
        let mut attempt = 0;
        loop {
            match Tx::begin(&self.pool, "BEGIN IMMEDIATE").await {
                Ok(tx) => return Ok((tx, writer)),
                Err(error) if is_busy(&error) && tokio::time::Instant::now() < deadline => {
                    attempt += 1;
                    tokio::time::sleep(BUSY_BACKOFF.delay(attempt)).await;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }
}

/// `SQLITE_BUSY` and `SQLITE_LOCKED`, with their extended codes.
fn is_busy(error: &sqlx::Error) -> bool {
    let Some(db) = error.as_database_error() else {
        return false;
    };
    db.code()
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

impl Store for SqliteStore {
    type Guard = SqlGuard<Sqlite>;

    fn namespace(&self) -> Option<&'static str> {
        Some(self.sql.namespace)
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<Self::Guard>, Error> {
        if let Some(claim) = claim_in_running_batch(self, self.sql.namespace, req).await? {
            return Ok(claim);
        }
        let (mut tx, writer) = self.begin_immediate().await?;
        let claimed = self.claim_statement(&mut tx, req).await?;
        if claimed {
            return Ok(self.fresh_guard(tx, req, Some(writer)));
        }
        if !req.needs_read() {
            // A `()` handler without fingerprint replays `()` whatever the
            // marker holds: no read. The rollback is awaited (it is local)
            // so the write lock is free before the writer permit is.
            tx.rollback().await?;
            drop(writer);
            return Ok(Claim::Done(Replay::default()));
        }
        let marker = self.read_marker(&mut tx, req).await?;
        tx.rollback().await?;
        drop(writer);
        replay(req, marker)
    }
}

impl ClaimSql for SqliteStore {
    type Db = Sqlite;

    async fn claim_statement(&self, conn: &mut sqlx::SqliteConnection, req: &Request<'_>) -> Result<bool, sqlx::Error> {
        <Sqlite as crate::store::sql::SqlBackend>::claim_returning(conn, Arc::clone(&self.sql.claim), req).await
    }

    fn marker_sql(&self) -> &MarkerSql {
        &self.sql.marker
    }

    fn outbox_table(&self) -> &Arc<crate::store::sql::OutboxTable> {
        &self.outbox.table
    }
}

/// `sqlite://file/table`; an in-memory database is private to its pool, so
/// it gets a namespace of its own.
fn namespace(pool: &SqlitePool, table: &crate::table::TableName) -> &'static str {
    let options = pool.connect_options();
    let file = options.get_filename();
    if file.as_os_str().is_empty() || file.to_string_lossy().contains(":memory:") {
        return crate::scope::unique_namespace(&format!("sqlite::memory:/{table}"));
    }
    let file = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
    crate::scope::intern_namespace(format!("sqlite://{}/{table}", file.display()))
}

impl TransactionalStore for SqliteStore {
    type Database = Sqlite;
}

impl crate::batch::BatchStore for SqliteStore {
    /// Takes the write lock (`BEGIN IMMEDIATE`, after this process's writer
    /// turn) for the whole batch.
    async fn begin_batch(&self) -> Result<crate::batch::Batch, Error> {
        let (tx, writer) = self.begin_immediate().await?;
        Ok(crate::batch::Batch::new(self.sql.namespace, tx, Some(writer), None))
    }
}

impl crate::store::StagesOutbox for SqliteStore {}

sql_backend!(
    Sqlite,
    sqlx::SqliteConnection,
    true,
    stage_outbox,
    crate::store::sql::plain_commit,
    holds_transaction,
    retire
);

/// What SQLite answers a `BEGIN` inside a transaction.
const ALREADY_IN_TRANSACTION: &str = "cannot start a transaction within a transaction";

/// [`SqlBackend::holds_transaction`](crate::store::sql::SqlBackend::holds_transaction)
/// on SQLite: whether the connection is still in a transaction (not back
/// in autocommit, after a `ROLLBACK` or `COMMIT` of the handler's own, or a
/// rollback SQLite made itself after an I/O error or `SQLITE_FULL`). SQL
/// has no function for it; `BEGIN` is refused inside a transaction, which
/// is the answer. Outside one it begins a deferred transaction (no lock),
/// which the refused claim's rollback ends, bringing sqlx's record of the
/// connection back in step with it.
async fn holds_transaction(conn: &mut sqlx::SqliteConnection) -> Result<bool, sqlx::Error> {
    match sqlx::query("BEGIN").execute(conn).await {
        Ok(_) => Ok(false),
        Err(sqlx::Error::Database(db)) if db.message().contains(ALREADY_IN_TRANSACTION) => Ok(true),
        Err(error) => Err(error),
    }
}

/// [`SqlBackend::retire`](crate::store::sql::SqlBackend::retire) on SQLite:
/// nothing to do. A SQLite connection runs its statements on its own
/// worker thread, which finishes a statement its caller abandoned, so its
/// release never waits on a peer; the fresh connection is kept.
async fn retire(_conn: &mut sqlx::SqliteConnection) {}

/// No janitor lock (the default, [`JanitorLock::unshared`](crate::store::JanitorLock::unshared)):
/// SQLite runs one write transaction at a time, so janitors of several
/// processes on one file already take turns, batch by batch.
impl crate::janitor::PurgeExpired for SqliteStore {
    /// Expired markers, then dispatched outgoing messages past the
    /// retention.
    async fn purge_expired(&self) -> Result<u64, Error> {
        Ok(SqliteStore::purge_expired(self).await? + self.purge_dispatched().await?)
    }
}
