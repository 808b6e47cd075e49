//! The spans of the consumers, the handlers and the relay, exported through
//! `tracing-opentelemetry` to the OpenTelemetry SDK's in-memory exporter:
//! the messaging semantic conventions (`messaging.*`, span names, kinds and
//! statuses) and the idempotency outcome, on real brokers.
//!
//! A fresh message and its duplicate go through a consumer of each broker
//! (Kafka: a private Tansu broker); on RabbitMQ the handler also stages an
//! outgoing message that the relay publishes, and a third delivery reuses
//! the key for another message.

mod common;

use std::time::Duration;

use idempotent_runtime::broker::{CancellationToken, ConsumerBuilder, RunStats, Verdict, pipeline::Broker};
use idempotent_runtime::outbox::{Outbox, Outgoing, RabbitPublisher, Relay};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection};
use idempotent_runtime::{MemoryStore, PgStore, idempotent};
use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
use opentelemetry::{Key, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const WAIT: Duration = Duration::from_secs(30);

// ---- exporting ---------------------------------------------------------------

/// Spans of this thread's `tracing` (targets `idempotent*`, debug and up)
/// exported to memory. `#[tokio::test]` runs every task of a test on its
/// thread, so the consumer's and the relay's tasks are traced too.
struct Exported {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _guard: tracing::subscriber::DefaultGuard,
}

impl Exported {
    fn install() -> Exported {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::Targets::new().with_target("idempotent", tracing::Level::DEBUG))
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idempotent-tests")));
        let guard = tracing::subscriber::set_default(subscriber);
        Exported {
            exporter,
            provider,
            _guard: guard,
        }
    }

    /// Every span ended so far, in the order they started.
    fn spans(&self) -> Vec<SpanData> {
        self.provider.force_flush().unwrap();
        let mut spans = self.exporter.get_finished_spans().unwrap();
        spans.sort_by_key(|span| span.start_time);
        spans
    }
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == Key::new(key.to_owned()))
        .map(|kv| &kv.value)
}

/// A string attribute (absent: `None`).
fn text(span: &SpanData, key: &str) -> Option<String> {
    attr(span, key).map(|value| match value {
        Value::String(s) => s.as_str().to_owned(),
        other => panic!("{key} is not a string on {}: {other:?}", span.name),
    })
}

/// An integer attribute (absent: `None`).
fn int(span: &SpanData, key: &str) -> Option<i64> {
    attr(span, key).map(|value| match value {
        Value::I64(i) => *i,
        other => panic!("{key} is not an integer on {}: {other:?}", span.name),
    })
}

fn is_error(span: &SpanData) -> bool {
    matches!(span.status, Status::Error { .. })
}

/// The `process` spans of the consumer, in order, each with the handler
/// span it holds (`idempotent`, its child in the same trace).
fn deliveries(spans: &[SpanData]) -> Vec<(&SpanData, &SpanData)> {
    spans
        .iter()
        .filter(|span| span.name.starts_with("process "))
        .map(|delivery| {
            let children: Vec<&SpanData> = spans
                .iter()
                .filter(|span| span.name == "idempotent" && span.parent_span_id == delivery.span_context.span_id())
                .collect();
            assert_eq!(
                children.len(),
                1,
                "one handler span under {} ({:?})",
                delivery.name,
                text(delivery, "messaging.message.id")
            );
            let handler = children[0];
            assert_eq!(
                handler.span_context.trace_id(),
                delivery.span_context.trace_id(),
                "the handler span is in the delivery's trace"
            );
            (delivery, handler)
        })
        .collect()
}

/// What every `process` span says, whatever the broker.
fn assert_process_span(span: &SpanData, system: &str, destination: &str, message_id: &str, body: &[u8]) {
    assert_eq!(span.name, format!("process {destination}"));
    assert_eq!(span.span_kind, SpanKind::Consumer, "{}", span.name);
    assert_eq!(text(span, "messaging.system").as_deref(), Some(system));
    assert_eq!(text(span, "messaging.operation.type").as_deref(), Some("process"));
    assert_eq!(text(span, "messaging.operation.name").as_deref(), Some("process"));
    assert_eq!(text(span, "messaging.destination.name").as_deref(), Some(destination));
    assert_eq!(text(span, "messaging.message.id").as_deref(), Some(message_id));
    assert_eq!(int(span, "messaging.message.body.size"), Some(body.len() as i64));
}

