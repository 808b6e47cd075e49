//! `RedisStore` against the real Redis at 127.0.0.1:6379: claims, replay,
//! fingerprints, release on failure, fencing of stale consumers, renewal,
//! crash recovery, key encoding and expiry.
//!
//! Every test writes under its own unique prefix and deletes its keys at the
//! end; every key it writes also carries a short Redis expiry, so a failed
//! test leaves nothing behind for long.

#![cfg(feature = "redis")]

use std::future::Future;
use std::time::{Duration, Instant};

use idempotent_runtime::redis::{self, AsyncCommands, aio::ConnectionManager};
use idempotent_runtime::store::{Claim, Fingerprint, Guard, PurgeExpired, RedisGuard, Request, Store};
use idempotent_runtime::{Error, RedisStore};

const TTL: Duration = Duration::from_secs(60);

async fn manager() -> ConnectionManager {
    let client = redis::Client::open("redis://127.0.0.1:6379/").expect("redis url");
    client.get_connection_manager().await.expect("Redis at 127.0.0.1:6379")
}

/// A store under a prefix no other test (or run) uses.
struct Fixture {
    conn: ConnectionManager,
    prefix: String,
    store: RedisStore,
}

impl Fixture {
    async fn new(test: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let prefix = format!("idempotent-test:{test}:{}:{nanos}:", std::process::id());
        let conn = manager().await;
        let store = RedisStore::builder(conn.clone()).prefix(&prefix).build().unwrap();
        Fixture { conn, prefix, store }
    }

    /// A second store on the same keys whose leases are not renewed.
    fn without_renewal(&self) -> RedisStore {
        RedisStore::builder(self.conn.clone())
            .prefix(&self.prefix)
            .renew(false)
            .build()
            .unwrap()
    }

    async fn raw(&self, scope: &str, key: &str) -> Option<String> {
        self.conn.clone().get(self.store.redis_key(scope, key)).await.unwrap()
    }

    async fn cleanup(&self) {
        let mut conn = self.conn.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: i64 = conn.del(keys).await.unwrap();
        }
    }
}

fn req<'a>(scope: &'a str, key: &'a str) -> Request<'a> {
    Request::new(scope, key).unwrap().with_ttl(TTL)
}

async fn fresh<S: Store>(store: &S, req: &Request<'_>) -> S::Guard {
    match store.claim(req).await {
        Ok(Claim::Fresh(guard)) => guard,
        Ok(Claim::Done(replay)) => panic!("expected a fresh claim, got a replay of {replay:?}"),
        Err(error) => panic!("expected a fresh claim, got {error}"),
    }
}

async fn done<S: Store>(store: &S, req: &Request<'_>) -> Option<String> {
    match store.claim(req).await {
        Ok(Claim::Done(replay)) => replay.json().map(str::to_owned),
        Ok(Claim::Fresh(_)) => panic!("expected a replay, got a fresh claim"),
        Err(error) => panic!("expected a replay, got {error}"),
    }
}

async fn assert_in_progress<S: Store>(store: &S, req: &Request<'_>) {
    match store.claim(req).await {
        Err(Error::InProgress { scope, key }) => {
            assert_eq!(scope, req.scope());
            assert_eq!(key.as_str(), req.key());
        }
        Ok(Claim::Fresh(_)) => panic!("expected InProgress, got a fresh claim"),
        Ok(Claim::Done(replay)) => panic!("expected InProgress, got a replay of {replay:?}"),
        Err(error) => panic!("expected InProgress, got {error}"),
    }
}

/// Polls `claim` until it is fresh; panics after `limit`.
async fn eventually_fresh(store: &RedisStore, req: &Request<'_>, limit: Duration) -> RedisGuard {
    let start = Instant::now();
    loop {
        match store.claim(req).await {
            Ok(Claim::Fresh(guard)) => return guard,
            Err(Error::InProgress { .. }) | Ok(Claim::Done(_)) if start.elapsed() < limit => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(Claim::Done(replay)) => panic!("still a replay of {replay:?} after {limit:?}"),
            Err(error) => panic!("not fresh after {limit:?}: {error}"),
        }
    }
}

