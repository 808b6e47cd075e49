//! NATS JetStream consumer (feature `nats`): ack after the handler's
//! commit, `nak` with backoff, `term` after dead-lettering, reconnection,
//! graceful shutdown.
//!
//! [`JetStreamConsumer`] pulls from a durable JetStream pull consumer with
//! explicit acks, decodes each message (JSON by default, see [`Decoder`](super::Decoder)),
//! calls the handler, and settles the message from the handler's result:
//!
//! | handler | what happens |
//! | --- | --- |
//! | `Ok` | the message is acknowledged (`+ACK`, confirmed by the server), only now (so after the marker's commit) |
//! | `Err`, attempts left and the error retryable | `-NAK` with an exponential delay: JetStream redelivers it and counts the delivery |
//! | `Err` on the last attempt, or not retryable ([`RetryPolicy`](super::RetryPolicy)) | the payload is published unchanged to the dead-letter subject with `x-idempotent-reason`, `-kind`, `-attempts` and `-source` headers (and the original's headers), then the message is terminated (`+TERM`) |
//! | a dependency down (the `#[idempotent]` store failed, or [`Verdict::Outage`](super::Verdict::Outage)) | the message is kept (in progress) and the handler run again after a backoff, without spending a delivery |
//! | undecodable payload (poison) | dead-lettered and terminated at once, the decoder's error as reason |
//! | panic | counts as a failed attempt |
//!
//! The attempt number is the server's delivery count, so a consumer that
//! dies before its ack (the server redelivers after `ack_wait`) also uses an
//! attempt. The attempts allowed are the builder's
//! [`max_attempts`](ConsumerBuilder::max_attempts), capped by the
//! consumer's `max_deliver` minus one when it has one: the server's **last
//! delivery is kept for settling**. A message that reaches it (its earlier
//! deliveries were lost to crashes, shutdown timeouts or dead letters that
//! could not be published) is not processed again: its handler is called
//! only to check whether it was processed (each `#[idempotent]` call claims
//! its key without running its body). A message whose effect is committed
//! (its consumer died between the commit and the ack) is acknowledged; one
//! that was not processed is dead-lettered, and on that delivery a
//! dead-letter publish that fails is retried (with in-progress acks)
//! instead of handed back, since the server would not deliver it again.
//! Code of the handler outside its `#[idempotent]` calls runs as on any
//! delivery (a handler with none runs entirely).
//!
//! The dead-letter subject must be captured by a stream: the dead letter is
//! published with a JetStream acknowledgement, and when the server refuses
//! it the message is `nak`ed instead of terminated, never dropped. The dead
//! letter does not carry the original's `Nats-Msg-Id` (that id goes in
//! `x-idempotent-msg-id`): its own id is derived from the stream, consumer
//! and stream sequence, so JetStream's duplicate window can never drop a
//! dead letter as a copy of another message, while a dead letter published
//! twice (the first `+TERM` lost) is stored once. The dead-letter subject may
//! be captured by the consumed stream itself, as long as the consumer's
//! filter excludes it: `run` refuses a consumer that would read its own dead
//! letters. While a message is held longer than half the consumer's
//! `ack_wait` (its handler runs, its outage retries wait, its batch runs,
//! commits and settles the others), the adapter sends "in progress"
//! (`+WPI`) so the server does not redeliver it meanwhile.
//!
//! # Connection loss
//!
//! The NATS client reconnects by itself; the consumer notices (its pulls
//! fail, or the client's connection count moves), reports it, waits for the
//! client to be connected again, gets its JetStream consumer back (creating
//! it again from its configuration if the server lost it) and resumes.
//! Messages in flight on the lost connection are still settled on the new
//! one: JetStream settles a delivery by a publish to its reply subject,
//! which does not depend on the connection. This matters for a message on
//! its last delivery, which the server would not deliver again, and for the
//! `+TERM` after a stored dead letter, tried again until confirmed. Each
//! delivery is known by its stream and stream sequence: a redelivery of a
//! message whose dead letter this consumer stored is terminated without
//! running its handler.
//!
//! A dead letter's publish whose acknowledgement does not come within the
//! context's timeout (a slow server) may have been stored: it is published
//! again (its derived `Nats-Msg-Id` makes the server answer a duplicate),
//! not taken for a refusal. At shutdown, a message released on its last
//! delivery (its check could not finish) is dead-lettered (`exhausted`) and
//! terminated, not handed back to a server that would never deliver it
//! again.
//!
//! ```no_run
//! use idempotent_runtime::async_nats::jetstream::{self, consumer::PullConsumer};
//! use idempotent_runtime::broker::shutdown_on_signal;
//! use idempotent_runtime::nats::JetStreamConsumer;
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
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::{self, Batch};
use async_nats::jetstream::consumer::{AckPolicy, FromConsumer, PullConsumer};
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;

