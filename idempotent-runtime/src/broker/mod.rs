//! Broker adapters: one delivery pipeline, and a thin part per broker.
//!
//! - [`pipeline`] is written once: it keeps a connection (reconnecting with
//!   backoff when it is lost), takes deliveries while handler slots are
//!   free, and takes each one through decode → poison → handler → verdict →
//!   settle, in a `tracing` span, with the counters, attempt accounting,
//!   outage retries in place and the shutdown drain.
//! - [`ConsumerOptions`] is the configuration every consumer shares; the
//!   one builder ([`ConsumerBuilder`]) and consumer ([`Consumer`]) types
//!   that each broker instantiates set it and run the pipeline with a
//!   [`Handler`].
//! - The policies decide about bodies ([`Decoder`]) and failures
//!   ([`RetryPolicy`], [`Verdict`], [`Backoff`], [`Reconnect`]);
//!   [`ConsumerStats`] counts.
//!
//! Every name the brokers share has one path, here
//! (`idempotent_runtime::broker::Verdict`); a broker's module holds only its
//! own (`rabbitmq::RabbitConsumer`...).
//! - Each broker supplies only how it connects and receives, and how it
//!   settles a delivery (ack, retry with delay, dead-letter, release):
//!   [`rabbitmq`], [`nats`], [`redis_streams`].

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures_util::FutureExt;

mod consumer;
mod handler;
mod options;
pub mod pipeline;
mod policy;
mod stats;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
pub mod redis_streams;

pub use consumer::{Consumer, ConsumerBuilder};
pub use handler::Handler;
pub use options::{
    BatchMode, ConsumerOptions, DEFAULT_BATCH_WAIT, DEFAULT_CONCURRENCY, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT, MAX_BATCH_WAIT,
};
pub use policy::{Backoff, Classify, Decoder, Json, Reconnect, RetryAll, RetryPolicy, Verdict};
pub use stats::{ConsumerStats, RunStats};
/// The cancellation token `run` stops on (re-exported from `tokio-util`).
pub use tokio_util::sync::CancellationToken;

/// `tracing` target of the adapters' spans and events.
pub const TRACING_TARGET: &str = "idempotent::broker";

/// Dead-letter header: why the message was dead-lettered, human readable
/// (the decoding error or the handler's last error).
pub const HEADER_REASON: &str = "x-idempotent-reason";
/// Dead-letter header: `poison` (undecodable), `exhausted` (failed on every
/// allowed attempt, or delivered as often as the broker allows) or
/// `rejected` (failed with an error the retry policy calls permanent).
pub const HEADER_KIND: &str = "x-idempotent-kind";
/// Dead-letter header: how many times the handler ran on the message (0 for
/// poison).
pub const HEADER_ATTEMPTS: &str = "x-idempotent-attempts";
/// Dead-letter header: where the message was consumed from (queue name,
/// `stream/consumer` for JetStream, `stream/group` for Redis Streams).
pub const HEADER_SOURCE: &str = "x-idempotent-source";
/// Header holding the attempt number of a retried copy (RabbitMQ, Redis
/// Streams), starting at 1 for the original message.
pub const HEADER_ATTEMPT: &str = "x-idempotent-attempt";
/// Dead-letter header holding the original message's broker-level id (the
/// dead letter may carry an id of its own).
pub const HEADER_MSG_ID: &str = "x-idempotent-msg-id";

/// Longest reason text put in a dead-letter header; longer ones are cut at a
/// character boundary and marked with `...`.
pub(crate) const MAX_REASON_BYTES: usize = 4096;

/// What the adapter knows about a delivery, for handlers that want it
/// (`run_with_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeliveryInfo {
    /// The broker-level message id, if the publisher set one (AMQP
    /// `message_id` property; NATS `Nats-Msg-Id` header; a Redis Streams
    /// entry's `message_id` field).
    pub message_id: Option<String>,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// The broker says this message was delivered before (to this or another
    /// consumer) without being acknowledged.
    pub redelivered: bool,
}

/// An adapter failed to run: bad configuration, topology it cannot use, or
/// a broker connection it could not get back within its
/// [`Reconnect`] policy.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The builder was given an unusable value, or the broker's topology
    /// does not fit (a missing exchange, a consumer that would read its own
    /// dead letters...).
    #[error("invalid consumer configuration: {0}")]
    Config(String),

    /// RabbitMQ failed (channel or connection closed, declaration refused...).
    #[cfg(feature = "rabbitmq")]
    #[error("RabbitMQ error: {0}")]
    Rabbit(#[from] lapin::Error),

    /// NATS failed.
    #[cfg(feature = "nats")]
    #[error("NATS error: {0}")]
    Nats(#[source] async_nats::Error),

    /// Kafka (librdkafka) failed.
    #[cfg(feature = "kafka")]
    #[error("Kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),

    /// Redis failed.
    #[cfg(feature = "redis-streams")]
    #[error("Redis error: {0}")]
    Redis(#[from] redis::RedisError),

    /// The connection was lost and could not be made again within the
    /// reconnection policy; the broker redelivers what was not settled.
    #[error("{0}")]
    Disconnected(String),

    /// The broker cancelled the consumer (for example the queue was deleted).
    #[error("the broker cancelled the consumer of `{0}`")]
    Cancelled(String),
}

/// What a handler call came to.
pub(crate) enum Called<E> {
    Ok,
    Err(E),
    Panicked(String),
    /// The handler returned `Ok`, but the transaction that stores the
    /// delivery's offset with its effect could not begin, store it or
    /// commit: nothing of it took effect (offsets in the database).
    #[cfg_attr(not(all(feature = "kafka", feature = "sqlx")), allow(dead_code))]
    Unstored(String),
}

/// Runs the handler's future, catching a panic so that it counts as a failed
/// attempt instead of leaving the delivery unacknowledged forever. Also
/// tells what its `#[idempotent]` calls noted: whether a store failed, and
/// their outcome.
pub(crate) async fn call<Fut, T, E>(fut: Fut, recorder: &stats::Recorder) -> (Called<E>, crate::signal::Noted)
where
    Fut: Future<Output = Result<T, E>>,
{
    let start = Instant::now();
    let (result, noted) = crate::signal::watch(AssertUnwindSafe(fut).catch_unwind()).await;
    recorder.handler_duration(start.elapsed());
    let called = match result {
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
    };
    (called, noted)
}

/// `reason` cut to [`MAX_REASON_BYTES`], on one line.
pub(crate) fn truncate_reason(reason: &str) -> String {
    let reason = reason.replace(['\r', '\n'], " ");
    if reason.len() <= MAX_REASON_BYTES {
        return reason;
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &reason[..end])
}

/// Sleeps `delay`, returning early when `token` fires.
pub(crate) async fn sleep_unless_cancelled(delay: Duration, token: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = token.cancelled() => {}
    }
}

/// A cancellation token that is cancelled on Ctrl-C (SIGINT) or, on Unix,
/// SIGTERM: pass it to `run` for a graceful shutdown when the service is
/// stopped. Spawns a task, so call it inside a Tokio runtime.
///
/// Cancel the token yourself (or a parent of it) to stop for other reasons.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_is_truncated_on_char_boundary_and_one_line() {
        let long = "é".repeat(MAX_REASON_BYTES);
        let cut = truncate_reason(&long);
        assert!(cut.len() <= MAX_REASON_BYTES + 3);
        assert!(cut.ends_with("..."));
        assert_eq!(truncate_reason("short\r\nline"), "short  line");
    }
}
