//! RabbitMQ consumer runner (feature `lapin`): ack after the handler's
//! commit, bounded retries, dead-lettering, graceful shutdown.
//!
//! [`RabbitConsumer`] consumes one queue on a channel it owns, decodes each
//! delivery (JSON by default, see [`Decoder`]), calls the handler, and
//! settles the delivery from the handler's result:
//!
//! | handler | what happens |
//! | --- | --- |
//! | `Ok` | the delivery is acknowledged, only now (so after the marker's commit) |
//! | `Err`, attempts left and the error retryable | after a backoff, a copy carrying `x-idempotent-attempt: n + 1` is published to the queue with publisher confirms, then the original is acknowledged |
//! | `Err` on the last attempt, or not retryable ([`RetryPolicy`]) | the body is published unchanged to the dead-letter queue with `x-idempotent-reason`, `-kind`, `-attempts` and `-source` headers, then acknowledged |
//! | undecodable body (poison) | dead-lettered at once, the decoder's error as reason |
//! | panic | counts as a failed attempt |
//!
//! RabbitMQ's own `basic.nack(requeue)` does not count attempts on classic
//! queues, hence the republish. Publishing the copy before acknowledging the
//! original means a crash between the two leaves *two* copies: the
//! idempotent handler absorbs that, as it absorbs every other redelivery.
//! Nothing is ever dropped: when a copy or a dead letter cannot be published
//! (unroutable, refused by the broker), the original is handed back with
//! `basic.nack(requeue)` instead.
//!
//! A delivery redelivered by the broker after a crash (the consumer died
//! before its ack) keeps its attempt number on classic queues; on quorum
//! queues the broker's `x-delivery-count` is added to it, and their
//! `delivery-limit` bounds crash loops.
//!
//! ```no_run
//! use idempotent_runtime::lapin::{Connection, ConnectionProperties};
//! use idempotent_runtime::rabbitmq::{shutdown_on_signal, RabbitConsumer};
//!
//! #[derive(serde::Deserialize)]
//! struct PaymentMessage { message_id: String, order_id: String, amount: i64 }
//!
//! # async fn process_payment(_: &PaymentMessage) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let conn = Connection::connect("amqp://127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
//! let consumer = RabbitConsumer::builder(conn.create_channel().await?, "payments")
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
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::broker::{
    self, Called, DeadKind, Outcome, Recorder, TRACING_TARGET, sleep_unless_cancelled, truncate_reason,
};
pub use crate::broker::{
    Backoff, ConsumerError, ConsumerStats, Decoder, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, Json, RetryAll, RetryPolicy, RunStats, shutdown_on_signal,
};
/// The cancellation token [`RabbitConsumer::run`] stops on (re-exported from
/// `tokio-util`).
pub use tokio_util::sync::CancellationToken;

/// Header holding the attempt number of a retried copy (RabbitMQ), starting
/// at 1 for the original message.
pub const HEADER_ATTEMPT: &str = "x-idempotent-attempt";
/// Header RabbitMQ quorum queues set to the number of earlier deliveries.
const DELIVERY_COUNT: &str = "x-delivery-count";

/// Default prefetch (`basic.qos`).
pub const DEFAULT_PREFETCH: u16 = 32;
/// Default number of handlers running at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default number of handler runs per message before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default time in-flight handlers get to finish after shutdown is requested.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

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

/// Configures a [`RabbitConsumer`]; from [`RabbitConsumer::builder`].
#[must_use = "call `.build()` to get the consumer"]
pub struct RabbitConsumerBuilder<D = Json, R = RetryAll> {
    channel: Channel,
    queue: String,
    consumer_tag: String,
    prefetch: u16,
    concurrency: usize,
    max_attempts: u32,
    backoff: Backoff,
    dead_letter_queue: Option<String>,
    dead_letter_exchange: Option<(String, String)>,
    declare_dead_letter_queue: bool,
    shutdown_timeout: Duration,
    decoder: D,
    retry: R,
}

impl<D, R> fmt::Debug for RabbitConsumerBuilder<D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumerBuilder")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .finish_non_exhaustive()
    }
}

