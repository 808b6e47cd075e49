//! `RedisStore`: a lease store on Redis, for high throughput when the effect
//! does not need to be atomic with the marker.
//!
//! A claim is one atomic `SET key <lease> NX PX <lease> GET` (Redis ≥ 7.0;
//! on older servers the same in a small Lua script), which also returns the
//! existing value when the key is taken, holding a lease with a random
//! fencing token. While the body runs the lease is
//! renewed; completion replaces the lease by the completed marker only if
//! the token still matches (one `SET key marker IFEQ lease PX ttl` on
//! Valkey ≥ 8.1 and Redis ≥ 8.4, a small Lua script on older servers), and
//! failure deletes the lease under the same condition, so a consumer whose
//! lease expired and was taken over can never overwrite or delete the new
//! owner's state.
//!
//! # Encoding
//!
//! The Redis key of `(scope, key)` is `{prefix}{len(scope)}:{scope}:{key}`,
//! where `len(scope)` is the scope's length in bytes written in decimal: the
//! length says where the scope ends, so no two different pairs share a key
//! whatever characters they contain.
//!
//! The value is tagged by its first byte:
//!
//! - `L{token}`: a live lease; `token` is 32 random hex digits.
//! - `D@{token}{fingerprint}{result}`: a completed marker; `token` is the
//!   token of the lease it replaced (so a completion sent again by the
//!   connection is recognised by its token, never by equal bytes of
//!   another claim's marker); `fingerprint` is `-` when the handler has
//!   none, else `{len}:{text}` (`len` in bytes, decimal); `result` is
//!   empty for JSON `null` (what `()` returns), else `={text}`. Markers
//!   written before the token was added (`D{fingerprint}{result}`) are
//!   still read.
//!
//! Keys and values travel as command arguments or script `KEYS`/`ARGV`,
//! never spliced into commands or scripts.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::aio::ConnectionManager;

use crate::Error;
use crate::store::redis_conn::{Lua, RedisConn, Replicas, Sent};
use crate::store::redis_renewal::{Renewal, Renewer};
use crate::store::{Claim, Guard, Replay, Request, Store};

/// The key prefix of [`RedisStore::new`].
const DEFAULT_PREFIX: &str = "idempotent:";

/// The longest key prefix [`RedisStoreBuilder::build`] accepts, in bytes.
const MAX_PREFIX_BYTES: usize = 128;

/// Sets the lease if the key is free; otherwise returns the current value.
/// ARGV: lease value, lease ms. Returns nil when claimed. For servers older
/// than 7.0, which refuse `SET .. NX .. GET`.
static CLAIM: Lua = Lua::new(
    r"if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
return redis.call('GET', KEYS[1])",
);

/// Replaces the lease by the completed marker if the token still matches.
/// ARGV: lease value, marker value, ttl ms. For servers without `SET ..
/// IFEQ` (before Valkey 8.1 and Redis 8.4).
static COMPLETE: Lua = Lua::new(
    r"if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0",
);

/// Deletes the lease if the token still matches. ARGV: lease value.
static RELEASE: Lua = Lua::new(
    r"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0",
);

/// Writes a value (a completed marker, or a lease) again, unchanged and
/// with its expiry, if it is still the key's value, so that a `WAIT` after
/// it tells whether the replicas have it (they receive writes in order).
/// ARGV: the value. Only with [`RedisStoreBuilder::wait_for_replicas`]:
/// before a replay, and after a claim or a completion the connection
/// retried.
static CONFIRM: Lua = Lua::new(
    r"if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL') return 1 end
return 0",
);

