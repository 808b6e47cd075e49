use idempotent_runtime::outbox::Outbox;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store, outbox = outbox)]
async fn handle(store: &PgStore, id: String, outbox: &Outbox) -> Result<(), AppError> {
    let _ = (id, outbox);
    Ok(())
}

fn main() {}
