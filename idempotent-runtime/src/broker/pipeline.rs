//! The delivery pipeline, written once for every broker.
//!
//! `run` keeps a [`Session`] (a live connection and subscription),
//! making it again with backoff when it is lost, and takes deliveries while
//! handler slots are free. Each delivery goes through `process`: its span,
//! decoding (a body longer than the consumer's limit, or one that does not
//! decode, is dead-lettered as poison), the
//! handler call (panics caught; on the last delivery the broker allows,
//! only a check of whether the message was processed: its `#[idempotent]`
//! calls claim without running their bodies, and a message processed before
//! is acknowledged, one that was not dead-lettered), the verdict on a
//! failure (outage: run again in place, unless other messages were
//! processed meanwhile or the retries in place ran out, which spends an
//! attempt; retry: hand it to the broker with a delay; otherwise
//! dead-letter), and the settlement, never on a connection
//! other than the one it came on. A delivery's progress is sent at its heartbeat
//! until it is settled, across the handler's runs and the waits between
//! them; in a batch, from the moment it is gathered, while the others run,
//! commit and settle. On shutdown, `drain` gives the handlers in flight
//! their time, then asks them to let go.
//!
//! The span of a delivery follows the OpenTelemetry messaging conventions
//! for a `process` operation (through `tracing-opentelemetry`, which reads
//! the `otel.*` fields as the span's name, kind and status): its name is
//! `process {destination}`, its kind `consumer`, and its fields are the
//! `messaging.*` attributes, from the broker's [`Broker::messaging`] and the
//! delivery's [`Meta`], with the `idempotency.outcome` of the handler's
//! `#[idempotent]` calls and, when the delivery failed, `error.type`.
//!
//! A broker supplies a [`Broker`] (how to connect), a [`Session`] (how to
//! receive) and a [`Delivery`] (how to settle one message): implement them
//! to run the pipeline on a broker of your own, as
//! [`rabbitmq`](super::rabbitmq), [`nats`](super::nats) and
//! [`redis_streams`](super::redis_streams) do.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use super::options::ConsumerOptions;
use super::stats::{ConnectionEvent, DeadKind, Outcome, Recorder};
use super::{
    Called, CancellationToken, ConsumerError, ConsumerStats, Decoder, DeliveryInfo, RetryPolicy, RunStats,
    TRACING_TARGET, Verdict, sleep_unless_cancelled, truncate_reason,
};
use crate::signal::{Noted, Outcome as Idempotency};

/// How long handlers that were asked to let go (after the shutdown timeout)
/// get to release their deliveries before their tasks are aborted.
const ABANDON_GRACE: Duration = Duration::from_secs(5);

/// A broker: how a consumer connects to it and what it checks at build.
pub trait Broker: Send + Sync + 'static {
    /// The `broker` label of metrics, and the `messaging.system` of spans
    /// (`rabbitmq`, `nats`, `redis`).
    const NAME: &'static str;
    /// A connection with its subscription.
    type Session: Session;

    /// Checks the consumer's settings against the broker's and adjusts them
    /// (at build).
    fn prepare(&mut self, options: &mut ConsumerOptions) -> Result<(), ConsumerError>;

    /// Where it consumes from (queue, `stream/consumer`...).
    fn source(&self) -> String;

    /// What the spans of its deliveries say about the consumer, in
    /// OpenTelemetry's messaging terms; by default the destination is
    /// [`source`](Self::source).
    fn messaging(&self) -> Messaging {
        Messaging::new(self.source())
    }

    /// Connects, sets up what it needs (declarations, checks) and
    /// subscribes.
    fn connect(&self, options: &ConsumerOptions) -> impl Future<Output = Result<Self::Session, Connect>> + Send;
}

/// The OpenTelemetry messaging attributes of a consumer's spans (see
/// [`Broker::messaging`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Messaging {
    /// `messaging.destination.name`: what it consumes from (a queue, a
    /// stream), unless a delivery names its own ([`Meta::destination`]).
    pub destination: String,
    /// `messaging.consumer.group.name`: the group its instances share the
    /// messages in (a JetStream durable consumer, a Redis Streams group).
    pub consumer_group: Option<String>,
    /// `messaging.client.id`: this instance in the group (a Redis Streams
    /// consumer name).
    pub client_id: Option<String>,
}

impl Messaging {
    /// A consumer of `destination`.
    pub fn new(destination: impl Into<String>) -> Messaging {
        Messaging {
            destination: destination.into(),
            consumer_group: None,
            client_id: None,
        }
    }

    /// In the consumer group `group`.
    pub fn consumer_group(mut self, group: impl Into<String>) -> Messaging {
        self.consumer_group = Some(group.into());
        self
    }

    /// As the client `id`.
    pub fn client_id(mut self, id: impl Into<String>) -> Messaging {
        self.client_id = Some(id.into());
        self
    }
}

/// Why [`Broker::connect`] failed.
pub enum Connect {
    /// Retrying cannot help (configuration, topology): `run` returns it.
    Fatal(ConsumerError),
    /// The broker could not be reached: try again within the policy.
    Failed(String),
}

