//! What the sqlx-based stores share: the claim guard (an open transaction
//! holding the new marker), the DDL template and the store settings.

use std::future::Future;
use std::sync::Arc;

use sqlx::Transaction;

use crate::Error;
use crate::store::{Guard, TransactionGuard};
use crate::table::TableName;

/// Markers deleted per statement by `purge_expired`, unless configured.
pub const DEFAULT_PURGE_BATCH: u32 = 1_000;

/// A database the sqlx stores run on: how it writes a result into a marker
/// inside the open transaction. Each backend's SQL stays in its own file.
pub trait SqlBackend: sqlx::Database {
    /// Runs `sql` (the backend's "store the result" statement) with
    /// `(result, scope, key)`.
    fn write_result<'a>(
        conn: &'a mut Self::Connection,
        sql: Arc<str>,
        result: String,
        scope: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// Implements [`SqlBackend`] for a sqlx database: the statement is the
/// backend's own (built in its file), the binding the same for all.
macro_rules! sql_backend {
    ($db:ty, $conn:ty) => {
        impl $crate::store::sql::SqlBackend for $db {
            async fn write_result<'a>(
                conn: &'a mut $conn,
                sql: ::std::sync::Arc<str>,
                result: String,
                scope: &'a str,
                key: &'a str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(result)
                    .bind(scope)
                    .bind(key)
                    .execute(conn)
                    .await?;
                Ok(())
            }
        }
    };
}
pub(crate) use sql_backend;

/// The claim of a transactional store: the transaction that inserted the
/// marker. The handler's body runs on it; dropping it rolls back.
pub struct SqlGuard<DB: SqlBackend> {
    tx: Transaction<'static, DB>,
    write_result_sql: Arc<str>,
    scope: String,
    key: String,
    _writer: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<DB: SqlBackend> SqlGuard<DB> {
    pub(crate) fn new(
        tx: Transaction<'static, DB>,
        write_result_sql: Arc<str>,
        req: &crate::store::Request<'_>,
        writer: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Self {
        SqlGuard {
            tx,
            write_result_sql,
            scope: req.scope().to_owned(),
            key: req.key().to_owned(),
            _writer: writer,
        }
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

impl<DB: SqlBackend> Guard for SqlGuard<DB> {
    async fn complete(mut self, result: Option<String>) -> Result<(), Error> {
        if let Some(result) = result {
            DB::write_result(
                &mut self.tx,
                Arc::clone(&self.write_result_sql),
                result,
                &self.scope,
                &self.key,
            )
            .await?;
        }
        self.tx.commit().await?;
        Ok(())
    }

    async fn abort(self) {
        if let Err(error) = self.tx.rollback().await {
            // The connection is gone; the server rolls the transaction back.
            tracing::debug!(target: "idempotent", %error, "rollback failed");
        }
    }
}

impl<DB: SqlBackend> TransactionGuard for SqlGuard<DB> {
    type Database = DB;

    fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        &mut self.tx
    }
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
/// the purge batch size; each backend's `build` validates them.
#[derive(Debug, Clone)]
pub struct SqlStoreBuilder<P> {
    pool: P,
    settings: Settings,
}

impl<P> SqlStoreBuilder<P> {
    pub(crate) fn new(pool: P) -> Self {
        SqlStoreBuilder {
            pool,
            settings: Settings::default(),
        }
    }

    /// The marker table (default `processed_messages`): `table`, or
    /// `schema.table` (`database.table` on MySQL; SQLite takes a plain
    /// name). Validated by `build`.
    pub fn table(mut self, name: &str) -> Self {
        self.settings.set_table(name);
        self
    }

    /// Markers deleted per statement by the store's `purge_expired`
    /// (default 1000).
    pub fn purge_batch(mut self, markers: u32) -> Self {
        self.settings.purge_batch = markers;
        self
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
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            table: Ok(TableName::default()),
            purge_batch: DEFAULT_PURGE_BATCH,
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
