//! The RabbitMQ adapter against the real broker (127.0.0.1:5672, guest/guest).
//!
//! Every test declares its own queues with a random suffix and deletes them
//! at the end. The handlers are what `#[idempotent]` generates, written out
//! by hand with a `MemoryStore`: claim the message id, apply the effect,
//! complete the marker; a duplicate is skipped.
#![cfg(feature = "lapin")]

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::lapin::message::BasicGetMessage;
use idempotent_runtime::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable, ShortString};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use idempotent_runtime::rabbitmq::{
    Backoff, CancellationToken, ConsumerStats, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, RabbitConsumer,
};
use idempotent_runtime::{Claim, Guard, MemoryStore, Request, Store};
use serde::{Deserialize, Serialize};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const WAIT: Duration = Duration::from_secs(15);

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    message_id: String,
    amount: i64,
}

fn unique(prefix: &str) -> String {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    format!("idem.test.{prefix}.{:016x}", hasher.finish())
}

/// The idempotent side of a handler, as `#[idempotent(key = "msg.message_id")]`
/// would run it on a lease store: claim, effect, complete.
#[derive(Clone, Default)]
struct Ledger {
    store: MemoryStore,
    /// Effects applied, by message id.
    effects: Arc<Mutex<HashMap<String, u32>>>,
    /// Handler calls, by message id.
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
    conn: Connection,
    admin: Channel,
    queue: String,
    dlq: String,
}

/// Queue arguments for a quorum queue.
fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    args
}

impl Fixture {
    async fn new(name: &str) -> Fixture {
        Fixture::with_args(name, FieldTable::default()).await
    }

