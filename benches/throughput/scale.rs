//! The marker table as it grows (issue 12, part 3): claim throughput with
//! 0 / 1 M / 10 M / 50 M live markers already in the table, every size
//! filled first and then measured interleaved, and the same claims while
//! `PgStore::purge_expired` runs on the same table.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::PgStore;
use idempotent_runtime::sqlx::{self, AssertSqlSafe};

use crate::harness::{self, Cell, Plan, RunOptions, RunStats, Variant};
use crate::{Config, Doc, Plans, fmt_count, pg, report};

/// Concurrency of every run of the section.
const CONCURRENCY: usize = 8;
/// Share of duplicates of every run of the section (%).
const DUPLICATES: u32 = 20;
/// Above this, the purge part drops from 5 to 3 repetitions.
const SECTION_BUDGET: Duration = Duration::from_secs(15 * 60);

/// One pre-filled marker table and what was measured on it.
struct Sized {
    markers: u64,
    fill: Duration,
    bytes: i64,
    tables: pg::Tables,
    claim_first: Arc<pg::ClaimFirst>,
    with_macro: Arc<pg::Macro<PgStore>>,
    store: PgStore,
    /// (c) and (d), no purge.
    c: Cell,
    d: Cell,
    /// (d) while the purge runs (deliveries started inside the purge).
    during: Cell,
    purge_rates: Vec<f64>,
    purge_secs: Vec<f64>,
}