/// A live connection and subscription.
pub trait Session: Send + 'static {
    /// One delivery of this session.
    type Delivery: Delivery;

    /// The next delivery, asking the broker for at most `room` at a time.
    /// Cancel-safe: a call dropped before it returns loses nothing.
    fn next(&mut self, room: usize) -> impl Future<Output = Next<Self::Delivery>> + Send;

    /// Stops new deliveries (shutdown): what the broker already sent keeps
    /// coming from [`next`](Self::next), then [`Next::End`].
    fn stop(&mut self) -> impl Future<Output = ()> + Send;

    /// Closes the connection after a stop.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// What [`Session::next`] came to.
pub enum Next<D> {
    /// A message.
    Delivery(D),
    /// Nothing for now (a pull request expired empty).
    Idle,
    /// The subscription ended: after [`Session::stop`], or the broker
    /// cancelled it.
    End,
    /// The connection is gone.
    Lost(String),
}

/// What the pipeline knows of a delivery.
#[derive(Debug, Clone)]
pub struct Meta {
    /// From 1.
    pub attempt: u32,
    /// The broker delivered it before.
    pub redelivered: bool,
    /// The broker-level message id.
    pub message_id: Option<String>,
    /// The broker will not deliver it again if it is handed back.
    pub last: bool,
    /// Where it is in the broker (delivery tag, stream sequence, entry
    /// id), for the span.
    pub position: String,
    /// Its `messaging.destination.name`, when it says more than the
    /// consumer's ([`Messaging::destination`]): RabbitMQ's
    /// `{exchange}:{routing key}:{queue}`.
    pub destination: Option<String>,
    /// Its `messaging.rabbitmq.destination.routing_key` (RabbitMQ).
    pub routing_key: Option<String>,
    /// Its `messaging.rabbitmq.message.delivery_tag` (RabbitMQ).
    pub delivery_tag: Option<u64>,
}

/// A dead letter to publish.
pub struct Letter<'a> {
    /// `poison`, `exhausted` or `rejected` (the `x-idempotent-kind` header).
    pub kind: &'static str,
    /// Why, on one line, at most 4 KiB.
    pub reason: &'a str,
    /// Handler runs.
    pub attempts: u32,
    /// Where the message was consumed from.
    pub source: &'a str,
}

/// Why a settlement did not happen.
#[derive(Debug)]
pub enum Settle {
    /// The broker would not take a publish (unroutable, refused): the
    /// delivery can still be handed back.
    Refused(String),
    /// The connection is gone: the broker redelivers the message.
    Lost(String),
}

impl fmt::Display for Settle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Settle::Refused(why) | Settle::Lost(why) => f.write_str(why),
        }
    }
}