async fn with_fixture<F, Fut>(test: &str, body: F)
where
    F: FnOnce(&'static Fixture) -> Fut,
    Fut: Future<Output = ()>,
{
    // Leaked so spawned tasks may borrow it; one small value per test.
    let fixture: &'static Fixture = Box::leak(Box::new(Fixture::new(test).await));
    body(fixture).await;
    fixture.cleanup().await;
}

#[tokio::test]
async fn completion_is_replayed_to_duplicates() {
    with_fixture("replay", |fx| async move {
        let r = req("orders", "msg-1");
        let guard = fresh(&fx.store, &r).await;
        guard.complete(Some(r#"{"charged":42}"#.into())).await.unwrap();
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some(r#"{"charged":42}"#));
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some(r#"{"charged":42}"#));

        // `()` stores nothing (JSON null) and replays as `None`.
        let unit = req("orders", "msg-unit");
        fresh(&fx.store, &unit).await.complete(None).await.unwrap();
        assert_eq!(done(&fx.store, &unit).await, None);

        // Results made of the encoding's own separators come back unchanged.
        let odd = req("orders", "msg-odd");
        let json = r#""D-=1:|L:=""#;
        fresh(&fx.store, &odd).await.complete(Some(json.into())).await.unwrap();
        assert_eq!(done(&fx.store, &odd).await.as_deref(), Some(json));

        // The completed marker carries the request's ttl as its Redis expiry.
        let pttl: i64 = fx
            .conn
            .clone()
            .pttl(fx.store.redis_key("orders", "msg-1"))
            .await
            .unwrap();
        assert!(pttl > 0 && pttl <= TTL.as_millis() as i64, "pttl {pttl}");
    })
    .await;
}

#[tokio::test]
async fn a_live_lease_answers_in_progress() {
    with_fixture("in-progress", |fx| async move {
        let r = req("orders", "msg-1");
        let guard = fresh(&fx.store, &r).await;
        assert_in_progress(&fx.store, &r).await;
        assert_in_progress(&fx.store.clone(), &r).await;
        guard.complete(Some("7".into())).await.unwrap();
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some("7"));
    })
    .await;
}

#[tokio::test]
async fn concurrent_duplicates_give_one_fresh_claim() {
    with_fixture("concurrent", |fx| async move {
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                tokio::spawn(async move {
                    let r = req("orders", "msg-1");
                    match fx.store.claim(&r).await {
                        Ok(Claim::Fresh(guard)) => Some(guard),
                        Err(Error::InProgress { .. }) => None,
                        Ok(Claim::Done(_)) => panic!("nothing was completed yet"),
                        Err(error) => panic!("{error}"),
                    }
                })
            })
            .collect();
        let mut winners = Vec::new();
        for task in tasks {
            winners.extend(task.await.unwrap());
        }
        assert_eq!(winners.len(), 1);
        winners.pop().unwrap().complete(None).await.unwrap();
        assert_eq!(done(&fx.store, &req("orders", "msg-1")).await, None);
    })
    .await;
}

#[tokio::test]
async fn a_different_fingerprint_is_key_reused() {
    with_fixture("fingerprint", |fx| async move {
        let first = Some(Fingerprint::of(&("order-1", 100)).unwrap());
        let other = Some(Fingerprint::of(&("order-1", 999)).unwrap());
        let r = req("orders", "msg-1").with_fingerprint(first.clone());
        fresh(&fx.store, &r).await.complete(Some("1".into())).await.unwrap();

        let reused = req("orders", "msg-1").with_fingerprint(other);
        match fx.store.claim(&reused).await {
            Err(Error::KeyReused { scope, key }) => {
                assert_eq!(scope, "orders");
                assert_eq!(key.as_str(), "msg-1");
            }
            other => panic!("expected KeyReused, got {other:?}"),
        }
        assert_eq!(
            done(&fx.store, &req("orders", "msg-1").with_fingerprint(first))
                .await
                .as_deref(),
            Some("1")
        );
        // A request without a fingerprint does not check one.
        assert_eq!(done(&fx.store, &req("orders", "msg-1")).await.as_deref(), Some("1"));

        // A marker stored without a fingerprint does not match one.
        let bare = req("orders", "msg-2");
        fresh(&fx.store, &bare).await.complete(None).await.unwrap();
        let with = req("orders", "msg-2").with_fingerprint(Some(Fingerprint::from_bytes(b"x")));
        assert!(matches!(fx.store.claim(&with).await, Err(Error::KeyReused { .. })));
    })
    .await;
}

#[tokio::test]
async fn abort_releases_the_lease_at_once() {
    with_fixture("abort", |fx| async move {
        let r = req("orders", "msg-1");
        fresh(&fx.store, &r).await.abort().await;
        assert_eq!(fx.raw("orders", "msg-1").await, None);
        fresh(&fx.store, &r).await.complete(None).await.unwrap();
        assert_eq!(done(&fx.store, &r).await, None);
    })
    .await;
}

#[tokio::test]
async fn dropping_the_guard_releases_the_lease() {
    with_fixture("drop", |fx| async move {
        let limit = Duration::from_secs(2);
        let r = req("orders", "msg-1");

        // Plain drop (what cancellation does to the guard).
        drop(fresh(&fx.store, &r).await);
        eventually_fresh(&fx.store, &r, limit).await.abort().await;

        // A body that panics while holding the guard.
        let guard = fresh(&fx.store, &r).await;
        let panicked = tokio::spawn(async move {
            let _guard = guard;
            panic!("handler panicked");
        })
        .await;
        assert!(panicked.unwrap_err().is_panic());
        eventually_fresh(&fx.store, &r, limit).await.abort().await;

        // A body cancelled by a timeout while it awaits.
        let cancelled = tokio::time::timeout(Duration::from_millis(50), async {
            let _guard = fresh(&fx.store, &r).await;
            std::future::pending::<()>().await;
        })
        .await;
        assert!(cancelled.is_err());
        let guard = eventually_fresh(&fx.store, &r, limit).await;
        guard.complete(Some("\"ok\"".into())).await.unwrap();
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some("\"ok\""));
    })
    .await;
}

#[tokio::test]
async fn a_stale_consumer_cannot_overwrite_the_new_owners_marker() {
    with_fixture("stale-complete", |fx| async move {
        let stale_store = fx.without_renewal();
        let short = req("orders", "msg-1").with_lease(Duration::from_millis(200));
        let stale = fresh(&stale_store, &short).await;
        // The stale consumer's body outlives its lease; another takes over.
        let owner = eventually_fresh(&fx.store, &req("orders", "msg-1"), Duration::from_secs(3)).await;
        let owners_lease = fx.raw("orders", "msg-1").await;

        let err = stale.complete(Some("\"stale\"".into())).await.unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{err:?}");
        assert!(err.to_string().contains("lease"), "{err}");
        assert_eq!(
            fx.raw("orders", "msg-1").await,
            owners_lease,
            "the new owner's lease was touched"
        );
        assert_in_progress(&fx.store, &req("orders", "msg-1")).await;

        owner.complete(Some("\"owner\"".into())).await.unwrap();
        assert_eq!(
            done(&fx.store, &req("orders", "msg-1")).await.as_deref(),
            Some("\"owner\"")
        );

        // Even after the owner completed, a stale completion changes nothing.
        let stale = fresh(
            &stale_store,
            &req("orders", "msg-2").with_lease(Duration::from_millis(200)),
        )
        .await;
        let owner = eventually_fresh(&fx.store, &req("orders", "msg-2"), Duration::from_secs(3)).await;
        owner.complete(Some("\"owner\"".into())).await.unwrap();
        let marker = fx.raw("orders", "msg-2").await;
        assert!(stale.complete(Some("\"stale\"".into())).await.is_err());
        assert_eq!(fx.raw("orders", "msg-2").await, marker);
        assert_eq!(
            done(&fx.store, &req("orders", "msg-2")).await.as_deref(),
            Some("\"owner\"")
        );
    })
    .await;
}

#[tokio::test]
async fn a_stale_consumers_completion_is_refused_even_when_it_stores_what_the_owner_stored() {
    with_fixture("stale-equal", |fx| async move {
        // A unit handler without fingerprint: both claims' completions
        // would store the same bytes but for their tokens.
        let stale_store = fx.without_renewal();
        let stale = fresh(
            &stale_store,
            &req("orders", "msg-1").with_lease(Duration::from_millis(200)),
        )
        .await;
        let owner = eventually_fresh(&fx.store, &req("orders", "msg-1"), Duration::from_secs(3)).await;
        owner.complete(None).await.unwrap();
        let marker = fx.raw("orders", "msg-1").await;
        let err = stale.complete(None).await.unwrap_err();
        assert!(matches!(err, Error::Store(_)), "the fenced holder is told: {err:?}");
        assert!(err.to_string().contains("lease"), "{err}");
        assert_eq!(
            fx.raw("orders", "msg-1").await,
            marker,
            "the owner's marker is untouched"
        );
    })
    .await;
}

#[tokio::test]
async fn a_stale_consumer_cannot_release_the_new_owners_claim() {
    with_fixture("stale-abort", |fx| async move {
        let stale_store = fx.without_renewal();
        let short = req("orders", "msg-1").with_lease(Duration::from_millis(200));

        // abort from the stale guard leaves the new owner's lease alone...
        let stale = fresh(&stale_store, &short).await;
        let owner = eventually_fresh(&fx.store, &req("orders", "msg-1"), Duration::from_secs(3)).await;
        stale.abort().await;
        assert_in_progress(&fx.store, &req("orders", "msg-1")).await;

        // ...and so does dropping it (the release runs in the background).
        let stale = fresh(
            &stale_store,
            &req("orders", "msg-2").with_lease(Duration::from_millis(200)),
        )
        .await;
        let owner2 = eventually_fresh(&fx.store, &req("orders", "msg-2"), Duration::from_secs(3)).await;
        drop(stale);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_in_progress(&fx.store, &req("orders", "msg-2")).await;

        owner.complete(Some("1".into())).await.unwrap();
        owner2.complete(Some("2".into())).await.unwrap();

        // A stale abort after the owner completed leaves the marker too.
        let stale = fresh(
            &stale_store,
            &req("orders", "msg-3").with_lease(Duration::from_millis(200)),
        )
        .await;
        let owner3 = eventually_fresh(&fx.store, &req("orders", "msg-3"), Duration::from_secs(3)).await;
        owner3.complete(Some("3".into())).await.unwrap();
        stale.abort().await;

        for (key, want) in [("msg-1", "1"), ("msg-2", "2"), ("msg-3", "3")] {
            assert_eq!(done(&fx.store, &req("orders", key)).await.as_deref(), Some(want));
        }
    })
    .await;
}

#[tokio::test]
async fn renewal_keeps_a_long_body_claimed() {
    with_fixture("renewal", |fx| async move {
        let lease = Duration::from_millis(300);
        let r = req("orders", "msg-1").with_lease(lease);
        let guard = fresh(&fx.store, &r).await;

        // The body runs three times the lease; a competitor never gets in.
        let start = Instant::now();
        while start.elapsed() < lease * 3 {
            assert_in_progress(&fx.store, &r).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pttl: i64 = fx
            .conn
            .clone()
            .pttl(fx.store.redis_key("orders", "msg-1"))
            .await
            .unwrap();
        assert!(pttl > 0, "the lease must still be live (pttl {pttl})");

        guard.complete(Some("\"long\"".into())).await.unwrap();
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some("\"long\""));
    })
    .await;
}

#[tokio::test]
async fn a_shorter_lease_after_a_longer_one_is_renewed_in_time() {
    // One task renews a store's leases at a third of the shortest lease seen:
    // a 300 ms lease claimed while a 6 s one is open must not wait for the
    // 2 s period.
    with_fixture("renewal-shorter", |fx| async move {
        let long = req("orders", "long").with_lease(Duration::from_secs(6));
        let long_guard = fresh(&fx.store, &long).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let lease = Duration::from_millis(300);
        let short = req("orders", "short").with_lease(lease);
        let short_guard = fresh(&fx.store, &short).await;
        let start = Instant::now();
        while start.elapsed() < lease * 3 {
            assert_in_progress(&fx.store, &short).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        short_guard.complete(None).await.unwrap();
        long_guard.complete(None).await.unwrap();
        assert!(done(&fx.store, &short).await.is_none());
        assert!(done(&fx.store, &long).await.is_none());
    })
    .await;
}

// On a multi-threaded runtime, as services run: the renewal task and the
// bodies on different worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_long_bodies_keep_their_leases_while_others_end() {
    with_fixture("renewal-many", |fx| async move {
        let lease = Duration::from_millis(300);
        let keys: Vec<String> = (0..50).map(|i| format!("msg-{i}")).collect();
        let mut guards = Vec::new();
        for key in &keys {
            guards.push(fresh(&fx.store, &req("orders", key).with_lease(lease)).await);
        }
        // Half of them fail at once: their leases are released, not renewed.
        for guard in guards.drain(25..) {
            guard.abort().await;
        }
        tokio::time::sleep(lease * 3).await;
        for key in &keys[..25] {
            assert_in_progress(&fx.store, &req("orders", key).with_lease(lease)).await;
        }
        for key in &keys[25..] {
            assert_eq!(fx.raw("orders", key).await, None, "{key}: a released lease came back");
        }
        for guard in guards {
            guard.complete(Some("1".into())).await.unwrap();
        }
        for key in &keys[..25] {
            assert_eq!(done(&fx.store, &req("orders", key)).await.as_deref(), Some("1"));
        }
    })
    .await;
}

#[tokio::test]
async fn a_claim_outliving_its_store_keeps_its_lease() {
    // The store (and every clone) dropped while a body still runs: its
    // lease is still renewed until the guard ends.
    with_fixture("renewal-dropped", |fx| async move {
        let store = RedisStore::builder(fx.conn.clone()).prefix(&fx.prefix).build().unwrap();
        let lease = Duration::from_millis(300);
        let r = req("orders", "msg-1").with_lease(lease);
        let guard = fresh(&store, &r).await;
        drop(store);
        tokio::time::sleep(lease * 2).await;
        assert_in_progress(&fx.store, &r).await;
        guard.complete(None).await.unwrap();
        assert!(done(&fx.store, &r).await.is_none());
    })
    .await;
}

#[test]
fn a_store_used_on_a_second_runtime_still_renews() {
    // A store (and its connection manager) made on one runtime, that runtime
    // shut down, the store then used on another, as tools and tests that
    // build a runtime per job do: the renewal task, which died with the
    // first runtime, runs again on the second.
    let first = tokio::runtime::Runtime::new().unwrap();
    let fx: &'static Fixture = first.block_on(async { Box::leak(Box::new(Fixture::new("renewal-runtimes").await)) });
    first.block_on(async {
        let guard = fresh(&fx.store, &req("orders", "first")).await;
        guard.complete(None).await.unwrap();
    });
    drop(first);
    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let lease = Duration::from_millis(300);
        let r = req("orders", "second").with_lease(lease);
        // The connection manager's connection died with the first runtime:
        // its first command fails and it reconnects.
        let mut attempts = 0;
        let guard = loop {
            attempts += 1;
            match fx.store.claim(&r).await {
                Ok(Claim::Fresh(guard)) => break guard,
                Err(Error::Store(_)) if attempts < 20 => tokio::time::sleep(Duration::from_millis(50)).await,
                Ok(Claim::Done(_)) => panic!("expected a fresh claim, got a replay"),
                Err(error) => panic!("expected a fresh claim, got {error}"),
            }
        };
        let start = Instant::now();
        while start.elapsed() < lease * 3 {
            assert_in_progress(&fx.store, &r).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        guard.complete(None).await.unwrap();
        fx.cleanup().await;
    });
}

