//! The transactional outbox on every SQL store (Postgres at Read Committed
//! and under a Repeatable Read default, MariaDB, SQLite): outgoing messages
//! commit with the effect and the marker or not at all, a duplicate stages
//! nothing, relays publish each row (several relays at once without
//! publishing a row twice), in order per ordering key, retry with backoff,
//! publish again with the same id after dying before the mark, wake on a
//! commit, and the janitor deletes dispatched rows.
//!
//! The relay's publisher here records what it is given (the brokers'
//! publishers are tested against the real brokers in
//! `idempotent-runtime/tests/outbox_publishers.rs`, and the whole chain in
//! `tests/outbox_chain.rs`).

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::outbox::{
    Outbox, OutboxBatch, OutboxRow, OutboxStore, Outgoing, PublishError, Publisher, Relay,
};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, Row};
use idempotent_runtime::store::{Claim, DEFAULT_OUTBOX_TABLE, Guard, PurgeExpired, Request, Store, TransactionGuard};
use idempotent_runtime::{Error, idempotent};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("failed after staging")]
    Failed,
}

/// An incoming message and what its handler stages.
#[derive(Clone, Debug)]
pub struct Charge {
    pub message_id: String,
    /// `(destination, ordering key)` of each message to stage.
    pub out: Vec<(String, Option<String>)>,
    /// Fail after writing the effect and staging.
    pub fail: bool,
}

impl Charge {
    fn new(message_id: &str, out: &[(&str, Option<&str>)]) -> Charge {
        Charge {
            message_id: message_id.into(),
            out: out
                .iter()
                .map(|(d, k)| ((*d).to_owned(), k.map(str::to_owned)))
                .collect(),
            fail: false,
        }
    }
}

/// The handler body shared by every backend, after its effect.
fn stage(msg: &Charge, outbox: &mut Outbox) -> Result<usize, AppError> {
    for (index, (destination, key)) in msg.out.iter().enumerate() {
        let mut message = Outgoing::new(destination.clone(), format!("{}#{index}", msg.message_id).into_bytes())
            .header("source", "outbox-test");
        if let Some(key) = key {
            message = message.ordered_by(key.clone());
        }
        outbox.publish(message);
    }
    if msg.fail {
        return Err(AppError::Failed);
    }
    Ok(outbox.len())
}

/// A row as a test reads it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub message_id: String,
    pub destination: String,
    pub ordering_key: Option<String>,
    pub payload: Vec<u8>,
    pub dispatched: bool,
    pub attempts: i64,
    pub last_error: Option<String>,
}

pub trait Backend: Sized + Send + Sync + 'static {
    type Store: OutboxStore + PurgeExpired + Clone + Store<Guard: TransactionGuard> + 'static;
    fn setup(retention: Duration) -> impl Future<Output = Self> + Send;
    fn store(&self) -> Self::Store;
    fn charge(&self, msg: &Charge) -> impl Future<Output = Result<usize, AppError>> + Send;
    fn effects(&self, message_id: &str) -> impl Future<Output = i64> + Send;
    /// The outbox's rows in id order.
    fn rows(&self) -> impl Future<Output = Vec<Stored>> + Send;
    fn teardown(self) -> impl Future<Output = ()> + Send;
}

// ---- Postgres -----------------------------------------------------------

pub struct Pg<const ISO: u8> {
    store: idempotent_runtime::PgStore,
    markers: String,
    outbox: String,
    effects: String,
}

impl<const ISO: u8> Pg<ISO> {
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn process(&self, msg: &Charge, tx: &mut sqlx::PgConnection, outbox: &mut Outbox) -> Result<usize, AppError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id) VALUES ($1)",
            self.effects
        )))
        .bind(&msg.message_id)
        .execute(&mut *tx)
        .await?;
        stage(msg, outbox)
    }
}