/// One message, and how to settle it.
pub trait Delivery: Send + Sync + 'static {
    /// The message's bytes, for the decoder.
    fn body(&self) -> &[u8];
    /// What the pipeline needs to know about it.
    fn meta(&self) -> &Meta;

    /// Why the delivery cannot carry a message at all (poison before
    /// decoding), if so.
    fn malformed(&self) -> Option<String> {
        None
    }

    /// The connection it came on is still the live one: settling it is
    /// allowed.
    fn is_current(&self) -> bool;

    /// How often to send [`progress`](Self::progress) while the consumer
    /// holds it unsettled: its handler runs, its outage retries wait, or
    /// its batch runs, commits and settles the others (brokers that
    /// redeliver what looks stuck).
    fn heartbeat(&self) -> Option<Duration> {
        None
    }

    /// "Still working on it".
    fn progress(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Done: remove it from the broker.
    fn ack(&self) -> impl Future<Output = Result<(), Settle>> + Send;

    /// Have it delivered again as attempt `next_attempt` after `delay`.
    fn retry(
        &self,
        next_attempt: u32,
        delay: Duration,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<(), Settle>> + Send;

    /// Publish it to the dead-letter destination, then remove it.
    fn dead_letter(&self, letter: &Letter<'_>) -> impl Future<Output = Result<(), Settle>> + Send;

    /// Give it back for another delivery, after `delay` where the broker
    /// can wait.
    fn release(&self, delay: Duration) -> impl Future<Output = Result<(), Settle>> + Send;
}

/// What the delivery tasks share.
struct Worker<D, R, H> {
    source: String,
    broker: &'static str,
    messaging: Messaging,
    options: ConsumerOptions,
    decoder: D,
    retry: R,
    handler: H,
    recorder: Recorder,
    shutdown: CancellationToken,
    /// Cancelled at the shutdown timeout: handlers still running let go.
    abandon: CancellationToken,
}

/// Runs a consumer of `broker` until shutdown (or idle, or a fatal error).
pub(crate) async fn run<B, M, D, R, H, Fut, T, E>(
    broker: B,
    options: ConsumerOptions,
    decoder: D,
    retry: R,
    handler: H,
    stats: ConsumerStats,
    shutdown: CancellationToken,
) -> Result<RunStats, ConsumerError>
where
    B: Broker,
    M: Send + 'static,
    D: Decoder<M>,
    R: RetryPolicy<E>,
    H: Fn(M, DeliveryInfo) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: fmt::Display + Send + 'static,
{
    let source = broker.source();
    let recorder = Recorder::new(B::NAME, &source, stats.clone());
    let worker = Arc::new(Worker {
        source: source.clone(),
        broker: B::NAME,
        messaging: broker.messaging(),
        options: options.clone(),
        decoder,
        retry,
        handler,
        recorder: recorder.clone(),
        shutdown: shutdown.clone(),
        abandon: CancellationToken::new(),
    });
    let concurrency = options.concurrency;
    #[cfg(feature = "sqlx")]
    let per_task = options.batch.as_ref().map_or(1, |batch| batch.max);
    #[cfg(not(feature = "sqlx"))]
    let per_task = 1;
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut fatal: Option<ConsumerError> = None;
    // Connection attempts failed in a row, and whether one was ever lost.
    let mut failures = 0u32;
    let mut lost = false;
    let mut last_activity = Instant::now();
    // The session that ended with the stop: closed after the drain, so the
    // handlers still running can settle on it.
    let mut stopped: Option<B::Session> = None;

    'connect: while !shutdown.is_cancelled() {
        let mut session = match broker.connect(&options).await {
            Ok(session) => session,
            Err(Connect::Fatal(err)) => {
                fatal = Some(err);
                break;
            }
            Err(Connect::Failed(why)) => {
                failures = failures.saturating_add(1);
                if options.reconnect.max_attempts.is_some_and(|max| failures > max) {
                    tracing::error!(target: TRACING_TARGET, source = %source, error = %why, failures, "cannot connect: giving up");
                    fatal = Some(ConsumerError::Disconnected(format!(
                        "cannot connect to {} for `{source}` after {failures} attempts: {why}",
                        B::NAME
                    )));
                    break;
                }
                let delay = options.reconnect.backoff.delay(failures);
                tracing::warn!(
                    target: TRACING_TARGET,
                    source = %source,
                    error = %why,
                    failures,
                    delay_ms = millis(delay),
                    "cannot connect: retrying"
                );
                sleep_unless_cancelled(delay, &shutdown).await;
                continue;
            }
        };
        if lost {
            recorder.connection(ConnectionEvent::Reconnected);
            tracing::info!(target: TRACING_TARGET, broker = B::NAME, source = %source, after = failures, "reconnected");
        } else {
            tracing::info!(
                target: TRACING_TARGET,
                broker = B::NAME,
                source = %source,
                concurrency,
                max_attempts = options.max_attempts,
                "consumer started"
            );
        }
        failures = 0;
        let mut stopping = false;
        loop {
            while let Some(done) = tasks.try_join_next() {
                note_task(done);
                last_activity = Instant::now();
            }
            // A task is one delivery, or one batch of up to `per_task`.
            let room = concurrency.saturating_sub(tasks.len()).saturating_mul(per_task);
            let idle_at = options
                .stop_when_idle
                .filter(|_| !stopping && tasks.is_empty())
                .map(|idle| last_activity + idle);
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !stopping => {
                    session.stop().await;
                    stopping = true;
                    continue;
                }
                _ = sleep_until(idle_at), if idle_at.is_some() => {
                    tracing::info!(target: TRACING_TARGET, source = %source, "idle: stopping");
                    session.stop().await;
                    stopping = true;
                    continue;
                }
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    note_task(done);
                    last_activity = Instant::now();
                    continue;
                }
                next = session.next(room), if room > 0 => next,
            };
            #[cfg(feature = "sqlx")]
            let next = match (next, &options.batch) {
                (Next::Delivery(first), Some(mode)) => {
                    recorder.received();
                    last_activity = Instant::now();
                    let (deliveries, after) = gather(&mut session, first, mode, &recorder).await;
                    tasks.spawn(process_batch(Arc::clone(&worker), deliveries));
                    match after {
                        Some(next) => next,
                        None => continue,
                    }
                }
                (next, _) => next,
            };
            match next {
                Next::Delivery(delivery) => {
                    recorder.received();
                    last_activity = Instant::now();
                    tasks.spawn(process(Arc::clone(&worker), delivery));
                }
                Next::Idle => {}
                Next::End if stopping => {
                    stopped = Some(session);
                    break 'connect;
                }
                Next::End => {
                    fatal = Some(ConsumerError::Cancelled(source.clone()));
                    stopped = Some(session);
                    break 'connect;
                }
                Next::Lost(why) => {
                    recorder.connection(ConnectionEvent::Lost);
                    lost = true;
                    tracing::warn!(
                        target: TRACING_TARGET,
                        broker = B::NAME,
                        source = %source,
                        error = %why,
                        in_flight = tasks.len(),
                        "connection lost: reconnecting; what was in flight is redelivered by the broker"
                    );
                    if stopping {
                        break 'connect;
                    }
                    continue 'connect;
                }
            }
        }
    }

    tracing::info!(target: TRACING_TARGET, source = %source, in_flight = tasks.len(), "consumer stopping");
    drain(&mut tasks, options.shutdown_timeout, &worker.abandon, &source).await;
    if let Some(session) = stopped {
        session.close().await;
    }
    let stats = stats.snapshot();
    tracing::info!(target: TRACING_TARGET, source = %source, ?stats, "consumer stopped");
    match fatal {
        Some(err) => Err(err),
        None => Ok(stats),
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Logs a delivery task that did not end normally (the handler's own panics
/// are caught inside the task: this is the adapter's).
fn note_task(done: Result<(), tokio::task::JoinError>) {
    if let Err(err) = done
        && err.is_panic()
    {
        tracing::error!(target: TRACING_TARGET, error = %err, "delivery task panicked");
    }
}

/// Waits for the in-flight delivery tasks, at most `timeout`; then asks
/// them to let go (they release their deliveries), and after a grace
/// period aborts what is left (those deliveries stay unsettled and the
/// broker redelivers them).
async fn drain(tasks: &mut JoinSet<()>, timeout: Duration, abandon: &CancellationToken, source: &str) {
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(done) => note_task(done),
                None => return,
            },
            _ = &mut deadline => break,
        }
    }
    tracing::warn!(
        target: TRACING_TARGET,
        source,
        abandoned = tasks.len(),
        "shutdown timeout: abandoning in-flight handlers, their messages go back to the broker"
    );
    abandon.cancel();
    let grace = tokio::time::sleep(ABANDON_GRACE);
    tokio::pin!(grace);
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(done) => note_task(done),
                None => return,
            },
            _ = &mut grace => {
                tasks.shutdown().await;
                return;
            }
        }
    }
}

