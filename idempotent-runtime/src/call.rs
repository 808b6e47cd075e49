//! What an `#[idempotent]` call does, step by step: the key's text, the
//! fingerprint, the request; the check that the parameters the macro left
//! in the signature are not transactions; registering the scope and
//! claiming the key; logging, counting and tracing the outcome (the
//! `idempotent` span's `idempotency.*` attributes, see [`span`]); storing
//! the result or replaying it; converting the store's errors into the
//! handler's.
//!
//! Expansions reach these items through [`crate::__private`], a list of
//! re-exports; none of them is public API.

use std::borrow::Cow;
use std::future::Future;

use tracing::Span;

use crate::scope::Site;

use crate::fingerprint::Fingerprint;
use crate::signal::Outcome;
use crate::store::{Claim, Guard, Replay, Request, Store};
use crate::{Error, IdempotencyKey};

/// The key's text, or `MissingKey`.
#[inline]
pub fn key<'k, K: IdempotencyKey + ?Sized>(scope: &'static str, key: &'k K) -> Result<Cow<'k, str>, Error> {
    crate::key::require(scope, key.key_text()).inspect_err(|error| note_refused(scope, error))
}

/// A value the `fingerprint = ..` expression can give.
#[diagnostic::on_unimplemented(
    message = "the fingerprint `{Self}` cannot be hashed",
    label = "the `fingerprint = ..` expression must be `serde::Serialize`",
    note = "the fingerprint is the hash of the value's canonical form: fingerprint the message (derive `Serialize` for it) or a tuple of its fields"
)]
pub trait FingerprintSource {
    /// The fingerprint of the value.
    fn fingerprint(&self) -> Result<Option<Fingerprint>, Error>;
}

impl<T: serde::Serialize + ?Sized> FingerprintSource for T {
    #[inline]
    fn fingerprint(&self) -> Result<Option<Fingerprint>, Error> {
        Fingerprint::of(self).map(Some)
    }
}

/// The fingerprint of the `fingerprint = ..` expression.
#[inline]
pub fn fingerprint<T: FingerprintSource + ?Sized>(value: &T) -> Result<Option<Fingerprint>, Error> {
    value.fingerprint()
}

/// The validated request of one call. `unit_result`: the handler's declared
/// result is `()` (known to the macro at compile time), so a duplicate
/// without fingerprint needs no read of the stored marker.
#[inline]
pub fn request<'a>(
    scope: &'static str,
    key: &'a str,
    ttl_ms: u64,
    lease_ms: u64,
    fingerprint: Result<Option<Fingerprint>, Error>,
    unit_result: bool,
) -> Result<Request<'a>, Error> {
    let request = match (Request::new(scope, key), fingerprint) {
        (Ok(request), Ok(fingerprint)) => Ok(request
            .with_ttl(std::time::Duration::from_millis(ttl_ms))
            .with_lease(std::time::Duration::from_millis(lease_ms))
            .with_fingerprint(fingerprint)
            .with_unit_result(unit_result)),
        (Err(error), _) | (_, Err(error)) => Err(error),
    };
    request.inspect_err(|error| note_refused(scope, error))
}

/// Logs and counts a call refused before its span existed (missing or
/// invalid key, fingerprint that cannot be hashed), and tells a broker
/// adapter running it.
#[cold]
fn note_refused(scope: &'static str, error: &Error) {
    let outcome = Outcome::of_error(error);
    Report::message(scope, "").refused(outcome, error);
    crate::signal::outcome(outcome);
}

