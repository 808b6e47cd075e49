//! A configuration and its fault schedule, both drawn from one seed.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// splitmix64: small, deterministic, no dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x1de3_c0de)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// `true` with probability `percent` / 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum StoreKind {
    Pg,
    PgPartitioned,
    MariaDb,
    Sqlite,
    Redis,
    Memory,
}

impl StoreKind {
    pub const ALL: [StoreKind; 6] = [
        StoreKind::Pg,
        StoreKind::PgPartitioned,
        StoreKind::MariaDb,
        StoreKind::Sqlite,
        StoreKind::Redis,
        StoreKind::Memory,
    ];
    /// Joins the database transaction (batches, outbox, effect in the
    /// transaction).
    pub fn transactional(self) -> bool {
        !matches!(self, StoreKind::Redis | StoreKind::Memory)
    }
    pub fn is_pg(self) -> bool {
        matches!(self, StoreKind::Pg | StoreKind::PgPartitioned)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum BrokerKind {
    Rabbit,
    JetStream,
    RedisStreams,
    /// A private Tansu broker per configuration (Kafka protocol, memory
    /// storage): drawn from a stream of its own (`KAFKA_FROM`), never
    /// restarted.
    Kafka,
}

impl BrokerKind {
    /// The brokers drawn from the seed's main stream (Kafka comes from a
    /// stream of its own, so that the seeds drawn before it keep their
    /// draws).
    pub const ALL: [BrokerKind; 3] = [BrokerKind::Rabbit, BrokerKind::JetStream, BrokerKind::RedisStreams];

    /// Whether its server can be restarted during a run (Tansu keeps its
    /// topics in memory only: a restart loses them, so Kafka is not).
    pub fn restartable(self) -> bool {
        self != BrokerKind::Kafka
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutboxMode {
    Off,
    /// The relay publishes to a broker other than the consumer's.
    OtherBroker(BrokerKind),
    /// The relay publishes to the consumer's broker.
    SameBroker,
}

/// Server settings users change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    /// PostgreSQL sessions start with `synchronous_commit = off`.
    pub pg_sync_commit_off: bool,
    /// PostgreSQL `default_transaction_isolation`: 0 server default, 1
    /// repeatable read, 2 serializable (`common::settings::PG_*`).
    pub pg_isolation: u8,
    /// MariaDB session isolation (`common::settings::MY_*`).
    pub my_isolation: u8,
    /// SQLite journal mode (`common::settings::LITE_*`).
    pub sqlite_journal: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// The body returns `Err` (after its effect, on transactional stores).
    HandlerError,
    /// The body panics.
    Panic,
    /// The body hangs and is cancelled by a timeout (its future dropped).
    Cancel,
    /// A body that does not decode.
    Poison,
    /// A message whose body always fails: dead-lettered after its attempts.
    Doomed,
    /// The consumer task is aborted mid-flight and a new one started.
    ConsumerKill,
    /// The consumer task is aborted after a handler returned `Ok`, before
    /// the ack.
    AbortAfterCommit,
    /// The store's database connections are killed.
    DbKill,
    /// A failed statement swallowed by the body, which returns `Ok`.
    Swallow,
    /// The relay's runtime is killed before a publish.
    RelayKillBeforePublish,
    /// The relay's runtime is killed after the broker confirmed a publish,
    /// before the row is marked dispatched.
    RelayKillAfterConfirm,
    /// A server setting changes while the consumers run (and is reset
    /// after).
    SettingChange,
    /// The broker (a private server) is restarted while the consumers run.
    BrokerRestart,
    /// The store's database (a private PostgreSQL) is restarted while the
    /// consumers run.
    DbRestart,
    /// A message the database refuses on every run (a NULL in a NOT NULL
    /// column): the handler's error is classified by `Verdict::of_sqlx`
    /// as a rejection and the message dead-lettered at once.
    DataError,
    /// A message whose body reports an outage of its own on every run
    /// (`Verdict::Outage`) while the others succeed: it must spend its
    /// attempts and be dead-lettered, not be retried in place forever.
    LoneOutage,
    /// A body over the consumer's `max_body_bytes`: dead-lettered as
    /// poison before it is decoded.
    Oversized,
    /// A consumer running in a child process is killed with SIGKILL at a
    /// drawn point (`KillPhase`); the in-process consumers drain the rest.
    ConsumerSigkill,
    /// The Redis Cluster a Redis store runs on loses a primary (SIGKILL),
    /// its replica is promoted and the node started again as a replica.
    Failover,
    /// The handler returns `Err` after its `#[idempotent]` call returned
    /// `Ok` (its effect made): alone, the call's commit stands and the
    /// retry replays it; in a batch, the member leaves nothing of its own
    /// in the batch's commit (issue 43, hole 3).
    AfterCall,
    /// MariaDB: the body's transaction is a deadlock's victim (a heavier
    /// transaction locks its rows in the opposite order) and the body
    /// swallows the error and returns `Ok`: InnoDB rolled the whole
    /// transaction back, marker and effect, and nothing may be reported
    /// committed (issue 43, hole 1).
    Deadlock,
    /// HTTP, `InProgress::Wait`: copies of a key in progress whose client
    /// goes away at a drawn moment of their life (before their claim,
    /// while they wait, once handed the key); at the end the layer's
    /// in-flight map is empty (issue 43, hole 6).
    WaiterDrop,
    /// PostgreSQL, ordering keys on the outbox: a transaction sleeps 150 ms
    /// at its `COMMIT`, its outgoing rows inserted, while others stage the
    /// same key (issue 43, hole 2).
    SlowCommit,
    /// A message that fails on each of its attempts and would succeed
    /// after: a redelivery handled after its dead letter was stored (an
    /// ack, a term, an offset lost in a fault of the settlement) commits an
    /// effect for a dead-lettered message (issue 43, holes 4 and 5).
    Relapse,
    /// Handlers with a ttl of seconds (`ttl = "2s"`), bodies that hold
    /// their claim for a while after their effect (so that copies wait on
    /// it) and copies published again across the ttl: no copy that comes
    /// within a ttl of an effect's commit runs the body again, and one
    /// that comes after it may (issue 43, hole 7).
    ShortTtl,
    /// The consumers' connections to the broker (through a proxy) are cut
    /// at a drawn moment and reconnect (issue 43, hole 8).
    ConnCut,
    /// The consumers' connections to the broker (through a proxy) stall:
    /// no byte goes through for a drawn while, no reset (issue 43, hole 8).
    ConnStall,
    /// The consumers' connections to the broker are cut right after a
    /// message's last failing attempt, while its dead letter or retry copy
    /// is published and the original settled (issue 43, hole 5).
    SettleCut,
}

impl FaultKind {
    pub const ALL: [FaultKind; 28] = [
        FaultKind::HandlerError,
        FaultKind::Panic,
        FaultKind::Cancel,
        FaultKind::Swallow,
        FaultKind::Poison,
        FaultKind::Doomed,
        FaultKind::ConsumerKill,
        FaultKind::AbortAfterCommit,
        FaultKind::DbKill,
        FaultKind::RelayKillBeforePublish,
        FaultKind::RelayKillAfterConfirm,
        FaultKind::SettingChange,
        FaultKind::BrokerRestart,
        FaultKind::DbRestart,
        FaultKind::DataError,
        FaultKind::LoneOutage,
        FaultKind::Oversized,
        FaultKind::ConsumerSigkill,
        FaultKind::Failover,
        FaultKind::AfterCall,
        FaultKind::Deadlock,
        FaultKind::WaiterDrop,
        FaultKind::SlowCommit,
        FaultKind::Relapse,
        FaultKind::ShortTtl,
        FaultKind::ConnCut,
        FaultKind::ConnStall,
        FaultKind::SettleCut,
    ];
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::HandlerError => "error",
            FaultKind::Panic => "panic",
            FaultKind::Cancel => "cancel",
            FaultKind::Swallow => "swallow",
            FaultKind::Poison => "poison",
            FaultKind::Doomed => "doomed",
            FaultKind::ConsumerKill => "consumer-kill",
            FaultKind::AbortAfterCommit => "abort-after-commit",
            FaultKind::DbKill => "db-kill",
            FaultKind::RelayKillBeforePublish => "relay-kill-before",
            FaultKind::RelayKillAfterConfirm => "relay-kill-after",
            FaultKind::SettingChange => "setting-change",
            FaultKind::BrokerRestart => "broker-restart",
            FaultKind::DbRestart => "db-restart",
            FaultKind::DataError => "data-error",
            FaultKind::LoneOutage => "lone-outage",
            FaultKind::Oversized => "oversized",
            FaultKind::ConsumerSigkill => "consumer-sigkill",
            FaultKind::Failover => "failover",
            FaultKind::AfterCall => "after-call",
            FaultKind::Deadlock => "deadlock",
            FaultKind::WaiterDrop => "waiter-drop",
            FaultKind::SlowCommit => "slow-commit",
            FaultKind::Relapse => "relapse",
            FaultKind::ShortTtl => "short-ttl",
            FaultKind::ConnCut => "conn-cut",
            FaultKind::ConnStall => "conn-stall",
            FaultKind::SettleCut => "settle-cut",
        }
    }
    pub fn parse(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|k| k.name() == name.trim())
    }
}

