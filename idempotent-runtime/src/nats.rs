//! NATS JetStream consumer runner (feature `nats`): ack after the handler's
//! commit, `nak` with backoff, `term` after dead-lettering, graceful shutdown.
//!
//! [`JetStreamConsumer`] pulls from a durable JetStream pull consumer with
//! explicit acks, decodes each message (JSON by default, see [`Decoder`]),
//! calls the handler, and settles the message from the handler's result:
//!
//! | handler | what happens |
//! | --- | --- |
//! | `Ok` | the message is acknowledged (`+ACK`, confirmed by the server), only now (so after the marker's commit) |
//! | `Err`, attempts left and the error retryable | `-NAK` with an exponential delay: JetStream redelivers it and counts the delivery |
//! | `Err` on the last attempt, or not retryable ([`RetryPolicy`]) | the payload is published unchanged to the dead-letter subject with `x-idempotent-reason`, `-kind`, `-attempts` and `-source` headers (and the original's headers), then the message is terminated (`+TERM`) |
//! | undecodable payload (poison) | dead-lettered and terminated at once, the decoder's error as reason |
//! | panic | counts as a failed attempt |
//!
//! The attempt number is the server's delivery count, so a consumer that
//! dies before its ack (the server redelivers after `ack_wait`) also uses an
//! attempt. The attempts allowed are the builder's
//! [`max_attempts`](JetStreamConsumerBuilder::max_attempts), capped by the
//! consumer's `max_deliver` minus one when it has one: the server's **last
//! delivery is kept for settling**. A message that reaches it (its earlier
//! deliveries were lost to crashes, shutdown timeouts or dead letters that
//! could not be published) is dead-lettered without running the handler
//! again, and on that delivery a dead-letter publish that fails is retried
//! (with in-progress acks) instead of handed back, since the server would
//! not deliver it again. A message is never released on its last delivery.
//!
//! The dead-letter subject must be captured by a stream: the dead letter is
//! published with a JetStream acknowledgement, and when that fails the
//! message is `nak`ed instead of terminated, never dropped. The dead letter
//! does not carry the original's `Nats-Msg-Id` (that id goes in
//! `x-idempotent-msg-id`): its own id is derived from the stream, consumer
//! and stream sequence, so JetStream's duplicate window can never drop a
//! dead letter as a copy of another message, while a dead letter published
//! twice (the first `+TERM` lost) is stored once. The dead-letter subject may
//! be captured by the consumed stream itself, as long as the consumer's
//! filter excludes it: `run` refuses a consumer that would read its own dead
//! letters. While a handler runs longer than half the consumer's `ack_wait`,
//! the adapter sends "in progress" (`+WPI`) so the server does not redeliver
//! it meanwhile.
//!
//! ```no_run
//! use idempotent_runtime::async_nats::jetstream::{self, consumer::PullConsumer};
//! use idempotent_runtime::nats::{shutdown_on_signal, JetStreamConsumer};
//!
//! #[derive(serde::Deserialize)]
//! struct PaymentMessage { message_id: String, order_id: String, amount: i64 }
//!
//! # async fn process_payment(_: &PaymentMessage) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let js = jetstream::new(idempotent_runtime::async_nats::connect("127.0.0.1:4222").await?);
//! let pull: PullConsumer = js.get_stream("PAYMENTS").await?.get_consumer("payments").await?;
//! let consumer = JetStreamConsumer::builder(js.clone(), pull)
//!     .dead_letter_subject("payments.dlq")
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

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::broker::{
    self, Called, DeadKind, Outcome, Recorder, TRACING_TARGET, sleep_unless_cancelled, truncate_reason,
};
pub use crate::broker::{
    Backoff, ConsumerError, ConsumerStats, Decoder, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, Json, RetryAll, RetryPolicy, RunStats, shutdown_on_signal,
};
/// The cancellation token [`JetStreamConsumer::run`] stops on (re-exported
/// from `tokio-util`).
pub use tokio_util::sync::CancellationToken;

