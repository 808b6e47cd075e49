//! Transactional stores (Postgres, SQLite, MySQL/MariaDB): the handler's effect and the
//! marker commit or roll back together. Each test writes a real effect row
//! through the handler's transaction parameter and then counts rows.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::{Error, idempotent};
use rand::seq::SliceRandom;
use tokio::sync::Notify;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("failed after writing the effect")]
    Failed,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum After {
    Commit,
    Fail,
    Panic,
    Block,
}

#[derive(Clone)]
pub struct Payment {
    pub message_id: String,
    pub order_id: String,
    pub amount: i64,
    pub after: After,
}

impl Payment {
    fn new(message_id: &str, amount: i64) -> Self {
        Payment {
            message_id: message_id.into(),
            order_id: format!("order-{message_id}"),
            amount,
            after: After::Commit,
        }
    }
    fn then(mut self, after: After) -> Self {
        self.after = after;
        self
    }
}

#[derive(Default)]
pub struct Signals {
    started: Notify,
}

/// What the body does after its write, shared by every backend's handler.
async fn after_effect(msg: &Payment, signals: &Signals) -> Result<i64, AppError> {
    match msg.after {
        After::Commit => Ok(msg.amount * 100),
        After::Fail => Err(AppError::Failed),
        After::Panic => panic!("panic after writing the effect"),
        After::Block => {
            signals.started.notify_one();
            std::future::pending().await
        }
    }
}

/// A transactional store with an effect table, per backend.
pub trait Backend: Sized + Send + Sync + 'static {
    fn setup() -> impl Future<Output = Self> + Send;
    fn pay(&self, msg: &Payment, signals: &Signals) -> impl Future<Output = Result<i64, AppError>> + Send;
    fn payments(&self, message_id: &str) -> impl Future<Output = i64> + Send;
    fn markers(&self, message_id: &str) -> impl Future<Output = i64> + Send;
    fn teardown(self) -> impl Future<Output = ()> + Send;
}

// ---- Postgres -----------------------------------------------------------

/// PostgreSQL, its sessions defaulting to the isolation level `ISO`.
pub struct Pg<const ISO: u8> {
    store: idempotent_runtime::PgStore,
    markers: String,
    payments: String,
}

impl<const ISO: u8> Pg<ISO> {
    #[idempotent(key = "msg.message_id", store = self.store, fingerprint = "(&msg.order_id, msg.amount)")]
    async fn process(&self, msg: &Payment, signals: &Signals, tx: &mut sqlx::PgConnection) -> Result<i64, AppError> {
        let insert = format!(
            "INSERT INTO {} (message_id, order_id, amount) VALUES ($1, $2, $3)",
            self.payments
        );
        sqlx::query(AssertSqlSafe(insert))
            .bind(&msg.message_id)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        after_effect(msg, signals).await
    }

    async fn count(&self, sql: String, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(id)
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
}

impl<const ISO: u8> Backend for Pg<ISO> {
    async fn setup() -> Self {
        let pool = common::pg_pool_with(24, ISO).await;
        let (markers, payments) = (common::unique("markers"), common::unique("payments"));
        let store = idempotent_runtime::PgStore::builder(pool.clone())
            .table(&markers)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let ddl = format!(
            "CREATE TABLE {payments} (id BIGSERIAL PRIMARY KEY, message_id TEXT, order_id TEXT, amount BIGINT)"
        );
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        Pg {
            store,
            markers,
            payments,
        }
    }
    fn pay(&self, msg: &Payment, signals: &Signals) -> impl Future<Output = Result<i64, AppError>> + Send {
        self.process(msg, signals)
    }
    async fn payments(&self, id: &str) -> i64 {
        self.count(
            format!("SELECT count(*) FROM {} WHERE message_id = $1", self.payments),
            id,
        )
        .await
    }
    async fn markers(&self, id: &str) -> i64 {
        self.count(
            format!("SELECT count(*) FROM {} WHERE message_id = $1", self.markers),
            id,
        )
        .await
    }
    async fn teardown(self) {
        common::drop_pg_table(self.store.pool(), &self.markers).await;
        common::drop_pg_table(self.store.pool(), &self.payments).await;
    }
}

// ---- SQLite -------------------------------------------------------------

/// SQLite in the journal mode `JOURNAL`.
pub struct Lite<const JOURNAL: u8> {
    store: idempotent_runtime::SqliteStore,
    _dir: tempfile::TempDir,
}

impl<const JOURNAL: u8> Lite<JOURNAL> {
    #[idempotent(key = "msg.message_id", store = self.store, fingerprint = "(&msg.order_id, msg.amount)")]
    async fn process(
        &self,
        msg: &Payment,
        signals: &Signals,
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    ) -> Result<i64, AppError> {
        sqlx::query("INSERT INTO payments (message_id, order_id, amount) VALUES (?1, ?2, ?3)")
            .bind(&msg.message_id)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut **tx)
            .await?;
        after_effect(msg, signals).await
    }

