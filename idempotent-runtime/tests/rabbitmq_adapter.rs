//! The RabbitMQ adapter against the real broker (127.0.0.1:5672, guest/guest).
//!
//! Every test declares its own queues with a random suffix and deletes them
//! at the end. The handlers are what `#[idempotent]` generates, written out
//! by hand with a `MemoryStore`: claim the message id, apply the effect,
//! complete the marker; a duplicate is skipped.
#![cfg(feature = "rabbitmq")]

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::MemoryStore;
use idempotent_runtime::broker::{
    Backoff, CancellationToken, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON, Reconnect, Verdict,
};
use idempotent_runtime::lapin::message::BasicGetMessage;
use idempotent_runtime::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable, ShortString};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use idempotent_runtime::rabbitmq::RabbitConsumer;
use idempotent_runtime::store::{Claim, Guard, Request, Store};
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

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_consumer_gracefully() {
    let fx = Fixture::new("signal").await;
    fx.publish_payment("signal-1", 1).await;
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue).build().unwrap();
    let stats = consumer.stats();
    let shutdown = idempotent_runtime::broker::shutdown_on_signal();
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

fn fast_outages() -> Backoff {
    Backoff::new(Duration::from_millis(20), Duration::from_millis(40))
}

/// A handler that calls every failure an outage, failing on `bad` alone
/// (the order whose text the database refuses); handler calls by
/// message id.
fn outage_on(
    bad: &'static str,
    calls: &Arc<Mutex<HashMap<String, u32>>>,
) -> impl Fn(Payment) -> std::future::Ready<Result<(), String>> + Send + Sync + 'static {
    let calls = Arc::clone(calls);
    move |msg: Payment| {
        *calls.lock().unwrap().entry(msg.message_id.clone()).or_default() += 1;
        std::future::ready(if msg.message_id == bad {
            Err(format!("{bad}: invalid byte sequence for encoding \"UTF8\": 0x00"))
        } else {
            Ok(())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_one_message_while_others_are_acknowledged_spends_its_attempts() {
    // The handler calls the error an outage, but the consumer's other
    // messages are processed meanwhile: the outage is this message's own.
    // It spends an attempt each time, and is dead-lettered after its
    // attempts instead of being retried in place for ever.
    let fx = Fixture::new("own-outage").await;
    fx.publish_payment("stuck", 1).await;
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue)
        .retry_backoff(fast_retries())
        .outage_backoff(fast_outages())
        .max_attempts(3)
        .classify(|_: &String| Verdict::Outage)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let calls = Arc::new(Mutex::new(HashMap::new()));
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(outage_on("stuck", &calls), shutdown.clone()));
    // Other messages keep coming, and are processed.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut published = 0;
    while stats.snapshot().dead_lettered == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dead-lettered: {:?}",
            stats.snapshot()
        );
        fx.publish_payment(&format!("ok-{published}"), 1).await;
        published += 1;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!((stats.retried, stats.dead_lettered), (2, 1), "{stats:?}");
    assert!(stats.acked >= 1, "{stats:?}");
    assert!(
        stats.outage_retries >= 3,
        "one retry in place per attempt at least: {stats:?}"
    );
    let stuck = calls.lock().unwrap()["stuck"];
    assert!(stuck >= 6, "each attempt ran again in place before spending: {stuck}");
    let dead = fx.drain(&fx.dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header_text(&dead[0], HEADER_KIND), "exhausted");
    assert_eq!(header_int(&dead[0], HEADER_ATTEMPTS), 3);
    assert!(header_text(&dead[0], HEADER_REASON).contains("0x00"));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_outage_retries_bounds_the_retries_in_place() {
    // Nothing else is processed (it could be a real outage): only the
    // opt-in bound makes the outage spend an attempt.
    let fx = Fixture::new("outage-bound").await;
    fx.publish_payment("down", 1).await;
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue)
        .retry_backoff(fast_retries())
        .outage_backoff(fast_outages())
        .max_attempts(2)
        .max_outage_retries(2)
        .classify(|_: &String| Verdict::Outage)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let calls = Arc::new(Mutex::new(HashMap::new()));
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(outage_on("down", &calls), shutdown.clone()));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    // Per attempt: the first run and 2 retries in place; the third outage
    // spends the attempt.
    assert_eq!(
        (stats.outage_retries, stats.retried, stats.dead_lettered, stats.acked),
        (4, 1, 1, 0),
        "{stats:?}"
    );
    assert_eq!(calls.lock().unwrap()["down"], 6);
    let dead = fx.drain(&fx.dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header_text(&dead[0], HEADER_KIND), "exhausted");
    assert_eq!(header_int(&dead[0], HEADER_ATTEMPTS), 2);
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
) -> idempotent_runtime::broker::RunStats {
    let consumer = configure(RabbitConsumer::builder(AMQP_URL, &fx.queue).retry_backoff(fast_retries()))
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
    // docs/brokers.md allows a dead-letter exchange with a routing key: direct,
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
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue)
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
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue)
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
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue)
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

