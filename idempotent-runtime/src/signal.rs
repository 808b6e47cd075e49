//! How a handler call tells the broker adapter what its `#[idempotent]`
//! calls came to: a task-local that the expansion writes (through
//! `__private`) and the adapter reads after the call, whatever error type
//! the handler returns. Two things are noted:
//!
//! - that the store failed, so that a database or Redis outage is retried
//!   without spending the message's attempts;
//! - the idempotency [`Outcome`], which the adapter records on the
//!   delivery's span (`idempotency.outcome`), so that a trace shows at the
//!   delivery whether the message was processed or skipped as a duplicate.

use std::cell::Cell;
use std::future::Future;

/// What one `#[idempotent]` call came to: the values of the
/// `idempotency.outcome` span attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Claimed fresh, the body returned `Ok`, the marker was committed.
    Processed,
    /// Already processed: the body did not run, the stored result was
    /// replayed.
    Duplicate,
    /// The body returned `Err`: the claim was rolled back or released.
    Failed,
    /// The key was processed before with a different fingerprint.
    KeyReused,
    /// Another consumer holds a live lease on the key.
    InProgress,
    /// The store or the call failed (store down, missing or invalid key,
    /// scope conflict, result that cannot be stored or replayed).
    Error,
}

impl Outcome {
    /// The attribute's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::Failed => "failed",
            Outcome::KeyReused => "key_reused",
            Outcome::InProgress => "in_progress",
            Outcome::Error => "error",
        }
    }

    /// Which of two outcomes of one delivery's calls it shows: a failure
    /// over a processed call over a duplicate (the first failure stays).
    fn rank(self) -> u8 {
        match self {
            Outcome::Duplicate => 0,
            Outcome::Processed => 1,
            _ => 2,
        }
    }

    /// The outcome of a call that failed with `error`.
    pub(crate) fn of_error(error: &crate::Error) -> Outcome {
        match error {
            crate::Error::KeyReused { .. } => Outcome::KeyReused,
            crate::Error::InProgress { .. } => Outcome::InProgress,
            _ => Outcome::Error,
        }
    }
}

/// What was noted during one handler call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Noted {
    /// A store failed (or another consumer held a key).
    pub(crate) store_failed: bool,
    /// The outcome of its `#[idempotent]` calls: when there were several,
    /// the first failure, else `processed` if any ran, else `duplicate`.
    pub(crate) outcome: Option<Outcome>,
}

tokio::task_local! {
    static NOTED: Cell<Noted>;
}

/// Runs `call`, telling what was noted during it.
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams")),
    allow(dead_code)
)]
pub(crate) async fn watch<F: Future>(call: F) -> (F::Output, Noted) {
    NOTED
        .scope(Cell::new(Noted::default()), async move {
            let output = call.await;
            let noted = NOTED.try_with(Cell::get).unwrap_or_default();
            (output, noted)
        })
        .await
}

/// Notes that the store failed in the current call; nothing outside
/// [`watch`].
pub(crate) fn store_failed() {
    let _ = NOTED.try_with(|noted| {
        noted.set(Noted {
            store_failed: true,
            ..noted.get()
        })
    });
}

/// Notes the outcome of an `#[idempotent]` call; nothing outside
/// [`watch`].
pub(crate) fn outcome(outcome: Outcome) {
    let _ = NOTED.try_with(|noted| {
        let mut now = noted.get();
        if now.outcome.is_none_or(|before| outcome.rank() > before.rank()) {
            now.outcome = Some(outcome);
            noted.set(now);
        }
    });
}