/// A store on Redis: markers are keys under a prefix, claims are leases.
///
/// A claim holds a lease (the handler's `lease`, default
/// [`DEFAULT_LEASE`](crate::DEFAULT_LEASE)) that is extended while the body
/// runs, between one and two thirds into its length, by one background task
/// per store (shared by its clones). A concurrent duplicate gets
/// [`Error::InProgress`]; a completed key replays the stored result for the
/// handler's `ttl`, after which Redis expires the marker by itself. When
/// the body fails, panics or is cancelled the lease is released at once;
/// when the process crashes the lease expires and the message can be
/// processed again.
///
/// Redis cannot join the database transaction of the effect: an effect that
/// succeeded before a crash (or before the lease was lost) is run again by
/// the redelivery. Make effects idempotent by design with this store.
///
/// Cloning is cheap: clones share the connection manager.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotent_runtime::{RedisStore, redis};
///
/// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
/// let store = RedisStore::builder(client.get_connection_manager().await?)
///     .prefix("payments:idempotent:")
///     .build()?;
/// # Ok(()) }
/// ```
///
/// # Redis Cluster
///
/// [`RedisStore::cluster`] (feature `redis-cluster`) runs the same commands
/// on a cluster connection, which sends each to the primary of its key's
/// hash slot and follows `MOVED` and `ASK` redirections (resharding, slot
/// migrations, failovers). A claim touches one key from its start to its
/// end (lease, renewals, completion or release), so every step of it lives
/// in one slot without hash tags, and the key layout is the single
/// server's: markers spread over the slots by their key. A prefix holding a
/// hash tag (`{payments}:`) would put every marker of the store in one slot,
/// on one primary.
///
/// # Replicas
///
/// Replication is asynchronous: a lease or a completed marker a primary
/// acknowledged and had not yet sent to its replicas is gone after a
/// failover. With [`RedisStoreBuilder::wait_for_replicas`], the claim, the
/// completion and the lease renewals are each followed by `WAIT` on the
/// same connection, and a claim or a completion that fewer replicas
/// acknowledge than asked fails with [`NotReplicated`] instead of
/// reporting success.
#[derive(Clone)]
pub struct RedisStore {
    conn: RedisConn,
    /// Replicas that must acknowledge claims and completions.
    wait: Option<Replicas>,
    prefix: Arc<str>,
    namespace: &'static str,
    /// Extends the leases of running claims (`None`: renewal off).
    renewer: Option<Arc<Renewer>>,
    /// The server's settings were checked (on the first claim).
    checked: Arc<tokio::sync::OnceCell<()>>,
    /// The server refused `SET .. NX .. GET` (Redis < 7.0): claims use the
    /// Lua script instead.
    scripted_claim: Arc<AtomicBool>,
    /// The server refused `SET .. IFEQ` (before Valkey 8.1 and Redis 8.4):
    /// completions use the Lua script instead.
    scripted_completion: Arc<AtomicBool>,
}

fn namespace(prefix: &str) -> &'static str {
    crate::scope::intern_namespace(format!("redis:{prefix}"))
}

impl RedisStore {
    /// A store on `conn` with the key prefix `idempotent:`.
    pub fn new(conn: ConnectionManager) -> Self {
        RedisStore::builder(conn).assemble(DEFAULT_PREFIX)
    }

    /// A store on a Redis Cluster with the key prefix `idempotent:`; see
    /// [above](RedisStore#redis-cluster). Feature
    /// `redis-cluster`.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use idempotent_runtime::{RedisStore, redis};
    ///
    /// let nodes = ["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/", "redis://10.0.0.3:6379/"];
    /// let client = redis::cluster::ClusterClient::new(nodes)?;
    /// let store = RedisStore::cluster_builder(client.get_async_connection().await?)
    ///     .prefix("payments:idempotent:")
    ///     .wait_for_replicas(1, Duration::from_millis(500))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis-cluster")]
    pub fn cluster(conn: redis::cluster_async::ClusterConnection) -> Self {
        RedisStore::cluster_builder(conn).assemble(DEFAULT_PREFIX)
    }

    /// A builder of a store on a Redis Cluster. Feature `redis-cluster`.
    #[cfg(feature = "redis-cluster")]
    pub fn cluster_builder(conn: redis::cluster_async::ClusterConnection) -> RedisStoreBuilder {
        RedisStoreBuilder::on(RedisConn::Cluster(conn))
    }

    /// A builder to set the key prefix.
    pub fn builder(conn: ConnectionManager) -> RedisStoreBuilder {
        RedisStoreBuilder::on(RedisConn::Manager(conn))
    }

    /// The prefix of every key this store writes.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key holding the marker or lease of `(scope, key)`:
    /// `{prefix}{len(scope)}:{scope}:{key}`.
    pub fn redis_key(&self, scope: &str, key: &str) -> String {
        format!("{}{}:{scope}:{key}", self.prefix, scope.len())
    }
}

