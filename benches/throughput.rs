//! Side-by-side throughput of `#[idempotent]` against the hand-written
//! patterns (issue 6).
//!
//! ```text
//! cargo bench --bench throughput                    # full run (~10-15 min): plots in docs/, results in docs/archive/
//! cargo bench --bench throughput -- --quick         # ~1 min (or IDEMPOTENT_BENCH_QUICK=1)
//! cargo bench --bench throughput -- --compile-cost  # build time of 100 handlers, with/without the attribute (docs/archive/)
//! cargo bench --bench throughput -- --only=pg,redis # sections: pg, batch, cache, rtt, sqlite, mysql, redis, memory, size, purge
//! cargo bench --bench throughput -- --out=DIR       # where the markdown and SVG files go
//! IDEMPOTENT_BENCH_ROWS=d cargo bench --bench throughput -- --only=pg   # one variant alone (to profile it)
//! IDEMPOTENT_BENCH_REDIS_URL=redis://127.0.0.1:6390/ cargo bench --bench throughput -- --only=redis   # another Redis or Valkey server
//! ```
//!
//! Needs the services of `.ci/run`: PostgreSQL (postgres://postgres@127.0.0.1:5432/test),
//! MariaDB or MySQL (mysql://root@127.0.0.1:3306/test) and Redis
//! (redis://127.0.0.1:6379); SQLite runs on a temporary file and
//! Redis round trips are counted on a private `redis-server` when one is on
//! the PATH. Every variant gets its own tables (unique names), dropped at
//! the end.

#[path = "throughput/compile_cost.rs"]
mod compile_cost;
#[path = "throughput/harness.rs"]
mod harness;
#[path = "throughput/redis.rs"]
mod kv;
#[path = "throughput/lite.rs"]
mod lite;
#[path = "throughput/mem.rs"]
mod mem;
#[path = "throughput/my.rs"]
mod my;
#[path = "throughput/pg.rs"]
mod pg;
#[path = "throughput/report.rs"]
mod report;
#[path = "throughput/scale.rs"]
mod scale;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use harness::{BoxError, Cell, Outcome, Plan, RunOptions, RunStats, Variant};
use idempotent_runtime::{CachedStore, MemoryStore, PgStore};
use report::Group;

/// The heading of the CPU table of every PostgreSQL section.
const PG_CPU_HEADING: &str = "\nCPU per delivery, µs: this process (client) + every PostgreSQL process (server):\n\n";

#[path = "shared/unique.rs"]
mod names;
pub use names::unique;

#[derive(Clone, Copy)]
struct Timing {
    warmup: Duration,
    duration: Duration,
}

struct Config {
    quick: bool,
    /// Repetitions of the main PostgreSQL grid.
    reps: usize,
    /// Repetitions of the other sections.
    reps_small: usize,
    timing: Timing,
    concurrencies: Vec<usize>,
    dups: Vec<u32>,
    /// Where the plots go.
    out_dir: PathBuf,
    /// Where the markdown output goes.
    results_file: PathBuf,
    sections: Option<Vec<String>>,
}

impl Config {
    /// The cells of the Redis and memory grids.
    fn lease_cells(&self) -> Vec<(u32, usize)> {
        let mut all = cells(&self.dups, &self.concurrencies);
        all.extend(cells(&[80], if self.quick { &[8] } else { &[8, 32] }));
        all
    }

