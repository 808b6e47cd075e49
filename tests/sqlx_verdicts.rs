//! `Verdict::of_sqlx` on real errors of PostgreSQL, MariaDB and SQLite: an
//! outage only when the database cannot be reached or is going away, a
//! rejection for what the message's data did (a NUL byte in a text, a
//! unique violation, a value out of range), a retry that spends an attempt
//! for what may pass next time (a deadlock, a foreign key whose row may
//! come later).

mod common;

use std::time::Duration;

use idempotent_runtime::broker::Verdict;
use idempotent_runtime::sqlx::mysql::MySqlPoolOptions;
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::sqlite::SqliteConnectOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, ConnectOptions, Connection};

/// The error's SQLSTATE (or driver code), for the messages.
fn code(error: &sqlx::Error) -> String {
    error
        .as_database_error()
        .and_then(|db| db.code().map(|c| c.into_owned()))
        .unwrap_or_default()
}

async fn pg_error(pool: &sqlx::PgPool, sql: String) -> sqlx::Error {
    sqlx::query(AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect_err("the statement fails")
}

#[tokio::test]
async fn postgres_data_errors_are_rejected_not_outages() {
    let pool = common::pg_pool(2).await;
    let parent = common::unique("verdict_parent");
    let child = common::unique("verdict_child");
    for ddl in [
        format!("CREATE TABLE {parent} (id TEXT PRIMARY KEY, n SMALLINT)"),
        format!("CREATE TABLE {child} (id TEXT PRIMARY KEY, parent TEXT NOT NULL REFERENCES {parent}(id))"),
    ] {
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    }

    // The message: an order whose text holds a NUL byte.
    let nul = sqlx::query(AssertSqlSafe(format!("INSERT INTO {parent} (id) VALUES ($1)")))
        .bind("order\u{0}1")
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(code(&nul), "22021", "{nul}");
    assert_eq!(Verdict::of_sqlx(&nul), Verdict::Reject, "{nul}");

    sqlx::query(AssertSqlSafe(format!("INSERT INTO {parent} (id) VALUES ('a')")))
        .execute(&pool)
        .await
        .unwrap();
    let unique = pg_error(&pool, format!("INSERT INTO {parent} (id) VALUES ('a')")).await;
    assert_eq!(code(&unique), "23505", "{unique}");
    assert_eq!(Verdict::of_sqlx(&unique), Verdict::Reject);

    let not_null = pg_error(&pool, format!("INSERT INTO {child} (id) VALUES ('c')")).await;
    assert_eq!(code(&not_null), "23502", "{not_null}");
    assert_eq!(Verdict::of_sqlx(&not_null), Verdict::Reject);

    let range = pg_error(&pool, format!("INSERT INTO {parent} (id, n) VALUES ('b', 100000)")).await;
    assert_eq!(code(&range), "22003", "{range}");
    assert_eq!(Verdict::of_sqlx(&range), Verdict::Reject);

    // The parent may come with a later message.
    let foreign = pg_error(&pool, format!("INSERT INTO {child} (id, parent) VALUES ('c', 'later')")).await;
    assert_eq!(code(&foreign), "23503", "{foreign}");
    assert_eq!(Verdict::of_sqlx(&foreign), Verdict::Retry);

    let missing = sqlx::query(AssertSqlSafe(format!("SELECT id FROM {parent} WHERE id = 'none'")))
        .fetch_one(&pool)
        .await
        .unwrap_err();
    assert!(matches!(missing, sqlx::Error::RowNotFound), "{missing}");
    assert_eq!(Verdict::of_sqlx(&missing), Verdict::Retry);

    // A bug (a table that does not exist, a column read as the wrong type)
    // spends attempts and ends in the dead-letter queue, for replay.
    let no_table = pg_error(&pool, format!("SELECT * FROM {parent}_missing")).await;
    assert_eq!(code(&no_table), "42P01", "{no_table}");
    assert_eq!(Verdict::of_sqlx(&no_table), Verdict::Retry);
    let decode = sqlx::query_scalar::<_, i64>("SELECT 'text'::TEXT")
        .fetch_one(&pool)
        .await
        .unwrap_err();
    assert!(matches!(decode, sqlx::Error::ColumnDecode { .. }), "{decode}");
    assert_eq!(Verdict::of_sqlx(&decode), Verdict::Retry);

    common::drop_pg_table(&pool, &child).await;
    common::drop_pg_table(&pool, &parent).await;
}

#[tokio::test]
async fn postgres_sqlstates_are_classified_by_class() {
    let pool = common::pg_pool(2).await;
    // Errors PostgreSQL raises with these SQLSTATEs.
    for (sqlstate, verdict) in [
        ("40001", Verdict::Retry),  // serialization_failure
        ("40P01", Verdict::Retry),  // deadlock_detected
        ("55P03", Verdict::Retry),  // lock_not_available
        ("57014", Verdict::Retry),  // query_canceled
        ("57P01", Verdict::Outage), // admin_shutdown
        ("57P03", Verdict::Outage), // cannot_connect_now
        ("08006", Verdict::Outage), // connection_failure
        ("53300", Verdict::Outage), // too_many_connections
        ("22P02", Verdict::Reject), // invalid_text_representation
        ("23514", Verdict::Reject), // check_violation
        ("XX000", Verdict::Retry),  // internal_error
    ] {
        let sql = format!("DO $$ BEGIN RAISE EXCEPTION 'raised' USING ERRCODE = '{sqlstate}'; END $$");
        let error = pg_error(&pool, sql).await;
        assert_eq!(code(&error), sqlstate, "{error}");
        assert_eq!(Verdict::of_sqlx(&error), verdict, "{sqlstate}: {error}");
    }

    // A statement timeout, for real.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL statement_timeout = 50")
        .execute(&mut *tx)
        .await
        .unwrap();
    let timeout = sqlx::query("SELECT pg_sleep(5)").execute(&mut *tx).await.unwrap_err();
    assert_eq!(code(&timeout), "57014", "{timeout}");
    assert_eq!(Verdict::of_sqlx(&timeout), Verdict::Retry);
}

#[tokio::test]
async fn postgres_unreachable_is_an_outage() {
    // Nothing listens on port 1.
    let refused = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert_eq!(Verdict::of_sqlx(&refused), Verdict::Outage, "{refused:?}");

    // Every connection of the pool is taken. (The limit also bounds the
    // first connect: long enough for a loaded machine.)
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(common::PG_URL)
        .await
        .unwrap();
    let held = pool.acquire().await.unwrap();
    let timed_out = pool.acquire().await.unwrap_err();
    assert!(matches!(timed_out, sqlx::Error::PoolTimedOut), "{timed_out}");
    assert_eq!(Verdict::of_sqlx(&timed_out), Verdict::Outage);
    drop(held);

    // The server ends the session (as a restart or a failover does).
    let mut conn = sqlx::PgConnection::connect(common::PG_URL).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let admin = common::pg_pool(1).await;
    let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&admin)
        .await
        .unwrap();
    let ended = sqlx::query("SELECT 1").execute(&mut conn).await.unwrap_err();
    assert_eq!(Verdict::of_sqlx(&ended), Verdict::Outage, "{ended:?}");
}

