//! `MySqlStore`: markers in a MySQL or MariaDB (InnoDB) table, claimed
//! inside the handler's READ COMMITTED transaction.
//!
//! # The claim
//!
//! One statement, the first of the transaction:
//!
//! ```sql
//! INSERT INTO t (scope, message_id, processed_at, expires_at, fingerprint)
//! VALUES (?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL ? MICROSECOND, ?)
//! ON DUPLICATE KEY UPDATE
//!     fingerprint = IF(LAST_INSERT_ID(IF(expires_at <= UTC_TIMESTAMP(3), 2, 1)) = 0, NULL, fingerprint)
//! ```
//!
//! and, only when the existing marker has expired, a second one that takes
//! it over:
//!
//! ```sql
//! UPDATE t SET fingerprint = ?, result = NULL, processed_at = UTC_TIMESTAMP(3),
//!              expires_at = UTC_TIMESTAMP(3) + INTERVAL ? MICROSECOND
//! WHERE scope = ? AND message_id = ?
//! ```
//!
//! * On a duplicate key InnoDB takes an **exclusive** lock on the existing
//!   row (a plain `INSERT` or `INSERT IGNORE` takes a shared one, and two
//!   shared holders that both go on to write deadlock). If the row belongs to
//!   a transaction still running, the statement waits for it: a concurrent
//!   duplicate blocks until the first call commits (it then sees the live
//!   marker) or rolls back (it then inserts the marker itself).
//! * sqlx connects with `CLIENT_FOUND_ROWS`, so the affected-rows count is 1
//!   both for a fresh insert and for a duplicate left unchanged: it cannot
//!   tell them apart. The outcome is read from the OK packet's
//!   `last_insert_id` instead: the table has no `AUTO_INCREMENT` column, so it
//!   is 0 after an insert, and `LAST_INSERT_ID(expr)` in the update clause
//!   sets it to 1 (live marker) or 2 (expired marker). The assignment never
//!   changes the row (`LAST_INSERT_ID` is 1 or 2, never 0): the clause
//!   only reports. MariaDB resolves an update clause again at every
//!   execution of the prepared statement, fresh inserts included, and the
//!   four conditional assignments that used to take the marker over here
//!   cost 2–6 % of the rate (docs/archive/benchmarks.md, "mid-morning").
//! * An expired marker is taken over by the `UPDATE`, under the exclusive
//!   lock the claim statement took: no other claim can see or change the
//!   marker in between, and a concurrent claim of the same key waits, then
//!   finds the marker live (or expired again, if this transaction rolls
//!   back). Taking over costs a second round trip, on a marker that outlived
//!   its ttl without being purged.
//!
//! InnoDB can still report a deadlock (1213) when several transactions wait
//! on the same key and the first rolls back, or a lock wait timeout (1205)
//! when the first runs longer than `innodb_lock_wait_timeout`. The claim is
//! the first statement of its transaction, so the whole transaction is
//! retried (bounded, with a small jittered backoff); these errors reach the
//! caller only when the retries are exhausted.

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, MySql, MySqlPool};

use crate::Error;
use crate::backoff::Backoff;
use crate::store::mysql::outbox::{MySqlOutboxSql, stage_outbox};
use crate::store::sql::{
    ClaimSql, DEFAULT_OUTBOX_RETENTION, MarkerSql, OutboxParts, SqlGuard, SqlStoreBuilder, claim_in_running_batch, ddl,
    delete_in_batches, sql_backend,
};
use crate::store::tx::Tx;
use crate::store::{Claim, Replay, Request, Store, TransactionalStore};

pub(crate) mod outbox;

/// Begins a transaction at READ COMMITTED (for this transaction only; the
/// pooled connection's session level is left alone).
const BEGIN_READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// `ER_LOCK_WAIT_TIMEOUT`.
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// `ER_LOCK_DEADLOCK`.
const ER_LOCK_DEADLOCK: u16 = 1213;
/// `ER_TABLE_EXISTS_ERROR`.
const ER_TABLE_EXISTS: u16 = 1050;

/// Attempts of a claim (or of one purge batch) that ends in a deadlock.
const MAX_DEADLOCK_ATTEMPTS: u32 = 12;
/// Lock wait timeouts tolerated per claim (or purge batch) before the error
/// is returned: each one already waited `innodb_lock_wait_timeout`.
const MAX_LOCK_WAIT_TIMEOUTS: u32 = 2;

