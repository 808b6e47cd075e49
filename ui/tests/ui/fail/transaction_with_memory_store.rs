use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String, tx: &mut PgConnection) -> Result<(), AppError> {
    let _ = (id, tx);
    Ok(())
}

fn main() {}
