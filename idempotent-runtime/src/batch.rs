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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};

use crate::Error;
use crate::store::sql::{Expiring, SqlBackend};
use crate::store::tx::Tx;

tokio::task_local! {
    /// The batch member (one handler call of [`Batch::run_all`]) this task
    /// is polling.
    static MEMBER: Member;
}

/// The savepoint a fresh claim takes inside a batch (the same statements on
/// PostgreSQL, MySQL/MariaDB and SQLite).
pub(crate) const SAVEPOINT: &str = "SAVEPOINT idempotent_batch";
/// Undoes the body of a failed message inside a batch.
pub(crate) const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idempotent_batch";

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What [`Finish`] does with a batch's transaction.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Commits a transaction that holds claims or offsets, after the
    /// completion proof ([`crate::store::sql::commit_claims`]).
    CommitClaims,
    /// Commits a transaction that holds nothing fresh (its claims were all
    /// duplicates).
    Commit,
    RollBack,
}

/// Ends the boxed transaction of a batch (the completed members' markers,
/// for their expiry, with a commit of claims).
type Finish = fn(Box<dyn Any + Send>, Ending, Vec<Expiring>) -> BoxFuture<Result<(), Error>>;

/// A claim waiting in a batch for the one statement that claims them all.
///
/// Only `PgStore` has such a statement (its fields are read there); the
/// other stores' batches never gather.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) struct BulkRequest {
    pub(crate) scope: String,
    pub(crate) key: String,
    pub(crate) ttl_millis: i64,
    pub(crate) fingerprint: Option<String>,
    pub(crate) needs_read: bool,
}

/// What the batch's one claim statement found for a request (made by
/// `PgStore`'s statement only).
#[derive(Debug)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) enum BulkOutcome {
    /// Claimed: the body runs in the batch once it has the transaction.
    Fresh,
    /// A live marker (its fingerprint and result, when read).
    Done {
        fingerprint: Option<String>,
        result: Option<String>,
    },
}

/// A store's statement claiming several keys in the batch's transaction:
/// takes the boxed transaction and gives it back with one outcome per
/// request, in order.
pub(crate) type BulkClaim = Arc<
    dyn Fn(
            Box<dyn Any + Send>,
            Vec<BulkRequest>,
        ) -> BoxFuture<(Box<dyn Any + Send>, Result<Vec<BulkOutcome>, sqlx::Error>)>
        + Send
        + Sync,
>;

/// The answer a gathered claim gets (read by `gather`, for `PgStore`).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) enum Gathered {
    Fresh(FreshTicket),
    Done {
        fingerprint: Option<String>,
        result: Option<String>,
    },
    /// Claim alone, once the fresh claims of the statement have ended (the
    /// same key appeared twice in it).
    Alone,
    Failed(Error),
}

#[derive(Default)]
struct Gather {
    /// Claims are gathered (until every running member waits in one).
    open: bool,
    /// Members still running.
    live: usize,
    waiting: Vec<(BulkRequest, oneshot::Sender<Gathered>)>,
}

