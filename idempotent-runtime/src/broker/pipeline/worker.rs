//! What the delivery tasks of one consumer share, read by the loop
//! (`run`), one delivery (`deliver`) and a batch (`batch`).

use std::time::Duration;

use super::dead::DeadLettered;
use super::traits::Messaging;
use crate::broker::CancellationToken;
use crate::broker::options::ConsumerOptions;
use crate::broker::stats::Recorder;

/// What the delivery tasks share.
pub(super) struct Worker<D, R, H> {
    pub(super) source: String,
    pub(super) broker: &'static str,
    pub(super) messaging: Messaging,
    pub(super) options: ConsumerOptions,
    pub(super) decoder: D,
    pub(super) retry: R,
    pub(super) handler: H,
    pub(super) recorder: Recorder,
    pub(super) shutdown: CancellationToken,
    /// Cancelled at the shutdown timeout: handlers still running let go.
    pub(super) abandon: CancellationToken,
    /// The messages the process's consumers dead-lettered.
    pub(super) dead: &'static DeadLettered,
}

/// Milliseconds of `d` for a log field (saturating).
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
