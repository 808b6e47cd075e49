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
//! consumer's `max_deliver` when it has one. Prefer a `max_deliver` above
//! `max_attempts` (or unlimited): a dead letter that cannot be published on
//! the server's last delivery cannot be tried again.
//!
//! The dead-letter subject must be captured by a stream: the dead letter is
//! published with a JetStream acknowledgement, and when that fails the
//! message is `nak`ed instead of terminated, never dropped. While a handler
//! runs longer than half the consumer's `ack_wait`, the adapter sends
//! "in progress" (`+WPI`) so the server does not redeliver it meanwhile.
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
    /// dead-lettered (at least 1); capped by the consumer's `max_deliver`.
    /// Default [`DEFAULT_MAX_ATTEMPTS`].
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
    /// prefetch or `max_attempts`, and for a consumer whose ack policy is
    /// not `explicit` (with `all`, one ack would settle other messages still
    /// in flight; with `none`, nothing could be retried).
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
        let max_attempts = match u32::try_from(config.max_deliver) {
            Ok(max_deliver) if max_deliver > 0 => {
                if max_deliver <= self.max_attempts {
                    tracing::warn!(
                        target: TRACING_TARGET,
                        consumer = %info.name,
                        max_deliver,
                        max_attempts = self.max_attempts,
                        "the consumer's max_deliver caps the attempts; prefer a max_deliver above max_attempts \
                         so that a failed dead-letter publish can be tried again"
                    );
                }
                max_deliver.min(self.max_attempts)
            }
            _ => self.max_attempts,
        };
        let progress = (!config.ack_wait.is_zero()).then(|| config.ack_wait / 2);
        Ok(JetStreamConsumer {
            context: self.context,
            consumer: self.consumer,
            source: format!("{}/{}", info.stream_name, info.name),
            dead_letter_subject,
            concurrency: self.concurrency,
            prefetch: self.prefetch.unwrap_or(self.concurrency),
            max_attempts,
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
    /// consumer's `max_deliver`.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Consumes until `shutdown` is cancelled, calling `handler` with each
    /// decoded message; returns the run's counters.
    ///
    /// On shutdown it stops pulling, `nak`s (without delay) the messages
    /// that arrive for the last pull request until it expires (at most the
    /// [fetch expiry](JetStreamConsumerBuilder::fetch_expiry)) so another
    /// consumer gets them at once, and waits for the handlers in flight to finish and settle
    /// their messages (up to the
    /// [shutdown timeout](JetStreamConsumerBuilder::shutdown_timeout)).
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
            backoff,
            fetch_expiry,
            shutdown_timeout,
            progress,
            decoder,
            retry,
            stats,
        } = self;
        let recorder = Recorder::new("nats", &source, stats.clone());
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
            backoff,
            progress,
            decoder,
            retry,
            handler,
            recorder: recorder.clone(),
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
                        // Messages still coming for this pull request go
                        // straight back to the server.
                        let recorder = recorder.clone();
                        tasks.spawn(async move {
                            while let Some(Ok(msg)) = batch.next().await {
                                recorder.received();
                                if let Err(err) = msg.ack_with(AckKind::Nak(None)).await {
                                    tracing::debug!(target: TRACING_TARGET, error = %err, "nak on shutdown failed");
                                }
                                recorder.outcome(Outcome::Released);
                            }
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
    backoff: Backoff,
    progress: Option<Duration>,
    decoder: D,
    retry: R,
    handler: H,
    recorder: Recorder,
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
    let (delivered, stream_sequence) = match msg.info() {
        Ok(info) => (info.delivered, info.stream_sequence),
        Err(_) => (1, 0),
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
    worker.process(msg, attempt, message_id).instrument(span).await;
    Ok(())
}

impl<D, R, H> Worker<D, R, H> {
    async fn process<M, Fut, T, E>(&self, msg: jetstream::Message, attempt: u32, message_id: Option<String>)
    where
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        let decoded = match self.decoder.decode(&msg.payload) {
            Ok(decoded) => decoded,
            Err(reason) => {
                tracing::error!(target: TRACING_TARGET, %reason, "undecodable (poison) message: dead-lettering it");
                self.dead_letter(&msg, DeadKind::Poison, &reason, 0, Outcome::Poison)
                    .await;
                return;
            }
        };
        let info = DeliveryInfo {
            message_id,
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
            self.dead_letter(&msg, kind, &reason, attempt, Outcome::DeadLettered)
                .await;
        }
    }

    /// Publishes the payload to the dead-letter subject and terminates the
    /// message; `nak`s it instead when the publish fails.
    async fn dead_letter(
        &self,
        msg: &jetstream::Message,
        kind: DeadKind,
        reason: &str,
        attempts: u32,
        outcome: Outcome,
    ) {
        let mut headers = HeaderMap::new();
        if let Some(original) = &msg.headers {
            for (name, values) in original.iter() {
                let name_str: &str = name.as_ref();
                // Publish expectations, TTLs, rollups... of the original
                // must not apply to the dead letter; its id may (dedup).
                if name_str.starts_with("Nats-") && !name_str.eq_ignore_ascii_case("Nats-Msg-Id") {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        let one_line = |s: &str| s.replace(['\r', '\n'], " ");
        headers.insert(HEADER_REASON, one_line(&truncate_reason(reason)));
        headers.insert(HEADER_KIND, kind.as_str());
        headers.insert(HEADER_ATTEMPTS, attempts.to_string());
        headers.insert(HEADER_SOURCE, one_line(&self.source));
        headers.insert("x-idempotent-subject", one_line(msg.subject.as_str()));

        let published = match self
            .context
            .publish_with_headers(self.dead_letter_subject.clone(), headers, msg.payload.clone())
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|err| err.to_string()),
            Err(err) => Err(err.to_string()),
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
    fn dead_letter_subject_must_be_concrete() {
        assert!(valid_publish_subject("payments.dlq"));
        assert!(!valid_publish_subject(""));
        assert!(!valid_publish_subject("payments.*"));
        assert!(!valid_publish_subject("payments.>"));
        assert!(!valid_publish_subject("payments..dlq"));
        assert!(!valid_publish_subject("pay ments"));
    }
}
