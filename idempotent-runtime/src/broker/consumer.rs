//! The builder and consumer types each broker instantiates:
//! `RabbitConsumer` is `Consumer<Rabbit, ..>`, `JetStreamConsumer` is
//! `Consumer<JetStream, ..>`, `StreamConsumer` is `Consumer<RedisStream, ..>`.
//! The settings every consumer has are set here, once; each broker's module
//! adds only its own (queue, dead-letter destination...).

use std::fmt;
use std::time::Duration;

use super::options::ConsumerOptions;
use super::pipeline::{self, Broker};
use super::policy::{Backoff, Classify, Json, Reconnect, RetryAll, Verdict};
use super::{CancellationToken, ConsumerError, ConsumerStats, Decoder, DeliveryInfo, Handler, RetryPolicy, RunStats};

/// Configures a consumer of broker `B`; from the consumer type's
/// `builder`. The setters here are every consumer's; each broker's module
/// adds its own.
#[must_use = "call `.build()` to get the consumer"]
pub struct ConsumerBuilder<B, D = Json, R = RetryAll> {
    pub(crate) broker: B,
    pub(crate) options: ConsumerOptions,
    decoder: D,
    retry: R,
}

impl<B: fmt::Debug, D, R> fmt::Debug for ConsumerBuilder<B, D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("broker", &self.broker)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<B> ConsumerBuilder<B> {
    pub(crate) fn new(broker: B) -> Self {
        ConsumerBuilder {
            broker,
            options: ConsumerOptions::default(),
            decoder: Json,
            retry: RetryAll,
        }
    }
}

