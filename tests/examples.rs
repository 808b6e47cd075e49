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