/// Default number of handlers running at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default number of handler runs per message before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default lifetime of one pull request.
pub const DEFAULT_FETCH_EXPIRY: Duration = Duration::from_secs(2);
/// Default time in-flight handlers get to finish after shutdown is requested.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// The shortest consumer `ack_wait` the adapter accepts: in-progress acks
/// go out every `ack_wait / 2`.
pub const MIN_ACK_WAIT: Duration = Duration::from_millis(100);

/// Header of a dead letter holding the original message's `Nats-Msg-Id`
/// (the dead letter has an id of its own).
pub const HEADER_MSG_ID: &str = "x-idempotent-msg-id";

/// Configures a [`JetStreamConsumer`]; from [`JetStreamConsumer::builder`].
#[must_use = "call `.build()` to get the consumer"]
pub struct JetStreamConsumerBuilder<D = Json, R = RetryAll> {
    context: jetstream::Context,
    consumer: PullConsumer,
    dead_letter_subject: Option<String>,
    concurrency: usize,
    prefetch: Option<usize>,
    max_attempts: u32,
    backoff: Backoff,
    fetch_expiry: Duration,
    shutdown_timeout: Duration,
    decoder: D,
    retry: R,
}

impl<D, R> fmt::Debug for JetStreamConsumerBuilder<D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let info = self.consumer.cached_info();
        f.debug_struct("JetStreamConsumerBuilder")
            .field("stream", &info.stream_name)
            .field("consumer", &info.name)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

impl<D, R> JetStreamConsumerBuilder<D, R> {
    /// Subject the dead letters are published to (required). A stream must
    /// capture it.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// How many handlers run at once (each in its own task). Default
    /// [`DEFAULT_CONCURRENCY`].
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Largest number of messages one pull request asks for (default: the
    /// concurrency). The adapter never asks for more messages than it has
    /// free handler slots, so messages do not wait in the client while
    /// their `ack_wait` runs.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = Some(prefetch);
        self
    }

    /// How many times the handler may run on one message before it is
    /// dead-lettered (at least 1); capped by the consumer's `max_deliver`
    /// minus one (the last delivery is kept for settling). Default
    /// [`DEFAULT_MAX_ATTEMPTS`].
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Redelivery delay asked for with each `nak`. Default 1 s doubling up
    /// to 30 s.
    pub fn retry_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Lifetime of one pull request (default [`DEFAULT_FETCH_EXPIRY`]).
    /// Shorter means a faster shutdown and more requests on an idle stream.
    pub fn fetch_expiry(mut self, expiry: Duration) -> Self {
        self.fetch_expiry = expiry;
        self
    }

    /// How long in-flight handlers get to finish once shutdown is requested;
    /// after it they are abandoned unacknowledged (the server redelivers
    /// them after `ack_wait`). Default [`DEFAULT_SHUTDOWN_TIMEOUT`].
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Replaces the payload decoder (default [`Json`]), e.g. with a closure
    /// `|payload: &[u8]| -> Result<M, E>`.
    pub fn decoder<D2>(self, decoder: D2) -> JetStreamConsumerBuilder<D2, R> {
        JetStreamConsumerBuilder {
            context: self.context,
            consumer: self.consumer,
            dead_letter_subject: self.dead_letter_subject,
            concurrency: self.concurrency,
            prefetch: self.prefetch,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            fetch_expiry: self.fetch_expiry,
            shutdown_timeout: self.shutdown_timeout,
            decoder,
            retry: self.retry,
        }
    }

    /// Decides which handler errors are retried (default [`RetryAll`]); a
    /// closure `|err: &E| -> bool` works. Errors it calls permanent are
    /// dead-lettered at once.
    pub fn retry_if<R2>(self, retry: R2) -> JetStreamConsumerBuilder<D, R2> {
        JetStreamConsumerBuilder {
            context: self.context,
            consumer: self.consumer,
            dead_letter_subject: self.dead_letter_subject,
            concurrency: self.concurrency,
            prefetch: self.prefetch,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            fetch_expiry: self.fetch_expiry,
            shutdown_timeout: self.shutdown_timeout,
            decoder: self.decoder,
            retry,
        }
    }

