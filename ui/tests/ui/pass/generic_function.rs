#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};
use idempotent_runtime::store::Store;

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

trait Message {
    fn id(&self) -> &str;
}

struct Order {
    id: String,
}

impl Message for Order {
    fn id(&self) -> &str {
        &self.id
    }
}

#[idempotent(key = "msg.id()", store = store)]
async fn handle<M: Message + Sync, S>(store: &S, msg: &M) -> Result<usize, AppError>
where
    S: Store,
{
    Ok(msg.id().len())
}

async fn usage() -> Result<usize, AppError> {
    handle(&MemoryStore::new(), &Order { id: "o-1".into() }).await
}

fn main() {
    let _ = usage;
}
