//! The NATS JetStream adapter against the real server (127.0.0.1:4222).
//!
//! Every test creates its own stream, dead-letter stream and durable pull
//! consumer with a random suffix and deletes the streams at the end. The
//! handlers are what `#[idempotent]` generates, written out by hand with a
//! `MemoryStore`: claim the message id, apply the effect, complete the
//! marker; a duplicate is skipped.
#![cfg(feature = "nats")]

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use idempotent_runtime::async_nats::jetstream::message::StreamMessage;
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::async_nats::{self, HeaderMap};
use idempotent_runtime::nats::{
    Backoff, CancellationToken, ConsumerStats, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, JetStreamConsumer,
};
use idempotent_runtime::{Claim, Guard, MemoryStore, Request, Store};
use serde::{Deserialize, Serialize};

const NATS_URL: &str = "127.0.0.1:4222";
const WAIT: Duration = Duration::from_secs(15);

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    message_id: String,
    amount: i64,
}

fn suffix() -> String {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    format!("{:016x}", hasher.finish())
}

/// The idempotent side of a handler, as `#[idempotent(key = "msg.message_id")]`
/// would run it on a lease store: claim, effect, complete.
#[derive(Clone, Default)]
struct Ledger {
    store: MemoryStore,
    effects: Arc<Mutex<HashMap<String, u32>>>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

impl Ledger {
    async fn process(&self, id: &str) -> Result<bool, idempotent_runtime::Error> {
        *self.calls.lock().unwrap().entry(id.to_owned()).or_default() += 1;
        let req = Request::new("payments", id)?;
        match self.store.claim(&req).await? {
            Claim::Fresh(guard) => {
                *self.effects.lock().unwrap().entry(id.to_owned()).or_default() += 1;
                guard.complete(None).await?;
                Ok(true)
            }
            Claim::Done(_) => Ok(false),
        }
    }

    fn effects(&self) -> HashMap<String, u32> {
        self.effects.lock().unwrap().clone()
    }

    fn calls(&self) -> HashMap<String, u32> {
        self.calls.lock().unwrap().clone()
    }
}

struct Fixture {
    js: jetstream::Context,
    stream: String,
    dlq_stream: String,
    subject: String,
    dlq_subject: String,
}

impl Fixture {
    async fn new(name: &str) -> Fixture {
        let js = connect().await;
        let id = suffix();
        let stream = format!("IDEM_TEST_{}_{id}", name.to_uppercase());
        let subject = format!("idem_test.{name}.{id}.in");
        let dlq_subject = format!("idem_test.{name}.{id}.dlq");
        let dlq_stream = format!("{stream}_DLQ");
        for (name, subject) in [(&stream, &subject), (&dlq_stream, &dlq_subject)] {
            js.create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        }
        Fixture {
            js,
            stream,
            dlq_stream,
            subject,
            dlq_subject,
        }
    }