/// A fault that fires in the body of one message's run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BodyFault {
    Error,
    Panic,
    Cancel,
    /// A statement of the body fails and the body returns `Ok` anyway (the
    /// "already done" reading of an error): on PostgreSQL the transaction
    /// is aborted and nothing may be reported committed.
    Swallow,
    /// Nothing in the body: the handler returns `Err` once the call
    /// returned `Ok` (`FaultKind::AfterCall`).
    AfterCall,
    /// After the effect, the body's transaction is made a deadlock's victim
    /// and the body swallows the error (`FaultKind::Deadlock`; MariaDB).
    Deadlock,
    /// After the effect, the body holds its claim for [`HOLD`] and then
    /// fails (`FaultKind::ShortTtl`): a copy waiting on the claim gets it
    /// once it is rolled back, and its marker must live its ttl from then.
    Hold,
}

/// The ttl of the short-ttl handlers (`ttl = "2s"` in
/// `combinations/handlers.rs`), in milliseconds.
pub const SHORT_TTL_MS: u64 = 2000;

/// How long a [`BodyFault::Hold`] holds its claim.
pub const HOLD: Duration = Duration::from_millis(900);

/// A fault that fires once the handlers were called `at` times in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimedFault {
    ConsumerKill,
    DbKill,
    SettingChange,
    /// The private broker goes down for this long and comes back.
    BrokerRestart(Duration),
    /// The private PostgreSQL goes down for this long and comes back.
    DbRestart(Duration),
    /// The primary of this hash slot of the Redis Cluster is SIGKILLed,
    /// its replica promoted, and the node started again (a replica).
    Failover(u16),
    /// The proxy between the consumers and their broker cuts every
    /// connection (`Config::proxied`; `FaultKind::ConnCut`).
    ConnCut,
    /// The proxy forwards nothing for this long, no reset
    /// (`Config::proxied`; `FaultKind::ConnStall`).
    ConnStall(Duration),
}

