//! HTTP as a source of the combination checker (issue 29): the requests of
//! a configuration go through the `Idempotency-Key` layer of a real axum
//! server on 127.0.0.1, sent by a reqwest client that retries (on a
//! connection lost, a timeout, `409` and `5xx`) and sends concurrent
//! duplicates of one key, instead of messages through a broker.
//!
//! # What is combined
//!
//! A configuration drawn as for the brokers (`config.rs`) runs through
//! HTTP when its seed draws it (from a stream of its own,
//! `Rng::new(seed ^ HTTP_SALT)`: 1 seed in 8 from `HTTP_FROM`, 1000, so
//! that the seeds below it, the short form's and the sabotage's, and every
//! seed's schedule stay what they were), or when
//! `IDEMPOTENT_CHECKER_FORCE=source=http` asks (`source=broker` runs the
//! broker instead). What it takes from the configuration: the store
//! (PostgreSQL plain or partitioned, MariaDB, SQLite, Redis, memory), the
//! `CachedStore` in front, the outbox (the handler publishes on its
//! `IdempotentTx`, a relay publishes to the sink's broker, killed before a
//! publish and after a confirm as scheduled), the server settings (session
//! settings, and one changed at run time), fingerprints (with them, some
//! keys are sent again with another body: `422`), a returned value (a
//! `201` with a JSON body, or a `204`), and the faults: body errors (`500`
//! after the effect), panics (the connection dies with the handler's task),
//! cancellations (the handler hangs longer than the client's timeout),
//! swallowed statement errors (a PostgreSQL transaction aborted under an
//! answer the handler meant to keep: `503`), data errors (`422` marked
//! `NotKept`), doomed and lone-outage keys (`500` / `503` on every run: the
//! client gives up), poison bodies (`400`, kept and replayed), oversized
//! bodies (`413` before the claim), the store's database connections
//! killed, the server killed in process (`consumer-kill`: every request in
//! flight is dropped and its connection closed, as in a crash of the
//! server process; the store survives), an answer lost after its commit
//! (`abort-after-commit`: the connection closed after the layer committed,
//! before the client reads the answer), and the restarts a seed draws
//! (the sink's broker, the store's private PostgreSQL). Left out: the
//! batches (the layer claims one key per request), the consumer SIGKILLs
//! of a child process (`tests/http_outbox.rs` and `tests/examples.rs`
//! SIGKILL a real server process), and the Kafka source.
//!
//! Of its own (the same stream): how many keys are also sent as a burst of
//! concurrent copies (2 to 8, and 1 or 2 keys with 24), whether a key in
//! progress is answered `409` or waited for (`InProgress::Wait`), the
//! client's concurrency, and, with `InProgress::Wait` on transactional
//! stores, copies of half the burst keys whose client goes away after 1,
//! 30, 300 or 1 500 ms (`waiter-drop`: before their claim, while they
//! wait, once handed the key, mid-body).
//!
//! # The checks (DESIGN.md's invariants, read for HTTP)
//!
//! 1. Every key that got a `2xx` has its effect exactly once, committed
//!    ("lost", "twice"); a key that never got one (doomed, refused) has
//!    none; an ordinary key that never got a `2xx` after its retries is a
//!    violation; no effect of a request that was refused before its claim
//!    (`413`) or answered `400` (poison) or `422` (another body).
//! 2. Replays answer byte for byte like the first run (status, body, the
//!    `x-run` header), with `Idempotent-Replayed: true`; a key answered
//!    "fresh" (not a replay) twice ran twice.
//! 3. Every `2xx` (a fresh answer or a replay, from the store or the
//!    cache) finds its effect committed when it arrives (invariant 4), and
//!    the cache never holds more keys than there are committed effects.
//! 4. With the outbox, every committed effect's outgoing message is
//!    delivered at the sink, by its id (re-publications counted apart),
//!    none of an effect that rolled back, no row left pending.
//! 5. PostgreSQL commits are durable (`synchronous_commit` at `COMMIT`).
//! 6. Once every request ended, no key is left in a layer's in-flight map
//!    (issue 43, hole 6).
//!
//! On the lease stores (Redis, memory) an effect made again is the
//! documented limit when the server died with a request in flight (the
//! in-process kill drops the lease): counted as "reapplied", a violation
//! without a kill.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use idempotent_runtime::axum::body::Bytes;
use idempotent_runtime::axum::extract::{Request, State};
use idempotent_runtime::axum::http::StatusCode;
use idempotent_runtime::axum::middleware::{self, Next};
use idempotent_runtime::axum::response::{IntoResponse, Response};
use idempotent_runtime::axum::routing::post;
use idempotent_runtime::axum::{self, Router};
use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx, InProgress, NotKept};
use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::store::{StagesOutbox, Store, TransactionalStore};
use idempotent_runtime::{CachedStore, MemoryStore, MySqlStore, PgStore, RedisStore, SqliteStore};
use tokio::sync::{Notify, watch};

use super::brokers::Sink;
use super::common;
use super::config::{BodyFault, Config, FaultKind, Rng, StoreKind, TimedFault};
use super::db::{self, Admin, Opened};
use super::handlers::{BoxFut, Msg, RedisConn};
use super::run::{self, Counts, Private, RelayPlan, Report, Sabotage};

/// The first seed that may draw HTTP as its source.
pub const HTTP_FROM: u64 = 1000;
/// The HTTP axis' stream: `Rng::new(seed ^ HTTP_SALT)`.
const HTTP_SALT: u64 = 0x4854_5450;
/// The layer's body limit (the brokers' consumers' size limit).
const BODY_LIMIT: usize = 2048;
/// The client's timeout per attempt.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a cancelled body hangs (longer than the client waits).
const HANG: Duration = Duration::from_secs(4);
/// How long a client keeps retrying one request.
const GIVE_UP: Duration = Duration::from_secs(60);

fn forced(what: &str) -> bool {
    std::env::var("IDEMPOTENT_CHECKER_FORCE").is_ok_and(|f| f.split(',').any(|p| p.trim() == what))
}

/// Whether configuration `cfg` runs through HTTP (instead of a broker).
pub fn source(cfg: &Config) -> bool {
    if forced("source=http") {
        return true;
    }
    if forced("source=broker") {
        return false;
    }
    cfg.seed >= HTTP_FROM && Rng::new(cfg.seed ^ HTTP_SALT).percent(12)
}

/// The HTTP axis' own draws.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Keys sent as a burst of concurrent copies, and how many.
    bursts: BTreeMap<usize, usize>,
    /// Keys sent again later with another body (with fingerprints).
    mismatched: Vec<usize>,
    /// Keys sent again later, the same request.
    later: Vec<usize>,
    in_progress: InProgress,
    /// Requests in flight at once (each with its retries).
    concurrency: usize,
    /// Burst keys with copies whose client goes away after this long
    /// (`FaultKind::WaiterDrop`; with `InProgress::Wait` on transactional
    /// stores, where a request dropped mid-body leaves nothing).
    dropped: BTreeMap<usize, Vec<Duration>>,
}

