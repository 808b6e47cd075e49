//! One end-to-end run: a queue filled beforehand (or fed at a steady rate),
//! one consumer with `slots` handler slots draining it into PostgreSQL,
//! timed from its first delivery to its last acknowledgement, with the CPU
//! time of this process, of PostgreSQL and of the broker's server.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotent_runtime::broker::pipeline::Broker;
use idempotent_runtime::broker::{CancellationToken, ConsumerBuilder, ConsumerStats};
use idempotent_runtime::sqlx::postgres::PgPoolOptions;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection, PgPool};
use idempotent_runtime::{PgStore, idempotent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::brokers::{BoxError, Kafka, Kind, Queue};

// Also in `benches/throughput/harness.rs`, which `benches/e2e.rs` loads
// for its chart: one file, two modules of that binary.
#[allow(clippy::duplicate_mod)]
#[path = "../shared/cpu.rs"]
pub mod cpu;

pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// What the consumer does with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// (a) No idempotency: the effect in a transaction of its own, acked
    /// after the commit (a duplicate is applied again).
    Plain,
    /// (s) The bound of (b): idempotency written by hand with one statement
    /// more than (a) in its transaction, a plain claim (`INSERT .. ON
    /// CONFLICT DO NOTHING` of the key; a duplicate rolls back).
    ByHand,
    /// (b) `#[idempotent]` on `PgStore`, one transaction per message.
    PerMessage,
    /// (d) Kafka only: (b) with the offsets in the database
    /// (`offsets_in(store)`), one transaction per message.
    Offsets,
    /// (c) The same handler with the consumer's batch transactions.
    Batch(Batching),
}

/// A batch variant's settings: `cN` (savepoints, the default), `oN`
/// (`batch_savepoints(false)`), `dN` (Kafka: offsets in the database,
/// savepoints); a suffix `wM` sets `batch_wait` to M ms (without it, the
/// builder's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    pub max: usize,
    pub savepoints: bool,
    pub offsets: bool,
    pub wait_ms: Option<u64>,
}

impl Variant {
    /// A batch of at most `max`, with savepoints and the default wait.
    pub const fn batch(max: usize) -> Variant {
        Variant::Batch(Batching {
            max,
            savepoints: true,
            offsets: false,
            wait_ms: None,
        })
    }

    /// `batch(max)` without savepoints.
    pub const fn lean(max: usize) -> Variant {
        Variant::Batch(Batching {
            max,
            savepoints: false,
            offsets: false,
            wait_ms: None,
        })
    }

    /// `batch(max)` with the offsets in the database (Kafka).
    pub const fn offsets_batch(max: usize) -> Variant {
        Variant::Batch(Batching {
            max,
            savepoints: true,
            offsets: true,
            wait_ms: None,
        })
    }

    pub fn label(self) -> String {
        match self {
            Variant::Plain => "a".into(),
            Variant::ByHand => "s".into(),
            Variant::PerMessage => "b".into(),
            Variant::Offsets => "d".into(),
            Variant::Batch(b) => {
                let letter = match (b.offsets, b.savepoints) {
                    (true, _) => 'd',
                    (false, true) => 'c',
                    (false, false) => 'o',
                };
                match b.wait_ms {
                    Some(ms) => format!("{letter}{}w{ms}", b.max),
                    None => format!("{letter}{}", b.max),
                }
            }
        }
    }

    /// `a`, `s`, `b`, `d`, `c` (batches of 32), `cN`, `o` (32, no
    /// savepoints), `oN`, `dN` (Kafka, offsets in the database, batches of
    /// N); a batch's `wM` suffix: a wait of M ms.
    pub fn parse(s: &str) -> Option<Variant> {
        match s {
            "a" => return Some(Variant::Plain),
            "s" => return Some(Variant::ByHand),
            "b" => return Some(Variant::PerMessage),
            "d" => return Some(Variant::Offsets),
            "c" => return Some(Variant::batch(32)),
            "o" => return Some(Variant::lean(32)),
            _ => {}
        }
        let (letter, rest) = s.split_at_checked(1)?;
        let (size, wait) = match rest.split_once('w') {
            Some((size, wait)) => (size, Some(wait.parse().ok()?)),
            None => (rest, None),
        };
        let max = size.parse().ok().filter(|&n: &usize| n > 0)?;
        let mut batching = match letter {
            "c" => Variant::batch(max),
            "o" => Variant::lean(max),
            "d" => Variant::offsets_batch(max),
            _ => return None,
        };
        if let Variant::Batch(b) = &mut batching {
            b.wait_ms = wait;
        }
        Some(batching)
    }

