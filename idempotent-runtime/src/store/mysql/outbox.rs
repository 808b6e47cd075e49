//! `MySqlStore`'s outbox: the statements that stage outgoing messages in the
//! marker's transaction, and those a relay takes, settles and deletes them
//! with (`FOR UPDATE SKIP LOCKED`: MariaDB 10.6+, MySQL 8).

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Row};

use crate::store::tx::Tx;

use crate::Error;
use crate::outbox::{OutboxBatch, OutboxRow, OutboxStore, StagedRow, ordering_keys};
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
    /// Deletes rows of the keys table whose key has no pending message.
    purge_keys: String,
}

/// The table of ordering keys beside the outbox table `table` (quoted):
/// `<table>_keys`, in the current database, as `migrate()` creates it
/// (the DDL names it like the outbox's indexes, without the schema).
fn keys_table(table: &str) -> String {
    let last = table.rsplit('.').next().unwrap_or(table);
    format!("`{}_keys`", last.trim_matches('`'))
}

/// Takes the lock of the ordering key `?` until the transaction ends: an
/// exclusive lock on its row of the keys table `{keys}` (inserted when it
/// is the key's first), the upsert locking the existing row by its primary
/// key only (no gap), so that other keys never wait.
fn lock_ordering_key(keys: &str) -> String {
    format!("INSERT INTO {keys} (ordering_key) VALUES (?) ON DUPLICATE KEY UPDATE ordering_key = ordering_key")
}

impl MySqlOutboxSql {
    pub(crate) fn new(t: &str) -> MySqlOutboxSql {
        let keys = keys_table(t);
        MySqlOutboxSql {
            purge_keys: format!(
                "DELETE FROM {keys} WHERE NOT EXISTS (SELECT 1 FROM {t} o \
                 WHERE o.ordering_key = {keys}.ordering_key AND o.dispatched_at IS NULL) LIMIT ?"
            ),
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

/// Writes staged rows with one multi-row `INSERT` per thousand, after
/// taking the lock of each of their ordering keys
/// ([`ordering_keys`](crate::outbox::ordering_keys)): per key, rows are
/// inserted in the order their transactions commit.
pub(crate) async fn stage_outbox(
    conn: &mut MySqlConnection,
    table: &str,
    rows: Vec<StagedRow>,
) -> Result<(), sqlx::Error> {
    let keys = ordering_keys(&rows);
    if !keys.is_empty() {
        let lock = lock_ordering_key(&keys_table(table));
        for key in keys {
            sqlx::query(AssertSqlSafe(lock.as_str()))
                .bind(key.as_bytes())
                .execute(&mut *conn)
                .await?;
        }
    }
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
    /// It then deletes the ordering keys with no pending message from the
    /// keys table (`<outbox table>_keys`; not counted): a key's row only
    /// matters while a transaction holds it, and staging inserts it again.
    pub async fn purge_dispatched(&self) -> Result<u64, Error> {
        let outbox = self.outbox();
        let deleted = self
            .delete_in_batches(&outbox.sql.purge, Some(micros(outbox.retention)))
            .await?;
        self.delete_in_batches(&outbox.sql.purge_keys, None).await?;
        Ok(deleted)
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
