//! Offsets in the database (`KafkaConsumerBuilder::offsets_in`), against a
//! private Tansu broker per test and each transactional store (PostgreSQL,
//! MariaDB, SQLite: one fixture per store, the same scenarios for each).
//!
//! The effects are rows of a table in the store's database, written in the
//! handler's transaction, and counted there. Most scenarios use a handler
//! whose marker never matches (a fresh key per call) and a consumer that
//! commits nothing to Kafka (`kafka_commits(false)`): then only the offset
//! stored with the effect stands between a record and its second effect.

mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use common::kafka::{Kafka, QUICK_OUTAGES, Step, step};
use idempotent_runtime::broker::CancellationToken;
use idempotent_runtime::idempotent;
use idempotent_runtime::kafka::{KafkaConsumer, KafkaConsumerBuilder};
use idempotent_runtime::sqlx;

const WAIT: Duration = Duration::from_secs(40);

fn builder(kafka: &Kafka, topic: &str, group: &str) -> KafkaConsumerBuilder {
    kafka
        .consumer(topic, group)
        .outage_backoff(QUICK_OUTAGES)
        .revoke_timeout(Duration::from_secs(1))
}

/// Waits until `$cond` (an expression that may `.await`) holds, at most
/// [`WAIT`].
macro_rules! wait_until {
    ($what:expr, $cond:expr) => {
        common::wait_for!(WAIT, $what, $cond)
    };
}

/// A store, its effects table, and the handlers that write it.
trait Fixture: Send + Sync + Sized + 'static {
    /// A fixture on its own marker and effects tables.
    fn open() -> impl Future<Output = Self> + Send;
    /// `builder` keeping its offsets in this fixture's store.
    fn offsets(&self, builder: KafkaConsumerBuilder) -> KafkaConsumerBuilder;
    /// `builder` running batches of up to `max` deliveries on this
    /// fixture's store.
    fn batched(&self, builder: KafkaConsumerBuilder, max: usize) -> KafkaConsumerBuilder;
    /// The handler: one effect row, under a marker per message id.
    fn apply(self: Arc<Self>, msg: Step) -> impl Future<Output = Result<(), idempotent_runtime::Error>> + Send;
    /// The same effect under a marker that never matches (a fresh key per
    /// call): markers disabled, in effect.
    fn apply_unmarked(self: Arc<Self>, msg: Step)
    -> impl Future<Output = Result<(), idempotent_runtime::Error>> + Send;
    /// How many times each message's effect was applied.
    fn effects(&self) -> impl Future<Output = BTreeMap<String, i64>> + Send;
    /// The stored next offset of each partition of `group`'s `topic`.
    fn stored(&self, group: &str, topic: &str) -> impl Future<Output = BTreeMap<i32, i64>> + Send;
    /// Drops the tables and the offsets of `topic`.
    fn clean(&self, topic: &str) -> impl Future<Output = ()> + Send;
}