use super::pipeline::{self, Broker, Connect, Letter, Messaging, Meta, Next, Settle};
use super::{
    CancellationToken, ConsumerError, ConsumerOptions, HEADER_ATTEMPTS, HEADER_KIND, HEADER_MSG_ID, HEADER_REASON,
    HEADER_SOURCE, Json, RetryAll,
};
use super::{Consumer, ConsumerBuilder, TRACING_TARGET};

#[cfg(feature = "sqlx")]
pub(crate) mod publisher;

/// Default lifetime of one pull request.
pub const DEFAULT_FETCH_EXPIRY: Duration = Duration::from_secs(2);
/// The shortest consumer `ack_wait` the adapter accepts: in-progress acks
/// go out every `ack_wait / 2`.
pub const MIN_ACK_WAIT: Duration = Duration::from_millis(100);

/// A consumer of a JetStream pull consumer; see the [module documentation](self).
pub type JetStreamConsumer<D = Json, R = RetryAll> = Consumer<JetStream, D, R>;

/// Configures a [`JetStreamConsumer`]; from [`JetStreamConsumer::builder`].
pub type JetStreamConsumerBuilder<D = Json, R = RetryAll> = ConsumerBuilder<JetStream, D, R>;

/// What a [`JetStreamConsumer`] consumes: the JetStream context, the pull
/// consumer and the dead-letter subject (the JetStream half of the
/// builder).
pub struct JetStream {
    context: jetstream::Context,
    consumer: PullConsumer,
    dead_letter_subject: Option<String>,
    prefetch: Option<usize>,
    fetch_expiry: Duration,
    /// Set by `prepare`.
    ready: Option<Ready>,
    /// The messages handed back to come again later, across connections.
    due: Arc<Due>,
}

#[derive(Clone)]
struct Ready {
    dead_letter_subject: String,
    /// `stream/consumer`, the `x-idempotent-source` of a dead letter the
    /// adapter publishes by itself ([`Delivery::release`](pipeline::Delivery::release)
    /// of a last delivery).
    source: String,
    prefetch: usize,
    max_deliver: Option<u32>,
    progress: Option<Duration>,
}

impl fmt::Debug for JetStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let info = self.consumer.cached_info();
        f.debug_struct("JetStream")
            .field("stream", &info.stream_name)
            .field("consumer", &info.name)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("prefetch", &self.prefetch)
            .finish_non_exhaustive()
    }
}

impl JetStreamConsumer {
    /// Starts configuring a runner for `consumer` (a pull consumer with
    /// explicit acks); `context` publishes the dead letters.
    pub fn builder(context: jetstream::Context, consumer: PullConsumer) -> JetStreamConsumerBuilder {
        ConsumerBuilder::new(JetStream {
            context,
            consumer,
            dead_letter_subject: None,
            prefetch: None,
            fetch_expiry: DEFAULT_FETCH_EXPIRY,
            ready: None,
            due: Arc::default(),
        })
    }
}

impl<D, R> ConsumerBuilder<JetStream, D, R> {
    /// Subject the dead letters are published to (required). A stream must
    /// capture it.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.broker.dead_letter_subject = Some(subject.into());
        self
    }

    /// Largest number of messages one pull request asks for (default: the
    /// concurrency, times the batch size in [batch](ConsumerBuilder::batch)
    /// mode). The adapter never asks for more messages than it has
    /// free handler slots, so messages do not wait in the client while
    /// their `ack_wait` runs.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.broker.prefetch = Some(prefetch);
        self
    }

    /// Lifetime of one pull request (default [`DEFAULT_FETCH_EXPIRY`]).
    /// Shorter means a faster shutdown and more requests on an idle stream.
    pub fn fetch_expiry(mut self, expiry: Duration) -> Self {
        self.broker.fetch_expiry = expiry;
        self
    }
}

