//! How a handler call tells the broker adapter that its `#[idempotent]`
//! store failed: a task-local flag that the expansion sets (through
//! `__private`) and the adapter reads after the call, so that a database or
//! Redis outage is retried without spending the message's attempts,
//! whatever error type the handler returns.

use std::cell::Cell;
use std::future::Future;

tokio::task_local! {
    static STORE_FAILED: Cell<bool>;
}

/// Runs `call`, telling whether a store failure was noted during it.
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams")),
    allow(dead_code)
)]
pub(crate) async fn watch<F: Future>(call: F) -> (F::Output, bool) {
    STORE_FAILED
        .scope(Cell::new(false), async move {
            let output = call.await;
            let failed = STORE_FAILED.try_with(Cell::get).unwrap_or(false);
            (output, failed)
        })
        .await
}

/// Notes that the store failed in the current call; nothing outside
/// [`watch`].
pub(crate) fn store_failed() {
    let _ = STORE_FAILED.try_with(|failed| failed.set(true));
}
