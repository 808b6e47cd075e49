use idempotent_runtime::sqlx::SqliteConnection;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(store: &PgStore, id: String, tx: &mut SqliteConnection) -> Result<(), AppError> {
    let _ = (id, tx);
    Ok(())
}

fn main() {}
