use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "tx", store = store)]
async fn handle(store: &PgStore, id: String, tx: &mut PgConnection) -> Result<(), AppError> {
    let _ = (id, tx);
    Ok(())
}

fn main() {}