impl<const ISO: u8> Backend for Pg<ISO> {
    type Store = idempotent_runtime::PgStore;
    async fn setup(retention: Duration) -> Self {
        let pool = common::pg_pool_with(16, ISO).await;
        let (markers, outbox, effects) = (
            common::unique("markers"),
            common::unique("outbox"),
            common::unique("effects"),
        );
        let store = idempotent_runtime::PgStore::builder(pool.clone())
            .table(&markers)
            .outbox_table(&outbox)
            .outbox_retention(retention)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::query(AssertSqlSafe(format!("CREATE TABLE {effects} (message_id TEXT)")))
            .execute(&pool)
            .await
            .unwrap();
        Pg {
            store,
            markers,
            outbox,
            effects,
        }
    }
    fn store(&self) -> Self::Store {
        self.store.clone()
    }
    fn charge(&self, msg: &Charge) -> impl Future<Output = Result<usize, AppError>> + Send {
        self.process(msg)
    }
    async fn effects(&self, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE message_id = $1",
            self.effects
        )))
        .bind(id)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }
    async fn rows(&self) -> Vec<Stored> {
        let sql = format!(
            "SELECT message_id, destination, ordering_key, payload, dispatched_at IS NOT NULL AS dispatched, \
             attempts::int8 AS attempts, last_error FROM {} ORDER BY id",
            self.outbox
        );
        sqlx::query(AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
            .into_iter()
            .map(|row| Stored {
                message_id: row.get("message_id"),
                destination: row.get("destination"),
                ordering_key: row.get("ordering_key"),
                payload: row.get("payload"),
                dispatched: row.get("dispatched"),
                attempts: row.get("attempts"),
                last_error: row.get("last_error"),
            })
            .collect()
    }
    async fn teardown(self) {
        for table in [&self.markers, &self.outbox, &self.effects] {
            common::drop_pg_table(self.store.pool(), table).await;
        }
    }
}

// ---- MariaDB ------------------------------------------------------------

pub struct My {
    store: idempotent_runtime::MySqlStore,
    markers: String,
    outbox: String,
    effects: String,
}