/// The span a call's events and body run in: `idempotent` (target
/// `idempotent`, debug level), a child of the span the handler was called
/// in (a broker adapter's `process` span). Its fields follow the
/// OpenTelemetry conventions for attributes of one's own:
/// `idempotency.scope`, `idempotency.key`, and once the call is decided
/// `idempotency.outcome` (`processed`, `duplicate`, `failed`, `key_reused`,
/// `in_progress`, `not_processed` or `error`); a call that ends in an error also gets
/// `error.type` and `otel.status_code = "error"`.
#[inline]
pub fn span(req: &Request<'_>) -> Span {
    tracing::debug_span!(
        target: "idempotent",
        "idempotent",
        idempotency.scope = req.scope(),
        idempotency.key = req.key(),
        idempotency.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Records what a call came to on its span and tells a broker adapter
/// running it (which records it on the delivery's span).
fn trace_outcome(span: &Span, outcome: Outcome, error_type: Option<&str>) {
    span.record("idempotency.outcome", outcome.as_str());
    if let Some(error_type) = error_type {
        span.record("error.type", error_type);
        span.record("otel.status_code", "error");
    }
    crate::signal::outcome(outcome);
}

/// [`trace_outcome`] of a call that failed with a store error.
fn trace_error(span: &Span, error: &Error) {
    trace_outcome(span, Outcome::of_error(error), Some(error_type(error)));
}

/// The `error.type` of a store error: its variant, in snake case.
fn error_type(error: &Error) -> &'static str {
    match error {
        Error::MissingKey { .. } => "missing_key",
        Error::InvalidKey { .. } => "invalid_key",
        Error::KeyReused { .. } => "key_reused",
        Error::InProgress { .. } => "in_progress",
        Error::Store(_) => "store",
        Error::ScopeConflict { .. } => "scope_conflict",
        Error::Codec(_) => "codec",
        Error::Config(_) => "config",
        Error::BatchAborted => "batch_aborted",
        Error::TransactionAborted => "transaction_aborted",
        Error::NotProcessed { .. } => "not_processed",
    }
}

/// The type of a `store = ..` expression: any [`Store`].
///
/// One blanket impl marked `do_not_recommend`: a value that is not a store
/// is reported as "not an idempotency store" on the expression, without the
/// list of every store type (which changes as stores are added).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "the `store = ..` expression must give a store",
    note = "use one of `PgStore`, `SqliteStore`, `MySqlStore`, `RedisStore` or `MemoryStore` (or a reference or `Arc` to one)"
)]
pub trait AnyStore: Sync {
    /// The store's [`Store::Guard`].
    type Guard: Guard;

    /// [`Store::claim`].
    fn claim_key(&self, req: &Request<'_>) -> impl Future<Output = Result<Claim<Self::Guard>, Error>> + Send;

    /// [`Store::namespace`].
    fn namespace_of(&self) -> Option<&'static str>;
}

#[diagnostic::do_not_recommend]
impl<S: Store + ?Sized> AnyStore for S {
    type Guard = S::Guard;

    #[inline]
    fn claim_key(&self, req: &Request<'_>) -> impl Future<Output = Result<Claim<Self::Guard>, Error>> + Send {
        self.claim(req)
    }

    #[inline]
    fn namespace_of(&self) -> Option<&'static str> {
        self.namespace()
    }
}

/// Which handler claims: where it is declared, its path and its scope.
#[derive(Clone, Copy)]
pub struct Caller {
    /// The handler's `static` site.
    pub site: &'static Site,
    /// The handler's path (its default scope), computed only when the
    /// scope is registered or refused.
    pub path: fn() -> &'static str,
    /// The scope it claims with.
    pub scope: &'static str,
    /// Which instantiation of the handler claims (with a default scope),
    /// or `Instance::ANY` (an explicit scope: all of them, one handler).
    pub instance: crate::scope::Instance,
}

/// Looks at the type of a handler parameter that the macro did not take for
/// the transaction: [`TxProbe::kind`] is an inherent method for database
/// transactions and connections, and [`ProbeFallback::kind`] for every other
/// type (inherent methods win when both apply). The expansion then requires
/// the kind to be [`NotATransaction`] through local traits whose
/// diagnostics name the parameter.
pub struct TxProbe<T: ?Sized>(std::marker::PhantomData<T>);