/// A fresh message then its duplicate: `processed` then `duplicate`, on
/// the delivery span and on the handler span under it, no error.
fn assert_fresh_then_duplicate(pairs: &[(&SpanData, &SpanData)], scope: &str, key: &str) {
    for ((delivery, handler), outcome) in pairs.iter().zip(["processed", "duplicate"]) {
        assert_eq!(text(delivery, "idempotency.outcome").as_deref(), Some(outcome));
        assert_eq!(text(delivery, "outcome").as_deref(), Some("processed"), "acknowledged");
        assert_eq!(text(delivery, "error.type"), None);
        assert!(!is_error(delivery), "{:?}", delivery.status);
        assert_eq!(handler.span_kind, SpanKind::Internal);
        assert_eq!(text(handler, "idempotency.outcome").as_deref(), Some(outcome));
        assert_eq!(text(handler, "idempotency.scope").as_deref(), Some(scope));
        assert_eq!(text(handler, "idempotency.key").as_deref(), Some(key));
        assert_eq!(text(handler, "error.type"), None);
        assert!(!is_error(handler), "{:?}", handler.status);
    }
}

// ---- the service -------------------------------------------------------------

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Payment {
    message_id: String,
    amount: i64,
}

fn payment(id: &str, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&Payment {
        message_id: id.to_owned(),
        amount,
    })
    .unwrap()
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Errors of the store (a reused key...) are decided by the runtime; the
/// rest are retried.
fn verdict(error: &AppError) -> Verdict {
    match error {
        AppError::Idem(error) => error.verdict(),
        AppError::Db(_) => Verdict::Retry,
    }
}

/// Charges a payment in PostgreSQL and announces it through the outbox.
struct Charges {
    store: PgStore,
    announce_to: String,
}

impl Charges {
    #[idempotent(key = "msg.message_id", store = self.store, scope = "otel.charge", fingerprint = msg)]
    async fn charge(&self, msg: &Payment, outbox: &mut Outbox, tx: &mut PgConnection) -> Result<(), AppError> {
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        outbox.publish(Outgoing::new(
            self.announce_to.clone(),
            format!("charged {}", msg.message_id),
        ));
        Ok(())
    }
}

/// Counts nothing: the spans are what these tests look at.
struct Ledger {
    store: MemoryStore,
}

impl Ledger {
    #[idempotent(key = "msg.message_id", store = self.store, scope = "otel.ledger")]
    async fn record(&self, msg: &Payment) -> Result<(), AppError> {
        Ok(())
    }
}