    /// Checks the configuration against the consumer's and builds.
    ///
    /// Fails without a dead-letter subject, with a zero concurrency,
    /// prefetch or `max_attempts`, for a consumer whose ack policy is not
    /// `explicit` (with `all`, one ack would settle other messages still in
    /// flight; with `none`, nothing could be retried), whose `max_deliver`
    /// is 1 (no delivery would be left to settle a failure on), or whose
    /// `ack_wait` is below [`MIN_ACK_WAIT`] (in-progress acks could not keep
    /// a running handler's message).
    pub fn build(self) -> Result<JetStreamConsumer<D, R>, ConsumerError> {
        let info = self.consumer.cached_info().clone();
        let config = &info.config;
        let dead_letter_subject = match self.dead_letter_subject {
            Some(subject) if valid_publish_subject(&subject) => subject,
            Some(subject) => {
                return Err(ConsumerError::Config(format!(
                    "dead-letter subject `{subject}` is not a valid subject to publish to"
                )));
            }
            None => return Err(ConsumerError::Config("a dead-letter subject is required".into())),
        };
        if config.ack_policy != AckPolicy::Explicit {
            return Err(ConsumerError::Config(format!(
                "consumer `{}` of stream `{}` must use the explicit ack policy, not {:?}",
                info.name, info.stream_name, config.ack_policy
            )));
        }
        if self.concurrency == 0 || self.prefetch == Some(0) {
            return Err(ConsumerError::Config(
                "concurrency and prefetch must be at least 1".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(ConsumerError::Config("max_attempts must be at least 1".into()));
        }
        let max_deliver = u32::try_from(config.max_deliver).ok().filter(|&n| n > 0);
        let max_attempts = match max_deliver {
            Some(1) => {
                return Err(ConsumerError::Config(format!(
                    "consumer `{}` of stream `{}` has max_deliver 1: no delivery would be left to retry or to \
                     dead-letter a failed message on; use at least 2, or -1 (unlimited)",
                    info.name, info.stream_name
                )));
            }
            Some(max_deliver) => {
                if max_deliver <= self.max_attempts {
                    tracing::info!(
                        target: TRACING_TARGET,
                        consumer = %info.name,
                        max_deliver,
                        max_attempts = self.max_attempts,
                        "the consumer's max_deliver caps the attempts at max_deliver - 1 (the last delivery is \
                         kept for settling)"
                    );
                }
                (max_deliver - 1).min(self.max_attempts)
            }
            None => self.max_attempts,
        };
        if !config.ack_wait.is_zero() && config.ack_wait < MIN_ACK_WAIT {
            return Err(ConsumerError::Config(format!(
                "consumer `{}` of stream `{}` has ack_wait {:?}: in-progress acks are sent every ack_wait / 2, \
                 so it must be at least {MIN_ACK_WAIT:?}",
                info.name, info.stream_name, config.ack_wait
            )));
        }
        let progress = (!config.ack_wait.is_zero()).then(|| (config.ack_wait / 2).max(Duration::from_millis(1)));
        Ok(JetStreamConsumer {
            context: self.context,
            consumer: self.consumer,
            source: format!("{}/{}", info.stream_name, info.name),
            dead_letter_subject,
            concurrency: self.concurrency,
            prefetch: self.prefetch.unwrap_or(self.concurrency),
            max_attempts,
            max_deliver,
            backoff: self.backoff,
            fetch_expiry: self.fetch_expiry,
            shutdown_timeout: self.shutdown_timeout,
            progress,
            decoder: self.decoder,
            retry: self.retry,
            stats: ConsumerStats::default(),
        })
    }
}

/// Consumes a JetStream pull consumer with an idempotent handler; see the
/// [module documentation](self) for the delivery rules.
pub struct JetStreamConsumer<D = Json, R = RetryAll> {
    context: jetstream::Context,
    consumer: PullConsumer,
    source: String,
    dead_letter_subject: String,
    concurrency: usize,
    prefetch: usize,
    max_attempts: u32,
    /// The consumer's `max_deliver`, when finite.
    max_deliver: Option<u32>,
    backoff: Backoff,
    fetch_expiry: Duration,
    shutdown_timeout: Duration,
    progress: Option<Duration>,
    decoder: D,
    retry: R,
    stats: ConsumerStats,
}

impl<D, R> fmt::Debug for JetStreamConsumer<D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamConsumer")
            .field("source", &self.source)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("concurrency", &self.concurrency)
            .field("prefetch", &self.prefetch)
            .field("max_attempts", &self.max_attempts)
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

impl JetStreamConsumer {
    /// Starts configuring a runner for `consumer` (a pull consumer with
    /// explicit acks); `context` publishes the dead letters.
    pub fn builder(context: jetstream::Context, consumer: PullConsumer) -> JetStreamConsumerBuilder {
        JetStreamConsumerBuilder {
            context,
            consumer,
            dead_letter_subject: None,
            concurrency: DEFAULT_CONCURRENCY,
            prefetch: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: Backoff::default(),
            fetch_expiry: DEFAULT_FETCH_EXPIRY,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            decoder: Json,
            retry: RetryAll,
        }
    }
}

impl<D, R> JetStreamConsumer<D, R> {
    /// A live view of this consumer's counters, readable while
    /// [`run`](Self::run) is going.
    pub fn stats(&self) -> ConsumerStats {
        self.stats.clone()
    }

    /// The attempts allowed per message: `max_attempts`, capped by the
    /// consumer's `max_deliver` minus one.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Consumes until `shutdown` is cancelled, calling `handler` with each
    /// decoded message; returns the run's counters.
    ///
    /// On shutdown it stops pulling, handles the messages that still arrive
    /// for the last pull request until it expires (at most the
    /// [fetch expiry](JetStreamConsumerBuilder::fetch_expiry)) rather than
    /// handing them back (which would spend one of their deliveries), and
    /// waits for the handlers in flight to finish and settle their messages
    /// (up to the [shutdown timeout](JetStreamConsumerBuilder::shutdown_timeout)).
    ///
    /// Fails at once with [`ConsumerError::Config`] when the consumed stream
    /// captures the dead-letter subject and the consumer's filter does not
    /// exclude it (it would consume its own dead letters).
    ///
    /// Pull failures (server unavailable, the client reconnecting) are
    /// logged and retried with backoff until shutdown.
    ///
    /// Dropping the returned future instead of cancelling `shutdown` aborts
    /// the handlers in flight: nothing more is acknowledged, and the server
    /// redelivers their messages after `ack_wait`.
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
    /// adapter knows about the message ([`DeliveryInfo`]: `Nats-Msg-Id`,
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
        let JetStreamConsumer {
            context,
            consumer,
            source,
            dead_letter_subject,
            concurrency,
            prefetch,
            max_attempts,
            max_deliver,
            backoff,
            fetch_expiry,
            shutdown_timeout,
            progress,
            decoder,
            retry,
            stats,
        } = self;
        let recorder = Recorder::new("nats", &source, stats.clone());
        check_not_consuming_dead_letters(&context, &consumer, &dead_letter_subject).await?;
        tracing::info!(
            target: TRACING_TARGET,
            source = %source,
            concurrency,
            prefetch,
            max_attempts,
            "JetStream consumer started"
        );
        let worker = Arc::new(Worker {
            context,
            source: source.clone(),
            dead_letter_subject,
            max_attempts,
            max_deliver,
            backoff,
            progress,
            decoder,
            retry,
            handler,
            recorder: recorder.clone(),
            shutdown: shutdown.clone(),
        });
        let pull_backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut pull_failures = 0u32;
        let mut tasks: JoinSet<Result<(), ConsumerError>> = JoinSet::new();
        let mut fatal: Option<ConsumerError> = None;

        'run: loop {
            while let Some(done) = tasks.try_join_next() {
                broker::note_task(done, &mut fatal);
            }
            // Never ask for more messages than there are free handler slots.
            if tasks.len() >= concurrency {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break 'run,
                    Some(done) = tasks.join_next() => {
                        broker::note_task(done, &mut fatal);
                        continue 'run;
                    }
                }
            }
            let want = (concurrency - tasks.len()).min(prefetch);
            let request = consumer.batch().max_messages(want).expires(fetch_expiry).messages();
            let batch = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break 'run,
                batch = request => batch,
            };
            let mut batch = match batch {
                Ok(batch) => {
                    pull_failures = 0;
                    batch
                }
                Err(err) => {
                    pull_failures = pull_failures.saturating_add(1);
                    tracing::warn!(target: TRACING_TARGET, source = %source, error = %err, "pull request failed: retrying");
                    sleep_unless_cancelled(pull_backoff.delay(pull_failures), &shutdown).await;
                    continue 'run;
                }
            };
            loop {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => {
                        // Messages still coming for this pull request are
                        // handled, not handed back: a `nak` would spend one
                        // of their deliveries.
                        let (recorder, worker) = (recorder.clone(), Arc::clone(&worker));
                        tasks.spawn(async move {
                            let mut handling = JoinSet::new();
                            while let Some(Ok(msg)) = batch.next().await {
                                recorder.received();
                                handling.spawn(handle(Arc::clone(&worker), msg));
                            }
                            while handling.join_next().await.is_some() {}
                            Ok(())
                        });
                        break 'run;
                    }
                    Some(done) = tasks.join_next(), if !tasks.is_empty() => broker::note_task(done, &mut fatal),
                    item = batch.next() => match item {
                        None => break,
                        Some(Err(err)) => {
                            tracing::debug!(target: TRACING_TARGET, source = %source, error = %err, "pull request ended");
                            break;
                        }
                        Some(Ok(msg)) => {
                            recorder.received();
                            tasks.spawn(handle(Arc::clone(&worker), msg));
                        }
                    },
                }
            }
        }

        tracing::info!(target: TRACING_TARGET, source = %source, in_flight = tasks.len(), "JetStream consumer stopping");
        broker::drain(&mut tasks, shutdown_timeout, &mut fatal, &source).await;
        let stats = stats.snapshot();
        tracing::info!(target: TRACING_TARGET, source = %source, ?stats, "JetStream consumer stopped");
        match fatal {
            Some(err) => Err(err),
            None => Ok(stats),
        }
    }
}

