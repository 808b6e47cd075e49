//! TLS with certificate verification (feature `tls-rustls`) to PostgreSQL,
//! MySQL/MariaDB, Redis, RabbitMQ and NATS, on private servers the tests
//! start with a CA and a server certificate they make themselves (rcgen). The
//! machine's shared servers, which other tests use, are not touched.
//!
//! Each server accepts TLS only, and its certificate names `localhost` only.
//! So a handler that runs proves TLS is in use, and the refusals prove it is
//! verified: a client that does not trust the test CA, or that reaches the
//! server by a name the certificate does not carry, does not get in. All of
//! this in one process whose rustls has every driver's TLS compiled in, as an
//! application with all the runtime's features would (see the `lapin`
//! dependency in `idempotent-runtime/Cargo.toml` for why that matters).
//!
//! Needs the server binaries: PostgreSQL's `initdb` and `pg_ctl` under
//! `/usr/lib/postgresql/*/bin` (run through `runuser -u postgres` when the
//! tests run as root, as PostgreSQL refuses to run as root),
//! `mariadb-install-db` and `mariadbd`, `redis-server`, `nats-server`, and
//! `/usr/lib/rabbitmq/bin/rabbitmq-server`. A missing one fails its test with
//! a message saying which package to install.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions, MySqlSslMode};
use idempotent_runtime::sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use idempotent_runtime::sqlx::{self, ConnectOptions, PgConnection};
use idempotent_runtime::{MySqlStore, PgStore, RedisStore, idempotent};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// The only name the servers' certificates carry.
const SERVER_NAME: &str = "localhost";
/// How long a connection attempt may take before the test gives up on it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

// ---------------------------------------------------------------- certificates

/// A CA made for one test, and a server certificate it signed for
/// `localhost` only, all PEM.
struct TestPki {
    ca_pem: String,
    server_cert_pem: String,
    server_key_pem: String,
}

impl TestPki {
    fn new(ca_name: &str) -> Self {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, ca_name);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

        let mut server_params = CertificateParams::new(vec![SERVER_NAME.to_owned()]).unwrap();
        server_params.distinguished_name.push(DnType::CommonName, SERVER_NAME);
        server_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().unwrap();
        let server_cert = server_params.signed_by(&server_key, &ca).unwrap();

        TestPki {
            ca_pem: ca.pem(),
            server_cert_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
        }
    }
}