/// Implements [`Fixture`] for one store: `$open` gives the store on the
/// marker table it is given (and what to keep alive with it), `$effect` is
/// the effects table's DDL.
macro_rules! fixture {
    ($name:ident, $store:ty, $conn:ty, $open:expr, $effects_ddl:literal, $drop:literal) => {
        struct $name {
            store: $store,
            markers: String,
            effects: String,
            fresh: AtomicU64,
            _keep: Option<tempfile::TempDir>,
        }

        impl $name {
            #[idempotent(key = "msg.message_id", store = self.store, scope = "kafka_offsets.apply")]
            async fn apply_marked(&self, msg: &Step, tx: &mut $conn) -> Result<(), idempotent_runtime::Error> {
                self.effect(msg, tx).await
            }

            #[idempotent(key = "self.fresh_key(msg)", store = self.store, scope = "kafka_offsets.unmarked")]
            async fn apply_fresh(&self, msg: &Step, tx: &mut $conn) -> Result<(), idempotent_runtime::Error> {
                self.effect(msg, tx).await
            }

            fn fresh_key(&self, msg: &Step) -> String {
                format!(
                    "{}-{}",
                    msg.message_id,
                    self.fresh.fetch_add(1, Ordering::Relaxed)
                )
            }

            async fn effect(&self, msg: &Step, tx: &mut $conn) -> Result<(), idempotent_runtime::Error> {
                let insert = format!(
                    "INSERT INTO {} (message_id) VALUES ('{}')",
                    self.effects, msg.message_id
                );
                sqlx::query(sqlx::AssertSqlSafe(insert)).execute(&mut *tx).await?;
                Ok(())
            }
        }

        impl Fixture for $name {
            async fn open() -> Self {
                let markers = common::unique("kafka_offsets_markers");
                let effects = common::unique("kafka_offsets_effects");
                let (store, keep): ($store, Option<tempfile::TempDir>) = $open(markers.clone()).await;
                store.migrate().await.unwrap();
                sqlx::query(sqlx::AssertSqlSafe(format!($effects_ddl, effects)))
                    .execute(store.pool())
                    .await
                    .unwrap();
                $name {
                    store,
                    markers,
                    effects,
                    fresh: AtomicU64::new(0),
                    _keep: keep,
                }
            }

            fn offsets(&self, builder: KafkaConsumerBuilder) -> KafkaConsumerBuilder {
                builder.offsets_in(self.store.clone())
            }

            fn batched(&self, builder: KafkaConsumerBuilder, max: usize) -> KafkaConsumerBuilder {
                builder.batch(self.store.clone(), max)
            }

            async fn apply(self: Arc<Self>, msg: Step) -> Result<(), idempotent_runtime::Error> {
                self.apply_marked(&msg).await
            }

            async fn apply_unmarked(self: Arc<Self>, msg: Step) -> Result<(), idempotent_runtime::Error> {
                self.apply_fresh(&msg).await
            }

            async fn effects(&self) -> BTreeMap<String, i64> {
                let select = format!(
                    "SELECT message_id, COUNT(*) FROM {} GROUP BY message_id",
                    self.effects
                );
                sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(select))
                    .fetch_all(self.store.pool())
                    .await
                    .unwrap()
                    .into_iter()
                    .collect()
            }

            async fn stored(&self, group: &str, topic: &str) -> BTreeMap<i32, i64> {
                let select = format!(
                    "SELECT kafka_partition, next_offset FROM idempotent_kafka_offsets \
                     WHERE consumer_group = '{group}' AND topic = '{topic}'"
                );
                sqlx::query_as::<_, (i32, i64)>(sqlx::AssertSqlSafe(select))
                    .fetch_all(self.store.pool())
                    .await
                    .unwrap()
                    .into_iter()
                    .collect()
            }

            async fn clean(&self, topic: &str) {
                let pool = self.store.pool();
                for table in [&self.markers, &self.effects] {
                    sqlx::query(sqlx::AssertSqlSafe(format!($drop, table)))
                        .execute(pool)
                        .await
                        .unwrap();
                }
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM idempotent_kafka_offsets WHERE topic = '{topic}'"
                )))
                .execute(pool)
                .await
                .unwrap();
            }
        }
    };
}

fixture!(
    Postgres,
    idempotent_runtime::PgStore,
    sqlx::PgConnection,
    |markers: String| async move {
        let pool = common::pg_pool(8).await;
        let store = idempotent_runtime::PgStore::builder(pool)
            .table(&markers)
            .build()
            .unwrap();
        (store, None)
    },
    "CREATE TABLE {} (message_id TEXT NOT NULL)",
    "DROP TABLE IF EXISTS {}"
);

fixture!(
    MariaDb,
    idempotent_runtime::MySqlStore,
    sqlx::MySqlConnection,
    |markers: String| async move {
        let pool = common::mysql_pool(8).await;
        let store = idempotent_runtime::MySqlStore::builder(pool)
            .table(&markers)
            .build()
            .unwrap();
        (store, None)
    },
    "CREATE TABLE {} (message_id VARCHAR(64) NOT NULL) ENGINE = InnoDB",
    "DROP TABLE IF EXISTS {}"
);

fixture!(
    Sqlite,
    idempotent_runtime::SqliteStore,
    sqlx::SqliteConnection,
    |markers: String| async move {
        let dir = tempfile::tempdir().unwrap();
        let store = idempotent_runtime::SqliteStore::open(dir.path().join("offsets.db"))
            .await
            .unwrap();
        let store = idempotent_runtime::SqliteStore::builder(store.pool().clone())
            .table(&markers)
            .build()
            .unwrap();
        (store, Some(dir))
    },
    "CREATE TABLE {} (message_id TEXT NOT NULL)",
    "DROP TABLE IF EXISTS {}"
);

