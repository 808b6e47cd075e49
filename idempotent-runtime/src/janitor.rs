//! The janitor: a background task that deletes expired markers periodically
//! so the marker table does not grow without bound, one process of a fleet
//! at a time.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::Error;

/// A store whose expired markers can be deleted.
pub trait PurgeExpired: Send + Sync + 'static {
    /// Deletes expired markers, and for SQL stores dispatched outgoing
    /// messages past the outbox retention (in bounded batches); returns how
    /// many rows.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Takes the lock that lets one janitor of a fleet purge this store's
    /// tables at a time: `Ok(None)` when another janitor (in this process or
    /// another) holds it. The [`Janitor`] calls it before each round and
    /// [releases](JanitorLock::release) the lock after the round.
    ///
    /// The default is [`JanitorLock::unshared`], for stores that one
    /// process owns or that need no coordination; `PgStore` and `MySqlStore`
    /// take a database lock (see the [`Janitor`]).
    fn try_lock_janitor(&self) -> impl Future<Output = Result<Option<JanitorLock>, Error>> + Send {
        std::future::ready(Ok(Some(JanitorLock::unshared())))
    }
}

impl PurgeExpired for crate::MemoryStore {
    fn purge_expired(&self) -> impl Future<Output = Result<u64, Error>> + Send {
        crate::MemoryStore::purge_expired(self)
    }
}

/// A held janitor lock (see [`PurgeExpired::try_lock_janitor`]).
///
/// [`release`](JanitorLock::release) frees it. Dropping it without releasing
/// frees it too: the database locks are tied to a connection of their own,
/// which the drop closes (the server then ends the session and its locks).
#[must_use = "the lock is freed as soon as it is dropped"]
pub struct JanitorLock {
    release: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl JanitorLock {
    /// A lock that excludes nothing: for stores that one process owns.
    pub fn unshared() -> JanitorLock {
        JanitorLock { release: None }
    }

    /// A held lock that `release` frees when awaited. Dropping the lock
    /// drops `release` unpolled, which must free the lock as well (own the
    /// connection whose session holds it, or an expiring lease).
    pub fn new(release: impl Future<Output = ()> + Send + 'static) -> JanitorLock {
        JanitorLock {
            release: Some(Box::pin(release)),
        }
    }

    /// Frees the lock.
    pub async fn release(mut self) {
        if let Some(release) = self.release.take() {
            release.await;
        }
    }
}

impl fmt::Debug for JanitorLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JanitorLock")
            .field("shared", &self.release.is_some())
            .finish()
    }
}

/// A lock identity for the janitor of a store's tables: the first bytes of
/// the SHA-256 of `parts` (each followed by a NUL, so the parts cannot run
/// into each other).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn lock_digest(parts: &[&str]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    hash.update(b"idempotent janitor\0");
    for part in parts {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    hash.finalize().into()
}

/// A connection of its own for a janitor lock, opened with a pool's options
/// within the pool's acquire timeout (a server that does not answer fails
/// the round instead of holding it up).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn lock_connection<C: sqlx::Connection>(options: &C::Options, timeout: Duration) -> Result<C, Error> {
    match tokio::time::timeout(timeout, C::connect_with(options)).await {
        Ok(connection) => Ok(connection?),
        Err(_) => Err(Error::Store(
            format!("no connection for the janitor lock within {timeout:?}").into(),
        )),
    }
}

/// Takes a janitor lock held by a session of its own: connects with
/// `options` (within `timeout`), runs `lock` with `key` (one row, one
/// integer column: 1 when the lock is held), and on success returns a
/// [`JanitorLock`] whose release runs `unlock` with `key` and closes the
/// session. The server frees a session lock when its connection closes,
/// whether the round ends, its future is dropped or the process dies.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn session_lock<C, K>(
    options: &C::Options,
    timeout: Duration,
    (lock, unlock): (&'static str, &'static str),
    key: K,
) -> Result<Option<JanitorLock>, Error>
where
    C: sqlx::Connection + 'static,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    <C::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<C::Database>,
    for<'q> K: sqlx::Encode<'q, C::Database> + sqlx::Type<C::Database> + Clone + Send + Sync + 'static,
    for<'r> i64: sqlx::Decode<'r, C::Database> + sqlx::Type<C::Database>,
    usize: sqlx::ColumnIndex<<C::Database as sqlx::Database>::Row>,
{
    use sqlx::Row as _;
    let mut conn: C = lock_connection(options, timeout).await?;
    let row = sqlx::query(lock).bind(key.clone()).fetch_one(&mut conn).await?;
    if row.try_get::<i64, _>(0)? != 1 {
        let _ = conn.close().await;
        return Ok(None);
    }
    Ok(Some(JanitorLock::new(async move {
        // Closing the session frees the lock even if the unlock fails.
        let _ = sqlx::query(unlock).bind(key).execute(&mut conn).await;
        let _ = conn.close().await;
    })))
}

