//! Kafka consumer (feature `kafka`, on `rdkafka`/librdkafka): a consumer
//! group member that keeps partition order, commits a partition's offset
//! only up to its last finished message, dead-letters to a topic, and lets
//! the handlers of revoked partitions finish before it gives them up.
//!
//! [`KafkaConsumer`] subscribes to one topic as a member of a consumer
//! group, decodes each record's value (JSON by default, see
//! [`Decoder`](super::Decoder)), calls the handler, and settles the record:
//!
//! | handler | what happens |
//! | --- | --- |
//! | `Ok` | the record is finished: its partition's offset may be committed past it, and the partition's next record (of its key, with [`Order::Key`]) starts |
//! | `Err`, attempts left and the error retryable | after the backoff, the same record runs again as the next attempt; the partition (its key, with [`Order::Key`]) waits for it |
//! | `Err` on the last attempt, or not retryable ([`RetryPolicy`](super::RetryPolicy)) | the record is produced to the dead-letter topic with its key, value and headers plus `x-idempotent-reason`, `-kind`, `-attempts`, `-source` and its `x-idempotent-topic`, `-partition`, `-offset`; then it is finished. A produce that may have been written all the same (it timed out) is produced again, and the record's handler does not run again in this process once its dead letter may be stored |
//! | a dependency down (the `#[idempotent]` store failed, or [`Verdict::Outage`](super::Verdict::Outage)) | the handler runs again after a backoff, without spending an attempt; the partition (its key) waits |
//! | undecodable value, or no value (poison) | dead-lettered at once |
//! | panic | counts as a failed attempt |
//!
//! # Order
//!
//! By default ([`Order::Partition`]) records of one partition are handled
//! one at a time, in offset order: the next one starts only after the
//! previous one is finished (its handler's transaction committed, or it was
//! dead-lettered). Retries and outage retries hold the partition: a record
//! never overtakes one before it. Partitions run concurrently, up to the
//! consumer's [concurrency](ConsumerBuilder::concurrency) at once (so more
//! partitions than the concurrency take turns).
//!
//! With [`order(Order::Key)`](ConsumerBuilder::order) the same holds per
//! key within a partition: records with the same key run in offset order,
//! one at a time, and a retry holds its key only; records of one partition
//! with different keys run concurrently (within the concurrency, and up to
//! [`max_buffered`](ConsumerBuilder::max_buffered) records buffered behind
//! a key that is held). Records without a key are ordered among
//! themselves, as one key.
//!
//! # Offsets
//!
//! The consumer commits offsets itself (`enable.auto.commit=false`, which
//! it sets): a partition's offset to commit is its lowest offset not yet
//! finished (buffered, running or waiting for a retry), or its last
//! finished record's offset + 1 when nothing is left, so the committed
//! offset never passes a record that is not finished, in whatever order
//! records finish ([`Order::Key`]). With the default order it is simply the
//! last finished record's offset + 1.
//! Commits are batched: made when [`commit_every`](ConsumerBuilder::commit_every)
//! records were finished since the last commit, or
//! [`commit_interval`](ConsumerBuilder::commit_interval) after it, whichever
//! comes first; and always when partitions are revoked and when the
//! consumer stops. Auto-commit with a manual offset store would also never
//! commit past a stored offset, but it commits on librdkafka's clock only,
//! says nothing of failures, and cannot be told to commit a revoked
//! partition before it is released; explicit commits from the thread that
//! serves the group's rebalances can.
//!
//! A record whose effect committed but whose offset did not (a crash, a
//! failed commit) is delivered again after a restart or a rebalance: the
//! idempotent handler recognises the duplicate. Kafka keeps no delivery
//! count: a record that crashes the process each time it runs is delivered
//! again each time (attempts are counted within one process only).
//!
//! # Rebalances
//!
//! librdkafka's group protocol runs on a thread of the consumer's own,
//! which polls continuously (so a long handler does not exceed
//! `max.poll.interval.ms`). When partitions are revoked, that thread stops
//! starting records of those partitions, waits for their handlers in flight
//! to finish, at most [`revoke_timeout`](ConsumerBuilder::revoke_timeout),
//! commits their finished offsets, and only then lets the partitions go. A
//! handler that outlives the timeout finishes unsettled: its partition's
//! new owner receives the record again, and the idempotent handler's marker
//! tells the duplicate (its claim waits for, or replays, this one's effect).
//! Records fetched but not started are dropped with the partition.
//!
//! # Offsets in the database
//!
//! With [`offsets_in(store)`](ConsumerBuilder::offsets_in) the offsets are
//! also kept in the database, in each record's own transaction (marker,
//! effect and offset commit together), and each assigned partition starts
//! at its stored offset: see the method. The Kafka commits above go on, as a
//! hint for monitoring ([`kafka_commits`](ConsumerBuilder::kafka_commits)).
//! A stored offset past the end of the partition's log (a log that lost
//! records, or a topic created again) is reported at the assignment, and a
//! partition whose first record comes before its stored offset (the broker
//! answered "out of range" and librdkafka moved the fetch back) is held:
//! nothing of it is handled, rather than its records skipped as already
//! applied, until its row is corrected.
//!
//! # Connection loss
//!
//! librdkafka reconnects to the brokers by itself; only a fatal client
//! error ends the session, and the consumer then makes a new client within
//! its [reconnection policy](ConsumerBuilder::reconnect).
//!
//! ```no_run
//! use idempotent_runtime::broker::shutdown_on_signal;
//! use idempotent_runtime::kafka::KafkaConsumer;
//! use idempotent_runtime::rdkafka::ClientConfig;
//!
//! #[derive(serde::Deserialize)]
//! struct PaymentMessage { message_id: String, order_id: String, amount: i64 }
//!
//! # async fn process_payment(_: &PaymentMessage) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let mut config = ClientConfig::new();
//! config.set("bootstrap.servers", "127.0.0.1:9092");
//! let consumer = KafkaConsumer::builder(config, "payments", "payment-service")
//!     .concurrency(8)
//!     .max_attempts(5)
//!     .build()?;
//!
//! let shutdown = shutdown_on_signal(); // cancelled on Ctrl-C or SIGTERM
//! let stats = consumer
//!     .run(|msg: PaymentMessage| async move { process_payment(&msg).await }, shutdown)
//!     .await?;
//! println!("acked {} dead-lettered {}", stats.acked, stats.dead_lettered);
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::pipeline::{self, Broker, Connect, Letter, Messaging, Meta, Next, Settle};
use super::{
    CancellationToken, ConsumerError, ConsumerOptions, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON, HEADER_SOURCE,
    Json, RetryAll,
};
use super::{Consumer, ConsumerBuilder, TRACING_TARGET};

#[cfg(feature = "sqlx")]
pub(crate) mod offsets;
#[cfg(feature = "sqlx")]
pub(crate) mod publisher;
#[cfg(feature = "sqlx")]
pub use offsets::OffsetStore;
#[cfg(feature = "sqlx")]
pub use publisher::HEADER_OUTBOX_ROW;

/// Default most records finished between two commits of a consumer's
/// offsets.
pub const DEFAULT_COMMIT_EVERY: usize = 100;
/// Default longest time between a record's finish and the commit of its
/// offset.
pub const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_secs(1);
/// Default time the handlers of revoked partitions get to finish before
/// the partitions are released.
pub const DEFAULT_REVOKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default most records fetched and not yet started, per partition, before
/// the partition's fetching pauses.
pub const DEFAULT_MAX_BUFFERED: usize = 500;
/// Default header holding a record's message id (what
/// [`KafkaPublisher`](crate::outbox::KafkaPublisher) writes).
pub const DEFAULT_MESSAGE_ID_HEADER: &str = "message_id";
/// Dead-letter header: the topic the record was consumed from.
pub const HEADER_TOPIC: &str = "x-idempotent-topic";
/// Dead-letter header: the partition the record was consumed from.
pub const HEADER_PARTITION: &str = "x-idempotent-partition";
/// Dead-letter header: the record's offset in its partition.
pub const HEADER_OFFSET: &str = "x-idempotent-offset";

