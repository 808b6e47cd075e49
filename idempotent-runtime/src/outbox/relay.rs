//! The relay: publishes committed outbox rows and marks them dispatched.
//!
//! Each round takes a batch of due rows (oldest first; of the rows sharing
//! an ordering key, only the first pending one) in a transaction that
//! locks them (`FOR UPDATE SKIP LOCKED`, so relays of other processes take
//! other rows), publishes them (concurrently, each confirmed by the
//! broker), marks the published ones dispatched, reschedules the failed
//! ones with a backoff, and commits. A relay that dies mid-round leaves its
//! rows pending: another round publishes them again, with the same message
//! ids.
//!
//! Each publish runs in a span that follows the OpenTelemetry messaging
//! conventions for a `send` operation: `outbox_publish` (target
//! `idempotent::outbox`, info level), named `send {destination}` for
//! `tracing-opentelemetry`, of kind `producer`, with the `messaging.*`
//! attributes the [`Publisher`] gives and, when the publish failed,
//! `error.type` (`publish_error` or `timeout`) and an error status.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing::field::Empty;

use crate::Error;
use crate::backoff::Backoff;

/// `tracing` target of the relay's spans and events.
const TARGET: &str = "idempotent::outbox";

/// A committed outgoing message, as a relay takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRow {
    /// The row's id (its order).
    pub id: i64,
    /// The message id the broker and the consumers downstream see.
    pub message_id: String,
    /// Routing key, subject or stream.
    pub destination: String,
    /// The key ordering it among the messages sharing it.
    pub ordering_key: Option<String>,
    /// Headers.
    pub headers: Vec<(String, String)>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Failed publish attempts so far.
    pub attempts: u32,
}

impl OutboxRow {
    /// A row as stores read it (headers as a JSON object).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: i64,
        message_id: String,
        destination: String,
        ordering_key: Option<String>,
        headers_json: &str,
        payload: Vec<u8>,
        attempts: i64,
    ) -> OutboxRow {
        let headers = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(headers_json)
            .map(|map| {
                map.into_iter()
                    .filter_map(|(name, value)| value.as_str().map(|v| (name, v.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        OutboxRow {
            id,
            message_id,
            destination,
            ordering_key,
            headers,
            payload,
            attempts: u32::try_from(attempts).unwrap_or(0),
        }
    }
}

/// Why a publish failed (the row is retried later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishError(pub String);

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PublishError {}

/// Publishes outbox rows to a broker, returning once the broker confirmed
/// (stored) the message.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes one row; `Ok` only once the broker holds it.
    fn publish(&self, row: &OutboxRow) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// The `messaging.system` of the publish spans (`rabbitmq`, `nats`,
    /// `redis`); by default `_OTHER`.
    fn system(&self) -> &'static str {
        "_OTHER"
    }

    /// The `messaging.destination.name` of a row's publish span; by default
    /// the row's destination.
    fn destination_name(&self, row: &OutboxRow) -> String {
        row.destination.clone()
    }
}

impl<P: Publisher + ?Sized> Publisher for Arc<P> {
    fn publish(&self, row: &OutboxRow) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).publish(row)
    }
    fn system(&self) -> &'static str {
        (**self).system()
    }
    fn destination_name(&self, row: &OutboxRow) -> String {
        (**self).destination_name(row)
    }
}

/// A batch of locked rows: published by the relay, then settled.
pub trait OutboxBatch: Send {
    /// The rows taken.
    fn rows(&self) -> &[OutboxRow];

    /// Marks `dispatched` as dispatched, reschedules each of `failed` after
    /// its delay with its error, and commits (releasing the other rows).
    fn settle(
        self,
        dispatched: Vec<i64>,
        failed: Vec<(i64, Duration, String)>,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// A store with an outbox table (`PgStore`, `MySqlStore`, `SqliteStore`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` keeps no outbox table",
    label = "a relay publishes the rows of a store's outbox table",
    note = "`PgStore`, `SqliteStore` and `MySqlStore` keep one, written by the marker's transaction"
)]
pub trait OutboxStore: Send + Sync + 'static {
    /// A batch of locked rows.
    type Batch: OutboxBatch;

    /// Notified after each commit that staged messages, in this process.
    fn outbox_waker(&self) -> Arc<Notify>;

    /// Takes up to `limit` due rows, oldest first, and of the rows sharing
    /// an ordering key only the first pending one, reserved for this relay:
    /// locked by the batch's transaction, or (SQLite, which has no row
    /// locks) leased for `lease`.
    fn take_batch(&self, limit: u32, lease: Duration) -> impl Future<Output = Result<Self::Batch, Error>> + Send;

    /// Rows not dispatched yet, and the age of the oldest of them.
    fn pending(&self) -> impl Future<Output = Result<(u64, Option<Duration>), Error>> + Send;
}