/// Asserts that `err` is rustls refusing the server's certificate for
/// `reason` (a `rustls::CertificateError` variant), as the drivers word it.
fn assert_certificate_refused(err: &(impl std::fmt::Debug + std::fmt::Display), reason: &str) {
    let debug = format!("{err:?}");
    let display = err.to_string();
    let refused = debug.contains("InvalidCertificate") || display.contains("invalid peer certificate");
    let for_reason = match reason {
        "NotValidForName" => debug.contains("NotValidForName") || display.contains("not valid for name"),
        _ => debug.contains(reason) || display.contains(reason),
    };
    assert!(
        refused && for_reason,
        "expected the certificate to be refused for {reason}, got: {display} ({debug})"
    );
    eprintln!("refused as expected ({reason}): {display}");
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn write_file(path: &Path, contents: &str) {
    fs::write(path, contents).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn is_root() -> bool {
    fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false)
}

/// Runs a command to completion; panics with its output when it fails or
/// cannot be started.
fn run(command: &mut Command, what: &str) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Waits up to `patience` until something listens on 127.0.0.1:`port`, or
/// panics with `log`.
fn wait_for_port(child: &mut Child, port: u16, patience: Duration, what: &str, log: &Path) {
    let deadline = Instant::now() + patience;
    loop {
        // Our child first: a port taken by someone else in the meantime
        // must not pass for our server listening.
        let exited = child.try_wait().unwrap();
        if exited.is_none() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if exited.is_some() || Instant::now() > deadline {
            panic!(
                "{what} did not start listening on 127.0.0.1:{port} ({}); its log:\n{}",
                exited.map_or(format!("still running after {patience:?}"), |s| format!("exited: {s}")),
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ------------------------------------------------------------------ PostgreSQL

/// A PostgreSQL cluster of its own, in a temporary directory, that accepts
/// host connections over TLS only (`hostssl` lines alone in `pg_hba.conf`).
/// Stopped (`pg_ctl stop -m immediate`) and removed on drop.
struct PrivatePostgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    ca_file: PathBuf,
    // Last: removed after the cluster is stopped.
    dir: tempfile::TempDir,
}

/// The newest PostgreSQL server binaries of the machine (Debian layout).
fn pg_bin_dir() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            (bin.join("initdb").exists() && bin.join("pg_ctl").exists()).then_some((version, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin: \
             install the `postgresql` package"
        ),
    }
}

/// The uid and gid of the `postgres` system user.
fn postgres_user() -> (u32, u32) {
    let passwd = fs::read_to_string("/etc/passwd").unwrap();
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres") && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .unwrap_or_else(|| panic!("no `postgres` user to run the private PostgreSQL cluster as (root may not)"))
}

/// `bin/program`, run as the `postgres` user when the tests run as root.
fn pg_command(bin: &Path, program: &str) -> Command {
    let program = bin.join(program);
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

impl PrivatePostgres {
    fn start(pki: &TestPki) -> Self {
        let bin = pg_bin_dir();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let owner = is_root().then(postgres_user);
        let chown = |path: &Path| {
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))
                    .unwrap_or_else(|e| panic!("chown {} to postgres: {e}", path.display()));
            }
        };
        chown(dir.path());

        let as_postgres = |program: &str| pg_command(&bin, program);
        run(
            as_postgres("initdb").arg("-D").arg(&data).args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ]),
            "initdb of the private PostgreSQL cluster",
        );

        // The server's certificate and key, readable by postgres alone (the
        // server refuses a key others can read).
        for (name, pem) in [
            ("server.crt", &pki.server_cert_pem),
            ("server.key", &pki.server_key_pem),
        ] {
            let path = data.join(name);
            write_file(&path, pem);
            chown(&path);
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        }
        let ca_file = dir.path().join("ca.crt");
        write_file(&ca_file, &pki.ca_pem);

        // Host connections over TLS only: no `host` or `hostnossl` line, so a
        // plaintext connection finds no entry and is refused.
        write_file(
            &data.join("pg_hba.conf"),
            "hostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n",
        );
        let port = free_port();
        let conf = format!(
            "\n# tests/tls.rs\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
             fsync = off\nmax_connections = 20\nshared_buffers = 16MB\n",
            dir.path().display()
        );
        let mut postgresql_conf = fs::read_to_string(data.join("postgresql.conf")).unwrap();
        postgresql_conf.push_str(&conf);
        write_file(&data.join("postgresql.conf"), &postgresql_conf);

        let log = dir.path().join("postgres.log");
        let started = as_postgres("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "30", "start"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run pg_ctl start: {e}"));
        assert!(
            started.status.success(),
            "the private PostgreSQL cluster on port {port} did not start ({}):\n{}\nlog:\n{}",
            started.status,
            String::from_utf8_lossy(&started.stderr),
            fs::read_to_string(&log).unwrap_or_default()
        );
        PrivatePostgres {
            bin,
            data,
            port,
            ca_file,
            dir,
        }
    }

    /// `postgres://postgres@<host>:<port>/postgres` with `query` appended.
    fn url(&self, host: &str, query: &str) -> String {
        format!("postgres://postgres@{host}:{}/postgres?{query}", self.port)
    }

    fn options(&self, host: &str, mode: PgSslMode) -> PgConnectOptions {
        PgConnectOptions::new()
            .host(host)
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .ssl_mode(mode)
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let stopped = pg_command(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "-t", "30", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !matches!(stopped, Ok(s) if s.success()) {
            eprintln!(
                "pg_ctl stop of the private cluster on port {} failed: {stopped:?}",
                self.port
            );
        }
    }
}

/// Connects once, within `CONNECT_TIMEOUT`.
async fn pg_connect(options: &PgConnectOptions) -> Result<PgConnection, sqlx::Error> {
    tokio::time::timeout(CONNECT_TIMEOUT, options.connect())
        .await
        .unwrap_or_else(|_| panic!("connecting to the private PostgreSQL timed out after {CONNECT_TIMEOUT:?}"))
}