/// Every record's effect once, each partition's offset stored past its
/// last record, and a message published twice upstream caught by its
/// marker (the offset cannot: the copy is another record).
async fn exactly_once_with_the_offsets_in_the_database<F: Fixture>() {
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    let topic = kafka.topic_of_steps("offsets_once", 2, 12).await;
    // p0-3 again, at the end of partition 1.
    kafka.produce(&topic, Some(1), None, &step(0, 3), &[]).await;
    let group = "once";
    let consumer = db
        .offsets(builder(&kafka, &topic, group))
        .concurrency(4)
        .stop_when_idle(Duration::from_secs(2))
        .build()
        .unwrap();
    let handler_db = Arc::clone(&db);
    let stats = tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Step| Arc::clone(&handler_db).apply(msg),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("stops once idle")
    .unwrap();
    let effects = db.effects().await;
    assert_eq!(effects.len(), 24, "{effects:?}");
    assert!(
        effects.values().all(|&n| n == 1),
        "an effect applied twice: {effects:?}"
    );
    assert_eq!(stats.acked, 25, "{stats:?}");
    assert_eq!(db.stored(group, &topic).await, BTreeMap::from([(0, 12), (1, 13)]));
    // Kafka's commits follow, as a hint for monitoring.
    assert_eq!(kafka.committed(group, &topic).await, vec![Some(12), Some(13)]);
    db.clean(&topic).await;
}

/// A consumer dropped mid-stream (its task aborted: handlers cut short,
/// nothing committed to Kafka), then a new member of the group: it starts
/// at the offsets stored with the effects, and with markers that never
/// match no record's effect is applied twice.
async fn a_new_consumer_resumes_at_the_stored_offsets_without_markers_or_kafka_commits<F: Fixture>() {
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    let topic = kafka.topic_of_steps("offsets_restart", 2, 15).await;
    let group = "restart";
    let applied = Arc::new(AtomicUsize::new(0));
    let start = |idle: Option<Duration>| {
        let mut builder = db
            .offsets(builder(&kafka, &topic, group))
            .kafka_commits(false)
            .concurrency(2);
        if let Some(idle) = idle {
            builder = builder.stop_when_idle(idle);
        }
        let consumer = builder.build().unwrap();
        let stats = consumer.stats();
        let (db, applied) = (Arc::clone(&db), Arc::clone(&applied));
        let run = tokio::spawn(consumer.run(
            move |msg: Step| {
                let (db, applied) = (Arc::clone(&db), Arc::clone(&applied));
                async move {
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    db.apply_unmarked(msg).await?;
                    applied.fetch_add(1, Ordering::SeqCst);
                    Ok::<(), idempotent_runtime::Error>(())
                }
            },
            CancellationToken::new(),
        ));
        (stats, run)
    };
    let (_, run_a) = start(None);
    wait_until!("A under way", applied.load(Ordering::SeqCst) >= 8);
    run_a.abort();
    assert!(run_a.await.unwrap_err().is_cancelled());
    let before = db.effects().await.len();
    assert!(before < 30, "records left for the new consumer");
    assert_eq!(
        kafka.committed(group, &topic).await,
        vec![None, None],
        "nothing was committed to Kafka: only the database knows where A stopped"
    );
    let (stats_b, run_b) = start(Some(Duration::from_secs(2)));
    let b = tokio::time::timeout(WAIT, run_b)
        .await
        .expect("B stops once idle")
        .unwrap()
        .unwrap();
    let effects = db.effects().await;
    assert_eq!(effects.len(), 30, "{effects:?}");
    assert!(
        effects.values().all(|&n| n == 1),
        "an effect applied twice after the restart: {effects:?}"
    );
    assert!(
        (b.received as usize) <= 30 - before + 2,
        "B started where A's committed effects ended, not at the start: {b:?} ({before} applied before)"
    );
    assert_eq!(stats_b.snapshot().acked, b.acked);
    assert_eq!(db.stored(group, &topic).await, BTreeMap::from([(0, 15), (1, 15)]));
    db.clean(&topic).await;
}