impl<T: ?Sized> TxProbe<T> {
    /// A probe of `T`.
    #[inline]
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        TxProbe(std::marker::PhantomData)
    }
}

/// The kind of a parameter that is neither a transaction nor a connection.
pub struct NotATransaction;
/// The kind of a parameter that is a database transaction or connection.
pub struct ATransaction;
/// The kind of a parameter that is a connection taken from a pool.
pub struct APooledConnection;
/// The kind of a parameter that is an [`Outbox`](crate::outbox::Outbox).
pub struct AnOutbox;

/// [`TxProbe::kind`] for every type that is not a transaction.
pub trait ProbeFallback {
    /// Not a transaction.
    #[inline]
    fn kind(&self) -> NotATransaction {
        NotATransaction
    }
}

impl<T: ?Sized> ProbeFallback for TxProbe<T> {}

#[cfg(feature = "sqlx")]
impl<DB: sqlx::Database> TxProbe<sqlx::Transaction<'_, DB>> {
    /// A transaction.
    #[inline]
    pub fn kind(&self) -> ATransaction {
        ATransaction
    }
}

#[cfg(feature = "sqlx")]
impl<DB: sqlx::Database> TxProbe<sqlx::pool::PoolConnection<DB>> {
    /// A pooled connection.
    #[inline]
    pub fn kind(&self) -> APooledConnection {
        APooledConnection
    }
}

#[cfg(feature = "sqlx")]
impl TxProbe<crate::outbox::Outbox> {
    /// An outbox.
    #[inline]
    pub fn kind(&self) -> AnOutbox {
        AnOutbox
    }
}

macro_rules! connection_probe {
    ($feature:literal, $conn:ty) => {
        #[cfg(feature = $feature)]
        impl TxProbe<$conn> {
            /// A connection.
            #[inline]
            pub fn kind(&self) -> ATransaction {
                ATransaction
            }
        }
    };
}
connection_probe!("postgres", sqlx::PgConnection);
connection_probe!("sqlite", sqlx::SqliteConnection);
connection_probe!("mysql", sqlx::MySqlConnection);

/// Claims with any store (handlers without a transaction parameter), after
/// refusing a scope that another handler owns on the same store (see
/// [`crate::scope`]).
#[inline]
pub async fn claim<S: AnyStore + ?Sized>(
    store: &S,
    req: &Request<'_>,
    span: &Span,
    caller: Caller,
) -> Result<Claim<S::Guard>, Error> {
    let claim = match crate::scope::register(
        caller.site,
        caller.instance,
        caller.path,
        caller.scope,
        store.namespace_of(),
    ) {
        Ok(()) => store.claim_key(req).await,
        Err(error) => Err(error),
    };
    let claim = check_only(claim, req).await;
    Report::message(caller.scope, req.key()).claimed(&claim, span);
    claim
}

/// A claim of a call that only checks whether its key is processed (on a
/// broker's last delivery of the message, see [`crate::signal::checking`]):
/// a fresh claim is given up at once, before the body, and the call fails
/// with [`Error::NotProcessed`]; anything else is left as it is (a key
/// already processed replays).
#[inline]
async fn check_only<G: Guard>(claim: Result<Claim<G>, Error>, req: &Request<'_>) -> Result<Claim<G>, Error> {
    match claim {
        Ok(Claim::Fresh(guard)) if crate::signal::check_only() => not_processed(guard, req).await,
        claim => claim,
    }
}

#[cold]
async fn not_processed<G: Guard>(guard: G, req: &Request<'_>) -> Result<Claim<G>, Error> {
    guard.abort().await;
    crate::signal::not_processed();
    Err(Error::NotProcessed {
        scope: req.scope().to_owned(),
        key: crate::error::DisplayKey::new(req.key()),
    })
}

