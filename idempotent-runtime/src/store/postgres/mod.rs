//! `PgStore`: markers in a PostgreSQL table, claimed inside the handler's
//! transaction.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};

use crate::Error;
use crate::batch::{BulkOutcome, BulkRequest, Gathered};
use crate::store::postgres::outbox::{PgOutboxSql, stage_outbox};
use crate::store::postgres::partitions::{PartitionSettings, Partitions};
use crate::store::sql::{
    BatchClaim, ClaimSql, DEFAULT_OUTBOX_RETENTION, MarkerSql, OutboxParts, SqlGuard, SqlStoreBuilder,
    claim_in_running_batch, ddl, delete_in_batches, replay, sql_backend,
};
use crate::store::tx::Tx;
use crate::store::{Claim, Replay, Request, Store, TransactionalStore};

pub(crate) mod outbox;
pub(crate) mod partitions;

/// Begins the claim's transaction at Read Committed, whatever
/// `default_transaction_isolation` says.
pub(crate) const BEGIN_READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Begins a single claim's transaction while the sessions have shown no
/// other default than Read Committed: the claim statement checks the level
/// ([`AT_READ_COMMITTED`]). Setting the level in `BEGIN` marks the
/// settings changed, and at the end of every such transaction PostgreSQL
/// (before 16) walks all of them to reset them (`AtEOXact_GUC`: 2.2-2.7 us
/// of server CPU per fresh message under pgbench; docs/archive/benchmarks.md).
const BEGIN_PLAIN: &str = "BEGIN";

/// The first condition of every claim statement: true at Read Committed;
/// at any other level the statement fails (22P02, with
/// [`NOT_READ_COMMITTED`] in the message) before it reads or writes
/// anything, and the claim begins again with [`BEGIN_READ_COMMITTED`]. So a
/// claim never runs at Repeatable Read or Serializable, where a concurrent
/// duplicate fails with a serialization error (40001) instead of waiting
/// for the first claim, whatever the sessions' default and whenever it
/// changes (`ALTER ROLE .. SET`, a new connection's options).
const AT_READ_COMMITTED: &str = "CASE current_setting('transaction_isolation') WHEN 'read committed' THEN true \
     ELSE ('idempotent: claim not at read committed: ' || current_setting('transaction_isolation'))::boolean END";

/// The mark of [`AT_READ_COMMITTED`]'s failure.
const NOT_READ_COMMITTED: &str = "idempotent: claim not at read committed";

/// What every claim's transaction (alone or a batch's) runs before its
/// `COMMIT`, as a prepared statement (parsed once per connection):
///
/// 1. `synchronous_commit` is set back `on` for this transaction when the
///    session has it `off` at this moment (whatever the server's, the
///    database's, the role's or the session's setting, and whenever it
///    changed): a commit that returns before it is durable would let the
///    broker's message be acknowledged for an effect that a server crash
///    then loses. Other values (`local`, `remote_write`, `remote_apply`)
///    all flush the WAL locally before the commit returns, and are kept.
/// 2. The statement fails (25P02) when a statement of the body failed and
///    aborted the transaction: PostgreSQL would answer `COMMIT` with a
///    `ROLLBACK` and no error, and the message would be acknowledged for
///    nothing.
///
/// Then sqlx's own `COMMIT`. One round trip more than a bare `COMMIT`, but
/// cheaper than folding the check into the commit's round trip as one
/// simple query (`..; COMMIT; BEGIN`), which the server parses every time
/// and whose trailing empty transaction sqlx rolls back at the release
/// (`cargo bench --bench commit_end`: (q) against (n)).
const CHECK_BEFORE_COMMIT: &str = "SELECT set_config('synchronous_commit', 'on', true) \
     WHERE current_setting('synchronous_commit') = 'off'";

/// PostgreSQL's "current transaction is aborted, commands ignored until end
/// of transaction block".
const IN_FAILED_TRANSACTION: &str = "25P02";

/// [`SqlBackend::commit`](crate::store::sql::SqlBackend::commit) on
/// PostgreSQL: [`CHECK_BEFORE_COMMIT`], then `COMMIT`.
async fn commit(mut tx: sqlx::Transaction<'static, Postgres>) -> Result<(), Error> {
    match sqlx::query(CHECK_BEFORE_COMMIT).execute(&mut *tx).await {
        Ok(_) => Ok(tx.commit().await?),
        // Dropping `tx` rolls the claim back.
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(IN_FAILED_TRANSACTION) => {
            Err(Error::TransactionAborted)
        }
        Err(error) => Err(error.into()),
    }
}