/// Two members, one leaving mid-stream: each partition's new owner starts
/// at its stored offset (no Kafka commits, no matching markers), and every
/// effect is applied once.
async fn a_rebalance_hands_each_partition_over_at_its_stored_offset<F: Fixture>() {
    const PARTITIONS: i32 = 4;
    const PER_PARTITION: u32 = 20;
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    let topic = kafka
        .topic_of_steps("offsets_rebalance", PARTITIONS, PER_PARTITION)
        .await;
    let group = "rebalance";
    let start = |name: &str| {
        let consumer = db
            .offsets(builder(&kafka, &topic, group))
            .kafka_commits(false)
            .concurrency(4)
            .client_config("client.id", name)
            .build()
            .unwrap();
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let db = Arc::clone(&db);
        let run = tokio::spawn(consumer.run(
            move |msg: Step| {
                let db = Arc::clone(&db);
                async move {
                    tokio::time::sleep(Duration::from_millis(60)).await;
                    db.apply_unmarked(msg).await
                }
            },
            shutdown.clone(),
        ));
        (stats, shutdown, run)
    };
    let total = (PARTITIONS as usize) * PER_PARTITION as usize;
    let (stats_a, shutdown_a, run_a) = start("member-a");
    wait_until!("A under way", stats_a.snapshot().acked >= 8);
    let (stats_b, shutdown_b, run_b) = start("member-b");
    wait_until!("B under way", stats_b.snapshot().acked >= 4);
    assert!(db.effects().await.len() < total - 10, "records left for the leave");
    shutdown_a.cancel();
    let a = run_a.await.unwrap().unwrap();
    wait_until!("every record", db.effects().await.len() == total);
    shutdown_b.cancel();
    let b = run_b.await.unwrap().unwrap();
    let effects = db.effects().await;
    assert!(
        effects.values().all(|&n| n == 1),
        "an effect applied twice across the rebalances: {effects:?} A {a:?} B {b:?}"
    );
    let stored = db.stored(group, &topic).await;
    let want: BTreeMap<i32, i64> = (0..PARTITIONS).map(|p| (p, i64::from(PER_PARTITION))).collect();
    assert_eq!(stored, want);
    db.clean(&topic).await;
}

/// A record that does not decode is dead-lettered and its offset stored
/// past it (in a transaction of its own): a new consumer neither handles
/// nor dead-letters it again.
async fn a_poison_record_moves_the_stored_offset_past_it<F: Fixture>() {
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    let topic = common::unique("offsets_poison");
    kafka.create_topic_with_dlq(&topic, 1).await;
    kafka.produce(&topic, Some(0), None, &step(0, 0), &[]).await;
    kafka.produce(&topic, Some(0), None, b"not json", &[]).await;
    kafka.produce(&topic, Some(0), None, &step(0, 2), &[]).await;
    let group = "poison";
    let run = |db: Arc<F>| {
        let consumer = db
            .offsets(builder(&kafka, &topic, group))
            .kafka_commits(false)
            .stop_when_idle(Duration::from_secs(2))
            .build()
            .unwrap();
        async move {
            tokio::time::timeout(
                WAIT,
                consumer.run(
                    move |msg: Step| Arc::clone(&db).apply_unmarked(msg),
                    CancellationToken::new(),
                ),
            )
            .await
            .expect("stops once idle")
            .unwrap()
        }
    };
    let first = run(Arc::clone(&db)).await;
    assert_eq!((first.acked, first.poison), (2, 1), "{first:?}");
    assert_eq!(db.stored(group, &topic).await, BTreeMap::from([(0, 3)]));
    let again = run(Arc::clone(&db)).await;
    assert_eq!(
        again.received, 0,
        "the new consumer started past the poison record: {again:?}"
    );
    assert_eq!(
        kafka.read_all(&format!("{topic}.dlq")).await.len(),
        1,
        "dead-lettered once"
    );
    let effects = db.effects().await;
    assert_eq!(effects, BTreeMap::from([("p0-0".into(), 1), ("p0-2".into(), 1)]));
    db.clean(&topic).await;
}