impl Plan {
    pub fn draw(cfg: &Config) -> Plan {
        let mut rng = Rng::new(cfg.seed ^ HTTP_SALT);
        let _source = rng.percent(12);
        let n = cfg.messages as u64;
        let mut bursts = BTreeMap::new();
        let mut later = Vec::new();
        for _ in 0..cfg.duplicates {
            let id = rng.below(n) as usize;
            if rng.percent(50) {
                bursts.insert(id, 2 + rng.below(7) as usize);
            } else {
                later.push(id);
            }
        }
        for _ in 0..1 + rng.below(2) {
            bursts.insert(rng.below(n) as usize, 24);
        }
        let mismatched = if cfg.fingerprint {
            (0..1 + rng.below(4)).map(|_| rng.below(n) as usize).collect()
        } else {
            Vec::new()
        };
        let in_progress = if rng.percent(50) {
            InProgress::Conflict {
                retry_after: Duration::from_secs(1),
            }
        } else {
            InProgress::Wait {
                timeout: Duration::from_secs(2),
            }
        };
        let concurrency = rng.pick(&[4, 8, 16]);
        // Drawn last, from the same stream: what came before is unchanged.
        let mut dropped = BTreeMap::new();
        if matches!(in_progress, InProgress::Wait { .. }) && cfg.store.transactional() {
            for &key in bursts.keys() {
                if rng.percent(50) {
                    let copies = (0..1 + rng.below(3))
                        .map(|_| Duration::from_millis(rng.pick(&[1, 30, 300, 1_500])))
                        .collect();
                    dropped.insert(key, copies);
                }
            }
        }
        Plan {
            bursts,
            mismatched,
            later,
            in_progress,
            concurrency,
            dropped,
        }
    }

    fn summary(&self) -> String {
        format!(
            "HTTP source: {} bursts (largest {}), {} later retries, {} mismatched, {:?}, {} at once",
            self.bursts.len(),
            self.bursts.values().max().copied().unwrap_or(0),
            self.later.len(),
            self.mismatched.len(),
            self.in_progress,
            self.concurrency
        )
    }
}

// ---- the server ------------------------------------------------------------------

/// What the handlers and the middleware share.
struct HttpState {
    opened: Arc<Opened>,
    /// `INSERT INTO <effects> (message_id) VALUES (<placeholder>)`.
    insert: String,
    sink: Option<String>,
    value: bool,
    doomed: HashSet<String>,
    data_error: HashSet<String>,
    lone_outage: HashSet<String>,
    /// Handler calls so far (the timed faults' clock).
    calls: AtomicU64,
    /// Runs of each key's body.
    runs: Mutex<HashMap<String, u64>>,
    /// Keys whose first `2xx` is lost after the commit (the connection
    /// closed before the client reads it).
    abort_after_commit: Mutex<HashSet<String>>,
    aborts_after_commit: AtomicU64,
    /// Bumped to kill every request in flight.
    kill: watch::Sender<u64>,
    /// The in-flight key counts of the layers served so far.
    layers: Mutex<Vec<Box<dyn Fn() -> usize + Send + Sync>>>,
}

impl HttpState {
    fn ctx(&self) -> &Arc<super::handlers::Ctx> {
        self.opened.ledger.ctx()
    }

    /// The run's number of `id`, counted.
    fn run_of(&self, id: &str) -> u64 {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut runs = self.runs.lock().unwrap();
        let n = runs.entry(id.to_owned()).or_default();
        *n += 1;
        *n
    }

    /// The body's fault after its effect, as an answer (or a panic, or a
    /// hang); `None`: no fault, answer normally.
    async fn fault(&self, id: &str, fault: Option<BodyFault>) -> Option<Response> {
        let ctx = self.ctx();
        if self.doomed.contains(id) {
            return Some((StatusCode::INTERNAL_SERVER_ERROR, format!("{id} is doomed")).into_response());
        }
        if self.lone_outage.contains(id) {
            ctx.fired_outages.fetch_add(1, Ordering::SeqCst);
            return Some((StatusCode::SERVICE_UNAVAILABLE, "a dependency is down").into_response());
        }
        match fault {
            Some(BodyFault::Error) => {
                ctx.fired_errors.fetch_add(1, Ordering::SeqCst);
                Some((StatusCode::INTERNAL_SERVER_ERROR, "checker: injected error").into_response())
            }
            Some(BodyFault::Panic) => {
                ctx.fired_panics.fetch_add(1, Ordering::SeqCst);
                panic!("checker: injected panic on {id}");
            }
            Some(BodyFault::Cancel) => {
                // The client gives up first; the handler answers later (if
                // its connection is still served).
                ctx.fired_cancels.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(HANG).await;
                None
            }
            Some(BodyFault::Hold) => {
                // Holds the key a while (its copies wait), then fails.
                tokio::time::sleep(super::config::HOLD).await;
                ctx.fired_errors.fetch_add(1, Ordering::SeqCst);
                Some((StatusCode::INTERNAL_SERVER_ERROR, "checker: held, then failed").into_response())
            }
            Some(BodyFault::Swallow | BodyFault::AfterCall | BodyFault::Deadlock) | None => None,
        }
    }

    /// The answer of a run that succeeded: `201` with the run in its body
    /// and header, or `204`.
    fn answer(&self, msg: &Msg, run: u64) -> Response {
        if self.value {
            let body = serde_json::json!({ "id": msg.id, "amount": msg.amount, "run": run }).to_string();
            (
                StatusCode::CREATED,
                [
                    ("x-run", run.to_string()),
                    ("content-type", "application/json".to_owned()),
                ],
                body,
            )
                .into_response()
        } else {
            (StatusCode::NO_CONTENT, [("x-run", run.to_string())]).into_response()
        }
    }
}

/// What the effect's statement binds.
enum Bind<'a> {
    None,
    Id(&'a str),
    Null,
}

/// A transactional store the handler can write through (`IdempotentTx`).
trait TxStore: TransactionalStore<Guard: 'static> + StagesOutbox + Clone + 'static {
    fn exec<'a>(tx: &'a mut IdempotentTx<Self>, sql: &'a str, bind: Bind<'a>) -> BoxFut<'a, Result<(), sqlx::Error>>;
}

macro_rules! tx_store {
    ($($s:ty),*) => {$(
        impl TxStore for $s {
            fn exec<'a>(tx: &'a mut IdempotentTx<Self>, sql: &'a str, bind: Bind<'a>) -> BoxFut<'a, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let query = sqlx::query(AssertSqlSafe(sql.to_owned()));
                    let query = match bind {
                        Bind::None => query,
                        Bind::Id(id) => query.bind(id.to_owned()),
                        Bind::Null => query.bind(None::<String>),
                    };
                    query.execute(&mut ***tx).await.map(|_| ())
                })
            }
        }
    )*};
}

tx_store!(
    PgStore,
    CachedStore<PgStore>,
    MySqlStore,
    CachedStore<MySqlStore>,
    SqliteStore,
    CachedStore<SqliteStore>
);

