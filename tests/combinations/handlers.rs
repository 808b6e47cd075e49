//! The service under test: one `#[idempotent]` handler per store type,
//! result type, fingerprint and outbox setting, behind one object-safe
//! trait so that the runner is written once.
//!
//! On a transactional store the effect is a row of an effects table written
//! in the marker's transaction (no unique constraint: a double effect shows
//! as two rows), and the injected body fault comes after it (so a rollback
//! must undo it). On Redis and the memory store, which cannot join a
//! transaction, the effect is a per-id mark made after the fault (the
//! README's "idempotent by design" effect): a field of a Redis hash
//! (`HSETNX`) with the Redis store, so that a child consumer's effects
//! count too, a map in this process with the memory store.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use idempotent_runtime::outbox::{Outbox, Outgoing};
use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::{CachedStore, MemoryStore, MySqlStore, PgStore, RedisStore, SqliteStore, idempotent};

use super::config::{BodyFault, Config, HOLD, SHORT_TTL_MS};

/// The process clock in ms since the epoch: when an effect was made.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// How much earlier than a ttl after the previous effect an effect made
/// again may come and still count as after the ttl: the stores leave a
/// claim's expiry alone when it is younger than a thousandth of the ttl
/// (at least 10 ms) at completion, and MariaDB's clock has milliseconds.
pub const EXPIRY_SLACK_MS: i64 = 100;

/// Whether an effect made `gap_ms` after the previous one of its message
/// came after that one's marker expired (`ttl_ms`): allowed, not "twice".
pub fn after_ttl(gap_ms: i64, ttl_ms: Option<u64>) -> bool {
    ttl_ms.is_some_and(|ttl| gap_ms >= ttl as i64 - EXPIRY_SLACK_MS)
}

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A message: its id is the idempotency key.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Msg {
    pub id: String,
    pub amount: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("{0}")]
    Failed(String),
    /// A dependency of this message alone is down (the checker's lone
    /// outage).
    #[error("{0}")]
    Outage(String),
}

/// The consumers' classification, as docs/brokers.md tells users to write it.
pub fn classify(error: &AppError) -> idempotent_runtime::broker::Verdict {
    use idempotent_runtime::broker::Verdict;
    match error {
        AppError::Idem(e) => e.verdict(),
        AppError::Db(e) => Verdict::of_sqlx(e),
        AppError::Failed(_) => Verdict::Retry,
        AppError::Outage(_) => Verdict::Outage,
    }
}

/// A connection to the Redis server or to the Redis Cluster (issue 30)
/// the Redis store of a configuration runs on.
#[derive(Clone)]
pub enum RedisConn {
    One(idempotent_runtime::redis::aio::ConnectionManager),
    Cluster(idempotent_runtime::redis::cluster_async::ClusterConnection),
}

impl idempotent_runtime::redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a idempotent_runtime::redis::Cmd,
    ) -> idempotent_runtime::redis::RedisFuture<'a, idempotent_runtime::redis::Value> {
        match self {
            RedisConn::One(conn) => conn.req_packed_command(cmd),
            RedisConn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a idempotent_runtime::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> idempotent_runtime::redis::RedisFuture<'a, Vec<idempotent_runtime::redis::Value>> {
        match self {
            RedisConn::One(conn) => conn.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::One(conn) => conn.get_db(),
            RedisConn::Cluster(conn) => conn.get_db(),
        }
    }
}

/// Where the Redis store's effects are recorded.
pub struct RedisEffects {
    pub conn: RedisConn,
    pub key: String,
}