/// Many retries and dead letters published at once on one connection, some
/// dead letters routable and others not: each delivery is settled by its own
/// publish's outcome.
///
/// Three kinds of messages, interleaved, consumed by 48 handlers at once:
/// `a-*` fail for good and their dead letters route to a queue (through a
/// headers exchange, by the message's `route: yes` header); `b-*` fail for
/// good and their dead letters route nowhere (`route: no`), so they must go
/// back to their queue, again and again, never acknowledged; `c-*` fail once
/// (retried: a copy to the queue) and succeed on their second attempt. The
/// queues are transient: the broker confirms routed messages at once, so
/// they share its `multiple` acks with the unroutable ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_retry_and_dead_letter_is_settled_by_its_own_confirm_among_unroutable_ones() {
    const EACH: usize = 40;
    let conn = connect().await;
    let admin = conn.create_channel().await.unwrap();
    admin.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let queue = unique("mixed");
    let routed = unique("mixed.dead");
    for q in [&queue, &routed] {
        admin
            .queue_declare(q.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())
            .await
            .unwrap();
    }
    let exchange = unique("mixed.dlx");
    admin
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Headers,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut binding = FieldTable::default();
    binding.insert("x-match".into(), AMQPValue::LongString("all".into()));
    binding.insert("route".into(), AMQPValue::LongString("yes".into()));
    admin
        .queue_bind(
            routed.as_str().into(),
            exchange.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            binding,
        )
        .await
        .unwrap();

    let mut ids = Vec::new();
    for i in 0..EACH {
        for (kind, route) in [("a", "yes"), ("b", "no"), ("c", "no")] {
            let id = format!("{kind}-{i}");
            let mut headers = FieldTable::default();
            headers.insert("route".into(), AMQPValue::LongString(route.into()));
            let body = serde_json::to_vec(&Payment {
                message_id: id.clone(),
                amount: 1,
            })
            .unwrap();
            let confirm = admin
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_headers(headers),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack());
            ids.push(id);
        }
    }

    // Handler calls: the attempts each message id was called with.
    let calls: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let consumer = RabbitConsumer::builder(AMQP_URL, &queue)
        .prefetch(200)
        .concurrency(48)
        .max_attempts(3)
        .retry_backoff(fast_retries())
        .retry_if(|err: &String| err == "retry")
        .dead_letter_exchange(exchange.as_str(), "failed")
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let seen = Arc::clone(&calls);
    let started = tokio::time::Instant::now();
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: Payment, info: DeliveryInfo| {
            seen.lock()
                .unwrap()
                .entry(msg.message_id.clone())
                .or_default()
                .push(info.attempt);
            async move {
                match msg.message_id.split('-').next() {
                    Some("c") if info.attempt == 1 => Err("retry".to_owned()),
                    Some("c") => Ok(()),
                    _ => Err("refused".to_owned()),
                }
            }
        },
        shutdown.clone(),
    ));
    // Until every `c` ran its second attempt, every `b` was handed back and
    // delivered again twice, and the `a` dead letters are in their queue.
    let deadline = started + WAIT;
    loop {
        let settled = {
            let calls = calls.lock().unwrap();
            (0..EACH).all(|i| {
                calls.get(&format!("c-{i}")).is_some_and(|a| a.contains(&2))
                    && calls.get(&format!("b-{i}")).is_some_and(|a| a.len() >= 3)
            })
        };
        if settled && fx_ready(&admin, &routed).await >= EACH as u32 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    let stats_end = run.await.unwrap().unwrap();

    // Where each message ended up.
    let count = |messages: &[BasicGetMessage]| {
        let mut by_id: HashMap<String, usize> = HashMap::new();
        for m in messages {
            let id = m.delivery.properties.message_id().as_ref().unwrap().to_string();
            *by_id.entry(id).or_default() += 1;
        }
        by_id
    };
    let dead = count(&drain_queue(&admin, &routed).await);
    let left = count(&drain_queue(&admin, &queue).await);
    let calls = calls.lock().unwrap().clone();
    let (mut lost_b, mut wrong_a, mut wrong_c) = (0usize, 0usize, 0usize);
    for i in 0..EACH {
        // A dead letter that was routed: in the dead-letter queue once.
        let a = format!("a-{i}");
        wrong_a += dead.get(&a).copied().unwrap_or(0).abs_diff(1) + left.get(&a).copied().unwrap_or(0);
        // A dead letter that could not be routed: the message is back in
        // its queue, once, and nowhere else.
        let b = format!("b-{i}");
        if left.get(&b).copied().unwrap_or(0) != 1 || dead.contains_key(&b) {
            lost_b += 1;
        }
        // A retried message: one copy, so one second attempt, and nothing
        // left behind.
        let c = format!("c-{i}");
        let second = calls.get(&c).map_or(0, |a| a.iter().filter(|n| **n == 2).count());
        wrong_c += second.abs_diff(1) + left.get(&c).copied().unwrap_or(0) + dead.get(&c).copied().unwrap_or(0);
    }
    let publishes: usize = calls.values().map(Vec::len).sum();
    eprintln!(
        "{} messages, {publishes} handler calls (each a retry or dead-letter publish but for the `c` second \
         attempts) in {elapsed:?}: {lost_b} of {EACH} unroutable dead letters reported stored (message lost), \
         {wrong_a} wrong routed dead letters of {EACH}, {wrong_c} wrong retries of {EACH}; \
         dead_lettered = {}, retried = {}",
        ids.len(),
        stats_end.dead_lettered,
        stats_end.retried,
    );

    for q in [&queue, &routed] {
        admin
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    admin
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "test done".into()).await;

    assert_eq!(
        (lost_b, wrong_a, wrong_c),
        (0, 0, 0),
        "each delivery settled by its own publish's outcome"
    );
    assert_eq!(stats_end.dead_lettered, EACH as u64);
    assert_eq!(stats_end.retried, EACH as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_exchange_deleted_while_consuming_stops_the_consumer_and_keeps_the_message() {
    let fx = Fixture::new("dlx-gone").await;
    let bound = unique("dlx-gone.dead");
    let exchange = fx.exchange(ExchangeKind::Direct, &[(&bound, "failed")]).await;
    let consumer = RabbitConsumer::builder(AMQP_URL, &fx.queue)
        .retry_if(|_: &String| false)
        .dead_letter_exchange(exchange.as_str(), "failed")
        .build()
        .unwrap();
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run(
        |msg: Payment| async move {
            if msg.message_id.starts_with("ok") {
                Ok(())
            } else {
                Err("refused".to_owned())
            }
        },
        CancellationToken::new(),
    ));
    fx.publish_payment("ok-1", 1).await;
    wait_until("the ack", || stats.snapshot().acked == 1).await;
    // The exchange goes away under the running consumer: publishing the
    // dead letter fails, the consumer connects again and its topology check
    // finds the exchange missing; the message stays in its queue.
    fx.delete_exchange(&exchange, &[&bound]).await;
    fx.publish_payment("fail-1", 1).await;
    let err = tokio::time::timeout(WAIT, run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("dead-letter exchange"), "{err}");
    assert_eq!(stats.snapshot().dead_lettered, 0);
    assert_eq!(fx.ready(&fx.queue).await, 1, "the message is kept");
    fx.cleanup().await;
}

/// Ready messages in `queue`.
async fn fx_ready(admin: &Channel, queue: &str) -> u32 {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    admin
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
        .unwrap()
        .message_count()
}

/// Takes every message of `queue`.
async fn drain_queue(admin: &Channel, queue: &str) -> Vec<BasicGetMessage> {
    let mut out = Vec::new();
    while let Some(msg) = admin
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        out.push(msg);
    }
    out
}

