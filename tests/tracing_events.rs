//! Every call emits a `tracing` event with its outcome (processed,
//! duplicate, failed) in a span carrying the scope and the key.

mod common;

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error("boom")]
    Boom,
}

#[idempotent(key = "id", store = store, scope = "traced")]
async fn handle(store: &MemoryStore, id: &str, fail: bool) -> Result<u32, AppError> {
    if fail { Err(AppError::Boom) } else { Ok(7) }
}

#[tokio::test]
async fn outcomes_are_traced_with_scope_and_key() {
    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::DEBUG));

    let store = MemoryStore::new();
    handle(&store, "m-1", true).await.unwrap_err();
    handle(&store, "m-1", false).await.unwrap();
    handle(&store, "m-1", false).await.unwrap();
    handle(&store, "", false).await.unwrap_err();

    let out = captured.text();
    let lines: Vec<&str> = out.lines().collect();
    let find = |outcome: &str| {
        lines
            .iter()
            .find(|l| l.contains(&format!("outcome=\"{outcome}\"")))
            .copied()
            .unwrap_or_default()
    };
    for outcome in ["failed", "processed", "duplicate"] {
        let line = find(outcome);
        assert!(
            line.contains("scope=\"traced\"") && line.contains("key=\"m-1\""),
            "{outcome}: {out}"
        );
    }
    assert!(find("duplicate").contains("INFO"), "{out}");
    assert_eq!(
        lines.iter().filter(|l| l.contains("outcome=\"processed\"")).count(),
        1,
        "{out}"
    );
}

#[tokio::test]
async fn at_the_default_level_a_skipped_duplicate_names_its_handler_and_key() {
    // The span carrying scope and key is at debug level: at `info`, the
    // event itself must say which handler skipped which message.
    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::INFO));
    let store = MemoryStore::new();
    handle(&store, "m-2", false).await.unwrap();
    handle(&store, "m-2", false).await.unwrap();
    let out = captured.text();
    let line = out
        .lines()
        .find(|l| l.contains("outcome=\"duplicate\""))
        .unwrap_or_else(|| panic!("no duplicate event: {out}"));
    assert!(line.contains("INFO"), "{line}");
    assert!(
        line.contains("scope=\"traced\"") && line.contains("key=\"m-2\""),
        "{line}"
    );
    assert!(
        !line.contains("idempotent{"),
        "the debug span is not shown at info: {line}"
    );
}

/// A replica whose janitor lock is held elsewhere says so at debug level.
#[tokio::test]
async fn a_skipped_janitor_round_is_traced() {
    use idempotent_runtime::store::{JanitorLock, PurgeExpired};

    static PURGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    struct HeldElsewhere;

    impl PurgeExpired for HeldElsewhere {
        async fn purge_expired(&self) -> Result<u64, idempotent_runtime::Error> {
            PURGED.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(0)
        }

        async fn try_lock_janitor(&self) -> Result<Option<JanitorLock>, idempotent_runtime::Error> {
            Ok(None)
        }
    }

    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::DEBUG));
    let janitor = idempotent_runtime::Janitor::spawn(HeldElsewhere, std::time::Duration::from_millis(5)).unwrap();
    while !captured.text().contains("janitor round skipped") {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    janitor.shutdown().await;
    let out = captured.text();
    let line = out
        .lines()
        .find(|l| l.contains("janitor round skipped"))
        .unwrap_or_default();
    assert!(line.contains("DEBUG") && line.contains("idempotent"), "{line}");
    assert!(
        !PURGED.load(std::sync::atomic::Ordering::SeqCst),
        "purged without the lock"
    );
}
