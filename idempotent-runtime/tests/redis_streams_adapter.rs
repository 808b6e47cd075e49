//! The Redis Streams adapter against the real server (127.0.0.1:6379): what
//! is particular to consumer groups. The behaviour every broker shares is
//! in the root package's `tests/broker_conformance.rs`.
#![cfg(feature = "redis-streams")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::MemoryStore;
use idempotent_runtime::broker::{CancellationToken, HEADER_KIND, HEADER_REASON};
use idempotent_runtime::redis::{self, AsyncCommands};
use idempotent_runtime::redis_streams::{StreamConsumer, StreamConsumerBuilder};

const REDIS_URL: &str = "redis://127.0.0.1:6379/";
const WAIT: Duration = Duration::from_secs(15);

struct Fixture {
    client: redis::Client,
    conn: redis::aio::MultiplexedConnection,
    stream: String,
    dlq: String,
}

impl Fixture {
    async fn new(name: &str) -> Fixture {
        use std::hash::{BuildHasher, Hasher};
        let client = redis::Client::open(REDIS_URL).unwrap();
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis at 127.0.0.1:6379");
        let id = std::hash::RandomState::new().build_hasher().finish();
        let stream = format!("idem.test.{name}.{id:016x}");
        let dlq = format!("{stream}.dlq");
        Fixture {
            client,
            conn,
            stream,
            dlq,
        }
    }

    fn builder(&self, consumer: &str) -> StreamConsumerBuilder {
        StreamConsumer::builder(self.client.clone(), &self.stream, "workers")
            .consumer_name(consumer)
            .claim_idle(Duration::from_millis(400))
            .block(Duration::from_millis(200))
            .shutdown_timeout(Duration::from_secs(2))
    }

    async fn add(&self, fields: &[(&str, &str)]) -> String {
        let mut conn = self.conn.clone();
        conn.xadd(&self.stream, "*", fields).await.unwrap()
    }

    async fn dead_letters(&self) -> Vec<redis::streams::StreamId> {
        let mut conn = self.conn.clone();
        let reply: redis::streams::StreamRangeReply = conn.xrange_all(&self.dlq).await.unwrap();
        reply.ids
    }

    /// `(consumer, times delivered)` of a pending entry.
    async fn pending(&self, id: &str) -> Option<(String, usize)> {
        let mut conn = self.conn.clone();
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg("workers")
            .arg(id)
            .arg(id)
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap();
        reply.ids.first().map(|p| (p.consumer.clone(), p.times_delivered))
    }

    async fn cleanup(self) {
        let mut conn = self.conn.clone();
        let _: () = conn.del(&[&self.stream, &self.dlq]).await.unwrap();
    }
}

fn field(entry: &redis::streams::StreamId, name: &str) -> String {
    match entry.map.get(name) {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("field {name}: {other:?}"),
    }
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[derive(serde::Deserialize)]
struct Payment {
    message_id: String,
}

/// A handler whose body counts its runs.
#[idempotent_runtime::idempotent(key = "msg.message_id", store = store, scope = "streams.pay")]
async fn pay(store: &MemoryStore, calls: &AtomicUsize, msg: &Payment) -> Result<(), idempotent_runtime::Error> {
    calls.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_lost_its_entry_cannot_settle_it() {
    // While A's handler runs, another consumer takes the entry over (as
    // XAUTOCLAIM would after a long pause). A's ack must not remove the
    // entry from under its new owner.
    let fx = Fixture::new("fence").await;
    let id = fx
        .add(&[("message_id", "fence-1"), ("body", r#"{"message_id":"fence-1"}"#)])
        .await;
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let consumer = fx.builder("a").build().unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let (s, r) = (Arc::clone(&started), Arc::clone(&release));
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            let (started, release) = (Arc::clone(&s), Arc::clone(&r));
            async move {
                started.notify_one();
                release.notified().await;
                Ok::<(), String>(())
            }
        },
        shutdown.clone(),
    ));
    tokio::time::timeout(WAIT, started.notified()).await.unwrap();
    let mut conn = fx.conn.clone();
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(&fx.stream)
        .arg("workers")
        .arg("b")
        .arg(0)
        .arg(&id)
        .query_async(&mut conn)
        .await
        .unwrap();
    release.notify_one();
    wait_until("A's settlement", || stats.snapshot().ack_failures == 1).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(stats.snapshot().acked, 0);
    assert_eq!(fx.pending(&id).await.map(|p| p.0), Some("b".to_owned()), "still B's");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_its_consumers_kept_dying_on_is_dead_lettered_without_running() {
    let fx = Fixture::new("crashloop").await;
    let id = fx
        .add(&[("message_id", "loop-1"), ("body", r#"{"message_id":"loop-1"}"#)])
        .await;
    // Consumers that took it and died, three times.
    let mut conn = fx.conn.clone();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&fx.stream)
        .arg("workers")
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg("ghost")
        .arg("STREAMS")
        .arg(&fx.stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    for _ in 0..2 {
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(&fx.stream)
            .arg("workers")
            .arg("ghost")
            .arg(0)
            .arg(&id)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    assert_eq!(fx.pending(&id).await.map(|p| p.1), Some(3));
    // The handler is only called to check that its key was not processed.
    let calls = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let consumer = fx.builder("survivor").max_attempts(3).build().unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let (store, calls) = (store.clone(), Arc::clone(&handler_calls));
            async move { pay(&store, &calls, &msg).await }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "its body not run on a delivery past max_attempts"
    );
    let dead = fx.dead_letters().await;
    assert_eq!(field(&dead[0], HEADER_KIND), "exhausted");
    assert!(field(&dead[0], HEADER_REASON).contains("without being settled"));
    assert_eq!(fx.pending(&id).await, None, "acknowledged");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_without_a_body_is_poison_and_dead_letters_can_be_trimmed() {
    let fx = Fixture::new("nobody").await;
    for i in 0..5 {
        fx.add(&[("message_id", &format!("nobody-{i}")), ("payload", "{}")])
            .await;
    }
    let consumer = fx.builder("a").dead_letter_max_len(2).build().unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(|_: Payment| async { Ok::<(), String>(()) }, shutdown.clone()));
    wait_until("5 poison", || stats.snapshot().poison == 5).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 2, "trimmed to the last 2");
    let last = dead.last().unwrap();
    assert_eq!(field(last, HEADER_KIND), "poison");
    assert!(field(last, HEADER_REASON).contains("has no `body` field"));
    assert_eq!(field(last, "payload"), "{}", "the entry's fields are kept");
    fx.cleanup().await;
}