/// The handler on a transactional store: the effect (a row) in the claim's
/// transaction, its outgoing message on the outbox, then the fault.
async fn tx_handler<S: TxStore>(State(st): State<Arc<HttpState>>, mut tx: IdempotentTx<S>, body: Bytes) -> Response {
    let Ok(msg) = serde_json::from_slice::<Msg>(&body) else {
        st.calls.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::BAD_REQUEST, "the body is not a payment").into_response();
    };
    let run = st.run_of(&msg.id);
    let fault = st.ctx().take_fault(&msg.id);
    if let Err(error) = S::exec(&mut tx, &st.insert, Bind::Id(&msg.id)).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    if fault == Some(BodyFault::Swallow) {
        // "Already done": the error is swallowed and the body answers as if
        // it succeeded (a PostgreSQL transaction is aborted by it).
        st.ctx().fired_swallows.fetch_add(1, Ordering::SeqCst);
        let _ = S::exec(
            &mut tx,
            "SELECT no_such_column FROM no_such_table_of_the_checker",
            Bind::None,
        )
        .await;
    }
    if st.data_error.contains(&msg.id) {
        st.ctx().fired_data_errors.fetch_add(1, Ordering::SeqCst);
        if let Err(error) = S::exec(&mut tx, &st.insert, Bind::Null).await {
            return (StatusCode::UNPROCESSABLE_ENTITY, NotKept, error.to_string()).into_response();
        }
    }
    if let Some(sink) = &st.sink {
        tx.publish(st.ctx().outgoing(sink, &msg.id));
    }
    if let Some(answer) = st.fault(&msg.id, fault).await {
        return answer;
    }
    st.answer(&msg, run)
}

/// The handler on a lease store: the fault, then the effect, a per-id mark
/// (idempotent by design: made again only counts as "reapplied").
async fn lease_handler(State(st): State<Arc<HttpState>>, body: Bytes) -> Response {
    let Ok(msg) = serde_json::from_slice::<Msg>(&body) else {
        st.calls.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::BAD_REQUEST, "the body is not a payment").into_response();
    };
    let run = st.run_of(&msg.id);
    let fault = st.ctx().take_fault(&msg.id);
    if let Some(answer) = st.fault(&msg.id, fault).await {
        return answer;
    }
    let ctx = st.ctx();
    if let Some(effects) = ctx.redis_effects.get() {
        if let Err(error) = effects.record(&msg.id, None).await {
            return (StatusCode::INTERNAL_SERVER_ERROR, error).into_response();
        }
    } else {
        let mut effects = ctx.mem_effects.lock().unwrap();
        let n = effects.entry(msg.id.clone()).or_default();
        if *n > 0 {
            ctx.reapplied.fetch_add(1, Ordering::SeqCst);
        } else {
            *n = 1;
        }
    }
    st.answer(&msg, run)
}

/// Outside the layer: kills the requests in flight when the server is
/// "killed" (their futures dropped, then their connections closed by a
/// panic of their task), and loses the first `2xx` of the keys scheduled
/// for it after the layer committed.
async fn outer(State(st): State<Arc<HttpState>>, request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_default();
    let mut killed = st.kill.subscribe();
    let answer = tokio::select! {
        answer = next.run(request) => Some(answer),
        _ = killed.changed() => None,
    };
    let Some(answer) = answer else {
        panic!("checker: injected panic: the server was killed with {id:?} in flight");
    };
    let replayed = answer.headers().contains_key("idempotent-replayed");
    if answer.status().is_success() && !replayed && st.abort_after_commit.lock().unwrap().remove(&id) {
        st.aborts_after_commit.fetch_add(1, Ordering::SeqCst);
        panic!("checker: injected panic: the answer of {id} lost after its commit");
    }
    answer
}

fn layer<S: Store + 'static>(store: S, plan: &Plan, st: &HttpState) -> IdempotencyLayer<S> {
    let layer = IdempotencyLayer::builder(store)
        .caller(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
        .body_limit(BODY_LIMIT)
        .in_progress(plan.in_progress)
        .lease(Duration::from_secs(3))
        .build();
    let counted = layer.clone();
    st.layers
        .lock()
        .unwrap()
        .push(Box::new(move || counted.in_flight_keys()));
    layer
}

fn tx_router<S: TxStore>(store: S, plan: &Plan, st: &Arc<HttpState>) -> Router {
    Router::new()
        .route("/payments", post(tx_handler::<S>))
        .route_layer(layer(store, plan, st))
        .layer(middleware::from_fn_with_state(Arc::clone(st), outer))
        .with_state(Arc::clone(st))
}

fn lease_router<S: Store<Guard: 'static> + 'static>(store: S, plan: &Plan, st: &Arc<HttpState>) -> Router {
    Router::new()
        .route("/payments", post(lease_handler))
        .route_layer(layer(store, plan, st))
        .layer(middleware::from_fn_with_state(Arc::clone(st), outer))
        .with_state(Arc::clone(st))
}

/// The number of keys in the store's cache, if it has one.
type CacheLen = Box<dyn Fn() -> Option<usize> + Send>;

/// The router on the configuration's store (built on the pools `db::open`
/// made, with its session settings), and the size of its cache.
fn router(cfg: &Config, opened: &Opened, plan: &Plan, st: &Arc<HttpState>) -> (Router, CacheLen) {
    const CACHE: usize = 10_000;
    macro_rules! serve {
        ($make:ident, $store:expr) => {{
            let store = $store;
            if cfg.cached {
                let cached = CachedStore::new(store, CACHE);
                let len = cached.clone();
                ($make(cached, plan, st), Box::new(move || Some(len.len())) as CacheLen)
            } else {
                ($make(store, plan, st), Box::new(|| None) as CacheLen)
            }
        }};
    }
    match &opened.admin {
        Admin::Pg { store_pool, .. } => {
            let mut builder = PgStore::builder(store_pool.clone())
                .table(&opened.markers)
                .outbox_table(&opened.outbox);
            if cfg.store == StoreKind::PgPartitioned {
                builder = builder.partitioned(Duration::from_secs(24 * 3600));
            }
            serve!(tx_router, builder.build().unwrap())
        }
        Admin::My { store_pool, .. } => serve!(
            tx_router,
            MySqlStore::builder(store_pool.clone())
                .table(&opened.markers)
                .outbox_table(&opened.outbox)
                .build()
                .unwrap()
        ),
        Admin::Lite { pool, .. } => serve!(
            tx_router,
            SqliteStore::builder(pool.clone())
                .table(&opened.markers)
                .outbox_table(&opened.outbox)
                .build()
                .unwrap()
        ),
        Admin::Redis { conn } => {
            let prefix = opened.redis_prefix.clone().unwrap_or_default();
            let store = match conn {
                RedisConn::One(conn) => RedisStore::builder(conn.clone()).prefix(prefix).build(),
                // The checker run's Redis Cluster (issue 30), as `db::open`
                // builds the messages' store on it.
                RedisConn::Cluster(conn) => {
                    let builder = RedisStore::cluster_builder(conn.clone()).prefix(prefix);
                    if cfg.wait_replicas {
                        builder.wait_for_replicas(1, Duration::from_millis(500)).build()
                    } else {
                        builder.build()
                    }
                }
            };
            serve!(lease_router, store.unwrap())
        }
        Admin::Memory => serve!(lease_router, MemoryStore::new()),
    }
}

// ---- the client ----------------------------------------------------------------