/// Whether `queue` exists (a passive declare on a channel of its own).
async fn exists(conn: &Connection, queue: &str) -> bool {
    let channel = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_queue_is_declared_and_a_refusal_declares_nothing() {
    let conn = connect().await;
    let admin = conn.create_channel().await.unwrap();
    admin.confirm_select(ConfirmSelectOptions::default()).await.unwrap();

    // As docs/brokers.md runs it against an empty broker: queue and dead-letter
    // queue are declared, the message is processed.
    let queue = unique("declared");
    let dlq = format!("{queue}.dlq");
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(AMQP_URL, &queue).build().unwrap();
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
    // Both are declared before the consumer subscribes, one after the
    // other: wait for both (waiting for the first alone raced the second).
    let mut declared = false;
    for _ in 0..200 {
        declared = exists(&conn, &queue).await && exists(&conn, &dlq).await;
        if declared {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(declared, "both declared");
    let body = serde_json::to_vec(&Payment {
        message_id: "declared-1".into(),
        amount: 1,
    })
    .unwrap();
    admin
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until("the ack", || stats.snapshot().acked == 1).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(ledger.effects().len(), 1);
    for q in [&queue, &dlq] {
        admin
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }

    // A queue that must exist and does not: an error, and its dead-letter
    // queue is not declared either.
    let queue = unique("absent");
    let err = RabbitConsumer::builder(AMQP_URL, &queue)
        .declare_queue(false)
        .build()
        .unwrap()
        .run(|_: Payment| async { Ok::<(), String>(()) }, CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
    assert!(!exists(&conn, &format!("{queue}.dlq")).await, "nothing half-declared");

    // A missing dead-letter exchange: the queue is not declared.
    let queue = unique("no-exchange");
    let err = RabbitConsumer::builder(AMQP_URL, &queue)
        .dead_letter_exchange(unique("missing"), "failed")
        .build()
        .unwrap()
        .run(|_: Payment| async { Ok::<(), String>(()) }, CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("dead-letter exchange"), "{err}");
    assert!(!exists(&conn, &queue).await, "nothing half-declared");
    let _ = conn.close(200, "test done".into()).await;
}

/// A TCP proxy in front of the broker that can freeze: once frozen it
/// stops forwarding in both directions (no reset, no answer; the sockets
/// stay open), and a connection it accepts then is held without ever
/// reaching the broker. `cut` closes every connection it holds.
struct FreezingProxy {
    address: String,
    frozen: Arc<std::sync::atomic::AtomicBool>,
    cut: Arc<Mutex<CancellationToken>>,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
}

impl FreezingProxy {
    async fn start() -> FreezingProxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let proxy = FreezingProxy {
            address,
            frozen: Arc::default(),
            cut: Arc::new(Mutex::new(CancellationToken::new())),
            accepted: Arc::default(),
            stop: CancellationToken::new(),
        };
        let (frozen, cut, accepted, stop) = (
            Arc::clone(&proxy.frozen),
            Arc::clone(&proxy.cut),
            Arc::clone(&proxy.accepted),
            proxy.stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => return,
                    },
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                let this_cut = cut.lock().unwrap().clone();
                if frozen.load(Ordering::SeqCst) {
                    // Accepts, never answers.
                    tokio::spawn(async move {
                        this_cut.cancelled().await;
                        drop(client);
                    });
                    continue;
                }
                let Ok(server) = tokio::net::TcpStream::connect("127.0.0.1:5672").await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, to) in [(client_read, server_write), (server_read, client_write)] {
                    tokio::spawn(pump(from, to, Arc::clone(&frozen), this_cut.clone()));
                }
            }
        });
        proxy
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.address)
    }

    /// Stops forwarding on every connection, and answers no new one.
    fn freeze(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Closes every connection it holds (the consumer sees a reset).
    fn cut(&self) {
        let mut cut = self.cut.lock().unwrap();
        cut.cancel();
        *cut = CancellationToken::new();
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.cut.lock().unwrap().cancel();
    }
}