impl RedisStoreBuilder {
    fn on(conn: RedisConn) -> RedisStoreBuilder {
        RedisStoreBuilder {
            conn,
            prefix: DEFAULT_PREFIX.to_owned(),
            renew: true,
            wait: None,
        }
    }

    /// The store under a valid `prefix`.
    fn assemble(self, prefix: &str) -> RedisStore {
        let conn = self.conn;
        RedisStore {
            renewer: self.renew.then(|| Renewer::new(conn.clone(), self.wait)),
            conn,
            wait: self.wait,
            prefix: Arc::from(prefix),
            namespace: namespace(prefix),
            checked: Arc::default(),
            scripted_claim: Arc::default(),
            scripted_completion: Arc::default(),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("renew", &self.renewer.is_some())
            .field("wait_for_replicas", &self.wait)
            .finish()
    }
}

/// Configures a [`RedisStore`].
#[derive(Clone)]
pub struct RedisStoreBuilder {
    conn: RedisConn,
    prefix: String,
    renew: bool,
    wait: Option<Replicas>,
}

impl RedisStoreBuilder {
    /// Sets the prefix of every key the store writes (default
    /// `idempotent:`): 1 to 128 bytes, no whitespace or control characters.
    ///
    /// Stores sharing one Redis database should use prefixes of which none
    /// starts another (`orders:` and `payments:`, not `idem` and `idem1`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Whether leases are renewed while the body runs (default `true`).
    ///
    /// Meant for tests that force a lease to expire mid-body or simulate a
    /// crashed consumer: without renewal a body that runs longer than its
    /// lease loses its claim to the next consumer, and its completion then
    /// fails.
    pub fn renew(mut self, renew: bool) -> Self {
        self.renew = renew;
        self
    }

    /// Waits, after each claim, completion and lease renewal, until
    /// `replicas` replicas of the key's server (in a cluster: of its slot's
    /// primary) acknowledge it, at most `timeout` (`WAIT replicas timeout`
    /// on the same connection, in one round trip with the write). Off by
    /// default.
    ///
    /// Replication is asynchronous: without this, a failover can lose a
    /// lease (another consumer then runs the body while the first still
    /// does) or a completed marker (a later duplicate runs the body again).
    /// With it:
    ///
    /// - a claim that fewer replicas acknowledge is released and fails with
    ///   [`Error::Store`] holding a [`NotReplicated`]; the body does not run
    ///   (the message is redelivered later);
    /// - a completion that fewer replicas acknowledge fails the same way:
    ///   the marker is on the primary but not known to be on a replica, so
    ///   the message must not be acknowledged; its redelivery replays the
    ///   marker if it survived, and runs the body again if a failover lost
    ///   it (as after a crash between the body and the completion);
    /// - a completed marker found by a claim is written again unchanged and
    ///   waited for before it is replayed, so that no duplicate is
    ///   acknowledged on the strength of a marker the replicas may not have;
    /// - a renewal that fewer replicas acknowledge is logged and retried at
    ///   the next renewal.
    ///
    /// What a claim or a completion reported as done is then on `replicas`
    /// replicas, and survives the failover to one of them. `replicas`
    /// should be the number of replicas of each primary (a failover may
    /// promote any of them); a primary with fewer reachable replicas fails
    /// every claim until they are back. Each claim and completion waits for
    /// a replica's acknowledgement: one round trip between the primary and
    /// a replica more (see the README's Redis Cluster section for the
    /// measured cost).
    ///
    /// `replicas` must be at least 1 and `timeout` at least a millisecond.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some(Replicas {
            count: replicas,
            timeout,
        });
        self
    }

    /// The store, or [`Error::Config`] for an invalid prefix or
    /// [`wait_for_replicas`](Self::wait_for_replicas) setting.
    pub fn build(self) -> Result<RedisStore, Error> {
        if let Some(wait) = self.wait
            && (wait.count == 0 || wait.timeout < Duration::from_millis(1))
        {
            return Err(Error::Config(format!(
                "wait_for_replicas({}, {:?}): wait for at least 1 replica and at least 1ms",
                wait.count, wait.timeout
            )));
        }
        let prefix = self.prefix.clone();
        if prefix.is_empty() || prefix.len() > MAX_PREFIX_BYTES {
            return Err(Error::Config(format!(
                "Redis key prefix {prefix:?} must be 1 to {MAX_PREFIX_BYTES} bytes long"
            )));
        }
        if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(Error::Config(format!(
                "Redis key prefix {prefix:?} must not contain whitespace or control characters"
            )));
        }
        Ok(self.assemble(&prefix))
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("renew", &self.renew)
            .field("wait_for_replicas", &self.wait)
            .finish()
    }
}

