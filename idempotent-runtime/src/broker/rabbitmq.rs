//! RabbitMQ consumer (feature `rabbitmq`): ack after the handler's commit,
//! bounded retries, dead-lettering, reconnection, graceful shutdown.
//!
//! [`RabbitConsumer`] connects to a broker (it owns its connection, so it
//! can make it again), makes sure its queues exist, consumes one queue,
//! decodes each delivery (JSON by default, see [`Decoder`](super::Decoder)), calls the
//! handler, and settles the delivery from the handler's result:
//!
//! | handler | what happens |
//! | --- | --- |
//! | `Ok` | the delivery is acknowledged, only now (so after the marker's commit) |
//! | `Err`, attempts left and the error retryable | after a backoff, a copy carrying `x-idempotent-attempt: n + 1` is published to the queue with publisher confirms, then the original is acknowledged |
//! | `Err` on the last attempt, or not retryable ([`RetryPolicy`](super::RetryPolicy)) | the body is published unchanged to the dead-letter queue with `x-idempotent-reason`, `-kind`, `-attempts` and `-source` headers, then acknowledged |
//! | a dependency down (the `#[idempotent]` store failed, or [`Verdict::Outage`](super::Verdict::Outage)) | the delivery is kept and the handler run again after a backoff, without spending an attempt |
//! | undecodable body (poison) | dead-lettered at once, the decoder's error as reason |
//! | panic | counts as a failed attempt |
//!
//! RabbitMQ's own `basic.nack(requeue)` does not count attempts on classic
//! queues, hence the republish. Publishing the copy before acknowledging the
//! original means a crash between the two leaves *two* copies: the
//! idempotent handler absorbs that, as it absorbs every other redelivery.
//! Nothing is ever dropped: when a copy or a dead letter cannot be published
//! (unroutable, refused by the broker), the original is handed back with
//! `basic.nack(requeue)` instead. Copies and dead letters are published on
//! channels of their own, one publish in flight on each, so that the
//! broker's answer (confirmed, returned as unroutable, refused) is that of
//! the very message, however many handlers publish at once.
//!
//! A delivery redelivered by the broker after a crash (the consumer died
//! before its ack) keeps its attempt number on classic queues; on quorum
//! queues the broker's `x-delivery-count` is added to it, and their
//! `delivery-limit` bounds crash loops.
//!
//! # Topology
//!
//! On each connection, before consuming, the consumer makes sure of what
//! it needs: the queue, the dead-letter queue or exchange. It declares the
//! queues (durable, no arguments) unless told not to
//! ([`declare_queue(false)`](ConsumerBuilder::declare_queue),
//! [`declare_dead_letter_queue(false)`](ConsumerBuilder::declare_dead_letter_queue)),
//! then it only checks that they exist; it never declares an exchange. What
//! must already exist is checked before anything is declared, so a refusal
//! (a missing exchange, a queue that must exist) leaves nothing
//! half-declared. Existing queues are used as they are, so quorum queues
//! and queues with arguments work.
//!
//! A declare is not preceded by a check: a passive declare of a missing
//! queue makes the broker close the channel, which lapin logs at ERROR on
//! every first start. Declaring a queue that exists durable without
//! arguments changes nothing and logs nothing. A queue that exists with
//! other properties (a quorum queue, arguments), or one the user may not
//! configure, is refused (`PRECONDITION_FAILED`, `ACCESS_REFUSED`): the
//! consumer then checks that it exists and uses it, and lapin logs the
//! refused declare once per connection at ERROR
//! (`lapin::channel: Channel closed .. PRECONDITION_FAILED`). To start
//! without it, turn declaring off for such queues.
//!
//! # Connection loss
//!
//! A lost connection is made again within the
//! [reconnection policy](ConsumerBuilder::reconnect) (forever by default),
//! and the topology checked again. Deliveries in flight on the lost
//! connection cannot be acknowledged on the new one: RabbitMQ requeues them
//! and the idempotent handler recognises the duplicates.
//!
//! A dead letter is published and confirmed, then the original
//! acknowledged: when the acknowledgement is lost with the connection,
//! RabbitMQ delivers the original again. The process remembers the
//! messages its consumers dead-lettered, by a digest of what a redelivery
//! keeps (exchange, routing key, properties and body; see [`Delivery`]),
//! and settles such a redelivery (flagged `redelivered`) without running
//! its handler again: it acknowledges it, or first publishes its dead
//! letter again when the first publish's outcome was not known. A process
//! that ends between the two steps does not remember: the message is
//! handled again after the restart.
//!
//! ```no_run
//! use idempotent_runtime::broker::shutdown_on_signal;
//! use idempotent_runtime::rabbitmq::RabbitConsumer;
//!
//! #[derive(serde::Deserialize)]
//! struct PaymentMessage { message_id: String, order_id: String, amount: i64 }
//!
//! # async fn process_payment(_: &PaymentMessage) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = RabbitConsumer::builder("amqp://127.0.0.1:5672/%2f", "payments")
//!     .prefetch(32)
//!     .concurrency(8)
//!     .max_attempts(5)
//!     .dead_letter_queue("payments.dlq")
//!     .retry_if(|err: &idempotent_runtime::Error| err.is_transient())
//!     .build()?;
//!
//! let shutdown = shutdown_on_signal(); // cancelled on Ctrl-C or SIGTERM
//! let stats = consumer
//!     .run(|msg: PaymentMessage| async move { process_payment(&msg).await }, shutdown)
//!     .await?;
//! println!("acked {} dead-lettered {}", stats.acked, stats.dead_lettered);
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use self::publisher::{ConfirmedPublisher, Unconfirmed};
use super::pipeline::{self, Broker, Connect, Letter, Meta, Next, Settle};
use super::{
    CancellationToken, ConsumerError, ConsumerOptions, HEADER_ATTEMPT, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, Json, RetryAll,
};
use super::{Consumer, ConsumerBuilder, TRACING_TARGET, sleep_unless_cancelled};

