//! `RedisStore` across a Redis restart, on a private Redis server started by
//! the test (so the machine's Redis, used by other tests, is not touched).
//! While Redis is down calls fail with `Error::Store` and run nothing; once
//! it is back, redeliveries are recognised (the server persists its data
//! with an append-only file, as a production Redis holding markers must)
//! and no effect is lost or doubled.

mod common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idempotent_runtime::{Error, RedisStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
}

#[derive(Default)]
struct Effects(Mutex<HashMap<String, u32>>);

#[idempotent(key = "id", store = store)]
async fn handle(store: &RedisStore, id: &str, effects: &Effects) -> Result<(), AppError> {
    *effects.0.lock().unwrap().entry(id.to_owned()).or_default() += 1;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_loses_and_doubles_nothing() {
    let mut redis = common::servers::ChildServer::redis();
    let client = idempotent_runtime::redis::Client::open(redis.redis_url()).unwrap();
    let config = idempotent_runtime::redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(1);
    let manager = client.get_connection_manager_with_config(config).await.unwrap();
    let store = RedisStore::new(manager);
    let effects = Effects::default();
    let ids: Vec<String> = (0..15).map(|i| format!("msg-{i}")).collect();

    for id in &ids[..10] {
        handle(&store, id, &effects).await.unwrap();
    }

    redis.kill();
    for id in &ids[10..] {
        let err = handle(&store, id, &effects).await.unwrap_err();
        assert!(matches!(err, AppError::Idem(Error::Store(_))), "{err:?}");
    }
    assert!(
        ids[10..].iter().all(|id| !effects.0.lock().unwrap().contains_key(id)),
        "nothing ran while down"
    );

    redis.spawn();
    // The broker redelivers everything; the connection manager reconnects.
    let mut pending: Vec<&String> = ids.iter().collect();
    for _ in 0..100 {
        let mut still = Vec::new();
        for id in pending {
            match handle(&store, id, &effects).await {
                Ok(()) => {}
                Err(AppError::Idem(Error::Store(_))) => still.push(id),
                Err(other) => panic!("{other:?}"),
            }
        }
        pending = still;
        if pending.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(pending.is_empty(), "Redis came back");
    let effects = effects.0.lock().unwrap();
    for id in &ids {
        assert_eq!(effects.get(id), Some(&1), "{id}: exactly one effect");
    }
}

async fn warnings_for(settings: &[&str]) -> String {
    let redis = common::servers::ChildServer::redis_with(settings);
    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::WARN));
    let client = idempotent_runtime::redis::Client::open(redis.redis_url()).unwrap();
    let store = RedisStore::new(client.get_connection_manager().await.unwrap());
    let effects = Effects::default();
    handle(&store, "first", &effects).await.unwrap();
    handle(&store, "second", &effects).await.unwrap();
    captured.text()
}

#[tokio::test(flavor = "current_thread")]
async fn a_redis_server_that_can_lose_markers_is_reported() {
    // Settings users change that silently forget markers: an eviction
    // policy (markers carry a ttl, so even volatile-* policies evict them)
    // and no persistence at all.
    let out = warnings_for(&[
        "--maxmemory",
        "64mb",
        "--maxmemory-policy",
        "volatile-lru",
        "--appendonly",
        "no",
    ])
    .await;
    assert!(out.contains("maxmemory_policy=volatile-lru"), "{out}");
    assert!(out.contains("keeps nothing on disk"), "{out}");
    assert_eq!(out.matches("may evict").count(), 1, "once per store: {out}");

    let out = warnings_for(&["--maxmemory-policy", "noeviction", "--appendonly", "yes"]).await;
    assert!(out.is_empty(), "a safe server: no warning: {out}");
}