/// The type of the `store = ..` expression of a handler that takes a
/// transaction parameter: any [`TransactionalStore`](crate::store::TransactionalStore)
/// (one blanket impl, like [`AnyStore`]).
#[cfg(feature = "sqlx")]
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot run the handler in a database transaction",
    label = "this handler takes a transaction parameter, so its store must be transactional",
    note = "Redis and in-memory stores cannot join a database transaction: remove the transaction parameter and make the effect idempotent by design, or use `PgStore`, `SqliteStore` or `MySqlStore`"
)]
pub trait AnyTransactionalStore: AnyStore {
    /// The database the transaction runs on.
    type Database: sqlx::Database;

    /// How the store's claims lend their transaction to the handler.
    fn binder(&self) -> Binder<Self::Guard, Self::Database>;
}

#[cfg(feature = "sqlx")]
#[diagnostic::do_not_recommend]
impl<S: crate::store::TransactionalStore + ?Sized> AnyTransactionalStore for S {
    type Database = S::Database;

    #[inline]
    fn binder(&self) -> Binder<Self::Guard, Self::Database> {
        <S::Guard as crate::store::TransactionGuard>::transaction
    }
}

/// How a transactional store's claim lends its transaction to the handler.
#[cfg(feature = "sqlx")]
pub type Binder<G, DB> = for<'a> fn(&'a mut G) -> &'a mut sqlx::Transaction<'static, DB>;

/// The [`Binder`] of `store`'s claims: the one check that the store is
/// transactional (reported once, on the `store = ..` expression), so that
/// neither the claim nor [`bind_transaction`] needs a bound of its own.
#[cfg(feature = "sqlx")]
#[inline]
pub fn binder<S: AnyTransactionalStore + ?Sized>(store: &S) -> Binder<S::Guard, S::Database> {
    store.binder()
}

/// Borrows the claim's transaction as the handler's parameter type.
#[cfg(feature = "sqlx")]
#[inline]
pub fn bind_transaction<'a, G, DB, P>(binder: Binder<G, DB>, guard: &'a mut G) -> P
where
    DB: sqlx::Database,
    P: crate::store::FromTransaction<'a, DB>,
{
    P::from_transaction(binder(guard))
}

/// The type of the `store = ..` expression of a handler that takes an
/// outbox: a transactional store with an outbox table (one blanket impl).
#[cfg(feature = "sqlx")]
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot write outgoing messages in the marker's transaction",
    label = "this handler takes an outbox, so its store must keep an outbox table in the marker's database",
    note = "the outbox's rows commit with the marker and the effect: use `PgStore`, `SqliteStore` or `MySqlStore` (Redis and in-memory stores cannot join a database transaction)"
)]
pub trait AnyOutboxStore: AnyTransactionalStore {
    /// [`TransactionGuard::stage`](crate::store::TransactionGuard::stage)
    /// on this store's guard.
    fn stage(
        guard: &mut Self::Guard,
        outbox: crate::outbox::Outbox,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_;
}

#[cfg(feature = "sqlx")]
#[diagnostic::do_not_recommend]
impl<S: crate::store::StagesOutbox + ?Sized> AnyOutboxStore for S {
    #[inline]
    fn stage(
        guard: &mut Self::Guard,
        outbox: crate::outbox::Outbox,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_ {
        crate::store::TransactionGuard::stage(guard, outbox)
    }
}

/// How a handler with an outbox reaches its store's transaction and outbox
/// without naming the store again (the `store = ..` expression may be a
/// temporary): from [`stager`], whose bound is the only outbox requirement
/// of the expansion, so a store without an outbox is reported once.
#[cfg(feature = "sqlx")]
pub struct Stager<G, DB: sqlx::Database> {
    binder: Binder<G, DB>,
    stage: StageFn<G>,
}

/// [`AnyOutboxStore::stage`] for one guard type (boxed: it runs only when a
/// body staged messages).
#[cfg(feature = "sqlx")]
type StageFn<G> = for<'a> fn(
    &'a mut G,
    crate::outbox::Outbox,
) -> std::pin::Pin<Box<dyn Future<Output = Result<(), Error>> + Send + 'a>>;

#[cfg(feature = "sqlx")]
impl<G, DB: sqlx::Database> Stager<G, DB> {
    /// The [`Binder`] of the store's claims, for a transaction parameter.
    #[inline]
    pub fn binder(&self) -> Binder<G, DB> {
        self.binder
    }
}

/// The [`Stager`] of `store`.
#[cfg(feature = "sqlx")]
#[inline]
pub fn stager<S: AnyOutboxStore + ?Sized>(store: &S) -> Stager<S::Guard, S::Database> {
    Stager {
        binder: store.binder(),
        stage: |guard, outbox| Box::pin(S::stage(guard, outbox)),
    }
}

/// What an outbox parameter can be: `&mut Outbox`.
#[cfg(feature = "sqlx")]
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an outbox parameter",
    label = "#[idempotent] binds this parameter to the call's outbox",
    note = "write it `&mut idempotent_runtime::outbox::Outbox`"
)]
pub trait FromOutbox<'a> {
    /// The parameter.
    fn from_outbox(outbox: &'a mut crate::outbox::Outbox) -> Self;
}