    async fn count(&self, sql: &'static str, id: &str) -> i64 {
        sqlx::query_scalar(sql)
            .bind(id)
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
}

impl<const JOURNAL: u8> Backend for Lite<JOURNAL> {
    async fn setup() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = common::sqlite_store_with(dir.path(), JOURNAL).await;
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE payments (id INTEGER PRIMARY KEY, message_id TEXT, order_id TEXT, amount INTEGER)")
            .execute(store.pool())
            .await
            .unwrap();
        Lite { store, _dir: dir }
    }
    fn pay(&self, msg: &Payment, signals: &Signals) -> impl Future<Output = Result<i64, AppError>> + Send {
        self.process(msg, signals)
    }
    async fn payments(&self, id: &str) -> i64 {
        self.count("SELECT count(*) FROM payments WHERE message_id = ?1", id)
            .await
    }
    async fn markers(&self, id: &str) -> i64 {
        self.count("SELECT count(*) FROM processed_messages WHERE message_id = ?1", id)
            .await
    }
    async fn teardown(self) {
        self.store.pool().close().await;
    }
}

// ---- MySQL / MariaDB ------------------------------------------------------

/// MariaDB, its sessions at the isolation level `ISO`.
pub struct My<const ISO: u8> {
    store: idempotent_runtime::MySqlStore,
    markers: String,
    payments: String,
}

impl<const ISO: u8> My<ISO> {
    #[idempotent(key = "msg.message_id", store = self.store, fingerprint = "(&msg.order_id, msg.amount)")]
    async fn process(&self, msg: &Payment, signals: &Signals, tx: &mut sqlx::MySqlConnection) -> Result<i64, AppError> {
        let insert = format!(
            "INSERT INTO `{}` (message_id, order_id, amount) VALUES (?, ?, ?)",
            self.payments
        );
        sqlx::query(AssertSqlSafe(insert))
            .bind(&msg.message_id)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        after_effect(msg, signals).await
    }

