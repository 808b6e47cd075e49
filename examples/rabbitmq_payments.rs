//! The article's payment consumer as a small service on the real RabbitMQ and
//! PostgreSQL.
//!
//! It declares a fresh queue and fresh tables, publishes 200 payment messages
//! (one in four twice, as a producer retry does) and runs three competing
//! [`RabbitConsumer`]s whose handler is an `#[idempotent]` method: the payment
//! insert and the "processed" marker commit in one transaction, the adapter
//! acks only after that commit.
//!
//! Consumer 1 "dies" right after the commit of one payment, before its ack:
//! its connection goes, so RabbitMQ redelivers every delivery it had not
//! acked to the two others, and the marker turns the redelivery of the
//! committed payment into a skipped duplicate. The proof is printed, then the
//! queues and tables are deleted.
//!
//! Needs the services of `.ci/run`: `cargo run --example rabbitmq_payments`
//! (`AMQP_URL` and `DATABASE_URL` override the defaults).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::rabbitmq::{
    CancellationToken, ConsumerError, ConsumerStats, DeliveryInfo, RabbitConsumer, RunStats,
};
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Distinct payments; one in four is published twice.
const PAYMENTS: usize = 200;
/// Competing consumers (service instances), each on its own connection.
const CONSUMERS: usize = 3;
/// Consumer 1 dies after committing this many payments of its own.
const KILL_AFTER: usize = 5;
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

/// Fresh names for this run's queues and tables.
struct Names {
    queue: String,
    dead_letters: String,
    markers: String,
    payments: String,
}

