//! The brokers of the end-to-end benchmark: a fresh queue (stream,
//! subject, topic) per run, filled fast (publishes pipelined, confirmed at
//! the end), a consumer builder on it, and its removal. Kafka is a private
//! Tansu broker ([`Kafka`], the tests' helper), started once per run of the
//! benchmark.

use std::future::IntoFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::try_join_all;
use idempotent_runtime::async_nats;
use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::broker::ConsumerBuilder;
use idempotent_runtime::kafka::{self as kafka_consumer, KafkaConsumer};
use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::FieldTable;
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::nats::{JetStream, JetStreamConsumer};
use idempotent_runtime::rabbitmq::{Rabbit, RabbitConsumer};
use idempotent_runtime::rdkafka::ClientConfig;
use idempotent_runtime::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotent_runtime::redis::{self, AsyncCommands};
use idempotent_runtime::redis_streams::{RedisStream, StreamConsumer};

pub use crate::common::kafka::Kafka;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "127.0.0.1:4222";
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";

/// Publishes in flight at once while a queue is filled.
const WINDOW: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    RabbitMq,
    JetStream,
    RedisStreams,
    Kafka,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::RabbitMq, Kind::JetStream, Kind::RedisStreams, Kind::Kafka];

    pub fn name(self) -> &'static str {
        match self {
            Kind::RabbitMq => "rabbitmq",
            Kind::JetStream => "nats",
            Kind::RedisStreams => "redis-streams",
            Kind::Kafka => "kafka",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Kind::RabbitMq => "RabbitMQ",
            Kind::JetStream => "NATS JetStream",
            Kind::RedisStreams => "Redis Streams",
            Kind::Kafka => "Kafka (Tansu)",
        }
    }

    /// The broker's server processes (`/proc/*/comm`), for its CPU time.
    pub fn server_comm(self) -> &'static str {
        match self {
            Kind::RabbitMq => "beam.smp",
            Kind::JetStream => "nats-server",
            Kind::RedisStreams => "redis-server",
            Kind::Kafka => "tansu",
        }
    }
}

/// A JetStream stream's name for the queue `name`.
fn stream_name(name: &str) -> String {
    name.to_uppercase().replace(['.', '-'], "_")
}

/// One run's queue and the connection that fills it.
#[allow(clippy::large_enum_variant)] // one per run
pub enum Queue {
    Rabbit {
        _conn: Connection,
        channel: Channel,
        queue: String,
        dlq: String,
    },
    Js {
        js: jetstream::Context,
        stream: String,
        dlq_stream: String,
        subject: String,
        dlq_subject: String,
        consumer: PullConsumer,
    },
    Redis {
        client: redis::Client,
        conn: redis::aio::MultiplexedConnection,
        stream: String,
        dlq: String,
    },
    Kafka {
        producer: FutureProducer,
        config: ClientConfig,
        topic: String,
        dlq: String,
        group: String,
        partitions: usize,
        /// The partition of the next record (round robin).
        next: AtomicUsize,
    },
}

impl Queue {
    /// A fresh, empty queue named after `name` (unique per run); on Kafka
    /// a topic of `partitions` partitions on `kafka` (one lane each).
    pub async fn setup(kind: Kind, name: &str, partitions: usize, kafka: Option<&Kafka>) -> Result<Queue, BoxError> {
        match kind {
            Kind::RabbitMq => {
                let conn = Connection::connect(AMQP_URL, ConnectionProperties::default()).await?;
                let channel = conn.create_channel().await?;
                for q in [format!("{name}.in"), format!("{name}.dlq")] {
                    channel
                        .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
                        .await?;
                }
                conn.close(200, "declared".into()).await?;
            }
            Kind::JetStream => {
                let js = jetstream::new(async_nats::connect(NATS_URL).await?);
                let stream_name = stream_name(name);
                let (subject, dlq_subject) = (format!("{name}.in"), format!("{name}.dlq"));
                for (n, s) in [
                    (stream_name.clone(), &subject),
                    (format!("{stream_name}_DLQ"), &dlq_subject),
                ] {
                    js.create_stream(stream::Config {
                        name: n,
                        subjects: vec![s.clone()],
                        ..Default::default()
                    })
                    .await?;
                }
                js.get_stream(&stream_name)
                    .await?
                    .create_consumer(pull::Config {
                        durable_name: Some("worker".into()),
                        ack_policy: AckPolicy::Explicit,
                        ack_wait: Duration::from_secs(30),
                        filter_subject: subject.clone(),
                        ..Default::default()
                    })
                    .await?;
            }
            Kind::RedisStreams => {}
            Kind::Kafka => {
                let kafka = kafka.ok_or("Kafka needs the benchmark's Tansu broker (Env::new with Kafka)")?;
                kafka
                    .create_topic(&format!("{name}.in"), i32::try_from(partitions.max(1))?)
                    .await;
                kafka.create_topic(&format!("{name}.dlq"), 1).await;
            }
        }
        Queue::open(kind, name, partitions, kafka.map(|k| k.bootstrap()).as_deref()).await
    }

