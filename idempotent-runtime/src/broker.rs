//! What the RabbitMQ and NATS JetStream adapters share: decoding, retry
//! classification and backoff, the outcome of a delivery (tracing, counters,
//! `metrics`), the handler call with panic capture, and the adapters' error.
//!
//! The public items are re-exported by [`crate::rabbitmq`] and [`crate::nats`].

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use serde::de::DeserializeOwned;

/// `tracing` target of the adapters' spans and events.
pub const TRACING_TARGET: &str = "idempotent::broker";

/// Dead-letter header: why the message was dead-lettered, human readable
/// (the decoding error or the handler's last error).
pub const HEADER_REASON: &str = "x-idempotent-reason";
/// Dead-letter header: `poison` (undecodable), `exhausted` (failed on every
/// allowed attempt) or `rejected` (failed with an error the retry policy
/// calls permanent).
pub const HEADER_KIND: &str = "x-idempotent-kind";
/// Dead-letter header: how many times the handler ran on the message (0 for
/// poison).
pub const HEADER_ATTEMPTS: &str = "x-idempotent-attempts";
/// Dead-letter header: where the message was consumed from (queue name, or
/// `stream/consumer` for JetStream).
pub const HEADER_SOURCE: &str = "x-idempotent-source";

/// Longest reason text put in a dead-letter header; longer ones are cut at a
/// character boundary and marked with `...`.
pub(crate) const MAX_REASON_BYTES: usize = 4096;

/// Turns a delivery's body into the handler's message type.
///
/// Implemented by [`Json`] (the default) for every `DeserializeOwned` type,
/// and by any closure `Fn(&[u8]) -> Result<M, E>` with `E: Display`, so a
/// custom format is one closure away.
///
/// A body the decoder refuses is a *poison* message: it is dead-lettered at
/// once with the error text as its reason, never retried, never dropped.
pub trait Decoder<M>: Send + Sync + 'static {
    /// Decodes one body; the error text becomes the dead-letter reason.
    fn decode(&self, body: &[u8]) -> Result<M, String>;
}

/// The default decoder: the body is JSON (`serde_json`).
///
/// A body that is not JSON, or JSON missing a required field (such as the
/// key field), is a poison message.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

impl<M: DeserializeOwned> Decoder<M> for Json {
    fn decode(&self, body: &[u8]) -> Result<M, String> {
        serde_json::from_slice(body).map_err(|err| format!("cannot decode JSON body: {err}"))
    }
}

impl<M, E, F> Decoder<M> for F
where
    F: Fn(&[u8]) -> Result<M, E> + Send + Sync + 'static,
    E: fmt::Display,
{
    fn decode(&self, body: &[u8]) -> Result<M, String> {
        self(body).map_err(|err| err.to_string())
    }
}

/// Tells whether a handler error is worth another attempt.
///
/// Implemented by [`RetryAll`] (the default: every error is retried until the
/// attempts run out) and by any closure `Fn(&E) -> bool` (`true`: retry).
/// A message whose error is not retryable is dead-lettered at once.
///
/// With handlers whose error wraps [`crate::Error`], a natural policy is
/// [`crate::Error::is_transient`]: a missing, invalid or reused key will never
/// succeed, a store failure or an `InProgress` lease may:
/// `.retry_if(|err: &AppError| match err { AppError::Idempotency(e) => e.is_transient(), _ => true })`.
pub trait RetryPolicy<E>: Send + Sync + 'static {
    /// `true` when the same message may succeed on a later attempt.
    fn is_retryable(&self, error: &E) -> bool;
}

/// The default retry policy: every error is retried until the attempts run
/// out.
#[derive(Debug, Clone, Copy, Default)]
pub struct RetryAll;

impl<E> RetryPolicy<E> for RetryAll {
    fn is_retryable(&self, _: &E) -> bool {
        true
    }
}

impl<E, F> RetryPolicy<E> for F
where
    F: Fn(&E) -> bool + Send + Sync + 'static,
{
    fn is_retryable(&self, error: &E) -> bool {
        self(error)
    }
}

/// Exponential backoff between attempts: `initial`, `2 × initial`, ... up to
/// `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failed attempt.
    pub initial: Duration,
    /// Upper bound of the delay.
    pub max: Duration,
}

impl Backoff {
    /// A backoff from `initial` doubling up to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
        }
    }

    /// The delay after failed attempt number `attempt` (1-based).
    pub fn delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(20);
        self.initial.saturating_mul(1u32 << exp).min(self.max)
    }
}

impl Default for Backoff {
    /// 1 second, doubling up to 30 seconds.
    fn default() -> Self {
        Backoff::new(Duration::from_secs(1), Duration::from_secs(30))
    }
}

/// What the adapter knows about a delivery, for handlers that want it
/// (`run_with_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeliveryInfo {
    /// The broker-level message id, if the publisher set one (AMQP
    /// `message_id` property; NATS `Nats-Msg-Id` header).
    pub message_id: Option<String>,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// The broker says this message was delivered before (to this or another
    /// consumer) without being acknowledged.
    pub redelivered: bool,
}

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
    /// Deliveries handed back to the broker without counting an attempt
    /// (shutdown before the handler ran, dead-letter publish refused).
    pub released: u64,
    /// The handler returned `Ok` but the acknowledgement failed (connection
    /// lost): the broker will redeliver it and the idempotent handler will
    /// recognise the duplicate.
    pub ack_failures: u64,
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
        }
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

/// What a handler call came to.
pub(crate) enum Called<E> {
    Ok,
    Err(E),
    Panicked(String),
}