impl<D, R> RabbitConsumerBuilder<D, R> {
    /// Maximum number of unacknowledged deliveries the broker sends to this
    /// consumer (`basic.qos`, per consumer). Default [`DEFAULT_PREFETCH`].
    /// `0` means no limit; keep it at least [`concurrency`](Self::concurrency).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How many handlers run at once (each in its own task). Default
    /// [`DEFAULT_CONCURRENCY`]; `1` processes the queue in order.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// How many times the handler may run on one message before it is
    /// dead-lettered (at least 1). Default [`DEFAULT_MAX_ATTEMPTS`].
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Delay before republishing a failed message. The consumer waits in
    /// the delivery's task, holding a concurrency slot and a prefetch slot,
    /// so keep it short (seconds). Default 1 s doubling up to 30 s.
    pub fn retry_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Dead-letter queue, published to through the default exchange and
    /// declared (durable, no arguments) when the consumer starts unless
    /// [`declare_dead_letter_queue(false)`](Self::declare_dead_letter_queue).
    /// Default: `"<queue>.dlq"`.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = Some(queue.into());
        self.dead_letter_exchange = None;
        self
    }

    /// Dead-letters to an exchange with a routing key instead of a queue.
    /// The exchange and a queue bound to it must exist: an unroutable dead
    /// letter is not dropped, the original goes back to its queue.
    pub fn dead_letter_exchange(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some((exchange.into(), routing_key.into()));
        self.dead_letter_queue = None;
        self
    }

    /// Whether to declare the dead-letter queue at start (default `true`).
    /// Turn it off when the queue exists with arguments of its own.
    pub fn declare_dead_letter_queue(mut self, declare: bool) -> Self {
        self.declare_dead_letter_queue = declare;
        self
    }

    /// Consumer tag shown in the management UI; default empty (the broker
    /// generates one).
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// How long in-flight handlers get to finish once shutdown is requested;
    /// after it they are abandoned unacknowledged (the broker redelivers
    /// them). Default [`DEFAULT_SHUTDOWN_TIMEOUT`].
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Replaces the body decoder (default [`Json`]), e.g. with a closure
    /// `|body: &[u8]| -> Result<M, E>`.
    pub fn decoder<D2>(self, decoder: D2) -> RabbitConsumerBuilder<D2, R> {
        RabbitConsumerBuilder {
            channel: self.channel,
            queue: self.queue,
            consumer_tag: self.consumer_tag,
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            dead_letter_queue: self.dead_letter_queue,
            dead_letter_exchange: self.dead_letter_exchange,
            declare_dead_letter_queue: self.declare_dead_letter_queue,
            shutdown_timeout: self.shutdown_timeout,
            decoder,
            retry: self.retry,
        }
    }

    /// Decides which handler errors are retried (default [`RetryAll`]); a
    /// closure `|err: &E| -> bool` works. Errors it calls permanent are
    /// dead-lettered at once.
    pub fn retry_if<R2>(self, retry: R2) -> RabbitConsumerBuilder<D, R2> {
        RabbitConsumerBuilder {
            channel: self.channel,
            queue: self.queue,
            consumer_tag: self.consumer_tag,
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            dead_letter_queue: self.dead_letter_queue,
            dead_letter_exchange: self.dead_letter_exchange,
            declare_dead_letter_queue: self.declare_dead_letter_queue,
            shutdown_timeout: self.shutdown_timeout,
            decoder: self.decoder,
            retry,
        }
    }

    /// Checks the configuration and builds the consumer.
    pub fn build(self) -> Result<RabbitConsumer<D, R>, ConsumerError> {
        let short = |what: &str, value: &str| {
            ShortString::try_new(value.to_owned())
                .map_err(|err| ConsumerError::Config(format!("{what} `{value}`: {err}")))
        };
        if self.queue.is_empty() {
            return Err(ConsumerError::Config("the queue name is empty".into()));
        }
        if self.concurrency == 0 {
            return Err(ConsumerError::Config("concurrency must be at least 1".into()));
        }
        if self.max_attempts == 0 {
            return Err(ConsumerError::Config("max_attempts must be at least 1".into()));
        }
        if self.prefetch != 0 && usize::from(self.prefetch) < self.concurrency {
            tracing::warn!(
                target: TRACING_TARGET,
                queue = %self.queue,
                prefetch = self.prefetch,
                concurrency = self.concurrency,
                "prefetch below concurrency: at most `prefetch` handlers will run at once"
            );
        }
        let queue = short("queue", &self.queue)?;
        let consumer_tag = short("consumer tag", &self.consumer_tag)?;
        let (dead_letter, declare) = match (self.dead_letter_exchange, self.dead_letter_queue) {
            (Some((exchange, routing_key)), _) => (
                DeadLetter::Exchange {
                    exchange: short("dead-letter exchange", &exchange)?,
                    routing_key: short("dead-letter routing key", &routing_key)?,
                },
                false,
            ),
            (None, name) => {
                let name = name.unwrap_or_else(|| format!("{}.dlq", self.queue));
                if name == self.queue {
                    return Err(ConsumerError::Config(
                        "the dead-letter queue is the consumed queue".into(),
                    ));
                }
                (
                    DeadLetter::Queue(short("dead-letter queue", &name)?),
                    self.declare_dead_letter_queue,
                )
            }
        };
        Ok(RabbitConsumer {
            channel: self.channel,
            queue,
            consumer_tag,
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            dead_letter,
            declare_dead_letter_queue: declare,
            shutdown_timeout: self.shutdown_timeout,
            decoder: self.decoder,
            retry: self.retry,
            stats: ConsumerStats::default(),
        })
    }
}