/// Where a child consumer is killed with SIGKILL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KillPhase {
    /// In a handler's body, after its effect was written (its transaction,
    /// or its batch's, open and holding the marker's claim).
    MidBody,
    /// After a handler returned `Ok`: alone, its effect is committed and
    /// the ack not sent; in a batch, before the batch's commit.
    AfterOk,
    /// After a batch committed, before its deliveries are acknowledged
    /// (batches only: the library's "batch committed" event).
    AfterBatchCommit,
    /// This many milliseconds after its `after`-th handler call, wherever
    /// it is then.
    Timed(u64),
}

/// A consumer SIGKILL: a child process joins the consumers once the
/// handlers were called `at` times in all, and is killed at `phase` once it
/// has made `after` handler calls of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sigkill {
    pub at: u64,
    pub after: u64,
    pub phase: KillPhase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RelayKill {
    BeforePublish,
    AfterConfirm,
}

/// What goes wrong, and when.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Schedule {
    /// Body faults per message id, in the order its runs meet them.
    pub body: BTreeMap<String, Vec<BodyFault>>,
    /// Messages whose body always fails.
    pub doomed: Vec<String>,
    /// Poison bodies published (each its own broker id).
    pub poison: usize,
    /// Messages after whose first `Ok` the consumer is aborted before the ack.
    pub abort_after_commit: Vec<String>,
    /// Faults at a number of handler calls.
    pub timed: Vec<(u64, TimedFault)>,
    /// Relay kills, at the n-th publish call.
    pub relay: Vec<(u64, RelayKill)>,
    /// Messages the database refuses on every run (transactional stores).
    pub data_error: Vec<String>,
    /// Messages whose body reports an outage on every run.
    pub lone_outage: Vec<String>,
    /// Bodies over the size limit published (each its own id, `big-N`).
    pub oversized: usize,
    /// Consumers run in a child process and SIGKILLed (every store but
    /// memory), in the order of their `at`.
    pub sigkill: Vec<Sigkill>,
    /// PostgreSQL with ordering keys on the outbox: messages whose
    /// transaction sleeps at its `COMMIT` (a deferred trigger), after its
    /// outgoing rows were inserted, so that a transaction staging the same
    /// key overlaps it (`FaultKind::SlowCommit`).
    #[serde(default)]
    pub slow_commit: Vec<String>,
    /// Messages whose body fails on each of its first `max_attempts` runs
    /// and succeeds after (`FaultKind::Relapse`): dead-lettered, a run
    /// after its dead letter commits an effect the checks see.
    #[serde(default)]
    pub relapse: Vec<String>,
    /// With `Config::short_ttl`: messages whose first run holds its claim
    /// and fails (`BodyFault::Hold`), each published a second time right
    /// after its first copy, so that the copy waits on the claim.
    #[serde(default)]
    pub hold: Vec<String>,
    /// With `Config::short_ttl`: copies published again this many ms after
    /// the first `Ok` of their message (around the ttl: before it they are
    /// duplicates, after it they may run again).
    #[serde(default)]
    pub late: Vec<(String, u64)>,
    /// With `Config::settle_cut`: the delays (ms, 0 to 30) after a
    /// message's last failing run at which the proxy cuts the consumers'
    /// connections, one per such run until they are spent
    /// (`FaultKind::SettleCut`).
    #[serde(default)]
    pub settle_cut_ms: Vec<u64>,
}

/// The first seed that draws restarts (broker and database): the long
/// form's seeds (`IDEMPOTENT_CHECKER_START` defaults to it); the short
/// form's fixed seeds below it draw none, except those listed from here up.
pub const RESTARTS_FROM: u64 = 1000;

/// The first seed that may draw Kafka (as the consumers' broker 1 time in
/// 4, as the outbox's other broker 1 time in 4 of the rest, from a stream
/// of its own): the seeds below it (the short form's and the sabotage's,
/// whose failures on earlier runtimes the checker's documentation quotes)
/// draw what they drew before Kafka existed.
pub const KAFKA_FROM: u64 = 40;

