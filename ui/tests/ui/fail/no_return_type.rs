use idempotent_runtime::{MemoryStore, idempotent};

#[idempotent(key = "id", store = store)]
async fn handle(store: &MemoryStore, id: String) {
    let _ = (store, id);
}

fn main() {}
