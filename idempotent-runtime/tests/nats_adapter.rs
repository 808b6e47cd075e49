//! The NATS JetStream adapter against the real server (127.0.0.1:4222).
//!
//! Every test creates its own stream, dead-letter stream and durable pull
//! consumer with a random suffix and deletes the streams at the end. The
//! handlers are what `#[idempotent]` generates, written out by hand with a
//! `MemoryStore`: claim the message id, apply the effect, complete the
//! marker; a duplicate is skipped.
#![cfg(feature = "nats")]

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::MemoryStore;
use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use idempotent_runtime::async_nats::jetstream::message::StreamMessage;
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::async_nats::{self, HeaderMap};
use idempotent_runtime::broker::{
    Backoff, CancellationToken, ConsumerError, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_MSG_ID,
    HEADER_REASON, HEADER_SOURCE,
};
use idempotent_runtime::nats::JetStreamConsumer;
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

struct Fixture {
    js: jetstream::Context,
    stream: String,
    dlq_stream: String,
    subject: String,
    dlq_subject: String,
}

/// Where the dead letters go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Topology {
    /// A stream of their own.
    OwnStream,
    /// The consumed stream also captures the dead-letter subject (the
    /// consumer's filter leaves it out).
    InputStream,
}

impl Fixture {
    async fn new(name: &str) -> Fixture {
        Fixture::with(name, Topology::OwnStream, None).await
    }

