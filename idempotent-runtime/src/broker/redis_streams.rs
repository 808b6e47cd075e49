//! Redis Streams consumer (feature `redis-streams`): a consumer group on a
//! stream, `XACK` after the handler's commit, reclaiming what dead
//! consumers left pending, a dead-letter stream, reconnection, graceful
//! shutdown.
//!
//! [`StreamConsumer`] reads a stream as one consumer of a consumer group
//! (`XREADGROUP`), decodes each entry's body field (JSON by default, see
//! [`Decoder`](super::Decoder)), calls the handler, and settles the entry:
//!
//! | handler | what happens |
//! | --- | --- |
//! | `Ok` | the entry is acknowledged (`XACK`), only now (so after the marker's commit) |
//! | `Err`, attempts left and the error retryable | after a backoff, a copy carrying `x-idempotent-attempt: n + 1` is added to the stream and the original acknowledged, in one script |
//! | `Err` on the last attempt, or not retryable ([`RetryPolicy`](super::RetryPolicy)) | the entry is added unchanged to the dead-letter stream with `x-idempotent-reason`, `-kind`, `-attempts` and `-source` fields, and acknowledged, in one script |
//! | a dependency down (the `#[idempotent]` store failed, or [`Verdict::Outage`](super::Verdict::Outage)) | the entry is kept (its idle time reset) and the handler run again after a backoff, without spending an attempt |
//! | undecodable body, or no body field (poison) | dead-lettered at once |
//! | panic | counts as a failed attempt |
//!
//! # Entries
//!
//! An entry is `XADD <stream> * message_id <id> body <bytes>`: the body
//! field (`body` unless [`body_field`](ConsumerBuilder::body_field) says
//! otherwise) holds the message, the optional `message_id` field (see
//! [`message_id_field`](ConsumerBuilder::message_id_field)) is reported as
//! [`DeliveryInfo::message_id`](super::DeliveryInfo::message_id). Other fields are kept on copies and dead
//! letters.
//!
//! # Consumers that die
//!
//! Entries a consumer read and never acknowledged stay pending in the
//! group. Every consumer reclaims (`XAUTOCLAIM`) entries pending longer than
//! [`claim_idle`](ConsumerBuilder::claim_idle) (default 30 s): those of a
//! consumer that died, and its own that it handed back. While an entry is
//! held (its handler runs, its retry or outage backoff waits, its batch
//! runs, commits and settles the others), its idle time is reset every
//! third of `claim_idle`, so a live consumer's work is not taken from it.
//! An entry delivered more than `max_attempts` times (its consumers kept
//! crashing on it) is not processed again: its handler is called only to
//! check whether it was processed (each `#[idempotent]` call claims its key
//! without running its body); it is acknowledged when its effect is
//! committed, dead-lettered otherwise.
//!
//! Every settlement is a script that first checks the entry is still
//! pending for this consumer: a consumer that lost its entry to another
//! (after a long pause, or a lost connection) cannot acknowledge or
//! dead-letter it under the new owner.
//!
//! # Trimming
//!
//! `XACK` does not delete entries: the stream keeps them until it is
//! trimmed. Trim the input stream where it is written (`XADD .. MAXLEN ~
//! n`, or `XTRIM .. MINID`), far enough behind that no consumer group still
//! needs the entries. The dead-letter stream is trimmed to
//! [`dead_letter_max_len`](ConsumerBuilder::dead_letter_max_len) when one
//! is set, and is never trimmed otherwise.
//!
//! # Redis Cluster
//!
//! [`StreamConsumer::cluster_builder`] (feature `redis-cluster`) reads a
//! stream of a Redis Cluster: a stream, its consumer group and its pending
//! entries are one key, so they live in one slot, on one primary, and the
//! settlement scripts touch the stream and the dead-letter stream
//! together: the two must share a hash tag (`{payments}` and
//! `{payments}.dlq`, the default name; the builder refuses names in two
//! slots). One stream is served by one primary: to spread the load over
//! the cluster, write to several streams with different hash tags
//! (`{payments-0}` .. `{payments-7}`, the partition chosen from the
//! message key) and run a consumer per stream.
//!
//! # Connection loss
//!
//! A lost connection (a read or a settlement that fails on it: broken, or
//! no answer within its timeout, as a cluster connection may give while
//! the stream's primary fails over) is made again within the
//! [reconnection policy](ConsumerBuilder::reconnect), and the group created
//! again if Redis lost it. Entries in flight on the lost connection are not
//! settled on the new one; they stay pending, are reclaimed after
//! `claim_idle`, and the idempotent handler recognises the duplicates.
//!
//! ```no_run
//! use idempotent_runtime::broker::shutdown_on_signal;
//! use idempotent_runtime::redis_streams::StreamConsumer;
//!
//! #[derive(serde::Deserialize)]
//! struct PaymentMessage { message_id: String, order_id: String, amount: i64 }
//!
//! # async fn process_payment(_: &PaymentMessage) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = idempotent_runtime::redis::Client::open("redis://127.0.0.1:6379/")?;
//! let consumer = StreamConsumer::builder(client, "payments", "payment-service")
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

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use redis::{AsyncConnectionConfig, Value};
use tokio::time::Instant;

