//! One behavioural suite, run against every broker adapter.
//!
//! The promises every consumer keeps, whatever its broker, instantiated by
//! `conformance!` at the bottom for RabbitMQ, NATS JetStream, Redis
//! Streams (on one server, and on a private Redis Cluster shared by the
//! binary's tests) and Kafka (a private Tansu broker per test) on the real servers: ack after commit, a crash between commit and
//! ack redelivered and recognised by the marker, bounded retries then the
//! dead-letter destination with the body intact, permanent errors and poison
//! (undecodable, or longer than the body size limit) dead-lettered at once, a graceful shutdown that loses nothing, "consume
//! until drained", a store outage that is retried in place without
//! spending attempts or dead-lettering, and an outage of one message while
//! others are processed that spends its attempts. Broker-specific behaviour
//! (topologies, JetStream's delivery counts, RabbitMQ exchanges, Redis
//! claims) is tested in `idempotent-runtime/tests/*_adapter.rs`.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::broker::{
    Backoff, CancellationToken, Consumer, ConsumerBuilder, DeliveryInfo, HEADER_ATTEMPTS, HEADER_KIND, HEADER_REASON,
    HEADER_SOURCE, RunStats, pipeline::Broker,
};
use idempotent_runtime::store::Store;
use idempotent_runtime::{Error, MemoryStore, PgStore, idempotent};

const WAIT: Duration = Duration::from_secs(20);

/// A broker set up fresh (own queue, stream or key) per test.
pub trait Fixture: Sized + Send + Sync + 'static {
    type B: Broker;
    /// How long a message held by a consumer that died takes to come back.
    const REDELIVERY: Duration;
    fn setup(name: &str) -> impl Future<Output = Self> + Send;
    /// A consumer of this fixture's source, dead-lettering to its
    /// destination, with short delays.
    fn builder(&self) -> ConsumerBuilder<Self::B>;
    fn publish(&self, body: &[u8], id: &str) -> impl Future<Output = ()> + Send;
    /// Publishes where no message of [`publish`](Self::publish) waits
    /// behind it: the same for brokers without order, a partition of its
    /// own for Kafka (whose partitions are handled in order, so a message
    /// held in outage retries holds its partition).
    fn publish_alone(&self, body: &[u8], id: &str) -> impl Future<Output = ()> + Send {
        self.publish(body, id)
    }
    /// The broker tells a redelivery from a first delivery
    /// ([`DeliveryInfo::redelivered`]); Kafka keeps no delivery state.
    const KNOWS_REDELIVERIES: bool = true;
    /// Every dead letter so far: body and headers (as text).
    fn dead_letters(&self) -> impl Future<Output = Vec<(Vec<u8>, HashMap<String, String>)>> + Send;
    /// Messages neither settled nor dead-lettered (ready or held).
    fn backlog(&self) -> impl Future<Output = u64> + Send;
    fn teardown(self) -> impl Future<Output = ()> + Send;
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Payment {
    pub message_id: String,
    pub amount: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] idempotent_runtime::sqlx::Error),
    #[error("{0}")]
    Failed(String),
}

/// The service: an `#[idempotent]` handler whose effect is counted.
pub struct Ledger<S> {
    store: S,
    effects: Mutex<HashMap<String, u32>>,
    calls: Mutex<HashMap<String, u32>>,
}

impl<S: Store> Ledger<S> {
    fn new(store: S) -> Arc<Self> {
        Arc::new(Ledger {
            store,
            effects: Mutex::default(),
            calls: Mutex::default(),
        })
    }

    #[idempotent(key = "msg.message_id", store = self.store, scope = "conformance.payments")]
    async fn pay(&self, msg: &Payment) -> Result<(), AppError> {
        *self.effects.lock().unwrap().entry(msg.message_id.clone()).or_default() += 1;
        Ok(())
    }

    async fn handle(&self, msg: &Payment) -> Result<(), AppError> {
        *self.calls.lock().unwrap().entry(msg.message_id.clone()).or_default() += 1;
        self.pay(msg).await
    }

    fn effects(&self) -> HashMap<String, u32> {
        self.effects.lock().unwrap().clone()
    }

    fn calls(&self, id: &str) -> u32 {
        self.calls.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

fn payment(id: &str) -> Vec<u8> {
    serde_json::to_vec(&Payment {
        message_id: id.to_owned(),
        amount: 1,
    })
    .unwrap()
}

fn fast() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(40))
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `consumer` with the ledger's handler until `done`, then stops it.
async fn run_until<B: Broker, S: Store + 'static>(
    consumer: Consumer<B>,
    ledger: &Arc<Ledger<S>>,
    what: &str,
    done: impl Fn(&RunStats) -> bool,
) -> RunStats {
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_ledger = Arc::clone(ledger);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = Arc::clone(&handler_ledger);
            async move { ledger.handle(&msg).await }
        },
        shutdown.clone(),
    ));
    wait_until(what, || done(&stats.snapshot())).await;
    shutdown.cancel();
    tokio::time::timeout(WAIT, run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap()
}

pub async fn ok_handlers_are_acknowledged<F: Fixture>() {
    let fx = F::setup("ok").await;
    for i in 0..3 {
        fx.publish(&payment(&format!("ok-{i}")), &format!("ok-{i}")).await;
    }
    let ledger = Ledger::new(MemoryStore::new());
    let stats = run_until(fx.builder().build().unwrap(), &ledger, "3 acks", |s| s.acked == 3).await;
    assert_eq!(
        (stats.received, stats.acked, stats.failed, stats.dead_lettered),
        (3, 3, 0, 0)
    );
    assert_eq!(ledger.effects().len(), 3);
    assert_eq!(fx.backlog().await, 0, "nothing left or waiting for an ack");
    assert!(fx.dead_letters().await.is_empty());
    fx.teardown().await;
}

