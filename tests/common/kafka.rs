//! Kafka helpers: a private Tansu broker per test (a Kafka-protocol broker
//! from `.ci/kafka`, memory storage), its topics, producing and reading
//! records, and a group's committed offsets, through librdkafka.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idempotent_runtime::broker::Backoff;
use idempotent_runtime::kafka::{KafkaConsumer, KafkaConsumerBuilder};
use idempotent_runtime::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idempotent_runtime::rdkafka::client::DefaultClientContext;
use idempotent_runtime::rdkafka::consumer::{BaseConsumer, Consumer};
use idempotent_runtime::rdkafka::message::{Header, Headers, OwnedHeaders};
use idempotent_runtime::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotent_runtime::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::servers::ChildServer;

const TIMEOUT: Duration = Duration::from_secs(10);

/// How long a test's consumer waits after an outage (a store that failed,
/// a key another consumer holds) before running the message again: 50 ms
/// doubling up to 200 ms.
pub const QUICK_OUTAGES: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(200));

/// The tests' record: its message id is `p<partition>-<seq>`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Step {
    pub message_id: String,
    pub partition: i32,
    pub seq: u32,
}

/// The JSON of the [`Step`] `seq` of `partition`.
pub fn step(partition: i32, seq: u32) -> Vec<u8> {
    serde_json::to_vec(&Step {
        message_id: format!("p{partition}-{seq}"),
        partition,
        seq,
    })
    .unwrap()
}

/// A record read back: partition, offset, key, value, headers (as text).
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: Vec<u8>,
    pub headers: HashMap<String, String>,
}

/// A producer to a test's broker (see [`Kafka::producer`]).
#[derive(Clone)]
pub struct Producer(FutureProducer);

impl Producer {
    /// Produces `value` to `partition` of `topic` (acknowledged).
    pub async fn send(&self, topic: &str, partition: i32, value: &[u8]) {
        let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).payload(value).partition(partition);
        self.0
            .send(record, TIMEOUT)
            .await
            .unwrap_or_else(|(err, _)| panic!("produce to {topic}: {err}"));
    }
}

/// A private Tansu broker, stopped on drop.
pub struct Kafka {
    pub server: ChildServer,
    producer: FutureProducer,
    /// Sends each record in a batch of its own (see `produce_one`).
    single: FutureProducer,
}

impl Kafka {
    pub fn start() -> Kafka {
        Kafka::on(ChildServer::tansu())
    }

    /// On `server`, a Tansu broker started by the caller (one that keeps
    /// its log over a restart: [`ChildServer::tansu_on_s3`]).
    pub fn on(server: ChildServer) -> Kafka {
        let producer = base_config(&server.kafka_bootstrap())
            .set("enable.idempotence", "true")
            .create()
            .expect("a producer");
        let single = base_config(&server.kafka_bootstrap())
            .set("enable.idempotence", "true")
            .set("linger.ms", "0")
            .set("batch.num.messages", "1")
            .create()
            .expect("a producer");
        Kafka {
            server,
            producer,
            single,
        }
    }

    pub fn bootstrap(&self) -> String {
        self.server.kafka_bootstrap()
    }

    /// A producer to this broker, for a task of its own.
    pub fn producer(&self) -> Producer {
        Producer(self.producer.clone())
    }

    /// The client configuration of the consumers under test: the group
    /// settings tuned so that joins and rebalances take seconds, not tens
    /// of seconds.
    pub fn config(&self) -> ClientConfig {
        group_config(&self.bootstrap())
    }

    /// A consumer of `topic` for `group` on this broker, quick for tests:
    /// the client configuration of [`config`](Self::config), offsets
    /// committed every 100 ms, retries after 20 ms then 40, 5 s for a
    /// revoked partition's handlers and 5 s to shut down.
    pub fn consumer(&self, topic: &str, group: &str) -> KafkaConsumerBuilder {
        KafkaConsumer::builder(self.config(), topic, group)
            .commit_interval(Duration::from_millis(100))
            .retry_backoff(Backoff::new(Duration::from_millis(20), Duration::from_millis(40)))
            .revoke_timeout(Duration::from_secs(5))
            .shutdown_timeout(Duration::from_secs(5))
    }

    pub async fn create_topic(&self, name: &str, partitions: i32) {
        create_topic(&self.bootstrap(), name, partitions).await;
    }

