//! A connection type re-exported under another name.
use idempotent_runtime::sqlx;
use idempotent_runtime::{PgStore, idempotent};

mod db {
    pub use idempotent_runtime::sqlx::PgConnection as Conn;
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "id", store = store)]
async fn handle(store: &PgStore, id: i64, conn: &mut db::Conn) -> Result<(), AppError> {
    sqlx::query("DELETE FROM carts WHERE id = $1").bind(id).execute(&mut *conn).await?;
    Ok(())
}

fn main() {}