impl<S: OutboxStore> OutboxStore for Arc<S> {
    type Batch = S::Batch;
    fn outbox_waker(&self) -> Arc<Notify> {
        (**self).outbox_waker()
    }
    fn take_batch(&self, limit: u32, lease: Duration) -> impl Future<Output = Result<Self::Batch, Error>> + Send {
        (**self).take_batch(limit, lease)
    }
    fn pending(&self) -> impl Future<Output = Result<(u64, Option<Duration>), Error>> + Send {
        (**self).pending()
    }
}

/// Counters of a relay, live.
#[derive(Debug, Clone, Default)]
pub struct OutboxStats {
    inner: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    retried: AtomicU64,
    rounds: AtomicU64,
    store_errors: AtomicU64,
    pending: AtomicU64,
    oldest_pending_ms: AtomicU64,
}

impl OutboxStats {
    /// Rows published and marked dispatched.
    pub fn published(&self) -> u64 {
        self.inner.published.load(Ordering::Relaxed)
    }
    /// Publish attempts that failed (the row was rescheduled).
    pub fn retried(&self) -> u64 {
        self.inner.retried.load(Ordering::Relaxed)
    }
    /// Batches taken.
    pub fn rounds(&self) -> u64 {
        self.inner.rounds.load(Ordering::Relaxed)
    }
    /// Store calls that failed (retried at the next round).
    pub fn store_errors(&self) -> u64 {
        self.inner.store_errors.load(Ordering::Relaxed)
    }
    /// Rows pending at the last look.
    pub fn pending(&self) -> u64 {
        self.inner.pending.load(Ordering::Relaxed)
    }
    /// Age of the oldest pending row at the last look: a stuck relay shows
    /// here.
    pub fn oldest_pending(&self) -> Duration {
        Duration::from_millis(self.inner.oldest_pending_ms.load(Ordering::Relaxed))
    }
}

/// Publishes a store's outbox through a [`Publisher`]; from
/// [`Relay::builder`], started with [`RelayBuilder::spawn`].
pub struct Relay;

impl Relay {
    /// A relay of `store`'s outbox through `publisher`.
    pub fn builder<S: OutboxStore, P: Publisher>(store: S, publisher: P) -> RelayBuilder<S, P> {
        RelayBuilder {
            store,
            publisher,
            batch: 100,
            poll: Duration::from_secs(1),
            retry: Backoff::new(Duration::from_millis(200), Duration::from_secs(60)),
            publish_timeout: Duration::from_secs(30),
        }
    }
}

/// Configures a relay.
#[must_use = "call `.spawn()` to start the relay"]
pub struct RelayBuilder<S, P> {
    store: S,
    publisher: P,
    batch: u32,
    poll: Duration,
    retry: Backoff,
    publish_timeout: Duration,
}

impl<S: OutboxStore, P: Publisher> RelayBuilder<S, P> {
    /// Rows taken per round (default 100).
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// How often to look for rows without being woken (default 1 s): rows
    /// committed by other processes, and rescheduled ones, are found so.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(Duration::from_millis(1));
        self
    }

    /// Delay before a failed row is tried again: `initial` doubling up to
    /// `max` per failed attempt (default 200 ms to 60 s).
    pub fn retry_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.retry = Backoff::new(initial, max);
        self
    }

    /// How long one publish may wait for the broker's confirmation before
    /// it counts as failed and is retried (default 30 s).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Starts the relay on the current tokio runtime.
    pub fn spawn(self) -> RelayHandle {
        let stats = OutboxStats::default();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(self, stats.clone(), shutdown.clone()));
        RelayHandle {
            stats,
            shutdown,
            task: Some(task),
        }
    }
}

/// A running relay: its counters, and how to stop it.
#[derive(Debug)]
pub struct RelayHandle {
    stats: OutboxStats,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl RelayHandle {
    /// The relay's counters.
    pub fn stats(&self) -> OutboxStats {
        self.stats.clone()
    }

    /// Stops after the round in progress.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn run<S: OutboxStore, P: Publisher>(relay: RelayBuilder<S, P>, stats: OutboxStats, shutdown: CancellationToken) {
    let waker = relay.store.outbox_waker();
    let counters = &stats.inner;
    tracing::info!(target: TARGET, batch = relay.batch, poll_ms = relay.poll.as_millis() as u64, "outbox relay started");
    loop {
        // Rounds until a short batch: everything due is published.
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            match round(&relay, counters).await {
                Ok(taken) if taken < relay.batch as usize => break,
                Ok(_) => {}
                Err(error) => {
                    counters.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(target: TARGET, %error, "outbox round failed: trying again at the next poll");
                    break;
                }
            }
        }
        report_pending(&relay.store, counters).await;
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = waker.notified() => {}
            _ = tokio::time::sleep(relay.poll) => {}
        }
    }
    tracing::info!(target: TARGET, published = stats.published(), "outbox relay stopped");
}

