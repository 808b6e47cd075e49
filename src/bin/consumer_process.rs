//! A consumer process for the tests that need more than one process
//! (competing consumers across processes, chaos with SIGKILL). Not an
//! example: tests find it through `CARGO_BIN_EXE_consumer_process`.
//!
//! `consumer_process race <markers_table> <payments_table> <message_id> <start_at_unix_ms>`
//! waits until the given instant, then handles the message once against
//! PostgreSQL and prints `processed` or `duplicate`.
//!
//! `consumer_process chaos <rabbitmq|nats|kafka> <source> <markers_table> <payments_table> <log_table> <fail_percent> <crash_percent>`
//! consumes payments into PostgreSQL, from a RabbitMQ queue (`source`) with
//! `RabbitConsumer`, from a JetStream stream (`source`, durable consumer
//! `chaos`, dead letters on `<source>.dlq` subject) with
//! `JetStreamConsumer`, or from a Kafka topic (`source`, as a member of the
//! consumer group `chaos`, dead letters to the topic `<source>.dlq`) with
//! `KafkaConsumer`; the body fails on purpose `fail_percent` of the
//! time (and always for messages marked `always_fail`), and the process
//! aborts right after a commit, before the ack, `crash_percent` of the
//! time. Every delivery, injected failure and crash is logged in
//! `log_table` (outside the handler's transaction, best effort) for the
//! chaos test's figures. The broker and database are
//! `IDEMPOTENT_BROKER_URL` and `IDEMPOTENT_PG_URL` (the machine's services
//! by default). With `IDEMPOTENT_CHAOS_BATCH=<n>` it runs batches of up to
//! `n` deliveries per transaction (`ConsumerBuilder::batch`): the abort in
//! the handler then lands mid-batch (before the commit), and a batch aborts
//! the process right after its commit, before its acks, five times
//! `crash_percent` of the time. Besides, the first delivery of each message
//! whose id ends with `IDEMPOTENT_CHAOS_CRASH_SUFFIX` (default `07` when
//! `crash_percent` is not 0) aborts
//! the process after its commit (once per message: Kafka keeps no delivery
//! count, so the log says whether it crashed before). On Kafka,
//! `IDEMPOTENT_CHAOS_KAFKA_ORDER=key` orders by key within a partition
//! (`Order::Key`) instead of by partition.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use idempotent_runtime::async_nats::{self, jetstream};
use idempotent_runtime::broker::{Backoff, DeliveryInfo, Reconnect, shutdown_on_signal};
use idempotent_runtime::kafka::{KafkaConsumer, Order};
use idempotent_runtime::nats::JetStreamConsumer;
use idempotent_runtime::rabbitmq::RabbitConsumer;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::Rng;

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A payment message of the chaos test.
#[derive(Debug, serde::Deserialize)]
struct ChaosPayment {
    message_id: String,
    amount: i64,
    #[serde(default)]
    always_fail: bool,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("injected failure")]
    Injected,
}

struct Consumer {
    store: PgStore,
    payments: String,
}

impl Consumer {
    /// Returns the process id of the process that ran the body.
    #[idempotent(key = "message_id", store = self.store)]
    async fn pay(&self, message_id: &str, tx: &mut PgConnection) -> Result<u32, AppError> {
        let insert = format!("INSERT INTO {} (message_id, pid) VALUES ($1, $2)", self.payments);
        sqlx::query(AssertSqlSafe(insert))
            .bind(message_id)
            .bind(i64::from(std::process::id()))
            .execute(&mut *tx)
            .await?;
        Ok(std::process::id())
    }
}

struct ChaosConsumer {
    store: PgStore,
    pool: PgPool,
    payments: String,
    log: String,
    fail_percent: u32,
}

impl ChaosConsumer {
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn pay(&self, msg: &ChaosPayment, tx: &mut PgConnection) -> Result<(), AppError> {
        let insert = format!(
            "INSERT INTO {} (message_id, amount, pid) VALUES ($1, $2, $3)",
            self.payments
        );
        sqlx::query(AssertSqlSafe(insert))
            .bind(&msg.message_id)
            .bind(msg.amount)
            .bind(i64::from(std::process::id()))
            .execute(&mut *tx)
            .await?;
        // Widen the window in which a SIGKILL lands mid-transaction.
        let pause = rand::rng().random_range(0..4);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        if msg.always_fail || rand::rng().random_ratio(self.fail_percent, 100) {
            self.log(&msg.message_id, "failure").await;
            return Err(AppError::Injected);
        }
        Ok(())
    }