    /// Whether it runs on `kind` (the offsets in the database are Kafka's).
    pub fn applies_to(self, kind: Kind) -> bool {
        match self {
            Variant::Offsets | Variant::Batch(Batching { offsets: true, .. }) => kind == Kind::Kafka,
            _ => true,
        }
    }

    /// Deliveries per transaction at most.
    fn per_task(self) -> usize {
        match self {
            Variant::Batch(b) => b.max,
            _ => 1,
        }
    }

    fn offsets(self) -> bool {
        matches!(self, Variant::Offsets | Variant::Batch(Batching { offsets: true, .. }))
    }
}

/// The message body.
#[derive(Debug, Serialize, Deserialize)]
pub struct Payment {
    pub id: String,
    pub amount: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The database side, shared by every run of a benchmark.
pub struct Env {
    pub pool: PgPool,
    store: PgStore,
    markers: String,
    effects: String,
    insert: String,
    /// (s)'s marker table and claim.
    hand_markers: String,
    hand_claim: String,
    /// The private Kafka (Tansu) broker, when the run has Kafka.
    pub kafka: Option<Kafka>,
}

impl Env {
    /// Fresh marker and effect tables; `connections` for the pool (at
    /// least the largest slot count, so that no slot waits for one); a
    /// private Kafka broker when `kafka`.
    pub async fn new(connections: u32, kafka: bool) -> Result<Arc<Env>, BoxError> {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .connect(PG_URL)
            .await?;
        let (markers, effects) = (crate::unique("e2e_markers"), crate::unique("e2e_effects"));
        let store = PgStore::builder(pool.clone()).table(&markers).build()?;
        store.migrate().await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {effects} (id TEXT NOT NULL, amount BIGINT NOT NULL)"
        )))
        .execute(&pool)
        .await?;
        let hand_markers = crate::unique("e2e_hand");
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {hand_markers} (scope TEXT NOT NULL, message_id TEXT NOT NULL, \
             processed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (scope, message_id))"
        )))
        .execute(&pool)
        .await?;
        let kafka = if kafka {
            Some(tokio::task::spawn_blocking(Kafka::start).await?)
        } else {
            None
        };
        Ok(Arc::new(Env::with(
            pool,
            store,
            [markers, effects, hand_markers],
            kafka,
        )))
    }

    fn with(pool: PgPool, store: PgStore, [markers, effects, hand_markers]: [String; 3], kafka: Option<Kafka>) -> Env {
        Env {
            pool,
            store,
            insert: format!("INSERT INTO {effects} (id, amount) VALUES ($1, $2)"),
            hand_claim: format!(
                "INSERT INTO {hand_markers} (scope, message_id) VALUES ('bench.e2e', $1) ON CONFLICT DO NOTHING"
            ),
            markers,
            effects,
            hand_markers,
            kafka,
        }
    }

    /// The tables of [`new`](Self::new), for [`attach`](Self::attach).
    pub fn tables(&self) -> [String; 3] {
        [self.markers.clone(), self.effects.clone(), self.hand_markers.clone()]
    }

    /// The tables another process made (a consumer process of
    /// `--processes`); no Kafka broker of its own.
    pub async fn attach(connections: u32, tables: [String; 3]) -> Result<Arc<Env>, BoxError> {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .connect(PG_URL)
            .await?;
        let store = PgStore::builder(pool.clone()).table(&tables[0]).build()?;
        Ok(Arc::new(Env::with(pool, store, tables, None)))
    }

    /// (a)'s handler.
    async fn plain(&self, msg: &Payment) -> Result<(), AppError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// (s)'s handler.
    async fn by_hand(&self, msg: &Payment) -> Result<(), AppError> {
        let mut tx = self.pool.begin().await?;
        let claimed = sqlx::query(AssertSqlSafe(self.hand_claim.as_str()))
            .bind(&msg.id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if claimed == 0 {
            tx.rollback().await?;
            return Ok(());
        }
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// (b)'s and (c)'s handler: the same effect, with the marker.
    #[idempotent(key = "msg.id", store = self.store, scope = "bench.e2e")]
    async fn charge(&self, msg: &Payment, tx: &mut PgConnection) -> Result<(), AppError> {
        sqlx::query(AssertSqlSafe(self.insert.as_str()))
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// Effect rows of the ids starting with `prefix`.
    pub async fn effects(&self, prefix: &str) -> Result<(i64, i64), BoxError> {
        let (rows, distinct): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT id) FROM {} WHERE id LIKE $1",
            self.effects
        )))
        .bind(format!("{prefix}%"))
        .fetch_one(&self.pool)
        .await?;
        Ok((rows, distinct))
    }

    pub async fn drop_tables(&self) -> Result<(), BoxError> {
        for table in [&self.markers, &self.effects, &self.hand_markers] {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }
}

