//! Batch transactions: several messages in one database transaction.
//!
//! One commit per message is the ceiling of every design that gives each
//! message its own transaction: on PostgreSQL the commit's WAL flush, not
//! the statements, sets the pace. A [`Batch`] is one transaction that the
//! `#[idempotent]` calls run inside [`Batch::run`] join, on the store that
//! opened it ([`BatchStore::begin_batch`]), instead of beginning their own:
//!
//! - the claim inserts the marker in the batch's transaction; a fresh claim
//!   then takes a savepoint, so the body's effects can be undone alone;
//! - a body that succeeds leaves marker, result and effects in the batch
//!   (nothing is committed yet); one that fails rolls back to its savepoint
//!   and deletes its marker, so only that message is undone;
//! - a duplicate is answered as usual (its marker was committed by an
//!   earlier transaction, or written earlier in this batch);
//! - [`Batch::commit`] commits everything at once. Only then may the
//!   messages be acknowledged: the results a handler returned inside the
//!   batch become durable with the commit, not before.
//!
//! A claim or a statement that fails inside the batch (deadlock, lost
//! connection), or a handler that panics or is dropped while its claim is
//! open, leaves the transaction unusable: the batch is then *aborted*,
//! [`Batch::commit`] rolls it back and returns [`Error::BatchAborted`], and
//! none of its messages has any effect; run them again, one per
//! transaction. The broker consumers' batch mode
//! ([`ConsumerBuilder::batch`](crate::broker::ConsumerBuilder::batch)) does
//! exactly that, and acknowledges only after the commit.
//!
//! Calls on another store, calls nested in a body that already holds the
//! batch's transaction, and partitioned `PgStore`s keep their own
//! transaction per message inside a batch (correct, just not batched).
//!
//! ```no_run
//! # use idempotent_runtime::{idempotent, PgStore, batch::BatchStore};
//! # use idempotent_runtime::sqlx::PgConnection;
//! # struct Msg { id: String }
//! # #[idempotent(key = "msg.id", store = store)]
//! # async fn handle(store: &PgStore, msg: &Msg, tx: &mut PgConnection) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # async fn example(store: PgStore, messages: Vec<Msg>) -> Result<(), idempotent_runtime::Error> {
//! let batch = store.begin_batch().await?;
//! let mut results = Vec::new();
//! for msg in &messages {
//!     results.push(batch.run(handle(&store, msg)).await);
//! }
//! batch.commit().await?; // now acknowledge the messages whose result is Ok
//! # Ok(()) }
//! ```

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::Error;

tokio::task_local! {
    /// The batch whose [`Batch::run`] is polling the current task.
    static CURRENT: Arc<Shared>;
}

/// The savepoint a fresh claim takes inside a batch (the same statements on
/// PostgreSQL, MySQL/MariaDB and SQLite).
pub(crate) const SAVEPOINT: &str = "SAVEPOINT idempotent_batch";
/// Undoes the body of a failed message inside a batch.
pub(crate) const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idempotent_batch";

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the claims of a batch share: its transaction, lent to one claim at
/// a time.
pub(crate) struct Shared {
    namespace: &'static str,
    tx: Mutex<Option<Box<dyn Any + Send>>>,
    aborted: AtomicBool,
    fresh: AtomicUsize,
    /// Run after a successful commit (outbox wakers, user callbacks).
    after_commit: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("namespace", &self.namespace)
            .field("aborted", &self.aborted.load(Ordering::Relaxed))
            .field("fresh", &self.fresh.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Borrows the batch's transaction, if it is one of `DB` and no other
    /// claim holds it.
    pub(crate) fn take<DB: sqlx::Database>(&self) -> Option<sqlx::Transaction<'static, DB>> {
        let mut slot = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let boxed = slot.take()?;
        match boxed.downcast::<sqlx::Transaction<'static, DB>>() {
            Ok(tx) => Some(*tx),
            Err(other) => {
                *slot = Some(other);
                None
            }
        }
    }

    /// Gives the transaction back after a claim, its body or its undo.
    pub(crate) fn give_back<DB: sqlx::Database>(&self, tx: sqlx::Transaction<'static, DB>) {
        *self.tx.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::new(tx));
    }

    /// Gives the transaction back after `error`, which left it unusable:
    /// the batch is aborted.
    pub(crate) fn fail<DB: sqlx::Database>(&self, tx: sqlx::Transaction<'static, DB>, error: sqlx::Error) -> Error {
        self.abort();
        self.give_back(tx);
        error.into()
    }

    pub(crate) fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }

    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Counts a fresh claim joined to the batch.
    pub(crate) fn joined(&self) {
        self.fresh.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs `f` once the batch has committed.
    pub(crate) fn after_commit(&self, f: Box<dyn FnOnce() + Send>) {
        self.after_commit.lock().unwrap_or_else(PoisonError::into_inner).push(f);
    }
}

/// The batch a claim on the store of `namespace` joins: the one whose
/// [`Batch::run`] is polling this task, if it was opened on that store and
/// is still usable.
pub(crate) fn current(namespace: &'static str) -> Option<Arc<Shared>> {
    CURRENT
        .try_with(|shared| (shared.namespace == namespace && !shared.is_aborted()).then(|| Arc::clone(shared)))
        .ok()
        .flatten()
}