/// What every message task shares.
struct Worker<D, R, H> {
    context: jetstream::Context,
    source: String,
    dead_letter_subject: String,
    max_attempts: u32,
    max_deliver: Option<u32>,
    backoff: Backoff,
    progress: Option<Duration>,
    decoder: D,
    retry: R,
    handler: H,
    recorder: Recorder,
    shutdown: CancellationToken,
}

/// What a delivery is, for settling it.
struct Delivered {
    attempt: u32,
    /// The server will not deliver it again (its `max_deliver`-th delivery).
    last: bool,
    /// The original's `Nats-Msg-Id`.
    message_id: Option<String>,
    /// The dead letter's own `Nats-Msg-Id`: derived from the stream,
    /// consumer, stream sequence and publish time, so it is the same for
    /// every attempt to dead-letter this message and differs from any
    /// other's.
    dead_letter_id: Option<String>,
}

async fn handle<M, D, R, H, Fut, T, E>(
    worker: Arc<Worker<D, R, H>>,
    msg: jetstream::Message,
) -> Result<(), ConsumerError>
where
    D: Decoder<M>,
    R: RetryPolicy<E>,
    H: Fn(M, DeliveryInfo) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: fmt::Display,
{
    let (delivered, stream_sequence, dead_letter_id) = match msg.info() {
        Ok(info) => (
            info.delivered,
            info.stream_sequence,
            Some(dead_letter_id(
                info.stream,
                info.consumer,
                info.stream_sequence,
                &format!("{:?}", info.published),
            )),
        ),
        Err(_) => (1, 0, None),
    };
    let attempt = u32::try_from(delivered.max(1)).unwrap_or(u32::MAX);
    let message_id = msg
        .headers
        .as_ref()
        .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|id| id.as_str().to_owned());
    let span = tracing::info_span!(
        target: TRACING_TARGET,
        "delivery",
        broker = "nats",
        source = %worker.source,
        subject = %msg.subject,
        stream_sequence,
        message_id = tracing::field::Empty,
        attempt,
        redelivered = delivered > 1,
        outcome = tracing::field::Empty,
    );
    if let Some(id) = &message_id {
        span.record("message_id", id.as_str());
    }
    let delivered = Delivered {
        attempt,
        last: worker.max_deliver.is_some_and(|max| attempt >= max),
        message_id,
        dead_letter_id,
    };
    worker.process(msg, delivered).instrument(span).await;
    Ok(())
}