    async fn count(&self, sql: String, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(id)
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
}

impl<const ISO: u8> Backend for My<ISO> {
    async fn setup() -> Self {
        let pool = common::mysql_pool_with(24, ISO).await;
        let (markers, payments) = (common::unique("markers"), common::unique("payments"));
        let store = idempotent_runtime::MySqlStore::builder(pool.clone())
            .table(&markers)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let ddl = format!(
            "CREATE TABLE `{payments}` (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARBINARY(255), \
             order_id VARCHAR(300), amount BIGINT)"
        );
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        My {
            store,
            markers,
            payments,
        }
    }
    fn pay(&self, msg: &Payment, signals: &Signals) -> impl Future<Output = Result<i64, AppError>> + Send {
        self.process(msg, signals)
    }
    async fn payments(&self, id: &str) -> i64 {
        self.count(
            format!("SELECT count(*) FROM `{}` WHERE message_id = ?", self.payments),
            id,
        )
        .await
    }
    async fn markers(&self, id: &str) -> i64 {
        self.count(
            format!("SELECT count(*) FROM `{}` WHERE message_id = ?", self.markers),
            id,
        )
        .await
    }
    async fn teardown(self) {
        common::drop_mysql_table(self.store.pool(), &self.markers).await;
        common::drop_mysql_table(self.store.pool(), &self.payments).await;
    }
}

// ---- the tests ------------------------------------------------------------

pub async fn sixteen_concurrent_deliveries_apply_the_effect_once<B: Backend>() {
    let b = Arc::new(B::setup().await);
    let id = common::unique("sixteen");
    let signals = Arc::new(Signals::default());
    let calls = (0..16).map(|_| {
        let (b, signals, msg) = (Arc::clone(&b), Arc::clone(&signals), Payment::new(&id, 7));
        tokio::spawn(async move { b.pay(&msg, &signals).await })
    });
    for result in futures_util::future::join_all(calls).await {
        assert_eq!(
            result.unwrap().unwrap(),
            700,
            "every caller gets Ok with the first run's result"
        );
    }
    assert_eq!(b.payments(&id).await, 1);
    assert_eq!(b.markers(&id).await, 1);
    Arc::into_inner(b).unwrap().teardown().await;
}

/// A body that wrote its effect and then failed, panicked or was cancelled:
/// neither effect nor marker remains, and the redelivery runs at once.
pub async fn failed_bodies_leave_no_effect_and_no_marker<B: Backend>() {
    let b = Arc::new(B::setup().await);
    let signals = Arc::new(Signals::default());

    let failed = common::unique("failed");
    let err = b
        .pay(&Payment::new(&failed, 1).then(After::Fail), &signals)
        .await
        .unwrap_err();
    assert!(matches!(err, AppError::Failed), "{err:?}");

    let panicked = common::unique("panicked");
    let (b2, s2, msg) = (
        Arc::clone(&b),
        Arc::clone(&signals),
        Payment::new(&panicked, 1).then(After::Panic),
    );
    assert!(
        tokio::spawn(async move { b2.pay(&msg, &s2).await })
            .await
            .unwrap_err()
            .is_panic()
    );

    let cancelled = common::unique("cancelled");
    let (b3, s3, msg) = (
        Arc::clone(&b),
        Arc::clone(&signals),
        Payment::new(&cancelled, 1).then(After::Block),
    );
    let call = tokio::spawn(async move { b3.pay(&msg, &s3).await });
    signals.started.notified().await; // the effect row is written, the body is mid-flight
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    for id in [&failed, &panicked, &cancelled] {
        assert_eq!(b.payments(id).await, 0, "{id}: the effect was rolled back");
        assert_eq!(b.markers(id).await, 0, "{id}: no marker");
        let redelivery = Payment::new(id, 1);
        let again = tokio::time::timeout(Duration::from_secs(10), b.pay(&redelivery, &signals));
        assert_eq!(
            again
                .await
                .expect("the redelivery did not wait on a lock left behind")
                .unwrap(),
            100
        );
        assert_eq!(b.payments(id).await, 1);
    }
    Arc::into_inner(b).unwrap().teardown().await;
}

pub async fn reused_key_commits_nothing<B: Backend>() {
    let b = B::setup().await;
    let signals = Signals::default();
    let id = common::unique("reused");
    b.pay(&Payment::new(&id, 10), &signals).await.unwrap();
    let err = b.pay(&Payment::new(&id, 99), &signals).await.unwrap_err();
    assert!(matches!(err, AppError::Idem(Error::KeyReused { .. })), "{err:?}");
    assert_eq!(b.payments(&id).await, 1);
    b.teardown().await;
}

pub async fn sql_in_a_key_is_only_data<B: Backend>() {
    let b = B::setup().await;
    let signals = Signals::default();
    let id = format!("{}'; DROP TABLE payments; --\"`\\", common::unique("hostile"));
    assert_eq!(b.pay(&Payment::new(&id, 2), &signals).await.unwrap(), 200);
    assert_eq!(b.pay(&Payment::new(&id, 2), &signals).await.unwrap(), 200);
    assert_eq!(b.payments(&id).await, 1);
    assert_eq!(b.markers(&id).await, 1, "the key is stored exactly as given");
    b.teardown().await;
}

/// Several hundred deliveries of 120 messages, shuffled, 16 at a time, with
/// some first attempts failing: every message's effect exactly once.
pub async fn shuffled_duplicates_under_concurrency_apply_each_effect_once<B: Backend>() {
    let b = Arc::new(B::setup().await);
    let signals = Arc::new(Signals::default());
    let ids: Vec<String> = (0..120).map(|i| common::unique(&format!("bulk{i}"))).collect();
    let mut deliveries: Vec<Payment> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let copies = 1 + i % 4; // 1..=4 deliveries each
        for c in 0..copies {
            let after = if c == 0 && i % 5 == 0 {
                After::Fail
            } else {
                After::Commit
            };
            deliveries.push(Payment::new(id, i as i64).then(after));
        }
    }
    // A failed first attempt is redelivered later, as a broker would.
    for (i, id) in ids.iter().enumerate() {
        if i % 5 == 0 {
            deliveries.push(Payment::new(id, i as i64));
        }
    }
    deliveries.shuffle(&mut rand::rng());
    let total = deliveries.len();
    assert!(total > 300);
    let queue = Arc::new(tokio::sync::Mutex::new(deliveries));
    let workers = (0..16).map(|_| {
        let (b, signals, queue) = (Arc::clone(&b), Arc::clone(&signals), Arc::clone(&queue));
        tokio::spawn(async move {
            loop {
                let Some(msg) = queue.lock().await.pop() else { return };
                match b.pay(&msg, &signals).await {
                    Ok(v) => assert_eq!(v, msg.amount * 100),
                    Err(AppError::Failed) => assert_eq!(msg.after, After::Fail),
                    Err(other) => panic!("unexpected error: {other:?}"),
                }
            }
        })
    });
    for worker in futures_util::future::join_all(workers).await {
        worker.unwrap();
    }
    for id in &ids {
        assert_eq!(b.payments(id).await, 1, "{id}");
    }
    Arc::into_inner(b).unwrap().teardown().await;
}

