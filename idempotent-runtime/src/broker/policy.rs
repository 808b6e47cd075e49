//! What a consumer decides about messages and failures: how a body is
//! decoded, which handler errors are worth another attempt, how long to wait
//! between attempts and between reconnections.

use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;

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

/// What to do with a message whose handler failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Try again later, spending one of the message's attempts; once they
    /// run out, dead-letter it (`exhausted`).
    Retry,
    /// The same message will always fail: dead-letter it now (`rejected`).
    Reject,
    /// Something the handler depends on is down (the database, a
    /// downstream service): keep the message and run the handler again
    /// after a backoff, without spending an attempt and without
    /// dead-lettering, until it works or the consumer stops.
    ///
    /// A call whose `#[idempotent]` store failed (`Error::Store`: the
    /// database or Redis unreachable) is an outage whatever the policy
    /// says.
    Outage,
}

/// Decides what happens to a message whose handler returned an error.
///
/// Implemented by [`RetryAll`] (the default: every error is retried until
/// the attempts run out), by any closure `Fn(&E) -> bool` (`true`: retry;
/// given to `retry_if`) and by [`Classify`] (a closure `Fn(&E) -> Verdict`,
/// given to `classify`).
///
/// Whatever the policy, a call in which the `#[idempotent]` store failed
/// (the database or Redis down) is an [`Verdict::Outage`]: the message is
/// kept and retried without spending attempts, never dead-lettered for it.
pub trait RetryPolicy<E>: Send + Sync + 'static {
    /// `true` when the same message may succeed on a later attempt.
    fn is_retryable(&self, error: &E) -> bool;

    /// What to do with the message; by default [`Verdict::Retry`] when
    /// [`is_retryable`](Self::is_retryable), else [`Verdict::Reject`].
    fn verdict(&self, error: &E) -> Verdict {
        if self.is_retryable(error) {
            Verdict::Retry
        } else {
            Verdict::Reject
        }
    }
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

/// A policy given as a closure `Fn(&E) -> Verdict` (see the builders'
/// `classify`).
#[derive(Debug, Clone, Copy)]
pub struct Classify<F>(pub F);

impl<E, F> RetryPolicy<E> for Classify<F>
where
    F: Fn(&E) -> Verdict + Send + Sync + 'static,
{
    fn is_retryable(&self, error: &E) -> bool {
        (self.0)(error) != Verdict::Reject
    }

    fn verdict(&self, error: &E) -> Verdict {
        (self.0)(error)
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

/// How a consumer gets its broker connection back after losing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reconnect {
    /// Wait between attempts.
    pub backoff: Backoff,
    /// Attempts in a row before `run` gives up with the error; `None`:
    /// forever (until shutdown).
    pub max_attempts: Option<u32>,
}

impl Reconnect {
    /// Reconnect forever, waiting `backoff` between attempts.
    pub fn forever(backoff: Backoff) -> Self {
        Reconnect {
            backoff,
            max_attempts: None,
        }
    }

    /// Reconnect at most `attempts` times in a row, then give up.
    pub fn up_to(attempts: u32, backoff: Backoff) -> Self {
        Reconnect {
            backoff,
            max_attempts: Some(attempts),
        }
    }

    /// Never reconnect: `run` returns the error when the connection is lost.
    pub fn never() -> Self {
        Reconnect::up_to(0, Backoff::default())
    }
}

impl Default for Reconnect {
    /// Forever, 100 ms doubling up to 10 s.
    fn default() -> Self {
        Reconnect::forever(Backoff::new(Duration::from_millis(100), Duration::from_secs(10)))
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
    fn policies_give_verdicts() {
        let retry_if = |e: &u8| *e > 1;
        assert_eq!(RetryPolicy::verdict(&retry_if, &2), Verdict::Retry);
        assert_eq!(RetryPolicy::verdict(&retry_if, &1), Verdict::Reject);
        let classify = Classify(|e: &u8| if *e == 0 { Verdict::Outage } else { Verdict::Reject });
        assert_eq!(classify.verdict(&0), Verdict::Outage);
        assert!(classify.is_retryable(&0));
        assert_eq!(classify.verdict(&3), Verdict::Reject);
    }
}