pub async fn table_size_section(cfg: &Config, doc: &mut Doc, env: &pg::PgEnv, plans: &Plans, warm: &Arc<Plan>) {
    let section_started = Instant::now();
    let load_before = crate::loadavg();
    let sizes: Vec<u64> = if cfg.quick {
        vec![0, 100_000]
    } else {
        vec![0, 1_000_000, 10_000_000, 50_000_000]
    };
    let reps = if cfg.quick { 1 } else { 5 };
    let expired: u64 = if cfg.quick { 50_000 } else { 500_000 };
    let plan = plans.get(DUPLICATES);

    // 1. Fill every table before measuring anything.
    let mut tables = Vec::with_capacity(sizes.len());
    for &n in &sizes {
        eprintln!("  size: filling {} markers…", fmt_count(n));
        let (t, fill) = pg::prefilled(env, &format!("size{n}"), n, false).await;
        let bytes = pg::relation_size(&env.pool, &t.markers).await;
        eprintln!(
            "  size: {} markers in {:.1} s, {}",
            fmt_count(n),
            fill.as_secs_f64(),
            fmt_bytes(bytes)
        );
        tables.push(Sized {
            markers: n,
            fill,
            bytes,
            claim_first: Arc::new(pg::ClaimFirst::new(t.clone(), false)),
            with_macro: Arc::new(pg::Macro::new(t.clone(), t.store())),
            store: t.store(), // default purge batch: 1000 markers per statement
            tables: t,
            c: Cell::new(),
            d: Cell::new(),
            during: Cell::new(),
            purge_rates: Vec::new(),
            purge_secs: Vec::new(),
        });
    }
    // The fills wrote gigabytes of WAL: flush them now rather than during the runs.
    let started = Instant::now();
    exec(env, "CHECKPOINT".into()).await;
    eprintln!(
        "  size: CHECKPOINT after the fills: {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // 2. Claims, interleaved: sizes in a rotating order, (c) and (d) alternating.
    for rep in 0..reps {
        let count = tables.len();
        for k in 0..count {
            let si = (k + rep) % count;
            for v in 0..2 {
                let which = (v + k + rep) % 2;
                let tab = &mut tables[si];
                let prefix = format!("n{}r{rep}v{which}-", tab.markers);
                let stats = if which == 0 {
                    measure(&tab.claim_first, &plan, warm, cfg, &prefix).await
                } else {
                    measure(&tab.with_macro, &plan, warm, cfg, &prefix).await
                };
                eprintln!(
                    "  size rep {rep} {:>5} {}: {:>6}/s  p50 {} ms  p99 {} ms",
                    fmt_count(tab.markers),
                    if which == 0 { "(c)" } else { "(d)" },
                    report::fmt_rate(stats.rate()),
                    report::fmt_ms(stats.percentile(50.0)),
                    report::fmt_ms(stats.percentile(99.0)),
                );
                if which == 0 { &mut tab.c } else { &mut tab.d }.add(&stats);
            }
        }
    }
    let claims_added = count_scope(env, &tables[0].tables.markers).await;

    // 3. (d) beside the purge, interleaved across the sizes: 5 repetitions,
    // or 3 if 5 would take the section past its budget.
    let mut purge_reps = reps;
    let mut rep = 0;
    while rep < purge_reps {
        let rep_started = Instant::now();
        let count = tables.len();
        for k in 0..count {
            let tab = &mut tables[(k + rep) % count];
            beside_purge(tab, env, &plan, warm, cfg, rep, expired).await;
        }
        rep += 1;
        if rep == 1 && purge_reps > 3 {
            let projected = section_started.elapsed() + rep_started.elapsed() * (purge_reps - 1) as u32;
            if projected > SECTION_BUDGET {
                eprintln!(
                    "  size: projected {:.0} s with 5 purge repetitions: 3",
                    projected.as_secs_f64()
                );
                purge_reps = 3;
            }
        }
    }

    // 4. The tables.
    let (c0, d0) = (tables[0].c.rate(), tables[0].d.rate());
    let mut text = format!(
        "## The marker table as it grows\n\nClaims at concurrency {CONCURRENCY}, {DUPLICATES} % duplicates, on marker \
         tables already holding N live markers of another scope. Every table is filled first (one `INSERT .. SELECT \
         generate_series`, then the primary key and the expiry index, then `VACUUM ANALYZE`; then one `CHECKPOINT` \
         for all), then measured **interleaved**: {}, each visiting the sizes in a rotating order \
         and, per size, (c) and (d) in alternating order; each run is a {} ms warm-up then {} ms of measurement. \
         Figures are the median of the runs per size and variant{}; latencies are pooled over them. The tables are not emptied \
         between runs: each run adds its own markers (the 0-marker table held {} markers after the last run, and \
         every table received the same claims). Load average at the start of the section: {load_before}.\n\n\
         | markers in the table | fill + index + `VACUUM ANALYZE` | table + indexes | (c) claim-first /s | \
         (d) #[idempotent] /s | d/c | (c) ÷ (c) at 0 | (d) ÷ (d) at 0 | (d) p50 / p99 ms |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        repetitions(reps),
        cfg.timing.warmup.as_millis(),
        cfg.timing.duration.as_millis(),
        if reps > 1 { ", min–max in small type" } else { "" },
        fmt_count(claims_added),
    );
    for tab in &tables {
        let _ = writeln!(
            text,
            "| {} | {:.1} s | {} | {} | {} | {} | {} | {} | {} / {} |",
            fmt_count(tab.markers),
            tab.fill.as_secs_f64(),
            fmt_bytes(tab.bytes),
            fmt_cell(&tab.c, reps),
            fmt_cell(&tab.d, reps),
            report::fmt_ratio(tab.d.rate(), tab.c.rate()),
            report::fmt_ratio(tab.c.rate(), c0),
            report::fmt_ratio(tab.d.rate(), d0),
            report::fmt_ms(tab.d.p(50.0)),
            report::fmt_ms(tab.d.p(99.0)),
        );
    }
    let _ = write!(
        text,
        "\n**Beside the purge.** Before each run, {} expired markers are added to the table (one `INSERT .. SELECT`, \
         then `ANALYZE`) and (d) warms up; then (d) at c={CONCURRENCY}, {DUPLICATES} % duplicates, and \
         `PgStore::purge_expired()` (batches of 1000 by `ctid`, `FOR UPDATE SKIP LOCKED`) start together, and the \
         claims stop when the purge returns. Counted: the deliveries started while the purge ran. After each run, \
         `VACUUM` on the table (autovacuum is off on this server), outside the measurement. Interleaved like the \
         claims above: {}, sizes in a rotating order, median{}{}.\n\n\
         | markers in the table | claims/s during the purge | ÷ same size without purge | ÷ 0 markers without purge \
         | claims p99 ms during the purge (without) | purge markers/s | purge time |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
        fmt_count(expired),
        repetitions(purge_reps),
        if purge_reps > 1 {
            ", min–max in small type"
        } else {
            ""
        },
        if purge_reps < reps {
            format!(
                " (3, not {reps}: the first repetition projected the section past {} minutes)",
                SECTION_BUDGET.as_secs() / 60
            )
        } else {
            String::new()
        },
    );
    for tab in &tables {
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} | {} ({}) | {} | {:.2} s |",
            fmt_count(tab.markers),
            fmt_cell(&tab.during, purge_reps),
            report::fmt_ratio(tab.during.rate(), tab.d.rate()),
            report::fmt_ratio(tab.during.rate(), d0),
            report::fmt_ms(tab.during.p(99.0)),
            report::fmt_ms(tab.d.p(99.0)),
            fmt_median(&tab.purge_rates, purge_reps),
            median(&tab.purge_secs),
        );
    }
    let _ = writeln!(
        text,
        "\nSection time {:.0} s; load average at its end: {}.",
        section_started.elapsed().as_secs_f64(),
        crate::loadavg()
    );
    doc.section(&text);
    env.cleanup().await; // free the disk
}

