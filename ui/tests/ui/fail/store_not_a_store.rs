use idempotent_runtime::idempotent;
use idempotent_runtime::sqlx::PgPool;

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = pool)]
async fn handle(pool: &PgPool, id: String) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

fn main() {}