#[tokio::test]
async fn mariadb_errors_are_classified() {
    let pool = common::mysql_pool(2).await;
    let parent = common::unique("verdict_parent");
    let child = common::unique("verdict_child");
    for ddl in [
        format!("CREATE TABLE `{parent}` (id VARCHAR(3) PRIMARY KEY, n INT) ENGINE=InnoDB"),
        format!(
            "CREATE TABLE `{child}` (id VARCHAR(3) PRIMARY KEY, parent VARCHAR(3) NOT NULL, \
             FOREIGN KEY (parent) REFERENCES `{parent}`(id)) ENGINE=InnoDB"
        ),
    ] {
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    }
    let number = |error: &sqlx::Error| {
        error
            .as_database_error()
            .and_then(|db| db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .map(|db| db.number())
    };
    let fails = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .expect_err("the statement fails")
        }
    };

    sqlx::query(AssertSqlSafe(format!("INSERT INTO `{parent}` (id) VALUES ('a')")))
        .execute(&pool)
        .await
        .unwrap();
    for (sql, errno, verdict) in [
        // Duplicate entry.
        (
            format!("INSERT INTO `{parent}` (id) VALUES ('a')"),
            1062,
            Verdict::Reject,
        ),
        // Data too long (strict mode).
        (
            format!("INSERT INTO `{parent}` (id) VALUES ('abcdef')"),
            1406,
            Verdict::Reject,
        ),
        // Incorrect integer value.
        (
            format!("INSERT INTO `{parent}` (id, n) VALUES ('b', 'abc')"),
            1366,
            Verdict::Reject,
        ),
        // Out of range.
        (
            format!("INSERT INTO `{parent}` (id, n) VALUES ('c', 99999999999)"),
            1264,
            Verdict::Reject,
        ),
        // Column cannot be null.
        (
            format!("INSERT INTO `{child}` (id, parent) VALUES ('x', NULL)"),
            1048,
            Verdict::Reject,
        ),
        // Foreign key: the parent may come later.
        (
            format!("INSERT INTO `{child}` (id, parent) VALUES ('x', 'zz')"),
            1452,
            Verdict::Retry,
        ),
        // Deadlock, lock wait timeout (raised with their numbers).
        (
            "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213".to_owned(),
            1213,
            Verdict::Retry,
        ),
        (
            "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1205".to_owned(),
            1205,
            Verdict::Retry,
        ),
        // A missing table: a bug or a migration not run, attempts spent.
        (format!("SELECT * FROM `{parent}_missing`"), 1146, Verdict::Retry),
    ] {
        let error = fails(sql.clone()).await;
        assert_eq!(number(&error), Some(errno), "{sql}: {error}");
        assert_eq!(Verdict::of_sqlx(&error), verdict, "{sql}: {error}");
    }

    // Refused on a closed port; a session the server kills.
    let refused = MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect("mysql://root@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert_eq!(Verdict::of_sqlx(&refused), Verdict::Outage, "{refused:?}");
    let mut conn = sqlx::MySqlConnection::connect(common::MYSQL_URL).await.unwrap();
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!("KILL {id}")))
        .execute(&pool)
        .await
        .unwrap();
    let killed = sqlx::query("SELECT 1").execute(&mut conn).await.unwrap_err();
    assert_eq!(Verdict::of_sqlx(&killed), Verdict::Outage, "{killed:?}");

    common::drop_mysql_table(&pool, &child).await;
    common::drop_mysql_table(&pool, &parent).await;
}