/// One delivery, from its span to its settlement.
async fn process<Dl, M, D, R, H, Fut, T, E>(worker: Arc<Worker<D, R, H>>, delivery: Dl)
where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<E>,
    H: Fn(M, DeliveryInfo) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: fmt::Display,
{
    worker.handle_alone(&delivery).await;
}

/// The span of one delivery (see the module's documentation).
fn delivery_span<Dl: Delivery, D, R, H>(worker: &Worker<D, R, H>, delivery: &Dl) -> Span {
    let meta = delivery.meta();
    let messaging = &worker.messaging;
    let destination = meta.destination.as_deref().unwrap_or(&messaging.destination);
    let span = tracing::info_span!(
        target: TRACING_TARGET,
        "delivery",
        otel.name = format!("process {destination}").as_str(),
        otel.kind = "consumer",
        otel.status_code = Empty,
        messaging.system = worker.broker,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = destination,
        messaging.consumer.group.name = messaging.consumer_group.as_deref(),
        messaging.client.id = messaging.client_id.as_deref(),
        messaging.message.id = meta.message_id.as_deref(),
        messaging.message.body.size = otel_int(delivery.body().len()),
        messaging.rabbitmq.destination.routing_key = meta.routing_key.as_deref(),
        messaging.rabbitmq.message.delivery_tag = meta.delivery_tag.map(otel_int),
        source = %worker.source,
        position = %meta.position,
        attempt = i64::from(meta.attempt),
        redelivered = meta.redelivered,
        outcome = Empty,
        idempotency.outcome = Empty,
        error.type = Empty,
    );
    span
}

/// Gathers a batch: `first`, then what the session has ready, up to the
/// batch's size, waiting at most its `max_wait`. Also returns what ended
/// the gathering when it was not a delivery (end, lost connection), for the
/// run loop.
#[cfg(feature = "sqlx")]
async fn gather<S: Session>(
    session: &mut S,
    first: S::Delivery,
    mode: &super::options::BatchMode,
    recorder: &Recorder,
) -> (Vec<S::Delivery>, Option<Next<S::Delivery>>) {
    let mut deliveries = vec![first];
    let deadline = Instant::now() + mode.max_wait;
    while deliveries.len() < mode.max {
        // `timeout_at` polls `next` before looking at the clock: with no
        // wait, this takes exactly what is ready.
        match tokio::time::timeout_at(deadline, session.next(mode.max - deliveries.len())).await {
            Ok(Next::Delivery(delivery)) => {
                recorder.received();
                deliveries.push(delivery);
            }
            Ok(Next::Idle) | Err(_) => break,
            Ok(other) => return (deliveries, Some(other)),
        }
    }
    (deliveries, None)
}

/// A batch of deliveries in one database transaction (see
/// [`ConsumerBuilder::batch`](super::ConsumerBuilder::batch)): the handlers
/// run together in the [`Batch`](crate::batch::Batch)
/// ([`run_all`](crate::batch::Batch::run_all)); after the commit each
/// delivery is settled on its handler's outcome, as alone. A batch that cannot begin or commit ran for nothing (its
/// transaction rolled back): its deliveries then run again, one per
/// transaction.
///
/// Every delivery of the batch is kept alive (its
/// [`progress`](Delivery::progress) sent at its heartbeat) from the moment
/// it is gathered until its settlement begins, whatever runs meanwhile: the
/// other members' handlers after its own returned, the commit, the
/// settlement of the members before it (a retry's backoff, outage retries,
/// a dead letter's publish). A delivery the broker took for stuck would be
/// redelivered, possibly on its last allowed delivery, while the batch
/// commits its effect.
#[cfg(feature = "sqlx")]
async fn process_batch<Dl, M, D, R, H, Fut, T, E>(worker: Arc<Worker<D, R, H>>, deliveries: Vec<Dl>)
where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<E>,
    H: Fn(M, DeliveryInfo) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: fmt::Display,
{
    let Some(mode) = &worker.options.batch else {
        for delivery in deliveries {
            process(Arc::clone(&worker), delivery).await;
        }
        return;
    };
    let kept = Kept::new(deliveries.len());
    // On the heap: the batch's work holds every handler's future.
    let work = Box::pin(run_batch(&worker, mode, &deliveries, &kept));
    tokio::select! {
        biased;
        () = work => {}
        () = keep_alive(&deliveries, &kept) => {}
    }
}

