//! What `#[idempotent]` expansions name, by absolute path
//! (`::idempotent_runtime::__private::..`): re-exports only. The logic is in
//! the crate's `call` module. Not public API: anything here may change in
//! any release.

pub use tracing::{Instrument, Span};

pub use crate::call::{
    APooledConnection, ATransaction, AnOutbox, AnyStore, Caller, Codec, FingerprintSource, HandlerError,
    NotATransaction, ProbeFallback, StoredResult, TxProbe, claim, fingerprint, finish, key, logged_key, request, span,
};
#[cfg(feature = "sqlx")]
pub use crate::call::{
    AnyOutboxStore, AnyTransactionalStore, Binder, FromOutbox, Stager, bind_outbox, bind_transaction, binder,
    finish_staged, stager,
};
#[cfg(feature = "sqlx")]
pub use crate::outbox::Outbox;
pub use crate::scope::{Instance, Site, default_scope, handler_path};
pub use crate::store::Claim;