use super::pipeline::{self, Broker, Connect, Letter, Messaging, Meta, Next, Settle};
use super::{
    CancellationToken, ConsumerError, ConsumerOptions, HEADER_ATTEMPT, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, Json, RetryAll,
};
use super::{Consumer, ConsumerBuilder, TRACING_TARGET, sleep_unless_cancelled};
use crate::store::redis_conn::{Lua, RedisConn};

#[cfg(feature = "sqlx")]
pub(crate) mod publisher;

/// Default idle time after which a pending entry is reclaimed.
pub const DEFAULT_CLAIM_IDLE: Duration = Duration::from_secs(30);
/// Default longest wait of one `XREADGROUP ... BLOCK`.
pub const DEFAULT_BLOCK: Duration = Duration::from_secs(2);
/// Field of a dead letter holding the original entry's id.
pub const FIELD_ENTRY_ID: &str = "x-idempotent-entry-id";

/// A consumer of a Redis stream; see the [module documentation](self).
pub type StreamConsumer<D = Json, R = RetryAll> = Consumer<RedisStream, D, R>;

/// Configures a [`StreamConsumer`]; from [`StreamConsumer::builder`].
pub type StreamConsumerBuilder<D = Json, R = RetryAll> = ConsumerBuilder<RedisStream, D, R>;

/// Checks the entry is still pending for this consumer, then acknowledges
/// it. KEYS: stream. ARGV: group, consumer, id. Returns 1, or 0 when the
/// entry is no longer this consumer's.
static ACK: Lua = Lua::new(
    r"local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return 1",
);

/// [`ACK`] for several entries: acknowledges, in one `XACK`, those still
/// pending for this consumer. KEYS: stream. ARGV: group, consumer, ids.
/// Returns, per id in order, 1, or 0 when it is no longer this consumer's.
static ACK_ALL: Lua = Lua::new(
    r"local acked, out = {}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    acked[#acked + 1] = ARGV[i]
  end
end
if #acked > 0 then redis.call('XACK', KEYS[1], ARGV[1], unpack(acked)) end
return out",
);

/// Entries acknowledged by one [`ACK_ALL`] at most (Lua's `unpack` takes a
/// few thousand values).
const ACK_ALL_CHUNK: usize = 512;

/// Checks ownership, adds an entry to KEYS[2] (a retry copy or a dead
/// letter), then acknowledges the original. KEYS: stream, target. ARGV:
/// group, consumer, id, max length (0: none), then field/value pairs.
static MOVE: Lua = Lua::new(
    r"local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
if ARGV[4] ~= '0' then
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[4], '*', unpack(fields))
else
  redis.call('XADD', KEYS[2], '*', unpack(fields))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return 1",
);

