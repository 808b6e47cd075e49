//! What a consumer counts: the outcome of each delivery, connection losses
//! and reconnections, outage retries; as live counters, in the delivery's
//! span, and through the `metrics` facade (feature `metrics`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters of a consumer's run, as returned by `run` and readable while it
/// runs through [`ConsumerStats`].
///
/// Every delivery taken ends in exactly one of `acked`, `retried`,
/// `dead_lettered`, `poison`, `released` or `ack_failures`, so once a run has
/// returned, `received` is their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunStats {
    /// Deliveries taken from the broker.
    pub received: u64,
    /// The handler returned `Ok` and the delivery was acknowledged.
    pub acked: u64,
    /// Handler calls that returned `Err` or panicked (each attempt counts).
    pub failed: u64,
    /// Failed deliveries scheduled for another attempt.
    pub retried: u64,
    /// Failed deliveries sent to the dead-letter destination (attempts
    /// exhausted or error not retryable).
    pub dead_lettered: u64,
    /// Undecodable deliveries sent to the dead-letter destination.
    pub poison: u64,
    /// Deliveries handed back to the broker without a verdict: the
    /// connection was lost under them (the broker redelivers them), the
    /// consumer stopped while their handler ran, or their dead letter could
    /// not be published.
    pub released: u64,
    /// The handler returned `Ok` but the acknowledgement failed (connection
    /// lost): the broker will redeliver it and the idempotent handler will
    /// recognise the duplicate.
    pub ack_failures: u64,
    /// Handler calls run again in place because a dependency was down
    /// ([`Verdict::Outage`](crate::broker::Verdict::Outage)), without
    /// spending an attempt.
    pub outage_retries: u64,
    /// Times the broker connection was lost.
    pub connection_losses: u64,
    /// Times the consumer connected again after a loss.
    pub reconnections: u64,
    /// Batches committed ([`batch`](crate::broker::ConsumerBuilder::batch)
    /// mode).
    pub batches: u64,
    /// Deliveries whose handler ran in a committed batch.
    pub batched: u64,
    /// Batches that could not commit (nothing of them took effect): their
    /// deliveries ran again one per transaction.
    pub batches_aborted: u64,
}

/// A live view of a consumer's counters, cheap to clone; get it with the
/// consumer's `stats()` before calling `run`.
#[derive(Debug, Clone, Default)]
pub struct ConsumerStats {
    inner: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    acked: AtomicU64,
    failed: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    poison: AtomicU64,
    released: AtomicU64,
    ack_failures: AtomicU64,
    outage_retries: AtomicU64,
    connection_losses: AtomicU64,
    reconnections: AtomicU64,
    batches: AtomicU64,
    batched: AtomicU64,
    batches_aborted: AtomicU64,
    /// Deliveries whose handling has not ended.
    in_flight: AtomicU64,
    /// See [`Recorder::processed`].
    processed: AtomicU64,
}

impl ConsumerStats {
    /// The counters right now.
    pub fn snapshot(&self) -> RunStats {
        let c = &self.inner;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RunStats {
            received: get(&c.received),
            acked: get(&c.acked),
            failed: get(&c.failed),
            retried: get(&c.retried),
            dead_lettered: get(&c.dead_lettered),
            poison: get(&c.poison),
            released: get(&c.released),
            ack_failures: get(&c.ack_failures),
            outage_retries: get(&c.outage_retries),
            connection_losses: get(&c.connection_losses),
            reconnections: get(&c.reconnections),
            batches: get(&c.batches),
            batched: get(&c.batched),
            batches_aborted: get(&c.batches_aborted),
        }
    }

    /// Deliveries taken and not yet settled.
    pub fn in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::Relaxed)
    }
}

/// How a delivery ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Processed,
    Retried,
    DeadLettered,
    Poison,
    Released,
    AckFailed,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Retried => "retried",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::Poison => "poison",
            Outcome::Released => "released",
            Outcome::AckFailed => "ack_failed",
        }
    }
}

/// Why a message is dead-lettered (the `x-idempotent-kind` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeadKind {
    Poison,
    Exhausted,
    Rejected,
}