    /// The queue `name` that [`setup`](Self::setup) made (in this process
    /// or another: a consumer process of `--processes`); Kafka's at
    /// `bootstrap`.
    pub async fn open(kind: Kind, name: &str, partitions: usize, bootstrap: Option<&str>) -> Result<Queue, BoxError> {
        Ok(match kind {
            Kind::RabbitMq => {
                let conn = Connection::connect(AMQP_URL, ConnectionProperties::default()).await?;
                let channel = conn.create_channel().await?;
                channel.confirm_select(ConfirmSelectOptions::default()).await?;
                Queue::Rabbit {
                    _conn: conn,
                    channel,
                    queue: format!("{name}.in"),
                    dlq: format!("{name}.dlq"),
                }
            }
            Kind::JetStream => {
                let js = jetstream::new(async_nats::connect(NATS_URL).await?);
                let stream = stream_name(name);
                let consumer = js.get_stream(&stream).await?.get_consumer("worker").await?;
                Queue::Js {
                    js,
                    dlq_stream: format!("{stream}_DLQ"),
                    stream,
                    subject: format!("{name}.in"),
                    dlq_subject: format!("{name}.dlq"),
                    consumer,
                }
            }
            Kind::RedisStreams => {
                let client = redis::Client::open(REDIS_URL)?;
                let conn = client.get_multiplexed_async_connection().await?;
                Queue::Redis {
                    client,
                    conn,
                    stream: format!("{name}.in"),
                    dlq: format!("{name}.dlq"),
                }
            }
            Kind::Kafka => {
                let bootstrap = bootstrap.ok_or("Kafka needs the benchmark's Tansu broker")?;
                // No linger: a steady feed's record leaves at once.
                let producer = crate::common::kafka::base_config(bootstrap)
                    .set("linger.ms", "0")
                    .create()?;
                Queue::Kafka {
                    producer,
                    config: crate::common::kafka::group_config(bootstrap),
                    topic: format!("{name}.in"),
                    dlq: format!("{name}.dlq"),
                    group: format!("{name}-group"),
                    partitions: partitions.max(1),
                    next: AtomicUsize::new(0),
                }
            }
        })
    }

