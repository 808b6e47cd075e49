//! `SqliteStore`'s outbox: the statements that stage outgoing messages in
//! the marker's transaction, and those a relay takes, settles and deletes
//! them with. SQLite has no row locks, so a relay leases the rows it takes
//! (`leased_until`) in one short write transaction and settles them in
//! another: the write lock is never held while the broker confirms.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection};

use crate::Error;
use crate::outbox::{OutboxBatch, OutboxRow, OutboxStore, StagedRow};
use crate::store::sql::{bind_ids, fmt_outbox_batch, millis, outbox_rows, pending_from, stage_inserts};
use crate::store::sqlite::{NOW_MS, SqliteStore};

/// Rows written per `INSERT` (5 parameters each, under SQLite's 32766).
const STAGE_CHUNK: usize = 1000;

/// The relay's statements for one outbox table.
#[derive(Debug)]
pub(crate) struct SqliteOutboxSql {
    /// Marks the rows `{ids}` dispatched.
    dispatched: String,
    take: String,
    reschedule: String,
    pub(crate) purge: String,
    pending: String,
}

impl SqliteOutboxSql {
    pub(crate) fn new(t: &str) -> SqliteOutboxSql {
        SqliteOutboxSql {
            dispatched: format!(
                "UPDATE {t} SET dispatched_at = {NOW_MS}, leased_until = 0, last_error = NULL WHERE id IN ({{ids}})"
            ),
            // Due, unleased rows in id order; of those sharing an ordering
            // key only the first pending one (a leased earlier row still
            // counts, so its followers wait).
            take: format!(
                "UPDATE {t} SET leased_until = {NOW_MS} + ?1 WHERE id IN (\
                 SELECT id FROM {t} o WHERE dispatched_at IS NULL \
                 AND next_attempt_at <= {NOW_MS} AND leased_until <= {NOW_MS} \
                 AND (ordering_key IS NULL OR NOT EXISTS (\
                 SELECT 1 FROM {t} p WHERE p.ordering_key = o.ordering_key \
                 AND p.dispatched_at IS NULL AND p.id < o.id)) \
                 ORDER BY id LIMIT ?2) \
                 RETURNING id, message_id, destination, ordering_key, headers, payload, attempts"
            ),
            reschedule: format!(
                "UPDATE {t} SET attempts = attempts + 1, leased_until = 0, \
                 next_attempt_at = {NOW_MS} + ?1, last_error = ?2 WHERE id = ?3"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE id IN (\
                 SELECT id FROM {t} WHERE dispatched_at <= {NOW_MS} - ?1 LIMIT ?2)"
            ),
            pending: format!(
                "SELECT COUNT(*), ({NOW_MS} - MIN(created_at)) / 1000.0 FROM {t} WHERE dispatched_at IS NULL"
            ),
        }
    }
}

/// Writes staged rows with one multi-row `INSERT` per thousand.
pub(crate) async fn stage_outbox(
    conn: &mut SqliteConnection,
    table: &str,
    rows: Vec<StagedRow>,
) -> Result<(), sqlx::Error> {
    let values = format!("(?, ?, ?, ?, ?, {NOW_MS}, {NOW_MS})");
    for insert in stage_inserts::<Sqlite, _>(table, &values, STAGE_CHUNK, rows, |key| key) {
        insert.execute(&mut *conn).await?;
    }
    Ok(())
}

/// Rows a relay leased.
pub struct SqliteOutboxBatch {
    store: SqliteStore,
    rows: Vec<OutboxRow>,
}

impl std::fmt::Debug for SqliteOutboxBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_outbox_batch(f, "SqliteOutboxBatch", &self.rows)
    }
}

impl OutboxBatch for SqliteOutboxBatch {
    fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    async fn settle(self, dispatched: Vec<i64>, failed: Vec<(i64, Duration, String)>) -> Result<(), Error> {
        if dispatched.is_empty() && failed.is_empty() {
            return Ok(());
        }
        let sql = Arc::clone(&self.store.outbox().sql);
        let (mut tx, _writer) = self.store.begin_immediate().await?;
        if !dispatched.is_empty() {
            bind_ids::<Sqlite>(&sql.dispatched, dispatched)
                .execute(&mut *tx)
                .await?;
        }
        for (id, delay, error) in failed {
            sqlx::query(AssertSqlSafe(sql.reschedule.as_str()))
                .bind(millis(delay))
                .bind(error)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

impl SqliteStore {
    /// Deletes outgoing messages dispatched longer ago than the store's
    /// outbox retention, in batches of its purge batch size (each its own
    /// write transaction); returns how many. The [`Janitor`](crate::Janitor)
    /// calls it after the markers.
    pub async fn purge_dispatched(&self) -> Result<u64, Error> {
        let outbox = self.outbox();
        self.purge_in_batches(&outbox.sql.purge, Some(millis(outbox.retention)))
            .await
    }
}

impl OutboxStore for SqliteStore {
    type Batch = SqliteOutboxBatch;

    fn outbox_waker(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.outbox().table.waker)
    }

    async fn take_batch(&self, limit: u32, lease: Duration) -> Result<SqliteOutboxBatch, Error> {
        let sql = Arc::clone(&self.outbox().sql);
        let (mut tx, writer) = self.begin_immediate().await?;
        let rows = sqlx::query(AssertSqlSafe(sql.take.as_str()))
            .bind(millis(lease))
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        drop(writer);
        let mut rows = outbox_rows(rows, |row| {
            Ok((
                row.try_get("id")?,
                row.try_get("ordering_key")?,
                row.try_get("attempts")?,
            ))
        })?;
        // RETURNING gives no order.
        rows.sort_by_key(|row| row.id);
        Ok(SqliteOutboxBatch {
            store: self.clone(),
            rows,
        })
    }

    async fn pending(&self) -> Result<(u64, Option<Duration>), Error> {
        let row = sqlx::query(AssertSqlSafe(self.outbox().sql.pending.as_str()))
            .fetch_one(self.pool())
            .await?;
        Ok(pending_from(row.try_get(0)?, row.try_get(1)?))
    }
}