/// The first seed whose Redis store and Redis Streams broker may run on a
/// Redis Cluster (issue 30; from a stream of its own): the seeds below it
/// draw what they drew before the cluster was drawn.
pub const CLUSTER_FROM: u64 = 40;

/// One configuration of the library, with its fault schedule.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    pub seed: u64,
    pub store: StoreKind,
    pub cached: bool,
    /// Batch size (transactional stores only).
    pub batch: Option<usize>,
    pub broker: BrokerKind,
    pub outbox: OutboxMode,
    pub fingerprint: bool,
    /// The handler returns a value (replayed to duplicates) instead of `()`.
    pub value_result: bool,
    pub settings: Settings,
    /// Consumer instances on the same source.
    pub consumers: usize,
    /// Handlers (or batches) at once per consumer.
    pub concurrency: usize,
    /// Distinct message ids.
    pub messages: usize,
    /// Extra publications of an already published id.
    pub duplicates: usize,
    pub max_attempts: u32,
    pub schedule: Schedule,
    /// The Kafka consumers keep their offsets in the database
    /// (`offsets_in(store)`), where [`offsets_in_db`](Config::offsets_in_db)
    /// says the configuration can: drawn for every seed from a stream of
    /// its own (`KAFKA_OFFSETS_STREAM`), so that the rest of each seed's
    /// draws are what they were before it.
    #[serde(default)]
    pub kafka_offsets: bool,
    /// The Kafka consumers order records by key within a partition
    /// (`order(Order::Key)`), where [`key_order`](Config::key_order) says
    /// the configuration can (not with the offsets in the database): drawn
    /// from a stream of its own (`KAFKA_ORDER_STREAM`).
    #[serde(default)]
    pub kafka_key_order: bool,
    /// The Redis store (its effects hash too) and the Redis Streams broker
    /// run on a Redis Cluster (3 primaries with a replica each, shared by
    /// the checker run; `common::cluster`).
    #[serde(default)]
    pub cluster: bool,
    /// On the cluster: the store waits for a replica after each claim,
    /// completion and renewal (`wait_for_replicas(1, 500ms)`).
    #[serde(default)]
    pub wait_replicas: bool,
    /// With the outbox: each outgoing message is staged with an ordering
    /// key (`k0`..`k2`, by message number), so that transactions staging
    /// one key overlap; drawn from a stream of its own
    /// (`ORDERED_OUTBOX_STREAM`). Checked: per key, the sink receives the
    /// messages in the order their transactions committed.
    #[serde(default)]
    pub ordered_outbox: bool,
    /// The in-process consumers reach their broker through a TCP proxy
    /// (`combinations/proxy.rs`) that the `ConnCut` and `ConnStall` timed
    /// faults, the settle cuts and the stall at shutdown act on: drawn from
    /// a stream of its own (`CONN_STREAM`), for RabbitMQ, NATS JetStream
    /// and Redis Streams on a single server (not Kafka, whose clients
    /// follow the addresses its metadata advertises; not the Redis Cluster;
    /// not a broker restarted). The checker's own connections stay direct.
    #[serde(default)]
    pub proxied: bool,
    /// Through the proxy: when a message fails on the run that gets it
    /// dead-lettered (a doomed, relapse or lone-outage message on its last
    /// attempt, a data error), the proxy drops every byte the consumers
    /// send from a drawn 0 to 3 ms later (`Schedule::settle_cut_ms`) and
    /// cuts the connections 200 ms after: a dead letter published before
    /// it is stored and confirmed, and the original's ack or term after it
    /// is lost (`FaultKind::SettleCut`).
    #[serde(default)]
    pub settle_cut: bool,
    /// Through the proxy: right before the drain stops the consumers, the
    /// proxy stalls for longer than the stop bound, and each consumer must
    /// still stop within it (`FaultKind::ConnStall`).
    #[serde(default)]
    pub stall_at_shutdown: bool,
    /// The handlers have a ttl of [`SHORT_TTL_MS`] (`FaultKind::ShortTtl`):
    /// drawn from a stream of its own (`SHORT_TTL_STREAM`). Checked: an
    /// effect made again within the ttl of the previous one is "twice"; one
    /// made after it is counted as expired (allowed).
    #[serde(default)]
    pub short_ttl: bool,
}

/// The stream of the consumers' proxy and its faults (`Config::proxied`,
/// `settle_cut`, `stall_at_shutdown`, the `ConnCut` and `ConnStall` timed
/// faults; issue 43).
pub const CONN_STREAM: u64 = 0x0c0e_c7ed;

/// The stream of `Config::ordered_outbox`.
pub const ORDERED_OUTBOX_STREAM: u64 = 0x0bde_0e3d;

/// The stream of `Config::short_ttl` and its schedule.
pub const SHORT_TTL_STREAM: u64 = 0x0005_4077;

/// The stream the offsets-in-the-database coin is drawn from (`seed ^` it).
pub const KAFKA_OFFSETS_STREAM: u64 = 0x0ff5_e7db;
/// The stream of the Kafka consumers' order (`Config::kafka_key_order`).
pub const KAFKA_ORDER_STREAM: u64 = 0x0de7_4e1b;