/// The completion proof's question on PostgreSQL
/// ([`SqlBackend::holds_transaction`](crate::store::sql::SqlBackend::holds_transaction)),
/// one prepared statement, run before the store's own statements after the
/// body and before the claim's `COMMIT`:
///
/// 1. Whether the transaction holds what was written in it: a claim's
///    transaction has an id from its marker's insert on, and keeps it until
///    it ends; a statement run after the handler ended it (`COMMIT` or
///    `ROLLBACK` of its own) runs in a transaction of its own that has none.
/// 2. In a transaction aborted by a failed statement it fails (25P02),
///    which is the same answer: PostgreSQL would turn `COMMIT` into a
///    `ROLLBACK` without an error.
/// 3. `synchronous_commit` is set back `on` for the transaction when the
///    session has it `off` (see [`CHECK_BEFORE_COMMIT`]).
const HOLDS_TRANSACTION: &str = "SELECT txid_current_if_assigned() IS NOT NULL, \
     CASE WHEN current_setting('synchronous_commit') = 'off' THEN set_config('synchronous_commit', 'on', true) END";

/// [`SqlBackend::holds_transaction`](crate::store::sql::SqlBackend::holds_transaction)
/// on PostgreSQL: [`HOLDS_TRANSACTION`].
async fn holds_transaction(conn: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
    match sqlx::query_scalar::<_, bool>(HOLDS_TRANSACTION).fetch_one(conn).await {
        Ok(holds) => Ok(holds),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(IN_FAILED_TRANSACTION) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Every claim's conflict clause (on the marker table as `m`): an expired
/// marker is taken over, a live one is not. `DO UPDATE` locks the
/// conflicting row before it tests the `WHERE`, live or not.
const TAKE_OVER: &str = "ON CONFLICT (scope, message_id) DO UPDATE \
     SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, \
         fingerprint = EXCLUDED.fingerprint, result = NULL \
     WHERE m.expires_at <= now()";

/// Ends a batch statement's lookup of one key in the marker table: a
/// batch probes the primary key once per key, never reads the whole table.
/// Without it PostgreSQL may hash the table for the batch's keys (a
/// `NOT EXISTS` becomes a hashed subplan, a join a hash join), which is
/// cheaper only while the table is small; and a prepared statement keeps
/// the plan it chose after its first five runs until the table is analyzed
/// again (never, with autovacuum off). A batch then read every marker:
/// 80 ms a batch at 200 000 markers (`tests/batch.rs`
/// `a_batch_probes_its_keys_whatever_the_table_grew_to_since_its_statements_were_planned`).
/// `OFFSET 0` keeps the subquery whole: it runs once per key, on the index.
const PROBE_EACH_KEY: &str = "OFFSET 0";

/// The guard of the claims that take no lock on a duplicate: no live
/// marker for (`scope`, `key`) in the table `t` (`l`); `tail` ends the
/// lookup ([`PROBE_EACH_KEY`] in a batch's statement).
fn no_live_marker(t: &str, scope: &str, key: &str, tail: &str) -> String {
    format!(
        "NOT EXISTS (SELECT FROM {t} l WHERE l.scope = {scope} AND l.message_id = {key} AND l.expires_at > now(){tail})"
    )
}

/// A PostgreSQL store: the marker is inserted in the same transaction as the
/// handler's effect, so both commit or neither does.
///
/// The transaction runs at Read Committed whatever the server's or role's
/// `default_transaction_isolation` (also when it changes while the store
/// runs: the claim statement refuses another level, and the store then sets
/// it in `BEGIN`), and commits with `synchronous_commit` on whenever the
/// session has it `off` at that moment (the message is acknowledged after
/// the commit, so the commit must be durable). A handler that returns `Ok`
/// after a statement of its body failed (which aborts a PostgreSQL
/// transaction) gets [`Error::TransactionAborted`], not an acknowledgement
/// of a commit that PostgreSQL turned into a rollback. A concurrent duplicate waits on the
/// marker's primary key until the first call commits (then it replays the
/// result) or rolls back (then it runs the body itself). Expiry is computed
/// by the database clock, and set again (by `clock_timestamp()`) at the
/// commit when the claim waited or ran long, or its batch did, so that a
/// marker lives its whole ttl once committed; on a
/// [`partitioned`](PgStoreBuilder::partitioned) table it is not (a row stays
/// in its partition). A handler that ends the claim's transaction itself
/// (`COMMIT`, `ROLLBACK`) and returns `Ok` also gets
/// [`Error::TransactionAborted`].
///
/// Cloning is cheap: clones share the pool.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    sql: Arc<PgSql>,
    outbox: Arc<PgOutbox>,
    /// Set once a claim met a session whose default isolation is not Read
    /// Committed: single claims then set the level in `BEGIN`.
    set_isolation: Arc<std::sync::atomic::AtomicBool>,
    /// The Kafka offsets table (offsets-in-the-database mode).
    #[cfg(feature = "kafka")]
    kafka_offsets: Arc<crate::store::kafka_offsets::OffsetSql>,
}

#[derive(Debug)]
struct PgSql {
    table: crate::table::TableName,
    namespace: &'static str,
    /// The claim of a request that reads the live marker: `ON CONFLICT DO
    /// UPDATE` locks it, so it stays until the read.
    claim: Arc<str>,
    /// The claim of a request that reads nothing back: the same statement,
    /// guarded so that a live marker is left unlocked.
    claim_no_read: Arc<str>,
    /// Reads, completes and undoes one marker.
    marker: MarkerSql,
    /// Claims a batch's keys in one statement.
    bulk_claim: Arc<str>,
    /// Reads the live markers a batch's duplicates need.
    bulk_read: Arc<str>,
    purge: Arc<str>,
    ddl: Vec<String>,
    purge_batch: i64,
    /// The partitioned layout (`.partitioned(period)`), or `None` for the
    /// plain table purged by `DELETE`.
    partitions: Option<Arc<Partitions>>,
}

/// Configures a [`PgStore`]: see [`SqlStoreBuilder`](crate::store::SqlStoreBuilder).
pub type PgStoreBuilder = SqlStoreBuilder<PgPool, PgBuilderSettings>;

/// What only a [`PgStore`]'s builder takes: the
/// [`partitioned`](PgStoreBuilder::partitioned) layout.
#[derive(Debug, Clone, Default)]
pub struct PgBuilderSettings {
    partitions: Option<PartitionSettings>,
}

impl SqlStoreBuilder<PgPool, PgBuilderSettings> {
    /// The store, or [`Error::Config`] for an invalid setting.
    pub fn build(self) -> Result<PgStore, Error> {
        let outbox = self.outbox_settings()?;
        let partitioning = self.backend.partitions;
        #[cfg(feature = "kafka")]
        let kafka_offsets = self.kafka_offsets_settings()?;
        let (pool, table, purge_batch) = self.into_parts()?;
        let partitions = match partitioning {
            Some(settings) => Some(Partitions::new(&table, settings)?),
            None => None,
        };
        #[allow(unused_mut)]
        let mut store = PgStore::assemble(pool, table, purge_batch, partitions).with_outbox(&outbox);
        #[cfg(feature = "kafka")]
        {
            store.kafka_offsets = crate::store::kafka_offsets::OffsetSql::postgres(&kafka_offsets);
        }
        Ok(store)
    }

    /// Partitions the marker table by expiry, one partition per `period`
    /// (a whole number of seconds; bounds are multiples of it since the Unix
    /// epoch, so a day is midnight to midnight UTC): the janitor then drops
    /// whole expired partitions instead of deleting rows. See docs/operations.md,
    /// "Partitioned retention". The table must be created partitioned (by
    /// `migrate`); a store refuses a table of the other layout.
    pub fn partitioned(mut self, period: std::time::Duration) -> Self {
        let horizon = self.backend.partitions.and_then(|p| p.horizon);
        self.backend.partitions = Some(PartitionSettings { period, horizon });
        self
    }

    /// How far ahead `migrate` and the janitor create partitions (default:
    /// the default ttl, 7 days, plus one period, but at most 999 periods):
    /// a claim whose marker
    /// expires beyond it creates its partition itself, at the cost of a
    /// retry. At most 1000 partitions ahead. Only with
    /// [`partitioned`](Self::partitioned).
    pub fn partition_horizon(mut self, ahead: std::time::Duration) -> Self {
        match &mut self.backend.partitions {
            Some(settings) => settings.horizon = Some(ahead),
            None => {
                self.settings.table = Err("partition_horizon needs partitioned(period) before it".into());
            }
        }
        self
    }
}

/// The store's outbox table (statements in `outbox.rs`).
type PgOutbox = OutboxParts<PgOutboxSql>;

fn pg_outbox(settings: &(crate::table::TableName, std::time::Duration)) -> PgOutbox {
    OutboxParts::new(
        settings,
        '"',
        include_str!("../../../sql/postgres_outbox.sql"),
        PgOutboxSql::new,
    )
}

impl PgStore {
    fn assemble(
        pool: PgPool,
        table: crate::table::TableName,
        purge_batch: u32,
        partitions: Option<Partitions>,
    ) -> PgStore {
        let t = table.quoted('"');
        let template = match partitions {
            Some(_) => include_str!("../../../sql/postgres_partitioned.sql"),
            None => include_str!("../../../sql/postgres.sql"),
        };
        let sql = PgSql {
            // The plain upsert: the cheapest statement for a fresh message
            // (a one-statement "claim or read" CTE was measured: it saved a
            // round trip per duplicate but cost ~38 us of server CPU on every
            // fresh message; see docs/archive/benchmarks.md).
            claim: format!(
                "INSERT INTO {t} AS m (scope, message_id, processed_at, expires_at, fingerprint) \
                 SELECT $1, $2, now(), now() + $3 * interval '1 millisecond', $4 \
                 WHERE {AT_READ_COMMITTED} \
                 {TAKE_OVER} RETURNING true"
            )
            .into(),
            // `ON CONFLICT DO UPDATE` locks the conflicting row before
            // testing its `WHERE`: on a duplicate, a transaction id, a row
            // lock and its WAL record that a request reading nothing back
            // does not need (under pgbench 106-111 us of server CPU per
            // duplicate, 75-85 with this guard; docs/archive/benchmarks.md). The
            // `NOT EXISTS` leaves a live marker alone and inserts nothing;
            // a missing or expired marker goes on to the upsert as above,
            // and a claim committed concurrently (not in this statement's
            // snapshot) is still met by the upsert, which waits for it and
            // then finds it live.
            claim_no_read: format!(
                "INSERT INTO {t} AS m (scope, message_id, processed_at, expires_at, fingerprint) \
                 SELECT $1, $2, now(), now() + $3 * interval '1 millisecond', $4 \
                 WHERE {AT_READ_COMMITTED} AND {} \
                 {TAKE_OVER} RETURNING true",
                no_live_marker(&t, "$1", "$2", "")
            )
            .into(),
            marker: MarkerSql::new(
                &t,
                |n| format!("${n}"),
                // The statement's own clock: `now()` is the transaction's start.
                |ttl| format!("clock_timestamp() + {ttl} * interval '1 millisecond'"),
            ),
            // A batch's claims in one statement, in key order (concurrent
            // batches lock their markers in one order: no deadlock). A
            // request that reads nothing back (`$5` false) has
            // `claim_no_read`'s guard: its live marker is left alone,
            // unlocked; the others keep the locking upsert, their live
            // markers read next by `bulk_read`. The guard probes the
            // primary key once per key (see `PROBE_EACH_KEY`).
            bulk_claim: format!(
                "INSERT INTO {t} AS m (scope, message_id, processed_at, expires_at, fingerprint) \
                 SELECT u.scope, u.message_id, now(), now() + u.ttl * interval '1 millisecond', u.fingerprint \
                 FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bool[]) \
                     AS u(scope, message_id, ttl, fingerprint, reads) \
                 WHERE u.reads OR {} \
                 ORDER BY u.scope, u.message_id \
                 {TAKE_OVER} RETURNING m.scope, m.message_id",
                no_live_marker(&t, "u.scope", "u.message_id", &format!(" {PROBE_EACH_KEY}"))
            )
            .into(),
            bulk_read: format!(
                "SELECT u.scope, u.message_id, m.fingerprint, m.result \
                 FROM unnest($1::text[], $2::text[]) AS u(scope, message_id) \
                 CROSS JOIN LATERAL (SELECT l.fingerprint, l.result FROM {t} l \
                     WHERE l.scope = u.scope AND l.message_id = u.message_id {PROBE_EACH_KEY}) m"
            )
            .into(),
            // By ctid: the planner deletes exactly the locked batch through
            // the expiry index (a `(scope, message_id) IN (..)` form was
            // planned as a hash join over the whole table: 14x slower).
            purge: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM {t} WHERE expires_at <= now() \
                 LIMIT $1 FOR UPDATE SKIP LOCKED))"
            )
            .into(),
            ddl: ddl(template, &table, '"'),
            purge_batch: i64::from(purge_batch),
            partitions: partitions.map(Arc::new),
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
            set_isolation: Arc::default(),
            #[cfg(feature = "kafka")]
            kafka_offsets: crate::store::kafka_offsets::OffsetSql::postgres(&crate::table::TableName::kafka_offsets()),
        }
    }

    fn with_outbox(mut self, settings: &(crate::table::TableName, std::time::Duration)) -> PgStore {
        self.outbox = Arc::new(pg_outbox(settings));
        self
    }

    pub(crate) fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    /// The Kafka offsets table's statements (offsets-in-the-database mode).
    #[cfg(feature = "kafka")]
    pub(crate) fn kafka_offsets(&self) -> &Arc<crate::store::kafka_offsets::OffsetSql> {
        &self.kafka_offsets
    }

    /// Whether the marker table is partitioned (its claims keep their own
    /// transaction inside a batch).
    #[cfg(feature = "kafka")]
    pub(crate) fn is_partitioned(&self) -> bool {
        self.sql.partitions.is_some()
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

    pub(crate) fn purge_batch(&self) -> i64 {
        self.sql.purge_batch
    }

    /// A store on `pool` with the default table, `processed_messages`.
    pub fn new(pool: PgPool) -> Self {
        PgStore::assemble(
            pool,
            crate::table::TableName::default(),
            crate::store::sql::DEFAULT_PURGE_BATCH,
            None,
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
    ///
    /// With the `kafka` feature it also creates the Kafka offsets table
    /// (`sql/postgres_kafka_offsets.sql`, default `idempotent_kafka_offsets`), where a
    /// consumer in offsets-in-the-database mode keeps its partitions' offsets.
    ///
    /// A [`partitioned`](PgStoreBuilder::partitioned) store creates the
    /// partitioned table of `sql/postgres_partitioned.sql` instead, and its
    /// partitions from now to the horizon. Either fails with
    /// [`Error::Config`] when the table exists in the other layout (or
    /// partitioned with another period).
    ///
    /// Objects that exist are skipped without a word: the statements run
    /// with `client_min_messages = warning` (for this transaction only), so
    /// PostgreSQL sends no "already exists, skipping" notices, which sqlx
    /// would log at INFO on every start.
    pub async fn migrate(&self) -> Result<(), Error> {
        // Read Committed whatever the sessions' default, so that the
        // catalog queries after the lock see what a concurrent migration
        // committed while this one waited.
        let mut tx = self.pool.begin_with(BEGIN_READ_COMMITTED).await?;
        // Concurrent CREATE TABLE IF NOT EXISTS can still collide in the
        // catalog; serialize migrations with a transaction-scoped lock.
        sqlx::query("SELECT pg_advisory_xact_lock(7306369421585737536)")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        if self.sql.partitions.is_none() {
            let kind: Option<String> =
                sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
                    .bind(self.sql.table.quoted('"'))
                    .fetch_optional(&mut *tx)
                    .await?;
            if kind.as_deref() == Some("p") {
                return Err(Error::Config(format!(
                    "marker table {} is partitioned: build the store with `.partitioned(period)`",
                    self.sql.table
                )));
            }
        }
        for statement in self
            .sql
            .ddl
            .iter()
            .chain(&self.outbox.ddl)
            .chain(self.kafka_offsets_ddl())
        {
            sqlx::query(AssertSqlSafe(statement.as_str())).execute(&mut *tx).await?;
        }
        if let Some(partitions) = &self.sql.partitions {
            partitions.check_parent(&mut tx).await?;
        }
        tx.commit().await?;
        if let Some(partitions) = &self.sql.partitions {
            partitions.create_ahead(&self.pool).await?;
        }
        Ok(())
    }

    /// Deletes expired markers, in batches of the configured size (each its
    /// own short statement, skipping rows that claims hold locked); returns
    /// how many were deleted.
    ///
    /// On a [`partitioned`](PgStoreBuilder::partitioned) store: creates the
    /// partitions up to the horizon, then detaches (concurrently) and drops
    /// the partitions whose upper bound has passed; returns how many markers
    /// they held. Expired markers in a partition that is still current stay
    /// until it ends (at most one period).
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        if let Some(partitions) = &self.sql.partitions {
            partitions.create_ahead(&self.pool).await?;
            return partitions.drop_expired(&self.pool).await;
        }
        delete_in_batches(self.sql.purge_batch as u64, || async move {
            Ok(sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
                .bind(self.sql.purge_batch)
                .execute(&self.pool)
                .await?
                .rows_affected())
        })
        .await
    }
}

impl PgStore {
    /// Begins a single claim's transaction and runs the claim statement:
    /// with a plain `BEGIN` until a session shows another default isolation
    /// than Read Committed (the statement refuses to run there), then with
    /// the level set in `BEGIN`. Whether the claim is fresh.
    async fn claim_alone(&self, req: &Request<'_>) -> Result<(Tx<Postgres>, bool), Error> {
        use std::sync::atomic::Ordering;
        if !self.set_isolation.load(Ordering::Relaxed) {
            let mut tx = Tx::begin(&self.pool, BEGIN_PLAIN).await?;
            match self.claim_statement(&mut tx, req).await {
                Ok(claimed) => return Ok((tx, claimed)),
                Err(error) if not_read_committed(&error) => {
                    // Nothing was read or written: roll back (returning the
                    // connection first, for a pool of one) and begin again.
                    tx.release();
                    if !self.set_isolation.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            target: "idempotent",
                            "a session of this pool defaults to another isolation level than read committed: \
                             claims set read committed in their BEGIN"
                        );
                    }
                }
                Err(error) => return Err(error.into()),
            }
        }
        let mut tx = Tx::begin(&self.pool, BEGIN_READ_COMMITTED).await?;
        let claimed = self.claim_statement(&mut tx, req).await?;
        Ok((tx, claimed))
    }
}

