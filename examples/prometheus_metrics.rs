//! The library's metrics (feature `metrics`) on a Prometheus endpoint.
//!
//! The runtime records its counters and histograms through the `metrics`
//! facade and exports nothing itself: the service installs a recorder. Here
//! it is `metrics-exporter-prometheus`, serving the text format on
//! `http://127.0.0.1:9000/metrics` (`METRICS_ADDR` overrides the address),
//! in front of a RabbitMQ payment consumer whose `#[idempotent]` handler
//! writes to SQLite, with a janitor purging expired markers.
//!
//! `cargo run --example prometheus_metrics` publishes a few payments (one of
//! them twice, one that the handler refuses, one that is not JSON), waits
//! until they are settled, prints what the endpoint serves and stops; with
//! `-- --serve` it keeps consuming until Ctrl-C, for Prometheus to scrape.
//! Needs RabbitMQ (`.ci/run` starts it; `AMQP_URL` overrides the default).
//! docs/observability.md, "Metrics", lists every metric and its labels.

use std::net::SocketAddr;
use std::time::Duration;

use idempotent_runtime::broker::{CancellationToken, shutdown_on_signal};
use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::FieldTable;
use idempotent_runtime::lapin::{BasicProperties, Connection, ConnectionProperties};
use idempotent_runtime::rabbitmq::RabbitConsumer;
use idempotent_runtime::sqlx::{self, SqliteConnection};
use idempotent_runtime::{Janitor, SqliteStore, idempotent};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Serialize, Deserialize)]
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
    #[error("refused: amount {0} is not positive")]
    Refused(i64),
}

struct PaymentConsumer {
    store: SqliteStore,
}

impl PaymentConsumer {
    #[idempotent(key = "msg.message_id", store = self.store, scope = "payments.charge")]
    async fn process_payment(&self, msg: &PaymentMessage, tx: &mut SqliteConnection) -> Result<(), AppError> {
        if msg.amount_cents <= 0 {
            return Err(AppError::Refused(msg.amount_cents));
        }
        sqlx::query("INSERT INTO payments (order_id, amount_cents) VALUES (?1, ?2)")
            .bind(&msg.order_id)
            .bind(msg.amount_cents)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// What a Prometheus scrape of `addr` gets (a plain HTTP/1.1 GET).
async fn scrape(addr: SocketAddr) -> Result<String, BoxError> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Ok(body.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let serve = std::env::args().any(|arg| arg == "--serve");
    let addr: SocketAddr = std::env::var("METRICS_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:9000".into())
        .parse()?;
    let amqp_url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());

    // The recorder, and its HTTP listener as a task of this runtime. The
    // durations get buckets (Prometheus histograms); without them the
    // exporter renders histograms as summaries.
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0],
        )?
        .install()?;

    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("payments.db")).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE payments (id INTEGER PRIMARY KEY, order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    let janitor = Janitor::spawn(store.clone(), Duration::from_secs(if serve { 3600 } else { 1 }))?;
    let service = std::sync::Arc::new(PaymentConsumer { store });

    // The queue, declared here as the consumer would declare it (durable,
    // no arguments), so that the payments below are not published before
    // it exists.
    let queue = format!("payments.metrics.{}", std::process::id());
    let conn = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    let consumer = RabbitConsumer::builder(&amqp_url, &queue)
        .max_attempts(2)
        .retry_backoff(idempotent_runtime::broker::Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
        ))
        .build()?;
    let stats = consumer.stats();
    let shutdown = if serve {
        shutdown_on_signal()
    } else {
        CancellationToken::new()
    };
    let handler_service = std::sync::Arc::clone(&service);
    let run = tokio::spawn(consumer.run(
        move |msg: PaymentMessage| {
            let service = std::sync::Arc::clone(&handler_service);
            async move { service.process_payment(&msg).await }
        },
        shutdown.clone(),
    ));

    // A few payments: `pay-2` twice (a duplicate), `pay-4` refused by the
    // handler (retried, then dead-lettered), and a body that is not JSON.
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    for (id, amount) in [
        ("pay-1", 1_000),
        ("pay-2", 2_500),
        ("pay-2", 2_500),
        ("pay-3", 700),
        ("pay-4", -5),
    ] {
        bodies.push(serde_json::to_vec(&PaymentMessage {
            message_id: id.into(),
            order_id: format!("order-{id}"),
            amount_cents: amount,
        })?);
    }
    bodies.push(b"not json".to_vec());
    for body in &bodies {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default(),
            )
            .await?
            .await?;
    }
    for _ in 0..300 {
        let s = stats.snapshot();
        if s.acked + s.dead_lettered + s.poison >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let the janitor tick once more.
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    let text = scrape(addr).await?;
    println!("GET http://{addr}/metrics:\n");
    for line in text.lines().filter(|line| line.starts_with("idempotent_")) {
        println!("{line}");
    }

    if serve {
        println!("\nserving http://{addr}/metrics until Ctrl-C");
        shutdown.cancelled().await;
    }
    shutdown.cancel();
    run.await??;
    janitor.shutdown().await;
    for q in [queue.clone(), format!("{queue}.dlq")] {
        channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