    /// Whether the log has a crash of this message (a crash after commit
    /// happens once per message).
    async fn crashed_before(&self, message_id: &str) -> bool {
        let query = format!(
            "SELECT count(*) FROM {} WHERE message_id = $1 AND event = 'crash'",
            self.log
        );
        let crashes: Result<i64, _> = sqlx::query_scalar(AssertSqlSafe(query))
            .bind(message_id)
            .fetch_one(&self.pool)
            .await;
        match crashes {
            Ok(n) => n > 0,
            // Unknown (the database is down): no crash.
            Err(_) => true,
        }
    }

    /// Logs an event outside the handler's transaction (best effort).
    async fn log(&self, message_id: &str, event: &str) {
        let insert = format!("INSERT INTO {} (message_id, event) VALUES ($1, $2)", self.log);
        let _ = sqlx::query(AssertSqlSafe(insert))
            .bind(message_id)
            .bind(event)
            .execute(&self.pool)
            .await;
    }
}

/// The store's batches, some of which abort the process right after their
/// commit, before the consumer acknowledges their deliveries.
#[derive(Clone)]
struct CrashingBatches {
    store: PgStore,
    pool: PgPool,
    log: String,
    crash_percent: u32,
}

impl idempotent_runtime::batch::BatchStore for CrashingBatches {
    async fn begin_batch(&self) -> Result<idempotent_runtime::batch::Batch, idempotent_runtime::Error> {
        let batch = self.store.begin_batch().await?;
        if rand::rng().random_ratio(self.crash_percent, 100) {
            // Logged before the commit (the process is gone after it).
            let insert = format!("INSERT INTO {} (message_id, event) VALUES ('', 'crash')", self.log);
            let _ = sqlx::query(AssertSqlSafe(insert)).execute(&self.pool).await;
            batch.after_commit(|| std::process::abort());
        }
        Ok(batch)
    }
}

