//! Publish latency of the transactional outbox (issue 11): from the moment a
//! handler's transaction committed (its call returned) to the moment the
//! staged message reaches a consumer of the broker, through the relay.
//!
//! ```text
//! cargo bench --bench outbox                  # ~1 min
//! cargo bench --bench outbox -- --messages=N  # messages per scenario (default 2000)
//! ```
//!
//! Scenarios, on PostgreSQL (postgres://postgres@127.0.0.1:5432/test) and
//! RabbitMQ (amqp://guest:guest@127.0.0.1:5672/%2f), each with its own
//! tables and queue:
//!
//! - **woken**: the relay runs in the handler's process and is woken by the
//!   commit (its poll interval is 1 s, so polling plays no part);
//! - **polled**: the relay is another store instance on the same tables, as
//!   a relay in another process would be: only its poll (100 ms) finds the
//!   rows;
//!
//! each with one handler calling in a loop (paced, about 500 calls/s) and
//! with 8 concurrent callers (unpaced). Prints a markdown table of p50,
//! p99 and max latency and the throughput of delivered messages.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idempotent_runtime::lapin::options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
use idempotent_runtime::lapin::types::FieldTable;
use idempotent_runtime::lapin::{Connection, ConnectionProperties};
use idempotent_runtime::outbox::{Outbox, Outgoing, RabbitPublisher, Relay};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection};
use idempotent_runtime::{PgStore, idempotent};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

struct Payments {
    store: PgStore,
    effects: String,
    queue: String,
}

impl Payments {
    #[idempotent(key = "id", store = self.store, scope = "bench.outbox")]
    async fn charge(&self, id: &str, tx: &mut PgConnection, outbox: &mut Outbox) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {} (id) VALUES ($1)", self.effects)))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        outbox.publish(Outgoing::new(self.queue.clone(), id.as_bytes().to_vec()).message_id(id));
        Ok(())
    }
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}_{}_{}", std::process::id(), nanos % 1_000_000_000)
}

#[derive(Clone, Copy)]
enum Wake {
    Woken,
    Polled,
}

struct Outcome {
    name: String,
    latencies: Vec<Duration>,
    elapsed: Duration,
}

async fn scenario(wake: Wake, callers: usize, paced: bool, messages: usize) -> Outcome {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(PG_URL)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432");
    let (markers, outbox, effects, queue) = (
        unique("markers"),
        unique("outbox"),
        unique("effects"),
        unique("bench_q"),
    );
    let build = || {
        PgStore::builder(pool.clone())
            .table(&markers)
            .outbox_table(&outbox)
            .build()
            .expect("valid names")
    };
    let store = build();
    store.migrate().await.expect("migrate");
    sqlx::query(AssertSqlSafe(format!("CREATE TABLE {effects} (id TEXT PRIMARY KEY)")))
        .execute(&pool)
        .await
        .expect("effects table");

    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .expect("queue");
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "bench".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let receiver = {
        let (committed, latencies) = (Arc::clone(&committed), Arc::clone(&latencies));
        tokio::spawn(async move {
            let mut seen = 0;
            while let Some(Ok(delivery)) = consumer.next().await {
                let arrived = Instant::now();
                let id = String::from_utf8_lossy(&delivery.data).into_owned();
                // The commit time is recorded right after the call returns;
                // a message may arrive first: wait for it.
                let at = loop {
                    if let Some(at) = committed.lock().expect("lock").get(&id).copied() {
                        break at;
                    }
                    tokio::task::yield_now().await;
                };
                latencies
                    .lock()
                    .expect("lock")
                    .push(arrived.saturating_duration_since(at));
                seen += 1;
                if seen == messages {
                    break;
                }
            }
        })
    };

    let relay_store = match wake {
        Wake::Woken => store.clone(),
        Wake::Polled => build(),
    };
    let poll = match wake {
        Wake::Woken => Duration::from_secs(1),
        Wake::Polled => Duration::from_millis(100),
    };
    let relay = Relay::builder(relay_store, RabbitPublisher::new(AMQP_URL))
        .poll_interval(poll)
        .spawn();

    let payments = Arc::new(Payments {
        store: store.clone(),
        effects: effects.clone(),
        queue: queue.clone(),
    });
    let start = Instant::now();
    let per_caller = messages / callers;
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (payments, committed) = (Arc::clone(&payments), Arc::clone(&committed));
            tokio::spawn(async move {
                for i in 0..per_caller {
                    let id = format!("m{caller}-{i}");
                    let call = Instant::now();
                    payments.charge(&id).await.expect("charge");
                    committed.lock().expect("lock").insert(id, Instant::now());
                    if paced {
                        tokio::time::sleep(Duration::from_millis(2).saturating_sub(call.elapsed())).await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("caller");
    }
    tokio::time::timeout(Duration::from_secs(120), receiver)
        .await
        .expect("every message delivered within 2 minutes")
        .expect("receiver");
    let elapsed = start.elapsed();
    relay.shutdown().await;
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete queue");
    for table in [&markers, &outbox, &effects] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(&pool)
            .await
            .expect("drop");
    }
    let name = format!(
        "{}, {} caller{}{}",
        match wake {
            Wake::Woken => "woken (same process)",
            Wake::Polled => "polled every 100 ms (another process)",
        },
        callers,
        if callers == 1 { "" } else { "s" },
        if paced { ", ~500 calls/s" } else { ", unpaced" }
    );
    let latencies = Arc::try_unwrap(latencies)
        .map(|m| m.into_inner().expect("lock"))
        .unwrap_or_default();
    Outcome {
        name,
        latencies,
        elapsed,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let messages: usize = std::env::args()
        .find_map(|arg| arg.strip_prefix("--messages=").map(str::to_owned))
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000);
    println!("outbox publish latency: commit -> consumer, PostgreSQL + RabbitMQ, {messages} messages per row\n");
    println!("| relay | p50 ms | p99 ms | max ms | delivered/s |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (wake, callers, paced) in [
        (Wake::Woken, 1, true),
        (Wake::Woken, 8, false),
        (Wake::Polled, 1, true),
        (Wake::Polled, 8, false),
    ] {
        let mut outcome = scenario(wake, callers, paced, messages).await;
        outcome.latencies.sort();
        let l = &outcome.latencies;
        println!(
            "| {} | {} | {} | {} | {:.0} |",
            outcome.name,
            ms(percentile(l, 0.50)),
            ms(percentile(l, 0.99)),
            ms(l.last().copied().unwrap_or_default()),
            l.len() as f64 / outcome.elapsed.as_secs_f64()
        );
    }
}