/// A handler that outlives its partition (A's handler of p0-0 sleeps 6 s;
/// B joins, A gives its partitions up after the 1 s revoke timeout): the
/// record is delivered again and committed by the partition's next owner
/// while the first handler runs on, markers never matching. Whichever
/// transaction comes second finds the stored offset past p0-0 and rolls
/// back with its effect; the offset never moves back (a late write of
/// `1` would leave partition 0 at 1).
async fn a_revoked_handler_cannot_move_the_stored_offset_back_or_apply_twice<F: Fixture>() {
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    let topic = kafka.topic_of_steps("offsets_zombie", 2, 5).await;
    let group = "zombie";
    let slowed = Arc::new(AtomicBool::new(false));
    let slow_started = Arc::new(tokio::sync::Notify::new());
    let slow_done = Arc::new(AtomicBool::new(false));
    let start = |name: &str| {
        let consumer = db
            .offsets(builder(&kafka, &topic, group))
            .kafka_commits(false)
            .concurrency(2)
            .client_config("client.id", name)
            .build()
            .unwrap();
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let (db, slowed, slow_started, slow_done) = (
            Arc::clone(&db),
            Arc::clone(&slowed),
            Arc::clone(&slow_started),
            Arc::clone(&slow_done),
        );
        let run = tokio::spawn(consumer.run(
            move |msg: Step| {
                let (db, slowed, slow_started, slow_done) = (
                    Arc::clone(&db),
                    Arc::clone(&slowed),
                    Arc::clone(&slow_started),
                    Arc::clone(&slow_done),
                );
                async move {
                    let slow = msg.message_id == "p0-0" && !slowed.swap(true, Ordering::SeqCst);
                    if slow {
                        slow_started.notify_one();
                        tokio::time::sleep(Duration::from_secs(6)).await;
                    }
                    let applied = db.apply_unmarked(msg).await;
                    if slow {
                        slow_done.store(true, Ordering::SeqCst);
                    }
                    applied
                }
            },
            shutdown.clone(),
        ));
        (stats, shutdown, run)
    };
    let (stats_a, shutdown_a, run_a) = start("member-a");
    tokio::time::timeout(WAIT, slow_started.notified())
        .await
        .expect("the slow handler started");
    let (stats_b, shutdown_b, run_b) = start("member-b");
    wait_until!(
        "every record, and the slow handler's end",
        db.effects().await.len() == 10
            && slow_done.load(Ordering::SeqCst)
            && stats_a.snapshot().acked + stats_a.snapshot().ack_failures + stats_b.snapshot().acked >= 11
    );
    shutdown_a.cancel();
    shutdown_b.cancel();
    let a = run_a.await.unwrap().unwrap();
    let b = run_b.await.unwrap().unwrap();
    let effects = db.effects().await;
    assert!(
        effects.values().all(|&n| n == 1),
        "an effect applied twice: {effects:?} A {a:?} B {b:?}"
    );
    assert_eq!(
        db.stored(group, &topic).await,
        BTreeMap::from([(0, 5), (1, 5)]),
        "the stored offsets moved back: A {a:?} B {b:?}"
    );
    db.clean(&topic).await;
}

