//! What the broker examples share: the article's payment service, the demo
//! run and its proof. Each example (`rabbitmq_payments`, `nats_payments`, `kafka_payments`,
//! `redis_streams_payments`) supplies only its broker's part ([`Demo`]): the
//! topology, how to publish, a consumer's builder, what is still unsettled.
//!
//! The run: fresh tables, 200 payment messages published (one in four
//! twice, as a producer retry does), three competing consumers whose
//! handler is an `#[idempotent]` method (the payment insert and the
//! "processed" marker commit in one transaction; the adapter acks only
//! after that commit). Consumer 1 "dies" right after the commit of its 5th
//! payment, before its ack: its task is aborted and its connection dropped,
//! the broker gives what it held to the two others, and the marker turns
//! the redelivery of the committed payment into a skipped duplicate.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idempotent_runtime::broker::pipeline::Broker;
use idempotent_runtime::broker::{
    CancellationToken, ConsumerBuilder, ConsumerError, ConsumerStats, DeliveryInfo, RunStats, Verdict,
};
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use tokio::task::{AbortHandle, JoinHandle};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Distinct payments; one in four is published twice.
pub const PAYMENTS: usize = 200;
/// Competing consumers (service instances), each on its own connection.
const CONSUMERS: usize = 3;
/// Consumer 1 dies after committing this many payments of its own.
const KILL_AFTER: usize = 5;
/// Longest the whole run may take before it is called a failure (unless
/// the broker's part says otherwise, [`Demo::DEADLINE`]).
const DEFAULT_DEADLINE: Duration = Duration::from_secs(25);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PaymentMessage {
    pub message_id: String,
    pub order_id: String,
    pub amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl AppError {
    /// What a failed payment means for its message: the library's errors
    /// classify themselves (a store that is down is an outage, a missing or
    /// reused key is rejected); a database error is an outage only when the
    /// database is unreachable, not when the payment's data was refused (a
    /// constraint violation, a NUL byte in a text), which would otherwise be
    /// retried in place for ever.
    pub fn verdict(&self) -> Verdict {
        match self {
            AppError::Idempotency(e) => e.verdict(),
            AppError::Database(e) => Verdict::of_sqlx(e),
        }
    }
}

/// The broker's part of a demo.
pub trait Demo: Send + Sync + 'static {
    type B: Broker;
    /// The broker's name, for the report.
    const TITLE: &'static str;
    /// Whether a payment consumer 1 committed before it died is delivered
    /// again (and skipped by its marker): `false` when the consumer stores
    /// its position with the payment (Kafka's offsets in the database),
    /// so the next owner starts after it.
    const REDELIVERS_COMMITTED: bool = true;
    /// Longest the whole run may take (Kafka's group joins and rebalances
    /// take seconds each).
    const DEADLINE: Duration = DEFAULT_DEADLINE;
    /// Whether consumer 1 dies only once the two others received a message:
    /// for the members of a consumer group, whose joins are a rebalance
    /// that a member leaving in the middle of it leaves hanging on the test
    /// broker (Tansu; see docs/brokers.md, "Under faults, against Tansu").
    /// Once both others received, their joins are complete. The three
    /// consumers then start together (each gets partitions with payments in
    /// them), and consumer 1 waits before the handler of what may be its
    /// last payment, before its transaction writes anything: a wait inside
    /// it would hold the payment's marker row locked, and a redelivery of
    /// that payment to another member would wait on the lock while a member
    /// whose partitions were drained never receives, so nothing would arm
    /// the kill (3 runs in 6 stalled so).
    const KILL_ONCE_OTHERS_CONSUME: bool = false;
    /// Where the payments go, for the report.
    fn describe(&self) -> String;
    /// Creates what the run consumes from (and its dead letters).
    fn setup(&self) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Publishes `(message_id, body)` pairs, waiting for the broker's
    /// acknowledgements.
    fn publish(&self, messages: Vec<(String, Vec<u8>)>) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// A consumer's builder (the example's settings).
    fn consumer(&self) -> ConsumerBuilder<Self::B>;
    /// Messages not acknowledged yet, plus dead letters.
    fn unsettled(&self) -> impl Future<Output = Result<u64, BoxError>> + Send;
    /// Deletes what `setup` created.
    fn cleanup(&self) -> impl Future<Output = Result<(), BoxError>> + Send;
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
    #[idempotent(key = "msg.message_id", store = self.store, scope = "payments.charge")]
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

/// Fresh table names for this run.
pub struct Tables {
    pub markers: String,
    pub payments: String,
}

/// An identifier of this run, for the names of what it creates.
pub fn run_id() -> String {
    format!("{:08x}", rand::random::<u32>())
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
    fn holds(&self, redelivers_committed: bool) -> bool {
        self.payments == PAYMENTS as i64
            && self.charged_twice == 0
            && self.killed >= 1
            && (self.redelivered_duplicates >= 1 || !redelivers_committed)
            && self.left_over == 0
    }

    /// Handler calls that never returned: those in flight in the killed
    /// consumer when it died. Each was rolled back or had just committed;
    /// either way its message was not acked and comes back.
    fn cut_short(&self) -> usize {
        self.deliveries.saturating_sub(self.charged + self.duplicates)
    }

    fn print<D: Demo>(&self, demo: &D, tables: &Tables) {
        let row = |label: &str, value: String| println!("  {label:<40} {value:>5}");
        println!(
            "idempotent on {}: the article's payment consumer, {CONSUMERS} competing consumers",
            D::TITLE
        );
        println!(
            "  {}, payments in PostgreSQL table `{}`",
            demo.describe(),
            tables.payments
        );
        println!();
        row("payment messages", PAYMENTS.to_string());
        row("messages published (with duplicates)", self.published.to_string());
        row("deliveries seen by the handlers", self.deliveries.to_string());
        row("consumers killed before ack", self.killed.to_string());
        row("  handler calls cut short with it", self.cut_short().to_string());
        row("redeliveries (flagged by the broker)", self.redeliveries.to_string());
        row("processed (body ran and committed)", self.charged.to_string());
        row("duplicates skipped", self.duplicates.to_string());
        row(
            "  of them redeliveries after the kill",
            self.redelivered_duplicates.to_string(),
        );
        row("payments in the table", self.payments.to_string());
        row("orders charged twice", self.charged_twice.to_string());
        row("messages left unsettled or dead-lettered", self.left_over.to_string());
        println!();
    }
}

/// Runs the demo on `demo`'s broker and prints the proof; fails when the
/// proof does not hold.
pub async fn run<D: Demo>(demo: D, tables: Tables) -> Result<(), BoxError> {
    let pg_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&pg_url)
        .await?;
    let outcome = tokio::time::timeout(D::DEADLINE, demo_run(&demo, &pool, &tables)).await;
    let cleaned = demo.cleanup().await;
    for table in [&tables.payments, &tables.markers] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(&pool)
            .await?;
    }
    pool.close().await;

    let Ok(proof) = outcome else {
        // Said here too: the consumers still running when the process
        // exits may bring it down before `main`'s error is printed.
        let why = format!("the demo did not finish within {:?}", D::DEADLINE);
        eprintln!("{why}");
        return Err(why.into());
    };
    let proof = proof?;
    cleaned?;
    proof.print(&demo, &tables);
    if proof.holds(D::REDELIVERS_COMMITTED) {
        println!("each payment was applied exactly once.");
        Ok(())
    } else {
        Err("the proof failed: a payment was lost or applied twice, or the crash was not exercised".into())
    }
}

