#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[derive(serde::Serialize)]
struct Payment {
    id: String,
    order_id: String,
    amount: i64,
}

#[idempotent(
    key = "payment.id",
    store = store,
    scope = "payments",
    ttl = "12h",
    fingerprint = "(&payment.order_id, payment.amount)",
    lease = "45s"
)]
async fn pay(store: &MemoryStore, payment: &Payment) -> Result<(), AppError> {
    let _ = payment;
    Ok(())
}

#[idempotent(key = payment.id, store = store, fingerprint = payment, ttl = "30s")]
async fn refund(store: &MemoryStore, payment: &Payment) -> Result<(), AppError> {
    let _ = payment;
    Ok(())
}

#[idempotent(key = "payment.id", store = store, ttl = "250ms", scope = "audit")]
async fn audit(store: &MemoryStore, payment: Payment) -> Result<(), AppError> {
    let _ = payment;
    Ok(())
}

async fn usage() -> Result<(), AppError> {
    let store = MemoryStore::new();
    let payment = Payment {
        id: "p".into(),
        order_id: "o".into(),
        amount: 1,
    };
    pay(&store, &payment).await?;
    refund(&store, &payment).await?;
    audit(&store, payment).await
}

fn main() {
    let _ = usage;
}
