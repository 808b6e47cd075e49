//! The one backoff of the crate: capped doubling between attempts, used by
//! the broker consumers (retries, outages, reconnections, public as
//! [`crate::broker::Backoff`]), the outbox relay's rescheduled rows, the
//! MySQL store's deadlock retries (with jitter) and the SQLite store's busy
//! retries.

use std::time::Duration;

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
    pub const fn new(initial: Duration, max: Duration) -> Self {
        let max = if max.as_nanos() < initial.as_nanos() {
            initial
        } else {
            max
        };
        Backoff { initial, max }
    }

    /// The delay after failed attempt number `attempt` (1-based).
    pub fn delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(20);
        self.initial.saturating_mul(1u32 << exp).min(self.max)
    }

    /// [`delay`](Self::delay) times a random factor in [0.5, 1.5), so that
    /// the parties that failed together (transactions that deadlocked) do
    /// not meet again.
    #[cfg(feature = "mysql")]
    pub(crate) fn jittered(&self, attempt: u32) -> Duration {
        use std::hash::{BuildHasher, Hasher};
        let jitter = std::collections::hash_map::RandomState::new().build_hasher().finish() % 1000;
        self.delay(attempt).mul_f64(0.5 + jitter as f64 / 1000.0)
    }
}

impl Default for Backoff {
    /// 1 second, doubling up to 30 seconds.
    fn default() -> Self {
        Backoff::new(Duration::from_secs(1), Duration::from_secs(30))
    }
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
    fn max_below_initial_is_raised_to_initial() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(10));
        assert_eq!(b.max, Duration::from_millis(100));
        assert_eq!(b.delay(5), Duration::from_millis(100));
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn jitter_stays_within_half_and_one_and_a_half() {
        let b = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
        for attempt in 1..10 {
            let d = b.jittered(attempt);
            assert!(d >= b.delay(attempt) / 2 && d < b.delay(attempt) * 3 / 2, "{d:?}");
        }
    }
}