impl<B, D, R> ConsumerBuilder<B, D, R> {
    /// How many handlers run at once (each in its own task). Default
    /// [`DEFAULT_CONCURRENCY`](super::DEFAULT_CONCURRENCY); `1` processes messages one at a time.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.options.concurrency = concurrency;
        self
    }

    /// How many times the handler may run on one message before it is
    /// dead-lettered (at least 1). Default [`DEFAULT_MAX_ATTEMPTS`](super::DEFAULT_MAX_ATTEMPTS). Outage
    /// retries in place do not count (see
    /// [`max_outage_retries`](Self::max_outage_retries) for when an outage
    /// does).
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.options.max_attempts = max_attempts;
        self
    }

    /// Delay between attempts. Default 1 s doubling up to 30 s.
    pub fn retry_backoff(mut self, backoff: Backoff) -> Self {
        self.options.retry_backoff = backoff;
        self
    }

    /// Delay before a handler runs again after an outage (its store, or
    /// what [`classify`](Self::classify) calls an outage, was down): the
    /// message is kept meanwhile. Default 200 ms doubling up to 10 s.
    pub fn outage_backoff(mut self, backoff: Backoff) -> Self {
        self.options.outage_backoff = backoff;
        self
    }

    /// At most `retries` outage retries in place per delivery: the outage
    /// after them spends an attempt, as [`Verdict::Retry`] does (so a
    /// message is dead-lettered, `exhausted`, once its attempts run out).
    /// Default: no bound of its own.
    ///
    /// Without it, a delivery's outages are bounded only by the rest of
    /// the consumer: an outage after the consumer processed other messages
    /// since this one's first outage (handlers returned `Ok` having done
    /// more than replay duplicates: what it calls down is evidently up)
    /// already spends an attempt; on a quiet queue nothing else is
    /// processed, and this is the bound that does not depend on traffic.
    /// Neither applies to a key another consumer holds
    /// (`Error::InProgress`) nor to a message's last delivery, whose check
    /// waits for the store.
    pub fn max_outage_retries(mut self, retries: u32) -> Self {
        self.options.max_outage_retries = Some(retries);
        self
    }

    /// The largest message body handed to the decoder, in bytes (at least
    /// 1). A longer one is poison: dead-lettered at once with its size and
    /// the limit as the reason (`body of 1048577 bytes exceeds the limit of
    /// 1048576`), never decoded and never given to the handler. Default
    /// [`DEFAULT_MAX_BODY_BYTES`](super::DEFAULT_MAX_BODY_BYTES) (1 MiB).
    pub fn max_body_bytes(mut self, max: usize) -> Self {
        self.options.max_body_bytes = max;
        self
    }

    /// How the consumer gets its connection back when it is lost. Default:
    /// forever, 100 ms doubling up to 10 s ([`Reconnect::default`]).
    pub fn reconnect(mut self, reconnect: Reconnect) -> Self {
        self.options.reconnect = reconnect;
        self
    }

    /// How long in-flight handlers get to finish once shutdown is requested
    /// (counted from the request, also while a handler waits for a
    /// connection that does not answer); after it they are abandoned
    /// unsettled (the broker redelivers them), given 5 s more to hand their
    /// messages back, and `run` returns.
    /// Default [`DEFAULT_SHUTDOWN_TIMEOUT`](super::DEFAULT_SHUTDOWN_TIMEOUT).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.options.shutdown_timeout = timeout;
        self
    }

    /// Stop on its own once nothing arrived and no handler ran for `idle`,
    /// as if shutdown had been requested: for tests, batch jobs and one-shot
    /// replays of a dead-letter queue ("consume until drained").
    pub fn stop_when_idle(mut self, idle: Duration) -> Self {
        self.options.stop_when_idle = Some(idle);
        self
    }

    /// Runs up to `max` deliveries in one database transaction of `store`
    /// (a [`Batch`](crate::batch::Batch)): the `#[idempotent]` handlers on
    /// that store join it, each message's body under its own savepoint, and
    /// the deliveries are acknowledged after the one commit. The same
    /// handler works with and without batches.
    ///
    /// A batch takes the deliveries that are ready when its first arrives,
    /// up to `max`, waiting at most [`batch_wait`](Self::batch_wait) for
    /// more (default [`DEFAULT_BATCH_WAIT`](super::DEFAULT_BATCH_WAIT):
    /// none, so a batch never delays a lone message); the
    /// [concurrency](Self::concurrency) is then the number of batches at
    /// once. Give the broker room: a RabbitMQ prefetch (or NATS prefetch)
    /// of at least `concurrency × max`.
    ///
    /// The fast configuration, one line on any broker:
    /// `.concurrency(4).batch(store.clone(), 32)`. Its latency trade-off: a
    /// message is acknowledged after the commit of its whole batch, so at a
    /// steady rate it waits for the batch in progress and its own
    /// (`docs/benchmarks.md`, end to end, has the measured p50 and p99).
    ///
    /// A handler that fails rolls back only its own savepoint and is
    /// retried or dead-lettered as without batches. When the batch cannot
    /// commit (a claim failed in it, a deadlock, a handler panicked with its
    /// claim open, the database went away), nothing of it took effect and
    /// each of its deliveries is run again in a transaction of its own, so
    /// no message is lost and none takes effect twice. On PostgreSQL keep
    /// `max` at most 64: each body's savepoint is a subtransaction, and a
    /// transaction with more than 64 of them that wrote slows every
    /// session's snapshots.
    #[cfg(feature = "sqlx")]
    pub fn batch<S>(mut self, store: S, max: usize) -> Self
    where
        S: crate::batch::BatchStore + Clone + 'static,
    {
        let (max_wait, savepoints) = self
            .options
            .batch
            .as_ref()
            .map_or((super::DEFAULT_BATCH_WAIT, true), |b| (b.max_wait, b.savepoints));
        self.options.batch = Some(super::options::BatchMode {
            max,
            max_wait,
            savepoints,
            begin: std::sync::Arc::new(move || {
                let store = store.clone();
                Box::pin(async move { store.begin_batch().await })
            }),
        });
        self
    }

    /// How long a batch waits for more deliveries after its first, at most
    /// [`MAX_BATCH_WAIT`](super::MAX_BATCH_WAIT) (default
    /// [`DEFAULT_BATCH_WAIT`](super::DEFAULT_BATCH_WAIT); zero: it takes what
    /// the client holds already and closes). Only with [`batch`](Self::batch).
    pub fn batch_wait(mut self, wait: Duration) -> Self {
        match &mut self.options.batch {
            Some(batch) => batch.max_wait = wait,
            None => self.options.batch_setting_alone = Some("batch_wait"),
        }
        self
    }

    /// Whether each message of a batch runs under a savepoint of its own
    /// (default `true`). With savepoints, a handler that fails is undone
    /// alone and the rest of its batch commits; each message costs one
    /// statement more (`SAVEPOINT`: a round trip, and a subtransaction on
    /// PostgreSQL). Without, a message is its effect's statements alone in
    /// the batch's transaction, and a handler that fails rolls the whole
    /// batch back: its deliveries then run again one per transaction (the
    /// others once more, the failing one alone, retried or dead-lettered as
    /// usual), as for any batch that cannot commit. Choose `false` when
    /// failures are rare (see `docs/performance.md`, end to end). Only with
    /// [`batch`](Self::batch).
    pub fn batch_savepoints(mut self, savepoints: bool) -> Self {
        match &mut self.options.batch {
            Some(batch) => batch.savepoints = savepoints,
            None => self.options.batch_setting_alone = Some("batch_savepoints"),
        }
        self
    }

    /// Replaces the body decoder (default [`Json`]), e.g. with a closure
    /// `|body: &[u8]| -> Result<M, E>`.
    pub fn decoder<D2>(self, decoder: D2) -> ConsumerBuilder<B, D2, R> {
        ConsumerBuilder {
            broker: self.broker,
            options: self.options,
            decoder,
            retry: self.retry,
        }
    }

    /// Decides which handler errors are retried (default [`RetryAll`]); a
    /// closure `|err: &E| -> bool` works. Errors it calls permanent are
    /// dead-lettered at once.
    pub fn retry_if<R2>(self, retry: R2) -> ConsumerBuilder<B, D, R2> {
        ConsumerBuilder {
            broker: self.broker,
            options: self.options,
            decoder: self.decoder,
            retry,
        }
    }

    /// Decides what each handler error means, [`Verdict::Retry`],
    /// [`Verdict::Reject`] or [`Verdict::Outage`] (a dependency down: the
    /// message is kept and the handler run again without spending an
    /// attempt, until other messages are processed meanwhile or
    /// [`max_outage_retries`](Self::max_outage_retries) runs out). Classify
    /// the library's errors with `Error::verdict` and the database's with
    /// [`Verdict::of_sqlx`] (features `postgres`, `mysql`, `sqlite`).
    pub fn classify<F, E>(self, classify: F) -> ConsumerBuilder<B, D, Classify<F>>
    where
        F: Fn(&E) -> Verdict + Send + Sync + 'static,
    {
        self.retry_if(Classify(classify))
    }

    /// The settings so far.
    pub fn options(&self) -> &ConsumerOptions {
        &self.options
    }
}