/// The `Nats-Msg-Id` of the dead letter of one stream message as seen by
/// one consumer.
fn dead_letter_id(stream: &str, consumer: &str, stream_sequence: u64, published: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in [stream, consumer, &stream_sequence.to_string(), published] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("idempotent-dead-letter-{hex}")
}

/// Refuses a consumer that would read its own dead letters: its stream
/// captures the dead-letter subject and its filter does not exclude it.
async fn check_not_consuming_dead_letters(
    context: &jetstream::Context,
    consumer: &PullConsumer,
    dead_letter_subject: &str,
) -> Result<(), ConsumerError> {
    let info = consumer.cached_info();
    let stream = context
        .get_stream(&info.stream_name)
        .await
        .map_err(|err| ConsumerError::Nats(err.into()))?;
    let captured = stream
        .cached_info()
        .config
        .subjects
        .iter()
        .any(|pattern| subject_matches(pattern, dead_letter_subject));
    let config = &info.config;
    let filters: Vec<&String> = std::iter::once(&config.filter_subject)
        .filter(|f| !f.is_empty())
        .chain(&config.filter_subjects)
        .collect();
    let read = filters.is_empty() || filters.iter().any(|f| subject_matches(f, dead_letter_subject));
    if captured && read {
        return Err(ConsumerError::Config(format!(
            "stream `{}` captures the dead-letter subject `{dead_letter_subject}` and consumer `{}` reads it \
             (filter {:?}): it would consume its own dead letters; filter the consumer on the input subjects, \
             or dead-letter to a subject of another stream",
            info.stream_name, info.name, filters
        )));
    }
    Ok(())
}

