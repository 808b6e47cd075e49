//! What a consumer's handler is: one trait, [`Handler`], implemented for
//! the closures and functions users write, so that the pipeline's bounds
//! say `H: Handler<M, A>` once instead of repeating the shape of a closure
//! returning a future of a `Result` everywhere.

use std::fmt;
use std::future::Future;

use super::DeliveryInfo;

/// A consumer's handler of messages of type `M`: an `async` closure or
/// function taking the decoded message, and optionally the
/// [`DeliveryInfo`] of its delivery, returning `Result<T, E>` (`E:
/// Display`, for the logs and the dead letter's reason), whose future is
/// `Send`.
///
/// It is implemented for
/// - `Fn(M) -> Fut` (what [`Consumer::run`](super::Consumer::run) takes),
///   with `A = (M,)`;
/// - `Fn(M, DeliveryInfo) -> Fut` (what
///   [`Consumer::run_with_info`](super::Consumer::run_with_info) takes),
///   with `A = (M, DeliveryInfo)`;
///
/// where `Fut: Future<Output = Result<T, E>> + Send + 'static`. `A` only
/// tells the two shapes apart (as in axum's `Handler<T, S>`): users never
/// name it.
///
/// ```
/// # use idempotent_runtime::broker::{DeliveryInfo, Handler};
/// fn is_handler<M, A, H: Handler<M, A>>(_: H) {}
///
/// async fn pay(amount: u64) -> Result<(), String> {
///     if amount == 0 { Err("nothing to pay".into()) } else { Ok(()) }
/// }
/// is_handler(pay);
/// is_handler(|amount: u64, info: DeliveryInfo| async move {
///     Ok::<u64, String>(amount * u64::from(info.attempt))
/// });
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handler of `{M}` messages",
    label = "not a handler of `{M}` messages",
    note = "a handler is an `async` closure or function taking the message (and, with `run_with_info`, a \
            `DeliveryInfo`) that returns `Result<T, E>` with `E: Display`; it and its future must be `Send`, and \
            it `Sync + 'static`"
)]
pub trait Handler<M, A>: Send + Sync + 'static {
    /// What a successful run returns (ignored by the consumer).
    type Output: Send + 'static;
    /// What a failed run returns: the [`RetryPolicy`](super::RetryPolicy)
    /// judges it, and its text is logged and put in the dead letter.
    type Error: fmt::Display + Send + 'static;
    /// The future of one run.
    type Future: Future<Output = Result<Self::Output, Self::Error>> + Send + 'static;

    /// Runs the handler on `message`, delivered as `info` says.
    fn call(&self, message: M, info: DeliveryInfo) -> Self::Future;
}

/// Implements [`Handler`] for closures taking the message and then the
/// given extra arguments (as axum implements its `Handler` per arity).
macro_rules! impl_handler {
    ($info:ident => ($($arg:ident: $ty:ty),*)) => {
        impl<F, Fut, M, T, E> Handler<M, (M, $($ty,)*)> for F
        where
            F: Fn(M, $($ty),*) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<T, E>> + Send + 'static,
            T: Send + 'static,
            E: fmt::Display + Send + 'static,
        {
            type Output = T;
            type Error = E;
            type Future = Fut;

            #[allow(unused_variables)]
            fn call(&self, message: M, $info: DeliveryInfo) -> Fut {
                self(message, $($arg),*)
            }
        }
    };
}

impl_handler!(info => ());
impl_handler!(info => (info: DeliveryInfo));

#[cfg(all(test, feature = "rabbitmq"))]
mod tests {
    use super::super::{CancellationToken, DeliveryInfo};
    use crate::rabbitmq::RabbitConsumer;

    #[derive(serde::Deserialize)]
    struct Payment {
        id: String,
    }

    async fn pay(payment: Payment) -> Result<(), String> {
        let _ = payment.id;
        Ok(())
    }

    async fn pay_once(payment: &Payment, info: &DeliveryInfo) -> Result<u32, std::io::Error> {
        let _ = &payment.id;
        Ok(info.attempt)
    }

    /// Compiles only: what `run` and `run_with_info` took before there was
    /// a `Handler` trait still goes, closures whose parameter types are
    /// inferred included.
    #[allow(dead_code)]
    async fn the_handlers_users_write_are_accepted() {
        let consumer = || RabbitConsumer::builder("amqp://127.0.0.1", "payments").build();
        if let Ok(consumer) = consumer() {
            let _ = consumer.run(pay, CancellationToken::new()).await;
        }
        if let Ok(consumer) = consumer() {
            let _ = consumer
                .run(|msg| async move { pay(msg).await }, CancellationToken::new())
                .await;
        }
        if let Ok(consumer) = consumer() {
            let _ = consumer
                .run_with_info(
                    |msg, info| async move {
                        let _ = info.redelivered;
                        pay_once(&msg, &info).await
                    },
                    CancellationToken::new(),
                )
                .await;
        }
    }
}
