#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Msg {
    id: String,
}

#[allow(async_fn_in_trait)]
trait Consumer {
    async fn consume(&self, msg: &Msg) -> Result<(), AppError>;
}

struct Notifier {
    store: MemoryStore,
}

impl Consumer for Notifier {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn consume(&self, msg: &Msg) -> Result<(), AppError> {
        let _ = msg;
        Ok(())
    }
}

async fn usage() -> Result<(), AppError> {
    let notifier = Notifier {
        store: MemoryStore::new(),
    };
    notifier.consume(&Msg { id: "a".into() }).await
}

fn main() {
    let _ = usage;
}