#[cfg(feature = "sqlx")]
impl<'a> FromOutbox<'a> for &'a mut crate::outbox::Outbox {
    #[inline]
    fn from_outbox(outbox: &'a mut crate::outbox::Outbox) -> Self {
        outbox
    }
}

/// Lends the call's outbox to the handler's parameter.
#[cfg(feature = "sqlx")]
#[inline]
pub fn bind_outbox<'a, P: FromOutbox<'a>>(outbox: &'a mut crate::outbox::Outbox) -> P {
    P::from_outbox(outbox)
}

/// [`finish`] for a handler with an outbox: when the body succeeded, its
/// staged messages are written in the marker's transaction first; a failure
/// to write them rolls everything back.
#[cfg(feature = "sqlx")]
#[allow(clippy::too_many_arguments)]
pub async fn finish_staged<G: Guard, DB: sqlx::Database, T, E>(
    stager: Stager<G, DB>,
    mut guard: G,
    outbox: crate::outbox::Outbox,
    codec: Codec<T>,
    outcome: Result<T, E>,
    span: Span,
    scope: &'static str,
    key: &str,
) -> Result<Result<T, E>, Error> {
    let mut staged = 0;
    if outcome.is_ok() && !outbox.is_empty() {
        let messages = outbox.len();
        if let Err(error) = (stager.stage)(&mut guard, outbox).await {
            guard.abort().await;
            note_outage(&error);
            trace_error(&span, &error);
            let label = Outcome::of_error(&error).as_str();
            span.in_scope(|| {
                tracing::warn!(target: "idempotent", scope, key, outcome = label, messages, %error, "outgoing messages not written; rolled back")
            });
            count(Cow::Borrowed(scope), label);
            return Err(error);
        }
        staged = messages;
    }
    let finished = finish(guard, codec, outcome, span, scope, key).await;
    // Counted once the rows are committed (after the batch's commit for a
    // batch member), like the outcomes.
    #[cfg(feature = "metrics")]
    if staged > 0 && matches!(finished, Ok(Ok(_))) {
        crate::store::when_committed(move || {
            metrics::counter!("idempotent_outbox_staged_total", "scope" => scope).increment(staged as u64)
        });
    }
    #[cfg(not(feature = "metrics"))]
    let _ = staged;
    finished
}

/// The key a fresh claim's [`finish`] names in its events (the key's own
/// text borrows from the handler's parameters, which the body then takes).
#[inline]
pub fn logged_key<G>(claim: &Result<Claim<G>, Error>, key: &str) -> Box<str> {
    match claim {
        Ok(Claim::Fresh(_)) => Box::from(key),
        _ => Box::default(),
    }
}