pub(crate) mod publisher;

/// Header RabbitMQ quorum queues set to the number of earlier deliveries.
const DELIVERY_COUNT: &str = "x-delivery-count";

/// Header recent RabbitMQ quorum queues may set to the number of times a
/// message was handed to a consumer: like [`DELIVERY_COUNT`], it changes
/// from one delivery of a message to the next.
const ACQUIRED_COUNT: &str = "x-acquired-count";

/// Default prefetch (`basic.qos`).
pub const DEFAULT_PREFETCH: u16 = 32;

/// Default time a connection attempt gets to be ready: the AMQP handshake,
/// the topology checks and declarations, `basic.qos` and `basic.consume`
/// ([`ConsumerBuilder::connect_timeout`]).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long closing the connection at shutdown waits for the broker's
/// `connection.close-ok` before it gives up on it (the connection is
/// dropped then, and the broker requeues what it had not acknowledged).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A consumer of a RabbitMQ queue; see the [module documentation](self).
pub type RabbitConsumer<D = Json, R = RetryAll> = Consumer<Rabbit, D, R>;

/// Configures a [`RabbitConsumer`]; from [`RabbitConsumer::builder`].
pub type RabbitConsumerBuilder<D = Json, R = RetryAll> = ConsumerBuilder<Rabbit, D, R>;

/// Where failed and poison messages go.
#[derive(Debug, Clone)]
enum DeadLetter {
    /// A queue, through the default exchange.
    Queue(ShortString),
    /// An exchange and routing key (declared by the user).
    Exchange {
        exchange: ShortString,
        routing_key: ShortString,
    },
}

/// What a [`RabbitConsumer`] consumes: the broker's address, the queue and
/// its dead-letter destination (the RabbitMQ half of the builder).
pub struct Rabbit {
    uri: String,
    properties: ConnectionProperties,
    tls: OwnedTLSConfig,
    queue: String,
    consumer_tag: String,
    prefetch: u16,
    dead_letter_queue: Option<String>,
    dead_letter_exchange: Option<(String, String)>,
    declare_queue: bool,
    declare_dead_letter_queue: bool,
    connect_timeout: Duration,
    /// Set by `prepare`.
    ready: Option<Ready>,
}

/// The validated settings.
#[derive(Debug, Clone)]
struct Ready {
    queue: ShortString,
    consumer_tag: ShortString,
    dead_letter: DeadLetter,
}

impl fmt::Debug for Rabbit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rabbit")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("declare_queue", &self.declare_queue)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// Starts configuring a consumer of `queue` on the broker at `uri`
    /// (`amqp://user:password@host:5672/%2f`).
    pub fn builder(uri: impl Into<String>, queue: impl Into<String>) -> RabbitConsumerBuilder {
        ConsumerBuilder::new(Rabbit {
            uri: uri.into(),
            properties: ConnectionProperties::default(),
            tls: OwnedTLSConfig::default(),
            queue: queue.into(),
            consumer_tag: String::new(),
            prefetch: DEFAULT_PREFETCH,
            dead_letter_queue: None,
            dead_letter_exchange: None,
            declare_queue: true,
            declare_dead_letter_queue: true,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            ready: None,
        })
    }
}

impl<D, R> ConsumerBuilder<Rabbit, D, R> {
    /// Maximum number of unacknowledged deliveries the broker sends to this
    /// consumer (`basic.qos`, per consumer). Default [`DEFAULT_PREFETCH`].
    /// `0` means no limit; keep it at least the concurrency.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.broker.prefetch = prefetch;
        self
    }

    /// The connection's properties (client name, executor...).
    pub fn connection_properties(mut self, properties: ConnectionProperties) -> Self {
        self.broker.properties = properties;
        self
    }

    /// TLS settings for an `amqps://` broker: CA certificates (PEM) trusted
    /// besides the system's, a client identity for mutual TLS.
    pub fn tls_config(mut self, tls: OwnedTLSConfig) -> Self {
        self.broker.tls = tls;
        self
    }

    /// Dead-letter queue, published to through the default exchange.
    /// Default: `"<queue>.dlq"`.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.broker.dead_letter_queue = Some(queue.into());
        self.broker.dead_letter_exchange = None;
        self
    }

    /// Dead-letters to an exchange with a routing key instead of a queue.
    /// The exchange must exist (checked when the consumer connects) and
    /// route the key to a queue: an unroutable dead letter is not dropped,
    /// the original goes back to its queue.
    pub fn dead_letter_exchange(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.broker.dead_letter_exchange = Some((exchange.into(), routing_key.into()));
        self.broker.dead_letter_queue = None;
        self
    }

    /// Whether to declare the queue (durable, no arguments; default
    /// `true`): nothing changes when it exists so. With `false` the queue is
    /// only checked, and a missing queue is an error: turn it off for a
    /// queue declared with other properties (a quorum queue, arguments),
    /// whose refused declare lapin logs at ERROR on each connection (see
    /// the [module documentation](crate::rabbitmq#topology)).
    pub fn declare_queue(mut self, declare: bool) -> Self {
        self.broker.declare_queue = declare;
        self
    }

    /// Whether to declare the dead-letter queue (durable, no arguments;
    /// default `true`), as [`declare_queue`](Self::declare_queue) does the
    /// queue. With `false` a missing dead-letter queue is an error.
    pub fn declare_dead_letter_queue(mut self, declare: bool) -> Self {
        self.broker.declare_dead_letter_queue = declare;
        self
    }

    /// How long one connection attempt may take, from the TCP connect to
    /// the subscription (handshake, topology, `basic.qos`,
    /// `basic.consume`); default [`DEFAULT_CONNECT_TIMEOUT`]. An attempt
    /// the broker does not answer in time (it accepts TCP but never speaks,
    /// a network that stalls) fails and is retried within the
    /// [reconnection policy](ConsumerBuilder::reconnect). It also bounds
    /// how long a shutdown asked during an attempt waits for it. A zero
    /// duration is replaced by the default.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.broker.connect_timeout = if timeout.is_zero() {
            DEFAULT_CONNECT_TIMEOUT
        } else {
            timeout
        };
        self
    }

    /// Consumer tag shown in the management UI; default empty (the broker
    /// generates one).
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.broker.consumer_tag = tag.into();
        self
    }
}