impl Store for RedisStore {
    type Guard = RedisGuard;

    /// `redis:{prefix}`: the connection manager does not tell which server
    /// it talks to, so two stores with one prefix count as one.
    fn namespace(&self) -> Option<&'static str> {
        Some(self.namespace)
    }

    async fn claim(&self, req: &Request<'_>) -> Result<Claim<RedisGuard>, Error> {
        self.checked.get_or_init(|| warn_about_server(self.conn.clone())).await;
        let key = self.redis_key(req.scope(), req.key());
        let lease = new_lease();
        let lease_ms = req.lease_millis();
        let mut conn = self.conn.clone();
        let sent = self.set_lease(&mut conn, &key, &lease, lease_ms).await?;
        let mut claimed = sent.replicated(self.wait);
        let current: Option<Vec<u8>> = sent_reply(sent)?;
        // Our own lease: the connection sent the claim again after losing
        // the reply to the first one (a cluster connection retries, after a
        // broken connection or a redirection). The write that set it was the
        // first attempt's, maybe on a connection since lost: the `WAIT` of
        // the retry, on this connection, does not cover it. Written again,
        // unchanged, so that a `WAIT` does.
        let retried = current.as_deref() == Some(lease.as_bytes());
        let current = current.filter(|_| !retried);
        if retried && self.wait.is_some() {
            let (unchanged, replicated) = rewrite(&mut conn, &key, lease.as_bytes(), self.wait).await?;
            if !unchanged {
                // Gone between the two commands (expired, or a failover
                // lost it): nothing is held, the message comes back.
                return Err(Error::Store(
                    format!("the Redis lease on {key:?} was lost while its claim was retried").into(),
                ));
            }
            claimed = replicated;
        }
        let Some(current) = current else {
            if !claimed {
                // Not on enough replicas: a failover could lose it while the
                // body runs. Released; the message is processed later.
                if let Err(error) = release(&mut conn, &key, &lease).await {
                    tracing::warn!(target: "idempotent", %key, %error, "releasing the Redis lease failed; it will expire");
                }
                return Err(not_replicated(&key, "claim", self.wait));
            }
            let renewal = self
                .renewer
                .as_ref()
                .and_then(|renewer| renewer.register(&key, &lease, lease_ms));
            return Ok(Claim::Fresh(RedisGuard {
                conn,
                wait: self.wait,
                key,
                lease,
                ttl_ms: req.ttl_millis(),
                fingerprint: req.fingerprint().map(|f| f.as_str().to_owned()),
                scripted_completion: Arc::clone(&self.scripted_completion),
                renewal,
                open: true,
            }));
        };
        match current.first() {
            Some(b'L') => Err(req.in_progress()),
            Some(b'D') => {
                self.confirm_marker(&mut conn, &key, &current, req).await?;
                // A `()` handler without fingerprint replays `()` whatever
                // the marker holds: nothing to decode.
                if !req.needs_read() {
                    return Ok(Claim::Done(Replay::default()));
                }
                let (fingerprint, result) = std::str::from_utf8(&current[1..])
                    .ok()
                    .and_then(decode_done)
                    .ok_or_else(|| unrecognised(&key))?;
                req.check_fingerprint(fingerprint)?;
                Ok(Claim::Done(Replay::new(result.map(str::to_owned))))
            }
            _ => Err(unrecognised(&key)),
        }
    }
}

/// The reply of `sent` as `T`, or the store error.
fn sent_reply<T: redis::FromRedisValue>(sent: Sent) -> Result<T, Error> {
    sent.parse().map_err(Error::store)
}