/// A fresh claim's hold on the batch: dropped while armed (a panic, a
/// cancelled handler), it aborts the batch, since the claim's savepoint
/// could not be undone.
pub(crate) struct Joined {
    pub(crate) shared: Arc<Shared>,
    /// Deletes the claim's marker after `ROLLBACK TO SAVEPOINT` (the marker
    /// was inserted before the savepoint).
    pub(crate) undo: Arc<str>,
    armed: bool,
}

impl Joined {
    pub(crate) fn new(shared: Arc<Shared>, undo: Arc<str>) -> Self {
        shared.joined();
        Joined {
            shared,
            undo,
            armed: true,
        }
    }

    /// The claim ended (completed or undone): dropping no longer aborts.
    pub(crate) fn disarm(mut self) -> Arc<Shared> {
        self.armed = false;
        Arc::clone(&self.shared)
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        if self.armed {
            self.shared.abort();
        }
    }
}

/// One database transaction shared by the `#[idempotent]` calls run in it:
/// see the [module](self).
#[must_use = "a batch does nothing until `commit`; dropping it rolls back"]
pub struct Batch {
    shared: Arc<Shared>,
    finish: fn(Box<dyn Any + Send>, bool) -> BoxFuture<Result<(), sqlx::Error>>,
    _writer: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shared.fmt(f)
    }
}

/// Commits (`true`) or rolls back a boxed transaction of `DB`.
fn finish<DB: sqlx::Database>(tx: Box<dyn Any + Send>, commit: bool) -> BoxFuture<Result<(), sqlx::Error>> {
    Box::pin(async move {
        match tx.downcast::<sqlx::Transaction<'static, DB>>() {
            Ok(tx) if commit => tx.commit().await,
            Ok(tx) => tx.rollback().await,
            Err(_) => Err(sqlx::Error::Protocol("the batch's transaction has another type".into())),
        }
    })
}

impl Batch {
    /// A batch on `tx`, joined by the claims of stores of `namespace`
    /// (a store's [`Store::namespace`](crate::store::Store::namespace)).
    pub(crate) fn new<DB: sqlx::Database>(
        namespace: &'static str,
        tx: sqlx::Transaction<'static, DB>,
        writer: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Batch {
        Batch {
            shared: Arc::new(Shared {
                namespace,
                tx: Mutex::new(Some(Box::new(tx))),
                aborted: AtomicBool::new(false),
                fresh: AtomicUsize::new(0),
                after_commit: Mutex::new(Vec::new()),
            }),
            finish: finish::<DB>,
            _writer: writer,
        }
    }

    /// Runs `fut` (a handler call) with its claims on this batch's store
    /// joining the batch. Run one call at a time: a second call running
    /// while the first holds the transaction gets a transaction of its own.
    pub async fn run<F: Future>(&self, fut: F) -> F::Output {
        CURRENT.scope(Arc::clone(&self.shared), fut).await
    }

    /// Whether the batch can no longer commit (a statement failed in it, or
    /// a handler was dropped with its claim open): [`commit`](Self::commit)
    /// will roll it back. Stop adding messages to it.
    pub fn is_aborted(&self) -> bool {
        self.shared.is_aborted()
    }

    /// How many fresh claims joined the batch (messages whose body ran in
    /// it, including those undone after a failure).
    pub fn fresh_claims(&self) -> usize {
        self.shared.fresh.load(Ordering::Relaxed)
    }

    /// Runs `f` after a successful [`commit`](Self::commit) (not after a
    /// rollback).
    pub fn after_commit(&self, f: impl FnOnce() + Send + 'static) {
        self.shared.after_commit(Box::new(f));
    }

    /// Commits every claim, result and effect of the batch. Fails with
    /// [`Error::BatchAborted`] (after rolling back) when the batch was
    /// aborted, or with the commit's error: then nothing of the batch
    /// happened.
    pub async fn commit(self) -> Result<(), Error> {
        let tx = self.shared.tx.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(tx) = tx else {
            // A claim still holds it (its guard outlived the handler call)
            // or it was dropped with a guard: the transaction is gone.
            return Err(Error::BatchAborted);
        };
        if self.shared.is_aborted() {
            if let Err(error) = (self.finish)(tx, false).await {
                tracing::debug!(target: "idempotent", %error, "rollback of an aborted batch failed");
            }
            return Err(Error::BatchAborted);
        }
        (self.finish)(tx, true).await?;
        let callbacks = std::mem::take(&mut *self.shared.after_commit.lock().unwrap_or_else(PoisonError::into_inner));
        for callback in callbacks {
            callback();
        }
        Ok(())
    }

    /// Rolls the whole batch back.
    pub async fn rollback(self) {
        let tx = self.shared.tx.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(tx) = tx
            && let Err(error) = (self.finish)(tx, false).await
        {
            tracing::debug!(target: "idempotent", %error, "rollback of a batch failed");
        }
    }
}

/// A store whose claims can share one transaction: see the [module](self).
/// `PgStore`, `MySqlStore` and `SqliteStore` are.
pub trait BatchStore: Send + Sync {
    /// Begins a batch: one transaction on this store's database, at the
    /// isolation its claims use (SQLite: the write lock, for the whole
    /// batch).
    fn begin_batch(&self) -> impl Future<Output = Result<Batch, Error>> + Send;
}

impl<S: BatchStore + ?Sized> BatchStore for &S {
    fn begin_batch(&self) -> impl Future<Output = Result<Batch, Error>> + Send {
        (**self).begin_batch()
    }
}

impl<S: BatchStore + ?Sized> BatchStore for Arc<S> {
    fn begin_batch(&self) -> impl Future<Output = Result<Batch, Error>> + Send {
        (**self).begin_batch()
    }
}