/// How long the consumer's thread waits for librdkafka at a time: the
/// longest delay of a commit that is due, or of a shutdown.
const POLL_EVERY: Duration = Duration::from_millis(50);
/// How long a dead letter may wait in the producer's queue.
const PRODUCE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the topic's metadata at connection.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait, at connection, for the group's first assignment (the
/// session starts anyway after it, and takes partitions when they come).
const JOIN_WAIT: Duration = Duration::from_secs(30);
/// Offsets in the database: how long one read of the stored offsets may
/// take at an assignment, and how many reads are tried.
#[cfg(feature = "sqlx")]
const READ_OFFSETS_TIMEOUT: Duration = Duration::from_secs(5);
#[cfg(feature = "sqlx")]
const READ_OFFSETS_ATTEMPTS: u32 = 3;

/// Properties of the consumer's configuration that its dead-letter
/// producer leaves out (librdkafka warns about consumer properties given to
/// a producer).
const CONSUMER_ONLY: [&str; 12] = [
    "auto.offset.reset",
    "group.id",
    "group.instance.id",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "max.poll.interval.ms",
    "partition.assignment.strategy",
    "fetch.wait.max.ms",
    "fetch.min.bytes",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "isolation.level",
];

/// Which records of one partition a [`KafkaConsumer`] handles one after
/// the other ([`order`](ConsumerBuilder::order)); partitions always run
/// concurrently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Order {
    /// All of them (the default): one record of a partition at a time, in
    /// offset order, the next starting only after the previous one is
    /// finished (its transaction committed, or it was dead-lettered). A
    /// retry holds the partition.
    #[default]
    Partition,
    /// Those with the same key: records of one partition with different
    /// keys run concurrently, those with the same key in offset order (the
    /// next of a key starts only after the previous one is finished; a
    /// retry holds its key, not the partition). Records without a key
    /// (a null key) are one key among themselves: in offset order, beside
    /// the keyed ones. Keys compare as bytes. Not with
    /// [`offsets_in`](ConsumerBuilder::offsets_in) (refused at build).
    Key,
}

/// A consumer of a Kafka topic; see the [module documentation](self).
pub type KafkaConsumer<D = Json, R = RetryAll> = Consumer<Kafka, D, R>;

/// Configures a [`KafkaConsumer`]; from [`KafkaConsumer::builder`].
pub type KafkaConsumerBuilder<D = Json, R = RetryAll> = ConsumerBuilder<Kafka, D, R>;

/// What a [`KafkaConsumer`] consumes: the client configuration, the topic
/// and the consumer group (the Kafka half of the builder).
pub struct Kafka {
    config: ClientConfig,
    topic: String,
    group: String,
    dead_letter_topic: Option<String>,
    message_id_header: String,
    commit_every: usize,
    commit_interval: Duration,
    revoke_timeout: Duration,
    max_buffered: usize,
    order: Order,
    /// Offsets in the database: the table, or why the store cannot keep
    /// them (reported at build).
    #[cfg(feature = "sqlx")]
    offsets: Option<Result<Arc<dyn offsets::OffsetTable>, String>>,
    /// Commit the offsets to Kafka too (always without offsets in the
    /// database).
    kafka_commits: bool,
    /// Set by `prepare`.
    ready: Option<Arc<Ready>>,
}

/// The validated settings.
struct Ready {
    consumer_config: ClientConfig,
    producer_config: ClientConfig,
    topic: String,
    group: String,
    client_id: String,
    dead_letter_topic: String,
    message_id_header: String,
    commit_every: usize,
    commit_interval: Duration,
    revoke_timeout: Duration,
    max_buffered: usize,
    order: Order,
    /// Offsets in the database: read at each assignment.
    #[cfg(feature = "sqlx")]
    offsets: Option<Arc<dyn offsets::OffsetTable>>,
    kafka_commits: bool,
}

impl fmt::Debug for Kafka {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kafka")
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("commit_every", &self.commit_every)
            .field("commit_interval", &self.commit_interval)
            .field("revoke_timeout", &self.revoke_timeout)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    /// Starts configuring a consumer of `topic` in the consumer group
    /// `group`. `config` is the client's librdkafka configuration
    /// (`bootstrap.servers`, security, tuning such as
    /// `session.timeout.ms`); the consumer sets `group.id` and
    /// `enable.auto.commit=false` itself, and `auto.offset.reset=earliest`
    /// unless `config` says otherwise (a new group reads the topic from its
    /// start).
    pub fn builder(config: ClientConfig, topic: impl Into<String>, group: impl Into<String>) -> KafkaConsumerBuilder {
        ConsumerBuilder::new(Kafka {
            config,
            topic: topic.into(),
            group: group.into(),
            dead_letter_topic: None,
            message_id_header: DEFAULT_MESSAGE_ID_HEADER.into(),
            commit_every: DEFAULT_COMMIT_EVERY,
            commit_interval: DEFAULT_COMMIT_INTERVAL,
            revoke_timeout: DEFAULT_REVOKE_TIMEOUT,
            max_buffered: DEFAULT_MAX_BUFFERED,
            order: Order::Partition,
            #[cfg(feature = "sqlx")]
            offsets: None,
            kafka_commits: true,
            ready: None,
        })
    }
}