/// `n` message bodies whose ids start with `prefix`; `dup_pct` % of them
/// repeat an earlier message (same id, same body), spread through the run.
pub fn plan(prefix: &str, n: usize, dup_pct: u32, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = StdRng::seed_from_u64(seed);
    // Each distinct message's body; a duplicate is one of them again, byte
    // for byte (as an upstream redelivery would be).
    let mut originals: Vec<Vec<u8>> = Vec::with_capacity(n);
    let mut bodies = Vec::with_capacity(n);
    for i in 0..n {
        if !originals.is_empty() && rng.random_range(0..100) < dup_pct {
            bodies.push(originals[rng.random_range(0..originals.len())].clone());
            continue;
        }
        let body = Payment {
            id: format!("{prefix}{i}"),
            amount: 100 + (i as i64 % 900),
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        originals.push(bytes.clone());
        bodies.push(bytes);
    }
    bodies
}

/// CPU time so far (ns, `/proc/*/schedstat`): this process, PostgreSQL's
/// processes, the broker's server.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu {
    pub client: u64,
    pub db: u64,
    pub broker: u64,
}

impl Cpu {
    pub fn now(server: &str) -> Cpu {
        let [db, broker] = cpu::processes_ns(|comm| {
            if comm.starts_with("postgres") {
                Some(cpu::Count::Main(0))
            } else if comm == server {
                Some(cpu::Count::Threads(1))
            } else {
                None
            }
        });
        Cpu {
            client: cpu::own_ns(),
            db,
            broker,
        }
    }

    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            client: self.client.saturating_sub(before.client),
            db: self.db.saturating_sub(before.db),
            broker: self.broker.saturating_sub(before.broker),
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Messages acknowledged per second, from the first delivery to the
    /// last acknowledgement.
    pub rate: f64,
    /// CPU per message (µs): consumer, database, broker.
    pub cpu_us: (f64, f64, f64),
    /// Publish-to-acknowledgement latencies (µs) in a steady run, sorted.
    pub latencies_us: Vec<u64>,
    /// Messages acknowledged, dead-lettered and failed attempts.
    pub acked: u64,
    pub dead_lettered: u64,
    pub failed: u64,
    /// Deliveries per committed batch (0 without batches).
    pub batch_size: f64,
    /// Rows of the effect table and distinct ids among them.
    pub effects: (i64, i64),
    /// Distinct ids published.
    pub distinct: usize,
}

/// What the consumer's side of a run measured (a [`Sample`] without what
/// the database says afterwards).
struct Consumed {
    rate: f64,
    cpu_us: (f64, f64, f64),
    latencies_us: Vec<u64>,
    acked: u64,
    dead_lettered: u64,
    failed: u64,
    batch_size: f64,
}

/// How a run is fed.
#[derive(Debug, Clone, Copy)]
pub enum Feed {
    /// The whole plan published before the consumer starts.
    Drain,
    /// Published at this many messages per second while the consumer runs,
    /// from its first delivery on (the first message is published alone
    /// beforehand: connecting, and Kafka's group join, are not measured).
    Steady(f64),
}