#[tokio::test]
async fn a_crashed_consumers_lease_expires() {
    with_fixture("crash", |fx| async move {
        let crashing = fx.without_renewal();
        let r = req("orders", "msg-1").with_lease(Duration::from_millis(300));
        // A crash: no completion, no release, no renewal.
        std::mem::forget(fresh(&crashing, &r).await);
        assert_in_progress(&fx.store, &r).await;

        let guard = eventually_fresh(&fx.store, &r, Duration::from_secs(3)).await;
        guard.complete(Some("\"again\"".into())).await.unwrap();
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some("\"again\""));
    })
    .await;
}

#[tokio::test]
async fn scopes_and_keys_never_collide() {
    with_fixture("encoding", |fx| async move {
        let pairs = [
            ("a:b", "c"),
            ("a", "b:c"),
            ("a", "1:a:b:c"),
            ("3:a", "b"),
            ("a*?[", "ü 💳\n\""),
        ];
        let keys: std::collections::HashSet<_> = pairs.iter().map(|(s, k)| fx.store.redis_key(s, k)).collect();
        assert_eq!(keys.len(), pairs.len());

        for (i, (scope, key)) in pairs.iter().enumerate() {
            fresh(&fx.store, &req(scope, key))
                .await
                .complete(Some(i.to_string()))
                .await
                .unwrap();
        }
        for (i, (scope, key)) in pairs.iter().enumerate() {
            assert_eq!(
                done(&fx.store, &req(scope, key)).await,
                Some(i.to_string()),
                "{scope:?} {key:?}"
            );
        }
        // The same key in two scopes keeps two markers.
        fresh(&fx.store, &req("other", "c")).await.abort().await;
    })
    .await;
}

