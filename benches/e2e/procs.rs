//! `--processes=N`: the consumer in N operating-system processes (this
//! benchmark's own binary, started with `--child`) competing on one queue,
//! the drain rate summed over them.
//!
//! Each child opens the queue the parent made ([`Queue::open`]), consumes
//! it into the parent's tables ([`Env::attach`]) and prints its progress on
//! standard output, a line `p <received> <settled>` whenever it changed
//! (at most every 2 ms); the parent's clock runs from the first delivery in
//! any child to the moment their settled messages add up to the run's. The
//! parent then closes their standard input, which stops them; each prints
//! `end <acked> <dead-lettered> <failed> <batches> <batched>` and exits.
//! CPU: every thread of the children (the consumers), PostgreSQL's
//! processes, the broker's server. On Kafka the topic has `slots` partitions
//! per process, and the group's rebalances, as the children join, fall in
//! the measured time.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

use crate::brokers::{BoxError, Kind, Queue};
use crate::run::{Env, Sample, Variant, cpu, plan, start_on};

/// The environment variable that tells a child what to consume.
const SPEC: &str = "IDEMPOTENT_E2E_CHILD";

/// One run of `variant` in `processes` consumer processes of `slots` slots
/// each, on a queue filled beforehand with `n` messages, `dup_pct` %
/// duplicates.
#[allow(clippy::too_many_arguments)] // the benchmark's matrix, one argument per axis
pub async fn run(
    env: &Arc<Env>,
    kind: Kind,
    variant: Variant,
    slots: usize,
    n: usize,
    dup_pct: u32,
    seed: u64,
    processes: usize,
) -> Result<Sample, BoxError> {
    let name = crate::unique("e2e");
    let prefix = format!("{name}-");
    let bodies = plan(&prefix, n, dup_pct, seed);
    let distinct = bodies
        .iter()
        .map(|b| b.as_slice())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let partitions = slots * processes;
    let queue = Queue::setup(kind, &name, partitions, env.kafka.as_ref()).await?;
    queue.publish(&bodies).await?;

    let bootstrap = env.kafka.as_ref().map(|k| k.bootstrap()).unwrap_or_default();
    let [markers, effects, hand] = env.tables();
    let spec = [
        kind.name().to_owned(),
        variant.label(),
        slots.to_string(),
        name.clone(),
        partitions.to_string(),
        markers,
        effects,
        hand,
        bootstrap,
    ]
    .join(";");
    let exe = std::env::current_exe()?;
    let mut children = Vec::with_capacity(processes);
    for _ in 0..processes {
        children.push(Child::spawn(&exe, &spec)?);
    }

    let received = || children.iter().map(|c| c.received.load(Ordering::Relaxed)).sum::<u64>();
    let settled = || children.iter().map(|c| c.settled.load(Ordering::Relaxed)).sum::<u64>();
    let deadline = Instant::now() + Duration::from_secs(600);
    while received() == 0 && Instant::now() < deadline && children.iter().all(Child::alive) {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let cpu_of = |children: &[Child]| {
        let [db, broker] = server_cpu(kind);
        let consumers: u64 = children
            .iter()
            .map(|c| cpu::threads_ns(&PathBuf::from(format!("/proc/{}", c.pid))))
            .sum();
        (consumers, db, broker)
    };
    let (t0, cpu0) = (Instant::now(), cpu_of(&children));
    while settled() < n as u64 && Instant::now() < deadline && children.iter().all(Child::alive) {
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let (elapsed, cpu1) = (t0.elapsed(), cpu_of(&children));
    let mut totals = [0u64; 5];
    for child in children {
        for (total, value) in totals.iter_mut().zip(child.stop().await?) {
            *total += value;
        }
    }
    queue.teardown(&env.pool).await?;
    let [acked, dead_lettered, failed, batches, batched] = totals;
    if acked + dead_lettered < n as u64 {
        return Err(format!("{} of {n} settled by {processes} processes", acked + dead_lettered).into());
    }
    let per = |ns: u64| ns as f64 / 1e3 / n as f64;
    Ok(Sample {
        rate: n as f64 / elapsed.as_secs_f64(),
        cpu_us: (
            per(cpu1.0.saturating_sub(cpu0.0)),
            per(cpu1.1.saturating_sub(cpu0.1)),
            per(cpu1.2.saturating_sub(cpu0.2)),
        ),
        latencies_us: Vec::new(),
        acked,
        dead_lettered,
        failed,
        batch_size: if batches == 0 {
            0.0
        } else {
            batched as f64 / batches as f64
        },
        effects: env.effects(&prefix).await?,
        distinct,
    })
}

/// PostgreSQL's and the broker's CPU time so far (ns).
fn server_cpu(kind: Kind) -> [u64; 2] {
    let server = kind.server_comm();
    cpu::processes_ns(|comm| {
        if comm.starts_with("postgres") {
            Some(cpu::Count::Main(0))
        } else if comm == server {
            Some(cpu::Count::Threads(1))
        } else {
            None
        }
    })
}

/// A consumer process and what it said.
struct Child {
    process: tokio::process::Child,
    pid: u32,
    received: Arc<AtomicU64>,
    settled: Arc<AtomicU64>,
    /// Its last line (`end ...`) once it stopped.
    reader: tokio::task::JoinHandle<Result<String, std::io::Error>>,
}

impl Child {
    fn spawn(exe: &std::path::Path, spec: &str) -> Result<Child, BoxError> {
        let mut process = Command::new(exe)
            .arg("--child")
            .env(SPEC, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let pid = process.id().ok_or("the consumer process ended at once")?;
        let stdout = process.stdout.take().ok_or("no standard output")?;
        let (received, settled) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (r, s) = (Arc::clone(&received), Arc::clone(&settled));
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            let mut last = String::new();
            while let Some(line) = lines.next_line().await? {
                let mut words = line.split_whitespace();
                if words.next() == Some("p") {
                    let mut next = || words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
                    r.store(next(), Ordering::Relaxed);
                    s.store(next(), Ordering::Relaxed);
                } else {
                    last = line;
                }
            }
            Ok(last)
        });
        Ok(Child {
            process,
            pid,
            received,
            settled,
            reader,
        })
    }

    fn alive(&self) -> bool {
        !self.reader.is_finished()
    }

    /// Closes its standard input (it stops), waits for its end and reads
    /// its totals: acked, dead-lettered, failed, batches, batched.
    async fn stop(mut self) -> Result<[u64; 5], BoxError> {
        if let Some(mut stdin) = self.process.stdin.take() {
            // Closing is the signal; a child already gone is seen below.
            let _ = stdin.shutdown().await;
        }
        let status = tokio::time::timeout(Duration::from_secs(60), self.process.wait()).await??;
        let last = self.reader.await??;
        let mut totals = [0u64; 5];
        let mut words = last.split_whitespace();
        if !status.success() || words.next() != Some("end") {
            return Err(format!("a consumer process ended with {status}, its last line `{last}`").into());
        }
        for (total, word) in totals.iter_mut().zip(words) {
            *total = word.parse()?;
        }
        Ok(totals)
    }
}

/// The child's side (`--child`): consumes what `IDEMPOTENT_E2E_CHILD`
/// names until its standard input closes.
pub async fn child() -> Result<(), BoxError> {
    let spec = std::env::var(SPEC).map_err(|_| format!("--child needs {SPEC}"))?;
    let parts: Vec<&str> = spec.split(';').collect();
    let &[
        kind,
        variant,
        slots,
        name,
        partitions,
        markers,
        effects,
        hand,
        bootstrap,
    ] = parts.as_slice()
    else {
        return Err(format!("cannot read {SPEC}=`{spec}`").into());
    };
    let kind = Kind::ALL
        .into_iter()
        .find(|k| k.name() == kind)
        .ok_or_else(|| format!("no broker `{kind}`"))?;
    let variant = Variant::parse(variant).ok_or_else(|| format!("no variant `{variant}`"))?;
    let slots: usize = slots.parse()?;
    let env = Env::attach(
        u32::try_from(slots + 2)?,
        [markers.to_owned(), effects.to_owned(), hand.to_owned()],
    )
    .await?;
    let bootstrap = (!bootstrap.is_empty()).then_some(bootstrap);
    let queue = Queue::open(kind, name, partitions.parse()?, bootstrap).await?;
    let (stats, run, shutdown) = start_on(&env, &queue, kind, variant, slots)?;
    // The parent closes our standard input to stop us.
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
        stop.cancel();
    });
    let mut out = tokio::io::stdout();
    let mut said = (0, 0);
    while !shutdown.is_cancelled() && !run.is_finished() {
        let snap = stats.snapshot();
        let now = (snap.received, snap.acked + snap.dead_lettered);
        if now != said {
            out.write_all(format!("p {} {}\n", now.0, now.1).as_bytes()).await?;
            out.flush().await?;
            said = now;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    shutdown.cancel();
    run.await??;
    let snap = stats.snapshot();
    out.write_all(
        format!(
            "end {} {} {} {} {}\n",
            snap.acked, snap.dead_lettered, snap.failed, snap.batches, snap.batched
        )
        .as_bytes(),
    )
    .await?;
    out.flush().await?;
    Ok(())
}