    /// Creates `name` with `partitions` partitions, and its dead-letter
    /// topic `<name>.dlq` (one partition).
    pub async fn create_topic_with_dlq(&self, name: &str, partitions: i32) {
        self.create_topic(name, partitions).await;
        self.create_topic(&format!("{name}.dlq"), 1).await;
    }

    /// A topic named `<prefix>_<unique>` with `partitions` partitions and
    /// its dead-letter topic, holding the [`step`]s `0..per_partition` of
    /// each partition (produced one at a time, in `seq` order, the
    /// partitions interleaved). Returns its name.
    pub async fn topic_of_steps(&self, prefix: &str, partitions: i32, per_partition: u32) -> String {
        let topic = super::unique(prefix);
        self.create_topic_with_dlq(&topic, partitions).await;
        for seq in 0..per_partition {
            for partition in 0..partitions {
                self.produce(&topic, Some(partition), None, &step(partition, seq), &[])
                    .await;
            }
        }
        topic
    }

    /// Produces `values` at once (librdkafka batches them), each
    /// acknowledged.
    pub async fn produce_batch(&self, topic: &str, partition: i32, values: &[Vec<u8>]) {
        let sends: Vec<_> = values
            .iter()
            .map(|value| {
                let record: FutureRecord<'_, str, [u8]> =
                    FutureRecord::to(topic).payload(value.as_slice()).partition(partition);
                self.producer.send(record, TIMEOUT)
            })
            .collect();
        for sent in futures_util::future::join_all(sends).await {
            sent.unwrap_or_else(|(err, _)| panic!("produce to {topic}: {err}"));
        }
    }

    /// Produces one record (acknowledged by the broker).
    pub async fn produce(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&str>,
        value: &[u8],
        headers: &[(&str, &str)],
    ) -> (i32, i64) {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(*value),
            });
        }
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).payload(value).headers(owned);
        if let Some(partition) = partition {
            record = record.partition(partition);
        }
        if let Some(key) = key {
            record = record.key(key);
        }
        let delivered = self
            .producer
            .send(record, TIMEOUT)
            .await
            .unwrap_or_else(|(err, _)| panic!("produce to {topic}: {err}"));
        (delivered.partition, delivered.offset)
    }

    /// Produces one record keyed `key` (acknowledged), in a batch of its
    /// own however many are in flight at once: Tansu reports a batch's high
    /// watermark short (see `high_watermarks`). Returns its partition and
    /// offset.
    pub async fn produce_one(&self, topic: &str, key: &str, value: &[u8]) -> (i32, i64) {
        let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).key(key).payload(value);
        let delivered = self
            .single
            .send(record, TIMEOUT)
            .await
            .unwrap_or_else(|(err, _)| panic!("produce to {topic}: {err}"));
        (delivered.partition, delivered.offset)
    }

    /// Every record of `topic`, by partition then offset.
    pub async fn read_all(&self, topic: &str) -> Vec<Record> {
        let bootstrap = self.bootstrap();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || read_all(&bootstrap, &topic))
            .await
            .unwrap()
    }

    /// Each partition's high watermark (the offset the next record gets;
    /// on Tansu, after a batch of several records, the batch's first
    /// record's offset + 1).
    pub async fn high_watermarks(&self, topic: &str) -> Vec<i64> {
        let bootstrap = self.bootstrap();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = base_config(&bootstrap).create().unwrap();
            (0..partitions(&consumer, &topic))
                .map(|p| consumer.fetch_watermarks(&topic, p, TIMEOUT).unwrap().1)
                .collect()
        })
        .await
        .unwrap()
    }

    /// The offsets `group` committed for each partition of `topic` (`None`:
    /// none).
    pub async fn committed(&self, group: &str, topic: &str) -> Vec<Option<i64>> {
        let bootstrap = self.bootstrap();
        let (group, topic) = (group.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = base_config(&bootstrap)
                .set("group.id", &group)
                .set("enable.auto.commit", "false")
                .create()
                .unwrap();
            let mut list = TopicPartitionList::new();
            for p in 0..partitions(&consumer, &topic) {
                list.add_partition(&topic, p);
            }
            let committed = consumer.committed_offsets(list, TIMEOUT).unwrap();
            committed
                .elements()
                .iter()
                .map(|e| match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                })
                .collect()
        })
        .await
        .unwrap()
    }

    /// Records of `group` not committed yet, over the partitions of
    /// `topic` (by the high watermarks: exact for records produced one at
    /// a time, see [`high_watermarks`](Self::high_watermarks)).
    pub async fn lag(&self, group: &str, topic: &str) -> u64 {
        let high = self.high_watermarks(topic).await;
        let committed = self.committed(group, topic).await;
        high.iter()
            .zip(committed)
            .map(|(high, committed)| (high - committed.unwrap_or(0)).max(0) as u64)
            .sum()
    }
}