impl RedisStore {
    /// Sets the lease on `key` unless it exists; the reply is `nil` when
    /// set, else the current value. One native command (`SET key lease NX
    /// PX ms GET`, Redis ≥ 7.0), or the `CLAIM` script on a server that
    /// refuses it; followed by `WAIT` with
    /// [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas).
    async fn set_lease(&self, conn: &mut RedisConn, key: &str, lease: &str, lease_ms: i64) -> Result<Sent, Error> {
        if !self.scripted_claim.load(Ordering::Relaxed) {
            let mut set = redis::cmd("SET");
            set.arg(key).arg(lease).arg("NX").arg("PX").arg(lease_ms).arg("GET");
            let sent = conn.send(&set, self.wait).await.map_err(Error::store)?;
            match &sent.reply {
                Err(error) if refuses_syntax(error) => {
                    tracing::debug!(target: "idempotent", %error, "SET NX GET refused (Redis < 7.0): claiming with a script");
                    self.scripted_claim.store(true, Ordering::Relaxed);
                }
                _ => return Ok(sent),
            }
        }
        CLAIM
            .key(key)
            .arg(lease)
            .arg(lease_ms)
            .send(conn, self.wait)
            .await
            .map_err(Error::store)
    }

    /// With [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas):
    /// makes sure the completed `marker` found on `key` is on the replicas
    /// before it is replayed (it may be a completion still waiting for
    /// them, or one a failover is about to lose), by writing it again
    /// unchanged and waiting for that write. Nothing to do without the
    /// option.
    async fn confirm_marker(
        &self,
        conn: &mut RedisConn,
        key: &str,
        marker: &[u8],
        req: &Request<'_>,
    ) -> Result<(), Error> {
        if self.wait.is_none() {
            return Ok(());
        }
        let (unchanged, replicated) = rewrite(conn, key, marker, self.wait).await?;
        if !unchanged {
            // It expired or was replaced meanwhile: the message is being
            // processed again.
            return Err(req.in_progress());
        }
        if !replicated {
            return Err(not_replicated(key, "completed marker", self.wait));
        }
        Ok(())
    }
}

/// Writes `value` again on `key`, unchanged and with its expiry, if it is
/// still the key's value (the `CONFIRM` script), followed by `WAIT` with
/// `wait`: whether it was unchanged, and whether enough replicas
/// acknowledged the write (they receive writes in order, so they then hold
/// the value). What makes a `WAIT` cover a value this connection did not
/// write itself: a marker found by a claim, or a lease or a marker whose
/// first write was sent by an attempt the connection retried.
async fn rewrite(conn: &mut RedisConn, key: &str, value: &[u8], wait: Option<Replicas>) -> Result<(bool, bool), Error> {
    let sent = CONFIRM
        .key(key)
        .arg(value)
        .send(conn, wait)
        .await
        .map_err(Error::store)?;
    let replicated = sent.replicated(wait);
    let unchanged: i64 = sent_reply(sent)?;
    Ok((unchanged == 1, replicated))
}

/// The error of a write fewer replicas acknowledged than `wait` asks for.
fn not_replicated(key: &str, what: &'static str, wait: Option<Replicas>) -> Error {
    let (required, timeout) = wait.map_or((0, Duration::ZERO), |wait| (wait.count, wait.timeout));
    Error::Store(Box::new(NotReplicated {
        key: key.to_owned(),
        what,
        required,
        timeout,
    }))
}

/// A claim or a completion of a [`RedisStore`] with
/// [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas) that fewer
/// replicas acknowledged in time than asked: it failed (inside
/// [`Error::Store`]) rather than risk being lost by a failover. A claim
/// was released and its body did not run; a completion's marker stays on
/// the primary, and the message must be processed again (the redelivery
/// replays the marker once the replicas have it, or runs the body again
/// if a failover lost it).
#[derive(Debug, thiserror::Error)]
#[error(
    "the Redis {what} on {key:?} was not acknowledged by {required} replica(s) within {timeout:?}: \
     a failover could lose it"
)]
pub struct NotReplicated {
    /// The Redis key.
    pub key: String,
    /// What was written: `claim`, `completion` or `completed marker` (a
    /// marker found by a claim, written again before its replay).
    pub what: &'static str,
    /// How many replicas had to acknowledge it.
    pub required: u32,
    /// How long the store waited for them.
    pub timeout: Duration,
}

/// The error of a server that does not know a `SET` option the store sends
/// ("ERR syntax error": `NX` together with `GET` before Redis 7.0, `IFEQ`
/// before Valkey 8.1 and Redis 8.4); nothing was written.
fn refuses_syntax(error: &redis::RedisError) -> bool {
    error.code() == Some("ERR") && error.detail().is_some_and(|detail| detail.contains("syntax"))
}