    /// Publishes `bodies` in order, [`WINDOW`] at a time, each confirmed
    /// by the broker before this returns. JetStream gets no `Nats-Msg-Id`:
    /// its de-duplication would drop the duplicates the run is about.
    pub async fn publish(&self, bodies: &[Vec<u8>]) -> Result<(), BoxError> {
        for window in bodies.chunks(WINDOW) {
            match self {
                Queue::Rabbit { channel, queue, .. } => {
                    let mut confirms = Vec::with_capacity(window.len());
                    for body in window {
                        let props = BasicProperties::default().with_delivery_mode(2);
                        confirms.push(
                            channel
                                .basic_publish(
                                    "".into(),
                                    queue.as_str().into(),
                                    BasicPublishOptions::default(),
                                    body,
                                    props,
                                )
                                .await?,
                        );
                    }
                    for confirm in try_join_all(confirms).await? {
                        if !confirm.is_ack() {
                            return Err("RabbitMQ refused a publish".into());
                        }
                    }
                }
                Queue::Js { js, subject, .. } => {
                    let mut acks = Vec::with_capacity(window.len());
                    for body in window {
                        acks.push(js.publish(subject.clone(), body.clone().into()).await?.into_future());
                    }
                    try_join_all(acks).await?;
                }
                Queue::Redis { conn, stream, .. } => {
                    let mut pipe = redis::pipe();
                    for body in window {
                        pipe.xadd(stream, "*", &[("body", body.as_slice())]).ignore();
                    }
                    let () = pipe.query_async(&mut conn.clone()).await?;
                }
                Queue::Kafka {
                    producer,
                    topic,
                    partitions,
                    next,
                    ..
                } => {
                    // Each record's position as its key: with the key order
                    // (`IDEMPOTENT_BENCH_KAFKA_ORDER=key`) every record is a
                    // key of its own.
                    let numbered: Vec<(usize, String, &Vec<u8>)> = window
                        .iter()
                        .map(|body| {
                            let n = next.fetch_add(1, Ordering::Relaxed);
                            (n % *partitions, n.to_string(), body)
                        })
                        .collect();
                    let sends: Vec<_> = numbered
                        .iter()
                        .map(|(partition, key, body)| {
                            let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
                                .key(key.as_str())
                                .payload(body.as_slice())
                                .partition(i32::try_from(*partition).unwrap_or(0));
                            producer.send(record, Duration::from_secs(10))
                        })
                        .collect();
                    for sent in futures_util::future::join_all(sends).await {
                        sent.map_err(|(error, _)| format!("produce to {topic}: {error}"))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A RabbitMQ consumer's builder on this queue.
    pub fn rabbit(&self, prefetch: u16) -> Option<ConsumerBuilder<Rabbit>> {
        match self {
            Queue::Rabbit { queue, dlq, .. } => Some(
                RabbitConsumer::builder(AMQP_URL, queue)
                    .prefetch(prefetch)
                    .dead_letter_queue(dlq)
                    .declare_queue(false)
                    .declare_dead_letter_queue(false),
            ),
            _ => None,
        }
    }

    /// A JetStream consumer's builder on this stream.
    pub fn jetstream(&self, prefetch: usize) -> Option<ConsumerBuilder<JetStream>> {
        match self {
            Queue::Js {
                js,
                consumer,
                dlq_subject,
                ..
            } => Some(
                JetStreamConsumer::builder(js.clone(), consumer.clone())
                    .dead_letter_subject(dlq_subject)
                    .prefetch(prefetch)
                    .fetch_expiry(Duration::from_millis(200)),
            ),
            _ => None,
        }
    }

    /// A Redis Streams consumer's builder on this stream.
    pub fn streams(&self) -> Option<ConsumerBuilder<RedisStream>> {
        match self {
            Queue::Redis {
                client, stream, dlq, ..
            } => Some(
                StreamConsumer::builder(client.clone(), stream, "workers")
                    .dead_letter_stream(dlq)
                    .block(Duration::from_millis(200)),
            ),
            _ => None,
        }
    }

    /// A Kafka consumer's builder on this topic, in a group of its own (one
    /// lane per partition).
    pub fn kafka(&self) -> Option<ConsumerBuilder<kafka_consumer::Kafka>> {
        match self {
            Queue::Kafka {
                config,
                topic,
                dlq,
                group,
                ..
            } => Some(KafkaConsumer::builder(config.clone(), topic, group).dead_letter_topic(dlq)),
            _ => None,
        }
    }

    /// Removes the queue and its dead letters (a Kafka topic stays on the
    /// private broker, which ends with the benchmark; its group's offsets
    /// in the database go).
    pub async fn teardown(self, pool: &idempotent_runtime::sqlx::PgPool) -> Result<(), BoxError> {
        match self {
            Queue::Rabbit {
                channel, queue, dlq, ..
            } => {
                for q in [queue, dlq] {
                    channel
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await?;
                }
            }
            Queue::Js {
                js, stream, dlq_stream, ..
            } => {
                for s in [stream, dlq_stream] {
                    js.delete_stream(&s).await?;
                }
            }
            Queue::Redis {
                mut conn, stream, dlq, ..
            } => {
                let () = conn.del(&[stream, dlq]).await?;
            }
            Queue::Kafka { group, .. } => {
                idempotent_runtime::sqlx::query("DELETE FROM idempotent_kafka_offsets WHERE consumer_group = $1")
                    .bind(&group)
                    .execute(pool)
                    .await?;
            }
        }
        Ok(())
    }
}