impl Config {
    /// The configuration and schedule of `seed`, leaving out the fault kinds
    /// in `without`.
    pub fn from_seed(seed: u64, without: &[FaultKind]) -> Config {
        Config::draw(seed, without, true)
    }

    /// The configuration `seed` drew before Kafka was drawn (`kafka`
    /// false), or now.
    pub fn draw(seed: u64, without: &[FaultKind], kafka: bool) -> Config {
        let mut rng = Rng::new(seed);
        let store = rng.pick(&StoreKind::ALL);
        let mut broker = rng.pick(&BrokerKind::ALL);
        // Kafka comes from a stream of its own: the rest of the seed's
        // draws are what they were before it.
        let mut kafka_rng = Rng::new(seed ^ 0x00ca_fca0);
        let kafka_source = kafka && seed >= KAFKA_FROM && kafka_rng.percent(25);
        let kafka_sink = kafka && seed >= KAFKA_FROM && kafka_rng.percent(25);
        if kafka_source {
            broker = BrokerKind::Kafka;
        }
        let cached = rng.percent(40);
        let batch = if store.transactional() && rng.percent(50) {
            Some(rng.pick(&[8, 32]))
        } else {
            None
        };
        let outbox = if store.transactional() && rng.percent(50) {
            if rng.percent(50) {
                OutboxMode::SameBroker
            } else {
                let others: Vec<BrokerKind> = BrokerKind::ALL.into_iter().filter(|b| *b != broker).collect();
                OutboxMode::OtherBroker(rng.pick(&others))
            }
        } else {
            OutboxMode::Off
        };
        let outbox = match outbox {
            OutboxMode::OtherBroker(_) if kafka_sink && broker != BrokerKind::Kafka => {
                OutboxMode::OtherBroker(BrokerKind::Kafka)
            }
            other => other,
        };
        let fingerprint = rng.percent(50);
        let value_result = rng.percent(50);
        let settings = Settings {
            pg_sync_commit_off: rng.percent(40),
            pg_isolation: rng.pick(&[0, 0, 1, 2]),
            my_isolation: rng.pick(&[0, 1, 2, 3]),
            sqlite_journal: rng.pick(&[0, 1]),
        };
        let consumers = if rng.percent(50) { 2 } else { 1 };
        let concurrency = rng.pick(&[1, 2, 4]);
        let messages = 150 + rng.below(100) as usize;
        let duplicates = messages / 5;
        let max_attempts = 5;

        let allowed = |k: FaultKind| !without.contains(&k);
        let mut schedule = Schedule::default();
        let id = |n: usize| format!("m{n:04}");
        for n in 0..messages {
            let roll = rng.below(1000);
            if roll < 15 && allowed(FaultKind::Doomed) {
                schedule.doomed.push(id(n));
                continue;
            }
            if roll < 130 {
                // One or two body faults, fewer than the attempts.
                let mut faults = Vec::new();
                for _ in 0..1 + rng.below(2) {
                    let fault = match rng.below(3) {
                        0 => (FaultKind::HandlerError, BodyFault::Error),
                        1 => (FaultKind::Panic, BodyFault::Panic),
                        _ => (FaultKind::Cancel, BodyFault::Cancel),
                    };
                    if allowed(fault.0) {
                        faults.push(fault.1);
                    }
                }
                if !faults.is_empty() {
                    schedule.body.insert(id(n), faults);
                }
            }
        }
        // Swallowed errors come from a stream of their own, so that the
        // rest of a seed's schedule is what it was before they existed.
        if store.transactional() && allowed(FaultKind::Swallow) {
            let mut swallow = Rng::new(seed ^ 0x005a_110e);
            for n in 0..messages {
                if swallow.percent(3) && !schedule.doomed.contains(&id(n)) {
                    schedule.body.entry(id(n)).or_default().insert(0, BodyFault::Swallow);
                }
            }
        }
        // Failures after a successful call come from a stream of their own
        // too (issue 43): about 1 message in 50, on every store, alone and
        // in batches.
        if allowed(FaultKind::AfterCall) {
            let mut after = Rng::new(seed ^ 0x00af_7e2c);
            for n in 0..messages {
                if after.percent(2) && !schedule.doomed.contains(&id(n)) {
                    schedule.body.entry(id(n)).or_default().insert(0, BodyFault::AfterCall);
                }
            }
        }
        // Deadlock victims on MariaDB, from a stream of their own.
        if store == StoreKind::MariaDb && allowed(FaultKind::Deadlock) {
            let mut deadlock = Rng::new(seed ^ 0x00de_ad10);
            for n in 0..messages {
                if deadlock.percent(3) && !schedule.doomed.contains(&id(n)) {
                    schedule.body.entry(id(n)).or_default().insert(0, BodyFault::Deadlock);
                }
            }
        }
        if allowed(FaultKind::Poison) {
            schedule.poison = rng.below(4) as usize;
        }
        // The faults the newcomer issue named (data errors, an outage of one
        // message, oversized bodies) come from a stream of their own too.
        let mut refused = Rng::new(seed ^ 0x0da7_a0e7);
        for n in 0..messages {
            let roll = refused.below(200);
            if schedule.doomed.contains(&id(n)) {
                continue;
            }
            let list = if roll < 2 && store.transactional() && allowed(FaultKind::DataError) {
                &mut schedule.data_error
            } else if (2..4).contains(&roll) && allowed(FaultKind::LoneOutage) {
                &mut schedule.lone_outage
            } else {
                continue;
            };
            // Its runs all fail the same way: no other body fault.
            schedule.body.remove(&id(n));
            list.push(id(n));
        }
        if allowed(FaultKind::Oversized) {
            schedule.oversized = refused.below(3) as usize;
        }
        if allowed(FaultKind::AbortAfterCommit) {
            for _ in 0..rng.below(3) {
                let n = rng.below(messages as u64) as usize;
                if !schedule.doomed.contains(&id(n)) && !schedule.abort_after_commit.contains(&id(n)) {
                    schedule.abort_after_commit.push(id(n));
                }
            }
        }
        let calls = messages as u64;
        if allowed(FaultKind::ConsumerKill) {
            for _ in 0..rng.below(3) {
                schedule
                    .timed
                    .push((calls / 10 + rng.below(calls * 7 / 10), TimedFault::ConsumerKill));
            }
        }
        if store.transactional() && store != StoreKind::Sqlite && allowed(FaultKind::DbKill) {
            for _ in 0..rng.below(3) {
                schedule
                    .timed
                    .push((calls / 10 + rng.below(calls * 7 / 10), TimedFault::DbKill));
            }
        }
        if (store.is_pg() || store == StoreKind::MariaDb) && allowed(FaultKind::SettingChange) && rng.percent(50) {
            schedule
                .timed
                .push((calls / 10 + rng.below(calls / 2), TimedFault::SettingChange));
        }
        // Restarts come from a stream of their own too, and only for the
        // seeds of the long form (`RESTARTS_FROM` and up), so that the
        // short form stays fast and a replay draws the same restarts.
        if seed >= RESTARTS_FROM {
            let mut restarts = Rng::new(seed ^ 0x0005_7a27);
            let broker_restart = restarts.percent(25);
            let db_restart = store.is_pg() && restarts.percent(25);
            let mut draw = |kind: fn(Duration) -> TimedFault| {
                let at = calls / 10 + restarts.below(calls * 6 / 10);
                let down = Duration::from_millis(300 + restarts.below(1700));
                (at, kind(down))
            };
            // Not on Kafka: its test broker keeps nothing over a restart.
            if broker_restart && broker.restartable() && allowed(FaultKind::BrokerRestart) {
                schedule.timed.push(draw(TimedFault::BrokerRestart));
            }
            if db_restart && allowed(FaultKind::DbRestart) {
                schedule.timed.push(draw(TimedFault::DbRestart));
            }
        }
        // The Redis Cluster comes from a stream of its own, for seeds from
        // `CLUSTER_FROM` up: the rest of a seed's schedule is what it was
        // before it.
        // It carries the Redis store and the Redis Streams broker (not the
        // outbox's sink); a configuration that restarts its broker keeps
        // it on its private server (and seed 1008 of the short form what
        // it drew).
        let (mut cluster, mut wait_replicas) = (false, false);
        let restarted = schedule
            .timed
            .iter()
            .any(|(_, f)| matches!(f, TimedFault::BrokerRestart(_)));
        if (store == StoreKind::Redis || broker == BrokerKind::RedisStreams) && seed >= CLUSTER_FROM && !restarted {
            let mut c = Rng::new(seed ^ 0x00c1_0573);
            cluster = c.percent(50);
            wait_replicas = c.percent(50);
            if cluster && c.percent(60) && allowed(FaultKind::Failover) {
                let at = calls / 10 + c.below(calls * 6 / 10);
                schedule.timed.push((at, TimedFault::Failover(c.below(16384) as u16)));
            }
            wait_replicas &= cluster && store == StoreKind::Redis;
        }
        schedule.timed.sort_by_key(|(at, _)| *at);
        if outbox != OutboxMode::Off {
            for _ in 0..rng.below(3) {
                let kill = if rng.percent(50) {
                    (FaultKind::RelayKillBeforePublish, RelayKill::BeforePublish)
                } else {
                    (FaultKind::RelayKillAfterConfirm, RelayKill::AfterConfirm)
                };
                if allowed(kill.0) {
                    schedule.relay.push((1 + rng.below(calls * 8 / 10), kill.1));
                }
            }
            schedule.relay.sort_by_key(|(at, _)| *at);
        }
        // Consumer SIGKILLs come from a stream of their own, for every
        // seed: the rest of a seed's schedule is what it was before them.
        // Only where a child process can join: every store but the memory
        // store (its markers are in this process).
        if store != StoreKind::Memory && allowed(FaultKind::ConsumerSigkill) {
            let mut kills = Rng::new(seed ^ 0x0051_6c11);
            if kills.percent(30) {
                for _ in 0..1 + kills.below(2) {
                    let phase = match kills.below(if batch.is_some() { 4 } else { 3 }) {
                        0 => KillPhase::MidBody,
                        1 => KillPhase::AfterOk,
                        2 => KillPhase::Timed(kills.below(300)),
                        _ => KillPhase::AfterBatchCommit,
                    };
                    schedule.sigkill.push(Sigkill {
                        at: calls / 10 + kills.below(calls / 2),
                        after: 1 + kills.below(6),
                        phase,
                    });
                }
                schedule.sigkill.sort_by_key(|k| k.at);
            }
        }
        // Relapses, from a stream of their own: about 1 message in 50 that
        // has no other fate drawn.
        if allowed(FaultKind::Relapse) {
            let mut relapse = Rng::new(seed ^ 0x0e1a_95e0);
            for n in 0..messages {
                let free = !schedule.doomed.contains(&id(n))
                    && !schedule.data_error.contains(&id(n))
                    && !schedule.lone_outage.contains(&id(n))
                    && !schedule.abort_after_commit.contains(&id(n));
                if relapse.percent(2) && free {
                    schedule
                        .body
                        .insert(id(n), vec![BodyFault::Error; max_attempts as usize]);
                    schedule.relapse.push(id(n));
                }
            }
        }
        // The consumers' proxy and its faults, from a stream of their own
        // (issue 43): RabbitMQ, NATS JetStream and Redis Streams on a
        // single server, not restarted.
        let conn_allowed = [FaultKind::ConnCut, FaultKind::ConnStall, FaultKind::SettleCut]
            .into_iter()
            .any(allowed);
        let mut conn = Rng::new(seed ^ CONN_STREAM);
        let proxiable = broker != BrokerKind::Kafka
            && !cluster
            && !schedule
                .timed
                .iter()
                .any(|(_, f)| matches!(f, TimedFault::BrokerRestart(_)));
        let proxied = conn.percent(40) && proxiable && conn_allowed;
        let (mut settle_cut, mut stall_at_shutdown) = (false, false);
        if proxied {
            if allowed(FaultKind::ConnCut) {
                for _ in 0..conn.below(3) {
                    schedule
                        .timed
                        .push((calls / 10 + conn.below(calls * 7 / 10), TimedFault::ConnCut));
                }
            }
            if allowed(FaultKind::ConnStall) && conn.percent(50) {
                let stall = Duration::from_millis(300 + conn.below(2201));
                schedule
                    .timed
                    .push((calls / 10 + conn.below(calls * 7 / 10), TimedFault::ConnStall(stall)));
            }
            settle_cut = allowed(FaultKind::SettleCut) && conn.percent(50);
            if settle_cut {
                schedule.settle_cut_ms = (0..5).map(|_| conn.below(4)).collect();
            }
            stall_at_shutdown = allowed(FaultKind::ConnStall) && conn.percent(30);
            schedule.timed.sort_by_key(|(at, _)| *at);
        }
        let ordered_outbox = Rng::new(seed ^ ORDERED_OUTBOX_STREAM).percent(50);
        if ordered_outbox && store.is_pg() && outbox != OutboxMode::Off && allowed(FaultKind::SlowCommit) {
            let mut slow = Rng::new(seed ^ 0x0510_c0de);
            for n in 0..messages {
                if slow.percent(10) {
                    schedule.slow_commit.push(id(n));
                }
            }
        }
        // Short ttls, from a stream of their own (issue 43, hole 7).
        let mut short = Rng::new(seed ^ SHORT_TTL_STREAM);
        let short_ttl = allowed(FaultKind::ShortTtl) && short.percent(30);
        if short_ttl {
            let ttl = SHORT_TTL_MS;
            for n in 0..messages {
                let free = !schedule.doomed.contains(&id(n))
                    && !schedule.data_error.contains(&id(n))
                    && !schedule.lone_outage.contains(&id(n))
                    && !schedule.relapse.contains(&id(n));
                if !free {
                    continue;
                }
                let roll = short.below(100);
                if roll < 8 {
                    schedule.body.entry(id(n)).or_default().insert(0, BodyFault::Hold);
                    schedule.hold.push(id(n));
                }
                if !(8..97).contains(&roll) {
                    schedule.late.push((id(n), ttl - 700 + short.below(1400)));
                }
            }
        }
        Config {
            seed,
            store,
            cached,
            batch,
            broker,
            outbox,
            fingerprint,
            value_result,
            settings,
            consumers,
            concurrency,
            messages,
            duplicates,
            max_attempts,
            schedule,
            kafka_offsets: Rng::new(seed ^ KAFKA_OFFSETS_STREAM).percent(50),
            kafka_key_order: Rng::new(seed ^ KAFKA_ORDER_STREAM).percent(50),
            cluster,
            wait_replicas,
            ordered_outbox,
            proxied,
            settle_cut,
            stall_at_shutdown,
            short_ttl,
        }
    }