/// Whether the subject `pattern` (with `*` and `>` wildcards) matches the
/// concrete `subject`.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for part in pattern.split('.') {
        match (part, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (part, Some(token)) if part == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

impl<D, R, H> Worker<D, R, H> {
    async fn process<M, Fut, T, E>(&self, msg: jetstream::Message, delivered: Delivered)
    where
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        let attempt = delivered.attempt;
        let decoded = match self.decoder.decode(&msg.payload) {
            Ok(decoded) => decoded,
            Err(reason) => {
                tracing::error!(target: TRACING_TARGET, %reason, "undecodable (poison) message: dead-lettering it");
                self.dead_letter(&msg, &delivered, DeadKind::Poison, &reason, 0, Outcome::Poison)
                    .await;
                return;
            }
        };
        if delivered.last {
            // Its earlier deliveries ended unsettled (crash, shutdown
            // timeout, dead letter refused): settle it now, on the delivery
            // the server will not repeat.
            let reason = format!(
                "delivered {attempt} times (the consumer's max_deliver) without being settled: the consumer \
                 crashed or stopped while handling it, or its dead letter could not be published; the last \
                 delivery is kept for dead-lettering it"
            );
            tracing::error!(target: TRACING_TARGET, attempt, "last allowed delivery: dead-lettering the message");
            self.dead_letter(
                &msg,
                &delivered,
                DeadKind::Exhausted,
                &reason,
                attempt.saturating_sub(1),
                Outcome::DeadLettered,
            )
            .await;
            return;
        }
        let info = DeliveryInfo {
            message_id: delivered.message_id.clone(),
            attempt,
            redelivered: attempt > 1,
        };
        let call = broker::call((self.handler)(decoded, info), &self.recorder);
        let called = match self.progress {
            None => call.await,
            Some(period) => {
                tokio::pin!(call);
                let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
                loop {
                    tokio::select! {
                        called = &mut call => break called,
                        _ = ticker.tick() => {
                            if let Err(err) = msg.ack_with(AckKind::Progress).await {
                                tracing::debug!(target: TRACING_TARGET, error = %err, "in-progress ack failed");
                            }
                        }
                    }
                }
            }
        };
        let (reason, retryable) = match called {
            Called::Ok => {
                match msg.double_ack().await {
                    Ok(()) => {
                        self.recorder.outcome(Outcome::Processed);
                        tracing::debug!(target: TRACING_TARGET, "processed and acknowledged");
                    }
                    Err(err) => {
                        self.recorder.outcome(Outcome::AckFailed);
                        tracing::warn!(
                            target: TRACING_TARGET,
                            error = %err,
                            "acknowledgement failed: the server will redeliver the message"
                        );
                    }
                }
                return;
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
            if let Err(err) = msg.ack_with(AckKind::Nak(Some(delay))).await {
                tracing::warn!(target: TRACING_TARGET, error = %err, "nak failed: the server redelivers after ack_wait");
            }
            self.recorder.outcome(Outcome::Retried);
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
            self.dead_letter(&msg, &delivered, kind, &reason, attempt, Outcome::DeadLettered)
                .await;
        }
    }

    /// Publishes the payload to the dead-letter subject and terminates the
    /// message; `nak`s it instead when the publish fails, except on the
    /// message's last delivery, where the publish is retried.
    async fn dead_letter(
        &self,
        msg: &jetstream::Message,
        delivered: &Delivered,
        kind: DeadKind,
        reason: &str,
        attempts: u32,
        outcome: Outcome,
    ) {
        let mut headers = HeaderMap::new();
        if let Some(original) = &msg.headers {
            for (name, values) in original.iter() {
                let name_str: &str = name.as_ref();
                // The original's id, publish expectations, TTLs, rollups...
                // must not apply to the dead letter: above all its id, or
                // the duplicate window could swallow the dead letter.
                if name_str.starts_with("Nats-") || name_str.eq_ignore_ascii_case(HEADER_MSG_ID) {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        let one_line = |s: &str| s.replace(['\r', '\n'], " ");
        if let Some(id) = &delivered.message_id {
            headers.insert(HEADER_MSG_ID, one_line(id));
        }
        if let Some(id) = &delivered.dead_letter_id {
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        }
        headers.insert(HEADER_REASON, one_line(&truncate_reason(reason)));
        headers.insert(HEADER_KIND, kind.as_str());
        headers.insert(HEADER_ATTEMPTS, attempts.to_string());
        headers.insert(HEADER_SOURCE, one_line(&self.source));
        headers.insert("x-idempotent-subject", one_line(msg.subject.as_str()));

        let mut failures = 0u32;
        let published = loop {
            let published = self.publish_dead_letter(headers.clone(), msg, delivered).await;
            match published {
                Err(err) if delivered.last && !self.shutdown.is_cancelled() => {
                    // The server will not deliver this message again: keep
                    // it (in progress) and try again.
                    failures = failures.saturating_add(1);
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %err,
                        subject = %self.dead_letter_subject,
                        "could not publish the dead letter on the message's last delivery: retrying"
                    );
                    if let Err(err) = msg.ack_with(AckKind::Progress).await {
                        tracing::debug!(target: TRACING_TARGET, error = %err, "in-progress ack failed");
                    }
                    sleep_unless_cancelled(self.backoff.delay(failures), &self.shutdown).await;
                }
                other => break other,
            }
        };
        match published {
            Ok(()) => {
                if let Err(err) = msg.double_ack_with(AckKind::Term).await {
                    tracing::warn!(
                        target: TRACING_TARGET,
                        error = %err,
                        "terminating a dead-lettered message failed: it may be dead-lettered twice"
                    );
                }
                self.recorder.outcome(outcome);
            }
            Err(err) if delivered.last => {
                tracing::error!(
                    target: TRACING_TARGET,
                    error = %err,
                    subject = %self.dead_letter_subject,
                    "could not publish the dead letter of a message on its last delivery before shutdown: it stays \
                     in the stream but this consumer will not deliver it again (see the server's MaxDeliveries \
                     advisory)"
                );
                self.recorder.outcome(Outcome::Released);
            }
            Err(err) => {
                tracing::error!(
                    target: TRACING_TARGET,
                    error = %err,
                    subject = %self.dead_letter_subject,
                    "could not publish the dead letter: handing the message back to the server"
                );
                if let Err(err) = msg.ack_with(AckKind::Nak(Some(self.backoff.initial))).await {
                    tracing::warn!(target: TRACING_TARGET, error = %err, "nak failed: the server redelivers after ack_wait");
                }
                self.recorder.outcome(Outcome::Released);
            }
        }
    }
}

impl<D, R, H> Worker<D, R, H> {
    /// Publishes one dead letter and waits for the stream's ack. A
    /// `duplicate` ack counts as stored only for the id the adapter derived
    /// (this very dead letter was stored by an earlier attempt).
    async fn publish_dead_letter(
        &self,
        headers: HeaderMap,
        msg: &jetstream::Message,
        delivered: &Delivered,
    ) -> Result<(), String> {
        let ack = self
            .context
            .publish_with_headers(self.dead_letter_subject.clone(), headers, msg.payload.clone())
            .await
            .map_err(|err| err.to_string())?
            .await
            .map_err(|err| err.to_string())?;
        if ack.duplicate && delivered.dead_letter_id.is_none() {
            return Err(format!(
                "stream `{}` took the dead letter for a duplicate and did not store it",
                ack.stream
            ));
        }
        Ok(())
    }
}

/// A concrete subject: non-empty tokens, no wildcards, no whitespace.
fn valid_publish_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">")
        && !subject.contains(char::is_whitespace)
}

#[cfg(test)]
mod tests {
    use super::valid_publish_subject;

    #[test]
    fn subjects_match_patterns_token_by_token() {
        use super::subject_matches;
        assert!(subject_matches("orders.*", "orders.dlq"));
        assert!(subject_matches("orders.>", "orders.a.b"));
        assert!(subject_matches(">", "x"));
        assert!(subject_matches("orders.in", "orders.in"));
        assert!(!subject_matches("orders.in", "orders.dlq"));
        assert!(!subject_matches("orders.*", "orders.a.b"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(!subject_matches("orders.*.x", "orders.a"));
    }

    #[test]
    fn dead_letter_ids_differ_by_stream_consumer_and_sequence() {
        use super::dead_letter_id;
        let a = dead_letter_id("S", "c", 1, "t");
        assert_eq!(a, dead_letter_id("S", "c", 1, "t"));
        for other in [
            dead_letter_id("S", "c", 2, "t"),
            dead_letter_id("S", "d", 1, "t"),
            dead_letter_id("T", "c", 1, "t"),
            dead_letter_id("S", "c", 1, "u"),
            dead_letter_id("Sc", "", 1, "t"),
        ] {
            assert_ne!(a, other);
        }
    }

    #[test]
    fn dead_letter_subject_must_be_concrete() {
        assert!(valid_publish_subject("payments.dlq"));
        assert!(!valid_publish_subject(""));
        assert!(!valid_publish_subject("payments.*"));
        assert!(!valid_publish_subject("payments.>"));
        assert!(!valid_publish_subject("payments..dlq"));
        assert!(!valid_publish_subject("pay ments"));
    }
}