/// The longest marker lifetime stored: about 1000 years, so the expiry stays
/// inside `DATETIME`'s range whatever ttl is asked for.
const MAX_TTL_MICROS: i64 = 1000 * 366 * 24 * 3600 * 1_000_000;
/// [`MAX_TTL_MICROS`] in milliseconds.
const MAX_TTL_MILLIS: i64 = MAX_TTL_MICROS / 1000;

/// `last_insert_id` of the claim statement: what happened to the marker.
const CLAIM_INSERTED: u64 = 0;
const CLAIM_LIVE: u64 = 1;
const CLAIM_EXPIRED: u64 = 2;

/// A MySQL / MariaDB store: the marker is inserted in the same InnoDB
/// transaction as the handler's effect, so both commit or neither does.
///
/// The transaction runs at READ COMMITTED. A concurrent duplicate waits on
/// the marker's primary key until the first call commits (then it replays
/// the result) or rolls back (then it runs the body itself). Deadlocks and
/// lock wait timeouts that InnoDB reports while claiming are retried a
/// bounded number of times. Expiry is computed by the database clock, in
/// UTC, and set again at the commit when the claim waited or ran long, so
/// that a marker lives its whole ttl once committed.
///
/// InnoDB resolves a deadlock by rolling its victim's whole transaction
/// back (marker and effect), and the session goes on in autocommit. A
/// handler that ignores such a failed statement and returns `Ok` gets
/// [`Error::TransactionAborted`]: before writing anything of its own after
/// the body, the store checks that the session is still in the claim's
/// transaction, and commits nothing otherwise (the message runs again).
///
/// Keys and scopes are stored as `VARBINARY`: two keys are the same marker
/// only when their bytes are equal (case, accents and trailing spaces
/// count).
///
/// Cloning is cheap: clones share the pool.
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    sql: Arc<MySqlSql>,
    outbox: Arc<MySqlOutbox>,
    /// The server's durability settings were checked (on the first claim).
    checked: Arc<tokio::sync::OnceCell<()>>,
    /// The Kafka offsets table (offsets-in-the-database mode).
    #[cfg(feature = "kafka")]
    kafka_offsets: Arc<crate::store::kafka_offsets::OffsetSql>,
}

#[derive(Debug)]
struct MySqlSql {
    table: crate::table::TableName,
    namespace: &'static str,
    claim: Arc<str>,
    /// Takes over an expired marker, locked by the claim statement.
    take_over: Arc<str>,
    /// Reads, completes and undoes one marker.
    marker: MarkerSql,
    purge: Arc<str>,
    ddl: Vec<String>,
    purge_batch: u64,
}

/// Configures a [`MySqlStore`]: see [`SqlStoreBuilder`](crate::store::SqlStoreBuilder).
pub type MySqlStoreBuilder = SqlStoreBuilder<MySqlPool>;

impl SqlStoreBuilder<MySqlPool> {
    /// The store, or [`Error::Config`] for an invalid setting.
    pub fn build(self) -> Result<MySqlStore, Error> {
        let outbox = self.outbox_settings()?;
        #[cfg(feature = "kafka")]
        let kafka_offsets = self.kafka_offsets_settings()?;
        let (pool, table, purge_batch) = self.into_parts()?;
        let mut store = MySqlStore::assemble(pool, table, purge_batch);
        store.outbox = Arc::new(mysql_outbox(&outbox));
        #[cfg(feature = "kafka")]
        {
            store.kafka_offsets = crate::store::kafka_offsets::OffsetSql::mysql(&kafka_offsets);
        }
        Ok(store)
    }
}

/// The store's outbox table (statements in `outbox.rs`).
type MySqlOutbox = OutboxParts<MySqlOutboxSql>;

fn mysql_outbox(settings: &(crate::table::TableName, Duration)) -> MySqlOutbox {
    OutboxParts::new(
        settings,
        '`',
        include_str!("../../../sql/mysql_outbox.sql"),
        MySqlOutboxSql::new,
    )
}