/// The client configuration of the consumers under test at `bootstrap`:
/// the group settings tuned so that joins and rebalances take seconds, not
/// tens of seconds. `IDEMPOTENT_KAFKA_DEBUG` (e.g. `cgrp`) sets librdkafka's
/// `debug` contexts, logged as `tracing` debug events.
pub fn group_config(bootstrap: &str) -> ClientConfig {
    let mut config = base_config(bootstrap);
    config
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("max.poll.interval.ms", "20000")
        .set("topic.metadata.refresh.interval.ms", "1000")
        .set("fetch.wait.max.ms", "100");
    if let Ok(contexts) = std::env::var("IDEMPOTENT_KAFKA_DEBUG") {
        config.set("debug", contexts);
    }
    config
}

/// Creates `name` with `partitions` partitions on the broker at
/// `bootstrap`, and waits until its metadata shows every partition.
pub async fn create_topic(bootstrap: &str, name: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = base_config(bootstrap).create().expect("an admin client");
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let results = admin
        .create_topics([&topic], &AdminOptions::new().operation_timeout(Some(TIMEOUT)))
        .await
        .expect("create topic");
    for result in results {
        result.unwrap_or_else(|(topic, err)| panic!("create topic {topic}: {err}"));
    }
    // Until its metadata shows every partition.
    let bootstrap = bootstrap.to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = base_config(&bootstrap).create().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let metadata = consumer.fetch_metadata(Some(&name), TIMEOUT).unwrap();
            let ready = metadata
                .topics()
                .iter()
                .any(|t| t.name() == name && t.error().is_none() && t.partitions().len() == partitions as usize);
            if ready {
                return;
            }
            assert!(Instant::now() < deadline, "topic {name} not in the metadata");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
}

pub fn base_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("broker.address.family", "v4");
    config
}

fn partitions(consumer: &BaseConsumer, topic: &str) -> i32 {
    let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT).unwrap();
    metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map_or(0, |t| t.partitions().len() as i32)
}

/// Every record of `topic` at `bootstrap`, by partition then offset
/// (blocking).
pub fn read_all(bootstrap: &str, topic: &str) -> Vec<Record> {
    let consumer: BaseConsumer = base_config(bootstrap)
        .set("group.id", super::unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut ends = HashMap::new();
    let mut list = TopicPartitionList::new();
    for p in 0..partitions(&consumer, topic) {
        let (low, high) = consumer.fetch_watermarks(topic, p, TIMEOUT).unwrap();
        if high > low {
            ends.insert(p, high);
            list.add_partition_offset(topic, p, Offset::Offset(low)).unwrap();
        }
    }
    let mut records = Vec::new();
    if ends.is_empty() {
        return records;
    }
    consumer.assign(&list).unwrap();
    // Until every partition passed its high watermark and nothing more
    // came for a while: Tansu 0.6.0 reports the watermark of a batch of
    // several records as its first record's offset + 1
    // (`tansu_reports_a_batch_s_high_watermark_as_its_first_record_s` in
    // tests/kafka.rs), so records may follow it.
    let deadline = Instant::now() + TIMEOUT;
    let mut last = Instant::now();
    while !ends.is_empty() || last.elapsed() < Duration::from_millis(500) {
        assert!(Instant::now() < deadline, "reading {topic}: still waiting for {ends:?}");
        let Some(message) = consumer.poll(Duration::from_millis(50)) else {
            continue;
        };
        last = Instant::now();
        let message = message.unwrap();
        let headers = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        records.push(Record {
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            value: message.payload().unwrap_or_default().to_vec(),
            headers,
        });
        if ends
            .get(&message.partition())
            .is_some_and(|end| message.offset() + 1 >= *end)
        {
            ends.remove(&message.partition());
        }
    }
    records.sort_by_key(|r| (r.partition, r.offset));
    records
}
