//! Two services chained through RabbitMQ by the transactional outbox, in one
//! program, and the proof that each payment is charged once and notified
//! once although the chain breaks at its weak points.
//!
//! - The **payments** service consumes payments (two competing consumers).
//!   Its `#[idempotent]` handler inserts the payment and stages a
//!   `payment.charged` event on its outbox: payment, marker and event commit
//!   in one PostgreSQL transaction.
//! - **Relays** publish the committed events to an exchange, and mark them
//!   dispatched once RabbitMQ confirmed them.
//! - The **notifications** service consumes `payment.charged` (two
//!   consumers), idempotent on the event's message id, with markers of its
//!   own, and inserts a notification.
//!
//! Where it breaks: payments consumer 1 dies right after committing its 5th
//! payment, before its ack (its task is aborted and its connection dropped):
//! RabbitMQ gives the payment to the other consumer, which skips it as a
//! duplicate. No relay runs until 50 payments are committed: their events
//! wait in the outbox. Relay 1 loses the outcome of its first 10 publishes
//! after RabbitMQ confirmed them, as when a relay dies between the broker's
//! confirmation and its mark: those rows stay pending and are published
//! again with the same message id, and the notifications service skips the
//! second copies. (`tests/outbox_chain.rs` does the same with real
//! processes killed at random.)
//!
//! Needs the services of `.ci/run` (RabbitMQ :5672, PostgreSQL :5432):
//! `cargo run --example outbox_chain` (`AMQP_URL` and `DATABASE_URL`
//! override the defaults). It deletes what it created and exits non-zero if
//! the proof fails.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idempotent_runtime::broker::{CancellationToken, ConsumerError, ConsumerStats, DeliveryInfo, RunStats, Verdict};
use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use idempotent_runtime::outbox::{
    Outbox, OutboxRow, Outgoing, PublishError, Publisher, RabbitPublisher, Relay, RelayHandle,
};
use idempotent_runtime::rabbitmq::RabbitConsumer;
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use tokio::task::{AbortHandle, JoinHandle};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Distinct payments; one in four is published twice.
const PAYMENTS: usize = 200;
/// Payments consumer 1 dies after committing this many payments.
const KILL_AFTER: usize = 5;
/// The relays start once this many payments are committed.
const RELAYS_START_AFTER: i64 = 50;
/// Relay 1 loses the outcome of this many confirmed publishes.
const LOST_CONFIRMS: usize = 10;
/// Longest the whole run may take before it is called a failure.
const DEADLINE: Duration = Duration::from_secs(25);

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    message_id: String,
    order_id: String,
    amount_cents: i64,
}

/// What the payments service announces.
#[derive(Debug, Serialize, Deserialize)]
struct PaymentCharged {
    payment_id: String,
    order_id: String,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("a payment.charged message without a message id")]
    NoMessageId,
}

impl AppError {
    /// What a failure means for its message: an outage only when the
    /// database (or the marker store) is unreachable, never for what the
    /// message's own data did.
    fn verdict(&self) -> Verdict {
        match self {
            AppError::Idempotency(e) => e.verdict(),
            AppError::Database(e) => Verdict::of_sqlx(e),
            AppError::NoMessageId => Verdict::Reject,
        }
    }
}

struct PaymentService {
    store: PgStore,
    insert: String,
}

impl PaymentService {
    /// The payment, its marker and its event commit together. `charged`
    /// tells the caller whether the body ran (for the proof only).
    #[idempotent(key = "msg.message_id", store = self.store, scope = "payments.charge")]
    async fn charge(
        &self,
        msg: &Payment,
        charged: &AtomicBool,
        tx: &mut PgConnection,
        outbox: &mut Outbox,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.order_id)
            .bind(msg.amount_cents)
            .execute(&mut *tx)
            .await?;
        let event = PaymentCharged {
            payment_id: msg.message_id.clone(),
            order_id: msg.order_id.clone(),
            amount_cents: msg.amount_cents,
        };
        outbox.publish(Outgoing::json("payment.charged", &event)?.ordered_by(&msg.order_id));
        charged.store(true, Ordering::Relaxed);
        Ok(())
    }
}

struct NotificationService {
    store: PgStore,
    insert: String,
}

