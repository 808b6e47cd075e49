//! `outbox = ..` names a parameter that is not an outbox.
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store, outbox = events)]
async fn handle(store: &PgStore, id: String, events: &mut Vec<String>) -> Result<(), AppError> {
    events.push(id);
    Ok(())
}

fn main() {}
