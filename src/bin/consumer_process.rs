//! A consumer process for the tests that need more than one process
//! (competing consumers across processes, chaos with SIGKILL). Not an
//! example: tests find it through `CARGO_BIN_EXE_consumer_process`.
//!
//! `consumer_process race <markers_table> <payments_table> <message_id> <start_at_unix_ms>`
//! waits until the given instant, then handles the message once against
//! PostgreSQL and prints `processed` or `duplicate`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection};
use idempotent_runtime::{PgStore, idempotent};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

struct Consumer {
    store: PgStore,
    payments: String,
}

impl Consumer {
    /// Returns the process id of the process that ran the body.
    #[idempotent(key = "message_id", store = self.store)]
    async fn pay(&self, message_id: &str, tx: &mut PgConnection) -> Result<u32, AppError> {
        let insert = format!("INSERT INTO {} (message_id, pid) VALUES ($1, $2)", self.payments);
        sqlx::query(AssertSqlSafe(insert))
            .bind(message_id)
            .bind(i64::from(std::process::id()))
            .execute(&mut *tx)
            .await?;
        Ok(std::process::id())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["race", markers, payments, message_id, start_at] => {
            let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(PG_URL).await?;
            let store = PgStore::builder(pool).table(markers).build()?;
            let consumer = Consumer { store, payments: (*payments).to_owned() };
            let start_at = Duration::from_millis(start_at.parse()?);
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
            tokio::time::sleep(start_at.saturating_sub(now)).await;
            let winner = consumer.pay(message_id).await?;
            println!("{}", if winner == std::process::id() { "processed" } else { "duplicate" });
            Ok(())
        }
        _ => Err("usage: consumer_process race <markers> <payments> <message_id> <start_at_unix_ms>".into()),
    }
}