impl Broker for JetStream {
    const NAME: &'static str = "nats";
    type Session = Session;

    /// Fails without a dead-letter subject, with a zero prefetch, for a
    /// consumer whose ack policy is not `explicit` (with `all`, one ack
    /// would settle other messages still in flight; with `none`, nothing
    /// could be retried), whose `max_deliver` is 1 (no delivery would be
    /// left to settle a failure on), or whose `ack_wait` is below
    /// [`MIN_ACK_WAIT`]. Caps `max_attempts` at `max_deliver - 1`.
    fn prepare(&mut self, options: &mut ConsumerOptions) -> Result<(), ConsumerError> {
        let info = self.consumer.cached_info().clone();
        let config = &info.config;
        let dead_letter_subject = match &self.dead_letter_subject {
            Some(subject) if valid_publish_subject(subject) => subject.clone(),
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
        if self.prefetch == Some(0) {
            return Err(ConsumerError::Config("prefetch must be at least 1".into()));
        }
        let max_deliver = u32::try_from(config.max_deliver).ok().filter(|&n| n > 0);
        match max_deliver {
            Some(1) => {
                return Err(ConsumerError::Config(format!(
                    "consumer `{}` of stream `{}` has max_deliver 1: no delivery would be left to retry or to \
                     dead-letter a failed message on; use at least 2, or -1 (unlimited)",
                    info.name, info.stream_name
                )));
            }
            Some(max_deliver) => {
                if max_deliver <= options.max_attempts {
                    tracing::info!(
                        target: TRACING_TARGET,
                        consumer = %info.name,
                        max_deliver,
                        max_attempts = options.max_attempts,
                        "the consumer's max_deliver caps the attempts at max_deliver - 1 (the last delivery is \
                         kept for settling)"
                    );
                }
                options.max_attempts = (max_deliver - 1).min(options.max_attempts);
            }
            None => {}
        }
        if !config.ack_wait.is_zero() && config.ack_wait < MIN_ACK_WAIT {
            return Err(ConsumerError::Config(format!(
                "consumer `{}` of stream `{}` has ack_wait {:?}: in-progress acks are sent every ack_wait / 2, \
                 so it must be at least {MIN_ACK_WAIT:?}",
                info.name, info.stream_name, config.ack_wait
            )));
        }
        self.ready = Some(Ready {
            dead_letter_subject,
            source: format!("{}/{}", info.stream_name, info.name),
            prefetch: self.prefetch.unwrap_or_else(|| {
                let per_task = options.batch.as_ref().map_or(1, |batch| batch.max);
                options.concurrency.saturating_mul(per_task)
            }),
            max_deliver,
            progress: (!config.ack_wait.is_zero()).then(|| (config.ack_wait / 2).max(Duration::from_millis(1))),
        });
        Ok(())
    }

    fn source(&self) -> String {
        let info = self.consumer.cached_info();
        format!("{}/{}", info.stream_name, info.name)
    }

    /// The stream, read by the durable consumer as the group its
    /// instances share.
    fn messaging(&self) -> Messaging {
        let info = self.consumer.cached_info();
        Messaging::new(info.stream_name.clone()).consumer_group(info.name.clone())
    }

    async fn connect(&self, _options: &ConsumerOptions) -> Result<Session, Connect> {
        let ready = self
            .ready
            .clone()
            .ok_or_else(|| Connect::Fatal(ConsumerError::Config("the consumer was not built".into())))?;
        let client = self.context.client();
        if client.connection_state() != async_nats::connection::State::Connected {
            return Err(Connect::Failed("the NATS client is not connected".into()));
        }
        let generation = client.statistics().connects.load(Ordering::Relaxed);
        let info = self.consumer.cached_info();
        let stream = self
            .context
            .get_stream(&info.stream_name)
            .await
            .map_err(|err| Connect::Failed(format!("cannot get stream `{}`: {err}", info.stream_name)))?;
        check_not_consuming_dead_letters(stream.cached_info(), info, &ready.dead_letter_subject)
            .map_err(Connect::Fatal)?;
        // The consumer as the server has it now; created again from its
        // configuration if the server lost it.
        let config = <pull::Config as FromConsumer>::try_from_consumer_config(info.config.clone())
            .map_err(|err| Connect::Fatal(ConsumerError::Config(format!("not a pull consumer: {err}"))))?;
        let consumer: PullConsumer = stream
            .get_or_create_consumer(&info.name, config)
            .await
            .map_err(|err| Connect::Failed(format!("cannot get consumer `{}`: {err}", info.name)))?;
        Ok(Session {
            shared: Arc::new(Shared {
                context: self.context.clone(),
                client,
                generation,
                ready,
                due: Arc::clone(&self.due),
            }),
            consumer,
            fetch_expiry: self.fetch_expiry,
            batch: None,
            pull: None,
            stopping: false,
            until_due: None,
        })
    }
}

/// Refuses a consumer that would read its own dead letters: its stream
/// captures the dead-letter subject and its filter does not exclude it.
fn check_not_consuming_dead_letters(
    stream: &jetstream::stream::Info,
    consumer: &jetstream::consumer::Info,
    dead_letter_subject: &str,
) -> Result<(), ConsumerError> {
    let captured = stream
        .config
        .subjects
        .iter()
        .any(|pattern| subject_matches(pattern, dead_letter_subject));
    let config = &consumer.config;
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
            consumer.stream_name, consumer.name, filters
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

/// A concrete subject: non-empty tokens, no wildcards, no whitespace.
fn valid_publish_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">")
        && !subject.contains(char::is_whitespace)
}