    /// A durable explicit-ack pull consumer on the stream.
    async fn consumer(&self, ack_wait: Duration, max_deliver: i64) -> PullConsumer {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let config = pull::Config {
            durable_name: Some("worker".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            max_deliver,
            ..Default::default()
        };
        stream.get_or_create_consumer("worker", config).await.unwrap()
    }

    async fn publish(&self, body: &[u8], message_id: &str) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", message_id);
        self.js
            .publish_with_headers(self.subject.clone(), headers, body.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    async fn publish_payment(&self, id: &str, amount: i64) {
        let body = serde_json::to_vec(&Payment {
            message_id: id.to_owned(),
            amount,
        })
        .unwrap();
        self.publish(&body, id).await;
    }

    /// (pending, ack pending) of the consumer.
    async fn backlog(&self) -> (u64, usize) {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let info = stream.consumer_info("worker").await.unwrap();
        (info.num_pending, info.num_ack_pending)
    }

    async fn dead_letters(&self) -> Vec<StreamMessage> {
        let mut stream = self.js.get_stream(&self.dlq_stream).await.unwrap();
        let count = stream.info().await.unwrap().state.messages;
        let mut out = Vec::new();
        for seq in 1..=count {
            out.push(stream.get_raw_message(seq).await.unwrap());
        }
        out
    }

    async fn cleanup(self) {
        for name in [&self.stream, &self.dlq_stream] {
            self.js.delete_stream(name).await.unwrap();
        }
    }
}

async fn connect() -> jetstream::Context {
    jetstream::new(async_nats::connect(NATS_URL).await.expect("NATS at 127.0.0.1:4222"))
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn header(msg: &StreamMessage, name: &str) -> String {
    msg.headers
        .get(name)
        .unwrap_or_else(|| panic!("header {name} missing"))
        .as_str()
        .to_owned()
}

fn fast_retries() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_handler_acks_and_nothing_is_pending() {
    let fx = Fixture::new("ok").await;
    for i in 0..3 {
        fx.publish_payment(&format!("ok-{i}"), 10).await;
    }
    let ledger = Ledger::default();
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(5), -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .concurrency(2)
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_ledger = ledger.clone();
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = handler_ledger.clone();
            async move { ledger.process(&msg.message_id).await }
        },
        shutdown.clone(),
    ));
    wait_until("3 acks", || stats.snapshot().acked == 3).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();

