#![deny(warnings)]

// The runtime reached under another name, as a renamed or re-exported
// dependency would be.
extern crate idempotent_runtime as idem_rt;

mod platform {
    pub mod idempotency {
        pub use idem_rt::*;
    }
}

use platform::idempotency::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idem_rt::Error);

#[idempotent(key = "id", store = store, crate = "idem_rt")]
async fn renamed(store: &MemoryStore, id: u32) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

#[idempotent(key = "id", store = store, crate = "crate::platform::idempotency")]
async fn reexported(store: &MemoryStore, id: u32) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

async fn usage() -> Result<(), AppError> {
    let store = MemoryStore::new();
    renamed(&store, 1).await?;
    reexported(&store, 1).await
}

fn main() {
    let _ = usage;
}