/// Whether `error` is [`AT_READ_COMMITTED`]'s refusal.
fn not_read_committed(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().as_deref() == Some("22P02") && db.message().contains(NOT_READ_COMMITTED),
        _ => false,
    }
}

impl Store for PgStore {
    type Guard = SqlGuard<Postgres>;

    fn namespace(&self) -> Option<&'static str> {
        Some(self.sql.namespace)
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<Self::Guard>, Error> {
        if let Some(partitions) = &self.sql.partitions {
            return self.claim_partitioned(partitions, req).await;
        }
        // Outside a batch (the common case) neither the gathering nor the
        // batch's transaction applies: one check of the task's batch.
        if crate::batch::in_batch(self.sql.namespace) {
            match crate::batch::gather(self.sql.namespace, req).await {
                Some(Gathered::Fresh(ticket)) => {
                    let batch = BatchClaim::claimed(self.sql.namespace, ticket).await?;
                    let guard = batch
                        .fresh(self.marker_sql(), Arc::clone(self.outbox_table()), req)
                        .await?;
                    return Ok(Claim::Fresh(guard));
                }
                // Not read when the request needs nothing back (both `None`).
                Some(Gathered::Done { fingerprint, result }) => return replay(req, (fingerprint, result)),
                Some(Gathered::Failed(error)) => return Err(error),
                Some(Gathered::Alone) | None => {}
            }
        }
        if let Some(claim) = claim_in_running_batch(self, self.sql.namespace, req).await? {
            return Ok(claim);
        }
        // Read Committed whatever the server's or role's default: at
        // Repeatable Read or Serializable a concurrent duplicate fails with
        // a serialization error (40001) instead of waiting for the first
        // claim and then replaying its result.
        let (mut tx, claimed) = self.claim_alone(req).await?;
        if claimed {
            return Ok(self.fresh_guard(tx, req, None));
        }
        if !req.needs_read() {
            // A `()` handler without fingerprint replays `()` whatever the
            // marker holds: no read. The dropped transaction's ROLLBACK is
            // queued and sent with the connection's release.
            tx.release();
            return Ok(Claim::Done(Replay::default()));
        }
        // A live marker exists: ON CONFLICT DO UPDATE locked it (a request
        // that needs a read claims with the locking statement), so it cannot
        // vanish before this read (a new snapshot, so it also sees a marker
        // committed by a concurrent claim this one waited for).
        let marker = self.read_marker(&mut tx, req).await?;
        // Nothing to undo: dropping the transaction queues its ROLLBACK,
        // sent when the connection returns to the pool, saving a round trip.
        tx.release();
        replay(req, marker)
    }
}

