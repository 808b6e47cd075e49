#![deny(warnings)]

use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] idempotent_runtime::sqlx::Error),
}

struct PaymentMessage {
    message_id: String,
    order_id: String,
    amount: i64,
}

struct PaymentConsumer {
    store: PgStore,
}

impl PaymentConsumer {
    #[idempotent(key = "msg.message_id", store = self.store)]
    async fn process_payment(&self, msg: &PaymentMessage, tx: &mut PgConnection) -> Result<(), AppError> {
        idempotent_runtime::sqlx::query("INSERT INTO payments (order_id, amount) VALUES ($1, $2)")
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

async fn usage(store: PgStore) -> Result<(), AppError> {
    let consumer = PaymentConsumer { store };
    let msg = PaymentMessage {
        message_id: "m-1".into(),
        order_id: "o-1".into(),
        amount: 10,
    };
    consumer.process_payment(&msg).await
}

fn main() {
    let _ = usage;
}