impl<D, R> ConsumerBuilder<Kafka, D, R> {
    /// Sets one librdkafka property of the client (`client.id`,
    /// `session.timeout.ms`...), beside those of the configuration given to
    /// [`builder`](KafkaConsumer::builder).
    pub fn client_config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.broker.config.set(key, value);
        self
    }

    /// The dead-letter topic (default `"<topic>.dlq"`). It must exist (the
    /// consumer checks at connection).
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.broker.dead_letter_topic = Some(topic.into());
        self
    }

    /// The header holding a record's message id, reported as
    /// [`DeliveryInfo::message_id`](super::DeliveryInfo::message_id)
    /// (default [`DEFAULT_MESSAGE_ID_HEADER`]).
    pub fn message_id_header(mut self, header: impl Into<String>) -> Self {
        self.broker.message_id_header = header.into();
        self
    }

    /// Commits the offsets once `records` records were finished since the
    /// last commit (at least 1; default [`DEFAULT_COMMIT_EVERY`]).
    pub fn commit_every(mut self, records: usize) -> Self {
        self.broker.commit_every = records;
        self
    }

    /// Commits the offsets of finished records at most `interval` after
    /// they finished (default [`DEFAULT_COMMIT_INTERVAL`]).
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.broker.commit_interval = interval;
        self
    }

    /// How long the handlers of revoked partitions get to finish before
    /// the partitions are released (default [`DEFAULT_REVOKE_TIMEOUT`]).
    /// Keep it well under the group's `max.poll.interval.ms` and rebalance
    /// timeout: the group waits for it.
    pub fn revoke_timeout(mut self, timeout: Duration) -> Self {
        self.broker.revoke_timeout = timeout;
        self
    }

    /// Keeps the offsets in the database (the mode no other Kafka client
    /// offers): each record's handler runs in a transaction that the
    /// consumer opens on `store`, which the `#[idempotent]` handlers on
    /// that store join, and that transaction also stores the partition's
    /// next offset in the store's Kafka offsets table (created by its
    /// `migrate()`, default
    /// [`DEFAULT_KAFKA_OFFSETS_TABLE`](crate::store::DEFAULT_KAFKA_OFFSETS_TABLE):
    /// one row per group, topic and partition). When the group assigns it
    /// partitions, the consumer starts each at its stored offset (at the
    /// group's committed offset, or `auto.offset.reset`, for one with no
    /// row yet). A record is then applied once even without a marker: a
    /// restart, a crash or a rebalance resumes exactly after the last
    /// committed effect, and the markers only catch duplicates produced
    /// upstream (the same message published twice).
    ///
    /// A stored offset never moves backwards: the transaction of the record
    /// at offset `o` moves it to `o + 1` only if it is at most `o`. A
    /// transaction that finds it past `o` (a revoked consumer's handler that
    /// outlived the [revoke timeout](Self::revoke_timeout), whose partition's
    /// new owner committed the record meanwhile) is rolled back with its
    /// effect, and the record settled as a duplicate. A dead-lettered record
    /// moves the offset in a transaction of its own, after its dead letter
    /// was produced; a failure of that write (a dropped connection, a
    /// failover) is tried again by itself, after the retry backoff, and the
    /// record's handler does not run again (a record handed back or fetched
    /// again meanwhile is recognised by its partition and offset). Only a
    /// consumer that stops before the write succeeds leaves the record to
    /// be handled again after a restart. With
    /// [`batch`](ConsumerBuilder::batch), the batch's transaction (begun on
    /// this `store`) stores each partition's offset past its members that
    /// returned `Ok`.
    ///
    /// The offsets are still committed to Kafka after the transactions, as
    /// a hint for tools that show a group's lag (see
    /// [`kafka_commits`](Self::kafka_commits)); the database is what the
    /// consumer starts from.
    ///
    /// `store` is `PgStore`, `MySqlStore` or `SqliteStore` ([`OffsetStore`]);
    /// others do not compile. A partitioned `PgStore` is refused at build,
    /// as are a group or topic longer than 255 bytes.
    ///
    /// ```compile_fail
    /// # use idempotent_runtime::{MemoryStore, kafka::KafkaConsumer, rdkafka::ClientConfig};
    /// // The memory store has no transaction to keep the offsets in.
    /// let _ = KafkaConsumer::builder(ClientConfig::new(), "payments", "payment-service")
    ///     .offsets_in(MemoryStore::new());
    /// ```
    #[cfg(feature = "sqlx")]
    pub fn offsets_in<S: OffsetStore>(mut self, store: S) -> Self {
        self.broker.offsets = Some(store.offset_table(&self.broker.group, &self.broker.topic));
        self
    }

    /// Whether the consumer commits the offsets of finished records to
    /// Kafka (default `true`). Only with [`offsets_in`](Self::offsets_in),
    /// where the database holds the offsets and Kafka's are a hint for
    /// monitoring: `false` saves the commits (and a group's lag then shows
    /// its whole topic). Without offsets in the database the consumer needs
    /// them, and refuses `false` at build.
    pub fn kafka_commits(mut self, commit: bool) -> Self {
        self.broker.kafka_commits = commit;
        self
    }

    /// Most records fetched but not started, per partition, before the
    /// partition's fetching pauses (at least 1; default
    /// [`DEFAULT_MAX_BUFFERED`]); it resumes below half. With
    /// [`Order::Key`] it is also how far a partition's other keys get
    /// ahead of a key that is held (a slow record, a retry waiting): its
    /// records stay buffered, and the partition pauses once `records` wait.
    pub fn max_buffered(mut self, records: usize) -> Self {
        self.broker.max_buffered = records;
        self
    }

    /// Which records of one partition run one after the other (default
    /// [`Order::Partition`]: all of them). [`Order::Key`] runs a
    /// partition's records with different keys concurrently, up to the
    /// consumer's [concurrency](ConsumerBuilder::concurrency) (partitions
    /// take turns) and [`max_buffered`](Self::max_buffered) records
    /// buffered behind a held key, each key's records in offset order;
    /// a [batch](ConsumerBuilder::batch) may then take several records of
    /// one partition (different keys). The committed offset is still the
    /// partition's lowest offset not finished, so it never passes a record
    /// still running or waiting for its retry: records of other keys
    /// finished after it are delivered again after a crash or a rebalance,
    /// and the idempotent handler skips them.
    ///
    /// Refused at build with [`offsets_in`](Self::offsets_in): the
    /// database keeps one next offset per partition, moved by each
    /// record's transaction, and records finishing out of order would move
    /// it past one still running (whose effect would then never be
    /// applied after a restart), or leave finished records below it to be
    /// applied again without a marker to catch them.
    pub fn order(mut self, order: Order) -> Self {
        self.broker.order = order;
        self
    }
}

impl Broker for Kafka {
    const NAME: &'static str = "kafka";
    type Session = Session;

    fn prepare(&mut self, options: &mut ConsumerOptions) -> Result<(), ConsumerError> {
        for (what, value) in [("topic", &self.topic), ("group", &self.group)] {
            if value.is_empty() {
                return Err(ConsumerError::Config(format!("the {what} is empty")));
            }
        }
        if self.config.get("bootstrap.servers").is_none_or(str::is_empty) {
            return Err(ConsumerError::Config(
                "the client configuration has no `bootstrap.servers`".into(),
            ));
        }
        let dead_letter_topic = self
            .dead_letter_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.topic));
        if dead_letter_topic == self.topic {
            return Err(ConsumerError::Config(
                "the dead-letter topic is the consumed topic".into(),
            ));
        }
        if self.commit_every == 0 {
            return Err(ConsumerError::Config("commit_every must be at least 1".into()));
        }
        if self.max_buffered == 0 {
            return Err(ConsumerError::Config("max_buffered must be at least 1".into()));
        }
        if self.commit_interval.is_zero() {
            return Err(ConsumerError::Config("commit_interval must be longer than zero".into()));
        }
        if self.config.get("enable.auto.commit").is_some_and(|v| v == "true") {
            return Err(ConsumerError::Config(
                "`enable.auto.commit=true`: the consumer commits the offsets of finished records itself; leave it \
                 unset"
                    .into(),
            ));
        }
        #[cfg(feature = "sqlx")]
        let offsets = match self.offsets.clone() {
            Some(Ok(_)) if self.order == Order::Key => {
                return Err(ConsumerError::Config(
                    "order(Order::Key) with offsets_in(store): the database keeps one next offset per partition, \
                     and records of different keys finishing out of order would move it past records still running; \
                     keep offsets in the database with Order::Partition (the default), or Kafka's commits with \
                     Order::Key"
                        .into(),
                ));
            }
            Some(Ok(table)) => {
                for (what, value) in [("group", &self.group), ("topic", &self.topic)] {
                    if value.len() > 255 {
                        return Err(ConsumerError::Config(format!(
                            "the {what} is longer than 255 bytes: the offsets table cannot hold it"
                        )));
                    }
                }
                options.offsets = Some(super::options::OffsetsMode(Arc::clone(&table)));
                Some(table)
            }
            Some(Err(why)) => return Err(ConsumerError::Config(why)),
            None => None,
        };
        #[cfg(not(feature = "sqlx"))]
        let _ = options;
        #[cfg(feature = "sqlx")]
        let in_database = offsets.is_some();
        #[cfg(not(feature = "sqlx"))]
        let in_database = false;
        if !self.kafka_commits && !in_database {
            return Err(ConsumerError::Config(
                "kafka_commits(false) without offsets_in(store): the consumer would keep no offsets at all".into(),
            ));
        }
        let client_id = self
            .config
            .get("client.id")
            .map_or_else(default_client_id, str::to_owned);
        let mut consumer_config = self.config.clone();
        consumer_config
            .set("group.id", &self.group)
            .set("client.id", &client_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false");
        if consumer_config.get("auto.offset.reset").is_none() {
            consumer_config.set("auto.offset.reset", "earliest");
        }
        let mut producer_config = self.config.clone();
        producer_config
            .set("client.id", format!("{client_id}-dlq"))
            .set("enable.idempotence", "true");
        for consumer_only in CONSUMER_ONLY {
            producer_config.remove(consumer_only);
        }
        self.ready = Some(Arc::new(Ready {
            consumer_config,
            producer_config,
            topic: self.topic.clone(),
            group: self.group.clone(),
            client_id,
            dead_letter_topic,
            message_id_header: self.message_id_header.clone(),
            commit_every: self.commit_every,
            commit_interval: self.commit_interval,
            revoke_timeout: self.revoke_timeout,
            max_buffered: self.max_buffered,
            order: self.order,
            #[cfg(feature = "sqlx")]
            offsets,
            kafka_commits: self.kafka_commits,
        }));
        Ok(())
    }

    fn source(&self) -> String {
        format!("{}/{}", self.topic, self.group)
    }

    /// The topic, read by a consumer group as this client.
    fn messaging(&self) -> Messaging {
        let client_id = self
            .ready
            .as_ref()
            .map(|ready| ready.client_id.clone())
            .or_else(|| self.config.get("client.id").map(str::to_owned));
        let messaging = Messaging::new(self.topic.clone()).consumer_group(self.group.clone());
        match client_id {
            Some(id) => messaging.client_id(id),
            None => messaging,
        }
    }

    async fn connect(&self, _options: &ConsumerOptions) -> Result<Session, Connect> {
        let ready = self
            .ready
            .clone()
            .ok_or_else(|| Connect::Fatal(ConsumerError::Config("the consumer was not built".into())))?;
        let producer: FutureProducer = ready
            .producer_config
            .create()
            .map_err(|err| Connect::Fatal(ConsumerError::Config(format!("the dead-letter producer: {err}"))))?;
        let shared = Arc::new(Shared {
            ready: Arc::clone(&ready),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            wake: Notify::new(),
            producer,
            alive: AtomicBool::new(true),
            #[cfg(feature = "sqlx")]
            runtime: tokio::runtime::Handle::current(),
        });
        let context = Context {
            shared: Arc::clone(&shared),
        };
        let consumer: BaseConsumer<Context> = ready
            .consumer_config
            .create_with_context(context)
            .map_err(|err| Connect::Fatal(ConsumerError::Config(format!("the Kafka consumer: {err}"))))?;
        // Metadata requests block: off the runtime's threads.
        let consumer = tokio::task::spawn_blocking(move || check_topics(consumer))
            .await
            .map_err(|err| Connect::Failed(format!("the metadata check did not finish: {err}")))??;
        consumer
            .subscribe(&[ready.topic.as_str()])
            .map_err(|err| Connect::Fatal(ConsumerError::Kafka(err)))?;
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("kafka-{}", ready.group))
            .spawn(move || poll_loop(consumer, &thread_shared))
            .map_err(|err| Connect::Failed(format!("cannot start the consumer's thread: {err}")))?;
        // Dropped (the thread then leaves the group) if this future is.
        let session = Session {
            shared: Arc::clone(&shared),
            thread: Some(thread),
            cursor: None,
        };
        // The group's first assignment: the consumer is connected once it
        // has its partitions (joining takes seconds; the idle time of
        // `stop_when_idle` counts from here).
        let deadline = Instant::now() + JOIN_WAIT;
        loop {
            {
                let state = shared.lock();
                if state.joined || state.lost.is_some() {
                    break;
                }
            }
            if tokio::time::timeout_at(deadline, shared.wake.notified()).await.is_err() {
                tracing::warn!(
                    target: TRACING_TARGET,
                    topic = %ready.topic,
                    group = %ready.group,
                    "no partition assignment yet: consuming once the group assigns partitions"
                );
                break;
            }
        }
        tracing::info!(
            target: TRACING_TARGET,
            topic = %ready.topic,
            group = %ready.group,
            client_id = %ready.client_id,
            "joined the consumer group"
        );
        Ok(session)
    }
}

