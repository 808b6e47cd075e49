//! The processes of the chained outbox chaos test (`tests/outbox_chain.rs`):
//! two services chained through RabbitMQ. Not an example: the test finds it
//! through `CARGO_BIN_EXE_chain_process`.
//!
//! `chain_process <role> <prefix> <abort_after_commit> <abort_before_publish> <abort_after_confirm>`
//!
//! Roles:
//!
//! - `payments`: consumes payments from the queue `<prefix>.payments`; the
//!   `#[idempotent]` handler inserts the payment into `<prefix>_pay` and
//!   stages a `payment.charged` event on its outbox (`<prefix>_ob`), both in
//!   the transaction of its marker (`<prefix>_pm`). The process also runs a
//!   relay publishing the outbox to the exchange `<prefix>.events`.
//! - `relay`: the relay alone.
//! - `notifications`: consumes `payment.charged` from the queue
//!   `<prefix>.charged`, idempotent on the message id the relay gave it,
//!   with markers of its own (`<prefix>_nm`): inserts a notification into
//!   `<prefix>_notif`.
//!
//! Faults, in per mille (each draw is independent):
//!
//! - `abort_after_commit`: a consumer (`payments` or `notifications`) aborts
//!   right after its handler committed, before the ack. A payments process
//!   stops its own relay's publishing first, so the payment's event is
//!   committed and not published: the crash lands between the commit and
//!   the publish (another process's relay publishes it later).
//! - `abort_before_publish`: a relay aborts with a batch of rows taken and
//!   locked, before publishing one of them.
//! - `abort_after_confirm`: a relay aborts right after the broker confirmed
//!   a publish, before the row is marked dispatched: the row is published
//!   again, with the same message id.
//!
//! Every abort, and every duplicate a consumer skips, is logged in
//! `<prefix>_log` (outside the handlers' transactions, best effort) for the
//! test's figures. The broker and the database are `IDEMPOTENT_BROKER_URL`
//! and `IDEMPOTENT_PG_URL` (the machine's services by default).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent_runtime::broker::{Backoff, DeliveryInfo, Reconnect, shutdown_on_signal};
use idempotent_runtime::outbox::{
    Outbox, OutboxRow, Outgoing, PublishError, Publisher, RabbitPublisher, Relay, RelayHandle,
};
use idempotent_runtime::rabbitmq::RabbitConsumer;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::Rng;
use serde::{Deserialize, Serialize};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A payment, as the test publishes it.
#[derive(Debug, Deserialize)]
struct Payment {
    message_id: String,
    order_id: String,
    amount: i64,
}

/// The event the payments service announces through its outbox.
#[derive(Debug, Serialize, Deserialize)]
struct PaymentCharged {
    payment_id: String,
    order_id: String,
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("a `payment.charged` delivery without a message id")]
    NoMessageId,
}

/// Per-mille fault rates.
#[derive(Debug, Clone, Copy)]
struct Faults {
    after_commit: u32,
    before_publish: u32,
    after_confirm: u32,
}

/// Set by a consumer about to abort after its commit: the relay of this
/// process publishes nothing more, so the event it just committed dies
/// unpublished with it (the crash lands between the commit and the publish).
static DYING: AtomicBool = AtomicBool::new(false);

fn draw(per_mille: u32) -> bool {
    per_mille > 0 && rand::rng().random_ratio(per_mille.min(1000), 1000)
}

/// Writes events outside any handler's transaction (best effort).
#[derive(Clone)]
struct Log {
    pool: PgPool,
    insert: Arc<str>,
}

impl Log {
    async fn event(&self, message_id: &str, event: &str) {
        let _ = sqlx::query(AssertSqlSafe(&*self.insert))
            .bind(message_id)
            .bind(event)
            .execute(&self.pool)
            .await;
    }

