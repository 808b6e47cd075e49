use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Payment {
    id: String,
    amount: i64,
}

#[idempotent(key = "payment.id", store = store, fingerprint = "payment")]
async fn handle(store: &MemoryStore, payment: &Payment) -> Result<(), AppError> {
    let _ = payment.amount;
    Ok(())
}

fn main() {}