/// [`process_batch`]'s work; each delivery is taken from the
/// [`keep_alive`] of the batch ([`Kept::take`]) when its settlement
/// begins.
#[cfg(feature = "sqlx")]
async fn run_batch<Dl, M, D, R, H, Fut, T, E>(
    worker: &Worker<D, R, H>,
    mode: &super::options::BatchMode,
    deliveries: &[Dl],
    kept: &Kept,
) where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<E>,
    H: Fn(M, DeliveryInfo) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: fmt::Display,
{
    // The last delivery of a message, and what is poison, are settled
    // alone, as without batches.
    let mut ready = Vec::with_capacity(deliveries.len());
    for (index, delivery) in deliveries.iter().enumerate() {
        let decoded = match (delivery.meta().last, worker.refused_body(delivery)) {
            (false, None) => worker.decoder.decode(delivery.body()).ok(),
            _ => None,
        };
        match decoded {
            Some(message) => ready.push(((index, delivery), message)),
            None => {
                kept.take(index).await;
                worker.handle_alone(delivery).await;
            }
        }
    }
    if ready.is_empty() {
        return;
    }
    let batch = match (mode.begin)().await {
        Ok(batch) => batch,
        Err(error) => {
            tracing::warn!(
                target: TRACING_TARGET,
                %error,
                deliveries = ready.len(),
                "cannot begin a batch: running its deliveries one by one"
            );
            for ((index, delivery), _) in ready {
                kept.take(index).await;
                worker.handle_alone(delivery).await;
            }
            return;
        }
    };
    let (members, messages): (Vec<(usize, &Dl)>, Vec<M>) = ready.into_iter().unzip();
    let spans: Vec<Span> = members
        .iter()
        .map(|(_, delivery)| delivery_span(worker, *delivery))
        .collect();
    // Their progress is the batch's keep-alive's.
    let calls = members
        .iter()
        .zip(messages)
        .zip(&spans)
        .map(|((&(_, delivery), message), span)| {
            worker
                .unless_abandoned(worker.call(delivery.meta(), message, false))
                .instrument(span.clone())
        })
        .collect();
    let outcomes = batch.run_all(calls).await;
    let members = members.into_iter().zip(spans);
    if outcomes.iter().any(Option::is_none) {
        // Shutdown timeout: nothing of the batch commits.
        batch.rollback().await;
        for ((index, delivery), span) in members {
            kept.take(index).await;
            worker.let_go(delivery).instrument(span).await;
        }
        return;
    }
    let ran: Vec<_> = members
        .zip(outcomes)
        .filter_map(|((member, span), outcome)| outcome.map(|outcome| (member, span, outcome)))
        .collect();
    let size = ran.len();
    let fresh = batch.fresh_claims();
    match batch.commit().await {
        Ok(()) => {
            worker.recorder.batch(size);
            tracing::debug!(target: TRACING_TARGET, deliveries = size, fresh, "batch committed");
            for ((index, delivery), span, outcome) in ran {
                kept.take(index).await;
                worker.handle_from(delivery, Some(outcome)).instrument(span).await;
            }
        }
        Err(error) => {
            worker.recorder.batch_aborted();
            tracing::warn!(
                target: TRACING_TARGET,
                %error,
                deliveries = size,
                "batch not committed (nothing of it took effect): running its deliveries one by one"
            );
            for ((index, delivery), span, _) in ran {
                kept.take(index).await;
                worker.handle(delivery).instrument(span).await;
            }
        }
    }
}

/// Which deliveries of a batch its [`keep_alive`] still sends progress
/// for: each until its settlement begins (from then on, the settlement
/// keeps it alive, as a delivery alone).
#[cfg(feature = "sqlx")]
struct Kept(tokio::sync::Mutex<Vec<bool>>);

#[cfg(feature = "sqlx")]
impl Kept {
    fn new(deliveries: usize) -> Kept {
        Kept(tokio::sync::Mutex::new(vec![true; deliveries]))
    }

    /// Takes delivery `index` out of the keep-alive, once the progress
    /// being sent (if any) has been: none of its progress follows its
    /// settlement (a JetStream "in progress" after a delayed `nak` would
    /// cut the delay short).
    async fn take(&self, index: usize) {
        if let Some(kept) = self.0.lock().await.get_mut(index) {
            *kept = false;
        }
    }
}

/// Sends the progress of every delivery of a batch still [`Kept`], at the
/// shortest of their heartbeats; never returns (pending for ever when they
/// have no heartbeat).
#[cfg(feature = "sqlx")]
async fn keep_alive<Dl: Delivery>(deliveries: &[Dl], kept: &Kept) {
    let mut beat = Beat::new(deliveries.iter().filter_map(Delivery::heartbeat).min());
    loop {
        beat.tick().await;
        let kept = kept.0.lock().await;
        let alive = deliveries
            .iter()
            .zip(kept.iter())
            .filter(|(_, kept)| **kept)
            .map(|(delivery, _)| delivery.progress());
        futures_util::future::join_all(alive).await;
    }
}

