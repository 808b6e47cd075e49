//! Redis: the article's `EXISTS` + `SETEX` against `RedisStore` (a lease
//! claim and a completion), with the effect an in-process counter so that
//! every Redis command counted is one of the idempotency layer's.

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent_runtime::redis::{self, AsyncCommands, aio::ConnectionManager};
use idempotent_runtime::{CachedStore, Error, RedisStore, idempotent};

use crate::harness::{BoxError, Outcome, Variant};
use crate::pg::Msg;

pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";
const WEEK_S: u64 = 7 * 24 * 3600;

pub async fn connect(url: &str) -> Result<ConnectionManager, BoxError> {
    let client = redis::Client::open(url)?;
    Ok(client.get_connection_manager().await?)
}

/// Deletes every key under `prefix` (the runs' keys live 7 days otherwise).
/// A command that fails (a long run leaves millions of keys, and a batch
/// can outlast the connection's response timeout) is tried again, up to
/// ten times in a row, then the deletion stops with a message: the
/// measurements are kept either way.
pub async fn delete_prefix(conn: &mut ConnectionManager, prefix: &str) -> u64 {
    let mut cursor: u64 = 0;
    let mut deleted = 0;
    let mut failures = 0;
    loop {
        let step = async {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(1_000)
                .query_async(conn)
                .await?;
            let n: u64 = if keys.is_empty() {
                0
            } else {
                redis::cmd("UNLINK").arg(&keys).query_async(conn).await?
            };
            Ok::<_, redis::RedisError>((next, n))
        };
        match step.await {
            Ok((next, n)) => {
                failures = 0;
                deleted += n;
                if next == 0 {
                    return deleted;
                }
                cursor = next;
            }
            Err(e) if failures < 10 => {
                failures += 1;
                eprintln!("  deleting {prefix}*: {e}; trying again");
            }
            Err(e) => {
                eprintln!("  deleting {prefix}*: {e}; stopped after {deleted} keys");
                return deleted;
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error(transparent)]
    Idem(#[from] Error),
}

/// The article: `EXISTS`, the effect, `SETEX`.
pub struct Article {
    pub conn: ConnectionManager,
    pub prefix: String,
    pub effects: AtomicU64,
}

impl Variant for Article {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut conn = self.conn.clone();
        let redis_key = format!("{}{key}", self.prefix);
        let seen: bool = conn.exists(&redis_key).await?;
        if seen {
            return Ok(Outcome::Duplicate);
        }
        self.effects.fetch_add(1, Ordering::Relaxed);
        let () = conn.set_ex(&redis_key, 1, WEEK_S).await?;
        Ok(Outcome::Fresh)
    }
}

/// Claim-first by hand: `SET key lease NX PX 30000`, the effect, then
/// `SET key done PX ttl` (no token check on completion: a consumer whose
/// lease expired overwrites the new owner's); a duplicate is the `SET NX`
/// that set nothing. Two commands per fresh message, one per duplicate, as
/// `RedisStore`.
pub struct ClaimFirst {
    pub conn: ConnectionManager,
    pub prefix: String,
    pub effects: AtomicU64,
}

impl Variant for ClaimFirst {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut conn = self.conn.clone();
        let redis_key = format!("{}{key}", self.prefix);
        let set: Option<String> = redis::cmd("SET")
            .arg(&redis_key)
            .arg("L")
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async(&mut conn)
            .await?;
        if set.is_none() {
            return Ok(Outcome::Duplicate);
        }
        self.effects.fetch_add(1, Ordering::Relaxed);
        let () = redis::cmd("SET")
            .arg(&redis_key)
            .arg("D")
            .arg("PX")
            .arg(WEEK_S * 1000)
            .query_async(&mut conn)
            .await?;
        Ok(Outcome::Fresh)
    }
}

/// By hand, what `RedisStore` sends for a `()` handler without
/// fingerprint, without lease renewal: `SET key token NX PX lease GET`, the
/// effect, then its completion: `SET key done IFEQ token PX ttl` where the
/// server has it (Valkey ≥ 8.1, Redis ≥ 8.4), else the script (the token
/// compared, `SET PX ttl`). (d') against (s) is the cost of the macro and
/// the runtime; (s) against (c) the cost of the token check.
pub struct StoreCommands {
    pub conn: ConnectionManager,
    pub prefix: String,
    pub effects: AtomicU64,
    pub tokens: AtomicU64,
    /// The server refused `SET .. IFEQ`.
    pub scripted: std::sync::atomic::AtomicBool,
}

impl StoreCommands {
    pub fn new(conn: ConnectionManager, prefix: String) -> Self {
        StoreCommands {
            conn,
            prefix,
            effects: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            scripted: std::sync::atomic::AtomicBool::new(false),
        }
    }

    async fn complete(&self, conn: &mut ConnectionManager, key: &str, token: &str) -> Result<bool, BoxError> {
        if !self.scripted.load(Ordering::Relaxed) {
            let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
                .arg(key)
                .arg("D")
                .arg("IFEQ")
                .arg(token)
                .arg("PX")
                .arg(WEEK_S * 1000)
                .query_async(conn)
                .await;
            match set {
                Ok(reply) => return Ok(reply.is_some()),
                // A syntax error: the server has no `IFEQ` (nothing written).
                Err(e) if e.code() == Some("ERR") && e.detail().is_some_and(|d| d.contains("syntax")) => {
                    self.scripted.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e.into()),
            }
        }
        let replaced: i64 = COMPLETE
            .key(key)
            .arg(token)
            .arg("D")
            .arg(WEEK_S * 1000)
            .invoke_async(conn)
            .await?;
        Ok(replaced == 1)
    }
}

static COMPLETE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0",
    )
});

