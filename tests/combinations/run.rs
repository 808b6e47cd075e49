//! Runs one configuration: publishes, consumes under the fault schedule,
//! drains, and checks the invariants.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::async_nats;
use idempotent_runtime::broker::pipeline::Broker;
use idempotent_runtime::broker::{Backoff, CancellationToken, ConsumerBuilder, DeliveryInfo};
use idempotent_runtime::outbox::{
    JetStreamPublisher, KafkaPublisher, OutboxRow, OutboxStore, PublishError, Publisher, RabbitPublisher, Relay,
    StreamPublisher,
};
use idempotent_runtime::{MySqlStore, PgStore, SqliteStore, redis};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use super::brokers::{Endpoints, Sink, Source};
use super::child::{self, ChildConsumer, ChildPlan};
use super::common;
use super::config::{BodyFault, BrokerKind, Config, FaultKind, KillPhase, RelayKill, TimedFault};
use super::db::{self, BatchTarget, Opened, RelayDb};
use super::handlers::{self, AppError, Msg};
use super::proxy::ConnFaults;

/// The consumers' body size limit; the checker's bodies are far below it,
/// its oversized ones above.
const MAX_BODY_BYTES: usize = 2048;
/// How long a hanging body runs before its future is dropped.
const CANCEL_AFTER: Duration = Duration::from_millis(300);
/// No handler call for this long, nothing left on the broker: drained.
const QUIET: Duration = Duration::from_millis(1500);
/// How long a consumer may take to stop: what the library promises (the
/// consumers' shutdown timeout, 5 s, counted from the request, then 5 s for
/// the handlers it abandons), and 2 s for a loaded machine.
const STOP_BOUND: Duration = Duration::from_secs(12);
/// A configuration that has not drained by then is reported stuck
/// (`IDEMPOTENT_CHECKER_DEADLINE` seconds, default 90; twice that on Kafka,
/// where each consumer start, stop and death is a rebalance of seconds and
/// a SIGKILLed member's partitions wait out the session timeout).
fn deadline(cfg: &Config) -> Duration {
    let secs = std::env::var("IDEMPOTENT_CHECKER_DEADLINE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(90);
    let kafka = if cfg.broker == BrokerKind::Kafka { 2 } else { 1 };
    Duration::from_secs(secs * kafka)
}

/// A deliberate break of the run, which an invariant must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// One applied message's effect is deleted: "lost".
    Lost,
    /// One applied message's effect is added again: "twice".
    Twice,
    /// A dead-lettered message gets an effect.
    Dead,
    /// One outgoing message is dropped at the sink.
    Outbox,
    /// The dead letter of a data error is dropped (as if acknowledged
    /// without it).
    Undead,
    /// The consumers run without the body size limit.
    Unlimited,
}

impl Sabotage {
    pub const ALL: [Sabotage; 6] = [
        Sabotage::Lost,
        Sabotage::Twice,
        Sabotage::Dead,
        Sabotage::Outbox,
        Sabotage::Undead,
        Sabotage::Unlimited,
    ];
    pub fn parse(name: &str) -> Option<Sabotage> {
        match name.trim() {
            "lost" => Some(Sabotage::Lost),
            "twice" => Some(Sabotage::Twice),
            "dead" => Some(Sabotage::Dead),
            "outbox" => Some(Sabotage::Outbox),
            "undead" => Some(Sabotage::Undead),
            "unlimited" => Some(Sabotage::Unlimited),
            _ => None,
        }
    }
}

/// How long one of the checker's own operations (a query, a kill, a
/// read of the broker) may take before the run reports it as hung.
const OPERATION: Duration = Duration::from_secs(30);

/// Runs one of the checker's own operations, reporting it when it hangs
/// (then the configuration's run goes on without its result).
async fn bounded<T>(what: &str, violations: &mut Vec<String>, op: impl std::future::Future<Output = T>) -> Option<T> {
    match tokio::time::timeout(OPERATION, op).await {
        Ok(value) => Some(value),
        Err(_) => {
            violations.push(format!(
                "hung: the checker's {what} did not return within {OPERATION:?}"
            ));
            None
        }
    }
}

/// What a run counted.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Distinct message ids published.
    pub messages: u64,
    /// Publications (with duplicates and poison).
    pub published: u64,
    pub applied: u64,
    pub lost: u64,
    pub twice: u64,
    /// Dead letters (deliveries), poison included.
    pub dead_lettered: u64,
    /// Messages every delivery of which was dead-lettered, yet with an effect.
    pub dead_with_effect: u64,
    /// Lease stores: an effect made again (documented when a consumer died
    /// between effect and completion).
    pub reapplied: u64,
    /// Effects made again after the previous one's ttl
    /// (`Config::short_ttl`): allowed.
    pub expired: u64,
    /// A duplicate answered before its effect was committed.
    pub early: u64,
    /// A replayed result different from the first run's.
    pub wrong_replay: u64,
    /// Messages left unsettled after the drain.
    pub left: u64,
    pub outbox_missing: u64,
    pub outbox_rolled_back: u64,
    /// Outgoing messages delivered more than once by id (the relay's
    /// documented at-least-once publishing).
    pub outbox_dupes: u64,
    pub outbox_pending: u64,
    /// PostgreSQL effects committed with `synchronous_commit = off`.
    pub non_durable: u64,
}

#[derive(Debug)]
pub struct Report {
    pub config: Config,
    pub counts: Counts,
    pub faults: BTreeMap<FaultKind, u64>,
    pub violations: Vec<String>,
    pub elapsed: Duration,
    /// Where each consumer SIGKILL landed.
    pub sigkill_phases: BTreeMap<&'static str, u64>,
    /// How long after a SIGKILL the messages its child held were handled
    /// again in this process.
    pub redelivery: Vec<Duration>,
    /// How long after a SIGKILL they were handled with `Ok` here.
    pub settled: Vec<Duration>,
    /// Messages a killed child held that this process never saw again
    /// (another copy of them, or a later child, settled them).
    pub not_seen_again: u64,
}

impl Report {
    pub fn failed(&self) -> bool {
        !self.violations.is_empty()
    }
}

/// What the handlers of every consumer instance share.
struct Shared {
    opened: Arc<Opened>,
    value: bool,
    batched: bool,
    /// The schedule has lone outages.
    lone_outages: bool,
    /// The consumers limit body sizes (unless sabotaged).
    size_limit: bool,
    calls: AtomicU64,
    last_call: Mutex<Instant>,
    abort_after_commit: Mutex<HashSet<String>>,
    abort_tx: mpsc::UnboundedSender<usize>,
    early: Mutex<Vec<String>>,
    wrong_replay: Mutex<Vec<String>>,
    /// Messages a SIGKILLed child held, and when it was killed.
    redelivery_watch: Mutex<HashMap<String, Instant>>,
    redelivered: Mutex<Vec<Duration>>,
    /// The same messages once handled again here, until a handler
    /// returns `Ok` for them.
    settle_watch: Mutex<HashMap<String, Instant>>,
    settled: Mutex<Vec<Duration>>,
    /// Late copies (`Schedule::late`) not yet due: their delay after the
    /// first `Ok` of their message.
    late: Mutex<HashMap<String, u64>>,
    /// Late copies due at an instant, published by `drive`.
    late_due: Mutex<Vec<(Instant, String)>>,
    /// The proxy the consumers reach their broker through, and its settle
    /// cuts (`Config::through_proxy`).
    conn: Option<Arc<ConnFaults>>,
}

