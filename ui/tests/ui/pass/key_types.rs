#![deny(warnings)]

use idempotent_runtime::uuid::Uuid;
use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

struct Msg {
    message_id: Option<String>,
    sequence: u64,
    event_id: Uuid,
}

#[idempotent(key = "msg.message_id", store = store)]
async fn option_key(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = msg;
    Ok(())
}

#[idempotent(key = "msg.sequence", store = store)]
async fn integer_key(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = msg;
    Ok(())
}

#[idempotent(key = "msg.event_id", store = store)]
async fn uuid_key(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = msg;
    Ok(())
}

#[idempotent(key = "id", store = store)]
async fn integer_parameter(store: &MemoryStore, id: i32) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

#[idempotent(key = msg.message_id.as_deref(), store = store)]
async fn bare_expression_key(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = msg;
    Ok(())
}

#[idempotent(key = "format!(\"{}-{}\", msg.sequence, msg.event_id)", store = store)]
async fn computed_key(store: &MemoryStore, msg: &Msg) -> Result<(), AppError> {
    let _ = msg;
    Ok(())
}

async fn usage() -> Result<(), AppError> {
    let store = MemoryStore::new();
    let msg = Msg {
        message_id: Some("m".into()),
        sequence: 1,
        event_id: Uuid::nil(),
    };
    option_key(&store, &msg).await?;
    integer_key(&store, &msg).await?;
    uuid_key(&store, &msg).await?;
    integer_parameter(&store, 5).await?;
    bare_expression_key(&store, &msg).await?;
    computed_key(&store, &msg).await
}

fn main() {
    let _ = usage;
}