impl Variant for StoreCommands {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let mut conn = self.conn.clone();
        let redis_key = format!("{}{key}", self.prefix);
        let token = format!("L{:032x}", self.tokens.fetch_add(1, Ordering::Relaxed));
        let current: Option<Vec<u8>> = redis::cmd("SET")
            .arg(&redis_key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .arg("GET")
            .query_async(&mut conn)
            .await?;
        if current.is_some() {
            return Ok(Outcome::Duplicate);
        }
        self.effects.fetch_add(1, Ordering::Relaxed);
        if !self.complete(&mut conn, &redis_key, &token).await? {
            return Err("the lease was lost".into());
        }
        Ok(Outcome::Fresh)
    }
}

/// `#[idempotent]` with a `RedisStore` (or a cached one).
pub struct Macro<S> {
    pub store: S,
    pub effects: AtomicU64,
}

impl<S: idempotent_runtime::store::Store + 'static> Macro<S> {
    #[idempotent(key = "msg.key", store = self.store, scope = "handle")]
    async fn handle(&self, msg: &Msg) -> Result<(), LeaseError> {
        msg.ran.store(true, Ordering::Relaxed);
        self.effects.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl<S: idempotent_runtime::store::Store + 'static> Variant for Macro<S> {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let msg = Msg::new(key);
        match self.handle(&msg).await {
            Ok(()) => Ok(msg.outcome()),
            Err(LeaseError::Idem(Error::InProgress { .. })) => Ok(Outcome::Busy),
            Err(e) => Err(e.into()),
        }
    }
}

pub fn store(conn: ConnectionManager, prefix: &str) -> RedisStore {
    RedisStore::builder(conn).prefix(prefix).build().unwrap()
}

/// A `RedisStore` that does not spawn a lease-renewal task per claim.
pub fn store_without_renewal(conn: ConnectionManager, prefix: &str) -> RedisStore {
    RedisStore::builder(conn).prefix(prefix).renew(false).build().unwrap()
}

pub fn cached(conn: ConnectionManager, prefix: &str, capacity: usize) -> CachedStore<RedisStore> {
    CachedStore::new(store(conn, prefix), capacity)
}

// ---- counting round trips on a private server --------------------------------------

/// A `redis-server` of our own on a free port, so that `INFO commandstats`
/// counts only this benchmark's commands.
pub struct PrivateRedis {
    pub url: String,
    child: Child,
    _dir: tempfile::TempDir,
}

impl PrivateRedis {
    pub fn start() -> Option<PrivateRedis> {
        let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let dir = tempfile::tempdir().ok()?;
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .ok()?;
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(PrivateRedis {
                    url: format!("redis://127.0.0.1:{port}/"),
                    child,
                    _dir: dir,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `calls` per command from `INFO commandstats`.
pub async fn command_stats(conn: &mut ConnectionManager) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await.unwrap();
    let mut out = HashMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let calls = fields
            .split(',')
            .find_map(|f| f.strip_prefix("calls="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        out.insert(name.to_owned(), calls);
    }
    out
}

/// Commands sent by clients between two snapshots: every command except
/// those a script runs inside the server (`SET`/`GET`/... under
/// `EVALSHA`), and except our own `INFO`.
///
/// `INFO commandstats` also counts the commands a script runs, so a plain
/// `SET` in `top_level` is ambiguous for `RedisStore` (its claim is a
/// client `SET`, its completion script runs one `SET` inside the server):
/// the entry `"set-outside-scripts"` counts the `SET`s beyond one per
/// `EVALSHA`.
pub fn client_commands(before: &HashMap<String, u64>, after: &HashMap<String, u64>, top_level: &[&str]) -> u64 {
    let calls = |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    top_level
        .iter()
        .map(|name| match *name {
            "set-outside-scripts" => calls("set").saturating_sub(calls("evalsha")),
            name => calls(name),
        })
        .sum()
}

pub fn delta(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(k, v)| *v > 0 && k != "info")
        .collect();
    out.sort();
    out
}
