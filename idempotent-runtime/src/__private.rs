//! What `#[idempotent]` expansions call, by absolute path. Not public API:
//! anything here may change in any release.

use std::borrow::Cow;

pub use tracing::Instrument;
pub use tracing::Span;

use crate::store::{Claim, Guard, Replay, Request, Store, encode_result};
use crate::{Error, Fingerprint, IdempotencyKey};

/// The key's text, or `MissingKey`.
#[inline]
pub fn key<'k, K: IdempotencyKey + ?Sized>(scope: &str, key: &'k K) -> Result<Cow<'k, str>, Error> {
    crate::key::require(scope, key.key_text())
}

/// The fingerprint of the `fingerprint = ..` expression.
#[inline]
pub fn fingerprint<T: serde::Serialize + ?Sized>(value: &T) -> Result<Option<Fingerprint>, Error> {
    Fingerprint::of(value).map(Some)
}

/// The validated request of one call.
#[inline]
pub fn request<'a>(
    scope: &'a str,
    key: &'a str,
    ttl_ms: u64,
    lease_ms: u64,
    fingerprint: Result<Option<Fingerprint>, Error>,
) -> Result<Request<'a>, Error> {
    Ok(Request::new(scope, key)?
        .ttl(std::time::Duration::from_millis(ttl_ms))
        .lease(std::time::Duration::from_millis(lease_ms))
        .fingerprint(fingerprint?))
}

/// The span a call's events and body run in.
#[inline]
pub fn span(req: &Request<'_>) -> Span {
    tracing::debug_span!(target: "idempotent", "idempotent", scope = req.scope_name(), key = req.key())
}

/// Claims with any store (handlers without a transaction parameter).
#[inline]
pub async fn claim<S: Store + ?Sized>(store: &S, req: &Request<'_>, span: &Span) -> Result<Claim<S::Guard>, Error> {
    let claim = store.claim(req).await;
    log_claim(&claim, span);
    claim
}

/// Claims with a store that runs the body in its transaction.
#[cfg(feature = "sqlx")]
#[inline]
pub async fn claim_transactional<S: crate::store::TransactionalStore + ?Sized>(
    store: &S,
    req: &Request<'_>,
    span: &Span,
) -> Result<Claim<S::Guard>, Error> {
    claim(store, req, span).await
}

/// Borrows the claim's transaction as the handler's parameter type.
#[cfg(feature = "sqlx")]
#[inline]
pub fn bind_transaction<'a, G, P>(guard: &'a mut G) -> P
where
    G: crate::store::TransactionGuard,
    P: crate::store::FromTransaction<'a, G::Database>,
{
    P::from_transaction(guard.transaction())
}

fn log_claim<G>(claim: &Result<Claim<G>, Error>, span: &Span) {
    span.in_scope(|| match claim {
        Ok(Claim::Fresh(_)) => {}
        Ok(Claim::Done(_)) => {
            tracing::info!(target: "idempotent", outcome = "duplicate", "duplicate message skipped")
        }
        Err(error) => tracing::warn!(target: "idempotent", outcome = "failed", %error, "claim failed"),
    });
}

/// A result type a handler can return: stored after the first run and
/// replayed to duplicates.
#[diagnostic::on_unimplemented(
    message = "the result type `{Self}` cannot be stored for replay to duplicates",
    label = "`{Self}` must implement `serde::Serialize` and `serde::de::DeserializeOwned`",
    note = "duplicates answer with the first run's result, so it is stored as JSON: derive `Serialize` and `Deserialize` for it, or return `()`"
)]
pub trait StoredResult: serde::Serialize + serde::de::DeserializeOwned {}
impl<T: serde::Serialize + serde::de::DeserializeOwned> StoredResult for T {}

/// An error type a handler can return.
#[diagnostic::on_unimplemented(
    message = "the handler's error type `{Self}` cannot hold an `idempotent_runtime::Error`",
    label = "`{Self}` must implement `From<idempotent_runtime::Error>`",
    note = "the store can fail (missing key, key reused, database down): add a variant with `#[from] idempotent_runtime::Error`, or return `anyhow::Error`"
)]
pub trait HandlerError: From<Error> {}
impl<E: From<Error>> HandlerError for E {}

/// Converts a store error into the handler's error type.
#[inline]
pub fn error<E: HandlerError>(error: Error) -> E {
    E::from(error)
}

/// Answers a duplicate with the first run's result.
#[inline]
pub fn replay<T: StoredResult, E: HandlerError>(replay: Replay) -> Result<T, E> {
    replay.decode().map_err(E::from)
}

/// Ends a claim with the body's outcome: `Ok` stores the result and commits,
/// `Err` rolls back (or releases the lease).
pub async fn finish<G: Guard, T: StoredResult, E: HandlerError>(
    guard: G,
    outcome: Result<T, E>,
    span: Span,
) -> Result<T, E> {
    match outcome {
        Ok(value) => {
            let stored = match encode_result(&value) {
                Ok(stored) => stored,
                Err(error) => {
                    guard.abort().await;
                    span.in_scope(
                        || tracing::warn!(target: "idempotent", outcome = "failed", %error, "result not stored"),
                    );
                    return Err(E::from(error));
                }
            };
            match guard.complete(stored).await {
                Ok(()) => {
                    span.in_scope(|| tracing::debug!(target: "idempotent", outcome = "processed", "message processed"));
                    Ok(value)
                }
                Err(error) => {
                    span.in_scope(|| tracing::warn!(target: "idempotent", outcome = "failed", %error, "commit failed"));
                    Err(E::from(error))
                }
            }
        }
        Err(error) => {
            guard.abort().await;
            span.in_scope(
                || tracing::debug!(target: "idempotent", outcome = "failed", "handler failed; claim released"),
            );
            Err(error)
        }
    }
}
