//! `MySqlStore` against the real MariaDB/MySQL server (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`), driven through the `Store`, `Guard`
//! and `TransactionGuard` traits.
//!
//! Each test works on its own marker table (`t_<test>_<random>`) and effect
//! table (`<marker table>_pay`), created at the start and dropped at the
//! end. The effect table has no unique constraint, so a body that ran twice
//! would show up as two rows instead of an error.

#![cfg(feature = "mysql")]

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, Row};
use idempotent_runtime::store::{Claim, Fingerprint, Guard, PurgeExpired, Request, Store, TransactionGuard};
use idempotent_runtime::{Error, MySqlStore};

type MyGuard = <MySqlStore as Store>::Guard;

fn url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

fn random_u64() -> u64 {
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

async fn pool(max: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .connect(&url())
        .await
        .expect("connect to MariaDB (MYSQL_URL)")
}

/// A store on a fresh marker table plus an effect table, dropped by
/// [`Fixture::drop_tables`].
struct Fixture {
    store: MySqlStore,
    pool: MySqlPool,
    table: String,
    pay: String,
}

impl Fixture {
    async fn new(test: &str, connections: u32) -> Self {
        Self::with_batch(test, connections, 1000).await
    }

    async fn with_batch(test: &str, connections: u32, batch: u32) -> Self {
        let pool = pool(connections).await;
        let table = format!("t_{test}_{:012x}", random_u64() & 0xffff_ffff_ffff);
        let store = MySqlStore::builder(pool.clone())
            .table(&table)
            .purge_batch(batch)
            .build()
            .expect("valid table");
        store.migrate().await.expect("migrate");
        let pay = format!("{table}_pay");
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE `{pay}` (seq BIGINT AUTO_INCREMENT PRIMARY KEY, order_id VARCHAR(300) NOT NULL, \
             amount BIGINT NOT NULL) ENGINE = InnoDB"
        )))
        .execute(&pool)
        .await
        .expect("create effect table");
        Fixture {
            store,
            pool,
            table,
            pay,
        }
    }

    async fn drop_tables(self) {
        for t in [&self.table, &self.pay] {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
                .execute(&self.pool)
                .await
                .expect("drop");
        }
        self.pool.close().await;
    }

    async fn claim(&self, key: &str) -> Result<Claim<MyGuard>, Error> {
        self.store.claim(&Request::new("pay", key)?).await
    }

    /// The handler's effect, written in the claim's transaction.
    async fn pay(&self, guard: &mut MyGuard, order: &str, amount: i64) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}` (order_id, amount) VALUES (?, ?)",
            self.pay
        )))
        .bind(order)
        .bind(amount)
        .execute(&mut **guard.transaction())
        .await
        .expect("effect");
    }

    async fn effects(&self, order: &str) -> i64 {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}` WHERE order_id = ?",
            self.pay
        )))
        .bind(order)
        .fetch_one(&self.pool)
        .await
        .expect("count effects")
        .get(0)
    }

    async fn all_effects(&self) -> HashMap<String, i64> {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT order_id, COUNT(*) FROM `{}` GROUP BY order_id",
            self.pay
        )))
        .fetch_all(&self.pool)
        .await
        .expect("effects")
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
    }

    async fn markers(&self) -> i64 {
        sqlx::query(AssertSqlSafe(format!("SELECT COUNT(*) FROM `{}`", self.table)))
            .fetch_one(&self.pool)
            .await
            .expect("count markers")
            .get(0)
    }

    async fn has_marker(&self, key: &str) -> bool {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT 1 FROM `{}` WHERE scope = 'pay' AND message_id = ?",
            self.table
        )))
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .expect("marker")
        .is_some()
    }
}

fn fresh(claim: Result<Claim<MyGuard>, Error>) -> MyGuard {
    match claim {
        Ok(Claim::Fresh(guard)) => guard,
        Ok(Claim::Done(replay)) => panic!("expected a fresh claim, got a duplicate replaying {:?}", replay.json()),
        Err(error) => panic!("expected a fresh claim, got {error}"),
    }
}

fn done(claim: Result<Claim<MyGuard>, Error>) -> Option<String> {
    match claim {
        Ok(Claim::Done(replay)) => replay.json().map(str::to_owned),
        Ok(Claim::Fresh(_)) => panic!("expected a duplicate, got a fresh claim"),
        Err(error) => panic!("expected a duplicate, got {error}"),
    }
}

