//! `RedisStore` and the Redis Streams consumer on a Redis Cluster of
//! private Valkey 8.1 processes (`common::cluster`), and the
//! `wait_for_replicas` durability option. The store and broker conformance
//! suites run on a cluster too (`tests/conformance.rs`,
//! `tests/broker_conformance.rs`); here is what a cluster adds:
//!
//! - a claim, a completion and replays while the slot of their keys
//!   migrates to another primary (`ASK` redirections), and after
//!   (`MOVED`);
//! - a primary SIGKILLed in the middle of a run of competing consumers
//!   (every message delivered twice, concurrently), its replica promoted,
//!   the killed node started again as a replica, then every message
//!   delivered once more: how many bodies ran twice, and how many ran again
//!   after their message was acknowledged (a completed marker the failover
//!   lost), with and without `wait_for_replicas`;
//! - `wait_for_replicas` on one server with a replica: a claim or a
//!   completion the replica does not acknowledge fails and runs nothing.
//!
//! The failover run is short here (2 000 messages, one kill). Its long
//! form, `IDEMPOTENT_CLUSTER_CHAOS=1` (`IDEMPOTENT_CLUSTER_CHAOS_MESSAGES`,
//! default 20 000; `IDEMPOTENT_CLUSTER_CHAOS_KILLS`, default 3), kills a
//! primary several times and migrates 64 slots twice, its consumers paced
//! (about 15 s per fault) so that every fault lands while they run, and
//! prints the figures and each fault's time (add `-- --nocapture`). A
//! delivery that does not succeed within 2 minutes is reported with what
//! the store holds for it and fails the test.
//! `IDEMPOTENT_CLUSTER_CHAOS_HERD=1` runs the final pass as a task per
//! message at once (how the first version of this test did it).

mod common;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{RedisCluster, ValkeyPair};
use idempotent_runtime::redis;
use idempotent_runtime::store::NotReplicated;
use idempotent_runtime::{Error, RedisStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
}

/// What the bodies did, per message id.
#[derive(Default)]
struct Ledger {
    runs: Mutex<HashMap<u32, u32>>,
    /// Messages acknowledged (their call returned `Ok`).
    acked: Mutex<HashSet<u32>>,
    /// Bodies started after their message was acknowledged.
    after_ack: AtomicU64,
}