impl NotificationService {
    /// Keyed on the event's message id, which the outbox derived from the
    /// payment: a republished event carries the same one.
    #[idempotent(key = "message_id", store = self.store, scope = "notifications.payment_charged")]
    async fn notify(
        &self,
        message_id: &str,
        event: &PaymentCharged,
        sent: &AtomicBool,
        tx: &mut PgConnection,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&event.payment_id)
            .bind(&event.order_id)
            .execute(&mut *tx)
            .await?;
        sent.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// Relay 1's publisher: its first `LOST_CONFIRMS` publishes reach RabbitMQ
/// and are confirmed, but the relay never learns it, as when it dies
/// between the confirmation and the mark. The rows stay pending.
struct ForgetfulPublisher {
    inner: RabbitPublisher,
    forgotten: AtomicUsize,
}

impl Publisher for ForgetfulPublisher {
    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        self.inner.publish(row).await?;
        if self.forgotten.fetch_add(1, Ordering::Relaxed) < LOST_CONFIRMS {
            return Err(PublishError(
                "confirmed by RabbitMQ, but the relay died before its mark".into(),
            ));
        }
        Ok(())
    }
}

/// What the handlers saw.
#[derive(Default)]
struct Tally {
    payment_duplicates: AtomicUsize,
    consumers_killed: AtomicUsize,
    charged_deliveries: AtomicUsize,
    notification_duplicates: AtomicUsize,
    republished_duplicates: AtomicUsize,
}

/// The names of what one run creates.
struct Names {
    payments_queue: String,
    charged_queue: String,
    exchange: String,
    tables: [String; 6],
}

impl Names {
    fn new() -> Names {
        let id = format!("{:08x}", rand::random::<u32>());
        Names {
            payments_queue: format!("outbox_chain.{id}.payments"),
            charged_queue: format!("outbox_chain.{id}.payment_charged"),
            exchange: format!("outbox_chain.{id}.events"),
            tables: [
                "pay_markers",
                "pay_outbox",
                "payments",
                "notif_markers",
                "notif_outbox",
                "notifications",
            ]
            .map(|t| format!("outbox_chain_{id}_{t}")),
        }
    }
    fn queues(&self) -> [String; 4] {
        [
            self.payments_queue.clone(),
            format!("{}.dlq", self.payments_queue),
            self.charged_queue.clone(),
            format!("{}.dlq", self.charged_queue),
        ]
    }
}

struct Proof {
    published: usize,
    consumers_killed: usize,
    payment_duplicates: usize,
    payments: i64,
    charged_twice: i64,
    waiting_for_a_relay: i64,
    events: i64,
    forgotten: usize,
    charged_deliveries: usize,
    notification_duplicates: usize,
    republished_duplicates: usize,
    notifications: i64,
    notified_twice: i64,
    never_notified: i64,
    left_over: u64,
}

impl Proof {
    fn holds(&self) -> bool {
        self.payments == PAYMENTS as i64
            && self.charged_twice == 0
            && self.events == PAYMENTS as i64
            && self.notifications == PAYMENTS as i64
            && self.notified_twice == 0
            && self.never_notified == 0
            && self.left_over == 0
            && self.consumers_killed >= 1
            && self.republished_duplicates >= 1
    }

    fn print(&self, names: &Names) {
        let row = |label: &str, value: String| println!("  {label:<52} {value:>5}");
        println!(
            "idempotent outbox chain on RabbitMQ and PostgreSQL: payments -> outbox -> payment.charged -> notifications"
        );
        println!(
            "  exchange `{}`, queues `{}`, `{}`",
            names.exchange, names.payments_queue, names.charged_queue
        );
        println!();
        row("payment messages", PAYMENTS.to_string());
        row("messages published (with duplicates)", self.published.to_string());
        row(
            "payments consumers killed after commit, before ack",
            self.consumers_killed.to_string(),
        );
        row("payment duplicates skipped", self.payment_duplicates.to_string());
        row("payments in the table", self.payments.to_string());
        row("payments charged twice", self.charged_twice.to_string());
        row(
            "events committed before any relay ran",
            self.waiting_for_a_relay.to_string(),
        );
        row("events in the outbox (one per payment)", self.events.to_string());
        row(
            "publishes confirmed but not marked (relay died)",
            self.forgotten.to_string(),
        );
        row("payment.charged deliveries", self.charged_deliveries.to_string());
        row(
            "notification duplicates skipped",
            self.notification_duplicates.to_string(),
        );
        row(
            "  of them events published again",
            self.republished_duplicates.to_string(),
        );
        row("notifications in the table", self.notifications.to_string());
        row("payments notified twice", self.notified_twice.to_string());
        row("payments never notified (lost)", self.never_notified.to_string());
        row(
            "events pending, messages unsettled or dead-lettered",
            self.left_over.to_string(),
        );
        println!();
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let amqp_url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let pg_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&pg_url)
        .await?;
    let connection = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let admin = connection.create_channel().await?;
    admin.confirm_select(ConfirmSelectOptions::default()).await?;
    let names = Names::new();