pub async fn a_crash_between_commit_and_ack_is_redelivered_and_recognised<F: Fixture>() {
    let fx = F::setup("crash").await;
    fx.publish(&payment("crash-1"), "crash-1").await;
    let ledger = Ledger::new(MemoryStore::new());

    // Consumer A commits, then its process "dies" before the ack.
    let consumer_a = fx.builder().concurrency(1).build().unwrap();
    let committed = Arc::new(tokio::sync::Notify::new());
    let (ledger_a, committed_a) = (Arc::clone(&ledger), Arc::clone(&committed));
    let run_a = tokio::spawn(consumer_a.run(
        move |msg: Payment| {
            let (ledger, committed) = (Arc::clone(&ledger_a), Arc::clone(&committed_a));
            async move {
                ledger.handle(&msg).await?;
                committed.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, AppError>(())
            }
        },
        CancellationToken::new(),
    ));
    tokio::time::timeout(WAIT, committed.notified())
        .await
        .expect("A committed");
    run_a.abort();
    assert!(run_a.await.unwrap_err().is_cancelled());
    assert_eq!(ledger.effects().get("crash-1"), Some(&1));

    // Consumer B gets it back and the marker makes it a duplicate.
    let seen: Arc<Mutex<Vec<DeliveryInfo>>> = Arc::default();
    let consumer_b = fx.builder().build().unwrap();
    let stats_b = consumer_b.stats();
    let shutdown = CancellationToken::new();
    let (ledger_b, seen_b) = (Arc::clone(&ledger), Arc::clone(&seen));
    let run_b = tokio::spawn(consumer_b.run_with_info(
        move |msg: Payment, info: DeliveryInfo| {
            let (ledger, seen) = (Arc::clone(&ledger_b), Arc::clone(&seen_b));
            async move {
                seen.lock().unwrap().push(info);
                ledger.handle(&msg).await
            }
        },
        shutdown.clone(),
    ));
    wait_until("the redelivery to be acked", || stats_b.snapshot().acked == 1).await;
    shutdown.cancel();
    run_b.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].redelivered || !F::KNOWS_REDELIVERIES,
        "flagged as a redelivery: {:?}",
        seen[0]
    );
    assert_eq!(seen[0].message_id.as_deref(), Some("crash-1"));
    assert_eq!(ledger.calls("crash-1"), 2, "the handler saw it twice");
    assert_eq!(ledger.effects().get("crash-1"), Some(&1), "the effect stayed single");
    assert_eq!(fx.backlog().await, 0);
    fx.teardown().await;
}

pub async fn failing_messages_are_dead_lettered_after_their_attempts<F: Fixture>() {
    let fx = F::setup("fail").await;
    let body = br#"{"message_id":"fail-1","amount":7}"#;
    fx.publish(body, "fail-1").await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let consumer = fx.builder().max_attempts(3).build().unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let seen = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run_with_info(
        move |_: Payment, info: DeliveryInfo| {
            seen.lock().unwrap().push(info.attempt);
            async move { Err::<(), _>(format!("gateway down\n(attempt {})", info.attempt)) }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(*calls.lock().unwrap(), [1, 2, 3], "attempts counted across retries");
    assert_eq!(
        (stats.failed, stats.retried, stats.dead_lettered, stats.acked),
        (3, 2, 1, 0)
    );
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    let (dead_body, headers) = &dead[0];
    assert_eq!(dead_body, body, "body intact");
    assert_eq!(headers[HEADER_KIND], "exhausted");
    assert_eq!(headers[HEADER_ATTEMPTS], "3");
    assert_eq!(headers[HEADER_REASON], "gateway down (attempt 3)", "one line");
    assert!(!headers[HEADER_SOURCE].is_empty());
    assert_eq!(fx.backlog().await, 0);
    fx.teardown().await;
}

pub async fn permanent_errors_and_poison_are_dead_lettered_at_once<F: Fixture>() {
    let fx = F::setup("permanent").await;
    fx.publish(&payment("permanent-1"), "permanent-1").await;
    fx.publish(b"{not json", "bad-json").await;
    fx.publish(br#"{"amount":5}"#, "no-key").await;
    fx.publish(&payment("good-1"), "good-1").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let consumer = fx
        .builder()
        .retry_if(|err: &AppError| match err {
            AppError::Idem(e) => e.is_transient(),
            _ => true,
        })
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if msg.message_id == "good-1" {
                    return Ok(());
                }
                // A missing key never gets better.
                Err::<(), _>(AppError::Idem(Error::MissingKey {
                    scope: "payments".into(),
                }))
            }
        },
        shutdown.clone(),
    ));
    wait_until("1 rejected, 2 poison, 1 ack", || {
        let s = stats.snapshot();
        s.dead_lettered == 1 && s.poison == 2 && s.acked == 1
    })
    .await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "poison never reaches the handler");
    let dead = fx.dead_letters().await;
    let kinds: Vec<&str> = {
        let mut k: Vec<&str> = dead.iter().map(|(_, h)| h[HEADER_KIND].as_str()).collect();
        k.sort();
        k
    };
    assert_eq!(kinds, ["poison", "poison", "rejected"]);
    let rejected = dead.iter().find(|(_, h)| h[HEADER_KIND] == "rejected").unwrap();
    assert_eq!(rejected.1[HEADER_ATTEMPTS], "1");
    assert!(rejected.1[HEADER_REASON].contains("no idempotency key"));
    let poison: Vec<&Vec<u8>> = dead
        .iter()
        .filter(|(_, h)| h[HEADER_KIND] == "poison")
        .map(|(b, _)| b)
        .collect();
    assert!(poison.contains(&&b"{not json".to_vec()) && poison.contains(&&br#"{"amount":5}"#.to_vec()));
    assert_eq!(fx.backlog().await, 0);
    fx.teardown().await;
}

pub async fn a_body_over_the_size_limit_is_poison<F: Fixture>() {
    // `max_body_bytes`: one byte over is dead-lettered before decoding,
    // with its size and the limit as the reason; at the limit it passes.
    let fx = F::setup("oversized").await;
    let fits = payment("size-1");
    let limit = fits.len();
    let over = payment("size-10");
    assert_eq!(over.len(), limit + 1);
    let reason = format!("body of {} bytes exceeds the limit of {limit}", limit + 1);
    fx.publish(&over, "size-10").await;
    fx.publish(&fits, "size-1").await;
    let ledger = Ledger::new(MemoryStore::new());
    let consumer = fx.builder().max_body_bytes(limit).build().unwrap();
    let stats = run_until(consumer, &ledger, "1 poison, 1 ack", |s| s.poison == 1 && s.acked == 1).await;
    assert_eq!((stats.poison, stats.acked, stats.failed), (1, 1, 0), "{stats:?}");
    assert_eq!(
        ledger.calls("size-10"),
        0,
        "an oversized body never reaches the handler"
    );
    assert_eq!(ledger.calls("size-1"), 1);
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    let (body, headers) = &dead[0];
    assert_eq!(body, &over, "body intact");
    assert_eq!(headers[HEADER_KIND], "poison");
    assert_eq!(headers[HEADER_ATTEMPTS], "0");
    assert_eq!(headers[HEADER_REASON], reason);

    // In batch mode too: the oversized delivery is settled alone, the
    // others commit in the batch.
    let db = DbLedger::new("oversized").await;
    for id in ["size-20", "size-2", "size-3"] {
        fx.publish(&payment(id), id).await;
    }
    let consumer = fx
        .builder()
        .concurrency(1)
        .max_body_bytes(limit)
        .batch(db.store.clone(), 4)
        .batch_wait(Duration::from_millis(50))
        .stop_when_idle(Duration::from_millis(1500))
        .build()
        .unwrap();
    let stats = run_batches(consumer, &db).await;
    assert_eq!((stats.poison, stats.acked), (1, 2), "{stats:?}");
    let effects = db.effects().await;
    assert_eq!(effects.keys().count(), 2, "{effects:?}");
    assert!(
        effects.contains_key("size-2") && effects.contains_key("size-3"),
        "{effects:?}"
    );
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 2);
    assert!(
        dead.iter()
            .any(|(body, h)| body == &payment("size-20") && h[HEADER_KIND] == "poison" && h[HEADER_REASON] == reason),
        "{dead:?}"
    );
    assert_eq!(fx.backlog().await, 0);
    db.teardown().await;
    fx.teardown().await;
}

