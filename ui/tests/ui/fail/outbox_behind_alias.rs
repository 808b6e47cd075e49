//! An outbox under another name is not recognised by its name: without
//! `outbox = ..` it would stay a parameter, and the messages staged on the
//! caller's outbox would never be sent.
use idempotent_runtime::outbox::{Outbox as Events, Outgoing};
use idempotent_runtime::sqlx::PgConnection;
use idempotent_runtime::{PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id", store = store)]
async fn handle(store: &PgStore, id: String, tx: &mut PgConnection, events: &mut Events) -> Result<(), AppError> {
    let _ = tx;
    events.publish(Outgoing::new("payment.charged", id.into_bytes()));
    Ok(())
}

fn main() {}