/// What the messages of one session share.
struct Shared {
    context: jetstream::Context,
    client: async_nats::Client,
    /// The client's connection count when the session started: the
    /// session ends when it moves (its pull requests went with the
    /// connection). Its deliveries are still settled on the new connection
    /// ([`Delivery::is_current`](pipeline::Delivery::is_current)).
    generation: u64,
    ready: Ready,
    due: Arc<Due>,
}

/// What of this consumer still waits somewhere though no handler runs: the
/// messages it handed back with `-NAK` (a retry's delay, a release) until
/// the server delivers them again, and the deliveries alive in the
/// process. A stop when idle ([`stop_when_idle`](ConsumerBuilder::stop_when_idle))
/// waits for them: a retry that is due is not idleness.
#[derive(Default)]
struct Due(std::sync::Mutex<DueState>);

#[derive(Default)]
struct DueState {
    /// Stream sequence of each message handed back, and when it is due.
    naked: std::collections::HashMap<u64, tokio::time::Instant>,
    /// Deliveries alive (handed to the pipeline, not dropped yet).
    alive: usize,
    /// The run's shutdown token, as the pipeline hands it to a retry: a
    /// stop while it is not cancelled is a stop when idle.
    shutdown: Option<CancellationToken>,
}

impl Due {
    fn state(&self) -> std::sync::MutexGuard<'_, DueState> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A delivery of the message at `sequence` arrived.
    fn arrived(&self, sequence: u64) {
        let mut state = self.state();
        state.naked.remove(&sequence);
        state.alive = state.alive.saturating_add(1);
    }

    /// A delivery is gone (settled, or abandoned).
    fn dropped(&self) {
        let mut state = self.state();
        state.alive = state.alive.saturating_sub(1);
    }

    /// The message at `sequence` was handed back, to come again after
    /// `delay`.
    fn naked(&self, sequence: u64, delay: Duration, shutdown: Option<&CancellationToken>) {
        let mut state = self.state();
        state.naked.insert(sequence, tokio::time::Instant::now() + delay);
        if let Some(shutdown) = shutdown {
            state.shutdown.get_or_insert_with(|| shutdown.clone());
        }
    }

    /// At a stop: the shutdown token to keep watching when something is
    /// still due and the stop is not a shutdown (the token, known from a
    /// retry, is not cancelled); `None` to stop now.
    fn stop_when_idle(&self) -> Option<CancellationToken> {
        let state = self.state();
        let shutdown = state.shutdown.as_ref()?;
        (!shutdown.is_cancelled() && (!state.naked.is_empty() || state.alive > 0)).then(|| shutdown.clone())
    }

    /// Nothing waits any more: no message handed back that has not come
    /// again, no delivery alive.
    fn settled(&self) -> bool {
        let state = self.state();
        state.naked.is_empty() && state.alive == 0
    }

    /// No delivery is alive and every message handed back has been due for
    /// longer than `grace` (another instance of the consumer may have taken
    /// it).
    fn all_overdue(&self, grace: Duration) -> bool {
        let state = self.state();
        let now = tokio::time::Instant::now();
        state.alive == 0 && state.naked.values().all(|&due| due + grace <= now)
    }

