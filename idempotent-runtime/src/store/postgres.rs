//! `PgStore`: markers in a PostgreSQL table, claimed inside the handler's
//! transaction.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};

use crate::Error;
use crate::store::postgres_outbox::{PgOutboxSql, stage_outbox};
use crate::store::sql::{DEFAULT_OUTBOX_RETENTION, OutboxParts, SqlGuard, SqlStoreBuilder, ddl, sql_backend};
use crate::store::{Claim, Replay, Request, Store, TransactionalStore};

/// Begins the claim's transaction at Read Committed, whatever
/// `default_transaction_isolation` says.
const BEGIN_READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// The same, for sessions whose `synchronous_commit` is `off`: a commit
/// that returns before it is durable would let the broker's message be
/// acknowledged for an effect that a server crash then loses.
const BEGIN_READ_COMMITTED_DURABLE: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit = on";

/// A PostgreSQL store: the marker is inserted in the same transaction as the
/// handler's effect, so both commit or neither does.
///
/// The transaction runs at Read Committed whatever the server's or role's
/// `default_transaction_isolation`, and with `synchronous_commit` on when
/// the sessions have it `off` (the message is acknowledged after the
/// commit, so the commit must be durable). A concurrent duplicate waits on the
/// marker's primary key until the first call commits (then it replays the
/// result) or rolls back (then it runs the body itself). Expiry is computed
/// by the database clock.
///
/// Cloning is cheap: clones share the pool.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    sql: Arc<PgSql>,
    outbox: Arc<PgOutbox>,
    /// How claims begin, decided on the first claim from the sessions'
    /// `synchronous_commit`.
    begin: Arc<tokio::sync::OnceCell<&'static str>>,
}

#[derive(Debug)]
struct PgSql {
    table: crate::table::TableName,
    namespace: &'static str,
    claim: Arc<str>,
    read: Arc<str>,
    write_result: Arc<str>,
    purge: Arc<str>,
    ddl: Vec<String>,
    purge_batch: i64,
}

/// Configures a [`PgStore`]: see [`SqlStoreBuilder`](crate::store::SqlStoreBuilder).
pub type PgStoreBuilder = SqlStoreBuilder<PgPool>;

impl SqlStoreBuilder<PgPool> {
    /// The store, or [`Error::Config`] for an invalid setting.
    pub fn build(self) -> Result<PgStore, Error> {
        let outbox = self.outbox_settings()?;
        let (pool, table, purge_batch) = self.into_parts()?;
        Ok(PgStore::assemble(pool, table, purge_batch).with_outbox(&outbox))
    }
}

/// The store's outbox table (statements in `postgres_outbox.rs`).
type PgOutbox = OutboxParts<PgOutboxSql>;

fn pg_outbox(settings: &(crate::table::TableName, std::time::Duration)) -> PgOutbox {
    OutboxParts::new(
        settings,
        '"',
        include_str!("../../sql/postgres_outbox.sql"),
        PgOutboxSql::new,
    )
}