/// Consumes a RabbitMQ queue with an idempotent handler; see the
/// [module documentation](self) for the delivery rules.
///
/// The consumer owns its channel: it enables publisher confirms and sets the
/// prefetch on it, and closes it when [`run`](Self::run) returns. Give it a
/// channel of its own (`connection.create_channel()`).
pub struct RabbitConsumer<D = Json, R = RetryAll> {
    channel: Channel,
    queue: ShortString,
    consumer_tag: ShortString,
    prefetch: u16,
    concurrency: usize,
    max_attempts: u32,
    backoff: Backoff,
    dead_letter: DeadLetter,
    declare_dead_letter_queue: bool,
    shutdown_timeout: Duration,
    decoder: D,
    retry: R,
    stats: ConsumerStats,
}

impl<D, R> fmt::Debug for RabbitConsumer<D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("dead_letter", &self.dead_letter)
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// Starts configuring a consumer of `queue` on `channel` (which the
    /// consumer then owns). The queue must exist.
    pub fn builder(channel: Channel, queue: impl Into<String>) -> RabbitConsumerBuilder {
        RabbitConsumerBuilder {
            channel,
            queue: queue.into(),
            consumer_tag: String::new(),
            prefetch: DEFAULT_PREFETCH,
            concurrency: DEFAULT_CONCURRENCY,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: Backoff::default(),
            dead_letter_queue: None,
            dead_letter_exchange: None,
            declare_dead_letter_queue: true,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            decoder: Json,
            retry: RetryAll,
        }
    }
}

impl<D, R> RabbitConsumer<D, R> {
    /// A live view of this consumer's counters, readable while
    /// [`run`](Self::run) is going.
    pub fn stats(&self) -> ConsumerStats {
        self.stats.clone()
    }