    /// The ordering key a message is staged with on the outbox, when
    /// `ordered_outbox`.
    pub fn ordering_key(&self, id: &str) -> Option<String> {
        let n: u64 = id.trim_start_matches('m').parse().ok()?;
        (self.ordered_outbox && self.sink().is_some()).then(|| format!("k{}", n % 3))
    }

    /// The Kafka consumers keep their offsets in the database: drawn
    /// (`kafka_offsets`), on Kafka, with a store that keeps them
    /// (PostgreSQL with the plain marker layout, MariaDB, SQLite; a
    /// partitioned `PgStore` is refused by `offsets_in`).
    pub fn offsets_in_db(&self) -> bool {
        self.kafka_offsets
            && self.broker == BrokerKind::Kafka
            && matches!(self.store, StoreKind::Pg | StoreKind::MariaDb | StoreKind::Sqlite)
    }

    /// The Kafka consumers order records by key within a partition: drawn
    /// (`kafka_key_order`), on Kafka, without the offsets in the database
    /// (the builder refuses the two together).
    pub fn key_order(&self) -> bool {
        self.kafka_key_order && self.broker == BrokerKind::Kafka && !self.offsets_in_db()
    }

    /// The broker runs on a private server, restarted during the run.
    pub fn broker_restart(&self) -> bool {
        self.schedule
            .timed
            .iter()
            .any(|(_, f)| matches!(f, TimedFault::BrokerRestart(_)))
    }