/// Whether the session runs over TLS, and which version, as the server sees it.
async fn pg_session_tls(conn: &mut PgConnection) -> (bool, Option<String>) {
    sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

#[derive(Debug)]
struct Payment {
    message_id: String,
    order_id: String,
    amount: i64,
}

#[idempotent(key = "msg.message_id", store = store)]
async fn charge_over_tls(
    store: &PgStore,
    msg: &Payment,
    runs: &AtomicU32,
    tx: &mut PgConnection,
) -> Result<(), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query("INSERT INTO tls_payments (order_id, amount) VALUES ($1, $2)")
        .bind(&msg.order_id)
        .bind(msg.amount)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_verified_tls_commits_the_effect_once() {
    let pki = TestPki::new("idempotent tls test CA (postgres store)");
    let pg = PrivatePostgres::start(&pki);

    // The URL form of docs/operations.md ("TLS"): verify-full against the test CA.
    let url = pg.url(
        SERVER_NAME,
        &format!("sslmode=verify-full&sslrootcert={}", pg.ca_file.display()),
    );
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("verify-full connection to {url}: {e}\nserver log:\n{}", pg.log()));

    let mut conn = pool.acquire().await.unwrap();
    let (ssl, version) = pg_session_tls(&mut conn).await;
    assert!(ssl, "the server sees a TLS session");
    assert!(
        version.as_deref().is_some_and(|v| v.starts_with("TLSv1.")),
        "{version:?}"
    );
    drop(conn);

    let store = PgStore::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE tls_payments (order_id TEXT NOT NULL, amount BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();

    let msg = Payment {
        message_id: "tls-payment-1".to_owned(),
        order_id: "order-1".to_owned(),
        amount: 4200,
    };
    let runs = AtomicU32::new(0);
    charge_over_tls(&store, &msg, &runs).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the first delivery runs the body");
    charge_over_tls(&store, &msg, &runs).await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the redelivery is a duplicate: the body does not run"
    );

    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM tls_payments WHERE order_id = 'order-1'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(payments, 1, "one effect committed");
    let markers: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages WHERE message_id = $1")
        .bind(&msg.message_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(markers, 1, "one marker, committed with the effect");
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_plaintext_and_unverified_tls() {
    let pki = TestPki::new("idempotent tls test CA (postgres refusals)");
    let pg = PrivatePostgres::start(&pki);

    // The control: verify-full with the CA, by the certificate's name.
    let trusted = pg
        .options(SERVER_NAME, PgSslMode::VerifyFull)
        .ssl_root_cert_from_pem(pki.ca_pem.clone().into_bytes());
    let mut conn = pg_connect(&trusted)
        .await
        .unwrap_or_else(|e| panic!("verify-full with the test CA: {e}\nserver log:\n{}", pg.log()));
    assert!(pg_session_tls(&mut conn).await.0);

    // Plaintext: the server has no pg_hba.conf line for it.
    let err = pg_connect(&pg.options(SERVER_NAME, PgSslMode::Disable))
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("no pg_hba.conf entry") && message.contains("no encryption"),
        "plaintext refused by the server: {message}"
    );
    eprintln!("refused as expected (plaintext): {message}");

    // verify-full without the test CA: the system's roots do not know it.
    let err = pg_connect(&pg.options(SERVER_NAME, PgSslMode::VerifyFull))
        .await
        .unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");

    // verify-full with another CA (an impostor's server certificate would be
    // signed by that one; here: the real server's is not).
    let other = TestPki::new("some other CA");
    let err = pg_connect(
        &pg.options(SERVER_NAME, PgSslMode::VerifyFull)
            .ssl_root_cert_from_pem(other.ca_pem.into_bytes()),
    )
    .await
    .unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");

    // verify-full by a name the certificate does not carry (the same server
    // reached as 127.0.0.1): refused...
    let by_address = pg
        .options("127.0.0.1", PgSslMode::VerifyFull)
        .ssl_root_cert_from_pem(pki.ca_pem.clone().into_bytes());
    let err = pg_connect(&by_address).await.unwrap_err();
    assert_certificate_refused(&err, "NotValidForName");
    // ... while verify-ca, which checks the chain but not the name, accepts
    // it: the name check is what refused it above.
    let mut conn = pg_connect(&by_address.ssl_mode(PgSslMode::VerifyCa))
        .await
        .unwrap_or_else(|e| panic!("verify-ca to 127.0.0.1 with the test CA: {e}"));
    assert!(pg_session_tls(&mut conn).await.0);
}

// --------------------------------------------------------------- MySQL/MariaDB

/// A MariaDB server of its own (`mariadb-install-db` into a temporary
/// directory) with `require_secure_transport = ON`. Killed on drop.
struct PrivateMariaDb {
    port: u16,
    ca_file: PathBuf,
    child: Child,
    dir: tempfile::TempDir,
}

impl PrivateMariaDb {
    fn start(pki: &TestPki) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str| dir.path().join(name);
        write_file(&file("server.crt"), &pki.server_cert_pem);
        write_file(&file("server.key"), &pki.server_key_pem);
        write_file(&file("ca.crt"), &pki.ca_pem);
        let data = file("data");
        // A tmpdir of its own: a starting server deletes the `#sql*` files
        // it finds in its tmpdir, which in a shared /tmp are other servers'
        // temporary tables (the machine's MariaDB's, or another test's).
        let tmpdir = file("tmp");
        fs::create_dir(&tmpdir).unwrap();
        run(
            Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .arg(format!("--tmpdir={}", tmpdir.display()))
                .args([
                    "--user=root",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                ]),
            "mariadb-install-db of the private MariaDB server (install the `mariadb-server` package)",
        );
        let port = free_port();
        let log = file("mariadb.log");
        let mut child = Command::new("mariadbd")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--tmpdir={}", tmpdir.display()))
            .args(["--user=root", "--bind-address=127.0.0.1", "--skip-name-resolve"])
            .arg(format!("--port={port}"))
            .arg(format!("--socket={}", file("mariadb.sock").display()))
            .arg(format!("--pid-file={}", file("mariadb.pid").display()))
            .arg(format!("--log-error={}", log.display()))
            .arg(format!("--ssl-cert={}", file("server.crt").display()))
            .arg(format!("--ssl-key={}", file("server.key").display()))
            .arg(format!("--ssl-ca={}", file("ca.crt").display()))
            .args(["--require-secure-transport=ON", "--innodb-buffer-pool-size=16M"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mariadbd (install the `mariadb-server` package): {e}"));
        wait_for_port(
            &mut child,
            port,
            Duration::from_secs(30),
            "the private TLS MariaDB server",
            &log,
        );
        PrivateMariaDb {
            port,
            ca_file: file("ca.crt"),
            child,
            dir,
        }
    }

    fn options(&self, host: &str, mode: MySqlSslMode) -> MySqlConnectOptions {
        MySqlConnectOptions::new()
            .host(host)
            .port(self.port)
            .username("root")
            .ssl_mode(mode)
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("mariadb.log")).unwrap_or_default()
    }
}

impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn mysql_connect(options: &MySqlConnectOptions) -> Result<sqlx::MySqlConnection, sqlx::Error> {
    tokio::time::timeout(CONNECT_TIMEOUT, options.connect())
        .await
        .unwrap_or_else(|_| panic!("connecting to the private MariaDB timed out after {CONNECT_TIMEOUT:?}"))
}

#[idempotent(key = "msg.message_id", store = store)]
async fn charge_over_mysql_tls(
    store: &MySqlStore,
    msg: &Payment,
    runs: &AtomicU32,
    tx: &mut sqlx::MySqlConnection,
) -> Result<(), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query("INSERT INTO tls_payments (order_id, amount) VALUES (?, ?)")
        .bind(&msg.order_id)
        .bind(msg.amount)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_over_verified_tls_commits_the_effect_once_and_refuses_the_rest() {
    let pki = TestPki::new("idempotent tls test CA (mysql)");
    let db = PrivateMariaDb::start(&pki);

    // Trusted, by the certificate's name (retried while the server finishes
    // starting), then a database for the test.
    let trusted = db
        .options(SERVER_NAME, MySqlSslMode::VerifyIdentity)
        .ssl_ca_from_pem(pki.ca_pem.clone().into_bytes());
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut conn = loop {
        match mysql_connect(&trusted).await {
            Ok(conn) => break conn,
            Err(e) if Instant::now() < deadline => {
                eprintln!("VERIFY_IDENTITY with the test CA, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("VERIFY_IDENTITY with the test CA: {e}\nserver log:\n{}", db.log()),
        }
    };
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(!cipher.is_empty(), "the server sees a TLS session");
    let required: i64 = sqlx::query_scalar("SELECT @@require_secure_transport")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(required, 1, "the server refuses plaintext");
    sqlx::query("CREATE DATABASE app").execute(&mut conn).await.unwrap();

    // Refused: plaintext (the server requires secure transport), the
    // system's roots only, another CA, a name the certificate lacks.
    let err = mysql_connect(&db.options(SERVER_NAME, MySqlSslMode::Disabled))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("Access denied") || err.to_string().contains("insecure transport"),
        "plaintext refused by the server: {err}"
    );
    eprintln!("refused as expected (plaintext): {err}");
    let err = mysql_connect(&db.options(SERVER_NAME, MySqlSslMode::VerifyIdentity))
        .await
        .unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");
    let other = TestPki::new("some other CA");
    let err = mysql_connect(
        &db.options(SERVER_NAME, MySqlSslMode::VerifyIdentity)
            .ssl_ca_from_pem(other.ca_pem.into_bytes()),
    )
    .await
    .unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");
    let err = mysql_connect(
        &db.options("127.0.0.1", MySqlSslMode::VerifyIdentity)
            .ssl_ca_from_pem(pki.ca_pem.clone().into_bytes()),
    )
    .await
    .unwrap_err();
    assert_certificate_refused(&err, "NotValidForName");

    // The URL form of docs/operations.md ("TLS"), and an idempotent handler on it.
    let url = format!(
        "mysql://root@{SERVER_NAME}:{}/app?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        db.port,
        db.ca_file.display()
    );
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let store = MySqlStore::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE tls_payments (order_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let msg = Payment {
        message_id: "tls-payment-1".to_owned(),
        order_id: "order-1".to_owned(),
        amount: 4200,
    };
    let runs = AtomicU32::new(0);
    charge_over_mysql_tls(&store, &msg, &runs).await.unwrap();
    charge_over_mysql_tls(&store, &msg, &runs).await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the redelivery is a duplicate: the body does not run"
    );
    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM tls_payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(payments, 1, "one effect committed");
    pool.close().await;
}

// ----------------------------------------------------------------------- Redis

/// A `redis-server` of its own that listens with TLS only (`--port 0`).
/// Killed on drop.
struct PrivateRedis {
    port: u16,
    ca_pem: String,
    child: Child,
    _dir: tempfile::TempDir,
}

impl PrivateRedis {
    fn start(pki: &TestPki) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca) = (
            dir.path().join("server.crt"),
            dir.path().join("server.key"),
            dir.path().join("ca.crt"),
        );
        write_file(&cert, &pki.server_cert_pem);
        write_file(&key, &pki.server_key_pem);
        write_file(&ca, &pki.ca_pem);
        let log = dir.path().join("redis.log");
        let port = free_port();
        let mut child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "-::1",
            ])
            .arg("--tls-cert-file")
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&key)
            .arg("--tls-ca-cert-file")
            .arg(&ca)
            .args(["--tls-auth-clients", "no", "--save", "", "--appendonly", "yes"])
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server (install the `redis-server` package): {e}"));
        wait_for_port(
            &mut child,
            port,
            Duration::from_secs(15),
            "the private TLS redis-server",
            &log,
        );
        PrivateRedis {
            port,
            ca_pem: pki.ca_pem.clone(),
            child,
            _dir: dir,
        }
    }

    fn url(&self, scheme: &str, host: &str) -> String {
        format!("{scheme}://{host}:{}/", self.port)
    }

    /// A client that trusts the test CA (and only it).
    fn trusting_client(&self, host: &str) -> idempotent_runtime::redis::Client {
        idempotent_runtime::redis::Client::build_with_tls(
            self.url("rediss", host),
            idempotent_runtime::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(self.ca_pem.clone().into_bytes()),
            },
        )
        .unwrap()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Opens one connection within `CONNECT_TIMEOUT`.