/// One run of `variant` on a fresh `kind` queue: `n` messages with
/// `dup_pct` % duplicates, `slots` handler slots (on Kafka, a topic of
/// `slots` partitions).
#[allow(clippy::too_many_arguments)] // the benchmark's matrix, one argument per axis
pub async fn run(
    env: &Arc<Env>,
    kind: Kind,
    variant: Variant,
    slots: usize,
    n: usize,
    dup_pct: u32,
    feed: Feed,
    seed: u64,
) -> Result<Sample, BoxError> {
    if !variant.applies_to(kind) {
        return Err(format!("({}) does not run on {}", variant.label(), kind.title()).into());
    }
    let name = crate::unique("e2e");
    let prefix = format!("{name}-");
    let bodies = plan(&prefix, n, dup_pct, seed);
    let distinct = bodies
        .iter()
        .map(|b| b.as_slice())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let queue = Arc::new(Queue::setup(kind, &name, slots, env.kafka.as_ref()).await?);
    if let Feed::Drain = feed {
        queue.publish(&bodies).await?;
    }
    let running = start_on(env, &queue, kind, variant, slots)?;
    let consumed = consume(running, &queue, bodies, feed, kind).await?;
    if let Ok(queue) = Arc::try_unwrap(queue) {
        queue.teardown(&env.pool).await?;
    }
    Ok(Sample {
        rate: consumed.rate,
        cpu_us: consumed.cpu_us,
        latencies_us: consumed.latencies_us,
        acked: consumed.acked,
        dead_lettered: consumed.dead_lettered,
        failed: consumed.failed,
        batch_size: consumed.batch_size,
        effects: env.effects(&prefix).await?,
        distinct,
    })
}

/// A running consumer: its stats, its task, its shutdown.
pub type Running = (
    ConsumerStats,
    tokio::task::JoinHandle<Result<idempotent_runtime::broker::RunStats, idempotent_runtime::broker::ConsumerError>>,
    CancellationToken,
);

/// Starts the consumer of `variant` on `queue` with `slots` handler slots.
pub fn start_on(
    env: &Arc<Env>,
    queue: &Queue,
    kind: Kind,
    variant: Variant,
    slots: usize,
) -> Result<Running, BoxError> {
    // Room at the broker for every slot's batch, and one more round.
    let prefetch = (slots * variant.per_task() * 2).max(8);
    match kind {
        Kind::RabbitMq => {
            let builder = queue
                .rabbit(u16::try_from(prefetch).unwrap_or(u16::MAX))
                .ok_or("not RabbitMQ")?;
            start(env, builder, variant, slots)
        }
        Kind::JetStream => start(env, queue.jetstream(prefetch).ok_or("not JetStream")?, variant, slots),
        Kind::RedisStreams => start(env, queue.streams().ok_or("not Redis Streams")?, variant, slots),
        Kind::Kafka => {
            let mut builder = queue.kafka().ok_or("not Kafka")?;
            if std::env::var("IDEMPOTENT_BENCH_KAFKA_ORDER").as_deref() == Ok("key") {
                builder = builder.order(idempotent_runtime::kafka::Order::Key);
            }
            if variant.offsets() {
                builder = builder.offsets_in(env.store.clone());
            }
            start(env, builder, variant, slots)
        }
    }
}

/// Starts the consumer of `variant` with `slots` handler slots.
fn start<B: Broker>(
    env: &Arc<Env>,
    builder: ConsumerBuilder<B>,
    variant: Variant,
    slots: usize,
) -> Result<Running, BoxError> {
    let builder = builder.concurrency(slots).max_attempts(3);
    let builder = match variant {
        Variant::Batch(b) => {
            let builder = builder.batch(env.store.clone(), b.max).batch_savepoints(b.savepoints);
            match b.wait_ms {
                Some(ms) => builder.batch_wait(Duration::from_millis(ms)),
                None => builder,
            }
        }
        _ => builder,
    };
    let consumer = builder.build()?;
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_env = Arc::clone(env);
    let run = match variant {
        Variant::Plain => tokio::spawn(consumer.run(
            move |msg: Payment| {
                let env = Arc::clone(&handler_env);
                async move { env.plain(&msg).await }
            },
            shutdown.clone(),
        )),
        Variant::ByHand => tokio::spawn(consumer.run(
            move |msg: Payment| {
                let env = Arc::clone(&handler_env);
                async move { env.by_hand(&msg).await }
            },
            shutdown.clone(),
        )),
        _ => tokio::spawn(consumer.run(
            move |msg: Payment| {
                let env = Arc::clone(&handler_env);
                async move { env.charge(&msg).await }
            },
            shutdown.clone(),
        )),
    };

    Ok((stats, run, shutdown))
}

