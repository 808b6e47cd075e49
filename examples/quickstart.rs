//! The article's payment consumer on embedded SQLite: no server needed.
//!
//! A little in-process broker delivers 60 payment messages at least once:
//! some are published twice, some consumers "crash" after the commit but
//! before the ack (so the broker redelivers them), and four consumers
//! compete for the queue. `#[idempotent]` makes each payment happen once.
//!
//! Run it with `cargo run --example quickstart`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotent_runtime::sqlx::{self, SqliteConnection};
use idempotent_runtime::{SqliteStore, idempotent};
use rand::Rng;
use rand::seq::SliceRandom;
use tokio::sync::Mutex;

#[derive(Clone, Debug)]
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

struct PaymentConsumer {
    store: SqliteStore,
    charged: AtomicUsize,
}

impl PaymentConsumer {
    /// Charges an order. The insert and the "processed" marker commit in one
    /// transaction; a duplicate returns `Ok(())` without running this body.
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn process_payment(&self, msg: &PaymentMessage, tx: &mut SqliteConnection) -> Result<(), AppError> {
        sqlx::query("INSERT INTO payments (order_id, amount_cents) VALUES (?1, ?2)")
            .bind(&msg.order_id)
            .bind(msg.amount_cents)
            .execute(&mut *tx)
            .await?;
        self.charged.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// An at-least-once queue: a message leaves it only when acked.
#[derive(Default)]
struct Broker {
    ready: Mutex<VecDeque<PaymentMessage>>,
    deliveries: AtomicUsize,
    redeliveries: AtomicUsize,
}

impl Broker {
    async fn publish(&self, msg: PaymentMessage) {
        self.ready.lock().await.push_back(msg);
    }

    async fn deliver(&self) -> Option<PaymentMessage> {
        let msg = self.ready.lock().await.pop_front()?;
        self.deliveries.fetch_add(1, Ordering::Relaxed);
        Some(msg)
    }

    /// The consumer died before acking: the broker delivers it again.
    async fn nack(&self, msg: PaymentMessage) {
        self.redeliveries.fetch_add(1, Ordering::Relaxed);
        self.ready.lock().await.push_back(msg);
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("payments.db");
    let store = SqliteStore::open(&path).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE payments (id INTEGER PRIMARY KEY, order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    // 60 payments; one in three is published twice (a producer retry).
    let broker = Arc::new(Broker::default());
    let mut messages = Vec::new();
    for i in 0..60 {
        let msg = PaymentMessage {
            message_id: format!("msg-{i:03}"),
            order_id: format!("order-{i:03}"),
            amount_cents: 1_000 + i,
        };
        if i % 3 == 0 {
            messages.push(msg.clone());
        }
        messages.push(msg);
    }
    messages.shuffle(&mut rand::rng());
    for msg in messages {
        broker.publish(msg).await;
    }

    // Four competing consumers; each "crashes" after the commit but before
    // the ack on about one delivery in ten.
    let consumer = Arc::new(PaymentConsumer {
        store: store.clone(),
        charged: AtomicUsize::new(0),
    });
    let crashes = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (broker, consumer, crashes) = (Arc::clone(&broker), Arc::clone(&consumer), Arc::clone(&crashes));
            tokio::spawn(async move {
                while let Some(msg) = broker.deliver().await {
                    consumer.process_payment(&msg).await?;
                    if rand::rng().random_ratio(1, 10) {
                        crashes.fetch_add(1, Ordering::Relaxed);
                        broker.nack(msg).await; // committed, never acked
                    } // else: ack (the message leaves the queue)
                }
                Ok::<_, AppError>(())
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }

    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(store.pool())
        .await?;
    let charged_twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT order_id FROM payments GROUP BY order_id HAVING count(*) > 1)",
    )
    .fetch_one(store.pool())
    .await?;
    let deliveries = broker.deliveries.load(Ordering::Relaxed);
    let processed = consumer.charged.load(Ordering::Relaxed);

    println!(
        "idempotent quickstart: the article's payment consumer on SQLite ({})",
        path.display()
    );
    println!();
    println!("  {:<34} {:>5}", "payment messages", 60);
    println!("  {:<34} {:>5}", "deliveries (with duplicates)", deliveries);
    println!(
        "  {:<34} {:>5}",
        "crashes after commit, before ack",
        crashes.load(Ordering::Relaxed)
    );
    println!("  {:<34} {:>5}", "processed (body ran and committed)", processed);
    println!("  {:<34} {:>5}", "duplicates skipped", deliveries - processed);
    println!("  {:<34} {:>5}", "payments in the table", payments);
    println!("  {:<34} {:>5}", "orders charged twice", charged_twice);
    println!();
    if payments == 60 && charged_twice == 0 && processed == 60 {
        println!("each payment was applied exactly once.");
        Ok(())
    } else {
        Err("a payment was lost or applied twice".into())
    }
}
