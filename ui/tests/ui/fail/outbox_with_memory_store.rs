//! An outbox's messages are rows written by the marker's transaction: a
//! store that has no transaction cannot take them.
use idempotent_runtime::outbox::{Outbox, Outgoing};
use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String, outbox: &mut Outbox) -> Result<(), AppError> {
    outbox.publish(Outgoing::new("payment.charged", id.into_bytes()));
    Ok(())
}

fn main() {}
