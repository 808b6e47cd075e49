use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Receipt {
    total: i64,
}

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String) -> Result<Receipt, AppError> {
    let _ = id;
    Ok(Receipt { total: 1 })
}

fn main() {}
