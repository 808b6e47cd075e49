//! What the sqlx-based stores share: the claim guard (an open transaction
//! holding the new marker), the DDL template and the store settings.

use std::future::Future;
use std::sync::Arc;

use sqlx::Transaction;

use crate::Error;
use crate::batch::{Joined, ROLLBACK_TO_SAVEPOINT, SAVEPOINT};
use crate::outbox::Outbox;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use crate::store::backend::plain_commit;
pub(crate) use crate::store::backend::{SqlBackend, sql_backend};
use crate::store::tx::Tx;
use crate::store::{Guard, TransactionGuard};
use crate::table::TableName;

/// The outbox table of [`SqlStoreBuilder::outbox_table`] by default.
pub const DEFAULT_OUTBOX_TABLE: &str = "idempotent_outbox";

/// How long dispatched outgoing messages are kept, unless configured.
pub const DEFAULT_OUTBOX_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

/// Markers deleted per statement by `purge_expired`, unless configured.
pub const DEFAULT_PURGE_BATCH: u32 = 1_000;

/// The completion proof, the one check every SQL backend, every claim and
/// every path (a single call, a batch member and the batch's commit, the
/// HTTP layer's transaction, outgoing messages staged, Kafka offsets in the
/// database) makes before a statement of its own after the handler's body:
/// that the session is still inside the transaction holding the claim
/// ([`SqlBackend::holds_transaction`], the backend's dialect).
/// [`Error::TransactionAborted`] when it is not: the server rolled it back
/// under the handler (an InnoDB deadlock victim, whose session goes on in
/// autocommit), a statement aborted it (PostgreSQL), or the handler ended
/// it itself. Nothing may then be written or committed: in autocommit each
/// statement would commit on its own, and `COMMIT` would succeed on
/// nothing.
pub(crate) async fn prove_claims_held<DB: SqlBackend>(tx: &mut Tx<DB>) -> Result<(), Error> {
    if DB::holds_transaction(tx).await? {
        Ok(())
    } else {
        Err(Error::TransactionAborted)
    }
}

/// Commits a transaction holding claims (a single claim's, a batch's):
/// the completion proof ([`prove_claims_held`]), then `COMMIT`. When the
/// proof fails the transaction is rolled back (which also brings sqlx's
/// record of the session back in step with the server) and
/// [`Error::TransactionAborted`] is returned: nothing was committed.
pub(crate) async fn commit_claims<DB: SqlBackend>(mut tx: Tx<DB>, expiring: Vec<Expiring>) -> Result<(), Error> {
    if let Err(error) = prove_claims_held(&mut tx).await {
        abandon(tx).await;
        return Err(error);
    }
    for marker in expiring {
        if expiry_is_stale(tx.began(), marker.ttl_millis) {
            let refreshed =
                DB::refresh_expiry(&mut tx, marker.sql, marker.ttl_millis, &marker.scope, &marker.key).await;
            if let Err(error) = refreshed {
                abandon(tx).await;
                return Err(error.into());
            }
        }
    }
    Ok(tx.commit_plain().await?)
}

/// A marker whose expiry may have to be set again before its commit: a
/// batch member's, whose batch commits after it completed.
pub(crate) struct Expiring {
    /// The backend's [`MarkerSql::refresh_expiry`].
    sql: Arc<str>,
    ttl_millis: i64,
    scope: String,
    key: String,
}

/// Whether a marker claimed in a transaction begun at `began`, with a ttl
/// of `ttl_millis`, must have its expiry set again before its commit. The
/// claim computed it by the database clock when its statement ran (on
/// PostgreSQL at the transaction's start), which can be well before the
/// commit makes the marker visible: after a wait on a key held by a claim
/// that then rolled back, a long body, or a batch's other members. A marker
/// lives its whole ttl from its commit, to within a thousandth of it (at
/// least 10 ms): only a claim older than that pays for the `UPDATE`.
fn expiry_is_stale(began: std::time::Instant, ttl_millis: i64) -> bool {
    let slack = std::time::Duration::from_millis(u64::try_from(ttl_millis / 1000).unwrap_or(0).max(10));
    began.elapsed() > slack
}

