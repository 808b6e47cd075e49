#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Receipt {
    payment_id: String,
    total_cents: i64,
}

#[idempotent(key = "order_id", store = store)]
async fn charge(store: &MemoryStore, order_id: String, cents: i64) -> Result<Receipt, AppError> {
    Ok(Receipt {
        payment_id: format!("pay-{order_id}"),
        total_cents: cents,
    })
}

#[idempotent(key = "order_id", store = store)]
async fn lines(store: &MemoryStore, order_id: String) -> Result<Vec<(String, i64)>, AppError> {
    Ok(vec![(order_id, 1)])
}

async fn usage() -> Result<i64, AppError> {
    let store = MemoryStore::new();
    let receipt = charge(&store, "o-1".into(), 100).await?;
    let _ = receipt.payment_id;
    let _ = lines(&store, "o-1".into()).await?;
    Ok(receipt.total_cents)
}

fn main() {
    let _ = usage;
}