impl MySqlStore {
    fn assemble(pool: MySqlPool, table: crate::table::TableName, purge_batch: u32) -> MySqlStore {
        let t = table.quoted('`');
        let expired = "expires_at <= UTC_TIMESTAMP(3)";
        let sql = MySqlSql {
            claim: format!(
                "INSERT INTO {t} (scope, message_id, processed_at, expires_at, fingerprint) \
                 VALUES (?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL ? MICROSECOND, ?) \
                 ON DUPLICATE KEY UPDATE \
                 fingerprint = IF(LAST_INSERT_ID(IF({expired}, {CLAIM_EXPIRED}, {CLAIM_LIVE})) = \
                 {CLAIM_INSERTED}, NULL, fingerprint)"
            )
            .into(),
            take_over: format!(
                "UPDATE {t} SET fingerprint = ?, result = NULL, processed_at = UTC_TIMESTAMP(3), \
                 expires_at = UTC_TIMESTAMP(3) + INTERVAL ? MICROSECOND WHERE scope = ? AND message_id = ?"
            )
            .into(),
            marker: MarkerSql::new(
                &t,
                |_| "?".to_owned(),
                // `UTC_TIMESTAMP(3)` is the statement's start: after any wait
                // of the claim's.
                |ttl| format!("UTC_TIMESTAMP(3) + INTERVAL (LEAST({ttl}, {MAX_TTL_MILLIS}) * 1000) MICROSECOND"),
            ),
            purge: format!("DELETE FROM {t} WHERE {expired} LIMIT ?").into(),
            ddl: ddl(include_str!("../../../sql/mysql.sql"), &table, '`'),
            purge_batch: u64::from(purge_batch),
            namespace: namespace(&pool, &table),
            table,
        };
        MySqlStore {
            pool,
            sql: Arc::new(sql),
            outbox: Arc::new(mysql_outbox(&(
                crate::table::TableName::outbox(),
                DEFAULT_OUTBOX_RETENTION,
            ))),
            checked: Arc::default(),
            #[cfg(feature = "kafka")]
            kafka_offsets: crate::store::kafka_offsets::OffsetSql::mysql(&crate::table::TableName::kafka_offsets()),
        }
    }

    /// A store on `pool` with the default table, `processed_messages`.
    pub fn new(pool: MySqlPool) -> Self {
        MySqlStore::assemble(
            pool,
            crate::table::TableName::default(),
            crate::store::sql::DEFAULT_PURGE_BATCH,
        )
    }

