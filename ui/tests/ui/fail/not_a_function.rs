use idempotent_runtime::idempotent;

#[idempotent(key = "id", store = store)]
struct Handler {
    id: String,
}

fn main() {}