/// Resets the idle time of an entry still pending for this consumer (its
/// delivery count is unchanged). KEYS: stream. ARGV: group, consumer, id.
static TOUCH: Lua = Lua::new(
    r"local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1",
);

/// What a [`StreamConsumer`] consumes: the Redis client, the stream, the
/// group and this consumer's name (the Redis half of the builder).
pub struct RedisStream {
    client: Source,
    stream: String,
    group: String,
    consumer: String,
    dead_letter_stream: Option<String>,
    dead_letter_max_len: Option<u64>,
    body_field: String,
    message_id_field: String,
    claim_idle: Duration,
    block: Duration,
    create_group: bool,
    start_id: String,
    /// Set by `prepare`.
    ready: Option<Arc<Ready>>,
}

/// The server a [`RedisStream`] reads (each client boxed: their sizes
/// differ widely, with TLS and without).
enum Source {
    /// One Redis server.
    Server(Box<redis::Client>),
    /// A Redis Cluster.
    #[cfg(feature = "redis-cluster")]
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl Source {
    /// A connection whose replies may take `response_timeout`.
    async fn connect(&self, response_timeout: Duration) -> redis::RedisResult<RedisConn> {
        match self {
            Source::Server(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(5)))
                    .set_response_timeout(Some(response_timeout));
                let conn = client.get_multiplexed_async_connection_with_config(&config).await?;
                Ok(RedisConn::Multiplexed(conn))
            }
            #[cfg(feature = "redis-cluster")]
            Source::Cluster(client) => {
                let config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(Duration::from_secs(5))
                    .set_response_timeout(response_timeout);
                let conn = client.get_async_connection_with_config(config).await?;
                Ok(RedisConn::Cluster(conn))
            }
        }
    }
}

/// The validated settings.
struct Ready {
    stream: String,
    group: String,
    consumer: String,
    dead_letter_stream: String,
    dead_letter_max_len: String,
    body_field: String,
    message_id_field: String,
    claim_idle: Duration,
    block: Duration,
    max_attempts: u32,
}

impl fmt::Debug for RedisStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStream")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("claim_idle", &self.claim_idle)
            .finish_non_exhaustive()
    }
}

impl StreamConsumer {
    /// Starts configuring a consumer of `stream` in the consumer group
    /// `group`, on the Redis server `client` points at. The consumer's own
    /// name in the group is unique per process unless set with
    /// [`consumer_name`](ConsumerBuilder::consumer_name).
    pub fn builder(
        client: redis::Client,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> StreamConsumerBuilder {
        StreamConsumer::on(Source::Server(Box::new(client)), stream.into(), group.into())
    }

    /// Starts configuring a consumer of `stream` in the consumer group
    /// `group`, on the Redis Cluster `client` points at (feature
    /// `redis-cluster`); see [Redis Cluster](self#redis-cluster). The
    /// stream and its dead-letter stream must share a hash tag.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotent_runtime::redis::cluster::ClusterClient;
    /// use idempotent_runtime::redis_streams::StreamConsumer;
    ///
    /// let client = ClusterClient::new(["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/"])?;
    /// // Dead letters go to `{payments}.dlq`, in the same slot.
    /// let consumer = StreamConsumer::cluster_builder(client, "{payments}", "payment-service").build()?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis-cluster")]
    pub fn cluster_builder(
        client: redis::cluster::ClusterClient,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> StreamConsumerBuilder {
        StreamConsumer::on(Source::Cluster(Box::new(client)), stream.into(), group.into())
    }

    fn on(client: Source, stream: String, group: String) -> StreamConsumerBuilder {
        ConsumerBuilder::new(RedisStream {
            client,
            stream,
            group,
            consumer: default_consumer_name(),
            dead_letter_stream: None,
            dead_letter_max_len: None,
            body_field: "body".into(),
            message_id_field: "message_id".into(),
            claim_idle: DEFAULT_CLAIM_IDLE,
            block: DEFAULT_BLOCK,
            create_group: true,
            start_id: "0".into(),
            ready: None,
        })
    }
}

/// `{host}-{pid}-{random}`: unique per consumer instance.
fn default_consumer_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "consumer".into());
    let random = std::hash::RandomState::new().build_hasher().finish();
    format!("{host}-{}-{:08x}", std::process::id(), random & 0xffff_ffff)
}