/// Runs `running` until it settled `bodies` (published beforehand, or
/// here at a steady rate), and measures it.
async fn consume(
    (stats, run, shutdown): Running,
    queue: &Arc<Queue>,
    bodies: Vec<Vec<u8>>,
    feed: Feed,
    kind: Kind,
) -> Result<Consumed, BoxError> {
    let n = bodies.len() as u64;

    // The clock starts at the first delivery (connecting is not measured).
    // The clock starts at the first delivery (connecting is not measured).
    let deadline = Instant::now() + Duration::from_secs(600);
    // Publish times (ns since the epoch) of a steady feed, by position.
    let published: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    if let Feed::Steady(_) = feed {
        // The first message alone, until the consumer has it.
        published[0].store(epoch_ns(), Ordering::Relaxed);
        queue.publish(&bodies[..1]).await?;
    }
    while stats.snapshot().received == 0 && Instant::now() < deadline && !run.is_finished() {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let publisher = match feed {
        Feed::Drain => None,
        Feed::Steady(rate) => {
            let (queue, published) = (Arc::clone(queue), Arc::clone(&published));
            Some(tokio::spawn(feed_steadily(queue, bodies, 1, rate, published)))
        }
    };

    let settled = |s: &ConsumerStats| {
        let snap = s.snapshot();
        snap.acked + snap.dead_lettered
    };
    let (t0, cpu0) = (Instant::now(), Cpu::now(kind.server_comm()));
    // Acknowledged count over time, for a steady feed's latencies.
    let mut progress: Vec<(u64, u64)> = Vec::new();
    loop {
        let done = settled(&stats);
        if publisher.is_some() {
            progress.push((epoch_ns(), done));
        }
        if done >= n || Instant::now() > deadline || run.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let (elapsed, cpu) = (t0.elapsed(), Cpu::now(kind.server_comm()).since(cpu0));
    shutdown.cancel();
    if let Some(publisher) = publisher {
        publisher.await??;
    }
    run.await??;
    let snap = stats.snapshot();
    if snap.acked + snap.dead_lettered < n {
        return Err(format!(
            "{} of {n} settled before the deadline or the consumer's end",
            snap.acked + snap.dead_lettered
        )
        .into());
    }
    let per = |ns: u64| ns as f64 / 1e3 / n as f64;
    let mut latencies_us = Vec::new();
    if matches!(feed, Feed::Steady(_)) {
        // Message k (in publish order) is counted settled at the first
        // sample with more than k settled: in order, which the slots keep
        // to within their number (of batches).
        let mut at = 0;
        for (k, published) in published.iter().enumerate() {
            while at < progress.len() && progress[at].1 <= k as u64 {
                at += 1;
            }
            let Some(&(done_ns, _)) = progress.get(at) else { break };
            latencies_us.push(done_ns.saturating_sub(published.load(Ordering::Relaxed)) / 1000);
        }
        latencies_us.sort_unstable();
    }
    Ok(Consumed {
        rate: n as f64 / elapsed.as_secs_f64(),
        cpu_us: (per(cpu.client), per(cpu.db), per(cpu.broker)),
        latencies_us,
        acked: snap.acked,
        dead_lettered: snap.dead_lettered,
        failed: snap.failed,
        batch_size: if snap.batches == 0 {
            0.0
        } else {
            snap.batched as f64 / snap.batches as f64
        },
    })
}

fn epoch_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Publishes `bodies` from `from` on at `rate` per second, in bursts
/// every millisecond, recording when each was handed to the broker.
async fn feed_steadily(
    queue: Arc<Queue>,
    bodies: Vec<Vec<u8>>,
    from: usize,
    rate: f64,
    published: Arc<Vec<AtomicU64>>,
) -> Result<(), BoxError> {
    let start = Instant::now();
    let mut sent = from.min(bodies.len());
    while sent < bodies.len() {
        let due = (from + (start.elapsed().as_secs_f64() * rate) as usize + 1).min(bodies.len());
        if due > sent {
            let now = epoch_ns();
            for stamp in &published[sent..due] {
                stamp.store(now, Ordering::Relaxed);
            }
            queue.publish(&bodies[sent..due]).await?;
            sent = due;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// The value at `p` (0–100) of sorted values.
pub fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64
}
