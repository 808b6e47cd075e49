//! The broker side of a configuration: the source the consumers read (with
//! its dead-letter destination) and the sink the outbox relay publishes to,
//! each on RabbitMQ, NATS JetStream, Redis Streams or Kafka (a private
//! Tansu broker per configuration), under names of their own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::async_nats::{self, HeaderMap};
use idempotent_runtime::broker::{Backoff, ConsumerBuilder, HEADER_KIND};
use idempotent_runtime::kafka::{Kafka, KafkaConsumer};
use idempotent_runtime::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::nats::{JetStream, JetStreamConsumer};
use idempotent_runtime::rabbitmq::{Rabbit, RabbitConsumer};
use idempotent_runtime::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idempotent_runtime::rdkafka::message::{Header, OwnedHeaders};
use idempotent_runtime::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotent_runtime::rdkafka::{Offset, TopicPartitionList};
use idempotent_runtime::redis::{self, AsyncCommands};
use idempotent_runtime::redis_streams::{RedisStream, StreamConsumer};

use super::common;
use super::config::BrokerKind;
use super::handlers::RedisConn;

/// The client the Redis Streams consumers are built on: the Redis server,
/// or the Redis Cluster (issue 30).
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // one per run
pub enum StreamsClient {
    One(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

/// A client of the cluster at `urls`, with the timeouts and retries that
/// ride out a failover.
pub fn cluster_client(urls: &[String]) -> redis::cluster::ClusterClient {
    redis::cluster::ClusterClient::builder(urls.to_vec())
        .connection_timeout(Duration::from_millis(500))
        .response_timeout(Duration::from_secs(2))
        .retries(6)
        .min_retry_wait(50)
        .max_retry_wait(1000)
        .build()
        .expect("cluster client")
}

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "127.0.0.1:4222";

/// Where a configuration's services are: the shared ones, or a private
/// server (restarted during the run).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Endpoints {
    pub amqp: String,
    pub nats: String,
    pub redis: String,
    pub pg: String,
    /// The configuration's private Tansu broker (`bootstrap.servers`), if
    /// Kafka is its broker or its outbox's.
    #[serde(default)]
    pub kafka: String,
    /// The nodes of the Redis Cluster a Redis store runs on
    /// (`Config::cluster`; the checker run's shared cluster), if any.
    #[serde(default)]
    pub cluster: Vec<String>,
}

impl Default for Endpoints {
    fn default() -> Endpoints {
        Endpoints {
            amqp: AMQP_URL.into(),
            nats: NATS_URL.into(),
            redis: common::REDIS_URL.into(),
            pg: common::PG_URL.into(),
            kafka: String::new(),
            cluster: Vec::new(),
        }
    }
}

/// The partitions of a configuration's Kafka topic (more than the
/// consumers of most configurations, so that a rebalance moves some).
pub const KAFKA_PARTITIONS: i32 = 4;
/// The consumer group of a configuration's Kafka consumers.
const KAFKA_GROUP: &str = "workers";
/// How long a message held by a consumer that died takes to come back
/// (JetStream's ack wait, Redis Streams' claim idle time).
pub const REDELIVERY: Duration = Duration::from_millis(800);

/// A dead letter: its body and its kind (`poison`, `exhausted`, `rejected`).
pub type DeadLetter = (Vec<u8>, String);

fn fast() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(50))
}