impl ClaimSql for PgStore {
    type Db = Postgres;

    async fn claim_statement(&self, conn: &mut sqlx::PgConnection, req: &Request<'_>) -> Result<bool, sqlx::Error> {
        let claim = if req.needs_read() {
            &self.sql.claim
        } else {
            &self.sql.claim_no_read
        };
        <Postgres as crate::store::sql::SqlBackend>::claim_returning(conn, Arc::clone(claim), req).await
    }

    fn marker_sql(&self) -> &MarkerSql {
        &self.sql.marker
    }

    fn outbox_table(&self) -> &Arc<crate::store::sql::OutboxTable> {
        &self.outbox.table
    }
}

/// The batch's one claim statement on the store's table (see
/// [`crate::batch`]).
fn bulk_claim(sql: Arc<PgSql>) -> crate::batch::BulkClaim {
    Arc::new(move |tx, requests| {
        let sql = Arc::clone(&sql);
        Box::pin(async move {
            let mut tx = match tx.downcast::<Tx<Postgres>>() {
                Ok(tx) => tx,
                Err(other) => {
                    let error = sqlx::Error::Protocol("the batch's transaction is not PostgreSQL's".into());
                    return (other, Err(error));
                }
            };
            let outcomes = claim_all(&mut tx, &sql, &requests).await;
            let tx: Box<dyn std::any::Any + Send> = tx;
            (tx, outcomes)
        })
    })
}