/// A batch member whose handler fails after its `#[idempotent]` call
/// completed leaves nothing in the batch's commit: with markers that never
/// match, an effect committed without its record's offset would be applied
/// again when the record is retried.
async fn a_batch_member_that_fails_after_its_call_leaves_nothing_in_the_commit<F: Fixture>() {
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    // Four partitions: a batch takes one record of each.
    let topic = kafka.topic_of_steps("offsets_member", 4, 3).await;
    let group = "member";
    let consumer = db
        .batched(db.offsets(builder(&kafka, &topic, group)), 8)
        .concurrency(1)
        .stop_when_idle(Duration::from_secs(2))
        .build()
        .unwrap();
    let handler_db = Arc::clone(&db);
    // The second record of each partition fails once, after its effect.
    let failed: Arc<std::sync::Mutex<std::collections::HashSet<String>>> = Arc::default();
    let handler_failed = Arc::clone(&failed);
    let stats = tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Step| {
                let (db, failed) = (Arc::clone(&handler_db), Arc::clone(&handler_failed));
                async move {
                    let (seq, id) = (msg.seq, msg.message_id.clone());
                    db.apply_unmarked(msg).await?;
                    if seq == 1 && failed.lock().unwrap().insert(id) {
                        return Err(idempotent_runtime::Error::Store(
                            "the handler failed after its call completed".into(),
                        ));
                    }
                    Ok(())
                }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("stops once idle")
    .unwrap();
    assert_eq!(failed.lock().unwrap().len(), 4, "each second record failed once");
    let effects = db.effects().await;
    assert_eq!(effects.len(), 12, "{effects:?}");
    assert!(
        effects.values().all(|&n| n == 1),
        "a failed member's effect was committed without its offset, then applied again: {effects:?}"
    );
    assert_eq!(stats.acked, 12, "{stats:?}");
    assert_eq!(
        db.stored(group, &topic).await,
        BTreeMap::from([(0, 3), (1, 3), (2, 3), (3, 3)])
    );
    db.clean(&topic).await;
}

/// Makes the first write of one topic's row in the offsets table fail,
/// once, with a real error from the database (a trigger on the table,
/// whose count is a sequence: a sequence's value is not rolled back with
/// the transaction the trigger fails), and undoes it.
trait FailOnce: Fixture {
    /// From now on, the first insert or update of `topic`'s offsets fails.
    fn fail_first_offset_write(&self, topic: &str) -> impl Future<Output = ()> + Send;
    /// How many writes of `topic`'s offsets the trigger saw (the first
    /// refused).
    fn offset_writes(&self, topic: &str) -> impl Future<Output = i64> + Send;
    /// Drops the trigger and what it uses.
    fn restore(&self, topic: &str) -> impl Future<Output = ()> + Send;
}

impl FailOnce for Postgres {
    async fn fail_first_offset_write(&self, topic: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SEQUENCE {topic}_seq;
             CREATE FUNCTION {topic}_fn() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF nextval('{topic}_seq') = 1 THEN
                     RAISE EXCEPTION 'the first offset write of {topic} fails (test)';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER {topic}_fail BEFORE INSERT OR UPDATE ON idempotent_kafka_offsets
                 FOR EACH ROW WHEN (NEW.topic = '{topic}') EXECUTE FUNCTION {topic}_fn();"
        )))
        .execute(self.store.pool())
        .await
        .unwrap();
    }

    async fn offset_writes(&self, topic: &str) -> i64 {
        let select = format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {topic}_seq");
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(select))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn restore(&self, topic: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TRIGGER IF EXISTS {topic}_fail ON idempotent_kafka_offsets;
             DROP FUNCTION IF EXISTS {topic}_fn();
             DROP SEQUENCE IF EXISTS {topic}_seq;"
        )))
        .execute(self.store.pool())
        .await
        .unwrap();
    }
}

impl FailOnce for MariaDb {
    async fn fail_first_offset_write(&self, topic: &str) {
        let pool = self.store.pool();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SEQUENCE {topic}_seq NOCACHE")))
            .execute(pool)
            .await
            .unwrap();
        // One trigger per event; the topic is tested first, so that other
        // tests' writes leave the sequence alone.
        for event in ["INSERT", "UPDATE"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE TRIGGER {topic}_{event} BEFORE {event} ON idempotent_kafka_offsets FOR EACH ROW
                 BEGIN
                     IF NEW.topic = '{topic}' THEN
                         IF NEXTVAL({topic}_seq) = 1 THEN
                             SIGNAL SQLSTATE '45000'
                                 SET MESSAGE_TEXT = 'the first offset write of {topic} fails (test)';
                         END IF;
                     END IF;
                 END"
            )))
            .execute(pool)
            .await
            .unwrap();
        }
    }

    async fn offset_writes(&self, topic: &str) -> i64 {
        let select = format!("SELECT next_not_cached_value - 1 FROM {topic}_seq");
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(select))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn restore(&self, topic: &str) {
        let pool = self.store.pool();
        for drop in [
            format!("DROP TRIGGER IF EXISTS {topic}_INSERT"),
            format!("DROP TRIGGER IF EXISTS {topic}_UPDATE"),
            format!("DROP SEQUENCE IF EXISTS {topic}_seq"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(pool).await.unwrap();
        }
    }
}

