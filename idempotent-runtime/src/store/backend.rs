//! What a database must provide for the sqlx stores ([`SqlBackend`]), and
//! the macro that implements it for each backend with its own statements.
//! Both [`crate::store::sql`] (the guard) and [`crate::store::tx`] (the
//! transaction) build on it.

use std::future::Future;
use std::sync::Arc;

use sqlx::Transaction;

use crate::Error;
use crate::outbox::StagedRow;

/// A database the sqlx stores run on: how it writes a result into a marker
/// inside the open transaction. Each backend's SQL stays in its own file.
pub trait SqlBackend: sqlx::Database {
    /// Whether a failed statement can end the transaction and leave the
    /// session in autocommit, where the statements that follow succeed and
    /// commit one by one (MySQL/MariaDB: InnoDB rolls a deadlock victim's
    /// whole transaction back; SQLite rolls back after some I/O errors and
    /// `SQLITE_FULL`). A batch member's completion then makes the
    /// completion proof before the next member uses the transaction.
    /// PostgreSQL aborts the transaction instead: every statement that
    /// follows fails until it ends, so the batch's commit proof suffices.
    const FAILURE_ENDS_SILENTLY: bool;

    /// Runs `sql` (the backend's "store the result" statement) with
    /// `(result, scope, key)`.
    fn write_result<'a>(
        conn: &'a mut Self::Connection,
        sql: Arc<str>,
        result: String,
        scope: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs `sql` (the backend's "expire `ttl` from now" statement, on the
    /// database clock) with `(ttl in ms, scope, key)`.
    fn refresh_expiry<'a>(
        conn: &'a mut Self::Connection,
        sql: Arc<str>,
        ttl_millis: i64,
        scope: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs `sql` (a backend's claim statement returning a row when the
    /// claim is fresh) with `(scope, key, ttl in ms, fingerprint)`: `true`
    /// when it returned a row.
    fn claim_returning<'a>(
        conn: &'a mut Self::Connection,
        sql: Arc<str>,
        req: &'a crate::store::Request<'a>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Runs `sql` (the backend's "read the marker" statement) with
    /// `(scope, key)`: the live marker's `(fingerprint, result)`.
    fn read_marker<'a>(
        conn: &'a mut Self::Connection,
        sql: Arc<str>,
        scope: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(Option<String>, Option<String>), sqlx::Error>> + Send + 'a;

    /// Runs `sql` with `(scope, key)` (a batch claim's marker undo), or
    /// with no parameter when both are `None` (savepoints).
    fn execute_keyed<'a>(
        conn: &'a mut Self::Connection,
        sql: Arc<str>,
        keyed: Option<(&'a str, &'a str)>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Writes staged outgoing messages into the outbox table `table`
    /// (quoted), inside the open transaction: the backend's own statement.
    fn stage_outbox<'a>(
        conn: &'a mut Self::Connection,
        table: &'a str,
        rows: Vec<StagedRow>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Commits a transaction that holds no claim (a relay's round, a batch
    /// that claimed nothing fresh), durably. A transaction holding claims
    /// commits through [`crate::store::sql::commit_claims`] instead, which
    /// first proves that it is still the claims' transaction
    /// ([`holds_transaction`](Self::holds_transaction)).
    /// [`Error::TransactionAborted`] when a statement had aborted it.
    fn commit(tx: Transaction<'static, Self>) -> impl Future<Output = Result<(), Error>> + Send + 'static;

    /// The completion proof's question, in the backend's dialect (see
    /// [`crate::store::sql::prove_claims_held`]): whether the session is
    /// still inside the transaction the store began, holding what was
    /// written in it. `false` when the transaction ended under the handler:
    /// rolled back by the server (InnoDB rolls a deadlock victim's whole
    /// transaction back and the session goes on in autocommit; SQLite rolls
    /// back on some I/O and `SQLITE_FULL` errors), aborted by a failed
    /// statement (PostgreSQL), or ended by the handler's own `ROLLBACK` or
    /// `COMMIT`. Run before every statement of the store's own after the
    /// body (outgoing messages, the result, `COMMIT`), which would otherwise
    /// commit on their own in autocommit. On PostgreSQL it also turns
    /// `synchronous_commit` back on for the transaction when the session
    /// has it `off`, so that the `COMMIT` after it is durable.
    fn holds_transaction<'a>(
        conn: &'a mut Self::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Moves a Kafka partition's stored offset to `next` in the open
    /// transaction, if it is at most `first` (the offset of the partition's
    /// first record being committed) or the partition has no row yet:
    /// `true` when it moved, `false` when it is already past `first`.
    #[cfg(feature = "kafka")]
    fn advance_offset<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a crate::store::kafka_offsets::OffsetSql,
        at: (&'a str, &'a str, i32),
        first: i64,
        next: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The stored next offsets `(partition, next offset)` of a consumer
    /// group's topic.
    #[cfg(feature = "kafka")]
    fn read_offsets<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a crate::store::kafka_offsets::OffsetSql,
        group: &'a str,
        topic: &'a str,
    ) -> impl Future<Output = Result<Vec<(i32, i64)>, sqlx::Error>> + Send + 'a;

    /// Makes the server end the session of `conn`, so that its release to
    /// the pool fails and the pool closes it (see [`crate::store::tx`]).
    fn retire(conn: &mut Self::Connection) -> impl Future<Output = ()> + Send + '_;
}

/// [`SqlBackend::commit`] on MySQL/MariaDB and SQLite: `COMMIT`, which
/// reports any failure. (A transaction the server rolled back under the
/// handler is caught before, by the completion proof.)
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn plain_commit<DB: sqlx::Database>(tx: Transaction<'static, DB>) -> Result<(), Error> {
    Ok(tx.commit().await?)
}

/// Implements [`SqlBackend`] for a sqlx database: the statement is the
/// backend's own (built in its file), the binding the same for all.
macro_rules! sql_backend {
    ($db:ty, $conn:ty, $silent:expr, $stage:path, $commit:path, $holds:path, $retire:path) => {
        impl $crate::store::backend::SqlBackend for $db {
            const FAILURE_ENDS_SILENTLY: bool = $silent;

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

            async fn refresh_expiry<'a>(
                conn: &'a mut $conn,
                sql: ::std::sync::Arc<str>,
                ttl_millis: i64,
                scope: &'a str,
                key: &'a str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(ttl_millis)
                    .bind(scope)
                    .bind(key)
                    .execute(conn)
                    .await?;
                Ok(())
            }

            async fn claim_returning<'a>(
                conn: &'a mut $conn,
                sql: ::std::sync::Arc<str>,
                req: &'a $crate::store::Request<'a>,
            ) -> Result<bool, sqlx::Error> {
                Ok(sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(req.scope())
                    .bind(req.key())
                    .bind(req.ttl_millis())
                    .bind(req.fingerprint().map(|f| f.as_str()))
                    .fetch_optional(conn)
                    .await?
                    .is_some())
            }

            async fn read_marker<'a>(
                conn: &'a mut $conn,
                sql: ::std::sync::Arc<str>,
                scope: &'a str,
                key: &'a str,
            ) -> Result<(Option<String>, Option<String>), sqlx::Error> {
                use sqlx::Row as _;
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(scope)
                    .bind(key)
                    .fetch_one(conn)
                    .await?;
                Ok((row.try_get("fingerprint")?, row.try_get("result")?))
            }

            async fn execute_keyed<'a>(
                conn: &'a mut $conn,
                sql: ::std::sync::Arc<str>,
                keyed: Option<(&'a str, &'a str)>,
            ) -> Result<(), sqlx::Error> {
                let query = sqlx::query(sqlx::AssertSqlSafe(sql));
                let query = match keyed {
                    Some((scope, key)) => query.bind(scope).bind(key),
                    None => query,
                };
                query.execute(conn).await?;
                Ok(())
            }

            fn stage_outbox<'a>(
                conn: &'a mut $conn,
                table: &'a str,
                rows: Vec<$crate::outbox::StagedRow>,
            ) -> impl ::std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'a {
                $stage(conn, table, rows)
            }