/// One request to send (with its retries).
#[derive(Debug, Clone)]
struct Job {
    key: String,
    tenant: String,
    body: Vec<u8>,
    /// What it is, for the checks.
    kind: JobKind,
    /// Sent once, its client gone after this long, its answer ignored
    /// (`FaultKind::WaiterDrop`).
    drop_after: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobKind {
    /// An ordinary payment (or a copy of one).
    Payment,
    /// A payment's key with another body.
    Mismatched,
    Poison,
    Oversized,
}

/// An answer the client got.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    status: u16,
    replayed: bool,
    run: Option<String>,
    body: Vec<u8>,
}

impl Answer {
    /// What a replay must repeat byte for byte.
    fn kept(&self) -> (u16, &Option<String>, &[u8]) {
        (self.status, &self.run, &self.body)
    }
}

/// What the client saw, per key.
#[derive(Default)]
struct Seen {
    answers: Mutex<HashMap<String, Vec<(JobKind, Answer)>>>,
    /// `2xx` answers that arrived before their effect was committed.
    early: Mutex<Vec<String>>,
    /// Requests given up on (no final answer within `GIVE_UP` or the
    /// attempts).
    given_up: Mutex<Vec<String>>,
    requests: AtomicU64,
    /// Requests whose client went away (`FaultKind::WaiterDrop`).
    dropped: AtomicU64,
}

/// How the client retries.
#[derive(Clone, Copy)]
struct Retries {
    /// `5xx` answers before it gives up.
    attempts: u32,
    /// The layer's `503` (the store failed, nothing ran) is retried until `GIVE_UP`
    /// without counting: while a Redis Cluster primary fails over, a store
    /// waiting for a replica refuses every claim of its slots until one is
    /// back, as a client with backoff would ride out.
    outages: bool,
}

impl Retries {
    /// The retries of a request for `key`: its body faults are `5xx` the
    /// schedule plans (a relapse plans as many as the attempts), on top of
    /// the room left for the store's failures.
    fn for_key(self, cfg: &Config, key: &str) -> Retries {
        let planned = cfg.schedule.body.get(key).map_or(0, Vec::len) as u32;
        Retries {
            attempts: self.attempts + planned,
            ..self
        }
    }
}