/// Issue 43, hole 4: the dead letter of p0-0 is produced, then the write
/// of its offset (in a transaction of its own) fails once. The write alone
/// is tried again: the record is not handed back, so its handler, which
/// would now succeed and commit an effect for a record already in the
/// dead-letter topic, never runs again. Before, the refused write handed
/// the record back at the same attempt, and its second run committed
/// `p0-0`.
async fn a_dead_letter_whose_offset_write_fails_is_never_handled_again<F: FailOnce>() {
    let kafka = Kafka::start();
    let db = Arc::new(F::open().await);
    let topic = kafka.topic_of_steps("dlqw", 1, 2).await;
    let group = "dlqw";
    db.fail_first_offset_write(&topic).await;
    let consumer = db
        .offsets(builder(&kafka, &topic, group))
        .kafka_commits(false)
        .max_attempts(1)
        .stop_when_idle(Duration::from_secs(2))
        .build()
        .unwrap();
    let calls: Arc<std::sync::Mutex<BTreeMap<String, u32>>> = Arc::default();
    let (handler_db, handler_calls) = (Arc::clone(&db), Arc::clone(&calls));
    let stats = tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Step| {
                let (db, calls) = (Arc::clone(&handler_db), Arc::clone(&handler_calls));
                async move {
                    let call = {
                        let mut calls = calls.lock().unwrap();
                        let call = calls.entry(msg.message_id.clone()).or_default();
                        *call += 1;
                        *call
                    };
                    if msg.seq == 0 && call == 1 {
                        return Err("declined the first time".to_owned());
                    }
                    db.apply_unmarked(msg).await.map_err(|err| err.to_string())
                }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("stops once idle")
    .unwrap();
    let writes = db.offset_writes(&topic).await;
    db.restore(&topic).await;
    assert!(
        writes >= 2,
        "the first offset write was refused and another one made: {writes} writes"
    );
    assert_eq!(
        *calls.lock().unwrap(),
        BTreeMap::from([("p0-0".into(), 1), ("p0-1".into(), 1)]),
        "the dead-lettered record's handler ran again: {stats:?}"
    );
    assert_eq!(
        db.effects().await,
        BTreeMap::from([("p0-1".into(), 1)]),
        "an effect for a dead-lettered record: {stats:?}"
    );
    let dead = kafka.read_all(&format!("{topic}.dlq")).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].headers["x-idempotent-offset"], "0");
    assert_eq!((stats.dead_lettered, stats.acked), (1, 1), "{stats:?}");
    assert_eq!(db.stored(group, &topic).await, BTreeMap::from([(0, 2)]));
    db.clean(&topic).await;
}