fn short(what: &str, value: &str) -> Result<ShortString, ConsumerError> {
    ShortString::try_new(value.to_owned()).map_err(|err| ConsumerError::Config(format!("{what} `{value}`: {err}")))
}

impl Broker for Rabbit {
    const NAME: &'static str = "rabbitmq";
    type Session = Session;

    fn prepare(&mut self, options: &mut ConsumerOptions) -> Result<(), ConsumerError> {
        if self.queue.is_empty() {
            return Err(ConsumerError::Config("the queue name is empty".into()));
        }
        if self.prefetch != 0 && usize::from(self.prefetch) < options.concurrency {
            tracing::warn!(
                target: TRACING_TARGET,
                queue = %self.queue,
                prefetch = self.prefetch,
                concurrency = options.concurrency,
                "prefetch below concurrency: at most `prefetch` handlers will run at once"
            );
        }
        #[cfg(feature = "sqlx")]
        if let Some(batch) = &options.batch {
            let wanted = options.concurrency.saturating_mul(batch.max);
            if self.prefetch != 0 && usize::from(self.prefetch) < wanted {
                tracing::info!(
                    target: TRACING_TARGET,
                    queue = %self.queue,
                    prefetch = self.prefetch,
                    concurrency = options.concurrency,
                    batch = batch.max,
                    "prefetch below concurrency x batch size: batches will hold fewer deliveries"
                );
            }
        }
        let queue = short("queue", &self.queue)?;
        let consumer_tag = short("consumer tag", &self.consumer_tag)?;
        let dead_letter = match (&self.dead_letter_exchange, &self.dead_letter_queue) {
            (Some((exchange, routing_key)), _) => DeadLetter::Exchange {
                exchange: short("dead-letter exchange", exchange)?,
                routing_key: short("dead-letter routing key", routing_key)?,
            },
            (None, name) => {
                let name = name.clone().unwrap_or_else(|| format!("{}.dlq", self.queue));
                if name == self.queue {
                    return Err(ConsumerError::Config(
                        "the dead-letter queue is the consumed queue".into(),
                    ));
                }
                DeadLetter::Queue(short("dead-letter queue", &name)?)
            }
        };
        self.ready = Some(Ready {
            queue,
            consumer_tag,
            dead_letter,
        });
        Ok(())
    }

    fn source(&self) -> String {
        self.queue.clone()
    }

    /// Connects within the [connect timeout](ConsumerBuilder::connect_timeout):
    /// an attempt the broker does not answer in time fails (and is retried
    /// within the reconnection policy).
    async fn connect(&self, options: &ConsumerOptions) -> Result<Session, Connect> {
        match tokio::time::timeout(self.connect_timeout, self.connect_now(options)).await {
            Ok(connected) => connected,
            Err(_) => Err(Connect::Failed(format!(
                "RabbitMQ did not complete the connection within {:?} (connect timeout)",
                self.connect_timeout
            ))),
        }
    }
}