/// What the claims of a batch share: its transaction, lent to one member
/// at a time (the turn).
pub(crate) struct Shared {
    namespace: &'static str,
    tx: Mutex<Option<Box<dyn Any + Send>>>,
    aborted: AtomicBool,
    fresh: AtomicUsize,
    /// Something the commit must prove it still holds was written: a fresh
    /// claim, a Kafka consumer's offsets.
    holds: AtomicBool,
    /// The completed members' markers: their expiry counts from the commit.
    expiring: Mutex<Vec<Expiring>>,
    /// Run after a successful commit (outbox wakers, user callbacks).
    after_commit: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    /// Who may use the transaction: one permit.
    turn: Arc<Semaphore>,
    /// The member holding the turn (0: none).
    holder: AtomicU64,
    gather: Mutex<Gather>,
    /// A member registered a claim or ended.
    changed: Notify,
    /// Fresh claims of the statement whose body has not ended.
    outstanding: AtomicUsize,
    settled: Notify,
    /// Whether a fresh claim takes a savepoint for its body
    /// ([`Batch::set_savepoints`]).
    savepoints: AtomicBool,
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
    fn take_any(&self) -> Option<Box<dyn Any + Send>> {
        self.tx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    fn put_any(&self, tx: Box<dyn Any + Send>) {
        *self.tx.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    }

    /// Borrows the batch's transaction, if it is one of `DB` and nobody
    /// holds it.
    pub(crate) fn take<DB: SqlBackend>(&self) -> Option<Tx<DB>> {
        let boxed = self.take_any()?;
        match boxed.downcast::<Tx<DB>>() {
            Ok(tx) => Some(*tx),
            Err(other) => {
                self.put_any(other);
                None
            }
        }
    }

    /// Gives the transaction back after a claim, its body or its undo.
    pub(crate) fn give_back<DB: SqlBackend>(&self, tx: Tx<DB>) {
        self.put_any(Box::new(tx));
    }

    /// Gives the transaction back after `error`, which left it unusable:
    /// the batch is aborted.
    pub(crate) fn fail<DB: SqlBackend>(&self, tx: Tx<DB>, error: sqlx::Error) -> Error {
        self.abort();
        self.give_back(tx);
        error.into()
    }

    pub(crate) fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        // Wake whoever waits on the others.
        self.settled.notify_waiters();
        self.changed.notify_one();
    }

    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Whether fresh claims take a savepoint for their body.
    pub(crate) fn savepoints(&self) -> bool {
        self.savepoints.load(Ordering::Relaxed)
    }

    /// A completed member's marker, whose expiry the commit sets again when
    /// the batch took long ([`crate::store::sql::commit_claims`]).
    pub(crate) fn expiring(&self, marker: Expiring) {
        self.expiring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(marker);
    }

    /// Runs `f` once the batch has committed.
    pub(crate) fn after_commit(&self, f: Box<dyn FnOnce() + Send>) {
        self.after_commit.lock().unwrap_or_else(PoisonError::into_inner).push(f);
    }

    /// Every running member waits in a claim: the gathered claims, for the
    /// one statement (gathering ends).
    fn take_gathered(&self) -> Option<Vec<(BulkRequest, oneshot::Sender<Gathered>)>> {
        let mut gather = self.gather.lock().unwrap_or_else(PoisonError::into_inner);
        if !gather.open || gather.waiting.len() < gather.live || gather.waiting.is_empty() {
            return None;
        }
        gather.open = false;
        Some(std::mem::take(&mut gather.waiting))
    }

    fn member_ended(&self) {
        let mut gather = self.gather.lock().unwrap_or_else(PoisonError::into_inner);
        gather.live = gather.live.saturating_sub(1);
    }

    /// Waits until the fresh claims of the statement have ended (or the
    /// batch is aborted).
    #[cfg(feature = "postgres")]
    async fn settle(&self) {
        loop {
            let settled = self.settled.notified();
            if self.outstanding.load(Ordering::Acquire) == 0 || self.is_aborted() {
                return;
            }
            settled.await;
        }
    }
}

/// One handler call of a batch: its batch and its id (ids start at 1).
#[derive(Clone)]
struct Member {
    shared: Arc<Shared>,
    id: u64,
}

fn next_member_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Runs `f` once the batch this task is a member of has committed (never,
/// if it rolls back: its messages then run again alone), or at once
/// outside any batch. See [`crate::store::when_committed`].
pub(crate) fn when_committed<F: FnOnce() + Send + 'static>(f: F) {
    match MEMBER.try_with(|member| Arc::clone(&member.shared)) {
        Ok(shared) => shared.after_commit(Box::new(f)),
        Err(_) => f(),
    }
}

