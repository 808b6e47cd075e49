//! The claim a request runs under, lent to its handler: [`IdempotentTx`],
//! the extractor that gives an axum handler the store's transaction, so the
//! handler's writes commit together with the kept response.

use std::sync::Arc;

use tokio::sync::Mutex;

/// The claim of the request being run, in the request's extensions: the
/// layer puts it there, [`IdempotentTx`] borrows it, and the layer takes it
/// back to complete it once the handler answered.
pub(crate) struct GuardCell<G>(pub(crate) Arc<Mutex<Option<G>>>);

impl<G> Clone for GuardCell<G> {
    fn clone(&self) -> Self {
        GuardCell(Arc::clone(&self.0))
    }
}

impl<G> GuardCell<G> {
    pub(crate) fn new(guard: G) -> Self {
        GuardCell(Arc::new(Mutex::new(Some(guard))))
    }

    /// Takes the claim back; `None` while a handler (or a task it spawned)
    /// still borrows it.
    pub(crate) fn take(&self) -> Option<G> {
        self.0.try_lock().ok().and_then(|mut guard| guard.take())
    }
}

#[cfg(feature = "sqlx")]
pub use transactional::IdempotentTx;

#[cfg(feature = "sqlx")]
mod transactional {
    use std::ops::{Deref, DerefMut};

    use ::axum::body::Body;
    use ::axum::extract::FromRequestParts;
    use ::axum::http::Response;
    use ::axum::http::request::Parts;
    use ::axum::response::IntoResponse;
    use tokio::sync::OwnedMappedMutexGuard;

    use super::GuardCell;
    use crate::http::problem::Kind;
    use crate::store::{Store, TransactionGuard, TransactionalStore};

    /// The database transaction of the request's claim, for an axum handler
    /// behind an [`IdempotencyLayer`](crate::http::IdempotencyLayer) on the
    /// transactional store `S` (`PgStore`, `SqliteStore`, `MySqlStore`, or a
    /// reference or `Arc` to one): the handler's writes through it commit in
    /// the transaction that inserted the key's marker, together with the
    /// kept response; an answer that is not kept (5xx, [`NotKept`]), an
    /// error or a dropped request rolls them back with the claim.
    ///
    /// It dereferences to `sqlx::Transaction<'static, DB>`: run statements
    /// on `&mut **tx` (the connection), as with any sqlx transaction.
    ///
    /// ```no_run
    /// use idempotent_runtime::SqliteStore;
    /// use idempotent_runtime::http::IdempotentTx;
    /// use idempotent_runtime::sqlx;
    ///
    /// async fn charge(mut tx: IdempotentTx<SqliteStore>) -> Result<&'static str, String> {
    ///     sqlx::query("INSERT INTO charges (amount) VALUES (42)")
    ///         .execute(&mut **tx)
    ///         .await
    ///         .map_err(|e| e.to_string())?;
    ///     Ok("charged")
    /// }
    /// ```
    ///
    /// Extracting it on a route without the layer, or on a request that
    /// runs without a claim (an optional key that was not sent, a safe
    /// method), is refused with `500 Internal Server Error` and a problem
    /// document that says so; so is extracting it twice in one request.
    /// Keep it only while the handler runs: a transaction still borrowed
    /// when the handler answers (moved into a spawned task) cannot be
    /// committed, and the request fails with 500.
    ///
    /// [`NotKept`]: crate::http::NotKept
    pub struct IdempotentTx<S: TransactionalStore> {
        tx: OwnedMappedMutexGuard<Option<S::Guard>, sqlx::Transaction<'static, S::Database>>,
    }

    impl<S: TransactionalStore> Deref for IdempotentTx<S> {
        type Target = sqlx::Transaction<'static, S::Database>;

        fn deref(&self) -> &Self::Target {
            &self.tx
        }
    }

    impl<S: TransactionalStore> DerefMut for IdempotentTx<S> {
        fn deref_mut(&mut self) -> &mut Self::Target {
            &mut self.tx
        }
    }

    impl<S: TransactionalStore> std::fmt::Debug for IdempotentTx<S> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("IdempotentTx").finish_non_exhaustive()
        }
    }

    impl<S, State> FromRequestParts<State> for IdempotentTx<S>
    where
        S: TransactionalStore + 'static,
        <S as Store>::Guard: 'static,
        State: Send + Sync,
    {
        type Rejection = Response<Body>;

        async fn from_request_parts(parts: &mut Parts, _state: &State) -> Result<Self, Self::Rejection> {
            let refused = |detail: &str| Kind::TransactionBorrowed.response(detail, None).into_response();
            let Some(cell) = parts.extensions.get::<GuardCell<<S as Store>::Guard>>() else {
                return Err(refused(
                    "IdempotentTx needs the route behind an IdempotencyLayer on the same store type, and a request \
                     that carries an Idempotency-Key",
                ));
            };
            let Ok(held) = std::sync::Arc::clone(&cell.0).try_lock_owned() else {
                return Err(refused("IdempotentTx is extracted once per request"));
            };
            match tokio::sync::OwnedMutexGuard::try_map(held, |guard| guard.as_mut().map(|guard| guard.transaction())) {
                Ok(tx) => Ok(IdempotentTx { tx }),
                Err(_) => Err(refused("the request's claim has already ended")),
            }
        }
    }
}