/// Forwards `from` to `to` until either side closes or the proxy cuts;
/// once frozen it forwards nothing more and holds both sockets open.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<std::sync::atomic::AtomicBool>,
    cut: CancellationToken,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            _ = cut.cancelled() => return,
            read = from.read(&mut buf) => read,
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(std::sync::atomic::Ordering::SeqCst) {
            cut.cancelled().await;
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The shutdown timeout of the two tests below, and how much later than it
/// `run` may return: the bound the adapter states (after the shutdown
/// timeout, handlers that do not let go get 5 s more, and the connection's
/// close waits at most 5 s, `CLOSE_TIMEOUT`; a connect in progress ends
/// within its connect timeout, 10 s by default), plus slack for a loaded
/// machine.
const STALL_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);
const STALL_BOUND: Duration = Duration::from_secs(10);
const STALL_SLACK: Duration = Duration::from_secs(5);

/// A connection that stalls (no reset, no answer) when shutdown is asked:
/// `basic.cancel` and the connection's close are not answered, yet `run`
/// returns within the shutdown timeout plus the stated bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_in_time_on_a_stalled_connection() {
    let fx = Fixture::new("stall").await;
    let proxy = FreezingProxy::start().await;
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(proxy.url(), &fx.queue)
        .shutdown_timeout(STALL_SHUTDOWN_TIMEOUT)
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
    fx.publish_payment("stall-1", 1).await;
    wait_until("the ack", || stats.snapshot().acked == 1).await;
    proxy.freeze();
    let asked = tokio::time::Instant::now();
    shutdown.cancel();
    let limit = STALL_SHUTDOWN_TIMEOUT + STALL_BOUND + STALL_SLACK;
    let stopped = tokio::time::timeout(limit, run).await;
    let took = asked.elapsed();
    drop(proxy);
    fx.cleanup().await;
    let stats = stopped
        .unwrap_or_else(|_| panic!("run did not return within {limit:?} of the shutdown on a stalled connection"))
        .unwrap()
        .unwrap();
    assert_eq!(stats.acked, 1);
    assert!(took < limit, "took {took:?}");
}

