//! Lease renewal for [`RedisStore`](super::RedisStore): one task per store
//! extends the leases of every claim still running, instead of a task
//! spawned per claim.
//!
//! A claim registers its lease (a map insert under a mutex) and the guard
//! deregisters it when it completes, aborts or is dropped: a body that ends
//! within a third of its lease, the common case, costs no task, no timer
//! and no wake-up. A task spawned and aborted per claim cost about 28 µs of
//! client CPU per message (docs/archive/benchmarks.md, Redis section).
//!
//! The task wakes every third of the shortest lease registered so far and
//! extends each lease that has gone a third of its length without being
//! extended, so a lease is extended at the latest two thirds into its
//! length. It ends when the store and all its clones are dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::store::redis_conn::{Lua, RedisConn, Replicas};

/// Extends the lease if the token still matches. ARGV: lease value, lease ms.
static RENEW: Lua = Lua::new(
    r"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0",
);

/// The open leases of one store and the task that extends them.
pub(crate) struct Renewer {
    conn: RedisConn,
    /// The store's `wait_for_replicas`: each extension is followed by `WAIT`.
    wait: Option<Replicas>,
    state: Mutex<State>,
    /// Wakes the task when a lease shorter than any before needs a shorter
    /// period (shared with the task, which holds no strong reference to the
    /// renewer while it sleeps).
    wake: Arc<Notify>,
}

struct State {
    next_id: u64,
    open: HashMap<u64, Held>,
    /// How often the task looks for leases to extend: a third of the
    /// shortest lease registered so far.
    period: Duration,
    task: Option<JoinHandle<()>>,
}

struct Held {
    key: String,
    lease: String,
    lease_ms: i64,
    /// When the lease was last set or extended (as sent: the server's
    /// expiry is never earlier).
    since: Instant,
}

/// A registered lease; deregistered when dropped.
pub(crate) struct Renewal {
    renewer: Arc<Renewer>,
    id: u64,
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.renewer.state().open.remove(&self.id);
    }
}

/// A third of `lease_ms`, at least a millisecond.
fn third(lease_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(lease_ms / 3).unwrap_or(0).max(1))
}

impl Renewer {
    pub(crate) fn new(conn: RedisConn, wait: Option<Replicas>) -> Arc<Renewer> {
        Arc::new(Renewer {
            conn,
            wait,
            state: Mutex::new(State {
                next_id: 0,
                open: HashMap::new(),
                period: Duration::MAX,
                task: None,
            }),
            wake: Arc::new(Notify::new()),
        })
    }

    /// The state; a panic elsewhere while it was locked leaves nothing
    /// half-done in it (each change is one map operation or assignment).
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Extends the lease `lease` on `key` every third of `lease_ms` until
    /// the returned handle is dropped. `None` outside a Tokio runtime (the
    /// lease then simply runs its length).
    pub(crate) fn register(self: &Arc<Self>, key: &str, lease: &str, lease_ms: i64) -> Option<Renewal> {
        let mut state = self.state();
        if state.task.as_ref().is_none_or(JoinHandle::is_finished) {
            // The first claim, or the runtime that ran the task has shut
            // down: (re)start it on the caller's runtime.
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            state.task = Some(runtime.spawn(run(Arc::downgrade(self), Arc::clone(&self.wake))));
        }
        let id = state.next_id;
        state.next_id += 1;
        state.open.insert(
            id,
            Held {
                key: key.to_owned(),
                lease: lease.to_owned(),
                lease_ms,
                since: Instant::now(),
            },
        );
        let period = third(lease_ms);
        let shorter = period < state.period;
        if shorter {
            state.period = period;
        }
        drop(state);
        if shorter {
            self.wake.notify_one();
        }
        Some(Renewal {
            renewer: Arc::clone(self),
            id,
        })
    }

    /// Extends every lease that has gone a third of its length without
    /// being extended, concurrently; forgets the ones that were lost.
    async fn extend_due(&self) {
        let now = Instant::now();
        let due: Vec<(u64, String, String, i64)> = self
            .state()
            .open
            .iter_mut()
            .filter(|(_, held)| now.duration_since(held.since) >= third(held.lease_ms))
            .map(|(id, held)| {
                held.since = now;
                (*id, held.key.clone(), held.lease.clone(), held.lease_ms)
            })
            .collect();
        let extensions = due.into_iter().map(|(id, key, lease, lease_ms)| {
            let mut conn = self.conn.clone();
            let wait = self.wait;
            async move {
                let extended = RENEW.key(&key).arg(&lease).arg(lease_ms).send(&mut conn, wait).await;
                let extended = extended.and_then(|sent| {
                    let replicated = sent.replicated(wait);
                    Ok((sent.parse::<i64>()?, replicated))
                });
                (id, key, extended)
            }
        });
        for (id, key, extended) in futures_util::future::join_all(extensions).await {
            match extended {
                Ok((1, true)) => {}
                // Extended on the primary; a failover before the replicas
                // have it would shorten the lease to what they have.
                Ok((1, false)) => {
                    if self.state().open.contains_key(&id) {
                        tracing::warn!(target: "idempotent", %key, "the Redis lease was extended on the primary but not acknowledged by its replicas in time; extended again a third of the lease later");
                    }
                }
                // Not extended: lost, unless the claim ended meanwhile (its
                // guard deregisters before completing or releasing, so an
                // extension sent after that finds the marker or nothing).
                Ok(_) => {
                    if self.state().open.remove(&id).is_some() {
                        tracing::warn!(target: "idempotent", %key, "the Redis lease was lost while the handler ran");
                    }
                }
                // Tried again a third of the lease later.
                Err(error) => {
                    if self.state().open.contains_key(&id) {
                        tracing::warn!(target: "idempotent", %key, %error, "renewing the Redis lease failed; retrying");
                    }
                }
            }
        }
    }
}

impl Drop for Renewer {
    fn drop(&mut self) {
        if let Some(task) = self.state().task.take() {
            task.abort();
        }
    }
}

/// The renewal task: sleeps a period (shortened when a shorter lease
/// arrives), then extends what is due; ends with the renewer.
async fn run(renewer: Weak<Renewer>, wake: Arc<Notify>) {
    loop {
        let Some(period) = renewer.upgrade().map(|r| r.state().period) else {
            return;
        };
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            () = wake.notified() => continue,
        }
        let Some(renewer) = renewer.upgrade() else {
            return;
        };
        renewer.extend_due().await;
    }
}
