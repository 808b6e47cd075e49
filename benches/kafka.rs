//! Kafka consumer throughput (issue 28): messages per second per partition
//! count, for a consumer without idempotency, marker mode and
//! offsets-in-the-database mode, side by side in one run.
//!
//! ```text
//! cargo bench --bench kafka                                  # ~5 min
//! cargo bench --bench kafka -- --messages=N --rounds=R --partitions=1,4,8
//! ```
//!
//! A private Tansu broker (the Kafka-protocol broker of the tests, installed
//! by `.ci/kafka`) and the PostgreSQL of `.ci/run`. For each partition
//! count, one topic holds `--messages` payments spread evenly over its
//! partitions; each measurement consumes it from its start with a fresh
//! consumer group (concurrency 8: one lane per partition), each record's
//! effect a row inserted in PostgreSQL, in one of three modes:
//!
//! - **(a) no idempotency**: the effect in a transaction of its own, then
//!   the offset committed to Kafka (batched);
//! - **(b) markers**: an `#[idempotent]` handler, marker and effect in one
//!   transaction, then the Kafka commit;
//! - **(c) offsets in the database**: the same handler with
//!   `offsets_in(store)`: marker, effect and the partition's next offset in
//!   one transaction (Kafka commits kept as a hint).
//!
//! The clock runs from the first handler call (the group's join left out)
//! to the last acknowledgement. The modes take turns within each round
//! (rounds × partition counts × modes), so that load on the machine falls
//! on all of them alike; the table gives each one's median over the rounds,
//! and the ratios to (a) and (b). The load average is printed before and
//! after: compare ratios within one run, not figures across runs.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "kafka/run.rs"]
mod run;

use run::Mode;

fn arg(name: &str) -> Option<String> {
    std::env::args().find_map(|a| a.strip_prefix(&format!("--{name}=")).map(str::to_owned))
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[tokio::main]
async fn main() {
    let messages: usize = arg("messages").and_then(|v| v.parse().ok()).unwrap_or(2000);
    let rounds: usize = arg("rounds").and_then(|v| v.parse().ok()).unwrap_or(3);
    let partitions: Vec<i32> = arg("partitions")
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 8]);
    println!(
        "Kafka consumer throughput: {messages} messages per measurement, {rounds} rounds, partitions {partitions:?}"
    );
    println!("load average before: {}", load());
    let kafka = common::kafka::Kafka::start();
    let pool = common::pg_pool(16).await;
    let mut topics = Vec::new();
    for &p in &partitions {
        topics.push((p, run::topic(&kafka, p, messages).await));
    }
    let mut rates: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); Mode::ALL.len()]; partitions.len()];
    for round in 1..=rounds {
        for (i, (p, topic)) in topics.iter().enumerate() {
            for (m, mode) in Mode::ALL.iter().enumerate() {
                match run::measure(&kafka, &pool, topic, *mode, messages).await {
                    Ok(rate) => {
                        eprintln!("round {round} partitions {p} {}: {rate:.0} msg/s", mode.label());
                        rates[i][m].push(rate);
                    }
                    Err(error) => eprintln!("round {round} partitions {p} {}: failed: {error}", mode.label()),
                }
            }
        }
    }
    println!("load average after: {}", load());
    println!();
    println!(
        "| partitions | {} | {} | {} | (b)/(a) | (c)/(a) | (c)/(b) |",
        Mode::ALL[0].label(),
        Mode::ALL[1].label(),
        Mode::ALL[2].label()
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (i, p) in partitions.iter().enumerate() {
        let [a, b, c] = [0, 1, 2].map(|m| median(rates[i][m].clone()));
        println!(
            "| {p} | {a:.0} msg/s | {b:.0} msg/s | {c:.0} msg/s | {:.2} | {:.2} | {:.2} |",
            b / a,
            c / a,
            c / b
        );
    }
}
