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

#[idempotent(key = "id", store = store, scope = "fingerprinted", fingerprint = amount)]
async fn charge(store: &MemoryStore, id: &str, amount: i64) -> Result<(), AppError> {
    Ok(())
}

/// A reused key is logged as what it is, `outcome = "key_reused"`, not as
/// a handler that failed nor as a claim (a store) that failed.
#[tokio::test]
async fn a_reused_key_is_logged_under_its_own_outcome() {
    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::DEBUG));
    let store = MemoryStore::new();
    charge(&store, "k-1", 5).await.unwrap();
    charge(&store, "k-1", 6).await.unwrap_err();
    let out = captured.text();
    let line = out
        .lines()
        .find(|l| l.contains("outcome=\"key_reused\""))
        .unwrap_or_else(|| panic!("no key_reused event: {out}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains("scope=\"fingerprinted\"") && line.contains("key=\"k-1\""),
        "{line}"
    );
    assert!(!out.contains("outcome=\"failed\""), "{out}");
    assert!(!out.contains("claim failed"), "{out}");
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

#[tokio::test]
async fn a_redis_lease_lost_while_the_body_runs_is_warned_and_an_ended_one_is_not() {
    use idempotent_runtime::RedisStore;
    use idempotent_runtime::redis::AsyncCommands;
    use idempotent_runtime::store::{Claim, Guard, Request, Store};
    use std::time::Duration;

    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::DEBUG));
    let client = idempotent_runtime::redis::Client::open("redis://127.0.0.1:6379/").unwrap();
    let mut conn = client.get_connection_manager().await.expect("Redis at 127.0.0.1:6379");
    let prefix = format!("idempotent-test:lost-lease:{}:", std::process::id());
    let store = RedisStore::builder(conn.clone()).prefix(&prefix).build().unwrap();
    let lease = Duration::from_millis(300);
    let claim = |key: String| {
        let store = store.clone();
        async move {
            let req = Request::new("traced", &key).unwrap().with_lease(lease);
            match store.claim(&req).await.unwrap() {
                Claim::Fresh(guard) => guard,
                Claim::Done(_) => panic!("{key}: expected a fresh claim"),
            }
        }
    };

    // Ended claims, completed and aborted, while extensions run beside them:
    // nothing to warn about.
    for round in 0..20 {
        let done = claim(format!("done-{round}")).await;
        tokio::time::sleep(lease / 3).await;
        if round % 2 == 0 {
            let _ = done.complete(None).await;
        } else {
            done.abort().await;
        }
    }
    assert!(
        !captured.text().contains("lease was lost"),
        "a warning for a claim that ended: {}",
        captured.text()
    );

    // Another consumer takes the key over while the body still runs.
    let running = claim("lost".to_owned()).await;
    let key = store.redis_key("traced", "lost");
    let _: () = conn.set(&key, "Lsomeone-else").await.unwrap();
    let deadline = tokio::time::Instant::now() + lease * 4;
    while !captured.text().contains("lease was lost") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no warning: {}",
            captured.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = captured.text();
    let line = out.lines().find(|l| l.contains("lease was lost")).unwrap_or_default();
    assert!(line.contains("WARN") && line.contains(&key), "{line}");
    assert!(
        running.complete(None).await.is_err(),
        "completed over another owner's lease"
    );
    let value: String = conn.get(&key).await.unwrap();
    assert_eq!(value, "Lsomeone-else");

    let keys: Vec<String> = conn.keys(format!("{prefix}*")).await.unwrap();
    if !keys.is_empty() {
        let _: i64 = conn.del(keys).await.unwrap();
    }
}
