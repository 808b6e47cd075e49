#![deny(warnings)]

use idempotent_runtime::sqlx::{self, Postgres, Transaction};
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "order_id", store = store)]
async fn ship(store: &PgStore, order_id: i64, tx: &mut Transaction<'_, Postgres>) -> Result<(), AppError> {
    sqlx::query("UPDATE orders SET shipped = true WHERE id = $1")
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(key = "order_id", store = store)]
async fn ship_full_path(
    store: &PgStore,
    order_id: i64,
    tx: &mut idempotent_runtime::sqlx::Transaction<'static, idempotent_runtime::sqlx::Postgres>,
) -> Result<(), AppError> {
    sqlx::query("UPDATE orders SET shipped = true WHERE id = $1")
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn usage(store: PgStore) -> Result<(), AppError> {
    ship(&store, 1).await?;
    ship_full_path(&store, 1).await
}

fn main() {
    let _ = usage;
}
