//! The configuration every consumer shares, whatever its broker, and its
//! defaults; the builder that sets it is
//! [`ConsumerBuilder`](super::ConsumerBuilder).

use std::fmt;
use std::time::Duration;

use super::ConsumerError;
use super::policy::{Backoff, Reconnect};

/// Default number of handlers running at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default number of handler runs per message before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default time in-flight handlers get to finish after shutdown is requested.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default largest message body a consumer hands to its decoder: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1_048_576;

/// Settings every consumer has, whatever its broker.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumerOptions {
    /// Handlers running at once.
    pub concurrency: usize,
    /// Handler runs per message before it is dead-lettered.
    pub max_attempts: u32,
    /// Delay between attempts (how the broker waits depends on it).
    pub retry_backoff: Backoff,
    /// Delay before running a handler again after an outage.
    pub outage_backoff: Backoff,
    /// Outage retries in place per delivery before the next outage spends
    /// an attempt ([`ConsumerBuilder::max_outage_retries`](super::ConsumerBuilder::max_outage_retries)); `None`: no
    /// bound of their own.
    pub max_outage_retries: Option<u32>,
    /// Largest body handed to the decoder; a longer one is poison
    /// ([`ConsumerBuilder::max_body_bytes`](super::ConsumerBuilder::max_body_bytes)).
    pub max_body_bytes: usize,
    /// How a lost connection is made again.
    pub reconnect: Reconnect,
    /// How long in-flight handlers get once shutdown is requested.
    pub shutdown_timeout: Duration,
    /// Stop once nothing arrived and nothing ran for this long.
    pub stop_when_idle: Option<Duration>,
    /// Several deliveries per database transaction
    /// ([`ConsumerBuilder::batch`](super::ConsumerBuilder::batch)), or one per delivery (`None`).
    pub batch: Option<BatchMode>,
    /// A batch setting (`batch_wait`, `batch_savepoints`) called without
    /// `batch` before it: its name.
    pub(crate) batch_setting_alone: Option<&'static str>,
    /// Each delivery's transaction also stores its partition's next offset
    /// (a Kafka consumer's
    /// [`offsets_in`](crate::broker::ConsumerBuilder::offsets_in)).
    #[cfg(all(feature = "kafka", feature = "sqlx"))]
    pub(crate) offsets: Option<OffsetsMode>,
}

/// The offsets table of a consumer whose deliveries' transactions store
/// their offsets.
#[cfg(all(feature = "kafka", feature = "sqlx"))]
#[derive(Clone)]
pub(crate) struct OffsetsMode(pub(crate) std::sync::Arc<dyn crate::broker::kafka::offsets::OffsetTable>);

#[cfg(all(feature = "kafka", feature = "sqlx"))]
impl fmt::Debug for OffsetsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("OffsetsMode").field(&self.0.describe()).finish()
    }
}

/// Deliveries run in one database transaction: see
/// [`ConsumerBuilder::batch`](super::ConsumerBuilder::batch).
#[derive(Clone)]
#[non_exhaustive]
pub struct BatchMode {
    /// At most this many deliveries per transaction.
    pub max: usize,
    /// How long a batch may wait for more deliveries after its first.
    pub max_wait: Duration,
    /// Whether each member's body runs under a savepoint of its own (the
    /// default), so that a member that fails is undone alone; without, a
    /// failure rolls the whole batch back and its deliveries run again one
    /// per transaction
    /// ([`ConsumerBuilder::batch_savepoints`](super::ConsumerBuilder::batch_savepoints)).
    pub savepoints: bool,
    #[cfg(feature = "sqlx")]
    pub(crate) begin: std::sync::Arc<dyn Fn() -> BeginBatch + Send + Sync>,
}

#[cfg(feature = "sqlx")]
pub(crate) type BeginBatch =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<crate::batch::Batch, crate::Error>> + Send>>;

impl fmt::Debug for BatchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchMode")
            .field("max", &self.max)
            .field("max_wait", &self.max_wait)
            .field("savepoints", &self.savepoints)
            .finish_non_exhaustive()
    }
}

/// How long a batch waits for more deliveries after its first unless
/// [`ConsumerBuilder::batch_wait`](super::ConsumerBuilder::batch_wait) says otherwise: none. A batch takes
/// what the client holds when its first delivery arrives and closes, so it
/// never delays a lone message; under load the client holds a full batch.
/// Measured end to end (`docs/benchmarks.md`), a wait of 5 ms made batches
/// at a moderate steady rate larger but their latency higher (each message
/// waits for its batch to close, then for the batches before it), and full
/// batches filled as fast without it.
pub const DEFAULT_BATCH_WAIT: Duration = Duration::ZERO;

/// The longest [`ConsumerBuilder::batch_wait`](super::ConsumerBuilder::batch_wait): a batch waits milliseconds
/// for more deliveries, never seconds.
pub const MAX_BATCH_WAIT: Duration = Duration::from_millis(100);

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions {
            concurrency: DEFAULT_CONCURRENCY,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_backoff: Backoff::default(),
            outage_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(10)),
            max_outage_retries: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            reconnect: Reconnect::default(),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            stop_when_idle: None,
            batch: None,
            batch_setting_alone: None,
            #[cfg(all(feature = "kafka", feature = "sqlx"))]
            offsets: None,
        }
    }
}

impl ConsumerOptions {
    pub(crate) fn validate(&self) -> Result<(), ConsumerError> {
        if self.concurrency == 0 {
            return Err(ConsumerError::Config("concurrency must be at least 1".into()));
        }
        if self.max_attempts == 0 {
            return Err(ConsumerError::Config("max_attempts must be at least 1".into()));
        }
        if self.max_body_bytes == 0 {
            return Err(ConsumerError::Config("max_body_bytes must be at least 1".into()));
        }
        if self.stop_when_idle.is_some_and(|idle| idle.is_zero()) {
            return Err(ConsumerError::Config("stop_when_idle must be longer than zero".into()));
        }
        if let Some(setting) = self.batch_setting_alone {
            return Err(ConsumerError::Config(format!(
                "{setting} needs batch(store, max) before it"
            )));
        }
        if let Some(batch) = &self.batch {
            if batch.max == 0 {
                return Err(ConsumerError::Config("a batch must hold at least 1 delivery".into()));
            }
            if batch.max_wait > MAX_BATCH_WAIT {
                return Err(ConsumerError::Config(format!(
                    "batch_wait is {:?}, at most {MAX_BATCH_WAIT:?}: a batch waits milliseconds for more deliveries, \
                     never longer",
                    batch.max_wait
                )));
            }
        }
        Ok(())
    }
}
