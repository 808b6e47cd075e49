#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

#[idempotent(key = "id", store = store)]
async fn with_store_parameter(store: &MemoryStore, id: String) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

#[idempotent(key = "id", store = *STORE)]
async fn with_static_store(id: &str) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

async fn usage() -> Result<(), AppError> {
    with_store_parameter(&MemoryStore::new(), "a".to_owned()).await?;
    with_static_store("a").await
}

fn main() {
    let _ = usage;
}