/// A store that is down (or a key another consumer holds) is not the
/// message's fault: tells a broker adapter running this call, so it retries
/// without spending an attempt.
fn note_outage(error: &Error) {
    if matches!(error, Error::Store(_) | Error::InProgress { .. }) {
        crate::signal::store_failed();
    }
}

/// Counts one outcome (`processed`, `duplicate`, `failed`, `key_reused`,
/// `in_progress`, `not_processed`, `error`: the values of the span's
/// `idempotency.outcome`) under a `scope` label:
/// `idempotent_outcomes_total{scope, outcome}` through the `metrics`
/// facade (feature `metrics`; without it, nothing). A handler's scope is a
/// `&'static str`, so its label borrows it rather than copying it.
///
/// Counted once the outcome is final: inside a batch, after the batch's
/// commit (an aborted batch's messages run again alone and are counted
/// then), so the counters never run ahead of what is committed.
#[inline]
fn count(scope: Label, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    crate::store::when_committed(move || {
        metrics::counter!("idempotent_outcomes_total", "scope" => scope, "outcome" => outcome).increment(1)
    });
    #[cfg(not(feature = "metrics"))]
    let _ = (scope, outcome);
}

/// The `scope` label of a counted outcome: a handler's scope, borrowed, or
/// an HTTP route's (see [`Report::request`]).
pub(crate) type Label = Cow<'static, str>;

/// What a claim is about, for the words of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Subject {
    /// A message, claimed by an `#[idempotent]` call.
    Message,
    /// An HTTP request, claimed by the `Idempotency-Key` layer (feature
    /// `axum`).
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    Request,
}

/// Where one claim's outcome is told: its events (with `scope` and `key`,
/// so that an operator at the default level sees which handler or route
/// skipped which key), its span (`idempotency.outcome`, `error.type`), the
/// broker adapter running it, and `idempotent_outcomes_total`. The one
/// place the `#[idempotent]` calls and the HTTP layer report through.
pub(crate) struct Report<'a> {
    scope: &'a str,
    key: &'a str,
    label: Label,
    subject: Subject,
}

impl<'a> Report<'a> {
    /// A message's claim by the handler of `scope`, counted under it.
    #[inline]
    pub(crate) fn message(scope: &'static str, key: &'a str) -> Self {
        Report {
            scope,
            key,
            label: Cow::Borrowed(scope),
            subject: Subject::Message,
        }
    }

    /// An HTTP request's claim in the keys' `scope` (which names the
    /// caller), counted under `label` (the route, without the caller: one
    /// series per route, not per tenant).
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn request(scope: &'a str, key: &'a str, label: String) -> Self {
        Report {
            scope,
            key,
            label: Cow::Owned(label),
            subject: Subject::Request,
        }
    }

    fn count(&self, outcome: Outcome) {
        count(self.label.clone(), outcome.as_str());
    }

    /// How a claim went: a duplicate, or a claim refused by the store. A
    /// fresh claim is told by [`processed`](Self::processed),
    /// [`failed`](Self::failed) or [`error`](Self::error) once it ends.
    pub(crate) fn claimed<G>(&self, claim: &Result<Claim<G>, Error>, span: &Span) {
        let (scope, key) = (self.scope, self.key);
        match claim {
            Ok(Claim::Fresh(_)) => {}
            Ok(Claim::Done(_)) => span.in_scope(|| {
                trace_outcome(span, Outcome::Duplicate, None);
                self.count(Outcome::Duplicate);
                let message = match self.subject {
                    Subject::Message => "duplicate message skipped",
                    Subject::Request => "retry answered with the kept response",
                };
                tracing::info!(target: "idempotent", scope, key, outcome = "duplicate", "{message}")
            }),
            Err(error) => span.in_scope(|| {
                let outcome = Outcome::of_error(error);
                self.count(outcome);
                note_outage(error);
                trace_error(span, error);
                self.log_refused(outcome, error);
            }),
        }
    }