/// `idempotent-{host}-{pid}-{random}`: unique per consumer instance.
fn default_client_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "consumer".into());
    let random = std::hash::RandomState::new().build_hasher().finish();
    format!("idempotent-{host}-{}-{:08x}", std::process::id(), random & 0xffff_ffff)
}

/// Checks that the topic and the dead-letter topic exist (a consumer of a
/// missing topic would wait forever, and a missing dead-letter topic would
/// refuse every dead letter).
fn check_topics(consumer: BaseConsumer<Context>) -> Result<BaseConsumer<Context>, Connect> {
    let ready = Arc::clone(&consumer.context().shared.ready);
    for (what, topic) in [("topic", &ready.topic), ("dead-letter topic", &ready.dead_letter_topic)] {
        let metadata = consumer
            .fetch_metadata(Some(topic), METADATA_TIMEOUT)
            .map_err(|err| Connect::Failed(format!("Kafka metadata of `{topic}`: {err}")))?;
        let found = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic.as_str())
            .filter(|t| t.error().is_none() && !t.partitions().is_empty());
        if found.is_none() {
            return Err(Connect::Fatal(ConsumerError::Config(format!(
                "the {what} `{topic}` does not exist (create it, with as many partitions as consumers you will run)"
            ))));
        }
    }
    Ok(consumer)
}

/// A record, as the consumer keeps it.
#[derive(Clone)]
struct Record {
    offset: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

/// A record handed back to run again (retry, outage, release).
struct Waiting {
    record: Record,
    attempt: u32,
    at: Instant,
}

/// One assigned partition.
struct Part {
    /// Which assignment it belongs to: a delivery of an earlier one is no
    /// longer current.
    epoch: u64,
    /// Fetched, not started, in offset order.
    queue: VecDeque<Record>,
    /// Handed back, to run again before anything after them in their lane
    /// (each holds its lane meanwhile).
    waiting: Vec<Waiting>,
    /// The offsets of its records in flight (started, not settled).
    running: BTreeSet<i64>,
    /// The lanes with a record started and not finished (running or
    /// handed back): nothing else of them starts.
    lanes: HashSet<Lane>,
    /// Being revoked: nothing more starts.
    revoking: bool,
    /// The highest offset finished (acknowledged or dead-lettered).
    last_finished: Option<i64>,
    /// What was committed last.
    committed: Option<i64>,
    /// Its fetching is paused (too much buffered).
    paused: bool,
    /// Offsets in the database: the offset it was started at, from its
    /// stored row, until its first record arrives (a record before it
    /// means the log ends before the stored offset: see `held`).
    expect_from: Option<i64>,
    /// Held: its log ends before its stored offset (the broker moved the
    /// fetch back), so nothing of it is handled in this assignment.
    held: bool,
}

/// The records of a partition that must run one after the other: all of
/// them ([`Order::Partition`], one lane, `None`), or those with the same
/// key ([`Order::Key`]; the records without a key share the lane `None`).
type Lane = Option<Vec<u8>>;

impl Part {
    /// A partition just assigned (assignment `epoch`), with nothing
    /// fetched; `expect_from`: its offset stored in the database, if any.
    fn new(epoch: u64, expect_from: Option<i64>) -> Part {
        Part {
            epoch,
            queue: VecDeque::new(),
            waiting: Vec::new(),
            running: BTreeSet::new(),
            lanes: HashSet::new(),
            revoking: false,
            last_finished: None,
            committed: None,
            paused: false,
            expect_from,
            held: false,
        }
    }

    /// Its offset to commit, once a record of it finished: its lowest
    /// offset not finished (buffered, running or handed back), or past its
    /// last finished record when none is left. Records fetched later have
    /// higher offsets, so every record below it is finished, whatever the
    /// order they finished in.
    fn commit_offset(&self) -> Option<i64> {
        let past_last = self.last_finished?.saturating_add(1);
        let lowest_unfinished = [
            self.queue.front().map(|record| record.offset),
            self.running.first().copied(),
            self.waiting.iter().map(|waiting| waiting.record.offset).min(),
        ]
        .into_iter()
        .flatten()
        .min();
        Some(lowest_unfinished.map_or(past_last, |lowest| lowest.min(past_last)))
    }