    /// The Redis Cluster loses a primary during the run.
    pub fn failover(&self) -> bool {
        self.schedule
            .timed
            .iter()
            .any(|(_, f)| matches!(f, TimedFault::Failover(_)))
    }

    /// The store's database is a private PostgreSQL, restarted during the
    /// run.
    pub fn db_restart(&self) -> bool {
        self.schedule
            .timed
            .iter()
            .any(|(_, f)| matches!(f, TimedFault::DbRestart(_)))
    }

    /// The in-process consumers go through the proxy: drawn (`proxied`),
    /// on a broker that can (what `IDEMPOTENT_CHECKER_FORCE` made of the
    /// configuration may not).
    pub fn through_proxy(&self) -> bool {
        self.proxied && self.broker != BrokerKind::Kafka && !self.cluster && !self.broker_restart()
    }

    /// The sink's broker when the outbox is on.
    pub fn sink(&self) -> Option<BrokerKind> {
        match self.outbox {
            OutboxMode::Off => None,
            OutboxMode::SameBroker => Some(self.broker),
            OutboxMode::OtherBroker(b) => Some(b),
        }
    }

    /// `, proxied (2 cuts, 1 stall, settle cuts, stall at shutdown)`, or
    /// nothing.
    fn proxy_summary(&self) -> String {
        if !self.through_proxy() {
            return String::new();
        }
        let count = |cut: bool| {
            self.schedule
                .timed
                .iter()
                .filter(|(_, f)| match f {
                    TimedFault::ConnCut => cut,
                    TimedFault::ConnStall(_) => !cut,
                    _ => false,
                })
                .count()
        };
        let mut parts = vec![format!("{} cuts", count(true)), format!("{} stalls", count(false))];
        if self.settle_cut {
            parts.push("settle cuts".into());
        }
        if self.stall_at_shutdown {
            parts.push("stall at shutdown".into());
        }
        format!(", proxied ({})", parts.join(", "))
    }

