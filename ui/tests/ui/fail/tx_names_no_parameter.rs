use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

type Db<'a> = &'a mut idempotent_runtime::sqlx::PgConnection;

#[idempotent(key = "id", store = store, tx = "nope")]
async fn handle(store: &PgStore, id: String, conn: Db<'_>) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