/// Whether this task is a member of a batch opened on the store of
/// `namespace` (the one check a claim outside any batch makes).
#[inline]
pub(crate) fn in_batch(namespace: &'static str) -> bool {
    MEMBER.try_with(|m| m.shared.namespace == namespace).unwrap_or(false)
}

/// This task's batch, when it was opened on the store of `namespace`.
fn member(namespace: &'static str) -> Option<Member> {
    MEMBER
        .try_with(|m| (m.shared.namespace == namespace).then(|| m.clone()))
        .ok()
        .flatten()
}

/// The turn: the batch's transaction, held by one member.
pub(crate) struct Turn {
    shared: Arc<Shared>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.shared.holder.store(0, Ordering::Release);
    }
}

/// Takes the turn for this task's member: `Ok(None)` outside a batch of
/// that store, or when this member already holds it (a call nested in a
/// body): the claim then keeps a transaction of its own.
/// [`Error::BatchAborted`] once the batch is aborted: nothing more joins
/// it, and a claim of its store fails (its messages run again alone).
pub(crate) async fn turn(namespace: &'static str) -> Result<Option<(Arc<Shared>, Turn)>, Error> {
    let Some(member) = member(namespace) else {
        return Ok(None);
    };
    let shared = member.shared;
    if shared.holder.load(Ordering::Acquire) == member.id {
        return Ok(None);
    }
    if shared.is_aborted() {
        return Err(Error::BatchAborted);
    }
    let Ok(permit) = Arc::clone(&shared.turn).acquire_owned().await else {
        return Err(Error::BatchAborted);
    };
    if shared.is_aborted() {
        return Err(Error::BatchAborted);
    }
    shared.holder.store(member.id, Ordering::Release);
    let turn = Turn {
        shared: Arc::clone(&shared),
        _permit: permit,
    };
    Ok(Some((shared, turn)))
}

/// Gathers this claim for the batch's one claim statement, when the batch
/// (of this store) is gathering; `None` otherwise.
#[cfg(feature = "postgres")]
pub(crate) async fn gather(namespace: &'static str, req: &crate::store::Request<'_>) -> Option<Gathered> {
    let member = member(namespace)?;
    let shared = member.shared;
    if shared.is_aborted() {
        return Some(Gathered::Failed(Error::BatchAborted));
    }
    let (reply, answer) = oneshot::channel();
    {
        let mut gather = shared.gather.lock().unwrap_or_else(PoisonError::into_inner);
        if !gather.open {
            return None;
        }
        gather.waiting.push((
            BulkRequest {
                scope: req.scope().to_owned(),
                key: req.key().to_owned(),
                ttl_millis: req.ttl_millis(),
                fingerprint: req.fingerprint().map(|f| f.as_str().to_owned()),
                needs_read: req.needs_read(),
            },
            reply,
        ));
    }
    shared.changed.notify_one();
    match answer.await {
        Ok(Gathered::Alone) => {
            shared.settle().await;
            Some(Gathered::Alone)
        }
        Ok(gathered) => Some(gathered),
        Err(_) => Some(Gathered::Failed(Error::BatchAborted)),
    }
}

/// Claims told to claim alone, answered when dropped (after the others).
struct Defer(Vec<(BulkRequest, oneshot::Sender<Gathered>)>);

impl Drop for Defer {
    fn drop(&mut self) {
        for (_, reply) in self.0.drain(..) {
            let _ = reply.send(Gathered::Alone);
        }
    }
}

/// A fresh claim of the batch's statement: its marker is in the batch, so
/// its body must run there. Dropped before the body ended (the handler
/// panicked or was cancelled), it aborts the batch.
pub(crate) struct FreshTicket {
    shared: Arc<Shared>,
    armed: bool,
}

impl FreshTicket {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.outstanding.fetch_add(1, Ordering::AcqRel);
        FreshTicket {
            shared: Arc::clone(shared),
            armed: true,
        }
    }

    /// The body ended (completed or undone).
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for FreshTicket {
    fn drop(&mut self) {
        if self.armed {
            self.shared.abort();
        }
        self.shared.outstanding.fetch_sub(1, Ordering::AcqRel);
        self.shared.settled.notify_waiters();
    }
}