async fn handle(sh: Arc<Shared>, instance: usize, msg: Msg) -> Result<(), AppError> {
    sh.calls.fetch_add(1, Ordering::SeqCst);
    *sh.last_call.lock().unwrap() = Instant::now();
    let killed = sh.redelivery_watch.lock().unwrap().remove(&msg.id);
    if let Some(killed) = killed {
        sh.redelivered.lock().unwrap().push(killed.elapsed());
        sh.settle_watch.lock().unwrap().insert(msg.id.clone(), killed);
    }
    let ledger = &sh.opened.ledger;
    let ran = AtomicBool::new(false);
    let fault = ledger.ctx().take_fault(&msg.id);
    let answer = if fault == Some(BodyFault::Cancel) {
        match tokio::time::timeout(CANCEL_AFTER, ledger.apply(&msg, &ran, fault)).await {
            Ok(answer) => answer?,
            Err(_) => return Err(AppError::Failed(format!("checker: {} cancelled", msg.id))),
        }
    } else {
        ledger.apply(&msg, &ran, fault).await?
    };
    if fault == Some(BodyFault::AfterCall) {
        ledger.ctx().fired_after_calls.fetch_add(1, Ordering::SeqCst);
        return Err(AppError::Failed(format!(
            "checker: {} fails after its call returned Ok",
            msg.id
        )));
    }
    let expected = sh.value.then_some(msg.amount);
    if answer != expected {
        sh.wrong_replay
            .lock()
            .unwrap()
            .push(format!("{}: {answer:?} instead of {expected:?}", msg.id));
    }
    if !ran.load(Ordering::SeqCst) && !sh.batched && !sh.opened.committed(&msg.id).await {
        sh.early.lock().unwrap().push(msg.id.clone());
    }
    *sh.last_call.lock().unwrap() = Instant::now();
    let late = sh.late.lock().unwrap().remove(&msg.id);
    if let Some(ms) = late {
        let due = Instant::now() + Duration::from_millis(ms);
        sh.late_due.lock().unwrap().push((due, msg.id.clone()));
    }
    let killed = sh.settle_watch.lock().unwrap().remove(&msg.id);
    if let Some(killed) = killed {
        sh.settled.lock().unwrap().push(killed.elapsed());
    }
    let abort = sh.abort_after_commit.lock().unwrap().remove(&msg.id);
    if abort {
        let _ = sh.abort_tx.send(instance);
        std::future::pending::<()>().await;
    }
    Ok(())
}

pub fn with_batch<B>(
    builder: ConsumerBuilder<B>,
    target: &Option<BatchTarget>,
    max: Option<usize>,
) -> ConsumerBuilder<B> {
    let (Some(target), Some(max)) = (target, max) else {
        return builder;
    };
    let builder = match target {
        BatchTarget::Pg(s) => builder.batch(s.clone(), max),
        BatchTarget::My(s) => builder.batch(s.clone(), max),
        BatchTarget::Lite(s) => builder.batch(s.clone(), max),
    };
    builder.batch_wait(Duration::from_millis(5))
}

/// `builder` keeping its offsets in `target`'s store (offsets in the
/// database: `Opened::offsets`, set where `Config::offsets_in_db`), and
/// ordering by key within a partition where `Config::key_order`.
pub fn with_offsets(
    builder: ConsumerBuilder<idempotent_runtime::kafka::Kafka>,
    target: &Option<BatchTarget>,
    cfg: &Config,
) -> ConsumerBuilder<idempotent_runtime::kafka::Kafka> {
    let builder = if cfg.key_order() {
        builder.order(idempotent_runtime::kafka::Order::Key)
    } else {
        builder
    };
    match target {
        Some(BatchTarget::Pg(s)) => builder.offsets_in(s.clone()),
        Some(BatchTarget::My(s)) => builder.offsets_in(s.clone()),
        Some(BatchTarget::Lite(s)) => builder.offsets_in(s.clone()),
        None => builder,
    }
}

/// The consumers' prefetch (in-process and child).
pub fn prefetch(cfg: &Config) -> usize {
    (cfg.concurrency * cfg.batch.unwrap_or(4)).max(16)
}

/// The options every consumer of a configuration gets, in this process or
/// in a child.
pub fn configure<B: Broker>(builder: ConsumerBuilder<B>, size_limit: bool, lone_outages: bool) -> ConsumerBuilder<B> {
    let builder = if size_limit {
        builder.max_body_bytes(MAX_BODY_BYTES)
    } else {
        builder
    };
    // With lone outages the end of a run has no other message to prove the
    // dependencies up: in-place retries are bounded there.
    if lone_outages {
        builder
            .outage_backoff(Backoff::new(Duration::from_millis(50), Duration::from_millis(400)))
            .max_outage_retries(3)
    } else {
        builder
    }
}

type Instance = (JoinHandle<()>, CancellationToken);

fn spawn_instance<B: Broker>(builder: ConsumerBuilder<B>, sh: &Arc<Shared>, i: usize) -> Instance {
    let consumer = configure(builder, sh.size_limit, sh.lone_outages)
        .classify(handlers::classify)
        .build()
        .expect("consumer configuration");
    let token = CancellationToken::new();
    let sh = Arc::clone(sh);
    let run = consumer.run_with_info(
        move |msg: Msg, info: DeliveryInfo| {
            let sh = Arc::clone(&sh);
            async move {
                let id = msg.id.clone();
                let result = handle(Arc::clone(&sh), i, msg).await;
                // A run that gets its message dead-lettered: the proxy may
                // cut the connections while it is settled.
                if result.is_err()
                    && let Some(conn) = &sh.conn
                {
                    conn.after_failure(&id, info.attempt);
                }
                result
            }
        },
        token.clone(),
    );
    let task = tokio::spawn(async move {
        if let Err(err) = run.await {
            eprintln!("checker: consumer {i} stopped with {err}");
        }
    });
    (task, token)
}

/// Fault counters of the run itself (the body faults are the ledger's).
#[derive(Default)]
struct Fired {
    consumer_kills: u64,
    aborts_after_commit: u64,
    db_kills: u64,
    setting_changes: u64,
    broker_restarts: u64,
    db_restarts: u64,
    sigkills: u64,
    sigkill_phases: BTreeMap<&'static str, u64>,
    /// Redis Cluster primaries killed (failed over).
    failovers: u64,
    /// The proxy's cuts and stalls (timed, and the stall at shutdown).
    conn_cuts: u64,
    conn_stalls: u64,
    /// Cuts right after a message's last failing run (`Config::settle_cut`).
    settle_cuts: u64,
}

impl Fired {
    /// A consumer died in the run (aborted or SIGKILLed), or a Redis
    /// Cluster failover lost what consumers wrote to it (an acknowledgement
    /// of a stream entry, a completed marker not yet replicated): the
    /// tolerances are those of a consumer's death.
    fn died(&self) -> bool {
        self.consumer_kills + self.aborts_after_commit + self.sigkills + self.failovers > 0
    }
}