    /// Consumes until `shutdown` is cancelled, calling `handler` with each
    /// decoded message; returns the run's counters.
    ///
    /// On shutdown it cancels the subscription (`basic.cancel`), waits for
    /// the handlers in flight to finish and settle their deliveries (up to
    /// the [shutdown timeout](RabbitConsumerBuilder::shutdown_timeout)),
    /// then closes the channel. Deliveries prefetched but not started go
    /// back to the queue with the channel.
    ///
    /// Returns an error when the channel or connection fails (the handlers
    /// in flight are still given their chance to finish); restart the
    /// consumer on a new channel then. Unacknowledged deliveries are
    /// redelivered by the broker.
    ///
    /// Dropping the returned future instead of cancelling `shutdown` aborts
    /// the handlers in flight: nothing more is acknowledged, and the broker
    /// redelivers their messages once the channel is gone.
    pub async fn run<M, H, Fut, T, E>(self, handler: H, shutdown: CancellationToken) -> Result<RunStats, ConsumerError>
    where
        M: Send + 'static,
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.run_with_info(move |msg, _info| handler(msg), shutdown).await
    }

    /// Like [`run`](Self::run), with the handler also given what the
    /// adapter knows about the delivery ([`DeliveryInfo`]: AMQP message id,
    /// attempt number, redelivered flag).
    pub async fn run_with_info<M, H, Fut, T, E>(
        self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<RunStats, ConsumerError>
    where
        M: Send + 'static,
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let RabbitConsumer {
            channel,
            queue,
            consumer_tag,
            prefetch,
            concurrency,
            max_attempts,
            backoff,
            dead_letter,
            declare_dead_letter_queue,
            shutdown_timeout,
            decoder,
            retry,
            stats,
        } = self;
        let recorder = Recorder::new("rabbitmq", queue.as_str(), stats.clone());

        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        match (&dead_letter, declare_dead_letter_queue) {
            (DeadLetter::Queue(dlq), true) => {
                channel
                    .queue_declare(dlq.clone(), QueueDeclareOptions::durable(), FieldTable::default())
                    .await?;
            }
            (DeadLetter::Exchange { exchange, .. }, _) => {
                // Fail now, not on the first dead letter: publishing to a
                // missing exchange closes the channel mid-run.
                let passive = ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                };
                channel
                    .exchange_declare(exchange.clone(), ExchangeKind::Direct, passive, FieldTable::default())
                    .await
                    .map_err(|err| {
                        ConsumerError::Config(format!("the dead-letter exchange `{exchange}` cannot be used: {err}"))
                    })?;
            }
            (DeadLetter::Queue(_), false) => {}
        }
        let mut consumer = channel
            .basic_consume(
                queue.clone(),
                consumer_tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let tag = consumer.tag();
        tracing::info!(
            target: TRACING_TARGET,
            queue = %queue,
            consumer_tag = %tag,
            prefetch,
            concurrency,
            max_attempts,
            "RabbitMQ consumer started"
        );

        let worker = Arc::new(Worker {
            channel: channel.clone(),
            queue: queue.clone(),
            max_attempts,
            backoff,
            dead_letter,
            decoder,
            retry,
            handler,
            recorder: recorder.clone(),
            shutdown: shutdown.clone(),
        });
        let mut tasks: JoinSet<Result<(), ConsumerError>> = JoinSet::new();
        let mut fatal: Option<ConsumerError> = None;

        loop {
            while let Some(done) = tasks.try_join_next() {
                broker::note_task(done, &mut fatal);
            }
            if fatal.is_some() {
                break;
            }
            if tasks.len() >= concurrency {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    Some(done) = tasks.join_next() => {
                        broker::note_task(done, &mut fatal);
                        continue;
                    }
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(done) = tasks.join_next(), if !tasks.is_empty() => broker::note_task(done, &mut fatal),
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        recorder.received();
                        tasks.spawn(handle(Arc::clone(&worker), delivery));
                    }
                    Some(Err(err)) => {
                        fatal = Some(err.into());
                        break;
                    }
                    None => {
                        fatal = Some(ConsumerError::Cancelled(queue.to_string()));
                        break;
                    }
                },
            }
        }

        tracing::info!(
            target: TRACING_TARGET,
            queue = %queue,
            in_flight = tasks.len(),
            error = fatal.as_ref().map(tracing::field::display),
            "RabbitMQ consumer stopping"
        );
        if channel.status().connected()
            && let Err(err) = channel.basic_cancel(tag, BasicCancelOptions::default()).await
        {
            tracing::warn!(target: TRACING_TARGET, queue = %queue, error = %err, "basic.cancel failed");
        }
        // Deliveries buffered but not started stay unacknowledged and go
        // back to the queue when the channel closes.
        drop(consumer);
        broker::drain(&mut tasks, shutdown_timeout, &mut fatal, queue.as_str()).await;
        drop(worker);
        if channel.status().connected()
            && let Err(err) = channel
                .close(200, ShortString::from("idempotent consumer stopped"))
                .await
        {
            tracing::warn!(target: TRACING_TARGET, queue = %queue, error = %err, "closing the channel failed");
        }
        let stats = stats.snapshot();
        tracing::info!(target: TRACING_TARGET, queue = %queue, ?stats, "RabbitMQ consumer stopped");
        match fatal {
            Some(err) => Err(err),
            None => Ok(stats),
        }
    }
}