impl Rabbit {
    /// Connects, declares and subscribes, without a time limit of its own
    /// ([`connect`](Broker::connect) bounds it).
    async fn connect_now(&self, options: &ConsumerOptions) -> Result<Session, Connect> {
        let ready = self
            .ready
            .clone()
            .ok_or_else(|| Connect::Fatal(ConsumerError::Config("the consumer was not built".into())))?;
        let runtime = lapin::runtime::default_runtime()
            .map_err(|err| Connect::Fatal(ConsumerError::Config(format!("no runtime for lapin: {err}"))))?;
        let conn = Connection::connect_with_config(&self.uri, self.properties.clone(), self.tls.clone(), runtime)
            .await
            .map_err(|err| Connect::Failed(format!("cannot connect to RabbitMQ: {err}")))?;
        let result = async {
            self.ensure_topology(&conn, &ready).await?;
            // Retries and dead letters are published on channels of their
            // own (see `publisher`), not on this one.
            let channel = conn.create_channel().await.map_err(lost)?;
            channel
                .basic_qos(self.prefetch, BasicQosOptions::default())
                .await
                .map_err(lost)?;
            let consumer = channel
                .basic_consume(
                    ready.queue.clone(),
                    ready.consumer_tag.clone(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(lost)?;
            Ok((channel, consumer))
        }
        .await;
        let (channel, consumer) = match result {
            Ok(parts) => parts,
            Err(err) => {
                let _ = tokio::time::timeout(
                    CLOSE_TIMEOUT,
                    conn.close(200, ShortString::from("idempotent consumer setup failed")),
                )
                .await;
                return Err(err);
            }
        };
        Ok(Session {
            shared: Arc::new(Shared {
                channel,
                publisher: ConfirmedPublisher::new(conn),
                queue: ready.queue,
                dead_letter: ready.dead_letter,
                unsettled: Unsettled::default(),
            }),
            tag: consumer.tag(),
            consumer,
            shutdown_timeout: options.shutdown_timeout,
            stop_deadline: None,
        })
    }
}

fn lost(err: lapin::Error) -> Connect {
    Connect::Failed(format!("RabbitMQ: {err}"))
}

fn is_not_found(err: &lapin::Error) -> bool {
    reply_code(err) == Some(404)
}

/// The AMQP reply code of a channel or connection closed by the broker.
fn reply_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// `ACCESS_REFUSED`: the user may not configure (declare) the queue.
const ACCESS_REFUSED: u16 = 403;
/// `PRECONDITION_FAILED`: the queue exists with other properties.
const PRECONDITION_FAILED: u16 = 406;

impl Rabbit {
    /// Checks what must exist already (a queue or dead-letter queue it may
    /// not declare, the dead-letter exchange), then declares the queues it
    /// may declare. A refusal declares nothing.
    ///
    /// A queue it may declare is declared straight away, not checked first:
    /// a passive declare of a missing queue makes the broker close the
    /// channel, which lapin logs at ERROR on every first start. Declaring a
    /// queue that exists with the same properties (durable, no arguments)
    /// changes nothing; see [`declare`](Self::declare) for one with others.
    async fn ensure_topology(&self, conn: &Connection, ready: &Ready) -> Result<(), Connect> {
        let mut declare: Vec<&ShortString> = Vec::new();
        if self.declare_queue {
            declare.push(&ready.queue);
        } else if !self.queue_exists(conn, &ready.queue).await? {
            return Err(Connect::Fatal(ConsumerError::Config(format!(
                "queue `{}` does not exist (and declare_queue is off)",
                ready.queue
            ))));
        }
        match &ready.dead_letter {
            DeadLetter::Queue(dlq) => {
                if self.declare_dead_letter_queue {
                    declare.push(dlq);
                } else if !self.queue_exists(conn, dlq).await? {
                    return Err(Connect::Fatal(ConsumerError::Config(format!(
                        "dead-letter queue `{dlq}` does not exist (and declare_dead_letter_queue is off)"
                    ))));
                }
            }
            DeadLetter::Exchange { exchange, .. } => {
                let channel = conn.create_channel().await.map_err(lost)?;
                let passive = ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                };
                match channel
                    .exchange_declare(exchange.clone(), ExchangeKind::Direct, passive, FieldTable::default())
                    .await
                {
                    Ok(()) => {
                        let _ = channel.close(200, ShortString::from("checked")).await;
                    }
                    Err(err) if is_not_found(&err) => {
                        return Err(Connect::Fatal(ConsumerError::Config(format!(
                            "the dead-letter exchange `{exchange}` does not exist: declare it and bind a queue to it"
                        ))));
                    }
                    Err(err) => return Err(lost(err)),
                }
            }
        }
        for queue in declare {
            self.declare(conn, queue).await?;
        }
        Ok(())
    }

    /// Declares `queue` durable without arguments, on a channel of its own.
    ///
    /// A queue that exists with other properties (a quorum queue, arguments,
    /// not durable) is refused with `PRECONDITION_FAILED`, and a user who
    /// may not configure the queue with `ACCESS_REFUSED`; the broker then
    /// closes the channel (lapin logs it at ERROR) and the queue is checked
    /// passively on a fresh channel: it is used as it is when it exists.
    async fn declare(&self, conn: &Connection, queue: &ShortString) -> Result<(), Connect> {
        let channel = conn.create_channel().await.map_err(lost)?;
        match channel
            .queue_declare(queue.clone(), QueueDeclareOptions::durable(), FieldTable::default())
            .await
        {
            Ok(_) => {
                let _ = channel.close(200, ShortString::from("declared")).await;
                tracing::debug!(target: TRACING_TARGET, queue = %queue, "queue declared (durable; unchanged when it existed)");
                Ok(())
            }
            Err(err) if matches!(reply_code(&err), Some(PRECONDITION_FAILED | ACCESS_REFUSED)) => {
                if self.queue_exists(conn, queue).await? {
                    tracing::debug!(
                        target: TRACING_TARGET,
                        queue = %queue,
                        refusal = %err,
                        "the queue exists and is used as it is"
                    );
                    Ok(())
                } else {
                    Err(Connect::Fatal(ConsumerError::Config(format!(
                        "cannot declare queue `{queue}`: {err}"
                    ))))
                }
            }
            Err(err) if reply_code(&err).is_some() => Err(Connect::Fatal(ConsumerError::Config(format!(
                "cannot declare queue `{queue}`: {err}"
            )))),
            Err(err) => Err(lost(err)),
        }
    }

    /// Whether `queue` exists (a passive declare, on a channel of its own:
    /// a missing queue closes the channel).
    async fn queue_exists(&self, conn: &Connection, queue: &ShortString) -> Result<bool, Connect> {
        let channel = conn.create_channel().await.map_err(lost)?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match channel
            .queue_declare(queue.clone(), passive, FieldTable::default())
            .await
        {
            Ok(_) => {
                let _ = channel.close(200, ShortString::from("checked")).await;
                Ok(true)
            }
            Err(err) if is_not_found(&err) => Ok(false),
            Err(err) => Err(lost(err)),
        }
    }
}

/// What the deliveries of one connection share.
struct Shared {
    /// The consuming channel.
    channel: Channel,
    /// The connection, and the channels retries and dead letters are
    /// published on.
    publisher: ConfirmedPublisher,
    queue: ShortString,
    dead_letter: DeadLetter,
    /// The delivery tags of the channel no acknowledgement (or `nack`) of
    /// ours has been sent for yet: an acknowledgement of several at once
    /// ([`Delivery::ack_all`](pipeline::Delivery::ack_all)) covers only
    /// tags of its own batch (see [`Unsettled`]).
    unsettled: Unsettled,
}

/// The channel's delivery tags not settled yet, in order: a tag enters
/// when its delivery is handed to the pipeline, and leaves once the frame
/// that settles it has been sent (the acker's answer), so a `basic.ack`
/// with `multiple` sent later cannot reach the broker before it.
///
/// `basic.ack` with `multiple` acknowledges every unacknowledged delivery
/// of the channel up to its tag: it is sent only when every tag up to it
/// still unsettled belongs to the batch being acknowledged. A tag the
/// consumer never settles (a task aborted at shutdown) stays here, and no
/// acknowledgement of several ever covers it.
#[derive(Default)]
struct Unsettled(std::sync::Mutex<std::collections::BTreeSet<u64>>);

impl Unsettled {
    fn insert(&self, tag: u64) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(tag);
    }