/// Rolls back a transaction the completion proof refused.
async fn abandon<DB: SqlBackend>(tx: Tx<DB>) {
    if let Err(error) = tx.rollback().await {
        tracing::debug!(target: "idempotent", %error, "rollback after a failed completion proof failed");
    }
}

/// The claim of a transactional store: the transaction that inserted the
/// marker. The handler's body runs on it; dropping it rolls back.
pub struct SqlGuard<DB: SqlBackend> {
    tx: Tx<DB>,
    /// The completion proof ran since the body ended (before staging
    /// outgoing messages): only the store's own statements followed it.
    proven: bool,
    /// Sets the marker's expiry again from the database's clock at the
    /// completion, when the one the claim computed is stale
    /// ([`expiry_is_stale`]); `None` where it cannot move (a partitioned
    /// table's row).
    refresh_expiry: Option<Arc<str>>,
    /// The claim's ttl, in milliseconds.
    ttl_millis: i64,
    write_result_sql: Arc<str>,
    outbox: Arc<OutboxTable>,
    /// Outgoing messages were written: wake the relay after the commit.
    staged: bool,
    scope: String,
    key: String,
    _writer: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The batch this claim joined: completing leaves the transaction open
    /// for the next message, aborting rolls back to the claim's savepoint.
    batch: Option<Joined>,
}

/// A store's outbox table, as its guards write it.
#[derive(Debug)]
pub(crate) struct OutboxTable {
    /// The table, quoted for the backend.
    pub(crate) quoted: String,
    /// Notified after a commit that staged messages.
    pub(crate) waker: Arc<tokio::sync::Notify>,
}

/// A store's outbox: the guards' view of the table, the relay's statements
/// `S` (each backend's `outbox.rs`), and the DDL `migrate()` runs.
#[derive(Debug)]
pub(crate) struct OutboxParts<S> {
    pub(crate) table: Arc<OutboxTable>,
    pub(crate) sql: Arc<S>,
    pub(crate) ddl: Vec<String>,
    /// How long dispatched rows are kept.
    pub(crate) retention: std::time::Duration,
}

impl<S> OutboxParts<S> {
    /// The outbox table `name`, quoted with `quote`, created by the DDL file
    /// `template`; `sql` builds the relay's statements for the quoted name.
    pub(crate) fn new(
        (name, retention): &(TableName, std::time::Duration),
        quote: char,
        template: &str,
        sql: impl FnOnce(&str) -> S,
    ) -> Self {
        let quoted = name.quoted(quote);
        OutboxParts {
            retention: *retention,
            sql: Arc::new(sql(&quoted)),
            ddl: outbox_ddl(template, name, quote),
            table: Arc::new(OutboxTable {
                quoted,
                waker: Arc::default(),
            }),
        }
    }
}

/// `statement` with its `{ids}` replaced by one `?` per id, the ids bound
/// in order: a relay settling a round's rows on a backend with no array
/// parameters (MySQL/MariaDB, SQLite).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn bind_ids<DB>(statement: &str, ids: Vec<i64>) -> sqlx::query::Query<'static, DB, DB::Arguments>
where
    DB: sqlx::Database,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    let placeholders = vec!["?"; ids.len()].join(", ");
    let query = sqlx::query(sqlx::AssertSqlSafe(statement.replace("{ids}", &placeholders)));
    ids.into_iter().fold(query, |query, id| query.bind(id))
}

