//! What a message's last allowed delivery sees (issue 27, hole 4), on the
//! real NATS JetStream and Redis Streams servers, with an `#[idempotent]`
//! handler whose effect is a PostgreSQL row in the marker's transaction.
//!
//! - Batches keep every delivery alive until it is settled: a member that
//!   finished while a slower one runs, and the members whose settlement
//!   waits for an earlier member's (its outage retries, its retry backoff),
//!   are not redelivered meanwhile. Their redelivery would be the last one
//!   the broker allows (JetStream `max_deliver`, Redis Streams attempts),
//!   dead-lettered without running while the batch then commits its effect.
//! - On the last delivery, the handler only checks whether the message's
//!   effect is committed: a message processed before (its consumer died
//!   between the commit and the ack) is acknowledged, not dead-lettered; one
//!   never processed is dead-lettered without running its body.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::broker::{
    Backoff, CancellationToken, Consumer, ConsumerBuilder, HEADER_KIND, HEADER_REASON, RetryPolicy, RunStats, Verdict,
    pipeline::Broker,
};
use idempotent_runtime::sqlx::{self, PgConnection};
use idempotent_runtime::{Error, PgStore, idempotent};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Payment {
    message_id: String,
}

fn payment(id: &str) -> Vec<u8> {
    serde_json::to_vec(&Payment {
        message_id: id.to_owned(),
    })
    .unwrap()
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("a dependency is down")]
    Down,
    #[error("failed once on purpose")]
    Failed,
}

/// `Down` is an outage, anything else is retried.
fn verdict(error: &AppError) -> Verdict {
    match error {
        AppError::Down => Verdict::Outage,
        _ => Verdict::Retry,
    }
}

/// The service: an effect row per message in the marker's transaction, and
/// how each message behaves.
struct Ledger {
    store: PgStore,
    effects: String,
    /// Runs of the `#[idempotent]` body per message.
    bodies: Mutex<HashMap<String, u32>>,
    /// Messages whose handler sleeps this long after the body.
    slow: Mutex<HashMap<String, Duration>>,
    /// Messages whose handler fails as an outage for this long from its
    /// first call (before the body).
    down_for: Mutex<HashMap<String, Duration>>,
    down_until: Mutex<HashMap<String, Instant>>,
    /// Messages whose first call fails (before the body).
    fail_once: Mutex<HashSet<String>>,
}

impl Ledger {
    async fn new(name: &str) -> Arc<Ledger> {
        let pool = common::pg_pool(8).await;
        let store = PgStore::builder(pool.clone())
            .table(&common::unique(&format!("{name}_m")))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let effects = common::unique(&format!("{name}_e"));
        let ddl = format!("CREATE TABLE {effects} (message_id TEXT NOT NULL)");
        sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        Arc::new(Ledger {
            store,
            effects,
            bodies: Mutex::default(),
            slow: Mutex::default(),
            down_for: Mutex::default(),
            down_until: Mutex::default(),
            fail_once: Mutex::default(),
        })
    }

