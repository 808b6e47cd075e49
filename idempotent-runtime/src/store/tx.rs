//! The transaction a SQL store holds for a claim, a batch or a relay round:
//! a `sqlx::Transaction` that cannot take a pool connection with it when it
//! is abandoned.
//!
//! A transaction dropped unfinished (its task aborted, a handler future
//! cancelled, a consumer stopped) leaves sqlx to roll it back when its
//! connection goes back to the pool, behind a `ping`. When the drop cut a
//! statement short, that connection can be left mid-exchange and its ping
//! never answers (sqlx issue 4349, seen on MariaDB by the combination
//! checker): the pool's slot is never given back, and once every slot went
//! that way every claim times out on `acquire`. [`Tx`] gives the release a
//! deadline: an abandoned transaction's connection is pinged first, with a
//! time limit; one that does not answer, or answers out of step (sqlx's own
//! ping at the release would then wait forever), is swapped for a fresh
//! connection and dropped (its socket closed, which makes the server roll
//! its transaction back). The fresh connection has not run the pool's
//! `after_connect`, so it is retired ([`SqlBackend::retire`]) before the
//! pool takes it back: its release fails and the pool opens a proper one
//! when it needs it.
//!
//! `BEGIN`, `COMMIT` and `ROLLBACK` run to their end ([`RunToEnd`]): in
//! place, and in a task of their own (in the caller's span) if the caller
//! is dropped first, so cancelling a caller does not cut them short.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use sqlx::{ConnectOptions, Connection, Pool, Transaction};

use crate::Error;
use crate::store::backend::SqlBackend;

/// How long an abandoned transaction's connection may take to answer a
/// ping before it is replaced. A healthy connection answers once the
/// statement it was cut from has finished on the server.
const PING_LIMIT: Duration = Duration::from_secs(5);

/// How long opening the replacement connection may take.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// A store's transaction (see the module documentation). Dereferences to
/// its connection, as `sqlx::Transaction` does; dropping it unfinished
/// releases the connection with a deadline.
pub(crate) struct Tx<DB: SqlBackend> {
    /// `None` only once [`Tx::finish`] took it (which consumes the `Tx`).
    tx: Option<Transaction<'static, DB>>,
    pool: Pool<DB>,
    /// When `BEGIN` was sent: no clock reading of the database in this
    /// transaction (a claim's expiry) is older.
    began: std::time::Instant,
}

impl<DB: SqlBackend> Tx<DB> {
    /// Begins a transaction on `pool` with `begin` (the backend's `BEGIN`
    /// statement), run to its end ([`RunToEnd`]): a caller cancelled
    /// meanwhile leaves a transaction that is dropped between statements,
    /// which sqlx releases cleanly.
    pub(crate) async fn begin(pool: &Pool<DB>, begin: &'static str) -> Result<Self, sqlx::Error> {
        let owned = pool.clone();
        let began = std::time::Instant::now();
        let tx = detached_value(async move { owned.begin_with(begin).await }).await?;
        Ok(Tx {
            tx: Some(tx),
            pool: pool.clone(),
            began,
        })
    }

    /// When `BEGIN` was sent (before any clock reading of the transaction).
    pub(crate) fn began(&self) -> std::time::Instant {
        self.began
    }

    /// The transaction, for a statement that ends it. Cancelling the caller
    /// before the statement ends takes the connection with it: run it to
    /// its end ([`Tx::commit`], [`Tx::rollback`]).
    fn finish(mut self) -> Result<Transaction<'static, DB>, sqlx::Error> {
        self.tx
            .take()
            .ok_or_else(|| sqlx::Error::Protocol("the transaction was already finished".into()))
    }

    /// Drops a transaction known to be between statements (nothing was cut
    /// short): sqlx rolls it back as it releases the connection, with no
    /// ping of ours first.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn release(self) {
        drop(self.finish());
    }

    /// Rolls back, to the end even if the caller is cancelled.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        let tx = self.finish()?;
        detached(tx.rollback()).await
    }

    /// Commits as sqlx does (no check of its own: for the stores' own
    /// maintenance, and for a claim's transaction once the completion proof
    /// ran in it, [`crate::store::sql::commit_claims`]), to the end even if
    /// the caller is cancelled.
    pub(crate) async fn commit_plain(self) -> Result<(), sqlx::Error> {
        let tx = self.finish()?;
        detached(tx.commit()).await
    }

    /// Commits durably ([`SqlBackend::commit`]), to the end even if the
    /// caller is cancelled: the message is acknowledged only after this
    /// returns `Ok`, and a cancelled caller's message is redelivered and
    /// answered from the committed marker.
    pub(crate) async fn commit(self) -> Result<(), Error> {
        let tx = self.finish()?;
        detached(DB::commit(tx)).await
    }
}