    /// A builder to set the table name and purge batch size.
    pub fn builder(pool: MySqlPool) -> MySqlStoreBuilder {
        SqlStoreBuilder::new(pool)
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &MySqlPool {
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

    pub(crate) fn outbox(&self) -> &MySqlOutbox {
        &self.outbox
    }

    /// Creates the marker table with its `expires_at` index if it does not
    /// exist (the DDL of `sql/mysql.sql`, one `CREATE TABLE IF NOT EXISTS`
    /// statement). Safe to run concurrently.
    ///
    /// With the `kafka` feature it also creates the Kafka offsets table
    /// (`sql/mysql_kafka_offsets.sql`, default `idempotent_kafka_offsets`), where a
    /// consumer in offsets-in-the-database mode keeps its partitions' offsets.
    pub async fn migrate(&self) -> Result<(), Error> {
        for statement in self
            .sql
            .ddl
            .iter()
            .chain(&self.outbox.ddl)
            .chain(self.kafka_offsets_ddl())
        {
            match sqlx::query(AssertSqlSafe(statement.as_str())).execute(&self.pool).await {
                Ok(_) => {}
                // A concurrent migration created it between the existence
                // check and the creation.
                Err(error) if error_number(&error) == Some(ER_TABLE_EXISTS) => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }

    /// Deletes expired markers in batches of the configured size, each its
    /// own short READ COMMITTED transaction; returns how many were deleted.
    ///
    /// A marker being taken over by a claim is waited for, then kept if the
    /// claim commits.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        self.delete_in_batches(&self.sql.purge, None).await
    }

    /// Runs the `DELETE ... LIMIT ?` `statement` (binding `age_micros`
    /// first when given) until it deletes less than a batch, each batch its
    /// own READ COMMITTED transaction retried on deadlocks.
    pub(crate) async fn delete_in_batches(&self, statement: &str, age_micros: Option<i64>) -> Result<u64, Error> {
        delete_in_batches(self.sql.purge_batch, || async move {
            let mut retry = Retry::default();
            loop {
                match self.delete_batch(statement, age_micros).await {
                    Ok(deleted) => return Ok(deleted),
                    Err(error) => retry.after(error, "purge").await?,
                }
            }
        })
        .await
    }

    async fn delete_batch(&self, statement: &str, age_micros: Option<i64>) -> Result<u64, sqlx::Error> {
        let mut tx = self.begin().await?;
        let mut query = sqlx::query(AssertSqlSafe(statement));
        if let Some(age) = age_micros {
            query = query.bind(age);
        }
        let deleted = query
            .bind(self.sql.purge_batch)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit_plain().await?;
        Ok(deleted)
    }

    pub(crate) async fn begin(&self) -> Result<Tx<MySql>, sqlx::Error> {
        Tx::begin(&self.pool, BEGIN_READ_COMMITTED).await
    }

    /// One claim transaction: `Ok(Fresh)` holding the marker, `Ok(Done)`
    /// with the live marker's `(fingerprint, result)`, or the database error
    /// (retried by the caller when it is a deadlock or lock wait timeout).
    async fn try_claim(&self, req: &Request<'_>) -> Result<Attempt, sqlx::Error> {
        let mut tx = self.begin().await?;
        if self.claim_statement(&mut tx, req).await? {
            return Ok(Attempt::Fresh(tx));
        }
        if !req.needs_read() {
            // A `()` handler without fingerprint replays `()` whatever the
            // marker holds: no read. The dropped transaction's ROLLBACK is
            // queued and sent with the connection's release.
            tx.release();
            return Ok(Attempt::Done {
                fingerprint: None,
                result: None,
            });
        }
        // A live marker: the claim statement holds an exclusive lock on it,
        // so it cannot change or vanish before this read, which at READ
        // COMMITTED sees its committed values.
        let (fingerprint, result) = self.read_marker(&mut tx, req).await?;
        tx.rollback().await?;
        Ok(Attempt::Done { fingerprint, result })
    }
}

impl ClaimSql for MySqlStore {
    type Db = MySql;

    async fn claim_statement(&self, conn: &mut sqlx::MySqlConnection, req: &Request<'_>) -> Result<bool, sqlx::Error> {
        let ttl_micros = req.ttl_millis().saturating_mul(1000).min(MAX_TTL_MICROS);
        let fingerprint = req.fingerprint().map(|f| f.as_str());
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim)))
            .bind(req.scope())
            .bind(req.key())
            .bind(ttl_micros)
            .bind(fingerprint)
            .execute(&mut *conn)
            .await?;
        match (done.last_insert_id(), done.rows_affected()) {
            (CLAIM_INSERTED, 1) => Ok(true),
            (CLAIM_LIVE, _) => Ok(false),
            (CLAIM_EXPIRED, _) => {
                let taken = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.take_over)))
                    .bind(fingerprint)
                    .bind(ttl_micros)
                    .bind(req.scope())
                    .bind(req.key())
                    .execute(conn)
                    .await?
                    .rows_affected();
                if taken == 1 {
                    Ok(true)
                } else {
                    Err(sqlx::Error::Protocol(format!(
                        "the expired marker locked by the MySQL claim statement was not taken over \
                         ({taken} rows affected)"
                    )))
                }
            }
            (id, rows) => Err(sqlx::Error::Protocol(format!(
                "unexpected outcome of the MySQL claim statement (last_insert_id {id}, {rows} rows affected)"
            ))),
        }
    }

    fn marker_sql(&self) -> &MarkerSql {
        &self.sql.marker
    }

    fn outbox_table(&self) -> &Arc<crate::store::sql::OutboxTable> {
        &self.outbox.table
    }
}

enum Attempt {
    Fresh(Tx<MySql>),
    Done {
        fingerprint: Option<String>,
        result: Option<String>,
    },
}

/// The MySQL error number of a database error.
fn error_number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()?
        .try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

/// The wait before retrying a transaction InnoDB aborted: 2 ms doubling up
/// to 100 ms, jittered so that the transactions that deadlocked do not meet
/// again.
const DEADLOCK_BACKOFF: Backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));