macro_rules! transactional_suite {
    ($module:ident, $backend:ty) => {
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sixteen_concurrent_deliveries_apply_the_effect_once() {
                super::sixteen_concurrent_deliveries_apply_the_effect_once::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn failed_bodies_leave_no_effect_and_no_marker() {
                super::failed_bodies_leave_no_effect_and_no_marker::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn reused_key_commits_nothing() {
                super::reused_key_commits_nothing::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sql_in_a_key_is_only_data() {
                super::sql_in_a_key_is_only_data::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn shuffled_duplicates_under_concurrency_apply_each_effect_once() {
                super::shuffled_duplicates_under_concurrency_apply_each_effect_once::<$backend>().await
            }
        }
    };
}

use common::settings::*;

transactional_suite!(postgres, super::Pg<{ super::PG_SERVER_DEFAULT }>);
transactional_suite!(
    postgres_repeatable_read_default,
    super::Pg<{ super::PG_REPEATABLE_READ }>
);
transactional_suite!(postgres_serializable_default, super::Pg<{ super::PG_SERIALIZABLE }>);
transactional_suite!(sqlite, super::Lite<{ super::LITE_WAL }>);
transactional_suite!(sqlite_rollback_journal, super::Lite<{ super::LITE_ROLLBACK_JOURNAL }>);
transactional_suite!(mysql, super::My<{ super::MY_SERVER_DEFAULT }>);
transactional_suite!(mysql_read_committed_session, super::My<{ super::MY_READ_COMMITTED }>);
transactional_suite!(mysql_serializable_session, super::My<{ super::MY_SERIALIZABLE }>);

#[tokio::test]
async fn invalid_table_names_are_refused_at_configuration() {
    let pool = common::pg_pool(1).await;
    for bad in ["x; DROP TABLE users", "a\"b", "1st", "a.b.c", ""] {
        let err = idempotent_runtime::PgStore::builder(pool.clone())
            .table(bad)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{bad:?}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let lite = idempotent_runtime::SqliteStore::open(dir.path().join("x.db"))
        .await
        .unwrap();
    for bad in ["x; DROP TABLE users", "main.markers", "with space"] {
        let err = idempotent_runtime::SqliteStore::builder(lite.pool().clone())
            .table(bad)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{bad:?}: {err}");
    }
    assert!(
        idempotent_runtime::PgStore::builder(pool)
            .table("app_markers")
            .build()
            .is_ok()
    );
}

#[tokio::test]
async fn postgres_commits_are_durable_even_when_the_session_default_is_not() {
    // `synchronous_commit = off` (a setting users turn on for speed) lets a
    // commit return before it is durable: the broker would be acknowledged
    // for an effect a server crash can still lose. The claim's transaction
    // turns it back on for its commit. What the commit runs with is read
    // at `COMMIT` itself, by a deferred constraint trigger on the effect.
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(common::PG_URL)
        .unwrap()
        .options([("synchronous_commit", "off")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let table = common::unique("durable");
    let effects = common::unique("durable_e");
    let store = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&table)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {effects} (id TEXT NOT NULL, at_commit TEXT); \
         CREATE FUNCTION {effects}_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         UPDATE {effects} SET at_commit = current_setting('synchronous_commit') WHERE id = NEW.id; \
         RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER {effects}_t AFTER INSERT ON {effects} DEFERRABLE INITIALLY DEFERRED \
         FOR EACH ROW EXECUTE FUNCTION {effects}_f()"
    )))
    .execute(&pool)
    .await
    .unwrap();

    #[idempotent(key = "id", store = store)]
    async fn effect(
        store: &idempotent_runtime::PgStore,
        effects: &str,
        id: &str,
        tx: &mut sqlx::PgConnection,
    ) -> Result<(), AppError> {
        sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {effects} (id) VALUES ($1)")))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    let outside: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(outside, "off", "the pool's sessions default to off");
    let id = common::unique("durable-msg");
    effect(&store, &effects, &id).await.unwrap();
    let at_commit: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT at_commit FROM {effects} WHERE id = $1"
    )))
    .bind(&id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(at_commit.as_deref(), Some("on"));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE {effects}; DROP FUNCTION {effects}_f()"
    )))
    .execute(&pool)
    .await
    .unwrap();
    common::drop_pg_table(&pool, &table).await;
}