    let outcome = tokio::time::timeout(DEADLINE, chain(&amqp_url, &admin, &pool, &names)).await;
    for queue in names.queues() {
        admin
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    admin
        .exchange_delete(names.exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await?;
    for table in &names.tables {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(&pool)
            .await?;
    }
    pool.close().await;

    let proof = outcome.map_err(|_| format!("the chain did not settle within {DEADLINE:?}"))??;
    proof.print(&names);
    if proof.holds() {
        println!("each payment was charged once and notified once.");
        Ok(())
    } else {
        Err("the proof failed: a payment or a notification was lost or doubled, or a fault was not exercised".into())
    }
}

async fn setup(admin: &Channel, pool: &PgPool, names: &Names) -> Result<(PgStore, PgStore), BoxError> {
    let [
        pay_markers,
        pay_outbox,
        payments,
        notif_markers,
        notif_outbox,
        notifications,
    ] = &names.tables;
    let payments_store = PgStore::builder(pool.clone())
        .table(pay_markers)
        .outbox_table(pay_outbox)
        .build()?;
    payments_store.migrate().await?;
    let notifications_store = PgStore::builder(pool.clone())
        .table(notif_markers)
        .outbox_table(notif_outbox)
        .build()?;
    notifications_store.migrate().await?;
    for ddl in [
        format!(
            "CREATE TABLE {payments} (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL)"
        ),
        format!(
            "CREATE TABLE {notifications} (id BIGSERIAL PRIMARY KEY, payment_id TEXT NOT NULL, order_id TEXT NOT NULL)"
        ),
    ] {
        sqlx::query(AssertSqlSafe(ddl)).execute(pool).await?;
    }
    // Fresh queues; `x-expires` removes them if this program dies first.
    let mut arguments = FieldTable::default();
    arguments.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    for queue in names.queues() {
        admin
            .queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), arguments.clone())
            .await?;
    }
    let options = ExchangeDeclareOptions {
        durable: true,
        auto_delete: true,
        ..ExchangeDeclareOptions::default()
    };
    admin
        .exchange_declare(
            names.exchange.as_str().into(),
            ExchangeKind::Direct,
            options,
            FieldTable::default(),
        )
        .await?;
    admin
        .queue_bind(
            names.charged_queue.as_str().into(),
            names.exchange.as_str().into(),
            "payment.charged".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((payments_store, notifications_store))
}

/// The payments, one in four twice, in random order.
async fn publish_payments(admin: &Channel, queue: &str) -> Result<usize, BoxError> {
    let mut messages = Vec::new();
    for i in 0..PAYMENTS {
        let msg = Payment {
            message_id: format!("msg-{i:03}"),
            order_id: format!("order-{i:03}"),
            amount_cents: 1_000 + i as i64,
        };
        let body = serde_json::to_vec(&msg)?;
        if i % 4 == 0 {
            messages.push((msg.message_id.clone(), body.clone()));
        }
        messages.push((msg.message_id, body));
    }
    messages.shuffle(&mut rand::rng());
    let mut confirms = Vec::with_capacity(messages.len());
    for (id, body) in &messages {
        let properties = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        confirms.push(
            admin
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await?,
        );
    }
    for confirm in confirms {
        if !confirm.await?.is_ack() {
            return Err("RabbitMQ refused a published payment".into());
        }
    }
    Ok(messages.len())
}

type Running = (ConsumerStats, JoinHandle<Result<RunStats, ConsumerError>>);

/// A payments consumer; with `dies`, it dies after its `KILL_AFTER`th
/// commit, before the ack: its whole task (the adapter, its handlers, its
/// connection) is aborted.
fn payments_consumer(
    amqp_url: &str,
    names: &Names,
    service: &Arc<PaymentService>,
    tally: &Arc<Tally>,
    dies: bool,
    shutdown: &CancellationToken,
) -> Result<Running, BoxError> {
    let consumer = RabbitConsumer::builder(amqp_url, &names.payments_queue)
        .prefetch(8)
        .concurrency(4)
        // Declared by `setup` (with `x-expires`): only checked.
        .declare_queue(false)
        .declare_dead_letter_queue(false)
        .classify(AppError::verdict)
        .build()?;
    let stats = consumer.stats();
    let task: Arc<OnceLock<AbortHandle>> = Arc::new(OnceLock::new());
    let committed = Arc::new(AtomicUsize::new(0));
    let (service, tally, own_task) = (Arc::clone(service), Arc::clone(tally), Arc::clone(&task));
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: Payment, _info: DeliveryInfo| {
            let (service, tally, own_task, committed) = (
                Arc::clone(&service),
                Arc::clone(&tally),
                Arc::clone(&own_task),
                Arc::clone(&committed),
            );
            async move {
                let charged = AtomicBool::new(false);
                service.charge(&msg, &charged).await?;
                if !charged.into_inner() {
                    tally.payment_duplicates.fetch_add(1, Ordering::Relaxed);
                } else if dies && committed.fetch_add(1, Ordering::Relaxed) + 1 == KILL_AFTER {
                    // Committed: payment, marker and event. Never acked.
                    tally.consumers_killed.fetch_add(1, Ordering::Relaxed);
                    while own_task.get().is_none() {
                        tokio::task::yield_now().await;
                    }
                    if let Some(task) = own_task.get() {
                        task.abort();
                    }
                    std::future::pending::<()>().await;
                }
                Ok::<_, AppError>(())
            }
        },
        shutdown.clone(),
    ));
    let _ = task.set(run.abort_handle());
    Ok((stats, run))
}