/// Bounded retries of a transaction that InnoDB aborted for a deadlock or a
/// lock wait timeout.
#[derive(Default)]
struct Retry {
    deadlocks: u32,
    lock_wait_timeouts: u32,
}

impl Retry {
    /// Sleeps before the next attempt when `error` is retryable and the
    /// budget allows it; otherwise gives the error back.
    async fn after(&mut self, error: sqlx::Error, what: &'static str) -> Result<(), Error> {
        let (count, budget) = match error_number(&error) {
            Some(ER_LOCK_DEADLOCK) => (&mut self.deadlocks, MAX_DEADLOCK_ATTEMPTS - 1),
            Some(ER_LOCK_WAIT_TIMEOUT) => (&mut self.lock_wait_timeouts, MAX_LOCK_WAIT_TIMEOUTS),
            _ => return Err(error.into()),
        };
        if *count >= budget {
            return Err(error.into());
        }
        *count += 1;
        let attempt = self.deadlocks + self.lock_wait_timeouts;
        tracing::debug!(target: "idempotent", %error, attempt, what, "retrying the MySQL transaction");
        drop(error);
        tokio::time::sleep(DEADLOCK_BACKOFF.jittered(attempt)).await;
        Ok(())
    }
}

impl Store for MySqlStore {
    type Guard = SqlGuard<MySql>;

    fn namespace(&self) -> Option<&'static str> {
        Some(self.sql.namespace)
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<Self::Guard>, Error> {
        // In a task of its own, like the claim's BEGIN: a claim cancelled
        // during this query must not take the pool's connection with it
        // (see `crate::store::tx`).
        self.checked
            .get_or_init(|| async {
                let pool = self.pool.clone();
                let _ = tokio::spawn(async move { warn_about_durability(&pool).await }).await;
            })
            .await;
        if let Some(claim) = claim_in_running_batch(self, self.sql.namespace, req).await? {
            return Ok(claim);
        }
        let mut retry = Retry::default();
        let attempt = loop {
            match self.try_claim(req).await {
                Ok(attempt) => break attempt,
                Err(error) => retry.after(error, "claim").await?,
            }
        };
        match attempt {
            Attempt::Fresh(tx) => Ok(self.fresh_guard(tx, req, None)),
            Attempt::Done { fingerprint, result } => {
                req.check_fingerprint(fingerprint.as_deref())?;
                Ok(Claim::Done(Replay::new(result)))
            }
        }
    }
}

/// Warns (once per store, on its first claim) when InnoDB does not flush its
/// log at each commit: the message is acknowledged after the commit, and a
/// server crash could then lose an acknowledged message's effect. The
/// setting is global (a session cannot turn it back on), so this is a
/// warning, not a fix.
async fn warn_about_durability(pool: &MySqlPool) {
    let flush: Result<i64, sqlx::Error> = sqlx::query_scalar("SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)")
        .fetch_one(pool)
        .await;
    if let Ok(flush) = flush
        && flush != 1
    {
        tracing::warn!(
            target: "idempotent",
            innodb_flush_log_at_trx_commit = flush,
            "InnoDB does not flush its log at each commit: a server crash can lose the last commits, whose \
             messages were already acknowledged; set innodb_flush_log_at_trx_commit = 1 on the markers' server"
        );
    }
}

/// `mysql://host:port/database/table` (the socket path for a socket).
fn namespace(pool: &MySqlPool, table: &crate::table::TableName) -> &'static str {
    let options = pool.connect_options();
    let host = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let database = options.get_database().unwrap_or_default();
    crate::scope::intern_namespace(format!("mysql://{host}/{database}/{table}"))
}

impl TransactionalStore for MySqlStore {
    type Database = MySql;
}

impl crate::batch::BatchStore for MySqlStore {
    /// A transaction begun like a claim's (Read Committed).
    async fn begin_batch(&self) -> Result<crate::batch::Batch, Error> {
        let tx = self.begin().await?;
        Ok(crate::batch::Batch::new(self.sql.namespace, tx, None, None))
    }
}

impl crate::store::StagesOutbox for MySqlStore {}

sql_backend!(
    MySql,
    sqlx::MySqlConnection,
    true,
    stage_outbox,
    crate::store::sql::plain_commit,
    holds_transaction,
    retire
);

/// Whether the session is in a transaction, on MariaDB.
const IN_TRANSACTION: &str = "SELECT CAST(@@in_transaction AS SIGNED)";

