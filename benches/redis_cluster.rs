//! Claims per second of `RedisStore` on a Redis Cluster, with and without
//! `wait_for_replicas`, side by side in one run (issue 30), beside one
//! server alone and one server with a replica.
//!
//! ```text
//! cargo bench --bench redis_cluster                          # 3 rounds of 4 variants, 5 s each (~1.5 min)
//! IDEMPOTENT_BENCH_SECONDS=2 IDEMPOTENT_BENCH_ROUNDS=1 cargo bench --bench redis_cluster
//! ```
//!
//! Every server is a private Valkey 8.1 process of this machine (the
//! cluster: 3 primaries with a replica each, `common::cluster`); 32 tasks
//! claim and complete fresh keys (an empty body) as fast as they can. The
//! variants take turns, round after round, and the median of the rounds is
//! reported with the load average of the machine before and after: compare
//! the ratios of one run, not figures of different runs.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::cluster::{RedisCluster, ValkeyPair};
use idempotent_runtime::{Error, RedisStore, idempotent};

const TASKS: usize = 32;

#[idempotent(key = "id", store = store, scope = "bench", ttl = "2m")]
async fn claim(store: &RedisStore, id: u64) -> Result<(), Error> {
    Ok(())
}

/// Claims completed per second by `TASKS` tasks over `seconds`.
async fn measure(store: &RedisStore, next: &Arc<AtomicU64>, seconds: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (store, next) = (store.clone(), Arc::clone(next));
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < deadline {
                    claim(&store, next.fetch_add(1, Ordering::Relaxed))
                        .await
                        .expect("claim");
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut done = 0;
    for task in tasks {
        done += task.await.expect("bench task");
    }
    done as f64 / started.elapsed().as_secs_f64()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn setting(name: &str, default: f64) -> f64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    let seconds = setting("IDEMPOTENT_BENCH_SECONDS", 5.0);
    let rounds = setting("IDEMPOTENT_BENCH_ROUNDS", 3.0) as usize;
    let load_before = load_average();
    let (cluster, pair, single) = tokio::task::spawn_blocking(|| {
        (
            RedisCluster::start(3),
            ValkeyPair::start(),
            common::servers::ChildServer::valkey(),
        )
    })
    .await
    .expect("start the servers");
    let manager = |url: String| async move {
        let client = idempotent_runtime::redis::Client::open(url).expect("url");
        client.get_connection_manager().await.expect("connect")
    };
    let wait = Duration::from_secs(1);
    let prefix = |name: &str| format!("{}:", common::unique(name));
    let variants: Vec<(&str, RedisStore)> = vec![
        (
            "one server",
            RedisStore::builder(manager(single.redis_url()).await)
                .prefix(prefix("one"))
                .build()
                .expect("store"),
        ),
        (
            "one server + replica, wait_for_replicas(1)",
            RedisStore::builder(manager(pair.primary.redis_url()).await)
                .prefix(prefix("pair"))
                .wait_for_replicas(1, wait)
                .build()
                .expect("store"),
        ),
        (
            "cluster (3 primaries, 3 replicas)",
            RedisStore::cluster_builder(cluster.connection().await)
                .prefix(prefix("cluster"))
                .build()
                .expect("store"),
        ),
        (
            "cluster, wait_for_replicas(1)",
            RedisStore::cluster_builder(cluster.connection().await)
                .prefix(prefix("cluster_wait"))
                .wait_for_replicas(1, wait)
                .build()
                .expect("store"),
        ),
    ];
    let next = Arc::new(AtomicU64::new(0));
    // Warm up: connections, scripts, the servers' allocators.
    for (_, store) in &variants {
        measure(store, &next, 0.5).await;
    }
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        for (i, (name, store)) in variants.iter().enumerate() {
            let rate = measure(store, &next, seconds).await;
            eprintln!("round {}: {name}: {rate:.0} claims/s", round + 1);
            results[i].push(rate);
        }
    }
    let load_after = load_average();
    let medians: Vec<f64> = results.iter_mut().map(|r| median(r)).collect();
    let base = medians[2];
    println!(
        "\n{TASKS} tasks, fresh keys, empty body; median of {rounds} rounds of {seconds} s; \
         load average before {load_before}, after {load_after}\n"
    );
    println!("| variant | claims/s | vs. cluster without waiting |");
    println!("| --- | ---: | ---: |");
    for ((name, _), rate) in variants.iter().zip(&medians) {
        println!("| {name} | {rate:.0} | {:.2} |", rate / base);
    }
}
