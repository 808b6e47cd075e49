//! One measurement of `benches/kafka.rs` (also run once, small, by
//! `tests/bench_smoke.rs`): a topic's records consumed from its start by a
//! fresh consumer group, each record's effect a row inserted in
//! PostgreSQL, in one of three modes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::broker::CancellationToken;
use idempotent_runtime::kafka::KafkaConsumer;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};

use crate::common::kafka::Kafka;
use crate::common::unique;

/// How the consumer makes a record's effect happen once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No idempotency: the effect in a transaction of its own, then the
    /// offset committed to Kafka.
    Bare,
    /// An `#[idempotent]` handler: marker and effect in one transaction,
    /// then the offset committed to Kafka.
    Markers,
    /// The same handler with `offsets_in(store)`: marker, effect and the
    /// partition's offset in one transaction (Kafka commits as a hint).
    Offsets,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Bare, Mode::Markers, Mode::Offsets];

    pub fn label(self) -> &'static str {
        match self {
            Mode::Bare => "(a) no idempotency",
            Mode::Markers => "(b) markers",
            Mode::Offsets => "(c) offsets in the database",
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Payment {
    id: String,
}

struct Ledger {
    store: PgStore,
    insert: String,
    /// When the first handler call started (the group had joined).
    first: Mutex<Option<Instant>>,
}

impl Ledger {
    #[idempotent(key = "msg.id", store = self.store, scope = "bench.kafka")]
    async fn charge(&self, msg: &Payment, tx: &mut PgConnection) -> Result<(), idempotent_runtime::Error> {
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn charge_bare(&self, msg: &Payment) -> Result<(), sqlx::Error> {
        let mut tx = self.store.pool().begin().await?;
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    fn started(&self) {
        if let Ok(mut first) = self.first.lock() {
            first.get_or_insert_with(Instant::now);
        }
    }
}

/// A topic of `partitions` partitions holding `messages` payments, spread
/// evenly.
pub async fn topic(kafka: &Kafka, partitions: i32, messages: usize) -> String {
    let topic = unique("bench_kafka");
    kafka.create_topic(&topic, partitions).await;
    kafka.create_topic(&format!("{topic}.dlq"), 1).await;
    for partition in 0..partitions {
        let values: Vec<Vec<u8>> = (0..messages)
            .filter(|i| (*i as i32) % partitions == partition)
            .map(|i| serde_json::to_vec(&Payment { id: format!("pay-{i}") }).unwrap_or_default())
            .collect();
        for chunk in values.chunks(500) {
            kafka.produce_batch(&topic, partition, chunk).await;
        }
    }
    topic
}

/// Consumes `topic` (`messages` records) from its start with a fresh group
/// in `mode`: messages per second from the first handler call to the last
/// acknowledgement (after its commit), the group's join left out.
pub async fn measure(kafka: &Kafka, pool: &PgPool, topic: &str, mode: Mode, messages: usize) -> Result<f64, String> {
    let markers = unique("bench_kafka_markers");
    let effects = unique("bench_kafka_effects");
    let group = unique("bench");
    let store = PgStore::builder(pool.clone())
        .table(&markers)
        .build()
        .map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| e.to_string())?;
    sqlx::query(AssertSqlSafe(format!("CREATE TABLE {effects} (id TEXT NOT NULL)")))
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    let ledger = Arc::new(Ledger {
        store: store.clone(),
        insert: format!("INSERT INTO {effects} (id) VALUES ($1)"),
        first: Mutex::new(None),
    });
    let mut builder = KafkaConsumer::builder(kafka.config(), topic, &group).concurrency(8);
    if mode == Mode::Offsets {
        builder = builder.offsets_in(store.clone());
    }
    let consumer = builder.build().map_err(|e| e.to_string())?;
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_ledger = Arc::clone(&ledger);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = Arc::clone(&handler_ledger);
            async move {
                ledger.started();
                match mode {
                    Mode::Bare => ledger.charge_bare(&msg).await.map_err(|e| e.to_string()),
                    Mode::Markers | Mode::Offsets => ledger.charge(&msg).await.map_err(|e| e.to_string()),
                }
            }
        },
        shutdown.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    let end = loop {
        if stats.snapshot().acked >= messages as u64 {
            break Instant::now();
        }
        if Instant::now() > deadline || run.is_finished() {
            shutdown.cancel();
            return Err(format!(
                "{mode:?}: {} of {messages} acknowledged",
                stats.snapshot().acked
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    shutdown.cancel();
    let ran = run.await.map_err(|e| e.to_string())?;
    ran.map_err(|e| e.to_string())?;
    let applied: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(DISTINCT id) FROM {effects}")))
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
    for table in [&markers, &effects] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(pool)
            .await
            .map_err(|e| e.to_string())?;
    }
    sqlx::query("DELETE FROM idempotent_kafka_offsets WHERE consumer_group = $1")
        .bind(&group)
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    if applied != messages as i64 {
        return Err(format!("{mode:?}: {applied} effects for {messages} records"));
    }
    let start = ledger
        .first
        .lock()
        .map_err(|_| "poisoned".to_owned())?
        .ok_or_else(|| "no handler ran".to_owned())?;
    Ok(messages as f64 / end.duration_since(start).as_secs_f64().max(1e-9))
}
