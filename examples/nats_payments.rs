//! The article's payment consumer as a small service on the real NATS
//! JetStream and PostgreSQL.
//!
//! It creates a fresh stream (and a dead-letter stream) with a durable pull
//! consumer, fresh tables, publishes 200 payment messages (one in four twice,
//! as a producer retry does) and runs three competing [`JetStreamConsumer`]s
//! on that durable consumer. Their handler is an `#[idempotent]` method: the
//! payment insert and the "processed" marker commit in one transaction, the
//! adapter acks only after that commit.
//!
//! Consumer 1 "dies" right after the commit of one payment, before its ack:
//! its task is aborted and its connection dropped, so after the consumer's
//! `ack_wait` (1 s here) JetStream redelivers every message it had not acked
//! to the two others, and the marker turns the redelivery of the committed
//! payment into a skipped duplicate. The proof is printed, then the streams
//! and tables are deleted.
//!
//! Needs the services of `.ci/run`: `cargo run --example nats_payments`
//! (`NATS_URL` and `DATABASE_URL` override the defaults).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idempotent_runtime::async_nats;
use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::nats::{
    CancellationToken, ConsumerError, ConsumerStats, DeliveryInfo, JetStreamConsumer, RunStats,
};
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use tokio::task::{AbortHandle, JoinHandle};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Distinct payments; one in four is published twice.
const PAYMENTS: usize = 200;
/// Competing consumers (service instances), each on its own connection.
const CONSUMERS: usize = 3;
/// Consumer 1 dies after committing this many payments of its own.
const KILL_AFTER: usize = 5;
/// How long JetStream waits for an ack before it redelivers.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// Name of the durable pull consumer the three service instances share.
const DURABLE: &str = "payment-service";
/// Longest the whole run may take before it is called a failure.
const DEADLINE: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, Serialize, Deserialize)]
struct PaymentMessage {
    message_id: String,
    order_id: String,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

struct PaymentService {
    store: PgStore,
    /// `INSERT INTO <payments table> ..`: the table has a fresh name per run.
    insert_payment: String,
}

impl PaymentService {
    /// Charges an order. The insert and the marker commit in one transaction;
    /// a duplicate returns `Ok(())` without running this body. `charged`
    /// tells the caller which of the two happened (for the proof only).
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn process_payment(
        &self,
        msg: &PaymentMessage,
        charged: &AtomicBool,
        tx: &mut PgConnection,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(self.insert_payment.as_str()))
            .bind(&msg.order_id)
            .bind(msg.amount_cents)
            .execute(&mut *tx)
            .await?;
        charged.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// What the handlers saw, across all consumers.
#[derive(Default)]
struct Tally {
    deliveries: AtomicUsize,
    redeliveries: AtomicUsize,
    charged: AtomicUsize,
    duplicates: AtomicUsize,
    redelivered_duplicates: AtomicUsize,
    kills: AtomicUsize,
}

/// The handler every consumer runs: the idempotent call, plus bookkeeping.
async fn handle(
    service: &PaymentService,
    tally: &Tally,
    msg: &PaymentMessage,
    info: &DeliveryInfo,
) -> Result<bool, AppError> {
    tally.deliveries.fetch_add(1, Ordering::Relaxed);
    if info.redelivered {
        tally.redeliveries.fetch_add(1, Ordering::Relaxed);
    }
    let charged = AtomicBool::new(false);
    service.process_payment(msg, &charged).await?;
    let charged = charged.into_inner();
    if charged {
        tally.charged.fetch_add(1, Ordering::Relaxed);
    } else {
        tally.duplicates.fetch_add(1, Ordering::Relaxed);
        if info.redelivered {
            tally.redelivered_duplicates.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(charged)
}

/// Fresh names for this run's streams and tables.
struct Names {
    stream: String,
    dead_letter_stream: String,
    subject: String,
    dead_letter_subject: String,
    markers: String,
    payments: String,
}

impl Names {
    fn new() -> Self {
        let id = format!("{:08x}", rand::random::<u32>());
        Names {
            stream: format!("PAYMENTS_DEMO_{id}"),
            dead_letter_stream: format!("PAYMENTS_DEMO_{id}_DLQ"),
            subject: format!("payments_demo.{id}"),
            dead_letter_subject: format!("payments_demo.{id}.dlq"),
            markers: format!("processed_messages_demo_{id}"),
            payments: format!("payments_demo_{id}"),
        }
    }
}

struct Proof {
    published: usize,
    deliveries: usize,
    redeliveries: usize,
    killed: usize,
    charged: usize,
    duplicates: usize,
    redelivered_duplicates: usize,
    payments: i64,
    charged_twice: i64,
    left_over: u64,
}

impl Proof {
    fn holds(&self) -> bool {
        self.payments == PAYMENTS as i64
            && self.charged_twice == 0
            && self.killed >= 1
            && self.redelivered_duplicates >= 1
            && self.left_over == 0
    }

    /// Handler calls that never returned: those in flight in the killed
    /// consumer when it died. Each was rolled back or had just committed;
    /// either way its message was not acked and comes back.
    fn cut_short(&self) -> usize {
        self.deliveries.saturating_sub(self.charged + self.duplicates)
    }

    fn print(&self, names: &Names) {
        let row = |label: &str, value: String| println!("  {label:<40} {value:>5}");
        println!("idempotent on NATS JetStream: the article's payment consumer, {CONSUMERS} competing consumers");
        println!(
            "  stream `{}`, payments in PostgreSQL table `{}`",
            names.stream, names.payments
        );
        println!();
        row("payment messages", PAYMENTS.to_string());
        row("messages published (with duplicates)", self.published.to_string());
        row("deliveries seen by the handlers", self.deliveries.to_string());
        row("consumers killed before ack", self.killed.to_string());
        row("  handler calls cut short with it", self.cut_short().to_string());
        row("redeliveries (counted by JetStream)", self.redeliveries.to_string());
        row("duplicates skipped", self.duplicates.to_string());
        row(
            "  of them redeliveries after the kill",
            self.redelivered_duplicates.to_string(),
        );
        row("payments in the table", self.payments.to_string());
        row("orders charged twice", self.charged_twice.to_string());
        row("messages left unacked or dead-lettered", self.left_over.to_string());
        println!();
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pg_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let names = Names::new();

    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&pg_url)
        .await?;
    let admin = jetstream::new(async_nats::connect(&nats_url).await?);

    let outcome = tokio::time::timeout(DEADLINE, demo(&nats_url, &pool, &admin, &names)).await;
    let cleaned = cleanup(&pool, &admin, &names).await;
    pool.close().await;

    let proof = outcome.map_err(|_| format!("the demo did not finish within {DEADLINE:?}"))??;
    cleaned?;
    proof.print(&names);
    if proof.holds() {
        println!("each payment was applied exactly once.");
        Ok(())
    } else {
        Err("the proof failed: a payment was lost or applied twice, or the crash was not exercised".into())
    }
}

async fn demo(nats_url: &str, pool: &PgPool, admin: &jetstream::Context, names: &Names) -> Result<Proof, BoxError> {
    // Fresh tables: the marker table (the store's DDL) and the payments.
    let store = PgStore::builder(pool.clone()).table(&names.markers).build()?;
    store.migrate().await?;
    let ddl = format!(
        "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
        names.payments
    );
    sqlx::query(AssertSqlSafe(ddl)).execute(pool).await?;
    let service = Arc::new(PaymentService {
        store,
        insert_payment: format!(
            "INSERT INTO {} (order_id, amount_cents) VALUES ($1, $2)",
            names.payments
        ),
    });

    // Fresh streams: the payments, and the dead letters (a stream must
    // capture the dead-letter subject). A durable pull consumer with
    // explicit acks and a short ack_wait, shared by the three instances.
    for (name, subject) in [
        (&names.stream, &names.subject),
        (&names.dead_letter_stream, &names.dead_letter_subject),
    ] {
        admin
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                storage: stream::StorageType::Memory,
                ..Default::default()
            })
            .await?;
    }
    let durable = pull::Config {
        durable_name: Some(DURABLE.into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        ..Default::default()
    };
    admin.get_stream(&names.stream).await?.create_consumer(durable).await?;

    let published = publish(admin, &names.subject).await?;

    // Three consumers, each on its own connection; consumer 1 dies after the
    // commit of its 5th payment.
    let tally = Arc::new(Tally::default());
    let shutdown = CancellationToken::new();
    let mut consumers = Vec::new();
    for n in 1..=CONSUMERS {
        let js = jetstream::new(async_nats::connect(nats_url).await?);
        let pull: PullConsumer = js.get_stream(&names.stream).await?.get_consumer(DURABLE).await?;
        let crash = (n == 1).then(|| Arc::new(Crash::default()));
        consumers.push(spawn_consumer(js, pull, names, &service, &tally, crash, &shutdown)?);
        if n == 1 {
            wait_for_first_delivery(&consumers[0].0).await;
        }
    }

    // Done when JetStream has every message delivered and acknowledged (by
    // consumer 1 before it died, or by the survivors, redeliveries included).
    let payments_stream = admin.get_stream(&names.stream).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let info = payments_stream.consumer_info(DURABLE).await?;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        if consumers.iter().skip(1).any(|(_, run)| run.is_finished()) {
            break; // a survivor stopped early: its error is reported below
        }
    }
    shutdown.cancel();
    let mut killed = 0;
    for (n, (_, run)) in consumers.into_iter().enumerate() {
        match run.await {
            // Consumer 1's task was aborted: the process "died".
            Err(err) if n == 0 && err.is_cancelled() && tally.kills.load(Ordering::Relaxed) > 0 => killed += 1,
            result => {
                result??;
            }
        }
    }

    let payments: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {}", names.payments)))
        .fetch_one(pool)
        .await?;
    let charged_twice: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT order_id FROM {} GROUP BY order_id HAVING count(*) > 1) twice",
        names.payments
    )))
    .fetch_one(pool)
    .await?;
    let info = payments_stream.consumer_info(DURABLE).await?;
    let dead_letters = admin
        .get_stream(&names.dead_letter_stream)
        .await?
        .get_info()
        .await?
        .state
        .messages;
    let left_over = info.num_pending + info.num_ack_pending as u64 + dead_letters;

    Ok(Proof {
        published,
        deliveries: tally.deliveries.load(Ordering::Relaxed),
        redeliveries: tally.redeliveries.load(Ordering::Relaxed),
        killed,
        charged: tally.charged.load(Ordering::Relaxed),
        duplicates: tally.duplicates.load(Ordering::Relaxed),
        redelivered_duplicates: tally.redelivered_duplicates.load(Ordering::Relaxed),
        payments,
        charged_twice,
        left_over,
    })
}