/// Sends `job` until a final answer: a `2xx` or a `4xx` but `409`; a `5xx`
/// is retried up to `retries.attempts` times, a lost connection, a timeout or a
/// `409` until `GIVE_UP`.
async fn send(client: &reqwest::Client, servers: &Servers, job: &Job, retries: Retries, opened: &Opened, seen: &Seen) {
    if let Some(after) = job.drop_after {
        // Sent once; the client goes away after `after`, whatever the
        // request is doing then.
        seen.requests.fetch_add(1, Ordering::SeqCst);
        seen.dropped.fetch_add(1, Ordering::SeqCst);
        let request = client
            .post(servers.pick())
            .header("idempotency-key", format!("\"{}\"", job.key))
            .header("x-tenant", &job.tenant)
            .header("content-type", "application/json")
            .body(job.body.clone())
            .send();
        let _ = tokio::time::timeout(after, request).await;
        return;
    }
    let attempts = retries.attempts;
    let started = Instant::now();
    let mut failures = 0;
    loop {
        if started.elapsed() > GIVE_UP || failures >= attempts {
            seen.given_up
                .lock()
                .unwrap()
                .push(format!("{} after {failures} 5xx, {:?}", job.key, started.elapsed()));
            return;
        }
        seen.requests.fetch_add(1, Ordering::SeqCst);
        let sent = client
            .post(servers.pick())
            .header("idempotency-key", format!("\"{}\"", job.key))
            .header("x-tenant", &job.tenant)
            .header("content-type", "application/json")
            .body(job.body.clone())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let run = response
            .headers()
            .get("x-run")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let Ok(body) = response.bytes().await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        if status == 409 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        // The layer's own 503 (a problem document of type `store-failed`),
        // not the handler's (a lone outage's `503` counts).
        if status == 503 && retries.outages && body.windows(12).any(|w| w == b"store-failed") {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if status >= 500 {
            failures += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        if (200..300).contains(&status) && !opened.committed(&job.key).await {
            seen.early
                .lock()
                .unwrap()
                .push(format!("{} (replayed: {replayed})", job.key));
        }
        let answer = Answer {
            status,
            replayed,
            run,
            body: body.to_vec(),
        };
        seen.answers
            .lock()
            .unwrap()
            .entry(job.key.clone())
            .or_default()
            .push((job.kind, answer));
        return;
    }
}

/// The requests of `cfg`, in waves: every key once (some as bursts of
/// concurrent copies), then the later retries and the mismatched bodies.
fn jobs(cfg: &Config, plan: &Plan) -> (Vec<Vec<Job>>, Vec<Job>) {
    let payment = |n: usize| Job {
        key: format!("m{n:04}"),
        tenant: format!("t{}", n % 3),
        body: serde_json::to_vec(&Msg {
            id: format!("m{n:04}"),
            amount: n as i64 + 1,
        })
        .unwrap(),
        kind: JobKind::Payment,
        drop_after: None,
    };
    let mut first: Vec<Vec<Job>> = (0..cfg.messages)
        .map(|n| {
            let mut copies = vec![payment(n); plan.bursts.get(&n).copied().unwrap_or(1)];
            for after in plan.dropped.get(&n).into_iter().flatten() {
                copies.push(Job {
                    drop_after: Some(*after),
                    ..payment(n)
                });
            }
            copies
        })
        .collect();
    for p in 0..cfg.schedule.poison {
        first.push(vec![Job {
            key: format!("poison-{p}"),
            tenant: "t0".into(),
            body: format!("{{not json {p}").into_bytes(),
            kind: JobKind::Poison,
            drop_after: None,
        }]);
    }
    for b in 0..cfg.schedule.oversized {
        let id = format!("big-{b}");
        let body = serde_json::json!({ "id": id, "amount": 1, "pad": "x".repeat(BODY_LIMIT) });
        first.push(vec![Job {
            key: id,
            tenant: "t0".into(),
            body: serde_json::to_vec(&body).unwrap(),
            kind: JobKind::Oversized,
            drop_after: None,
        }]);
    }
    let mut then: Vec<Job> = plan.later.iter().map(|n| payment(*n)).collect();
    for n in &plan.mismatched {
        let mut job = payment(*n);
        job.body = serde_json::to_vec(&Msg {
            id: job.key.clone(),
            amount: -1,
        })
        .unwrap();
        job.kind = JobKind::Mismatched;
        then.push(job);
    }
    // The poison bodies are sent again: a kept 400 is replayed.
    for p in 0..cfg.schedule.poison {
        then.push(Job {
            key: format!("poison-{p}"),
            tenant: "t0".into(),
            body: format!("{{not json {p}").into_bytes(),
            kind: JobKind::Poison,
            drop_after: None,
        });
    }
    (first, then)
}

// ---- one configuration ------------------------------------------------------

/// What fired in the run, by the timed-fault driver.
#[derive(Default)]
struct Fired {
    server_kills: u64,
    db_kills: u64,
    setting_changes: u64,
    broker_restarts: u64,
    db_restarts: u64,
    failovers: u64,
}

/// Fires `cfg`'s timed faults as the handler calls reach them, until
/// `done`.
async fn drive_faults(cfg: &Config, st: &HttpState, opened: &Opened, private: &Private, done: &Notify) -> Fired {
    let mut fired = Fired::default();
    let mut timed = cfg.schedule.timed.clone();
    timed.sort_by_key(|(at, _)| *at);
    let mut timed = timed.into_iter().peekable();
    let finished = done.notified();
    tokio::pin!(finished);
    loop {
        tokio::select! {
            () = &mut finished => return fired,
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        let calls = st.calls.load(Ordering::SeqCst);
        while let Some((_, fault)) = timed.next_if(|(at, _)| *at <= calls) {
            match fault {
                TimedFault::ConsumerKill => {
                    st.kill.send_modify(|epoch| *epoch += 1);
                    fired.server_kills += 1;
                }
                TimedFault::DbKill => {
                    if opened.kill_connections().await > 0 {
                        fired.db_kills += 1;
                    }
                }
                TimedFault::SettingChange => {
                    opened.change_setting(true).await;
                    fired.setting_changes += 1;
                }
                TimedFault::BrokerRestart(down) => {
                    private.restart_broker(down).await;
                    fired.broker_restarts += 1;
                }
                TimedFault::DbRestart(down) => {
                    private.restart_db(down).await;
                    fired.db_restarts += 1;
                }
                // A Redis Cluster primary SIGKILLed, its replica promoted,
                // the node started again (as `run::run` does it).
                TimedFault::Failover(slot) => {
                    run::blocking(move || {
                        let cluster = common::cluster::RedisCluster::shared();
                        let killed = cluster.kill_primary_of(slot);
                        cluster.wait_for_promotion(killed, slot);
                        cluster.restart(killed);
                    })
                    .await;
                    fired.failovers += 1;
                }
                // The consumers' proxy: no broker consumers here.
                TimedFault::ConnCut | TimedFault::ConnStall(_) => {}
            }
        }
    }
}

/// The handlers' shared state for `cfg` on `opened`.
fn state(cfg: &Config, opened: &Arc<Opened>, sink: Option<String>) -> Arc<HttpState> {
    let placeholder = if cfg.store.is_pg() { "$1" } else { "?" };
    Arc::new(HttpState {
        opened: Arc::clone(opened),
        insert: format!("INSERT INTO {} (message_id) VALUES ({placeholder})", opened.effects),
        sink: sink.filter(|_| cfg.store.transactional()),
        value: cfg.value_result,
        doomed: cfg.schedule.doomed.iter().cloned().collect(),
        data_error: cfg.schedule.data_error.iter().cloned().collect(),
        lone_outage: cfg.schedule.lone_outage.iter().cloned().collect(),
        calls: AtomicU64::new(0),
        runs: Mutex::default(),
        abort_after_commit: Mutex::new(cfg.schedule.abort_after_commit.iter().cloned().collect()),
        aborts_after_commit: AtomicU64::new(0),
        kill: watch::Sender::new(0),
        layers: Mutex::default(),
    })
}

// ---- a server process, SIGKILLed ------------------------------------------------

/// What the server child serves (`checker_http_child_server`).
const CHILD_ENV: &str = "IDEMPOTENT_CHECKER_HTTP_CHILD";

#[derive(serde::Serialize, serde::Deserialize)]
struct ChildSpec {
    cfg: Config,
    name: String,
    addr: String,
    sink: Option<String>,
    pg: String,
    sqlite: Option<std::path::PathBuf>,
    /// The checker run's Redis Cluster (empty: none), for a Redis store on it.
    cluster: Vec<String>,
}

/// A second server of a configuration, in a process of its own: runs when
/// an HTTP run with a consumer SIGKILL starts this binary again with
/// `IDEMPOTENT_CHECKER_HTTP_CHILD`, serves the same store (its tables, its
/// SQLite file, its Redis prefix) with the same handler until it is
/// SIGKILLed; does nothing otherwise.
#[test]
fn checker_http_child_server() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    super::quiet_injected_panics();
    let spec: ChildSpec = serde_json::from_str(&spec).expect("the child's spec");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the child's runtime")
        .block_on(async move {
            let attach = db::Attach { sqlite: spec.sqlite };
            if !spec.cluster.is_empty() {
                let _ = db::CLUSTER_URLS.set(spec.cluster.clone());
            }
            let opened = Arc::new(db::open(&spec.cfg, &spec.name, spec.sink.clone(), &spec.pg, Some(&attach)).await);
            let plan = Plan::draw(&spec.cfg);
            let st = state(&spec.cfg, &opened, spec.sink);
            let (app, _) = router(&spec.cfg, &opened, &plan, &st);
            let listener = tokio::net::TcpListener::bind(&spec.addr)
                .await
                .expect("the child's port");
            let _ = axum::serve(listener, app).await;
        });
}

/// The server child of a run, while it lives: the client sends every
/// other attempt to it.
struct Child {
    process: std::process::Child,
    url: String,
}

/// Starts the server child and waits until it listens.
async fn start_child(spec: &ChildSpec) -> Option<Child> {
    let exe = std::env::current_exe().ok()?;
    let process = std::process::Command::new(exe)
        .args(["http::checker_http_child_server", "--exact", "--nocapture"])
        .env(CHILD_ENV, serde_json::to_string(spec).ok()?)
        .stdout(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let started = Instant::now();
    while tokio::net::TcpStream::connect(&spec.addr).await.is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(Child {
        process,
        url: format!("http://{}/payments", spec.addr),
    })
}

/// Where the client sends: the in-process server, and the child's while it
/// lives (every other attempt).
struct Servers {
    local: String,
    child: Mutex<Option<String>>,
    turn: AtomicU64,
    /// Attempts sent to a child.
    to_child: AtomicU64,
}

impl Servers {
    fn pick(&self) -> String {
        let child = self.child.lock().unwrap().clone();
        match child {
            Some(url) if self.turn.fetch_add(1, Ordering::SeqCst) % 2 == 1 => {
                self.to_child.fetch_add(1, Ordering::SeqCst);
                url
            }
            _ => self.local.clone(),
        }
    }
}

/// Starts the server child once the handlers were called `kill.at` times,
/// and SIGKILLs it `kill.after` × 150 ms later, with requests in flight on
/// it; until `done`. Returns the SIGKILLs made.
async fn sigkill_children(
    cfg: &Config,
    spec: &ChildSpec,
    st: &HttpState,
    servers: &Servers,
    done: &Notify,
    violations: &Mutex<Vec<String>>,
) -> u64 {
    let mut killed = 0;
    let finished = done.notified();
    tokio::pin!(finished);
    for kill in &cfg.schedule.sigkill {
        loop {
            if st.calls.load(Ordering::SeqCst) >= kill.at {
                break;
            }
            tokio::select! {
                () = &mut finished => return killed,
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
        }
        let Some(mut child) = start_child(spec).await else {
            violations
                .lock()
                .unwrap()
                .push("the HTTP server child did not start".into());
            return killed;
        };
        *servers.child.lock().unwrap() = Some(child.url.clone());
        tokio::select! {
            () = &mut finished => {}
            () = tokio::time::sleep(Duration::from_millis(150 * kill.after.max(1))) => {}
        }
        // SIGKILL (`Child::kill`), then no more attempts to it.
        let _ = child.process.kill();
        let _ = child.process.wait();
        *servers.child.lock().unwrap() = None;
        killed += 1;
        println!(
            "    HTTP server child SIGKILLed ({} attempts sent to children so far)",
            servers.to_child.load(Ordering::SeqCst)
        );
    }
    killed
}

/// What of `cfg` an HTTP run uses: no broker source, so its broker matters
/// only as the outbox's sink (a restart of it only then; a Kafka broker is
/// started only for a Kafka sink).
fn http_view(cfg: &Config) -> Config {
    let mut cfg = cfg.clone();
    if cfg.sink() != Some(cfg.broker) {
        cfg.schedule
            .timed
            .retain(|(_, f)| !matches!(f, TimedFault::BrokerRestart(_)));
        if cfg.broker == super::config::BrokerKind::Kafka {
            cfg.broker = super::config::BrokerKind::Rabbit;
        }
    }
    cfg
}

/// Runs `cfg` through HTTP and checks the invariants.
pub async fn run(cfg: &Config, sabotage: Option<Sabotage>) -> Report {
    let started = Instant::now();
    let cfg = &http_view(cfg);
    let plan = Plan::draw(cfg);
    println!("{}\n    {}", cfg.summary(), plan.summary());
    let name = common::unique(&format!("chkh{}", cfg.seed));
    let (private, at) = Private::start(cfg).await;
    let sink = match cfg.sink() {
        Some(kind) => Some(Sink::setup(kind, &name, &at).await),
        None => None,
    };
    let opened = Arc::new(db::open(cfg, &name, sink.as_ref().map(Sink::destination), &at.pg, None).await);
    let mut violations = Vec::new();

    let relay_fired: Arc<Mutex<BTreeMap<FaultKind, u64>>> = Arc::default();
    let relay = match (&opened.relay, &sink) {
        (Some(db), Some(sink)) => Some(run::supervise_relay(RelayPlan {
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

    let st = state(cfg, &opened, sink.as_ref().map(Sink::destination));
    let (app, cache_len) = router(cfg, &opened, &plan, &st);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let servers = Servers {
        local: format!("http://{}/payments", listener.local_addr().unwrap()),
        child: Mutex::default(),
        turn: AtomicU64::new(0),
        to_child: AtomicU64::new(0),
    };
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    // A server child SIGKILLed (not on the memory store: its keys live in
    // this process).
    let child_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .unwrap_or_default();
    let spec = ChildSpec {
        cfg: cfg.clone(),
        name: name.clone(),
        addr: child_addr,
        sink: sink.as_ref().map(Sink::destination),
        pg: at.pg.clone(),
        sqlite: opened.sqlite_path.clone(),
        cluster: at.cluster.clone(),
    };
    let child_violations = Mutex::new(Vec::new());

    // The client: every key (bursts at once), then the later requests.
    let client = reqwest::Client::builder().timeout(CLIENT_TIMEOUT).build().unwrap();
    let seen = Seen::default();
    let (first, then) = jobs(cfg, &plan);
    let done = Notify::new();
    // Store failures (a killed connection, a serialization failure) are
    // 5xx too: room for them beside the body's faults.
    let retries = Retries {
        attempts: cfg.max_attempts + 5,
        outages: cfg.failover(),
    };
    let clients = async {
        futures_util::stream::iter(first)
            .for_each_concurrent(plan.concurrency, |copies| {
                let (client, servers, seen, opened) = (&client, &servers, &seen, &opened);
                async move {
                    futures_util::future::join_all(
                        copies
                            .iter()
                            .map(|job| send(client, servers, job, retries.for_key(cfg, &job.key), opened, seen)),
                    )
                    .await;
                }
            })
            .await;
        futures_util::stream::iter(then)
            .for_each_concurrent(plan.concurrency, |job| {
                let (client, servers, seen, opened) = (&client, &servers, &seen, &opened);
                async move {
                    let retries = retries.for_key(cfg, &job.key);
                    send(client, servers, &job, retries, opened, seen).await
                }
            })
            .await;
        done.notify_waiters();
    };
    let sigkills = async {
        if cfg.store == StoreKind::Memory {
            return 0;
        }
        sigkill_children(cfg, &spec, &st, &servers, &done, &child_violations).await
    };
    let (fired, (), sigkills) = tokio::join!(drive_faults(cfg, &st, &opened, &private, &done), clients, sigkills);
    violations.extend(child_violations.into_inner().unwrap());
    // Every request ended: no key may stay in a layer's in-flight map.
    let in_flight = || st.layers.lock().unwrap().iter().map(|count| count()).sum::<usize>();
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if in_flight() > 0 {
        violations.push(format!(
            "the layer's in-flight map holds {} key(s) after every request ended",
            in_flight()
        ));
    }
    if fired.setting_changes > 0 {
        opened.change_setting(false).await;
    }
    server.abort();
    let _ = server.await;

    // The relay drains the outbox, then stops.
    let mut counts = Counts::default();
    if let Some((rt, task)) = relay {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let pending = opened.outbox_pending().await;
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
    let answers = std::mem::take(&mut *seen.answers.lock().unwrap());
    let mut effects = opened.effects().await;
    let mut sink_rows = match &sink {
        Some(sink) => sink.read().await,
        None => Vec::new(),
    };
    if let Some(sabotage) = sabotage {
        let applied = (0..cfg.messages)
            .map(|n| format!("m{n:04}"))
            .find(|id| effects.get(id) == Some(&1));
        match (sabotage, applied) {
            (Sabotage::Lost, Some(id)) => opened.tamper(&id, true).await,
            (Sabotage::Twice, Some(id)) => opened.tamper(&id, false).await,
            (Sabotage::Outbox, Some(id)) => {
                if let Some(at) = sink_rows.iter().position(|(_, payload)| payload == id.as_bytes()) {
                    sink_rows.remove(at);
                }
            }
            _ => {}
        }
        effects = opened.effects().await;
    }
    // A failover may lose a Redis lease or marker (the README's failover
    // table): like a server's death, it lets a Redis effect be made again.
    let died = fired.server_kills + st.aborts_after_commit.load(Ordering::SeqCst) + sigkills + fired.failovers > 0;
    // Without `wait_for_replicas`, a failover can lose a completed marker
    // that was already answered (the README's failover table): the next
    // retry runs the body again and is answered afresh. With the option the
    // answer waits for a replica, so a second fresh answer stays a
    // violation.
    let markers_may_be_lost = cfg.store == StoreKind::Redis && cfg.cluster && !cfg.wait_replicas && fired.failovers > 0;
    let no_effect: HashSet<&String> = cfg
        .schedule
        .doomed
        .iter()
        .chain(&cfg.schedule.data_error)
        .chain(&cfg.schedule.lone_outage)
        .collect();
    let mut lost = Vec::new();
    let mut twice = Vec::new();
    let mut wrong = Vec::new();
    let mut answered_again = 0u64;
    counts.messages = cfg.messages as u64;
    counts.published = seen.requests.load(Ordering::SeqCst);
    for n in 0..cfg.messages {
        let id = format!("m{n:04}");
        let e = effects.get(&id).copied().unwrap_or(0);
        let got = answers.get(&id).cloned().unwrap_or_default();
        let ok: Vec<&Answer> = got
            .iter()
            .filter(|(kind, a)| *kind == JobKind::Payment && (200..300).contains(&a.status))
            .map(|(_, a)| a)
            .collect();
        if no_effect.contains(&id) {
            counts.dead_lettered += 1;
            if e != 0 {
                counts.dead_with_effect += 1;
                violations.push(format!(
                    "{id}: never answered 2xx (doomed or refused), yet {e} effect(s)"
                ));
            }
            if !ok.is_empty() {
                violations.push(format!("{id}: doomed or refused, yet answered {}", ok[0].status));
            }
            continue;
        }
        if ok.is_empty() {
            violations.push(format!("{id}: no 2xx answer after the client's retries: {got:?}"));
            continue;
        }
        match e {
            0 => {
                counts.lost += 1;
                lost.push(id.clone());
            }
            1 => counts.applied += 1,
            _ => {
                counts.twice += 1;
                twice.push(format!("{id} x{e}"));
            }
        }
        // Replays: byte for byte the first run's answer; one fresh answer.
        let fresh: Vec<&&Answer> = ok.iter().filter(|a| !a.replayed).collect();
        if fresh.len() > 1 && markers_may_be_lost {
            answered_again += 1;
        } else if fresh.len() > 1 {
            wrong.push(format!(
                "{id}: {} fresh answers (the body ran and was kept more than once)",
                fresh.len()
            ));
        }
        let reference = fresh.first().copied().copied().unwrap_or(ok[0]);
        for a in &ok {
            // After a lost marker, a replay is one of the fresh answers.
            let matches =
                a.kept() == reference.kept() || markers_may_be_lost && fresh.iter().any(|f| f.kept() == a.kept());
            if !matches {
                wrong.push(format!(
                    "{id}: a replay differs from the first answer: {:?} / {:?}",
                    (a.status, &a.run, String::from_utf8_lossy(&a.body)),
                    (
                        reference.status,
                        &reference.run,
                        String::from_utf8_lossy(&reference.body)
                    )
                ));
            }
        }
        for (kind, a) in &got {
            if *kind == JobKind::Mismatched && a.status != 422 {
                wrong.push(format!(
                    "{id}: another body with a used key answered {}, not 422",
                    a.status
                ));
            }
        }
    }
    for (id, e) in &effects {
        let ours = id.len() == 5 && id.starts_with('m') && id[1..].parse::<usize>().is_ok_and(|n| n < cfg.messages);
        if !ours && *e != 0 {
            violations.push(format!("an effect for {id}, never a payment"));
        }
    }
    for p in 0..cfg.schedule.poison {
        let id = format!("poison-{p}");
        let got = answers.get(&id).cloned().unwrap_or_default();
        let statuses: Vec<u16> = got.iter().map(|(_, a)| a.status).collect();
        if statuses.is_empty() || statuses.iter().any(|s| *s != 400) {
            wrong.push(format!("{id}: answered {statuses:?}, not 400 (kept and replayed)"));
        } else if got.iter().filter(|(_, a)| !a.replayed).count() > 1 {
            wrong.push(format!("{id}: its 400 was not replayed"));
        }
    }
    for b in 0..cfg.schedule.oversized {
        let id = format!("big-{b}");
        let statuses: Vec<u16> = answers
            .get(&id)
            .map(|got| got.iter().map(|(_, a)| a.status).collect())
            .unwrap_or_default();
        if statuses != [413] {
            wrong.push(format!("{id}: a body over the limit answered {statuses:?}, not 413"));
        }
    }
    lost.sort();
    twice.sort();
    if !lost.is_empty() {
        violations.push(format!(
            "lost: {} key(s) answered 2xx without an effect: {lost:?}",
            lost.len()
        ));
    }
    if !twice.is_empty() {
        violations.push(format!(
            "twice: {} key(s) applied more than once: {twice:?}",
            twice.len()
        ));
    }
    counts.wrong_replay = wrong.len() as u64;
    if answered_again > 0 {
        println!(
            "    {answered_again} keys answered afresh after a failover lost their completed marker (no wait_for_replicas: the README's failover table)"
        );
    }
    if !wrong.is_empty() {
        violations.push(format!("wrong answers: {wrong:?}"));
    }
    let given_up = seen.given_up.lock().unwrap().clone();
    let given_up: Vec<&String> = given_up
        .iter()
        .filter(|g| !no_effect.iter().any(|id| g.starts_with(id.as_str())))
        .collect();
    if !given_up.is_empty() {
        violations.push(format!("requests the client gave up on: {given_up:?}"));
    }
    let early = seen.early.lock().unwrap().clone();
    counts.early = early.len() as u64;
    if !early.is_empty() {
        violations.push(format!("2xx answered before the effect was committed: {early:?}"));
    }
    counts.reapplied = opened.reapplied().await;
    if counts.reapplied > 0 && !died {
        violations.push(format!(
            "a lease store's effect made {} more time(s) with no server killed",
            counts.reapplied
        ));
    }
    let non_durable = opened.non_durable_commits().await;
    counts.non_durable = non_durable.len() as u64;
    if !non_durable.is_empty() {
        violations.push(format!(
            "effects committed with synchronous_commit = off (acknowledged before durable): {non_durable:?}"
        ));
    }
    if sink.is_some() && cfg.store.transactional() {
        let mut by_id: HashMap<&str, u64> = HashMap::new();
        let mut by_payload: HashMap<String, u64> = HashMap::new();
        for (id, payload) in &sink_rows {
            *by_id.entry(id.as_str()).or_default() += 1;
            *by_payload
                .entry(String::from_utf8_lossy(payload).into_owned())
                .or_default() += 1;
        }
        counts.outbox_dupes = by_id.values().filter(|n| **n > 1).map(|n| n - 1).sum();
        let mut missing: Vec<String> = effects
            .iter()
            .filter(|(id, e)| **e > 0 && !by_payload.contains_key(*id))
            .map(|(id, _)| id.clone())
            .collect();
        let mut rolled_back: Vec<String> = by_payload
            .keys()
            .filter(|id| effects.get(*id).copied().unwrap_or(0) == 0)
            .cloned()
            .collect();
        // One message id per key: the same whichever run committed.
        let mut ids_per_payload: HashMap<String, HashSet<&str>> = HashMap::new();
        for (id, payload) in &sink_rows {
            ids_per_payload
                .entry(String::from_utf8_lossy(payload).into_owned())
                .or_default()
                .insert(id.as_str());
        }
        let mut several: Vec<String> = ids_per_payload
            .iter()
            .filter(|(_, ids)| ids.len() > 1)
            .map(|(p, _)| p.clone())
            .collect();
        missing.sort();
        rolled_back.sort();
        several.sort();
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
        if !several.is_empty() {
            violations.push(format!(
                "outbox: keys whose message arrived under several ids: {several:?}"
            ));
        }
    }
    if let Some(cached) = cache_len() {
        let committed = effects.values().filter(|n| **n > 0).count() + cfg.schedule.poison;
        if cached > committed {
            violations.push(format!("the cache holds {cached} keys, only {committed} committed"));
        }
    }

    let ctx = opened.ledger.ctx();
    let mut faults: BTreeMap<FaultKind, u64> = BTreeMap::new();
    faults.insert(FaultKind::HandlerError, ctx.fired_errors.load(Ordering::SeqCst));
    faults.insert(FaultKind::WaiterDrop, seen.dropped.load(Ordering::SeqCst));
    faults.insert(FaultKind::SlowCommit, cfg.schedule.slow_commit.len() as u64);
    faults.insert(FaultKind::Panic, ctx.fired_panics.load(Ordering::SeqCst));
    faults.insert(FaultKind::Cancel, ctx.fired_cancels.load(Ordering::SeqCst));
    faults.insert(FaultKind::Swallow, ctx.fired_swallows.load(Ordering::SeqCst));
    faults.insert(FaultKind::DataError, ctx.fired_data_errors.load(Ordering::SeqCst));
    faults.insert(FaultKind::LoneOutage, ctx.fired_outages.load(Ordering::SeqCst));
    faults.insert(FaultKind::Poison, cfg.schedule.poison as u64);
    faults.insert(FaultKind::Oversized, cfg.schedule.oversized as u64);
    faults.insert(FaultKind::Doomed, cfg.schedule.doomed.len() as u64);
    faults.insert(FaultKind::ConsumerKill, fired.server_kills);
    faults.insert(FaultKind::Failover, fired.failovers);
    faults.insert(
        FaultKind::AbortAfterCommit,
        st.aborts_after_commit.load(Ordering::SeqCst),
    );
    faults.insert(FaultKind::ConsumerSigkill, sigkills);
    faults.insert(FaultKind::DbKill, fired.db_kills);
    faults.insert(FaultKind::SettingChange, fired.setting_changes);
    faults.insert(FaultKind::BrokerRestart, fired.broker_restarts);
    faults.insert(FaultKind::DbRestart, fired.db_restarts);
    for (k, v) in relay_fired.lock().unwrap().iter() {
        faults.insert(*k, *v);
    }
    faults.retain(|_, v| *v > 0);

    drop(st);
    if let Some(sink) = sink {
        sink.teardown().await;
    }
    violations.extend(opened.teardown().await);
    private.stop().await;
    Report {
        config: cfg.clone(),
        counts,
        faults,
        violations,
        elapsed: started.elapsed(),
        sigkill_phases: if sigkills > 0 {
            BTreeMap::from([("HTTP server child, requests in flight", sigkills)])
        } else {
            BTreeMap::new()
        },
        redelivery: Vec::new(),
        settled: Vec::new(),
        not_seen_again: 0,
    }
}

// ---- the default run -----------------------------------------------------------

/// A configuration of `seed` cut to `messages` keys, on `store`.
fn shaped(seed: u64, store: StoreKind, cached: bool, messages: usize) -> Config {
    let mut cfg = Config::from_seed(seed, &[]);
    cfg.store = store;
    cfg.cached = cached;
    if !store.transactional() {
        cfg.outbox = super::config::OutboxMode::Off;
        cfg.schedule.data_error.clear();
        for faults in cfg.schedule.body.values_mut() {
            faults.retain(|f| *f != BodyFault::Swallow);
        }
    }
    let keep = |id: &String| id.as_str() < format!("m{messages:04}").as_str();
    cfg.messages = messages;
    cfg.duplicates = messages / 5;
    cfg.schedule.body.retain(|id, _| keep(id));
    cfg.schedule.doomed.retain(keep);
    cfg.schedule.data_error.retain(keep);
    cfg.schedule.lone_outage.retain(keep);
    cfg.schedule.abort_after_commit.retain(keep);
    for (at, _) in &mut cfg.schedule.timed {
        *at = (*at).min(messages as u64 * 3 / 4);
    }
    for (at, _) in &mut cfg.schedule.relay {
        *at = (*at).min(messages as u64 / 2);
    }
    // No restarts (private servers) in the default run: they cost seconds.
    cfg.schedule
        .timed
        .retain(|(_, f)| !matches!(f, TimedFault::BrokerRestart(_) | TimedFault::DbRestart(_)));
    cfg.schedule.sigkill.clear();
    cfg
}

/// The default run's HTTP configurations: PostgreSQL partitioned behind
/// the cache with the outbox, PostgreSQL plain, MariaDB, SQLite, Redis and
/// memory, each with its seed's faults (cut to 80 keys), and a server kill
/// and a database connection kill in each where the store has them; on
/// PostgreSQL a second server, in a process of its own, SIGKILLed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_combinations_keep_the_invariants() {
    if [
        "IDEMPOTENT_CHECKER",
        "IDEMPOTENT_CHECKER_SEED",
        "IDEMPOTENT_CHECKER_LIST",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|v| !v.is_empty()))
    {
        return;
    }
    super::quiet_injected_panics();
    let t = Instant::now();
    let runs = [
        (1, StoreKind::PgPartitioned, true),
        (3, StoreKind::Pg, false),
        (5, StoreKind::MariaDb, true),
        (10, StoreKind::Sqlite, false),
        (15, StoreKind::Redis, true),
        (16, StoreKind::Memory, false),
    ];
    let mut reports = Vec::new();
    for (seed, store, cached) in runs {
        let mut cfg = shaped(seed, store, cached, 80);
        if store.transactional() && cfg.sink().is_none() {
            cfg.outbox = super::config::OutboxMode::SameBroker;
        }
        cfg.schedule.timed.push((20, TimedFault::ConsumerKill));
        if store.transactional() && store != StoreKind::Sqlite {
            cfg.schedule.timed.push((40, TimedFault::DbKill));
        }
        if store.transactional() && cfg.schedule.abort_after_commit.is_empty() {
            cfg.schedule.abort_after_commit.push("m0007".into());
        }
        // A server process SIGKILLed with requests in flight, on PostgreSQL.
        if store == StoreKind::Pg {
            cfg.schedule.sigkill.push(super::config::Sigkill {
                at: 10,
                after: 4,
                phase: super::config::KillPhase::Timed(0),
            });
        }
        let report = run(&cfg, None).await;
        super::print_report(&report);
        reports.push(report);
    }
    println!(
        "HTTP checker: {} configurations in {:.1}s",
        reports.len(),
        t.elapsed().as_secs_f64()
    );
    super::assert_passed(&reports);
}

/// The HTTP checks can fire: a lost effect, a doubled one and a dropped
/// outgoing message are each reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_checker_catches_each_sabotage() {
    if [
        "IDEMPOTENT_CHECKER",
        "IDEMPOTENT_CHECKER_SEED",
        "IDEMPOTENT_CHECKER_LIST",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|v| !v.is_empty()))
    {
        return;
    }
    super::quiet_injected_panics();
    for (sabotage, want) in [
        (Sabotage::Lost, "lost:"),
        (Sabotage::Twice, "twice:"),
        (
            Sabotage::Outbox,
            "outbox: committed effects whose message never arrived",
        ),
    ] {
        let mut cfg = shaped(1, StoreKind::Pg, false, 30);
        cfg.outbox = super::config::OutboxMode::SameBroker;
        cfg.broker = super::config::BrokerKind::Rabbit;
        cfg.schedule.timed.clear();
        cfg.schedule.relay.clear();
        let report = run(&cfg, Some(sabotage)).await;
        println!("sabotage {sabotage:?} (HTTP): the violations below are expected");
        super::print_report(&report);
        assert!(
            report.violations.iter().any(|v| v.contains(want)),
            "sabotage {sabotage:?} was not caught: {:?}",
            report.violations
        );
    }
}