/// SIGKILLs a child consumer, and notes what it held (its redelivery is
/// timed).
async fn sigkill_child(
    mut child: ChildConsumer,
    landed: &'static str,
    held: Option<&str>,
    sh: &Shared,
    fired: &mut Fired,
    violations: &mut Vec<String>,
) {
    let killed = Instant::now();
    if child.sigkill().await.is_none() {
        violations.push("hung: a SIGKILLed child consumer was not reaped within 10 s".into());
    }
    // What it wrote before it died and was not read yet: the handlers
    // that returned (not held), its too-early answers and wrong replays.
    while let Ok(event) = tokio::time::timeout(Duration::from_secs(2), child.next_event()).await {
        match event {
            child::Event::Call(id) => {
                child.in_flight.insert(id);
            }
            child::Event::Done(id) => {
                child.in_flight.remove(&id);
            }
            child::Event::Early(id) => sh.early.lock().unwrap().push(format!("{id} (child)")),
            child::Event::Wrong(what) => sh.wrong_replay.lock().unwrap().push(what),
            child::Event::Closed => break,
            child::Event::Ready | child::Event::KillPoint(..) | child::Event::Other(_) => {}
        }
    }
    fired.sigkills += 1;
    *fired.sigkill_phases.entry(landed).or_default() += 1;
    let mut watch = sh.redelivery_watch.lock().unwrap();
    for id in child
        .in_flight
        .iter()
        .map(String::as_str)
        .chain(held)
        .filter(|id| *id != "-")
    {
        watch.insert(id.to_owned(), killed);
    }
}

/// The private servers of a configuration with restarts (`broker-restart`:
/// its broker; `db-restart`: its PostgreSQL), stopped when dropped, also
/// when the configuration fails or panics.
#[derive(Default, Clone)]
pub struct Private {
    rabbit: Option<Arc<common::servers::PrivateRabbit>>,
    /// NATS or Redis.
    child: Option<Arc<Mutex<common::servers::ChildServer>>>,
    pg: Option<Arc<common::servers::PrivatePostgres>>,
    /// The Tansu (Kafka) broker of a configuration on Kafka, or relaying
    /// to it (never restarted: it keeps its topics in memory).
    tansu: Option<Arc<common::servers::ChildServer>>,
}

impl Private {
    /// Starts the servers `cfg` restarts, and says where they are.
    pub async fn start(cfg: &Config) -> (Private, Endpoints) {
        let mut at = Endpoints::default();
        let mut private = Private::default();
        if cfg.broker == BrokerKind::Kafka || cfg.sink() == Some(BrokerKind::Kafka) {
            let tansu = blocking(common::servers::ChildServer::tansu).await;
            at.kafka = tansu.kafka_bootstrap();
            private.tansu = Some(Arc::new(tansu));
        }
        if cfg.broker_restart() {
            match cfg.broker {
                BrokerKind::Rabbit => {
                    let rabbit = blocking(common::servers::PrivateRabbit::start).await;
                    at.amqp = rabbit.url();
                    private.rabbit = Some(Arc::new(rabbit));
                }
                BrokerKind::JetStream => {
                    let nats = blocking(common::servers::ChildServer::nats).await;
                    at.nats = nats.nats_url();
                    private.child = Some(Arc::new(Mutex::new(nats)));
                }
                BrokerKind::RedisStreams => {
                    let redis = blocking(common::servers::ChildServer::redis).await;
                    at.redis = redis.redis_url();
                    private.child = Some(Arc::new(Mutex::new(redis)));
                }
                // Never drawn (`BrokerKind::restartable`).
                BrokerKind::Kafka => {}
            }
        }
        if cfg.cluster {
            // One cluster for the whole checker run (each configuration
            // its own key prefix), stopped when the test process exits.
            let cluster = blocking(common::cluster::RedisCluster::shared).await;
            at.cluster = cluster.urls();
            let _ = super::db::CLUSTER_URLS.set(at.cluster.clone());
        }
        if cfg.db_restart() {
            let pg = blocking(common::servers::PrivatePostgres::start).await;
            at.pg = pg.url();
            private.pg = Some(Arc::new(pg));
        }
        (private, at)
    }

    /// Restarts the broker (down for `down`), on a blocking thread.
    pub async fn restart_broker(&self, down: Duration) {
        let private = self.clone();
        blocking(move || {
            if let Some(rabbit) = &private.rabbit {
                rabbit.restart(down);
            }
            if let Some(child) = &private.child {
                child.lock().unwrap().restart(down);
            }
        })
        .await
    }

    /// Restarts the PostgreSQL (down for `down`), on a blocking thread.
    pub async fn restart_db(&self, down: Duration) {
        let private = self.clone();
        blocking(move || {
            if let Some(pg) = &private.pg {
                pg.restart(down);
            }
        })
        .await
    }

    /// Stops the servers, on a blocking thread.
    pub async fn stop(self) {
        blocking(move || drop(self)).await
    }
}

/// Runs `f` on a blocking thread (a panic there is the caller's).
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(err) => std::panic::resume_unwind(err.into_panic()),
    }
}

/// Publishes the late copies that are due (`all`: every one left, due or
/// not, and those whose message had no `Ok` here); returns how many were
/// left to publish before.
async fn publish_late(sh: &Shared, source: &Source, all: bool) -> usize {
    let due: Vec<String> = {
        let mut late_due = sh.late_due.lock().unwrap();
        let mut late = sh.late.lock().unwrap();
        let left = late_due.len() + late.len();
        if left == 0 {
            return 0;
        }
        let now = Instant::now();
        let mut due: Vec<String> = Vec::new();
        late_due.retain(|(at, id)| {
            let go = all || *at <= now;
            if go {
                due.push(id.clone());
            }
            !go
        });
        if all {
            due.extend(late.drain().map(|(id, _)| id));
        }
        if due.is_empty() {
            return left;
        }
        due
    };
    let n = due.len();
    for id in due {
        let amount = id.trim_start_matches('m').parse::<i64>().unwrap_or(0) + 1;
        let body = serde_json::to_vec(&Msg { id: id.clone(), amount }).unwrap();
        source.publish(&body, &format!("{id}.late")).await;
    }
    n
}