/// What every delivery task shares.
struct Worker<D, R, H> {
    channel: Channel,
    queue: ShortString,
    max_attempts: u32,
    backoff: Backoff,
    dead_letter: DeadLetter,
    decoder: D,
    retry: R,
    handler: H,
    recorder: Recorder,
    shutdown: CancellationToken,
}

/// The outcome of a publish: `Err` for a broken channel, `Ok(Err(why))` for
/// a message the broker would not take.
type Published = Result<Result<(), String>, lapin::Error>;

async fn handle<M, D, R, H, Fut, T, E>(worker: Arc<Worker<D, R, H>>, delivery: Delivery) -> Result<(), ConsumerError>
where
    D: Decoder<M>,
    R: RetryPolicy<E>,
    H: Fn(M, DeliveryInfo) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: fmt::Display,
{
    let attempt = attempt_of(&delivery.properties);
    let message_id = delivery.properties.message_id().as_ref().map(ToString::to_string);
    let span = tracing::info_span!(
        target: TRACING_TARGET,
        "delivery",
        broker = "rabbitmq",
        source = %worker.queue,
        message_id = tracing::field::Empty,
        delivery_tag = delivery.delivery_tag,
        attempt,
        redelivered = delivery.redelivered,
        outcome = tracing::field::Empty,
    );
    if let Some(id) = &message_id {
        span.record("message_id", id.as_str());
    }
    worker.process(delivery, attempt, message_id).instrument(span).await
}

impl<D, R, H> Worker<D, R, H> {
    async fn process<M, Fut, T, E>(
        &self,
        delivery: Delivery,
        attempt: u32,
        message_id: Option<String>,
    ) -> Result<(), ConsumerError>
    where
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        let msg = match self.decoder.decode(&delivery.data) {
            Ok(msg) => msg,
            Err(reason) => {
                tracing::error!(target: TRACING_TARGET, %reason, "undecodable (poison) message: dead-lettering it");
                let published = self.dead_letter(&delivery, DeadKind::Poison, &reason, 0).await;
                return self.settle(&delivery, published, Outcome::Poison).await;
            }
        };
        let info = DeliveryInfo {
            message_id,
            attempt,
            redelivered: delivery.redelivered,
        };
        let (reason, retryable) = match broker::call((self.handler)(msg, info), &self.recorder).await {
            Called::Ok => {
                self.ack(&delivery, Outcome::Processed).await?;
                tracing::debug!(target: TRACING_TARGET, "processed and acknowledged");
                return Ok(());
            }
            Called::Err(err) => {
                let retryable = self.retry.is_retryable(&err);
                (err.to_string(), retryable)
            }
            Called::Panicked(reason) => (reason, true),
        };
        self.recorder.handler_failed();