/// The multi-row `INSERT`s that stage `rows` in the outbox table `table`
/// on a backend with no array parameters (MySQL/MariaDB, SQLite): one per
/// `chunk` rows, each row written as `values` (its five `?` and its clock
/// columns), the ordering key bound as `key` makes it.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn stage_inserts<DB, K>(
    table: &str,
    values: &str,
    chunk: usize,
    rows: Vec<crate::outbox::StagedRow>,
    key: impl Fn(Option<String>) -> K,
) -> Vec<sqlx::query::Query<'static, DB, DB::Arguments>>
where
    DB: sqlx::Database,
    for<'t> String: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Vec<u8>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> K: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    let mut rows = rows.into_iter().peekable();
    let mut inserts = Vec::new();
    while rows.peek().is_some() {
        let chunk: Vec<crate::outbox::StagedRow> = rows.by_ref().take(chunk).collect();
        let insert = format!(
            "INSERT INTO {table} (message_id, destination, ordering_key, headers, payload, created_at, next_attempt_at) \
             VALUES {}",
            vec![values; chunk.len()].join(", ")
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(insert));
        inserts.push(chunk.into_iter().fold(query, |query, row| {
            query
                .bind(row.message_id)
                .bind(row.destination)
                .bind(key(row.ordering_key))
                .bind(row.headers)
                .bind(row.payload)
        }));
    }
    inserts
}

/// Writes an outbox batch as its type's name and how many rows it holds.
pub(crate) fn fmt_outbox_batch(
    f: &mut std::fmt::Formatter<'_>,
    name: &str,
    rows: &[crate::outbox::OutboxRow],
) -> std::fmt::Result {
    f.debug_struct(name).field("rows", &rows.len()).finish()
}

/// Milliseconds of `d` for a SQL parameter (saturating).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Runs `delete` (one statement deleting at most `batch` rows, returning
/// how many it deleted) until it deletes fewer than `batch`; returns the
/// total. How every SQL store purges markers and dispatched outgoing
/// messages: bounded statements, so that no transaction holds many locks.
pub(crate) async fn delete_in_batches<F, Fut>(batch: u64, mut delete: F) -> Result<u64, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, Error>>,
{
    let mut total = 0;
    loop {
        let deleted = delete().await?;
        total += deleted;
        if deleted < batch {
            return Ok(total);
        }
    }
}

/// The outgoing messages a relay's `take` statement returned, their
/// columns by name; `columns` reads the three whose types differ between
/// backends: `(id, ordering_key, attempts)`.
pub(crate) fn outbox_rows<R>(
    rows: Vec<R>,
    columns: impl Fn(&R) -> Result<(i64, Option<String>, i64), sqlx::Error>,
) -> Result<Vec<crate::outbox::OutboxRow>, sqlx::Error>
where
    R: sqlx::Row,
    &'static str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    rows.into_iter()
        .map(|row| {
            let (id, ordering_key, attempts) = columns(&row)?;
            Ok(crate::outbox::OutboxRow::new(
                id,
                row.try_get("message_id")?,
                row.try_get("destination")?,
                ordering_key,
                row.try_get::<String, _>("headers")?.as_str(),
                row.try_get("payload")?,
                attempts,
            ))
        })
        .collect()
}

/// `(count, age of the oldest in seconds)` as [`OutboxStore::pending`]
/// returns it.
///
/// [`OutboxStore::pending`]: crate::outbox::OutboxStore::pending
pub(crate) fn pending_from(count: i64, oldest_secs: Option<f64>) -> (u64, Option<std::time::Duration>) {
    (
        u64::try_from(count).unwrap_or(0),
        oldest_secs.map(|secs| std::time::Duration::from_secs_f64(secs.max(0.0))),
    )
}