    fn remove(&self, tags: impl IntoIterator<Item = u64>) {
        let mut unsettled = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for tag in tags {
            unsettled.remove(&tag);
        }
    }

    /// The highest tag of `ours` (sorted) that one `basic.ack` with
    /// `multiple` may acknowledge: every tag up to it not yet settled is in
    /// `ours`; `None` when fewer than two would be covered.
    fn covered_by(&self, ours: &[u64]) -> Option<u64> {
        let unsettled = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut upto = None;
        let mut count = 0usize;
        for tag in unsettled.iter() {
            if ours.binary_search(tag).is_err() {
                break;
            }
            upto = Some(*tag);
            count += 1;
        }
        upto.filter(|_| count >= 2)
    }
}

/// A connection consuming the queue.
pub struct Session {
    shared: Arc<Shared>,
    tag: ShortString,
    consumer: lapin::Consumer,
    /// The consumer's shutdown timeout.
    shutdown_timeout: Duration,
    /// Set by `stop`: the subscription is taken as ended by then, whether
    /// or not the broker confirmed the `basic.cancel` (a connection that
    /// stalls never does).
    stop_deadline: Option<tokio::time::Instant>,
}

impl pipeline::Session for Session {
    type Delivery = Delivery;

    async fn next(&mut self, _room: usize) -> Next<Delivery> {
        let next = match self.stop_deadline {
            None => self.consumer.next().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, self.consumer.next()).await {
                Ok(next) => next,
                Err(_) => {
                    // What the broker sent and we did not take stays
                    // unacknowledged: it is requeued when the connection
                    // closes.
                    tracing::warn!(
                        target: TRACING_TARGET,
                        queue = %self.shared.queue,
                        "the subscription did not end within the shutdown timeout: stopping without it"
                    );
                    return Next::End;
                }
            },
        };
        match next {
            Some(Ok(delivery)) => {
                self.shared.unsettled.insert(delivery.delivery_tag);
                Next::Delivery(Delivery::new(Arc::clone(&self.shared), delivery))
            }
            Some(Err(err)) => Next::Lost(err.to_string()),
            None if self.shared.channel.status().connected() => Next::End,
            None => Next::Lost("the channel closed".into()),
        }
    }

    /// Sends `basic.cancel` and waits for its answer at most the shutdown
    /// timeout; the subscription is then taken as ended within the
    /// shutdown timeout of this call, answered or not (see `next`).
    async fn stop(&mut self) {
        let deadline = tokio::time::Instant::now() + self.shutdown_timeout;
        self.stop_deadline = Some(deadline);
        // Deliveries the broker already sent keep coming until the
        // subscription ends.
        if !self.shared.channel.status().connected() {
            return;
        }
        let cancel = self
            .shared
            .channel
            .basic_cancel(self.tag.clone(), BasicCancelOptions::default());
        match tokio::time::timeout_at(deadline, cancel).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(target: TRACING_TARGET, queue = %self.shared.queue, error = %err, "basic.cancel failed");
            }
            Err(_) => {
                tracing::warn!(
                    target: TRACING_TARGET,
                    queue = %self.shared.queue,
                    "basic.cancel not answered within the shutdown timeout"
                );
            }
        }
    }

    /// Closes the connection, waiting at most [`CLOSE_TIMEOUT`] for the
    /// broker's answer.
    async fn close(self) {
        let conn = self.shared.publisher.connection();
        if !conn.status().connected() {
            return;
        }
        match tokio::time::timeout(
            CLOSE_TIMEOUT,
            conn.close(200, ShortString::from("idempotent consumer stopped")),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::debug!(target: TRACING_TARGET, error = %err, "closing the connection failed");
            }
            Err(_) => {
                tracing::warn!(
                    target: TRACING_TARGET,
                    queue = %self.shared.queue,
                    "the broker did not answer the connection's close in time: dropping it"
                );
            }
        }
    }
}