/// Warns (once per store, on its first claim) about server settings that
/// lose markers: an eviction policy that may evict them under memory
/// pressure, and no persistence at all. Servers that refuse `CONFIG GET`
/// (managed services often do) are not checked. On a cluster, one node
/// (any) is asked.
async fn warn_about_server(conn: RedisConn) {
    let config = |name: &'static str| {
        let mut conn = conn.clone();
        async move {
            let pair: redis::RedisResult<Vec<String>> =
                redis::cmd("CONFIG").arg("GET").arg(name).query_async(&mut conn).await;
            pair.ok().and_then(|pair| pair.into_iter().nth(1))
        }
    };
    if let Some(policy) = config("maxmemory-policy").await
        && policy != "noeviction"
    {
        tracing::warn!(
            target: "idempotent",
            maxmemory_policy = %policy,
            "Redis may evict keys under memory pressure: an evicted marker makes a processed message look new \
             and it would be processed again; set maxmemory-policy to noeviction on the markers' server"
        );
    }
    let appendonly = config("appendonly").await;
    let save = config("save").await;
    if appendonly.as_deref() == Some("no") && save.as_deref() == Some("") {
        tracing::warn!(
            target: "idempotent",
            "Redis keeps nothing on disk (appendonly no, no save points): a restart forgets every marker and \
             processed messages would be processed again; enable appendonly"
        );
    }
}

/// Redis expires markers by itself (each completed marker carries its
/// `ttl` as a Redis expiry), so there is nothing to purge: always `Ok(0)`,
/// and no janitor lock (a fleet has nothing to take turns at).
impl crate::janitor::PurgeExpired for RedisStore {
    fn purge_expired(&self) -> impl Future<Output = Result<u64, Error>> + Send {
        std::future::ready(Ok(0))
    }
}

/// The lease of a [`RedisStore`] claim, renewed in the background until the
/// guard completes, aborts or is dropped; released on drop.
pub struct RedisGuard {
    conn: RedisConn,
    wait: Option<Replicas>,
    key: String,
    lease: String,
    ttl_ms: i64,
    fingerprint: Option<String>,
    /// The store's [`RedisStore::scripted_completion`].
    scripted_completion: Arc<AtomicBool>,
    renewal: Option<Renewal>,
    open: bool,
}

impl RedisGuard {
    fn stop_renewal(&mut self) {
        self.renewal = None;
    }

    /// Replaces the lease by `marker` if this guard's token is still the
    /// key's value: `true` when replaced. One native command (`SET key marker
    /// IFEQ lease PX ttl`, Valkey ≥ 8.1 and Redis ≥ 8.4), or the `COMPLETE`
    /// script on a server that refuses it; followed by `WAIT` with
    /// [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas), an
    /// error when fewer replicas acknowledge it.
    async fn replace_lease(&mut self, marker: &str) -> Result<bool, Error> {
        if !self.scripted_completion.load(Ordering::Relaxed) {
            let mut set = redis::cmd("SET");
            set.arg(&self.key)
                .arg(marker)
                .arg("IFEQ")
                .arg(&self.lease)
                .arg("PX")
                .arg(self.ttl_ms);
            let sent = self.conn.send(&set, self.wait).await.map_err(Error::store)?;
            let replicated = sent.replicated(self.wait);
            let replaced = match sent.reply {
                Ok(redis::Value::Nil) => return self.retried_completion(marker).await,
                Ok(redis::Value::Okay) => Some(true),
                Ok(redis::Value::SimpleString(reply)) if reply == "OK" => Some(true),
                Ok(other) => {
                    return Err(Error::Store(
                        format!("unexpected reply to SET .. IFEQ on Redis key {:?}: {other:?}", self.key).into(),
                    ));
                }
                Err(error) if refuses_syntax(&error) => {
                    tracing::debug!(target: "idempotent", %error, "SET IFEQ refused (before Valkey 8.1 and Redis 8.4): completing with a script");
                    self.scripted_completion.store(true, Ordering::Relaxed);
                    None
                }
                Err(error) => return Err(Error::store(error)),
            };
            if let Some(replaced) = replaced {
                return self.replicated(replaced, replicated);
            }
        }
        let sent = COMPLETE
            .key(&self.key)
            .arg(&self.lease)
            .arg(marker)
            .arg(self.ttl_ms)
            .send(&mut self.conn, self.wait)
            .await
            .map_err(Error::store)?;
        let replicated = sent.replicated(self.wait);
        let replaced: i64 = sent_reply(sent)?;
        if replaced != 1 {
            return self.retried_completion(marker).await;
        }
        self.replicated(true, replicated)
    }