#[tokio::test]
async fn a_completed_marker_expires_after_its_ttl() {
    with_fixture("ttl", |fx| async move {
        let r = Request::new("orders", "msg-1")
            .unwrap()
            .with_ttl(Duration::from_millis(300));
        fresh(&fx.store, &r).await.complete(Some("1".into())).await.unwrap();
        assert_eq!(done(&fx.store, &r).await.as_deref(), Some("1"));
        eventually_fresh(&fx.store, &r, Duration::from_secs(3))
            .await
            .abort()
            .await;
        assert_eq!(fx.store.purge_expired().await.unwrap(), 0);
    })
    .await;
}

#[tokio::test]
async fn a_foreign_value_under_the_prefix_is_a_store_error() {
    with_fixture("foreign", |fx| async move {
        let key = fx.store.redis_key("orders", "msg-1");
        let _: () = fx.conn.clone().set_ex(&key, "something else", 60).await.unwrap();
        let err = fx.store.claim(&req("orders", "msg-1")).await.unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{err:?}");
    })
    .await;
}

#[tokio::test]
async fn the_prefix_is_validated() {
    let conn = manager().await;
    assert_eq!(RedisStore::new(conn.clone()).prefix(), "idempotent:");
    assert_eq!(
        RedisStore::builder(conn.clone()).build().unwrap().prefix(),
        "idempotent:"
    );
    for bad in [String::new(), "x".repeat(129), "has space:".into(), "ctl\n".into()] {
        let err = RedisStore::builder(conn.clone())
            .prefix(bad.clone())
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{bad:?}: {err:?}");
    }
    let store = RedisStore::builder(conn).prefix("app:idem:").build().unwrap();
    assert_eq!(store.redis_key("a:b", "c"), "app:idem:3:a:b:c");
    assert_eq!(store.redis_key("a", "b:c"), "app:idem:1:a:b:c");
}

