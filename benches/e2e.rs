//! End to end (issue 32): what `#[idempotent]` costs a real consumer on each
//! broker (RabbitMQ, NATS JetStream, Redis Streams, Kafka), writing to
//! PostgreSQL, side by side in one run:
//!
//! - (a) a consumer without idempotency: the effect in a transaction of its
//!   own per message, acknowledged after the commit;
//! - (s) the bound of (b): idempotency by hand with one statement more
//!   than (a) in the same transaction (a plain claim of the key);
//! - (b) the idempotent consumer, one transaction per message;
//! - (d) Kafka only: (b) with the offsets in the database
//!   (`offsets_in(store)`);
//! - (c) the same handler with the consumer's batch transactions (`cN`:
//!   batches of at most N, each message under a savepoint; `c` is 32;
//!   `oN`: the same without savepoints, `batch_savepoints(false)`; `dN`:
//!   Kafka's offsets in the database, batched; a suffix `wM`, e.g.
//!   `c32w5`: `batch_wait` of M ms instead of the builder's default);
//!
//! at each number of handler slots (on Kafka, partitions: one lane each)
//! and share of duplicates, from a queue filled beforehand (the drain rate,
//! from the first delivery to the last acknowledgement) and at a steady
//! publish rate of half of (a)'s drain rate (publish-to-acknowledgement
//! latency, p50 and p99, from the consumer's first delivery on). The
//! variants run interleaved, each on a fresh queue; the ratios b/a and c/a
//! are the medians of each repetition's own ratios. CPU per message: the
//! consumer process(es), PostgreSQL's processes, the broker's server.
//!
//! ```text
//! cargo bench --bench e2e                      # every broker, slots 1,4,16, 0 and 20 % duplicates
//! cargo bench --bench e2e -- --quick           # 500 messages, slots 4, one repetition
//! cargo bench --bench e2e -- --brokers=rabbitmq,nats,redis-streams,kafka --slots=4,16 --dups=0,20
//!                           --variants=a,s,b,d,c8,c32,o32,c32w0,d32 --messages=4000 --reps=3 --no-steady
//!                           --out=FILE.md --svg=FILE.svg
//! cargo bench --bench e2e -- --processes=4     # 4 competing consumer processes, drain rates summed (no steady runs)
//! cargo bench --bench e2e -- --no-drain --steady-rate=300 --variants=a,b,c32,c32w5   # latency at a rate of your choice
//! IDEMPOTENT_BENCH_LOG=debug cargo bench --bench e2e -- ...   # the library's (and clients') events on stderr
//! IDEMPOTENT_BENCH_KAFKA_ORDER=key cargo bench --bench e2e -- --brokers=kafka --variants=a,b,c32,o32   # Kafka in key order
//! ```
//!
//! Needs the services of `.ci/run` (PostgreSQL, RabbitMQ, NATS JetStream,
//! Redis); Kafka is a private Tansu broker (`.ci/kafka`) started for the
//! run. Every queue, stream and table is fresh and removed at the end.
//! The report is markdown (a table per broker, then the summary of the
//! README), `--svg` the bar chart of `docs/benchmarks.md`.

#[path = "e2e/brokers.rs"]
mod brokers;
#[path = "e2e/procs.rs"]
mod procs;
#[path = "e2e/run.rs"]
mod run;
// The Tansu broker of the Kafka tests (`common::kafka::Kafka`).
#[path = "../tests/common/mod.rs"]
mod common;
// The bar charts of `benches/throughput.rs` (`report::bar_chart` of
// `harness::Cell`s).
#[allow(dead_code)]
#[path = "throughput/harness.rs"]
mod harness;
#[allow(dead_code)]
#[path = "throughput/report.rs"]
mod report;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Instant;

use brokers::{BoxError, Kind};
use run::{Env, Feed, Sample, Variant, percentile};

#[path = "shared/unique.rs"]
mod names;
pub use names::unique;