    /// Logs `event`, then dies as a SIGKILL would: no destructor, no ack.
    async fn abort(&self, message_id: &str, event: &str) -> ! {
        self.event(message_id, event).await;
        std::process::abort();
    }
}

/// The names of one chain, derived from the test's prefix.
struct Names {
    prefix: String,
}

impl Names {
    fn table(&self, suffix: &str) -> String {
        format!("{}_{suffix}", self.prefix)
    }
    fn queue(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }
}

struct PaymentService {
    store: PgStore,
    insert: String,
}

impl PaymentService {
    /// The effect and the event commit with the marker, or not at all.
    #[idempotent(key = "msg.message_id", store = self.store, scope = "chain.payments.charge")]
    async fn charge(
        &self,
        msg: &Payment,
        ran: &AtomicBool,
        tx: &mut PgConnection,
        outbox: &mut Outbox,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.message_id)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .bind(i64::from(std::process::id()))
            .execute(&mut *tx)
            .await?;
        let event = PaymentCharged {
            payment_id: msg.message_id.clone(),
            order_id: msg.order_id.clone(),
            amount: msg.amount,
        };
        outbox.publish(Outgoing::json("payment.charged", &event)?.ordered_by(&msg.order_id));
        ran.store(true, Ordering::Relaxed);
        Ok(())
    }
}

struct NotificationService {
    store: PgStore,
    insert: String,
}

impl NotificationService {
    /// Keyed on the id the outbox gave the event: a republished row carries
    /// the same id.
    #[idempotent(key = "message_id", store = self.store, scope = "chain.notifications.send")]
    async fn notify(
        &self,
        message_id: &str,
        event: &PaymentCharged,
        ran: &AtomicBool,
        tx: &mut PgConnection,
    ) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&event.payment_id)
            .bind(message_id)
            .bind(i64::from(std::process::id()))
            .execute(&mut *tx)
            .await?;
        ran.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// The relay's publisher with the relay's two crash points around the
/// broker's confirmation.
struct CrashingPublisher {
    inner: RabbitPublisher,
    faults: Faults,
    log: Log,
}

impl Publisher for CrashingPublisher {
    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        if DYING.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if draw(self.faults.before_publish) {
            self.log.abort(&row.message_id, "relay-abort-before-publish").await;
        }
        self.inner.publish(row).await?;
        if draw(self.faults.after_confirm) {
            self.log.abort(&row.message_id, "relay-abort-after-confirm").await;
        }
        Ok(())
    }
}

fn start_relay(store: PgStore, names: &Names, faults: Faults, log: &Log) -> RelayHandle {
    let url = std::env::var("IDEMPOTENT_BROKER_URL").unwrap_or_else(|_| AMQP_URL.to_owned());
    let publisher = CrashingPublisher {
        inner: RabbitPublisher::new(url).exchange(names.queue("events")),
        faults,
        log: log.clone(),
    };
    Relay::builder(store, publisher)
        .batch_size(16)
        .poll_interval(Duration::from_millis(100))
        .retry_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .publish_timeout(Duration::from_secs(5))
        .spawn()
}

fn consumer(
    names: &Names,
    queue: &str,
) -> idempotent_runtime::broker::ConsumerBuilder<idempotent_runtime::rabbitmq::Rabbit> {
    let url = std::env::var("IDEMPOTENT_BROKER_URL").unwrap_or_else(|_| AMQP_URL.to_owned());
    RabbitConsumer::builder(url, names.queue(queue))
        .declare_queue(false)
        .prefetch(8)
        .concurrency(4)
        .max_attempts(10)
        .retry_backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(50)))
        .reconnect(Reconnect::forever(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(500),
        )))
}