impl<D, R> ConsumerBuilder<RedisStream, D, R> {
    /// This consumer's name in the group (default `{host}-{pid}-{random}`).
    /// Two live consumers must not share a name.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.broker.consumer = name.into();
        self
    }

    /// The dead-letter stream (default `"<stream>.dlq"`).
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.broker.dead_letter_stream = Some(stream.into());
        self
    }

    /// Trims the dead-letter stream to its last `entries` (`MAXLEN`) as dead
    /// letters are added; by default it is never trimmed.
    pub fn dead_letter_max_len(mut self, entries: u64) -> Self {
        self.broker.dead_letter_max_len = Some(entries);
        self
    }

    /// The field holding the message body (default `body`).
    pub fn body_field(mut self, field: impl Into<String>) -> Self {
        self.broker.body_field = field.into();
        self
    }

    /// The field holding the message id, if any (default `message_id`).
    pub fn message_id_field(mut self, field: impl Into<String>) -> Self {
        self.broker.message_id_field = field.into();
        self
    }

    /// How long an entry stays pending before any consumer of the group
    /// reclaims it (default [`DEFAULT_CLAIM_IDLE`]): longer than a handler
    /// pause, shorter than you can wait for a crashed consumer's entries.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.broker.claim_idle = idle;
        self
    }

    /// Longest wait of one read (`BLOCK`, default [`DEFAULT_BLOCK`]):
    /// shorter means a faster shutdown.
    pub fn block(mut self, block: Duration) -> Self {
        self.broker.block = block;
        self
    }

    /// Whether to create the group (and the stream) when missing, starting
    /// at `start_id` (`"0"`: every entry already in the stream, the
    /// default; `"$"`: only new ones). Default `true`.
    pub fn create_group(mut self, create: bool, start_id: impl Into<String>) -> Self {
        self.broker.create_group = create;
        self.broker.start_id = start_id.into();
        self
    }
}

impl Broker for RedisStream {
    const NAME: &'static str = "redis";
    type Session = Session;