#[allow(clippy::large_enum_variant)] // one per run
pub enum Source {
    Rabbit {
        url: String,
        /// Connected again when a restart closed it.
        admin: tokio::sync::Mutex<(Connection, Channel)>,
        queue: String,
        dlq: String,
        /// Where the consumers connect: `url`, or the proxy's
        /// (`Source::through`).
        consumer_url: String,
    },
    Js {
        js: jetstream::Context,
        stream: String,
        dlq_stream: String,
        subject: String,
        dlq_subject: String,
        consumer: PullConsumer,
        /// The consumers' context and consumer handle on a connection
        /// through the proxy (`Source::through`), if any.
        via: Option<(jetstream::Context, PullConsumer)>,
    },
    Redis {
        client: StreamsClient,
        /// Reconnects by itself after a restart (the cluster's follows
        /// failovers).
        conn: RedisConn,
        stream: String,
        dlq: String,
        /// The consumers' client through the proxy (`Source::through`),
        /// if any.
        via: Option<redis::Client>,
    },
    Kafka {
        bootstrap: String,
        topic: String,
        dlq: String,
        producer: FutureProducer,
        /// Reads the group's committed offsets (it never joins the group).
        offsets: Arc<BaseConsumer>,
        /// Each partition's end: the offset after the last record the
        /// checker produced to it (from the producer's acknowledgements:
        /// Tansu's high watermark is short after a batch).
        ends: Mutex<HashMap<i32, i64>>,
    },
}

fn amqp_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => s.to_string(),
        AMQPValue::ShortString(s) => s.to_string(),
        other => format!("{other:?}"),
    }
}

/// A connection and a channel in confirm mode.
async fn rabbit_channel(url: &str) -> Result<(Connection, Channel), idempotent_runtime::lapin::Error> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok((conn, channel))
}

/// The admin channel, connected again if a restart closed it (if that
/// fails, the closed one: the operation fails and is retried by its caller).
async fn live_channel(url: &str, admin: &tokio::sync::Mutex<(Connection, Channel)>) -> Channel {
    let mut held = admin.lock().await;
    if !held.1.status().connected()
        && let Ok(fresh) = rabbit_channel(url).await
    {
        *held = fresh;
    }
    held.1.clone()
}

