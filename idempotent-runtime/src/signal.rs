//! How a handler call tells the broker adapter what its `#[idempotent]`
//! calls came to: a task-local that the expansion writes (through
//! `__private`) and the adapter reads after the call, whatever error type
//! the handler returns. Two things are noted:
//!
//! - that the store failed, so that a database or Redis outage is retried
//!   without spending the message's attempts;
//! - the idempotency [`Outcome`], which the adapter records on the
//!   delivery's span (`idempotency.outcome`), so that a trace shows at the
//!   delivery whether the message was processed or skipped as a duplicate;
//! - that a call made only to check (see [`checking`]) found its key not
//!   processed.
//!
//! And one thing goes the other way, from the adapter to the calls: that
//! they only check ([`checking`]). On the broker's last delivery of a
//! message, the adapter calls the handler so: each `#[idempotent]` call
//! claims its key; a key already processed replays as usual (the message's
//! effect is committed: it is acknowledged), a key that would be claimed
//! fresh is given up at once without running the body (the call fails with
//! [`Error::NotProcessed`](crate::Error::NotProcessed), and the adapter
//! dead-letters the message).

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
    /// The call only checked whether its key was processed (a broker's last
    /// delivery of the message), and it was not: the body did not run.
    NotProcessed,
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
            Outcome::NotProcessed => "not_processed",
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
            crate::Error::NotProcessed { .. } => Outcome::NotProcessed,
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
    /// A call that only checked (see [`checking`]) found its key not
    /// processed, and gave its claim up without running its body.
    pub(crate) not_processed: bool,
    /// Some call completed a fresh claim (whatever the others did): inside
    /// a batch, its marker and effects wait in the batch's transaction.
    pub(crate) processed: bool,
}

tokio::task_local! {
    static NOTED: Cell<Noted>;
    /// The calls only check whether their key is processed (see
    /// [`checking`]).
    static CHECK_ONLY: bool;
}

/// Runs `call`, telling what was noted during it.
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams", feature = "kafka")),
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
        now.processed |= outcome == Outcome::Processed;
        if now.outcome.is_none_or(|before| outcome.rank() > before.rank()) {
            now.outcome = Some(outcome);
        }
        noted.set(now);
    });
}

/// Runs `call` with its `#[idempotent]` calls only checking whether their
/// key is processed, when `check_only`: a key already processed replays as
/// usual, a key that would be claimed fresh is given up without running the
/// body (see [`crate::call::claim`]). Reaches the calls made in the task
/// polling `call` (not those of tasks it spawns).
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams", feature = "kafka")),
    allow(dead_code)
)]
pub(crate) fn checking<F: Future>(check_only: bool, call: F) -> impl Future<Output = F::Output> {
    // Not an `async fn`: that would hold `call` twice (its argument and the
    // scope's), and handler futures are large.
    CHECK_ONLY.scope(check_only, call)
}

/// Whether the current call only checks (inside [`checking`]).
pub(crate) fn check_only() -> bool {
    CHECK_ONLY.try_with(|check_only| *check_only).unwrap_or(false)
}

/// Notes that a call that only checked found its key not processed;
/// nothing outside [`watch`].
pub(crate) fn not_processed() {
    let _ = NOTED.try_with(|noted| {
        noted.set(Noted {
            not_processed: true,
            ..noted.get()
        })
    });
}