impl My {
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn process(
        &self,
        msg: &Charge,
        tx: &mut sqlx::MySqlConnection,
        outbox: &mut Outbox,
    ) -> Result<usize, AppError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}` (message_id) VALUES (?)",
            self.effects
        )))
        .bind(&msg.message_id)
        .execute(&mut *tx)
        .await?;
        stage(msg, outbox)
    }
}

impl Backend for My {
    type Store = idempotent_runtime::MySqlStore;
    async fn setup(retention: Duration) -> Self {
        let pool = common::mysql_pool(16).await;
        let (markers, outbox, effects) = (
            common::unique("markers"),
            common::unique("outbox"),
            common::unique("effects"),
        );
        let store = idempotent_runtime::MySqlStore::builder(pool.clone())
            .table(&markers)
            .outbox_table(&outbox)
            .outbox_retention(retention)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE `{effects}` (message_id VARCHAR(255))"
        )))
        .execute(&pool)
        .await
        .unwrap();
        My {
            store,
            markers,
            outbox,
            effects,
        }
    }
    fn store(&self) -> Self::Store {
        self.store.clone()
    }
    fn charge(&self, msg: &Charge) -> impl Future<Output = Result<usize, AppError>> + Send {
        self.process(msg)
    }
    async fn effects(&self, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM `{}` WHERE message_id = ?",
            self.effects
        )))
        .bind(id)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }
    async fn rows(&self) -> Vec<Stored> {
        let sql = format!(
            "SELECT message_id, destination, ordering_key, payload, dispatched_at IS NOT NULL AS dispatched, \
             CAST(attempts AS SIGNED) AS attempts, last_error FROM `{}` ORDER BY id",
            self.outbox
        );
        sqlx::query(AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
            .into_iter()
            .map(|row| Stored {
                message_id: row.get("message_id"),
                destination: row.get("destination"),
                ordering_key: row
                    .get::<Option<Vec<u8>>, _>("ordering_key")
                    .map(|k| String::from_utf8(k).unwrap()),
                payload: row.get("payload"),
                dispatched: row.get::<i32, _>("dispatched") == 1,
                attempts: row.get("attempts"),
                last_error: row.get("last_error"),
            })
            .collect()
    }
    async fn teardown(self) {
        let keys = format!("{}_keys", self.outbox);
        for table in [&self.markers, &self.outbox, &self.effects, &keys] {
            common::drop_mysql_table(self.store.pool(), table).await;
        }
    }
}

// ---- SQLite -------------------------------------------------------------

pub struct Lite {
    store: idempotent_runtime::SqliteStore,
    _dir: tempfile::TempDir,
}

impl Lite {
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn process(
        &self,
        msg: &Charge,
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
        outbox: &mut Outbox,
    ) -> Result<usize, AppError> {
        sqlx::query("INSERT INTO effects (message_id) VALUES (?1)")
            .bind(&msg.message_id)
            .execute(&mut **tx)
            .await?;
        stage(msg, outbox)
    }
}

impl Backend for Lite {
    type Store = idempotent_runtime::SqliteStore;
    async fn setup(retention: Duration) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let opened = idempotent_runtime::SqliteStore::open(dir.path().join("outbox.db"))
            .await
            .unwrap();
        let store = idempotent_runtime::SqliteStore::builder(opened.pool().clone())
            .outbox_retention(retention)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE effects (message_id TEXT)")
            .execute(store.pool())
            .await
            .unwrap();
        Lite { store, _dir: dir }
    }
    fn store(&self) -> Self::Store {
        self.store.clone()
    }
    fn charge(&self, msg: &Charge) -> impl Future<Output = Result<usize, AppError>> + Send {
        self.process(msg)
    }
    async fn effects(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = ?1")
            .bind(id)
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
    async fn rows(&self) -> Vec<Stored> {
        let sql = format!(
            "SELECT message_id, destination, ordering_key, payload, dispatched_at IS NOT NULL AS dispatched, \
             attempts, last_error FROM {DEFAULT_OUTBOX_TABLE} ORDER BY id"
        );
        sqlx::query(AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
            .into_iter()
            .map(|row| Stored {
                message_id: row.get("message_id"),
                destination: row.get("destination"),
                ordering_key: row.get("ordering_key"),
                payload: row.get("payload"),
                dispatched: row.get("dispatched"),
                attempts: row.get("attempts"),
                last_error: row.get("last_error"),
            })
            .collect()
    }
    async fn teardown(self) {
        self.store.pool().close().await;
    }
}

// ---- A recording publisher ------------------------------------------------

/// Records every publish in order; fails the messages told to, a number of
/// times each.
#[derive(Default)]
pub struct Recorder {
    published: Mutex<Vec<OutboxRow>>,
    failures: Mutex<HashMap<String, u32>>,
    /// Sleeps this long in each publish (to let relays overlap).
    delay: Duration,
}

impl Recorder {
    fn with_delay(delay: Duration) -> Arc<Recorder> {
        Arc::new(Recorder {
            delay,
            ..Recorder::default()
        })
    }
    fn fail(&self, message_id: &str, times: u32) {
        self.failures.lock().unwrap().insert(message_id.to_owned(), times);
    }
    fn published(&self) -> Vec<OutboxRow> {
        self.published.lock().unwrap().clone()
    }
    fn ids(&self) -> Vec<String> {
        self.published().into_iter().map(|row| row.message_id).collect()
    }
}

impl Publisher for Recorder {
    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if let Some(left) = self.failures.lock().unwrap().get_mut(&row.message_id)
            && *left > 0
        {
            *left -= 1;
            return Err(PublishError("the broker is away".into()));
        }
        self.published.lock().unwrap().push(row.clone());
        Ok(())
    }
}

/// Waits until `done` holds (checking every 20 ms), or panics after 30 s.
async fn until<F: Future<Output = bool>>(what: &str, mut done: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const KEEP: Duration = Duration::from_secs(3600);

// ---- The cases ------------------------------------------------------------

/// The effect, the marker and the messages commit together; the duplicate
/// answers like the first run and stages nothing; message ids are the
/// derived ones, stable and distinct.
async fn messages_commit_with_the_effect_and_once<B: Backend>() {
    let b = B::setup(KEEP).await;
    let msg = Charge::new("m1", &[("payment.charged", Some("order-1")), ("audit", None)]);
    assert_eq!(b.charge(&msg).await.unwrap(), 2);
    assert_eq!(b.charge(&msg).await.unwrap(), 2, "the duplicate replays the result");
    assert_eq!(b.effects("m1").await, 1);
    let rows = b.rows().await;
    assert_eq!(rows.len(), 2, "the duplicate staged nothing: {rows:?}");
    assert_eq!(rows[0].destination, "payment.charged");
    assert_eq!(rows[0].ordering_key.as_deref(), Some("order-1"));
    assert_eq!(rows[0].payload, b"m1#0");
    assert_eq!(rows[1].ordering_key, None);
    assert!(rows.iter().all(|row| !row.dispatched));
    assert_ne!(rows[0].message_id, rows[1].message_id);
    assert_eq!(rows[0].message_id.len(), 32);
    b.teardown().await;
}

/// A body that fails after staging leaves no row and no effect; so does a
/// message the outbox refuses (an empty destination), and the call can run
/// again afterwards.
async fn nothing_is_written_when_the_call_fails<B: Backend>() {
    let b = B::setup(KEEP).await;
    let mut failing = Charge::new("m2", &[("payment.charged", None)]);
    failing.fail = true;
    assert!(matches!(b.charge(&failing).await, Err(AppError::Failed)));
    let bad = Charge::new("m3", &[("ok", None), ("", None)]);
    match b.charge(&bad).await {
        Err(AppError::Idem(Error::Config(message))) => assert!(message.contains("destination"), "{message}"),
        other => panic!("an empty destination is refused: {other:?}"),
    }
    assert_eq!(b.rows().await, Vec::new());
    assert_eq!(b.effects("m2").await + b.effects("m3").await, 0);
    failing.fail = false;
    assert_eq!(b.charge(&failing).await.unwrap(), 1, "the marker was rolled back too");
    assert_eq!(b.rows().await.len(), 1);
    b.teardown().await;
}

/// A relay publishes every committed row and marks it dispatched; the
/// pending gauge comes back to zero.
async fn the_relay_publishes_and_marks<B: Backend>() {
    let b = B::setup(KEEP).await;
    for i in 0..30 {
        b.charge(&Charge::new(&format!("r{i}"), &[("events", None)]))
            .await
            .unwrap();
    }
    let recorder = Arc::new(Recorder::default());
    let relay = Relay::builder(b.store(), Arc::clone(&recorder))
        .batch_size(7)
        .poll_interval(Duration::from_millis(50))
        .spawn();
    until("every row dispatched", || async {
        b.rows().await.iter().all(|row| row.dispatched)
    })
    .await;
    let stats = relay.stats();
    relay.shutdown().await;
    let rows = b.rows().await;
    let mut published = recorder.ids();
    assert_eq!(published.len(), 30, "each row published once");
    published.sort();
    let mut stored: Vec<String> = rows.iter().map(|row| row.message_id.clone()).collect();
    stored.sort();
    assert_eq!(published, stored);
    assert_eq!(stats.published(), 30);
    assert_eq!(b.store().pending().await.unwrap().0, 0);
    let first = &recorder.published()[0];
    assert_eq!(first.headers, vec![("source".to_owned(), "outbox-test".to_owned())]);
    b.teardown().await;
}

/// Three relays on one table: every row published exactly once (rows are
/// locked or leased by the relay that took them), and the messages of each
/// ordering key in staging order.
async fn relays_share_the_table_and_keep_key_order<B: Backend>() {
    let b = B::setup(KEEP).await;
    let keys = ["a", "b", "c", "d"];
    let mut expected: HashMap<&str, Vec<String>> = HashMap::new();
    for i in 0..60 {
        let key = keys[i % keys.len()];
        b.charge(&Charge::new(
            &format!("o{i}"),
            &[("ordered", Some(key)), ("free", None)],
        ))
        .await
        .unwrap();
    }
    for row in b.rows().await {
        if let Some(key) = &row.ordering_key {
            expected
                .entry(keys.iter().find(|k| **k == key).unwrap())
                .or_default()
                .push(row.message_id);
        }
    }
    let recorder = Recorder::with_delay(Duration::from_millis(3));
    let relays: Vec<_> = (0..3)
        .map(|_| {
            Relay::builder(b.store(), Arc::clone(&recorder))
                .batch_size(5)
                .poll_interval(Duration::from_millis(10))
                .spawn()
        })
        .collect();
    until("every row dispatched", || async {
        b.rows().await.iter().all(|row| row.dispatched)
    })
    .await;
    for relay in relays {
        relay.shutdown().await;
    }
    let published = recorder.published();
    let unique: HashSet<&str> = published.iter().map(|row| row.message_id.as_str()).collect();
    assert_eq!(published.len(), 120, "no row published twice");
    assert_eq!(unique.len(), 120);
    for key in keys {
        let order: Vec<String> = published
            .iter()
            .filter(|row| row.ordering_key.as_deref() == Some(key))
            .map(|row| row.message_id.clone())
            .collect();
        assert_eq!(order, expected[key], "key {key} published in staging order");
    }
    b.teardown().await;
}

/// A failing publish is retried after a backoff, its attempts and error
/// recorded; while it fails, the later messages of its ordering key wait,
/// the others go.
async fn failures_are_retried_and_hold_their_key_back<B: Backend>() {
    let b = B::setup(KEEP).await;
    b.charge(&Charge::new(
        "f1",
        &[("t", Some("k")), ("t", Some("k")), ("t", Some("other"))],
    ))
    .await
    .unwrap();
    let rows = b.rows().await;
    let recorder = Arc::new(Recorder::default());
    recorder.fail(&rows[0].message_id, 3);
    let relay = Relay::builder(b.store(), Arc::clone(&recorder))
        .poll_interval(Duration::from_millis(10))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(200))
        .spawn();
    until("the free key published", || async {
        recorder.ids().contains(&rows[2].message_id)
    })
    .await;
    assert!(
        !recorder.ids().contains(&rows[1].message_id),
        "the second of key k waits for the first"
    );
    until("every row dispatched", || async {
        b.rows().await.iter().all(|row| row.dispatched)
    })
    .await;
    let stats = relay.stats();
    relay.shutdown().await;
    let ids = recorder.ids();
    let position = |id: &str| ids.iter().position(|p| p == id).unwrap();
    assert!(position(&rows[0].message_id) < position(&rows[1].message_id));
    assert_eq!(stats.retried(), 3);
    let first = &b.rows().await[0];
    assert_eq!(first.attempts, 3, "three failed attempts recorded");
    assert_eq!(first.last_error, None, "cleared once dispatched");
    b.teardown().await;
}

/// A relay that published and died before marking leaves the rows pending
/// (its lock died with it, or its lease runs out): they are published
/// again, with the same message ids.
async fn a_relay_that_dies_before_marking_republishes_the_same_ids<B: Backend>() {
    let b = B::setup(KEEP).await;
    b.charge(&Charge::new("d1", &[("t", None), ("t", Some("k"))]))
        .await
        .unwrap();
    let store = b.store();
    let batch = store.take_batch(10, Duration::from_millis(300)).await.unwrap();
    let first: Vec<String> = batch.rows().iter().map(|row| row.message_id.clone()).collect();
    assert_eq!(first.len(), 2);
    // "Published", then the relay dies: the batch is dropped unsettled.
    drop(batch);
    let recorder = Arc::new(Recorder::default());
    let relay = Relay::builder(store, Arc::clone(&recorder))
        .poll_interval(Duration::from_millis(20))
        .spawn();
    until("every row dispatched", || async {
        b.rows().await.iter().all(|row| row.dispatched)
    })
    .await;
    relay.shutdown().await;
    let mut again = recorder.ids();
    again.sort();
    let mut first = first;
    first.sort();
    assert_eq!(again, first, "the same ids, published again");
    b.teardown().await;
}

/// A commit that staged messages wakes the relay of its process: with a
/// one-hour poll, the messages still go out.
async fn a_commit_wakes_the_relay<B: Backend>() {
    let b = B::setup(KEEP).await;
    let recorder = Arc::new(Recorder::default());
    let relay = Relay::builder(b.store(), Arc::clone(&recorder))
        .poll_interval(Duration::from_secs(3600))
        .spawn();
    // Let the relay's first round pass and go to sleep.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for i in 0..3 {
        b.charge(&Charge::new(&format!("w{i}"), &[("t", None)])).await.unwrap();
        let want = i + 1;
        until("the woken relay", || async { recorder.ids().len() == want }).await;
    }
    relay.shutdown().await;
    b.teardown().await;
}

/// The janitor deletes dispatched rows past the retention, never pending
/// ones.
async fn the_janitor_deletes_dispatched_rows<B: Backend>() {
    let b = B::setup(Duration::ZERO).await;
    for i in 0..5 {
        b.charge(&Charge::new(&format!("j{i}"), &[("t", None)])).await.unwrap();
    }
    let recorder = Arc::new(Recorder::default());
    recorder.fail(&b.rows().await[4].message_id, u32::MAX);
    let relay = Relay::builder(b.store(), Arc::clone(&recorder))
        .poll_interval(Duration::from_millis(10))
        .retry_backoff(Duration::from_secs(3600), Duration::from_secs(3600))
        .spawn();
    until("four dispatched", || async {
        b.rows().await.iter().filter(|row| row.dispatched).count() == 4
    })
    .await;
    relay.shutdown().await;
    // Dispatched "now": past a zero retention once the clock moved on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let deleted = b.store().purge_expired().await.unwrap();
    assert_eq!(deleted, 4);
    let left = b.rows().await;
    assert_eq!(left.len(), 1, "the pending row stays: {left:?}");
    assert!(!left[0].dispatched);
    assert_eq!(left[0].last_error.as_deref(), Some("the broker is away"));
    b.teardown().await;
}

/// A fresh claim of `key` with one message of ordering key `ordering`
/// (message id `message_id`) staged in its transaction, left open.
async fn staged<S: Store<Guard: TransactionGuard>>(store: &S, key: &str, message_id: &str, ordering: &str) -> S::Guard {
    let request = Request::new("outbox.overlap", key).unwrap();
    let Claim::Fresh(mut guard) = store.claim(&request).await.unwrap() else {
        panic!("{key} is fresh");
    };
    let mut outbox = Outbox::new();
    outbox.publish(
        Outgoing::new("t", message_id.as_bytes().to_vec())
            .message_id(message_id)
            .ordered_by(ordering),
    );
    guard.stage(outbox).await.unwrap();
    guard
}

/// Issue 43, hole 2: two transactions stage a row of one ordering key;
/// the one that inserted first commits last. Per key, the relay publishes
/// in insertion order, which is commit order: the second stager waits for
/// the first one's transaction before it inserts. Twice: for a key staged
/// for the first time, and for one staged before (MariaDB: its row in the
/// keys table exists then).
async fn overlapping_transactions_publish_a_key_in_insertion_order<B: Backend>() {
    let b = B::setup(KEEP).await;
    let recorder = Arc::new(Recorder::default());
    let relay = Relay::builder(b.store(), Arc::clone(&recorder))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    let mut expected = Vec::new();
    for round in 0..2 {
        let (a, b_id) = (format!("a{round}-inserted-first"), format!("b{round}-inserted-second"));
        let store = b.store();
        // A inserts its row of "order-42" and keeps its transaction open.
        let first = staged(&store, &format!("tx-a{round}"), &a, "order-42").await;
        // B stages a row of the same key and commits, on its own task.
        let (key, id) = (format!("tx-b{round}"), b_id.clone());
        let second = tokio::spawn(async move {
            let guard = staged(&store, &key, &id, "order-42").await;
            guard.complete(None).await.unwrap();
        });
        // Time for B to commit and for the relay to publish whatever it sees.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        first.complete(None).await.unwrap();
        second.await.unwrap();
        expected.extend([a, b_id]);
        until("the round's rows dispatched", || async {
            let rows = b.rows().await;
            rows.len() == expected.len() && rows.iter().all(|row| row.dispatched)
        })
        .await;
    }
    relay.shutdown().await;
    assert_eq!(
        recorder.ids(),
        expected,
        "per ordering key, the row inserted first is published first"
    );
    let rows: Vec<String> = b.rows().await.into_iter().map(|row| row.message_id).collect();
    assert_eq!(rows, expected, "ids in insertion order");
    b.teardown().await;
}

/// The order of one key costs nothing to the others: a transaction that
/// stages a row of another key commits while the first one is still open.
async fn overlapping_transactions_of_different_keys_do_not_wait<B: Backend>() {
    let b = B::setup(KEEP).await;
    let store = b.store();
    let first = staged(&store, "tx-a", "a-of-order-1", "order-1").await;
    let other = tokio::spawn(async move {
        let guard = staged(&store, "tx-b", "b-of-order-2", "order-2").await;
        guard.complete(None).await.unwrap();
    });
    // A deadline only to turn a wait on "order-1" into a failure.
    tokio::time::timeout(Duration::from_secs(20), other)
        .await
        .expect("a transaction staging another key does not wait for the open one")
        .unwrap();
    let rows: Vec<String> = b.rows().await.into_iter().map(|row| row.message_id).collect();
    assert_eq!(rows, ["b-of-order-2"], "committed while A is still open");
    first.complete(None).await.unwrap();
    assert_eq!(b.rows().await.len(), 2);
    b.teardown().await;
}

/// MariaDB keeps a row per ordering key (`<outbox>_keys`, the row a
/// stager locks): the janitor deletes those with no pending message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_janitor_deletes_the_keys_of_dispatched_messages() {
    let b = My::setup(Duration::ZERO).await;
    b.charge(&Charge::new("k1", &[("t", Some("done")), ("t", Some("waiting"))]))
        .await
        .unwrap();
    let recorder = Arc::new(Recorder::default());
    recorder.fail(&b.rows().await[1].message_id, u32::MAX);
    let relay = Relay::builder(b.store(), Arc::clone(&recorder))
        .poll_interval(Duration::from_millis(10))
        .retry_backoff(Duration::from_secs(3600), Duration::from_secs(3600))
        .spawn();
    until("the first dispatched", || async { b.rows().await[0].dispatched }).await;
    relay.shutdown().await;
    let keys = || async {
        sqlx::query_scalar::<_, Vec<u8>>(AssertSqlSafe(format!(
            "SELECT ordering_key FROM `{}_keys` ORDER BY ordering_key",
            b.outbox
        )))
        .fetch_all(b.store.pool())
        .await
        .unwrap()
    };
    assert_eq!(keys().await, [b"done".to_vec(), b"waiting".to_vec()]);
    tokio::time::sleep(Duration::from_millis(20)).await;
    PurgeExpired::purge_expired(&b.store()).await.unwrap();
    assert_eq!(keys().await, [b"waiting".to_vec()], "the pending message's key stays");
    b.teardown().await;
}

macro_rules! suite {
    ($module:ident, $backend:ty $(, $concurrent:ident)?) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn messages_commit_with_the_effect_and_once() {
                super::messages_commit_with_the_effect_and_once::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn nothing_is_written_when_the_call_fails() {
                super::nothing_is_written_when_the_call_fails::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn the_relay_publishes_and_marks() {
                super::the_relay_publishes_and_marks::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn relays_share_the_table_and_keep_key_order() {
                super::relays_share_the_table_and_keep_key_order::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn failures_are_retried_and_hold_their_key_back() {
                super::failures_are_retried_and_hold_their_key_back::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_relay_that_dies_before_marking_republishes_the_same_ids() {
                super::a_relay_that_dies_before_marking_republishes_the_same_ids::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_commit_wakes_the_relay() {
                super::a_commit_wakes_the_relay::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn the_janitor_deletes_dispatched_rows() {
                super::the_janitor_deletes_dispatched_rows::<$backend>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn overlapping_transactions_publish_a_key_in_insertion_order() {
                super::overlapping_transactions_publish_a_key_in_insertion_order::<$backend>().await;
            }
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $concurrent() {
                    super::$concurrent::<$backend>().await;
                }
            )?
        }
    };
}

// SQLite has one writer at a time: a second transaction always waits.
suite!(
    postgres,
    Pg<{ common::settings::PG_SERVER_DEFAULT }>,
    overlapping_transactions_of_different_keys_do_not_wait
);
suite!(
    postgres_repeatable_read_default,
    Pg<{ common::settings::PG_REPEATABLE_READ }>,
    overlapping_transactions_of_different_keys_do_not_wait
);
suite!(mariadb, My, overlapping_transactions_of_different_keys_do_not_wait);
suite!(sqlite, Lite);
