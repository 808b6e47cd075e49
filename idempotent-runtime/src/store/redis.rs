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
//! - `D{fingerprint}{result}`: a completed marker; `fingerprint` is `-` when
//!   the handler has none, else `{len}:{text}` (`len` in bytes, decimal);
//!   `result` is empty for JSON `null` (what `()` returns), else `={json}`.
//!
//! Keys and values travel as command arguments or script `KEYS`/`ARGV`,
//! never spliced into commands or scripts.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use redis::Script;
use redis::aio::ConnectionManager;

use crate::Error;
use crate::store::redis_renewal::{Renewal, Renewer};
use crate::store::{Claim, Guard, Replay, Request, Store};

/// The key prefix of [`RedisStore::new`].
const DEFAULT_PREFIX: &str = "idempotent:";

/// The longest key prefix [`RedisStoreBuilder::build`] accepts, in bytes.
const MAX_PREFIX_BYTES: usize = 128;

/// Sets the lease if the key is free; otherwise returns the current value.
/// ARGV: lease value, lease ms. Returns nil when claimed. For servers older
/// than 7.0, which refuse `SET .. NX .. GET`.
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
return redis.call('GET', KEYS[1])",
    )
});

/// Replaces the lease by the completed marker if the token still matches.
/// ARGV: lease value, marker value, ttl ms. For servers without `SET ..
/// IFEQ` (before Valkey 8.1 and Redis 8.4).
static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0",
    )
});

/// Deletes the lease if the token still matches. ARGV: lease value.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0",
    )
});

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
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
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
        RedisStore::assemble(conn, DEFAULT_PREFIX, true)
    }

    /// The store on `conn` under a valid `prefix`, renewing leases if
    /// `renew`.
    fn assemble(conn: ConnectionManager, prefix: &str, renew: bool) -> Self {
        RedisStore {
            renewer: renew.then(|| Renewer::new(conn.clone())),
            conn,
            prefix: Arc::from(prefix),
            namespace: namespace(prefix),
            checked: Arc::default(),
            scripted_claim: Arc::default(),
            scripted_completion: Arc::default(),
        }
    }

    /// A builder to set the key prefix.
    pub fn builder(conn: ConnectionManager) -> RedisStoreBuilder {
        RedisStoreBuilder {
            conn,
            prefix: DEFAULT_PREFIX.to_owned(),
            renew: true,
        }
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

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("renew", &self.renewer.is_some())
            .finish()
    }
}

/// Configures a [`RedisStore`].
#[derive(Clone)]
pub struct RedisStoreBuilder {
    conn: ConnectionManager,
    prefix: String,
    renew: bool,
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

    /// The store, or [`Error::Config`] for an invalid prefix.
    pub fn build(self) -> Result<RedisStore, Error> {
        let prefix = self.prefix;
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
        Ok(RedisStore::assemble(self.conn, &prefix, self.renew))
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("renew", &self.renew)
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
        let current = self.set_lease(&mut conn, &key, &lease, lease_ms).await?;
        let Some(current) = current else {
            let renewal = self
                .renewer
                .as_ref()
                .and_then(|renewer| renewer.register(&key, &lease, lease_ms));
            return Ok(Claim::Fresh(RedisGuard {
                conn,
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
            // A `()` handler without fingerprint replays `()` whatever the
            // marker holds: nothing to decode.
            Some(b'D') if !req.needs_read() => Ok(Claim::Done(Replay::default())),
            Some(b'D') => {
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

impl RedisStore {
    /// Sets the lease on `key` unless it exists: `None` when set, else the
    /// current value. One native command (`SET key lease NX PX ms GET`,
    /// Redis ≥ 7.0), or the `CLAIM` script on a server that refuses it.
    async fn set_lease(
        &self,
        conn: &mut ConnectionManager,
        key: &str,
        lease: &str,
        lease_ms: i64,
    ) -> Result<Option<Vec<u8>>, Error> {
        if !self.scripted_claim.load(Ordering::Relaxed) {
            let set: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("SET")
                .arg(key)
                .arg(lease)
                .arg("NX")
                .arg("PX")
                .arg(lease_ms)
                .arg("GET")
                .query_async(conn)
                .await;
            match set {
                Err(error) if refuses_syntax(&error) => {
                    tracing::debug!(target: "idempotent", %error, "SET NX GET refused (Redis < 7.0): claiming with a script");
                    self.scripted_claim.store(true, Ordering::Relaxed);
                }
                other => return other.map_err(Error::store),
            }
        }
        CLAIM
            .key(key)
            .arg(lease)
            .arg(lease_ms)
            .invoke_async(conn)
            .await
            .map_err(Error::store)
    }
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
/// (managed services often do) are not checked.
async fn warn_about_server(conn: ConnectionManager) {
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
    conn: ConnectionManager,
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
    /// script on a server that refuses it.
    async fn replace_lease(&mut self, marker: &str) -> Result<bool, Error> {
        if !self.scripted_completion.load(Ordering::Relaxed) {
            let set: redis::RedisResult<redis::Value> = redis::cmd("SET")
                .arg(&self.key)
                .arg(marker)
                .arg("IFEQ")
                .arg(&self.lease)
                .arg("PX")
                .arg(self.ttl_ms)
                .query_async(&mut self.conn)
                .await;
            match set {
                Ok(redis::Value::Nil) => return Ok(false),
                Ok(redis::Value::Okay) => return Ok(true),
                Ok(redis::Value::SimpleString(reply)) if reply == "OK" => return Ok(true),
                Ok(other) => {
                    return Err(Error::Store(
                        format!("unexpected reply to SET .. IFEQ on Redis key {:?}: {other:?}", self.key).into(),
                    ));
                }
                Err(error) if refuses_syntax(&error) => {
                    tracing::debug!(target: "idempotent", %error, "SET IFEQ refused (before Valkey 8.1 and Redis 8.4): completing with a script");
                    self.scripted_completion.store(true, Ordering::Relaxed);
                }
                Err(error) => return Err(Error::store(error)),
            }
        }
        let replaced: i64 = COMPLETE
            .key(&self.key)
            .arg(&self.lease)
            .arg(marker)
            .arg(self.ttl_ms)
            .invoke_async(&mut self.conn)
            .await
            .map_err(Error::store)?;
        Ok(replaced == 1)
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
        let marker = encode_done(self.fingerprint.as_deref(), result.as_deref());
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

async fn release(conn: &mut ConnectionManager, key: &str, lease: &str) -> redis::RedisResult<()> {
    let _: i64 = RELEASE.key(key).arg(lease).invoke_async(conn).await?;
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

/// `D{fingerprint}{result}`; see the module docs.
fn encode_done(fingerprint: Option<&str>, result: Option<&str>) -> String {
    let mut value = String::with_capacity(8 + fingerprint.map_or(0, str::len) + result.map_or(0, str::len));
    value.push('D');
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
        for fingerprint in [None, Some(""), Some("abc"), Some("12:=-D|x")] {
            for result in [None, Some(""), Some("42"), Some(r#"{"a":"=:-|"}"#), Some("=")] {
                let value = encode_done(fingerprint, result);
                assert_eq!(value.as_bytes()[0], b'D');
                assert_eq!(decode_done(&value[1..]), Some((fingerprint, result)), "{value}");
            }
        }
    }

    #[test]
    fn malformed_markers_are_refused() {
        for rest in ["", "x", "3:ab", "3:abcx", "-x", "+1:a", "1a:b"] {
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
