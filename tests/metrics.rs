//! Every call counts its outcome through the `metrics` facade:
//! `idempotent_outcomes_total{scope, outcome}`. (A binary of its own: the
//! tracing test next door installs a subscriber, and tracing caches
//! per-callsite interest process-wide.)

mod common;

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error("boom")]
    Boom,
}

#[idempotent(key = "id", store = store, scope = "counted")]
async fn handle(store: &MemoryStore, id: &str, fail: bool) -> Result<u32, AppError> {
    if fail { Err(AppError::Boom) } else { Ok(7) }
}

// A recorder that keeps counters in a map, installed for one test.
use common::counters as recorder;

#[test]
fn outcomes_are_counted_through_the_metrics_facade() {
    let counters = recorder::Counters::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&counters, || {
        runtime.block_on(async {
            let store = MemoryStore::new();
            handle(&store, "c-1", true).await.unwrap_err();
            handle(&store, "c-1", false).await.unwrap();
            handle(&store, "c-1", false).await.unwrap();
            handle(&store, "c-1", false).await.unwrap();
        })
    });
    let count = |outcome: &str| counters.get(&format!("idempotent_outcomes_total{{outcome={outcome},scope=counted}}"));
    assert_eq!((count("processed"), count("duplicate"), count("failed")), (1, 2, 1));
}

#[idempotent(key = "id", store = store, scope = "claimed", fingerprint = amount)]
async fn charge(store: &MemoryStore, id: &str, amount: i64) -> Result<i64, AppError> {
    Ok(amount)
}

/// A claim that does not run the body is counted under its own outcome, the
/// span's `idempotency.outcome`: a reused key is `key_reused`, a key another
/// consumer holds `in_progress`, a key that cannot be stored `error`; none
/// of them is a handler that `failed`.
#[test]
fn claims_that_do_not_run_the_body_are_counted_under_their_own_outcome() {
    use idempotent_runtime::store::{Claim, Request, Store};

    let counters = recorder::Counters::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&counters, || {
        runtime.block_on(async {
            let store = MemoryStore::new();
            assert_eq!(charge(&store, "r-1", 5).await.unwrap(), 5);
            assert_eq!(charge(&store, "r-1", 5).await.unwrap(), 5);
            let reused = charge(&store, "r-1", 6).await.unwrap_err();
            assert!(
                matches!(reused, AppError::Idem(idempotent_runtime::Error::KeyReused { .. })),
                "{reused:?}"
            );
            // Another consumer holds the key's lease.
            let req = Request::new("claimed", "r-2").unwrap();
            let Claim::Fresh(_held) = store.claim(&req).await.unwrap() else {
                panic!("fresh");
            };
            let busy = charge(&store, "r-2", 1).await.unwrap_err();
            assert!(
                matches!(busy, AppError::Idem(idempotent_runtime::Error::InProgress { .. })),
                "{busy:?}"
            );
            charge(&store, "", 1).await.unwrap_err();
        })
    });
    let count = |outcome: &str| counters.get(&format!("idempotent_outcomes_total{{outcome={outcome},scope=claimed}}"));
    assert_eq!(
        [
            count("processed"),
            count("duplicate"),
            count("key_reused"),
            count("in_progress"),
            count("error"),
            count("failed")
        ],
        [1, 1, 1, 1, 1, 0]
    );
}

/// In a batch, outcomes are counted when they are final: after the batch's
/// commit, once per message. An aborted batch's members count nothing;
/// their rerun alone counts them then.
mod batch {
    use idempotent_runtime::batch::BatchStore;
    use idempotent_runtime::{SqliteStore, idempotent};

    use super::AppError;

