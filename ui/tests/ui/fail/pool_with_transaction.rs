use idempotent_runtime::idempotent;
use idempotent_runtime::sqlx::{PgConnection, PgPool};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = pool)]
async fn handle(pool: &PgPool, id: String, tx: &mut PgConnection) -> Result<(), AppError> {
    let _ = (id, tx);
    Ok(())
}

fn main() {}