    fn prepare(&mut self, options: &mut ConsumerOptions) -> Result<(), ConsumerError> {
        for (what, value) in [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer name", &self.consumer),
            ("body field", &self.body_field),
        ] {
            if value.is_empty() {
                return Err(ConsumerError::Config(format!("the {what} is empty")));
            }
        }
        let dead_letter_stream = self
            .dead_letter_stream
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.stream));
        if dead_letter_stream == self.stream {
            return Err(ConsumerError::Config(
                "the dead-letter stream is the consumed stream".into(),
            ));
        }
        #[cfg(feature = "redis-cluster")]
        if matches!(self.client, Source::Cluster(_)) {
            use redis::cluster_routing::Slot;
            if Slot::for_key(&self.stream) != Slot::for_key(&dead_letter_stream) {
                return Err(ConsumerError::Config(format!(
                    "in a Redis Cluster the stream `{}` and its dead-letter stream `{dead_letter_stream}` must \
                     share a hash tag (one slot): name the stream `{{{}}}`, whose dead letters go to `{{{}}}.dlq`",
                    self.stream, self.stream, self.stream
                )));
            }
        }
        if self.claim_idle < Duration::from_millis(100) {
            return Err(ConsumerError::Config(format!(
                "claim_idle {:?} is too short: entries of live consumers would be taken from them; use at least 100ms",
                self.claim_idle
            )));
        }
        self.ready = Some(Arc::new(Ready {
            stream: self.stream.clone(),
            group: self.group.clone(),
            consumer: self.consumer.clone(),
            dead_letter_stream,
            dead_letter_max_len: self.dead_letter_max_len.unwrap_or(0).to_string(),
            body_field: self.body_field.clone(),
            message_id_field: self.message_id_field.clone(),
            claim_idle: self.claim_idle,
            block: self.block,
            max_attempts: options.max_attempts,
        }));
        Ok(())
    }

    fn source(&self) -> String {
        format!("{}/{}", self.stream, self.group)
    }

    /// The stream, read by a consumer group as this consumer.
    fn messaging(&self) -> Messaging {
        Messaging::new(self.stream.clone())
            .consumer_group(self.group.clone())
            .client_id(self.consumer.clone())
    }

    async fn connect(&self, _options: &ConsumerOptions) -> Result<Session, Connect> {
        let ready = self
            .ready
            .clone()
            .ok_or_else(|| Connect::Fatal(ConsumerError::Config("the consumer was not built".into())))?;
        let failed = |err: redis::RedisError| Connect::Failed(format!("Redis: {err}"));
        // Reads block: they get a connection of their own.
        let mut read = self
            .client
            .connect(ready.block + Duration::from_secs(5))
            .await
            .map_err(failed)?;
        let settle = self.client.connect(Duration::from_secs(5)).await.map_err(failed)?;
        if self.create_group {
            let created: redis::RedisResult<()> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&ready.stream)
                .arg(&ready.group)
                .arg(&self.start_id)
                .arg("MKSTREAM")
                .query_async(&mut read)
                .await;
            match created {
                Ok(()) => {
                    tracing::info!(target: TRACING_TARGET, stream = %ready.stream, group = %ready.group, "consumer group created");
                }
                Err(err) if err.code() == Some("BUSYGROUP") => {}
                Err(err) => return Err(failed(err)),
            }
        }
        Ok(Session {
            shared: Arc::new(Shared {
                ready,
                conn: settle,
                alive: AtomicBool::new(true),
            }),
            read,
            buffered: VecDeque::new(),
            reading: None,
            last_claim: None,
            claim_cursor: "0-0".into(),
            stopping: false,
        })
    }
}

/// What the entries of one session share.
struct Shared {
    ready: Arc<Ready>,
    /// Settlements go on their own connection (reads block theirs).
    conn: RedisConn,
    /// Cleared when the session's connection is lost.
    alive: AtomicBool,
}

/// What one read brought: entries with their delivery counts, and for a
/// reclaim the cursor of the next one.
struct Read {
    entries: Vec<(StreamId, u32)>,
    claim_cursor: Option<String>,
}

type Pending = Pin<Box<dyn Future<Output = Result<Read, redis::RedisError>> + Send>>;

/// A consumer in the group, on one connection.
pub struct Session {
    shared: Arc<Shared>,
    read: RedisConn,
    /// Entries read, not yet handed out.
    buffered: VecDeque<(StreamId, u32)>,
    /// A read or reclaim in progress (kept across cancelled `next` calls).
    reading: Option<Pending>,
    last_claim: Option<Instant>,
    claim_cursor: String,
    stopping: bool,
}