    /// The lease was not there to replace. Either it was lost (expired and
    /// taken over, or lost by a failover): `false`; or the connection sent
    /// the completion again after losing the reply to the first attempt,
    /// which did replace it (a cluster connection retries, after a broken
    /// connection or a redirection): the key holds this very marker, which
    /// carries this claim's token (the marker of a claim that took the key
    /// over carries its own, whatever result it stored). Then `true`, and
    /// with
    /// [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas) the
    /// marker is written again unchanged and waited for, since the first
    /// attempt's write may have been on a connection since lost, which this
    /// connection's `WAIT` does not cover.
    async fn retried_completion(&mut self, marker: &str) -> Result<bool, Error> {
        let current: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&self.key)
            .query_async(&mut self.conn)
            .await
            .map_err(Error::store)?;
        if current.as_deref() != Some(marker.as_bytes()) {
            return Ok(false);
        }
        if self.wait.is_none() {
            return Ok(true);
        }
        let (unchanged, replicated) = rewrite(&mut self.conn, &self.key, marker.as_bytes(), self.wait).await?;
        self.replicated(unchanged, replicated)
    }

    /// `replaced`, or [`NotReplicated`] for a marker written but not
    /// acknowledged by enough replicas.
    fn replicated(&self, replaced: bool, replicated: bool) -> Result<bool, Error> {
        if replaced && !replicated {
            return Err(not_replicated(&self.key, "completion", self.wait));
        }
        Ok(replaced)
    }
}

impl fmt::Debug for RedisGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGuard")
            .field("key", &self.key)
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl Guard for RedisGuard {
    async fn complete(mut self, result: Option<String>) -> Result<(), Error> {
        self.open = false;
        self.stop_renewal();
        let token = self.lease.get(1..).unwrap_or_default();
        let marker = encode_done(token, self.fingerprint.as_deref(), result.as_deref());
        if self.replace_lease(&marker).await? {
            Ok(())
        } else {
            Err(Error::Store(
                format!(
                    "the Redis lease on {:?} expired and was lost before the handler completed; the result was not stored",
                    self.key
                )
                .into(),
            ))
        }
    }

    async fn abort(mut self) {
        self.open = false;
        self.stop_renewal();
        if let Err(error) = release(&mut self.conn, &self.key, &self.lease).await {
            tracing::warn!(target: "idempotent", key = %self.key, %error, "releasing the Redis lease failed; it will expire");
        }
    }
}

impl Drop for RedisGuard {
    fn drop(&mut self) {
        self.stop_renewal();
        if !self.open {
            return;
        }
        // Dropped without completion (panic or cancellation): release in the
        // background; without a runtime the lease simply expires.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut conn = self.conn.clone();
            let key = std::mem::take(&mut self.key);
            let lease = std::mem::take(&mut self.lease);
            runtime.spawn(async move {
                if let Err(error) = release(&mut conn, &key, &lease).await {
                    tracing::warn!(target: "idempotent", %key, %error, "releasing the Redis lease failed; it will expire");
                }
            });
        }
    }
}

/// Deletes the lease if it is still `lease` (no `WAIT`: a release a
/// failover loses only leaves the lease to expire).
async fn release(conn: &mut RedisConn, key: &str, lease: &str) -> redis::RedisResult<()> {
    let _: i64 = RELEASE.key(key).arg(lease).invoke(conn).await?;
    Ok(())
}

fn unrecognised(key: &str) -> Error {
    Error::Store(
        format!("unrecognised value under Redis key {key:?}: is something else writing under this store's prefix?")
            .into(),
    )
}

