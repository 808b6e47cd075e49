//! A Redis Cluster of private Valkey 8.1 processes (so `RedisStore`'s
//! native `SET .. IFEQ` completion runs on it), for the tests of the store
//! and of the Redis Streams consumer on a cluster: primaries with one
//! replica each, created with `redis-cli --cluster create`, on free ports
//! of 127.0.0.1 and a temporary directory.
//!
//! Every process is killed when the cluster is dropped (also when the test
//! panics), and by a watchdog process when the test process dies without
//! dropping it (a SIGKILL, or the cluster shared by a test binary, which
//! lives until the process exits). The tests kill primaries (SIGKILL), wait
//! for their replicas' promotion, start the killed nodes again (they come
//! back as replicas) and migrate slots.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use idempotent_runtime::redis;

use super::servers::{ChildServer, free_port, valkey_server, wait_for_port};

/// How long a node may be unreachable before the cluster fails it over.
pub const NODE_TIMEOUT: Duration = Duration::from_millis(2000);

struct Node {
    port: u16,
    bus_port: u16,
    child: Option<Child>,
}

/// A running cluster; see the module documentation.
pub struct RedisCluster {
    dir: tempfile::TempDir,
    server: PathBuf,
    nodes: Mutex<Vec<Node>>,
    watchdog: Mutex<Option<Child>>,
}

/// One line of `CLUSTER NODES`.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    /// Flagged `fail` or `fail?` by the node asked.
    pub failed: bool,
    /// The primary's id, for a replica.
    pub primary_id: Option<String>,
    /// Slot ranges served (primaries), inclusive.
    pub slots: Vec<(u16, u16)>,
}

impl NodeInfo {
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(from, to)| from <= slot && slot <= to)
    }
}

impl RedisCluster {
    /// `primaries` primaries (at least 3) with one replica each, every slot
    /// covered, `cluster_state:ok` on every node.
    pub fn start(primaries: usize) -> RedisCluster {
        assert!(primaries >= 3, "a Redis Cluster needs at least 3 primaries");
        let cluster = RedisCluster {
            dir: tempfile::tempdir().expect("temp dir"),
            server: valkey_server(),
            nodes: Mutex::new(Vec::new()),
            watchdog: Mutex::new(None),
        };
        // Two ports per node (clients, cluster bus), all different.
        let mut taken = std::collections::HashSet::new();
        let mut port = || loop {
            let port = free_port();
            if taken.insert(port) {
                return port;
            }
        };
        let ports: Vec<(u16, u16)> = (0..primaries * 2).map(|_| (port(), port())).collect();
        for &(port, bus_port) in &ports {
            std::fs::create_dir_all(cluster.node_dir(port)).expect("node dir");
            let child = cluster.spawn(port, bus_port);
            cluster.nodes.lock().unwrap().push(Node {
                port,
                bus_port,
                child: Some(child),
            });
        }
        cluster.start_watchdog();
        for &(port, _) in &ports {
            wait_for_port(port, "a Valkey cluster node", Duration::from_secs(20));
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for &(port, _) in &ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = create.output().expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_until(
            "every node reports cluster_state:ok and knows every node",
            Duration::from_secs(60),
            |c| {
                c.ports().iter().all(|&port| {
                    c.try_cli(port, &["CLUSTER", "INFO"])
                        .is_some_and(|info| info.contains("cluster_state:ok"))
                        && c.try_nodes(port)
                            .is_some_and(|nodes| nodes.len() == ports.len() && nodes.iter().all(|n| !n.failed))
                }) && c.replicas_in_sync()
            },
        );
        cluster
    }

    /// The cluster shared by the tests of one test binary (3 primaries, 3
    /// replicas), started on first use; its processes are stopped by the
    /// watchdog when the test process exits. Tests that kill or migrate
    /// start a cluster of their own.
    pub fn shared() -> &'static RedisCluster {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(|| RedisCluster::start(3))
    }

    fn node_dir(&self, port: u16) -> PathBuf {
        self.dir.path().join(port.to_string())
    }