impl Session {
    /// The next read: a reclaim of idle entries when one is due, else new
    /// entries.
    fn start_read(&mut self, room: usize) -> Pending {
        let ready = Arc::clone(&self.shared.ready);
        let mut conn = self.read.clone();
        let count = room.max(1);
        let claim_every = (ready.claim_idle / 2).max(Duration::from_millis(100));
        let claim_due = self.last_claim.is_none_or(|at| at.elapsed() >= claim_every);
        if claim_due {
            self.last_claim = Some(Instant::now());
            let cursor = self.claim_cursor.clone();
            return Box::pin(async move {
                let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                    .arg(&ready.stream)
                    .arg(&ready.group)
                    .arg(&ready.consumer)
                    .arg(u64::try_from(ready.claim_idle.as_millis()).unwrap_or(u64::MAX))
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(count)
                    .query_async(&mut conn)
                    .await?;
                let mut entries = Vec::with_capacity(reply.claimed.len());
                for entry in reply.claimed {
                    // The delivery count, raised by the claim.
                    let pending: StreamPendingCountReply = redis::cmd("XPENDING")
                        .arg(&ready.stream)
                        .arg(&ready.group)
                        .arg(&entry.id)
                        .arg(&entry.id)
                        .arg(1)
                        .query_async(&mut conn)
                        .await?;
                    let delivered = pending.ids.first().map_or(1, |p| p.times_delivered);
                    entries.push((entry, u32::try_from(delivered).unwrap_or(u32::MAX)));
                }
                Ok(Read {
                    entries,
                    claim_cursor: Some(reply.next_stream_id),
                })
            });
        }
        Box::pin(async move {
            let reply: StreamReadReply = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&ready.group)
                .arg(&ready.consumer)
                .arg("COUNT")
                .arg(count)
                .arg("BLOCK")
                .arg(u64::try_from(ready.block.as_millis()).unwrap_or(u64::MAX))
                .arg("STREAMS")
                .arg(&ready.stream)
                .arg(">")
                .query_async(&mut conn)
                .await?;
            Ok(Read {
                entries: reply
                    .keys
                    .into_iter()
                    .flat_map(|key| key.ids)
                    .map(|entry| (entry, 1))
                    .collect(),
                claim_cursor: None,
            })
        })
    }
}

impl pipeline::Session for Session {
    type Delivery = Delivery;

    async fn next(&mut self, room: usize) -> Next<Delivery> {
        loop {
            if let Some((entry, delivered)) = self.buffered.pop_front() {
                return Next::Delivery(Delivery::new(Arc::clone(&self.shared), entry, delivered));
            }
            if self.stopping {
                return Next::End;
            }
            if !self.shared.alive.load(Ordering::Relaxed) {
                return Next::Lost("Redis: the connection settling the entries was lost".into());
            }
            let reading = match &mut self.reading {
                Some(reading) => reading,
                None => {
                    let read = self.start_read(room);
                    self.reading.insert(read)
                }
            };
            let read = reading.await;
            self.reading = None;
            match read {
                Ok(Read { entries, claim_cursor }) => {
                    let reclaim = claim_cursor.is_some();
                    if let Some(cursor) = claim_cursor {
                        self.claim_cursor = cursor;
                    }
                    if entries.is_empty() && !reclaim {
                        return Next::Idle;
                    }
                    self.buffered.extend(entries);
                }
                Err(err) => {
                    self.shared.alive.store(false, Ordering::Relaxed);
                    return Next::Lost(format!("Redis: {err}"));
                }
            }
        }
    }

    async fn stop(&mut self) {
        // Entries already read are handled; no new read is made.
        self.stopping = true;
    }

    async fn close(self) {
        self.shared.alive.store(false, Ordering::Relaxed);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.shared.alive.store(false, Ordering::Relaxed);
    }
}

/// One stream entry.
pub struct Delivery {
    shared: Arc<Shared>,
    id: String,
    fields: HashMap<String, Value>,
    body: Option<Vec<u8>>,
    meta: Meta,
}

fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.as_bytes().to_vec()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        Value::Double(d) => Some(d.to_string().into_bytes()),
        _ => None,
    }
}

impl Delivery {
    fn new(shared: Arc<Shared>, entry: StreamId, delivered: u32) -> Delivery {
        let ready = &shared.ready;
        let body = entry.map.get(&ready.body_field).and_then(bytes);
        let message_id = entry
            .map
            .get(&ready.message_id_field)
            .and_then(bytes)
            .and_then(|b| String::from_utf8(b).ok());
        let copy_attempt = entry
            .map
            .get(HEADER_ATTEMPT)
            .and_then(bytes)
            .and_then(|b| std::str::from_utf8(&b).ok()?.trim().parse::<u32>().ok())
            .unwrap_or(1)
            .max(1);
        // Deliveries of this copy beyond the first were lost (crashes,
        // shutdowns): they count as attempts.
        let attempt = copy_attempt.saturating_add(delivered.saturating_sub(1));
        let meta = Meta {
            attempt,
            redelivered: delivered > 1,
            message_id,
            last: delivered > ready.max_attempts,
            position: format!("entry_id={}", entry.id),
            destination: None,
            routing_key: None,
            delivery_tag: None,
            partition: None,
            offset: None,
            message_key: None,
        };
        Delivery {
            shared,
            id: entry.id,
            fields: entry.map,
            body,
            meta,
        }
    }