/// Runs the handler's future, catching a panic so that it counts as a failed
/// attempt instead of leaving the delivery unacknowledged forever.
pub(crate) async fn call<Fut, T, E>(fut: Fut, recorder: &Recorder) -> Called<E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let start = Instant::now();
    let result = AssertUnwindSafe(fut).catch_unwind().await;
    recorder.handler_duration(start.elapsed());
    match result {
        Ok(Ok(_)) => Called::Ok,
        Ok(Err(err)) => Called::Err(err),
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            Called::Panicked(format!("handler panicked: {text}"))
        }
    }
}

/// `reason` cut to [`MAX_REASON_BYTES`].
pub(crate) fn truncate_reason(reason: &str) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason.to_owned();
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &reason[..end])
}

/// Sleeps `delay`, returning early when `shutdown` fires.
pub(crate) async fn sleep_unless_cancelled(delay: Duration, shutdown: &tokio_util::sync::CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = shutdown.cancelled() => {}
    }
}

/// A cancellation token that is cancelled on Ctrl-C (SIGINT) or, on Unix,
/// SIGTERM: pass it to `run` for a graceful shutdown when the service is
/// stopped. Spawns a task, so call it inside a Tokio runtime.
///
/// Cancel the token yourself (or a parent of it) to stop for other reasons.
pub fn shutdown_on_signal() -> tokio_util::sync::CancellationToken {
    let token = tokio_util::sync::CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            signal = wait_for_signal() => {
                tracing::info!(target: TRACING_TARGET, signal, "shutdown signal received");
                cancel.cancel();
            }
            _ = cancel.cancelled() => {}
        }
    });
    token
}

/// Waits for SIGINT or SIGTERM; never returns when no handler can be
/// installed (the token can still be cancelled by hand).
async fn wait_for_signal() -> &'static str {
    let ctrl_c = async {
        match tokio::signal::ctrl_c().await {
            Ok(()) => "SIGINT",
            Err(err) => {
                tracing::warn!(target: TRACING_TARGET, error = %err, "cannot listen for Ctrl-C");
                std::future::pending().await
            }
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
                "SIGTERM"
            }
            Err(err) => {
                tracing::warn!(target: TRACING_TARGET, error = %err, "cannot listen for SIGTERM");
                std::future::pending().await
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<&'static str>();
    tokio::select! {
        signal = ctrl_c => signal,
        signal = terminate => signal,
    }
}

/// Notes the end of a delivery task: keeps the first fatal error.
pub(crate) fn note_task(
    done: Result<Result<(), ConsumerError>, tokio::task::JoinError>,
    fatal: &mut Option<ConsumerError>,
) {
    match done {
        Ok(Ok(())) => {}
        Ok(Err(err)) => {
            if fatal.is_none() {
                *fatal = Some(err);
            }
        }
        Err(err) if err.is_panic() => {
            // Handler panics are caught inside the task; this is the adapter's own.
            tracing::error!(target: TRACING_TARGET, error = %err, "delivery task panicked");
        }
        Err(_) => {}
    }
}

/// Waits for the in-flight delivery tasks, at most `timeout`; then aborts
/// the rest (their deliveries stay unacknowledged and are redelivered).
pub(crate) async fn drain(
    tasks: &mut tokio::task::JoinSet<Result<(), ConsumerError>>,
    timeout: Duration,
    fatal: &mut Option<ConsumerError>,
    source: &str,
) {
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(done) => note_task(done, fatal),
                None => return,
            },
            _ = &mut deadline => {
                tracing::warn!(
                    target: TRACING_TARGET,
                    source,
                    abandoned = tasks.len(),
                    "shutdown timeout: abandoning in-flight handlers, their messages will be redelivered"
                );
                tasks.shutdown().await;
                return;
            }
        }
    }
}

/// An adapter failed to run: bad configuration, or the broker connection
/// broke in a way the consumer cannot recover from by itself (restart it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The builder was given an unusable value.
    #[error("invalid consumer configuration: {0}")]
    Config(String),

    /// RabbitMQ failed (channel or connection closed, declaration refused...).
    #[cfg(feature = "lapin")]
    #[error("RabbitMQ error: {0}")]
    Rabbit(#[from] lapin::Error),

    /// NATS failed.
    #[cfg(feature = "nats")]
    #[error("NATS error: {0}")]
    Nats(#[source] async_nats::Error),

    /// The channel or connection closed under a delivery that was still to
    /// be settled; the broker redelivers it.
    #[error("{0}")]
    Disconnected(String),

    /// The broker cancelled the consumer (for example the queue was deleted).
    #[error("the broker cancelled the consumer of `{0}`")]
    Cancelled(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_max() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        assert_eq!(b.delay(1), Duration::from_millis(100));
        assert_eq!(b.delay(2), Duration::from_millis(200));
        assert_eq!(b.delay(3), Duration::from_millis(400));
        assert_eq!(b.delay(4), Duration::from_millis(500));
        assert_eq!(b.delay(u32::MAX), Duration::from_millis(500));
        assert_eq!(b.delay(0), Duration::from_millis(100));
    }

    #[test]
    fn json_decoder_reports_missing_field() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Msg {
            message_id: String,
        }
        let err = Decoder::<Msg>::decode(&Json, br#"{"amount":1}"#).unwrap_err();
        assert!(err.contains("missing field `message_id`"), "{err}");
        let err = Decoder::<Msg>::decode(&Json, b"{not json").unwrap_err();
        assert!(err.contains("cannot decode JSON"), "{err}");
    }

    #[test]
    fn reason_is_truncated_on_char_boundary() {
        let long = "é".repeat(MAX_REASON_BYTES);
        let cut = truncate_reason(&long);
        assert!(cut.len() <= MAX_REASON_BYTES + 3);
        assert!(cut.ends_with("..."));
        assert_eq!(truncate_reason("short"), "short");
    }
}