    /// Its offset to commit when it differs from the one committed last.
    fn to_commit(&self) -> Option<i64> {
        self.commit_offset().filter(|next| Some(*next) != self.committed)
    }
}

#[derive(Default)]
struct State {
    parts: BTreeMap<i32, Part>,
    epochs: u64,
    /// Records finished since the last commit.
    finished_since_commit: usize,
    /// The session stopped taking records.
    stopping: bool,
    /// The session is closing: the thread commits and leaves the group.
    closing: bool,
    /// A fatal client error.
    lost: Option<String>,
    /// The group assigned partitions (possibly none) at least once.
    joined: bool,
    /// Offsets in the database: the offsets the partitions of the
    /// assignment under way start at (from their stored rows).
    starts: BTreeMap<i32, i64>,
}

/// What the session, its deliveries and its thread share.
struct Shared {
    ready: Arc<Ready>,
    state: Mutex<State>,
    /// Signalled when a record is finished or handed back (the revocation
    /// waits on it).
    changed: Condvar,
    /// Wakes the session: a record arrived, a partition became free.
    wake: Notify,
    producer: FutureProducer,
    alive: AtomicBool,
    /// The runtime the consumer runs on: the consumer's thread reads the
    /// stored offsets on it (offsets in the database).
    #[cfg(feature = "sqlx")]
    runtime: tokio::runtime::Handle,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind: go on.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The client's context: serves the group's rebalances and forwards
/// librdkafka's logs to `tracing`.
struct Context {
    shared: Arc<Shared>,
}

impl ClientContext for Context {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
                tracing::error!(target: TRACING_TARGET, facility = fac, "librdkafka: {log_message}");
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: TRACING_TARGET, facility = fac, "librdkafka: {log_message}");
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: TRACING_TARGET, facility = fac, "librdkafka: {log_message}");
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: TRACING_TARGET, facility = fac, "librdkafka: {log_message}");
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: TRACING_TARGET, error = %error, "librdkafka: {reason}");
    }
}

impl ConsumerContext for Context {
    /// librdkafka's rebalance, as rdkafka's default runs it (`pre_rebalance`,
    /// the assignment, `post_rebalance`), with partitions assigned at their
    /// offsets stored in the database (offsets in the database).
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, list: &mut TopicPartitionList) {
        let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                #[cfg(feature = "sqlx")]
                start_at_stored_offsets(consumer, &self.shared, list);
                self.pre_rebalance(consumer, &Rebalance::Assign(list));
                let assigned = if cooperative {
                    consumer.incremental_assign(list)
                } else {
                    consumer.assign(list)
                };
                if let Err(err) = assigned {
                    tracing::warn!(target: TRACING_TARGET, error = %err, "assigning the partitions failed");
                }
                self.post_rebalance(consumer, &Rebalance::Assign(list));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.pre_rebalance(consumer, &Rebalance::Revoke(list));
                let unassigned = if cooperative {
                    consumer.incremental_unassign(list)
                } else {
                    consumer.unassign()
                };
                if let Err(err) = unassigned {
                    tracing::warn!(target: TRACING_TARGET, error = %err, "releasing the partitions failed");
                }
                self.post_rebalance(consumer, &Rebalance::Revoke(list));
            }
            other => {
                let rebalance = Rebalance::Error(KafkaError::Rebalance(other.into()));
                self.pre_rebalance(consumer, &rebalance);
                self.post_rebalance(consumer, &rebalance);
            }
        }
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(list) => {
                let partitions: Vec<i32> = list
                    .elements_for_topic(&self.shared.ready.topic)
                    .iter()
                    .map(|e| e.partition())
                    .collect();
                revoke(consumer, &self.shared, &partitions);
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(err) => {
                tracing::warn!(target: TRACING_TARGET, error = %err, "rebalance error");
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let mut state = self.shared.lock();
            let mut assigned = Vec::new();
            for element in list.elements_for_topic(&self.shared.ready.topic) {
                let partition = element.partition();
                if state.parts.contains_key(&partition) {
                    continue;
                }
                state.epochs += 1;
                let epoch = state.epochs;
                let expect_from = state.starts.remove(&partition);
                state.parts.insert(partition, Part::new(epoch, expect_from));
                assigned.push(partition);
            }
            state.joined = true;
            state.starts.clear();
            drop(state);
            // librdkafka keeps a partition paused over a rebalance: one this
            // member paused (too much buffered) and is given again would
            // never be fetched. A new assignment has nothing buffered.
            for partition in &assigned {
                set_paused(consumer, &self.shared.ready, *partition, false);
            }
            self.shared.wake.notify_one();
            tracing::info!(target: TRACING_TARGET, topic = %self.shared.ready.topic, ?assigned, "partitions assigned");
        }
    }
}

/// Offsets in the database: sets each partition of the assignment `list`
/// that has a stored offset to start there (the others start at the
/// group's committed offset, or `auto.offset.reset`). Runs on the
/// consumer's thread, inside librdkafka's rebalance: the read runs on the
/// consumer's runtime, and the thread waits for it. When the database
/// cannot be read, the partitions start at the group's committed offsets,
/// which are never ahead of the database: records it already has are then
/// handled again, and their transactions, finding the stored offset past
/// them, roll back (no effect twice).
#[cfg(feature = "sqlx")]
fn start_at_stored_offsets(consumer: &BaseConsumer<Context>, shared: &Shared, list: &mut TopicPartitionList) {
    let Some(offsets) = shared.ready.offsets.as_ref() else {
        return;
    };
    let topic = shared.ready.topic.as_str();
    let assigned: Vec<i32> = list.elements_for_topic(topic).iter().map(|e| e.partition()).collect();
    if assigned.is_empty() {
        return;
    }
    let mut failure = String::new();
    for attempt in 1..=READ_OFFSETS_ATTEMPTS {
        let (send, receive) = std::sync::mpsc::channel();
        let table = Arc::clone(offsets);
        shared.runtime.spawn(async move {
            let _ = send.send(table.read().await);
        });
        match receive.recv_timeout(READ_OFFSETS_TIMEOUT) {
            Ok(Ok(stored)) => {
                let mut starts = Vec::new();
                for (partition, next) in stored.into_iter().filter(|(p, _)| assigned.contains(p)) {
                    match list.set_partition_offset(topic, partition, Offset::Offset(next)) {
                        Ok(()) => starts.push((partition, next)),
                        Err(err) => {
                            tracing::warn!(target: TRACING_TARGET, partition, error = %err, "cannot start the partition at its stored offset");
                        }
                    }
                }
                shared.lock().starts = starts.iter().copied().collect();
                for (partition, next) in &starts {
                    check_against_log_end(consumer, shared, *partition, *next);
                }
                tracing::info!(
                    target: TRACING_TARGET,
                    topic,
                    offsets = %offsets.describe(),
                    ?starts,
                    "assigned partitions start at their offsets stored in the database (partition, next offset)"
                );
                return;
            }
            Ok(Err(error)) => failure = error.to_string(),
            Err(_) => failure = format!("no answer within {READ_OFFSETS_TIMEOUT:?}"),
        }
        tracing::warn!(target: TRACING_TARGET, attempt, error = %failure, "reading the stored offsets failed");
        std::thread::sleep(Duration::from_millis(200) * attempt);
    }
    tracing::error!(
        target: TRACING_TARGET,
        topic,
        error = %failure,
        "cannot read the offsets stored in the database: the partitions start at the group's committed offsets; \
         records the database already has roll back as duplicates"
    );
}