/// The same question on MySQL, which has no `@@in_transaction`: refused
/// inside a transaction ([`ER_CANT_CHANGE_TX_CHARACTERISTICS`]); outside
/// one it only sets the next transaction's level to the one every claim
/// begins with.
const SET_NEXT_TRANSACTION: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// `ER_UNKNOWN_SYSTEM_VARIABLE`.
const ER_UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;
/// `ER_CANT_CHANGE_TX_CHARACTERISTICS`.
const ER_CANT_CHANGE_TX_CHARACTERISTICS: u16 = 1568;

/// A server answered that it has no `@@in_transaction` (MySQL): the proof
/// asks with [`SET_NEXT_TRANSACTION`] from then on.
static NO_IN_TRANSACTION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// [`SqlBackend::holds_transaction`](crate::store::sql::SqlBackend::holds_transaction)
/// on MySQL/MariaDB: whether the session is still in a transaction. InnoDB
/// rolls a deadlock victim's whole transaction back (marker, effect,
/// everything) and the session goes on in autocommit, where every statement
/// commits on its own and `COMMIT` succeeds on nothing.
async fn holds_transaction(conn: &mut sqlx::MySqlConnection) -> Result<bool, sqlx::Error> {
    use std::sync::atomic::Ordering;
    if !NO_IN_TRANSACTION.load(Ordering::Relaxed) {
        match sqlx::query_scalar::<_, i64>(IN_TRANSACTION).fetch_one(&mut *conn).await {
            Ok(open) => return Ok(open != 0),
            Err(error) if error_number(&error) == Some(ER_UNKNOWN_SYSTEM_VARIABLE) => {
                NO_IN_TRANSACTION.store(true, Ordering::Relaxed);
            }
            Err(error) => return Err(error),
        }
    }
    match sqlx::raw_sql(SET_NEXT_TRANSACTION).execute(conn).await {
        Ok(_) => Ok(false),
        Err(error) if error_number(&error) == Some(ER_CANT_CHANGE_TX_CHARACTERISTICS) => Ok(true),
        Err(error) => Err(error),
    }
}

/// [`SqlBackend::retire`](crate::store::sql::SqlBackend::retire) on
/// MySQL/MariaDB: the session kills itself (`KILL` of its own id, which any
/// user may do); the errors this draws are the point.
async fn retire(conn: &mut sqlx::MySqlConnection) {
    let id: Result<u64, _> = sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await;
    if let Ok(id) = id {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!("KILL {id}")))
            .execute(&mut *conn)
            .await;
    }
}

impl crate::janitor::PurgeExpired for MySqlStore {
    /// Expired markers, then dispatched outgoing messages past the
    /// retention.
    async fn purge_expired(&self) -> Result<u64, Error> {
        Ok(MySqlStore::purge_expired(self).await? + self.purge_dispatched().await?)
    }

    /// `GET_LOCK(name, 0)` with a name derived from the database and the
    /// marker and outbox tables (`GET_LOCK` names are per server), on a
    /// connection of its own opened with the pool's options: it does not
    /// take one of the pool's connections, and the server frees the lock when
    /// that connection closes, whether the round ends, its future is dropped
    /// or the process dies.
    async fn try_lock_janitor(&self) -> Result<Option<crate::janitor::JanitorLock>, Error> {
        // The database's name is part of the lock's: GET_LOCK names are per
        // server.
        let options = self.pool.connect_options();
        let digest = crate::janitor::lock_digest(&[
            "mysql",
            options.get_database().unwrap_or_default(),
            &self.sql.table.to_string(),
            &self.outbox.table.quoted,
        ]);
        // GET_LOCK names are at most 64 characters: 19 + 40.
        let name: String = std::iter::once("idempotent-janitor:".to_owned())
            .chain(digest[..20].iter().map(|byte| format!("{byte:02x}")))
            .collect();
        crate::janitor::session_lock::<sqlx::MySqlConnection, _>(
            &options,
            self.pool.options().get_acquire_timeout(),
            (
                "SELECT CAST(COALESCE(GET_LOCK(?, 0), 0) AS SIGNED)",
                "SELECT RELEASE_LOCK(?)",
            ),
            name,
        )
        .await
    }
}