    /// The event of a claim that did not give the body a go, under the
    /// claim's own outcome: a reused key is not a handler that failed, nor
    /// a store that is down.
    #[cold]
    fn log_refused(&self, outcome: Outcome, error: &Error) {
        let (scope, key) = (self.scope, self.key);
        /// One event at `$level`, with the claim's fields and `$message`.
        macro_rules! refused {
            ($level:ident, $message:expr) => {
                tracing::$level!(target: "idempotent", scope, key, outcome = outcome.as_str(), %error, "{}", $message)
            };
        }
        let request = self.subject == Subject::Request;
        match outcome {
            Outcome::KeyReused if request => refused!(warn, "key reused for a different request: refused"),
            Outcome::KeyReused => refused!(warn, "key reused for a different message: refused"),
            Outcome::InProgress if request => refused!(info, "key held by a request in progress: not run"),
            Outcome::InProgress => refused!(info, "key held by another consumer: not run"),
            Outcome::NotProcessed => tracing::info!(
                target: "idempotent",
                scope,
                key,
                outcome = outcome.as_str(),
                "key not processed before (checked only): not run"
            ),
            _ => refused!(warn, "claim failed"),
        }
    }

    /// A call or request refused before its claim (a missing or invalid
    /// key, a fingerprint that cannot be hashed; for a request also an
    /// unknown caller or a body over the limit), under `outcome`.
    #[cold]
    pub(crate) fn refused(&self, outcome: Outcome, error: &dyn std::fmt::Display) {
        let (scope, key) = (self.scope, self.key);
        self.count(outcome);
        match self.subject {
            Subject::Message => {
                tracing::warn!(target: "idempotent", scope, outcome = outcome.as_str(), %error, "call refused before its claim")
            }
            // The client's mistake, answered 4xx: not a warning of ours.
            Subject::Request => {
                tracing::info!(target: "idempotent", scope, key, outcome = outcome.as_str(), %error, "request refused before its claim")
            }
        }
    }

    /// A fresh claim committed: counted now, after the commit (in a batch,
    /// after the batch's).
    pub(crate) fn processed(&self, span: &Span) {
        let (scope, key) = (self.scope, self.key);
        trace_outcome(span, Outcome::Processed, None);
        let message = match self.subject {
            Subject::Message => "message processed",
            Subject::Request => "request processed; answer kept",
        };
        span.in_scope(|| tracing::debug!(target: "idempotent", scope, key, outcome = "processed", "{message}"));
        self.count(Outcome::Processed);
    }

    /// The body failed (`error_type`: OpenTelemetry's `error.type`, the
    /// handler's error type or status) and its claim was rolled back or
    /// released, so a retry runs again.
    pub(crate) fn failed(&self, span: &Span, error_type: &str) {
        let (scope, key) = (self.scope, self.key);
        trace_outcome(span, Outcome::Failed, Some(error_type));
        let message = match self.subject {
            Subject::Message => "handler failed; claim released",
            Subject::Request => "answer not kept (a server error or NotKept); claim released",
        };
        span.in_scope(|| tracing::debug!(target: "idempotent", scope, key, outcome = "failed", "{message}"));
        self.count(Outcome::Failed);
    }

    /// A fresh claim that could not end as the body asked (its result not
    /// stored, its commit failed): `what` says which.
    pub(crate) fn error(&self, span: &Span, error: &Error, what: &str) {
        let (scope, key) = (self.scope, self.key);
        let outcome = Outcome::of_error(error);
        note_outage(error);
        trace_error(span, error);
        span.in_scope(
            || tracing::warn!(target: "idempotent", scope, key, outcome = outcome.as_str(), %error, "{what}"),
        );
        self.count(outcome);
    }
}

