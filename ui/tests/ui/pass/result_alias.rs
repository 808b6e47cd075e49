#![deny(warnings)]

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct MyError(#[from] idempotent_runtime::Error);

type Result<T> = std::result::Result<T, MyError>;

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String) -> Result<()> {
    let _ = id;
    Ok(())
}

#[idempotent(key = "id", store = store)]
async fn length(store: &MemoryStore, id: String) -> Result<usize> {
    Ok(id.len())
}

async fn usage() -> Result<usize> {
    let store = MemoryStore::new();
    handle(&store, "a".into()).await?;
    length(&store, "a".into()).await
}

fn main() {
    let _ = usage;
}
