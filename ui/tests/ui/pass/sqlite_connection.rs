#![deny(warnings)]

use idempotent_runtime::sqlx::{self, SqliteConnection};
use idempotent_runtime::{SqliteStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

struct Msg {
    id: String,
    amount: i64,
}

struct Consumer {
    store: SqliteStore,
}

impl Consumer {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn pay(&self, msg: &Msg, conn: &mut SqliteConnection) -> Result<i64, AppError> {
        sqlx::query("INSERT INTO payments (id, amount) VALUES (?, ?)")
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(msg.amount)
    }
}

async fn usage(store: SqliteStore) -> Result<i64, AppError> {
    Consumer { store }
        .pay(&Msg {
            id: "m".into(),
            amount: 3,
        })
        .await
}

fn main() {
    let _ = usage;
}
