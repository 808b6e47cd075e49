//! The `Idempotency-Key` layer's cost (issue 29): requests per second and
//! p50/p99 latency of one handler (one `INSERT`) served by axum on
//! 127.0.0.1 to a reqwest client with 1 and 16 connections, side by side in
//! one run:
//!
//! - (a) without the layer (the insert on a pool connection, autocommit);
//! - (b) with the layer, a fresh key per request (claim, insert in the
//!   claim's transaction, kept answer, commit);
//! - (c) with the layer, retries of keys already answered (replays);
//! - (h) without the layer, (b)'s transaction written by hand (the key's
//!   row, the insert, the answer, one commit): the bound of (b);
//! - (a2) (a) again: the A/A control, for the run's noise.
//!
//! On PostgreSQL and on SQLite (a file in a temporary directory). Each
//! repetition runs every variant once per database and connection count,
//! interleaved; the table gives the median rate of the repetitions, the
//! ratios of medians, and the percentiles of all their requests. The client
//! runs in the server's process, on the same cores: what it costs is in
//! every variant alike.
//!
//! `cargo bench --bench http -- [reps] [seconds per run] [pg|sqlite|both]`
//! (defaults 5, 1.0 and both).

#[path = "http/rig.rs"]
mod rig;

use std::time::Duration;

use rig::{Db, Rig, Sample, Variant};

const CONNECTIONS: [usize; 2] = [1, 16];

/// (a), (b), (c), (h), (a2), as run and printed.
const VARIANTS: [Variant; 5] = [
    Variant::Bare,
    Variant::Fresh,
    Variant::Replay,
    Variant::Hand,
    Variant::Bare,
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let at = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    sorted[at].as_secs_f64() * 1000.0
}

/// Every repetition of one variant at one connection count.
#[derive(Default)]
struct Runs {
    rates: Vec<f64>,
    latencies: Vec<Duration>,
}

impl Runs {
    fn add(&mut self, sample: Sample) {
        self.rates.push(sample.per_sec);
        self.latencies.extend(sample.latencies);
    }
    /// Median rate, p50 and p99 in milliseconds.
    fn summary(mut self) -> (f64, f64, f64) {
        self.latencies.sort();
        (
            median(self.rates),
            percentile(&self.latencies, 0.50),
            percentile(&self.latencies, 0.99),
        )
    }
}

/// The table rows of `db`: every repetition interleaved.
async fn measure<D: Db>(db: D, reps: usize, secs: f64) -> Vec<String> {
    let name = db.name();
    let rig = Rig::start(db).await;
    let keys = rig.answered_keys(256).await;
    // Warm the pools and the server up.
    for variant in VARIANTS {
        rig.run(variant, 16, secs / 4.0, &keys).await;
    }
    let mut runs: Vec<Vec<Runs>> = CONNECTIONS
        .iter()
        .map(|_| VARIANTS.iter().map(|_| Runs::default()).collect())
        .collect();
    for _ in 0..reps {
        for (c, connections) in CONNECTIONS.into_iter().enumerate() {
            for (v, variant) in VARIANTS.into_iter().enumerate() {
                runs[c][v].add(rig.run(variant, connections, secs, &keys).await);
            }
        }
    }
    let rows_written = rig.db.rows().await;
    rig.stop().await;
    eprintln!("{name}: {rows_written} rows inserted");
    CONNECTIONS
        .into_iter()
        .zip(runs)
        .map(|(connections, runs)| {
            let s: Vec<(f64, f64, f64)> = runs.into_iter().map(Runs::summary).collect();
            let (a, b, c, h, a2) = (s[0], s[1], s[2], s[3], s[4]);
            format!(
                "| {name} | {connections} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} / {:.2} / {:.2} / {:.2} | {:.2} / {:.2} / {:.2} / {:.2} |",
                a.0,
                b.0,
                c.0,
                h.0,
                a2.0,
                b.0 / a.0,
                c.0 / a.0,
                b.0 / h.0,
                a2.0 / a.0,
                a.1,
                b.1,
                c.1,
                h.1,
                a.2,
                b.2,
                c.2,
                h.2
            )
        })
        .collect()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with('-'));
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1.0);
    let which = args.next().unwrap_or_else(|| "both".into());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{reps} interleaved repetitions of {secs} s per variant and connection count; load average at the start: {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let mut rows = Vec::new();
    if which != "sqlite" {
        let pg = rig::Pg::connect(20).await.expect("PostgreSQL at 127.0.0.1:5432");
        rows.extend(measure(pg, reps, secs).await);
    }
    if which != "pg" {
        let lite = rig::Lite::open().await.expect("a SQLite file");
        rows.extend(measure(lite, reps, secs).await);
    }
    println!(
        "| database | connections | (a) no layer req/s | (b) layer, fresh keys req/s | (c) layer, replays req/s | (h) by hand, fresh keys req/s | (a2) A/A req/s | b/a | c/a | b/h | a2/a | p50 ms a / b / c / h | p99 ms a / b / c / h |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in rows {
        println!("{row}");
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "load average at the end: {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
}