fn notifications_consumer(
    amqp_url: &str,
    names: &Names,
    service: &Arc<NotificationService>,
    tally: &Arc<Tally>,
    shutdown: &CancellationToken,
) -> Result<Running, BoxError> {
    let consumer = RabbitConsumer::builder(amqp_url, &names.charged_queue)
        .prefetch(8)
        .concurrency(4)
        // Declared by `setup` (with `x-expires`): only checked.
        .declare_queue(false)
        .declare_dead_letter_queue(false)
        .classify(AppError::verdict)
        .build()?;
    let stats = consumer.stats();
    let (service, tally) = (Arc::clone(service), Arc::clone(tally));
    let run = tokio::spawn(consumer.run_with_info(
        move |event: PaymentCharged, info: DeliveryInfo| {
            let (service, tally) = (Arc::clone(&service), Arc::clone(&tally));
            async move {
                tally.charged_deliveries.fetch_add(1, Ordering::Relaxed);
                let message_id = info.message_id.as_deref().ok_or(AppError::NoMessageId)?;
                let sent = AtomicBool::new(false);
                service.notify(message_id, &event, &sent).await?;
                if !sent.into_inner() {
                    tally.notification_duplicates.fetch_add(1, Ordering::Relaxed);
                    if !info.redelivered {
                        // Not a redelivery: a second publish of the event.
                        tally.republished_duplicates.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok::<_, AppError>(())
            }
        },
        shutdown.clone(),
    ));
    Ok((stats, run))
}

async fn count(pool: &PgPool, sql: String) -> Result<i64, BoxError> {
    Ok(sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await?)
}

/// Messages ready in the run's queues (unacked ones are with a live
/// consumer; those of the killed one are back in the queue at once).
async fn unsettled(admin: &Channel, names: &Names) -> Result<u64, BoxError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let mut ready = 0;
    for queue in names.queues() {
        ready += u64::from(
            admin
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await?
                .message_count(),
        );
    }
    Ok(ready)
}

async fn chain(amqp_url: &str, admin: &Channel, pool: &PgPool, names: &Names) -> Result<Proof, BoxError> {
    let (payments_store, notifications_store) = setup(admin, pool, names).await?;
    let [_, pay_outbox, payments, _, _, notifications] = &names.tables;
    let published = publish_payments(admin, &names.payments_queue).await?;

    let tally = Arc::new(Tally::default());
    let shutdown = CancellationToken::new();
    let payment_service = Arc::new(PaymentService {
        store: payments_store.clone(),
        insert: format!("INSERT INTO {payments} (order_id, amount_cents) VALUES ($1, $2)"),
    });
    let notification_service = Arc::new(NotificationService {
        store: notifications_store,
        insert: format!("INSERT INTO {notifications} (payment_id, order_id) VALUES ($1, $2)"),
    });
    // Payments consumer 1 starts first and gets its share before the other
    // competes, so that it has payments to commit before it dies.
    let mut consumers = vec![payments_consumer(
        amqp_url,
        names,
        &payment_service,
        &tally,
        true,
        &shutdown,
    )?];
    while consumers[0].0.snapshot().received == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    consumers.push(payments_consumer(
        amqp_url,
        names,
        &payment_service,
        &tally,
        false,
        &shutdown,
    )?);
    for _ in 0..2 {
        consumers.push(notifications_consumer(
            amqp_url,
            names,
            &notification_service,
            &tally,
            &shutdown,
        )?);
    }

    // No relay yet: the first payments' events wait in the outbox.
    let pending = format!("SELECT count(*) FROM {pay_outbox} WHERE dispatched_at IS NULL");
    while count(pool, format!("SELECT count(*) FROM {payments}")).await? < RELAYS_START_AFTER {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waiting_for_a_relay = count(pool, pending.clone()).await?;
    let forgetful = Arc::new(ForgetfulPublisher {
        inner: RabbitPublisher::new(amqp_url).exchange(&names.exchange),
        forgotten: AtomicUsize::new(0),
    });
    let mut relays: Vec<RelayHandle> = vec![
        Relay::builder(payments_store.clone(), Arc::clone(&forgetful))
            .poll_interval(Duration::from_millis(100))
            .retry_backoff(Duration::from_millis(100), Duration::from_secs(1))
            .spawn(),
    ];
    // Relay 2 starts once relay 1 has lost its confirms: started together,
    // relay 2 could take the waiting events first (each relay skips the
    // rows the other holds) and leave relay 1 fewer than LOST_CONFIRMS.
    while forgetful.forgotten.load(Ordering::Relaxed) < LOST_CONFIRMS {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relays.push(
        Relay::builder(
            payments_store.clone(),
            RabbitPublisher::new(amqp_url).exchange(&names.exchange),
        )
        .poll_interval(Duration::from_millis(100))
        .spawn(),
    );

    // Settled: every payment charged and notified, the outbox drained, the
    // queues empty and the surviving consumers idle.
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if consumers.iter().skip(1).any(|(_, run)| run.is_finished()) {
            break; // a consumer stopped early: its error is reported below
        }
        let idle = consumers.iter().skip(1).all(|(stats, _)| stats.in_flight() == 0);
        let notified = count(pool, format!("SELECT count(DISTINCT payment_id) FROM {notifications}")).await?;
        if idle
            && notified == PAYMENTS as i64
            && count(pool, pending.clone()).await? == 0
            && unsettled(admin, names).await? == 0
        {
            break;
        }
    }
    shutdown.cancel();
    for relay in relays {
        relay.shutdown().await;
    }
    let mut consumers_killed = 0;
    for (n, (_, run)) in consumers.into_iter().enumerate() {
        match run.await {
            // Payments consumer 1's task was aborted: it "died".
            Err(err) if n == 0 && err.is_cancelled() => consumers_killed += 1,
            result => {
                result??;
            }
        }
    }

    Ok(Proof {
        published,
        consumers_killed: consumers_killed.min(tally.consumers_killed.load(Ordering::Relaxed)),
        payment_duplicates: tally.payment_duplicates.load(Ordering::Relaxed),
        payments: count(pool, format!("SELECT count(*) FROM {payments}")).await?,
        charged_twice: count(
            pool,
            format!("SELECT count(*) FROM (SELECT order_id FROM {payments} GROUP BY order_id HAVING count(*) > 1) t"),
        )
        .await?,
        waiting_for_a_relay,
        events: count(pool, format!("SELECT count(*) FROM {pay_outbox}")).await?,
        forgotten: forgetful.forgotten.load(Ordering::Relaxed).min(LOST_CONFIRMS),
        charged_deliveries: tally.charged_deliveries.load(Ordering::Relaxed),
        notification_duplicates: tally.notification_duplicates.load(Ordering::Relaxed),
        republished_duplicates: tally.republished_duplicates.load(Ordering::Relaxed),
        notifications: count(pool, format!("SELECT count(*) FROM {notifications}")).await?,
        notified_twice: count(
            pool,
            format!(
                "SELECT count(*) FROM (SELECT payment_id FROM {notifications} GROUP BY payment_id HAVING count(*) > 1) t"
            ),
        )
        .await?,
        never_notified: PAYMENTS as i64
            - count(pool, format!("SELECT count(DISTINCT payment_id) FROM {notifications}")).await?,
        left_over: unsettled(admin, names).await? + count(pool, pending).await? as u64,
    })
}