            fn commit(
                tx: sqlx::Transaction<'static, $db>,
            ) -> impl ::std::future::Future<Output = Result<(), $crate::Error>> + Send + 'static {
                $commit(tx)
            }

            fn holds_transaction<'a>(
                conn: &'a mut $conn,
            ) -> impl ::std::future::Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
                $holds(conn)
            }

            #[cfg(feature = "kafka")]
            async fn advance_offset<'a>(
                conn: &'a mut $conn,
                sql: &'a $crate::store::kafka_offsets::OffsetSql,
                (group, topic, partition): (&'a str, &'a str, i32),
                first: i64,
                next: i64,
            ) -> Result<bool, sqlx::Error> {
                let advanced = sqlx::query(sqlx::AssertSqlSafe(::std::sync::Arc::clone(&sql.advance)))
                    .bind(next)
                    .bind(group)
                    .bind(topic)
                    .bind(partition)
                    .bind(first)
                    .execute(&mut *conn)
                    .await?
                    .rows_affected();
                if advanced > 0 {
                    return Ok(true);
                }
                // No row yet, or one already past `first`: the insert tells.
                let inserted = sqlx::query(sqlx::AssertSqlSafe(::std::sync::Arc::clone(&sql.insert)))
                    .bind(group)
                    .bind(topic)
                    .bind(partition)
                    .bind(next)
                    .execute(&mut *conn)
                    .await?
                    .rows_affected();
                Ok(inserted > 0)
            }

            #[cfg(feature = "kafka")]
            async fn read_offsets<'a>(
                pool: &'a sqlx::Pool<$db>,
                sql: &'a $crate::store::kafka_offsets::OffsetSql,
                group: &'a str,
                topic: &'a str,
            ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
                let rows = sqlx::query(sqlx::AssertSqlSafe(::std::sync::Arc::clone(&sql.read)))
                    .bind(group)
                    .bind(topic)
                    .fetch_all(pool)
                    .await?;
                rows.iter()
                    .map(|row| Ok((sqlx::Row::try_get(row, 0)?, sqlx::Row::try_get(row, 1)?)))
                    .collect()
            }

            fn retire(conn: &mut $conn) -> impl ::std::future::Future<Output = ()> + Send + '_ {
                $retire(conn)
            }
        }
    };
}
pub(crate) use sql_backend;
