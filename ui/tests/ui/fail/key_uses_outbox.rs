use idempotent_runtime::outbox::Outbox;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "outbox.len()", store = store)]
async fn handle(store: &PgStore, outbox: &mut Outbox) -> Result<(), AppError> {
    let _ = outbox;
    Ok(())
}

fn main() {}