    /// Forgets the messages handed back (the server has none of this
    /// consumer's waiting).
    fn forget(&self) {
        self.state().naked.clear();
    }
}

impl Shared {
    fn is_current(&self) -> bool {
        self.client.statistics().connects.load(Ordering::Relaxed) == self.generation
            && self.client.connection_state() == async_nats::connection::State::Connected
    }
}

/// How long after its expiry a pull request's end may still come. The
/// server ends an expired request with a `408` status; nats-server before
/// 2.9.15 could drop one without it (nats-io/nats-server#3942; on 2.9.10
/// here, in 11 of 14 runs of 4 s at 1 600 msg/s, 200 ms expiry, batches of
/// 32: the server held no request, `num_waiting` 0), and async-nats then
/// waits five seconds more before it gives the request up, with nothing
/// delivered meanwhile. The session gives up this much after the expiry
/// (half the expiry, from 100 ms to 1 s) and pulls again. A request the
/// server still held would deliver to the abandoned inbox: those messages
/// are redelivered after the consumer's `ack_wait`, nothing is lost.
fn end_grace(expiry: Duration) -> Duration {
    (expiry / 2).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

type PullFuture = Pin<Box<dyn Future<Output = Result<Batch, String>> + Send>>;

/// A pull subscription on one connection.
pub struct Session {
    shared: Arc<Shared>,
    consumer: PullConsumer,
    fetch_expiry: Duration,
    /// The pull request being answered, and when its end (the server's
    /// `408` at expiry, or its last message) is overdue.
    batch: Option<(Batch, tokio::time::Instant)>,
    /// A pull request being sent (kept across cancelled `next` calls).
    pull: Option<PullFuture>,
    stopping: bool,
    /// A stop when idle while messages of this consumer are still due
    /// ([`Due`]): it goes on pulling until they came back and were
    /// settled, or until this shutdown token is cancelled.
    until_due: Option<CancellationToken>,
}

impl Session {
    /// Whether a stop when idle may end now: nothing is due any more, a
    /// shutdown was asked meanwhile, or what was handed back is long
    /// overdue and the server reports nothing of this consumer pending.
    async fn idle_stop_may_end(&mut self) -> bool {
        let Some(shutdown) = &self.until_due else {
            return true;
        };
        if shutdown.is_cancelled() || self.shared.due.settled() {
            return true;
        }
        let grace = self.fetch_expiry.saturating_mul(2) + Duration::from_secs(1);
        if self.shared.due.all_overdue(grace) {
            match self.consumer.get_info().await {
                Ok(info) if info.num_pending == 0 && info.num_ack_pending == 0 => {
                    self.shared.due.forget();
                    return true;
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(target: TRACING_TARGET, error = %err, "consumer info failed");
                }
            }
        }
        false
    }
}

impl pipeline::Session for Session {
    type Delivery = Delivery;

    async fn next(&mut self, room: usize) -> Next<Delivery> {
        loop {
            if self.until_due.is_some() && self.idle_stop_may_end().await {
                self.until_due = None;
                self.stopping = true;
            }
            if !self.shared.is_current() {
                return Next::Lost("the NATS connection was lost or made again".into());
            }
            if let Some((batch, overdue)) = &mut self.batch {
                // What the client holds comes first (`timeout_at` polls the
                // stream before the clock); past the overdue instant the
                // request is gone from the server (below).
                let Ok(next) = tokio::time::timeout_at(*overdue, batch.next()).await else {
                    self.batch = None;
                    tracing::debug!(target: TRACING_TARGET, "pull request ended without a word from the server");
                    if self.stopping {
                        return Next::End;
                    }
                    return Next::Idle;
                };
                match next {
                    Some(Ok(msg)) => return Next::Delivery(Delivery::new(Arc::clone(&self.shared), msg)),
                    Some(Err(err)) => {
                        self.batch = None;
                        if self.stopping {
                            return Next::End;
                        }
                        if !self.shared.is_current() {
                            return Next::Lost(format!("pull request failed: {err}"));
                        }
                        tracing::debug!(target: TRACING_TARGET, error = %err, "pull request ended");
                        return Next::Idle;
                    }
                    None => {
                        self.batch = None;
                        if self.stopping {
                            return Next::End;
                        }
                        return Next::Idle;
                    }
                }
            }
            if self.stopping {
                return Next::End;
            }
            let want = room.clamp(1, self.shared.ready.prefetch);
            let pull = self.pull.get_or_insert_with(|| {
                let (consumer, expiry) = (self.consumer.clone(), self.fetch_expiry);
                Box::pin(async move {
                    consumer
                        .batch()
                        .max_messages(want)
                        .expires(expiry)
                        .messages()
                        .await
                        .map_err(|err| err.to_string())
                })
            });
            let pulled = pull.await;
            self.pull = None;
            match pulled {
                Ok(batch) => {
                    let overdue = tokio::time::Instant::now() + self.fetch_expiry + end_grace(self.fetch_expiry);
                    self.batch = Some((batch, overdue));
                }
                Err(err) => return Next::Lost(format!("pull request failed: {err}")),
            }
        }
    }

    async fn stop(&mut self) {
        // The pull request being answered keeps delivering until it
        // expires; those messages are handled, not handed back (that would
        // spend one of their deliveries).
        match self.shared.due.stop_when_idle() {
            // A stop when idle while a message of this consumer is still
            // due (handed back with a delay, not delivered again yet): it
            // goes on pulling until that came back and was settled.
            Some(shutdown) => {
                tracing::info!(
                    target: TRACING_TARGET,
                    "no handler runs, but messages handed back are still due: waiting for them"
                );
                self.until_due = Some(shutdown);
            }
            None => self.stopping = true,
        }
    }

    async fn close(self) {}
}

/// One JetStream message.
pub struct Delivery {
    shared: Arc<Shared>,
    msg: jetstream::Message,
    meta: Meta,
    /// The dead letter's own `Nats-Msg-Id`: derived from the stream,
    /// consumer, stream sequence and publish time, so it is the same for
    /// every attempt to dead-letter this message and differs from any
    /// other's.
    dead_letter_id: Option<String>,
    /// Its stream sequence (0 when its reply subject did not say).
    sequence: u64,
    /// `stream/sequence`, the same on every delivery of the message
    /// (`None` when its reply subject did not say).
    identity: Option<String>,
    /// What became of its dead letter so far.
    letter: std::sync::Mutex<DeadLetter>,
}

/// What became of a delivery's dead letter: [`release`](pipeline::Delivery::release)
/// does not hand back a message whose dead letter may be stored.
#[derive(Clone, Default)]
enum DeadLetter {
    /// None published.
    #[default]
    None,
    /// Published, its acknowledgement not received (these headers: the
    /// same `Nats-Msg-Id` if published again).
    Unsure(HeaderMap),
    /// Stored.
    Stored,
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.shared.due.dropped();
    }
}