/// Offsets in the database: reports a stored offset `next` past the high
/// watermark of `partition` (the offset its next record would get). On
/// Kafka that means the log lost records, was truncated or the topic was
/// created again: the broker answers the fetch at `next` with "out of
/// range", and the consumer holds the partition when its first record comes
/// before `next` (see `hold`). A broker that answers such a fetch with no
/// records instead (Tansu 0.6 does) leaves the records below `next` unread
/// and delivers those from `next` on: this error is then all that tells.
/// Tansu also reports a batch's high watermark short (the batch's first
/// offset + 1), so there a stored offset past it can be a false alarm;
/// the consumer only reports it. Runs inside the rebalance (one metadata
/// request per partition, at most `READ_OFFSETS_TIMEOUT` each).
#[cfg(feature = "sqlx")]
fn check_against_log_end(consumer: &BaseConsumer<Context>, shared: &Shared, partition: i32, next: i64) {
    let ready = &shared.ready;
    match consumer.fetch_watermarks(&ready.topic, partition, READ_OFFSETS_TIMEOUT) {
        Ok((_, high)) if next > high => {
            let table = ready
                .offsets
                .as_ref()
                .map_or_else(|| "the offsets table".to_owned(), |offsets| offsets.describe());
            tracing::error!(
                target: TRACING_TARGET,
                topic = %ready.topic,
                group = %ready.group,
                partition,
                stored_offset = next,
                high_watermark = high,
                "the offset stored in the database is past the partition's high watermark: if the log lost records, \
                 was truncated or the topic was created again, its records below the stored offset are not handled \
                 (on Kafka the consumer holds the partition; a broker that answers the fetch with no records leaves \
                 them unread); correct its row in {table} (delete it to start over, or set its next offset)"
            );
        }
        Ok(_) => {}
        Err(err) => {
            tracing::debug!(target: TRACING_TARGET, partition, error = %err, "cannot read the partition's high watermark");
        }
    }
}

/// Revokes `partitions`: nothing more of them starts, their handlers in
/// flight get the revoke timeout to finish, their finished offsets are
/// committed, and they are forgotten (deliveries still out are no longer
/// current). Runs on the consumer's thread, inside librdkafka's rebalance.
fn revoke(consumer: &BaseConsumer<Context>, shared: &Shared, partitions: &[i32]) {
    let ready = &shared.ready;
    let deadline = std::time::Instant::now() + ready.revoke_timeout;
    let mut state = shared.lock();
    for partition in partitions {
        if let Some(part) = state.parts.get_mut(partition) {
            part.revoking = true;
        }
    }
    loop {
        let busy: Vec<i32> = partitions
            .iter()
            .copied()
            .filter(|p| state.parts.get(p).is_some_and(|part| !part.running.is_empty()))
            .collect();
        let now = std::time::Instant::now();
        // Closing: the consumer's drain already waited for its handlers;
        // those still out were abandoned.
        if busy.is_empty() || state.closing {
            break;
        }
        if now >= deadline {
            tracing::warn!(
                target: TRACING_TARGET,
                topic = %ready.topic,
                partitions = ?busy,
                timeout_ms = u64::try_from(ready.revoke_timeout.as_millis()).unwrap_or(u64::MAX),
                "handlers of revoked partitions outlived the revoke timeout: their records go to the partitions' new \
                 owners (the idempotent handler tells the duplicate)"
            );
            break;
        }
        state = shared
            .changed
            .wait_timeout(state, deadline - now)
            .map_or_else(|poisoned| poisoned.into_inner().0, |(state, _)| state);
    }
    let mut offsets = TopicPartitionList::new();
    for partition in partitions {
        if let Some(part) = state.parts.remove(partition)
            && let Some(next) = part.to_commit()
            && let Err(err) = offsets.add_partition_offset(&ready.topic, *partition, Offset::Offset(next))
        {
            tracing::warn!(target: TRACING_TARGET, error = %err, partition, "cannot list the offset to commit");
        }
    }
    drop(state);
    if offsets.count() > 0 && ready.kafka_commits {
        match consumer.commit(&offsets, CommitMode::Sync) {
            Ok(()) => {
                tracing::info!(target: TRACING_TARGET, topic = %ready.topic, ?partitions, "offsets of revoked partitions committed");
            }
            Err(err) => {
                tracing::warn!(
                    target: TRACING_TARGET,
                    topic = %ready.topic,
                    error = %err,
                    "committing the offsets of revoked partitions failed: their new owners receive those records again"
                );
            }
        }
    }
    tracing::info!(target: TRACING_TARGET, topic = %ready.topic, ?partitions, "partitions revoked");
    shared.wake.notify_one();
}

/// The consumer's thread: polls librdkafka (fetching, the group's
/// heartbeats and rebalances), buffers records per partition, pauses and
/// resumes fetching, and commits; on close, commits and leaves the group.
fn poll_loop(consumer: BaseConsumer<Context>, shared: &Shared) {
    let ready = &shared.ready;
    let mut last_commit = std::time::Instant::now();
    loop {
        if shared.lock().closing {
            break;
        }
        match consumer.poll(POLL_EVERY) {
            Some(Ok(message)) => {
                let record = Record {
                    offset: message.offset(),
                    key: message.key().map(<[u8]>::to_vec),
                    value: message.payload().map(<[u8]>::to_vec),
                    headers: message
                        .headers()
                        .map(|headers| {
                            headers
                                .iter()
                                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                                .collect()
                        })
                        .unwrap_or_default(),
                };
                let partition = message.partition();
                let mut state = shared.lock();
                let mut pause = false;
                if let Some(part) = state.parts.get_mut(&partition).filter(|part| !part.revoking) {
                    if let Some(from) = part.expect_from.take()
                        && record.offset < from
                    {
                        hold(ready, partition, part, from, record.offset);
                    }
                    if part.held {
                        pause = !part.paused;
                        part.paused = true;
                    } else {
                        part.queue.push_back(record);
                        if part.queue.len() >= ready.max_buffered && !part.paused {
                            part.paused = true;
                            pause = true;
                        }
                    }
                }
                drop(state);
                shared.wake.notify_one();
                if pause {
                    set_paused(&consumer, ready, partition, true);
                }
            }
            Some(Err(KafkaError::MessageConsumptionFatal(code))) => {
                let why = format!("fatal Kafka client error: {code}");
                tracing::error!(target: TRACING_TARGET, topic = %ready.topic, error = %why, "the Kafka client failed");
                shared.lock().lost = Some(why);
                shared.alive.store(false, Ordering::Relaxed);
                shared.wake.notify_one();
                break;
            }
            Some(Err(err)) => {
                tracing::warn!(target: TRACING_TARGET, topic = %ready.topic, error = %err, "Kafka consumer error (librdkafka retries)");
            }
            None => {}
        }
        // Resume what drained below half.
        let resume: Vec<i32> = {
            let mut state = shared.lock();
            state
                .parts
                .iter_mut()
                .filter(|(_, part)| part.paused && !part.held && part.queue.len() <= ready.max_buffered / 2)
                .map(|(partition, part)| {
                    part.paused = false;
                    *partition
                })
                .collect()
        };
        for partition in resume {
            set_paused(&consumer, ready, partition, false);
        }
        let due = {
            let state = shared.lock();
            state.finished_since_commit >= ready.commit_every
                || (state.finished_since_commit > 0 && last_commit.elapsed() >= ready.commit_interval)
        };
        if due {
            commit_finished(&consumer, shared);
            last_commit = std::time::Instant::now();
        }
    }
    // Closing: what finished is committed, then dropping the consumer
    // leaves the group (its revocation runs `revoke`).
    commit_finished(&consumer, shared);
    drop(consumer);
    shared.alive.store(false, Ordering::Relaxed);
    tracing::debug!(target: TRACING_TARGET, topic = %ready.topic, "left the consumer group");
}

