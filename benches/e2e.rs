//! End to end (issue 32): what `#[idempotent]` costs a real consumer on each
//! broker, writing to PostgreSQL, side by side in one run:
//!
//! - (a) a consumer without idempotency: the effect in a transaction of its
//!   own per message, acknowledged after the commit;
//! - (s) the bound of (b): idempotency by hand with one statement more
//!   than (a) in the same transaction (a plain claim of the key);
//! - (b) the idempotent consumer, one transaction per message;
//! - (c) the same handler with the consumer's batch transactions (`cN`:
//!   batches of at most N, each message under a savepoint; `c` is 32;
//!   `oN`: the same without savepoints, `batch_savepoints(false)`);
//!
//! at each number of handler slots and share of duplicates, from a queue
//! filled beforehand (the drain rate, from the first delivery to the last
//! acknowledgement) and at a steady publish rate of half of (a)'s drain
//! rate (publish-to-acknowledgement latency, p50 and p99). The variants run
//! interleaved, each on a fresh queue; the ratios b/a and c/a are the
//! medians of each repetition's own ratios. CPU per message: this process
//! (the consumer), PostgreSQL's processes, the broker's server.
//!
//! ```text
//! cargo bench --bench e2e                      # every broker, slots 1,4,16, 0 and 20 % duplicates
//! cargo bench --bench e2e -- --quick           # ~1 min: 500 messages, slots 4, one repetition
//! cargo bench --bench e2e -- --brokers=rabbitmq,nats,redis-streams --slots=4,16 --dups=0,20
//!                           --variants=a,s,b,c8,c32,o32,o64 --messages=4000 --reps=3 --no-steady --out=FILE
//! ```
//!
//! Needs the services of `.ci/run` (PostgreSQL, RabbitMQ, NATS JetStream,
//! Redis). One consumer process; every queue, stream and table is fresh and
//! removed at the end.

#[path = "e2e/brokers.rs"]
mod brokers;
#[path = "e2e/run.rs"]
mod run;

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
    out: Option<String>,
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
        variants: vec![
            Variant::Plain,
            Variant::ByHand,
            Variant::PerMessage,
            Variant::Batch(32),
            Variant::Lean(32),
        ],
        messages: if quick { 500 } else { 4000 },
        reps: if quick { 1 } else { 3 },
        steady: true,
        steady_secs: if quick { 1.0 } else { 3.0 },
        out: None,
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
            "--out" => args.out = Some(value.to_owned()),
            "--quick" | "--bench" => {}
            other => return Err(format!("unknown argument `{other}` (see the top of benches/e2e.rs)").into()),
        }
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
    steady_rate: f64,
}

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
    let args = args()?;
    let started = Instant::now();
    let max_slots = args.slots.iter().copied().max().unwrap_or(1);
    let env = Env::new(u32::try_from(max_slots + 4).unwrap_or(64)).await?;
    let version: String = idempotent_runtime::sqlx::query_scalar("SHOW server_version")
        .fetch_one(&env.pool)
        .await?;
    let mut report = String::new();
    writeln!(
        report,
        "End to end, PostgreSQL {version}: {} messages per run, {} interleaved repetitions, one consumer process; \
         load at the start {}",
        args.messages,
        args.reps,
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
    )?;
    let labels: Vec<String> = args.variants.iter().map(|v| v.label()).collect();
    let mut seed = 0;
    for &kind in &args.brokers {
        let mut cells: Vec<((usize, u32), Cell)> = Vec::new();
        for &slots in &args.slots {
            for &dup in &args.dups {
                let mut cell = Cell::default();
                for rep in 0..args.reps {
                    for &variant in &args.variants {
                        seed += 1;
                        let sample =
                            run::run(&env, kind, variant, slots, args.messages, dup, Feed::Drain, seed).await?;
                        let label = format!("{} {} slots={slots} dup={dup}% rep={rep}", kind.name(), variant.label());
                        check(&label, variant, &sample, args.messages)?;
                        eprintln!("{label}: {:.0} msg/s, batches of {:.1}", sample.rate, sample.batch_size);
                        cell.rates.entry(variant.label()).or_default().push(sample.rate);
                        cell.cpu.entry(variant.label()).or_default().push(sample.cpu_us);
                    }
                }
                if args.steady {
                    cell.steady_rate = (median(cell.rates["a"].clone()) / 2.0).max(1.0);
                    let n = ((cell.steady_rate * args.steady_secs) as usize).max(10);
                    for &variant in &args.variants {
                        seed += 1;
                        let sample =
                            run::run(&env, kind, variant, slots, n, dup, Feed::Steady(cell.steady_rate), seed).await?;
                        check(
                            &format!("{} {} steady", kind.name(), variant.label()),
                            variant,
                            &sample,
                            n,
                        )?;
                        cell.steady.insert(variant.label(), sample.latencies_us);
                    }
                }
                cells.push(((slots, dup), cell));
            }
        }
        write_broker(&mut report, kind, &labels, &cells, args.steady)?;
    }
    env.drop_tables().await?;
    writeln!(report, "\nTotal time {:.0} s.", started.elapsed().as_secs_f64())?;
    print!("{report}");
    if let Some(out) = &args.out {
        std::fs::write(out, &report)?;
        eprintln!("wrote {out}");
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
            write!(report, " {:.0} |", median(cell.rates[l].clone()))?;
        }
        for (x, y) in &ratios {
            // Each repetition's own ratio (its variants ran back to back).
            let each = cell.rates[*x].iter().zip(&cell.rates[*y]).map(|(x, y)| x / y).collect();
            write!(report, " {:.2} |", median(each))?;
        }
        for l in labels {
            let cpu = &cell.cpu[l];
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
            "\nSteady publishing at half of (a)'s drain rate: publish to acknowledgement, p50 / p99 (ms)\n"
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
                let lat = &cell.steady[l];
                write!(
                    report,
                    " {:.1} / {:.1} |",
                    percentile(lat, 50.0) / 1e3,
                    percentile(lat, 99.0) / 1e3
                )?;
            }
            writeln!(report)?;
        }
    }
    Ok(())
}