#[tokio::test]
async fn postgres_claims_run_at_read_committed_when_the_sessions_default_changes_under_the_store() {
    // The claim begins with a plain `BEGIN` while the sessions default to
    // Read Committed, and its statement refuses any other level. A default
    // changed while the service runs (`ALTER ROLE .. SET`, here the one
    // pooled session's own) must not let a claim run at Repeatable Read,
    // where a concurrent duplicate fails instead of waiting and replaying.
    // Two stores on the pool, so that each claim statement (the one that
    // reads the marker back, and the guarded one of a `()` handler) meets
    // the changed default first.
    let pool = common::pg_pool(1).await;
    let table = common::unique("iso_change");
    let store = || {
        idempotent_runtime::PgStore::builder(pool.clone())
            .table(&table)
            .build()
            .unwrap()
    };
    let (reading, unit) = (store(), store());
    reading.migrate().await.unwrap();
    let levels = common::unique("iso_levels");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {levels} (id TEXT PRIMARY KEY, level TEXT)"
    )))
    .execute(&pool)
    .await
    .unwrap();

    #[idempotent(key = "id", store = store)]
    async fn level_inside(
        store: &idempotent_runtime::PgStore,
        id: &str,
        tx: &mut sqlx::PgConnection,
    ) -> Result<String, AppError> {
        Ok(sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&mut *tx)
            .await?)
    }

    #[idempotent(key = "id", store = store)]
    async fn record_level(
        store: &idempotent_runtime::PgStore,
        levels: &str,
        id: &str,
        tx: &mut sqlx::PgConnection,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {levels} VALUES ($1, current_setting('transaction_isolation'))"
        )))
        .bind(id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
    let recorded = |id: String| {
        let (pool, levels) = (pool.clone(), levels.clone());
        async move {
            sqlx::query_scalar::<_, String>(AssertSqlSafe(format!("SELECT level FROM {levels} WHERE id = $1")))
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    let before = (common::unique("before"), common::unique("before-unit"));
    assert_eq!(level_inside(&reading, &before.0).await.unwrap(), "read committed");
    record_level(&unit, &levels, &before.1).await.unwrap();
    assert_eq!(recorded(before.1).await, "read committed");

    sqlx::query("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&pool)
        .await
        .unwrap();
    let outside: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(outside, "repeatable read", "the pool's one session now defaults to it");

    for round in 0..2 {
        let (id, unit_id) = (common::unique("after"), common::unique("after-unit"));
        assert_eq!(
            level_inside(&reading, &id).await.unwrap(),
            "read committed",
            "round {round}"
        );
        record_level(&unit, &levels, &unit_id).await.unwrap();
        assert_eq!(recorded(unit_id.clone()).await, "read committed", "round {round}");
        // The duplicates replay: the reading one its stored result, the
        // `()` one without running its body (a second insert of its id
        // would fail on the primary key).
        assert_eq!(level_inside(&reading, &id).await.unwrap(), "read committed");
        record_level(&unit, &levels, &unit_id).await.unwrap();
    }
    common::drop_pg_table(&pool, &levels).await;
    common::drop_pg_table(&pool, &table).await;
}

#[tokio::test(flavor = "current_thread")]
async fn mysql_without_a_log_flush_at_each_commit_is_reported() {
    // innodb_flush_log_at_trx_commit is global: a session cannot turn it
    // back on, so the store says so (once) instead of pretending.
    /// Puts the server's setting back even if the test fails, on a
    /// connection of its own (the pool belongs to the test's runtime).
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            let status = std::process::Command::new("mariadb")
                .args([
                    "-h127.0.0.1",
                    "-uroot",
                    "-e",
                    "SET GLOBAL innodb_flush_log_at_trx_commit = 1",
                ])
                .status()
                .expect("the mariadb client");
            assert!(status.success(), "restoring innodb_flush_log_at_trx_commit");
        }
    }
    #[idempotent(key = "id", store = store)]
    async fn touch(
        store: &idempotent_runtime::MySqlStore,
        id: &str,
        tx: &mut sqlx::MySqlConnection,
    ) -> Result<(), AppError> {
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        Ok(())
    }

    let pool = common::mysql_pool(2).await;
    let table = common::unique("flush");
    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::WARN));
    {
        sqlx::query("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
            .execute(&pool)
            .await
            .unwrap();
        let _restore = Restore;
        let store = idempotent_runtime::MySqlStore::builder(pool.clone())
            .table(&table)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        touch(&store, &common::unique("flush-a")).await.unwrap();
        touch(&store, &common::unique("flush-b")).await.unwrap();
    }
    let out = captured.text();
    assert_eq!(out.matches("innodb_flush_log_at_trx_commit=2").count(), 1, "{out}");
    common::drop_mysql_table(&pool, &table).await;
}

