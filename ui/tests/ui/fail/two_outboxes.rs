use idempotent_runtime::outbox::Outbox;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(store: &PgStore, id: String, first: &mut Outbox, second: &mut Outbox) -> Result<(), AppError> {
    let _ = (id, first, second);
    Ok(())
}

fn main() {}
