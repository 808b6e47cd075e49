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
/// `key` is an expression over the handler's parameters, written as a
/// string (`key = "msg.message_id"`) or bare (`key = msg.message_id`);
/// `fingerprint` likewise. rustc reports a mistake inside a string
/// (`"msg.mesage_id"`) on the whole string and without its "a field with a
/// similar name exists" help, which would replace the whole string with the
/// field's name and not compile; written bare, the key gets rustc's help
/// on the token it fixes.
///
/// Arguments: `key` (required), `store` (required), `scope`, `ttl`,
/// `fingerprint`, `lease`, `tx`, `outbox`, `crate`. See the `idempotent-runtime`
/// documentation for the full contract.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into()).into()
}
