//! The README's first command, `cargo run --example quickstart`, and the
//! by-design example: both run on embedded SQLite and must prove their point.

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