/// `XRANGE key - +`, retried while the connection manager reconnects (its
/// first command after a restart fails).
async fn xrange_all(conn: &RedisConn, key: &str) -> redis::streams::StreamRangeReply {
    let mut tries = 0;
    loop {
        let mut conn = conn.clone();
        match conn.xrange_all(key).await {
            Ok(reply) => return reply,
            Err(err) if tries < 50 => {
                tries += 1;
                eprintln!("checker: XRANGE {key}: {err}, retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("XRANGE {key}: {err}"),
        }
    }
}

impl Source {
    /// The source `setup` made, for a child consumer: nothing is created.
    pub async fn attach(kind: BrokerKind, name: &str, at: &Endpoints) -> Source {
        match kind {
            // Declaring the same durable queues again changes nothing;
            // Redis Streams has nothing to create.
            BrokerKind::Rabbit | BrokerKind::RedisStreams => Source::setup(kind, name, at).await,
            BrokerKind::Kafka => Source::kafka_at(name, at),
            BrokerKind::JetStream => {
                let js = jetstream::new(async_nats::connect(at.nats.as_str()).await.expect("NATS"));
                let stream_name = name.to_uppercase().replace('.', "_");
                let consumer: PullConsumer = js
                    .get_stream(&stream_name)
                    .await
                    .expect("the parent's stream")
                    .get_consumer("worker")
                    .await
                    .expect("the parent's consumer");
                Source::Js {
                    js,
                    dlq_stream: format!("{stream_name}_DLQ"),
                    stream: stream_name,
                    subject: format!("{name}.in"),
                    dlq_subject: format!("{name}.dlq"),
                    consumer,
                    via: None,
                }
            }
        }
    }

    pub async fn setup(kind: BrokerKind, name: &str, at: &Endpoints) -> Source {
        match kind {
            BrokerKind::Rabbit => {
                let (conn, admin) = rabbit_channel(&at.amqp).await.expect("RabbitMQ");
                let queue = format!("{name}.in");
                let dlq = format!("{name}.dlq");
                for q in [&queue, &dlq] {
                    admin
                        .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
                        .await
                        .unwrap();
                }
                Source::Rabbit {
                    url: at.amqp.clone(),
                    admin: tokio::sync::Mutex::new((conn, admin)),
                    queue,
                    dlq,
                    consumer_url: at.amqp.clone(),
                }
            }
            BrokerKind::JetStream => {
                let js = jetstream::new(async_nats::connect(at.nats.as_str()).await.expect("NATS"));
                let stream_name = name.to_uppercase().replace('.', "_");
                let subject = format!("{name}.in");
                let dlq_subject = format!("{name}.dlq");
                let dlq_stream = format!("{stream_name}_DLQ");
                common::nats::create_streams(&js, [(&stream_name, &subject), (&dlq_stream, &dlq_subject)]).await;
                let consumer = js
                    .get_stream(&stream_name)
                    .await
                    .unwrap()
                    .get_or_create_consumer(
                        "worker",
                        pull::Config {
                            durable_name: Some("worker".into()),
                            ack_policy: AckPolicy::Explicit,
                            ack_wait: REDELIVERY,
                            filter_subject: subject.clone(),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap();
                Source::Js {
                    js,
                    stream: stream_name,
                    dlq_stream,
                    subject,
                    dlq_subject,
                    consumer,
                    via: None,
                }
            }
            BrokerKind::RedisStreams if !at.cluster.is_empty() => {
                // On the cluster: the stream and its dead letters share a
                // slot (a hash tag).
                let client = cluster_client(&at.cluster);
                let conn = client.get_async_connection().await.expect("the Redis Cluster");
                Source::Redis {
                    client: StreamsClient::Cluster(client),
                    conn: RedisConn::Cluster(conn),
                    stream: format!("{{{name}}}.in"),
                    dlq: format!("{{{name}}}.dlq"),
                    via: None,
                }
            }
            BrokerKind::RedisStreams => {
                let client = redis::Client::open(at.redis.as_str()).unwrap();
                let conn = redis::aio::ConnectionManager::new(client.clone()).await.expect("Redis");
                Source::Redis {
                    client: StreamsClient::One(client),
                    conn: RedisConn::One(conn),
                    stream: format!("{name}.in"),
                    dlq: format!("{name}.dlq"),
                    via: None,
                }
            }
            BrokerKind::Kafka => {
                let source = Source::kafka_at(name, at);
                if let Source::Kafka { topic, dlq, .. } = &source {
                    common::kafka::create_topic(&at.kafka, topic, KAFKA_PARTITIONS).await;
                    common::kafka::create_topic(&at.kafka, dlq, 1).await;
                }
                source
            }
        }
    }

    /// The Kafka source of run `name` (its topics are created by `setup`).
    fn kafka_at(name: &str, at: &Endpoints) -> Source {
        let producer = common::kafka::base_config(&at.kafka)
            .set("enable.idempotence", "true")
            .set("linger.ms", "0")
            .create()
            .expect("a Kafka producer");
        let offsets = common::kafka::base_config(&at.kafka)
            .set("group.id", KAFKA_GROUP)
            .set("enable.auto.commit", "false")
            .create()
            .expect("a Kafka client");
        Source::Kafka {
            bootstrap: at.kafka.clone(),
            topic: format!("{name}.in"),
            dlq: format!("{name}.dlq"),
            producer,
            offsets: Arc::new(offsets),
            ends: Mutex::default(),
        }
    }

    /// Where the in-process consumers' connections go: through the proxy
    /// at `addr` (`127.0.0.1:port`, in front of this source's broker)
    /// instead of to the broker. The checker's own connections (backlog,
    /// dead letters, publishes) stay direct; child consumers
    /// (`Source::attach`) connect directly too.
    pub async fn through(&mut self, addr: &str) {
        match self {
            Source::Rabbit { url, consumer_url, .. } => *consumer_url = super::proxy::via(url, addr),
            Source::Js {
                via,
                stream: stream_name,
                ..
            } => {
                let client = async_nats::connect(addr).await.expect("NATS through the proxy");
                let js = jetstream::new(client);
                let consumer: PullConsumer = js
                    .get_stream(stream_name.as_str())
                    .await
                    .expect("the stream, through the proxy")
                    .get_consumer("worker")
                    .await
                    .expect("the consumer, through the proxy");
                *via = Some((js, consumer));
            }
            Source::Redis {
                client: StreamsClient::One(client),
                via,
                ..
            } => {
                let url = match client.get_connection_info().redis_settings().db() {
                    0 => format!("redis://{addr}/"),
                    db => format!("redis://{addr}/{db}"),
                };
                *via = Some(redis::Client::open(url).expect("a Redis client through the proxy"));
            }
            // Never drawn (`Config::through_proxy`).
            Source::Redis { .. } | Source::Kafka { .. } => {}
        }
    }

    /// The broker address (`host:port`) the proxy forwards to.
    pub fn broker_addr(kind: BrokerKind, at: &Endpoints) -> String {
        let url = match kind {
            BrokerKind::Rabbit => &at.amqp,
            BrokerKind::JetStream => &at.nats,
            BrokerKind::RedisStreams => &at.redis,
            BrokerKind::Kafka => &at.kafka,
        };
        super::proxy::host_port(url).to_owned()
    }

    pub fn rabbit(&self, prefetch: u16) -> ConsumerBuilder<Rabbit> {
        match self {
            Source::Rabbit {
                consumer_url: url,
                queue,
                dlq,
                ..
            } => RabbitConsumer::builder(url, queue)
                .prefetch(prefetch)
                .dead_letter_queue(dlq)
                .retry_backoff(fast())
                .outage_backoff(fast())
                .shutdown_timeout(Duration::from_secs(5)),
            _ => unreachable!(),
        }
    }

    pub fn jetstream(&self, prefetch: usize) -> ConsumerBuilder<JetStream> {
        match self {
            Source::Js {
                js,
                consumer,
                dlq_subject,
                via,
                ..
            } => {
                // Through the proxy: the context and the consumer handle
                // (which keeps a context of its own) of the proxied
                // connection.
                let (js, consumer) = via.as_ref().map_or((js, consumer), |(js, consumer)| (js, consumer));
                JetStreamConsumer::builder(js.clone(), consumer.clone())
                    .dead_letter_subject(dlq_subject)
                    .prefetch(prefetch)
                    .fetch_expiry(Duration::from_millis(300))
                    .retry_backoff(fast())
                    .outage_backoff(fast())
                    .shutdown_timeout(Duration::from_secs(5))
            }
            _ => unreachable!(),
        }
    }

    pub fn streams(&self) -> ConsumerBuilder<RedisStream> {
        match self {
            Source::Redis {
                client,
                stream,
                dlq,
                via,
                ..
            } => match client {
                // Through the proxy, if the run has one.
                StreamsClient::One(client) => {
                    StreamConsumer::builder(via.as_ref().unwrap_or(client).clone(), stream, "workers")
                }
                StreamsClient::Cluster(client) => StreamConsumer::cluster_builder(client.clone(), stream, "workers"),
            }
            .dead_letter_stream(dlq)
            .claim_idle(REDELIVERY)
            .block(Duration::from_millis(300))
            .retry_backoff(fast())
            .outage_backoff(fast())
            .shutdown_timeout(Duration::from_secs(5)),
            _ => unreachable!(),
        }
    }

    pub fn kafka(&self) -> ConsumerBuilder<Kafka> {
        match self {
            Source::Kafka {
                bootstrap, topic, dlq, ..
            } => KafkaConsumer::builder(common::kafka::group_config(bootstrap), topic, KAFKA_GROUP)
                .dead_letter_topic(dlq)
                .commit_interval(Duration::from_millis(100))
                .revoke_timeout(Duration::from_secs(3))
                .retry_backoff(fast())
                .outage_backoff(fast())
                .shutdown_timeout(Duration::from_secs(5)),
            _ => unreachable!(),
        }
    }

    pub async fn publish(&self, body: &[u8], id: &str) {
        match self {
            Source::Rabbit { url, admin, queue, .. } => {
                // Late copies are published while the consumers run, a
                // broker restart among them: again on a fresh channel.
                for attempt in 1.. {
                    let channel = live_channel(url, admin).await;
                    let props = BasicProperties::default()
                        .with_message_id(id.into())
                        .with_delivery_mode(2);
                    let confirmed = match channel
                        .basic_publish(
                            "".into(),
                            queue.as_str().into(),
                            BasicPublishOptions::default(),
                            body,
                            props.clone(),
                        )
                        .await
                    {
                        Ok(confirm) => confirm.await.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    match confirmed {
                        Ok(confirm) if confirm.is_ack() => break,
                        other if attempt < 50 => {
                            eprintln!("checker: RabbitMQ publish of {id}: {other:?}, again");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        other => panic!("RabbitMQ publish of {id}: {other:?}"),
                    }
                }
            }
            Source::Js { js, subject, .. } => {
                // The server's acknowledgement can time out on a loaded
                // machine; the same `Nats-Msg-Id` makes the retry a no-op
                // for a copy already stored.
                for attempt in 1.. {
                    let mut headers = HeaderMap::new();
                    headers.insert("Nats-Msg-Id", id);
                    let acked = match js
                        .publish_with_headers(subject.clone(), headers, body.to_vec().into())
                        .await
                    {
                        Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    match acked {
                        Ok(()) => break,
                        Err(e) if attempt < 50 => {
                            eprintln!("checker: JetStream publish of {id} failed ({e}), again");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => panic!("JetStream publish of {id}: {e}"),
                    }
                }
            }
            Source::Redis { conn, stream, .. } => {
                let mut conn = conn.clone();
                if let RedisConn::Cluster(_) = conn {
                    // A producer that waits for a replica: a failover must
                    // not lose a published message for "lost" to be the
                    // consumers' (retried while a failover is under way).
                    let mut attempt = 0;
                    loop {
                        let sent: Result<(String, i64), _> = redis::pipe()
                            .cmd("XADD")
                            .arg(stream)
                            .arg("*")
                            .arg("message_id")
                            .arg(id.as_bytes())
                            .arg("body")
                            .arg(body)
                            .cmd("WAIT")
                            .arg(1)
                            .arg(1000)
                            .query_async(&mut conn)
                            .await;
                        match sent {
                            Ok((_, replicas)) if replicas >= 1 => break,
                            other if attempt < 30 => {
                                attempt += 1;
                                eprintln!("checker: XADD of {id} on the cluster: {other:?}, again");
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                            other => panic!("XADD of {id} on the cluster: {other:?}"),
                        }
                    }
                } else {
                    // Late copies are published while the consumers run, a
                    // broker restart among them: the connection manager
                    // connects again.
                    for attempt in 1.. {
                        let sent: Result<String, _> = conn
                            .xadd(stream, "*", &[("message_id", id.as_bytes()), ("body", body)])
                            .await;
                        match sent {
                            Ok(_) => break,
                            Err(e) if attempt < 50 => {
                                eprintln!("checker: XADD of {id}: {e}, again");
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                            Err(e) => panic!("XADD of {id}: {e}"),
                        }
                    }
                }
            }
            Source::Kafka {
                topic, producer, ends, ..
            } => {
                // Keyed by the broker-level id: the copies of a message
                // land in partitions of their own, handled concurrently.
                let headers = OwnedHeaders::new().insert(Header {
                    key: "message_id",
                    value: Some(id),
                });
                let record: FutureRecord<'_, str, [u8]> =
                    FutureRecord::to(topic).key(id).payload(body).headers(headers);
                let delivered = producer
                    .send(record, Duration::from_secs(10))
                    .await
                    .unwrap_or_else(|(err, _)| panic!("produce {id} to {topic}: {err}"));
                let mut ends = ends.lock().unwrap();
                let end = ends.entry(delivered.partition).or_default();
                *end = (*end).max(delivered.offset + 1);
            }
        }
    }

    /// Every dead letter (read without consuming on RabbitMQ: requeued).
    pub async fn dead_letters(&self) -> Vec<DeadLetter> {
        match self {
            Source::Rabbit { url, admin, dlq, .. } => {
                let admin = live_channel(url, admin).await;
                let mut out = Vec::new();
                let mut held = Vec::new();
                while let Some(msg) = admin
                    .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
                    .await
                    .unwrap()
                {
                    let kind = msg
                        .delivery
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|h| h.inner().get(HEADER_KIND).map(amqp_text))
                        .unwrap_or_default();
                    out.push((msg.delivery.data.clone(), kind));
                    held.push(msg);
                }
                for msg in held {
                    msg.delivery
                        .acker
                        .nack(idempotent_runtime::lapin::options::BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        })
                        .await
                        .unwrap();
                }
                out
            }
            Source::Js { js, dlq_stream, .. } => {
                let mut stream = js.get_stream(dlq_stream).await.unwrap();
                let last = stream.info().await.map(|i| i.state.last_sequence).unwrap_or(0);
                let mut out = Vec::new();
                for seq in 1..=last {
                    if let Ok(msg) = stream.get_raw_message(seq).await {
                        let kind = msg
                            .headers
                            .get(HEADER_KIND)
                            .map(|v| v.as_str().to_owned())
                            .unwrap_or_default();
                        out.push((msg.payload.to_vec(), kind));
                    }
                }
                out
            }
            Source::Redis { conn, dlq, .. } => {
                let reply = xrange_all(conn, dlq).await;
                reply
                    .ids
                    .into_iter()
                    .map(|entry| {
                        let field = |name: &str| match entry.map.get(name) {
                            Some(redis::Value::BulkString(b)) => b.clone(),
                            _ => Vec::new(),
                        };
                        (field("body"), String::from_utf8_lossy(&field(HEADER_KIND)).into_owned())
                    })
                    .collect()
            }
            Source::Kafka { bootstrap, dlq, .. } => {
                let (bootstrap, dlq) = (bootstrap.clone(), dlq.clone());
                let records = tokio::task::spawn_blocking(move || common::kafka::read_all(&bootstrap, &dlq))
                    .await
                    .unwrap();
                records
                    .into_iter()
                    .map(|r| (r.value, r.headers.get(HEADER_KIND).cloned().unwrap_or_default()))
                    .collect()
            }
        }
    }

    /// Messages neither settled nor dead-lettered (ready or held).
    pub async fn backlog(&self) -> u64 {
        match self {
            Source::Rabbit { url, admin, queue, .. } => {
                let admin = live_channel(url, admin).await;
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                match admin
                    .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                    .await
                {
                    Ok(q) => u64::from(q.message_count()),
                    Err(_) => u64::MAX,
                }
            }
            Source::Js { js, stream, .. } => {
                let Ok(stream) = js.get_stream(stream).await else {
                    return u64::MAX;
                };
                match stream.consumer_info("worker").await {
                    Ok(info) => info.num_pending + info.num_ack_pending as u64,
                    Err(_) => u64::MAX,
                }
            }
            Source::Redis { conn, stream, .. } => {
                let mut conn = conn.clone();
                let groups: Result<redis::streams::StreamInfoGroupsReply, _> = conn.xinfo_groups(stream).await;
                match groups {
                    Ok(groups) => groups
                        .groups
                        .iter()
                        .map(|g| g.pending as u64 + g.lag.unwrap_or(0) as u64)
                        .sum(),
                    Err(_) => u64::MAX,
                }
            }
            Source::Kafka {
                topic, offsets, ends, ..
            } => {
                // What the group has not committed: records in flight,
                // buffered or not fetched yet.
                let ends = ends.lock().unwrap().clone();
                let mut list = TopicPartitionList::new();
                for partition in 0..KAFKA_PARTITIONS {
                    list.add_partition(topic, partition);
                }
                let offsets = Arc::clone(offsets);
                let committed =
                    tokio::task::spawn_blocking(move || offsets.committed_offsets(list, Duration::from_secs(5))).await;
                let Ok(Ok(committed)) = committed else {
                    return u64::MAX;
                };
                let committed: HashMap<i32, i64> = committed
                    .elements()
                    .iter()
                    .map(|e| {
                        let at = match e.offset() {
                            Offset::Offset(o) => o,
                            _ => 0,
                        };
                        (e.partition(), at)
                    })
                    .collect();
                ends.iter()
                    .map(|(partition, end)| (end - committed.get(partition).copied().unwrap_or(0)).max(0) as u64)
                    .sum()
            }
        }
    }

    /// Unacknowledged messages held by consumers (RabbitMQ's count leaves
    /// them out; the others count them in `backlog`).
    pub async fn teardown(self) {
        match self {
            Source::Rabbit {
                url, admin, queue, dlq, ..
            } => {
                let channel = live_channel(&url, &admin).await;
                for q in [&queue, &dlq] {
                    let _ = channel
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                let (conn, _) = admin.into_inner();
                let _ = conn.close(200, "checker done".into()).await;
            }
            Source::Js {
                js, stream, dlq_stream, ..
            } => {
                for name in [&stream, &dlq_stream] {
                    let _ = js.delete_stream(name).await;
                }
            }
            Source::Redis {
                mut conn, stream, dlq, ..
            } => {
                let _: Result<(), _> = conn.del(&[&stream, &dlq]).await;
            }
            // The topics go with the configuration's private broker.
            Source::Kafka { .. } => {}
        }
    }
}

/// Where the outbox relay publishes.
#[allow(clippy::large_enum_variant)] // one per run
pub enum Sink {
    Rabbit {
        url: String,
        conn: Connection,
        channel: Channel,
        queue: String,
    },
    Js {
        js: jetstream::Context,
        stream: String,
        subject: String,
    },
    Redis {
        conn: redis::aio::ConnectionManager,
        key: String,
    },
    Kafka {
        bootstrap: String,
        topic: String,
    },
}

impl Sink {
    pub async fn setup(kind: BrokerKind, name: &str, at: &Endpoints) -> Sink {
        match kind {
            BrokerKind::Rabbit => {
                let conn = Connection::connect(&at.amqp, ConnectionProperties::default())
                    .await
                    .expect("RabbitMQ");
                let channel = conn.create_channel().await.unwrap();
                let queue = format!("{name}.sink");
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions::durable(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                Sink::Rabbit {
                    url: at.amqp.clone(),
                    conn,
                    channel,
                    queue,
                }
            }
            BrokerKind::JetStream => {
                let js = jetstream::new(async_nats::connect(at.nats.as_str()).await.expect("NATS"));
                let stream = format!("{}_SINK", name.to_uppercase().replace('.', "_"));
                let subject = format!("{name}.sink");
                js.create_stream(stream::Config {
                    name: stream.clone(),
                    subjects: vec![subject.clone()],
                    duplicate_window: Duration::from_secs(120),
                    ..Default::default()
                })
                .await
                .unwrap();
                Sink::Js { js, stream, subject }
            }
            BrokerKind::RedisStreams => {
                let client = redis::Client::open(at.redis.as_str()).unwrap();
                let conn = redis::aio::ConnectionManager::new(client).await.expect("Redis");
                Sink::Redis {
                    conn,
                    key: format!("{name}.sink"),
                }
            }
            BrokerKind::Kafka => {
                let topic = format!("{name}.sink");
                common::kafka::create_topic(&at.kafka, &topic, 2).await;
                Sink::Kafka {
                    bootstrap: at.kafka.clone(),
                    topic,
                }
            }
        }
    }

    pub fn kind(&self) -> BrokerKind {
        match self {
            Sink::Rabbit { .. } => BrokerKind::Rabbit,
            Sink::Js { .. } => BrokerKind::JetStream,
            Sink::Redis { .. } => BrokerKind::RedisStreams,
            Sink::Kafka { .. } => BrokerKind::Kafka,
        }
    }

    /// The outbox destination: queue, subject or stream.
    pub fn destination(&self) -> String {
        match self {
            Sink::Rabbit { queue, .. } => queue.clone(),
            Sink::Js { subject, .. } => subject.clone(),
            Sink::Redis { key, .. } => key.clone(),
            Sink::Kafka { topic, .. } => topic.clone(),
        }
    }

    /// Everything delivered: (message id, payload).
    pub async fn read(&self) -> Vec<(String, Vec<u8>)> {
        match self {
            Sink::Rabbit {
                url, channel, queue, ..
            } => {
                // Connected again if a restart closed the channel.
                let fresh = match channel.status().connected() {
                    true => None,
                    false => Some(rabbit_channel(url).await.expect("RabbitMQ after its restart")),
                };
                let channel = fresh.as_ref().map_or(channel, |(_, c)| c);
                let mut out = Vec::new();
                while let Some(m) = channel
                    .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap()
                {
                    let id = m
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|s| s.to_string())
                        .unwrap_or_default();
                    out.push((id, m.delivery.data.clone()));
                }
                out
            }
            Sink::Js { js, stream, .. } => {
                let mut stream = js.get_stream(stream).await.unwrap();
                let last = stream.info().await.map(|i| i.state.last_sequence).unwrap_or(0);
                let mut out = Vec::new();
                for seq in 1..=last {
                    if let Ok(msg) = stream.get_raw_message(seq).await {
                        let id = msg
                            .headers
                            .get(async_nats::header::NATS_MESSAGE_ID)
                            .map(|v| v.as_str().to_owned())
                            .unwrap_or_default();
                        out.push((id, msg.payload.to_vec()));
                    }
                }
                out
            }
            Sink::Redis { conn, key } => {
                let reply = xrange_all(&RedisConn::One(conn.clone()), key).await;
                reply
                    .ids
                    .into_iter()
                    .map(|entry| {
                        let field = |name: &str| match entry.map.get(name) {
                            Some(redis::Value::BulkString(b)) => b.clone(),
                            _ => Vec::new(),
                        };
                        (
                            String::from_utf8_lossy(&field("message_id")).into_owned(),
                            field("body"),
                        )
                    })
                    .collect()
            }
            Sink::Kafka { bootstrap, topic } => {
                let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
                let records = tokio::task::spawn_blocking(move || common::kafka::read_all(&bootstrap, &topic))
                    .await
                    .unwrap();
                records
                    .into_iter()
                    .map(|r| {
                        let id = r
                            .headers
                            .get(idempotent_runtime::kafka::DEFAULT_MESSAGE_ID_HEADER)
                            .cloned()
                            .unwrap_or_default();
                        (id, r.value)
                    })
                    .collect()
            }
        }
    }

    pub async fn teardown(self) {
        match self {
            Sink::Rabbit {
                url,
                conn,
                channel,
                queue,
            } => {
                let fresh = match channel.status().connected() {
                    true => None,
                    false => rabbit_channel(&url).await.ok(),
                };
                let channel = fresh.as_ref().map_or(&channel, |(_, c)| c);
                let _ = channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = conn.close(200, "checker done".into()).await;
            }
            Sink::Js { js, stream, .. } => {
                let _ = js.delete_stream(&stream).await;
            }
            Sink::Redis { mut conn, key } => {
                let _: Result<(), _> = conn.del(&key).await;
            }
            Sink::Kafka { .. } => {}
        }
    }
}