    /// Runs `script` on the settle connection; `Lost` when the entry is no
    /// longer this consumer's (or the connection failed).
    async fn settle(&self, script: &'static Lua, keys: &[&str], extra: Vec<Vec<u8>>) -> Result<(), Settle> {
        let ready = &self.shared.ready;
        let mut invocation = script.key(keys).arg(&ready.group).arg(&ready.consumer).arg(&self.id);
        for arg in extra {
            invocation = invocation.arg(arg);
        }
        let mut conn = self.shared.conn.clone();
        let done: i64 = invocation.invoke(&mut conn).await.map_err(|err| {
            let settle = classify(&err);
            if matches!(settle, Settle::Lost(_)) {
                // The settle connection broke or stopped answering (a
                // cluster connection can keep timing out on a slot whose
                // primary failed over): the session is lost, so that its
                // other entries are not settled one timeout at a time and
                // the consumer connects again.
                self.shared.alive.store(false, Ordering::Relaxed);
            }
            settle
        })?;
        if done == 1 {
            Ok(())
        } else {
            Err(Settle::Lost(format!(
                "entry {} is no longer pending for consumer `{}`: another consumer took it over",
                self.id, ready.consumer
            )))
        }
    }

    /// The entry's fields with `edit` applied, flattened for `XADD`.
    fn fields_with(&self, edit: impl FnOnce(&mut Vec<(String, Vec<u8>)>)) -> Vec<Vec<u8>> {
        let mut fields: Vec<(String, Vec<u8>)> = self
            .fields
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), bytes(value)?)))
            .collect();
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        edit(&mut fields);
        fields
            .into_iter()
            .flat_map(|(name, value)| [name.into_bytes(), value])
            .collect()
    }
}

/// A script error: refused (cluster slots, a wrong type...) or lost.
fn classify(err: &redis::RedisError) -> Settle {
    if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() || err.is_unrecoverable_error() {
        Settle::Lost(format!("Redis: {err}"))
    } else {
        Settle::Refused(format!("Redis: {err}"))
    }
}

fn set(fields: &mut Vec<(String, Vec<u8>)>, name: &str, value: impl Into<Vec<u8>>) {
    fields.retain(|(n, _)| n != name);
    fields.push((name.to_owned(), value.into()));
}

impl pipeline::Delivery for Delivery {
    fn body(&self) -> &[u8] {
        self.body.as_deref().unwrap_or_default()
    }

    fn malformed(&self) -> Option<String> {
        self.body
            .is_none()
            .then(|| format!("entry {} has no `{}` field", self.id, self.shared.ready.body_field))
    }

    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn is_current(&self) -> bool {
        self.shared.alive.load(Ordering::Relaxed)
    }

    /// The stream's key and the entry's id: the same on every delivery of
    /// the entry (a claim by this consumer after its pending entry went
    /// idle).
    fn identity(&self) -> Option<String> {
        Some(format!("{} {}", self.shared.ready.stream, self.id))
    }

    fn heartbeat(&self) -> Option<Duration> {
        Some((self.shared.ready.claim_idle / 3).max(Duration::from_millis(10)))
    }

    async fn progress(&self) {
        let stream = self.shared.ready.stream.clone();
        if let Err(err) = self.settle(&TOUCH, &[&stream], Vec::new()).await {
            tracing::debug!(target: TRACING_TARGET, error = %err, "resetting the entry's idle time failed");
        }
    }

    async fn ack(&self) -> Result<(), Settle> {
        let stream = self.shared.ready.stream.clone();
        self.settle(&ACK, &[&stream], Vec::new()).await
    }