#[tokio::test]
async fn sqlite_errors_are_classified() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("v.db"))
        .create_if_missing(true)
        .busy_timeout(Duration::ZERO);
    let mut first = options.connect().await.unwrap();
    let mut second = options.connect().await.unwrap();
    sqlx::query("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        .execute(&mut first)
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES ('a', 1)")
        .execute(&mut first)
        .await
        .unwrap();
    let unique = sqlx::query("INSERT INTO t VALUES ('a', 1)")
        .execute(&mut first)
        .await
        .unwrap_err();
    assert_eq!(Verdict::of_sqlx(&unique), Verdict::Reject, "{unique}");
    let not_null = sqlx::query("INSERT INTO t (id) VALUES ('b')")
        .execute(&mut first)
        .await
        .unwrap_err();
    assert_eq!(Verdict::of_sqlx(&not_null), Verdict::Reject, "{not_null}");

    // Another connection holds the write lock: busy, try again.
    sqlx::query("BEGIN IMMEDIATE").execute(&mut first).await.unwrap();
    let busy = sqlx::query("INSERT INTO t VALUES ('c', 1)")
        .execute(&mut second)
        .await
        .unwrap_err();
    assert_eq!(code(&busy), "5", "{busy}");
    assert_eq!(Verdict::of_sqlx(&busy), Verdict::Retry, "{busy}");
    sqlx::query("ROLLBACK").execute(&mut first).await.unwrap();
}
