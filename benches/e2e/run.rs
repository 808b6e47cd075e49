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

use super::brokers::{BoxError, Kind, Queue};

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
    /// (c) The same handler with the consumer's batch transactions of at
    /// most this many messages, each under a savepoint (the default).
    Batch(usize),
    /// (c) without savepoints (`batch_savepoints(false)`): a failure
    /// reruns the batch one message per transaction.
    Lean(usize),
}

impl Variant {
    pub fn label(self) -> String {
        match self {
            Variant::Plain => "a".into(),
            Variant::ByHand => "s".into(),
            Variant::PerMessage => "b".into(),
            Variant::Batch(max) => format!("c{max}"),
            Variant::Lean(max) => format!("o{max}"),
        }
    }

    /// `a`, `b`, `c` (batches of 32), `cN`, `o` (32, no savepoints) or `oN`.
    pub fn parse(s: &str) -> Option<Variant> {
        let size = |rest: &str| rest.parse().ok().filter(|&n: &usize| n > 0);
        match s {
            "a" => Some(Variant::Plain),
            "s" => Some(Variant::ByHand),
            "b" => Some(Variant::PerMessage),
            "c" => Some(Variant::Batch(32)),
            "o" => Some(Variant::Lean(32)),
            _ => match s.split_at_checked(1)? {
                ("c", rest) => size(rest).map(Variant::Batch),
                ("o", rest) => size(rest).map(Variant::Lean),
                _ => None,
            },
        }
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
}

impl Env {
    /// Fresh marker and effect tables; `connections` for the pool (at
    /// least the largest slot count, so that no slot waits for one).
    pub async fn new(connections: u32) -> Result<Arc<Env>, BoxError> {
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
        let insert = format!("INSERT INTO {effects} (id, amount) VALUES ($1, $2)");
        let hand_markers = crate::unique("e2e_hand");
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {hand_markers} (scope TEXT NOT NULL, message_id TEXT NOT NULL, \
             processed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (scope, message_id))"
        )))
        .execute(&pool)
        .await?;
        let hand_claim =
            format!("INSERT INTO {hand_markers} (scope, message_id) VALUES ('bench.e2e', $1) ON CONFLICT DO NOTHING");
        Ok(Arc::new(Env {
            pool,
            store,
            markers,
            effects,
            insert,
            hand_markers,
            hand_claim,
        }))
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

fn schedstat(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// Every thread of the process at `proc`.
fn threads(proc: &std::path::Path) -> u64 {
    std::fs::read_dir(proc.join("task")).map_or(0, |tasks| {
        tasks.flatten().map(|t| schedstat(&t.path().join("schedstat"))).sum()
    })
}

impl Cpu {
    pub fn now(broker: &str) -> Cpu {
        let mut cpu = Cpu {
            client: threads(std::path::Path::new("/proc/self")),
            ..Cpu::default()
        };
        for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            if !p.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            if comm.starts_with("postgres") {
                cpu.db += schedstat(&p.path().join("schedstat"));
            } else if comm.trim_end() == broker {
                cpu.broker += threads(&p.path());
            }
        }
        cpu
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
    /// CPU per message (µs).
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

/// How a run is fed.
#[derive(Debug, Clone, Copy)]
pub enum Feed {
    /// The whole plan published before the consumer starts.
    Drain,
    /// Published at this many messages per second while the consumer runs.
    Steady(f64),
}

/// One run of `variant` on a fresh `kind` queue: `n` messages with
/// `dup_pct` % duplicates, `slots` handler slots.
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
    let name = crate::unique("e2e");
    let prefix = format!("{name}-");
    let bodies = plan(&prefix, n, dup_pct, seed);
    let distinct = bodies
        .iter()
        .map(|b| b.as_slice())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let queue = Arc::new(Queue::setup(kind, &name).await?);
    if let Feed::Drain = feed {
        queue.publish(&bodies).await?;
    }
    // Room at the broker for every slot's batch, and one more round.
    let per_slot = match variant {
        Variant::Batch(max) | Variant::Lean(max) => max,
        _ => 1,
    };
    let prefetch = (slots * per_slot * 2).max(8);
    let sample = match kind {
        Kind::RabbitMq => {
            let builder = queue
                .rabbit(u16::try_from(prefetch).unwrap_or(u16::MAX))
                .ok_or("not RabbitMQ")?;
            consume(env, builder, variant, slots, &queue, bodies, feed, kind).await?
        }
        Kind::JetStream => {
            let builder = queue.jetstream(prefetch).ok_or("not JetStream")?;
            consume(env, builder, variant, slots, &queue, bodies, feed, kind).await?
        }
        Kind::RedisStreams => {
            let builder = queue.streams().ok_or("not Redis Streams")?;
            consume(env, builder, variant, slots, &queue, bodies, feed, kind).await?
        }
    };
    if let Ok(queue) = Arc::try_unwrap(queue) {
        queue.teardown().await?;
    }
    Ok(Sample {
        effects: env.effects(&prefix).await?,
        distinct,
        ..sample
    })
}

#[allow(clippy::too_many_arguments)]
async fn consume<B: Broker>(
    env: &Arc<Env>,
    builder: ConsumerBuilder<B>,
    variant: Variant,
    slots: usize,
    queue: &Arc<Queue>,
    bodies: Vec<Vec<u8>>,
    feed: Feed,
    kind: Kind,
) -> Result<Sample, BoxError> {
    let n = bodies.len() as u64;
    let builder = builder.concurrency(slots).max_attempts(3);
    let builder = match variant {
        Variant::Batch(max) => builder.batch(env.store.clone(), max),
        Variant::Lean(max) => builder.batch(env.store.clone(), max).batch_savepoints(false),
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

    // Publish times (ns since the epoch) of a steady feed, by position.
    let published: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let publisher = match feed {
        Feed::Drain => None,
        Feed::Steady(rate) => {
            let (queue, published) = (Arc::clone(queue), Arc::clone(&published));
            Some(tokio::spawn(feed_steadily(queue, bodies, rate, published)))
        }
    };

    let settled = |s: &ConsumerStats| {
        let snap = s.snapshot();
        snap.acked + snap.dead_lettered
    };
    // The clock starts at the first delivery (connecting is not measured).
    let deadline = Instant::now() + Duration::from_secs(600);
    while stats.snapshot().received == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
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
        // to within their number.
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
    Ok(Sample {
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
        effects: (0, 0),
        distinct: 0,
    })
}

fn epoch_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Publishes `bodies` at `rate` per second, in bursts every millisecond,
/// recording when each was handed to the broker.
async fn feed_steadily(
    queue: Arc<Queue>,
    bodies: Vec<Vec<u8>>,
    rate: f64,
    published: Arc<Vec<AtomicU64>>,
) -> Result<(), BoxError> {
    let start = Instant::now();
    let mut sent = 0;
    while sent < bodies.len() {
        let due = ((start.elapsed().as_secs_f64() * rate) as usize + 1).min(bodies.len());
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