/// Shutdown while reconnecting to a broker that accepts TCP but never
/// answers: the connect does not hold the shutdown.
/// A cancel while a connection attempt waits on a broker that accepted TCP
/// and never answers returns at once, not after the attempt's timeout: the
/// pipeline races every broker's connect against the shutdown (issue 43,
/// hole 8). Before, `run` waited out the connect timeout (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_during_a_connect_returns_at_once() {
    let fx = Fixture::new("connect-cancel").await;
    let proxy = FreezingProxy::start().await;
    proxy.freeze();
    let consumer = RabbitConsumer::builder(proxy.url(), &fx.queue)
        .connect_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let ledger = Ledger::default();
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = ledger.clone();
            async move { ledger.process(&msg.message_id).await }
        },
        shutdown.clone(),
    ));
    wait_until("a connect attempt held by the silent broker", || proxy.accepted() > 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = tokio::time::Instant::now();
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(5), run).await;
    let took = asked.elapsed();
    drop(proxy);
    fx.cleanup().await;
    let stats = stopped
        .unwrap_or_else(|_| panic!("run did not return within 5 s of a cancel during a connect"))
        .unwrap()
        .unwrap();
    assert_eq!(stats.acked, 0);
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_in_time_while_reconnecting_to_a_silent_broker() {
    let fx = Fixture::new("silent").await;
    let proxy = FreezingProxy::start().await;
    let ledger = Ledger::default();
    let consumer = RabbitConsumer::builder(proxy.url(), &fx.queue)
        .shutdown_timeout(STALL_SHUTDOWN_TIMEOUT)
        .reconnect(Reconnect::forever(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
        )))
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
    fx.publish_payment("silent-1", 1).await;
    wait_until("the ack", || stats.snapshot().acked == 1).await;
    let before = proxy.accepted();
    proxy.freeze();
    proxy.cut();
    wait_until("a reconnect attempt held by the silent broker", || {
        proxy.accepted() > before
    })
    .await;
    // Let the connect wait on the handshake for a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = tokio::time::Instant::now();
    shutdown.cancel();
    let limit = STALL_SHUTDOWN_TIMEOUT + STALL_BOUND + STALL_SLACK;
    let stopped = tokio::time::timeout(limit, run).await;
    let took = asked.elapsed();
    drop(proxy);
    fx.cleanup().await;
    let stats = stopped
        .unwrap_or_else(|_| panic!("run did not return within {limit:?} of the shutdown while reconnecting"))
        .unwrap()
        .unwrap();
    assert_eq!(stats.acked, 1);
    assert!(took < limit, "took {took:?}");
}