/// The `messaging.destination.name` of a delivery, as OpenTelemetry's
/// RabbitMQ conventions put it on the consumer side:
/// `{exchange}:{routing key}:{queue}`, without the parts that are empty (the
/// default exchange) and with the routing key once when it is the queue's
/// name.
fn destination_name(exchange: &str, routing_key: &str, queue: &str) -> String {
    let routing_key = if routing_key == queue { "" } else { routing_key };
    [exchange, routing_key, queue]
        .into_iter()
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join(":")
}

/// One RabbitMQ delivery.
pub struct Delivery {
    shared: Arc<Shared>,
    delivery: AmqpDelivery,
    meta: Meta,
}

impl Delivery {
    fn new(shared: Arc<Shared>, delivery: AmqpDelivery) -> Delivery {
        let routing_key = delivery.routing_key.as_str();
        let meta = Meta {
            attempt: attempt_of(&delivery.properties),
            redelivered: delivery.redelivered,
            message_id: delivery.properties.message_id().as_ref().map(ToString::to_string),
            last: false,
            position: format!("delivery_tag={}", delivery.delivery_tag),
            destination: Some(destination_name(
                delivery.exchange.as_str(),
                routing_key,
                shared.queue.as_str(),
            )),
            routing_key: (!routing_key.is_empty()).then(|| routing_key.to_owned()),
            delivery_tag: Some(delivery.delivery_tag),
            partition: None,
            offset: None,
            message_key: None,
        };
        Delivery { shared, delivery, meta }
    }

    /// Publishes the delivery's body with `mandatory` and waits for the
    /// broker's confirmation of this very message ([`publisher`]): `Ok` only
    /// once the broker stored it in a queue.
    ///
    /// A message returned as unroutable or refused (`basic.nack`) is
    /// [`Refused`](Settle::Refused): the broker does not hold it. One the
    /// channel answered without a confirmation is
    /// [`Unknown`](Settle::Unknown): the broker may hold it. One whose
    /// channel or connection failed before the confirmation is
    /// [`Lost`](Settle::Lost) (the broker may hold it too, and redelivers
    /// the original). The wait has no time limit of its own: the broker
    /// confirms every message it takes, and a connection that stops
    /// answering fails at its heartbeat timeout, as lost.
    async fn publish(
        &self,
        exchange: &ShortString,
        routing_key: &ShortString,
        props: BasicProperties,
    ) -> Result<(), Settle> {
        let published = self
            .shared
            .publisher
            .publish(exchange.clone(), routing_key.clone(), &self.delivery.data, props)
            .await;
        match published {
            Ok(()) => Ok(()),
            Err(Unconfirmed::Returned { reply_code, reply_text }) => Err(Settle::Refused(format!(
                "unroutable to exchange `{exchange}` with routing key `{routing_key}`: {reply_code} {reply_text}"
            ))),
            Err(Unconfirmed::Nacked) => Err(Settle::Refused(format!(
                "the broker refused the message for `{routing_key}` (nack)"
            ))),
            // The message went out on a channel that answered without a
            // confirmation: the broker may hold it or not.
            Err(unconfirmed @ Unconfirmed::NotConfirmed) => Err(Settle::Unknown(unconfirmed.to_string())),
            Err(Unconfirmed::Failed(why)) => {
                // The publishing channel failed (an exchange deleted since
                // the consumer connected closes it). Start over on a new
                // connection, as when the publish shared the consuming
                // channel: its topology check reports what is missing, and
                // the broker redelivers the message.
                if self.shared.channel.status().connected()
                    && let Err(err) = self
                        .shared
                        .channel
                        .close(200, ShortString::from("a publish failed: reconnecting"))
                        .await
                {
                    tracing::debug!(target: TRACING_TARGET, error = %err, "closing the consuming channel failed");
                }
                Err(Settle::Lost(why))
            }
        }
    }
}

fn lost_settle(err: lapin::Error) -> Settle {
    Settle::Lost(format!("RabbitMQ: {err}"))
}

impl pipeline::Delivery for Delivery {
    fn body(&self) -> &[u8] {
        &self.delivery.data
    }

    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn is_current(&self) -> bool {
        self.shared.channel.status().connected()
    }

    /// A digest of what RabbitMQ keeps identical when it delivers the
    /// message again, on this connection or another (its exchange, routing
    /// key, properties and body; not the counts quorum queues add).
    /// The pipeline asks for it only when it dead-letters the message, and
    /// for each delivery once it has dead-lettered something; never on the
    /// way of a message acknowledged before any dead letter.
    fn identity(&self) -> Option<String> {
        Some(identity_of(&self.delivery))
    }

    /// RabbitMQ's `redelivered` flag is clear: a message published anew
    /// (a dead letter sent back as it was) is never taken for the
    /// redelivery of a dead-lettered one.
    fn first_delivery(&self) -> bool {
        !self.delivery.redelivered
    }

    async fn ack(&self) -> Result<(), Settle> {
        let acked = self.delivery.acker.ack(BasicAckOptions::default()).await;
        self.shared.unsettled.remove([self.delivery.delivery_tag]);
        match acked {
            Ok(true) => Ok(()),
            Ok(false) => Err(Settle::Lost(format!(
                "the channel consuming `{}` closed before delivery {} was settled",
                self.shared.queue, self.delivery.delivery_tag
            ))),
            Err(err) => Err(lost_settle(err)),
        }
    }