pub async fn a_panicking_handler_is_a_failed_attempt<F: Fixture>() {
    let fx = F::setup("panic").await;
    fx.publish(&payment("panic-1"), "panic-1").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let consumer = fx.builder().max_attempts(2).build().unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_calls = Arc::clone(&calls);
    let run = tokio::spawn(consumer.run(
        move |_: Payment| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            async {
                if true {
                    panic!("handler bug");
                }
                Ok::<(), AppError>(())
            }
        },
        shutdown.clone(),
    ));
    wait_until("the dead letter", || stats.snapshot().dead_lettered == 1).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "a panic is retried like an error");
    assert_eq!((stats.failed, stats.retried), (2, 1));
    let dead = fx.dead_letters().await;
    assert_eq!(dead[0].1[HEADER_KIND], "exhausted");
    assert!(dead[0].1[HEADER_REASON].contains("handler panicked: handler bug"));
    fx.teardown().await;
}

pub async fn a_graceful_shutdown_loses_nothing_and_applies_nothing_twice<F: Fixture>() {
    const N: usize = 24;
    let fx = F::setup("shutdown").await;
    for i in 0..N {
        fx.publish(&payment(&format!("msg-{i:02}")), &format!("msg-{i:02}"))
            .await;
    }
    let ledger = Ledger::new(MemoryStore::new());
    let in_flight = Arc::new(AtomicUsize::new(0));
    let start = || {
        let consumer = fx.builder().concurrency(4).build().unwrap();
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let (ledger, in_flight) = (Arc::clone(&ledger), Arc::clone(&in_flight));
        let run = tokio::spawn(consumer.run(
            move |msg: Payment| {
                let (ledger, in_flight) = (Arc::clone(&ledger), Arc::clone(&in_flight));
                async move {
                    in_flight.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(60)).await;
                    let result = ledger.handle(&msg).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    result
                }
            },
            shutdown.clone(),
        ));
        (stats, shutdown, run)
    };
    let (_, shutdown_a, run_a) = start();
    wait_until("progress with handlers in flight", || {
        ledger.effects().len() >= 6 && in_flight.load(Ordering::SeqCst) > 0
    })
    .await;
    shutdown_a.cancel();
    let stats_a = tokio::time::timeout(WAIT, run_a)
        .await
        .expect("A stops")
        .unwrap()
        .unwrap();
    assert_eq!(in_flight.load(Ordering::SeqCst), 0, "in-flight handlers finished first");
    assert_eq!(stats_a.released, 0, "nothing handed back");
    assert!(stats_a.acked < N as u64, "stopped mid-way");
    let (stats_b, shutdown_b, run_b) = start();
    wait_until("all effects", || ledger.effects().len() == N).await;
    wait_until("all acks", || stats_a.acked + stats_b.snapshot().acked == N as u64).await;
    shutdown_b.cancel();
    run_b.await.unwrap().unwrap();
    let effects = ledger.effects();
    assert!(effects.values().all(|&n| n == 1), "none applied twice: {effects:?}");
    assert_eq!(fx.backlog().await, 0);
    fx.teardown().await;
}