impl<DB: SqlBackend> SqlGuard<DB> {
    pub(crate) fn new(
        tx: Tx<DB>,
        write_result_sql: Arc<str>,
        outbox: Arc<OutboxTable>,
        req: &crate::store::Request<'_>,
        writer: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Self {
        SqlGuard {
            tx,
            proven: false,
            refresh_expiry: None,
            ttl_millis: req.ttl_millis(),
            write_result_sql,
            outbox,
            staged: false,
            scope: req.scope().to_owned(),
            key: req.key().to_owned(),
            _writer: writer,
            batch: None,
        }
    }
}

/// The statements on one marker (by scope and key) that every SQL store
/// has, in its backend's SQL.
#[derive(Debug)]
pub(crate) struct MarkerSql {
    /// The live marker's `(fingerprint, result)`, by `(scope, key)`.
    pub(crate) read: Arc<str>,
    /// Stores the result: `(result, scope, key)`.
    pub(crate) write_result: Arc<str>,
    /// Deletes a marker claimed in a batch whose body failed, by `(scope,
    /// key)`.
    pub(crate) undo: Arc<str>,
    /// Sets the expiry again, `ttl` from the database clock's now, by
    /// `(ttl in ms, scope, key)` (see [`expiry_is_stale`]).
    pub(crate) refresh_expiry: Arc<str>,
}

impl MarkerSql {
    /// The statements on the marker table `t` (quoted), with the backend's
    /// placeholder for parameter `n` (1-based): `$n`, `?n` or `?`, and its
    /// expression of "a ttl of (the given placeholder) ms from now" on the
    /// database clock at the statement's run (not at its transaction's
    /// start).
    pub(crate) fn new(t: &str, param: impl Fn(u8) -> String, expiry: impl Fn(&str) -> String) -> Self {
        let (p1, p2, p3) = (param(1), param(2), param(3));
        MarkerSql {
            refresh_expiry: format!(
                "UPDATE {t} SET expires_at = {} WHERE scope = {p2} AND message_id = {p3}",
                expiry(&p1)
            )
            .into(),
            read: format!("SELECT fingerprint, result FROM {t} WHERE scope = {p1} AND message_id = {p2}").into(),
            write_result: format!("UPDATE {t} SET result = {p1} WHERE scope = {p2} AND message_id = {p3}").into(),
            undo: format!("DELETE FROM {t} WHERE scope = {p1} AND message_id = {p2}").into(),
        }
    }
}

/// The statements of a SQL store's claim, for the claim code its backends
/// share.
pub(crate) trait ClaimSql: Sync {
    /// The store's database.
    type Db: SqlBackend;

    /// The statements on one marker.
    fn marker_sql(&self) -> &MarkerSql;

    /// The store's outbox table, as its guards write it.
    fn outbox_table(&self) -> &Arc<OutboxTable>;

    /// Inserts the marker, or takes over an expired one: `true` when the
    /// claim is fresh.
    fn claim_statement<'a>(
        &'a self,
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        req: &'a crate::store::Request<'a>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The live marker's fingerprint and result.
    fn read_marker<'a>(
        &'a self,
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        req: &'a crate::store::Request<'a>,
    ) -> impl Future<Output = Result<(Option<String>, Option<String>), sqlx::Error>> + Send + 'a {
        Self::Db::read_marker(conn, Arc::clone(&self.marker_sql().read), req.scope(), req.key())
    }

    /// The guard of a claim made fresh on its own transaction `tx` (the
    /// SQLite writer's turn `writer` held with it).
    fn fresh_guard(
        &self,
        tx: Tx<Self::Db>,
        req: &crate::store::Request<'_>,
        writer: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> crate::store::Claim<SqlGuard<Self::Db>> {
        let marker = self.marker_sql();
        let mut guard = SqlGuard::new(
            tx,
            Arc::clone(&marker.write_result),
            Arc::clone(self.outbox_table()),
            req,
            writer,
        );
        guard.refresh_expiry = Some(Arc::clone(&marker.refresh_expiry));
        crate::store::Claim::Fresh(guard)
    }
}

/// The claim of `req` in the batch this task runs in, when that batch is
/// on the store of `namespace` (see [`crate::batch`]); `None` otherwise
/// (the common case costs one look at the task's batch), or for a call
/// nested in a body holding the batch's turn: the claim then takes its own
/// transaction.
pub(crate) async fn claim_in_running_batch<S: ClaimSql>(
    store: &S,
    namespace: &'static str,
    req: &crate::store::Request<'_>,
) -> Result<Option<crate::store::Claim<SqlGuard<S::Db>>>, Error> {
    if !crate::batch::in_batch(namespace) {
        return Ok(None);
    }
    match BatchClaim::join(namespace).await? {
        Some(batch) => claim_in_batch(store, batch, req).await.map(Some),
        None => Ok(None),
    }
}