/// Runs `builder`'s consumer with the ledger until it has been idle a while.
async fn run_ledger<B: Broker>(builder: ConsumerBuilder<B>) -> RunStats {
    let ledger = std::sync::Arc::new(Ledger {
        store: MemoryStore::new(),
    });
    let consumer = builder
        .concurrency(1)
        .stop_when_idle(Duration::from_millis(700))
        .build()
        .unwrap();
    tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Payment| {
                let ledger = std::sync::Arc::clone(&ledger);
                async move { ledger.record(&msg).await }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the consumer stops once drained")
    .unwrap()
}

// ---- RabbitMQ, PostgreSQL and the relay --------------------------------------

#[tokio::test]
async fn rabbitmq_deliveries_handlers_and_the_relay_follow_the_messaging_conventions() {
    use idempotent_runtime::lapin::options::{
        BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use idempotent_runtime::lapin::types::FieldTable;
    use idempotent_runtime::lapin::{BasicProperties, Connection, ConnectionProperties};
    use idempotent_runtime::rabbitmq::RabbitConsumer;

    let exported = Exported::install();
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672");
    let channel = conn.create_channel().await.unwrap();
    channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let queue = common::unique("otel.payments");
    let (dlq, announcements) = (format!("{queue}.dlq"), format!("{queue}.charged"));
    for q in [&queue, &dlq, &announcements] {
        channel
            .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
            .await
            .unwrap();
    }
    let pool = common::pg_pool(4).await;
    let (markers, outbox) = (common::unique("otel_markers"), common::unique("otel_outbox"));
    let store = PgStore::builder(pool.clone())
        .table(&markers)
        .outbox_table(&outbox)
        .build()
        .unwrap();
    store.migrate().await.unwrap();

    // The message, its duplicate, and another message under the same key.
    let bodies = [payment("pay-1", 10), payment("pay-1", 10), payment("pay-1", 99)];
    for body in &bodies {
        let props = BasicProperties::default()
            .with_message_id("pay-1".into())
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }

    let charges = std::sync::Arc::new(Charges {
        store: store.clone(),
        announce_to: announcements.clone(),
    });
    let consumer = RabbitConsumer::builder(AMQP_URL, &queue)
        .dead_letter_queue(&dlq)
        .concurrency(1)
        .classify(verdict)
        .stop_when_idle(Duration::from_millis(700))
        .build()
        .unwrap();
    let stats = tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Payment| {
                let charges = std::sync::Arc::clone(&charges);
                async move { charges.charge(&msg).await }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the consumer stops once drained")
    .unwrap();
    assert_eq!((stats.acked, stats.dead_lettered), (2, 1), "{stats:?}");

    // The relay publishes the one announcement (the duplicate staged none).
    let relay = Relay::builder(store.clone(), RabbitPublisher::new(AMQP_URL))
        .poll_interval(Duration::from_millis(50))
        .spawn();
    let deadline = tokio::time::Instant::now() + WAIT;
    let announced = loop {
        if let Some(message) = channel
            .basic_get(announcements.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            break message;
        }
        assert!(tokio::time::Instant::now() < deadline, "the relay published nothing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    relay.shutdown().await;
    let announced_id = announced
        .delivery
        .properties
        .message_id()
        .as_ref()
        .map(ToString::to_string)
        .expect("the relay sets the message id");

    let spans = exported.spans();
    let pairs = deliveries(&spans);
    assert_eq!(pairs.len(), 3, "one process span per delivery");
    for (i, ((delivery, _), body)) in pairs.iter().zip(&bodies).enumerate() {
        // The default exchange, routed by the queue's name: the queue alone.
        assert_process_span(delivery, "rabbitmq", &queue, "pay-1", body);
        assert_eq!(
            text(delivery, "messaging.rabbitmq.destination.routing_key").as_deref(),
            Some(queue.as_str())
        );
        assert_eq!(
            int(delivery, "messaging.rabbitmq.message.delivery_tag"),
            Some(i as i64 + 1)
        );
        assert_eq!(
            text(delivery, "messaging.consumer.group.name"),
            None,
            "none on RabbitMQ"
        );
    }
    assert_fresh_then_duplicate(&pairs[..2], "otel.charge", "pay-1");

    // The same key with another fingerprint: refused, and the delivery
    // dead-lettered, with the reason on both spans.
    let (delivery, handler) = pairs[2];
    assert_eq!(text(handler, "idempotency.outcome").as_deref(), Some("key_reused"));
    assert_eq!(text(handler, "error.type").as_deref(), Some("key_reused"));
    assert!(is_error(handler), "{:?}", handler.status);
    assert_eq!(text(delivery, "idempotency.outcome").as_deref(), Some("key_reused"));
    assert_eq!(text(delivery, "error.type").as_deref(), Some("key_reused"));
    assert_eq!(text(delivery, "outcome").as_deref(), Some("dead_lettered"));
    assert!(is_error(delivery), "{:?}", delivery.status);

    // The relay's publish: a producer span of a `send`.
    let sends: Vec<&SpanData> = spans.iter().filter(|span| span.name.starts_with("send ")).collect();
    assert_eq!(
        sends.len(),
        1,
        "one publish: {:?}",
        sends.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    let send = sends[0];
    assert_eq!(send.name, format!("send {announcements}"));
    assert_eq!(send.span_kind, SpanKind::Producer);
    assert_eq!(text(send, "messaging.system").as_deref(), Some("rabbitmq"));
    assert_eq!(text(send, "messaging.operation.type").as_deref(), Some("send"));
    assert_eq!(text(send, "messaging.operation.name").as_deref(), Some("publish"));
    assert_eq!(
        text(send, "messaging.destination.name").as_deref(),
        Some(announcements.as_str())
    );
    assert_eq!(text(send, "messaging.message.id"), Some(announced_id));
    assert_eq!(
        int(send, "messaging.message.body.size"),
        Some("charged pay-1".len() as i64)
    );
    assert_eq!(int(send, "outbox.attempt"), Some(1));
    assert!(!is_error(send), "{:?}", send.status);

    for q in [&queue, &dlq, &announcements] {
        channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "test done".into()).await;
    let pending: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {outbox} WHERE dispatched_at IS NULL"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pending, 0);
    common::drop_pg_table(&pool, &outbox).await;
    common::drop_pg_table(&pool, &markers).await;
}

// ---- NATS JetStream ------------------------------------------------------------

#[tokio::test]
async fn jetstream_deliveries_name_the_stream_and_the_durable_consumer() {
    use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, pull};
    use idempotent_runtime::async_nats::jetstream::{self, stream};
    use idempotent_runtime::async_nats::{self, HeaderMap};
    use idempotent_runtime::nats::JetStreamConsumer;

    let exported = Exported::install();
    let js = jetstream::new(
        async_nats::connect("127.0.0.1:4222")
            .await
            .expect("NATS at 127.0.0.1:4222"),
    );
    let id = common::unique("otel");
    let stream_name = format!("OTEL_{}", id.to_uppercase());
    let subject = format!("otel.{id}.in");
    js.create_stream(stream::Config {
        name: stream_name.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    let durable = "ledger";
    let pull_consumer = js
        .get_stream(&stream_name)
        .await
        .unwrap()
        .get_or_create_consumer(
            durable,
            pull::Config {
                durable_name: Some(durable.into()),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    // JetStream drops a second `Nats-Msg-Id` within its window: the
    // duplicate is the same payment under another broker-level id.
    let body = payment("pay-2", 5);
    for nats_id in ["n-1", "n-2"] {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", nats_id);
        js.publish_with_headers(subject.clone(), headers, body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let stats = run_ledger(
        JetStreamConsumer::builder(js.clone(), pull_consumer)
            .dead_letter_subject(format!("otel.{id}.dlq"))
            .fetch_expiry(Duration::from_millis(300)),
    )
    .await;
    assert_eq!(stats.acked, 2, "{stats:?}");

    let spans = exported.spans();
    let pairs = deliveries(&spans);
    assert_eq!(pairs.len(), 2);
    for ((delivery, _), nats_id) in pairs.iter().zip(["n-1", "n-2"]) {
        assert_process_span(delivery, "nats", &stream_name, nats_id, &body);
        assert_eq!(
            text(delivery, "messaging.consumer.group.name").as_deref(),
            Some(durable)
        );
        assert_eq!(text(delivery, "messaging.rabbitmq.destination.routing_key"), None);
    }
    assert_fresh_then_duplicate(&pairs, "otel.ledger", "pay-2");
    js.delete_stream(&stream_name).await.unwrap();
}

// ---- Redis Streams ---------------------------------------------------------------

#[tokio::test]
async fn redis_stream_deliveries_name_the_stream_the_group_and_the_consumer() {
    use idempotent_runtime::redis::{self, AsyncCommands};
    use idempotent_runtime::redis_streams::StreamConsumer;

    let exported = Exported::install();
    let client = redis::Client::open(common::REDIS_URL).unwrap();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis at 127.0.0.1:6379");
    let stream = common::unique("otel.stream");
    let body = payment("pay-3", 7);
    for _ in 0..2 {
        let _: String = conn
            .xadd(&stream, "*", &[("message_id", &b"pay-3"[..]), ("body", &body[..])])
            .await
            .unwrap();
    }

    let stats = run_ledger(
        StreamConsumer::builder(client.clone(), &stream, "ledgers")
            .consumer_name("ledger-1")
            .block(Duration::from_millis(300)),
    )
    .await;
    assert_eq!(stats.acked, 2, "{stats:?}");

    let spans = exported.spans();
    let pairs = deliveries(&spans);
    assert_eq!(pairs.len(), 2);
    for (delivery, _) in &pairs {
        assert_process_span(delivery, "redis", &stream, "pay-3", &body);
        assert_eq!(
            text(delivery, "messaging.consumer.group.name").as_deref(),
            Some("ledgers")
        );
        assert_eq!(text(delivery, "messaging.client.id").as_deref(), Some("ledger-1"));
    }
    assert_fresh_then_duplicate(&pairs, "otel.ledger", "pay-3");
    let _: () = conn.del(&[&stream, &format!("{stream}.dlq")]).await.unwrap();
}

// ---- Kafka -------------------------------------------------------------------------

#[tokio::test]
async fn kafka_deliveries_name_the_topic_the_group_the_partition_the_offset_and_the_key() {
    use idempotent_runtime::kafka::KafkaConsumer;

    let exported = Exported::install();
    let kafka = common::kafka::Kafka::start();
    let topic = common::unique("otel.topic");
    kafka.create_topic(&topic, 1).await;
    kafka.create_topic(&format!("{topic}.dlq"), 1).await;
    let body = payment("pay-4", 9);
    for _ in 0..2 {
        kafka
            .produce(&topic, Some(0), Some("order-4"), &body, &[("message_id", "pay-4")])
            .await;
    }

    let stats =
        run_ledger(KafkaConsumer::builder(kafka.config(), &topic, "ledgers").client_config("client.id", "ledger-1"))
            .await;
    assert_eq!(stats.acked, 2, "{stats:?}");

    let spans = exported.spans();
    let pairs = deliveries(&spans);
    assert_eq!(pairs.len(), 2);
    for (offset, (delivery, _)) in pairs.iter().enumerate() {
        assert_process_span(delivery, "kafka", &topic, "pay-4", &body);
        assert_eq!(
            text(delivery, "messaging.consumer.group.name").as_deref(),
            Some("ledgers")
        );
        assert_eq!(text(delivery, "messaging.client.id").as_deref(), Some("ledger-1"));
        assert_eq!(
            text(delivery, "messaging.destination.partition.id").as_deref(),
            Some("0")
        );
        assert_eq!(int(delivery, "messaging.kafka.offset"), Some(offset as i64));
        assert_eq!(
            text(delivery, "messaging.kafka.message.key").as_deref(),
            Some("order-4")
        );
    }
    assert_fresh_then_duplicate(&pairs, "otel.ledger", "pay-4");
}