    /// One `basic.ack` with `multiple` for the batch's lowest deliveries
    /// when no other delivery of the channel below them is unsettled (see
    /// `Unsettled`); the others acknowledged one by one, all in flight
    /// together.
    async fn ack_all<'a>(deliveries: &'a [&'a Self]) -> Vec<Result<(), Settle>> {
        let together = match deliveries.first() {
            Some(first) if deliveries.iter().all(|d| Arc::ptr_eq(&d.shared, &first.shared)) => {
                let mut tags: Vec<u64> = deliveries.iter().map(|d| d.delivery.delivery_tag).collect();
                tags.sort_unstable();
                first.shared.unsettled.covered_by(&tags).and_then(|upto| {
                    let last = deliveries.iter().find(|d| d.delivery.delivery_tag == upto)?;
                    Some((upto, *last))
                })
            }
            _ => None,
        };
        let Some((upto, last)) = together else {
            return futures_util::future::join_all(deliveries.iter().map(|d| pipeline::Delivery::ack(*d))).await;
        };
        let multiple = async {
            let acked = last.delivery.acker.ack(BasicAckOptions { multiple: true }).await;
            let covered = deliveries
                .iter()
                .map(|d| d.delivery.delivery_tag)
                .filter(|&tag| tag <= upto);
            last.shared.unsettled.remove(covered);
            match acked {
                Ok(true) => Ok(()),
                Ok(false) => Err(Settle::Lost(format!(
                    "the channel consuming `{}` closed before deliveries up to {upto} were settled",
                    last.shared.queue
                ))),
                Err(err) => Err(lost_settle(err)),
            }
        };
        let alone = futures_util::future::join_all(
            deliveries
                .iter()
                .filter(|d| d.delivery.delivery_tag > upto)
                .map(|d| pipeline::Delivery::ack(*d)),
        );
        let (multiple, alone) = futures_util::future::join(multiple, alone).await;
        let mut alone = alone.into_iter();
        deliveries
            .iter()
            .map(|d| {
                if d.delivery.delivery_tag <= upto {
                    multiple.clone()
                } else {
                    alone
                        .next()
                        .unwrap_or_else(|| Err(Settle::Lost("not acknowledged".into())))
                }
            })
            .collect()
    }

    async fn retry(&self, next_attempt: u32, delay: Duration, shutdown: &CancellationToken) -> Result<(), Settle> {
        sleep_unless_cancelled(delay, shutdown).await;
        let props = edit_headers(&self.delivery.properties, |headers| {
            headers.remove(DELIVERY_COUNT);
            headers.insert(
                ShortString::from(HEADER_ATTEMPT),
                AMQPValue::LongLongInt(i64::from(next_attempt)),
            );
        });
        self.publish(&ShortString::default(), &self.shared.queue, props).await?;
        self.ack().await
    }

    async fn dead_letter(&self, letter: &Letter<'_>) -> Result<(), Settle> {
        let props = edit_headers(&self.delivery.properties, |headers| {
            headers.remove(HEADER_ATTEMPT);
            headers.remove(DELIVERY_COUNT);
            let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
            headers.insert(ShortString::from(HEADER_REASON), text(letter.reason));
            headers.insert(ShortString::from(HEADER_KIND), text(letter.kind));
            headers.insert(
                ShortString::from(HEADER_ATTEMPTS),
                AMQPValue::LongLongInt(i64::from(letter.attempts)),
            );
            headers.insert(ShortString::from(HEADER_SOURCE), text(letter.source));
        });
        match &self.shared.dead_letter {
            DeadLetter::Queue(queue) => self.publish(&ShortString::default(), queue, props).await?,
            DeadLetter::Exchange { exchange, routing_key } => self.publish(exchange, routing_key, props).await?,
        }
        Ok(())
    }

    async fn release(&self, delay: Duration) -> Result<(), Settle> {
        tokio::time::sleep(delay).await;
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let released = self.delivery.acker.nack(options).await;
        self.shared.unsettled.remove([self.delivery.delivery_tag]);
        match released {
            Ok(true) => Ok(()),
            Ok(false) => Err(Settle::Lost("the channel closed".into())),
            Err(err) => Err(lost_settle(err)),
        }
    }
}