/// A fresh claim's hold on the batch: the turn, and (for a claim of the
/// batch's statement) its ticket. Dropped while armed (a panic, a
/// cancelled handler), it aborts the batch, since the claim's savepoint
/// could not be undone.
pub(crate) struct Joined {
    pub(crate) shared: Arc<Shared>,
    /// Deletes the claim's marker after `ROLLBACK TO SAVEPOINT` (the marker
    /// was inserted before the savepoint).
    pub(crate) undo: Arc<str>,
    armed: bool,
    turn: Option<Turn>,
    ticket: Option<FreshTicket>,
}

impl Joined {
    pub(crate) fn new(shared: Arc<Shared>, undo: Arc<str>, turn: Turn, ticket: Option<FreshTicket>) -> Self {
        shared.fresh.fetch_add(1, Ordering::Relaxed);
        shared.holds.store(true, Ordering::Relaxed);
        Joined {
            shared,
            undo,
            armed: true,
            turn: Some(turn),
            ticket,
        }
    }

    /// The claim ended (completed or undone): dropping no longer aborts.
    /// Call after giving the transaction back: the turn passes on.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
        if let Some(ticket) = self.ticket.take() {
            ticket.disarm();
        }
        self.turn = None;
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
    finish: Finish,
    bulk: Option<BulkClaim>,
    _writer: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shared.fmt(f)
    }
}

/// Ends a boxed transaction of `DB` as `ending` says: a commit of claims
/// after the completion proof, a durable commit ([`SqlBackend::commit`]),
/// or a rollback.
fn finish<DB: SqlBackend>(
    tx: Box<dyn Any + Send>,
    ending: Ending,
    expiring: Vec<Expiring>,
) -> BoxFuture<Result<(), Error>> {
    Box::pin(async move {
        match tx.downcast::<Tx<DB>>() {
            Ok(tx) => match ending {
                Ending::CommitClaims => crate::store::sql::commit_claims(*tx, expiring).await,
                Ending::Commit => tx.commit().await,
                Ending::RollBack => Ok(tx.rollback().await?),
            },
            Err(_) => Err(sqlx::Error::Protocol("the batch's transaction has another type".into()).into()),
        }
    })
}

impl Batch {
    /// A batch on `tx`, joined by the claims of stores of `namespace`
    /// (a store's [`Store::namespace`](crate::store::Store::namespace));
    /// `bulk` claims the gathered keys in one statement (claims are made
    /// one by one without it).
    pub(crate) fn new<DB: SqlBackend>(
        namespace: &'static str,
        tx: Tx<DB>,
        writer: Option<OwnedSemaphorePermit>,
        bulk: Option<BulkClaim>,
    ) -> Batch {
        Batch {
            shared: Arc::new(Shared {
                namespace,
                tx: Mutex::new(Some(Box::new(tx))),
                aborted: AtomicBool::new(false),
                fresh: AtomicUsize::new(0),
                holds: AtomicBool::new(false),
                expiring: Mutex::new(Vec::new()),
                after_commit: Mutex::new(Vec::new()),
                turn: Arc::new(Semaphore::new(1)),
                holder: AtomicU64::new(0),
                gather: Mutex::new(Gather::default()),
                changed: Notify::new(),
                outstanding: AtomicUsize::new(0),
                settled: Notify::new(),
                savepoints: AtomicBool::new(true),
            }),
            finish: finish::<DB>,
            bulk,
            _writer: writer,
        }
    }

    /// Runs `fut` (a handler call) with its claims on this batch's store
    /// joining the batch: [`run_all`](Self::run_all) of one call.
    pub async fn run<F: Future>(&self, fut: F) -> F::Output {
        self.drive(1, self.member(fut)).await
    }