    fn wants(&self, section: &str) -> bool {
        self.sections.as_ref().is_none_or(|s| s.iter().any(|x| x == section))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env_quick = std::env::var("IDEMPOTENT_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let quick = env_quick || args.iter().any(|a| a == "--quick");
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // `--out=DIR`: every file in DIR. Otherwise a quick run writes to
    // `target/idempotent-bench/`, and a full run draws the plots of the
    // current results page (`docs/*.svg`, shown by `docs/performance.md`)
    // and files its dated output in `docs/archive/`.
    let out_arg = args.iter().find_map(|a| a.strip_prefix("--out=")).map(PathBuf::from);
    let (out_dir, results_dir, stamp) = match out_arg {
        Some(dir) => (dir.clone(), dir, None),
        None if quick => {
            let dir = workspace.join("target/idempotent-bench");
            (dir.clone(), dir, None)
        }
        None => (
            workspace.join("docs"),
            workspace.join("docs/archive"),
            Some(date_stamp()),
        ),
    };
    let dated = |name: &str| match &stamp {
        Some(stamp) => results_dir.join(format!("{name}-{stamp}.md")),
        None => results_dir.join(format!("{name}.md")),
    };
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::create_dir_all(&results_dir).unwrap();

    if args.iter().any(|a| a == "--compile-cost") {
        let mut md = format!("## Compile time: 100 handlers\n\n{}\n", machine_line());
        match compile_cost::run(&workspace) {
            Ok(table) => md.push_str(&table),
            Err(e) => {
                eprintln!("compile-cost failed: {e}");
                std::process::exit(1);
            }
        }
        println!("{md}");
        std::fs::write(dated("compile-cost"), md).unwrap();
        return;
    }

    // `IDEMPOTENT_BENCH_REPS=7 IDEMPOTENT_BENCH_SECS=5`: more and longer
    // (or, `IDEMPOTENT_BENCH_SECS=0.3`, shorter) runs than the defaults
    // (every table). A value that is not a positive number stops the run:
    // ignoring it would measure something else than what was asked.
    let env_number = |name: &str| -> Option<f64> {
        let text = std::env::var(name).ok()?;
        match text.trim().parse::<f64>() {
            Ok(n) if n.is_finite() && n > 0.0 => Some(n),
            _ => {
                eprintln!("{name}={text:?}: expected a positive number");
                std::process::exit(2);
            }
        }
    };
    let reps_env = env_number("IDEMPOTENT_BENCH_REPS").map(|n| {
        if n.fract() != 0.0 {
            eprintln!("IDEMPOTENT_BENCH_REPS={n}: expected a whole number of repetitions");
            std::process::exit(2);
        }
        n as usize
    });
    let secs_env = env_number("IDEMPOTENT_BENCH_SECS");
    let mut cfg = Config {
        quick,
        reps: if quick { 1 } else { 5 },
        reps_small: if quick { 1 } else { 3 },
        timing: if quick {
            Timing {
                warmup: Duration::from_millis(100),
                duration: Duration::from_millis(300),
            }
        } else {
            Timing {
                warmup: Duration::from_millis(250),
                duration: Duration::from_millis(1500),
            }
        },
        concurrencies: vec![1, 8, 32],
        dups: vec![0, 20],
        out_dir,
        results_file: dated("benchmark-results"),
        sections: args
            .iter()
            .find_map(|a| a.strip_prefix("--only="))
            .map(|s| s.split(',').map(str::to_owned).collect()),
    };
    if let Some(reps) = reps_env {
        (cfg.reps, cfg.reps_small) = (reps, reps);
    }
    if let Some(secs) = secs_env {
        cfg.timing.duration = Duration::from_secs_f64(secs);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(cfg));
}

// ---- one row of a table: a variant, type-erased ---------------------------------

type LocalFuture<T> = Pin<Box<dyn Future<Output = T>>>;

struct Row {
    name: &'static str,
    measure: Box<dyn Fn(Arc<Plan>, usize, String) -> LocalFuture<RunStats>>,
}

fn row<V: Variant>(name: &'static str, variant: V, timing: Timing, warm: &Arc<Plan>) -> Row {
    let variant = Arc::new(variant);
    let warm = Arc::clone(warm);
    Row {
        name,
        measure: Box::new(move |plan, concurrency, prefix| {
            let (variant, warm) = (Arc::clone(&variant), Arc::clone(&warm));
            Box::pin(async move {
                variant.reset().await;
                let warm_prefix = format!("w{prefix}");
                let opts = RunOptions {
                    concurrency,
                    duration: timing.warmup,
                    prefix: &warm_prefix,
                    keep_starts: false,
                    stop: None,
                };
                harness::run(&variant, &warm, opts).await;
                let opts = RunOptions {
                    concurrency,
                    duration: timing.duration,
                    prefix: &prefix,
                    keep_starts: false,
                    stop: None,
                };
                harness::run(&variant, &plan, opts).await
            })
        }),
    }
}

/// A variant with something to do after its reset (clear a cache).
struct Hooked<V> {
    inner: V,
    after_reset: Box<dyn Fn(&V) + Send + Sync>,
}

impl<V: Variant> Variant for Hooked<V> {
    fn deliver(&self, key: String) -> impl Future<Output = Result<Outcome, BoxError>> + Send {
        self.inner.deliver(key)
    }
    async fn reset(&self) {
        self.inner.reset().await;
        (self.after_reset)(&self.inner);
    }
}

/// A variant rebuilt from scratch at each reset (the in-memory stores).
struct Rebuilt<V> {
    make: Box<dyn Fn() -> V + Send + Sync>,
    current: RwLock<Arc<V>>,
}

impl<V: Variant> Rebuilt<V> {
    fn new(make: impl Fn() -> V + Send + Sync + 'static) -> Self {
        let current = RwLock::new(Arc::new(make()));
        Rebuilt {
            make: Box::new(make),
            current,
        }
    }
}

impl<V: Variant> Variant for Rebuilt<V> {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let current = Arc::clone(&self.current.read().unwrap());
        current.deliver(key).await
    }
    async fn reset(&self) {
        *self.current.write().unwrap() = Arc::new((self.make)());
    }
}

struct Plans {
    by_dup: HashMap<u32, Arc<Plan>>,
}

impl Plans {
    fn new(len: usize) -> Plans {
        let by_dup = [0, 20, 80]
            .into_iter()
            .map(|d| (d, Arc::new(Plan::new(d, len, 0x1de3))))
            .collect();
        Plans { by_dup }
    }
    fn get(&self, dup: u32) -> Arc<Plan> {
        Arc::clone(&self.by_dup[&dup])
    }
}

/// Measures every row at every (duplicates, concurrency), `reps` times,
/// interleaved (the order of the rows rotates from one repetition to the
/// next). Returns one group per (duplicates, concurrency).
async fn grid(section: &str, rows: &[Row], cells: &[(u32, usize)], plans: &Plans, reps: usize) -> Vec<Group> {
    let mut groups: Vec<Group> = cells
        .iter()
        .map(|(dup, conc)| Group {
            label: format!("c={conc}, {dup} % dup"),
            cells: vec![None; rows.len()],
        })
        .collect();
    // `IDEMPOTENT_BENCH_ROWS=d,s`: only these rows (by their letter), to
    // profile one variant alone (`perf record -p ..`).
    let only: Option<Vec<String>> = std::env::var("IDEMPOTENT_BENCH_ROWS")
        .ok()
        .map(|v| v.split(',').map(|r| format!("({})", r.trim())).collect());
    // The order rotates over the rows measured, so that each of them comes
    // first (and last) as often as the others.
    let measured: Vec<usize> = (0..rows.len())
        .filter(|&ri| {
            only.as_ref()
                .is_none_or(|only| only.iter().any(|o| rows[ri].name.starts_with(o.as_str())))
        })
        .collect();
    for rep in 0..reps {
        for (gi, &(dup, conc)) in cells.iter().enumerate() {
            for k in 0..measured.len() {
                let ri = measured[(k + rep) % measured.len()];
                let row = &rows[ri];
                let prefix = format!("r{rep}c{conc}d{dup}v{ri}-");
                let stats = (row.measure)(plans.get(dup), conc, prefix).await;
                eprintln!(
                    "  {section} {:<16} {:<34} {:>9}/s  p50 {:>7} ms  p99 {:>7} ms  dup {:>4.1} %{}{}",
                    groups[gi].label,
                    row.name,
                    report::fmt_rate(stats.rate()),
                    report::fmt_ms(stats.percentile(50.0)),
                    report::fmt_ms(stats.percentile(99.0)),
                    100.0 * stats.duplicates as f64 / stats.deliveries.max(1) as f64,
                    if stats.busy > 0 {
                        format!("  busy {}", stats.busy)
                    } else {
                        String::new()
                    },
                    if stats.plan_exhausted { "  (plan exhausted)" } else { "" },
                );
                groups[gi].cells[ri].get_or_insert_with(Cell::new).add(&stats);
            }
        }
    }
    groups
}

fn cells(dups: &[u32], concs: &[usize]) -> Vec<(u32, usize)> {
    dups.iter().flat_map(|&d| concs.iter().map(move |&c| (d, c))).collect()
}

// ---- the run ---------------------------------------------------------------------

struct Doc {
    md: String,
}

impl Doc {
    fn section(&mut self, text: &str) {
        println!("\n{text}");
        self.md.push_str(text);
        self.md.push('\n');
    }
}

async fn run(cfg: Config) {
    let started = Instant::now();
    let mode = if cfg.quick { "quick" } else { "full" };
    let mut doc = Doc { md: String::new() };
    let load_before = loadavg();
    doc.section(&format!(
        "# Benchmark results ({mode} mode)\n\n{}\n\nLoad average at start: {load_before}. Every figure is deliveries per \
         second, the median of {} interleaved runs for the main PostgreSQL table and of {} for the others{}; each run \
         has a {} ms warm-up then {} ms of measurement (MemoryStore: a third of that).\n",
        machine_line(),
        cfg.reps,
        cfg.reps_small,
        if cfg.reps > 1 { ", min–max in small type" } else { "" },
        cfg.timing.warmup.as_millis(),
        cfg.timing.duration.as_millis(),
    ));
    let plans = Plans::new(if cfg.quick { 1_500_000 } else { 4_000_000 });
    let warm = plans.get(0);
    let t = cfg.timing;
    let mut charts: Vec<(String, String, Vec<&'static str>, Vec<Group>)> = Vec::new();

    let env = match pg::PgEnv::connect(40).await {
        Ok(env) => Some(env),
        Err(e) => {
            eprintln!("PostgreSQL unavailable ({e}): skipping its sections");
            None
        }
    };

    if let Some(env) = &env {
        doc.section(&format!("PostgreSQL: {}.\n", pg_version(env).await));
    }

    // -- PostgreSQL: a/b/c/d -----------------------------------------------------------------
    if let (Some(env), true) = (&env, cfg.wants("pg")) {
        let rows = vec![
            row(
                "(a) bare tx, no idempotency",
                pg::Bare::new(env.tables("a").await),
                t,
                &warm,
            ),
            row(
                "(b) article: check, then tx",
                pg::Article::new(env.tables("b").await),
                t,
                &warm,
            ),
            row(
                "(c) hand-written claim-first",
                pg::ClaimFirst::new(env.tables("c").await, false),
                t,
                &warm,
            ),
            {
                let td = env.tables("d").await;
                row(
                    "(d) #[idempotent] + PgStore",
                    pg::Macro::new(td.clone(), td.store()),
                    t,
                    &warm,
                )
            },
            row(
                "(s) by hand, PgStore's statements",
                pg::ClaimFirst::store_statements(env.tables("s").await),
                t,
                &warm,
            ),
            row(
                "(c2) (c) again: the A/A control",
                pg::ClaimFirst::new(env.tables("cc").await, false),
                t,
                &warm,
            ),
        ];
        let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
        let groups = grid("pg", &rows, &cells(&cfg.dups, &cfg.concurrencies), &plans, cfg.reps).await;
        let mut text = String::from(
            "## PostgreSQL: deliveries per second\n\n(a) `BEGIN; INSERT effect; COMMIT`. (b) the article: `SELECT` on the \
             marker table, then `BEGIN; INSERT effect; INSERT marker; COMMIT` (a concurrent duplicate fails on the \
             primary key). (c) by hand with sqlx: `BEGIN; INSERT marker ON CONFLICT DO NOTHING RETURNING 1`, then the \
             effect and `COMMIT`, or on a duplicate return (the dropped transaction rolls back). (d) the same handler \
             with `#[idempotent]` and `PgStore` (for this `()` handler without fingerprint: `BEGIN`, then `INSERT .. \
             SELECT .. WHERE <at read committed> AND NOT EXISTS (live marker) ON CONFLICT DO UPDATE .. WHERE \
             expired RETURNING`, so a duplicate neither locks nor reads the marker; its transaction is dropped, its \
             `ROLLBACK` sent with the pool's release ping). (s) by hand, exactly the statements `PgStore` sends for \
             this handler (`BEGIN`, its claim statement with four parameters): d/s is the cost of \
             the macro and the runtime, s/c the cost of the statement. (c2) is (c) again on tables of its own: \
             c2/c is how far two identical variants differ in one run, the resolution of every ratio. All marker \
             tables have `PgStore`'s layout; the effect is one `INSERT` into a table of its own.\n\n",
        );
        text.push_str(&report::tables(
            &names,
            &groups,
            &[(3, 2), (3, 1), (3, 0), (3, 4), (4, 2), (5, 2)],
            cfg.reps,
            "\nLatency per delivery, p50 / p99 (ms):\n\n",
            Some(PG_CPU_HEADING),
        ));
        doc.section(&text);
        charts.push((
            "throughput-postgres.svg".into(),
            "PostgreSQL: deliveries/s (median, min–max)".into(),
            names,
            groups,
        ));
        env.cleanup().await;
    }

    // -- PostgreSQL: batch transactions (c=8) -------------------------------------------------
    if let (Some(env), true) = (&env, cfg.wants("batch")) {
        let mut rows = vec![
            row(
                "(a) bare tx, no idempotency",
                pg::Bare::new(env.tables("ba").await),
                t,
                &warm,
            ),
            {
                let td = env.tables("bd").await;
                row(
                    "(d) #[idempotent], one tx per message",
                    pg::Macro::new(td.clone(), td.store()),
                    t,
                    &warm,
                )
            },
        ];
        for (size, name) in [
            (1, "(e1) batch of 1"),
            (8, "(e8) batch of 8"),
            (32, "(e32) batch of 32"),
            (128, "(e128) batch of 128"),
        ] {
            rows.push(row(
                name,
                pg::Batched::new(env.tables(&format!("be{size}")).await, size),
                t,
                &warm,
            ));
        }
        let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
        let groups = grid("batch", &rows, &cells(&cfg.dups, &[8]), &plans, cfg.reps).await;
        let mut text = String::from(
            "## PostgreSQL: batch transactions\n\nThe (d) handler, unchanged, run N deliveries per transaction \
             (`PgStore::begin_batch`, the N calls in `Batch::run_all`, one `Batch::commit`): the calls' claims are \
             gathered into one `INSERT .. SELECT FROM unnest(..) ORDER BY key ON CONFLICT .. RETURNING`, each fresh \
             message's body runs under a savepoint, duplicates are answered as usual (one more statement reads the \
             markers of those that need a result), one commit for the batch (what `ConsumerBuilder::batch` does \
             between the broker and the handler). A \
             worker takes N deliveries at once; every message of a batch counts the batch's latency (it is \
             acknowledged after the commit). Concurrency 8 (8 batches at once).\n\n",
        );
        text.push_str(&report::tables(
            &names,
            &groups,
            &[(2, 1), (3, 0), (3, 1), (4, 0), (4, 1), (5, 0), (5, 1)],
            cfg.reps,
            "\nLatency per message, p50 / p99 (ms):\n\n",
            Some(PG_CPU_HEADING),
        ));
        doc.section(&text);
        charts.push((
            "batch-postgres.svg".into(),
            "PostgreSQL, c=8: deliveries/s by batch size".into(),
            names,
            groups,
        ));
        env.cleanup().await;
    }

    // -- PostgreSQL: where the round trips go (c=8, 20 % dup) -----------------------------
    if let (Some(env), true) = (&env, cfg.wants("rtt")) {
        let rows = vec![
            row(
                "(c) claim-first, drop tx on dup",
                pg::ClaimFirst::new(env.tables("c2").await, false),
                t,
                &warm,
            ),
            row(
                "(c') claim-first, await rollback",
                pg::ClaimFirst::new(env.tables("c3").await, true),
                t,
                &warm,
            ),
            {
                let td = env.tables("d2").await;
                row(
                    "(d) #[idempotent] + PgStore",
                    pg::Macro::new(td.clone(), td.store()),
                    t,
                    &warm,
                )
            },
        ];
        let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
        let groups = grid("rtt", &rows, &cells(&[20, 80], &[8]), &plans, cfg.reps_small).await;
        let mut text = String::from(
            "## PostgreSQL: the duplicate path\n\nSame workload at concurrency 8. Client round trips per delivery \
             (each waits for the server): fresh (c) = (d) = 4 (`BEGIN`, claim, effect, `COMMIT`); duplicate: (c) 2 \
             (`BEGIN`, claim; the `ROLLBACK` is queued by sqlx and sent with the pool's release ping, off the \
             caller's path), (c') 3, (d) 2 (`BEGIN`, the claim, which for this `()` handler neither locks nor \
             reads the live marker; the `ROLLBACK` likewise queued).\n\n",
        );
        text.push_str(&report::tables(
            &names,
            &groups,
            &[(2, 0), (2, 1)],
            cfg.reps_small,
            "\nLatency p50 / p99 (ms):\n\n",
            Some(PG_CPU_HEADING),
        ));
        doc.section(&text);
        env.cleanup().await;
    }

    // -- PostgreSQL: the duplicate cache at 80 % duplicates -----------------------------------
    if let (Some(env), true) = (&env, cfg.wants("cache")) {
        let concs: Vec<usize> = if cfg.quick { vec![8] } else { vec![1, 8, 32] };
        let rows = vec![
            row(
                "(b) article: check, then tx",
                pg::Article::new(env.tables("b80").await),
                t,
                &warm,
            ),
            row(
                "(c) hand-written claim-first",
                pg::ClaimFirst::new(env.tables("c80").await, false),
                t,
                &warm,
            ),
            {
                let td = env.tables("d80").await;
                row(
                    "(d) #[idempotent] + PgStore",
                    pg::Macro::new(td.clone(), td.store()),
                    t,
                    &warm,
                )
            },
            {
                let tk = env.tables("k80").await;
                let store = pg::cached(&tk, 100_000);
                let hooked = Hooked {
                    inner: pg::Macro::new(tk, store),
                    after_reset: Box::new(|v: &pg::Macro<CachedStore<PgStore>>| v.store.clear()),
                };
                row("(d+cache) CachedStore<PgStore>", hooked, t, &warm)
            },
        ];
        let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
        let groups = grid("cache", &rows, &cells(&[80], &concs), &plans, cfg.reps_small).await;
        let mut text = String::from(
            "## Duplicate fast path: 80 % duplicates\n\n`CachedStore::new(PgStore, 100_000)`: a repeated duplicate is \
             answered from an in-process LRU of completed keys, without a round trip. Each duplicate repeats a \
             message processed by this process (so, with a large enough cache, every duplicate is a hit).\n\n",
        );
        text.push_str(&report::tables(
            &names,
            &groups,
            &[(3, 2), (3, 1), (2, 1)],
            cfg.reps_small,
            "\nLatency p50 / p99 (ms):\n\n",
            Some(PG_CPU_HEADING),
        ));
        doc.section(&text);
        charts.push((
            "duplicates-80.svg".into(),
            "PostgreSQL, 80 % duplicates: deliveries/s".into(),
            names,
            groups,
        ));
        env.cleanup().await;
    }

    // -- SQLite ------------------------------------------------------------------------------
    if cfg.wants("sqlite") {
        let env = lite::LiteEnv::open().await;
        let rows = vec![
            row(
                "(a) bare tx, no idempotency",
                lite::Bare::new(env.tables("a").await),
                t,
                &warm,
            ),
            row(
                "(b) article: check, then tx",
                lite::Article::new(env.tables("b").await),
                t,
                &warm,
            ),
            row(
                "(c) hand-written claim-first",
                lite::ClaimFirst::new(env.tables("c").await),
                t,
                &warm,
            ),
            row(
                "(d) #[idempotent] + SqliteStore",
                lite::Macro::new(env.tables("d").await),
                t,
                &warm,
            ),
            row(
                "(s) by hand, SqliteStore's statement",
                lite::ClaimFirst::store_statements(env.tables("s").await),
                t,
                &warm,
            ),
            row(
                "(c2) (c) again: the A/A control",
                lite::ClaimFirst::new(env.tables("cc").await),
                t,
                &warm,
            ),
        ];
        let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
        let concs = [1, 8];
        let groups = grid("sqlite", &rows, &cells(&cfg.dups, &concs), &plans, cfg.reps_small).await;
        let mut text = String::from(
            "## SQLite: deliveries per second\n\nA temporary database file, WAL, `synchronous = NORMAL` \
             (`SqliteStore::open`). Writers are serialised in-process (one permit, then `BEGIN IMMEDIATE`) for \
             every variant, as `SqliteStore` does; the article's check runs outside the write lock. (s) by hand, \
             exactly the claim statement `SqliteStore` sends (`ON CONFLICT DO UPDATE .. WHERE expired`, the clock \
             read in SQL): d/s is the cost of the macro and the runtime, s/c the cost of the statement. (c2) is (c) \
             again on tables of its own: c2/c is the resolution of every ratio.\n\n",
        );
        text.push_str(&report::tables(
            &names,
            &groups,
            &[(3, 2), (3, 1), (3, 0), (3, 4), (4, 2), (5, 2)],
            cfg.reps_small,
            "\nLatency p50 / p99 (ms):\n\n",
            None,
        ));
        doc.section(&text);
        charts.push((
            "throughput-sqlite.svg".into(),
            "SQLite: deliveries/s".into(),
            names,
            groups,
        ));
    }

    // -- MariaDB / MySQL ---------------------------------------------------------------------
    if cfg.wants("mysql") {
        mysql_section(&cfg, &mut doc, &mut charts, &plans, &warm).await;
    }

    // -- Redis -----------------------------------------------------------------------------
    if cfg.wants("redis") {
        let url = std::env::var("IDEMPOTENT_BENCH_REDIS_URL").unwrap_or_else(|_| kv::REDIS_URL.to_owned());
        match kv::connect(&url).await {
            Ok(conn) => redis_section(&cfg, &mut doc, &mut charts, conn, &url, &plans, &warm).await,
            Err(e) => eprintln!("Redis unavailable ({e}): skipping"),
        }
    }

    // -- MemoryStore ---------------------------------------------------------------------------
    if cfg.wants("memory") {
        let t = Timing {
            warmup: t.warmup / 3,
            duration: t.duration / 3,
        };
        let rows = vec![
            row("(a) no idempotency", mem::Bare::default(), t, &warm),
            row(
                "(d) #[idempotent] + MemoryStore",
                Rebuilt::new(|| mem::Macro::new(MemoryStore::new())),
                t,
                &warm,
            ),
            row(
                "(d+cache) CachedStore<MemoryStore>",
                Rebuilt::new(|| mem::Macro::new(CachedStore::new(MemoryStore::new(), 100_000))),
                t,
                &warm,
            ),
            row(
                "(d+value) (d) returning a struct",
                Rebuilt::new(|| mem::MacroValue::new(MemoryStore::new())),
                t,
                &warm,
            ),
        ];
        let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
        let groups = grid("memory", &rows, &cfg.lease_cells(), &plans, cfg.reps_small).await;
        let mut text = String::from(
            "## MemoryStore: deliveries per second\n\nNo I/O: what the expansion and a store cost per call. The effect \
             is an atomic counter; every row builds the message key (`format!`) and a message struct.\n\n",
        );
        text.push_str(&report::tables(
            &names,
            &groups,
            &[(1, 0), (2, 1), (3, 1)],
            cfg.reps_small,
            "\nLatency p50 / p99 (ms):\n\n",
            None,
        ));
        doc.section(&text);
    }

    // -- the marker table as it grows ------------------------------------------------------------
    if let (Some(env), true) = (&env, cfg.wants("size")) {
        scale::table_size_section(&cfg, &mut doc, env, &plans, &warm).await;
        env.cleanup().await;
    }
    if let (Some(env), true) = (&env, cfg.wants("purge")) {
        purge_section(&cfg, &mut doc, env, &plans, &warm).await;
        env.cleanup().await;
    }

    for (file, title, names, groups) in &charts {
        let path = cfg.out_dir.join(file);
        match report::bar_chart(&path, title, names, groups) {
            Ok(()) => eprintln!("wrote {}", path.display()),
            Err(e) => eprintln!("chart {file}: {e}"),
        }
    }
    doc.section(&format!(
        "Load average at the end: {}. Total time {:.0} s.\n",
        loadavg(),
        started.elapsed().as_secs_f64()
    ));
    let file = cfg.results_file.clone();
    std::fs::write(&file, &doc.md).unwrap();
    eprintln!("wrote {}", file.display());
    if let Some(env) = env {
        env.cleanup().await;
    }
}

async fn redis_section(
    cfg: &Config,
    doc: &mut Doc,
    charts: &mut Vec<(String, String, Vec<&'static str>, Vec<Group>)>,
    conn: idempotent_runtime::redis::aio::ConnectionManager,
    url: &str,
    plans: &Plans,
    warm: &Arc<Plan>,
) {
    let t = cfg.timing;
    let base = format!("idem-bench:{}:", std::process::id());
    let version = redis_version(&mut conn.clone()).await;
    let rows = vec![
        row(
            "(b) article: EXISTS, then SETEX",
            kv::Article {
                conn: conn.clone(),
                prefix: format!("{base}article:"),
                effects: AtomicU64::new(0),
            },
            t,
            warm,
        ),
        row(
            "(c) claim-first by hand: SET NX PX, then SET PX",
            kv::ClaimFirst {
                conn: conn.clone(),
                prefix: format!("{base}claimfirst:"),
                effects: AtomicU64::new(0),
            },
            t,
            warm,
        ),
        row(
            "(d) #[idempotent] + RedisStore",
            kv::Macro {
                store: kv::store(conn.clone(), &format!("{base}store:")),
                effects: AtomicU64::new(0),
            },
            t,
            warm,
        ),
        row(
            "(d') RedisStore, lease renewal off",
            kv::Macro {
                store: kv::store_without_renewal(conn.clone(), &format!("{base}norenew:")),
                effects: AtomicU64::new(0),
            },
            t,
            warm,
        ),
        row(
            "(s) by hand, RedisStore's commands, no renewal",
            kv::StoreCommands::new(conn.clone(), format!("{base}storecmds:")),
            t,
            warm,
        ),
        row(
            "(d+cache) CachedStore<RedisStore>",
            Hooked {
                inner: kv::Macro {
                    store: kv::cached(conn.clone(), &format!("{base}cached:"), 100_000),
                    effects: AtomicU64::new(0),
                },
                after_reset: Box::new(|v: &kv::Macro<CachedStore<idempotent_runtime::RedisStore>>| v.store.clear()),
            },
            t,
            warm,
        ),
        row(
            "(c2) (c) again: the A/A control",
            kv::ClaimFirst {
                conn: conn.clone(),
                prefix: format!("{base}claimfirst2:"),
                effects: AtomicU64::new(0),
            },
            t,
            warm,
        ),
    ];
    let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
    let groups = grid("redis", &rows, &cfg.lease_cells(), plans, cfg.reps_small).await;
    let deleted = kv::delete_prefix(&mut conn.clone(), &base).await;
    eprintln!("  redis: deleted {deleted} keys under {base}");

    let mut text = format!(
        "## Redis: deliveries per second\n\n{version} at {url}, one multiplexed connection \
         (`ConnectionManager`) shared by the workers. (b) the article: `EXISTS`, the effect, `SETEX` (not atomic: two \
         concurrent deliveries can both pass `EXISTS`). (c) claim-first by hand: `SET key lease NX PX`, the effect, `SET key done PX ttl` (no token check). \
         (d) `RedisStore`: `SET key lease NX PX ms GET` claims a lease or returns the completed marker (a script on \
         Redis < 7.0); completion is `SET key marker IFEQ lease PX ttl` (Valkey ≥ 8.1, Redis ≥ 8.4), else a \
         script (token check + `SET PX`); the leases of running bodies are \
         extended by one task per store. (d') the same without renewal. (s) by hand, the commands (d) sends, \
         without renewal: d'/s is the cost of the macro and the runtime, s/c the cost of the token check. (c2) is \
         (c) again under keys of its own: c2/c is the resolution of every ratio. The effect is an in-process \
         counter.\n\n"
    );
    text.push_str(&report::tables(
        &names,
        &groups,
        &[(2, 1), (2, 0), (3, 2), (5, 2), (3, 4), (4, 1), (6, 1)],
        cfg.reps_small,
        "\nLatency p50 / p99 (ms):\n\n",
        Some("\nCPU per delivery, µs: this process (client) + `redis-server` or `valkey-server` (server):\n\n"),
    ));
    text.push_str(&redis_round_trips().await);
    doc.section(&text);
    charts.push((
        "throughput-redis.svg".into(),
        format!("{version}: deliveries/s"),
        names,
        groups,
    ));
}

/// Counts the commands each Redis variant sends per fresh message and per
/// duplicate, on a private server (`INFO commandstats` deltas).
async fn redis_round_trips() -> String {
    let Some(server) = kv::PrivateRedis::start() else {
        return "\n(Round trips not counted: no `redis-server` on the PATH.)\n".into();
    };
    let conn = match kv::connect(&server.url).await {
        Ok(conn) => conn,
        Err(e) => return format!("\n(Round trips not counted: {e}.)\n"),
    };
    const N: usize = 500;
    let mut text = format!(
        "\n### Redis round trips\n\nCounted on a private `redis-server` with `INFO commandstats` deltas: {N} fresh \
         messages one after the other, then the same {N} again (duplicates), then once more. Only commands the \
         client sends count as round trips (the `SET`/`GET` a script runs inside the server do not: for \
         `RedisStore`, the `SET`s beyond one per `EVALSHA`, whose completion script runs one).\n\n\
         | variant | commands per fresh message | per duplicate | per repeated duplicate | commands seen (fresh; duplicates) |\n\
         | --- | --- | --- | --- | --- |\n"
    );
    async fn phase<V: Variant>(
        v: &V,
        conn: &mut idempotent_runtime::redis::aio::ConnectionManager,
        tag: &str,
        top: &[&str],
    ) -> (f64, String) {
        let before = kv::command_stats(conn).await;
        for i in 0..N {
            v.deliver(format!("{tag}-{i}")).await.unwrap();
        }
        let after = kv::command_stats(conn).await;
        let per = kv::client_commands(&before, &after, top) as f64 / N as f64;
        let seen = kv::delta(&before, &after)
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        (per, seen)
    }
    let article_top = ["exists", "setex", "set", "get", "incr"];
    let store_top = [
        "set-outside-scripts",
        "evalsha",
        "eval",
        "evalsha_ro",
        "eval_ro",
        "script|load",
        "fcall",
    ];
    let article = kv::Article {
        conn: conn.clone(),
        prefix: "rt:article:".into(),
        effects: AtomicU64::new(0),
    };
    let store = kv::Macro {
        store: kv::store(conn.clone(), "rt:store:"),
        effects: AtomicU64::new(0),
    };
    let cached = kv::Macro {
        store: kv::cached(conn.clone(), "rt:cached:", 10_000),
        effects: AtomicU64::new(0),
    };
    let mut c = conn.clone();
    let results = [
        ("(b) article: EXISTS, then SETEX", {
            let f = phase(&article, &mut c, "m", &article_top).await;
            let d = phase(&article, &mut c, "m", &article_top).await;
            let r = phase(&article, &mut c, "m", &article_top).await;
            (f, d, r)
        }),
        ("(d) RedisStore", {
            let f = phase(&store, &mut c, "m", &store_top).await;
            let d = phase(&store, &mut c, "m", &store_top).await;
            let r = phase(&store, &mut c, "m", &store_top).await;
            (f, d, r)
        }),
        ("(d+cache) CachedStore<RedisStore>", {
            let f = phase(&cached, &mut c, "m", &store_top).await;
            let d = phase(&cached, &mut c, "m", &store_top).await;
            let r = phase(&cached, &mut c, "m", &store_top).await;
            (f, d, r)
        }),
    ];
    for (name, (f, d, r)) in &results {
        let _ = writeln!(
            text,
            "| {name} | {:.3} | {:.3} | {:.3} | {}; {} |",
            f.0, d.0, r.0, f.1, d.1
        );
    }
    let (f, d, _) = &results[1].1;
    let _ = writeln!(
        text,
        "\nTarget (at most 2 round trips per fresh message, 1 per duplicate): {}. The first call of each script \
         goes `EVALSHA` → `NOSCRIPT` → `SCRIPT LOAD` → `EVALSHA` (redis-rs), once per server and script: the \
         excess above 2.000 per fresh message.\n",
        if f.0 <= 2.0 + 4.5 / N as f64 && d.0 <= 1.0 + 1e-9 {
            "**met**"
        } else {
            "**not met**"
        }
    );
    drop(server);
    text
}

async fn purge_section(cfg: &Config, doc: &mut Doc, env: &pg::PgEnv, plans: &Plans, warm: &Arc<Plan>) {
    let expired: u64 = if cfg.quick { 50_000 } else { 500_000 };
    let conc = 8;
    let (t, _) = pg::prefilled(env, "purge", 0, false).await;
    let store = t.store(); // default purge batch: 1000 markers per statement
    let d = Arc::new(pg::Macro::new(t.clone(), t.store()));
    let plan = plans.get(20);
    let warm_opts = RunOptions {
        concurrency: conc,
        duration: cfg.timing.warmup,
        prefix: "wbase-",
        keep_starts: false,
        stop: None,
    };
    harness::run(&d, warm, warm_opts).await;

    // Claims without a purge (with expired markers in the table).
    pg::add_expired(&t, expired, "x0").await;
    let opts = RunOptions {
        concurrency: conc,
        duration: cfg.timing.duration.max(Duration::from_secs(1)),
        prefix: "base-",
        keep_starts: true,
        stop: None,
    };
    let base = harness::run(&d, &plan, opts).await;
    let base_w = window_stats(&base, (Duration::ZERO, base.elapsed));
    store.purge_expired().await.unwrap();

    let mut purges = String::new();
    let mut claims = format!(
        "| without purge | {} | {} | {} | {} |\n",
        report::fmt_rate(base_w.0),
        report::fmt_ms(base_w.1),
        report::fmt_ms(base_w.2),
        report::fmt_ms(base_w.3)
    );
    {
        let name = "`PgStore::purge_expired`";
        // Alone.
        pg::add_expired(&t, expired, "a").await;
        let started = Instant::now();
        let deleted = store.purge_expired().await.unwrap();
        let alone = started.elapsed();
        eprintln!("  purge alone, {name}: {deleted} in {:.2} s", alone.as_secs_f64());
        // While claims run: the claims stop when the purge is done.
        pg::add_expired(&t, expired, "b").await;
        let lead = Duration::from_millis(300);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (purge_store, purge_stop) = (store.clone(), Arc::clone(&stop));
        let purge = tokio::spawn(async move {
            tokio::time::sleep(lead).await;
            let started = Instant::now();
            let deleted = purge_store.purge_expired().await.unwrap();
            let took = started.elapsed();
            tokio::time::sleep(Duration::from_millis(200)).await;
            purge_stop.store(true, Ordering::Relaxed);
            (deleted, took)
        });
        let opts = RunOptions {
            concurrency: conc,
            duration: Duration::from_secs(300),
            prefix: "during-",
            keep_starts: true,
            stop: Some(stop),
        };
        let during = harness::run(&d, &plan, opts).await;
        let (deleted_during, took) = purge.await.unwrap();
        let w = window_stats(&during, (lead, lead + took));
        eprintln!(
            "  purge during claims, {name}: {deleted_during} in {:.2} s; claims {}/s",
            took.as_secs_f64(),
            report::fmt_rate(w.0)
        );
        let _ = writeln!(
            purges,
            "| {name} | {} | {:.2} s | {} | {:.2} s | {} |",
            fmt_count(deleted),
            alone.as_secs_f64(),
            report::fmt_rate(deleted as f64 / alone.as_secs_f64()),
            took.as_secs_f64(),
            report::fmt_rate(deleted_during as f64 / took.as_secs_f64()),
        );
        let _ = writeln!(
            claims,
            "| during {name} | {} | {} | {} | {} |",
            report::fmt_rate(w.0),
            report::fmt_ms(w.1),
            report::fmt_ms(w.2),
            report::fmt_ms(w.3)
        );
    }
    let text = format!(
        "## Purging expired markers\n\nA marker table with {} expired markers (plus the live ones the claims add). \
         `PgStore::purge_expired()` deletes in batches of 1000 by `ctid`, each its own statement: `DELETE FROM t WHERE \
         ctid = ANY(ARRAY(SELECT ctid FROM t WHERE expires_at <= now() LIMIT 1000 FOR UPDATE SKIP LOCKED))`.\n\n\
         | purge | markers | alone | markers/s alone | while claims run (c={conc}) | markers/s then |\n\
         | --- | --- | --- | --- | --- | --- |\n{purges}\n\
         Claims (`#[idempotent]` + `PgStore`, concurrency {conc}, 20 % duplicates) on the same table, counting the \
         deliveries started while the purge ran:\n\n\
         | | claims/s | p50 ms | p99 ms | max ms |\n| --- | --- | --- | --- | --- |\n{claims}",
        fmt_count(expired),
    );
    doc.section(&text);
}

/// Rate, p50, p99 and max latency of the deliveries started inside `window`.
fn window_stats(stats: &RunStats, window: (Duration, Duration)) -> (f64, f64, f64, f64) {
    let (from, to) = (window.0.as_micros() as u32, window.1.as_micros() as u32);
    let mut lat: Vec<u32> = stats
        .starts_us
        .iter()
        .zip(&stats.latencies_us)
        .filter(|(s, _)| **s >= from && **s < to)
        .map(|(_, l)| *l)
        .collect();
    lat.sort_unstable();
    let secs = (window.1.min(stats.elapsed) - window.0).as_secs_f64().max(1e-9);
    (
        lat.len() as f64 / secs,
        harness::percentile(&lat, 50.0),
        harness::percentile(&lat, 99.0),
        lat.last().map_or(f64::NAN, |v| f64::from(*v)),
    )
}

fn fmt_count(n: u64) -> String {
    match n {
        0 => "0".into(),
        n if n % 1_000_000 == 0 => format!("{} M", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{} k", n / 1_000),
        n => n.to_string(),
    }
}

// ---- the machine -----------------------------------------------------------------------

fn machine_line() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().to_owned()))
        })
        .unwrap_or_default();
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    format!("Machine: {cpu}, {cores} cores (`nproc`), {mem} RAM; the databases run on the same machine. Date: {date}.")
}

