//! The README's first command, `cargo run --example quickstart`, the
//! by-design example and the HTTP payments example: all run on embedded
//! SQLite and must prove their point.

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/examples/<name>`: cargo builds examples before it runs
/// the tests.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

fn run(name: &str) -> String {
    let output = Command::new(example(name))
        .output()
        .unwrap_or_else(|e| panic!("run example {name}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{name} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn quickstart_applies_each_payment_once() {
    let out = run("quickstart");
    assert!(out.contains("each payment was applied exactly once."), "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("payments in the table"))
        .expect("table line");
    assert!(line.trim_end().ends_with(" 60"), "{line}");
    let twice = out
        .lines()
        .find(|l| l.contains("orders charged twice"))
        .expect("table line");
    assert!(twice.trim_end().ends_with(" 0"), "{twice}");
}

#[test]
fn by_design_patterns_tolerate_repeats_and_reordering() {
    let out = run("by_design");
    assert!(out.contains("shipments in the table: 2"), "{out}");
    assert!(out.contains("final: Rua C, 3 (v3)"), "{out}");
}

#[test]
fn http_payments_charges_each_payment_once() {
    let out = run("http_payments");
    assert!(out.contains("proof: every payment was charged exactly once."), "{out}");
    assert!(out.contains("order A-1 of acme charged: 1"), "{out}");
    assert!(out.contains("same key, another amount: 422"), "{out}");
    assert!(
        out.contains("a later retry: 201 replayed=true identical to the first answer=true"),
        "{out}"
    );
    assert!(
        out.contains("another tenant, same key: 201 (globex's A-1 charged: 1)"),
        "{out}"
    );
}

/// The payment endpoint served by `http_payments --serve`, SIGKILLed while
/// a payment's handler runs (after its insert, before its commit), then
/// restarted on the same database: the client's retry with the same key
/// charges the order once, and the retry after that is a replay.
#[test]
fn http_payments_killed_mid_request_charges_once_after_the_retry() {
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("payments.db");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let serve = || {
        let child = Command::new(example("http_payments"))
            .args(["--serve", &addr, &db.display().to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start the server");
        let started = Instant::now();
        while TcpStream::connect(&addr).is_err() {
            assert!(started.elapsed() < Duration::from_secs(30), "the server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    };
    let pay = |key: &str| {
        Command::new("curl")
            .args([
                "-sS",
                "-i",
                "--max-time",
                "10",
                "-X",
                "POST",
                &format!("http://{addr}/payments"),
                "-H",
                &format!("Idempotency-Key: \"{key}\""),
                "-H",
                "X-Tenant: acme",
                "-H",
                "Content-Type: application/json",
                "-d",
                r#"{"order_id": "K-1", "amount": 700}"#,
            ])
            .output()
            .expect("curl")
    };
    let charged = || {
        let out = Command::new("curl")
            .args(["-sS", &format!("http://{addr}/payments/K-1"), "-H", "X-Tenant: acme"])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    let mut server = serve();
    // The handler sleeps 300 ms between its insert and the commit: the
    // server is killed in between.
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        server.kill().expect("SIGKILL the server");
        server.wait().expect("reap the server");
    });
    let cut = pay("kill-1");
    killer.join().expect("killer thread");
    let cut_out = String::from_utf8_lossy(&cut.stdout);
    assert!(
        !cut_out.starts_with("HTTP/1.1 201"),
        "the first request was answered before the kill: {cut_out}"
    );

    let mut server = serve();
    assert!(charged().contains(r#""charges":0"#), "the killed request committed");
    let retry = pay("kill-1");
    let retry_out = String::from_utf8_lossy(&retry.stdout).to_ascii_lowercase();
    assert!(retry_out.starts_with("http/1.1 201"), "{retry_out}");
    assert!(!retry_out.contains("idempotent-replayed"), "{retry_out}");
    let again = pay("kill-1");
    let again_out = String::from_utf8_lossy(&again.stdout).to_ascii_lowercase();
    assert!(again_out.contains("idempotent-replayed: true"), "{again_out}");
    assert!(charged().contains(r#""charges":1"#), "{}", charged());
    server.kill().expect("stop the server");
    server.wait().expect("reap the server");
}

/// An outside client in another language: Python `requests`, from a virtual
/// environment this test makes (with the system's packages; `requests` is
/// installed into it with pip when the system has none), against
/// `http_payments --serve` (`tests/python/http_client.py`).
#[test]
fn http_payments_answers_a_python_client() {
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().expect("temp dir");
    let venv = dir.path().join("venv");
    let made = Command::new("python3")
        .args(["-m", "venv", "--system-site-packages"])
        .arg(&venv)
        .status()
        .expect("python3 (to make a virtual environment)");
    assert!(made.success(), "python3 -m venv failed");
    let python = venv.join("bin").join("python");
    let has_requests = Command::new(&python)
        .args(["-c", "import requests"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_requests {
        let installed = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "requests"])
            .status()
            .expect("pip");
        assert!(installed.success(), "pip install requests failed");
    }

    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Command::new(example("http_payments"))
        .args(["--serve", &addr])
        .arg(dir.path().join("payments.db"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start the server");
    let started = Instant::now();
    while TcpStream::connect(&addr).is_err() {
        assert!(started.elapsed() < Duration::from_secs(30), "the server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/http_client.py");
    let output = Command::new(&python)
        .arg(script)
        .args([&format!("http://{addr}"), "py-key-1"])
        .output()
        .expect("run the Python client");
    server.kill().expect("stop the server");
    server.wait().expect("reap the server");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("python proof ok"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