/// One batch: take, publish concurrently, settle. Returns how many rows it
/// took.
async fn round<S: OutboxStore, P: Publisher>(relay: &RelayBuilder<S, P>, counters: &Counters) -> Result<usize, Error> {
    // The lease outlasts the publishes' timeout: a leased row is only
    // taken again once its relay has given up on it or died.
    let batch = relay.store.take_batch(relay.batch, relay.publish_timeout * 2).await?;
    let taken = batch.rows().len();
    if taken == 0 {
        batch.settle(Vec::new(), Vec::new()).await?;
        return Ok(0);
    }
    counters.rounds.fetch_add(1, Ordering::Relaxed);
    let span = tracing::debug_span!(target: TARGET, "outbox_round", rows = taken);
    let results = futures_util::future::join_all(batch.rows().iter().map(|row| publish(relay, row)))
        .instrument(span)
        .await;
    let mut dispatched = Vec::with_capacity(taken);
    let mut failed = Vec::new();
    for (row, result) in batch.rows().iter().zip(results) {
        match result {
            Ok(()) => dispatched.push(row.id),
            Err(error) => {
                let delay = relay.retry.delay(row.attempts + 1);
                tracing::warn!(
                    target: TARGET,
                    message_id = %row.message_id,
                    destination = %row.destination,
                    attempts = row.attempts + 1,
                    delay_ms = delay.as_millis() as u64,
                    %error,
                    "publishing an outbox row failed: retrying later"
                );
                failed.push((row.id, delay, error.0));
            }
        }
    }
    let (published, retried) = (dispatched.len() as u64, failed.len() as u64);
    batch.settle(dispatched, failed).await?;
    counters.published.fetch_add(published, Ordering::Relaxed);
    counters.retried.fetch_add(retried, Ordering::Relaxed);
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("idempotent_outbox_published_total").increment(published);
        metrics::counter!("idempotent_outbox_retried_total").increment(retried);
    }
    Ok(taken)
}

/// Publishes one row in its `send` span.
async fn publish<S, P: Publisher>(relay: &RelayBuilder<S, P>, row: &OutboxRow) -> Result<(), PublishError> {
    let destination = relay.publisher.destination_name(row);
    let span = tracing::info_span!(
        target: TARGET,
        "outbox_publish",
        otel.name = format!("send {destination}").as_str(),
        otel.kind = "producer",
        otel.status_code = Empty,
        messaging.system = relay.publisher.system(),
        messaging.operation.type = "send",
        messaging.operation.name = "publish",
        messaging.destination.name = destination.as_str(),
        messaging.message.id = row.message_id.as_str(),
        // Signed: `tracing-opentelemetry` exports unsigned fields as strings.
        messaging.message.body.size = i64::try_from(row.payload.len()).unwrap_or(i64::MAX),
        outbox.row_id = row.id,
        outbox.attempt = i64::from(row.attempts).saturating_add(1),
        error.type = Empty,
    );
    let published = tokio::time::timeout(relay.publish_timeout, relay.publisher.publish(row))
        .instrument(span.clone())
        .await;
    let (result, error_type) = match published {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(error)) => (Err(error), "publish_error"),
        Err(_) => (
            Err(PublishError(format!(
                "the broker did not confirm within {:?}",
                relay.publish_timeout
            ))),
            "timeout",
        ),
    };
    span.record("error.type", error_type);
    span.record("otel.status_code", "error");
    result
}

async fn report_pending<S: OutboxStore>(store: &S, counters: &Counters) {
    if let Ok((pending, oldest)) = store.pending().await {
        let oldest_ms = oldest.map_or(0, |age| u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        counters.pending.store(pending, Ordering::Relaxed);
        counters.oldest_pending_ms.store(oldest_ms, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        {
            metrics::gauge!("idempotent_outbox_pending").set(pending as f64);
            metrics::gauge!("idempotent_outbox_oldest_pending_seconds").set(oldest_ms as f64 / 1000.0);
        }
    }
}