impl RedisEffects {
    /// Records the effect of `id` (`HSETNX`), counting a second one in
    /// `<key>:again`. On the cluster the effect waits for a replica, and is
    /// written again (`HSETNX`: idempotent by design) while a failover is
    /// under way: a failover must not lose an effect the handler reported
    /// made, nor make the checker's own effects store fail the message (the
    /// user's effects store, not the library's markers, is what this makes
    /// durable).
    pub async fn record(&self, id: &str, ttl_ms: Option<u64>) -> Result<(), String> {
        use idempotent_runtime::redis;
        let RedisEffects { conn, key } = self;
        let mut conn = conn.clone();
        let fresh: bool = if let RedisConn::Cluster(_) = conn {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            let mut fresh = false;
            loop {
                let sent: Result<(bool, i64), _> = redis::pipe()
                    .cmd("HSETNX")
                    .arg(key)
                    .arg(id)
                    .arg(1)
                    .cmd("WAIT")
                    .arg(1)
                    .arg(500)
                    .query_async(&mut conn)
                    .await;
                match sent {
                    Ok((set, replicas)) => {
                        fresh |= set;
                        if replicas >= 1 {
                            break;
                        }
                    }
                    Err(e) if std::time::Instant::now() > deadline => {
                        return Err(format!("checker: the effect of {id}: {e}"));
                    }
                    Err(_) => {}
                }
                if std::time::Instant::now() > deadline {
                    return Err(format!("checker: the effect of {id} is not on a replica after 30 s"));
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            fresh
        } else {
            redis::cmd("HSETNX")
                .arg(key)
                .arg(id)
                .arg(1)
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("checker: the effect of {id}: {e}"))?
        };
        let at = format!("{key}:at");
        let previous: Option<i64> = if fresh {
            None
        } else {
            redis::cmd("HGET")
                .arg(&at)
                .arg(id)
                .query_async(&mut conn)
                .await
                .unwrap_or(None)
        };
        let now = now_ms();
        if fresh || previous.is_some_and(|t| after_ttl(now - t, ttl_ms)) {
            let _: Result<i64, _> = redis::cmd("HSET")
                .arg(&at)
                .arg(id)
                .arg(now)
                .query_async(&mut conn)
                .await;
        }
        if !fresh {
            let counter = if previous.is_some_and(|t| after_ttl(now - t, ttl_ms)) {
                "expired"
            } else {
                "again"
            };
            let _: Result<i64, _> = redis::cmd("INCR")
                .arg(format!("{key}:{counter}"))
                .query_async(&mut conn)
                .await;
        }
        Ok(())
    }
}

impl std::fmt::Debug for RedisEffects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RedisEffects({})", self.key)
    }
}

/// What the handlers share: the fault schedule and the in-process effects.
#[derive(Debug)]
pub struct Ctx {
    pub effects_table: String,
    /// The outbox's destination (the sink), when the outbox is on.
    pub sink: Option<String>,
    faults: Mutex<HashMap<String, VecDeque<BodyFault>>>,
    doomed: HashSet<String>,
    data_error: HashSet<String>,
    lone_outage: HashSet<String>,
    /// Outgoing messages carry an ordering key (`Config::ordered_outbox`).
    ordered: bool,
    /// Effects of the memory store, per id.
    pub mem_effects: Mutex<HashMap<String, i64>>,
    /// The Redis store's effects: a hash (`HSETNX` per id), and a counter
    /// of effects made again (key `<hash>:again`), shared with child
    /// consumers.
    pub redis_effects: OnceLock<RedisEffects>,
    /// Lease-store effects made again for an id that had one.
    pub reapplied: AtomicU64,
    /// The handlers' ttl when it is short (`Config::short_ttl`).
    pub short_ttl: Option<u64>,
    /// The memory store's effects: when each id's last one was made.
    pub mem_effect_at: Mutex<HashMap<String, i64>>,
    /// Lease-store effects made again after the previous one's ttl.
    pub expired: AtomicU64,
    pub fired_holds: AtomicU64,
    pub fired_errors: AtomicU64,
    pub fired_panics: AtomicU64,
    pub fired_cancels: AtomicU64,
    pub fired_swallows: AtomicU64,
    pub fired_after_calls: AtomicU64,
    /// Deadlocks whose victim was the body's transaction.
    pub fired_deadlocks: AtomicU64,
    /// MariaDB: what makes a body a deadlock's victim.
    pub deadlock: OnceLock<DeadlockRig>,
    pub fired_data_errors: AtomicU64,
    pub fired_outages: AtomicU64,
    /// In a child consumer (`child.rs`): its handler calls so far.
    pub child_calls: AtomicU64,
    /// In a child consumer killed mid-body: the body hangs (after its
    /// effect) once the child made this many handler calls; `u64::MAX`
    /// never.
    pub hang_body_after: AtomicU64,
    /// The child's kill point was reached (it fires once).
    pub kill_point_reached: AtomicBool,
}