/// [`a_dead_letter_whose_offset_write_fails_is_never_handled_again`] on
/// the stores whose offset write a trigger can fail once (SQLite keeps no
/// count outside the transaction that fails).
mod offset_write_fails_once {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_dead_letter_whose_offset_write_fails_is_never_handled_again() {
        super::a_dead_letter_whose_offset_write_fails_is_never_handled_again::<Postgres>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mariadb_a_dead_letter_whose_offset_write_fails_is_never_handled_again() {
        super::a_dead_letter_whose_offset_write_fails_is_never_handled_again::<MariaDb>().await;
    }
}

/// The scenarios, for each store.
macro_rules! scenarios {
    ($($module:ident: $fixture:ty;)*) => {$(
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn exactly_once_with_the_offsets_in_the_database() {
                super::exactly_once_with_the_offsets_in_the_database::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_new_consumer_resumes_at_the_stored_offsets_without_markers_or_kafka_commits() {
                super::a_new_consumer_resumes_at_the_stored_offsets_without_markers_or_kafka_commits::<$fixture>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rebalance_hands_each_partition_over_at_its_stored_offset() {
                super::a_rebalance_hands_each_partition_over_at_its_stored_offset::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_poison_record_moves_the_stored_offset_past_it() {
                super::a_poison_record_moves_the_stored_offset_past_it::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_revoked_handler_cannot_move_the_stored_offset_back_or_apply_twice() {
                super::a_revoked_handler_cannot_move_the_stored_offset_back_or_apply_twice::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_member_that_fails_after_its_call_leaves_nothing_in_the_commit() {
                super::a_batch_member_that_fails_after_its_call_leaves_nothing_in_the_commit::<$fixture>().await;
            }
        }
    )*};
}

scenarios! {
    postgres: Postgres;
    mariadb: MariaDb;
    sqlite: Sqlite;
}

/// The stores that cannot keep offsets do not compile (`ui/tests/ui`); a
/// partitioned `PgStore`, whose claims keep their own transaction, is
/// refused at build.
#[tokio::test]
async fn a_partitioned_pg_store_is_refused_at_build() {
    let pool = common::pg_pool(1).await;
    let store = idempotent_runtime::PgStore::builder(pool)
        .table("offsets_partitioned_never_created")
        .partitioned(Duration::from_secs(86_400))
        .build()
        .unwrap();
    let mut config = idempotent_runtime::rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", "127.0.0.1:9");
    let refused = KafkaConsumer::builder(config.clone(), "t", "g")
        .offsets_in(store)
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(refused.contains("partitioned PgStore"), "{refused}");
    let refused = KafkaConsumer::builder(config, "t", "g")
        .kafka_commits(false)
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(refused.contains("kafka_commits(false) without offsets_in"), "{refused}");
}

/// Set in the consumer processes `consumers_sigkilled_mid_stream_resume_at_the_stored_offsets`
/// starts: `bootstrap,topic,group,markers table,effects table`.
const CHILD: &str = "IDEMPOTENT_KAFKA_OFFSETS_CHILD";

/// Not a test by itself: with `IDEMPOTENT_KAFKA_OFFSETS_CHILD` set, the
/// consumer process that the SIGKILL test starts (offsets in PostgreSQL,
/// markers that never match, no Kafka commits), running until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_child_consumer() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let [bootstrap, topic, group, markers, effects] = parts[..] else {
        panic!("{CHILD}={spec}");
    };
    let pool = common::pg_pool(4).await;
    let db = Arc::new(Postgres {
        store: idempotent_runtime::PgStore::builder(pool)
            .table(markers)
            .build()
            .unwrap(),
        markers: markers.into(),
        effects: effects.into(),
        // Keys no other process makes.
        fresh: AtomicU64::new(u64::from(std::process::id()) << 32),
        _keep: None,
    });
    let mut config = idempotent_runtime::rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("broker.address.family", "v4")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("fetch.wait.max.ms", "100");
    let consumer = db
        .offsets(KafkaConsumer::builder(config, topic, group))
        .kafka_commits(false)
        .concurrency(2)
        .build()
        .unwrap();
    let _ = consumer
        .run(
            move |msg: Step| {
                let db = Arc::clone(&db);
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    db.apply_unmarked(msg).await
                }
            },
            CancellationToken::new(),
        )
        .await;
}

/// Consumer processes SIGKILLed mid-stream, twice (their transactions cut
/// wherever they were), then a last consumer: with markers that never
/// match and nothing committed to Kafka, every record's effect is applied
/// once, because each new member starts at the offsets stored with the
/// effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_sigkilled_mid_stream_resume_at_the_stored_offsets() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    const PER_PARTITION: u32 = 60;
    let kafka = Kafka::start();
    let db = Arc::new(Postgres::open().await);
    let topic = kafka.topic_of_steps("offsets_sigkill", 2, PER_PARTITION).await;
    let group = "sigkill";
    let spec = format!("{},{topic},{group},{},{}", kafka.bootstrap(), db.markers, db.effects);
    for kill in 1..=2 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["offsets_child_consumer", "--exact", "--nocapture"])
            .env(CHILD, &spec)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_until!("the child under way", db.effects().await.len() >= kill * 30);
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
    }
    let before = db.effects().await.len();
    assert!(before < 120, "records left for the last consumer");
    let consumer = db
        .offsets(builder(&kafka, &topic, group))
        .kafka_commits(false)
        .stop_when_idle(Duration::from_secs(3))
        .build()
        .unwrap();
    let handler_db = Arc::clone(&db);
    let last = tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Step| Arc::clone(&handler_db).apply_unmarked(msg),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the last consumer stops once idle")
    .unwrap();
    let effects = db.effects().await;
    assert_eq!(effects.len(), 120, "{effects:?}");
    assert!(
        effects.values().all(|&n| n == 1),
        "an effect applied twice after a SIGKILL: {effects:?}"
    );
    assert!(
        (last.received as usize) <= 120 - before + 4,
        "the last consumer started at the stored offsets: {last:?} ({before} applied before)"
    );
    assert_eq!(db.stored(group, &topic).await, BTreeMap::from([(0, 60), (1, 60)]));
    db.clean(&topic).await;
}