impl Delivery {
    fn new(shared: Arc<Shared>, msg: jetstream::Message) -> Delivery {
        let (delivered, stream_sequence, dead_letter_id, identity) = match msg.info() {
            Ok(info) => (
                info.delivered,
                info.stream_sequence,
                Some(dead_letter_id(
                    info.stream,
                    info.consumer,
                    info.stream_sequence,
                    &format!("{:?}", info.published),
                )),
                Some(format!("{}/{}", info.stream, info.stream_sequence)),
            ),
            Err(_) => (1, 0, None, None),
        };
        let attempt = u32::try_from(delivered.max(1)).unwrap_or(u32::MAX);
        let message_id = msg
            .headers
            .as_ref()
            .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|id| id.as_str().to_owned());
        let meta = Meta {
            attempt,
            redelivered: attempt > 1,
            message_id,
            last: shared.ready.max_deliver.is_some_and(|max| attempt >= max),
            position: format!("stream_sequence={stream_sequence} subject={}", msg.subject),
            destination: None,
            routing_key: None,
            delivery_tag: None,
            partition: None,
            offset: None,
            message_key: None,
        };
        shared.due.arrived(stream_sequence);
        Delivery {
            shared,
            msg,
            meta,
            dead_letter_id,
            sequence: stream_sequence,
            identity,
            letter: std::sync::Mutex::default(),
        }
    }

    fn letter(&self) -> std::sync::MutexGuard<'_, DeadLetter> {
        self.letter.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The dead letter's headers: the original's (but its `Nats-*` ones),
    /// the dead letter's own `Nats-Msg-Id` and the `x-idempotent-*` ones.
    fn letter_headers(&self, letter: &Letter<'_>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(original) = &self.msg.headers {
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
        if let Some(id) = &self.meta.message_id {
            headers.insert(HEADER_MSG_ID, one_line(id));
        }
        if let Some(id) = &self.dead_letter_id {
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        }
        headers.insert(HEADER_REASON, letter.reason);
        headers.insert(HEADER_KIND, letter.kind);
        headers.insert(HEADER_ATTEMPTS, letter.attempts.to_string());
        headers.insert(HEADER_SOURCE, one_line(letter.source));
        headers.insert("x-idempotent-subject", one_line(self.msg.subject.as_str()));
        headers
    }

    /// Publishes the dead letter with `headers`, and notes what became of
    /// it: `Ok` once stored; [`Settle::Unknown`] when its acknowledgement
    /// did not come in time (the server may have stored it: publishing it
    /// again with the same `Nats-Msg-Id` is answered as a duplicate);
    /// [`Settle::Refused`] otherwise.
    async fn publish_letter(&self, headers: HeaderMap) -> Result<(), Settle> {
        let before = std::mem::replace(&mut *self.letter(), DeadLetter::Unsure(headers.clone()));
        let published = self.publish_once(headers).await;
        let mut letter = self.letter();
        match &published {
            Ok(()) => *letter = DeadLetter::Stored,
            // Not stored by this publish; an earlier one's outcome stands.
            Err(Settle::Refused(_)) => *letter = before,
            Err(_) => {}
        }
        published
    }

    async fn publish_once(&self, headers: HeaderMap) -> Result<(), Settle> {
        let ready = &self.shared.ready;
        let ack = self
            .shared
            .context
            .publish_with_headers(ready.dead_letter_subject.clone(), headers, self.msg.payload.clone())
            .await
            .map_err(publish_failed)?
            .await
            .map_err(publish_failed)?;
        // A duplicate counts as stored only for the id derived here (this
        // very dead letter was stored by an earlier attempt).
        if ack.duplicate && self.dead_letter_id.is_none() {
            return Err(Settle::Refused(format!(
                "stream `{}` took the dead letter for a duplicate and did not store it",
                ack.stream
            )));
        }
        Ok(())
    }

    /// `-NAK`, after `delay` when not zero.
    async fn nak(&self, delay: Duration) -> Result<(), Settle> {
        let nak = (!delay.is_zero()).then_some(delay);
        self.msg.ack_with(AckKind::Nak(nak)).await.map_err(lost)?;
        self.shared.due.naked(self.sequence, delay, None);
        Ok(())
    }
}