async fn redis_connect(
    client: &idempotent_runtime::redis::Client,
) -> Result<idempotent_runtime::redis::aio::MultiplexedConnection, idempotent_runtime::redis::RedisError> {
    tokio::time::timeout(CONNECT_TIMEOUT, client.get_multiplexed_async_connection())
        .await
        .unwrap_or_else(|_| panic!("connecting to the private redis-server timed out after {CONNECT_TIMEOUT:?}"))
}

#[idempotent(key = "id", store = store)]
async fn note_over_tls(store: &RedisStore, id: &str, runs: &AtomicU32) -> Result<u32, AppError> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_verified_tls_runs_the_handler_once() {
    let pki = TestPki::new("idempotent tls test CA (redis store)");
    let redis = PrivateRedis::start(&pki);

    let config = idempotent_runtime::redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(Duration::from_secs(5)))
        .set_number_of_retries(2);
    let manager = tokio::time::timeout(
        CONNECT_TIMEOUT * 2,
        redis
            .trusting_client(SERVER_NAME)
            .get_connection_manager_with_config(config),
    )
    .await
    .expect("connection manager over TLS timed out")
    .expect("connection manager over TLS with the test CA");
    let store = RedisStore::new(manager);

    let runs = AtomicU32::new(0);
    assert_eq!(
        note_over_tls(&store, "tls-msg-1", &runs).await.unwrap(),
        1,
        "the first delivery runs the body"
    );
    assert_eq!(
        note_over_tls(&store, "tls-msg-1", &runs).await.unwrap(),
        1,
        "the redelivery replays the first result"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refuses_plaintext_and_unverified_tls() {
    let pki = TestPki::new("idempotent tls test CA (redis refusals)");
    let redis = PrivateRedis::start(&pki);

    // The control: the test CA, the certificate's name.
    let mut conn = redis_connect(&redis.trusting_client(SERVER_NAME))
        .await
        .expect("rediss:// with the test CA");
    let pong: String = idempotent_runtime::redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pong, "PONG");

    // rediss:// trusting the system's roots only: the test CA is unknown.
    let untrusting = idempotent_runtime::redis::Client::open(redis.url("rediss", SERVER_NAME)).unwrap();
    let err = redis_connect(&untrusting).await.unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");

    // Another CA.
    let other = TestPki::new("some other CA");
    let wrong_ca = idempotent_runtime::redis::Client::build_with_tls(
        redis.url("rediss", SERVER_NAME),
        idempotent_runtime::redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(other.ca_pem.into_bytes()),
        },
    )
    .unwrap();
    let err = redis_connect(&wrong_ca).await.unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");

    // The same server by a name its certificate does not carry.
    let err = redis_connect(&redis.trusting_client("127.0.0.1")).await.unwrap_err();
    assert_certificate_refused(&err, "NotValidForName");

    // Plaintext to the TLS port gets no answer to its commands.
    let plain = idempotent_runtime::redis::Client::open(redis.url("redis", SERVER_NAME)).unwrap();
    let plaintext = tokio::time::timeout(Duration::from_secs(3), async {
        let mut conn = plain.get_multiplexed_async_connection().await?;
        idempotent_runtime::redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
    })
    .await;
    assert!(
        !matches!(plaintext, Ok(Ok(_))),
        "a plaintext PING must not be answered: {plaintext:?}"
    );
    eprintln!("refused as expected (plaintext): {plaintext:?}");
}

