use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct OrderId {
    region: u16,
    number: u64,
}

struct Msg {
    order: OrderId,
}

#[idempotent(key = "msg.order", store = store)]
async fn handle(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = (msg.order.region, msg.order.number);
    Ok(())
}

fn main() {}