impl PgStore {
    fn assemble(pool: PgPool, table: crate::table::TableName, purge_batch: u32) -> PgStore {
        let t = table.quoted('"');
        let sql = PgSql {
            // The plain upsert: the cheapest statement for a fresh message
            // (a one-statement "claim or read" CTE was measured: it saved a
            // round trip per duplicate but cost ~38 us of server CPU on every
            // fresh message; see docs/benchmarks.md).
            claim: format!(
                "INSERT INTO {t} AS m (scope, message_id, processed_at, expires_at, fingerprint) \
                 VALUES ($1, $2, now(), now() + $3 * interval '1 millisecond', $4) \
                 ON CONFLICT (scope, message_id) DO UPDATE \
                 SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, \
                     fingerprint = EXCLUDED.fingerprint, result = NULL \
                 WHERE m.expires_at <= now() \
                 RETURNING true"
            )
            .into(),
            read: format!("SELECT fingerprint, result FROM {t} WHERE scope = $1 AND message_id = $2").into(),
            write_result: format!("UPDATE {t} SET result = $1 WHERE scope = $2 AND message_id = $3").into(),
            // By ctid: the planner deletes exactly the locked batch through
            // the expiry index (a `(scope, message_id) IN (..)` form was
            // planned as a hash join over the whole table: 14x slower).
            purge: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM {t} WHERE expires_at <= now() \
                 LIMIT $1 FOR UPDATE SKIP LOCKED))"
            )
            .into(),
            ddl: ddl(include_str!("../../sql/postgres.sql"), &table, '"'),
            purge_batch: i64::from(purge_batch),
            namespace: namespace(&pool, &table),
            table,
        };
        PgStore {
            pool,
            sql: Arc::new(sql),
            outbox: Arc::new(pg_outbox(&(
                crate::table::TableName::outbox(),
                DEFAULT_OUTBOX_RETENTION,
            ))),
            begin: Arc::default(),
        }
    }

    fn with_outbox(mut self, settings: &(crate::table::TableName, std::time::Duration)) -> PgStore {
        self.outbox = Arc::new(pg_outbox(settings));
        self
    }

    pub(crate) fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    pub(crate) fn purge_batch(&self) -> i64 {
        self.sql.purge_batch
    }

    /// A store on `pool` with the default table, `processed_messages`.
    pub fn new(pool: PgPool) -> Self {
        PgStore::assemble(
            pool,
            crate::table::TableName::default(),
            crate::store::sql::DEFAULT_PURGE_BATCH,
        )
    }

    /// A builder to set the table name and purge batch size.
    pub fn builder(pool: PgPool) -> PgStoreBuilder {
        SqlStoreBuilder::new(pool)
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The marker table.
    pub fn table(&self) -> &crate::table::TableName {
        &self.sql.table
    }

    /// Creates the marker table and its `expires_at` index, and the outbox
    /// table and its indexes, if they do not exist (the DDL of
    /// `sql/postgres.sql` and `sql/postgres_outbox.sql`). Safe to run
    /// concurrently.
    pub async fn migrate(&self) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        // Concurrent CREATE TABLE IF NOT EXISTS can still collide in the
        // catalog; serialize migrations with a transaction-scoped lock.
        sqlx::query("SELECT pg_advisory_xact_lock(7306369421585737536)")
            .execute(&mut *tx)
            .await?;
        for statement in self.sql.ddl.iter().chain(&self.outbox.ddl) {
            sqlx::query(AssertSqlSafe(statement.as_str())).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Deletes expired markers, in batches of the configured size (each its
    /// own short statement, skipping rows that claims hold locked); returns
    /// how many were deleted.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        let mut total = 0;
        loop {
            let deleted = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
                .bind(self.sql.purge_batch)
                .execute(&self.pool)
                .await?
                .rows_affected();
            total += deleted;
            if deleted < self.sql.purge_batch as u64 {
                return Ok(total);
            }
        }
    }
}

impl PgStore {
    /// The statement that begins a claim: with `synchronous_commit` forced
    /// back on when the sessions run with it `off` (asked once per store).
    async fn begin_statement(&self) -> Result<&'static str, Error> {
        let begin = self
            .begin
            .get_or_try_init(|| async {
                let setting: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
                    .fetch_one(&self.pool)
                    .await?;
                if setting == "off" {
                    tracing::info!(
                        target: "idempotent",
                        "synchronous_commit is off for this pool's sessions: claims set it on for their own \
                         transactions, so an acknowledged message's effect cannot be lost by a server crash"
                    );
                    Ok::<_, Error>(BEGIN_READ_COMMITTED_DURABLE)
                } else {
                    Ok(BEGIN_READ_COMMITTED)
                }
            })
            .await?;
        Ok(begin)
    }
}

impl Store for PgStore {
    type Guard = SqlGuard<Postgres>;

