//! `PgStore`'s outbox: the statements that stage outgoing messages in the
//! marker's transaction, and those a relay takes, settles and deletes them
//! with.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row};

use crate::store::tx::Tx;

use crate::Error;
use crate::outbox::{OutboxBatch, OutboxRow, OutboxStore, StagedRow, ordering_keys};
use crate::store::postgres::PgStore;
use crate::store::sql::{delete_in_batches, fmt_outbox_batch, millis, outbox_rows, pending_from};

/// The relay's statements for one outbox table.
#[derive(Debug)]
pub(crate) struct PgOutboxSql {
    take: String,
    dispatched: String,
    reschedule: String,
    purge: String,
    pending: String,
}

impl PgOutboxSql {
    pub(crate) fn new(t: &str) -> PgOutboxSql {
        PgOutboxSql {
            // Due rows in id order; of those sharing an ordering key only the
            // first pending one (a locked earlier row still counts, so a
            // relay never overtakes another's row of the same key).
            take: format!(
                "SELECT id, message_id, destination, ordering_key, headers, payload, attempts FROM {t} o \
                 WHERE dispatched_at IS NULL AND next_attempt_at <= now() \
                 AND (ordering_key IS NULL OR NOT EXISTS (\
                 SELECT 1 FROM {t} p WHERE p.ordering_key = o.ordering_key \
                 AND p.dispatched_at IS NULL AND p.id < o.id)) \
                 ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
            ),
            dispatched: format!("UPDATE {t} SET dispatched_at = now(), last_error = NULL WHERE id = ANY($1)"),
            reschedule: format!(
                "UPDATE {t} SET attempts = attempts + 1, \
                 next_attempt_at = now() + $2 * interval '1 millisecond', last_error = $3 WHERE id = $1"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM {t} WHERE dispatched_at <= now() - $1 * interval '1 millisecond' \
                 LIMIT $2 FOR UPDATE SKIP LOCKED))"
            ),
            pending: format!(
                "SELECT count(*), EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM {t} \
                 WHERE dispatched_at IS NULL"
            ),
        }
    }
}

/// The lock a stager takes on an ordering key, held until its transaction
/// ends: a transaction-level advisory lock on a 64-bit hash of the outbox
/// table and the key (keys of two tables or two hashing alike share a
/// lock, which only makes one wait for the other's commit).
const LOCK_ORDERING_KEY: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";

/// Writes staged rows with one statement, whatever their number, after
/// taking the lock of each of their ordering keys
/// ([`ordering_keys`](crate::outbox::ordering_keys)): per key, rows are
/// inserted in the order their transactions commit.
pub(crate) async fn stage_outbox(
    conn: &mut PgConnection,
    table: &str,
    rows: Vec<StagedRow>,
) -> Result<(), sqlx::Error> {
    for key in ordering_keys(&rows) {
        sqlx::query(LOCK_ORDERING_KEY)
            .bind(format!("{table}:{key}"))
            .execute(&mut *conn)
            .await?;
    }
    let mut ids = Vec::with_capacity(rows.len());
    let mut destinations = Vec::with_capacity(rows.len());
    let mut keys = Vec::with_capacity(rows.len());
    let mut headers = Vec::with_capacity(rows.len());
    let mut payloads = Vec::with_capacity(rows.len());
    for row in rows {
        ids.push(row.message_id);
        destinations.push(row.destination);
        keys.push(row.ordering_key);
        headers.push(row.headers);
        payloads.push(row.payload);
    }
    let insert = format!(
        "INSERT INTO {table} (message_id, destination, ordering_key, headers, payload) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[])"
    );
    sqlx::query(AssertSqlSafe(insert))
        .bind(ids)
        .bind(destinations)
        .bind(keys)
        .bind(headers)
        .bind(payloads)
        .execute(conn)
        .await?;
    Ok(())
}

/// Rows a relay took, locked in its transaction.
pub struct PgOutboxBatch {
    tx: Tx<Postgres>,
    rows: Vec<OutboxRow>,
    sql: Arc<PgOutboxSql>,
}

impl std::fmt::Debug for PgOutboxBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_outbox_batch(f, "PgOutboxBatch", &self.rows)
    }
}

impl OutboxBatch for PgOutboxBatch {
    fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    async fn settle(mut self, dispatched: Vec<i64>, failed: Vec<(i64, Duration, String)>) -> Result<(), Error> {
        if !dispatched.is_empty() {
            sqlx::query(AssertSqlSafe(self.sql.dispatched.as_str()))
                .bind(dispatched)
                .execute(&mut *self.tx)
                .await?;
        }
        for (id, delay, error) in failed {
            sqlx::query(AssertSqlSafe(self.sql.reschedule.as_str()))
                .bind(id)
                .bind(millis(delay))
                .bind(error)
                .execute(&mut *self.tx)
                .await?;
        }
        self.tx.commit().await?;
        Ok(())
    }
}

impl PgStore {
    /// Deletes outgoing messages dispatched longer ago than the store's
    /// outbox retention, in batches of its purge batch size; returns how
    /// many. The [`Janitor`](crate::Janitor) calls it after the markers.
    pub async fn purge_dispatched(&self) -> Result<u64, Error> {
        let outbox = self.outbox();
        let batch = self.purge_batch();
        delete_in_batches(batch as u64, || async move {
            Ok(sqlx::query(AssertSqlSafe(outbox.sql.purge.as_str()))
                .bind(millis(outbox.retention))
                .bind(batch)
                .execute(self.pool())
                .await?
                .rows_affected())
        })
        .await
    }
}

impl OutboxStore for PgStore {
    type Batch = PgOutboxBatch;

    fn outbox_waker(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.outbox().table.waker)
    }

    async fn take_batch(&self, limit: u32, _lease: Duration) -> Result<PgOutboxBatch, Error> {
        let sql = Arc::clone(&self.outbox().sql);
        let mut tx = Tx::begin(self.pool(), "BEGIN ISOLATION LEVEL READ COMMITTED").await?;
        let rows = sqlx::query(AssertSqlSafe(sql.take.as_str()))
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        let rows = outbox_rows(rows, |row| {
            Ok((
                row.try_get("id")?,
                row.try_get("ordering_key")?,
                i64::from(row.try_get::<i32, _>("attempts")?),
            ))
        })?;
        Ok(PgOutboxBatch { tx, rows, sql })
    }

    async fn pending(&self) -> Result<(u64, Option<Duration>), Error> {
        let row = sqlx::query(AssertSqlSafe(self.outbox().sql.pending.as_str()))
            .fetch_one(self.pool())
            .await?;
        Ok(pending_from(row.try_get(0)?, row.try_get(1)?))
    }
}