impl Ledger {
    fn run(&self, id: u32) {
        *self.runs.lock().unwrap().entry(id).or_default() += 1;
        if self.acked.lock().unwrap().contains(&id) {
            self.after_ack.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn runs(&self, id: u32) -> u32 {
        self.runs.lock().unwrap().get(&id).copied().unwrap_or(0)
    }

    fn twice(&self) -> usize {
        self.runs.lock().unwrap().values().filter(|&&n| n > 1).count()
    }
}

#[idempotent(key = "id", store = store, scope = "cluster", shared_scope = true, lease = "5s")]
async fn apply(store: &RedisStore, id: u32, ledger: &Ledger) -> Result<(), AppError> {
    ledger.run(id);
    tokio::time::sleep(Duration::from_millis(1)).await;
    Ok(())
}

/// Holds its claim until `release` is notified (the markers of `apply`).
#[idempotent(key = "id", store = store, scope = "cluster", shared_scope = true)]
async fn apply_held(
    store: &RedisStore,
    id: u32,
    ledger: &Ledger,
    started: &tokio::sync::Notify,
    release: &tokio::sync::Notify,
) -> Result<(), AppError> {
    ledger.run(id);
    started.notify_one();
    release.notified().await;
    Ok(())
}

/// Runs `f` (a blocking cluster operation) off the runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_completions_follow_a_slot_migration() {
    let cluster = Arc::new(blocking(|| RedisCluster::start(3)).await);
    // A hash tag in the prefix puts every key of this store in one slot:
    // the slot the test migrates.
    let tag = common::unique("migrating");
    let store = RedisStore::cluster_builder(cluster.connection().await)
        .prefix(format!("{{{tag}}}:"))
        .build()
        .unwrap();
    let ledger = Arc::new(Ledger::default());
    let slot = cluster.slot(&format!("{{{tag}}}"));
    let to = cluster.other_primary(slot);

    let before: Vec<u32> = (0..40).collect();
    for &id in &before {
        apply(&store, id, &ledger).await.unwrap();
    }
    // A claim held open while its key moves.
    let (started, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let held = {
        let (store, ledger, started, release) = (store.clone(), ledger.clone(), started.clone(), release.clone());
        tokio::spawn(async move { apply_held(&store, 1000, &ledger, &started, &release).await })
    };
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("the held claim's body started");

    // The slot is migrating, 20 of its 41 keys have moved: a key still on
    // the old owner is served there, a moved one is redirected (ASK).
    let c = cluster.clone();
    let migration = blocking(move || {
        let migration = c.begin_migration(slot, to);
        assert_eq!(c.migrate_keys(&migration, 20), 20);
        migration
    })
    .await;
    for &id in &before {
        apply(&store, id, &ledger).await.unwrap();
    }
    // New keys while migrating: absent from the old owner, so their
    // claims and completions go to the new one (ASK).
    let during: Vec<u32> = (100..140).collect();
    for &id in &during {
        apply(&store, id, &ledger).await.unwrap();
    }
    // Every key moves, the held lease with them: its completion (`SET ..
    // IFEQ`), asked to the old owner, is redirected.
    let c = cluster.clone();
    let migration = blocking(move || {
        while c.migrate_keys(&migration, 100) > 0 {}
        migration
    })
    .await;
    release.notify_one();
    held.await.unwrap().unwrap();
    let all: Vec<u32> = before.iter().chain(&during).copied().chain([1000]).collect();
    for &id in &all {
        apply(&store, id, &ledger).await.unwrap();
    }
    let target = migration.to.port;
    let c = cluster.clone();
    blocking(move || c.finish_migration(migration)).await;
    // The slot has its new owner (MOVED): replays, and new keys.
    let after: Vec<u32> = (200..210).collect();
    for &id in all.iter().chain(&after) {
        apply(&store, id, &ledger).await.unwrap();
    }
    for &id in all.iter().chain(&after) {
        assert_eq!(ledger.runs(id), 1, "message {id}: one run");
    }
    assert_eq!(ledger.after_ack.load(Ordering::SeqCst), 0);
    let keys: u64 = cluster
        .cli(target, &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        keys,
        (all.len() + after.len()) as u64,
        "every marker is on the slot's new owner"
    );
}

/// The figures of one failover run.
#[derive(Debug, Default)]
struct Figures {
    messages: u32,
    deliveries: u64,
    /// Bodies that ran more than once.
    twice: usize,
    /// Bodies that ran again after their message was acknowledged.
    after_ack: u64,
    /// Messages whose final redelivery (after the failovers) ran the body:
    /// their completed marker was lost.
    lost_markers: usize,
    /// Calls refused because a replica did not acknowledge in time.
    not_replicated: u64,
    /// Calls that failed on the store (connection lost, cluster down, ..).
    store_errors: u64,
    /// Calls that did not answer within `CALL_TIMEOUT` (abandoned, tried
    /// again).
    timeouts: u64,
    /// Primaries SIGKILLed, and slots migrated, during the run.
    kills: usize,
    migrated_slots: usize,
    /// Deliveries given up after `DELIVERY_DEADLINE`, with what the store
    /// held for them: none expected.
    unprocessed: Vec<String>,
    seconds: f64,
}

struct Chaos {
    messages: u32,
    kills: usize,
    /// Slots to migrate (with their keys) during the run.
    migrations: usize,
    wait: bool,
    /// How long the first pass over the messages should last at least
    /// (each consumer pauses between deliveries), so that the faults,
    /// which take seconds each, land while the consumers run.
    pace: Duration,
}

/// How long one delivery may take, retries included, before it is given
/// up and reported.
const DELIVERY_DEADLINE: Duration = Duration::from_secs(120);
/// How long one call may take before it is abandoned (as a consumer's
/// handler timeout would) and tried again.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// The counters the deliveries share.
#[derive(Default)]
struct Tally {
    not_replicated: AtomicU64,
    store_errors: AtomicU64,
    timeouts: AtomicU64,
    unprocessed: Mutex<Vec<String>>,
}

/// Delivers message `id` until its call returns `Ok` (retrying after
/// `InProgress` and store errors, as a consumer's redelivery would), or
/// gives up after `DELIVERY_DEADLINE` and records what the store holds.
async fn deliver(store: &RedisStore, cluster: &RedisCluster, id: u32, ledger: &Ledger, tally: &Tally) {
    let deadline = Instant::now() + DELIVERY_DEADLINE;
    let mut last = String::from("none");
    let mut attempts = 0u32;
    while Instant::now() < deadline {
        attempts += 1;
        match tokio::time::timeout(CALL_TIMEOUT, apply(store, id, ledger)).await {
            Ok(Ok(())) => {
                ledger.acked.lock().unwrap().insert(id);
                return;
            }
            Ok(Err(AppError::Idem(Error::InProgress { .. }))) => {
                last = "in progress".into();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(Err(AppError::Idem(Error::Store(error)))) => {
                if error.is::<NotReplicated>() {
                    tally.not_replicated.fetch_add(1, Ordering::Relaxed);
                } else {
                    tally.store_errors.fetch_add(1, Ordering::Relaxed);
                }
                last = error.to_string();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(Err(other)) => panic!("message {id}: {other:?}"),
            Err(_) => {
                tally.timeouts.fetch_add(1, Ordering::Relaxed);
                last = format!("no answer within {CALL_TIMEOUT:?}");
            }
        }
    }
    // What the store holds for it, asked on a connection of its own.
    let key = store.redis_key("cluster", &id.to_string());
    let held = async {
        let mut conn = cluster.client().get_async_connection().await?;
        let value: Option<String> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await?;
        Ok::<_, redis::RedisError>(format!("value {value:?}, pttl {pttl} ms"))
    };
    let held = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .unwrap_or_else(|_| Ok("no answer".into()))
        .unwrap_or_else(|e| format!("unreadable: {e}"));
    tally.unprocessed.lock().unwrap().push(format!(
        "message {id} ({key}, slot {}): {attempts} attempts in {DELIVERY_DEADLINE:?}, ran {} time(s), last: {last}; holds {held}",
        cluster.slot(&key),
        ledger.runs(id)
    ));
}

/// Competing consumers: `workers` tasks taking the messages of `queue`
/// in turn until it is empty; `done` counts the deliveries finished.
#[allow(clippy::too_many_arguments)] // the run's parts
fn consume(
    queue: Vec<u32>,
    workers: usize,
    pause: Duration,
    store: &RedisStore,
    cluster: &Arc<RedisCluster>,
    ledger: &Arc<Ledger>,
    tally: &Arc<Tally>,
    done: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let queue = Arc::new(Mutex::new(VecDeque::from(queue)));
    (0..workers)
        .map(|_| {
            let (queue, store, cluster, ledger, tally, done) = (
                queue.clone(),
                store.clone(),
                cluster.clone(),
                ledger.clone(),
                tally.clone(),
                done.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Some(id) = queue.lock().unwrap().pop_front() else {
                        return;
                    };
                    deliver(&store, &cluster, id, &ledger, &tally).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
            })
        })
        .collect()
}

/// Competing consumers over `messages` messages, each delivered twice
/// (the two copies in different places of the queue), 16 at a time;
/// `kills` times a primary is SIGKILLed when a share of the deliveries are
/// done, its replica promoted and the killed node started again, and
/// `migrations` times 64 slots move to other primaries with their keys;
/// then every message is delivered once more (16 at a time again).
async fn failover_run(chaos: Chaos) -> Figures {
    let cluster = Arc::new(blocking(|| RedisCluster::start(3)).await);
    let mut builder =
        RedisStore::cluster_builder(cluster.connection().await).prefix(format!("{}:", common::unique("failover")));
    if chaos.wait {
        builder = builder.wait_for_replicas(1, Duration::from_millis(500));
    }
    let store = builder.build().unwrap();
    let ledger = Arc::new(Ledger::default());
    let mut queue: Vec<u32> = (0..chaos.messages).chain(0..chaos.messages).collect();
    {
        use rand::seq::SliceRandom;
        queue.shuffle(&mut rand::rng());
    }
    let total = queue.len() as u64;
    let done = Arc::new(AtomicU64::new(0));
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let pause = chaos.pace * 16 / u32::try_from(total).unwrap_or(u32::MAX).max(1);
    let workers = consume(queue, 16, pause, &store, &cluster, &ledger, &tally, &done);

    // The faults, each when its share of the deliveries is done: kills
    // and migrations taking turns.
    let mut faults: Vec<bool> = Vec::new();
    for i in 0..chaos.kills.max(chaos.migrations) {
        faults.extend((i < chaos.kills).then_some(true));
        faults.extend((i < chaos.migrations).then_some(false));
    }
    let count = faults.len() as u64;
    let (mut kills, mut migrated_slots) = (0, 0);
    for (n, kill) in faults.into_iter().enumerate() {
        let at = total * (n as u64 + 1) / (count + 2);
        while done.load(Ordering::SeqCst) < at {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let cluster = cluster.clone();
        let t = Instant::now();
        if kill {
            // The primary of a random slot.
            let slot = rand::random_range(0..16384u16);
            let killed = blocking(move || {
                let killed = cluster.kill_primary_of(slot);
                cluster.wait_for_promotion(killed, slot);
                cluster.restart(killed);
                killed
            })
            .await;
            kills += 1;
            eprintln!(
                "  {:.1} s: primary :{killed} SIGKILLed, replica promoted, node back as a replica in {:.1} s ({} of {total} deliveries done)",
                started.elapsed().as_secs_f64(),
                t.elapsed().as_secs_f64(),
                done.load(Ordering::SeqCst)
            );
        } else {
            // 64 slots (their keys with them) to other primaries, while
            // the consumers run.
            blocking(move || {
                let first = rand::random_range(0..16384u16 - 64);
                for slot in first..first + 64 {
                    let to = cluster.other_primary(slot);
                    let migration = cluster.begin_migration(slot, to);
                    cluster.finish_migration(migration);
                }
            })
            .await;
            migrated_slots += 64;
            eprintln!(
                "  {:.1} s: 64 slots migrated in {:.1} s ({} of {total} deliveries done)",
                started.elapsed().as_secs_f64(),
                t.elapsed().as_secs_f64(),
                done.load(Ordering::SeqCst)
            );
        }
    }
    for worker in workers {
        worker.await.unwrap();
    }
    // Every message once more, after the faults: a body that runs now lost
    // its completed marker.
    let before: HashMap<u32, u32> = ledger.runs.lock().unwrap().clone();
    // 16 consumers again; `IDEMPOTENT_CLUSTER_CHAOS_HERD=1`: every message
    // at once, as this test first did (a task per message), the load under
    // which its long form first stalled.
    let herd = std::env::var_os("IDEMPOTENT_CLUSTER_CHAOS_HERD").is_some();
    let again = consume(
        (0..chaos.messages).collect(),
        if herd { chaos.messages as usize } else { 16 },
        Duration::ZERO,
        &store,
        &cluster,
        &ledger,
        &tally,
        &done,
    );
    for worker in again {
        worker.await.unwrap();
    }
    let runs = ledger.runs.lock().unwrap().clone();
    let lost_markers = (0..chaos.messages).filter(|id| runs.get(id) != before.get(id)).count();
    let unprocessed = std::mem::take(&mut *tally.unprocessed.lock().unwrap());
    if unprocessed.is_empty() {
        for id in 0..chaos.messages {
            assert!(ledger.runs(id) >= 1, "message {id} was never processed");
        }
    }
    Figures {
        messages: chaos.messages,
        deliveries: total + u64::from(chaos.messages),
        twice: ledger.twice(),
        after_ack: ledger.after_ack.load(Ordering::SeqCst),
        lost_markers,
        not_replicated: tally.not_replicated.load(Ordering::Relaxed),
        store_errors: tally.store_errors.load(Ordering::Relaxed),
        timeouts: tally.timeouts.load(Ordering::Relaxed),
        kills,
        migrated_slots,
        unprocessed,
        seconds: started.elapsed().as_secs_f64(),
    }
}

fn report(label: &str, figures: &Figures) {
    eprintln!(
        "{label}: {} messages, {} deliveries in {:.1} s, {} primaries killed, {} slots migrated: twice {}, \
         ran again after the ack {}, markers lost {}, refused as not replicated {}, store errors {}, \
         calls timed out {}, unprocessed {}",
        figures.messages,
        figures.deliveries,
        figures.seconds,
        figures.kills,
        figures.migrated_slots,
        figures.twice,
        figures.after_ack,
        figures.lost_markers,
        figures.not_replicated,
        figures.store_errors,
        figures.timeouts,
        figures.unprocessed.len()
    );
    for line in figures.unprocessed.iter().take(20) {
        eprintln!("  unprocessed: {line}");
    }
}

fn chaos_setting(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

impl Chaos {
    /// The short run (2 000 messages, one kill), or with
    /// `IDEMPOTENT_CLUSTER_CHAOS` the long one.
    fn from_env(wait: bool) -> Chaos {
        let long = std::env::var_os("IDEMPOTENT_CLUSTER_CHAOS").is_some();
        Chaos {
            messages: if long {
                chaos_setting("IDEMPOTENT_CLUSTER_CHAOS_MESSAGES", 20_000) as u32
            } else {
                2_000
            },
            kills: if long {
                chaos_setting("IDEMPOTENT_CLUSTER_CHAOS_KILLS", 3)
            } else {
                1
            },
            migrations: if long { 2 } else { 0 },
            wait,
            pace: Duration::ZERO,
        }
        .paced()
    }

    /// With faults in the run, the first pass lasts about 15 s per fault
    /// (a kill, its failover and the node's return take about 10 s here;
    /// 64 slots migrate in about as long), so that each lands while the
    /// consumers run rather than after they finished.
    fn paced(mut self) -> Chaos {
        if self.kills + self.migrations > 1 {
            self.pace = Duration::from_secs(15 * (self.kills + self.migrations) as u64);
        }
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_killed_mid_run_without_waiting_for_replicas() {
    let figures = failover_run(Chaos::from_env(false)).await;
    report("failover without wait_for_replicas", &figures);
    assert!(
        figures.unprocessed.is_empty(),
        "every message is processed: {:?}",
        figures.unprocessed
    );
    // Asynchronous replication: a marker or a lease the failover lost runs
    // a body again. Those are the honest figures (reported above and in the
    // README), not asserted; every message was processed.
    assert_eq!(figures.not_replicated, 0, "nothing waits for replicas");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_killed_mid_run_waiting_for_replicas_loses_no_acknowledged_marker() {
    let figures = failover_run(Chaos::from_env(true)).await;
    report("failover with wait_for_replicas(1, 500ms)", &figures);
    assert!(
        figures.unprocessed.is_empty(),
        "every message is processed: {:?}",
        figures.unprocessed
    );
    assert_eq!(
        figures.after_ack, 0,
        "no body runs again after its message was acknowledged: {figures:?}"
    );
    assert_eq!(figures.lost_markers, 0, "no completed marker is lost: {figures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_completions_that_no_replica_acknowledges_fail_and_run_nothing() {
    let mut pair = blocking(ValkeyPair::start).await;
    let client = redis::Client::open(pair.primary.redis_url()).unwrap();
    let store = RedisStore::builder(client.get_connection_manager().await.unwrap())
        .prefix(format!("{}:", common::unique("waiting")))
        .wait_for_replicas(1, Duration::from_millis(200))
        .build()
        .unwrap();
    let ledger = Ledger::default();
    apply(&store, 1, &ledger).await.unwrap();
    apply(&store, 1, &ledger).await.unwrap();
    assert_eq!(
        ledger.runs(1),
        1,
        "acknowledged by the replica: processed once, then replayed"
    );

    pair.replica.kill();
    for id in [1, 2] {
        let err = apply(&store, id, &ledger).await.unwrap_err();
        let AppError::Idem(Error::Store(source)) = &err else {
            panic!("{err:?}");
        };
        let refused = source.downcast_ref::<NotReplicated>().expect("NotReplicated");
        assert_eq!(refused.required, 1);
        assert!(err.to_string().contains("not acknowledged by 1 replica"), "{err}");
    }
    assert_eq!(ledger.runs(2), 0, "a claim no replica acknowledged runs nothing");
    assert_eq!(ledger.runs(1), 1, "nor does a replay of a marker it cannot confirm");

    let _pair = blocking(move || {
        pair.replica.spawn();
        pair.wait_for_sync();
        pair
    })
    .await;
    apply(&store, 2, &ledger).await.unwrap();
    apply(&store, 1, &ledger).await.unwrap();
    assert_eq!((ledger.runs(1), ledger.runs(2)), (1, 1), "back with the replica");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_no_replica_acknowledges_fails() {
    let mut pair = blocking(ValkeyPair::start).await;
    let client = redis::Client::open(pair.primary.redis_url()).unwrap();
    let store = RedisStore::builder(client.get_connection_manager().await.unwrap())
        .prefix(format!("{}:", common::unique("waiting")))
        .wait_for_replicas(1, Duration::from_millis(200))
        .build()
        .unwrap();
    let ledger = Arc::new(Ledger::default());
    let (started, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let held = {
        let (store, ledger, started, release) = (store.clone(), ledger.clone(), started.clone(), release.clone());
        tokio::spawn(async move { apply_held(&store, 7, &ledger, &started, &release).await })
    };
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("the held claim's body started");
    pair.replica.kill();
    release.notify_one();
    let err = held.await.unwrap().unwrap_err();
    let AppError::Idem(Error::Store(source)) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(
        source.downcast_ref::<NotReplicated>().expect("NotReplicated").what,
        "completion"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn wait_for_replicas_needs_a_replica_and_a_timeout() {
    let client = redis::Client::open(common::REDIS_URL).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    for (replicas, timeout) in [(0, Duration::from_secs(1)), (1, Duration::ZERO)] {
        let err = RedisStore::builder(conn.clone())
            .wait_for_replicas(replicas, timeout)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
    }
}

#[test]
fn a_cluster_stream_and_its_dead_letters_must_share_a_slot() {
    use idempotent_runtime::redis_streams::StreamConsumer;
    let client = redis::cluster::ClusterClient::new(["redis://127.0.0.1:1/"]).unwrap();
    let err = StreamConsumer::cluster_builder(client.clone(), "payments", "workers")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("must share a hash tag"), "{err}");
    assert!(err.to_string().contains("{payments}"), "{err}");
    StreamConsumer::cluster_builder(client.clone(), "{payments}", "workers")
        .build()
        .unwrap();
    StreamConsumer::cluster_builder(client, "{payments}.in", "workers")
        .dead_letter_stream("{payments}.failed")
        .build()
        .unwrap();
}

/// The outbox's publisher on a cluster: each `XADD` goes to the primary
/// of its stream's slot; streams named with different hash tags spread
/// over the primaries (how users spread load over the cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_publisher_spreads_streams_over_the_cluster_by_hash_tag() {
    use idempotent_runtime::outbox::{OutboxRow, Publisher, StreamPublisher};
    let cluster = RedisCluster::shared();
    let publisher = StreamPublisher::cluster(cluster.connection().await);
    let mut conn = cluster.connection().await;
    let base = common::unique("spread");
    let streams: Vec<String> = (0..8).map(|i| format!("{{{base}-{i}}}")).collect();
    for (i, stream) in streams.iter().enumerate() {
        let row = OutboxRow::new(
            i as i64,
            format!("m-{i}"),
            stream.clone(),
            None,
            "{}",
            b"{}".to_vec(),
            0,
        );
        publisher.publish(&row).await.unwrap();
    }
    let primaries: HashSet<u16> = streams
        .iter()
        .map(|stream| cluster.primary_of(cluster.slot(stream)).port)
        .collect();
    assert!(
        primaries.len() > 1,
        "8 hash tags land on several primaries: {primaries:?}"
    );
    for (i, stream) in streams.iter().enumerate() {
        let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(entries.ids.len(), 1, "{stream}");
        let id: String = entries.ids[0].get("message_id").unwrap();
        assert_eq!(id, format!("m-{i}"));
    }
}

/// A claim and a completion that the cluster connection sends again
/// (the README's "Retries and slot migrations"), forced: the slot's replica
/// is stopped (SIGSTOP), so the `WAIT` after the write blocks, and the
/// store's connection is killed (`CLIENT KILL`) while it does. The write
/// was made, its reply is lost; the cluster connection reconnects and
/// sends the write and its `WAIT` again. The claim finds its own lease,
/// the completion its own marker, and the `WAIT` of the new connection
/// covers neither (nothing was written on it): the store writes the value
/// again and waits for that write. With the replica still stopped, that
/// `WAIT` times out and both fail (`NotReplicated`) instead of counting a
/// lease or a marker no replica has; once the replica is back, the message
/// runs once and its replay is confirmed, with the marker on the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_claim_and_completion_are_written_again_and_waited_for() {
    let cluster = Arc::new(blocking(|| RedisCluster::start(3)).await);
    let tag = common::unique("retried");
    let slot = cluster.slot(&format!("{{{tag}}}"));
    let (primary, replica) = (cluster.primary_of(slot).port, cluster.replica_of(slot).port);
    // No response timeout of the client's own in the window: only the kill
    // makes the connection send again.
    let client = redis::cluster::ClusterClient::builder(cluster.urls())
        .connection_timeout(Duration::from_millis(500))
        .response_timeout(Duration::from_secs(10))
        .retries(3)
        .min_retry_wait(50)
        .max_retry_wait(200)
        .build()
        .unwrap();
    let store = RedisStore::cluster_builder(client.get_async_connection().await.unwrap())
        .prefix(format!("{{{tag}}}:"))
        .wait_for_replicas(1, Duration::from_millis(1500))
        .build()
        .unwrap();
    let ledger = Arc::new(Ledger::default());
    // The store's first-use checks, out of the way.
    apply(&store, 100, &ledger).await.unwrap();

    // Kills the store's connection once its `WAIT` blocks on `primary`.
    let kill_the_waiting_connection = {
        let cluster = Arc::clone(&cluster);
        move || {
            let cluster = Arc::clone(&cluster);
            blocking(move || {
                let id = cluster.client_running(primary, "wait", Duration::from_secs(5));
                cluster.cli(primary, &["CLIENT", "KILL", "ID", &id]);
            })
        }
    };

    // A retried claim.
    cluster.cli(primary, &["CONFIG", "RESETSTAT"]);
    cluster.pause(replica);
    let claim = {
        let (store, ledger) = (store.clone(), Arc::clone(&ledger));
        tokio::spawn(async move { apply(&store, 1, &ledger).await })
    };
    kill_the_waiting_connection().await;
    let outcome = claim.await.unwrap();
    cluster.resume(replica);
    assert!(
        cluster.calls(primary, "set") >= 2,
        "the claim's SET was sent again on a new connection"
    );
    let err = outcome.expect_err("a retried claim no replica acknowledged is refused");
    let AppError::Idem(Error::Store(source)) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(
        source.downcast_ref::<NotReplicated>().expect("NotReplicated").what,
        "claim",
        "{err}"
    );
    assert_eq!(ledger.runs(1), 0, "a refused claim runs nothing");
    blocking({
        let cluster = Arc::clone(&cluster);
        move || cluster.wait_for_replicas_of(primary)
    })
    .await;
    apply(&store, 1, &ledger).await.unwrap();
    apply(&store, 1, &ledger).await.unwrap();
    assert_eq!(
        ledger.runs(1),
        1,
        "once the replica is back: processed once, then replayed"
    );

    // A retried completion.
    let (started, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let held = {
        let (store, ledger, started, release) = (store.clone(), ledger.clone(), started.clone(), release.clone());
        tokio::spawn(async move { apply_held(&store, 2, &ledger, &started, &release).await })
    };
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("the held claim's body started");
    cluster.cli(primary, &["CONFIG", "RESETSTAT"]);
    cluster.pause(replica);
    release.notify_one();
    kill_the_waiting_connection().await;
    let outcome = held.await.unwrap();
    cluster.resume(replica);
    assert!(
        cluster.calls(primary, "set") >= 2,
        "the completion's SET .. IFEQ was sent again on a new connection"
    );
    let err = outcome.expect_err("a retried completion no replica acknowledged fails");
    let AppError::Idem(Error::Store(source)) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(
        source.downcast_ref::<NotReplicated>().expect("NotReplicated").what,
        "completion",
        "{err}"
    );
    blocking({
        let cluster = Arc::clone(&cluster);
        move || cluster.wait_for_replicas_of(primary)
    })
    .await;
    // The redelivery finds the marker the first attempt wrote: confirmed
    // on the replica, replayed, not run again.
    release.notify_one();
    apply_held(&store, 2, &ledger, &started, &release).await.unwrap();
    assert_eq!(ledger.runs(2), 1, "the body ran once");
    let mut on_replica = redis::Client::open(format!("redis://127.0.0.1:{replica}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("READONLY").query_async(&mut on_replica).await.unwrap();
    let marker: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.redis_key("cluster", "2"))
        .query_async(&mut on_replica)
        .await
        .unwrap();
    assert_eq!(
        marker.as_deref().and_then(|m| m.first()),
        Some(&b'D'),
        "the replica holds the completed marker"
    );
}

/// A Redis Streams consumer asked to stop while the primary of its
/// stream's slot does not answer (SIGSTOP: its connections stay open, the
/// acknowledgements of a committed batch wait for replies that do not
/// come, and the slot may fail over meanwhile) stops within its bound: the shutdown timeout,
/// counted from the request, then the 5 s the abandoned handlers get. The
/// consumer of the checker's seed 1025 did not: its batch settled 32
/// entries one response timeout after another on a cluster connection that
/// no longer answered, while the stop waited for a handler slot. Nothing is
/// lost: a consumer started after the failover handles every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_consumer_stops_within_its_bound_while_its_primary_fails_over() {
    use idempotent_runtime::broker::CancellationToken;
    use idempotent_runtime::redis_streams::StreamConsumer;
    #[derive(serde::Deserialize)]
    struct Message {
        id: u32,
    }
    const MESSAGES: u32 = 20;
    const SHUTDOWN: Duration = Duration::from_secs(1);
    let cluster = Arc::new(blocking(|| RedisCluster::start(3)).await);
    let stream = format!("{{{}}}", common::unique("stopping"));
    let slot = cluster.slot(&stream);
    let primary = cluster.primary_of(slot).port;
    let mut conn = cluster.connection().await;
    for id in 0..MESSAGES {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("message_id")
            .arg(format!("m-{id}"))
            .arg("body")
            .arg(format!("{{\"id\":{id}}}"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    blocking({
        let cluster = Arc::clone(&cluster);
        move || cluster.wait_for_replicas_of(primary)
    })
    .await;

    let handled: Arc<Mutex<HashMap<u32, u32>>> = Arc::default();
    let consumer = |handled: Arc<Mutex<HashMap<u32, u32>>>,
                    hold: Option<(Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>)>| {
        let hold = Arc::new(Mutex::new(hold));
        move |message: Message| {
            let (handled, hold) = (Arc::clone(&handled), hold.lock().unwrap().take());
            async move {
                if let Some((started, go)) = hold {
                    started.notify_one();
                    go.notified().await;
                }
                *handled.lock().unwrap().entry(message.id).or_default() += 1;
                Ok::<(), Error>(())
            }
        }
    };
    let (started, go) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let shutdown = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_runtime::SqliteStore::open(dir.path().join("markers.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let run = tokio::spawn(
        StreamConsumer::cluster_builder(cluster.client(), &stream, "workers")
            .concurrency(1)
            // A batch: its entries are settled one after another once it
            // committed, as in the checker's seed.
            .batch(store, 8)
            .claim_idle(Duration::from_secs(1))
            .block(Duration::from_millis(300))
            .shutdown_timeout(SHUTDOWN)
            .build()
            .unwrap()
            .run(
                consumer(Arc::clone(&handled), Some((Arc::clone(&started), Arc::clone(&go)))),
                shutdown.clone(),
            ),
    );
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("the first handler started");
    cluster.pause(primary);
    go.notify_one();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asked = Instant::now();
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(60), run).await;
    let took = asked.elapsed();
    cluster.resume(primary);
    assert!(stopped.is_ok(), "the consumer did not stop within 60 s");
    let bound = SHUTDOWN + Duration::from_secs(5) + Duration::from_secs(1);
    assert!(
        took <= bound,
        "the consumer stopped {took:?} after the request (bound {bound:?})"
    );

    // The paused node may have been failed over (paused longer than the
    // node timeout) and come back as a replica; the entries whose
    // acknowledgement was lost are reclaimed.
    blocking({
        let cluster = Arc::clone(&cluster);
        move || cluster.wait_for_ok()
    })
    .await;
    StreamConsumer::cluster_builder(cluster.client(), &stream, "workers")
        .claim_idle(Duration::from_secs(1))
        .block(Duration::from_millis(300))
        .stop_when_idle(Duration::from_secs(3))
        .build()
        .unwrap()
        .run(consumer(Arc::clone(&handled), None), CancellationToken::new())
        .await
        .unwrap();
    let handled = handled.lock().unwrap().clone();
    let missing: Vec<u32> = (0..MESSAGES).filter(|id| !handled.contains_key(id)).collect();
    assert!(missing.is_empty(), "messages never handled: {missing:?}");
    let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
        .arg(&stream)
        .arg("workers")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pending.count(), 0, "nothing left pending");
}