/// Consumer 1 starts first and gets its share before the others compete, so
/// that it has payments to commit before it dies however the machine is loaded.
async fn wait_for_first_delivery(stats: &ConsumerStats) {
    while stats.snapshot().received == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes the payments, one in four twice, in random order, and waits for
/// JetStream's acks. Returns how many messages were published.
///
/// No `Nats-Msg-Id` header: JetStream would drop a copy with the same id
/// within the stream's duplicate window (2 minutes by default). That window
/// catches quick publisher retries; the marker catches everything else
/// (later retries, redeliveries, replays), which is what this shows.
async fn publish(js: &jetstream::Context, subject: &str) -> Result<usize, BoxError> {
    let mut messages = Vec::new();
    for i in 0..PAYMENTS {
        let msg = PaymentMessage {
            message_id: format!("msg-{i:03}"),
            order_id: format!("order-{i:03}"),
            amount_cents: 1_000 + i as i64,
        };
        if i % 4 == 0 {
            messages.push(msg.clone());
        }
        messages.push(msg);
    }
    messages.shuffle(&mut rand::rng());
    let mut acks = Vec::with_capacity(messages.len());
    for msg in &messages {
        let body = serde_json::to_vec(msg)?;
        acks.push(js.publish(subject.to_owned(), body.into()).await?);
    }
    for ack in acks {
        ack.await?;
    }
    Ok(messages.len())
}

/// How consumer 1 dies: after committing its `KILL_AFTER`th payment, its
/// whole task (the adapter, its handlers, its connection) is aborted before
/// the adapter can ack.
#[derive(Default)]
struct Crash {
    committed: AtomicUsize,
    run: OnceLock<AbortHandle>,
}

type Running = (ConsumerStats, JoinHandle<Result<RunStats, ConsumerError>>);

fn spawn_consumer(
    js: jetstream::Context,
    pull: PullConsumer,
    names: &Names,
    service: &Arc<PaymentService>,
    tally: &Arc<Tally>,
    crash: Option<Arc<Crash>>,
    shutdown: &CancellationToken,
) -> Result<Running, BoxError> {
    let consumer = JetStreamConsumer::builder(js, pull)
        .dead_letter_subject(&names.dead_letter_subject)
        .concurrency(4)
        .max_attempts(3)
        .fetch_expiry(Duration::from_millis(500))
        .build()?;
    let stats = consumer.stats();
    let (service, tally, dying) = (Arc::clone(service), Arc::clone(tally), crash.clone());
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: PaymentMessage, info: DeliveryInfo| {
            let (service, tally, crash) = (Arc::clone(&service), Arc::clone(&tally), dying.clone());
            async move {
                let charged = handle(&service, &tally, &msg, &info).await?;
                if let Some(crash) = crash
                    && charged
                    && crash.committed.fetch_add(1, Ordering::Relaxed) + 1 == KILL_AFTER
                {
                    // The payment is committed; the process "dies" before
                    // the ack: JetStream redelivers after ack_wait.
                    tally.kills.fetch_add(1, Ordering::Relaxed);
                    while crash.run.get().is_none() {
                        tokio::task::yield_now().await;
                    }
                    if let Some(run) = crash.run.get() {
                        run.abort();
                    }
                    std::future::pending::<()>().await;
                }
                Ok::<_, AppError>(())
            }
        },
        shutdown.clone(),
    ));
    if let Some(crash) = crash {
        let _ = crash.run.set(run.abort_handle());
    }
    Ok((stats, run))
}

/// Deletes this run's streams (and so the consumer) and tables, whatever
/// happened before.
async fn cleanup(pool: &PgPool, js: &jetstream::Context, names: &Names) -> Result<(), BoxError> {
    for name in [&names.stream, &names.dead_letter_stream] {
        if js.get_stream(name).await.is_ok() {
            js.delete_stream(name).await?;
        }
    }
    for table in [&names.payments, &names.markers] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(pool)
            .await?;
    }
    Ok(())
}