impl Ctx {
    pub fn new(cfg: &Config, effects_table: String, sink: Option<String>) -> Ctx {
        Ctx {
            effects_table,
            sink,
            faults: Mutex::new(
                cfg.schedule
                    .body
                    .iter()
                    .map(|(id, f)| (id.clone(), f.iter().copied().collect()))
                    .collect(),
            ),
            doomed: cfg.schedule.doomed.iter().cloned().collect(),
            data_error: cfg.schedule.data_error.iter().cloned().collect(),
            lone_outage: cfg.schedule.lone_outage.iter().cloned().collect(),
            ordered: cfg.ordering_key("m0").is_some(),
            mem_effects: Mutex::default(),
            redis_effects: OnceLock::new(),
            reapplied: AtomicU64::new(0),
            short_ttl: cfg.short_ttl.then_some(SHORT_TTL_MS),
            mem_effect_at: Mutex::default(),
            expired: AtomicU64::new(0),
            fired_holds: AtomicU64::new(0),
            fired_errors: AtomicU64::new(0),
            fired_panics: AtomicU64::new(0),
            fired_cancels: AtomicU64::new(0),
            fired_swallows: AtomicU64::new(0),
            fired_after_calls: AtomicU64::new(0),
            fired_deadlocks: AtomicU64::new(0),
            deadlock: OnceLock::new(),
            fired_data_errors: AtomicU64::new(0),
            fired_outages: AtomicU64::new(0),
            child_calls: AtomicU64::new(0),
            hang_body_after: AtomicU64::new(u64::MAX),
            kill_point_reached: AtomicBool::new(false),
        }
    }

    /// Whether a child consumer that made `after` handler calls or more
    /// reaches its kill point now (true once).
    pub fn reach_kill_point(&self, after: u64) -> bool {
        self.child_calls.load(Ordering::SeqCst) >= after && !self.kill_point_reached.swap(true, Ordering::SeqCst)
    }

    /// In a child consumer killed mid-body: tells the parent and hangs
    /// until the SIGKILL (the body's transaction open, its effect written).
    async fn hang_mid_body(&self, id: &str) {
        let after = self.hang_body_after.load(Ordering::SeqCst);
        if after != u64::MAX && self.reach_kill_point(after) {
            super::child::kill_point("mid-body", id);
            std::future::pending::<()>().await;
        }
    }

    /// The fault of this handler call of `id`, if it has one (taken by the
    /// call, so that the caller knows whether to cancel it, whether the body
    /// then runs or not).
    pub fn take_fault(&self, id: &str) -> Option<BodyFault> {
        self.faults.lock().unwrap().get_mut(id).and_then(|q| q.pop_front())
    }

    /// The body's fault, if this run has one.
    async fn fault(&self, id: &str, fault: Option<BodyFault>) -> Result<(), AppError> {
        if self.doomed.contains(id) {
            return Err(AppError::Failed(format!("{id} is doomed")));
        }
        if self.lone_outage.contains(id) {
            self.fired_outages.fetch_add(1, Ordering::SeqCst);
            return Err(AppError::Outage(format!("checker: the dependency of {id} is down")));
        }
        match fault {
            None => Ok(()),
            Some(BodyFault::Error) => {
                self.fired_errors.fetch_add(1, Ordering::SeqCst);
                Err(AppError::Failed(format!("checker: injected error on {id}")))
            }
            Some(BodyFault::Panic) => {
                self.fired_panics.fetch_add(1, Ordering::SeqCst);
                panic!("checker: injected panic on {id}");
            }
            Some(BodyFault::Cancel) => {
                self.fired_cancels.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<()>().await;
                Ok(())
            }
            Some(BodyFault::Hold) => {
                self.fired_holds.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(HOLD).await;
                Err(AppError::Failed(format!("checker: {id} held its claim and failed")))
            }
            // Done by the transactional bodies (before this), nothing on
            // the lease stores; after the call by its caller.
            Some(BodyFault::Swallow | BodyFault::AfterCall | BodyFault::Deadlock) => Ok(()),
        }
    }

    fn stage(&self, msg: &Msg, outbox: &mut Outbox) {
        if let Some(sink) = &self.sink {
            outbox.publish(self.outgoing(sink, &msg.id));
        }
    }

    /// The outgoing message of `id` to `sink`, with its ordering key when
    /// the configuration has them.
    pub fn outgoing(&self, sink: &str, id: &str) -> Outgoing {
        let outgoing = Outgoing::new(sink.to_owned(), id.as_bytes().to_vec());
        match self
            .ordered
            .then(|| id.trim_start_matches('m').parse::<u64>().ok())
            .flatten()
        {
            Some(n) => outgoing.ordered_by(format!("k{}", n % 3)),
            None => outgoing,
        }
    }

