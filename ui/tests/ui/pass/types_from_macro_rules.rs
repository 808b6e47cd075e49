#![deny(warnings)]

// Handlers written by a `macro_rules!`: the parameter types arrive as
// fragments (`$conn:ty`), wrapped in invisible groups; the transaction
// parameter must still be recognised (and taken out of the signature), or
// a caller would pass a connection of its own and lose the atomicity.

use idempotent_runtime::sqlx;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

macro_rules! handlers {
    ($conn:ty, $whole:ty) => {
        #[idempotent(key = "order_id", store = store, scope = "orders.ship")]
        async fn ship(store: &PgStore, order_id: i64, tx: &mut $conn) -> Result<(), AppError> {
            sqlx::query("UPDATE orders SET shipped = true WHERE id = $1")
                .bind(order_id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }

        #[idempotent(key = "order_id", store = store, scope = "orders.bill")]
        async fn bill(store: &PgStore, order_id: i64, tx: $whole) -> Result<(), AppError> {
            sqlx::query("UPDATE orders SET billed = true WHERE id = $1")
                .bind(order_id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }
    };
}

handlers!(sqlx::PgConnection, &mut sqlx::PgConnection);

async fn usage(store: PgStore) -> Result<(), AppError> {
    ship(&store, 1).await?;
    bill(&store, 1).await
}

fn main() {
    let _ = usage;
}