/// Runs `work` to its end: [`RunToEnd`] with no value.
fn detached<F, E>(work: F) -> RunToEnd<F>
where
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: From<sqlx::Error> + Send + 'static,
{
    detached_value(work)
}

/// Runs `work` to its end, in the caller's span: [`RunToEnd`].
fn detached_value<F, T, E>(work: F) -> RunToEnd<F>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: From<sqlx::Error> + Send + 'static,
{
    use tracing::Instrument;
    RunToEnd {
        work: Some(Box::pin(work.instrument(tracing::Span::current()))),
    }
}

/// Work that runs to its end even if its caller is dropped: the caller
/// polls it in place (no task, no thread woken on the common path), and
/// dropping it before it finished hands the rest to a task of its own, so
/// that a cancelled caller never cuts a statement short. The work is boxed,
/// so the stores' futures hold only a pointer.
struct RunToEnd<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `None` once it returned its value.
    work: Option<Pin<Box<tracing::instrument::Instrumented<F>>>>,
}

impl<F, T, E> Future for RunToEnd<F>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: From<sqlx::Error> + Send + 'static,
{
    type Output = Result<T, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(work) = this.work.as_mut() else {
            return Poll::Ready(Err(sqlx::Error::Protocol(
                "a transaction's statement was polled after it ended".into(),
            )
            .into()));
        };
        let outcome = std::task::ready!(work.as_mut().poll(cx));
        this.work = None;
        Poll::Ready(outcome)
    }
}

impl<F> Drop for RunToEnd<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        // Without a runtime sqlx cannot run it either: dropped in place.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                // The caller is gone: the outcome has no one to go to (a
                // commit's message is redelivered and answered from the
                // marker, or runs again if it rolled back).
                let _ = work.await;
            });
        }
    }
}

impl<DB: SqlBackend> Tx<DB> {
    /// The `sqlx::Transaction`, as a handler's body receives it.
    pub(crate) fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        // `tx` is `None` only inside `finish`, which consumes `self`.
        match &mut self.tx {
            Some(tx) => tx,
            None => unreachable!("a finished Tx is consumed"),
        }
    }
}

impl<DB: SqlBackend> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        match &self.tx {
            Some(tx) => tx,
            None => unreachable!("a finished Tx is consumed"),
        }
    }
}

impl<DB: SqlBackend> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.transaction()
    }
}

impl<DB: SqlBackend> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("open", &self.tx.is_some())
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> Drop for Tx<DB> {
    fn drop(&mut self) {
        let Some(tx) = self.tx.take() else { return };
        // Without a runtime sqlx cannot release it either: drop in place.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release_abandoned(tx, self.pool.clone()));
        }
    }
}

/// Releases an abandoned transaction's connection to the pool: as sqlx
/// would if it answers a ping within [`PING_LIMIT`], or else (no answer, or
/// an answer out of step, which a ping at the release would meet again)
/// after swapping it for a fresh connection, retired, and closing it.
async fn release_abandoned<DB: SqlBackend>(mut tx: Transaction<'static, DB>, pool: Pool<DB>) {
    let failure = match tokio::time::timeout(PING_LIMIT, tx.ping()).await {
        // In step: dropping `tx` rolls back and releases as usual.
        Ok(Ok(())) => return,
        Ok(Err(error)) => format!("answered a ping out of step ({error})"),
        Err(_elapsed) => format!("did not answer a ping within {PING_LIMIT:?}"),
    };
    let options = pool.connect_options();
    match tokio::time::timeout(CONNECT_LIMIT, options.connect()).await {
        Ok(Ok(mut fresh)) => {
            // `tx` now holds the fresh connection (no transaction open on
            // it: the rollback at its release has nothing to do); the
            // abandoned one is dropped here, closing its socket.
            std::mem::swap(&mut *tx, &mut fresh);
            drop(fresh);
            let _ = tokio::time::timeout(PING_LIMIT, DB::retire(&mut tx)).await;
            tracing::warn!(
                target: "idempotent",
                "an abandoned transaction's connection {failure}: closed, and its pool slot returned"
            );
        }
        Ok(Err(error)) => tracing::warn!(
            target: "idempotent",
            %error,
            "an abandoned transaction's connection {failure}, and no replacement could be opened: the pool may lose it"
        ),
        Err(_elapsed) => tracing::warn!(
            target: "idempotent",
            "an abandoned transaction's connection {failure}, and opening a replacement timed out: the pool may lose it"
        ),
    }
}