/// A TCP proxy in front of the broker that loses the first `basic.ack` a
/// client sends: it forwards the client's frames up to it, then closes the
/// connection on both sides instead of forwarding it (the broker requeues
/// the message, as when the acknowledgement is lost with the connection).
/// Every later connection and acknowledgement is forwarded.
struct AckCuttingProxy {
    address: String,
    /// Set until the first `basic.ack` is cut.
    armed: Arc<std::sync::atomic::AtomicBool>,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
}

impl AckCuttingProxy {
    async fn start() -> AckCuttingProxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = AckCuttingProxy {
            address: listener.local_addr().unwrap().to_string(),
            armed: Arc::new(AtomicBool::new(true)),
            accepted: Arc::default(),
            stop: CancellationToken::new(),
        };
        let (armed, accepted, stop) = (
            Arc::clone(&proxy.armed),
            Arc::clone(&proxy.accepted),
            proxy.stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => return,
                    },
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect("127.0.0.1:5672").await else {
                    continue;
                };
                // Cancelled when either direction ends: both sockets close.
                let cut = stop.child_token();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump_cutting_first_ack(
                    client_read,
                    server_write,
                    Arc::clone(&armed),
                    cut.clone(),
                ));
                tokio::spawn(async move {
                    pump(server_read, client_write, Arc::default(), cut.clone()).await;
                    cut.cancel();
                });
            }
        });
        proxy
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.address)
    }

    /// Whether the first `basic.ack` was cut.
    fn cut(&self) -> bool {
        !self.armed.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for AckCuttingProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Forwards a client's AMQP frames to the broker, whole frames at a time;
/// the first `basic.ack` (a method frame, type 1, of 13 bytes: class 60,
/// method 80, the delivery tag and the `multiple` bit) while `armed` is not
/// forwarded: the connection is closed on both sides instead.
async fn pump_cutting_first_ack(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    armed: Arc<std::sync::atomic::AtomicBool>,
    cut: CancellationToken,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The protocol header, `AMQP 0 0 9 1`, comes before the frames.
    let mut header_left = 8usize;
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            _ = cut.cancelled() => return,
            read = from.read(&mut buf) => read,
        };
        let n = match read {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        let mut at = header_left.min(pending.len());
        header_left -= at;
        // Whole frames: type (1), channel (2), size (4), payload, frame end.
        while pending.len() >= at + 7 {
            let size = u32::from_be_bytes(pending[at + 3..at + 7].try_into().unwrap()) as usize;
            let end = at + 7 + size + 1;
            if pending.len() < end {
                break;
            }
            let payload = &pending[at + 7..at + 7 + size];
            let is_ack = pending[at] == 1 && size == 13 && payload[..4] == [0x00, 0x3C, 0x00, 0x50];
            if is_ack && armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                let _ = to.write_all(&pending[..at]).await;
                cut.cancel();
                return;
            }
            at = end;
        }
        if to.write_all(&pending[..at]).await.is_err() {
            break;
        }
        pending.drain(..at);
    }
    cut.cancel();
}

