use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Msg {
    message_id: String,
}

#[idempotent(key = msg.mesage_id, store = store)]
async fn handle(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = (store, &msg.message_id);
    Ok(())
}

fn main() {}