/// Claims `requests` in one statement (locking the live markers of those
/// that read them); reads the live markers of those that are not fresh and
/// need their fingerprint or result, in one more.
async fn claim_all(
    conn: &mut sqlx::PgConnection,
    sql: &PgSql,
    requests: &[BulkRequest],
) -> Result<Vec<BulkOutcome>, sqlx::Error> {
    let scopes: Vec<String> = requests.iter().map(|r| r.scope.clone()).collect();
    let keys: Vec<String> = requests.iter().map(|r| r.key.clone()).collect();
    let ttls: Vec<i64> = requests.iter().map(|r| r.ttl_millis).collect();
    let fingerprints: Vec<Option<String>> = requests.iter().map(|r| r.fingerprint.clone()).collect();
    let reads: Vec<bool> = requests.iter().map(|r| r.needs_read).collect();
    let rows = sqlx::query(AssertSqlSafe(Arc::clone(&sql.bulk_claim)))
        .bind(scopes)
        .bind(keys)
        .bind(ttls)
        .bind(fingerprints)
        .bind(reads)
        .fetch_all(&mut *conn)
        .await?;
    let mut fresh = std::collections::HashSet::with_capacity(rows.len());
    for row in &rows {
        fresh.insert((row.try_get::<String, _>(0)?, row.try_get::<String, _>(1)?));
    }
    let is_fresh = |r: &BulkRequest| fresh.contains(&(r.scope.clone(), r.key.clone()));
    let unread: Vec<&BulkRequest> = requests.iter().filter(|r| r.needs_read && !is_fresh(r)).collect();
    let mut live = std::collections::HashMap::new();
    if !unread.is_empty() {
        let scopes: Vec<String> = unread.iter().map(|r| r.scope.clone()).collect();
        let keys: Vec<String> = unread.iter().map(|r| r.key.clone()).collect();
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&sql.bulk_read)))
            .bind(scopes)
            .bind(keys)
            .fetch_all(&mut *conn)
            .await?;
        for row in rows {
            let id: (String, String) = (row.try_get(0)?, row.try_get(1)?);
            let marker: (Option<String>, Option<String>) = (row.try_get(2)?, row.try_get(3)?);
            live.insert(id, marker);
        }
    }
    requests
        .iter()
        .map(|r| {
            if is_fresh(r) {
                return Ok(BulkOutcome::Fresh);
            }
            if !r.needs_read {
                return Ok(BulkOutcome::Done {
                    fingerprint: None,
                    result: None,
                });
            }
            // The claim statement locked the live marker: it is there.
            match live.remove(&(r.scope.clone(), r.key.clone())) {
                Some((fingerprint, result)) => Ok(BulkOutcome::Done { fingerprint, result }),
                None => Err(sqlx::Error::RowNotFound),
            }
        })
        .collect()
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