impl DeadKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DeadKind::Poison => "poison",
            DeadKind::Exhausted => "exhausted",
            DeadKind::Rejected => "rejected",
        }
    }
}

/// A connection event, for logs, counters and `metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectionEvent {
    Lost,
    Reconnected,
}

/// Records outcomes into the counters, the current span and `metrics`.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    broker: &'static str,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    source: Arc<str>,
    stats: ConsumerStats,
}

impl Recorder {
    pub(crate) fn new(broker: &'static str, source: &str, stats: ConsumerStats) -> Self {
        Recorder {
            broker,
            source: Arc::from(source),
            stats,
        }
    }

    pub(crate) fn received(&self) {
        self.stats.inner.received.fetch_add(1, Ordering::Relaxed);
        self.stats.inner.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A batch of `size` deliveries committed.
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub(crate) fn batch(&self, size: usize) {
        self.stats.inner.batches.fetch_add(1, Ordering::Relaxed);
        let size = u64::try_from(size).unwrap_or(u64::MAX);
        self.stats.inner.batched.fetch_add(size, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::histogram!(
            "idempotent_batch_size",
            "broker" => self.broker,
            "source" => self.source.to_string()
        )
        .record(size as f64);
    }

    /// A batch that could not commit.
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub(crate) fn batch_aborted(&self) {
        self.stats.inner.batches_aborted.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotent_batches_aborted_total",
            "broker" => self.broker,
            "source" => self.source.to_string()
        )
        .increment(1);
    }

    /// A handler returned `Ok` having done more than replay duplicates (see
    /// [`processed`](Self::processed)).
    pub(crate) fn note_processed(&self) {
        self.stats.inner.processed.fetch_add(1, Ordering::Relaxed);
    }

    /// Handler runs so far that returned `Ok` having done more than replay
    /// duplicates: evidence that what the consumer's handlers depend on is
    /// up (a duplicate may be answered by a cache while the database is
    /// down). A delivery whose outage persists while this grows is
    /// retried with an attempt spent.
    pub(crate) fn processed(&self) -> u64 {
        self.stats.inner.processed.load(Ordering::Relaxed)
    }

    pub(crate) fn handler_failed(&self) {
        self.stats.inner.failed.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotent_handler_errors_total",
            "broker" => self.broker,
            "source" => self.source.to_string()
        )
        .increment(1);
    }

    pub(crate) fn outage_retry(&self) {
        self.stats.inner.outage_retries.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotent_outage_retries_total",
            "broker" => self.broker,
            "source" => self.source.to_string()
        )
        .increment(1);
    }

    pub(crate) fn handler_duration(&self, elapsed: Duration) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(
            "idempotent_handler_duration_seconds",
            "broker" => self.broker,
            "source" => self.source.to_string()
        )
        .record(elapsed.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = elapsed;
    }

    pub(crate) fn connection(&self, event: ConnectionEvent) {
        let c = &self.stats.inner;
        let (counter, name) = match event {
            ConnectionEvent::Lost => (&c.connection_losses, "lost"),
            ConnectionEvent::Reconnected => (&c.reconnections, "reconnected"),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotent_consumer_connections_total",
            "broker" => self.broker,
            "source" => self.source.to_string(),
            "event" => name
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = name;
    }

    pub(crate) fn outcome(&self, outcome: Outcome) {
        let c = &self.stats.inner;
        let counter = match outcome {
            Outcome::Processed => &c.acked,
            Outcome::Retried => &c.retried,
            Outcome::DeadLettered => &c.dead_lettered,
            Outcome::Poison => &c.poison,
            Outcome::Released => &c.released,
            Outcome::AckFailed => &c.ack_failures,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        c.in_flight.fetch_sub(1, Ordering::Relaxed);
        tracing::Span::current().record("outcome", outcome.as_str());
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotent_deliveries_total",
            "broker" => self.broker,
            "source" => self.source.to_string(),
            "outcome" => outcome.as_str()
        )
        .increment(1);
    }
}
