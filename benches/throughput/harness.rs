//! The measuring loop shared by every backend: a delivery plan with a given
//! share of duplicates, N workers pulling deliveries from it for a fixed
//! time, per-delivery latencies.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// Also in `benches/e2e/run.rs` (`benches/e2e.rs` loads this file for its
// chart).
#[allow(clippy::duplicate_mod)]
#[path = "../shared/cpu.rs"]
mod cpu;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one delivery did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The effect ran (first delivery, or no idempotency at all).
    Fresh,
    /// Recognised as a duplicate and skipped.
    Duplicate,
    /// A lease store saw a concurrent claim (`InProgress`): to retry later.
    Busy,
}

/// One way of handling a delivery (a row of the tables).
pub trait Variant: Send + Sync + 'static {
    /// Handles the delivery of message `key`.
    fn deliver(&self, key: String) -> impl Future<Output = Result<Outcome, BoxError>> + Send;
    /// Empties the variant's tables before a run (not for the table-size runs).
    fn reset(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// Deliveries a worker takes at once (batch variants); 1 otherwise.
    fn batch(&self) -> usize {
        1
    }
    /// Handles `keys` together (only called when `batch() > 1`): one
    /// outcome per key, every one settled when this returns.
    fn deliver_batch(&self, keys: Vec<String>) -> impl Future<Output = Result<Vec<Outcome>, BoxError>> + Send {
        async move {
            let mut outcomes = Vec::with_capacity(keys.len());
            for key in keys {
                outcomes.push(self.deliver(key).await?);
            }
            Ok(outcomes)
        }
    }
}

/// Which message each delivery carries: message numbers, with `dup_pct` %
/// of the deliveries repeating an earlier message.
///
/// A duplicate repeats a message first delivered at least `GAP` fresh
/// messages earlier (so that, at the concurrencies measured, it is a
/// redelivery of a processed message rather than a concurrent one), chosen
/// uniformly among the `WINDOW` messages before that.
pub struct Plan {
    messages: Vec<u32>,
}

const GAP: u32 = 64;
const WINDOW: u32 = 10_000;

impl Plan {
    pub fn new(dup_pct: u32, len: usize, seed: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed ^ u64::from(dup_pct));
        let mut fresh: u32 = 0;
        let mut messages = Vec::with_capacity(len);
        for _ in 0..len {
            let dup = rng.random_range(0..100) < dup_pct && fresh > GAP;
            if dup {
                let newest = fresh - GAP;
                let span = newest.min(WINDOW);
                messages.push(newest - rng.random_range(0..span) - 1);
            } else {
                messages.push(fresh);
                fresh += 1;
            }
        }
        Plan { messages }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    pub deliveries: u64,
    pub fresh: u64,
    pub duplicates: u64,
    pub busy: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// Per-delivery latencies in microseconds, sorted.
    pub latencies_us: Vec<u32>,
    /// Start of each delivery (µs since the run started), for windows.
    pub starts_us: Vec<u32>,
    pub first_error: Option<String>,
    pub plan_exhausted: bool,
    /// CPU time of this process during the run (ns).
    pub client_cpu_ns: u64,
    /// CPU time of the database server's processes during the run (ns).
    pub server_cpu_ns: u64,
}

impl RunStats {
    /// One delivery that started at `t0` (the run at `start`) and ended now.
    fn record(&mut self, t0: Instant, start: Instant, keep_starts: bool, outcome: Result<Outcome, BoxError>) {
        self.deliveries += 1;
        self.latencies_us
            .push(u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX));
        if keep_starts {
            self.starts_us
                .push(u32::try_from((t0 - start).as_micros()).unwrap_or(u32::MAX));
        }
        match outcome {
            Ok(Outcome::Fresh) => self.fresh += 1,
            Ok(Outcome::Duplicate) => self.duplicates += 1,
            Ok(Outcome::Busy) => self.busy += 1,
            Err(error) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(error.to_string());
                }
            }
        }
    }

    pub fn rate(&self) -> f64 {
        self.deliveries as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn percentile(&self, p: f64) -> f64 {
        percentile(&self.latencies_us, p)
    }
}

pub fn percentile(sorted_us: &[u32], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted_us.len() - 1) as f64).round() as usize;
    f64::from(sorted_us[rank.min(sorted_us.len() - 1)])
}

pub struct RunOptions<'a> {
    pub concurrency: usize,
    pub duration: Duration,
    /// Key prefix of this run (keys are `{prefix}{message}`).
    pub prefix: &'a str,
    /// Keep per-delivery start times (for the purge windows).
    pub keep_starts: bool,
    /// Ends the run early when set.
    pub stop: Option<Arc<AtomicBool>>,
}