        if retryable && attempt < self.max_attempts {
            let delay = self.backoff.delay(attempt);
            tracing::warn!(
                target: TRACING_TARGET,
                error = %reason,
                attempt,
                max_attempts = self.max_attempts,
                delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                "handler failed: retrying"
            );
            sleep_unless_cancelled(delay, &self.shutdown).await;
            let props = edit_headers(&delivery.properties, |headers| {
                headers.remove(DELIVERY_COUNT);
                headers.insert(
                    ShortString::from(HEADER_ATTEMPT),
                    AMQPValue::LongLongInt(i64::from(attempt) + 1),
                );
            });
            let published = self
                .publish(&ShortString::default(), &self.queue, &delivery.data, props)
                .await;
            self.settle(&delivery, published, Outcome::Retried).await
        } else {
            let kind = if retryable {
                DeadKind::Exhausted
            } else {
                DeadKind::Rejected
            };
            tracing::error!(
                target: TRACING_TARGET,
                error = %reason,
                attempt,
                max_attempts = self.max_attempts,
                kind = kind.as_str(),
                "handler failed: dead-lettering the message"
            );
            let published = self.dead_letter(&delivery, kind, &reason, attempt).await;
            self.settle(&delivery, published, Outcome::DeadLettered).await
        }
    }

    /// Publishes the body unchanged, with the dead-letter headers.
    async fn dead_letter(&self, delivery: &Delivery, kind: DeadKind, reason: &str, attempts: u32) -> Published {
        let props = edit_headers(&delivery.properties, |headers| {
            headers.remove(HEADER_ATTEMPT);
            headers.remove(DELIVERY_COUNT);
            let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
            headers.insert(ShortString::from(HEADER_REASON), text(&truncate_reason(reason)));
            headers.insert(ShortString::from(HEADER_KIND), text(kind.as_str()));
            headers.insert(
                ShortString::from(HEADER_ATTEMPTS),
                AMQPValue::LongLongInt(i64::from(attempts)),
            );
            headers.insert(ShortString::from(HEADER_SOURCE), text(self.queue.as_str()));
        });
        match &self.dead_letter {
            DeadLetter::Queue(queue) => {
                self.publish(&ShortString::default(), queue, &delivery.data, props)
                    .await
            }
            DeadLetter::Exchange { exchange, routing_key } => {
                self.publish(exchange, routing_key, &delivery.data, props).await
            }
        }
    }

    /// Publishes with `mandatory` and waits for the broker's confirm.
    async fn publish(
        &self,
        exchange: &ShortString,
        routing_key: &ShortString,
        body: &[u8],
        props: BasicProperties,
    ) -> Published {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let confirm = self
            .channel
            .basic_publish(exchange.clone(), routing_key.clone(), options, body, props)
            .await?
            .await?;
        Ok(match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(format!(
                "unroutable to exchange `{exchange}` with routing key `{routing_key}`: {} {}",
                returned.reply_code, returned.reply_text
            )),
            Confirmation::Nack(_) => Err(format!("the broker refused the message for `{routing_key}` (nack)")),
        })
    }

    /// Acknowledges after a successful publish; hands the delivery back
    /// when the broker would not take the publish.
    async fn settle(&self, delivery: &Delivery, published: Published, outcome: Outcome) -> Result<(), ConsumerError> {
        match published {
            Ok(Ok(())) => self.ack(delivery, outcome).await,
            Ok(Err(why)) => {
                tracing::error!(
                    target: TRACING_TARGET,
                    error = %why,
                    "could not publish the message's next step: returning it to the queue"
                );
                sleep_unless_cancelled(self.backoff.initial, &self.shutdown).await;
                let options = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                self.recorder.outcome(Outcome::Released);
                match delivery.acker.nack(options).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(self.closed(delivery)),
                    Err(err) => Err(err.into()),
                }
            }
            Err(err) => {
                // The channel is gone: the broker redelivers the original.
                self.recorder.outcome(Outcome::Released);
                Err(err.into())
            }
        }
    }

    async fn ack(&self, delivery: &Delivery, outcome: Outcome) -> Result<(), ConsumerError> {
        let result = match delivery.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.closed(delivery)),
            Err(err) => Err(err.into()),
        };
        match &result {
            Ok(()) => self.recorder.outcome(outcome),
            Err(err) => {
                self.recorder.outcome(Outcome::AckFailed);
                tracing::warn!(
                    target: TRACING_TARGET,
                    error = %err,
                    "acknowledgement failed: the broker will redeliver the message"
                );
            }
        }
        result
    }

    fn closed(&self, delivery: &Delivery) -> ConsumerError {
        ConsumerError::Disconnected(format!(
            "the channel consuming `{}` closed before delivery {} was settled",
            self.queue, delivery.delivery_tag
        ))
    }
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