/// The clock of a delivery's progress: ticks every heartbeat period from
/// its start, across whatever its holder awaits in between (handler runs,
/// the waits between them); never ticks without a heartbeat.
struct Beat(Option<tokio::time::Interval>);

impl Beat {
    fn new(period: Option<Duration>) -> Beat {
        Beat(period.map(|period| {
            let period = period.max(Duration::from_millis(1));
            let mut ticker = tokio::time::interval_at(Instant::now() + period, period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker
        }))
    }

    /// The next tick (cancel-safe).
    async fn tick(&mut self) {
        match &mut self.0 {
            Some(ticker) => {
                ticker.tick().await;
            }
            None => std::future::pending().await,
        }
    }
}

/// A count as a signed integer: `tracing-opentelemetry` exports `i64`
/// fields as integer attributes, and unsigned ones as strings.
fn otel_int<N: TryInto<i64>>(n: N) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// Marks the current delivery's span as failed: `error.type` (`poison`,
/// `exhausted`, `handler_error`, `panic`, `ack_failed`, or the
/// idempotency outcome that failed the handler: `key_reused`,
/// `in_progress`, `error`) and an error status.
fn trace_failure(error_type: &str) {
    let span = Span::current();
    span.record("error.type", error_type);
    span.record("otel.status_code", "error");
}

impl<D, R, H> Worker<D, R, H> {
    /// One delivery, in its span.
    async fn handle_alone<Dl, M, Fut, T, E>(&self, delivery: &Dl)
    where
        Dl: Delivery,
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        let span = delivery_span(self, delivery);
        self.handle(delivery).instrument(span).await;
    }