struct Args {
    brokers: Vec<Kind>,
    slots: Vec<usize>,
    dups: Vec<u32>,
    variants: Vec<Variant>,
    messages: usize,
    reps: usize,
    steady: bool,
    steady_secs: f64,
    /// A fixed steady rate instead of half of (a)'s drain rate.
    steady_rate: Option<f64>,
    drain: bool,
    out: Option<String>,
    svg: Option<String>,
    processes: usize,
}

fn list<T>(value: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, BoxError> {
    value
        .split(',')
        .map(|v| parse(v.trim()).ok_or_else(|| format!("cannot read `{v}` in `{value}`").into()))
        .collect()
}

fn args() -> Result<Args, BoxError> {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut args = Args {
        brokers: Kind::ALL.to_vec(),
        slots: if quick { vec![4] } else { vec![1, 4, 16] },
        dups: vec![0, 20],
        variants: ["a", "s", "b", "d", "c32", "o32", "d32"]
            .into_iter()
            .filter_map(Variant::parse)
            .collect(),
        messages: if quick { 500 } else { 4000 },
        reps: if quick { 1 } else { 3 },
        steady: true,
        steady_secs: if quick { 1.0 } else { 3.0 },
        steady_rate: None,
        drain: true,
        out: None,
        svg: None,
        processes: 1,
    };
    for arg in std::env::args().skip(1) {
        let (key, value) = arg.split_once('=').unwrap_or((arg.as_str(), ""));
        match key {
            "--brokers" => {
                args.brokers = list(value, |v| Kind::ALL.into_iter().find(|k| k.name() == v))?;
            }
            "--slots" => args.slots = list(value, |v| v.parse().ok().filter(|&s| s > 0))?,
            "--dups" => args.dups = list(value, |v| v.parse().ok().filter(|&d| d < 100))?,
            "--variants" => args.variants = list(value, Variant::parse)?,
            "--messages" => args.messages = value.parse()?,
            "--reps" => args.reps = value.parse()?,
            "--steady-secs" => args.steady_secs = value.parse()?,
            "--no-steady" => args.steady = false,
            "--steady-rate" => args.steady_rate = Some(value.parse::<f64>()?.max(1.0)),
            "--no-drain" => args.drain = false,
            "--out" => args.out = Some(value.to_owned()),
            "--svg" => args.svg = Some(value.to_owned()),
            "--processes" => args.processes = value.parse::<usize>()?.max(1),
            "--quick" | "--bench" => {}
            other => return Err(format!("unknown argument `{other}` (see the top of benches/e2e.rs)").into()),
        }
    }
    if args.processes > 1 {
        // Steady runs measure one consumer's latency.
        args.steady = false;
    }
    if !args.drain && (args.steady_rate.is_none() || !args.steady) {
        return Err("--no-drain needs --steady-rate=R (the steady rate is otherwise half of (a)'s drain rate)".into());
    }
    if !args.variants.contains(&Variant::Plain) {
        return Err("the variants must include `a`: the ratios and the steady rate are taken against it".into());
    }
    Ok(args)
}

/// The medians of one cell's repetitions.
#[derive(Default)]
struct Cell {
    rates: HashMap<String, Vec<f64>>,
    cpu: HashMap<String, Vec<(f64, f64, f64)>>,
    steady: HashMap<String, Vec<u64>>,
    steady_batch: HashMap<String, f64>,
    steady_rate: f64,
}

/// One broker's part of the run: its variants' labels and its cells (by
/// slots and share of duplicates).
type Ran = (Kind, Vec<String>, Vec<((usize, u32), Cell)>);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Checks that a run settled every message and applied each the right
/// number of times: all of them for (a), once per distinct id otherwise.
fn check(label: &str, variant: Variant, sample: &Sample, n: usize) -> Result<(), BoxError> {
    let (rows, distinct) = sample.effects;
    let expected = if variant == Variant::Plain { n } else { sample.distinct };
    if sample.dead_lettered != 0
        || sample.acked != n as u64
        || rows != expected as i64
        || distinct != sample.distinct as i64
    {
        return Err(format!(
            "{label}: {rows} effect rows ({distinct} distinct) for {n} messages ({} distinct), {} acked, {} dead-lettered, {} failed attempts",
            sample.distinct, sample.acked, sample.dead_lettered, sample.failed
        )
        .into());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    if std::env::args().any(|a| a == "--child") {
        // A consumer process of `--processes` (see benches/e2e/procs.rs).
        return procs::child().await;
    }
    // `IDEMPOTENT_BENCH_LOG=debug` (or info, trace): the library's events
    // on standard error.
    if let Ok(level) = std::env::var("IDEMPOTENT_BENCH_LOG") {
        let level: tracing::Level = level
            .parse()
            .map_err(|_| format!("IDEMPOTENT_BENCH_LOG={level}: not a level"))?;
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .init();
    }
    let args = args()?;
    let started = Instant::now();
    let max_slots = args.slots.iter().copied().max().unwrap_or(1);
    let env = Env::new(
        u32::try_from(max_slots + 4).unwrap_or(64),
        args.brokers.contains(&Kind::Kafka),
    )
    .await?;
    let version: String = idempotent_runtime::sqlx::query_scalar("SHOW server_version")
        .fetch_one(&env.pool)
        .await?;
    let mut report = String::new();
    writeln!(
        report,
        "End to end, PostgreSQL {version}, {} cores: {} messages per run, {} interleaved repetitions, {} consumer \
         process(es); load at the start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.messages,
        args.reps,
        args.processes,
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
    )?;
    writeln!(
        report,
        "Command: `cargo bench --bench e2e -- {}`",
        std::env::args()
            .skip(1)
            .filter(|a| a != "--bench")
            .collect::<Vec<_>>()
            .join(" ")
    )?;
    let mut seed = 0;
    let mut all: Vec<Ran> = Vec::new();
    for &kind in &args.brokers {
        let variants: Vec<Variant> = args.variants.iter().copied().filter(|v| v.applies_to(kind)).collect();
        let labels: Vec<String> = variants.iter().map(|v| v.label()).collect();
        let mut cells: Vec<((usize, u32), Cell)> = Vec::new();
        for &slots in &args.slots {
            for &dup in &args.dups {
                let mut cell = Cell::default();
                for rep in 0..if args.drain { args.reps } else { 0 } {
                    for &variant in &variants {
                        seed += 1;
                        let sample = if args.processes > 1 {
                            let (n, p) = (args.messages, args.processes);
                            procs::run(&env, kind, variant, slots, n, dup, seed, p).await?
                        } else {
                            run::run(&env, kind, variant, slots, args.messages, dup, Feed::Drain, seed).await?
                        };
                        let label = format!("{} {} slots={slots} dup={dup}% rep={rep}", kind.name(), variant.label());
                        check(&label, variant, &sample, args.messages)?;
                        eprintln!(
                            "{label}: {:.0} msg/s, batches of {:.1}, {} failed attempts",
                            sample.rate, sample.batch_size, sample.failed
                        );
                        cell.rates.entry(variant.label()).or_default().push(sample.rate);
                        cell.cpu.entry(variant.label()).or_default().push(sample.cpu_us);
                    }
                }
                if args.steady {
                    cell.steady_rate = match args.steady_rate {
                        Some(rate) => rate,
                        None => (median(cell.rates["a"].clone()) / 2.0).max(1.0),
                    };
                    let n = ((cell.steady_rate * args.steady_secs) as usize).max(10);
                    for &variant in &variants {
                        seed += 1;
                        let sample =
                            run::run(&env, kind, variant, slots, n, dup, Feed::Steady(cell.steady_rate), seed).await?;
                        let label = format!("{} {} slots={slots} dup={dup}% steady", kind.name(), variant.label());
                        check(&label, variant, &sample, n)?;
                        eprintln!(
                            "{label} at {:.0} msg/s: p50 {:.1} ms, p99 {:.1} ms, batches of {:.1}",
                            cell.steady_rate,
                            percentile(&sample.latencies_us, 50.0) / 1e3,
                            percentile(&sample.latencies_us, 99.0) / 1e3,
                            sample.batch_size
                        );
                        cell.steady.insert(variant.label(), sample.latencies_us);
                        cell.steady_batch.insert(variant.label(), sample.batch_size);
                    }
                }
                cells.push(((slots, dup), cell));
            }
        }
        write_broker(&mut report, kind, &labels, &cells, args.steady)?;
        all.push((kind, labels, cells));
    }
    write_summary(&mut report, &all, args.steady)?;
    env.drop_tables().await?;
    writeln!(report, "\nTotal time {:.0} s.", started.elapsed().as_secs_f64())?;
    print!("{report}");
    if let Some(out) = &args.out {
        std::fs::write(out, &report)?;
        eprintln!("wrote {out}");
    }
    if let Some(svg) = &args.svg {
        plot(std::path::Path::new(svg), &all, &args.dups)?;
        eprintln!("wrote {svg}");
    }
    Ok(())
}

fn write_broker(
    report: &mut String,
    kind: Kind,
    labels: &[String],
    cells: &[((usize, u32), Cell)],
    steady: bool,
) -> Result<(), BoxError> {
    writeln!(report, "\n### {}\n", kind.title())?;
    // Each ratio's numerator and denominator: every variant against (a),
    // and (b) against its bound (s).
    let mut ratios: Vec<(&str, &str)> = labels.iter().filter(|l| *l != "a").map(|l| (l.as_str(), "a")).collect();
    if labels.iter().any(|l| l == "s") && labels.iter().any(|l| l == "b") {
        ratios.push(("b", "s"));
    }
    write!(report, "| slots, duplicates |")?;
    for l in labels {
        write!(report, " ({l}) msg/s |")?;
    }
    for (x, y) in &ratios {
        write!(report, " {x}/{y} |")?;
    }
    for l in labels {
        write!(report, " ({l}) CPU µs/msg: consumer + db + broker |")?;
    }
    writeln!(report)?;
    writeln!(report, "|{}", " --- |".repeat(1 + labels.len() * 2 + ratios.len()))?;
    for ((slots, dup), cell) in cells {
        write!(report, "| {slots}, {dup} % |")?;
        for l in labels {
            write!(
                report,
                " {:.0} |",
                median(cell.rates.get(l).cloned().unwrap_or_default())
            )?;
        }
        for (x, y) in &ratios {
            write!(report, " {:.2} |", ratio(cell, x, y))?;
        }
        for l in labels {
            let cpu = cell.cpu.get(l).cloned().unwrap_or_default();
            let (c, d, b) = (
                median(cpu.iter().map(|c| c.0).collect()),
                median(cpu.iter().map(|c| c.1).collect()),
                median(cpu.iter().map(|c| c.2).collect()),
            );
            write!(report, " {c:.0} + {d:.0} + {b:.0} |")?;
        }
        writeln!(report)?;
    }
    if steady {
        writeln!(
            report,
            "\nSteady publishing at half of (a)'s drain rate: publish to acknowledgement, p50 / p99 (ms); \
             batches: their mean size\n"
        )?;
        write!(report, "| slots, duplicates | msg/s |")?;
        for l in labels {
            write!(report, " ({l}) |")?;
        }
        writeln!(report)?;
        writeln!(report, "|{}", " --- |".repeat(2 + labels.len()))?;
        for ((slots, dup), cell) in cells {
            write!(report, "| {slots}, {dup} % | {:.0} |", cell.steady_rate)?;
            for l in labels {
                let lat = cell.steady.get(l).cloned().unwrap_or_default();
                write!(
                    report,
                    " {:.1} / {:.1}",
                    percentile(&lat, 50.0) / 1e3,
                    percentile(&lat, 99.0) / 1e3
                )?;
                match cell.steady_batch.get(l) {
                    Some(&size) if size > 0.0 => write!(report, " (batches of {size:.1}) |")?,
                    _ => write!(report, " |")?,
                }
            }
            writeln!(report)?;
        }
    }
    Ok(())
}

/// The median of one cell's repetitions' own ratios `x`/`y` (each
/// repetition's variants ran back to back).
fn ratio(cell: &Cell, x: &str, y: &str) -> f64 {
    match (cell.rates.get(x), cell.rates.get(y)) {
        (Some(xs), Some(ys)) => median(xs.iter().zip(ys).map(|(x, y)| x / y).collect()),
        _ => f64::NAN,
    }
}

/// The first batch variant without offsets (`cN`, `oN`): the summary's (c).
fn batch_label(labels: &[String]) -> Option<&str> {
    labels
        .iter()
        .map(String::as_str)
        .find(|l| l.starts_with('c') || l.starts_with('o'))
}

/// The table of the README: per broker and slot count, without
/// duplicates, (a), (b), (c) and (d) where it runs, b/a and c/a, and (c)'s
/// steady p99.
fn write_summary(report: &mut String, all: &[Ran], steady: bool) -> Result<(), BoxError> {
    writeln!(
        report,
        "\n### Summary (no duplicates; (c) is the first batch variant, (d) Kafka's offsets in the database)\n"
    )?;
    writeln!(
        report,
        "| broker | slots | (a) msg/s | (b) msg/s | (c) msg/s | (d) msg/s | b/a | c/a | (c) p50 / p99 ms at half of (a) |"
    )?;
    writeln!(
        report,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )?;
    for (kind, labels, cells) in all {
        let c = batch_label(labels);
        for ((slots, dup), cell) in cells {
            if *dup != 0 {
                continue;
            }
            let rate = |l: Option<&str>| {
                l.and_then(|l| cell.rates.get(l))
                    .map_or_else(|| "–".to_owned(), |r| format!("{:.0}", median(r.clone())))
            };
            let ratio_of =
                |x: Option<&str>| x.map_or_else(|| "–".to_owned(), |x| format!("{:.2}", ratio(cell, x, "a")));
            let d = labels.iter().any(|l| l == "d").then_some("d");
            let latency = match (steady, c.and_then(|c| cell.steady.get(c))) {
                (true, Some(lat)) => format!(
                    "{:.1} / {:.1}",
                    percentile(lat, 50.0) / 1e3,
                    percentile(lat, 99.0) / 1e3
                ),
                _ => "–".to_owned(),
            };
            writeln!(
                report,
                "| {} | {slots} | {} | {} | {} | {} | {} | {} | {latency} |",
                kind.title(),
                rate(Some("a")),
                rate(Some("b")),
                rate(c),
                rate(d),
                ratio_of(Some("b")),
                ratio_of(c),
            )?;
        }
    }
    Ok(())
}

/// Bars of (a), (b), (c) and (d) per broker and slot count, without
/// duplicates (the first share of duplicates run when none is 0), with the
/// repetitions' min–max: `report::bar_chart` of `benches/throughput.rs`.
fn plot(path: &std::path::Path, all: &[Ran], dups: &[u32]) -> Result<(), BoxError> {
    let dup = if dups.contains(&0) {
        0
    } else {
        dups.first().copied().unwrap_or(0)
    };
    let series = [
        "(a) no idempotency",
        "(b) per message",
        "(c) batches",
        "(d) Kafka, offsets in the db",
    ];
    let mut groups = Vec::new();
    for (kind, labels, cells) in all {
        let c = batch_label(labels);
        for ((slots, d), cell) in cells {
            if *d != dup {
                continue;
            }
            let of = |l: Option<&str>| {
                l.and_then(|l| cell.rates.get(l)).map(|rates| {
                    let mut h = harness::Cell::new();
                    h.rates = rates.clone();
                    h
                })
            };
            groups.push(report::Group {
                label: format!("{}, {slots}", kind.name()),
                cells: vec![
                    of(Some("a")),
                    of(Some("b")),
                    of(c),
                    of(labels.iter().any(|l| l == "d").then_some("d")),
                ],
            });
        }
    }
    report::bar_chart(
        path,
        &format!("End to end into PostgreSQL: messages/s by broker and slots ({dup} % duplicates)"),
        &series,
        &groups,
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}
