use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store, tx = "conn")]
async fn handle(store: &PgStore, id: String, conn: &PgConnection) -> Result<(), AppError> {
    let _ = (id, conn);
    Ok(())
}

fn main() {}
