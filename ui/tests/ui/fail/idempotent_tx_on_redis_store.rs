//! `IdempotentTx` (the HTTP layer's extractor) lends a database
//! transaction: a Redis store has none, and saying so is a compile error.
use idempotent_runtime::RedisStore;
use idempotent_runtime::http::IdempotentTx;

async fn charge(tx: IdempotentTx<RedisStore>) -> &'static str {
    let _ = tx;
    "charged"
}

fn main() {
    let _ = charge;
}