    #[idempotent(key = "id", store = store, scope = "batched")]
    async fn handle(store: &SqliteStore, id: &str, hang: bool) -> Result<(), AppError> {
        if hang {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    #[test]
    fn batch_outcomes_are_counted_after_the_commit() {
        let counters = super::recorder::Counters::default();
        let count =
            |outcome: &str| counters.get(&format!("idempotent_outcomes_total{{outcome={outcome},scope=batched}}"));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        metrics::with_local_recorder(&counters, || {
            runtime.block_on(async {
                let store = SqliteStore::open(dir.path().join("b.db")).await.unwrap();
                store.migrate().await.unwrap();
                // Aborted: one member completes, one is cancelled mid-body.
                let batch = store.begin_batch().await.unwrap();
                batch.run(handle(&store, "a", false)).await.unwrap();
                batch.run(handle(&store, "a", false)).await.unwrap();
                let hang = std::time::Duration::from_millis(200);
                assert!(
                    tokio::time::timeout(hang, batch.run(handle(&store, "b", true)))
                        .await
                        .is_err()
                );
                batch.commit().await.unwrap_err();
                assert_eq!(
                    (count("processed"), count("duplicate")),
                    (0, 0),
                    "an aborted batch counted"
                );
                // The rerun alone, then a batch that commits.
                handle(&store, "a", false).await.unwrap();
                handle(&store, "b", false).await.unwrap();
                let batch = store.begin_batch().await.unwrap();
                batch.run(handle(&store, "c", false)).await.unwrap();
                batch.run(handle(&store, "a", false)).await.unwrap();
                assert_eq!(
                    (count("processed"), count("duplicate")),
                    (2, 0),
                    "counted before the commit"
                );
                batch.commit().await.unwrap();
            })
        });
        assert_eq!((count("processed"), count("duplicate"), count("failed")), (3, 1, 0));
    }
}

mod outbox {
    use std::sync::Arc;
    use std::time::Duration;

    use idempotent_runtime::outbox::{Outbox, OutboxRow, Outgoing, PublishError, Publisher, Relay};
    use idempotent_runtime::{SqliteStore, idempotent};

    use super::AppError;

    #[idempotent(key = "id", store = store, scope = "staging")]
    async fn stage(store: &SqliteStore, id: &str, outbox: &mut Outbox) -> Result<(), AppError> {
        outbox.publish(Outgoing::new("a", id.as_bytes().to_vec()));
        outbox.publish(Outgoing::new("b", id.as_bytes().to_vec()));
        Ok(())
    }

    struct Accept;

    impl Publisher for Accept {
        async fn publish(&self, _: &OutboxRow) -> Result<(), PublishError> {
            Ok(())
        }
    }

    /// Staged and published outgoing messages are counted too:
    /// `idempotent_outbox_staged_total{scope}` and
    /// `idempotent_outbox_published_total`.
    #[test]
    fn outgoing_messages_are_counted() {
        let counters = super::recorder::Counters::default();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        metrics::with_local_recorder(&counters, || {
            runtime.block_on(async {
                let store = SqliteStore::open(dir.path().join("m.db")).await.unwrap();
                store.migrate().await.unwrap();
                stage(&store, "s-1").await.unwrap();
                stage(&store, "s-1").await.unwrap();
                let relay = Relay::builder(store.clone(), Arc::new(Accept))
                    .poll_interval(Duration::from_millis(5))
                    .spawn();
                while relay.stats().published() < 2 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                relay.shutdown().await;
            })
        });
        assert_eq!(
            counters.get("idempotent_outbox_staged_total{scope=staging}"),
            2,
            "the duplicate stages nothing"
        );
        assert_eq!(counters.get("idempotent_outbox_published_total{}"), 2);
    }
    #[idempotent(key = "id", store = store, scope = "staging_batched")]
    async fn stage_or_hang(store: &SqliteStore, id: &str, hang: bool, outbox: &mut Outbox) -> Result<(), AppError> {
        outbox.publish(Outgoing::new("a", id.as_bytes().to_vec()));
        if hang {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    /// The outgoing messages of a batch member are counted once its batch
    /// commits: an aborted batch's staged rows (rolled back) are not.
    #[test]
    fn a_batch_members_staged_messages_are_counted_after_the_commit() {
        use idempotent_runtime::batch::BatchStore;

        let counters = super::recorder::Counters::default();
        let staged = || counters.get("idempotent_outbox_staged_total{scope=staging_batched}");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        metrics::with_local_recorder(&counters, || {
            runtime.block_on(async {
                let store = SqliteStore::open(dir.path().join("sb.db")).await.unwrap();
                store.migrate().await.unwrap();
                let batch = store.begin_batch().await.unwrap();
                batch.run(stage_or_hang(&store, "x", false)).await.unwrap();
                let hang = Duration::from_millis(200);
                assert!(
                    tokio::time::timeout(hang, batch.run(stage_or_hang(&store, "y", true)))
                        .await
                        .is_err()
                );
                batch.commit().await.unwrap_err();
                assert_eq!(staged(), 0, "the rolled-back rows were counted");
                let batch = store.begin_batch().await.unwrap();
                batch.run(stage_or_hang(&store, "x", false)).await.unwrap();
                assert_eq!(staged(), 0, "counted before the commit");
                batch.commit().await.unwrap();
            })
        });
        assert_eq!(staged(), 1);
    }
}

mod janitor {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Duration;

    use idempotent_runtime::store::{JanitorLock, PurgeExpired};
    use idempotent_runtime::{Error, Janitor};

    /// A store whose janitor lock another replica holds while `held` is set.
    #[derive(Clone, Default)]
    struct Shared {
        held: Arc<AtomicBool>,
        purges: Arc<AtomicU64>,
    }

    impl PurgeExpired for Shared {
        async fn purge_expired(&self) -> Result<u64, Error> {
            self.purges.fetch_add(1, Ordering::SeqCst);
            Ok(3)
        }

        async fn try_lock_janitor(&self) -> Result<Option<JanitorLock>, Error> {
            Ok((!self.held.load(Ordering::SeqCst)).then(|| JanitorLock::new(async {})))
        }
    }

    /// Janitor rounds are counted by outcome
    /// (`idempotent_janitor_rounds_total{outcome}`), the rows they deleted
    /// as `idempotent_janitor_deleted_total`; a skipped round purges nothing.
    #[test]
    fn janitor_rounds_are_counted() {
        let counters = super::recorder::Counters::default();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let store = Shared::default();
        store.held.store(true, Ordering::SeqCst);
        let skipped = || counters.get("idempotent_janitor_rounds_total{outcome=skipped}");
        let purged = || counters.get("idempotent_janitor_rounds_total{outcome=purged}");
        metrics::with_local_recorder(&counters, || {
            runtime.block_on(async {
                let janitor = Janitor::spawn(store.clone(), Duration::from_millis(5)).unwrap();
                while skipped() < 3 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert_eq!(store.purges.load(Ordering::SeqCst), 0, "a skipped round purged");
                store.held.store(false, Ordering::SeqCst);
                while purged() < 2 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                janitor.shutdown().await;
            })
        });
        assert_eq!(purged(), store.purges.load(Ordering::SeqCst));
        assert_eq!(counters.get("idempotent_janitor_deleted_total{}"), 3 * purged());
        assert_eq!(counters.get("idempotent_janitor_rounds_total{outcome=failed}"), 0);
    }
}
