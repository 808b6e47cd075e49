//! What a consumer decides about messages and failures: how a body is
//! decoded, which handler errors are worth another attempt, how long to wait
//! between attempts and between reconnections.

use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;

pub use crate::backoff::Backoff;

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
    ///
    /// An outage is for what is down for every message, never for an error
    /// of this message's own data: a delivery whose outage persists while
    /// the consumer processes other messages (since its first outage)
    /// spends an attempt after all, as [`Verdict::Retry`], so it is
    /// dead-lettered once its attempts run out instead of looping for ever;
    /// `max_outage_retries(n)` on the builder bounds the retries in place
    /// outright.
    Outage,
}

#[cfg(feature = "sqlx")]
impl Verdict {
    /// The verdict on an error of `sqlx` (a handler's own query failed), for
    /// `classify`: an outage only when the database cannot be reached or
    /// is going away, never for what the message's data did.
    ///
    /// | error | verdict |
    /// | --- | --- |
    /// | I/O, TLS, protocol, configuration, pool timed out or closed, worker crashed | [`Outage`](Verdict::Outage) |
    /// | SQLSTATE class `08` (connection exception), `53` (insufficient resources), `57P01`–`57P03` (admin or crash shutdown, cannot connect now); MySQL/MariaDB 1040 (too many connections), 1053 (server shutdown), 2006 and 2013 (server gone away, connection lost); SQLite `IOERR`, `FULL`, `CANTOPEN`, `NOMEM` | [`Outage`](Verdict::Outage) |
    /// | SQLSTATE `40001` (serialization failure), `40P01` (deadlock), `55P03` (lock not available), `57014` (statement cancelled or timed out); MySQL/MariaDB 1213 (deadlock), 1205 (lock wait timeout); SQLite `BUSY`, `LOCKED` | [`Retry`](Verdict::Retry): transient, spends an attempt |
    /// | a foreign key violation; no row found | [`Retry`](Verdict::Retry): the row it needs may come with a later message |
    /// | unique, not-null, check and exclusion violations (SQLSTATE class `23`), data exceptions (class `22`: a NUL byte in a text, a value out of range, an invalid date...; MySQL/MariaDB 1366, 1265, 1406, 1264, 1292), a value that cannot be encoded, an invalid argument | [`Reject`](Verdict::Reject): the same message always fails the same way |
    /// | anything else (a syntax error, a missing table or column, a value that cannot be decoded...) | [`Retry`](Verdict::Retry): attempts are spent, then the message is dead-lettered (`exhausted`) for replay once fixed |
    ///
    /// ```
    /// use idempotent_runtime::broker::Verdict;
    /// use idempotent_runtime::sqlx;
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// enum AppError {
    ///     #[error(transparent)] Idempotency(#[from] idempotent_runtime::Error),
    ///     #[error(transparent)] Database(#[from] sqlx::Error),
    /// }
    ///
    /// fn classify(err: &AppError) -> Verdict {
    ///     match err {
    ///         AppError::Idempotency(e) => e.verdict(),
    ///         AppError::Database(e) => Verdict::of_sqlx(e),
    ///     }
    /// }
    /// assert_eq!(classify(&AppError::Database(sqlx::Error::PoolTimedOut)), Verdict::Outage);
    /// assert_eq!(classify(&AppError::Database(sqlx::Error::RowNotFound)), Verdict::Retry);
    /// ```
    pub fn of_sqlx(error: &sqlx::Error) -> Verdict {
        use sqlx::Error as E;
        match error {
            E::Database(db) => Verdict::of_database(&**db),
            E::Io(_)
            | E::Tls(_)
            | E::Protocol(_)
            | E::Configuration(_)
            | E::PoolTimedOut
            | E::PoolClosed
            | E::WorkerCrashed
            | E::BeginFailed => Verdict::Outage,
            E::Encode(_) | E::InvalidArgument(_) => Verdict::Reject,
            _ => Verdict::Retry,
        }
    }

    /// [`of_sqlx`](Self::of_sqlx) of an error the database returned.
    fn of_database(error: &(dyn sqlx::error::DatabaseError + 'static)) -> Verdict {
        use sqlx::error::ErrorKind;
        #[cfg(feature = "mysql")]
        if let Some(mysql) = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            && let Some(verdict) = mysql_verdict(mysql.number())
        {
            return verdict;
        }
        #[cfg(feature = "sqlite")]
        if let Some(sqlite) = error.try_downcast_ref::<sqlx::sqlite::SqliteError>()
            && let Some(verdict) = sqlite_verdict(sqlite)
        {
            return verdict;
        }
        match error.kind() {
            ErrorKind::ForeignKeyViolation => return Verdict::Retry,
            ErrorKind::UniqueViolation
            | ErrorKind::NotNullViolation
            | ErrorKind::CheckViolation
            | ErrorKind::ExclusionViolation => return Verdict::Reject,
            _ => {}
        }
        match error.code() {
            Some(code) => sqlstate_verdict(&code),
            None => Verdict::Retry,
        }
    }
}

/// The verdict on a SQLSTATE (PostgreSQL's, and MySQL's where it says
/// more than `HY000`).
#[cfg(feature = "sqlx")]
fn sqlstate_verdict(code: &str) -> Verdict {
    match code {
        "40001" | "40P01" | "55P03" | "57014" => Verdict::Retry,
        "57P01" | "57P02" | "57P03" => Verdict::Outage,
        _ if code.starts_with("08") || code.starts_with("53") => Verdict::Outage,
        _ if code.starts_with("22") || code.starts_with("23") => Verdict::Reject,
        _ => Verdict::Retry,
    }
}

/// The verdict on a MySQL/MariaDB error number, where it decides.
#[cfg(feature = "mysql")]
fn mysql_verdict(number: u16) -> Option<Verdict> {
    match number {
        // Deadlock, lock wait timeout.
        1213 | 1205 => Some(Verdict::Retry),
        // Too many connections, server shutdown, server gone away, lost
        // connection.
        1040 | 1053 | 2006 | 2013 => Some(Verdict::Outage),
        // Incorrect string value, data truncated, data too long, out of
        // range, incorrect value: the message's data (SQLSTATE HY000 or
        // 01000 for some of them).
        1366 | 1265 | 1406 | 1264 | 1292 => Some(Verdict::Reject),
        _ => None,
    }
}

/// The verdict on a SQLite result code, where it decides.
#[cfg(feature = "sqlite")]
fn sqlite_verdict(error: &sqlx::sqlite::SqliteError) -> Option<Verdict> {
    use sqlx::error::DatabaseError;
    // The extended result code; its low byte is the primary one.
    let code: i64 = error.code()?.parse().ok()?;
    match code & 0xff {
        // BUSY, LOCKED.
        5 | 6 => Some(Verdict::Retry),
        // NOMEM, IOERR, FULL, CANTOPEN.
        7 | 10 | 13 | 14 => Some(Verdict::Outage),
        // CONSTRAINT (those `kind` leaves out), MISMATCH, TOOBIG, RANGE.
        19 | 20 | 18 | 25 => Some(Verdict::Reject),
        _ => None,
    }
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
