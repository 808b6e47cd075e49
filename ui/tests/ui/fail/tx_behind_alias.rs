//! A transaction parameter behind a type alias is not recognised by its
//! name: without `tx = ..` it would stay a parameter, and a caller passing
//! its own transaction would run the effect outside the marker's.
use idempotent_runtime::sqlx::{self, Postgres};
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

type Tx<'a> = sqlx::Transaction<'a, Postgres>;

#[idempotent(key = "id", store = store)]
async fn handle(store: &PgStore, id: i64, tx: &mut Tx<'_>) -> Result<(), AppError> {
    sqlx::query("DELETE FROM carts WHERE id = $1").bind(id).execute(&mut **tx).await?;
    Ok(())
}

fn main() {}
