//! The store given by a field path: the missing capability is reported once,
//! on the whole path.
use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Service {
    store: MemoryStore,
}

impl Service {
    #[idempotent(key = "id", store = self.store)]
    async fn handle(&self, id: String, tx: &mut PgConnection) -> Result<(), AppError> {
        let _ = (id, tx);
        Ok(())
    }
}

fn main() {}
