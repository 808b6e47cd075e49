#![deny(warnings)]

use std::sync::Arc;

use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{MemoryStore, PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] idempotent_runtime::sqlx::Error),
}

struct Msg {
    id: String,
}

struct Consumer {
    pg: PgStore,
    memory: MemoryStore,
}

impl Consumer {
    #[idempotent(key = "msg.id", store = self.pg)]
    async fn in_transaction(&self, msg: &Msg, tx: &mut PgConnection) -> Result<(), AppError> {
        idempotent_runtime::sqlx::query("SELECT 1").execute(&mut *tx).await?;
        let _ = msg;
        Ok(())
    }

    #[idempotent(key = "msg.id", store = self.memory)]
    async fn with_lease(&self, msg: Msg) -> Result<(), AppError> {
        let _ = msg;
        Ok(())
    }
}

fn assert_send<T: Send>(_: T) {}

async fn usage(consumer: Arc<Consumer>) {
    let msg = Msg { id: "a".into() };
    assert_send(consumer.in_transaction(&msg));
    assert_send(consumer.with_lease(Msg { id: "b".into() }));
    let spawned = tokio::spawn(async move {
        consumer.in_transaction(&msg).await?;
        consumer.with_lease(msg).await
    });
    let _ = spawned.await;
}

fn main() {
    let _ = usage;
}