/// A claim that must not wait for a lock left behind (the server's lock wait
/// timeout is far longer than this).
async fn claim_now(fx: &Fixture, key: &str) -> Result<Claim<MyGuard>, Error> {
    tokio::time::timeout(Duration::from_secs(5), fx.claim(key))
        .await
        .expect("the claim waited for a released key")
}

#[tokio::test]
async fn claim_effect_complete_then_duplicates_replay() {
    // One connection: the fresh claim of `m-2` follows duplicates on the same
    // session, whose `LAST_INSERT_ID` the claim statement set to 1.
    let fx = Fixture::new("replay", 1).await;

    let mut guard = fresh(fx.claim("m-1").await);
    fx.pay(&mut guard, "order-1", 100).await;
    guard
        .complete(Some(r#"{"receipt":42}"#.to_owned()))
        .await
        .expect("complete");

    for _ in 0..3 {
        assert_eq!(done(fx.claim("m-1").await).as_deref(), Some(r#"{"receipt":42}"#));
    }
    let replay = match fx.claim("m-1").await.expect("claim") {
        Claim::Done(replay) => replay,
        Claim::Fresh(_) => panic!("fresh"),
    };
    assert_eq!(
        replay.decode::<serde_json::Value>().expect("decode"),
        serde_json::json!({"receipt": 42})
    );
    assert_eq!(fx.effects("order-1").await, 1);

    // A unit result stores nothing and replays `null`.
    let mut guard = fresh(fx.claim("m-2").await);
    fx.pay(&mut guard, "order-2", 5).await;
    guard.complete(None).await.expect("complete");
    assert_eq!(done(fx.claim("m-2").await), None);
    assert_eq!(fx.effects("order-2").await, 1);
    assert_eq!(fx.markers().await, 2);

    // Scopes keep separate markers for the same key.
    let other = Request::new("refund", "m-1").expect("request");
    let guard = fresh(fx.store.claim(&other).await);
    guard.complete(None).await.expect("complete");
    assert_eq!(fx.markers().await, 3);

    fx.drop_tables().await;
}

#[tokio::test]
async fn the_claim_runs_at_read_committed_and_leaves_the_session_alone() {
    // One connection, so the plain transaction below runs on the very
    // connection the claim used; a second pool writes concurrently.
    // (Behaviour is checked rather than `information_schema.innodb_trx`,
    // whose isolation column is a cache refreshed at most every 100 ms.)
    let fx = Fixture::new("isolation", 1).await;
    let other = pool(1).await;
    let probe = format!("{}_probe", fx.table);
    let read = format!("SELECT a FROM `{probe}`");
    let write = format!("UPDATE `{probe}` SET a = ?");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE `{probe}` (a INT NOT NULL) ENGINE = InnoDB"
    )))
    .execute(&other)
    .await
    .expect("create probe");
    sqlx::query(AssertSqlSafe(format!("INSERT INTO `{probe}` VALUES (1)")))
        .execute(&other)
        .await
        .expect("insert");
    let set = |a: i32| sqlx::query(AssertSqlSafe(write.clone())).bind(a).execute(&other);

    let mut guard = fresh(fx.claim("iso").await);
    let first: i32 = sqlx::query_scalar(AssertSqlSafe(read.clone()))
        .fetch_one(&mut **guard.transaction())
        .await
        .expect("read");
    set(2).await.expect("concurrent update");
    let second: i32 = sqlx::query_scalar(AssertSqlSafe(read.clone()))
        .fetch_one(&mut **guard.transaction())
        .await
        .expect("read");
    guard.complete(None).await.expect("complete");
    assert_eq!(
        (first, second),
        (1, 2),
        "READ COMMITTED sees the other transaction's commit"
    );

    // The next transaction on that connection has the session's own level
    // again (the server default here, REPEATABLE READ).
    let mut tx = fx.pool.begin().await.expect("begin");
    // `tx_isolation` on MariaDB, `transaction_isolation` on MySQL 8.
    let session: String = match sqlx::query_scalar("SELECT @@session.tx_isolation")
        .fetch_one(&mut *tx)
        .await
    {
        Ok(level) => level,
        Err(_) => sqlx::query_scalar("SELECT @@session.transaction_isolation")
            .fetch_one(&mut *tx)
            .await
            .expect("session level"),
    };
    let first: i32 = sqlx::query_scalar(AssertSqlSafe(read.clone()))
        .fetch_one(&mut *tx)
        .await
        .expect("read");
    set(3).await.expect("concurrent update");
    let second: i32 = sqlx::query_scalar(AssertSqlSafe(read.clone()))
        .fetch_one(&mut *tx)
        .await
        .expect("read");
    tx.rollback().await.expect("rollback");
    if session == "REPEATABLE-READ" {
        assert_eq!((first, second), (2, 2), "SET TRANSACTION must not outlive the claim");
    }

    sqlx::query(AssertSqlSafe(format!("DROP TABLE `{probe}`")))
        .execute(&other)
        .await
        .expect("drop probe");
    other.close().await;
    fx.drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_duplicates_run_the_body_once() {
    let fx = Arc::new(Fixture::new("sixteen", 20).await);
    let runs = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(16));

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..16 {
        let (fx, runs, start) = (Arc::clone(&fx), Arc::clone(&runs), Arc::clone(&start));
        tasks.spawn(async move {
            start.wait().await;
            match fx.claim("dup-key").await? {
                Claim::Fresh(mut guard) => {
                    runs.fetch_add(1, Ordering::SeqCst);
                    fx.pay(&mut guard, "order-dup", 10).await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let result = format!(r#"{{"by":{i}}}"#);
                    guard.complete(Some(result.clone())).await?;
                    Ok::<_, Error>((true, Some(result)))
                }
                Claim::Done(replay) => Ok((false, replay.json().map(str::to_owned))),
            }
        });
    }
    let outcomes: Vec<(bool, Option<String>)> = tasks
        .join_all()
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("no claim may fail");

    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(outcomes.iter().filter(|(fresh, _)| *fresh).count(), 1);
    let first = outcomes.iter().find(|(fresh, _)| *fresh).and_then(|(_, r)| r.clone());
    assert!(first.is_some());
    assert!(outcomes.iter().all(|(_, result)| *result == first), "{outcomes:?}");
    assert_eq!(fx.effects("order-dup").await, 1);
    assert_eq!(fx.markers().await, 1);

    Arc::into_inner(fx).expect("tasks are done").drop_tables().await;
}

/// Counts the store's "retrying" events, to report how often InnoDB
/// deadlocked or timed out and the store retried.
mod retries {
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub static SEEN: AtomicUsize = AtomicUsize::new(0);

    struct Counter;

    struct Message(bool);

    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" && format!("{value:?}").contains("retrying") {
                self.0 = true;
            }
        }
    }

    impl tracing::Subscriber for Counter {
        fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
            metadata.target() == "idempotent"
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut message = Message(false);
            event.record(&mut message);
            if message.0 {
                SEEN.fetch_add(1, Ordering::Relaxed);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    pub fn install() {
        let _ = tracing::subscriber::set_global_default(Counter);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundreds_of_mixed_concurrent_deliveries_leak_no_deadlock() {
    const KEYS: usize = 100;
    const COPIES: usize = 3;
    const CONCURRENCY: usize = 24;
    retries::install();

    let fx = Arc::new(Fixture::new("mixed", CONCURRENCY as u32 + 2).await);
    // Every third key fails its first run (the body's error rolls back), and
    // every seventh key's first run is dropped mid-body instead.
    let failed_once: Arc<Vec<std::sync::atomic::AtomicBool>> = Arc::new(
        (0..KEYS)
            .map(|k| std::sync::atomic::AtomicBool::new(k % 3 != 0 && k % 7 != 0))
            .collect(),
    );
    let committed = Arc::new(AtomicUsize::new(0));

    let mut deliveries: Vec<usize> = (0..KEYS).flat_map(|k| std::iter::repeat_n(k, COPIES)).collect();
    let mut seed = random_u64() | 1;
    for i in (1..deliveries.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        deliveries.swap(i, (seed % (i as u64 + 1)) as usize);
    }

    let limit = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    for (n, k) in deliveries.into_iter().enumerate() {
        let (fx, failed_once, committed, limit) = (
            Arc::clone(&fx),
            Arc::clone(&failed_once),
            Arc::clone(&committed),
            Arc::clone(&limit),
        );
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await.expect("semaphore");
            let key = format!("key-{k}");
            let order = format!("order-{k}");
            // Redeliver until the message is processed or found processed,
            // as a broker requeues a failed message.
            let mut redeliveries = 0;
            loop {
                match fx.claim(&key).await? {
                    Claim::Done(replay) => {
                        assert_eq!(replay.json(), Some(format!(r#""ok-{k}""#).as_str()));
                        return Ok::<_, Error>(redeliveries);
                    }
                    Claim::Fresh(mut guard) => {
                        fx.pay(&mut guard, &order, n as i64).await;
                        tokio::time::sleep(Duration::from_millis(1 + (n % 5) as u64)).await;
                        if !failed_once[k].swap(true, Ordering::SeqCst) {
                            if k % 7 == 0 {
                                drop(guard);
                            } else {
                                guard.abort().await;
                            }
                            redeliveries += 1;
                            continue;
                        }
                        guard.complete(Some(format!(r#""ok-{k}""#))).await?;
                        committed.fetch_add(1, Ordering::SeqCst);
                        return Ok(redeliveries);
                    }
                }
            }
        });
    }
    let mut errors = Vec::new();
    let mut redeliveries = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("delivery task panicked") {
            Ok(n) => redeliveries += n,
            Err(error) => errors.push(error.to_string()),
        }
    }
    assert!(errors.is_empty(), "{} deliveries failed: {errors:?}", errors.len());
    assert_eq!(committed.load(Ordering::SeqCst), KEYS);

    let effects = fx.all_effects().await;
    assert_eq!(effects.len(), KEYS);
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
    assert_eq!(fx.markers().await, KEYS as i64);
    eprintln!(
        "{} deliveries, {redeliveries} redeliveries after failed first runs, {} deadlock/lock-timeout retries inside claims (process-wide)",
        KEYS * COPIES,
        retries::SEEN.load(Ordering::Relaxed)
    );

    Arc::into_inner(fx).expect("tasks are done").drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlocked_claim_is_retried_not_reported() {
    retries::install();
    let fx = Arc::new(Fixture::new("deadlock", 4).await);
    let t = fx.table.clone();
    fresh(fx.claim("k-existing").await)
        .complete(None)
        .await
        .expect("complete");

    // Another transaction (REPEATABLE READ, the server default), made heavier
    // (more undo) so that InnoDB picks the claim as the deadlock victim,
    // locks the whole `expires_at` index, gaps included...
    let mut other = fx.pool.begin().await.expect("begin");
    for i in 0..50 {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}` (order_id, amount) VALUES ('weight', ?)",
            fx.pay
        )))
        .bind(i)
        .execute(&mut *other)
        .await
        .expect("weight");
    }
    sqlx::query(AssertSqlSafe(format!(
        "SELECT expires_at FROM `{t}` FORCE INDEX (`{t}_expires_at_idx`) WHERE expires_at >= '2000-01-01' FOR UPDATE"
    )))
    .fetch_all(&mut *other)
    .await
    .expect("lock the index");

    // ...the claim inserts its marker row, then waits to insert its index
    // entry...
    let claim = tokio::spawn({
        let fx = Arc::clone(&fx);
        async move {
            match fx.claim("k-dl").await? {
                Claim::Fresh(guard) => guard.complete(Some("1".to_owned())).await.map(|()| true),
                Claim::Done(_) => Ok(false),
            }
        }
    });
    // Wait until the claim is blocked. `innodb_trx` is a cache that is not
    // refreshed while it was read in the last 100 ms: poll more slowly.
    let waiting = format!(
        "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE '%{t}%'"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(waiting.clone()))
            .fetch_one(&fx.pool)
            .await
            .expect("poll");
        if n > 0 {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            let trx: Vec<(String, Option<String>, String)> =
                sqlx::query_as("SELECT trx_state, trx_query, trx_isolation_level FROM information_schema.innodb_trx")
                    .fetch_all(&fx.pool)
                    .await
                    .expect("trx");
            panic!(
                "the claim never waited for the index lock; finished: {}; {trx:?}",
                claim.is_finished()
            );
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let before = retries::SEEN.load(Ordering::SeqCst);
    // ...and the other transaction now wants the claim's row: a deadlock.
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT result FROM `{t}` WHERE scope = 'pay' AND message_id = 'k-dl' FOR UPDATE"
    )))
    .fetch_optional(&mut *other)
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let retried = retries::SEEN.load(Ordering::SeqCst) > before;
    other.rollback().await.expect("rollback");
    let took_over = tokio::time::timeout(Duration::from_secs(10), claim)
        .await
        .expect("the claim finishes")
        .expect("join")
        .expect("the deadlock must not reach the caller");
    assert!(took_over);
    assert_eq!(done(fx.claim("k-dl").await).as_deref(), Some("1"));
    eprintln!("other transaction: {row:?}; claim retried after a deadlock: {retried}");
    assert!(retried, "the claim should have been the deadlock victim and retried");

    Arc::into_inner(fx).expect("tasks are done").drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_drop_panic_and_cancellation_release_the_key_at_once() {
    let fx = Arc::new(Fixture::new("release", 6).await);

    // abort(), with a duplicate already waiting on the key: it gets the key
    // as soon as the first rolls back.
    let mut guard = fresh(fx.claim("k-abort").await);
    fx.pay(&mut guard, "o-abort", 1).await;
    let waiter = tokio::spawn({
        let fx = Arc::clone(&fx);
        async move { fx.claim("k-abort").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "a concurrent duplicate must wait for the first call"
    );
    guard.abort().await;
    let mut guard = fresh(
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("waited")
            .expect("join"),
    );
    assert_eq!(fx.effects("o-abort").await, 0);
    fx.pay(&mut guard, "o-abort", 1).await;
    guard.complete(None).await.expect("complete");
    assert_eq!(fx.effects("o-abort").await, 1);

    // Dropping the guard rolls back too.
    let mut guard = fresh(fx.claim("k-drop").await);
    fx.pay(&mut guard, "o-drop", 1).await;
    drop(guard);
    assert_eq!(fx.effects("o-drop").await, 0);
    let guard = fresh(claim_now(&fx, "k-drop").await);
    guard.abort().await;
    assert!(!fx.has_marker("k-drop").await);

    // A panicking body.
    let panicked = tokio::spawn({
        let fx = Arc::clone(&fx);
        async move {
            let mut guard = fresh(fx.claim("k-panic").await);
            fx.pay(&mut guard, "o-panic", 1).await;
            panic!("the handler panicked");
        }
    })
    .await;
    assert!(panicked.is_err_and(|e| e.is_panic()));
    assert_eq!(fx.effects("o-panic").await, 0);
    assert!(!fx.has_marker("k-panic").await);
    let mut guard = fresh(claim_now(&fx, "k-panic").await);
    fx.pay(&mut guard, "o-panic", 1).await;
    guard.complete(None).await.expect("complete");
    assert_eq!(fx.effects("o-panic").await, 1);

    // A cancelled handler (its task aborted while the body runs).
    let (written_tx, written) = tokio::sync::oneshot::channel();
    let task = tokio::spawn({
        let fx = Arc::clone(&fx);
        async move {
            let mut guard = fresh(fx.claim("k-cancel").await);
            fx.pay(&mut guard, "o-cancel", 1).await;
            let _ = written_tx.send(());
            tokio::time::sleep(Duration::from_secs(600)).await;
            guard.complete(None).await
        }
    });
    written.await.expect("the body started");
    task.abort();
    assert!(task.await.is_err_and(|e| e.is_cancelled()));
    let guard = fresh(claim_now(&fx, "k-cancel").await);
    assert_eq!(fx.effects("o-cancel").await, 0);
    guard.complete(Some("7".to_owned())).await.expect("complete");
    assert_eq!(done(fx.claim("k-cancel").await).as_deref(), Some("7"));
    assert_eq!(fx.effects("o-cancel").await, 0);

    Arc::into_inner(fx).expect("tasks are done").drop_tables().await;
}

#[tokio::test]
async fn fingerprint_mismatch_is_key_reused_and_commits_nothing() {
    let fx = Fixture::new("fingerprint", 4).await;
    let a = Fingerprint::of(&("order-1", 100)).expect("fingerprint");
    let b = Fingerprint::of(&("order-1", 999)).expect("fingerprint");
    let req = |fp: &Fingerprint| {
        Request::new("pay", "m-fp")
            .expect("request")
            .with_fingerprint(Some(fp.clone()))
    };

    let mut guard = fresh(fx.store.claim(&req(&a)).await);
    fx.pay(&mut guard, "order-1", 100).await;
    guard.complete(Some("1".to_owned())).await.expect("complete");
    let before: (Option<String>, String) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT fingerprint, CAST(processed_at AS CHAR) FROM `{}` WHERE message_id = 'm-fp'",
        fx.table
    )))
    .fetch_one(&fx.pool)
    .await
    .expect("marker");

    let Err(err) = fx.store.claim(&req(&b)).await else {
        panic!("a reused key must be refused")
    };
    assert!(matches!(err, Error::KeyReused { .. }), "{err}");
    assert!(!err.is_transient());
    // The same message again replays.
    assert_eq!(done(fx.store.claim(&req(&a)).await).as_deref(), Some("1"));

    let after: (Option<String>, String) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT fingerprint, CAST(processed_at AS CHAR) FROM `{}` WHERE message_id = 'm-fp'",
        fx.table
    )))
    .fetch_one(&fx.pool)
    .await
    .expect("marker");
    assert_eq!(before, after);
    assert_eq!(after.0.as_deref(), Some(a.as_str()));
    assert_eq!(fx.effects("order-1").await, 1);
    assert_eq!(fx.markers().await, 1);

    fx.drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_markers_are_taken_over_and_purged() {
    let fx = Arc::new(Fixture::with_batch("expiry", 10, 7).await);
    // A one-second ttl: long enough that a loaded machine still sees the
    // marker live right after completing it, short enough to wait out.
    let short = |key: &'static str| {
        Request::new("pay", key)
            .expect("request")
            .with_ttl(Duration::from_secs(1))
    };

    let mut guard = fresh(fx.store.claim(&short("k-exp")).await);
    fx.pay(&mut guard, "o-exp", 1).await;
    guard.complete(Some(r#""first""#.to_owned())).await.expect("complete");
    assert_eq!(
        done(fx.store.claim(&short("k-exp")).await).as_deref(),
        Some(r#""first""#)
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // Taking over an expired marker whose body then fails keeps the old
    // (expired) marker: the redelivery takes it over again.
    let guard = fresh(fx.store.claim(&short("k-exp")).await);
    guard.abort().await;
    // The takeover resets the fingerprint and result: a new fingerprint is
    // not `KeyReused` once the old marker expired.
    let fp = Fingerprint::of("second message").expect("fingerprint");
    let take_over = Request::new("pay", "k-exp")
        .expect("request")
        .with_fingerprint(Some(fp));
    let mut guard = fresh(fx.store.claim(&take_over).await);
    fx.pay(&mut guard, "o-exp", 2).await;
    guard.complete(None).await.expect("complete");
    assert_eq!(done(fx.store.claim(&take_over).await), None);
    assert_eq!(fx.effects("o-exp").await, 2);
    assert_eq!(fx.markers().await, 1);

    // Eight consumers race for one expired marker: exactly one takes it.
    let guard = fresh(fx.store.claim(&short("k-race")).await);
    guard.complete(Some(r#""old""#.to_owned())).await.expect("complete");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let start = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..8 {
        let (fx, start) = (Arc::clone(&fx), Arc::clone(&start));
        tasks.spawn(async move {
            start.wait().await;
            let req = Request::new("pay", "k-race")?;
            match fx.store.claim(&req).await? {
                Claim::Fresh(mut guard) => {
                    fx.pay(&mut guard, "o-race", i).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    guard.complete(Some(i.to_string())).await?;
                    Ok::<_, Error>(Some(i.to_string()))
                }
                Claim::Done(replay) => Ok(replay.json().map(str::to_owned)),
            }
        });
    }
    let results: Vec<Option<String>> = tasks
        .join_all()
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("claims");
    assert_eq!(fx.effects("o-race").await, 1);
    assert!(
        results
            .iter()
            .all(|r| *r == results[0] && r.as_deref() != Some(r#""old""#)),
        "{results:?}"
    );

    // Purge: 25 expired markers (several batches of 7) and 5 live ones.
    for i in 0..30 {
        let key = format!("p-{i}");
        let ttl = if i < 25 {
            Duration::from_millis(20)
        } else {
            Duration::from_secs(3600)
        };
        let guard = fresh(
            fx.store
                .claim(&Request::new("pay", &key).expect("request").with_ttl(ttl))
                .await,
        );
        guard.complete(None).await.expect("complete");
    }
    // A huge ttl is clamped, not an error.
    let guard = fresh(
        fx.store
            .claim(&Request::new("pay", "forever").expect("request").with_ttl(Duration::MAX))
            .await,
    );
    guard.complete(None).await.expect("complete");
    tokio::time::sleep(Duration::from_millis(120)).await;
    // k-exp and k-race were taken over with the default ttl: they stay.
    assert_eq!(fx.store.purge_expired().await.expect("purge"), 25);
    assert_eq!(fx.markers().await, 8);
    assert_eq!(PurgeExpired::purge_expired(&fx.store).await.expect("purge"), 0);
    for i in 25..30 {
        assert!(fx.has_marker(&format!("p-{i}")).await);
    }
    assert!(fx.has_marker("forever").await);

    Arc::into_inner(fx).expect("tasks are done").drop_tables().await;
}

#[tokio::test]
async fn keys_are_distinct_byte_for_byte() {
    let fx = Fixture::new("bytes", 2).await;
    let long = "€".repeat(85);
    assert_eq!(long.len(), idempotent_runtime::MAX_KEY_BYTES);
    let keys = [
        "k",
        "K",
        "k ",
        " k",
        "é",
        "e\u{301}",
        "ê",
        "e",
        "💳",
        "a\u{7f}",
        long.as_str(),
    ];
    for key in keys {
        fresh(fx.claim(key).await)
            .complete(Some(format!("{key:?}")))
            .await
            .expect("complete");
    }
    for key in keys {
        assert_eq!(done(fx.claim(key).await), Some(format!("{key:?}")), "key {key:?}");
    }
    assert_eq!(fx.markers().await, keys.len() as i64);
    let too_long = format!("{long}x");
    assert!(matches!(fx.claim(&too_long).await, Err(Error::InvalidKey { .. })));
    assert!(matches!(fx.claim("").await, Err(Error::InvalidKey { .. })));

    fx.drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_safe_to_run_concurrently() {
    let pool = pool(10).await;
    let table = format!("t_migrate_{:012x}", random_u64() & 0xffff_ffff_ffff);
    let store = MySqlStore::builder(pool.clone())
        .table(&table)
        .build()
        .expect("valid table");
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let store = store.clone();
        tasks.spawn(async move { store.migrate().await });
    }
    for result in tasks.join_all().await {
        result.expect("concurrent migrate");
    }
    store.migrate().await.expect("migrate again");

    let (_, create): (String, String) = sqlx::query_as(AssertSqlSafe(format!("SHOW CREATE TABLE `{table}`")))
        .fetch_one(&pool)
        .await
        .expect("show");
    assert!(
        create.contains(&format!("KEY `{table}_expires_at_idx` (`expires_at`)")),
        "{create}"
    );
    assert!(create.contains("PRIMARY KEY (`scope`,`message_id`)"), "{create}");
    assert!(create.contains("`message_id` varbinary(255) NOT NULL"), "{create}");

    // A `database.table` name works as well.
    let qualified = MySqlStore::builder(pool.clone())
        .table(&format!("test.{table}_q"))
        .build()
        .expect("valid");
    qualified.migrate().await.expect("migrate qualified");
    assert_eq!(qualified.table().to_string(), format!("test.{table}_q"));
    let req = Request::new("s", "k").expect("request");
    fresh(qualified.claim(&req).await)
        .complete(None)
        .await
        .expect("complete");
    assert_eq!(done(qualified.claim(&req).await), None);

    for t in [table.clone(), format!("{table}_q")] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE `{t}`")))
            .execute(&pool)
            .await
            .expect("drop");
    }
    pool.close().await;
}

#[tokio::test]
async fn invalid_configuration_is_refused_by_build() {
    let pool = MySqlPoolOptions::new().connect_lazy(&url()).expect("lazy pool");
    for bad in ["x; DROP TABLE users", "a`b", "a.b.c", "", "1abc", "t\u{e9}"] {
        let err = MySqlStore::builder(pool.clone()).table(bad).build().expect_err(bad);
        assert!(matches!(err, Error::Config(_)), "{bad:?}: {err}");
        assert!(err.to_string().contains("invalid table name"), "{err}");
    }
    let err = MySqlStore::builder(pool.clone())
        .purge_batch(0)
        .build()
        .expect_err("batch 0");
    assert!(matches!(err, Error::Config(_)), "{err}");
    let store = MySqlStore::new(pool.clone());
    assert_eq!(store.table().to_string(), "processed_messages");
}

/// The same store behind `#[idempotent]`: the handler's transaction
/// parameter is a MySQL connection or transaction.
mod with_the_macro {
    use super::*;
    use idempotent_runtime::idempotent;

    #[derive(Debug)]
    enum AppError {
        Idem(Error),
        Db(sqlx::Error),
        Failed,
    }

    impl std::fmt::Display for AppError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self {
                AppError::Idem(e) => write!(f, "{e}"),
                AppError::Db(e) => write!(f, "{e}"),
                AppError::Failed => f.write_str("failed after writing the effect"),
            }
        }
    }

    impl From<Error> for AppError {
        fn from(e: Error) -> Self {
            AppError::Idem(e)
        }
    }

    impl From<sqlx::Error> for AppError {
        fn from(e: sqlx::Error) -> Self {
            AppError::Db(e)
        }
    }

    struct Msg {
        id: String,
        order: String,
        amount: i64,
        fail: bool,
    }

    struct Consumer {
        store: MySqlStore,
        pay: String,
    }

    impl Consumer {
        #[idempotent(key = "msg.id", store = self.store, fingerprint = "(&msg.order, msg.amount)")]
        async fn on_conn(&self, msg: &Msg, tx: &mut sqlx::MySqlConnection) -> Result<i64, AppError> {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO `{}` (order_id, amount) VALUES (?, ?)",
                self.pay
            )))
            .bind(&msg.order)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
            tokio::time::sleep(Duration::from_millis(50)).await;
            if msg.fail {
                return Err(AppError::Failed);
            }
            Ok(msg.amount * 100)
        }

        #[idempotent(key = "msg.id", store = self.store, scope = "on_tx")]
        async fn on_tx(&self, msg: &Msg, tx: &mut sqlx::Transaction<'_, sqlx::MySql>) -> Result<(), AppError> {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO `{}` (order_id, amount) VALUES (?, ?)",
                self.pay
            )))
            .bind(&msg.order)
            .bind(msg.amount)
            .execute(&mut **tx)
            .await?;
            Ok(())
        }
    }

    fn msg(id: &str, amount: i64, fail: bool) -> Msg {
        Msg {
            id: id.into(),
            order: format!("order-{id}"),
            amount,
            fail,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn handlers_run_once_and_replay_their_result() {
        let fx = Fixture::new("macro", 12).await;
        let consumer = Arc::new(Consumer {
            store: fx.store.clone(),
            pay: fx.pay.clone(),
        });

        // Eight concurrent deliveries of one message.
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let consumer = Arc::clone(&consumer);
            tasks.spawn(async move { consumer.on_conn(&msg("m-1", 7, false)).await });
        }
        for result in tasks.join_all().await {
            assert_eq!(result.expect("delivery"), 700);
        }
        assert_eq!(fx.effects("order-m-1").await, 1);

        // A failed run commits nothing; the redelivery runs again.
        assert!(matches!(
            consumer.on_conn(&msg("m-2", 3, true)).await,
            Err(AppError::Failed)
        ));
        assert_eq!(fx.effects("order-m-2").await, 0);
        assert_eq!(consumer.on_conn(&msg("m-2", 3, false)).await.expect("redelivery"), 300);
        assert_eq!(consumer.on_conn(&msg("m-2", 3, false)).await.expect("duplicate"), 300);
        assert_eq!(fx.effects("order-m-2").await, 1);

        // The same id with another amount is a reused key.
        let reused = consumer.on_conn(&msg("m-2", 4, false)).await;
        assert!(
            matches!(reused, Err(AppError::Idem(Error::KeyReused { .. }))),
            "{reused:?}"
        );
        assert_eq!(fx.effects("order-m-2").await, 1);

        // A `Transaction` parameter, unit result, its own scope.
        consumer.on_tx(&msg("m-1", 1, false)).await.expect("first");
        consumer.on_tx(&msg("m-1", 1, false)).await.expect("duplicate");
        assert_eq!(fx.effects("order-m-1").await, 2);
        assert_eq!(fx.markers().await, 3);

        drop(consumer);
        fx.drop_tables().await;
    }
}