async fn demo_run<D: Demo>(demo: &D, pool: &PgPool, tables: &Tables) -> Result<Proof, BoxError> {
    // Fresh tables: the marker table (the store's DDL) and the payments.
    let store = PgStore::builder(pool.clone()).table(&tables.markers).build()?;
    store.migrate().await?;
    let ddl = format!(
        "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
        tables.payments
    );
    sqlx::query(AssertSqlSafe(ddl)).execute(pool).await?;
    let service = Arc::new(PaymentService {
        store,
        insert_payment: format!(
            "INSERT INTO {} (order_id, amount_cents) VALUES ($1, $2)",
            tables.payments
        ),
    });

    demo.setup().await?;
    let messages = payment_messages()?;
    let published = messages.len();
    demo.publish(messages).await?;

    // Three consumers; consumer 1 dies after the commit of its 5th payment.
    let tally = Arc::new(Tally::default());
    let shutdown = CancellationToken::new();
    let mut consumers = Vec::new();
    let dying = Arc::new(Crash::default());
    if !D::KILL_ONCE_OTHERS_CONSUME {
        dying.armed.store(true, Ordering::Relaxed);
    }
    for n in 1..=CONSUMERS {
        let crash = (n == 1).then(|| Arc::clone(&dying));
        consumers.push(spawn_consumer(demo, &service, &tally, crash, &shutdown)?);
        if n == 1 && !D::KILL_ONCE_OTHERS_CONSUME {
            wait_for_first_delivery(&consumers[0].0).await;
        }
    }

    // Done when the broker has every message delivered and acknowledged (by
    // consumer 1 before it died, or by the survivors, redeliveries
    // included), and the survivors are idle.
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if consumers.iter().skip(1).any(|(_, run)| run.is_finished()) {
            break; // a survivor stopped early: its error is reported below
        }
        if consumers.iter().skip(1).all(|(stats, _)| stats.snapshot().received > 0) {
            dying.armed.store(true, Ordering::Relaxed);
        }
        let idle = consumers.iter().skip(1).all(|(stats, _)| stats.in_flight() == 0);
        if tally.kills.load(Ordering::Relaxed) > 0 && idle && demo.unsettled().await? == 0 {
            break;
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

    let payments: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {}", tables.payments)))
        .fetch_one(pool)
        .await?;
    let charged_twice: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT order_id FROM {} GROUP BY order_id HAVING count(*) > 1) twice",
        tables.payments
    )))
    .fetch_one(pool)
    .await?;

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
        left_over: demo.unsettled().await?,
    })
}

