use idempotent_runtime::{MemoryStore, idempotent};

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String) -> Option<u64> {
    let _ = (store, id);
    Some(1)
}

fn main() {}