async fn run(role: &str, names: Names, faults: Faults) -> Result<(), BoxError> {
    let pg_url = std::env::var("IDEMPOTENT_PG_URL").unwrap_or_else(|_| PG_URL.to_owned());
    let options: sqlx::postgres::PgConnectOptions = pg_url.parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options.application_name("chain_process"));
    let log = Log {
        pool: pool.clone(),
        insert: format!("INSERT INTO {} (message_id, event) VALUES ($1, $2)", names.table("log")).into(),
    };
    let payments_store = || {
        PgStore::builder(pool.clone())
            .table(&names.table("pm"))
            .outbox_table(&names.table("ob"))
            .build()
    };
    match role {
        "payments" => {
            let service = Arc::new(PaymentService {
                store: payments_store()?,
                insert: format!(
                    "INSERT INTO {} (message_id, order_id, amount, pid) VALUES ($1, $2, $3, $4)",
                    names.table("pay")
                ),
            });
            let relay = start_relay(payments_store()?, &names, faults, &log);
            let handler = move |msg: Payment, info: DeliveryInfo| {
                let (service, log) = (Arc::clone(&service), log.clone());
                async move {
                    let ran = AtomicBool::new(false);
                    service.charge(&msg, &ran).await?;
                    if !ran.load(Ordering::Relaxed) {
                        let event = if info.redelivered {
                            "pay-duplicate-redelivered"
                        } else {
                            "pay-duplicate"
                        };
                        log.event(&msg.message_id, event).await;
                    } else if draw(faults.after_commit) {
                        // Committed (effect, marker, event), neither acked
                        // nor published.
                        DYING.store(true, Ordering::SeqCst);
                        log.abort(&msg.message_id, "pay-abort-after-commit").await;
                    }
                    Ok::<_, AppError>(())
                }
            };
            consumer(&names, "payments")
                .build()?
                .run_with_info(handler, shutdown_on_signal())
                .await?;
            relay.shutdown().await;
        }
        "relay" => {
            let relay = start_relay(payments_store()?, &names, faults, &log);
            shutdown_on_signal().cancelled().await;
            relay.shutdown().await;
        }
        "notifications" => {
            let service = Arc::new(NotificationService {
                store: PgStore::builder(pool.clone())
                    .table(&names.table("nm"))
                    .outbox_table(&names.table("nob"))
                    .build()?,
                insert: format!(
                    "INSERT INTO {} (payment_id, message_id, pid) VALUES ($1, $2, $3)",
                    names.table("notif")
                ),
            });
            let handler = move |event: PaymentCharged, info: DeliveryInfo| {
                let (service, log) = (Arc::clone(&service), log.clone());
                async move {
                    let message_id = info.message_id.as_deref().ok_or(AppError::NoMessageId)?;
                    let ran = AtomicBool::new(false);
                    service.notify(message_id, &event, &ran).await?;
                    if !ran.load(Ordering::Relaxed) {
                        // A copy published again by a relay is a new
                        // message to the broker; a copy given back after a
                        // consumer died is flagged redelivered.
                        let event = if info.redelivered || info.attempt > 1 {
                            "notify-duplicate-redelivered"
                        } else {
                            "notify-duplicate-republished"
                        };
                        log.event(message_id, event).await;
                    } else if draw(faults.after_commit) {
                        log.abort(message_id, "notify-abort-after-commit").await;
                    }
                    Ok::<_, AppError>(())
                }
            };
            consumer(&names, "charged")
                .build()?
                .run_with_info(handler, shutdown_on_signal())
                .await?;
        }
        other => return Err(format!("unknown role `{other}`: payments, relay or notifications").into()),
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [role, prefix, after_commit, before_publish, after_confirm] = args.as_slice() else {
        return Err(
            "usage: chain_process <payments|relay|notifications> <prefix> <abort_after_commit‰> \
                    <abort_before_publish‰> <abort_after_confirm‰>"
                .into(),
        );
    };
    let faults = Faults {
        after_commit: after_commit.parse()?,
        before_publish: before_publish.parse()?,
        after_confirm: after_confirm.parse()?,
    };
    run(role, Names { prefix: prefix.clone() }, faults).await
}