    assert_eq!(
        (stats.received, stats.acked, stats.failed, stats.dead_lettered),
        (3, 3, 0, 0)
    );
    assert_eq!(ledger.effects().len(), 3);
    assert_eq!(fx.backlog().await, (0, 0), "nothing pending, nothing awaiting an ack");
    assert!(fx.dead_letters().await.is_empty());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_dying_after_commit_before_ack_gets_redelivery_acked_once() {
    let fx = Fixture::new("crash").await;
    fx.publish_payment("crash-1", 42).await;
    let ledger = Ledger::default();
    let ack_wait = Duration::from_secs(1);

    // Consumer A, on its own connection: the handler commits marker and
    // effect, then the process "dies" before the adapter acks.
    let js_a = connect().await;
    let consumer_a = JetStreamConsumer::builder(js_a.clone(), fx.consumer(ack_wait, -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .build()
        .unwrap();
    let committed = Arc::new(tokio::sync::Notify::new());
    let (ledger_a, committed_a) = (ledger.clone(), Arc::clone(&committed));
    let run_a = tokio::spawn(consumer_a.run(
        move |msg: Payment| {
            let (ledger, committed) = (ledger_a.clone(), Arc::clone(&committed_a));
            async move {
                assert!(ledger.process(&msg.message_id).await?);
                committed.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, idempotent_runtime::Error>(())
            }
        },
        CancellationToken::new(),
    ));
    tokio::time::timeout(WAIT, committed.notified())
        .await
        .expect("A committed");
    run_a.abort(); // the process dies: its tasks stop, nothing is acked
    assert!(run_a.await.unwrap_err().is_cancelled());
    drop(js_a);
    assert_eq!(ledger.effects().get("crash-1"), Some(&1));

    // Consumer B gets the redelivery after ack_wait; the store recognises it.
    let seen: Arc<Mutex<Vec<(DeliveryInfo, bool)>>> = Arc::default();
    let consumer_b = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(ack_wait, -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats_b = consumer_b.stats();
    let shutdown = CancellationToken::new();
    let (ledger_b, seen_b) = (ledger.clone(), Arc::clone(&seen));
    let run_b = tokio::spawn(consumer_b.run_with_info(
        move |msg: Payment, info: DeliveryInfo| {
            let (ledger, seen) = (ledger_b.clone(), Arc::clone(&seen_b));
            async move {
                let fresh = ledger.process(&msg.message_id).await?;
                seen.lock().unwrap().push((info, fresh));
                Ok::<_, idempotent_runtime::Error>(())
            }
        },
        shutdown.clone(),
    ));
    wait_until("the redelivery to be acked", || stats_b.snapshot().acked == 1).await;
    shutdown.cancel();
    let stats_b = run_b.await.unwrap().unwrap();

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let (info, fresh) = &seen[0];
    assert!(info.redelivered);
    assert_eq!(info.attempt, 2, "JetStream counts the lost delivery");
    assert_eq!(info.message_id.as_deref(), Some("crash-1"));
    assert!(!fresh, "the redelivery is a duplicate for the store");
    assert_eq!(ledger.calls().get("crash-1"), Some(&2));
    assert_eq!(ledger.effects().get("crash-1"), Some(&1), "the effect stayed single");
    assert_eq!(stats_b.acked, 1);
    assert_eq!(fx.backlog().await, (0, 0));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_handler_ends_in_dead_letter_subject_after_max_deliver() {
    let fx = Fixture::new("fail").await;
    let body = br#"{"message_id":"fail-1","amount":7}"#;
    fx.publish(body, "fail-1").await;
    let calls = Arc::new(AtomicUsize::new(0));
    // The consumer's max_deliver (3) caps the builder's 10 attempts.
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(5), 3).await)
        .dead_letter_subject(&fx.dlq_subject)
        .max_attempts(10)
        .retry_backoff(fast_retries())
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    assert_eq!(consumer.max_attempts(), 3);
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run_with_info(
        move |_: Payment, info: DeliveryInfo| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            async move { Err::<(), _>(format!("payment gateway down\n(attempt {})", info.attempt)) }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();

    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        (
            stats.received,
            stats.failed,
            stats.retried,
            stats.dead_lettered,
            stats.acked
        ),
        (3, 3, 2, 1, 0)
    );
    assert_eq!(fx.backlog().await, (0, 0), "terminated, not pending");
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    let dead = &dead[0];
    assert_eq!(&dead.payload[..], body, "body intact");
    assert_eq!(header(dead, "Nats-Msg-Id"), "fail-1");
    assert_eq!(
        header(dead, HEADER_REASON),
        "payment gateway down (attempt 3)",
        "newlines flattened"
    );
    assert_eq!(header(dead, HEADER_KIND), "exhausted");
    assert_eq!(header(dead, HEADER_ATTEMPTS), "3");
    assert_eq!(header(dead, HEADER_SOURCE), format!("{}/worker", fx.stream));
    assert_eq!(header(dead, "x-idempotent-subject"), fx.subject);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_errors_are_dead_lettered_at_once() {
    let fx = Fixture::new("permanent").await;
    fx.publish_payment("permanent-1", 1).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(5), -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .retry_backoff(fast_retries())
        .retry_if(|err: &idempotent_runtime::Error| err.is_transient())
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            async {
                Err::<(), _>(idempotent_runtime::Error::MissingKey {
                    scope: "payments".into(),
                })
            }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();

    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let dead = fx.dead_letters().await;
    assert_eq!(header(&dead[0], HEADER_KIND), "rejected");
    assert_eq!(header(&dead[0], HEADER_ATTEMPTS), "1");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_consumer_keeps_going() {
    let fx = Fixture::new("poison").await;
    fx.publish(b"{not json", "bad-json").await;
    fx.publish(br#"{"amount":5}"#, "no-key").await;
    fx.publish_payment("good-1", 5).await;
    let ledger = Ledger::default();
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(5), -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .concurrency(1)
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_ledger = ledger.clone();
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = handler_ledger.clone();
            async move { ledger.process(&msg.message_id).await }
        },
        shutdown.clone(),
    ));
    wait_until("2 poison + 1 ack", || {
        let s = stats.snapshot();
        s.poison == 2 && s.acked == 1
    })
    .await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();

    assert_eq!((stats.received, stats.poison, stats.acked, stats.failed), (3, 2, 1, 0));
    assert_eq!(ledger.calls().len(), 1, "the handler only saw the good message");
    assert_eq!(fx.backlog().await, (0, 0));
    let dead = fx.dead_letters().await;
    let by_id: HashMap<String, &StreamMessage> = dead.iter().map(|m| (header(m, "Nats-Msg-Id"), m)).collect();
    let bad_json = by_id["bad-json"];
    assert_eq!(&bad_json.payload[..], b"{not json");
    assert_eq!(header(bad_json, HEADER_KIND), "poison");
    assert!(header(bad_json, HEADER_REASON).contains("cannot decode JSON body"));
    assert_eq!(header(bad_json, HEADER_ATTEMPTS), "0");
    let no_key = by_id["no-key"];
    assert_eq!(&no_key.payload[..], br#"{"amount":5}"#);
    assert!(header(no_key, HEADER_REASON).contains("missing field `message_id`"));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_loses_nothing_and_applies_nothing_twice() {
    const N: usize = 24;
    let fx = Fixture::new("shutdown").await;
    for i in 0..N {
        fx.publish_payment(&format!("msg-{i:02}"), i as i64).await;
    }
    let ledger = Ledger::default();
    let in_flight = Arc::new(AtomicUsize::new(0));

    let start = |ledger: Ledger, in_flight: Arc<AtomicUsize>, pull: PullConsumer| {
        let consumer = JetStreamConsumer::builder(fx.js.clone(), pull)
            .dead_letter_subject(&fx.dlq_subject)
            .concurrency(4)
            .fetch_expiry(Duration::from_millis(300))
            .build()
            .unwrap();
        let stats: ConsumerStats = consumer.stats();
        let shutdown = CancellationToken::new();
        let run = tokio::spawn(consumer.run(
            move |msg: Payment| {
                let (ledger, in_flight) = (ledger.clone(), Arc::clone(&in_flight));
                async move {
                    in_flight.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let result = ledger.process(&msg.message_id).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    result
                }
            },
            shutdown.clone(),
        ));
        (stats, shutdown, run)
    };

    // A long ack_wait: a message lost by the shutdown would not come back
    // within the test.
    let ack_wait = Duration::from_secs(30);
    let (_, shutdown_a, run_a) = start(ledger.clone(), Arc::clone(&in_flight), fx.consumer(ack_wait, -1).await);
    wait_until("some progress with handlers in flight", || {
        ledger.calls().len() >= 6 && in_flight.load(Ordering::SeqCst) > 0
    })
    .await;
    shutdown_a.cancel();
    let stats_a = tokio::time::timeout(WAIT, run_a)
        .await
        .expect("A stops promptly")
        .unwrap()
        .unwrap();
    assert_eq!(
        in_flight.load(Ordering::SeqCst),
        0,
        "in-flight handlers finished before run returned"
    );
    let calls_a: u32 = ledger.calls().values().sum();
    assert_eq!(stats_a.acked, u64::from(calls_a), "every handler A started was acked");
    assert!(stats_a.acked < N as u64, "stopped mid-way");
    assert_eq!(fx.backlog().await.1, 0, "A left nothing awaiting an ack");

    let (stats_b, shutdown_b, run_b) = start(ledger.clone(), Arc::clone(&in_flight), fx.consumer(ack_wait, -1).await);
    wait_until("all effects", || ledger.effects().len() == N).await;
    wait_until("all acks", || stats_a.acked + stats_b.snapshot().acked == N as u64).await;
    shutdown_b.cancel();
    let stats_b = run_b.await.unwrap().unwrap();

    let effects = ledger.effects();
    assert_eq!(effects.len(), N, "none lost");
    assert!(effects.values().all(|&n| n == 1), "none applied twice: {effects:?}");
    let calls = ledger.calls();
    assert!(calls.values().all(|&n| n == 1), "no acked message came back: {calls:?}");
    assert_eq!(stats_a.acked + stats_b.acked, N as u64);
    assert_eq!(fx.backlog().await, (0, 0));
    fx.cleanup().await;
}