/// A running janitor task. Dropping it stops the task; [`Janitor::shutdown`]
/// stops it and waits for a purge in progress to finish.
///
/// ```no_run
/// # async fn run(store: idempotent_runtime::MemoryStore) {
/// use std::time::Duration;
/// let janitor = idempotent_runtime::Janitor::spawn(store, Duration::from_secs(3600)).unwrap();
/// // ... serve ...
/// janitor.shutdown().await;
/// # }
/// ```
///
/// # Fleet janitor
///
/// Every replica of a service usually spawns a janitor. Before each round
/// the janitor asks its store for the store's janitor lock
/// ([`PurgeExpired::try_lock_janitor`]); a replica that does not get it skips
/// the round (a `debug` event, and `idempotent_janitor_rounds_total{outcome =
/// "skipped"}` with the `metrics` feature) and tries again at its next tick.
/// The lock is held for one round only, so a dead or stopped replica never
/// leaves the purge undone for longer than one period of the others.
///
/// - [`PgStore`](crate::PgStore): a session advisory lock
///   (`pg_try_advisory_lock`) on a connection of its own, opened with the
///   pool's options for the round and closed after it: a holder that dies
///   (even by SIGKILL) drops the connection and the server frees the lock.
/// - `MySqlStore`: `GET_LOCK(name, 0)` / `RELEASE_LOCK` on a connection of
///   its own, freed in the same way.
/// - [`SqliteStore`](crate::SqliteStore), [`MemoryStore`](crate::MemoryStore),
///   `RedisStore`: no lock. A memory store belongs to one process, which must
///   purge it itself; SQLite runs one write transaction at a time on a file
///   (purges from several processes already take turns, batch by batch, and
///   a fleet on several hosts cannot share the file); Redis expires markers
///   by itself, so its round does nothing worth coordinating.
///
/// Locks are named after the store's marker and outbox tables (in the
/// database: PostgreSQL advisory locks are per database, MySQL's `GET_LOCK`
/// names are per server so the name includes `DATABASE()`): replicas with the
/// same configuration share one lock, stores of other tables do not wait for
/// it.
#[derive(Debug)]
pub struct Janitor {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Janitor {
    /// Spawns a task on the current tokio runtime that purges `store` now and
    /// then every `every`, each round under the store's janitor lock (a
    /// round whose lock another janitor holds is skipped). Failures are
    /// logged (`tracing`, target `idempotent`) and retried at the next tick.
    ///
    /// Fails with [`Error::Config`] when called outside a tokio runtime.
    pub fn spawn<S: PurgeExpired>(store: S, every: Duration) -> Result<Janitor, Error> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Config("Janitor::spawn must be called from inside a tokio runtime".into()))?;
        let (stop, mut stopped) = watch::channel(false);
        let task = runtime.spawn(async move {
            let mut ticks = tokio::time::interval(every.max(Duration::from_millis(1)));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = ticks.tick() => {}
                }
                round(&store).await;
            }
        });
        Ok(Janitor { stop, task: Some(task) })
    }

    /// Stops the janitor, letting a purge in progress finish.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// One round: the lock, the purge, the lock's release.
async fn round<S: PurgeExpired>(store: &S) {
    let lock = match store.try_lock_janitor().await {
        Ok(Some(lock)) => lock,
        Ok(None) => {
            tracing::debug!(target: "idempotent", "janitor round skipped: another janitor holds the lock");
            count_round("skipped", 0);
            return;
        }
        Err(error) => {
            tracing::warn!(target: "idempotent", %error, "taking the janitor lock failed");
            count_round("failed", 0);
            return;
        }
    };
    let purged = store.purge_expired().await;
    lock.release().await;
    match purged {
        Ok(deleted) => {
            if deleted > 0 {
                tracing::info!(target: "idempotent", deleted, "expired markers purged");
            }
            count_round("purged", deleted);
        }
        Err(error) => {
            tracing::warn!(target: "idempotent", %error, "purging expired markers failed");
            count_round("failed", 0);
        }
    }
}

/// `idempotent_janitor_rounds_total{outcome}` and
/// `idempotent_janitor_deleted_total` with the `metrics` feature.
#[inline]
fn count_round(outcome: &'static str, deleted: u64) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("idempotent_janitor_rounds_total", "outcome" => outcome).increment(1);
        if deleted > 0 {
            metrics::counter!("idempotent_janitor_deleted_total").increment(deleted);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, deleted);
}

impl Drop for Janitor {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