/// The replay of a live marker `(fingerprint, result)`, after checking its
/// fingerprint.
pub(crate) fn replay<G>(
    req: &crate::store::Request<'_>,
    (fingerprint, result): (Option<String>, Option<String>),
) -> Result<crate::store::Claim<G>, Error> {
    req.check_fingerprint(fingerprint.as_deref())?;
    Ok(crate::store::Claim::Done(crate::store::Replay::new(result)))
}

/// The claim inside a batch (see [`crate::batch`]), made one by one: the
/// store's statements on the batch's transaction; a fresh claim takes a
/// savepoint.
pub(crate) async fn claim_in_batch<S: ClaimSql>(
    store: &S,
    mut batch: BatchClaim<S::Db>,
    req: &crate::store::Request<'_>,
) -> Result<crate::store::Claim<SqlGuard<S::Db>>, Error> {
    let claimed = store.claim_statement(&mut batch.tx, req).await;
    if batch.check(claimed)? {
        let guard = batch
            .fresh(store.marker_sql(), Arc::clone(store.outbox_table()), req)
            .await?;
        return Ok(crate::store::Claim::Fresh(guard));
    }
    if !req.needs_read() {
        batch.done();
        return Ok(crate::store::Claim::Done(crate::store::Replay::default()));
    }
    let marker = store.read_marker(&mut batch.tx, req).await;
    let marker = batch.check(marker)?;
    batch.done();
    replay(req, marker)
}

/// A claim made inside a batch, for each store's claim code: the batch's
/// transaction is taken for the claim statement and given back (or kept
/// by the fresh claim's guard, after its savepoint).
pub(crate) struct BatchClaim<DB: SqlBackend> {
    pub(crate) batch: Arc<crate::batch::Shared>,
    pub(crate) tx: Tx<DB>,
    turn: crate::batch::Turn,
    ticket: Option<crate::batch::FreshTicket>,
}

impl<DB: SqlBackend> BatchClaim<DB> {
    /// The batch this task runs in, when it was opened on the store of
    /// `namespace`: waits for its turn on the batch's transaction. `None`
    /// outside a batch, or for a call nested in a body holding the turn: the
    /// claim then keeps its own transaction. [`Error::BatchAborted`] once
    /// the batch is aborted.
    pub(crate) async fn join(namespace: &'static str) -> Result<Option<Self>, Error> {
        let Some((batch, turn)) = crate::batch::turn(namespace).await? else {
            return Ok(None);
        };
        let Some(tx) = batch.take::<DB>() else {
            // Taken by a guard that was dropped: the transaction is gone.
            batch.abort();
            return Err(Error::BatchAborted);
        };
        Ok(Some(BatchClaim {
            batch,
            tx,
            turn,
            ticket: None,
        }))
    }

    /// A claim the batch's statement made fresh: its body's turn.
    #[cfg(feature = "postgres")]
    pub(crate) async fn claimed(namespace: &'static str, ticket: crate::batch::FreshTicket) -> Result<Self, Error> {
        match Self::join(namespace).await {
            Ok(Some(mut claim)) => {
                claim.ticket = Some(ticket);
                Ok(claim)
            }
            // Dropping the ticket aborts the batch: its marker has no body.
            Ok(None) | Err(_) => Err(Error::BatchAborted),
        }
    }

    /// The claim statement's outcome: an error leaves the transaction
    /// unusable, so it aborts the batch.
    pub(crate) fn check<T>(&mut self, outcome: Result<T, sqlx::Error>) -> Result<T, Error> {
        outcome.map_err(|error| {
            self.batch.abort();
            error.into()
        })
    }

    /// A fresh claim: takes the savepoint its body can be undone to (when
    /// the batch has them).
    pub(crate) async fn fresh(
        mut self,
        marker: &MarkerSql,
        outbox: Arc<OutboxTable>,
        req: &crate::store::Request<'_>,
    ) -> Result<SqlGuard<DB>, Error> {
        if self.batch.savepoints()
            && let Err(error) = DB::execute_keyed(&mut self.tx, SAVEPOINT.into(), None).await
        {
            return Err(self.batch.fail(self.tx, error));
        }
        let undo = Arc::clone(&marker.undo);
        let joined = Joined::new(Arc::clone(&self.batch), undo, self.turn, self.ticket);
        let mut guard = SqlGuard::new(self.tx, Arc::clone(&marker.write_result), outbox, req, None);
        guard.refresh_expiry = Some(Arc::clone(&marker.refresh_expiry));
        guard.batch = Some(joined);
        Ok(guard)
    }