// ------------------------------------------------------------------------ NATS

/// A `nats-server` of its own, with JetStream, that requires TLS. Killed on
/// drop.
struct PrivateNats {
    port: u16,
    ca_file: PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl PrivateNats {
    fn start(pki: &TestPki) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca_file) = (
            dir.path().join("server.crt"),
            dir.path().join("server.key"),
            dir.path().join("ca.crt"),
        );
        write_file(&cert, &pki.server_cert_pem);
        write_file(&key, &pki.server_key_pem);
        write_file(&ca_file, &pki.ca_pem);
        let log = dir.path().join("nats.log");
        let port = free_port();
        let mut child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "--tls"])
            .arg("--tlscert")
            .arg(&cert)
            .arg("--tlskey")
            .arg(&key)
            .arg("-js")
            .arg("-sd")
            .arg(dir.path().join("jetstream"))
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start nats-server (install the `nats-server` package): {e}"));
        wait_for_port(
            &mut child,
            port,
            Duration::from_secs(15),
            "the private TLS nats-server",
            &log,
        );
        PrivateNats {
            port,
            ca_file,
            child,
            _dir: dir,
        }
    }

    fn url(&self, host: &str) -> String {
        format!("tls://{host}:{}", self.port)
    }

    /// Connects once (no retry), within `CONNECT_TIMEOUT`.
    async fn connect(
        &self,
        host: &str,
        options: idempotent_runtime::async_nats::ConnectOptions,
    ) -> Result<idempotent_runtime::async_nats::Client, idempotent_runtime::async_nats::ConnectError> {
        tokio::time::timeout(
            CONNECT_TIMEOUT * 2,
            options
                .connection_timeout(CONNECT_TIMEOUT)
                .require_tls(true)
                .connect(self.url(host)),
        )
        .await
        .unwrap_or_else(|_| panic!("connecting to the private nats-server timed out"))
    }

    fn trusting(&self) -> idempotent_runtime::async_nats::ConnectOptions {
        idempotent_runtime::async_nats::ConnectOptions::new().add_root_certificates(self.ca_file.clone())
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Note {
    id: String,
}

#[idempotent(key = "note.id", store = store)]
async fn note_seen(store: &idempotent_runtime::MemoryStore, note: &Note, runs: &AtomicU32) -> Result<(), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Runs `consumer`, whose queue holds one note published twice, with the
/// idempotent [`note_seen`] on a `MemoryStore` of its own until both
/// deliveries are acked (15 s at most): none dead-lettered, the body ran
/// once.
async fn the_note_published_twice_runs_once<B: idempotent_runtime::broker::pipeline::Broker>(
    consumer: idempotent_runtime::broker::Consumer<B>,
) {
    use idempotent_runtime::broker::CancellationToken;
    use std::sync::Arc;

    let stats = consumer.stats();
    let store = idempotent_runtime::MemoryStore::new();
    let runs = Arc::new(AtomicU32::new(0));
    let shutdown = CancellationToken::new();
    let handler_runs = Arc::clone(&runs);
    let run = tokio::spawn(consumer.run(
        move |note: Note| {
            let (store, runs) = (store.clone(), Arc::clone(&handler_runs));
            async move { note_seen(&store, &note, &runs).await }
        },
        shutdown.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(15);
    while stats.snapshot().acked < 2 {
        assert!(
            Instant::now() < deadline,
            "both deliveries acked within 15 s: {:?}",
            stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let totals = run.await.unwrap().unwrap();
    assert_eq!(totals.acked, 2, "{totals:?}");
    assert_eq!(totals.dead_lettered, 0, "{totals:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the duplicate did not run the body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_consumer_over_verified_tls() {
    use idempotent_runtime::async_nats::jetstream::{self, consumer::pull, stream};
    use idempotent_runtime::nats::JetStreamConsumer;

    let pki = TestPki::new("idempotent tls test CA (nats)");
    let nats = PrivateNats::start(&pki);

    // The server announces that it requires TLS, before any client speaks.
    // (A server still starting under load has reset this first connection
    // once in a full test run: a few attempts.)
    let mut info = [0u8; 4096];
    let mut attempts = 0;
    let n = loop {
        attempts += 1;
        let mut raw = match std::net::TcpStream::connect(("127.0.0.1", nats.port)) {
            Ok(raw) => raw,
            // The server may still be binding its port.
            Err(_) if attempts < 5 => {
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
            Err(err) => panic!("the private nats-server refused {attempts} connections: {err}"),
        };
        raw.set_read_timeout(Some(CONNECT_TIMEOUT)).unwrap();
        match std::io::Read::read(&mut raw, &mut info) {
            Ok(n) if n > 0 => break n,
            Ok(_) | Err(_) if attempts < 5 => std::thread::sleep(Duration::from_millis(200)),
            other => panic!("no INFO from the private nats-server after {attempts} attempts: {other:?}"),
        }
    };
    let info = String::from_utf8_lossy(&info[..n]);
    assert!(
        info.starts_with("INFO ") && info.contains("\"tls_required\":true"),
        "{info}"
    );

    // Refused: the system's roots only (the test CA is unknown), and the
    // certificate's name not matching the address dialled.
    let err = nats
        .connect(SERVER_NAME, idempotent_runtime::async_nats::ConnectOptions::new())
        .await
        .unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");
    let err = nats.connect("127.0.0.1", nats.trusting()).await.unwrap_err();
    assert_certificate_refused(&err, "NotValidForName");

    // Trusting the test CA: a JetStream consumer runs an idempotent handler
    // on a message published twice; the body runs once, both are acked.
    let client = nats
        .connect(SERVER_NAME, nats.trusting())
        .await
        .unwrap_or_else(|e| panic!("tls:// with the test CA: {e}"));
    let js = jetstream::new(client);
    for (name, subject) in [("NOTES", "notes"), ("NOTES_DLQ", "notes.dlq")] {
        js.create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            storage: stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let pull = js
        .get_stream("NOTES")
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some("notes".to_owned()),
            ..Default::default()
        })
        .await
        .unwrap();
    let body = serde_json::to_vec(&Note {
        id: "tls-note-1".to_owned(),
    })
    .unwrap();
    for _ in 0..2 {
        js.publish("notes", body.clone().into()).await.unwrap().await.unwrap();
    }

    let consumer = JetStreamConsumer::builder(js.clone(), pull)
        .dead_letter_subject("notes.dlq")
        .fetch_expiry(Duration::from_millis(200))
        .build()
        .unwrap();
    the_note_published_twice_runs_once(consumer).await;
}

// -------------------------------------------------------------------- RabbitMQ

/// The RabbitMQ server script of the Debian package (the `/usr/sbin` wrapper
/// would switch to the `rabbitmq` user and its shared data directory).
const RABBITMQ_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// A RabbitMQ node of its own (own node name, ports, data, cookie and no
/// plugins), listening with TLS only. Its process group is killed on drop.
struct PrivateRabbit {
    port: u16,
    ca_pem: String,
    child: Child,
    dir: tempfile::TempDir,
}

impl PrivateRabbit {
    fn start(pki: &TestPki) -> Self {
        assert!(
            Path::new(RABBITMQ_SERVER).exists(),
            "{RABBITMQ_SERVER} not found: install the `rabbitmq-server` package"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str| dir.path().join(name);
        write_file(&file("server.crt"), &pki.server_cert_pem);
        write_file(&file("server.key"), &pki.server_key_pem);
        write_file(&file("ca.crt"), &pki.ca_pem);
        write_file(&file("enabled_plugins"), "[].\n");
        let port = free_port();
        write_file(
            &file("rabbitmq.conf"),
            &format!(
                "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\n\
                 ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n",
                file("ca.crt").display(),
                file("server.crt").display(),
                file("server.key").display()
            ),
        );
        let log = file("rabbitmq.out");
        let out = fs::File::create(&log).unwrap();
        let node = format!("idempotent_tls_{}_{port}@localhost", std::process::id());
        let mut child = Command::new(RABBITMQ_SERVER)
            .current_dir(dir.path())
            .env("HOME", dir.path()) // its own Erlang cookie
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_CONFIG_FILE", file("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", file("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", file("mnesia"))
            .env("RABBITMQ_LOG_BASE", file("log"))
            .env("RABBITMQ_PID_FILE", file("rabbitmq.pid"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            // Its own process group, so that drop ends the node's whole tree.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {RABBITMQ_SERVER}: {e}"));
        // A node boots in about 6 s on an idle 2-core machine.
        wait_for_port(
            &mut child,
            port,
            Duration::from_secs(60),
            "the private TLS RabbitMQ node",
            &log,
        );
        PrivateRabbit {
            port,
            ca_pem: pki.ca_pem.clone(),
            child,
            dir,
        }
    }

    fn url(&self, scheme: &str, host: &str) -> String {
        format!("{scheme}://guest:guest@{host}:{}/%2f", self.port)
    }

    /// Connects once with `ca_pem` as extra trusted roots, within `CONNECT_TIMEOUT`.
    async fn connect(
        &self,
        url: &str,
        ca_pem: Option<String>,
    ) -> Result<idempotent_runtime::lapin::Connection, idempotent_runtime::lapin::Error> {
        let tls = idempotent_runtime::lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: ca_pem,
        };
        tokio::time::timeout(
            CONNECT_TIMEOUT,
            idempotent_runtime::lapin::Connection::connect_with_config(
                url,
                idempotent_runtime::lapin::ConnectionProperties::default(),
                tls,
                idempotent_runtime::lapin::runtime::default_runtime().unwrap(),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("connecting to the private RabbitMQ node timed out"))
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        // The group of the script started above: the script, the Erlang VM
        // and its helpers (epmd, shared with the machine's node, runs
        // detached from it and stays).
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_consumer_over_verified_tls() {
    use idempotent_runtime::lapin::BasicProperties;
    use idempotent_runtime::lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
    use idempotent_runtime::lapin::types::FieldTable;
    use idempotent_runtime::rabbitmq::RabbitConsumer;

    let pki = TestPki::new("idempotent tls test CA (rabbitmq)");
    let rabbit = PrivateRabbit::start(&pki);

    // Trusting the test CA, by the certificate's name. Retried while the
    // node finishes booting (its listener opens shortly before it is ready).
    let trusted_url = rabbit.url("amqps", SERVER_NAME);
    let deadline = Instant::now() + Duration::from_secs(30);
    let connection = loop {
        match rabbit.connect(&trusted_url, Some(rabbit.ca_pem.clone())).await {
            Ok(connection) => break connection,
            Err(e) if Instant::now() < deadline => {
                eprintln!("amqps:// with the test CA, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!(
                "amqps:// with the test CA: {e}\nnode output:\n{}",
                fs::read_to_string(rabbit.dir.path().join("rabbitmq.out")).unwrap_or_default()
            ),
        }
    };

    // Refused: the system's roots only, and the wrong name.
    let err = rabbit
        .connect(&rabbit.url("amqps", SERVER_NAME), None)
        .await
        .unwrap_err();
    assert_certificate_refused(&err, "UnknownIssuer");
    let err = rabbit
        .connect(&rabbit.url("amqps", "127.0.0.1"), Some(rabbit.ca_pem.clone()))
        .await
        .unwrap_err();
    assert_certificate_refused(&err, "NotValidForName");
    // Plaintext AMQP to the TLS listener does not get a connection.
    let plain = rabbit.connect(&rabbit.url("amqp", SERVER_NAME), None).await;
    assert!(plain.is_err(), "plaintext AMQP must be refused");
    eprintln!("refused as expected (plaintext): {:?}", plain.err());

    // A RabbitMQ consumer of its own over `amqps://`, trusting the test CA,
    // runs an idempotent handler on a message published twice (over the
    // trusted admin connection); the body runs once, both are acked.
    let admin = connection.create_channel().await.unwrap();
    admin
        .queue_declare("notes".into(), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .unwrap();
    admin.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let body = serde_json::to_vec(&Note {
        id: "tls-note-1".to_owned(),
    })
    .unwrap();
    for _ in 0..2 {
        let confirm = admin
            .basic_publish(
                "".into(),
                "notes".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await
            .unwrap();
        assert!(confirm.await.unwrap().is_ack());
    }

    let consumer = RabbitConsumer::builder(trusted_url.clone(), "notes")
        .tls_config(idempotent_runtime::lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: Some(rabbit.ca_pem.clone()),
        })
        .build()
        .unwrap();
    the_note_published_twice_runs_once(consumer).await;
}
