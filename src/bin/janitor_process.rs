//! A service replica that runs only a janitor, for the fleet janitor tests
//! (tests/fleet_janitor.rs). Not an example: tests find it through
//! `CARGO_BIN_EXE_janitor_process`.
//!
//! `janitor_process <pg|mysql> <markers_table> <log_file> <every_ms> <hold_ms> <run_ms>`
//! runs `Janitor::spawn(store, every)` on the machine's PostgreSQL or
//! MariaDB for `run_ms` (or until killed), then shuts the janitor down and
//! prints `done`. Each purge round holds for `hold_ms` before purging, so
//! rounds last long enough to overlap if the lock let them; the process
//! appends one line per event to `log_file`: `<pid> <event> <unix_nanos>`,
//! with the events `skip` (the lock was held elsewhere), `start` and `end`
//! (a purge round, under the lock).

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_runtime::store::{JanitorLock, PurgeExpired};
use idempotent_runtime::{Error, Janitor, MySqlStore, PgStore};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// A store whose janitor rounds are logged and last at least `hold`.
struct Logged<S> {
    inner: S,
    log: String,
    hold: Duration,
}

impl<S> Logged<S> {
    fn record(&self, event: &str) {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        // One write per line on an O_APPEND file: lines of several processes
        // do not interleave.
        let line = format!("{} {event} {nanos}\n", std::process::id());
        let written = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.log)
            .and_then(|mut file| file.write_all(line.as_bytes()));
        if let Err(error) = written {
            eprintln!("janitor_process: cannot log to {}: {error}", self.log);
        }
    }
}

impl<S: PurgeExpired> PurgeExpired for Logged<S> {
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.record("start");
        tokio::time::sleep(self.hold).await;
        let deleted = self.inner.purge_expired().await;
        self.record("end");
        deleted
    }

    async fn try_lock_janitor(&self) -> Result<Option<JanitorLock>, Error> {
        let lock = self.inner.try_lock_janitor().await?;
        if lock.is_none() {
            self.record("skip");
        }
        Ok(lock)
    }
}

async fn run<S: PurgeExpired>(store: Logged<S>, every: Duration, run_for: Duration) -> Result<(), Error> {
    let janitor = Janitor::spawn(store, every)?;
    tokio::time::sleep(run_for).await;
    janitor.shutdown().await;
    println!("done");
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [backend, table, log, every, hold, run_for] = args.as_slice() else {
        return Err(
            "usage: janitor_process <pg|mysql> <markers_table> <log_file> <every_ms> <hold_ms> <run_ms>".into(),
        );
    };
    let millis = |text: &str| text.parse().map(Duration::from_millis);
    let (every, hold, run_for) = (millis(every)?, millis(hold)?, millis(run_for)?);
    let log = log.clone();
    match backend.as_str() {
        "pg" => {
            let pool = idempotent_runtime::sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(PG_URL)
                .await?;
            let inner = PgStore::builder(pool).table(table).build()?;
            run(Logged { inner, log, hold }, every, run_for).await?;
        }
        "mysql" => {
            let pool = idempotent_runtime::sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(2)
                .connect(MYSQL_URL)
                .await?;
            let inner = MySqlStore::builder(pool).table(table).build()?;
            run(Logged { inner, log, hold }, every, run_for).await?;
        }
        other => return Err(format!("unknown backend {other:?} (pg or mysql)").into()),
    }
    Ok(())
}