/// Offsets in the database: holds `partition`, whose first record came at
/// `offset`, before the offset `from` it was started at (its stored row).
/// librdkafka moves a fetch back only when the broker answers that the
/// offset is out of range (`auto.offset.reset`): the partition's log now
/// ends before `from`, so it lost records, was truncated or was recreated
/// (Kafka keeps its log over restarts; a test broker with memory storage
/// does not). Its records below `from` would each be taken for one already
/// applied (the stored offset is past them) and skipped without a trace,
/// so nothing of the partition is handled: its fetching stays paused and
/// its records are dropped until the stored offset is corrected and the
/// partition assigned again. Other partitions go on.
fn hold(ready: &Ready, partition: i32, part: &mut Part, from: i64, offset: i64) {
    part.held = true;
    #[cfg(feature = "sqlx")]
    let table = ready
        .offsets
        .as_ref()
        .map_or_else(|| "the offsets table".to_owned(), |offsets| offsets.describe());
    #[cfg(not(feature = "sqlx"))]
    let table = "the offsets table".to_owned();
    tracing::error!(
        target: TRACING_TARGET,
        topic = %ready.topic,
        group = %ready.group,
        partition,
        stored_offset = from,
        fetched_offset = offset,
        "the offset stored in the database is past the end of the partition's log (the broker moved the fetch back \
         to an earlier offset: the log was lost, truncated or the topic recreated): its records below the stored \
         offset would be skipped as already applied, so the consumer holds the partition and handles nothing of it; \
         correct its row in {table} (delete it to start over, or set its next offset) and restart the consumer"
    );
}

fn set_paused(consumer: &BaseConsumer<Context>, ready: &Ready, partition: i32, pause: bool) {
    let mut list = TopicPartitionList::new();
    list.add_partition(&ready.topic, partition);
    let done = if pause {
        consumer.pause(&list)
    } else {
        consumer.resume(&list)
    };
    if let Err(err) = done {
        tracing::warn!(target: TRACING_TARGET, partition, pause, error = %err, "cannot pause or resume fetching");
    }
}

/// Commits each partition's offset up to its last finished record.
fn commit_finished(consumer: &BaseConsumer<Context>, shared: &Shared) {
    let ready = &shared.ready;
    let mut offsets = TopicPartitionList::new();
    let mut listed = Vec::new();
    {
        let mut state = shared.lock();
        state.finished_since_commit = 0;
        for (partition, part) in &state.parts {
            if let Some(next) = part.to_commit()
                && offsets
                    .add_partition_offset(&ready.topic, *partition, Offset::Offset(next))
                    .is_ok()
            {
                listed.push((*partition, next));
            }
        }
    }
    if listed.is_empty() || !ready.kafka_commits {
        return;
    }
    match consumer.commit(&offsets, CommitMode::Sync) {
        Ok(()) => {
            let mut state = shared.lock();
            for (partition, next) in listed {
                if let Some(part) = state.parts.get_mut(&partition) {
                    part.committed = Some(next);
                }
            }
            drop(state);
            tracing::debug!(target: TRACING_TARGET, topic = %ready.topic, "offsets committed");
        }
        Err(err) => {
            // Tried again at the next one.
            shared.lock().finished_since_commit = ready.commit_every;
            tracing::warn!(target: TRACING_TARGET, topic = %ready.topic, error = %err, "committing offsets failed");
        }
    }
}

/// A member of the consumer group, with its thread.
pub struct Session {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The partition served last (partitions take turns).
    cursor: Option<i32>,
}

impl Session {
    /// The next record that may start, partitions taking turns: in a
    /// partition, a handed-back record that is due first (it holds its
    /// lane), then the first buffered record whose lane is free; or when
    /// the earliest handed-back record is due.
    fn take(&mut self) -> Result<Option<Delivery>, Option<Instant>> {
        let shared = &self.shared;
        let order = shared.ready.order;
        let now = Instant::now();
        let mut state = shared.lock();
        let mut earliest: Option<Instant> = None;
        let after = self.cursor.unwrap_or(i32::MIN);
        let partitions: Vec<i32> = state
            .parts
            .range(after.saturating_add(1)..)
            .chain(state.parts.range(..=after))
            .map(|(p, _)| *p)
            .collect();
        for partition in partitions {
            let Some(part) = state.parts.get_mut(&partition) else {
                continue;
            };
            if part.revoking {
                continue;
            }
            let due = part
                .waiting
                .iter()
                .enumerate()
                .filter(|(_, waiting)| waiting.at <= now)
                .min_by_key(|(_, waiting)| waiting.record.offset)
                .map(|(index, _)| index);
            let taken = if let Some(index) = due {
                let waiting = part.waiting.swap_remove(index);
                Some((waiting.record, waiting.attempt))
            } else {
                if let Some(at) = part.waiting.iter().map(|waiting| waiting.at).min() {
                    earliest = Some(earliest.map_or(at, |e| e.min(at)));
                }
                let free = match order {
                    // One lane: only the head, once nothing is in flight.
                    Order::Partition => (!part.lanes.contains(&None) && !part.queue.is_empty()).then_some(0),
                    Order::Key => part.queue.iter().position(|record| !part.lanes.contains(&record.key)),
                };
                free.and_then(|index| part.queue.remove(index))
                    .map(|record| (record, 1))
            };
            if let Some((record, attempt)) = taken {
                let lane = match order {
                    Order::Partition => None,
                    Order::Key => record.key.clone(),
                };
                part.running.insert(record.offset);
                part.lanes.insert(lane.clone());
                let epoch = part.epoch;
                drop(state);
                self.cursor = Some(partition);
                return Ok(Some(Delivery::new(
                    Arc::clone(shared),
                    partition,
                    epoch,
                    lane,
                    record,
                    attempt,
                )));
            }
        }
        Err(earliest)
    }
}

impl pipeline::Session for Session {
    type Delivery = Delivery;

    async fn next(&mut self, _room: usize) -> Next<Delivery> {
        loop {
            {
                let mut state = self.shared.lock();
                if let Some(why) = state.lost.take() {
                    return Next::Lost(why);
                }
                if state.stopping {
                    return Next::End;
                }
            }
            let earliest = match self.take() {
                Ok(Some(delivery)) => return Next::Delivery(delivery),
                Ok(None) => None,
                Err(earliest) => earliest,
            };
            let due = async {
                match earliest {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.shared.wake.notified() => {}
                () = due => {}
            }
        }
    }

    async fn stop(&mut self) {
        // Records fetched and not started are not handled: their offsets
        // are not committed, so the group's next owner gets them.
        self.shared.lock().stopping = true;
    }

    async fn close(mut self) {
        self.shared.lock().closing = true;
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                tracing::warn!(target: TRACING_TARGET, "the Kafka consumer's thread did not end cleanly");
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The thread commits, leaves the group and ends by itself.
        self.shared.lock().closing = true;
    }
}

/// One record of an assigned partition.
pub struct Delivery {
    shared: Arc<Shared>,
    partition: i32,
    epoch: u64,
    /// The lane it holds until it is finished.
    lane: Lane,
    record: Record,
    meta: Meta,
}

impl Delivery {
    fn new(shared: Arc<Shared>, partition: i32, epoch: u64, lane: Lane, record: Record, attempt: u32) -> Delivery {
        let ready = &shared.ready;
        let message_id = record
            .headers
            .iter()
            .find(|(name, _)| *name == ready.message_id_header)
            .and_then(|(_, value)| String::from_utf8(value.clone()?).ok());
        let meta = Meta {
            attempt,
            redelivered: attempt > 1,
            message_id,
            // Records are handed back in this process, never lost.
            last: false,
            position: format!("partition={partition} offset={}", record.offset),
            destination: None,
            routing_key: None,
            delivery_tag: None,
            partition: Some(partition),
            offset: Some(record.offset),
            message_key: record
                .key
                .as_deref()
                .map(|key| String::from_utf8_lossy(key).into_owned()),
        };
        Delivery {
            shared,
            partition,
            epoch,
            lane,
            record,
            meta,
        }
    }