/// A result type a handler can return: stored after the first run and
/// replayed to duplicates.
///
/// The expansion names `<T as StoredResult>::codec` once, spanned on the
/// handler's declared `T`, so a type that cannot be stored is reported there
/// and only there; [`finish`] and the replay use the [`Codec`] and need no
/// bound of their own.
#[diagnostic::on_unimplemented(
    message = "the result type `{Self}` cannot be stored for replay to duplicates",
    label = "`{Self}` must implement `serde::Serialize` and `serde::Deserialize`",
    note = "duplicates answer with the first run's result, so it is stored as JSON: derive `Serialize` and `Deserialize` for it, or return `()`"
)]
// No supertraits: rustc then reports `T: StoredResult` (with this
// explanation) rather than the bare serde bound.
pub trait StoredResult: Sized {
    /// How values of this type are stored and replayed.
    fn codec() -> Codec<Self>;
}

// `do_not_recommend`: one error on `T: StoredResult` (this explanation),
// rather than one per missing serde trait.
#[diagnostic::do_not_recommend]
impl<T: serde::Serialize + serde::de::DeserializeOwned> StoredResult for T {
    #[inline]
    fn codec() -> Codec<Self> {
        Codec {
            encode: crate::replay::encode::<Self>,
            decode: Replay::decode::<Self>,
        }
    }
}

/// Stores and replays a handler's `T` (see [`StoredResult::codec`]).
pub struct Codec<T> {
    encode: fn(&T) -> Result<Option<String>, Error>,
    decode: fn(&Replay) -> Result<T, Error>,
}

impl<T> Clone for Codec<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Codec<T> {}

impl<T> Codec<T> {
    /// Answers a duplicate with the first run's result.
    #[inline]
    pub fn replay(&self, replay: &Replay) -> Result<T, Error> {
        (self.decode)(replay)
    }
}

/// An error type a handler can return.
///
/// The expansion names `<E as HandlerError>::from_store` once, spanned on the
/// handler's declared `E`, and converts every store error through it.
#[diagnostic::on_unimplemented(
    message = "the handler's error type `{Self}` cannot hold an `idempotent_runtime::Error`",
    label = "`{Self}` must implement `From<idempotent_runtime::Error>`",
    note = "the store can fail (missing key, key reused, database down): add a variant with `#[from] idempotent_runtime::Error`, or return `anyhow::Error`"
)]
// No supertrait, for the same reason as `StoredResult`.
pub trait HandlerError: Sized {
    /// Converts a store error into the handler's error type.
    fn from_store(error: Error) -> Self;
}

impl<E: From<Error>> HandlerError for E {
    #[inline]
    fn from_store(error: Error) -> Self {
        E::from(error)
    }
}

/// Ends a claim with the body's outcome: `Ok` stores the result and commits,
/// `Err` rolls back (or releases the lease) and is handed back as it is.
/// The outer `Err` is the store's error, for the caller to convert.
pub async fn finish<G: Guard, T, E>(
    guard: G,
    codec: Codec<T>,
    outcome: Result<T, E>,
    span: Span,
    scope: &'static str,
    key: &str,
) -> Result<Result<T, E>, Error> {
    let report = Report::message(scope, key);
    match outcome {
        Ok(value) => {
            let stored = match (codec.encode)(&value) {
                Ok(stored) => stored,
                Err(error) => {
                    guard.abort().await;
                    report.error(&span, &error, "result not stored");
                    return Err(error);
                }
            };
            match guard.complete(stored).await {
                Ok(()) => {
                    report.processed(&span);
                    Ok(Ok(value))
                }
                Err(error) => {
                    // The body succeeded; the store could not commit it.
                    report.error(&span, &error, "commit failed");
                    Err(error)
                }
            }
        }
        Err(error) => {
            guard.abort().await;
            // The handler's own error type names the failure (OpenTelemetry's
            // `error.type` is the error's type name).
            report.failed(&span, std::any::type_name::<E>());
            Ok(Err(error))
        }
    }
}