/// Consumes until drained (or the deadline), firing the timed faults.
/// Returns the messages left unsettled.
#[allow(clippy::too_many_arguments)] // the run's parts, each borrowed its own way
async fn drive<B: Broker>(
    cfg: &Config,
    make: &(dyn Fn() -> ConsumerBuilder<B> + Send + Sync),
    sh: &Arc<Shared>,
    source: &Source,
    mut abort_rx: mpsc::UnboundedReceiver<usize>,
    fired: &mut Fired,
    private: &Private,
    children: &ChildPlan,
    violations: &mut Vec<String>,
) -> u64 {
    let start = Instant::now();
    let mut instances: Vec<Instance> = (0..cfg.consumers).map(|i| spawn_instance(make(), sh, i)).collect();
    let mut timed = cfg.schedule.timed.iter().peekable();
    let mut sigkills = cfg.schedule.sigkill.iter().peekable();
    let mut joined: Option<ChildConsumer> = None;
    let batched = cfg.batch.is_some();
    let mut kill_rotation = 0usize;
    let mut stalled_at_shutdown = false;
    loop {
        let tick = joined
            .as_ref()
            .and_then(|c| c.kill_at)
            .map_or(Duration::from_millis(50), |at| {
                at.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(50))
            });
        tokio::select! {
            Some(i) = abort_rx.recv() => {
                instances[i].0.abort();
                bounded("wait for an aborted consumer task", violations, &mut instances[i].0).await;
                fired.aborts_after_commit += 1;
                instances[i] = spawn_instance(make(), sh, i);
            }
            event = child::next_event(&mut joined) => {
                let Some(c) = joined.as_mut() else { continue };
                match event {
                    child::Event::Call(id) => {
                        c.calls += 1;
                        c.in_flight.insert(id);
                        *sh.last_call.lock().unwrap() = Instant::now();
                        if let KillPhase::Timed(ms) = c.kill.phase
                            && c.calls >= c.kill.after
                            && c.kill_at.is_none()
                        {
                            c.kill_at = Some(Instant::now() + Duration::from_millis(ms));
                        }
                    }
                    child::Event::Done(id) => {
                        c.in_flight.remove(&id);
                        *sh.last_call.lock().unwrap() = Instant::now();
                    }
                    child::Event::KillPoint(phase, id) => {
                        if let Some(c) = joined.take() {
                            let landed = child::landed(&phase, batched);
                            sigkill_child(c, landed, Some(&id), sh, fired, violations).await;
                        }
                    }
                    child::Event::Early(id) => sh.early.lock().unwrap().push(format!("{id} (child)")),
                    child::Event::Wrong(what) => sh.wrong_replay.lock().unwrap().push(what),
                    child::Event::Ready => {}
                    child::Event::Other(what) => {
                        eprintln!("checker: a child consumer says {what:?}");
                        c.last_said = Some(what);
                    }
                    child::Event::Closed => {
                        let status = c.exited();
                        violations.push(format!(
                            "a child consumer exited before its SIGKILL ({status:?}, after {} calls in {:?}; it said {:?})",
                            c.calls,
                            c.spawned.elapsed(),
                            c.last_said
                        ));
                        joined = None;
                    }
                }
            }
            _ = tokio::time::sleep(tick) => {}
        }
        if joined
            .as_ref()
            .and_then(|c| c.kill_at)
            .is_some_and(|at| at <= Instant::now())
            && let Some(c) = joined.take()
        {
            let landed = if c.in_flight.is_empty() {
                "timed (no handler running)"
            } else {
                "timed (handlers running)"
            };
            sigkill_child(c, landed, None, sh, fired, violations).await;
        }
        let calls = sh.calls.load(Ordering::SeqCst);
        if joined.is_none()
            && let Some(kill) = sigkills.next_if(|k| calls >= k.at)
        {
            match ChildConsumer::spawn(&children.spec(*kill, &sh.opened)) {
                Ok(c) => joined = Some(c),
                Err(err) => violations.push(format!("a child consumer did not start: {err}")),
            }
        }
        while let Some((at, fault)) = timed.peek() {
            if calls < *at {
                break;
            }
            match fault {
                TimedFault::ConsumerKill => {
                    let i = kill_rotation % instances.len();
                    kill_rotation += 1;
                    instances[i].0.abort();
                    bounded("wait for an aborted consumer task", violations, &mut instances[i].0).await;
                    instances[i] = spawn_instance(make(), sh, i);
                    fired.consumer_kills += 1;
                }
                TimedFault::DbKill => {
                    bounded(
                        "kill of the store's connections",
                        violations,
                        sh.opened.kill_connections(),
                    )
                    .await;
                    fired.db_kills += 1;
                }
                TimedFault::SettingChange => {
                    bounded("setting change", violations, sh.opened.change_setting(true)).await;
                    fired.setting_changes += 1;
                }
                TimedFault::BrokerRestart(down) => {
                    bounded("restart of the broker", violations, private.restart_broker(*down)).await;
                    fired.broker_restarts += 1;
                }
                TimedFault::DbRestart(down) => {
                    bounded("restart of the database", violations, private.restart_db(*down)).await;
                    fired.db_restarts += 1;
                }
                TimedFault::Failover(slot) => {
                    let slot = *slot;
                    let failover = blocking(move || {
                        let cluster = common::cluster::RedisCluster::shared();
                        let killed = cluster.kill_primary_of(slot);
                        cluster.wait_for_promotion(killed, slot);
                        cluster.restart(killed);
                    });
                    bounded("failover of a Redis Cluster primary", violations, failover).await;
                    fired.failovers += 1;
                }
                // Only through the proxy (`Config::through_proxy`).
                TimedFault::ConnCut => {
                    if let Some(conn) = &sh.conn {
                        conn.proxy.cut();
                        fired.conn_cuts += 1;
                    }
                }
                TimedFault::ConnStall(d) => {
                    if let Some(conn) = &sh.conn {
                        conn.proxy.stall(*d);
                        fired.conn_stalls += 1;
                    }
                }
            }
            timed.next();
        }
        publish_late(sh, source, false).await;
        let quiet = sh.last_call.lock().unwrap().elapsed() > QUIET;
        let timed_done = timed.peek().is_none() && sigkills.peek().is_none();
        let backlog = bounded("read of the broker's backlog", violations, source.backlog())
            .await
            .unwrap_or(u64::MAX);
        if quiet
            && (timed_done || start.elapsed() > deadline(cfg) / 2)
            && backlog == 0
            && publish_late(sh, source, true).await > 0
        {
            // Late copies still to come (their message's `Ok` was not seen
            // here, or is recent): published now, drained with the rest.
            *sh.last_call.lock().unwrap() = Instant::now();
            continue;
        }
        if quiet && (timed_done || start.elapsed() > deadline(cfg) / 2) && backlog == 0 {
            // A child that never reached its kill point is killed now.
            if let Some(c) = joined.take() {
                sigkill_child(c, "at the drain (kill point not reached)", None, sh, fired, violations).await;
            }
            // With `stall_at_shutdown`, once: the consumers' connections
            // stall (no reset, no answer) for longer than the bound their
            // stop is checked against.
            let stalled = match &sh.conn {
                Some(conn) if cfg.stall_at_shutdown && !stalled_at_shutdown => {
                    stalled_at_shutdown = true;
                    conn.proxy.stall(STOP_BOUND + Duration::from_secs(5));
                    fired.conn_stalls += 1;
                    Some(conn)
                }
                _ => None,
            };
            // Stop every instance; anything they held goes back.
            for (task, token) in &instances {
                token.cancel();
                let _ = task;
            }
            // Each within the bound of its own shutdown, asked of all at once.
            let stop_by = tokio::time::Instant::now() + STOP_BOUND;
            for (task, _) in instances.drain(..) {
                if tokio::time::timeout_at(stop_by, task).await.is_err() {
                    violations.push(format!(
                        "a consumer did not stop within {STOP_BOUND:?} of its shutdown{}",
                        if stalled.is_some() {
                            " (its connection stalled)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            // The stall ends, and what the stopped consumers held is let go
            // of with their connections.
            if let Some(conn) = stalled {
                eprintln!(
                    "checker: the consumers stopped {} ms after their shutdown, their connections stalled",
                    (STOP_BOUND - stop_by.saturating_duration_since(tokio::time::Instant::now())).as_millis()
                );
                conn.proxy.unstall();
                conn.proxy.cut();
            }
            tokio::time::sleep(super::brokers::REDELIVERY + Duration::from_millis(200)).await;
            let left = bounded("read of the broker's backlog", violations, source.backlog())
                .await
                .unwrap_or(u64::MAX);
            if left == 0 || start.elapsed() > deadline(cfg) {
                return left;
            }
            instances = (0..cfg.consumers).map(|i| spawn_instance(make(), sh, i)).collect();
            *sh.last_call.lock().unwrap() = Instant::now();
        }
        if start.elapsed() > deadline(cfg) {
            if let Some(c) = joined.take() {
                sigkill_child(c, "at the deadline", None, sh, fired, violations).await;
            }
            for (task, token) in instances.drain(..) {
                token.cancel();
                task.abort();
            }
            violations.push(format!("not drained within {:?}", deadline(cfg)));
            return bounded("read of the broker's backlog", violations, source.backlog())
                .await
                .unwrap_or(u64::MAX);
        }
    }
}

// ---- the relay, in a runtime of its own so that it can be killed ----------

/// A publisher that kills its relay (by signalling the supervisor, which
/// shuts the relay's runtime down) at the scheduled publish calls.
struct KillingPublisher<P> {
    inner: P,
    calls: Arc<AtomicU64>,
    kills: Arc<Mutex<Vec<(u64, RelayKill)>>>,
    killed: Arc<Notify>,
    fired: Arc<Mutex<BTreeMap<FaultKind, u64>>>,
}

impl<P: Publisher> Publisher for KillingPublisher<P> {
    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let kill = {
            let mut kills = self.kills.lock().unwrap();
            let at = kills.iter().position(|(k, _)| *k <= n);
            at.map(|at| kills.remove(at).1)
        };
        if kill == Some(RelayKill::BeforePublish) {
            *self
                .fired
                .lock()
                .unwrap()
                .entry(FaultKind::RelayKillBeforePublish)
                .or_default() += 1;
            self.killed.notify_one();
            std::future::pending::<()>().await;
        }
        let result = self.inner.publish(row).await;
        if kill == Some(RelayKill::AfterConfirm) {
            if result.is_ok() {
                *self
                    .fired
                    .lock()
                    .unwrap()
                    .entry(FaultKind::RelayKillAfterConfirm)
                    .or_default() += 1;
                self.killed.notify_one();
                std::future::pending::<()>().await;
            } else {
                self.kills.lock().unwrap().push((n + 1, RelayKill::AfterConfirm));
            }
        }
        result
    }
}

#[derive(Clone)]
pub struct RelayPlan {
    pub db: RelayDb,
    pub sink: BrokerKind,
    /// The sink's broker (the private one when it is the restarted broker).
    pub at: Endpoints,
    pub calls: Arc<AtomicU64>,
    pub kills: Arc<Mutex<Vec<(u64, RelayKill)>>>,
    pub killed: Arc<Notify>,
    pub fired: Arc<Mutex<BTreeMap<FaultKind, u64>>>,
}

async fn relay_with<S: OutboxStore>(store: S, plan: RelayPlan) {
    let wrap = |inner| KillingPublisher {
        inner,
        calls: Arc::clone(&plan.calls),
        kills: Arc::clone(&plan.kills),
        killed: Arc::clone(&plan.killed),
        fired: Arc::clone(&plan.fired),
    };
    let handle = match plan.sink {
        BrokerKind::Rabbit => Relay::builder(store, wrap(PublisherKind::Rabbit(RabbitPublisher::new(&plan.at.amqp))))
            .poll_interval(Duration::from_millis(50))
            .publish_timeout(Duration::from_secs(2))
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .batch_size(16)
            .spawn(),
        BrokerKind::JetStream => {
            let nats = retrying("the relay's NATS connection", || {
                async_nats::connect(plan.at.nats.as_str())
            })
            .await;
            let js = async_nats::jetstream::new(nats);
            Relay::builder(store, wrap(PublisherKind::Js(JetStreamPublisher::new(js))))
                .poll_interval(Duration::from_millis(50))
                .publish_timeout(Duration::from_secs(2))
                .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
                .batch_size(16)
                .spawn()
        }
        BrokerKind::RedisStreams => {
            let client = redis::Client::open(plan.at.redis.as_str()).unwrap();
            let conn = retrying("the relay's Redis connection", || {
                redis::aio::ConnectionManager::new(client.clone())
            })
            .await;
            Relay::builder(store, wrap(PublisherKind::Redis(StreamPublisher::new(conn))))
                .poll_interval(Duration::from_millis(50))
                .publish_timeout(Duration::from_secs(2))
                .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
                .batch_size(16)
                .spawn()
        }
        BrokerKind::Kafka => {
            let config = common::kafka::base_config(&plan.at.kafka);
            let publisher = KafkaPublisher::new(&config).expect("a Kafka publisher");
            Relay::builder(store, wrap(PublisherKind::Kafka(publisher)))
                .poll_interval(Duration::from_millis(50))
                .publish_timeout(Duration::from_secs(2))
                .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
                .batch_size(16)
                .spawn()
        }
    };
    std::future::pending::<()>().await;
    drop(handle);
}

/// Connects, retrying for up to 60 s while the server is down (a relay
/// started again during a restart).
async fn retrying<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    mut connect: impl FnMut() -> F,
) -> T {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        match connect().await {
            Ok(value) => return value,
            Err(err) if Instant::now() < until => {
                eprintln!("checker: {what}: {err}, retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("{what}: {err}"),
        }
    }
}

/// One publisher type for the four brokers (one relay instantiation per
/// store).
enum PublisherKind {
    Rabbit(RabbitPublisher),
    Js(JetStreamPublisher),
    Redis(StreamPublisher),
    Kafka(KafkaPublisher),
}

impl Publisher for PublisherKind {
    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        match self {
            PublisherKind::Rabbit(p) => p.publish(row).await,
            PublisherKind::Js(p) => p.publish(row).await,
            PublisherKind::Redis(p) => p.publish(row).await,
            PublisherKind::Kafka(p) => p.publish(row).await,
        }
    }
}

/// Starts a relay in a runtime of its own.
fn start_relay(plan: &RelayPlan) -> tokio::runtime::Runtime {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("relay runtime");
    let plan = plan.clone();
    rt.spawn(async move {
        match plan.db.clone() {
            RelayDb::Pg {
                url,
                markers,
                outbox,
                settings,
                partitioned,
            } => {
                let pool = retrying("the relay's PostgreSQL pool", || {
                    db::pg_store_pool(&url, Arc::clone(&settings), Arc::default(), 2)
                })
                .await;
                let mut builder = PgStore::builder(pool).table(&markers).outbox_table(&outbox);
                if partitioned {
                    builder = builder.partitioned(Duration::from_secs(24 * 3600));
                }
                relay_with(builder.build().unwrap(), plan).await
            }
            RelayDb::My { markers, outbox } => {
                let pool = db::my_store_pool(Arc::default(), Arc::default(), 2).await;
                let store = MySqlStore::builder(pool)
                    .table(&markers)
                    .outbox_table(&outbox)
                    .build()
                    .unwrap();
                relay_with(store, plan).await
            }
            RelayDb::Lite {
                path,
                markers,
                outbox,
                wal,
            } => {
                let pool = db::lite_pool(&path, wal).await;
                let store = SqliteStore::builder(pool)
                    .table(&markers)
                    .outbox_table(&outbox)
                    .build()
                    .unwrap();
                relay_with(store, plan).await
            }
        }
    });
    rt
}

/// Kills the relay's runtime whenever its publisher says so, and starts a
/// new one.
pub fn supervise_relay(plan: RelayPlan) -> (Arc<Mutex<Option<tokio::runtime::Runtime>>>, JoinHandle<()>) {
    let current = Arc::new(Mutex::new(Some(start_relay(&plan))));
    let slot = Arc::clone(&current);
    let task = tokio::spawn(async move {
        loop {
            plan.killed.notified().await;
            let old = slot.lock().unwrap().take();
            if let Some(rt) = old {
                rt.shutdown_background();
            }
            let new = start_relay(&plan);
            *slot.lock().unwrap() = Some(new);
        }
    });
    (current, task)
}

// ---- one configuration ------------------------------------------------------

fn env_name(cfg: &Config) -> String {
    common::unique(&format!("chk{}", cfg.seed))
}

/// Runs `cfg` and checks the invariants.
pub async fn run(cfg: &Config, sabotage: Option<Sabotage>) -> Report {
    let started = Instant::now();
    let name = env_name(cfg);
    let (private, at) = Private::start(cfg).await;
    let mut source = Source::setup(cfg.broker, &name, &at).await;
    // The in-process consumers through a proxy (`Config::through_proxy`;
    // child consumers connect directly, `Source::attach`).
    let conn = if cfg.through_proxy() {
        let conn = ConnFaults::start(cfg, &Source::broker_addr(cfg.broker, &at)).await;
        source.through(&conn.proxy.addr()).await;
        Some(Arc::new(conn))
    } else {
        None
    };
    let sink = match cfg.sink() {
        Some(kind) => Some(Sink::setup(kind, &name, &at).await),
        None => None,
    };
    let opened = Arc::new(db::open(cfg, &name, sink.as_ref().map(Sink::destination), &at.pg, None).await);
    let mut violations = Vec::new();

    // The relay.
    let relay_fired: Arc<Mutex<BTreeMap<FaultKind, u64>>> = Arc::default();
    let relay = match (&opened.relay, &sink) {
        (Some(db), Some(sink)) => Some(supervise_relay(RelayPlan {
            db: db.clone(),
            sink: sink.kind(),
            at: at.clone(),
            calls: Arc::default(),
            kills: Arc::new(Mutex::new(cfg.schedule.relay.clone())),
            killed: Arc::new(Notify::new()),
            fired: Arc::clone(&relay_fired),
        })),
        _ => None,
    };

    // Publish: every id once, then the duplicates (same id, same body,
    // another broker-level id), and the poison.
    let body = |n: usize| {
        serde_json::to_vec(&Msg {
            id: format!("m{n:04}"),
            amount: n as i64 + 1,
        })
        .unwrap()
    };
    let mut publications: HashMap<String, u64> = HashMap::new();
    let mut order: Vec<(Vec<u8>, String)> = Vec::new();
    for n in 0..cfg.messages {
        order.push((body(n), format!("m{n:04}")));
        *publications.entry(format!("m{n:04}")).or_default() += 1;
    }
    let mut rng = super::config::Rng::new(cfg.seed ^ 0xd0b1e);
    for d in 0..cfg.duplicates {
        let n = rng.below(cfg.messages as u64) as usize;
        let at = rng.below(order.len() as u64 + 1) as usize;
        order.insert(at.max(n + 1).min(order.len()), (body(n), format!("m{n:04}.dup{d}")));
        *publications.entry(format!("m{n:04}")).or_default() += 1;
    }
    // Short ttls: a held message's copy right after its first one (it
    // waits on the held claim), and the late copies to come.
    for id in &cfg.schedule.hold {
        if let Some(at) = order.iter().position(|(_, i)| i == id) {
            let n: usize = id.trim_start_matches('m').parse().unwrap();
            order.insert(at + 1, (body(n), format!("{id}.held")));
            *publications.entry(id.clone()).or_default() += 1;
        }
    }
    for (id, _) in &cfg.schedule.late {
        *publications.entry(id.clone()).or_default() += 1;
    }
    for p in 0..cfg.schedule.poison {
        let at = rng.below(order.len() as u64) as usize;
        order.insert(at, (format!("{{not json {p}").into_bytes(), format!("poison-{p}")));
    }
    // Oversized bodies decode (the padding is an unknown field): only the
    // size limit keeps their effect out. Their positions come from a stream
    // of their own.
    let mut big_rng = super::config::Rng::new(cfg.seed ^ 0x0b16_b0d1);
    let oversized: Vec<String> = (0..cfg.schedule.oversized).map(|b| format!("big-{b}")).collect();
    for id in &oversized {
        let body = serde_json::json!({ "id": id, "amount": 1, "pad": "x".repeat(MAX_BODY_BYTES) });
        let at = big_rng.below(order.len() as u64) as usize;
        order.insert(at, (serde_json::to_vec(&body).unwrap(), id.clone()));
    }
    for (body, id) in &order {
        source.publish(body, id).await;
    }

    let (abort_tx, abort_rx) = mpsc::unbounded_channel();
    let sh = Arc::new(Shared {
        opened: Arc::clone(&opened),
        value: cfg.value_result,
        batched: cfg.batch.is_some(),
        lone_outages: !cfg.schedule.lone_outage.is_empty(),
        size_limit: sabotage != Some(Sabotage::Unlimited),
        calls: AtomicU64::new(0),
        last_call: Mutex::new(Instant::now()),
        abort_after_commit: Mutex::new(cfg.schedule.abort_after_commit.iter().cloned().collect()),
        abort_tx,
        early: Mutex::default(),
        wrong_replay: Mutex::default(),
        redelivery_watch: Mutex::default(),
        redelivered: Mutex::default(),
        settle_watch: Mutex::default(),
        settled: Mutex::default(),
        late: Mutex::new(cfg.schedule.late.iter().cloned().collect()),
        late_due: Mutex::default(),
        conn: conn.clone(),
    });
    let children = ChildPlan::new(
        cfg,
        &name,
        &at,
        opened.sqlite_path.clone(),
        sink.as_ref().map(Sink::destination),
        sabotage != Some(Sabotage::Unlimited),
    );
    let mut fired = Fired::default();
    let prefetch = prefetch(cfg);
    let batch = opened.batch.clone();
    let left = match cfg.broker {
        BrokerKind::Rabbit => {
            let make = || {
                with_batch(source.rabbit(prefetch as u16), &batch, cfg.batch)
                    .concurrency(cfg.concurrency)
                    .max_attempts(cfg.max_attempts)
            };
            drive(
                cfg,
                &make,
                &sh,
                &source,
                abort_rx,
                &mut fired,
                &private,
                &children,
                &mut violations,
            )
            .await
        }
        BrokerKind::JetStream => {
            let make = || {
                with_batch(source.jetstream(prefetch), &batch, cfg.batch)
                    .concurrency(cfg.concurrency)
                    .max_attempts(cfg.max_attempts)
            };
            drive(
                cfg,
                &make,
                &sh,
                &source,
                abort_rx,
                &mut fired,
                &private,
                &children,
                &mut violations,
            )
            .await
        }
        BrokerKind::RedisStreams => {
            let make = || {
                with_batch(source.streams(), &batch, cfg.batch)
                    .concurrency(cfg.concurrency)
                    .max_attempts(cfg.max_attempts)
            };
            drive(
                cfg,
                &make,
                &sh,
                &source,
                abort_rx,
                &mut fired,
                &private,
                &children,
                &mut violations,
            )
            .await
        }
        BrokerKind::Kafka => {
            let make = || {
                with_offsets(with_batch(source.kafka(), &batch, cfg.batch), &opened.offsets, cfg)
                    .concurrency(cfg.concurrency)
                    .max_attempts(cfg.max_attempts)
            };
            drive(
                cfg,
                &make,
                &sh,
                &source,
                abort_rx,
                &mut fired,
                &private,
                &children,
                &mut violations,
            )
            .await
        }
    };
    if let Some(conn) = &conn {
        fired.settle_cuts = conn.settle_cuts.load(Ordering::SeqCst);
        // The checker's own wiring: the consumers went through the proxy.
        if conn.proxy.accepted() == 0 {
            violations.push("the consumers never connected through their proxy".into());
        }
    }
    if fired.setting_changes > 0 {
        bounded("setting reset", &mut violations, opened.change_setting(false)).await;
    }

    // The relay drains the outbox, then stops.
    let mut counts = Counts::default();
    if let Some((rt, task)) = relay {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let pending = bounded("read of the outbox", &mut violations, opened.outbox_pending())
                .await
                .unwrap_or(u64::MAX);
            if pending == 0 {
                break;
            }
            if Instant::now() > deadline {
                counts.outbox_pending = pending;
                violations.push(format!("{pending} outbox rows still pending after 30 s"));
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        task.abort();
        let _ = task.await;
        let old = rt.lock().unwrap().take();
        if let Some(rt) = old {
            rt.shutdown_background();
        }
    }

    // ---- the checks ----
    let mut effects = bounded("read of the effects", &mut violations, opened.effects())
        .await
        .unwrap_or_default();
    let mut dead = bounded("read of the dead letters", &mut violations, source.dead_letters())
        .await
        .unwrap_or_default();
    if sabotage == Some(Sabotage::Undead) {
        let refused = |body: &[u8]| {
            serde_json::from_slice::<Msg>(body).is_ok_and(|msg| cfg.schedule.data_error.contains(&msg.id))
        };
        if let Some(at) = dead.iter().position(|(body, _)| refused(body)) {
            dead.remove(at);
        }
    }
    let mut sink_rows = match &sink {
        Some(sink) => bounded("read of the sink", &mut violations, sink.read())
            .await
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let doomed: HashSet<&String> = cfg.schedule.doomed.iter().collect();
    let refused: HashSet<&String> = cfg
        .schedule
        .data_error
        .iter()
        .chain(&cfg.schedule.lone_outage)
        .collect();
    let mut dead_by_id: HashMap<String, u64> = HashMap::new();
    // Dead letters of each undecodable body: a consumer that dies after a
    // dead letter is stored and before the original is acknowledged
    // dead-letters the redelivery again (at least once, as for the outbox).
    let mut poison_dead: HashMap<&[u8], u64> = HashMap::new();
    // The kinds each message id was dead-lettered as.
    let mut dead_kinds: HashMap<String, HashSet<&str>> = HashMap::new();
    for (body, kind) in &dead {
        match serde_json::from_slice::<Msg>(body) {
            Ok(msg) => {
                dead_kinds.entry(msg.id.clone()).or_default().insert(kind.as_str());
                *dead_by_id.entry(msg.id).or_default() += 1;
            }
            Err(_) => {
                *poison_dead.entry(body.as_slice()).or_default() += 1;
                if kind != "poison" {
                    violations.push(format!("an undecodable body dead-lettered as {kind:?}"));
                }
            }
        }
    }
    if let Some(sabotage) = sabotage {
        let applied = (0..cfg.messages)
            .map(|n| format!("m{n:04}"))
            .find(|id| effects.get(id) == Some(&1) && dead_by_id.get(id).copied().unwrap_or(0) == 0);
        match (sabotage, applied) {
            (Sabotage::Lost, Some(id)) => opened.tamper(&id, true).await,
            (Sabotage::Twice, Some(id)) => opened.tamper(&id, false).await,
            (Sabotage::Dead, _) => {
                if let Some(id) = cfg.schedule.doomed.first() {
                    opened.tamper(id, false).await;
                }
            }
            (Sabotage::Outbox, Some(id)) => {
                let dropped = sink_rows.iter().position(|(_, payload)| payload == id.as_bytes());
                if let Some(at) = dropped {
                    sink_rows.remove(at);
                }
            }
            _ => {}
        }
        effects = bounded("read of the effects", &mut violations, opened.effects())
            .await
            .unwrap_or_default();
    }
    counts.messages = cfg.messages as u64;
    counts.published = order.len() as u64;
    counts.dead_lettered = dead.len() as u64;
    counts.left = left;
    if left > 0 {
        violations.push(format!("{left} messages left unsettled on the broker after the drain"));
    }
    let poison_again = poison_dead.values().sum::<u64>() - poison_dead.len() as u64;
    if poison_again > 0 && !fired.died() {
        violations.push(format!(
            "{poison_again} poison bodies dead-lettered again though no consumer died"
        ));
    }
    if poison_dead.len() != cfg.schedule.poison {
        violations.push(format!(
            "{} poison bodies published, {} dead-lettered",
            cfg.schedule.poison,
            poison_dead.len()
        ));
    }
    let died = fired.died();
    // Oversized bodies: dead-lettered as poison (once, unless a consumer
    // died), never applied (an effect is caught below as never published).
    for id in &oversized {
        let d = dead_by_id.get(id).copied().unwrap_or(0);
        let kinds = dead_kinds.get(id).cloned().unwrap_or_default();
        if d == 0 {
            violations.push(format!("{id}: a body over the size limit was not dead-lettered"));
        } else if d > 1 && !died {
            violations.push(format!(
                "{id}: oversized, dead-lettered {d} times though no consumer died"
            ));
        }
        if kinds.iter().any(|k| *k != "poison") {
            violations.push(format!("{id}: oversized, dead-lettered as {kinds:?} instead of poison"));
        }
    }
    // The messages that can only end as dead letters: every copy is
    // dead-lettered, as the kind its failure calls for (a consumer that died
    // may leave a copy to the last-delivery rule, "exhausted").
    let must_die = [
        (&cfg.schedule.doomed, "doomed", "exhausted"),
        (&cfg.schedule.data_error, "data error", "rejected"),
        (&cfg.schedule.lone_outage, "lone outage", "exhausted"),
    ];
    for (ids, what, kind) in must_die {
        for id in ids {
            let d = dead_by_id.get(id).copied().unwrap_or(0);
            let published = publications.get(id).copied().unwrap_or(0);
            if d < published {
                violations.push(format!(
                    "{id} ({what}): published {published} times, dead-lettered {d} times"
                ));
            }
            let kinds = dead_kinds.get(id).cloned().unwrap_or_default();
            let wrong: Vec<&&str> = kinds
                .iter()
                .filter(|k| **k != kind && !(died && **k == "exhausted"))
                .collect();
            if !wrong.is_empty() {
                violations.push(format!("{id} ({what}): dead-lettered as {wrong:?}, not {kind:?}"));
            }
        }
    }
    for (id, n) in &effects {
        if !publications.contains_key(id) && *n != 0 {
            violations.push(format!("an effect for {id}, never published"));
        }
    }
    let mut lost_ids = Vec::new();
    let mut twice_ids = Vec::new();
    let mut relapsed_after_kill = 0u64;
    for (id, published) in &publications {
        let e = effects.get(id).copied().unwrap_or(0);
        let d = dead_by_id.get(id).copied().unwrap_or(0);
        // More dead letters than copies: a consumer died after a dead
        // letter was stored and before the original was acknowledged, and
        // the redelivery was dead-lettered again (at least once). Without a
        // death it is a violation.
        if d > *published && !died {
            violations.push(format!(
                "{id}: published {published} times, dead-lettered {d} times, though no consumer died"
            ));
        }
        if d >= *published || doomed.contains(id) || refused.contains(id) {
            // A child SIGKILLed between a relapse's dead letter and its ack:
            // the next process runs it again (the documented limit of a
            // process that dies between the two steps).
            if e == 1 && fired.sigkills > 0 && cfg.schedule.relapse.contains(id) {
                relapsed_after_kill += 1;
            } else if e != 0 {
                counts.dead_with_effect += 1;
                violations.push(format!(
                    "{id}: every delivery dead-lettered ({d}){}, yet {e} effect(s)",
                    if doomed.contains(id) { ", doomed" } else { "" }
                ));
            }
        } else if e == 0 {
            counts.lost += 1;
            lost_ids.push(id.clone());
        } else if e > 1 {
            counts.twice += 1;
            twice_ids.push(format!("{id} x{e}"));
        } else {
            counts.applied += 1;
        }
    }
    lost_ids.sort();
    twice_ids.sort();
    if !lost_ids.is_empty() && left > 0 {
        // Not drained: these may be among the messages left on the broker.
        violations.push(format!(
            "unprocessed: {} message(s) without an effect or a dead letter, {left} left on the broker: {lost_ids:?}",
            lost_ids.len()
        ));
        counts.lost = 0;
    } else if !lost_ids.is_empty() {
        violations.push(format!(
            "lost: {} acknowledged message(s) without an effect: {lost_ids:?}",
            lost_ids.len()
        ));
    }
    if !twice_ids.is_empty() {
        violations.push(format!(
            "twice: {} message(s) applied more than once: {twice_ids:?}",
            twice_ids.len()
        ));
    }
    let ctx = opened.ledger.ctx();
    counts.expired = bounded(
        "read of the effects after a ttl",
        &mut violations,
        opened.expired_effects(),
    )
    .await
    .unwrap_or_default();
    counts.reapplied = bounded("read of the effects made again", &mut violations, opened.reapplied())
        .await
        .unwrap_or_default();
    counts.reapplied += relapsed_after_kill;
    // A failover may lose a completed marker (replication is
    // asynchronous; without `wait_for_replicas` even one that was
    // acknowledged), or fail a completion as the primary dies: the body
    // runs again, the documented limit of the cluster (README, "Redis
    // Cluster").
    if counts.reapplied > 0 && !died {
        violations.push(format!(
            "a lease store's effect made {} more time(s) with no consumer killed",
            counts.reapplied
        ));
    }
    let non_durable = bounded("read of the commit log", &mut violations, opened.non_durable_commits())
        .await
        .unwrap_or_default();
    counts.non_durable = non_durable.len() as u64;
    if !non_durable.is_empty() {
        violations.push(format!(
            "effects committed with synchronous_commit = off (acknowledged before durable): {non_durable:?}"
        ));
    }
    let early = sh.early.lock().unwrap().clone();
    counts.early = early.len() as u64;
    if !early.is_empty() {
        violations.push(format!(
            "duplicates answered before their effect was committed: {early:?}"
        ));
    }
    let wrong = sh.wrong_replay.lock().unwrap().clone();
    counts.wrong_replay = wrong.len() as u64;
    if !wrong.is_empty() {
        violations.push(format!("wrong replayed results: {wrong:?}"));
    }
    if sink.is_some() {
        let mut by_id: HashMap<&str, u64> = HashMap::new();
        let mut by_payload: HashMap<String, u64> = HashMap::new();
        for (id, payload) in &sink_rows {
            *by_id.entry(id.as_str()).or_default() += 1;
            *by_payload
                .entry(String::from_utf8_lossy(payload).into_owned())
                .or_default() += 1;
        }
        counts.outbox_dupes = by_id.values().filter(|n| **n > 1).map(|n| n - 1).sum();
        let mut missing = Vec::new();
        for (id, e) in &effects {
            if *e > 0 && !by_payload.contains_key(id) {
                missing.push(id.clone());
            }
        }
        let mut rolled_back = Vec::new();
        for id in by_payload.keys() {
            if effects.get(id).copied().unwrap_or(0) == 0 {
                rolled_back.push(id.clone());
            }
        }
        missing.sort();
        rolled_back.sort();
        counts.outbox_missing = missing.len() as u64;
        counts.outbox_rolled_back = rolled_back.len() as u64;
        if cfg.ordering_key("m0").is_some() {
            let order = opened.outbox_order().await;
            violations.extend(super::db::out_of_commit_order(&order, &sink_rows));
        }
        if !missing.is_empty() {
            violations.push(format!(
                "outbox: committed effects whose message never arrived: {missing:?}"
            ));
        }
        if !rolled_back.is_empty() {
            violations.push(format!("outbox: messages of effects that rolled back: {rolled_back:?}"));
        }
    }
    if let Some(cached) = opened.ledger.cached() {
        // The cache only knows committed keys: never more than the effects.
        let committed = effects.values().filter(|n| **n > 0).count();
        if cached > committed {
            violations.push(format!("the cache holds {cached} keys, only {committed} committed"));
        }
    }

    let mut faults: BTreeMap<FaultKind, u64> = BTreeMap::new();
    faults.insert(FaultKind::HandlerError, ctx.fired_errors.load(Ordering::SeqCst));
    faults.insert(FaultKind::Panic, ctx.fired_panics.load(Ordering::SeqCst));
    faults.insert(FaultKind::Cancel, ctx.fired_cancels.load(Ordering::SeqCst));
    faults.insert(FaultKind::Swallow, ctx.fired_swallows.load(Ordering::SeqCst));
    faults.insert(FaultKind::AfterCall, ctx.fired_after_calls.load(Ordering::SeqCst));
    faults.insert(FaultKind::Deadlock, ctx.fired_deadlocks.load(Ordering::SeqCst));
    faults.insert(FaultKind::SlowCommit, cfg.schedule.slow_commit.len() as u64);
    faults.insert(FaultKind::Relapse, cfg.schedule.relapse.len() as u64);
    faults.insert(
        FaultKind::ShortTtl,
        ctx.fired_holds.load(Ordering::SeqCst) + cfg.schedule.late.len() as u64,
    );
    faults.insert(FaultKind::Poison, cfg.schedule.poison as u64);
    faults.insert(FaultKind::DataError, ctx.fired_data_errors.load(Ordering::SeqCst));
    faults.insert(FaultKind::LoneOutage, ctx.fired_outages.load(Ordering::SeqCst));
    faults.insert(FaultKind::Oversized, cfg.schedule.oversized as u64);
    faults.insert(FaultKind::Doomed, cfg.schedule.doomed.len() as u64);
    faults.insert(FaultKind::ConsumerKill, fired.consumer_kills);
    faults.insert(FaultKind::AbortAfterCommit, fired.aborts_after_commit);
    faults.insert(FaultKind::ConsumerSigkill, fired.sigkills);
    faults.insert(FaultKind::DbKill, fired.db_kills);
    faults.insert(FaultKind::SettingChange, fired.setting_changes);
    faults.insert(FaultKind::BrokerRestart, fired.broker_restarts);
    faults.insert(FaultKind::DbRestart, fired.db_restarts);
    faults.insert(FaultKind::Failover, fired.failovers);
    faults.insert(FaultKind::ConnCut, fired.conn_cuts);
    faults.insert(FaultKind::ConnStall, fired.conn_stalls);
    faults.insert(FaultKind::SettleCut, fired.settle_cuts);
    for (k, v) in relay_fired.lock().unwrap().iter() {
        faults.insert(*k, *v);
    }
    faults.retain(|_, v| *v > 0);

    let redelivery = sh.redelivered.lock().unwrap().clone();
    let settled = sh.settled.lock().unwrap().clone();
    let not_seen_again = sh.redelivery_watch.lock().unwrap().len() as u64;

    // Clean up.
    drop(sh);
    drop(conn);
    bounded("clean-up of the source", &mut violations, source.teardown()).await;
    if let Some(sink) = sink {
        bounded("clean-up of the sink", &mut violations, sink.teardown()).await;
    }
    if let Some(problems) = bounded("clean-up of the store", &mut violations, opened.teardown()).await {
        violations.extend(problems);
    }
    private.stop().await;
    Report {
        config: cfg.clone(),
        counts,
        faults,
        violations,
        elapsed: started.elapsed(),
        sigkill_phases: fired.sigkill_phases,
        redelivery,
        settled,
        not_seen_again,
    }
}
