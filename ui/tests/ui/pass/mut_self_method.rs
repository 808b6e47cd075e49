#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Counter {
    store: MemoryStore,
    processed: u64,
}

impl Counter {
    #[idempotent(key = "id", store = self.store.clone())]
    async fn count(&mut self, id: u64) -> Result<u64, AppError> {
        self.processed += 1;
        Ok(self.processed + id)
    }
}

async fn usage() -> Result<u64, AppError> {
    let mut counter = Counter {
        store: MemoryStore::new(),
        processed: 0,
    };
    counter.count(7).await
}

fn main() {
    let _ = usage;
}
