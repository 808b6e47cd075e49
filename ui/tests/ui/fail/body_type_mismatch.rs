use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String) -> Result<usize, AppError> {
    if id.is_empty() {
        return Ok("empty");
    }
    Ok(id.len())
}

fn main() {}