    /// Runs the handler calls `calls` together in this batch and returns
    /// their outputs, in order. Their claims on the batch's store are
    /// gathered while they start, then made in one statement (on
    /// PostgreSQL; one by one on MySQL and SQLite), keys in sorted order so
    /// that concurrent batches cannot deadlock on each other's markers; the
    /// bodies then run one at a time on the transaction, each under its
    /// savepoint; what a call awaits outside the database overlaps with the
    /// others. A key that appears twice is answered, after its first run, as
    /// a duplicate.
    pub async fn run_all<F: Future>(&self, calls: Vec<F>) -> Vec<F::Output> {
        let live = calls.len();
        let members = futures_util::future::join_all(calls.into_iter().map(|call| self.member(call)));
        self.drive(live, members).await
    }

    /// `call` as a member of the batch: its claims find the batch, and its
    /// end is counted (the others may then all be waiting in a claim).
    async fn member<F: Future>(&self, call: F) -> F::Output {
        let member = Member {
            shared: Arc::clone(&self.shared),
            id: next_member_id(),
        };
        let output = MEMBER.scope(member, call).await;
        self.shared.member_ended();
        self.shared.changed.notify_one();
        output
    }

    /// Polls `calls` (`live` members) to their end, making the gathered
    /// claims' statement whenever every running member waits in a claim.
    async fn drive<F: Future>(&self, live: usize, calls: F) -> F::Output {
        let shared = &self.shared;
        {
            let mut gather = shared.gather.lock().unwrap_or_else(PoisonError::into_inner);
            gather.open = self.bulk.is_some() && !shared.is_aborted();
            gather.live = live;
            gather.waiting.clear();
        }
        tokio::pin!(calls);
        let output = loop {
            if let Some(gathered) = shared.take_gathered() {
                self.claim_gathered(gathered).await;
                continue;
            }
            let changed = shared.changed.notified();
            tokio::select! {
                output = &mut calls => break output,
                _ = changed => {}
            }
        };
        let mut gather = shared.gather.lock().unwrap_or_else(PoisonError::into_inner);
        gather.open = false;
        gather.live = 0;
        output
    }

    /// The one statement for the gathered claims; answers each.
    async fn claim_gathered(&self, gathered: Vec<(BulkRequest, oneshot::Sender<Gathered>)>) {
        let shared = &self.shared;
        // A key twice: the later ones claim alone, after the first's body.
        let mut seen = std::collections::HashSet::new();
        let (bulk, alone): (Vec<_>, Vec<_>) = gathered
            .into_iter()
            .partition(|(req, _)| seen.insert((req.scope.clone(), req.key.clone())));
        // Answered last: they wait for the fresh claims' tickets, which the
        // statement's answers create.
        let _alone = Defer(alone);
        let Some(claim) = self.bulk.as_ref() else {
            for (_, reply) in bulk {
                let _ = reply.send(Gathered::Alone);
            }
            return;
        };
        let tx = match shared.take_any() {
            Some(tx) if !shared.is_aborted() => tx,
            taken => {
                if let Some(tx) = taken {
                    shared.put_any(tx);
                }
                for (_, reply) in bulk {
                    let _ = reply.send(Gathered::Failed(Error::BatchAborted));
                }
                return;
            }
        };
        let requests: Vec<BulkRequest> = bulk.iter().map(|(req, _)| req.clone()).collect();
        let (tx, outcomes) = claim(tx, requests).await;
        shared.put_any(tx);
        match outcomes {
            Ok(outcomes) if outcomes.len() == bulk.len() => {
                for ((_, reply), outcome) in bulk.into_iter().zip(outcomes) {
                    let answer = match outcome {
                        BulkOutcome::Fresh => Gathered::Fresh(FreshTicket::new(shared)),
                        BulkOutcome::Done { fingerprint, result } => Gathered::Done { fingerprint, result },
                    };
                    // A member gone meanwhile drops its ticket: abort.
                    let _ = reply.send(answer);
                }
            }
            outcome => {
                shared.abort();
                let error = match outcome {
                    Err(error) => error.to_string(),
                    Ok(_) => "the batch claim statement answered the wrong number of claims".to_owned(),
                };
                tracing::debug!(target: "idempotent", %error, "the batch's claim statement failed: batch aborted");
                for (_, reply) in bulk {
                    let _ = reply.send(Gathered::Failed(Error::BatchAborted));
                }
            }
        }
    }