    /// The lease stores' effect: after the fault.
    async fn mem_body(&self, msg: &Msg, ran: &AtomicBool, fault: Option<BodyFault>) -> Result<(), AppError> {
        ran.store(true, Ordering::SeqCst);
        self.fault(&msg.id, fault).await?;
        if let Some(effects) = self.redis_effects.get() {
            effects
                .record(&msg.id, self.short_ttl)
                .await
                .map_err(AppError::Failed)?;
            // A child killed mid-body: the effect made, the lease held.
            self.hang_mid_body(&msg.id).await;
            return Ok(());
        }
        let mut effects = self.mem_effects.lock().unwrap();
        let mut at = self.mem_effect_at.lock().unwrap();
        let n = effects.entry(msg.id.clone()).or_default();
        let now = now_ms();
        let previous = at.get(&msg.id).copied();
        if *n == 0 {
            *n = 1;
            at.insert(msg.id.clone(), now);
        } else if previous.is_some_and(|t| after_ttl(now - t, self.short_ttl)) {
            self.expired.fetch_add(1, Ordering::SeqCst);
            at.insert(msg.id.clone(), now);
        } else {
            self.reapplied.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// MariaDB: a second session that takes a body's rows in the opposite
/// order, in a transaction heavier than the body's (InnoDB rolls back the
/// transaction that changed fewer rows).
#[derive(Clone, Debug)]
pub struct DeadlockRig {
    pub pool: sqlx::MySqlPool,
    /// `k VARCHAR PRIMARY KEY`: the two rows of each message.
    pub locks: String,
    /// Rows the adversary inserts to weigh more than the body.
    pub heavy: String,
}

impl DeadlockRig {
    /// The two rows of `id`, made to exist (autocommit).
    async fn prepare(&self, id: &str) -> (String, String) {
        let (a, b) = (format!("{id}:a"), format!("{id}:b"));
        sqlx::query(AssertSqlSafe(format!(
            "INSERT IGNORE INTO {} (k) VALUES (?), (?)",
            self.locks
        )))
        .bind(&a)
        .bind(&b)
        .execute(&self.pool)
        .await
        .expect("the deadlock's rows");
        (a, b)
    }

    /// Locks `b` (says so on `locked`), then asks for `a`, which the body
    /// holds; rolls back once it has it or was the victim itself.
    async fn adversary(self, a: String, b: String, locked: tokio::sync::oneshot::Sender<()>) {
        let Ok(mut conn) = self.pool.acquire().await else {
            return;
        };
        let lock = |k: String| {
            let sql = AssertSqlSafe(format!("SELECT k FROM {} WHERE k = ? FOR UPDATE", self.locks));
            sqlx::query(sql).bind(k)
        };
        let _ = sqlx::query("BEGIN").execute(&mut *conn).await;
        let values = vec!["(1)"; 40].join(", ");
        let _ = sqlx::query(AssertSqlSafe(format!("INSERT INTO {} (n) VALUES {values}", self.heavy)))
            .execute(&mut *conn)
            .await;
        let _ = lock(b).fetch_all(&mut *conn).await;
        let _ = locked.send(());
        let _ = lock(a).fetch_all(&mut *conn).await;
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
    }
}

/// The handler, whatever the store: `Ok(Some(amount))` when the handler
/// returns a value, `Ok(None)` for `()`. `ran` is set when the body ran.
pub trait Ledger: Send + Sync + 'static {
    fn apply<'a>(
        &'a self,
        msg: &'a Msg,
        ran: &'a AtomicBool,
        fault: Option<BodyFault>,
    ) -> BoxFut<'a, Result<Option<i64>, AppError>>;
    fn ctx(&self) -> &Arc<Ctx>;
    /// Entries in the cache, when there is one.
    fn cached(&self) -> Option<usize>;
}

/// Which handler variant a ledger calls.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    pub fingerprint: bool,
    pub value: bool,
    pub outbox: bool,
    /// The handlers with a ttl of `SHORT_TTL_MS` (`Config::short_ttl`).
    pub short: bool,
}