/// A warm-up run, then the measured run (the table is not emptied).
async fn measure<V: Variant>(v: &Arc<V>, plan: &Arc<Plan>, warm: &Arc<Plan>, cfg: &Config, prefix: &str) -> RunStats {
    let warm_prefix = format!("w{prefix}");
    let warm_opts = RunOptions {
        concurrency: CONCURRENCY,
        duration: cfg.timing.warmup,
        prefix: &warm_prefix,
        keep_starts: false,
        stop: None,
    };
    harness::run(v, warm, warm_opts).await;
    let opts = RunOptions {
        concurrency: CONCURRENCY,
        duration: cfg.timing.duration,
        prefix,
        keep_starts: false,
        stop: None,
    };
    harness::run(v, plan, opts).await
}

/// Adds `expired` markers, then runs (d) and the purge together; records
/// the claims started during the purge and the purge's rate.
async fn beside_purge(
    tab: &mut Sized,
    env: &pg::PgEnv,
    plan: &Arc<Plan>,
    warm: &Arc<Plan>,
    cfg: &Config,
    rep: usize,
    expired: u64,
) {
    let n = tab.markers;
    pg::add_expired(&tab.tables, expired, &format!("x{rep}")).await;
    let warm_prefix = format!("wp{n}r{rep}-");
    let warm_opts = RunOptions {
        concurrency: CONCURRENCY,
        duration: cfg.timing.warmup,
        prefix: &warm_prefix,
        keep_starts: false,
        stop: None,
    };
    harness::run(&tab.with_macro, warm, warm_opts).await;

    let stop = Arc::new(AtomicBool::new(false));
    let (store, done) = (tab.store.clone(), Arc::clone(&stop));
    let origin = Instant::now();
    let purge = tokio::spawn(async move {
        let started = Instant::now();
        let deleted = store.purge_expired().await.unwrap();
        let ended = Instant::now();
        done.store(true, Ordering::Relaxed);
        (deleted, started, ended)
    });
    let prefix = format!("p{n}r{rep}-");
    let opts = RunOptions {
        concurrency: CONCURRENCY,
        duration: Duration::from_secs(600),
        prefix: &prefix,
        keep_starts: true,
        stop: Some(stop),
    };
    let claims = harness::run(&tab.with_macro, plan, opts).await;
    let (deleted, started, ended) = purge.await.unwrap();
    let took = ended - started;
    let inside = window(&claims, started - origin, ended - origin);
    let rate = deleted as f64 / took.as_secs_f64().max(1e-9);
    eprintln!(
        "  size purge rep {rep} {:>5}: {} expired in {:.2} s ({}/s); claims {}/s  p99 {} ms",
        fmt_count(n),
        fmt_count(deleted),
        took.as_secs_f64(),
        report::fmt_rate(rate),
        report::fmt_rate(inside.rate()),
        report::fmt_ms(inside.percentile(99.0)),
    );
    tab.during.add(&inside);
    tab.purge_rates.push(rate);
    tab.purge_secs.push(took.as_secs_f64());

    let started = Instant::now();
    exec(env, format!("VACUUM {}", tab.tables.markers)).await;
    eprintln!("  size purge: VACUUM {:.1} s", started.elapsed().as_secs_f64());
}

/// The deliveries of `stats` (run with `keep_starts`) started inside
/// `[from, to)`, as a run of that length.
fn window(stats: &RunStats, from: Duration, to: Duration) -> RunStats {
    let (lo, hi) = (from.as_micros() as u32, to.as_micros() as u32);
    let mut latencies_us: Vec<u32> = stats
        .starts_us
        .iter()
        .zip(&stats.latencies_us)
        .filter(|(s, _)| (lo..hi).contains(*s))
        .map(|(_, l)| *l)
        .collect();
    latencies_us.sort_unstable();
    RunStats {
        deliveries: latencies_us.len() as u64,
        elapsed: to.min(stats.elapsed).saturating_sub(from),
        latencies_us,
        ..RunStats::default()
    }
}

async fn exec(env: &pg::PgEnv, sql: String) {
    sqlx::query(AssertSqlSafe(sql)).execute(&env.pool).await.unwrap();
}

/// Markers the claims wrote into `table` (their scope, not the fill's).
async fn count_scope(env: &pg::PgEnv, table: &str) -> u64 {
    let sql = format!("SELECT count(*) FROM {table} WHERE scope = 'handle'");
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&env.pool)
        .await
        .unwrap();
    n as u64
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Median rate, with min–max when there are several runs.
fn fmt_cell(cell: &Cell, reps: usize) -> String {
    fmt_median(&cell.rates, reps)
}

fn fmt_median(values: &[f64], reps: usize) -> String {
    let m = report::fmt_rate(median(values));
    if reps < 2 {
        return m;
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{m} <sub>{}–{}</sub>", report::fmt_rate(min), report::fmt_rate(max))
}

fn repetitions(n: usize) -> String {
    if n == 1 {
        "1 repetition".into()
    } else {
        format!("{n} repetitions")
    }
}

fn fmt_bytes(bytes: i64) -> String {
    if bytes < 1_000_000 {
        format!("{:.0} kB", bytes as f64 / 1e3)
    } else if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.0} MB", bytes as f64 / 1e6)
    }
}