impl PgStore {
    /// The claim on a partitioned table (see `partitions.rs`): a
    /// per-key advisory lock, then "find a live marker or insert one" in a
    /// fresh snapshot. A claim whose expiry has no partition yet creates it
    /// (outside its transaction) and tries again.
    async fn claim_partitioned(
        &self,
        partitions: &Partitions,
        req: &Request<'_>,
    ) -> Result<Claim<SqlGuard<Postgres>>, Error> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let mut tx = Tx::begin(&self.pool, BEGIN_READ_COMMITTED).await?;
            sqlx::query(AssertSqlSafe(Arc::clone(&partitions.claim_lock)))
                .bind(req.scope())
                .bind(req.key())
                .execute(&mut *tx)
                .await?;
            let row = sqlx::query(AssertSqlSafe(Arc::clone(&partitions.claim)))
                .bind(req.scope())
                .bind(req.key())
                .bind(req.ttl_millis())
                .bind(req.fingerprint().map(|f| f.as_str()))
                .fetch_one(&mut *tx)
                .await;
            let row = match row {
                Ok(row) => row,
                Err(error) if attempts < 3 && Partitions::is_missing_partition(&error) => {
                    // Roll back first: the new partition is attached while
                    // this claim holds no lock on the table.
                    tx.release();
                    partitions.create_for_ttl(&self.pool, req.ttl_millis()).await?;
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            if row.try_get::<bool, _>("fresh")? {
                return Ok(Claim::Fresh(SqlGuard::new(
                    tx,
                    Arc::clone(&partitions.write_result),
                    Arc::clone(&self.outbox.table),
                    req,
                    None,
                )));
            }
            tx.release();
            let fingerprint: Option<String> = row.try_get("fingerprint")?;
            req.check_fingerprint(fingerprint.as_deref())?;
            return Ok(Claim::Done(Replay::new(row.try_get("result")?)));
        }
    }
}