fn lost(err: impl fmt::Display) -> Settle {
    Settle::Lost(format!("NATS: {err}"))
}

/// A failed dead-letter publish: [`Settle::Unknown`] when its
/// acknowledgement did not come (in time, or at all), which may have been
/// stored; [`Settle::Refused`] when the server or the client said no.
fn publish_failed(err: PublishError) -> Settle {
    match err.kind() {
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => Settle::Unknown(format!(
            "NATS: the dead letter's publish acknowledgement did not come: {err}"
        )),
        _ => Settle::Refused(err.to_string()),
    }
}

impl pipeline::Delivery for Delivery {
    fn body(&self) -> &[u8] {
        &self.msg.payload
    }

    fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Always: JetStream settles a delivery by a publish to its reply
    /// subject, which names the consumer, the stream sequence and the
    /// delivery, not the connection; the client publishes it on whatever
    /// connection it has (waiting for one while it reconnects). A delivery
    /// of a lost connection is still settled: above all the last one
    /// (`max_deliver`), which JetStream would not deliver again, and the
    /// `+TERM` of a message whose dead letter is stored.
    fn is_current(&self) -> bool {
        true
    }

    fn heartbeat(&self) -> Option<Duration> {
        self.shared.ready.progress
    }

    async fn progress(&self) {
        if let Err(err) = self.msg.ack_with(AckKind::Progress).await {
            tracing::debug!(target: TRACING_TARGET, error = %err, "in-progress ack failed");
        }
    }

    async fn ack(&self) -> Result<(), Settle> {
        self.msg.double_ack().await.map_err(lost)
    }

    /// Each acknowledged as `ack` does (the server confirms
    /// each), all in flight together: one round trip for the batch, not one
    /// per message.
    async fn ack_all<'a>(deliveries: &'a [&'a Self]) -> Vec<Result<(), Settle>> {
        futures_util::future::join_all(deliveries.iter().map(|d| pipeline::Delivery::ack(*d))).await
    }

