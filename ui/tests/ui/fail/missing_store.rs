use idempotent_runtime::idempotent;

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

#[idempotent(key = "id")]
async fn handle(id: String) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

fn main() {}