    /// Not fresh: the transaction goes back to the batch.
    pub(crate) fn done(self) {
        self.batch.give_back(self.tx);
    }
}

impl<DB: SqlBackend> std::fmt::Debug for SqlGuard<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlGuard")
            .field("scope", &self.scope)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> SqlGuard<DB> {
    /// Stores the body's result (when not unit) in the claimed marker.
    async fn write_result(&mut self, result: Option<String>) -> Result<(), sqlx::Error> {
        match result {
            Some(result) => {
                let sql = Arc::clone(&self.write_result_sql);
                DB::write_result(&mut self.tx, sql, result, &self.scope, &self.key).await
            }
            None => Ok(()),
        }
    }
}

impl<DB: SqlBackend> Guard for SqlGuard<DB> {
    async fn complete(mut self, result: Option<String>) -> Result<(), Error> {
        if let Some(joined) = self.batch.take() {
            let batch = Arc::clone(&joined.shared);
            // Where a failed statement may have left the session in
            // autocommit, before the next member's statements (on
            // PostgreSQL they would fail: the batch's commit proves it).
            if DB::FAILURE_ENDS_SILENTLY && !self.proven {
                match DB::holds_transaction(&mut self.tx).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // The batch's transaction ended under this body: every
                        // member's claim is gone, and what follows would run
                        // in autocommit. The batch is aborted (its `commit`
                        // reports it, and no member is acknowledged).
                        tracing::debug!(
                            target: "idempotent",
                            "the batch's transaction ended under a handler: batch aborted"
                        );
                        batch.abort();
                        batch.give_back(self.tx);
                        joined.disarm();
                        return Ok(());
                    }
                    Err(error) => {
                        let error = batch.fail(self.tx, error);
                        joined.disarm();
                        return Err(error);
                    }
                }
            }
            let written = self.write_result(result).await;
            if let Err(error) = written {
                let error = batch.fail(self.tx, error);
                joined.disarm();
                return Err(error);
            }
            if self.staged {
                let waker = Arc::clone(&self.outbox.waker);
                batch.after_commit(Box::new(move || waker.notify_one()));
            }
            if let Some(sql) = self.refresh_expiry.take() {
                // Its expiry counts from the batch's commit.
                batch.expiring(Expiring {
                    sql,
                    ttl_millis: self.ttl_millis,
                    scope: std::mem::take(&mut self.scope),
                    key: std::mem::take(&mut self.key),
                });
            }
            // Committed (and the message acknowledged) with the batch.
            batch.give_back(self.tx);
            joined.disarm();
            return Ok(());
        }
        if !self.proven
            && let Err(error) = prove_claims_held(&mut self.tx).await
        {
            abandon(self.tx).await;
            return Err(error);
        }
        if let Some(sql) = self.refresh_expiry.take()
            && expiry_is_stale(self.tx.began(), self.ttl_millis)
        {
            DB::refresh_expiry(&mut self.tx, sql, self.ttl_millis, &self.scope, &self.key).await?;
        }
        self.write_result(result).await?;
        self.tx.commit_plain().await?;
        if self.staged {
            self.outbox.waker.notify_one();
        }
        Ok(())
    }

    async fn abort(mut self) {
        if let Some(joined) = self.batch.take() {
            let batch = Arc::clone(&joined.shared);
            if !batch.savepoints() {
                // No savepoint to undo the body alone: nothing of the batch
                // may commit.
                batch.abort();
                batch.give_back(self.tx);
                joined.disarm();
                return;
            }
            // Undo the body, then the marker (inserted before the savepoint).
            let undone = match DB::execute_keyed(&mut self.tx, ROLLBACK_TO_SAVEPOINT.into(), None).await {
                Ok(()) => {
                    DB::execute_keyed(&mut self.tx, Arc::clone(&joined.undo), Some((&self.scope, &self.key))).await
                }
                Err(error) => Err(error),
            };
            match undone {
                Ok(()) => batch.give_back(self.tx),
                Err(error) => {
                    let error = batch.fail(self.tx, error);
                    tracing::debug!(target: "idempotent", %error, "undoing a claim in a batch failed: batch aborted");
                }
            }
            joined.disarm();
            return;
        }
        if let Err(error) = self.tx.rollback().await {
            // The connection is gone; the server rolls the transaction back.
            tracing::debug!(target: "idempotent", %error, "rollback failed");
        }
    }
}