    /// Streams in `topology`; the input stream's duplicate window is
    /// `window` when given (the server's 2 minutes otherwise).
    async fn with(name: &str, topology: Topology, window: Option<Duration>) -> Fixture {
        let js = connect().await;
        let id = suffix();
        let stream = format!("IDEM_TEST_{}_{id}", name.to_uppercase());
        let subject = format!("idem_test.{name}.{id}.in");
        let dlq_subject = format!("idem_test.{name}.{id}.dlq");
        let (dlq_stream, input_subjects) = match topology {
            Topology::OwnStream => (format!("{stream}_DLQ"), vec![subject.clone()]),
            Topology::InputStream => (stream.clone(), vec![subject.clone(), dlq_subject.clone()]),
        };
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: input_subjects,
            duplicate_window: window.unwrap_or_default(),
            ..Default::default()
        })
        .await
        .unwrap();
        if topology == Topology::OwnStream {
            js.create_stream(stream::Config {
                name: dlq_stream.clone(),
                subjects: vec![dlq_subject.clone()],
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

    /// A durable explicit-ack pull consumer `name` on the stream, filtered
    /// on `filter` (empty: every subject of the stream).
    async fn consumer_named(&self, name: &str, filter: &str, ack_wait: Duration, max_deliver: i64) -> PullConsumer {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let config = pull::Config {
            durable_name: Some(name.into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            max_deliver,
            filter_subject: filter.into(),
            ..Default::default()
        };
        stream.get_or_create_consumer(name, config).await.unwrap()
    }

    /// The durable explicit-ack pull consumer `worker`, filtered on the
    /// input subject.
    async fn consumer(&self, ack_wait: Duration, max_deliver: i64) -> PullConsumer {
        self.consumer_named("worker", &self.subject.clone(), ack_wait, max_deliver)
            .await
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

    /// The messages stored on the dead-letter subject.
    async fn dead_letters(&self) -> Vec<StreamMessage> {
        let mut stream = self.js.get_stream(&self.dlq_stream).await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(msg) = stream.get_raw_message(seq).await
                && msg.subject.as_str() == self.dlq_subject
            {
                out.push(msg);
            }
        }
        out
    }

    async fn cleanup(self) {
        self.js.delete_stream(&self.stream).await.unwrap();
        if self.dlq_stream != self.stream {
            self.js.delete_stream(&self.dlq_stream).await.unwrap();
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
async fn failing_handler_ends_in_dead_letter_subject_after_max_deliver() {
    let fx = Fixture::new("fail").await;
    let body = br#"{"message_id":"fail-1","amount":7}"#;
    fx.publish(body, "fail-1").await;
    let calls = Arc::new(AtomicUsize::new(0));
    // The consumer's max_deliver (4) caps the builder's 10 attempts at 3:
    // its last delivery is kept for settling.
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(5), 4).await)
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
    assert_eq!(header(dead, HEADER_MSG_ID), "fail-1", "the original's id, kept aside");
    assert!(
        header(dead, "Nats-Msg-Id").starts_with("idempotent-dead-letter-"),
        "the dead letter's own id"
    );
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

/// Runs a consumer whose handler always fails with a permanent error, until
/// `dead` dead letters were published; returns the handler calls.
async fn dead_letter_all(fx: &Fixture, consumer: PullConsumer, dead: u64) -> usize {
    let calls = Arc::new(AtomicUsize::new(0));
    let consumer = JetStreamConsumer::builder(fx.js.clone(), consumer)
        .dead_letter_subject(&fx.dlq_subject)
        .retry_if(|_: &String| false)
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>("refused".to_owned()) }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letters", || stats.snapshot().dead_lettered == dead).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    calls.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_captured_by_the_input_stream_are_stored_not_deduplicated() {
    // docs/brokers.md allows the dead-letter subject in the consumed stream when
    // the consumer's filter leaves it out. The dead letter of a message
    // carrying `Nats-Msg-Id` used to copy that id: the stream, which has
    // just stored the original under it, acked the dead letter as a
    // duplicate, the adapter terminated the original, and the message was
    // gone.
    let fx = Fixture::with("inside", Topology::InputStream, None).await;
    fx.publish_payment("inside-1", 3).await;
    let calls = dead_letter_all(&fx, fx.consumer(Duration::from_secs(5), -1).await, 1).await;
    assert_eq!(calls, 1);
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1, "the dead letter is in the stream");
    assert_eq!(header(&dead[0], HEADER_MSG_ID), "inside-1");
    assert_eq!(header(&dead[0], HEADER_KIND), "rejected");
    assert_eq!(
        serde_json::from_slice::<Payment>(&dead[0].payload).unwrap().message_id,
        "inside-1"
    );
    assert_eq!(fx.backlog().await, (0, 0));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_messages_with_one_id_are_both_dead_lettered() {
    // Two messages under one `Nats-Msg-Id` (published further apart than the
    // input stream's duplicate window) both fail: both dead letters must be
    // stored, though the dead-letter stream's window is 2 minutes.
    let fx = Fixture::with("reused", Topology::OwnStream, Some(Duration::from_millis(200))).await;
    fx.publish(br#"{"message_id":"reused-1","amount":1}"#, "same-id").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    fx.publish(br#"{"message_id":"reused-1","amount":2}"#, "same-id").await;
    let calls = dead_letter_all(&fx, fx.consumer(Duration::from_secs(5), -1).await, 2).await;
    assert_eq!(calls, 2);
    let mut amounts: Vec<i64> = fx
        .dead_letters()
        .await
        .iter()
        .map(|m| serde_json::from_slice::<Payment>(&m.payload).unwrap().amount)
        .collect();
    amounts.sort();
    assert_eq!(amounts, [1, 2], "both dead letters stored");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_of_one_stream_each_dead_letter_the_message() {
    let fx = Fixture::new("fanout").await;
    fx.publish_payment("fanout-1", 1).await;
    let subject = fx.subject.clone();
    for name in ["billing", "shipping"] {
        let consumer = fx.consumer_named(name, &subject, Duration::from_secs(5), -1).await;
        assert_eq!(dead_letter_all(&fx, consumer, 1).await, 1);
    }
    let mut sources: Vec<String> = fx
        .dead_letters()
        .await
        .iter()
        .map(|m| header(m, HEADER_SOURCE))
        .collect();
    sources.sort();
    assert_eq!(
        sources,
        [format!("{}/billing", fx.stream), format!("{}/shipping", fx.stream)],
        "one dead letter per consumer"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_would_read_its_own_dead_letters_is_refused() {
    let fx = Fixture::with("loop", Topology::InputStream, None).await;
    for filter in [String::new(), "idem_test.>".to_owned()] {
        let name = if filter.is_empty() { "all" } else { "wide" };
        let consumer = fx.consumer_named(name, &filter, Duration::from_secs(5), -1).await;
        let runner = JetStreamConsumer::builder(fx.js.clone(), consumer)
            .dead_letter_subject(&fx.dlq_subject)
            .build()
            .unwrap();
        let err = runner
            .run(|_: Payment| async { Ok::<(), String>(()) }, CancellationToken::new())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ConsumerError::Config(text) if text.contains("its own dead letters")),
            "{err}"
        );
    }
    fx.cleanup().await;
}

/// A handler whose body never ends.
#[idempotent_runtime::idempotent(key = "msg.message_id", store = store, scope = "nats.hang")]
async fn hang(store: &MemoryStore, calls: &AtomicUsize, msg: &Payment) -> Result<(), idempotent_runtime::Error> {
    calls.fetch_add(1, Ordering::SeqCst);
    std::future::pending().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_released_before_its_last_delivery_is_still_dead_lettered() {
    // max_deliver 2: the first delivery's handler never finishes and the
    // consumer is stopped (its shutdown timeout abandons the handler). The
    // server delivers the message once more, its last time: it must be
    // dead-lettered then, its body not run and abandoned again (nothing
    // would ever deliver or dead-letter it after that). The handler is only
    // called to check that its key was not processed.
    let fx = Fixture::new("last").await;
    fx.publish_payment("last-1", 1).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let ack_wait = Duration::from_secs(1);
    let start = |calls: Arc<AtomicUsize>, pull: PullConsumer| {
        let consumer = JetStreamConsumer::builder(fx.js.clone(), pull)
            .dead_letter_subject(&fx.dlq_subject)
            .fetch_expiry(Duration::from_millis(300))
            .shutdown_timeout(Duration::from_millis(200))
            .build()
            .unwrap();
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let store = store.clone();
        let run = tokio::spawn(consumer.run(
            move |msg: Payment| {
                let (store, calls) = (store.clone(), Arc::clone(&calls));
                async move { hang(&store, &calls, &msg).await }
            },
            shutdown.clone(),
        ));
        (stats, shutdown, run)
    };
    let (_, shutdown_a, run_a) = start(Arc::clone(&calls), fx.consumer(ack_wait, 2).await);
    wait_until("the first call", || calls.load(Ordering::SeqCst) == 1).await;
    shutdown_a.cancel();
    run_a.await.unwrap().unwrap();

    let (stats_b, shutdown_b, run_b) = start(Arc::clone(&calls), fx.consumer(ack_wait, 2).await);
    wait_until("the dead letter", || stats_b.snapshot().dead_lettered == 1).await;
    shutdown_b.cancel();
    run_b.await.unwrap().unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "its body not run again on its last delivery"
    );
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header(&dead[0], HEADER_KIND), "exhausted");
    assert!(header(&dead[0], HEADER_REASON).contains("without being settled"));
    assert_eq!(fx.backlog().await, (0, 0));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_consumer_settings_are_refused_at_build() {
    let fx = Fixture::new("settings").await;
    let tiny = fx
        .consumer_named("tiny", &fx.subject.clone(), Duration::from_millis(10), -1)
        .await;
    let err = JetStreamConsumer::builder(fx.js.clone(), tiny)
        .dead_letter_subject(&fx.dlq_subject)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("ack_wait"), "{err}");
    let once = fx
        .consumer_named("once", &fx.subject.clone(), Duration::from_secs(5), 1)
        .await;
    let err = JetStreamConsumer::builder(fx.js.clone(), once)
        .dead_letter_subject(&fx.dlq_subject)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max_deliver 1"), "{err}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arriving_during_shutdown_are_handled_without_spending_a_delivery() {
    // An idle consumer has a pull request waiting; shutdown is requested;
    // then messages arrive for that request. Handing them back (`nak`)
    // would spend one of their deliveries (and on a consumer with
    // `max_deliver`, possibly the last); they are handled instead.
    let fx = Fixture::new("late").await;
    let attempts: Arc<Mutex<Vec<u32>>> = Arc::default();
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(30), -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .fetch_expiry(Duration::from_secs(2))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let seen = Arc::clone(&attempts);
    let run = tokio::spawn(consumer.run_with_info(
        move |_: Payment, info: DeliveryInfo| {
            seen.lock().unwrap().push(info.attempt);
            async { Ok::<(), String>(()) }
        },
        shutdown.clone(),
    ));
    // Let the consumer's pull request reach the server, then stop it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    for i in 0..3 {
        fx.publish_payment(&format!("late-{i}"), 1).await;
    }
    let stats_a = run.await.unwrap().unwrap();
    let handled_by_a = stats_a.acked;
    assert_eq!(stats_a.released, 0, "nothing handed back");
    // Whatever the pull request did not carry is still pending, untouched.
    let (pending, ack_pending) = fx.backlog().await;
    assert_eq!(ack_pending, 0);
    assert_eq!(handled_by_a + pending, 3, "handled or still pending: {stats:?}");
    assert!(attempts.lock().unwrap().iter().all(|&a| a == 1), "{attempts:?}");
    fx.cleanup().await;
}

/// A TCP proxy in front of the NATS server that swallows the first `drop`
/// pull requests (`PUB`s to `$JS.API.CONSUMER.MSG.NEXT.*`) its clients send,
/// as nats-server before 2.9.15 could lose one without a `408`; everything
/// else passes both ways unchanged. Returns its address and the number of
/// pull requests that went through.
async fn pull_swallowing_proxy(drop: usize) -> (String, Arc<AtomicUsize>) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (to_drop, passed) = (Arc::new(AtomicUsize::new(drop)), Arc::new(AtomicUsize::new(0)));
    let counted = Arc::clone(&passed);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(NATS_URL).await.unwrap();
            let (client_read, mut client_write) = client.into_split();
            let (server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let mut server_read = server_read;
                let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
            });
            let (to_drop, passed) = (Arc::clone(&to_drop), Arc::clone(&counted));
            tokio::spawn(async move {
                let mut reader = BufReader::new(client_read);
                let mut line = String::new();
                loop {
                    line.clear();
                    if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut frame = line.clone().into_bytes();
                    let words: Vec<&str> = line.split_whitespace().collect();
                    let is_pub = matches!(words.first(), Some(&"PUB") | Some(&"HPUB"));
                    if is_pub {
                        // The payload (and its CRLF) follows the line.
                        let size: usize = words.last().and_then(|w| w.parse().ok()).unwrap_or(0);
                        let mut payload = vec![0; size + 2];
                        if reader.read_exact(&mut payload).await.is_err() {
                            return;
                        }
                        frame.extend_from_slice(&payload);
                        if words
                            .get(1)
                            .is_some_and(|s| s.starts_with("$JS.API.CONSUMER.MSG.NEXT."))
                        {
                            let swallowed = to_drop
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                                .is_ok();
                            if swallowed {
                                continue;
                            }
                            passed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    if server_write.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (address, passed)
}

/// A pull request that the server never ends (no message, no `408`) is
/// given up soon after its expiry and pulled again, not after async-nats's
/// own five seconds more: a message waiting meanwhile is handled well
/// before then, on its first delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_request_lost_at_the_server_is_pulled_again_soon_after_its_expiry() {
    let fx = Fixture::new("lost_pull").await;
    fx.consumer(Duration::from_secs(30), 5).await;
    fx.publish_payment("lost-1", 5).await;
    let (proxy, pulls) = pull_swallowing_proxy(1).await;
    let js = jetstream::new(async_nats::connect(proxy.as_str()).await.unwrap());
    let consumer = js
        .get_stream(&fx.stream)
        .await
        .unwrap()
        .get_consumer::<pull::Config>("worker")
        .await
        .unwrap();
    let consumer = JetStreamConsumer::builder(js, consumer)
        .dead_letter_subject(&fx.dlq_subject)
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let (shutdown, seen) = (CancellationToken::new(), Arc::clone(&attempts));
    let started = tokio::time::Instant::now();
    let run = tokio::spawn(consumer.run_with_info(
        move |payment: Payment, info: DeliveryInfo| {
            seen.lock().unwrap().push((payment.message_id, info.attempt));
            async { Ok::<(), String>(()) }
        },
        shutdown.clone(),
    ));
    wait_until("the message", || stats.snapshot().acked == 1).await;
    let waited = started.elapsed();
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert!(
        waited < Duration::from_secs(3),
        "handled {waited:?} after the start: the lost pull request was waited for until async-nats gave it up"
    );
    assert!(pulls.load(Ordering::SeqCst) >= 1, "a second pull request went out");
    assert_eq!(*attempts.lock().unwrap(), vec![("lost-1".to_owned(), 1)]);
    assert_eq!(fx.backlog().await, (0, 0));
    fx.cleanup().await;
}

/// A handler that fails once with a retry delay longer than
/// `stop_when_idle`: the `-NAK` with delay leaves nothing running in the
/// process while the message waits in the server, and that is not idle.
/// The run returns only after the second attempt succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_when_idle_waits_for_a_retry_that_is_due() {
    let fx = Fixture::new("idle_retry").await;
    fx.publish_payment("idle-retry-1", 1).await;
    let retry_delay = Duration::from_secs(1);
    let consumer = JetStreamConsumer::builder(fx.js.clone(), fx.consumer(Duration::from_secs(30), -1).await)
        .dead_letter_subject(&fx.dlq_subject)
        .max_attempts(3)
        .retry_backoff(Backoff::new(retry_delay, retry_delay))
        .fetch_expiry(Duration::from_millis(200))
        .stop_when_idle(Duration::from_millis(300))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = Arc::clone(&calls);
    let stats = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run_with_info(
            move |_: Payment, info: DeliveryInfo| {
                handler_calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    if info.attempt == 1 {
                        Err("fails once".to_owned())
                    } else {
                        Ok(())
                    }
                }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("stopped when idle")
    .unwrap();
    let backlog = fx.backlog().await;
    fx.cleanup().await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the second attempt ran before the run returned"
    );
    assert_eq!((stats.retried, stats.acked), (1, 1));
    assert_eq!(backlog, (0, 0), "nothing left waiting in the server");
}

/// What [`proxy`] does to the traffic between its clients and the server,
/// besides passing it on.
#[derive(Clone, Default)]
struct Rules {
    /// Cuts the connection, the first time only, when a publish of the
    /// client's carries this (its frame is not passed on).
    cut_on: Option<&'static str>,
    /// After the client's first publish to this subject, holds what the
    /// server sends for this long.
    hold_after_publish_to: Option<(String, Duration)>,
}

/// A TCP proxy in front of the NATS server (see [`Rules`]).
#[derive(Clone)]
struct Proxy {
    address: String,
    /// One token per connection: cancelled, the connection is cut.
    connections: Arc<Mutex<Vec<CancellationToken>>>,
    /// Connections cut by a rule or by [`cut`](Proxy::cut).
    cuts: Arc<AtomicUsize>,
    /// Times the server's bytes were held.
    holds: Arc<AtomicUsize>,
}

impl Proxy {
    /// Cuts every connection open now.
    fn cut(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.cancel();
        }
        self.cuts.fetch_add(1, Ordering::SeqCst);
    }

    /// A JetStream context connected through the proxy, its requests (and
    /// publish acknowledgements) timing out after `timeout`, and the
    /// `worker` consumer of the fixture's stream from it.
    async fn jetstream(&self, fx: &Fixture, timeout: Duration) -> (jetstream::Context, PullConsumer) {
        let client = async_nats::connect(self.address.as_str()).await.unwrap();
        let mut js = jetstream::new(client);
        js.set_timeout(timeout);
        let consumer = js
            .get_stream(&fx.stream)
            .await
            .unwrap()
            .get_consumer::<pull::Config>("worker")
            .await
            .unwrap();
        (js, consumer)
    }
}

async fn proxy(rules: Rules) -> Proxy {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = Proxy {
        address: listener.local_addr().unwrap().to_string(),
        connections: Arc::default(),
        cuts: Arc::default(),
        holds: Arc::default(),
    };
    let shared = proxy.clone();
    // Each rule applies once, across connections.
    let cut_armed = Arc::new(std::sync::atomic::AtomicBool::new(rules.cut_on.is_some()));
    let hold_armed = Arc::new(std::sync::atomic::AtomicBool::new(
        rules.hold_after_publish_to.is_some(),
    ));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(NATS_URL).await.unwrap();
            let token = CancellationToken::new();
            shared.connections.lock().unwrap().push(token.clone());
            let (client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            let held_until: Arc<Mutex<Option<tokio::time::Instant>>> = Arc::default();
            let (cancel, held) = (token.clone(), Arc::clone(&held_until));
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                loop {
                    let n = tokio::select! {
                        _ = cancel.cancelled() => break,
                        n = server_read.read(&mut buf) => match n {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        },
                    };
                    let until = *held.lock().unwrap();
                    if let Some(until) = until {
                        tokio::select! {
                            _ = cancel.cancelled() => break,
                            _ = tokio::time::sleep_until(until) => {}
                        }
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                cancel.cancel();
            });
            let (rules, shared) = (rules.clone(), shared.clone());
            let (cut_armed, hold_armed) = (Arc::clone(&cut_armed), Arc::clone(&hold_armed));
            tokio::spawn(async move {
                let mut reader = BufReader::new(client_read);
                let mut line = String::new();
                loop {
                    line.clear();
                    let read = tokio::select! {
                        _ = token.cancelled() => return,
                        read = reader.read_line(&mut line) => read.unwrap_or(0),
                    };
                    if read == 0 {
                        token.cancel();
                        return;
                    }
                    let mut frame = line.clone().into_bytes();
                    let words: Vec<&str> = line.split_whitespace().collect();
                    if matches!(words.first(), Some(&"PUB") | Some(&"HPUB")) {
                        // The payload (and its CRLF) follows the line.
                        let size: usize = words.last().and_then(|w| w.parse().ok()).unwrap_or(0);
                        let mut payload = vec![0; size + 2];
                        if reader.read_exact(&mut payload).await.is_err() {
                            token.cancel();
                            return;
                        }
                        if let Some(cut_on) = rules.cut_on
                            && payload.windows(cut_on.len()).any(|w| w == cut_on.as_bytes())
                            && cut_armed.swap(false, Ordering::SeqCst)
                        {
                            shared.cuts.fetch_add(1, Ordering::SeqCst);
                            token.cancel();
                            return;
                        }
                        if let Some((subject, hold)) = &rules.hold_after_publish_to
                            && words.get(1) == Some(&subject.as_str())
                            && hold_armed.swap(false, Ordering::SeqCst)
                        {
                            shared.holds.fetch_add(1, Ordering::SeqCst);
                            *held_until.lock().unwrap() = Some(tokio::time::Instant::now() + *hold);
                        }
                        frame.extend_from_slice(&payload);
                    }
                    if server_write.write_all(&frame).await.is_err() {
                        token.cancel();
                        return;
                    }
                }
            });
        }
    });
    proxy
}

/// Waits until the consumer has nothing pending or unacknowledged.
async fn wait_for_empty_backlog(fx: &Fixture) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let backlog = fx.backlog().await;
        if backlog == (0, 0) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "backlog still {backlog:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `consumer` with a handler that fails on its first call and
/// succeeds (one effect each) on any later one, until its dead letter is
/// counted, the consumer's backlog is empty and twice `ack_wait` passed
/// (a redelivery would have run the handler by then); returns (handler
/// calls, effects).
async fn fail_once_then_succeed(fx: &Fixture, consumer: JetStreamConsumer, ack_wait: Duration) -> (usize, usize) {
    let (calls, effects) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let (handler_calls, handler_effects) = (Arc::clone(&calls), Arc::clone(&effects));
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            let first = handler_calls.fetch_add(1, Ordering::SeqCst) == 0;
            let effects = Arc::clone(&handler_effects);
            async move {
                if first {
                    return Err("fails once".to_owned());
                }
                effects.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter or an effect", || {
        stats.snapshot().dead_lettered == 1 || effects.load(Ordering::SeqCst) > 0
    })
    .await;
    wait_for_empty_backlog(fx).await;
    tokio::time::sleep(ack_wait * 2).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    (calls.load(Ordering::SeqCst), effects.load(Ordering::SeqCst))
}

/// The `+TERM` after the stored dead letter is lost with the connection
/// (the proxy cuts it instead of passing the `+TERM` on): it is sent again
/// on the client's new connection, and the message is not redelivered to
/// the handler (which would now succeed and commit an effect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_term_lost_with_the_connection_is_sent_again_and_the_handler_not_run_again() {
    let fx = Fixture::new("term_lost").await;
    let ack_wait = Duration::from_secs(1);
    fx.consumer(ack_wait, -1).await;
    fx.publish_payment("term-lost-1", 1).await;
    let proxy = proxy(Rules {
        cut_on: Some("+TERM"),
        ..Rules::default()
    })
    .await;
    let (js, pull) = proxy.jetstream(&fx, Duration::from_millis(500)).await;
    let consumer = JetStreamConsumer::builder(js, pull)
        .dead_letter_subject(&fx.dlq_subject)
        .max_attempts(1)
        .retry_backoff(fast_retries())
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let (calls, effects) = fail_once_then_succeed(&fx, consumer, ack_wait).await;
    let (dead, backlog) = (fx.dead_letters().await.len(), fx.backlog().await);
    fx.cleanup().await;
    assert_eq!(proxy.cuts.load(Ordering::SeqCst), 1, "the first +TERM was cut");
    assert_eq!((calls, effects), (1, 0), "the handler ran once, no effect");
    assert_eq!(dead, 1);
    assert_eq!(backlog, (0, 0), "terminated");
}

/// The dead letter's publish acknowledgement comes after the context's
/// timeout (the proxy holds what the server sends): the dead letter is
/// stored, so the timeout is not a refusal; it is published again (the
/// server answers a duplicate) and the message terminated, not handed back
/// to the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_acknowledged_after_the_timeout_is_not_handed_back() {
    let fx = Fixture::new("late_pub_ack").await;
    let ack_wait = Duration::from_secs(1);
    fx.consumer(ack_wait, -1).await;
    fx.publish_payment("late-ack-1", 1).await;
    let proxy = proxy(Rules {
        hold_after_publish_to: Some((fx.dlq_subject.clone(), Duration::from_secs(2))),
        ..Rules::default()
    })
    .await;
    let (js, pull) = proxy.jetstream(&fx, Duration::from_millis(500)).await;
    let consumer = JetStreamConsumer::builder(js, pull)
        .dead_letter_subject(&fx.dlq_subject)
        .max_attempts(1)
        .retry_backoff(fast_retries())
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let (calls, effects) = fail_once_then_succeed(&fx, consumer, ack_wait).await;
    let (dead, backlog) = (fx.dead_letters().await.len(), fx.backlog().await);
    fx.cleanup().await;
    assert_eq!(
        proxy.holds.load(Ordering::SeqCst),
        1,
        "the publish acknowledgement was held"
    );
    assert_eq!((calls, effects), (1, 0), "the handler ran once, no effect");
    assert_eq!(dead, 1, "stored once: published again with the same Nats-Msg-Id");
    assert_eq!(backlog, (0, 0), "terminated");
}