    /// One line: what is combined.
    pub fn summary(&self) -> String {
        format!(
            "seed {:>5}: {:?}{}{}{} / {:?} / outbox {:?} / fp {} / {} / {}x{} / {} msgs +{} dup / faults: {} body, {} doomed, {} data error, {} lone outage, {} poison, {} oversized, {} abort-after-commit, {} timed, {} relay, {} sigkill{}{}{}",
            self.seed,
            self.store,
            match (self.cluster, self.wait_replicas) {
                (false, _) => "",
                (true, false) => "@cluster",
                (true, true) => "@cluster+wait",
            },
            if self.cached { "+cache" } else { "" },
            self.batch.map(|b| format!("+batch{b}")).unwrap_or_default(),
            self.broker,
            self.outbox,
            self.fingerprint,
            if self.value_result { "value" } else { "unit" },
            self.consumers,
            self.concurrency,
            self.messages,
            self.duplicates,
            self.schedule.body.len(),
            self.schedule.doomed.len(),
            self.schedule.data_error.len(),
            self.schedule.lone_outage.len(),
            self.schedule.poison,
            self.schedule.oversized,
            self.schedule.abort_after_commit.len(),
            self.schedule.timed.len(),
            self.schedule.relay.len(),
            self.schedule.sigkill.len(),
            if self.broker_restart() { ", broker restart" } else { "" },
            if self.db_restart() { ", db restart" } else { "" },
            if self.failover() { ", failover" } else { "" },
        ) + if self.offsets_in_db() { ", offsets in db" } else { "" }
            + if self.key_order() { ", key order" } else { "" }
            + if self.ordering_key("m0").is_some() {
                ", ordered outbox"
            } else {
                ""
            }
            + &self.proxy_summary()
            + &if self.short_ttl {
                format!(
                    ", ttl {} ms ({} held, {} late copies)",
                    SHORT_TTL_MS,
                    self.schedule.hold.len(),
                    self.schedule.late.len()
                )
            } else {
                String::new()
            }
    }
}