    fn spawn(&self, port: u16, bus_port: u16) -> Child {
        let dir = self.node_dir(port);
        Command::new(&self.server)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes", "--cluster-port", &bus_port.to_string()])
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", &NODE_TIMEOUT.as_millis().to_string()])
            // A replica may always be promoted, however long it was cut off.
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--pidfile")
            .arg(dir.join("valkey.pid"))
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("start {}: {err}", self.server.display()))
    }

    /// A process that outlives this one by at most half a second: it kills
    /// the nodes (by the pid files they write) once the test process is
    /// gone.
    fn start_watchdog(&self) {
        let script = r#"while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
for f in "$2"/*/valkey.pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
rm -rf "$2""#;
        let child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .arg("watchdog")
            .arg(std::process::id().to_string())
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the cluster's watchdog");
        *self.watchdog.lock().unwrap() = Some(child);
    }

    /// The ports of every node, killed or not.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.lock().unwrap().iter().map(|n| n.port).collect()
    }

    /// The ports of the nodes running now.
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .lock()
            .unwrap()
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// `redis://127.0.0.1:<port>/` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.ports()
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}/"))
            .collect()
    }

    /// A client of the cluster with short timeouts and retries that ride
    /// out a failover (a few seconds).
    pub fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClient::builder(self.urls())
            .connection_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(2))
            .retries(6)
            .min_retry_wait(50)
            .max_retry_wait(1000)
            .build()
            .expect("cluster client")
    }

    /// A connection to the cluster.
    pub async fn connection(&self) -> redis::cluster_async::ClusterConnection {
        self.client()
            .get_async_connection()
            .await
            .expect("connect to the Redis Cluster")
    }

    /// `redis-cli -p <port> <args>` (raw output), or `None` when it fails.
    pub fn try_cli(&self, port: u16, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && !text.starts_with("ERR") && !text.starts_with("Could not connect")).then_some(text)
    }

    /// `redis-cli -p <port> <args>`, which must succeed.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        self.try_cli(port, args)
            .unwrap_or_else(|| panic!("redis-cli -p {port} {args:?} failed"))
    }

    fn try_nodes(&self, port: u16) -> Option<Vec<NodeInfo>> {
        let text = self.try_cli(port, &["CLUSTER", "NODES"])?;
        let mut nodes = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let address = fields[1].split('@').next()?;
            let node_port: u16 = address.rsplit(':').next()?.parse().ok()?;
            let flags = fields[2];
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            nodes.push(NodeInfo {
                id: fields[0].to_owned(),
                port: node_port,
                primary: flags.contains("master"),
                failed: flags.contains("fail"),
                primary_id: (fields[3] != "-").then(|| fields[3].to_owned()),
                slots,
            });
        }
        Some(nodes)
    }

    /// `CLUSTER NODES` as seen by a live node.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        for port in self.live_ports() {
            if let Some(nodes) = self.try_nodes(port) {
                return nodes;
            }
        }
        panic!("no live cluster node answers CLUSTER NODES");
    }

    /// The hash slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        let port = self.live_ports()[0];
        self.cli(port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT")
    }

    /// The live primary serving `slot`.
    pub fn primary_of(&self, slot: u16) -> NodeInfo {
        self.nodes()
            .into_iter()
            .find(|n| n.primary && !n.failed && n.serves(slot))
            .unwrap_or_else(|| panic!("no live primary serves slot {slot}"))
    }

    /// Every replica is connected to its primary and caught up.
    fn replicas_in_sync(&self) -> bool {
        self.live_ports().iter().all(|&port| {
            let Some(info) = self.try_cli(port, &["INFO", "replication"]) else {
                return false;
            };
            !info.contains("role:slave") || info.contains("master_link_status:up")
        })
    }

    /// Calls `check` every 100 ms until it holds; panics after `timeout`.
    fn wait_until(&self, what: &str, timeout: Duration, check: impl Fn(&RedisCluster) -> bool) {
        let deadline = Instant::now() + timeout;
        while !check(self) {
            assert!(
                Instant::now() < deadline,
                "the Redis Cluster: {what}: not within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILLs the node on `port` (its data, in memory only, is gone).
    pub fn kill(&self, port: u16) {
        let mut nodes = self.nodes.lock().unwrap();
        let node = nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node of this cluster");
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(self.node_dir(port).join("valkey.pid"));
    }

    /// SIGKILLs the primary of `slot`; its port.
    pub fn kill_primary_of(&self, slot: u16) -> u16 {
        let primary = self.primary_of(slot);
        self.kill(primary.port);
        primary.port
    }

    /// Waits until another node serves `slot` as a primary (the killed
    /// one's replica was promoted) and the cluster is `ok` again.
    pub fn wait_for_promotion(&self, killed: u16, slot: u16) -> u16 {
        self.wait_until("a replica is promoted", Duration::from_secs(30), |c| {
            c.nodes()
                .iter()
                .any(|n| n.primary && !n.failed && n.port != killed && n.serves(slot))
                && c.live_ports().iter().all(|&port| {
                    c.try_cli(port, &["CLUSTER", "INFO"])
                        .is_some_and(|info| info.contains("cluster_state:ok"))
                })
        });
        self.primary_of(slot).port
    }

    /// Waits until every live node reports `cluster_state:ok` and sees no
    /// node failed (after a node was paused, failed over or not).
    pub fn wait_for_ok(&self) {
        self.wait_until("the cluster is ok again", Duration::from_secs(60), |c| {
            c.live_ports().iter().all(|&port| {
                c.try_cli(port, &["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
                    && c.try_nodes(port).is_some_and(|nodes| nodes.iter().all(|n| !n.failed))
            }) && c.replicas_in_sync()
        });
    }

    /// Starts the killed node on `port` again: it rejoins as a replica of
    /// the node promoted in its place and copies its data.
    pub fn restart(&self, port: u16) {
        {
            let mut nodes = self.nodes.lock().unwrap();
            let node = nodes
                .iter_mut()
                .find(|n| n.port == port)
                .expect("a node of this cluster");
            assert!(node.child.is_none(), "node :{port} is running");
            node.child = Some(self.spawn(node.port, node.bus_port));
        }
        wait_for_port(port, "the restarted cluster node", Duration::from_secs(20));
        self.wait_until(
            "the restarted node is a replica in sync",
            Duration::from_secs(60),
            |c| {
                c.try_cli(port, &["INFO", "replication"])
                    .is_some_and(|info| info.contains("role:slave") && info.contains("master_link_status:up"))
                    && c.try_nodes(c.live_ports()[0])
                        .is_some_and(|nodes| nodes.iter().all(|n| !n.failed))
            },
        );
    }

    /// Stops the node on `port` with SIGSTOP: its connections stay open and
    /// it answers nothing (a replica stops acknowledging writes) until
    /// [`resume`](Self::resume).
    pub fn pause(&self, port: u16) {
        self.signal(port, "-STOP");
    }

    /// Continues a node [`pause`](Self::pause)d.
    pub fn resume(&self, port: u16) {
        self.signal(port, "-CONT");
    }

    fn signal(&self, port: u16, signal: &str) {
        let pid = {
            let nodes = self.nodes.lock().unwrap();
            let node = nodes.iter().find(|n| n.port == port).expect("a node of this cluster");
            node.child.as_ref().expect("a running node").id()
        };
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} (node :{port}) failed");
    }

    /// The replica of the primary serving `slot`.
    pub fn replica_of(&self, slot: u16) -> NodeInfo {
        let primary = self.primary_of(slot);
        self.nodes()
            .into_iter()
            .find(|n| !n.primary && n.primary_id.as_deref() == Some(primary.id.as_str()))
            .unwrap_or_else(|| panic!("no replica of the primary of slot {slot}"))
    }

    /// Waits until every replica of the primary on `port` acknowledged all
    /// its writes (`INFO replication`: each replica's `offset` at the
    /// primary's `master_repl_offset`).
    pub fn wait_for_replicas_of(&self, port: u16) {
        self.wait_until("the replicas caught up", Duration::from_secs(30), |c| {
            let Some(info) = c.try_cli(port, &["INFO", "replication"]) else {
                return false;
            };
            let field = |line: &str, name: &str| {
                line.split([',', ':'])
                    .find_map(|part| part.strip_prefix(name)?.strip_prefix('=').map(str::to_owned))
            };
            let master = info
                .lines()
                .find_map(|l| l.trim().strip_prefix("master_repl_offset:").map(str::to_owned));
            let replicas: Vec<&str> = info
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("ip="))
                .collect();
            master.is_some_and(|master| {
                !replicas.is_empty()
                    && replicas.iter().all(|l| {
                        field(l, "state").as_deref() == Some("online")
                            && field(l, "offset").as_deref() == Some(master.trim())
                    })
            })
        });
    }

    /// The id of a client of the node on `port` whose current command is
    /// `command` (a blocked `WAIT`, ...), waiting for one up to `timeout`.
    pub fn client_running(&self, port: u16, command: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let wanted = format!("cmd={command}");
        loop {
            if let Some(list) = self.try_cli(port, &["CLIENT", "LIST"])
                && let Some(id) = list.lines().find_map(|line| {
                    let mut fields = line.split(' ');
                    let id = fields.next()?.strip_prefix("id=")?;
                    line.split(' ').any(|f| f == wanted).then(|| id.to_owned())
                })
            {
                return id;
            }
            assert!(
                Instant::now() < deadline,
                "no client of :{port} running {command} within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The `calls` of `command` in `INFO commandstats` of the node on
    /// `port` (0 when it was not called since the last `CONFIG RESETSTAT`).
    pub fn calls(&self, port: u16, command: &str) -> u64 {
        let stats = self.cli(port, &["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        stats
            .lines()
            .find_map(|l| l.trim().strip_prefix(&prefix)?.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Starts moving `slot` to the primary on `to`: the slot is
    /// `MIGRATING` on its owner and `IMPORTING` on `to`, and no key is
    /// moved yet (clients get `ASK` for keys the owner does not hold).
    pub fn begin_migration(&self, slot: u16, to: u16) -> Migration {
        let nodes = self.nodes();
        let from = nodes
            .iter()
            .find(|n| n.primary && !n.failed && n.serves(slot))
            .expect("the slot's owner")
            .clone();
        let target = nodes.iter().find(|n| n.port == to).expect("the target node").clone();
        assert!(target.primary && target.port != from.port, "migrate to another primary");
        let slot_text = slot.to_string();
        self.cli(to, &["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &from.id]);
        self.cli(from.port, &["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &target.id]);
        Migration { slot, from, to: target }
    }

    /// Moves up to `count` keys of the migration's slot (`MIGRATE`); how
    /// many were moved.
    pub fn migrate_keys(&self, migration: &Migration, count: usize) -> usize {
        let slot = migration.slot.to_string();
        let listed = self.cli(
            migration.from.port,
            &["CLUSTER", "GETKEYSINSLOT", &slot, &count.to_string()],
        );
        let keys: Vec<&str> = listed.lines().filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            return 0;
        }
        let to_port = migration.to.port.to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
        args.extend(&keys);
        let out = self.cli(migration.from.port, &args);
        assert!(out.contains("OK") || out.contains("NOKEY"), "MIGRATE: {out}");
        keys.len()
    }

    /// Moves the remaining keys and gives the slot to the target, on every
    /// primary.
    pub fn finish_migration(&self, migration: Migration) {
        while self.migrate_keys(&migration, 100) > 0 {}
        let slot = migration.slot.to_string();
        self.cli(
            migration.to.port,
            &["CLUSTER", "SETSLOT", &slot, "NODE", &migration.to.id],
        );
        self.cli(
            migration.from.port,
            &["CLUSTER", "SETSLOT", &slot, "NODE", &migration.to.id],
        );
        for node in self.nodes().iter().filter(|n| n.primary && !n.failed) {
            let _ = self.try_cli(node.port, &["CLUSTER", "SETSLOT", &slot, "NODE", &migration.to.id]);
        }
        self.wait_until("every node sees the slot's new owner", Duration::from_secs(30), |c| {
            c.live_ports().iter().all(|&port| {
                c.try_nodes(port).is_some_and(|nodes| {
                    nodes
                        .iter()
                        .any(|n| n.id == migration.to.id && n.serves(migration.slot))
                })
            })
        });
    }

    /// A primary other than the one serving `slot`.
    pub fn other_primary(&self, slot: u16) -> u16 {
        self.nodes()
            .into_iter()
            .find(|n| n.primary && !n.failed && !n.serves(slot))
            .expect("another primary")
            .port
    }

    /// The data directory of the cluster.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// A private Valkey primary and its replica (one server, no cluster), for
/// `wait_for_replicas` on a single server.
pub struct ValkeyPair {
    pub primary: ChildServer,
    pub replica: ChildServer,
}

impl ValkeyPair {
    /// Both running, the replica in sync.
    pub fn start() -> ValkeyPair {
        let server = valkey_server();
        let command = |server: PathBuf, primary: Option<u16>| {
            move |port: u16, dir: &Path| {
                let mut command = Command::new(&server);
                command
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                    .args(["--appendonly", "no"]);
                if let Some(primary) = primary {
                    command.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
                }
                command.arg("--dir").arg(dir);
                command
            }
        };
        let primary = ChildServer::start("the private Valkey primary", command(server.clone(), None));
        let replica = ChildServer::start("the private Valkey replica", command(server, Some(primary.port)));
        let pair = ValkeyPair { primary, replica };
        pair.wait_for_sync();
        pair
    }

    /// Waits until the replica is connected to the primary and synced.
    pub fn wait_for_sync(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new("redis-cli")
                .args(["-p", &self.replica.port.to_string(), "INFO", "replication"])
                .output()
                .expect("run redis-cli");
            if String::from_utf8_lossy(&out.stdout).contains("master_link_status:up") {
                return;
            }
            assert!(Instant::now() < deadline, "the Valkey replica did not sync within 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A slot on its way from one primary to another.
pub struct Migration {
    pub slot: u16,
    pub from: NodeInfo,
    pub to: NodeInfo,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        let nodes = self.nodes.get_mut().unwrap_or_else(|e| e.into_inner());
        for node in nodes.iter_mut() {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if let Some(mut watchdog) = self.watchdog.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
    }
}
