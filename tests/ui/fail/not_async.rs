use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
}

static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

#[idempotent(key = "id", store = *STORE)]
fn handle(id: String) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

fn main() {}