/// Runs `variant` with `concurrency` workers over `plan` for `duration`
/// (each worker finishes the delivery it is in when time is up).
pub async fn run<V: Variant>(variant: &Arc<V>, plan: &Arc<Plan>, opts: RunOptions<'_>) -> RunStats {
    let next = Arc::new(AtomicUsize::new(0));
    let cpu_before = cpu_snapshot();
    let start = Instant::now();
    let deadline = start + opts.duration;
    let mut tasks = Vec::with_capacity(opts.concurrency);
    for _ in 0..opts.concurrency {
        let (variant, plan, next) = (Arc::clone(variant), Arc::clone(plan), Arc::clone(&next));
        let prefix = opts.prefix.to_owned();
        let keep_starts = opts.keep_starts;
        let stop = opts.stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut stats = RunStats::default();
            stats.latencies_us.reserve(4096);
            loop {
                let now = Instant::now();
                if now >= deadline || stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed)) {
                    break;
                }
                let size = variant.batch().max(1);
                let i = next.fetch_add(size, Ordering::Relaxed);
                let Some(messages) = plan.messages.get(i..i + size) else {
                    stats.plan_exhausted = true;
                    break;
                };
                let t0 = Instant::now();
                // Each message of a batch is settled when the batch is: its
                // latency is the batch's.
                if size == 1 {
                    let outcome = variant.deliver(format!("{prefix}{}", messages[0])).await;
                    stats.record(t0, start, keep_starts, outcome);
                } else {
                    let keys = messages.iter().map(|m| format!("{prefix}{m}")).collect();
                    match variant.deliver_batch(keys).await {
                        Ok(outcomes) => {
                            for outcome in outcomes {
                                stats.record(t0, start, keep_starts, Ok(outcome));
                            }
                        }
                        Err(error) => stats.record(t0, start, keep_starts, Err(error)),
                    }
                }
            }
            stats
        }));
    }
    let mut total = RunStats::default();
    for task in tasks {
        let stats = task.await.expect("worker panicked");
        total.deliveries += stats.deliveries;
        total.fresh += stats.fresh;
        total.duplicates += stats.duplicates;
        total.busy += stats.busy;
        total.errors += stats.errors;
        total.plan_exhausted |= stats.plan_exhausted;
        if total.first_error.is_none() {
            total.first_error = stats.first_error;
        }
        if opts.keep_starts {
            // Keep latencies and starts paired: merge then sort pairs later.
            total.starts_us.extend(stats.starts_us);
        }
        total.latencies_us.extend(stats.latencies_us);
    }
    total.elapsed = start.elapsed();
    let cpu_after = cpu_snapshot();
    total.client_cpu_ns = cpu_after.client_ns.saturating_sub(cpu_before.client_ns);
    total.server_cpu_ns = cpu_after.server_ns.saturating_sub(cpu_before.server_ns);
    if !opts.keep_starts {
        total.latencies_us.sort_unstable();
    }
    if let Some(error) = &total.first_error {
        eprintln!("    ! {} errors, first: {error}", total.errors);
    }
    total
}

/// The result of one cell (variant × concurrency × duplicates) over its
/// repetitions.
#[derive(Debug, Clone)]
pub struct Cell {
    pub rates: Vec<f64>,
    pub latencies_us: Vec<u32>,
    pub duplicates: u64,
    pub deliveries: u64,
    pub busy: u64,
    pub errors: u64,
    pub client_cpu_ns: u64,
    pub server_cpu_ns: u64,
}

impl Cell {
    pub fn new() -> Cell {
        Cell {
            rates: Vec::new(),
            latencies_us: Vec::new(),
            duplicates: 0,
            deliveries: 0,
            busy: 0,
            errors: 0,
            client_cpu_ns: 0,
            server_cpu_ns: 0,
        }
    }

    /// CPU µs per delivery: (this process, the database server).
    pub fn cpu_us(&self) -> (f64, f64) {
        let n = self.deliveries.max(1) as f64;
        (
            self.client_cpu_ns as f64 / n / 1000.0,
            self.server_cpu_ns as f64 / n / 1000.0,
        )
    }

    pub fn add(&mut self, stats: &RunStats) {
        self.rates.push(stats.rate());
        // At most ~100k latencies per run: a strided sample of the sorted
        // latencies keeps the percentiles.
        let stride = stats.latencies_us.len().div_ceil(100_000).max(1);
        self.latencies_us.extend(stats.latencies_us.iter().step_by(stride));
        self.latencies_us.sort_unstable();
        self.duplicates += stats.duplicates;
        self.deliveries += stats.deliveries;
        self.busy += stats.busy;
        self.errors += stats.errors;
        self.client_cpu_ns += stats.client_cpu_ns;
        self.server_cpu_ns += stats.server_cpu_ns;
    }

    /// Median of the repetitions' rates.
    pub fn rate(&self) -> f64 {
        let mut r = self.rates.clone();
        r.sort_by(f64::total_cmp);
        median(&r)
    }

    pub fn min_max(&self) -> (f64, f64) {
        let min = self.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.rates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }

    pub fn p(&self, p: f64) -> f64 {
        percentile(&self.latencies_us, p)
    }
}

/// The median of sorted values (NaN for none).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// CPU time consumed so far (ns, from `/proc/*/schedstat`) by this process
/// and by the database servers (`postgres` and `redis-server` processes, and
/// every thread of `mariadbd`/`mysqld`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSnapshot {
    pub client_ns: u64,
    pub server_ns: u64,
}

pub fn cpu_snapshot() -> CpuSnapshot {
    let [server_ns] = cpu::processes_ns(|comm| {
        if comm.starts_with("postgres") || comm.starts_with("redis-server") || comm.starts_with("valkey-server") {
            Some(cpu::Count::Main(0))
        } else if comm.starts_with("mariadbd") || comm.starts_with("mysqld") {
            // One process, a thread per connection.
            Some(cpu::Count::Threads(0))
        } else {
            None
        }
    });
    CpuSnapshot {
        client_ns: cpu::own_ns(),
        server_ns,
    }
}