/// The transactional store's handlers (unit or value, with a fingerprint or
/// not, with the outbox or not) under the names given; `$extra` is added to
/// each attribute (`, ttl = "2s"` for the short-ttl ones).
macro_rules! tx_handlers {
    ($conn:ty, $u:ident, $uf:ident, $v:ident, $vf:ident, $uo:ident, $ufo:ident, $vo:ident, $vfo:ident; $($extra:tt)*) => {
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.u" $($extra)*)]
        async fn $u(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
        ) -> Result<(), AppError> {
            self.body(msg, ran, fault, tx, None).await
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.uf" $($extra)*, fingerprint = "msg")]
        async fn $uf(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
        ) -> Result<(), AppError> {
            self.body(msg, ran, fault, tx, None).await
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.v" $($extra)*)]
        async fn $v(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
        ) -> Result<i64, AppError> {
            self.body(msg, ran, fault, tx, None).await.map(|()| msg.amount)
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.vf" $($extra)*, fingerprint = "msg")]
        async fn $vf(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
        ) -> Result<i64, AppError> {
            self.body(msg, ran, fault, tx, None).await.map(|()| msg.amount)
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.uo" $($extra)*)]
        async fn $uo(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
            outbox: &mut Outbox,
        ) -> Result<(), AppError> {
            self.body(msg, ran, fault, tx, Some(outbox)).await
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.ufo" $($extra)*, fingerprint = "msg")]
        async fn $ufo(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
            outbox: &mut Outbox,
        ) -> Result<(), AppError> {
            self.body(msg, ran, fault, tx, Some(outbox)).await
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.vo" $($extra)*)]
        async fn $vo(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
            outbox: &mut Outbox,
        ) -> Result<i64, AppError> {
            self.body(msg, ran, fault, tx, Some(outbox))
                .await
                .map(|()| msg.amount)
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.vfo" $($extra)*, fingerprint = "msg")]
        async fn $vfo(
            &self,
            msg: &Msg,
            ran: &AtomicBool,
            fault: Option<BodyFault>,
            tx: &mut $conn,
            outbox: &mut Outbox,
        ) -> Result<i64, AppError> {
            self.body(msg, ran, fault, tx, Some(outbox))
                .await
                .map(|()| msg.amount)
        }
    };
}

macro_rules! tx_ledger {
    ($name:ident, $store:ty, $conn:ty, $ph:literal, $ph2:literal) => {
        pub struct $name {
            pub store: $store,
            pub ctx: Arc<Ctx>,
            pub variant: Variant,
        }

        impl $name {
            async fn body(
                &self,
                msg: &Msg,
                ran: &AtomicBool,
                fault: Option<BodyFault>,
                tx: &mut $conn,
                outbox: Option<&mut Outbox>,
            ) -> Result<(), AppError> {
                ran.store(true, Ordering::SeqCst);
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {} (message_id, at_ms) VALUES ({}, {})",
                    self.ctx.effects_table, $ph, $ph2
                )))
                .bind(&msg.id)
                .bind(now_ms())
                .execute(&mut *tx)
                .await?;
                if let Some(outbox) = outbox {
                    self.ctx.stage(msg, outbox);
                }
                self.ctx.hang_mid_body(&msg.id).await;
                if fault == Some(BodyFault::Deadlock)
                    && let Some(rig) = self.ctx.deadlock.get()
                {
                    let (a, b) = rig.prepare(&msg.id).await;
                    let lock = format!("SELECT k FROM {} WHERE k = {} FOR UPDATE", rig.locks, $ph);
                    sqlx::query(AssertSqlSafe(lock.clone()))
                        .bind(&a)
                        .fetch_all(&mut *tx)
                        .await?;
                    let (locked, has_locked) = tokio::sync::oneshot::channel();
                    let adversary = tokio::spawn(rig.clone().adversary(a, b.clone(), locked));
                    let _ = has_locked.await;
                    // A cycle: InnoDB rolls back the lighter transaction,
                    // the body's (its marker, its effect); the body swallows
                    // the error and goes on as if it had its row.
                    if sqlx::query(AssertSqlSafe(lock))
                        .bind(&b)
                        .fetch_all(&mut *tx)
                        .await
                        .is_err()
                    {
                        self.ctx.fired_deadlocks.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = adversary.await;
                }
                if fault == Some(BodyFault::Swallow) {
                    self.ctx.fired_swallows.fetch_add(1, Ordering::SeqCst);
                    // Fails on every database; aborts a PostgreSQL transaction.
                    let swallowed = sqlx::query("INSERT INTO idempotent_checker_no_such_table VALUES (1)")
                        .execute(&mut *tx)
                        .await;
                    assert!(swallowed.is_err(), "the swallowed statement must fail");
                }
                if self.ctx.data_error.contains(&msg.id) {
                    self.ctx.fired_data_errors.fetch_add(1, Ordering::SeqCst);
                    // A NULL in a NOT NULL column: refused on every database,
                    // after the effect (which the rollback must undo).
                    sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO {} (message_id) VALUES (NULL)",
                        self.ctx.effects_table
                    )))
                    .execute(&mut *tx)
                    .await?;
                }
                self.ctx.fault(&msg.id, fault).await
            }

            tx_handlers!($conn, u, uf, v, vf, uo, ufo, vo, vfo;);
            tx_handlers!($conn, u_s, uf_s, v_s, vf_s, uo_s, ufo_s, vo_s, vfo_s; , ttl = "2s");
        }

        impl Ledger for $name {
            fn apply<'a>(
                &'a self,
                msg: &'a Msg,
                ran: &'a AtomicBool,
                fault: Option<BodyFault>,
            ) -> BoxFut<'a, Result<Option<i64>, AppError>> {
                let Variant {
                    fingerprint,
                    value,
                    outbox,
                    short,
                } = self.variant;
                match (value, fingerprint, outbox, short) {
                    (false, false, false, false) => {
                        Box::pin(async move { self.u(msg, ran, fault).await.map(|()| None) })
                    }
                    (false, true, false, false) => {
                        Box::pin(async move { self.uf(msg, ran, fault).await.map(|()| None) })
                    }
                    (true, false, false, false) => Box::pin(async move { self.v(msg, ran, fault).await.map(Some) }),
                    (true, true, false, false) => Box::pin(async move { self.vf(msg, ran, fault).await.map(Some) }),
                    (false, false, true, false) => {
                        Box::pin(async move { self.uo(msg, ran, fault).await.map(|()| None) })
                    }
                    (false, true, true, false) => {
                        Box::pin(async move { self.ufo(msg, ran, fault).await.map(|()| None) })
                    }
                    (true, false, true, false) => Box::pin(async move { self.vo(msg, ran, fault).await.map(Some) }),
                    (true, true, true, false) => Box::pin(async move { self.vfo(msg, ran, fault).await.map(Some) }),
                    (false, false, false, true) => {
                        Box::pin(async move { self.u_s(msg, ran, fault).await.map(|()| None) })
                    }
                    (false, true, false, true) => {
                        Box::pin(async move { self.uf_s(msg, ran, fault).await.map(|()| None) })
                    }
                    (true, false, false, true) => Box::pin(async move { self.v_s(msg, ran, fault).await.map(Some) }),
                    (true, true, false, true) => Box::pin(async move { self.vf_s(msg, ran, fault).await.map(Some) }),
                    (false, false, true, true) => {
                        Box::pin(async move { self.uo_s(msg, ran, fault).await.map(|()| None) })
                    }
                    (false, true, true, true) => {
                        Box::pin(async move { self.ufo_s(msg, ran, fault).await.map(|()| None) })
                    }
                    (true, false, true, true) => Box::pin(async move { self.vo_s(msg, ran, fault).await.map(Some) }),
                    (true, true, true, true) => Box::pin(async move { self.vfo_s(msg, ran, fault).await.map(Some) }),
                }
            }
            fn ctx(&self) -> &Arc<Ctx> {
                &self.ctx
            }
            fn cached(&self) -> Option<usize> {
                cached_len(&self.store)
            }
        }
    };
}

