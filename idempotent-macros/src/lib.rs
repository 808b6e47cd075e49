//! The `#[idempotent]` attribute: turns an async message handler into one
//! that runs at most once per key, with its effect and a "processed" marker
//! committed in one transaction.
//!
//! Users depend on `idempotent-runtime`, which re-exports this macro; the
//! expansion calls the runtime by absolute path
//! (`::idempotent_runtime::__private`), or through `crate = "path"`.
//!
//! The pipeline, one module per stage: `args` parses the attribute,
//! `handler` models and checks the function's signature, `expand` writes
//! the code. Every stage collects its errors in a `ctxt::Ctxt` so a user
//! sees all their mistakes, each spanned where it is.

mod args;
mod ctxt;
mod duration;
mod expand;
mod handler;
mod suggest;

use proc_macro::TokenStream;

/// Makes an async message handler idempotent.
///
/// ```text
/// #[idempotent(key = "msg.message_id", store = self.store)]
/// async fn process(&self, msg: &Payment, tx: &mut PgConnection) -> Result<(), AppError> { .. }
/// ```
///
/// Arguments: `key` (required), `store` (required), `scope`, `ttl`,
/// `fingerprint`, `lease`, `tx`, `outbox`, `crate`. See the `idempotent-runtime`
/// documentation for the full contract.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into()).into()
}
