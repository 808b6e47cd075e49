//! With a transaction parameter too, the store's one missing capability is
//! reported once.
use idempotent_runtime::outbox::Outbox;
use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{RedisStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Service {
    store: RedisStore,
}

impl Service {
    #[idempotent(key = "id", store = self.store)]
    async fn handle(&self, id: String, tx: &mut PgConnection, outbox: &mut Outbox) -> Result<(), AppError> {
        let _ = (id, tx, outbox);
        Ok(())
    }
}

fn main() {}