/// The lease stores' handlers (unit or value, with a fingerprint or not)
/// under the names given; `$extra` is added to each attribute.
macro_rules! lease_handlers {
    ($u:ident, $uf:ident, $v:ident, $vf:ident; $($extra:tt)*) => {
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.u", lease = "3s" $($extra)*)]
        async fn $u(&self, msg: &Msg, ran: &AtomicBool, fault: Option<BodyFault>) -> Result<(), AppError> {
            self.ctx.mem_body(msg, ran, fault).await
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.uf", lease = "3s" $($extra)*, fingerprint = "msg")]
        async fn $uf(&self, msg: &Msg, ran: &AtomicBool, fault: Option<BodyFault>) -> Result<(), AppError> {
            self.ctx.mem_body(msg, ran, fault).await
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.v", lease = "3s" $($extra)*)]
        async fn $v(&self, msg: &Msg, ran: &AtomicBool, fault: Option<BodyFault>) -> Result<i64, AppError> {
            self.ctx.mem_body(msg, ran, fault).await.map(|()| msg.amount)
        }
        #[idempotent(key = "msg.id", store = self.store, scope = "checker.vf", lease = "3s" $($extra)*, fingerprint = "msg")]
        async fn $vf(&self, msg: &Msg, ran: &AtomicBool, fault: Option<BodyFault>) -> Result<i64, AppError> {
            self.ctx.mem_body(msg, ran, fault).await.map(|()| msg.amount)
        }
    };
}

macro_rules! lease_ledger {
    ($name:ident, $store:ty) => {
        pub struct $name {
            pub store: $store,
            pub ctx: Arc<Ctx>,
            pub variant: Variant,
        }

        impl $name {
            lease_handlers!(u, uf, v, vf;);
            lease_handlers!(u_s, uf_s, v_s, vf_s; , ttl = "2s");
        }

        impl Ledger for $name {
            fn apply<'a>(
                &'a self,
                msg: &'a Msg,
                ran: &'a AtomicBool,
                fault: Option<BodyFault>,
            ) -> BoxFut<'a, Result<Option<i64>, AppError>> {
                match (self.variant.value, self.variant.fingerprint, self.variant.short) {
                    (false, false, false) => Box::pin(async move { self.u(msg, ran, fault).await.map(|()| None) }),
                    (false, true, false) => Box::pin(async move { self.uf(msg, ran, fault).await.map(|()| None) }),
                    (true, false, false) => Box::pin(async move { self.v(msg, ran, fault).await.map(Some) }),
                    (true, true, false) => Box::pin(async move { self.vf(msg, ran, fault).await.map(Some) }),
                    (false, false, true) => Box::pin(async move { self.u_s(msg, ran, fault).await.map(|()| None) }),
                    (false, true, true) => Box::pin(async move { self.uf_s(msg, ran, fault).await.map(|()| None) }),
                    (true, false, true) => Box::pin(async move { self.v_s(msg, ran, fault).await.map(Some) }),
                    (true, true, true) => Box::pin(async move { self.vf_s(msg, ran, fault).await.map(Some) }),
                }
            }
            fn ctx(&self) -> &Arc<Ctx> {
                &self.ctx
            }
            fn cached(&self) -> Option<usize> {
                cached_len(&self.store)
            }
        }
    };
}

