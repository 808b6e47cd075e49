//! The connection [`RedisStore`](super::RedisStore) and the Redis Streams
//! consumer talk through: one server, or a Redis Cluster (feature
//! `redis-cluster`), whose connection routes each command to the primary
//! of its key's hash slot and follows `MOVED` and `ASK` redirections.
//!
//! Also the two things every write of theirs goes through:
//!
//! - scripts are sent as `EVALSHA`, and as `EVAL` with their source when the
//!   server answers `NOSCRIPT` (a restarted server, a promoted replica, a
//!   node a slot migrated to): one command routed by its key, where redis-rs'
//!   own fallback sends `SCRIPT LOAD`, which a cluster connection sends to
//!   every node and which fails while one of them is down;
//! - a write that must reach replicas before it counts is sent in one
//!   pipeline with `WAIT n timeout`: the same connection, so the `WAIT`
//!   covers that write (and a cluster connection sends a pipeline to the
//!   node of its first key, so the `WAIT` goes to the slot's primary).

use std::sync::OnceLock;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Script, ToRedisArgs, Value};

/// One Redis server or a cluster: the commands are the same, the cluster
/// connection routes them by key.
#[derive(Clone)]
pub(crate) enum RedisConn {
    /// One server, through a connection manager (it reconnects).
    Manager(ConnectionManager),
    /// One server, through a multiplexed connection (the Redis Streams
    /// consumer's, which reconnects itself).
    #[cfg(feature = "redis-streams")]
    Multiplexed(redis::aio::MultiplexedConnection),
    /// A Redis Cluster.
    #[cfg(feature = "redis-cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Manager(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "redis-streams")]
            RedisConn::Multiplexed(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "redis-cluster")]
            RedisConn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Manager(conn) => conn.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "redis-streams")]
            RedisConn::Multiplexed(conn) => conn.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "redis-cluster")]
            RedisConn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Manager(conn) => conn.get_db(),
            #[cfg(feature = "redis-streams")]
            RedisConn::Multiplexed(conn) => conn.get_db(),
            #[cfg(feature = "redis-cluster")]
            RedisConn::Cluster(conn) => conn.get_db(),
        }
    }
}

/// How many replicas must acknowledge a write before it counts, and how
/// long to wait for them (`WAIT count timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Replicas {
    pub(crate) count: u32,
    pub(crate) timeout: Duration,
}

impl Replicas {
    /// The `WAIT` timeout in milliseconds, at least 1 (0 would wait
    /// forever).
    fn timeout_ms(self) -> u64 {
        u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).max(1)
    }
}

/// What a write sent with [`RedisConn::send`] answered.
pub(crate) struct Sent {
    /// The command's reply (an error reply is an `Err`).
    pub(crate) reply: RedisResult<Value>,
    /// How many replicas acknowledged it, when it was sent with `WAIT`.
    pub(crate) replicas: Option<i64>,
}

impl Sent {
    /// The reply as `T`.
    pub(crate) fn parse<T: FromRedisValue>(self) -> RedisResult<T> {
        Ok(redis::from_redis_value(self.reply?)?)
    }

    /// Whether `wait` (if any) was met.
    pub(crate) fn replicated(&self, wait: Option<Replicas>) -> bool {
        match (wait, self.replicas) {
            (None, _) => true,
            (Some(wait), Some(acked)) => acked >= i64::from(wait.count),
            (Some(_), None) => false,
        }
    }
}

impl RedisConn {
    /// Sends `cmd`; with `wait`, in one pipeline followed by `WAIT`. The
    /// outer `Err` is a failed pipeline (connection, or the `WAIT`);
    /// `cmd`'s own error, or the connection's without `wait`, is in
    /// [`Sent::reply`].
    pub(crate) async fn send(&mut self, cmd: &Cmd, wait: Option<Replicas>) -> RedisResult<Sent> {
        let Some(wait) = wait else {
            let reply = self.req_packed_command(cmd).await.and_then(Value::extract_error);
            return Ok(Sent { reply, replicas: None });
        };
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone())
            .cmd("WAIT")
            .arg(wait.count)
            .arg(wait.timeout_ms())
            .ignore_errors();
        let mut values: Vec<Value> = pipe.query_async(self).await?;
        let (Some(acked), Some(reply), true) = (values.pop(), values.pop(), values.is_empty()) else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "unexpected reply to a write and its WAIT",
            )));
        };
        let acked: i64 = redis::from_redis_value(acked.extract_error()?)?;
        Ok(Sent {
            reply: reply.extract_error(),
            replicas: Some(acked),
        })
    }
}

/// A Lua script, sent as `EVALSHA` and, when the server does not have it,
/// as `EVAL` with its source.
pub(crate) struct Lua {
    code: &'static str,
    hash: OnceLock<String>,
}

impl Lua {
    pub(crate) const fn new(code: &'static str) -> Lua {
        Lua {
            code,
            hash: OnceLock::new(),
        }
    }

    fn hash(&self) -> &str {
        self.hash.get_or_init(|| Script::new(self.code).get_hash().to_owned())
    }

    /// A call of the script on `keys` (one key, or a slice of keys of one
    /// hash slot).
    pub(crate) fn key(&'static self, keys: impl ToRedisArgs) -> LuaCall {
        LuaCall {
            lua: self,
            keys: keys.to_redis_args(),
            args: Vec::new(),
        }
    }
}

/// A prepared call of a [`Lua`] script.
pub(crate) struct LuaCall {
    lua: &'static Lua,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl LuaCall {
    /// Adds an argument (`ARGV[n]`).
    pub(crate) fn arg(mut self, arg: impl ToRedisArgs) -> Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    fn cmd(&self, by_hash: bool) -> Cmd {
        let mut cmd = if by_hash {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(self.lua.hash());
            cmd
        } else {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(self.lua.code);
            cmd
        };
        cmd.arg(self.keys.len()).arg(&*self.keys).arg(&*self.args);
        cmd
    }

    /// Runs the script; with `wait`, followed by `WAIT` on the same
    /// connection.
    pub(crate) async fn send(&self, conn: &mut RedisConn, wait: Option<Replicas>) -> RedisResult<Sent> {
        let sent = conn.send(&self.cmd(true), wait).await?;
        match &sent.reply {
            Err(error) if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                conn.send(&self.cmd(false), wait).await
            }
            _ => Ok(sent),
        }
    }

    /// Runs the script and parses its reply.
    pub(crate) async fn invoke<T: FromRedisValue>(&self, conn: &mut RedisConn) -> RedisResult<T> {
        self.send(conn, None).await?.parse()
    }
}
