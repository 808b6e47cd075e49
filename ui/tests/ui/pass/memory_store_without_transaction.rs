#![deny(warnings)]

use std::sync::Arc;

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Msg {
    id: String,
    email: String,
}

struct Mailer {
    store: Arc<MemoryStore>,
}

impl Mailer {
    #[idempotent(key = "msg.id", store = self.store, lease = "10s")]
    async fn send_welcome(&self, msg: Msg) -> Result<(), AppError> {
        let _ = msg.email;
        Ok(())
    }
}

async fn usage() -> Result<(), AppError> {
    let mailer = Mailer {
        store: Arc::new(MemoryStore::new()),
    };
    mailer
        .send_welcome(Msg {
            id: "1".into(),
            email: "a@b".into(),
        })
        .await
}

fn main() {
    let _ = usage;
}