/// A lease value: `L` and a token of 32 hex digits, unique per claim: 128
/// bits from two randomly keyed SipHashes (the OS seeds std's
/// `RandomState`) over the process id, the time and a counter. The process
/// id is read once (`getpid` is a system call at every read); a child forked
/// afterwards still hashes another time.
fn new_lease() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static PID: LazyLock<u32> = LazyLock::new(std::process::id);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let half = || {
        let mut hasher = std::hash::RandomState::new().build_hasher();
        hasher.write_u32(*PID);
        hasher.write_u128(nanos);
        hasher.write_u64(count);
        hasher.finish()
    };
    format!("L{:016x}{:016x}", half(), half())
}

/// The hex digits of a lease's token.
const TOKEN_DIGITS: usize = 32;

/// `D@{token}{fingerprint}{result}`; see the module docs.
fn encode_done(token: &str, fingerprint: Option<&str>, result: Option<&str>) -> String {
    let mut value =
        String::with_capacity(10 + token.len() + fingerprint.map_or(0, str::len) + result.map_or(0, str::len));
    value.push_str("D@");
    value.push_str(token);
    match fingerprint {
        Some(fp) => {
            value.push_str(&fp.len().to_string());
            value.push(':');
            value.push_str(fp);
        }
        None => value.push('-'),
    }
    if let Some(result) = result {
        value.push('=');
        value.push_str(result);
    }
    value
}

/// The fingerprint and result of a completed marker (after its `D`).
fn decode_done(rest: &str) -> Option<(Option<&str>, Option<&str>)> {
    // The claim's token: 32 hex digits (absent from older markers).
    let rest = match rest.strip_prefix('@') {
        Some(rest) => {
            let token = rest.get(..TOKEN_DIGITS)?;
            if !token.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            rest.get(TOKEN_DIGITS..)?
        }
        None => rest,
    };
    let (fingerprint, rest) = match rest.strip_prefix('-') {
        Some(rest) => (None, rest),
        None => {
            let (len, rest) = rest.split_once(':')?;
            if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let len: usize = len.parse().ok()?;
            let fingerprint = rest.get(..len)?;
            (Some(fingerprint), rest.get(len..)?)
        }
    };
    let result = match rest {
        "" => None,
        rest => Some(rest.strip_prefix('=')?),
    };
    Some((fingerprint, result))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completed_markers_round_trip() {
        let lease = new_lease();
        for fingerprint in [None, Some(""), Some("abc"), Some("12:=-D|x")] {
            for result in [None, Some(""), Some("42"), Some(r#"{"a":"=:-|"}"#), Some("=")] {
                let value = encode_done(&lease[1..], fingerprint, result);
                assert!(value.starts_with(&format!("D@{}", &lease[1..])), "{value}");
                assert_eq!(decode_done(&value[1..]), Some((fingerprint, result)), "{value}");
                // A marker written before the token was added.
                let old = value.replace(&format!("@{}", &lease[1..]), "");
                assert_eq!(decode_done(&old[1..]), Some((fingerprint, result)), "{old}");
            }
        }
        assert_ne!(
            encode_done(&lease[1..], None, None),
            encode_done(&new_lease()[1..], None, None),
            "two claims' markers differ whatever they store"
        );
    }

    #[test]
    fn malformed_markers_are_refused() {
        for rest in [
            "",
            "x",
            "3:ab",
            "3:abcx",
            "-x",
            "+1:a",
            "1a:b",
            "@-",
            "@0123-",
            "@0123456789abcdef0123456789abcdeg-",
        ] {
            assert_eq!(decode_done(rest), None, "{rest}");
        }
    }

    #[test]
    fn a_syntax_error_selects_the_scripts() {
        let refusal = |reply: &[u8]| {
            let value = redis::parse_redis_value(reply).unwrap();
            value.extract_error().unwrap_err()
        };
        // What Redis < 7.0 answers to `SET .. NX .. GET`, and Redis < 8.4
        // to `SET .. IFEQ`.
        assert!(refuses_syntax(&refusal(b"-ERR syntax error\r\n")));
        assert!(!refuses_syntax(&refusal(
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        )));
        assert!(!refuses_syntax(&refusal(b"-ERR max number of clients reached\r\n")));
    }

    #[test]
    fn tokens_differ() {
        let a = new_lease();
        assert_eq!(a.len(), 33);
        assert!(
            a.starts_with('L') && a[1..].bytes().all(|b| b.is_ascii_hexdigit()),
            "{a}"
        );
        assert_ne!(a, new_lease());
    }
}