impl<DB: SqlBackend> TransactionGuard for SqlGuard<DB> {
    type Database = DB;

    fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        self.tx.transaction()
    }

    async fn stage(&mut self, outbox: Outbox) -> Result<(), Error> {
        if outbox.is_empty() {
            return Ok(());
        }
        let rows = outbox.into_rows(&self.scope, &self.key)?;
        // Outside the claim's transaction the rows would commit on their
        // own, for an effect that did not: the proof first (the caller
        // then aborts the claim).
        prove_claims_held(&mut self.tx).await?;
        self.proven = true;
        DB::stage_outbox(&mut self.tx, &self.outbox.quoted, rows).await?;
        self.staged = true;
        Ok(())
    }
}

/// The shipped outbox DDL file with the configured outbox table in place of
/// `idempotent_outbox` (and its index names derived from it), split into
/// statements.
pub(crate) fn outbox_ddl(template: &str, table: &TableName, quote: char) -> Vec<String> {
    let body: String = template
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    // Index names `idempotent_outbox_<what>_idx`, then the table itself.
    let mut out = String::new();
    let mut rest = body.as_str();
    while let Some(at) = rest.find(DEFAULT_OUTBOX_TABLE) {
        out.push_str(&rest[..at]);
        let after = &rest[at + DEFAULT_OUTBOX_TABLE.len()..];
        if let Some(suffix) = after.strip_prefix('_') {
            let end = suffix
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(suffix.len());
            out.push_str(&format!("{quote}{}_{}{quote}", table.table(), &suffix[..end]));
            rest = &suffix[end..];
        } else {
            out.push_str(&table.quoted(quote));
            rest = after;
        }
    }
    out.push_str(rest);
    out.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The shipped DDL file with the configured table name in place of the
/// default one, split into statements.
pub(crate) fn ddl(template: &str, table: &TableName, quote: char) -> Vec<String> {
    let body: String = template
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    // One pass, so the table name is not replaced inside the index name.
    let body = body
        .split("processed_messages_expires_at_idx")
        .map(|part| part.replace("processed_messages", &table.quoted(quote)))
        .collect::<Vec<_>>()
        .join(&table.expiry_index(quote));
    body.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Configures a SQL store (`PgStoreBuilder`, `SqliteStoreBuilder`,
/// `MySqlStoreBuilder` are this type for their pool): the marker table and
/// the purge batch size; each backend's `build` validates them. `B` holds
/// what only one backend takes (PostgreSQL's partitioned layout).
#[derive(Debug, Clone)]
pub struct SqlStoreBuilder<P, B = ()> {
    pool: P,
    pub(crate) settings: Settings,
    /// The settings only this backend takes (`()` but for PostgreSQL).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) backend: B,
}

impl<P, B: Default> SqlStoreBuilder<P, B> {
    pub(crate) fn new(pool: P) -> Self {
        SqlStoreBuilder {
            pool,
            settings: Settings::default(),
            backend: B::default(),
        }
    }
}

impl<P, B> SqlStoreBuilder<P, B> {
    /// The marker table (default `processed_messages`): `table`, or
    /// `schema.table` (`database.table` on MySQL; SQLite takes a plain
    /// name). Validated by `build`.
    pub fn table(mut self, name: &str) -> Self {
        self.settings.set_table(name);
        self
    }

    /// How long dispatched outgoing messages are kept, unless configured.
    pub const DEFAULT_OUTBOX_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

    /// Markers deleted per statement by the store's `purge_expired`
    /// (default 1000).
    pub fn purge_batch(mut self, markers: u32) -> Self {
        self.settings.purge_batch = markers;
        self
    }

    /// The outbox table (default [`DEFAULT_OUTBOX_TABLE`]), where handlers'
    /// outgoing messages are written; same rules as [`table`](Self::table).
    pub fn outbox_table(mut self, name: &str) -> Self {
        self.settings.outbox = TableName::new(name).map_err(|e| e.to_string());
        self
    }

    /// How long dispatched outgoing messages stay in the outbox table before
    /// the janitor deletes them (default 1 hour): the window in which an
    /// operator can still see what was sent.
    pub fn outbox_retention(mut self, keep: std::time::Duration) -> Self {
        self.settings.outbox_retention = keep;
        self
    }

    /// The table where a Kafka consumer in offsets-in-the-database mode
    /// keeps its partitions' offsets (default
    /// [`DEFAULT_KAFKA_OFFSETS_TABLE`](crate::store::DEFAULT_KAFKA_OFFSETS_TABLE));
    /// same rules as [`table`](Self::table). `migrate()` creates it. See
    /// [`offsets_in`](crate::broker::ConsumerBuilder::offsets_in).
    #[cfg(feature = "kafka")]
    pub fn kafka_offsets_table(mut self, name: &str) -> Self {
        self.settings.kafka_offsets = TableName::new(name).map_err(|e| e.to_string());
        self
    }

    /// The validated Kafka offsets table.
    #[cfg(feature = "kafka")]
    pub(crate) fn kafka_offsets_settings(&self) -> Result<TableName, Error> {
        self.settings.kafka_offsets.clone().map_err(Error::Config)
    }

    /// The validated outbox table and its retention.
    pub(crate) fn outbox_settings(&self) -> Result<(TableName, std::time::Duration), Error> {
        let table = self.settings.outbox.clone().map_err(Error::Config)?;
        Ok((table, self.settings.outbox_retention))
    }

    /// The pool and the validated settings, or [`Error::Config`].
    pub(crate) fn into_parts(self) -> Result<(P, TableName, u32), Error> {
        Ok((self.pool, self.settings.table()?, self.settings.purge_batch()?))
    }
}

/// Settings every sqlx store takes from its builder.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) table: Result<TableName, String>,
    pub(crate) purge_batch: u32,
    pub(crate) outbox: Result<TableName, String>,
    pub(crate) outbox_retention: std::time::Duration,
    #[cfg(feature = "kafka")]
    pub(crate) kafka_offsets: Result<TableName, String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            table: Ok(TableName::default()),
            purge_batch: DEFAULT_PURGE_BATCH,
            outbox: Ok(TableName::outbox()),
            outbox_retention: DEFAULT_OUTBOX_RETENTION,
            #[cfg(feature = "kafka")]
            kafka_offsets: Ok(TableName::kafka_offsets()),
        }
    }
}

impl Settings {
    pub(crate) fn set_table(&mut self, name: &str) {
        self.table = TableName::new(name).map_err(|e| e.to_string());
    }

    pub(crate) fn table(&self) -> Result<TableName, Error> {
        self.table.clone().map_err(Error::Config)
    }

    pub(crate) fn purge_batch(&self) -> Result<u32, Error> {
        if self.purge_batch == 0 {
            return Err(Error::Config("purge batch size must be at least 1".into()));
        }
        Ok(self.purge_batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddl_uses_the_configured_table_everywhere() {
        let table = TableName::new("app.seen").unwrap();
        let stmts = ddl(include_str!("../../sql/postgres.sql"), &table, '"');
        assert_eq!(stmts.len(), 2);
        assert!(
            stmts[0].starts_with("CREATE TABLE IF NOT EXISTS \"app\".\"seen\" ("),
            "{}",
            stmts[0]
        );
        assert!(stmts[1].contains("\"seen_expires_at_idx\""), "{}", stmts[1]);
        assert!(stmts[1].contains("ON \"app\".\"seen\" (expires_at)"), "{}", stmts[1]);
        assert!(!stmts.iter().any(|s| s.contains("processed_messages")));
    }
}