    /// The queue and its `.dlq`, both declared with `args`.
    async fn with_args(name: &str, args: FieldTable) -> Fixture {
        let conn = connect().await;
        let admin = conn.create_channel().await.unwrap();
        admin.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        let queue = unique(name);
        let dlq = format!("{queue}.dlq");
        for q in [&queue, &dlq] {
            admin
                .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), args.clone())
                .await
                .unwrap();
        }
        Fixture {
            conn,
            admin,
            queue,
            dlq,
        }
    }

    /// An exchange of `kind` and, for each `(queue, binding key)`, a queue
    /// bound to it.
    async fn exchange(&self, kind: ExchangeKind, bindings: &[(&str, &str)]) -> String {
        let exchange = unique("dlx");
        self.admin
            .exchange_declare(
                exchange.as_str().into(),
                kind,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        for (queue, key) in bindings {
            self.admin
                .queue_declare((*queue).into(), QueueDeclareOptions::durable(), FieldTable::default())
                .await
                .unwrap();
            self.admin
                .queue_bind(
                    (*queue).into(),
                    exchange.as_str().into(),
                    (*key).into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        exchange
    }

    async fn delete_exchange(&self, exchange: &str, queues: &[&str]) {
        for queue in queues {
            self.admin
                .queue_delete((*queue).into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        self.admin
            .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }

    async fn channel(&self) -> Channel {
        self.conn.create_channel().await.unwrap()
    }

    async fn publish(&self, body: &[u8], message_id: &str) {
        let props = BasicProperties::default()
            .with_message_id(message_id.into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        let confirm = self
            .admin
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }

    async fn publish_payment(&self, id: &str, amount: i64) {
        let body = serde_json::to_vec(&Payment {
            message_id: id.to_owned(),
            amount,
        })
        .unwrap();
        self.publish(&body, id).await;
    }

    /// Ready messages in `queue`.
    async fn ready(&self, queue: &str) -> u32 {
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.admin
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    /// Takes every message of `queue`.
    async fn drain(&self, queue: &str) -> Vec<BasicGetMessage> {
        let mut out = Vec::new();
        while let Some(msg) = self
            .admin
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            out.push(msg);
        }
        out
    }

    async fn cleanup(self) {
        for q in [&self.queue, &self.dlq] {
            self.admin
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        let _ = self.conn.close(200, "test done".into()).await;
    }
}

async fn connect() -> Connection {
    Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672")
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn header<'a>(msg: &'a BasicGetMessage, name: &str) -> Option<&'a AMQPValue> {
    msg.delivery.properties.headers().as_ref()?.inner().get(name)
}

fn header_text(msg: &BasicGetMessage, name: &str) -> String {
    match header(msg, name) {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        Some(AMQPValue::ShortString(s)) => s.to_string(),
        other => panic!("header {name}: {other:?}"),
    }
}

fn header_int(msg: &BasicGetMessage, name: &str) -> i64 {
    match header(msg, name) {
        Some(AMQPValue::LongLongInt(v)) => *v,
        other => panic!("header {name}: {other:?}"),
    }
}

fn fast_retries() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_handler_acks_and_queue_is_empty() {
    let fx = Fixture::new("ok").await;
    for i in 0..3 {
        fx.publish_payment(&format!("ok-{i}"), 10).await;
    }
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .concurrency(2)
        .prefetch(4)
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
    assert_eq!(fx.ready(&fx.queue).await, 0, "nothing left or requeued");
    assert_eq!(fx.ready(&fx.dlq).await, 0);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_dying_after_commit_before_ack_gets_redelivery_acked_once() {
    let fx = Fixture::new("crash").await;
    fx.publish_payment("crash-1", 42).await;
    let ledger = Ledger::default();

    // Consumer A on its own connection: the handler commits its marker and
    // effect, then the connection dies before the adapter can ack.
    let conn_a = Arc::new(connect().await);
    let consumer_a = RabbitConsumer::builder(conn_a.create_channel().await.unwrap(), &fx.queue)
        .concurrency(1)
        .build()
        .unwrap();
    let (ledger_a, conn_kill) = (ledger.clone(), Arc::clone(&conn_a));
    let result_a = tokio::time::timeout(
        WAIT,
        consumer_a.run(
            move |msg: Payment| {
                let (ledger, conn) = (ledger_a.clone(), Arc::clone(&conn_kill));
                async move {
                    let fresh = ledger.process(&msg.message_id).await?;
                    assert!(fresh);
                    // The process "dies": its connection goes, no ack is sent.
                    let _ = conn.close(320, "simulated crash".into()).await;
                    Ok::<_, idempotent_runtime::Error>(())
                }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("consumer A stops when its connection dies");
    assert!(
        result_a.is_err(),
        "consumer A reports the lost connection: {result_a:?}"
    );
    assert_eq!(ledger.effects().get("crash-1"), Some(&1));

    // Consumer B gets the redelivery; the store recognises the duplicate.
    let seen: Arc<Mutex<Vec<(DeliveryInfo, bool)>>> = Arc::default();
    let consumer_b = RabbitConsumer::builder(fx.channel().await, &fx.queue).build().unwrap();
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
    assert!(info.redelivered, "the broker flags the redelivery");
    assert_eq!(info.message_id.as_deref(), Some("crash-1"));
    assert!(!fresh, "the redelivery is a duplicate for the store");
    assert_eq!(
        ledger.calls().get("crash-1"),
        Some(&2),
        "the handler saw the message twice"
    );
    assert_eq!(ledger.effects().get("crash-1"), Some(&1), "the effect stayed single");
    assert_eq!(stats_b.acked, 1);
    assert_eq!(fx.ready(&fx.queue).await, 0);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_handler_ends_in_dead_letter_queue_after_max_attempts() {
    let fx = Fixture::new("fail").await;
    let body = br#"{"message_id":"fail-1","amount":7}"#;
    fx.publish(body, "fail-1").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .max_attempts(3)
        .retry_backoff(fast_retries())
        .dead_letter_queue(&fx.dlq)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run_with_info(
        move |_: Payment, info: DeliveryInfo| {
            let n = handler_calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                assert_eq!(
                    info.attempt as usize, n,
                    "attempts are counted across the republished copies"
                );
                Err::<(), _>(format!("payment gateway down (attempt {})", info.attempt))
            }
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
    assert_eq!(fx.ready(&fx.queue).await, 0);
    let dead = fx.drain(&fx.dlq).await;
    assert_eq!(dead.len(), 1);
    let dead = &dead[0];
    assert_eq!(dead.delivery.data, body, "body intact");
    assert_eq!(
        dead.delivery.properties.message_id().as_ref().map(ShortString::as_str),
        Some("fail-1")
    );
    assert_eq!(header_text(dead, HEADER_REASON), "payment gateway down (attempt 3)");
    assert_eq!(header_text(dead, HEADER_KIND), "exhausted");
    assert_eq!(header_int(dead, HEADER_ATTEMPTS), 3);
    assert_eq!(header_text(dead, HEADER_SOURCE), fx.queue);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_errors_and_panics() {
    let fx = Fixture::new("permanent").await;
    fx.publish_payment("permanent-1", 1).await;
    fx.publish_payment("panics-1", 2).await;
    let calls = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .max_attempts(2)
        .retry_backoff(fast_retries())
        .retry_if(|err: &idempotent_runtime::Error| err.is_transient())
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            *handler_calls.lock().unwrap().entry(msg.message_id.clone()).or_default() += 1;
            async move {
                if msg.message_id == "panics-1" {
                    panic!("handler bug");
                }
                // A key error never succeeds on a retry.
                Err::<(), _>(idempotent_runtime::Error::MissingKey {
                    scope: "payments".into(),
                })
            }
        },
        shutdown.clone(),
    ));
    wait_until("two dead letters", || stats.snapshot().dead_lettered == 2).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();

    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.get("permanent-1"), Some(&1), "a permanent error is not retried");
    assert_eq!(calls.get("panics-1"), Some(&2), "a panic is a failed attempt, retried");
    assert_eq!((stats.failed, stats.retried, stats.dead_lettered), (3, 1, 2));
    let mut dead = fx.drain(&fx.dlq).await;
    dead.sort_by_key(|m| header_text(m, HEADER_KIND));
    assert_eq!(header_text(&dead[0], HEADER_KIND), "exhausted");
    assert!(header_text(&dead[0], HEADER_REASON).contains("handler panicked: handler bug"));
    assert_eq!(header_text(&dead[1], HEADER_KIND), "rejected");
    assert!(header_text(&dead[1], HEADER_REASON).contains("no idempotency key"));
    assert_eq!(header_int(&dead[1], HEADER_ATTEMPTS), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_consumer_keeps_going() {
    let fx = Fixture::new("poison").await;
    fx.publish(b"{not json", "bad-json").await;
    fx.publish(br#"{"amount":5}"#, "no-key").await;
    fx.publish_payment("good-1", 5).await;
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .concurrency(1)
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
    assert_eq!(ledger.effects().get("good-1"), Some(&1));
    let dead = fx.drain(&fx.dlq).await;
    let by_id: HashMap<String, &BasicGetMessage> = dead
        .iter()
        .map(|m| (m.delivery.properties.message_id().as_ref().unwrap().to_string(), m))
        .collect();
    let bad_json = by_id["bad-json"];
    assert_eq!(bad_json.delivery.data, b"{not json");
    assert_eq!(header_text(bad_json, HEADER_KIND), "poison");
    assert!(header_text(bad_json, HEADER_REASON).contains("cannot decode JSON body"));
    assert_eq!(header_int(bad_json, HEADER_ATTEMPTS), 0);
    let no_key = by_id["no-key"];
    assert_eq!(no_key.delivery.data, br#"{"amount":5}"#);
    assert!(header_text(no_key, HEADER_REASON).contains("missing field `message_id`"));
    assert_eq!(fx.ready(&fx.queue).await, 0);
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

    let start = |ledger: Ledger, in_flight: Arc<AtomicUsize>, channel: Channel| {
        let consumer = RabbitConsumer::builder(channel, &fx.queue)
            .concurrency(4)
            .prefetch(8)
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

    let (_, shutdown_a, run_a) = start(ledger.clone(), Arc::clone(&in_flight), fx.channel().await);
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

    let (stats_b, shutdown_b, run_b) = start(ledger.clone(), Arc::clone(&in_flight), fx.channel().await);
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
    assert_eq!(fx.ready(&fx.queue).await, 0);
    fx.cleanup().await;
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_consumer_gracefully() {
    let fx = Fixture::new("signal").await;
    fx.publish_payment("signal-1", 1).await;
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue).build().unwrap();
    let stats = consumer.stats();
    let shutdown = idempotent_runtime::rabbitmq::shutdown_on_signal();
    let handler_ledger = ledger.clone();
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = handler_ledger.clone();
            async move { ledger.process(&msg.message_id).await }
        },
        shutdown.clone(),
    ));
    wait_until("the ack", || stats.snapshot().acked == 1).await;
    // The signal handler is installed by now (the listener task ran long ago).
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let stats = tokio::time::timeout(WAIT, run)
        .await
        .expect("stopped on SIGTERM")
        .unwrap()
        .unwrap();
    assert!(shutdown.is_cancelled());
    assert_eq!(stats.acked, 1);
    fx.cleanup().await;
}

/// Runs a consumer built by `configure` whose handler always fails
/// permanently, until `dead` dead letters were published; returns the run's
/// counters.
async fn dead_letter_all(
    fx: &Fixture,
    dead: u64,
    configure: impl FnOnce(
        idempotent_runtime::rabbitmq::RabbitConsumerBuilder,
    ) -> idempotent_runtime::rabbitmq::RabbitConsumerBuilder,
) -> idempotent_runtime::rabbitmq::RunStats {
    let consumer = configure(RabbitConsumer::builder(fx.channel().await, &fx.queue).retry_backoff(fast_retries()))
        .retry_if(|_: &String| false)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(
        |_: Payment| async { Err::<(), _>("refused".to_owned()) },
        shutdown.clone(),
    ));
    wait_until("the dead letters", || stats.snapshot().dead_lettered == dead).await;
    shutdown.cancel();
    run.await.unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_reach_every_queue_an_exchange_routes_them_to() {
    // The README allows a dead-letter exchange with a routing key: direct,
    // topic and fanout exchanges each deliver it to their bound queues.
    let fx = Fixture::new("dlx").await;
    let (direct_q, topic_q, fan_a, fan_b) = (unique("direct"), unique("topic"), unique("fan.a"), unique("fan.b"));
    let direct = fx.exchange(ExchangeKind::Direct, &[(&direct_q, "failed")]).await;
    let topic = fx
        .exchange(ExchangeKind::Topic, &[(&topic_q, "payments.*.failed")])
        .await;
    let fanout = fx.exchange(ExchangeKind::Fanout, &[(&fan_a, ""), (&fan_b, "")]).await;
    for (n, (exchange, key, queues)) in [
        (&direct, "failed", vec![direct_q.as_str()]),
        (&topic, "payments.eu.failed", vec![topic_q.as_str()]),
        (&fanout, "anything", vec![fan_a.as_str(), fan_b.as_str()]),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("dlx-{n}");
        fx.publish_payment(&id, 1).await;
        let stats = dead_letter_all(&fx, 1, |b| b.dead_letter_exchange(exchange.as_str(), key)).await;
        assert_eq!((stats.dead_lettered, stats.released), (1, 0));
        for queue in queues {
            let dead = fx.drain(queue).await;
            assert_eq!(dead.len(), 1, "{queue}");
            assert_eq!(
                dead[0]
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(ShortString::as_str),
                Some(id.as_str())
            );
            assert_eq!(header_text(&dead[0], HEADER_KIND), "rejected");
        }
        assert_eq!(fx.ready(&fx.queue).await, 0);
    }
    fx.delete_exchange(&direct, &[&direct_q]).await;
    fx.delete_exchange(&topic, &[&topic_q]).await;
    fx.delete_exchange(&fanout, &[&fan_a, &fan_b]).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_dead_letter_goes_back_to_its_queue_until_it_can_be_routed() {
    let fx = Fixture::new("unroutable").await;
    fx.publish_payment("unroutable-1", 1).await;
    let bound = unique("late");
    let exchange = fx.exchange(ExchangeKind::Direct, &[]).await;
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .retry_backoff(fast_retries())
        .retry_if(|_: &String| false)
        .dead_letter_exchange(exchange.as_str(), "failed")
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(
        |_: Payment| async { Err::<(), _>("refused".to_owned()) },
        shutdown.clone(),
    ));
    wait_until("the dead letter handed back", || stats.snapshot().released >= 2).await;
    assert_eq!(stats.snapshot().dead_lettered, 0);
    // Once a queue is bound, the next try gets through.
    let admin = &fx.admin;
    admin
        .queue_declare(
            bound.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    admin
        .queue_bind(
            bound.as_str().into(),
            exchange.as_str().into(),
            "failed".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(fx.drain(&bound).await.len(), 1);
    assert_eq!(fx.ready(&fx.queue).await, 0);
    fx.delete_exchange(&exchange, &[&bound]).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_exchange_is_reported_before_anything_is_consumed() {
    let fx = Fixture::new("no-dlx").await;
    fx.publish_payment("no-dlx-1", 1).await;
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .dead_letter_exchange(unique("missing"), "failed")
        .build()
        .unwrap();
    let err = consumer
        .run(
            |_: Payment| async { Err::<(), _>("refused".to_owned()) },
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("dead-letter exchange"), "{err}");
    assert_eq!(fx.ready(&fx.queue).await, 1, "the message was not touched");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_count_attempts_and_take_dead_letters() {
    // Input and dead-letter queue are quorum queues (declared by the
    // operator, so the consumer must not declare the dead-letter queue).
    let fx = Fixture::with_args("quorum", quorum()).await;
    fx.publish_payment("quorum-1", 1).await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let consumer = RabbitConsumer::builder(fx.channel().await, &fx.queue)
        .max_attempts(3)
        .retry_backoff(fast_retries())
        .dead_letter_queue(&fx.dlq)
        .declare_dead_letter_queue(false)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let seen = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run_with_info(
        move |_: Payment, info: DeliveryInfo| {
            seen.lock().unwrap().push(info.attempt);
            async { Err::<(), _>("down".to_owned()) }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(*calls.lock().unwrap(), [1, 2, 3]);
    let dead = fx.drain(&fx.dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header_int(&dead[0], HEADER_ATTEMPTS), 3);
    assert_eq!(fx.ready(&fx.queue).await, 0);
    fx.cleanup().await;
}