async fn chaos(args: &[&str]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let [broker, source, markers, payments, log, fail_percent, crash_percent] = args else {
        return Err(
            "usage: consumer_process chaos <rabbitmq|nats> <source> <markers> <payments> <log> <fail%> <crash%>".into(),
        );
    };
    let crash_percent: u32 = crash_percent.parse()?;
    let pg_url = std::env::var("IDEMPOTENT_PG_URL").unwrap_or_else(|_| PG_URL.to_owned());
    // The name the chaos driver finds this process's backends by.
    let options: sqlx::postgres::PgConnectOptions = pg_url.parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options.application_name("chaos_consumer"));
    // Keep a connection open (made again after a database restart), so the
    // driver's connection kills find one even once every message is settled.
    let keepalive = pool.clone();
    tokio::spawn(async move {
        loop {
            let _ = sqlx::query("SELECT 1").execute(&keepalive).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let store = PgStore::builder(pool.clone()).table(markers).build()?;
    let batch: Option<usize> = match std::env::var("IDEMPOTENT_CHAOS_BATCH") {
        Ok(n) if !n.is_empty() => Some(n.parse()?),
        _ => None,
    };
    let batches = CrashingBatches {
        store: store.clone(),
        pool: pool.clone(),
        log: (*log).to_owned(),
        // A batch holds several messages: five times the per-message rate.
        crash_percent: (crash_percent * 5).min(100),
    };
    let consumer = Arc::new(ChaosConsumer {
        store,
        pool,
        payments: (*payments).to_owned(),
        log: (*log).to_owned(),
        fail_percent: fail_percent.parse()?,
    });
    // Forced crashes: with the suffix given, or `07` with random crashes.
    let crash_suffix = std::env::var("IDEMPOTENT_CHAOS_CRASH_SUFFIX")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| (crash_percent > 0).then(|| "07".to_owned()));
    let handler = move |msg: ChaosPayment, info: DeliveryInfo| {
        let consumer = Arc::clone(&consumer);
        let crash_suffix = crash_suffix.clone();
        async move {
            let redelivered = if info.redelivered { " redelivered" } else { "" };
            // The process id: the Kafka run counts partition handovers.
            let event = format!("delivery {}{redelivered} pid={}", info.attempt, std::process::id());
            consumer.log(&msg.message_id, &event).await;
            consumer.pay(&msg).await?;
            // Besides the random crashes, the first commit of every
            // hundredth message (`pay-…07`) crashes its process, so a run
            // always has some (a 2 % draw over a few hundred deliveries
            // came out 0 once): once per message (the log says whether it
            // crashed before), and not on a redelivery; a retry in place
            // counts (the first attempt may have failed by injection or
            // on a database restart: a Kafka run of 1 200 messages, whose
            // only candidate's first attempt failed, had none).
            let forced = batch.is_none()
                && crash_suffix
                    .as_deref()
                    .is_some_and(|suffix| msg.message_id.ends_with(suffix))
                && !info.redelivered
                && !consumer.crashed_before(&msg.message_id).await;
            if forced || rand::rng().random_ratio(crash_percent, 100) {
                if batch.is_some() {
                    // Mid-batch: nothing of the batch is committed.
                    consumer.log(&msg.message_id, "mid-batch crash").await;
                } else {
                    // Committed, never acked: the broker must redeliver.
                    consumer.log(&msg.message_id, "crash").await;
                }
                std::process::abort();
            }
            Ok::<_, AppError>(())
        }
    };
    let retry = Backoff::new(Duration::from_millis(5), Duration::from_millis(20));
    let fast_reconnect = Reconnect::forever(Backoff::new(Duration::from_millis(50), Duration::from_millis(500)));
    match *broker {
        "rabbitmq" => {
            let url = std::env::var("IDEMPOTENT_BROKER_URL").unwrap_or_else(|_| AMQP_URL.to_owned());
            let builder = RabbitConsumer::builder(url, *source)
                .concurrency(4)
                .max_attempts(5)
                .retry_backoff(retry)
                .reconnect(fast_reconnect);
            let builder = match batch {
                Some(n) => builder
                    .prefetch(u16::try_from(4 * n)?)
                    .batch(batches, n)
                    .batch_wait(Duration::from_millis(2)),
                None => builder.prefetch(8),
            };
            builder.build()?.run_with_info(handler, shutdown_on_signal()).await?;
        }
        "nats" => {
            let url = std::env::var("IDEMPOTENT_BROKER_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
            let js = jetstream::new(async_nats::connect(url).await?);
            let pull = js.get_stream(*source).await?.get_consumer("chaos").await?;
            let builder = JetStreamConsumer::builder(js, pull)
                .dead_letter_subject(format!("{source}.dlq"))
                .concurrency(4)
                .max_attempts(5)
                .retry_backoff(retry)
                .reconnect(fast_reconnect)
                .fetch_expiry(Duration::from_millis(500));
            let builder = match batch {
                Some(n) => builder
                    .prefetch(4 * n)
                    .batch(batches, n)
                    .batch_wait(Duration::from_millis(2)),
                None => builder,
            };
            builder.build()?.run_with_info(handler, shutdown_on_signal()).await?;
        }
        "kafka" => {
            let bootstrap = std::env::var("IDEMPOTENT_BROKER_URL").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
            // The group settings of the tests: joins and rebalances in
            // seconds (a SIGKILLed member's partitions move after the
            // session timeout).
            let mut config = idempotent_runtime::rdkafka::ClientConfig::new();
            config
                .set("bootstrap.servers", bootstrap)
                .set("broker.address.family", "v4")
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "500")
                .set("max.poll.interval.ms", "20000")
                .set("topic.metadata.refresh.interval.ms", "1000")
                .set("fetch.wait.max.ms", "100");
            let builder = KafkaConsumer::builder(config, *source, "chaos")
                .dead_letter_topic(format!("{source}.dlq"))
                .concurrency(4)
                .max_attempts(5)
                .retry_backoff(retry)
                .reconnect(fast_reconnect)
                .commit_interval(Duration::from_millis(200))
                .revoke_timeout(Duration::from_secs(3))
                .order(match std::env::var("IDEMPOTENT_CHAOS_KAFKA_ORDER").as_deref() {
                    Ok("key") => Order::Key,
                    _ => Order::Partition,
                });
            let builder = match batch {
                Some(n) => builder.batch(batches, n).batch_wait(Duration::from_millis(2)),
                None => builder,
            };
            builder.build()?.run_with_info(handler, shutdown_on_signal()).await?;
        }
        other => return Err(format!("unknown broker `{other}`").into()),
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["race", markers, payments, message_id, start_at] => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(PG_URL)
                .await?;
            let store = PgStore::builder(pool).table(markers).build()?;
            let consumer = Consumer {
                store,
                payments: (*payments).to_owned(),
            };
            let start_at = Duration::from_millis(start_at.parse()?);
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
            tokio::time::sleep(start_at.saturating_sub(now)).await;
            let winner = consumer.pay(message_id).await?;
            println!(
                "{}",
                if winner == std::process::id() {
                    "processed"
                } else {
                    "duplicate"
                }
            );
            Ok(())
        }
        ["chaos", rest @ ..] => chaos(rest).await,
        _ => Err("usage: consumer_process race|chaos ... (see the module docs)".into()),
    }
}