/// The payments, one in four twice, in random order: `(message_id, body)`.
fn payment_messages() -> Result<Vec<(String, Vec<u8>)>, BoxError> {
    let mut messages = Vec::new();
    for i in 0..PAYMENTS {
        let msg = PaymentMessage {
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
    Ok(messages)
}

/// Consumer 1 starts first and gets its share before the others compete, so
/// that it has payments to commit before it dies however the machine is loaded
/// (unless it waits for the others to consume before it dies: then the
/// three start together).
async fn wait_for_first_delivery(stats: &ConsumerStats) {
    while stats.snapshot().received == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How consumer 1 dies: after committing its `KILL_AFTER`th payment (once
/// armed: [`Demo::KILL_ONCE_OTHERS_CONSUME`]), its whole task (the adapter,
/// its handlers, its connection) is aborted before the adapter can ack.
#[derive(Default)]
struct Crash {
    committed: AtomicUsize,
    /// It may die (from the start, unless the demo waits for the others).
    armed: AtomicBool,
    run: OnceLock<AbortHandle>,
}

type Running = (ConsumerStats, JoinHandle<Result<RunStats, ConsumerError>>);

fn spawn_consumer<D: Demo>(
    demo: &D,
    service: &Arc<PaymentService>,
    tally: &Arc<Tally>,
    crash: Option<Arc<Crash>>,
    shutdown: &CancellationToken,
) -> Result<Running, BoxError> {
    let consumer = demo
        .consumer()
        .concurrency(4)
        .max_attempts(3)
        .classify(AppError::verdict)
        .build()?;
    let stats = consumer.stats();
    let (service, tally, dying) = (Arc::clone(service), Arc::clone(tally), crash.clone());
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: PaymentMessage, info: DeliveryInfo| {
            let (service, tally, crash) = (Arc::clone(&service), Arc::clone(&tally), dying.clone());
            async move {
                // What may be consumer 1's last payment waits until it may
                // die, before its transaction writes (and locks) anything.
                if let Some(crash) = &crash
                    && crash.committed.load(Ordering::Relaxed) + 1 >= KILL_AFTER
                {
                    while !crash.armed.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                let charged = handle(&service, &tally, &msg, &info).await?;
                if let Some(crash) = crash
                    && charged
                    && crash.committed.fetch_add(1, Ordering::Relaxed) + 1 == KILL_AFTER
                {
                    // The payment is committed; the process "dies" before
                    // the ack: the broker gives its messages to the others.
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