pub async fn a_consumer_can_stop_once_drained<F: Fixture>() {
    let fx = F::setup("drained").await;
    for i in 0..5 {
        fx.publish(&payment(&format!("drain-{i}")), &format!("drain-{i}")).await;
    }
    let ledger = Ledger::new(MemoryStore::new());
    let consumer = fx.builder().stop_when_idle(Duration::from_millis(700)).build().unwrap();
    let handler_ledger = Arc::clone(&ledger);
    let stats = tokio::time::timeout(
        WAIT,
        consumer.run(
            move |msg: Payment| {
                let ledger = Arc::clone(&handler_ledger);
                async move { ledger.handle(&msg).await }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("returns on its own once idle")
    .unwrap();
    assert_eq!(stats.acked, 5);
    assert_eq!(ledger.effects().len(), 5);
    assert_eq!(fx.backlog().await, 0);
    fx.teardown().await;
}

pub async fn a_store_outage_is_retried_without_spending_attempts<F: Fixture>() {
    // The marker table is gone (a database that is down, a failover, a
    // migration in progress: `Error::Store`). The messages must neither be
    // dead-lettered nor burn their attempts; once the table is back they
    // are processed, once.
    let fx = F::setup("outage").await;
    let pool = common::pg_pool(4).await;
    let table = common::unique("outage");
    let store = PgStore::builder(pool.clone()).table(&table).build().unwrap();
    for i in 0..3 {
        fx.publish(&payment(&format!("outage-{i}")), &format!("outage-{i}"))
            .await;
    }
    let ledger = Ledger::new(store.clone());
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let consumer = fx
        .builder()
        .max_attempts(2)
        .outage_backoff(Backoff::new(Duration::from_millis(50), Duration::from_millis(200)))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let (handler_ledger, seen) = (Arc::clone(&ledger), Arc::clone(&attempts));
    let run = tokio::spawn(consumer.run_with_info(
        move |msg: Payment, info: DeliveryInfo| {
            let ledger = Arc::clone(&handler_ledger);
            seen.lock().unwrap().push(info.attempt);
            async move { ledger.handle(&msg).await }
        },
        shutdown.clone(),
    ));
    wait_until("outage retries", || stats.snapshot().outage_retries >= 9).await;
    assert_eq!(stats.snapshot().dead_lettered, 0, "an outage never dead-letters");
    store.migrate().await.unwrap();
    wait_until("the messages once the store is back", || stats.snapshot().acked == 3).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!((stats.dead_lettered, stats.retried), (0, 0));
    assert!(attempts.lock().unwrap().iter().all(|&a| a == 1), "no attempt spent");
    assert!(ledger.effects().values().all(|&n| n == 1));
    assert_eq!(ledger.effects().len(), 3);
    assert_eq!(fx.backlog().await, 0);
    assert!(fx.dead_letters().await.is_empty());
    common::drop_pg_table(&pool, &table).await;
    fx.teardown().await;
}

pub async fn an_outage_of_one_message_spends_attempts_once_others_are_processed<F: Fixture>() {
    // The handler calls "stuck"'s error an outage. While the consumer only
    // replays duplicates (a cache could answer them with the database
    // down), that proves nothing: the outage stays free. Once other
    // messages are processed, it is the message's own: it spends its
    // attempts and is dead-lettered.
    let fx = F::setup("own-outage").await;
    let ledger = Ledger::new(MemoryStore::new());
    let dup = Payment {
        message_id: "own-dup".into(),
        amount: 1,
    };
    ledger.pay(&dup).await.unwrap();
    fx.publish_alone(&payment("stuck"), "stuck").await;
    let consumer = fx
        .builder()
        .max_attempts(2)
        .outage_backoff(Backoff::new(Duration::from_millis(20), Duration::from_millis(40)))
        .classify(|err: &AppError| match err {
            AppError::Failed(_) => idempotent_runtime::broker::Verdict::Outage,
            _ => idempotent_runtime::broker::Verdict::Retry,
        })
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_ledger = Arc::clone(&ledger);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = Arc::clone(&handler_ledger);
            async move {
                if msg.message_id == "stuck" {
                    return Err(AppError::Failed("stuck: invalid data".into()));
                }
                ledger.handle(&msg).await
            }
        },
        shutdown.clone(),
    ));
    // The consumer holds "stuck" before the duplicates come (a Kafka
    // consumer joins its group first, which takes seconds).
    wait_until("the stuck message", || stats.snapshot().received >= 1).await;
    // Distinct broker-level ids: JetStream would drop a republished id.
    for i in 0..10 {
        fx.publish(&payment("own-dup"), &format!("own-dup-{i}")).await;
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    wait_until("the duplicates", || stats.snapshot().acked >= 10).await;
    let before = stats.snapshot();
    assert!(before.outage_retries >= 5, "{before:?}");
    assert_eq!(
        (before.retried, before.dead_lettered),
        (0, 0),
        "duplicates alone spend no attempt"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut fresh = 0;
    while stats.snapshot().dead_lettered == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dead-lettered: {:?}",
            stats.snapshot()
        );
        let id = format!("own-fresh-{fresh}");
        fx.publish(&payment(&id), &id).await;
        fresh += 1;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    shutdown.cancel();
    let stats = tokio::time::timeout(WAIT, run).await.unwrap().unwrap().unwrap();
    assert_eq!((stats.retried, stats.dead_lettered), (1, 1), "{stats:?}");
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1[HEADER_KIND], "exhausted");
    assert_eq!(dead[0].1[HEADER_ATTEMPTS], "2");
    assert_eq!(dead[0].1[HEADER_REASON], "stuck: invalid data");
    fx.teardown().await;
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Order {
    pub message_id: String,
    pub note: String,
}

/// The consumer of docs/brokers.md: an order's note inserted in the marker's
/// transaction, its errors classified as docs/brokers.md does.
struct Orders {
    store: PgStore,
    table: String,
}

impl Orders {
    #[idempotent(key = "msg.message_id", store = self.store, scope = "conformance.orders")]
    async fn place(&self, msg: &Order, tx: &mut idempotent_runtime::sqlx::PgConnection) -> Result<(), AppError> {
        let insert = format!("INSERT INTO {} (message_id, note) VALUES ($1, $2)", self.table);
        idempotent_runtime::sqlx::query(idempotent_runtime::sqlx::AssertSqlSafe(insert))
            .bind(&msg.message_id)
            .bind(&msg.note)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

fn classify_as_the_readme(err: &AppError) -> idempotent_runtime::broker::Verdict {
    use idempotent_runtime::broker::Verdict;
    match err {
        AppError::Idem(e) => e.verdict(),
        AppError::Db(e) => Verdict::of_sqlx(e),
        AppError::Failed(_) => Verdict::Retry,
    }
}

pub async fn a_database_data_error_is_rejected_at_once<F: Fixture>() {
    // The issue's order: a note holding a NUL byte, which PostgreSQL
    // refuses (22021) on every attempt. Classified as docs/brokers.md does, it
    // is dead-lettered at once (`rejected`), with no effect, while the
    // other order is processed.
    let fx = F::setup("nul").await;
    let pool = common::pg_pool(4).await;
    let table = common::unique("orders");
    let store = PgStore::builder(pool.clone())
        .table(&common::unique("orders_m"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let ddl = format!("CREATE TABLE {table} (message_id TEXT PRIMARY KEY, note TEXT NOT NULL)");
    idempotent_runtime::sqlx::query(idempotent_runtime::sqlx::AssertSqlSafe(ddl))
        .execute(&pool)
        .await
        .unwrap();
    let orders = Arc::new(Orders {
        store: store.clone(),
        table: table.clone(),
    });
    let order = |id: &str, note: &str| {
        serde_json::to_vec(&Order {
            message_id: id.into(),
            note: note.into(),
        })
        .unwrap()
    };
    let bad = order("nul-1", "gift\u{0}wrap");
    fx.publish(&bad, "nul-1").await;
    fx.publish(&order("nul-2", "gift wrap"), "nul-2").await;
    let consumer = fx
        .builder()
        .max_attempts(5)
        .classify(classify_as_the_readme)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_orders = Arc::clone(&orders);
    let run = tokio::spawn(consumer.run(
        move |msg: Order| {
            let orders = Arc::clone(&handler_orders);
            async move { orders.place(&msg).await }
        },
        shutdown.clone(),
    ));
    wait_until("1 rejected, 1 ack", || {
        let s = stats.snapshot();
        s.dead_lettered == 1 && s.acked == 1
    })
    .await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(
        (stats.failed, stats.retried, stats.outage_retries),
        (1, 0, 0),
        "one run, no retry: {stats:?}"
    );
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    let (body, headers) = &dead[0];
    assert_eq!(body, &bad);
    assert_eq!(headers[HEADER_KIND], "rejected");
    assert_eq!(headers[HEADER_ATTEMPTS], "1");
    assert!(headers[HEADER_REASON].contains("0x00"), "{}", headers[HEADER_REASON]);
    let notes: Vec<String> = idempotent_runtime::sqlx::query_scalar(idempotent_runtime::sqlx::AssertSqlSafe(format!(
        "SELECT message_id FROM {table} ORDER BY message_id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(notes, ["nul-2"]);
    assert_eq!(fx.backlog().await, 0);
    common::drop_pg_table(&pool, &table).await;
    common::drop_pg_table(&pool, &store.table().to_string()).await;
    fx.teardown().await;
}

/// A service whose effect is a row in PostgreSQL, in the marker's
/// transaction: what batch mode needs (an in-memory effect would survive a
/// batch's rollback).
struct DbLedger {
    store: PgStore,
    effects: String,
    /// Messages whose first run fails (returns `Err`) or panics.
    fail_once: Mutex<HashMap<String, &'static str>>,
}

impl DbLedger {
    async fn new(name: &str) -> Arc<DbLedger> {
        let pool = common::pg_pool(8).await;
        let store = PgStore::builder(pool.clone())
            .table(&common::unique(&format!("{name}_m")))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let effects = common::unique(&format!("{name}_e"));
        let ddl = format!("CREATE TABLE {effects} (message_id TEXT NOT NULL)");
        idempotent_runtime::sqlx::query(idempotent_runtime::sqlx::AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .unwrap();
        Arc::new(DbLedger {
            store,
            effects,
            fail_once: Mutex::default(),
        })
    }

    #[idempotent(key = "msg.message_id", store = self.store, scope = "conformance.batch")]
    async fn pay(&self, msg: &Payment, tx: &mut idempotent_runtime::sqlx::PgConnection) -> Result<(), AppError> {
        let insert = format!("INSERT INTO {} (message_id) VALUES ($1)", self.effects);
        idempotent_runtime::sqlx::query(idempotent_runtime::sqlx::AssertSqlSafe(insert))
            .bind(&msg.message_id)
            .execute(&mut *tx)
            .await?;
        let failure = self.fail_once.lock().unwrap().remove(&msg.message_id);
        match failure {
            Some("panic") => panic!("first run of {} panics", msg.message_id),
            Some(_) => Err(AppError::Failed(format!("first run of {} fails", msg.message_id))),
            None => Ok(()),
        }
    }

    /// Effects per message id.
    async fn effects(&self) -> HashMap<String, i64> {
        let sql = format!("SELECT message_id, COUNT(*) FROM {} GROUP BY message_id", self.effects);
        idempotent_runtime::sqlx::query_as::<_, (String, i64)>(idempotent_runtime::sqlx::AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    async fn teardown(&self) {
        common::drop_pg_table(self.store.pool(), &self.store.table().to_string()).await;
        common::drop_pg_table(self.store.pool(), &self.effects).await;
    }
}

/// Runs `consumer` with the ledger's handler until it is idle.
async fn run_batches<B: Broker>(consumer: Consumer<B>, ledger: &Arc<DbLedger>) -> RunStats {
    let ledger = Arc::clone(ledger);
    tokio::time::timeout(
        WAIT * 2,
        consumer.run(
            move |msg: Payment| {
                let ledger = Arc::clone(&ledger);
                async move { ledger.pay(&msg).await }
            },
            CancellationToken::new(),
        ),
    )
    .await
    .expect("returns once idle")
    .unwrap()
}

pub async fn batches_apply_each_message_once_and_settle_after_the_commit<F: Fixture>() {
    let fx = F::setup("batch").await;
    let ledger = DbLedger::new("batch").await;
    ledger.fail_once.lock().unwrap().insert("batch-7".into(), "error");
    for i in 0..40 {
        fx.publish(&payment(&format!("batch-{i}")), &format!("batch-{i}")).await;
    }
    // Redeliveries of processed messages (other broker-level ids).
    for i in 0..10 {
        fx.publish(&payment(&format!("batch-{i}")), &format!("again-{i}")).await;
    }
    fx.publish(b"{not json", "poison").await;
    let consumer = fx
        .builder()
        .concurrency(2)
        .batch(ledger.store.clone(), 8)
        .batch_wait(Duration::from_millis(5))
        .stop_when_idle(Duration::from_millis(1500))
        .build()
        .unwrap();
    let stats = run_batches(consumer, &ledger).await;
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), 40, "every message applied: {effects:?}");
    assert!(effects.values().all(|&n| n == 1), "none twice: {effects:?}");
    assert_eq!(
        (stats.acked, stats.retried, stats.poison, stats.dead_lettered),
        (50, 1, 1, 0),
        "{stats:?}"
    );
    assert!(stats.batches >= 1, "{stats:?}");
    assert_eq!(
        stats.batched, 51,
        "every decoded delivery ran in a committed batch: {stats:?}"
    );
    assert_eq!(stats.batches_aborted, 0);
    assert_eq!(fx.backlog().await, 0);
    ledger.teardown().await;
    fx.teardown().await;
}

pub async fn a_batch_that_cannot_commit_runs_its_deliveries_alone<F: Fixture>() {
    // A panic with the claim open: the batch's transaction is lost.
    a_failed_batch_runs_again_one_by_one::<F>("abort", "panic", true).await
}

pub async fn batches_without_savepoints_run_a_failed_batch_again_one_by_one<F: Fixture>() {
    // Its body fails once (after its effect's INSERT): with no savepoint to
    // undo it alone, its whole batch rolls back and runs again one by one.
    a_failed_batch_runs_again_one_by_one::<F>("lean", "error", false).await
}

/// Twelve payments in batches of 6, the fourth failing once with `failure`:
/// its batch aborts, its deliveries run again alone, each applied once.
async fn a_failed_batch_runs_again_one_by_one<F: Fixture>(prefix: &str, failure: &'static str, savepoints: bool) {
    let fx = F::setup(&format!("batch-{prefix}")).await;
    let ledger = DbLedger::new(&format!("batch_{prefix}")).await;
    ledger.fail_once.lock().unwrap().insert(format!("{prefix}-3"), failure);
    for i in 0..12 {
        fx.publish(&payment(&format!("{prefix}-{i}")), &format!("{prefix}-{i}"))
            .await;
    }
    let consumer = fx
        .builder()
        .concurrency(1)
        .batch(ledger.store.clone(), 6)
        .batch_savepoints(savepoints)
        .batch_wait(Duration::from_millis(20))
        .stop_when_idle(Duration::from_millis(1500))
        .build()
        .unwrap();
    let stats = run_batches(consumer, &ledger).await;
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), 12, "every message applied: {effects:?}");
    assert!(effects.values().all(|&n| n == 1), "none twice: {effects:?}");
    assert_eq!(stats.batches_aborted, 1, "{stats:?}");
    assert!(stats.batches >= 1, "the other batch committed: {stats:?}");
    assert_eq!((stats.acked, stats.dead_lettered), (12, 0), "{stats:?}");
    assert_eq!(fx.backlog().await, 0);
    ledger.teardown().await;
    fx.teardown().await;
}

#[test]
fn the_body_size_limit_is_1_mib_by_default_and_at_least_1() {
    use idempotent_runtime::broker::DEFAULT_MAX_BODY_BYTES;
    use idempotent_runtime::rabbitmq::RabbitConsumer;
    assert_eq!(DEFAULT_MAX_BODY_BYTES, 1_048_576);
    let builder = RabbitConsumer::builder("amqp://x", "q");
    assert_eq!(builder.options().max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    let zero = RabbitConsumer::builder("amqp://x", "q")
        .max_body_bytes(0)
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(zero.contains("max_body_bytes must be at least 1"), "{zero}");
}

#[test]
fn batch_settings_are_checked_at_build() {
    use idempotent_runtime::rabbitmq::RabbitConsumer;
    let store = || PgStore::new(idempotent_runtime::sqlx::PgPool::connect_lazy(common::PG_URL).unwrap());
    let build =
        |b: ConsumerBuilder<idempotent_runtime::rabbitmq::Rabbit>| b.build().map(|_| ()).unwrap_err().to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let zero = build(RabbitConsumer::builder("amqp://x", "q").batch(store(), 0));
    assert!(zero.contains("at least 1"), "{zero}");
    let long = build(
        RabbitConsumer::builder("amqp://x", "q")
            .batch(store(), 8)
            .batch_wait(Duration::from_secs(1)),
    );
    assert!(long.contains("never longer"), "{long}");
    let alone = build(RabbitConsumer::builder("amqp://x", "q").batch_wait(Duration::from_millis(1)));
    assert!(alone.contains("batch_wait needs batch"), "{alone}");
    let alone = build(RabbitConsumer::builder("amqp://x", "q").batch_savepoints(false));
    assert!(alone.contains("batch_savepoints needs batch"), "{alone}");
    // Set before or after `batch`, the setting holds.
    let before = RabbitConsumer::builder("amqp://x", "q")
        .batch(store(), 8)
        .batch_savepoints(false);
    assert_eq!(before.options().batch.as_ref().map(|b| b.savepoints), Some(false));
    let kept = before.batch(store(), 16);
    assert_eq!(
        kept.options().batch.as_ref().map(|b| (b.max, b.savepoints)),
        Some((16, false))
    );
    let default = RabbitConsumer::builder("amqp://x", "q").batch(store(), 8);
    assert_eq!(default.options().batch.as_ref().map(|b| b.savepoints), Some(true));
}

macro_rules! conformance {
    ($module:ident, $fixture:ty) => {
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ok_handlers_are_acknowledged() {
                super::ok_handlers_are_acknowledged::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_without_savepoints_run_a_failed_batch_again_one_by_one() {
                super::batches_without_savepoints_run_a_failed_batch_again_one_by_one::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_crash_between_commit_and_ack_is_redelivered_and_recognised() {
                super::a_crash_between_commit_and_ack_is_redelivered_and_recognised::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn failing_messages_are_dead_lettered_after_their_attempts() {
                super::failing_messages_are_dead_lettered_after_their_attempts::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn permanent_errors_and_poison_are_dead_lettered_at_once() {
                super::permanent_errors_and_poison_are_dead_lettered_at_once::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_body_over_the_size_limit_is_poison() {
                super::a_body_over_the_size_limit_is_poison::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panicking_handler_is_a_failed_attempt() {
                super::a_panicking_handler_is_a_failed_attempt::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_graceful_shutdown_loses_nothing_and_applies_nothing_twice() {
                super::a_graceful_shutdown_loses_nothing_and_applies_nothing_twice::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_consumer_can_stop_once_drained() {
                super::a_consumer_can_stop_once_drained::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_store_outage_is_retried_without_spending_attempts() {
                super::a_store_outage_is_retried_without_spending_attempts::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_outage_of_one_message_spends_attempts_once_others_are_processed() {
                super::an_outage_of_one_message_spends_attempts_once_others_are_processed::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_database_data_error_is_rejected_at_once() {
                super::a_database_data_error_is_rejected_at_once::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_apply_each_message_once_and_settle_after_the_commit() {
                super::batches_apply_each_message_once_and_settle_after_the_commit::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_that_cannot_commit_runs_its_deliveries_alone() {
                super::a_batch_that_cannot_commit_runs_its_deliveries_alone::<$fixture>().await
            }
        }
    };
}

// ---- fixtures ----------------------------------------------------------

mod rabbit {
    use idempotent_runtime::lapin::message::BasicGetMessage;
    use idempotent_runtime::lapin::options::{
        BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
    use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
    use idempotent_runtime::rabbitmq::{Rabbit, RabbitConsumer};

    use super::*;

    pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

    pub struct RabbitFixture {
        conn: Connection,
        admin: Channel,
        queue: String,
        dlq: String,
    }

    impl RabbitFixture {
        async fn count(&self, queue: &str) -> u64 {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            match self
                .admin
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await
            {
                Ok(q) => u64::from(q.message_count()),
                Err(err) => panic!("queue {queue}: {err}"),
            }
        }
    }

    fn text(value: &AMQPValue) -> String {
        match value {
            AMQPValue::LongString(s) => s.to_string(),
            AMQPValue::ShortString(s) => s.to_string(),
            AMQPValue::LongLongInt(v) => v.to_string(),
            AMQPValue::LongInt(v) => v.to_string(),
            other => format!("{other:?}"),
        }
    }

    impl Fixture for RabbitFixture {
        type B = Rabbit;
        const REDELIVERY: Duration = Duration::ZERO;

        async fn setup(name: &str) -> Self {
            let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
                .await
                .expect("RabbitMQ at 127.0.0.1:5672");
            let admin = conn.create_channel().await.unwrap();
            admin.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
            let queue = common::unique(&format!("conf.{name}"));
            let dlq = format!("{queue}.dlq");
            for q in [&queue, &dlq] {
                admin
                    .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
                    .await
                    .unwrap();
            }
            RabbitFixture {
                conn,
                admin,
                queue,
                dlq,
            }
        }

        fn builder(&self) -> ConsumerBuilder<Rabbit> {
            RabbitConsumer::builder(AMQP_URL, &self.queue)
                .prefetch(8)
                .dead_letter_queue(&self.dlq)
                .retry_backoff(fast())
                .shutdown_timeout(Duration::from_secs(5))
        }

        async fn publish(&self, body: &[u8], id: &str) {
            let props = BasicProperties::default()
                .with_message_id(id.into())
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

        async fn dead_letters(&self) -> Vec<(Vec<u8>, HashMap<String, String>)> {
            let mut out = Vec::new();
            // Read and put back: `basic_get` without ack, then nack all.
            let mut held: Vec<BasicGetMessage> = Vec::new();
            while let Some(msg) = self
                .admin
                .basic_get(self.dlq.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
            {
                let headers = msg
                    .delivery
                    .properties
                    .headers()
                    .as_ref()
                    .map(|h| h.inner().iter().map(|(k, v)| (k.to_string(), text(v))).collect())
                    .unwrap_or_default();
                out.push((msg.delivery.data.clone(), headers));
                held.push(msg);
            }
            for msg in held {
                msg.delivery
                    .acker
                    .nack(idempotent_runtime::lapin::options::BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await
                    .unwrap();
            }
            out
        }

        async fn backlog(&self) -> u64 {
            self.count(&self.queue).await
        }

        async fn teardown(self) {
            for q in [&self.queue, &self.dlq] {
                self.admin
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .unwrap();
            }
            let _ = self.conn.close(200, "test done".into()).await;
        }
    }
}

mod jetstream {
    use idempotent_runtime::nats::{JetStream, JetStreamConsumer};

    use super::*;

    pub struct NatsFixture(common::nats::Streams);

    impl Fixture for NatsFixture {
        type B = JetStream;
        const REDELIVERY: Duration = Duration::from_secs(1);

        async fn setup(name: &str) -> Self {
            NatsFixture(common::nats::Streams::setup("conf", name, Self::REDELIVERY, None).await)
        }

        fn builder(&self) -> ConsumerBuilder<JetStream> {
            JetStreamConsumer::builder(self.0.js.clone(), self.0.consumer.clone())
                .dead_letter_subject(&self.0.dlq_subject)
                .fetch_expiry(Duration::from_millis(300))
                .retry_backoff(fast())
                .shutdown_timeout(Duration::from_secs(5))
        }

        async fn publish(&self, body: &[u8], id: &str) {
            self.0.publish(body.to_vec(), id).await;
        }

        async fn dead_letters(&self) -> Vec<(Vec<u8>, HashMap<String, String>)> {
            self.0.dead_letters().await
        }

        async fn backlog(&self) -> u64 {
            let (pending, unacked) = self.0.backlog().await;
            pending + unacked as u64
        }

        async fn teardown(self) {
            self.0.teardown().await;
        }
    }
}

mod tansu {
    use std::sync::atomic::AtomicI32;

    use idempotent_runtime::kafka::{Kafka, KafkaConsumer};

    use super::*;

    /// A topic of 3 partitions on a private Tansu broker: messages are
    /// published to partitions 1 and 2 in turn, and
    /// [`publish_alone`](Fixture::publish_alone) to partition 0.
    pub struct KafkaFixture {
        kafka: common::kafka::Kafka,
        topic: String,
        dlq: String,
        turn: AtomicI32,
    }

    const GROUP: &str = "workers";

    impl Fixture for KafkaFixture {
        type B = Kafka;
        const REDELIVERY: Duration = Duration::ZERO;
        const KNOWS_REDELIVERIES: bool = false;

        async fn setup(name: &str) -> Self {
            let kafka = common::kafka::Kafka::start();
            let topic = common::unique(&format!("conf.{name}"));
            let dlq = format!("{topic}.dlq");
            kafka.create_topic(&topic, 3).await;
            kafka.create_topic(&dlq, 1).await;
            KafkaFixture {
                kafka,
                topic,
                dlq,
                turn: AtomicI32::new(0),
            }
        }

        fn builder(&self) -> ConsumerBuilder<Kafka> {
            KafkaConsumer::builder(self.kafka.config(), &self.topic, GROUP)
                .dead_letter_topic(&self.dlq)
                .commit_interval(Duration::from_millis(200))
                .revoke_timeout(Duration::from_secs(5))
                .retry_backoff(fast())
                .shutdown_timeout(Duration::from_secs(5))
        }

        async fn publish(&self, body: &[u8], id: &str) {
            let partition = 1 + self.turn.fetch_add(1, Ordering::Relaxed) % 2;
            self.kafka
                .produce(&self.topic, Some(partition), Some(id), body, &[("message_id", id)])
                .await;
        }

        async fn publish_alone(&self, body: &[u8], id: &str) {
            self.kafka
                .produce(&self.topic, Some(0), Some(id), body, &[("message_id", id)])
                .await;
        }

        async fn dead_letters(&self) -> Vec<(Vec<u8>, HashMap<String, String>)> {
            self.kafka
                .read_all(&self.dlq)
                .await
                .into_iter()
                .map(|r| (r.value, r.headers))
                .collect()
        }

        async fn backlog(&self) -> u64 {
            self.kafka.lag(GROUP, &self.topic).await
        }

        async fn teardown(self) {
            // The broker (memory storage) goes with its process.
            drop(self.kafka);
        }
    }
}

mod streams {
    use idempotent_runtime::redis::{self, AsyncCommands};
    use idempotent_runtime::redis_streams::{RedisStream, StreamConsumer, StreamConsumerBuilder};

    use super::*;

    /// A stream on one Redis server (`MultiplexedConnection`, the
    /// machine's Redis) or on a Redis Cluster (`ClusterConnection`, the
    /// private cluster this test binary shares): the same fixture, on the
    /// server's connection type.
    pub struct RedisFixture<C = redis::aio::MultiplexedConnection> {
        consumer: MakeConsumer,
        conn: C,
        stream: String,
        dlq: String,
    }

    /// How a fixture reaches its server: a connection for the fixture's
    /// own commands, a consumer builder, and the stream's name (in a
    /// cluster, a hash tag, so that its dead-letter stream shares its
    /// slot).
    pub trait Server: redis::aio::ConnectionLike + Clone + Send + Sync + Sized + 'static {
        fn open(name: &str) -> impl Future<Output = (Self, MakeConsumer, String)> + Send;
    }

    /// A consumer builder of the named stream.
    type MakeConsumer = Box<dyn Fn(&str) -> StreamConsumerBuilder + Send + Sync>;

    impl Server for redis::aio::MultiplexedConnection {
        fn open(name: &str) -> impl Future<Output = (Self, MakeConsumer, String)> + Send {
            let stream = common::unique(&format!("conf.{name}"));
            async move {
                let client = redis::Client::open(common::REDIS_URL).unwrap();
                let conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("Redis at 127.0.0.1:6379");
                let consumer = move |stream: &str| StreamConsumer::builder(client.clone(), stream, "workers");
                (conn, Box::new(consumer) as MakeConsumer, stream)
            }
        }
    }

    impl Server for redis::cluster_async::ClusterConnection {
        fn open(name: &str) -> impl Future<Output = (Self, MakeConsumer, String)> + Send {
            let stream = format!("{{{}}}", common::unique(&format!("conf.{name}")));
            async move {
                let cluster = common::cluster::RedisCluster::shared();
                let conn = cluster.connection().await;
                let client = cluster.client();
                let consumer = move |stream: &str| StreamConsumer::cluster_builder(client.clone(), stream, "workers");
                (conn, Box::new(consumer) as MakeConsumer, stream)
            }
        }
    }

    /// The fixture on the Redis Cluster.
    pub type ClusterFixture = RedisFixture<redis::cluster_async::ClusterConnection>;

    fn text(value: &redis::Value) -> String {
        match value {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            redis::Value::SimpleString(s) => s.clone(),
            redis::Value::Int(i) => i.to_string(),
            other => format!("{other:?}"),
        }
    }

    impl<C: Server> Fixture for RedisFixture<C> {
        type B = RedisStream;
        const REDELIVERY: Duration = Duration::from_millis(600);

        async fn setup(name: &str) -> Self {
            let (conn, consumer, stream) = C::open(name).await;
            let dlq = format!("{stream}.dlq");
            RedisFixture {
                consumer,
                conn,
                stream,
                dlq,
            }
        }

        fn builder(&self) -> ConsumerBuilder<RedisStream> {
            (self.consumer)(&self.stream)
                .claim_idle(Self::REDELIVERY)
                .block(Duration::from_millis(300))
                .retry_backoff(fast())
                .shutdown_timeout(Duration::from_secs(5))
        }

        async fn publish(&self, body: &[u8], id: &str) {
            let mut conn = self.conn.clone();
            let _: String = conn
                .xadd(&self.stream, "*", &[("message_id", id.as_bytes()), ("body", body)])
                .await
                .unwrap();
        }

        async fn dead_letters(&self) -> Vec<(Vec<u8>, HashMap<String, String>)> {
            let mut conn = self.conn.clone();
            let reply: redis::streams::StreamRangeReply = conn.xrange_all(&self.dlq).await.unwrap();
            reply
                .ids
                .into_iter()
                .map(|entry| {
                    let body = match entry.map.get("body") {
                        Some(redis::Value::BulkString(b)) => b.clone(),
                        _ => Vec::new(),
                    };
                    let headers = entry.map.iter().map(|(k, v)| (k.clone(), text(v))).collect();
                    (body, headers)
                })
                .collect()
        }

        async fn backlog(&self) -> u64 {
            let mut conn = self.conn.clone();
            let groups: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(&self.stream).await.unwrap();
            groups
                .groups
                .iter()
                .map(|g| g.pending as u64 + g.lag.unwrap_or(0) as u64)
                .sum()
        }

        async fn teardown(self) {
            let mut conn = self.conn.clone();
            let _: () = conn.del(&[&self.stream, &self.dlq]).await.unwrap();
        }
    }
}

conformance!(rabbitmq, super::rabbit::RabbitFixture);
conformance!(nats, super::jetstream::NatsFixture);
conformance!(redis_streams, super::streams::RedisFixture);
conformance!(redis_streams_cluster, super::streams::ClusterFixture);
conformance!(kafka, super::tansu::KafkaFixture);