/// The same store behind `#[idempotent]`: replay, a concurrent duplicate,
/// renewal of a body longer than its lease, and a failure that releases.
mod through_the_attribute {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Consumer {
        store: RedisStore,
        runs: AtomicUsize,
    }

    impl Consumer {
        #[idempotent_runtime::idempotent(key = msg_id, store = self.store, scope = "charge", lease = "300ms", ttl = "1m")]
        async fn charge(&self, msg_id: &str, amount: u64, body: Duration) -> Result<u64, Error> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(body).await;
            if amount == 0 {
                return Err(Error::Config("nothing to charge".into()));
            }
            Ok(amount * 2)
        }
    }

    #[tokio::test]
    async fn handlers_on_a_redis_store() {
        with_fixture("attribute", |fx| async move {
            let consumer: &'static Consumer = Box::leak(Box::new(Consumer {
                store: fx.store.clone(),
                runs: AtomicUsize::new(0),
            }));
            let quick = Duration::ZERO;

            assert_eq!(consumer.charge("m-1", 21, quick).await.unwrap(), 42);
            assert_eq!(consumer.charge("m-1", 21, quick).await.unwrap(), 42);
            assert_eq!(consumer.runs.load(Ordering::SeqCst), 1);

            // A body three times its lease keeps the claim while a duplicate arrives.
            let long = tokio::spawn(consumer.charge("m-2", 5, Duration::from_millis(900)));
            tokio::time::sleep(Duration::from_millis(600)).await;
            assert!(matches!(
                consumer.charge("m-2", 5, quick).await,
                Err(Error::InProgress { .. })
            ));
            assert_eq!(long.await.unwrap().unwrap(), 10);
            assert_eq!(consumer.charge("m-2", 5, quick).await.unwrap(), 10);
            assert_eq!(consumer.runs.load(Ordering::SeqCst), 2);

            // A failed body releases its claim: the redelivery runs again.
            assert!(consumer.charge("m-3", 0, quick).await.is_err());
            assert!(consumer.charge("m-3", 0, quick).await.is_err());
            assert_eq!(consumer.runs.load(Ordering::SeqCst), 4);
        })
        .await;
    }
}
