//! A connection written as a fully qualified associated type.
use idempotent_runtime::sqlx::{self, Postgres};
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "id", store = store)]
async fn handle(
    store: &PgStore,
    id: i64,
    conn: &mut <Postgres as sqlx::Database>::Connection,
) -> Result<(), AppError> {
    sqlx::query("DELETE FROM carts WHERE id = $1").bind(id).execute(&mut *conn).await?;
    Ok(())
}

fn main() {}