/// A handler's `#[idempotent]` body, for the last-delivery check.
#[idempotent_runtime::idempotent(key = "msg.message_id", store = store, scope = "nats.checked")]
async fn checked(store: &MemoryStore, bodies: &AtomicUsize, msg: &Payment) -> Result<(), idempotent_runtime::Error> {
    bodies.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Delivers the fixture's one message once, without settling it: its next
/// delivery, after `ack_wait`, is the last of a consumer with
/// `max_deliver` 2.
async fn spend_first_delivery(fx: &Fixture, ack_wait: Duration) {
    use futures_util::StreamExt;
    let pull = fx.consumer(ack_wait, 2).await;
    let mut messages = pull.fetch().max_messages(1).messages().await.unwrap();
    let first = messages.next().await.unwrap().unwrap();
    assert_eq!(first.info().unwrap().delivered, 1);
}

/// A message on its last delivery (`max_deliver` 2) is being checked when
/// the client's connection is cut (and made again): JetStream would not
/// deliver it again, so its dead letter is published and it is terminated
/// on the new connection, not given up as "redelivered by the broker".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_delivery_checked_across_a_reconnect_is_dead_lettered_and_terminated() {
    let fx = Fixture::new("last_reconnect").await;
    let ack_wait = Duration::from_secs(1);
    fx.publish_payment("last-reconnect-1", 1).await;
    spend_first_delivery(&fx, ack_wait).await;
    let proxy = proxy(Rules::default()).await;
    let (js, pull) = proxy.jetstream(&fx, Duration::from_secs(2)).await;
    let client = js.client();
    let consumer = JetStreamConsumer::builder(js, pull)
        .dead_letter_subject(&fx.dlq_subject)
        .retry_backoff(fast_retries())
        .fetch_expiry(Duration::from_millis(300))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let (store, checks, bodies) = (
        MemoryStore::new(),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let shutdown = CancellationToken::new();
    let (handler_checks, handler_bodies, cutter) = (Arc::clone(&checks), Arc::clone(&bodies), proxy.clone());
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: Payment, info: DeliveryInfo| {
            let (store, checks, bodies, proxy, client) = (
                store.clone(),
                Arc::clone(&handler_checks),
                Arc::clone(&handler_bodies),
                cutter.clone(),
                client.clone(),
            );
            async move {
                assert_eq!(info.attempt, 2, "the last delivery");
                if checks.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The connection is lost while the message is checked,
                    // and made again.
                    let connects = client.statistics().connects.load(Ordering::SeqCst);
                    proxy.cut();
                    let deadline = tokio::time::Instant::now() + WAIT;
                    while client.statistics().connects.load(Ordering::SeqCst) == connects
                        || client.connection_state() != async_nats::connection::State::Connected
                    {
                        assert!(tokio::time::Instant::now() < deadline, "not reconnected");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                checked(&store, &bodies, &msg).await
            }
        },
        shutdown.clone(),
    ));
    wait_until("the last delivery's settlement", || {
        let stats = stats.snapshot();
        stats.dead_lettered + stats.released + stats.acked > 0
    })
    .await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    let (dead, backlog) = (fx.dead_letters().await, fx.backlog().await);
    fx.cleanup().await;
    assert_eq!(proxy.cuts.load(Ordering::SeqCst), 1);
    assert_eq!(checks.load(Ordering::SeqCst), 1, "checked once");
    assert_eq!(
        bodies.load(Ordering::SeqCst),
        0,
        "its body not run on its last delivery"
    );
    assert_eq!(dead.len(), 1, "dead-lettered on the new connection: {stats:?}");
    assert_eq!(header(&dead[0], HEADER_KIND), "exhausted");
    assert_eq!((stats.dead_lettered, stats.released), (1, 0));
    assert_eq!(backlog, (0, 0), "terminated");
}

