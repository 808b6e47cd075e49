//! The article's payment consumer on Kafka, with the offsets in the
//! database (the demo is described in `payments/mod.rs`).
//!
//! A fresh topic of four partitions (and its dead-letter topic) read by
//! three members of one consumer group, each a [`KafkaConsumer`] with
//! `offsets_in(store)`: each payment's transaction also stores its
//! partition's next offset in PostgreSQL, beside the payment and its
//! marker, and nothing is committed to Kafka (`kafka_commits(false)`): the
//! database alone says where each partition resumes. The payments published
//! twice (one in four, keyed by message id, so both copies land in one
//! partition) are skipped by their markers. The three consumers start
//! together. When consumer 1 dies (its task aborted inside its 5th
//! payment's handler, before the consumer commits that payment's
//! transaction: it is rolled back; before that payment's transaction writes
//! anything, the handler waits until the two others received a payment, so
//! that consumer 1 leaves the group once their joins completed, not in the
//! middle of that rebalance, which the test broker would leave hanging),
//! the group gives its
//! partitions to the two others, which start at the stored offsets: what
//! consumer 1 committed is not delivered again, and its payment cut short
//! is charged by its next owner, once.
//!
//! Run it with the broker of the tests: `bash .ci/kafka` installs Tansu
//! (a Kafka-protocol broker, pinned by version and checksum; this example
//! runs the script itself when the broker is missing), then
//! `cargo run --example kafka_payments` starts a private Tansu on a free
//! port, or uses the broker at `KAFKA_BOOTSTRAP`. PostgreSQL is the one of
//! `.ci/run` (`DATABASE_URL` overrides it).

mod payments;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempotent_runtime::PgStore;
use idempotent_runtime::broker::ConsumerBuilder;
use idempotent_runtime::kafka::{Kafka, KafkaConsumer};
use idempotent_runtime::rdkafka::ClientConfig;
use idempotent_runtime::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idempotent_runtime::rdkafka::client::DefaultClientContext;
use idempotent_runtime::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idempotent_runtime::rdkafka::message::{Header, OwnedHeaders};
use idempotent_runtime::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use payments::{BoxError, Demo, Tables};

const PARTITIONS: i32 = 4;
const TIMEOUT: Duration = Duration::from_secs(10);

struct KafkaDemo {
    bootstrap: String,
    topic: String,
    dead_letters: String,
    group: String,
    /// The store of the payments' markers, where the offsets are kept too.
    store: PgStore,
    producer: FutureProducer,
    /// Each partition's end: the offset after its last published record.
    ends: Mutex<BTreeMap<i32, i64>>,
}

impl KafkaDemo {
    /// The clients' configuration: group settings tuned so that joins and
    /// rebalances take seconds (as the tests' are).
    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.bootstrap)
            .set("broker.address.family", "v4")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("max.poll.interval.ms", "20000")
            .set("topic.metadata.refresh.interval.ms", "1000")
            .set("fetch.wait.max.ms", "100");
        // `IDEMPOTENT_EXAMPLE_LOG=cgrp`: librdkafka's consumer-group log too.
        if std::env::var("IDEMPOTENT_EXAMPLE_LOG").is_ok_and(|v| v == "cgrp") {
            config
                .set("debug", "cgrp")
                .set_log_level(idempotent_runtime::rdkafka::config::RDKafkaLogLevel::Debug);
        }
        config
    }

    fn admin(&self) -> Result<AdminClient<DefaultClientContext>, BoxError> {
        Ok(self.config().create()?)
    }

    /// The partitions of `topic` in the metadata, and their high watermarks.
    async fn watermarks(&self, topic: &str) -> Result<Vec<i64>, BoxError> {
        let config = self.config();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || -> Result<Vec<i64>, BoxError> {
            let consumer: BaseConsumer = config.create()?;
            let metadata = consumer.fetch_metadata(Some(&topic), TIMEOUT)?;
            let partitions = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic && t.error().is_none())
                .map_or(0, |t| t.partitions().len() as i32);
            (0..partitions)
                .map(|p| -> Result<i64, BoxError> { Ok(consumer.fetch_watermarks(&topic, p, TIMEOUT)?.1) })
                .collect()
        })
        .await?
    }
}

impl Demo for KafkaDemo {
    type B = Kafka;
    const TITLE: &'static str = "Kafka (offsets in the database)";
    const REDELIVERS_COMMITTED: bool = false;
    const DEADLINE: Duration = Duration::from_secs(90);
    const KILL_ONCE_OTHERS_CONSUME: bool = true;

    fn describe(&self) -> String {
        format!(
            "topic `{}` ({PARTITIONS} partitions), group `{}`",
            self.topic, self.group
        )
    }