    async fn handle<Dl, M, Fut, T, E>(&self, delivery: &Dl)
    where
        Dl: Delivery,
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        self.handle_from(delivery, None).await;
    }

    /// Handles a delivery from its handler's run: `ran` when the handler
    /// already ran (in a committed batch), otherwise from the checks that
    /// come before it.
    ///
    /// On the last delivery the broker allows (its earlier ones ended
    /// unsettled: a crash, a shutdown timeout, a dead letter refused), the
    /// handler is called only to check whether the message was processed
    /// ([`signal::checking`](crate::signal::checking)): each
    /// `#[idempotent]` call claims its key without running its body. A
    /// message whose effect is committed (its keys replay) is acknowledged;
    /// one whose key was not processed is dead-lettered (`exhausted`); one
    /// whose check cannot tell yet (the store down, the key held by a
    /// transaction that may still commit) waits, in progress, as an outage.
    async fn handle_from<Dl, M, Fut, T, E>(&self, delivery: &Dl, mut ran: Option<(Called<E>, Noted)>)
    where
        Dl: Delivery,
        D: Decoder<M>,
        R: RetryPolicy<E>,
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        let meta = delivery.meta();
        let attempt = meta.attempt;
        // Its progress, across the handler's runs and the waits between
        // them.
        let mut beat = Beat::new(delivery.heartbeat());
        let check_only = ran.is_none() && meta.last;
        if let Some(reason) = self.refused_body(delivery).filter(|_| ran.is_none()) {
            tracing::error!(target: TRACING_TARGET, %reason, "malformed or oversized (poison) message: dead-lettering it");
            trace_failure("poison");
            self.dead_letter(delivery, DeadKind::Poison, &reason, 0, Outcome::Poison)
                .await;
            return;
        }
        if check_only {
            tracing::warn!(
                target: TRACING_TARGET,
                attempt,
                "last allowed delivery: checking whether the message was processed, without running its handler's \
                 bodies"
            );
        }
        let mut outages = 0u32;
        // Deliveries the consumer processed and acknowledged (see
        // `Recorder::processed`) when this one's first outage was seen, and
        // when its latest run started.
        let mut acked_at_first_outage: Option<u64> = None;
        let mut acked_at_start = self.recorder.processed();
        let (reason, verdict, error_type) = loop {
            let (called, noted) = match ran.take() {
                Some(ran) => ran,
                None => {
                    let decoded = match self.decoder.decode(delivery.body()) {
                        Ok(decoded) => decoded,
                        Err(reason) => {
                            tracing::error!(target: TRACING_TARGET, %reason, "undecodable (poison) message: dead-lettering it");
                            trace_failure("poison");
                            self.dead_letter(delivery, DeadKind::Poison, &reason, 0, Outcome::Poison)
                                .await;
                            return;
                        }
                    };
                    acked_at_start = self.recorder.processed();
                    let call = self.call(meta, decoded, check_only);
                    let Some(outcome) = self.watched(delivery, &mut beat, call).await else {
                        self.let_go(delivery).await;
                        return;
                    };
                    outcome
                }
            };
            if let Some(outcome) = noted.outcome {
                Span::current().record("idempotency.outcome", outcome.as_str());
            }
            if check_only && noted.not_processed {
                // Not processed, and the broker will not deliver it again:
                // settle it now, without its effect.
                let reason = format!(
                    "delivered {attempt} times (as often as the broker allows) without being settled, and not \
                     processed: the consumer crashed or stopped while handling it, or its dead letter could not \
                     be published; the last delivery is kept for dead-lettering it"
                );
                tracing::error!(
                    target: TRACING_TARGET,
                    attempt,
                    "last allowed delivery of a message not processed: dead-lettering it"
                );
                trace_failure("exhausted");
                self.dead_letter(
                    delivery,
                    DeadKind::Exhausted,
                    &reason,
                    attempt.saturating_sub(1),
                    Outcome::DeadLettered,
                )
                .await;
                return;
            }
            // A handler that failed because an `#[idempotent]` call did is
            // named by that call's outcome.
            let handler_error = match noted.outcome {
                Some(
                    outcome @ (Idempotency::KeyReused
                    | Idempotency::InProgress
                    | Idempotency::NotProcessed
                    | Idempotency::Error),
                ) => outcome.as_str(),
                _ => "handler_error",
            };
            let (reason, verdict, error_type) = match called {
                Called::Ok => {
                    // Evidence that the consumer's dependencies are up,
                    // unless every call only replayed (a cache can answer
                    // duplicates while the database is down).
                    let processed = noted.outcome != Some(Idempotency::Duplicate);
                    self.ack(delivery, processed).await;
                    return;
                }
                Called::Err(err) if noted.store_failed => (err.to_string(), Verdict::Outage, handler_error),
                Called::Err(err) => {
                    let verdict = self.retry.verdict(&err);
                    (err.to_string(), verdict, handler_error)
                }
                Called::Panicked(reason) => (reason, Verdict::Retry, "panic"),
            };
            self.recorder.handler_failed();
            if verdict != Verdict::Outage {
                break (reason, verdict, error_type);
            }
            // An outage that is this message's own (the consumer processes
            // other messages meanwhile), or that outlived the
            // retries in place allowed, spends an attempt. A key another
            // consumer holds waits for it, and the last delivery's check
            // for the store.
            let waits = check_only || noted.outcome == Some(Idempotency::InProgress);
            let escalated = if waits {
                None
            } else if self.options.max_outage_retries.is_some_and(|max| outages >= max) {
                Some("its outage retries in place ran out (max_outage_retries)")
            } else if acked_at_first_outage.is_some_and(|first| acked_at_start > first) {
                Some("other messages were processed since its first outage")
            } else {
                None
            };
            if let Some(why) = escalated {
                tracing::warn!(
                    target: TRACING_TARGET,
                    error = %reason,
                    outages,
                    "outage of this message alone: {why}; spending an attempt"
                );
                break (reason, Verdict::Retry, error_type);
            }
            acked_at_first_outage.get_or_insert_with(|| self.recorder.processed());
            // A dependency is down: keep the message, run it again later,
            // without spending an attempt.
            outages = outages.saturating_add(1);
            self.recorder.outage_retry();
            let delay = self.options.outage_backoff.delay(outages);
            tracing::warn!(
                target: TRACING_TARGET,
                error = %reason,
                outages,
                delay_ms = millis(delay),
                "a dependency is down: keeping the message and running it again"
            );
            if self
                .watched(delivery, &mut beat, sleep_unless_cancelled(delay, &self.shutdown))
                .await
                .is_none()
                || self.shutdown.is_cancelled()
            {
                self.let_go(delivery).await;
                return;
            }
        };
        trace_failure(error_type);

        if verdict == Verdict::Retry && attempt < self.options.max_attempts {
            let delay = self.options.retry_backoff.delay(attempt);
            tracing::warn!(
                target: TRACING_TARGET,
                error = %reason,
                error_type,
                attempt,
                max_attempts = self.options.max_attempts,
                delay_ms = millis(delay),
                "handler failed: retrying"
            );
            let retried = if delivery.is_current() {
                delivery.retry(attempt + 1, delay, &self.shutdown).await
            } else {
                Err(Settle::Lost("the connection it came on was lost".into()))
            };
            match retried {
                Ok(()) => self.recorder.outcome(Outcome::Retried),
                Err(Settle::Refused(why)) => {
                    tracing::error!(target: TRACING_TARGET, error = %why, "could not schedule the retry: handing the message back");
                    self.release(delivery).await;
                }
                Err(Settle::Lost(why)) => {
                    tracing::warn!(target: TRACING_TARGET, error = %why, "connection lost: the broker redelivers the message");
                    self.recorder.outcome(Outcome::Released);
                }
            }
            return;
        }
        let kind = if verdict == Verdict::Reject {
            DeadKind::Rejected
        } else {
            DeadKind::Exhausted
        };
        tracing::error!(
            target: TRACING_TARGET,
            error = %reason,
            error_type,
            attempt,
            max_attempts = self.options.max_attempts,
            kind = kind.as_str(),
            "handler failed: dead-lettering the message"
        );
        self.dead_letter(delivery, kind, &reason, attempt, Outcome::DeadLettered)
            .await;
    }

    /// Why the delivery's body is poison before decoding, if it is: the
    /// broker says it carries no message, or it is longer than
    /// [`max_body_bytes`](super::ConsumerBuilder::max_body_bytes).
    fn refused_body<Dl: Delivery>(&self, delivery: &Dl) -> Option<String> {
        let size = delivery.body().len();
        let max = self.options.max_body_bytes;
        delivery
            .malformed()
            .or_else(|| (size > max).then(|| format!("body of {size} bytes exceeds the limit of {max}")))
    }

    /// The handler's call on the decoded `message` of the delivery `meta`
    /// describes: its outcome and what its `#[idempotent]` calls noted.
    /// With `check_only`, the calls only check whether their key is
    /// processed (see [`handle_from`](Self::handle_from)).
    fn call<M, Fut, T, E>(&self, meta: &Meta, message: M, check_only: bool) -> impl Future<Output = (Called<E>, Noted)>
    where
        H: Fn(M, DeliveryInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let info = DeliveryInfo {
            message_id: meta.message_id.clone(),
            attempt: meta.attempt,
            redelivered: meta.redelivered,
        };
        super::call(
            crate::signal::checking(check_only, (self.handler)(message, info)),
            &self.recorder,
        )
    }

    /// Runs `fut` while sending the delivery's progress at each `beat`;
    /// `None` when the consumer asks in-flight handlers to let go (shutdown
    /// timeout).
    async fn watched<Dl: Delivery, F: Future>(&self, delivery: &Dl, beat: &mut Beat, fut: F) -> Option<F::Output> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return Some(out),
                _ = self.abandon.cancelled() => return None,
                _ = beat.tick() => delivery.progress().await,
            }
        }
    }

    /// Runs `fut`; `None` when the consumer asks in-flight handlers to let
    /// go (shutdown timeout).
    #[cfg(feature = "sqlx")]
    async fn unless_abandoned<F: Future>(&self, fut: F) -> Option<F::Output> {
        tokio::select! {
            biased;
            out = fut => Some(out),
            _ = self.abandon.cancelled() => None,
        }
    }

    /// Acknowledges a processed delivery, on its own connection only.
    /// `processed`: the handler ran for real (see [`Recorder::processed`]).
    async fn ack<Dl: Delivery>(&self, delivery: &Dl, processed: bool) {
        if processed {
            self.recorder.note_processed();
        }
        let acked = if delivery.is_current() {
            delivery.ack().await
        } else {
            Err(Settle::Lost("the connection it came on was lost".into()))
        };
        match acked {
            Ok(()) => {
                self.recorder.outcome(Outcome::Processed);
                tracing::debug!(target: TRACING_TARGET, "processed and acknowledged");
            }
            Err(err) => {
                self.recorder.outcome(Outcome::AckFailed);
                trace_failure("ack_failed");
                tracing::warn!(
                    target: TRACING_TARGET,
                    error = %err,
                    "acknowledgement failed: the broker will redeliver the message (a duplicate for the handler)"
                );
            }
        }
    }

    /// Hands a delivery back after the consumer stopped wanting it.
    async fn let_go<Dl: Delivery>(&self, delivery: &Dl) {
        tracing::warn!(target: TRACING_TARGET, "the consumer is stopping: handing the message back");
        if delivery.is_current()
            && let Err(err) = delivery.release(Duration::ZERO).await
        {
            tracing::debug!(target: TRACING_TARGET, error = %err, "release failed: the broker redelivers it");
        }
        self.recorder.outcome(Outcome::Released);
    }

    /// Hands a delivery back after a publish the broker refused.
    async fn release<Dl: Delivery>(&self, delivery: &Dl) {
        if delivery.is_current()
            && let Err(err) = delivery.release(self.options.retry_backoff.initial).await
        {
            tracing::debug!(target: TRACING_TARGET, error = %err, "release failed: the broker redelivers it");
        }
        self.recorder.outcome(Outcome::Released);
    }

    /// Publishes the dead letter and removes the delivery; hands it back
    /// when the publish is refused, except on its last delivery, where the
    /// publish is tried again until it works or the consumer stops.
    async fn dead_letter<Dl: Delivery>(
        &self,
        delivery: &Dl,
        kind: DeadKind,
        reason: &str,
        attempts: u32,
        outcome: Outcome,
    ) {
        let reason = truncate_reason(reason);
        let letter = Letter {
            kind: kind.as_str(),
            reason: &reason,
            attempts,
            source: &self.source,
        };
        let last = delivery.meta().last;
        let mut failures = 0u32;
        loop {
            let published = if delivery.is_current() {
                delivery.dead_letter(&letter).await
            } else {
                Err(Settle::Lost("the connection it came on was lost".into()))
            };
            match published {
                Ok(()) => {
                    self.recorder.outcome(outcome);
                    return;
                }
                Err(Settle::Lost(why)) => {
                    tracing::warn!(target: TRACING_TARGET, error = %why, "connection lost before the dead letter: the broker redelivers the message");
                    self.recorder.outcome(Outcome::Released);
                    return;
                }
                Err(Settle::Refused(why)) if last && !self.shutdown.is_cancelled() => {
                    failures = failures.saturating_add(1);
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        failures,
                        "could not publish the dead letter of a message on its last delivery: retrying"
                    );
                    delivery.progress().await;
                    sleep_unless_cancelled(self.options.retry_backoff.delay(failures), &self.shutdown).await;
                }
                Err(Settle::Refused(why)) if last => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        "could not publish the dead letter of a message on its last delivery before shutdown: the \
                         broker keeps it but will not deliver it again (see its max-deliveries advisory)"
                    );
                    self.recorder.outcome(Outcome::Released);
                    return;
                }
                Err(Settle::Refused(why)) => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        "could not publish the dead letter: handing the message back"
                    );
                    self.release(delivery).await;
                    return;
                }
            }
        }
    }
}