    fn namespace(&self) -> Option<&'static str> {
        Some(self.sql.namespace)
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<Self::Guard>, Error> {
        // Read Committed whatever the server's or role's default: at
        // Repeatable Read or Serializable a concurrent duplicate fails with
        // a serialization error (40001) instead of waiting for the first
        // claim and then replaying its result.
        let begin = self.begin_statement().await?;
        let mut tx = self.pool.begin_with(begin).await?;
        let claimed = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim)))
            .bind(req.scope())
            .bind(req.key())
            .bind(req.ttl_millis())
            .bind(req.fingerprint().map(|f| f.as_str()))
            .fetch_optional(&mut *tx)
            .await?
            .is_some();
        if claimed {
            return Ok(Claim::Fresh(SqlGuard::new(
                tx,
                Arc::clone(&self.sql.write_result),
                Arc::clone(&self.outbox.table),
                req,
                None,
            )));
        }
        if !req.needs_read() {
            // A `()` handler without fingerprint replays `()` whatever the
            // marker holds: no read. The dropped transaction's ROLLBACK is
            // queued and sent with the connection's release.
            drop(tx);
            return Ok(Claim::Done(Replay::default()));
        }
        // A live marker exists: ON CONFLICT DO UPDATE locked it, so it cannot
        // vanish before this read (a new snapshot, so it also sees a marker
        // committed by a concurrent claim this one waited for).
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.read)))
            .bind(req.scope())
            .bind(req.key())
            .fetch_one(&mut *tx)
            .await?;
        // Nothing to undo: dropping the transaction queues its ROLLBACK,
        // sent when the connection returns to the pool, saving a round trip.
        drop(tx);
        let fingerprint: Option<String> = row.try_get("fingerprint")?;
        req.check_fingerprint(fingerprint.as_deref())?;
        Ok(Claim::Done(Replay::new(row.try_get("result")?)))
    }
}

/// `postgres://host:port/database/table` (the socket path for a socket).
fn namespace(pool: &PgPool, table: &crate::table::TableName) -> &'static str {
    let options = pool.connect_options();
    let host = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let database = options.get_database().unwrap_or(options.get_username());
    crate::scope::intern_namespace(format!("postgres://{host}/{database}/{table}"))
}

impl TransactionalStore for PgStore {
    type Database = Postgres;
}

impl crate::store::StagesOutbox for PgStore {}

sql_backend!(Postgres, sqlx::PgConnection, stage_outbox);

impl crate::janitor::PurgeExpired for PgStore {
    /// Expired markers, then dispatched outgoing messages past the
    /// retention.
    async fn purge_expired(&self) -> Result<u64, Error> {
        Ok(PgStore::purge_expired(self).await? + self.purge_dispatched().await?)
    }

    /// A session advisory lock (`pg_try_advisory_lock`) named after the
    /// marker and outbox tables, on a connection of its own opened with the
    /// pool's options: it does not take one of the pool's connections, and
    /// the server frees the lock when that connection closes, whether the
    /// round ends, its future is dropped or the process dies. It needs a
    /// session of its own: not through a pooler in transaction mode.
    async fn try_lock_janitor(&self) -> Result<Option<crate::janitor::JanitorLock>, Error> {
        use sqlx::Connection;
        let digest = crate::janitor::lock_digest(&["postgres", &self.sql.table.to_string(), &self.outbox.table.quoted]);
        let mut key = [0; 8];
        key.copy_from_slice(&digest[..8]);
        let key = i64::from_be_bytes(key);
        let mut conn: sqlx::PgConnection =
            crate::janitor::lock_connection(&*self.pool.connect_options(), self.pool.options().get_acquire_timeout())
                .await?;
        let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut conn)
            .await?;
        if !held {
            let _ = conn.close().await;
            return Ok(None);
        }
        Ok(Some(crate::janitor::JanitorLock::new(async move {
            // Closing the session frees the lock even if the unlock fails.
            let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(key)
                .execute(&mut conn)
                .await;
            let _ = conn.close().await;
        })))
    }
}
