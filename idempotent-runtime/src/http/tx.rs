//! The claim a request runs under, lent to its handler: [`IdempotentTx`],
//! the extractor that gives an axum handler the store's transaction, so the
//! handler's writes commit together with the kept response.

use std::sync::Arc;

use tokio::sync::Mutex;

/// The claim of the request being run, in the request's extensions: the
/// layer puts it there, [`IdempotentTx`] borrows it, and the layer takes it
/// back to complete it once the handler answered.
pub(crate) struct GuardCell<G> {
    pub(crate) guard: Arc<Mutex<Option<G>>>,
    /// The outgoing messages the handler published on its `IdempotentTx`,
    /// staged by the layer in the claim's transaction before the commit.
    #[cfg(feature = "sqlx")]
    pub(crate) staging: Arc<std::sync::Mutex<Staging<G>>>,
}

impl<G> Clone for GuardCell<G> {
    fn clone(&self) -> Self {
        GuardCell {
            guard: Arc::clone(&self.guard),
            #[cfg(feature = "sqlx")]
            staging: Arc::clone(&self.staging),
        }
    }
}

impl<G> GuardCell<G> {
    pub(crate) fn new(guard: G) -> Self {
        GuardCell {
            guard: Arc::new(Mutex::new(Some(guard))),
            #[cfg(feature = "sqlx")]
            staging: Arc::new(std::sync::Mutex::new(Staging {
                outbox: crate::outbox::Outbox::new(),
                stage: None,
            })),
        }
    }

    /// Takes the claim back; `None` while a handler (or a task it spawned)
    /// still borrows it.
    pub(crate) fn take(&self) -> Option<G> {
        self.guard.try_lock().ok().and_then(|mut guard| guard.take())
    }

    /// The messages the handler published, with the function that stages
    /// them on its claim; `None` when it published none.
    #[cfg(feature = "sqlx")]
    pub(crate) fn take_staged(&self) -> Option<(crate::outbox::Outbox, StageFn<G>)> {
        let mut staging = self.staging.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let stage = staging.stage.take()?;
        let outbox = std::mem::take(&mut staging.outbox);
        (!outbox.is_empty()).then_some((outbox, stage))
    }
}

/// Writes a handler's outgoing messages into the store's outbox, in the
/// claim's transaction: `TransactionGuard::stage` for one guard type (a
/// function pointer, so that the layer, generic over any store, can call it
/// for the transactional ones).
#[cfg(feature = "sqlx")]
pub(crate) type StageFn<G> =
    for<'a> fn(
        &'a mut G,
        crate::outbox::Outbox,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), crate::Error>> + Send + 'a>>;

/// What [`IdempotentTx::publish`] gathered for the layer.
#[cfg(feature = "sqlx")]
pub(crate) struct Staging<G> {
    pub(crate) outbox: crate::outbox::Outbox,
    /// Set by the first `publish` (where the store is known to keep an
    /// outbox).
    pub(crate) stage: Option<StageFn<G>>,
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

    use super::{GuardCell, StageFn, Staging};
    use crate::http::problem::Kind;
    use crate::outbox::Outgoing;
    use crate::store::{StagesOutbox, Store, TransactionGuard, TransactionalStore};

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
    /// # Outgoing messages
    ///
    /// On a store with an outbox (`PgStore`, `SqliteStore`, `MySqlStore`,
    /// and a `CachedStore` over one), [`publish`](Self::publish) stages a
    /// message to another service (the [transactional
    /// outbox](crate::outbox)): once the handler answered with a response
    /// that is kept, the layer writes the messages into the outbox table
    /// in this transaction, before the commit. Effect, kept response and
    /// messages commit together or not at all: a `5xx`, a [`NotKept`]
    /// answer, an error or a server that dies leaves no message; a retry
    /// answered with the kept response stages none (the first run's are
    /// committed already). Each message's id is derived from the key's
    /// scope (caller, method, route), the key and its place among the
    /// messages, so it is the same whichever run of the key committed. A
    /// [`Relay`](crate::outbox::Relay) publishes them.
    ///
    /// ```no_run
    /// use idempotent_runtime::PgStore;
    /// use idempotent_runtime::axum::http::StatusCode;
    /// use idempotent_runtime::http::IdempotentTx;
    /// use idempotent_runtime::outbox::Outgoing;
    /// use idempotent_runtime::sqlx;
    ///
    /// async fn pay(mut tx: IdempotentTx<PgStore>, order: String) -> Result<StatusCode, StatusCode> {
    ///     let failed = |_| StatusCode::INTERNAL_SERVER_ERROR;
    ///     sqlx::query("INSERT INTO charges (order_id) VALUES ($1)")
    ///         .bind(&order)
    ///         .execute(&mut **tx)
    ///         .await
    ///         .map_err(failed)?;
    ///     // Written in this transaction once the answer is known to be kept.
    ///     tx.publish(Outgoing::new("payment.charged", order.into_bytes()));
    ///     Ok(StatusCode::CREATED)
    /// }
    /// ```
    ///
    /// A message the outbox refuses (an empty or over-long destination,
    /// ordering key or id) fails the request with `500`
    /// (`urn:idempotent:outgoing-refused`) and nothing is committed.
    ///
    /// [`NotKept`]: crate::http::NotKept
    pub struct IdempotentTx<S: TransactionalStore> {
        tx: OwnedMappedMutexGuard<Option<S::Guard>, sqlx::Transaction<'static, S::Database>>,
        staging: std::sync::Arc<std::sync::Mutex<Staging<S::Guard>>>,
    }

    impl<S: StagesOutbox> IdempotentTx<S> {
        /// Stages `message` to be written into the store's outbox in this
        /// transaction when the handler's answer is kept (see [Outgoing
        /// messages](Self#outgoing-messages)): published once the
        /// transaction commits, never if it rolls back.
        pub fn publish(&mut self, message: Outgoing) {
            let stage: StageFn<S::Guard> = |guard, outbox| Box::pin(TransactionGuard::stage(guard, outbox));
            let mut staging = self.staging.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            staging.stage = Some(stage);
            staging.outbox.publish(message);
        }

        /// How many messages this request has published so far.
        pub fn published(&self) -> usize {
            self.staging
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .outbox
                .len()
        }
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
            let Ok(held) = std::sync::Arc::clone(&cell.guard).try_lock_owned() else {
                return Err(refused("IdempotentTx is extracted once per request"));
            };
            let staging = std::sync::Arc::clone(&cell.staging);
            match tokio::sync::OwnedMutexGuard::try_map(held, |guard| guard.as_mut().map(|guard| guard.transaction())) {
                Ok(tx) => Ok(IdempotentTx { tx, staging }),
                Err(_) => Err(refused("the request's claim has already ended")),
            }
        }
    }
}