/// `YYYY-MM-DD-HHMM` (UTC), the suffix of a full run's files in
/// `docs/archive/`.
fn date_stamp() -> String {
    std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d-%H%M")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "undated".into())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

async fn pg_version(env: &pg::PgEnv) -> String {
    idempotent_runtime::sqlx::query_scalar::<_, String>("SELECT version()")
        .fetch_one(&env.pool)
        .await
        .map(|v| v.split(" on ").next().unwrap_or(&v).to_owned())
        .unwrap_or_default()
}

async fn redis_version(conn: &mut idempotent_runtime::redis::aio::ConnectionManager) -> String {
    let info: String = idempotent_runtime::redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .unwrap_or_default();
    let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    match (field("valkey_version:"), field("redis_version:")) {
        (Some(valkey), _) => format!("Valkey {valkey}"),
        (None, redis) => format!("Redis {}", redis.unwrap_or("?")),
    }
}

// ---- the section ---------------------------------------------------------------

/// The MariaDB / MySQL table: (a), (b), (c), (d) at every (duplicates,
/// concurrency) of the main grid, `cfg.reps` times. Skipped, with a line on
/// stderr, when the server cannot be reached.
async fn mysql_section(
    cfg: &Config,
    doc: &mut Doc,
    charts: &mut Vec<(String, String, Vec<&'static str>, Vec<Group>)>,
    plans: &Plans,
    warm: &Arc<Plan>,
) {
    let env = match my::MyEnv::connect(40).await {
        Ok(env) => env,
        Err(e) => {
            eprintln!("MariaDB/MySQL unavailable ({e}): skipping its section");
            return;
        }
    };
    let (version, flush, isolation) = env.server().await;
    let t = cfg.timing;
    let rows = vec![
        row(
            "(a) bare tx, no idempotency",
            my::Bare::new(env.tables("a").await),
            t,
            warm,
        ),
        row(
            "(b) article: check, then tx",
            my::Article::new(env.tables("b").await),
            t,
            warm,
        ),
        row(
            "(c) hand-written claim-first",
            my::ClaimFirst::new(env.tables("c").await),
            t,
            warm,
        ),
        {
            let td = env.tables("d").await;
            let store = td.store.clone();
            row("(d) #[idempotent] + MySqlStore", my::Macro::new(td, store), t, warm)
        },
        row(
            "(s) by hand, MySqlStore's statement",
            my::StoreStatements::new(env.tables("s").await),
            t,
            warm,
        ),
        row(
            "(c2) (c) again: the A/A control",
            my::ClaimFirst::new(env.tables("cc").await),
            t,
            warm,
        ),
    ];
    let names: Vec<&'static str> = rows.iter().map(|r| r.name).collect();
    let groups = grid("mysql", &rows, &cells(&cfg.dups, &cfg.concurrencies), plans, cfg.reps).await;
    let mut text = format!(
        "## MariaDB / MySQL: deliveries per second\n\nServer `{version}` at 127.0.0.1:3306 \
         (`innodb_flush_log_at_trx_commit = {flush}`), a pool of 40 connections; median of {reps} interleaved \
         runs{minmax}. (a) `BEGIN; INSERT effect; \
         COMMIT`. (b) the article: `SELECT` on the marker table, then `BEGIN; INSERT effect; INSERT marker; COMMIT` \
         (a concurrent duplicate fails on the primary key, `ER_DUP_ENTRY`). (c) by hand with sqlx, at READ \
         COMMITTED like the store: `SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION`, \
         `INSERT IGNORE` of the marker (1 row affected: claimed; 0: a duplicate, whose transaction is dropped), \
         then the effect and `COMMIT`. (d) the same handler with `#[idempotent]` and `MySqlStore` (the same \
         `BEGIN`, then `INSERT .. ON DUPLICATE KEY UPDATE` whose update clause only reports an expired marker \
         (taken over by a second statement), its outcome read from `last_insert_id`; a duplicate's transaction \
         is dropped, no read since the handler returns `()`). (s) by hand, exactly the statements `MySqlStore` sends for this handler: d/s is the cost of the \
         macro and the runtime, s/c the cost of the statement. (c2) is (c) again on tables of its own: c2/c is \
         the resolution of every ratio. (a) and (b) use the server's default isolation ({isolation}). A dropped transaction's \
         `ROLLBACK` is sent with the pool's release ping. All marker tables have `MySqlStore`'s layout; the \
         effect is one `INSERT` into a table of its own.\n\n",
        reps = cfg.reps,
        minmax = if cfg.reps > 1 { ", min–max in small type" } else { "" },
    );
    text.push_str(&report::tables(
        &names,
        &groups,
        &[(3, 2), (3, 1), (3, 0), (3, 4), (4, 2), (5, 2)],
        cfg.reps,
        "\nLatency per delivery, p50 / p99 (ms):\n\n",
        Some("\nCPU per delivery, µs: this process (client) + every thread of the server (`mariadbd`/`mysqld`):\n\n"),
    ));
    doc.section(&text);
    charts.push((
        "throughput-mysql.svg".into(),
        "MariaDB / MySQL: deliveries/s (median, min–max)".into(),
        names,
        groups,
    ));
    env.cleanup().await;
    env.pool.close().await;
}