/// The cache's size, for a `CachedStore`.
trait MaybeCached {
    fn cached_len(&self) -> Option<usize>;
}

impl<S> MaybeCached for CachedStore<S> {
    fn cached_len(&self) -> Option<usize> {
        Some(self.len())
    }
}

macro_rules! not_cached {
    ($($t:ty),*) => {
        $(impl MaybeCached for $t {
            fn cached_len(&self) -> Option<usize> {
                None
            }
        })*
    };
}

not_cached!(PgStore, MySqlStore, SqliteStore, RedisStore, MemoryStore);

fn cached_len<S: MaybeCached>(store: &S) -> Option<usize> {
    store.cached_len()
}

tx_ledger!(PgLedger, PgStore, sqlx::PgConnection, "$1", "$2");
tx_ledger!(PgCachedLedger, CachedStore<PgStore>, sqlx::PgConnection, "$1", "$2");
tx_ledger!(MyLedger, MySqlStore, sqlx::MySqlConnection, "?", "?");
tx_ledger!(MyCachedLedger, CachedStore<MySqlStore>, sqlx::MySqlConnection, "?", "?");
tx_ledger!(LiteLedger, SqliteStore, sqlx::SqliteConnection, "?", "?");
tx_ledger!(
    LiteCachedLedger,
    CachedStore<SqliteStore>,
    sqlx::SqliteConnection,
    "?",
    "?"
);
lease_ledger!(RedisLedger, RedisStore);
lease_ledger!(RedisCachedLedger, CachedStore<RedisStore>);
lease_ledger!(MemLedger, MemoryStore);
lease_ledger!(MemCachedLedger, CachedStore<MemoryStore>);
