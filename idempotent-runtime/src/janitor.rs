//! The janitor: a background task that deletes expired markers periodically
//! so the marker table does not grow without bound.

use std::future::Future;
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
}

impl PurgeExpired for crate::MemoryStore {
    fn purge_expired(&self) -> impl Future<Output = Result<u64, Error>> + Send {
        crate::MemoryStore::purge_expired(self)
    }
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
#[derive(Debug)]
pub struct Janitor {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Janitor {
    /// Spawns a task on the current tokio runtime that purges `store` now and
    /// then every `every`. Failures are logged (`tracing`, target
    /// `idempotent`) and retried at the next tick.
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
                match store.purge_expired().await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::info!(target: "idempotent", deleted, "expired markers purged"),
                    Err(error) => tracing::warn!(target: "idempotent", %error, "purging expired markers failed"),
                }
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

impl Drop for Janitor {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