impl TransactionalStore for PgStore {
    type Database = Postgres;
}

impl crate::batch::BatchStore for PgStore {
    /// A transaction begun like a claim's (Read Committed), and committed
    /// like one (durably; a statement failed in it rolls it back).
    /// A [`partitioned`](PgStoreBuilder::partitioned) store's claims do not
    /// join it: each keeps its own transaction (its claim may have to create
    /// a partition outside any transaction).
    async fn begin_batch(&self) -> Result<crate::batch::Batch, Error> {
        let tx = Tx::begin(&self.pool, BEGIN_READ_COMMITTED).await?;
        let bulk = match self.sql.partitions {
            Some(_) => None,
            None => Some(bulk_claim(Arc::clone(&self.sql))),
        };
        Ok(crate::batch::Batch::new(self.sql.namespace, tx, None, bulk))
    }
}

impl crate::store::StagesOutbox for PgStore {}

sql_backend!(
    Postgres,
    sqlx::PgConnection,
    false,
    stage_outbox,
    commit,
    holds_transaction,
    retire
);

/// [`SqlBackend::retire`](crate::store::sql::SqlBackend::retire) on
/// PostgreSQL: the backend terminates itself (allowed for a role's own
/// sessions); the error this draws is the point.
async fn retire(conn: &mut sqlx::PgConnection) {
    let _ = sqlx::raw_sql("SELECT pg_terminate_backend(pg_backend_pid())")
        .execute(conn)
        .await;
}

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
        let digest = crate::janitor::lock_digest(&["postgres", &self.sql.table.to_string(), &self.outbox.table.quoted]);
        let mut key = [0; 8];
        key.copy_from_slice(&digest[..8]);
        crate::janitor::session_lock::<sqlx::PgConnection, _>(
            &self.pool.connect_options(),
            self.pool.options().get_acquire_timeout(),
            (
                "SELECT pg_try_advisory_lock($1)::int::int8",
                "SELECT pg_advisory_unlock($1)",
            ),
            i64::from_be_bytes(key),
        )
        .await
    }
}