// ---- a transaction that ended under the handler (issue #43, hole 1) -------
//
// A call reports a commit only if the transaction that commits is the one
// holding its claim. InnoDB rolls a deadlock victim's whole transaction back
// and the session goes on in autocommit; a handler may end the transaction
// itself (`ROLLBACK`). A handler that returns `Ok` over either must get
// `Error::TransactionAborted`, with nothing committed: no effect, no marker,
// no outgoing message, and the redelivery runs the body.

/// A deadlock made on purpose between the handler and an opponent holding
/// the second statistics row (and many more, so that InnoDB picks the
/// handler, the lighter transaction, as its victim).
#[derive(Default)]
struct Fight {
    /// The handler holds the first statistics row: the opponent asks for it.
    go: Notify,
    /// What the handler's best-effort statements failed with.
    swallowed: std::sync::Mutex<Vec<String>>,
}

/// MariaDB with a payment table, statistics rows, the opponent's filler rows
/// and an outbox table.
struct MyFight {
    store: idempotent_runtime::MySqlStore,
    payments: String,
    stats: String,
    filler: String,
    outbox: String,
}

impl MyFight {
    async fn setup() -> Self {
        let pool = common::mysql_pool(8).await;
        let (markers, payments, stats, filler, outbox) = (
            common::unique("markers"),
            common::unique("payments"),
            common::unique("stats"),
            common::unique("filler"),
            common::unique("outbox"),
        );
        let store = idempotent_runtime::MySqlStore::builder(pool.clone())
            .table(&markers)
            .outbox_table(&outbox)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        for ddl in [
            format!("CREATE TABLE `{payments}` (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARBINARY(255))"),
            format!("CREATE TABLE `{stats}` (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE=InnoDB"),
            format!("INSERT INTO `{stats}` VALUES (1, 0), (2, 0)"),
            format!("CREATE TABLE `{filler}` (id INT PRIMARY KEY, v BIGINT NOT NULL) ENGINE=InnoDB"),
            format!("INSERT INTO `{filler}` SELECT seq, 0 FROM seq_1_to_500"),
        ] {
            sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        }
        MyFight {
            store,
            payments,
            stats,
            filler,
            outbox,
        }
    }