    async fn retry(&self, _next_attempt: u32, delay: Duration, shutdown: &CancellationToken) -> Result<(), Settle> {
        self.msg.ack_with(AckKind::Nak(Some(delay))).await.map_err(lost)?;
        self.shared.due.naked(self.sequence, delay, Some(shutdown));
        Ok(())
    }

    /// `stream/sequence`.
    fn identity(&self) -> Option<String> {
        self.identity.clone()
    }

    /// Publishes it with a JetStream acknowledgement; an acknowledgement
    /// that does not come in time is [`Settle::Unknown`] (published again,
    /// the derived `Nats-Msg-Id` makes the server answer a duplicate).
    async fn dead_letter(&self, letter: &Letter<'_>) -> Result<(), Settle> {
        self.publish_letter(self.letter_headers(letter)).await
    }

    /// `+TERM`, confirmed by the server.
    async fn discard(&self) -> Result<(), Settle> {
        self.msg
            .double_ack_with(AckKind::Term)
            .await
            .map_err(|err| Settle::Unknown(format!("NATS: terminating the message was not confirmed: {err}")))
    }

    /// `-NAK`, except for a message JetStream must not or would not deliver
    /// again, which is dead-lettered and terminated instead (`+TERM`):
    ///
    /// - one whose dead letter may be stored (its publish not confirmed,
    ///   the consumer stopping): published once more, with the same
    ///   `Nats-Msg-Id` (the server answers a duplicate if the first was
    ///   stored); handed back only if that is not confirmed either and
    ///   attempts are left (its redelivery to this consumer publishes it
    ///   again);
    /// - the last delivery (`max_deliver`), released at shutdown while its
    ///   check ran: JetStream would never deliver it again, so it is
    ///   dead-lettered (`exhausted`) with a reason saying whether it was
    ///   processed is not known.
    async fn release(&self, delay: Duration) -> Result<(), Settle> {
        let state = self.letter().clone();
        let headers = match state {
            DeadLetter::Stored => None,
            DeadLetter::Unsure(headers) => Some(headers),
            DeadLetter::None if self.meta.last => {
                let reason = format!(
                    "delivered {} times (as often as the broker allows), and the consumer stopped before its last \
                     delivery was settled: whether it was processed is not known (its check could not tell in \
                     time); JetStream would not deliver it again",
                    self.meta.attempt
                );
                Some(self.letter_headers(&Letter {
                    kind: crate::broker::stats::DeadKind::Exhausted.as_str(),
                    reason: &reason,
                    attempts: self.meta.attempt.saturating_sub(1),
                    source: &self.shared.ready.source,
                }))
            }
            DeadLetter::None => return self.nak(delay).await,
        };
        if let Some(headers) = headers {
            match self.publish_letter(headers).await {
                Ok(()) => {}
                // JetStream delivers it again: to this consumer, which
                // remembers it and publishes its dead letter again.
                Err(err) if !self.meta.last => {
                    tracing::warn!(
                        target: TRACING_TARGET,
                        error = %err,
                        "the dead letter of a message released could not be confirmed: handing it back"
                    );
                    return self.nak(delay).await;
                }
                Err(err) => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %err,
                        "the dead letter of a message released on its last delivery could not be confirmed: \
                         JetStream keeps it but will not deliver it again (see its max-deliveries advisory)"
                    );
                    return Err(err);
                }
            }
        }
        tracing::warn!(
            target: TRACING_TARGET,
            last = self.meta.last,
            "released with its dead letter stored: terminating it instead of handing it back"
        );
        pipeline::Delivery::discard(self).await
    }
}

/// The `Nats-Msg-Id` of the dead letter of one stream message as seen by
/// one consumer.
fn dead_letter_id(stream: &str, consumer: &str, stream_sequence: u64, published: &str) -> String {
    let hex = crate::key::digest_hex(&[
        stream.as_bytes(),
        consumer.as_bytes(),
        stream_sequence.to_string().as_bytes(),
        published.as_bytes(),
    ]);
    format!("idempotent-dead-letter-{hex}")
}

#[cfg(test)]
mod tests {
    use super::{dead_letter_id, subject_matches, valid_publish_subject};

    #[test]
    fn subjects_match_patterns_token_by_token() {
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