    #[idempotent(key = "msg.message_id", store = self.store, scope = "last_delivery.pay")]
    async fn pay(&self, msg: &Payment, tx: &mut PgConnection) -> Result<(), AppError> {
        *self.bodies.lock().unwrap().entry(msg.message_id.clone()).or_default() += 1;
        let insert = format!("INSERT INTO {} (message_id) VALUES ($1)", self.effects);
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(&msg.message_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// The consumer's handler.
    async fn handle(&self, msg: &Payment) -> Result<(), AppError> {
        let id = &msg.message_id;
        let down_for = self.down_for.lock().unwrap().get(id).copied();
        if let Some(down_for) = down_for {
            let until = *self
                .down_until
                .lock()
                .unwrap()
                .entry(id.clone())
                .or_insert_with(|| Instant::now() + down_for);
            if Instant::now() < until {
                return Err(AppError::Down);
            }
        }
        if self.fail_once.lock().unwrap().remove(id) {
            return Err(AppError::Failed);
        }
        self.pay(msg).await?;
        let slow = self.slow.lock().unwrap().get(id).copied();
        if let Some(slow) = slow {
            tokio::time::sleep(slow).await;
        }
        Ok(())
    }

    fn bodies(&self, id: &str) -> u32 {
        self.bodies.lock().unwrap().get(id).copied().unwrap_or(0)
    }

    /// Effect rows per message id.
    async fn effects(&self) -> HashMap<String, i64> {
        let sql = format!("SELECT message_id, COUNT(*) FROM {} GROUP BY message_id", self.effects);
        sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    /// Markers in the store.
    async fn markers(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.store.table());
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn teardown(&self) {
        common::drop_pg_table(self.store.pool(), &self.store.table().to_string()).await;
        common::drop_pg_table(self.store.pool(), &self.effects).await;
    }
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(ms(20)).await;
    }
}

/// Runs `consumer` with the ledger's handler until `done`, then stops it.
async fn run_until<B: Broker, R: RetryPolicy<AppError>>(
    consumer: Consumer<B, idempotent_runtime::broker::Json, R>,
    ledger: &Arc<Ledger>,
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

/// Every message applied once, none dead-lettered.
async fn assert_each_applied_once(ledger: &Ledger, ids: &[&str], stats: &RunStats) {
    let effects = ledger.effects().await;
    for id in ids {
        assert_eq!(effects.get(*id), Some(&1), "{id} applied once: {effects:?}, {stats:?}");
        assert_eq!(ledger.bodies(id), 1, "{id}'s body ran once: {stats:?}");
    }
    assert_eq!(stats.dead_lettered, 0, "nothing dead-lettered: {stats:?}");
}

// ---- NATS JetStream ----------------------------------------------------

mod nats {
    use idempotent_runtime::nats::{JetStream, JetStreamConsumer};

    use super::*;

    pub struct Fixture(common::nats::Streams);

    impl Fixture {
        /// A stream, its dead-letter stream, and the durable consumer
        /// `worker` with `ack_wait` and `max_deliver`.
        pub async fn setup(name: &str, ack_wait: Duration, max_deliver: i64) -> Fixture {
            Fixture(common::nats::Streams::setup("last", name, ack_wait, Some(max_deliver)).await)
        }

        pub fn builder(&self) -> ConsumerBuilder<JetStream> {
            JetStreamConsumer::builder(self.0.js.clone(), self.0.consumer.clone())
                .dead_letter_subject(&self.0.dlq_subject)
                .fetch_expiry(ms(300))
                .shutdown_timeout(Duration::from_secs(5))
        }

        pub async fn publish(&self, id: &str) {
            self.0.publish(payment(id), id).await;
        }

        /// Takes one delivery of the next message and never settles it (a
        /// consumer that died holding it).
        pub async fn lose_one_delivery(&self) {
            use futures_util::StreamExt;
            let mut messages = self
                .0
                .consumer
                .fetch()
                .max_messages(1)
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .unwrap();
            let msg = messages.next().await.expect("a message").unwrap();
            drop(msg);
        }

        /// The dead letters' headers.
        pub async fn dead_letters(&self) -> Vec<HashMap<String, String>> {
            self.0
                .dead_letters()
                .await
                .into_iter()
                .map(|(_, headers)| headers)
                .collect()
        }

        /// (pending, waiting for an ack).
        pub async fn backlog(&self) -> (u64, usize) {
            self.0.backlog().await
        }

        pub async fn teardown(self) {
            self.0.teardown().await;
        }
    }
}

// ---- Redis Streams -----------------------------------------------------

mod streams {
    use idempotent_runtime::redis::{self, AsyncCommands};
    use idempotent_runtime::redis_streams::{RedisStream, StreamConsumer};

    use super::*;

    pub const GROUP: &str = "workers";

    pub struct Fixture {
        client: redis::Client,
        conn: redis::aio::MultiplexedConnection,
        stream: String,
        dlq: String,
    }

    impl Fixture {
        pub async fn setup(name: &str) -> Fixture {
            let client = redis::Client::open(common::REDIS_URL).unwrap();
            let conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("Redis at 127.0.0.1:6379");
            let stream = common::unique(&format!("last.{name}"));
            let dlq = format!("{stream}.dlq");
            Fixture {
                client,
                conn,
                stream,
                dlq,
            }
        }

        pub fn builder(&self, claim_idle: Duration) -> ConsumerBuilder<RedisStream> {
            StreamConsumer::builder(self.client.clone(), &self.stream, GROUP)
                .consumer_name("live")
                .claim_idle(claim_idle)
                .block(ms(200))
                .shutdown_timeout(Duration::from_secs(5))
        }

        /// Adds the message; returns its entry id.
        pub async fn publish(&self, id: &str) -> String {
            let mut conn = self.conn.clone();
            conn.xadd(
                &self.stream,
                "*",
                &[("message_id", id.as_bytes()), ("body", payment(id).as_slice())],
            )
            .await
            .unwrap()
        }

        /// Makes every entry of the stream pending for a consumer that died
        /// long ago, each delivered `delivered[i]` times so far (the live
        /// consumer's reclaim adds one).
        pub async fn held_by_a_dead_consumer(&self, delivered: &[(&str, u32)]) {
            let mut conn = self.conn.clone();
            let _: () = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&self.stream)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut conn)
                .await
                .unwrap();
            let _: redis::Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(GROUP)
                .arg("ghost")
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(">")
                .query_async(&mut conn)
                .await
                .unwrap();
            for (entry, count) in delivered {
                let _: redis::Value = redis::cmd("XCLAIM")
                    .arg(&self.stream)
                    .arg(GROUP)
                    .arg("ghost")
                    .arg(0)
                    .arg(*entry)
                    .arg("IDLE")
                    .arg(60_000)
                    .arg("RETRYCOUNT")
                    .arg(*count)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        }

        /// The dead letters' fields.
        pub async fn dead_letters(&self) -> Vec<HashMap<String, String>> {
            let mut conn = self.conn.clone();
            let reply: redis::streams::StreamRangeReply = conn.xrange_all(&self.dlq).await.unwrap();
            reply
                .ids
                .into_iter()
                .map(|entry| {
                    entry
                        .map
                        .iter()
                        .map(|(k, v)| {
                            let text = match v {
                                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                                other => format!("{other:?}"),
                            };
                            (k.clone(), text)
                        })
                        .collect()
                })
                .collect()
        }

        /// Entries pending or not yet read by the group.
        pub async fn backlog(&self) -> u64 {
            let mut conn = self.conn.clone();
            let groups: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(&self.stream).await.unwrap();
            groups
                .groups
                .iter()
                .map(|g| g.pending as u64 + g.lag.unwrap_or(0) as u64)
                .sum()
        }

        pub async fn teardown(self) {
            let mut conn = self.conn.clone();
            let _: () = conn.del(&[&self.stream, &self.dlq]).await.unwrap();
        }
    }
}

// ---- batches keep their deliveries alive -------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_batch_member_that_finished_is_kept_alive_while_a_slower_one_runs() {
    // ack_wait 1 s, max_deliver 2: a redelivery of either message would be
    // its last, dead-lettered without running.
    let fx = nats::Fixture::setup("slow", Duration::from_secs(1), 2).await;
    let ledger = Ledger::new("last_slow_nats").await;
    ledger.slow.lock().unwrap().insert("slow-1".into(), ms(2500));
    fx.publish("fast-1").await;
    fx.publish("slow-1").await;
    let consumer = fx
        .builder()
        .concurrency(2)
        .batch(ledger.store.clone(), 2)
        .batch_wait(ms(50))
        .build()
        .unwrap();
    let stats = run_until(consumer, &ledger, "both settled", |s| s.acked + s.ack_failures >= 2).await;
    assert_each_applied_once(&ledger, &["fast-1", "slow-1"], &stats).await;
    assert_eq!((stats.received, stats.acked), (2, 2), "no redelivery: {stats:?}");
    assert!(fx.dead_letters().await.is_empty());
    assert_eq!(fx.backlog().await, (0, 0));
    ledger.teardown().await;
    fx.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_batch_member_that_finished_is_kept_alive_while_a_slower_one_runs() {
    // claim_idle 400 ms, max_attempts 1: a reclaimed entry is on its last
    // delivery.
    let fx = streams::Fixture::setup("slow").await;
    let ledger = Ledger::new("last_slow_redis").await;
    ledger.slow.lock().unwrap().insert("slow-1".into(), ms(1500));
    fx.publish("fast-1").await;
    fx.publish("slow-1").await;
    let consumer = fx
        .builder(ms(400))
        .max_attempts(1)
        .concurrency(2)
        .batch(ledger.store.clone(), 2)
        .batch_wait(ms(50))
        .build()
        .unwrap();
    let stats = run_until(consumer, &ledger, "both settled", |s| s.acked + s.ack_failures >= 2).await;
    assert_each_applied_once(&ledger, &["fast-1", "slow-1"], &stats).await;
    assert_eq!((stats.received, stats.acked), (2, 2), "no reclaim: {stats:?}");
    assert!(fx.dead_letters().await.is_empty());
    assert_eq!(fx.backlog().await, 0);
    ledger.teardown().await;
    fx.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_later_batch_members_are_kept_alive_while_an_earlier_one_settles() {
    // The batch commits `later-1`; `first-1` failed as an outage, so its
    // settlement runs it again in place for 2.5 s before `later-1` is
    // acknowledged.
    let fx = nats::Fixture::setup("settle", Duration::from_secs(1), 2).await;
    let ledger = Ledger::new("last_settle_nats").await;
    ledger.down_for.lock().unwrap().insert("first-1".into(), ms(2500));
    fx.publish("first-1").await;
    fx.publish("later-1").await;
    let consumer = fx
        .builder()
        .concurrency(2)
        .batch(ledger.store.clone(), 2)
        .batch_wait(ms(50))
        .outage_backoff(Backoff::new(ms(100), ms(200)))
        .classify(verdict)
        .build()
        .unwrap();
    let stats = run_until(consumer, &ledger, "both settled", |s| s.acked + s.ack_failures >= 2).await;
    assert_each_applied_once(&ledger, &["first-1", "later-1"], &stats).await;
    assert_eq!((stats.received, stats.acked), (2, 2), "no redelivery: {stats:?}");
    assert!(stats.outage_retries >= 1, "{stats:?}");
    assert!(fx.dead_letters().await.is_empty());
    assert_eq!(fx.backlog().await, (0, 0));
    ledger.teardown().await;
    fx.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_later_batch_members_are_kept_alive_while_an_earlier_one_waits_out_its_retry() {
    // max_attempts 2. Both entries were held by a consumer that died: the
    // live one reclaims `first-1` on its first delivery and `later-1` on
    // its second, so reclaiming `later-1` once more would be its last.
    // `first-1` fails once: its retry waits 1.5 s (claim_idle is 400 ms)
    // before `later-1`, which the batch committed, is acknowledged.
    let fx = streams::Fixture::setup("settle").await;
    let ledger = Ledger::new("last_settle_redis").await;
    ledger.fail_once.lock().unwrap().insert("first-1".into());
    let first = fx.publish("first-1").await;
    let later = fx.publish("later-1").await;
    fx.held_by_a_dead_consumer(&[(&first, 0), (&later, 1)]).await;
    let consumer = fx
        .builder(ms(400))
        .max_attempts(2)
        .concurrency(2)
        .batch(ledger.store.clone(), 2)
        .batch_wait(ms(50))
        .retry_backoff(Backoff::new(ms(1500), ms(1500)))
        .classify(verdict)
        .build()
        .unwrap();
    let stats = run_until(consumer, &ledger, "both settled", |s| s.acked + s.ack_failures >= 2).await;
    assert_each_applied_once(&ledger, &["first-1", "later-1"], &stats).await;
    assert_eq!(
        (stats.received, stats.retried, stats.acked),
        (3, 1, 2),
        "the two entries and first-1's retry copy: {stats:?}"
    );
    assert!(fx.dead_letters().await.is_empty());
    assert_eq!(fx.backlog().await, 0);
    ledger.teardown().await;
    fx.teardown().await;
}

// ---- the last delivery checks what is committed ------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_message_whose_effect_is_committed_is_acked_on_its_last_delivery() {
    // max_deliver 2. The message was processed (effect and marker
    // committed) by a consumer that died before its ack: the server's next
    // delivery is its last.
    let fx = nats::Fixture::setup("done", Duration::from_secs(1), 2).await;
    let ledger = Ledger::new("last_done_nats").await;
    ledger
        .pay(&Payment {
            message_id: "done-1".into(),
        })
        .await
        .unwrap();
    fx.publish("done-1").await;
    fx.lose_one_delivery().await;
    let stats = run_until(fx.builder().build().unwrap(), &ledger, "the settlement", |s| {
        s.acked + s.dead_lettered >= 1
    })
    .await;
    assert_each_applied_once(&ledger, &["done-1"], &stats).await;
    assert_eq!(stats.acked, 1, "{stats:?}");
    assert!(fx.dead_letters().await.is_empty());
    assert_eq!(fx.backlog().await, (0, 0));
    ledger.teardown().await;
    fx.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_message_never_processed_is_dead_lettered_on_its_last_delivery_without_running_its_body() {
    let fx = nats::Fixture::setup("never", Duration::from_secs(1), 2).await;
    let ledger = Ledger::new("last_never_nats").await;
    fx.publish("never-1").await;
    fx.lose_one_delivery().await;
    let stats = run_until(fx.builder().build().unwrap(), &ledger, "the settlement", |s| {
        s.acked + s.dead_lettered >= 1
    })
    .await;
    assert_eq!((stats.acked, stats.dead_lettered), (0, 1), "{stats:?}");
    assert_eq!(ledger.bodies("never-1"), 0, "the body never ran");
    assert!(ledger.effects().await.is_empty());
    assert_eq!(ledger.markers().await, 0, "the check left no marker");
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0][HEADER_KIND], "exhausted");
    assert!(dead[0][HEADER_REASON].contains("without being settled"), "{dead:?}");
    assert_eq!(fx.backlog().await, (0, 0));
    ledger.teardown().await;
    fx.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_message_whose_effect_is_committed_is_acked_on_its_last_delivery() {
    // max_attempts 2: an entry delivered twice already (its consumers died,
    // one of them after the commit) is reclaimed on its last delivery.
    let fx = streams::Fixture::setup("done").await;
    let ledger = Ledger::new("last_done_redis").await;
    ledger
        .pay(&Payment {
            message_id: "done-1".into(),
        })
        .await
        .unwrap();
    let entry = fx.publish("done-1").await;
    fx.held_by_a_dead_consumer(&[(&entry, 2)]).await;
    let consumer = fx.builder(ms(400)).max_attempts(2).build().unwrap();
    let stats = run_until(consumer, &ledger, "the settlement", |s| s.acked + s.dead_lettered >= 1).await;
    assert_each_applied_once(&ledger, &["done-1"], &stats).await;
    assert_eq!(stats.acked, 1, "{stats:?}");
    assert!(fx.dead_letters().await.is_empty());
    assert_eq!(fx.backlog().await, 0);
    ledger.teardown().await;
    fx.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_message_never_processed_is_dead_lettered_on_its_last_delivery_without_running_its_body() {
    let fx = streams::Fixture::setup("never").await;
    let ledger = Ledger::new("last_never_redis").await;
    let entry = fx.publish("never-1").await;
    fx.held_by_a_dead_consumer(&[(&entry, 2)]).await;
    let consumer = fx.builder(ms(400)).max_attempts(2).build().unwrap();
    let stats = run_until(consumer, &ledger, "the settlement", |s| s.acked + s.dead_lettered >= 1).await;
    assert_eq!((stats.acked, stats.dead_lettered), (0, 1), "{stats:?}");
    assert_eq!(ledger.bodies("never-1"), 0, "the body never ran");
    assert!(ledger.effects().await.is_empty());
    assert_eq!(ledger.markers().await, 0, "the check left no marker");
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0][HEADER_KIND], "exhausted");
    assert!(dead[0][HEADER_REASON].contains("without being settled"), "{dead:?}");
    assert_eq!(fx.backlog().await, 0);
    ledger.teardown().await;
    fx.teardown().await;
}
