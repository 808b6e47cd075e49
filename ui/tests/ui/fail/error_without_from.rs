use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug)]
enum AppError {
    Invalid,
}

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String) -> Result<(), AppError> {
    if id.is_empty() {
        return Err(AppError::Invalid);
    }
    Ok(())
}

fn main() {}