impl Names {
    fn new() -> Self {
        let id = format!("{:08x}", rand::random::<u32>());
        Names {
            queue: format!("payments_demo.{id}"),
            dead_letters: format!("payments_demo.{id}.dlq"),
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
    acks_lost: u64,
    charged: usize,
    duplicates: usize,
    redelivered_duplicates: usize,
    payments: i64,
    charged_twice: i64,
    left_over: u32,
}

impl Proof {
    fn holds(&self) -> bool {
        self.payments == PAYMENTS as i64
            && self.charged_twice == 0
            && self.charged == PAYMENTS
            && self.killed >= 1
            && self.redelivered_duplicates >= 1
            && self.left_over == 0
    }

    fn print(&self, names: &Names) {
        let row = |label: &str, value: String| println!("  {label:<40} {value:>5}");
        println!("idempotent on RabbitMQ: the article's payment consumer, {CONSUMERS} competing consumers");
        println!(
            "  queue `{}`, payments in PostgreSQL table `{}`",
            names.queue, names.payments
        );
        println!();
        row("payment messages", PAYMENTS.to_string());
        row("messages published (with duplicates)", self.published.to_string());
        row("deliveries seen by the handlers", self.deliveries.to_string());
        row("consumers killed before ack", self.killed.to_string());
        row("  acks lost with it", self.acks_lost.to_string());
        row("redeliveries (flagged by RabbitMQ)", self.redeliveries.to_string());
        row("processed (body ran and committed)", self.charged.to_string());
        row("duplicates skipped", self.duplicates.to_string());
        row(
            "  of them redeliveries after the kill",
            self.redelivered_duplicates.to_string(),
        );
        row("payments in the table", self.payments.to_string());
        row("orders charged twice", self.charged_twice.to_string());
        row("messages left in the queues", self.left_over.to_string());
        println!();
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let amqp_url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let pg_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let names = Names::new();

    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&pg_url)
        .await?;
    let admin_connection = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let admin = admin_connection.create_channel().await?;

    let outcome = tokio::time::timeout(DEADLINE, demo(&amqp_url, &pool, &admin, &names)).await;
    let cleaned = cleanup(&pool, &admin, &names).await;
    let _ = admin_connection.close(200, "demo done".into()).await;
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

async fn demo(amqp_url: &str, pool: &PgPool, admin: &Channel, names: &Names) -> Result<Proof, BoxError> {
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

    // Fresh queues. `x-expires` removes them if this program dies before it
    // deletes them itself.
    let mut arguments = FieldTable::default();
    arguments.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    for queue in [&names.queue, &names.dead_letters] {
        admin
            .queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), arguments.clone())
            .await?;
    }

    let published = publish(admin, &names.queue).await?;

    // Three consumers; consumer 1 dies after the commit of its 5th payment.
    let tally = Arc::new(Tally::default());
    let shutdown = CancellationToken::new();
    let (mut connections, mut consumers) = (Vec::new(), Vec::new());
    for n in 1..=CONSUMERS {
        let connection = Arc::new(Connection::connect(amqp_url, ConnectionProperties::default()).await?);
        let crash = (n == 1).then(|| Crash {
            connection: Arc::clone(&connection),
            committed: AtomicUsize::new(0),
        });
        consumers.push(spawn_consumer(&connection, names, &service, &tally, crash, &shutdown).await?);
        connections.push(connection);
        if n == 1 {
            wait_for_first_delivery(&consumers[0].0).await;
        }
    }

    // Done when every copy published has been acknowledged (by consumer 1
    // before it died, or by the survivors, redeliveries included). An ack
    // racing the kill may reach the broker without being counted, so also
    // done when consumer 1 is gone, every payment is in, the queue is empty
    // and the survivors have been idle for a while.
    let mut quiet_polls = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let acked: u64 = consumers.iter().map(|(stats, _)| stats.snapshot().acked).sum();
        if acked >= published as u64 {
            break;
        }
        let survivors_idle = consumers.iter().skip(1).all(|(stats, _)| idle(&stats.snapshot()));
        if consumers[0].1.is_finished()
            && survivors_idle
            && tally.charged.load(Ordering::Relaxed) == PAYMENTS
            && ready(admin, &names.queue).await? == 0
        {
            quiet_polls += 1;
            if quiet_polls == 5 {
                break;
            }
        } else {
            quiet_polls = 0;
        }
        if consumers.iter().skip(1).any(|(_, run)| run.is_finished()) {
            break; // a survivor stopped early: its error is reported below
        }
    }
    shutdown.cancel();
    let killed_stats = consumers[0].0.clone();
    let mut killed = 0;
    for (n, (_, run)) in consumers.into_iter().enumerate() {
        match run.await? {
            // Consumer 1 reports the connection it lost under an unacked delivery.
            Err(_) if n == 0 && tally.kills.load(Ordering::Relaxed) > 0 => killed += 1,
            result => {
                result?;
            }
        }
    }
    let acks_lost = killed_stats.snapshot().ack_failures;
    for connection in connections {
        if connection.status().connected() {
            connection.close(200, "demo done".into()).await?;
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
    // Every channel is closed now: anything unacknowledged is back in the queue.
    let left_over = ready(admin, &names.queue).await? + ready(admin, &names.dead_letters).await?;

    Ok(Proof {
        published,
        deliveries: tally.deliveries.load(Ordering::Relaxed),
        redeliveries: tally.redeliveries.load(Ordering::Relaxed),
        killed,
        acks_lost,
        charged: tally.charged.load(Ordering::Relaxed),
        duplicates: tally.duplicates.load(Ordering::Relaxed),
        redelivered_duplicates: tally.redelivered_duplicates.load(Ordering::Relaxed),
        payments,
        charged_twice,
        left_over,
    })
}

/// A consumer with no delivery in flight: everything it took is settled.
fn idle(stats: &RunStats) -> bool {
    stats.received
        == stats.acked + stats.retried + stats.dead_lettered + stats.poison + stats.released + stats.ack_failures
}

/// Messages ready in `queue` (not counting those delivered and unacked).
async fn ready(admin: &Channel, queue: &str) -> Result<u32, BoxError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    Ok(admin
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?
        .message_count())
}

/// Consumer 1 starts first and gets its share before the others compete, so
/// that it has payments to commit before it dies however the machine is loaded.
async fn wait_for_first_delivery(stats: &ConsumerStats) {
    while stats.snapshot().received == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes the payments, one in four twice, in random order, and waits for
/// the broker's confirms. Returns how many messages were published.
async fn publish(admin: &Channel, queue: &str) -> Result<usize, BoxError> {
    admin.confirm_select(ConfirmSelectOptions::default()).await?;
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
    let mut confirms = Vec::with_capacity(messages.len());
    for msg in &messages {
        let properties = BasicProperties::default()
            .with_message_id(msg.message_id.as_str().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        let body = serde_json::to_vec(msg)?;
        let confirm = admin
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body,
                properties,
            )
            .await?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        if !confirm.await?.is_ack() {
            return Err("RabbitMQ refused a published payment".into());
        }
    }
    Ok(messages.len())
}

/// How consumer 1 dies: after committing its `KILL_AFTER`th payment, its
/// connection is closed before the adapter can ack.
struct Crash {
    connection: Arc<Connection>,
    committed: AtomicUsize,
}

type Running = (ConsumerStats, JoinHandle<Result<RunStats, ConsumerError>>);

async fn spawn_consumer(
    connection: &Connection,
    names: &Names,
    service: &Arc<PaymentService>,
    tally: &Arc<Tally>,
    crash: Option<Crash>,
    shutdown: &CancellationToken,
) -> Result<Running, BoxError> {
    let consumer = RabbitConsumer::builder(connection.create_channel().await?, &names.queue)
        .prefetch(8)
        .concurrency(4)
        .max_attempts(3)
        .dead_letter_queue(&names.dead_letters)
        .declare_dead_letter_queue(false) // declared above, with `x-expires`
        .build()?;
    let stats = consumer.stats();
    let (service, tally, crash) = (Arc::clone(service), Arc::clone(tally), crash.map(Arc::new));
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: PaymentMessage, info: DeliveryInfo| {
            let (service, tally, crash) = (Arc::clone(&service), Arc::clone(&tally), crash.clone());
            async move {
                let charged = handle(&service, &tally, &msg, &info).await?;
                if let Some(crash) = crash
                    && charged
                    && crash.committed.fetch_add(1, Ordering::Relaxed) + 1 == KILL_AFTER
                {
                    // The payment is committed; the process "dies" before
                    // the ack: its connection goes, RabbitMQ redelivers.
                    tally.kills.fetch_add(1, Ordering::Relaxed);
                    let _ = crash.connection.close(320, "simulated crash".into()).await;
                }
                Ok::<_, AppError>(())
            }
        },
        shutdown.clone(),
    ));
    Ok((stats, run))
}

/// Deletes this run's queues and tables, whatever happened before.
async fn cleanup(pool: &PgPool, admin: &Channel, names: &Names) -> Result<(), BoxError> {
    for queue in [&names.queue, &names.dead_letters] {
        admin
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    for table in [&names.payments, &names.markers] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(pool)
            .await?;
    }
    Ok(())
}
