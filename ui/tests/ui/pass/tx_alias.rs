#![deny(warnings)]

use idempotent_runtime::sqlx;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// An alias the macro cannot recognise as a transaction by its name.
type Db<'a> = &'a mut sqlx::PgConnection;
type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

#[idempotent(key = "id", store = store, tx = "db")]
async fn with_connection_alias(store: &PgStore, id: i64, db: Db<'_>) -> Result<(), AppError> {
    sqlx::query("DELETE FROM carts WHERE id = $1")
        .bind(id)
        .execute(&mut *db)
        .await?;
    Ok(())
}

#[idempotent(key = "id", store = store, tx = t)]
async fn with_transaction_alias(store: &PgStore, id: i64, t: &mut Tx) -> Result<(), AppError> {
    sqlx::query("DELETE FROM carts WHERE id = $1")
        .bind(id)
        .execute(&mut **t)
        .await?;
    Ok(())
}

async fn usage(store: PgStore) -> Result<(), AppError> {
    with_connection_alias(&store, 1).await?;
    with_transaction_alias(&store, 1).await
}

fn main() {
    let _ = usage;
}