/// What names a message across its deliveries (see
/// [`Delivery::identity`](pipeline::Delivery::identity)): a SHA-256 digest
/// of the exchange and routing key it was published with, its properties
/// (its `message_id` among them) and its body, which RabbitMQ keeps as they
/// are when it delivers the message again. What changes from one delivery
/// to the next is left out: the delivery tag (per channel), the
/// `redelivered` flag, and the headers quorum queues set to count the
/// deliveries ([`DELIVERY_COUNT`], [`ACQUIRED_COUNT`]).
///
/// The `message_id` alone would not do: it is the producer's name for the
/// message, which other messages can share (the retry copies this consumer
/// publishes, a message replayed from the dead-letter queue, a producer that
/// reuses its ids). A redelivery of a remembered message is settled without
/// its handler, so a replayed message recognised by its `message_id` would
/// be acknowledged without being processed while its dead letter was gone.
///
/// Two distinct messages that are identical in all of the above (no
/// `message_id`, or the same one, the same headers and body, published to
/// the same exchange and routing key) have the same identity. Only a
/// delivery RabbitMQ flags `redelivered` is looked up
/// ([`first_delivery`](pipeline::Delivery::first_delivery)), so a new
/// message of the same bytes (a dead letter sent back exactly as it was
/// first published) is handled; the collision that remains is a second
/// such message that is itself redelivered (its consumer's connection
/// lost before its ack) while the process remembers the first as
/// dead-lettered: it is settled as the first was, without its handler,
/// and acknowledged.
fn identity_of(delivery: &AmqpDelivery) -> String {
    // The headers apart, without the counts: no headers and an empty table
    // are the same (a quorum queue's redelivery carries a table for its
    // counts alone). The debug form of the same values is the same within
    // a process, which is as long as the consumer remembers.
    let mut headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    headers.remove(DELIVERY_COUNT);
    headers.remove(ACQUIRED_COUNT);
    let headers = format!("{headers:?}");
    let props = format!("{:?}", delivery.properties.clone().with_headers(FieldTable::default()));
    let hex = crate::key::digest_hex(&[
        delivery.exchange.as_str().as_bytes(),
        delivery.routing_key.as_str().as_bytes(),
        props.as_bytes(),
        headers.as_bytes(),
        delivery.data.as_slice(),
    ]);
    format!("rabbitmq:{hex}")
}

/// The attempt number of a delivery: our header (1 when absent) plus the
/// quorum queues' count of earlier deliveries of this copy.
fn attempt_of(props: &BasicProperties) -> u32 {
    let headers = props.headers().as_ref().map(FieldTable::inner);
    let header = |name: &str| headers.and_then(|h| h.get(name)).and_then(as_u64);
    let attempt = header(HEADER_ATTEMPT)
        .unwrap_or(1)
        .max(1)
        .saturating_add(header(DELIVERY_COUNT).unwrap_or(0));
    u32::try_from(attempt).unwrap_or(u32::MAX)
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongString(v) => std::str::from_utf8(v.as_bytes()).ok()?.trim().parse().ok(),
        AMQPValue::ShortString(v) => v.as_str().trim().parse().ok(),
        _ => None,
    }
}

fn edit_headers(props: &BasicProperties, edit: impl FnOnce(&mut BTreeMap<ShortString, AMQPValue>)) -> BasicProperties {
    let mut headers = props.headers().as_ref().map(|h| h.inner().clone()).unwrap_or_default();
    edit(&mut headers);
    props.clone().with_headers(FieldTable::from(headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destination_names_follow_the_rabbitmq_conventions() {
        // The default exchange, routed by queue name: the queue alone.
        assert_eq!(destination_name("", "payments", "payments"), "payments");
        // An exchange and a routing key other than the queue: all three.
        assert_eq!(
            destination_name("orders", "order.paid", "billing"),
            "orders:order.paid:billing"
        );
        // A fanout exchange (no routing key).
        assert_eq!(destination_name("events", "", "audit"), "events:audit");
        // An exchange whose routing key is the queue's name.
        assert_eq!(destination_name("direct", "billing", "billing"), "direct:billing");
    }

    #[test]
    fn a_message_keeps_its_identity_across_deliveries_and_only_its_own() {
        let delivery = |tag: u64, redelivered: bool, body: &[u8], props: BasicProperties| {
            let mut delivery = AmqpDelivery::mock(tag, "orders".into(), "paid".into(), redelivered, body.to_vec());
            delivery.properties = props;
            delivery
        };
        let props = BasicProperties::default().with_message_id("m-1".into());
        let first = identity_of(&delivery(1, false, b"{}", props.clone()));
        // Another tag, redelivered, with a quorum queue's counts (in a
        // table the first delivery did not have).
        let counted = edit_headers(&props, |h| {
            h.insert(ShortString::from(DELIVERY_COUNT), AMQPValue::LongInt(1));
            h.insert(ShortString::from(ACQUIRED_COUNT), AMQPValue::LongInt(2));
        });
        assert_eq!(identity_of(&delivery(7, true, b"{}", counted)), first);
        // What the producer set tells messages apart.
        assert_ne!(identity_of(&delivery(1, false, b"{ }", props.clone())), first);
        let other_id = BasicProperties::default().with_message_id("m-2".into());
        assert_ne!(identity_of(&delivery(1, false, b"{}", other_id)), first);
        let other_header = edit_headers(&props, |h| {
            h.insert(ShortString::from("x-shovelled"), AMQPValue::Boolean(true));
        });
        assert_ne!(identity_of(&delivery(1, false, b"{}", other_header)), first);
        let mut routed = delivery(1, false, b"{}", props);
        routed.routing_key = "shipped".into();
        assert_ne!(identity_of(&routed), first);
    }

    #[test]
    fn attempt_reads_our_header_and_delivery_count() {
        let props = BasicProperties::default();
        assert_eq!(attempt_of(&props), 1);
        let props = edit_headers(&props, |h| {
            h.insert(ShortString::from(HEADER_ATTEMPT), AMQPValue::LongLongInt(3));
        });
        assert_eq!(attempt_of(&props), 3);
        let props = edit_headers(&props, |h| {
            h.insert(ShortString::from(DELIVERY_COUNT), AMQPValue::LongInt(2));
        });
        assert_eq!(attempt_of(&props), 5);
        let props = edit_headers(&BasicProperties::default(), |h| {
            h.insert(ShortString::from(HEADER_ATTEMPT), AMQPValue::LongString("junk".into()));
        });
        assert_eq!(attempt_of(&props), 1);
    }
}
