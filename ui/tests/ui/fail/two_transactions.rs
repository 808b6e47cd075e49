use idempotent_runtime::sqlx::{PgConnection, Postgres, Transaction};
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(
    store: &PgStore,
    id: String,
    tx: &mut Transaction<'_, Postgres>,
    conn: &mut PgConnection,
) -> Result<(), AppError> {
    let _ = (store, id, tx, conn);
    Ok(())
}

fn main() {}