/// The issue: the dead letter is published and confirmed, and the
/// `basic.ack` of the original that follows is lost with the connection;
/// RabbitMQ requeues the original. The reconnected consumer must settle
/// the redelivery without running its handler (which would now succeed and
/// commit an effect for a message already dead-lettered): one dead letter,
/// no effect, the queue empty.
async fn a_lost_ack_after_a_dead_letter_does_not_run_the_handler_again(name: &str, args: FieldTable) {
    use std::sync::atomic::{AtomicU32, Ordering};
    let quorum = !args.inner().is_empty();
    let fx = Fixture::with_args(name, args).await;
    let proxy = AckCuttingProxy::start().await;
    let calls = Arc::new(AtomicU32::new(0));
    let effects = Arc::new(AtomicU32::new(0));
    let consumer = RabbitConsumer::builder(proxy.url(), &fx.queue)
        .dead_letter_queue(&fx.dlq)
        .declare_queue(!quorum)
        .declare_dead_letter_queue(!quorum)
        .retry_backoff(fast_retries())
        .reconnect(Reconnect::forever(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
        )))
        .classify(|_: &String| Verdict::Reject)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let (handler_calls, handler_effects) = (Arc::clone(&calls), Arc::clone(&effects));
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            // Fails the first time (rejected: dead-lettered at once), works
            // afterwards.
            let first = handler_calls.fetch_add(1, Ordering::SeqCst) == 0;
            if !first {
                handler_effects.fetch_add(1, Ordering::SeqCst);
            }
            std::future::ready(if first {
                Err("refused the first time".to_owned())
            } else {
                Ok(())
            })
        },
        shutdown.clone(),
    ));
    fx.publish_payment("lost-ack-1", 1).await;
    wait_until("the acknowledgement cut", || proxy.cut()).await;
    wait_until("the redelivery settled on a new connection", || {
        let s = stats.snapshot();
        s.dead_lettered + s.acked >= 2
    })
    .await;
    assert!(proxy.accepted() >= 2, "reconnected");
    shutdown.cancel();
    let stats = tokio::time::timeout(WAIT, run).await.unwrap().unwrap().unwrap();
    // What the consumer left unacknowledged is requeued by the close.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dead = fx.drain(&fx.dlq).await;
    let left = fx.ready(&fx.queue).await;
    let (calls, effects) = (calls.load(Ordering::SeqCst), effects.load(Ordering::SeqCst));
    drop(proxy);
    fx.cleanup().await;
    assert_eq!(
        (calls, effects),
        (1, 0),
        "the handler ran again on the redelivery: {stats:?}"
    );
    assert_eq!(dead.len(), 1, "{stats:?}");
    assert_eq!(header_text(&dead[0], HEADER_KIND), "rejected");
    assert_eq!(left, 0, "the original is still in its queue: {stats:?}");
    assert_eq!(stats.acked, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_ack_after_a_dead_letter_does_not_run_the_handler_again_classic() {
    a_lost_ack_after_a_dead_letter_does_not_run_the_handler_again("lost-ack", FieldTable::default()).await;
}

/// The same on quorum queues, whose redelivery carries delivery counts in
/// its headers (left out of the message's identity).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_ack_after_a_dead_letter_does_not_run_the_handler_again_quorum() {
    a_lost_ack_after_a_dead_letter_does_not_run_the_handler_again("lost-ack-quorum", quorum()).await;
}