    /// Borrows the batch's transaction, once every member gave it back,
    /// for a statement of the consumer's own (a Kafka consumer's offsets);
    /// `None` when it is not one of `DB` or a claim still holds it.
    #[cfg(feature = "kafka")]
    pub(crate) fn take_transaction<DB: SqlBackend>(&self) -> Option<Tx<DB>> {
        self.shared.holds.store(true, Ordering::Relaxed);
        self.shared.take::<DB>()
    }

    /// Gives the transaction back after [`take_transaction`](Self::take_transaction).
    #[cfg(feature = "kafka")]
    pub(crate) fn give_back_transaction<DB: SqlBackend>(&self, tx: Tx<DB>) {
        self.shared.give_back(tx);
    }

    /// Gives the transaction back after `error`, which left it unusable:
    /// the batch is aborted.
    #[cfg(feature = "kafka")]
    pub(crate) fn fail_transaction<DB: SqlBackend>(&self, tx: Tx<DB>, error: sqlx::Error) -> Error {
        self.shared.fail(tx, error)
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

    /// Whether each fresh claim's body runs under a savepoint of its own
    /// (default `true`): a body that fails is then undone alone. Without
    /// (`false`), a message costs one statement less, and a body that fails
    /// aborts the batch ([`commit`](Self::commit) rolls everything back and
    /// returns [`Error::BatchAborted`]: run the messages again, one per
    /// transaction). Set it before the first call joins.
    pub fn set_savepoints(&self, savepoints: bool) {
        self.shared.savepoints.store(savepoints, Ordering::Relaxed);
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
        let Some(tx) = self.shared.take_any() else {
            // A claim still holds it (its guard outlived the handler call)
            // or it was dropped with a guard: the transaction is gone.
            return Err(Error::BatchAborted);
        };
        if self.shared.is_aborted() {
            if let Err(error) = (self.finish)(tx, Ending::RollBack, Vec::new()).await {
                tracing::debug!(target: "idempotent", %error, "rollback of an aborted batch failed");
            }
            return Err(Error::BatchAborted);
        }
        // The completion proof when the batch holds claims or offsets
        // (PostgreSQL's proof needs something written to recognise the
        // transaction; a batch of duplicates commits nothing of its own).
        let ending = if self.shared.holds.load(Ordering::Relaxed) {
            Ending::CommitClaims
        } else {
            Ending::Commit
        };
        let expiring = std::mem::take(&mut *self.shared.expiring.lock().unwrap_or_else(PoisonError::into_inner));
        match (self.finish)(tx, ending, expiring).await {
            Ok(()) => {}
            // A member returned `Ok` over a statement that failed, or the
            // server rolled the batch's transaction back under a member
            // (an InnoDB deadlock victim): its `COMMIT` would have
            // committed nothing, or only what ran after in autocommit.
            Err(Error::TransactionAborted) => {
                tracing::debug!(target: "idempotent", "a statement failed in the batch: batch rolled back");
                return Err(Error::BatchAborted);
            }
            Err(error) => return Err(error),
        }
        let callbacks = std::mem::take(&mut *self.shared.after_commit.lock().unwrap_or_else(PoisonError::into_inner));
        for callback in callbacks {
            callback();
        }
        Ok(())
    }

    /// Rolls the whole batch back.
    pub async fn rollback(self) {
        if let Some(tx) = self.shared.take_any()
            && let Err(error) = (self.finish)(tx, Ending::RollBack, Vec::new()).await
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
