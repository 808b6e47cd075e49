//! `RedisStore`'s completion on both kinds of server, each a private server
//! started by the test (so `INFO commandstats` counts only its commands): on
//! Valkey 8.1 (as on Redis ≥ 8.4) one native `SET key marker IFEQ lease PX
//! ttl`, on Redis 7.0 the token-checking script. On both, a consumer whose
//! lease was taken over neither overwrites nor deletes the new owner's lease.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

use common::servers::ChildServer;
use idempotent_runtime::redis::{self, aio::ConnectionManager};
use idempotent_runtime::{Error, RedisStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("the body failed")]
    Body,
}

/// What a body does to its own lease before it returns.
#[derive(Clone, Copy, PartialEq)]
enum Body {
    Succeeds,
    /// Another consumer takes the key over (the lease expired meanwhile),
    /// then the body succeeds.
    LosesLeaseThenSucceeds,
    /// The same, then the body fails.
    LosesLeaseThenFails,
}

const THIEF: &str = "Lthe-new-owner's-lease";

struct Consumer {
    store: RedisStore,
    conn: ConnectionManager,
    runs: AtomicU32,
}

impl Consumer {
    #[idempotent(key = "id", store = self.store, scope = "pay", fingerprint = "amount")]
    async fn pay(&self, id: &str, amount: u64, body: Body) -> Result<u64, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if body != Body::Succeeds {
            let key = self.store.redis_key("pay", id);
            let () = redis::cmd("SET")
                .arg(&key)
                .arg(THIEF)
                .query_async(&mut self.conn.clone())
                .await
                .unwrap();
        }
        match body {
            Body::LosesLeaseThenFails => Err(AppError::Body),
            _ => Ok(amount * 2),
        }
    }
}

async fn consumer(server: &ChildServer) -> Consumer {
    let client = redis::Client::open(server.redis_url()).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    Consumer {
        store: RedisStore::builder(conn.clone())
            .prefix(format!("{}:", common::unique("completion")))
            .build()
            .unwrap(),
        conn,
        runs: AtomicU32::new(0),
    }
}

/// `calls` per command since the server started.
async fn calls(conn: &ConnectionManager) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|rest| rest.split_once(':'))
        .map(|(name, fields)| {
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            (name.to_owned(), calls)
        })
        .collect()
}

/// The commands run between two [`calls`] snapshots (`INFO` left out).
fn ran(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> HashMap<String, u64> {
    after
        .iter()
        .map(|(name, n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
        .filter(|(name, n)| *n > 0 && name != "info")
        .collect()
}

async fn value(consumer: &Consumer, id: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(consumer.store.redis_key("pay", id))
        .query_async(&mut consumer.conn.clone())
        .await
        .unwrap()
}

/// Two fresh messages (the first may probe the server), a duplicate that
/// replays, a reused key, and the commands each fresh message sent.
async fn complete_and_replay(server: &ChildServer) -> (HashMap<String, u64>, HashMap<String, u64>) {
    let c = consumer(server).await;
    let before = calls(&c.conn).await;
    assert_eq!(c.pay("first", 5, Body::Succeeds).await.unwrap(), 10);
    let between = calls(&c.conn).await;
    assert_eq!(c.pay("second", 7, Body::Succeeds).await.unwrap(), 14);
    let after = calls(&c.conn).await;
    assert_eq!(c.runs.load(Ordering::SeqCst), 2);

    assert_eq!(c.pay("first", 5, Body::Succeeds).await.unwrap(), 10, "replayed");
    assert_eq!(c.pay("second", 7, Body::Succeeds).await.unwrap(), 14, "replayed");
    let reused = c.pay("first", 6, Body::Succeeds).await.unwrap_err();
    assert!(matches!(reused, AppError::Idem(Error::KeyReused { .. })), "{reused:?}");
    assert_eq!(c.runs.load(Ordering::SeqCst), 2, "no body ran again");
    let marker = value(&c, "first").await.unwrap();
    assert!(marker.starts_with('D'), "a completed marker: {marker:?}");
    (ran(&before, &between), ran(&between, &after))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_completes_with_one_native_set_and_no_script() {
    let server = ChildServer::valkey();
    let (mut first, second) = complete_and_replay(&server).await;
    // The store's first claim reads three settings to warn about.
    assert_eq!(first.remove("config|get"), Some(3), "{first:?}");
    let expected = HashMap::from([("set".to_owned(), 2)]);
    assert_eq!(
        first, expected,
        "the claim's SET NX GET and the completion's SET IFEQ, nothing else"
    );
    assert_eq!(second, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_7_completes_with_the_script_after_one_refused_probe() {
    let server = ChildServer::redis_with(&["--appendonly", "no"]);
    let (first, second) = complete_and_replay(&server).await;
    // The first completion's `SET .. IFEQ` is refused (a syntax error,
    // nothing written), then the script runs; later completions go straight
    // to the script: one EVALSHA, whose own GET and SET Redis counts too.
    assert!(first.get("evalsha").is_some_and(|&n| n >= 1), "{first:?}");
    assert_eq!(
        second,
        HashMap::from([("set".to_owned(), 2), ("evalsha".to_owned(), 1), ("get".to_owned(), 1)]),
        "the claim's SET, the script's GET and SET"
    );
}

async fn a_taken_over_lease_is_neither_overwritten_nor_released(server: &ChildServer) {
    let c = consumer(server).await;
    // Completion: the result is not stored over the new owner's lease.
    let lost = c.pay("taken", 5, Body::LosesLeaseThenSucceeds).await.unwrap_err();
    match &lost {
        AppError::Idem(Error::Store(message)) => assert!(message.to_string().contains("lease"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        value(&c, "taken").await.as_deref(),
        Some(THIEF),
        "the new owner's lease is intact"
    );
    // Failure: the lease is released only if it is still this claim's.
    let failed = c.pay("failed", 5, Body::LosesLeaseThenFails).await.unwrap_err();
    assert!(matches!(failed, AppError::Body), "{failed:?}");
    assert_eq!(
        value(&c, "failed").await.as_deref(),
        Some(THIEF),
        "the new owner's lease is intact"
    );
    // The new owner's lease makes a redelivery wait, not run.
    let busy = c.pay("taken", 5, Body::Succeeds).await.unwrap_err();
    assert!(matches!(busy, AppError::Idem(Error::InProgress { .. })), "{busy:?}");
    assert_eq!(c.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_a_taken_over_lease_is_neither_overwritten_nor_released() {
    a_taken_over_lease_is_neither_overwritten_nor_released(&ChildServer::valkey()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_7_a_taken_over_lease_is_neither_overwritten_nor_released() {
    a_taken_over_lease_is_neither_overwritten_nor_released(&ChildServer::redis_with(&["--appendonly", "no"])).await;
}