    /// One script for the batch (`ACK_ALL`): each entry's ownership
    /// checked and those still this consumer's acknowledged in one `XACK`.
    async fn ack_all<'a>(deliveries: &'a [&'a Self]) -> Vec<Result<(), Settle>> {
        let mut results = Vec::with_capacity(deliveries.len());
        for chunk in deliveries.chunks(ACK_ALL_CHUNK) {
            let Some(first) = chunk.first() else { continue };
            if !chunk.iter().all(|d| Arc::ptr_eq(&d.shared, &first.shared)) {
                for delivery in chunk {
                    results.push(pipeline::Delivery::ack(*delivery).await);
                }
                continue;
            }
            let ready = &first.shared.ready;
            let mut invocation = ACK_ALL.key(&ready.stream).arg(&ready.group).arg(&ready.consumer);
            for delivery in chunk {
                invocation = invocation.arg(&delivery.id);
            }
            let mut conn = first.shared.conn.clone();
            match invocation.invoke::<Vec<i64>>(&mut conn).await {
                Ok(done) => {
                    for (index, delivery) in chunk.iter().enumerate() {
                        results.push(match done.get(index) {
                            Some(1) => Ok(()),
                            _ => Err(Settle::Lost(format!(
                                "entry {} is no longer pending for consumer `{}`: another consumer took it over",
                                delivery.id, ready.consumer
                            ))),
                        });
                    }
                }
                Err(err) => {
                    let why = classify(&err);
                    if matches!(why, Settle::Lost(_)) {
                        // As in `settle`: the session is lost, so that its
                        // other entries do not wait out one timeout each.
                        first.shared.alive.store(false, Ordering::Relaxed);
                    }
                    for _ in chunk {
                        results.push(Err(why.clone()));
                    }
                }
            }
        }
        results
    }

    async fn retry(&self, next_attempt: u32, delay: Duration, shutdown: &CancellationToken) -> Result<(), Settle> {
        // Waits holding the entry (its idle time reset), then adds the copy.
        let deadline = Instant::now() + delay;
        let every = (self.shared.ready.claim_idle / 3).max(Duration::from_millis(10));
        while Instant::now() < deadline && !shutdown.is_cancelled() {
            let wait = deadline.saturating_duration_since(Instant::now()).min(every);
            sleep_unless_cancelled(wait, shutdown).await;
            pipeline::Delivery::progress(self).await;
        }
        let ready = &self.shared.ready;
        let fields = self.fields_with(|fields| set(fields, HEADER_ATTEMPT, next_attempt.to_string()));
        let mut extra = vec![b"0".to_vec()];
        extra.extend(fields);
        self.settle(&MOVE, &[&ready.stream, &ready.stream], extra).await
    }

    async fn dead_letter(&self, letter: &Letter<'_>) -> Result<(), Settle> {
        let ready = &self.shared.ready;
        let fields = self.fields_with(|fields| {
            fields.retain(|(n, _)| n != HEADER_ATTEMPT);
            set(fields, HEADER_REASON, letter.reason);
            set(fields, HEADER_KIND, letter.kind);
            set(fields, HEADER_ATTEMPTS, letter.attempts.to_string());
            set(fields, HEADER_SOURCE, letter.source);
            set(fields, FIELD_ENTRY_ID, self.id.as_str());
        });
        let mut extra = vec![ready.dead_letter_max_len.clone().into_bytes()];
        extra.extend(fields);
        self.settle(&MOVE, &[&ready.stream, &ready.dead_letter_stream], extra)
            .await
    }

    /// Nothing: [`dead_letter`](pipeline::Delivery::dead_letter) adds the
    /// dead letter and acknowledges the entry in one script.
    async fn discard(&self) -> Result<(), Settle> {
        Ok(())
    }

    async fn release(&self, _delay: Duration) -> Result<(), Settle> {
        // Left pending: reclaimed after `claim_idle` by this or another
        // consumer of the group.
        Ok(())
    }
}
