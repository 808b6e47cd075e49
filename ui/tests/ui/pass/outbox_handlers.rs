//! Handlers with an outbox: with and without a transaction parameter, on
//! every SQL store, behind a cache, through a reference, and under another
//! name with `outbox = ..`.
use idempotent_runtime::outbox::{Outbox, Outbox as Events, Outgoing};
use idempotent_runtime::sqlx::{self, MySqlConnection, PgConnection, Sqlite, Transaction};
use idempotent_runtime::store::CachedStore;
use idempotent_runtime::{MySqlStore, PgStore, SqliteStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[derive(serde::Serialize)]
struct Charged<'a> {
    order: &'a str,
}

#[idempotent(key = "id", store = store)]
async fn pg(store: &PgStore, id: String, tx: &mut PgConnection, outbox: &mut Outbox) -> Result<u32, AppError> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    outbox.publish(Outgoing::json("payment.charged", &Charged { order: &id })?.ordered_by(&id));
    Ok(1)
}

#[idempotent(key = "id", store = store)]
async fn only_messages(store: &PgStore, id: String, outbox: &mut Outbox) -> Result<(), AppError> {
    outbox.publish(Outgoing::new("audit", id.into_bytes()));
    Ok(())
}

#[idempotent(key = "id", store = store)]
async fn mysql(store: &MySqlStore, id: String, tx: &mut MySqlConnection, outbox: &mut Outbox) -> Result<(), AppError> {
    let _ = tx;
    outbox.publish(Outgoing::new("audit", id.into_bytes()).message_id("mine"));
    Ok(())
}

#[idempotent(key = "id", store = store, outbox = events)]
async fn sqlite(
    store: &SqliteStore,
    id: String,
    tx: &mut Transaction<'_, Sqlite>,
    events: &mut Events,
) -> Result<(), AppError> {
    let _ = tx;
    events.publish(Outgoing::new("audit", id.into_bytes()).header("k", "v"));
    Ok(())
}

#[idempotent(key = "id", store = store)]
async fn cached(store: &CachedStore<PgStore>, id: String, outbox: &mut Outbox) -> Result<(), AppError> {
    outbox.publish(Outgoing::new("audit", id.into_bytes()));
    Ok(())
}

fn assert_send<T: Send>(_: T) {}

fn usage(store: &PgStore) {
    assert_send(pg(store, String::new()));
    assert_send(only_messages(store, String::new()));
}

fn main() {
    let _ = (usage, mysql, sqlite, cached);
}
