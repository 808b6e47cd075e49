//! `MySqlStore`'s outbox: the statements that stage outgoing messages in the
//! marker's transaction, and those a relay takes, settles and deletes them
//! with (`FOR UPDATE SKIP LOCKED`: MariaDB 10.6+, MySQL 8).

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Row};

use crate::store::tx::Tx;

use crate::Error;
use crate::outbox::{OutboxBatch, OutboxRow, OutboxStore, StagedRow};
use crate::store::mysql::MySqlStore;
use crate::store::sql::{bind_ids, fmt_outbox_batch, outbox_rows, pending_from, stage_inserts};

/// Rows written per `INSERT` (5 parameters each, well under MySQL's 65535).
const STAGE_CHUNK: usize = 1000;

/// The longest `last_error` kept, in characters.
const MAX_ERROR_CHARS: usize = 1000;

/// The relay's statements for one outbox table.
#[derive(Debug)]
pub(crate) struct MySqlOutboxSql {
    /// Marks the rows `{ids}` dispatched.
    dispatched: String,
    take: String,
    reschedule: String,
    pub(crate) purge: String,
    pending: String,
}

impl MySqlOutboxSql {
    pub(crate) fn new(t: &str) -> MySqlOutboxSql {
        MySqlOutboxSql {
            dispatched: format!(
                "UPDATE {t} SET dispatched_at = UTC_TIMESTAMP(3), last_error = NULL WHERE id IN ({{ids}})"
            ),
            // Due rows in id order; of those sharing an ordering key only the
            // first pending one. The subquery is a plain read, so a row that
            // another relay holds locked still counts as pending there and
            // its followers wait.
            take: format!(
                "SELECT id, message_id, destination, ordering_key, headers, payload, attempts FROM {t} o \
                 WHERE dispatched_at IS NULL AND next_attempt_at <= UTC_TIMESTAMP(3) \
                 AND (ordering_key IS NULL OR NOT EXISTS (\
                 SELECT 1 FROM {t} p WHERE p.ordering_key = o.ordering_key \
                 AND p.dispatched_at IS NULL AND p.id < o.id)) \
                 ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            reschedule: format!(
                "UPDATE {t} SET attempts = attempts + 1, \
                 next_attempt_at = UTC_TIMESTAMP(3) + INTERVAL ? MICROSECOND, last_error = ? WHERE id = ?"
            ),
            purge: format!("DELETE FROM {t} WHERE dispatched_at <= UTC_TIMESTAMP(3) - INTERVAL ? MICROSECOND LIMIT ?"),
            pending: format!(
                "SELECT COUNT(*), TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(3)) / 1e6 FROM {t} \
                 WHERE dispatched_at IS NULL"
            ),
        }
    }
}

/// Writes staged rows with one multi-row `INSERT` per thousand.
pub(crate) async fn stage_outbox(
    conn: &mut MySqlConnection,
    table: &str,
    rows: Vec<StagedRow>,
) -> Result<(), sqlx::Error> {
    let values = "(?, ?, ?, ?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))";
    for insert in stage_inserts::<MySql, _>(table, values, STAGE_CHUNK, rows, |key| key.map(String::into_bytes)) {
        insert.execute(&mut *conn).await?;
    }
    Ok(())
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Rows a relay took, locked in its transaction.
pub struct MySqlOutboxBatch {
    tx: Tx<MySql>,
    rows: Vec<OutboxRow>,
    sql: Arc<MySqlOutboxSql>,
}

impl std::fmt::Debug for MySqlOutboxBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_outbox_batch(f, "MySqlOutboxBatch", &self.rows)
    }
}

impl OutboxBatch for MySqlOutboxBatch {
    fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    async fn settle(mut self, dispatched: Vec<i64>, failed: Vec<(i64, Duration, String)>) -> Result<(), Error> {
        if !dispatched.is_empty() {
            bind_ids::<MySql>(&self.sql.dispatched, dispatched)
                .execute(&mut *self.tx)
                .await?;
        }
        for (id, delay, error) in failed {
            sqlx::query(AssertSqlSafe(self.sql.reschedule.as_str()))
                .bind(micros(delay))
                .bind(error.chars().take(MAX_ERROR_CHARS).collect::<String>())
                .bind(id)
                .execute(&mut *self.tx)
                .await?;
        }
        self.tx.commit().await?;
        Ok(())
    }
}

impl MySqlStore {
    /// Deletes outgoing messages dispatched longer ago than the store's
    /// outbox retention, in batches of its purge batch size; returns how
    /// many. The [`Janitor`](crate::Janitor) calls it after the markers.
    pub async fn purge_dispatched(&self) -> Result<u64, Error> {
        let outbox = self.outbox();
        self.delete_in_batches(&outbox.sql.purge, Some(micros(outbox.retention)))
            .await
    }
}

impl OutboxStore for MySqlStore {
    type Batch = MySqlOutboxBatch;

    fn outbox_waker(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.outbox().table.waker)
    }

    async fn take_batch(&self, limit: u32, _lease: Duration) -> Result<MySqlOutboxBatch, Error> {
        let sql = Arc::clone(&self.outbox().sql);
        let mut tx = self.begin().await?;
        let rows = sqlx::query(AssertSqlSafe(sql.take.as_str()))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let rows = outbox_rows(rows, |row| {
            let ordering_key: Option<Vec<u8>> = row.try_get("ordering_key")?;
            Ok((
                i64::try_from(row.try_get::<u64, _>("id")?).unwrap_or(i64::MAX),
                ordering_key.map(|key| String::from_utf8_lossy(&key).into_owned()),
                i64::from(row.try_get::<i32, _>("attempts")?),
            ))
        })?;
        Ok(MySqlOutboxBatch { tx, rows, sql })
    }

    async fn pending(&self) -> Result<(u64, Option<Duration>), Error> {
        let row = sqlx::query(AssertSqlSafe(self.outbox().sql.pending.as_str()))
            .fetch_one(self.pool())
            .await?;
        Ok(pending_from(row.try_get(0)?, row.try_get(1)?))
    }
}