impl<B: Broker, D, R> ConsumerBuilder<B, D, R> {
    /// Checks the configuration and builds the consumer.
    pub fn build(mut self) -> Result<Consumer<B, D, R>, ConsumerError> {
        self.options.validate()?;
        self.broker.prepare(&mut self.options)?;
        Ok(Consumer {
            broker: self.broker,
            options: self.options,
            decoder: self.decoder,
            retry: self.retry,
            stats: ConsumerStats::default(),
        })
    }
}

/// Consumes from broker `B` with an idempotent handler; see the broker's
/// module for its delivery rules.
pub struct Consumer<B, D = Json, R = RetryAll> {
    pub(crate) broker: B,
    pub(crate) options: ConsumerOptions,
    decoder: D,
    retry: R,
    stats: ConsumerStats,
}

impl<B: fmt::Debug, D, R> fmt::Debug for Consumer<B, D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("broker", &self.broker)
            .field("options", &self.options)
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

impl<B: Broker, D, R> Consumer<B, D, R> {
    /// A live view of this consumer's counters, readable while
    /// [`run`](Self::run) is going.
    pub fn stats(&self) -> ConsumerStats {
        self.stats.clone()
    }

    /// The settings it runs with (after the broker's adjustments, such as
    /// JetStream's `max_deliver` capping `max_attempts`).
    pub fn options(&self) -> &ConsumerOptions {
        &self.options
    }

    /// The attempts allowed per message.
    pub fn max_attempts(&self) -> u32 {
        self.options.max_attempts
    }

    /// Consumes until `shutdown` is cancelled (or, with
    /// [`stop_when_idle`](ConsumerBuilder::stop_when_idle), until idle),
    /// calling `handler` with each decoded message; returns the run's
    /// counters.
    ///
    /// A lost connection is made again within the
    /// [reconnection policy](ConsumerBuilder::reconnect); what was in
    /// flight on it is not settled on the new one (the broker redelivers
    /// it, and the idempotent handler recognises the duplicate). On
    /// shutdown the consumer stops taking new deliveries, still handles
    /// those the broker had already sent, waits for the handlers in flight
    /// (up to the [shutdown timeout](ConsumerBuilder::shutdown_timeout)),
    /// and returns.
    ///
    /// Returns an error for a configuration or topology the broker refuses,
    /// and for a connection it could not get back within the policy.
    ///
    /// The handler is any [`Handler`] taking the message alone (the `Fn`
    /// bound lets a closure's parameter types be inferred).
    pub async fn run<M, H, Fut>(self, handler: H, shutdown: CancellationToken) -> Result<RunStats, ConsumerError>
    where
        M: Send + 'static,
        D: Decoder<M>,
        R: RetryPolicy<H::Error>,
        H: Handler<M, (M,)> + Fn(M) -> Fut,
    {
        self.run_handler(handler, shutdown).await
    }

    /// Like [`run`](Self::run), with the handler also given what the
    /// adapter knows about the delivery ([`DeliveryInfo`]: message id,
    /// attempt number, redelivered flag): any [`Handler`] taking both.
    pub async fn run_with_info<M, H, Fut>(
        self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<RunStats, ConsumerError>
    where
        M: Send + 'static,
        D: Decoder<M>,
        R: RetryPolicy<H::Error>,
        H: Handler<M, (M, DeliveryInfo)> + Fn(M, DeliveryInfo) -> Fut,
    {
        self.run_handler(handler, shutdown).await
    }

    /// Runs `handler`, of either shape ([`Handler`]).
    async fn run_handler<M, A, H>(self, handler: H, shutdown: CancellationToken) -> Result<RunStats, ConsumerError>
    where
        M: Send + 'static,
        A: 'static,
        D: Decoder<M>,
        R: RetryPolicy<H::Error>,
        H: Handler<M, A>,
    {
        pipeline::run(
            self.broker,
            self.options,
            self.decoder,
            self.retry,
            handler,
            self.stats,
            shutdown,
        )
        .await
    }
}