/// A message on its last delivery whose check does not end before the
/// shutdown timeout is released: JetStream would never deliver it again
/// after a `-NAK`, so it is dead-lettered (its processing not known) and
/// terminated instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_delivery_released_at_shutdown_is_dead_lettered_not_lost() {
    let fx = Fixture::new("last_shutdown").await;
    let ack_wait = Duration::from_secs(1);
    fx.publish_payment("last-shutdown-1", 1).await;
    spend_first_delivery(&fx, ack_wait).await;
    let pull = fx
        .js
        .get_stream(&fx.stream)
        .await
        .unwrap()
        .get_consumer::<pull::Config>("worker")
        .await
        .unwrap();
    let consumer = JetStreamConsumer::builder(fx.js.clone(), pull)
        .dead_letter_subject(&fx.dlq_subject)
        .fetch_expiry(Duration::from_millis(300))
        .shutdown_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let checks = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let handler_checks = Arc::clone(&checks);
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            handler_checks.fetch_add(1, Ordering::SeqCst);
            // A check that cannot tell (its store unreachable).
            std::future::pending::<Result<(), String>>()
        },
        shutdown.clone(),
    ));
    wait_until("the check", || checks.load(Ordering::SeqCst) == 1).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    let (dead, backlog) = (fx.dead_letters().await, fx.backlog().await);
    fx.cleanup().await;
    assert_eq!(stats.released, 1, "{stats:?}");
    assert_eq!(dead.len(), 1, "dead-lettered at its release");
    assert_eq!(header(&dead[0], HEADER_KIND), "exhausted");
    assert!(header(&dead[0], HEADER_REASON).contains("not known"));
    assert_eq!(backlog, (0, 0), "terminated");
}