    /// Runs `settle` on this delivery's partition while it is still this
    /// assignment's, once the record is no longer in flight.
    fn settle(&self, settle: impl FnOnce(&mut Part)) -> Result<(), Settle> {
        let mut state = self.shared.lock();
        let Some(part) = state
            .parts
            .get_mut(&self.partition)
            .filter(|part| part.epoch == self.epoch)
        else {
            return Err(Settle::Lost(format!(
                "partition {} was revoked: its new owner receives the record at offset {} again",
                self.partition, self.record.offset
            )));
        };
        part.running.remove(&self.record.offset);
        settle(part);
        drop(state);
        self.shared.changed.notify_all();
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Finished: its lane is free, and the partition's offset may be
    /// committed past it once nothing before it is left unfinished.
    fn finish(&self) -> Result<(), Settle> {
        let offset = self.record.offset;
        let mut finished = false;
        let result = self.settle(|part| {
            part.lanes.remove(&self.lane);
            part.last_finished = Some(part.last_finished.map_or(offset, |last| last.max(offset)));
            finished = true;
        });
        if finished {
            let mut state = self.shared.lock();
            state.finished_since_commit = state.finished_since_commit.saturating_add(1);
        }
        result
    }

    /// Handed back, to run as `attempt` after `delay`, before anything
    /// after it in its lane (which it keeps).
    fn hand_back(&self, attempt: u32, delay: Duration) -> Result<(), Settle> {
        let record = self.record.clone();
        self.settle(|part| {
            part.waiting.push(Waiting {
                record,
                attempt,
                at: Instant::now() + delay,
            });
        })
    }
}

impl pipeline::Delivery for Delivery {
    fn body(&self) -> &[u8] {
        self.record.value.as_deref().unwrap_or_default()
    }

    fn malformed(&self) -> Option<String> {
        self.record.value.is_none().then(|| {
            format!(
                "the record at partition {} offset {} has no value (a tombstone)",
                self.partition, self.record.offset
            )
        })
    }

    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn is_current(&self) -> bool {
        self.shared.alive.load(Ordering::Relaxed)
            && self
                .shared
                .lock()
                .parts
                .get(&self.partition)
                .is_some_and(|part| part.epoch == self.epoch)
    }

    /// The topic, the partition and the record's offset: the same on every
    /// delivery of the record (a hand back, or a fetch again from the
    /// committed offset after a rebalance).
    fn identity(&self) -> Option<String> {
        Some(format!(
            "{} partition={} offset={}",
            self.shared.ready.topic, self.partition, self.record.offset
        ))
    }

    async fn ack(&self) -> Result<(), Settle> {
        self.finish()
    }

    async fn retry(&self, next_attempt: u32, delay: Duration, _shutdown: &CancellationToken) -> Result<(), Settle> {
        self.hand_back(next_attempt, delay)
    }

    async fn dead_letter(&self, letter: &Letter<'_>) -> Result<(), Settle> {
        let ready = &self.shared.ready;
        let mut headers = OwnedHeaders::new();
        for (name, value) in &self.record.headers {
            headers = headers.insert(Header {
                key: name,
                value: value.as_deref(),
            });
        }
        let attempts = letter.attempts.to_string();
        let partition = self.partition.to_string();
        let offset = self.record.offset.to_string();
        for (name, value) in [
            (HEADER_REASON, letter.reason),
            (HEADER_KIND, letter.kind),
            (HEADER_ATTEMPTS, attempts.as_str()),
            (HEADER_SOURCE, letter.source),
            (HEADER_TOPIC, ready.topic.as_str()),
            (HEADER_PARTITION, partition.as_str()),
            (HEADER_OFFSET, offset.as_str()),
        ] {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&ready.dead_letter_topic).headers(headers);
        if let Some(key) = &self.record.key {
            record = record.key(key.as_slice());
        }
        if let Some(value) = &self.record.value {
            record = record.payload(value.as_slice());
        }
        self.shared
            .producer
            .send(record, PRODUCE_TIMEOUT)
            .await
            .map_err(|(err, _)| {
                let why = format!(
                    "producing the dead letter to `{}` failed: {err}",
                    ready.dead_letter_topic
                );
                if possibly_stored(&err) {
                    Settle::Unknown(why)
                } else {
                    Settle::Refused(why)
                }
            })?;
        Ok(())
    }

    /// The record is finished; with offsets in the database, once its
    /// offset is stored (in a transaction of its own). A failed offset
    /// write is tried again by the pipeline, never the handler.
    async fn discard(&self) -> Result<(), Settle> {
        #[cfg(feature = "sqlx")]
        if let Some(offsets) = &self.shared.ready.offsets
            && let Err(error) = offsets.advance_alone(self.partition, self.record.offset).await
        {
            return Err(Settle::Refused(format!(
                "the dead letter was produced, but storing the record's offset in {} failed: {error}",
                offsets.describe()
            )));
        }
        self.finish()
    }

    async fn release(&self, delay: Duration) -> Result<(), Settle> {
        self.hand_back(self.meta.attempt, delay)
    }
}

/// Whether a failed produce of a dead letter may have been written all the
/// same. librdkafka retries a produce by itself until `message.timeout.ms`
/// (`delivery.timeout.ms`); a produce that timed out there (sent, its
/// acknowledgement lost with a connection or not in time), was purged in
/// flight, or was refused after the leader appended it (not enough
/// replicas) may or may not be in the topic: the idempotent producer's
/// deduplication covers its own retries only, not a new produce. Such a
/// failure is [`Settle::Unknown`]: the pipeline produces the dead letter
/// again (a second copy in the dead-letter topic at worst) rather than
/// hand the record back, whose handler would run again for a record that
/// may already be dead-lettered. Any other failure (the record was not
/// queued: a full queue, too large, an unknown topic; or the broker
/// refused it) left nothing written: [`Settle::Refused`].
fn possibly_stored(err: &KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode as Code;
    match err {
        KafkaError::MessageProduction(code) => matches!(
            code,
            Code::MessageTimedOut
                | Code::PurgeInflight
                | Code::RequestTimedOut
                | Code::NetworkException
                | Code::BrokerTransportFailure
                | Code::NotEnoughReplicasAfterAppend
        ),
        // The delivery report never came (the producer went away).
        KafkaError::Canceled => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode as Code};

    use super::{Part, Record, Waiting, possibly_stored};

    fn record(offset: i64) -> Record {
        Record {
            offset,
            key: None,
            value: None,
            headers: Vec::new(),
        }
    }

    fn part() -> Part {
        Part::new(1, None)
    }

    #[test]
    fn the_offset_to_commit_is_the_lowest_unfinished_whatever_finished_after_it() {
        let mut part = part();
        part.running.extend([3, 7]);
        part.queue.extend([record(5), record(8)]);
        assert_eq!(part.commit_offset(), None, "nothing finished yet");
        // 4 and 6 finished: 3 still runs.
        part.last_finished = Some(6);
        assert_eq!(part.commit_offset(), Some(3));
        // 3 finished; 5 (buffered, its key held) is the lowest left.
        part.running.remove(&3);
        assert_eq!(part.commit_offset(), Some(5));
        // 5 waits for its retry.
        part.queue.pop_front();
        part.waiting.push(Waiting {
            record: record(5),
            attempt: 2,
            at: tokio::time::Instant::now(),
        });
        assert_eq!(part.commit_offset(), Some(5));
        // Everything up to 8 finished.
        part.waiting.clear();
        part.running.clear();
        part.queue.clear();
        part.last_finished = Some(8);
        assert_eq!(part.commit_offset(), Some(9));
        part.committed = Some(9);
        assert_eq!(part.to_commit(), None, "already committed");
    }

    #[test]
    fn a_dead_letter_that_timed_out_may_be_stored_one_never_queued_is_not() {
        for code in [
            Code::MessageTimedOut,
            Code::PurgeInflight,
            Code::RequestTimedOut,
            Code::NetworkException,
            Code::BrokerTransportFailure,
            Code::NotEnoughReplicasAfterAppend,
        ] {
            assert!(possibly_stored(&KafkaError::MessageProduction(code)), "{code:?}");
        }
        assert!(possibly_stored(&KafkaError::Canceled));
        for code in [
            Code::QueueFull,
            Code::MessageSizeTooLarge,
            Code::UnknownTopic,
            Code::TopicAuthorizationFailed,
            Code::PurgeQueue,
        ] {
            assert!(!possibly_stored(&KafkaError::MessageProduction(code)), "{code:?}");
        }
    }
}