    async fn setup(&self) -> Result<(), BoxError> {
        let topics = [
            NewTopic::new(&self.topic, PARTITIONS, TopicReplication::Fixed(1)),
            NewTopic::new(&self.dead_letters, 1, TopicReplication::Fixed(1)),
        ];
        for created in self
            .admin()?
            .create_topics(&topics, &AdminOptions::new().operation_timeout(Some(TIMEOUT)))
            .await?
        {
            created.map_err(|(topic, err)| format!("create topic {topic}: {err}"))?;
        }
        // Until the metadata shows every partition.
        let deadline = Instant::now() + TIMEOUT;
        while self.watermarks(&self.topic).await?.len() != PARTITIONS as usize {
            if Instant::now() > deadline {
                return Err(format!("topic {} not in the metadata", self.topic).into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Keyed by message id (so a payment's copies share a partition), with
    /// the id in the `message_id` header; each acknowledged by the broker.
    async fn publish(&self, messages: Vec<(String, Vec<u8>)>) -> Result<(), BoxError> {
        let sends: Vec<_> = messages
            .iter()
            .map(|(id, body)| {
                let headers = OwnedHeaders::new().insert(Header {
                    key: "message_id",
                    value: Some(id.as_str()),
                });
                let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&self.topic)
                    .key(id.as_str())
                    .payload(body.as_slice())
                    .headers(headers);
                self.producer.send(record, TIMEOUT)
            })
            .collect();
        let sent = futures_util::future::join_all(sends).await;
        let mut ends = self.ends.lock().map_err(|_| "poisoned")?;
        for sent in sent {
            let delivered = sent.map_err(|(err, _)| format!("publish: {err}"))?;
            let end = ends.entry(delivered.partition).or_default();
            *end = (*end).max(delivered.offset + 1);
        }
        Ok(())
    }

    fn consumer(&self) -> ConsumerBuilder<Kafka> {
        KafkaConsumer::builder(self.config(), &self.topic, &self.group)
            .dead_letter_topic(&self.dead_letters)
            .offsets_in(self.store.clone())
            .kafka_commits(false)
            .revoke_timeout(Duration::from_secs(2))
    }

    /// Records past the offsets stored in the database, plus dead letters.
    async fn unsettled(&self) -> Result<u64, BoxError> {
        let stored: BTreeMap<i32, i64> = idempotent_runtime::sqlx::query_as::<_, (i32, i64)>(
            "SELECT kafka_partition, next_offset FROM idempotent_kafka_offsets \
             WHERE consumer_group = $1 AND topic = $2",
        )
        .bind(&self.group)
        .bind(&self.topic)
        .fetch_all(self.store.pool())
        .await?
        .into_iter()
        .collect();
        let ends = self.ends.lock().map_err(|_| "poisoned")?.clone();
        let behind: i64 = ends
            .iter()
            .map(|(p, end)| (end - stored.get(p).copied().unwrap_or(0)).max(0))
            .sum();
        let dead: i64 = self.watermarks(&self.dead_letters).await?.iter().sum();
        Ok(u64::try_from(behind + dead).unwrap_or(0))
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        idempotent_runtime::sqlx::query(
            "DELETE FROM idempotent_kafka_offsets WHERE consumer_group = $1 AND topic = $2",
        )
        .bind(&self.group)
        .bind(&self.topic)
        .execute(self.store.pool())
        .await?;
        self.admin()?
            .delete_topics(
                &[self.topic.as_str(), self.dead_letters.as_str()],
                &AdminOptions::new().operation_timeout(Some(TIMEOUT)),
            )
            .await?;
        Ok(())
    }
}

/// A Tansu broker of this run, killed when dropped.
struct Tansu(Child);

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The broker at `KAFKA_BOOTSTRAP`, or a private Tansu on a free port (the
/// binary `.ci/kafka` installs, running the script when it is missing).
fn broker() -> Result<(String, Option<Tansu>), BoxError> {
    if let Ok(bootstrap) = std::env::var("KAFKA_BOOTSTRAP") {
        return Ok((bootstrap, None));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci").join("kafka");
    let installed = Command::new("bash").arg(&script).stderr(Stdio::inherit()).output()?;
    if !installed.status.success() {
        return Err(format!("{} could not install the Tansu broker", script.display()).into());
    }
    let tansu = PathBuf::from(String::from_utf8(installed.stdout)?.trim());
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let url = format!("tcp://127.0.0.1:{port}");
    let child = Command::new(&tansu)
        .arg("broker")
        .args(["--listener-url", &url, "--advertised-listener-url", &url])
        .args(["--storage-engine", "memory://tansu/"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let tansu = Tansu(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("the Tansu broker did not start listening".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((format!("127.0.0.1:{port}"), Some(tansu)))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // `IDEMPOTENT_EXAMPLE_LOG=1`: the consumers' log (joins, assignments,
    // revocations, commits) on stderr.
    if std::env::var_os("IDEMPOTENT_EXAMPLE_LOG").is_some() {
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        tracing_subscriber::registry()
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .with(tracing_subscriber::filter::Targets::new().with_target("idempotent", tracing::Level::DEBUG))
            .init();
    }
    let (bootstrap, _tansu) = broker()?;
    let pg_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let id = payments::run_id();
    let tables = Tables {
        markers: format!("processed_messages_demo_{id}"),
        payments: format!("payments_demo_{id}"),
    };
    // The store the handlers claim on (`payments::run` builds the same one
    // on its own pool): the consumers' transactions are begun on it, so
    // the handlers' claims join them.
    let pool = PgPoolOptions::new().max_connections(16).connect_lazy(&pg_url)?;
    let store = PgStore::builder(pool).table(&tables.markers).build()?;
    let mut producer_config = ClientConfig::new();
    producer_config
        .set("bootstrap.servers", &bootstrap)
        .set("broker.address.family", "v4")
        .set("enable.idempotence", "true");
    let demo = KafkaDemo {
        producer: producer_config.create()?,
        bootstrap,
        topic: format!("payments.demo.{id}"),
        dead_letters: format!("payments.demo.{id}.dlq"),
        group: format!("payments-demo-{id}"),
        store,
        ends: Mutex::default(),
    };
    payments::run(demo, tables).await
}
