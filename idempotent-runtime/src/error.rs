//! The one error type every store, the expansion and the adapters report
//! ([`Error`], also at the crate root), and how it shows a key
//! ([`DisplayKey`]).

use std::fmt;

/// What can go wrong around an idempotent handler.
///
/// A handler's own error type must implement `From<Error>`; the expansion
/// converts with `?`-style conversion, so `anyhow::Error` and `Box<dyn Error>`
/// work out of the box.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key expression produced `None`: the message carries no key, and
    /// the body was not run.
    #[error("message for `{scope}` has no idempotency key (the key expression gave `None`)")]
    MissingKey {
        /// The handler's scope.
        scope: String,
    },

    /// The key cannot be stored as it is: empty, too long or containing a
    /// character no backend can hold. Keys are never truncated.
    #[error("invalid idempotency key for `{scope}`: {reason}")]
    InvalidKey {
        /// The handler's scope.
        scope: String,
        /// Why the key was refused.
        reason: String,
    },

    /// The key was already processed with a different fingerprint: the same
    /// id was reused for another message. Nothing was run or committed.
    #[error("idempotency key {key} of `{scope}` was already used for a message with a different fingerprint")]
    KeyReused {
        /// The handler's scope.
        scope: String,
        /// The reused key, shortened for display.
        key: DisplayKey,
    },

    /// Another consumer holds a live lease on this key (stores that cannot
    /// join a transaction). Retry later: the message is being processed.
    #[error("idempotency key {key} of `{scope}` is being processed by another consumer")]
    InProgress {
        /// The handler's scope.
        scope: String,
        /// The key, shortened for display.
        key: DisplayKey,
    },

    /// The store failed (connection lost, deadlock that outlived its retries,
    /// missing table...). The handler's effect, if any, was rolled back by
    /// transactional stores.
    #[error("idempotency store error: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),

    /// Two different handlers claimed with one scope on one store in this
    /// process: they would share markers, and each would skip the messages
    /// the other processed. Nothing was run or committed. Give each handler
    /// its own `scope`, or mark both `shared_scope = true` when they must
    /// share.
    #[error(
        "scope {scope:?} of handler {handler} is already used by handler {other} on the same store: \
         they would share markers and skip each other's messages; give each its own `scope = ..`, \
         or add `shared_scope = true` to both if they must share"
    )]
    ScopeConflict {
        /// The contested scope.
        scope: String,
        /// The handler that was refused (path and declaration site).
        handler: String,
        /// The handler that owns the scope (path and declaration site).
        other: String,
    },

    /// The handler's result could not be stored or replayed (serde).
    #[error("cannot store or replay the handler's result: {0}")]
    Codec(#[source] serde_json::Error),

    /// A store or janitor was configured with an invalid value (for example a
    /// table name that is not a plain SQL identifier).
    #[error("invalid idempotency configuration: {0}")]
    Config(String),

    /// A [`Batch`](crate::batch::Batch) could not commit: a statement failed
    /// in it, or a handler was dropped (panic, cancellation) while its claim
    /// was open. The batch was rolled back: none of its messages had an
    /// effect; run them again, each in its own transaction.
    #[error(
        "the batch transaction was aborted and rolled back (a statement failed in it, or a handler was dropped \
         with its claim open): none of its messages took effect; run them again"
    )]
    BatchAborted,

    /// The handler returned `Ok`, but its claim's transaction no longer
    /// held the claim: a statement of its body had failed and left the
    /// transaction unusable (on PostgreSQL a failed statement aborts the
    /// whole transaction, and `COMMIT` then quietly rolls it back), the
    /// database had ended the transaction under the handler (InnoDB rolls
    /// a deadlock victim back whole and goes on in autocommit; SQLite rolls
    /// back after some errors), or the handler ended it itself (`COMMIT`,
    /// `ROLLBACK`). Every SQL store checks it before writing anything of its
    /// own after the body and before `COMMIT`. Nothing was committed:
    /// neither the effect nor the marker. Return the statement's error from
    /// the handler, or run a statement that may fail under a savepoint of
    /// its own (`tx.begin()`), so that its failure leaves the transaction
    /// usable.
    #[error(
        "the handler returned Ok, but its transaction no longer held the claim (a statement of its body failed \
         and aborted it, or the database or the handler ended it): nothing was committed (return the \
         statement's error, or run a statement that may fail under a savepoint)"
    )]
    TransactionAborted,

    /// The call only checked whether its key was processed, and it was not:
    /// its claim was given up at once and the body was not run. A broker
    /// consumer checks so on the last delivery the broker allows for a
    /// message (JetStream `max_deliver`, Redis Streams attempts): a message
    /// processed before (its consumer died between the commit and the ack)
    /// is acknowledged; one that was not is dead-lettered, never run on a
    /// delivery that could not be retried.
    #[error(
        "idempotency key {key} of `{scope}` was not processed before, and this call only checked it (the \
         broker's last delivery of the message, which is dead-lettered): the body was not run"
    )]
    NotProcessed {
        /// The handler's scope.
        scope: String,
        /// The key, shortened for display.
        key: DisplayKey,
    },
}

impl Error {
    /// Wraps any store-level error.
    pub fn store(err: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Store(Box::new(err))
    }

    /// `true` when retrying the same message later can succeed
    /// (`InProgress` and store failures); `false` for errors that the same
    /// message will always produce again (missing, invalid or reused keys).
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::InProgress { .. } | Error::Store(_) | Error::BatchAborted)
    }

    /// What a broker adapter should do with a message that failed with this
    /// error: an outage for a store that is down or a key another consumer
    /// holds (keep the message, without spending an attempt), a rejection
    /// for errors the same message will always produce (missing, invalid or
    /// reused keys, a scope conflict, a result that cannot be stored), and
    /// a retry that spends an attempt for a transaction a failed statement
    /// of the body aborted.
    #[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams", feature = "kafka"))]
    pub fn verdict(&self) -> crate::broker::Verdict {
        if self.is_transient() {
            crate::broker::Verdict::Outage
        } else if matches!(self, Error::TransactionAborted) {
            // The body's failed statement may pass next time (a deadlock,
            // a serialization failure): spend an attempt.
            crate::broker::Verdict::Retry
        } else {
            crate::broker::Verdict::Reject
        }
    }
}

#[cfg(feature = "sqlx")]
impl From<sqlx::Error> for Error {
    fn from(err: sqlx::Error) -> Self {
        Error::Store(Box::new(err))
    }
}

/// A key as shown in error messages: quoted, and shortened when long so a
/// hostile 10 KB key does not flood the logs.
#[derive(Clone, PartialEq, Eq)]
pub struct DisplayKey(String);

impl DisplayKey {
    const MAX_SHOWN: usize = 64;

    pub(crate) fn new(key: &str) -> Self {
        DisplayKey(key.to_owned())
    }

    /// The full key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DisplayKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut end = self.0.len().min(Self::MAX_SHOWN);
        while !self.0.is_char_boundary(end) {
            end -= 1;
        }
        if end < self.0.len() {
            write!(f, "{:?}... ({} bytes)", &self.0[..end], self.0.len())
        } else {
            write!(f, "{:?}", self.0)
        }
    }
}

impl fmt::Debug for DisplayKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
