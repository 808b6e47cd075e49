use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent]
async fn handle(store: &MemoryStore, id: String) -> Result<(), AppError> {
    let _ = (store, id);
    Ok(())
}

fn main() {}