    /// Pays, stages an outgoing message when `stage`, then bumps two
    /// statistics rows, best effort: their errors are ignored, as many
    /// services do. With a `fight`, waits between the two for the opponent
    /// to ask for the first row, so that the second one deadlocks.
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn pay(
        &self,
        msg: &Payment,
        fight: Option<&Fight>,
        stage: bool,
        tx: &mut sqlx::MySqlConnection,
        outbox: &mut idempotent_runtime::outbox::Outbox,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}` (message_id) VALUES (?)",
            self.payments
        )))
        .bind(&msg.message_id)
        .execute(&mut *tx)
        .await?;
        if stage {
            outbox.publish(idempotent_runtime::outbox::Outgoing::new(
                "payments",
                msg.message_id.clone().into_bytes(),
            ));
        }
        let bump = format!("UPDATE `{}` SET n = n + 1 WHERE id = ?", self.stats);
        let first = sqlx::query(AssertSqlSafe(bump.clone())).bind(1).execute(&mut *tx).await;
        if let Some(fight) = fight {
            fight.go.notify_one();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let second = sqlx::query(AssertSqlSafe(bump)).bind(2).execute(&mut *tx).await;
        for outcome in [first, second] {
            if let (Err(error), Some(fight)) = (outcome, fight) {
                fight.swallowed.lock().unwrap().push(error.to_string());
            }
        }
        Ok(())
    }

    /// The opponent: a transaction of its own that writes the filler rows
    /// and the second statistics row, then (once told) asks for the first.
    async fn opponent(&self, fight: Arc<Fight>) -> tokio::task::JoinHandle<()> {
        let mut tx = self.store.pool().begin().await.unwrap();
        for sql in [
            format!("UPDATE `{}` SET v = v + 1", self.filler),
            format!("UPDATE `{}` SET n = n + 1 WHERE id = 2", self.stats),
        ] {
            sqlx::query(AssertSqlSafe(sql)).execute(&mut *tx).await.unwrap();
        }
        let first = format!("UPDATE `{}` SET n = n + 1 WHERE id = 1", self.stats);
        tokio::spawn(async move {
            fight.go.notified().await;
            // Waits for the handler's lock, until InnoDB rolls the handler back.
            sqlx::query(AssertSqlSafe(first)).execute(&mut *tx).await.unwrap();
            tx.rollback().await.unwrap();
        })
    }

    async fn count(&self, table: &str, column: &str, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM `{table}` WHERE {column} = ?"
        )))
        .bind(id)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    async fn teardown(self) {
        let markers = self.store.table().to_string();
        for table in [&markers, &self.payments, &self.stats, &self.filler, &self.outbox] {
            common::drop_mysql_table(self.store.pool(), table).await;
        }
    }
}

/// The deadlock, with or without an outgoing message staged after it.
async fn a_mysql_deadlock_victim_is_reported_not_committed(stage: bool) {
    let b = MyFight::setup().await;
    let id = common::unique("victim");
    let msg = Payment::new(&id, 1);
    let fight = Arc::new(Fight::default());
    let opponent = b.opponent(Arc::clone(&fight)).await;

    let outcome = b.pay(&msg, Some(&fight), stage).await;
    opponent.await.unwrap();
    let swallowed = fight.swallowed.lock().unwrap().clone();
    assert!(
        swallowed.len() == 1 && swallowed[0].contains("1213"),
        "the handler was the deadlock's victim: {swallowed:?}"
    );
    assert!(
        matches!(outcome, Err(AppError::Idem(Error::TransactionAborted))),
        "InnoDB rolled the claim's transaction back: not a commit: {outcome:?}"
    );
    assert_eq!(b.count(&b.payments, "message_id", &id).await, 0, "no effect");
    let markers = b.store.table().to_string();
    assert_eq!(b.count(&markers, "message_id", &id).await, 0, "no marker");
    assert_eq!(
        b.count(&b.outbox, "destination", "payments").await,
        0,
        "no outgoing message"
    );

    // The redelivery processes it.
    b.pay(&msg, None, stage).await.unwrap();
    assert_eq!(b.count(&b.payments, "message_id", &id).await, 1);
    assert_eq!(b.count(&markers, "message_id", &id).await, 1);
    assert_eq!(b.count(&b.outbox, "destination", "payments").await, i64::from(stage));
    b.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_deadlock_victim_whose_handler_returns_ok_is_reported_not_committed() {
    a_mysql_deadlock_victim_is_reported_not_committed(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_deadlock_victim_stages_no_outgoing_message() {
    a_mysql_deadlock_victim_is_reported_not_committed(true).await;
}

/// A handler that ends the claim's transaction itself (`ROLLBACK`) and
/// returns `Ok`, on `$conn` with `$insert` (the payment) and outbox table
/// `{outbox}`.
macro_rules! ended_by_the_handler {
    ($name:ident, $store:ty, $conn:ty, $insert:literal, $setup:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            struct Svc {
                store: $store,
                payments: String,
            }
            impl Svc {
                #[idempotent(key = "msg.message_id", store = self.store)]
                async fn pay(
                    &self,
                    msg: &Payment,
                    end: bool,
                    tx: &mut $conn,
                    outbox: &mut idempotent_runtime::outbox::Outbox,
                ) -> Result<(), AppError> {
                    sqlx::query(AssertSqlSafe(format!($insert, self.payments)))
                        .bind(&msg.message_id)
                        .execute(&mut *tx)
                        .await?;
                    outbox.publish(idempotent_runtime::outbox::Outgoing::new(
                        "payments",
                        msg.message_id.clone().into_bytes(),
                    ));
                    if end {
                        sqlx::query("ROLLBACK").execute(&mut *tx).await?;
                    }
                    Ok(())
                }
            }
            let (store, payments, outbox, cleanup) = $setup.await;
            let svc = Svc { store, payments };
            let count = |sql: String| {
                let pool = svc.store.pool().clone();
                async move {
                    let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                    n
                }
            };
            let markers = svc.store.table().to_string();
            let id = common::unique("ended");
            let msg = Payment::new(&id, 1);
            let effects = format!("SELECT count(*) FROM {} WHERE message_id = '{id}'", svc.payments);
            let marked = format!("SELECT count(*) FROM {markers} WHERE message_id = '{id}'");
            let staged = format!("SELECT count(*) FROM {outbox}");
            for round in 0..3 {
                let outcome = svc.pay(&msg, true).await;
                assert!(
                    matches!(outcome, Err(AppError::Idem(Error::TransactionAborted))),
                    "round {round}: the handler rolled the claim back: {outcome:?}"
                );
            }
            assert_eq!(count(effects.clone()).await, 0, "no effect");
            assert_eq!(count(marked.clone()).await, 0, "no marker");
            assert_eq!(count(staged.clone()).await, 0, "no outgoing message");
            // The redelivery processes it, on the same pool's connections.
            for _ in 0..3 {
                svc.pay(&msg, false).await.unwrap();
            }
            assert_eq!(count(effects).await, 1);
            assert_eq!(count(marked).await, 1);
            assert_eq!(count(staged).await, 1);
            cleanup(svc.store.clone()).await;
        }
    };
}

type Cleanup<S> = fn(S) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

async fn sqlite_with_outbox() -> (
    idempotent_runtime::SqliteStore,
    String,
    String,
    Cleanup<idempotent_runtime::SqliteStore>,
) {
    let dir = tempfile::tempdir().unwrap().keep();
    let store = idempotent_runtime::SqliteStore::open(dir.join("markers.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE payments (id INTEGER PRIMARY KEY, message_id TEXT)")
        .execute(store.pool())
        .await
        .unwrap();
    let outbox = idempotent_runtime::store::DEFAULT_OUTBOX_TABLE.to_owned();
    let cleanup: Cleanup<idempotent_runtime::SqliteStore> = |store| {
        Box::pin(async move {
            let file = store.pool().connect_options().get_filename().to_path_buf();
            store.pool().close().await;
            if let Some(dir) = file.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        })
    };
    (store, "payments".to_owned(), outbox, cleanup)
}

async fn pg_with_outbox() -> (
    idempotent_runtime::PgStore,
    String,
    String,
    Cleanup<idempotent_runtime::PgStore>,
) {
    let pool = common::pg_pool(4).await;
    let base = common::unique("ended");
    let (markers, payments, outbox) = (format!("m_{base}"), format!("p_{base}"), format!("o_{base}"));
    let store = idempotent_runtime::PgStore::builder(pool.clone())
        .table(&markers)
        .outbox_table(&outbox)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {payments} (id BIGSERIAL PRIMARY KEY, message_id TEXT)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let cleanup: Cleanup<idempotent_runtime::PgStore> = |store| {
        Box::pin(async move {
            let markers = store.table().to_string();
            let payments = markers.replacen("m_", "p_", 1);
            let outbox = markers.replacen("m_", "o_", 1);
            for table in [markers, payments, outbox] {
                common::drop_pg_table(store.pool(), &table).await;
            }
        })
    };
    (store, payments, outbox, cleanup)
}

async fn mysql_with_outbox() -> (
    idempotent_runtime::MySqlStore,
    String,
    String,
    Cleanup<idempotent_runtime::MySqlStore>,
) {
    let pool = common::mysql_pool(4).await;
    let base = common::unique("ended");
    let (markers, payments, outbox) = (format!("m_{base}"), format!("p_{base}"), format!("o_{base}"));
    let store = idempotent_runtime::MySqlStore::builder(pool.clone())
        .table(&markers)
        .outbox_table(&outbox)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {payments} (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(255))"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let cleanup: Cleanup<idempotent_runtime::MySqlStore> = |store| {
        Box::pin(async move {
            let markers = store.table().to_string();
            let payments = markers.replacen("m_", "p_", 1);
            let outbox = markers.replacen("m_", "o_", 1);
            for table in [markers, payments, outbox] {
                common::drop_mysql_table(store.pool(), &table).await;
            }
        })
    };
    (store, payments, outbox, cleanup)
}

ended_by_the_handler!(
    sqlite_a_handler_that_rolls_the_claim_back_itself_is_reported_not_committed,
    idempotent_runtime::SqliteStore,
    sqlx::SqliteConnection,
    "INSERT INTO {} (message_id) VALUES (?1)",
    sqlite_with_outbox()
);
ended_by_the_handler!(
    postgres_a_handler_that_rolls_the_claim_back_itself_is_reported_not_committed,
    idempotent_runtime::PgStore,
    sqlx::PgConnection,
    "INSERT INTO {} (message_id) VALUES ($1)",
    pg_with_outbox()
);
ended_by_the_handler!(
    mysql_a_handler_that_rolls_the_claim_back_itself_is_reported_not_committed,
    idempotent_runtime::MySqlStore,
    sqlx::MySqlConnection,
    "INSERT INTO {} (message_id) VALUES (?)",
    mysql_with_outbox()
);
