//! CPU time of processes, from `/proc/*/schedstat` (ns): the benchmarks'
//! CPU per message, of this process and of the servers it talks to
//! (shared by `benches/throughput/harness.rs` and `benches/e2e/run.rs`).

use std::path::Path;

/// The CPU time of the thread or process whose `schedstat` is at `path`
/// (0 when it is gone).
pub fn schedstat_ns(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// CPU time of every live thread of the process at `proc` (`/proc/<pid>`).
pub fn threads_ns(proc: &Path) -> u64 {
    std::fs::read_dir(proc.join("task")).map_or(0, |tasks| {
        tasks.flatten().map(|t| schedstat_ns(&t.path().join("schedstat"))).sum()
    })
}

/// Every thread of this process.
pub fn own_ns() -> u64 {
    threads_ns(Path::new("/proc/self"))
}

/// How a process counts, by its `comm`: in which of the `N` sums, and
/// whether with all its threads (a process with a thread per connection or
/// a thread pool: its own `schedstat` counts its main thread only) or its
/// main thread (one process per connection, as PostgreSQL's).
pub enum Count {
    Main(usize),
    Threads(usize),
}

/// The CPU time of the machine's processes, summed into `N` sums by
/// `classify` (`None`: not counted).
pub fn processes_ns<const N: usize>(classify: impl Fn(&str) -> Option<Count>) -> [u64; N] {
    let mut sums = [0; N];
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if !p.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let path = p.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        match classify(comm.trim_end()) {
            Some(Count::Main(i)) if i < N => sums[i] += schedstat_ns(&path.join("schedstat")),
            Some(Count::Threads(i)) if i < N => sums[i] += threads_ns(&path),
            _ => {}
        }
    }
    sums
}
