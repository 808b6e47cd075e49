//! Chaos: several consumer **processes** against the real RabbitMQ and
//! PostgreSQL while a driver SIGKILLs them at random moments (mid-body,
//! between commit and ack, mid-retry) and restarts them; handlers fail at
//! random and some messages always fail. At the end every message's effect
//! is in the database exactly once, or the message is in the dead-letter
//! queue: nothing is lost, nothing is applied twice.
//!
//! The fast run is part of the default test command. The soak runs with
//! `IDEMPOTENT_SOAK=1 cargo test --test chaos -- --nocapture` and prints its
//! figures (the README quotes the last one); `IDEMPOTENT_SOAK_MESSAGES`
//! sizes it (default 20 000).

mod common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotent_runtime::PgStore;
use idempotent_runtime::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::FieldTable;
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgPool};
use rand::Rng;
use rand::seq::SliceRandom;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

struct Plan {
    messages: usize,
    duplicate_percent: u32,
    always_fail_percent: u32,
    consumers: usize,
    fail_percent: u32,
    crash_percent: u32,
    kills: usize,
    kill_every: (u64, u64),
    deadline: Duration,
}

#[derive(Debug, Default)]
struct Figures {
    messages: usize,
    published: usize,
    deliveries: i64,
    kills: usize,
    crashes_after_commit: i64,
    injected_failures: i64,
    effects: i64,
    dead_lettered: usize,
    /// Dead-lettered and never applied.
    dead_only: usize,
    lost: usize,
    applied_twice: usize,
    elapsed: Duration,
}

struct Consumers {
    args: Vec<String>,
    children: Vec<Child>,
    restarts: usize,
}

impl Consumers {
    fn spawn(&self) -> Child {
        Command::new(env!("CARGO_BIN_EXE_consumer_process"))
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start consumer process")
    }

    /// Restarts consumers that died by themselves (aborted after a commit).
    fn revive(&mut self) {
        for i in 0..self.children.len() {
            if self.children[i].try_wait().unwrap().is_some() {
                self.children[i] = self.spawn();
                self.restarts += 1;
            }
        }
    }

    fn kill_one(&mut self) {
        let i = rand::rng().random_range(0..self.children.len());
        self.children[i].kill().unwrap(); // SIGKILL
        self.children[i].wait().unwrap();
        self.children[i] = self.spawn();
    }

    fn stop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn publish(channel: &Channel, queue: &str, body: Vec<u8>) {
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into());
    let confirm = channel
        .basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &body, props)
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
}

async fn ready(channel: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap()
        .message_count()
}

/// Takes what reached the dead-letter queue so far: message ids.
async fn drain_ids(channel: &Channel, queue: &str, into: &mut HashSet<String>) -> usize {
    let mut taken = 0;
    while let Some(msg) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let body: serde_json::Value = serde_json::from_slice(&msg.delivery.data).unwrap();
        into.insert(body["message_id"].as_str().unwrap().to_owned());
        taken += 1;
    }
    taken
}

async fn scalar(pool: &PgPool, sql: String) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
}

async fn run(plan: Plan) -> Figures {
    let started = Instant::now();
    let pool = common::pg_pool(4).await;
    let queue = common::unique("idem.chaos");
    let dlq = format!("{queue}.dlq");
    let (markers, payments, log) = (
        common::unique("chaos_m"),
        common::unique("chaos_p"),
        common::unique("chaos_log"),
    );
    PgStore::builder(pool.clone())
        .table(&markers)
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    for ddl in [
        format!("CREATE TABLE {payments} (message_id TEXT NOT NULL, amount BIGINT NOT NULL, pid BIGINT NOT NULL)"),
        format!("CREATE TABLE {log} (message_id TEXT NOT NULL, event TEXT NOT NULL)"),
    ] {
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    }
    let connection = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ");
    let channel = connection.create_channel().await.unwrap();
    channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for q in [&queue, &dlq] {
        channel
            .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
            .await
            .unwrap();
    }

    // Messages, a share of them published twice, a few that always fail.
    let mut rng = rand::rng();
    let mut bodies = Vec::new();
    let mut always_fail = HashSet::new();
    for i in 0..plan.messages {
        let id = format!("pay-{i:06}");
        let fails = rng.random_ratio(plan.always_fail_percent, 100);
        if fails {
            always_fail.insert(id.clone());
        }
        let body =
            serde_json::to_vec(&serde_json::json!({"message_id": id, "amount": i, "always_fail": fails})).unwrap();
        if rng.random_ratio(plan.duplicate_percent, 100) {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    bodies.shuffle(&mut rng);
    let published = bodies.len();
    for body in bodies {
        publish(&channel, &queue, body).await;
    }

    let args = [
        "chaos",
        &queue,
        &markers,
        &payments,
        &log,
        &plan.fail_percent.to_string(),
        &plan.crash_percent.to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    let mut consumers = Consumers {
        args,
        children: Vec::new(),
        restarts: 0,
    };
    consumers.children = (0..plan.consumers).map(|_| consumers.spawn()).collect();

    let expected_effects = (plan.messages - always_fail.len()) as i64;
    let mut dead: HashSet<String> = HashSet::new();
    let mut kills = 0;
    let mut next_kill = Instant::now() + Duration::from_millis(rng.random_range(plan.kill_every.0..plan.kill_every.1));
    let deadline = Instant::now() + plan.deadline;
    loop {
        if Instant::now() >= deadline {
            let missing: Vec<&String> = always_fail.iter().filter(|id| !dead.contains(*id)).collect();
            let effects = scalar(&pool, format!("SELECT count(DISTINCT message_id) FROM {payments}")).await;
            panic!(
                "not drained in time: {kills} kills, effects {effects}/{expected_effects}, \
                 always-failing messages not dead-lettered: {missing:?} (log table {log})"
            );
        }
        consumers.revive();
        if kills < plan.kills && Instant::now() >= next_kill {
            consumers.kill_one();
            kills += 1;
            next_kill = Instant::now() + Duration::from_millis(rng.random_range(plan.kill_every.0..plan.kill_every.1));
        }
        drain_ids(&channel, &dlq, &mut dead).await;
        let effects = scalar(&pool, format!("SELECT count(DISTINCT message_id) FROM {payments}")).await;
        let all_dead = always_fail.iter().all(|id| dead.contains(id));
        if kills >= plan.kills && all_dead && effects >= expected_effects && ready(&channel, &queue).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let in-flight redeliveries settle, then stop everything.
    tokio::time::sleep(Duration::from_millis(500)).await;
    consumers.stop();
    drain_ids(&channel, &dlq, &mut dead).await;

    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, count(*) FROM {payments} GROUP BY message_id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let effects: HashMap<String, i64> = rows.into_iter().collect();
    let ids = (0..plan.messages).map(|i| format!("pay-{i:06}"));
    let lost = ids.filter(|id| !effects.contains_key(id) && !dead.contains(id)).count();
    // A duplicate copy can exhaust its attempts while the other copy
    // succeeds: such a message is both applied (once) and dead-lettered.
    let dead_only = dead.iter().filter(|id| !effects.contains_key(*id)).count();
    let events = |event: &'static str| scalar(&pool, format!("SELECT count(*) FROM {log} WHERE event LIKE '{event}%'"));
    let figures = Figures {
        messages: plan.messages,
        published,
        deliveries: events("delivery").await,
        kills,
        crashes_after_commit: events("crash").await,
        injected_failures: events("failure").await,
        effects: effects.values().sum(),
        dead_lettered: dead.len(),
        dead_only,
        lost,
        applied_twice: effects.values().filter(|n| **n > 1).count(),
        elapsed: started.elapsed(),
    };
    for id in &always_fail {
        assert!(!effects.contains_key(id), "{id} always fails: it has no effect");
    }

    for q in [&queue, &dlq] {
        channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    if std::env::var("IDEMPOTENT_CHAOS_KEEP").is_ok() {
        println!("kept tables {markers} {payments} {log}");
        return figures;
    }
    for table in [&markers, &payments, &log] {
        common::drop_pg_table(&pool, table).await;
    }
    let _ = connection.close(200, "chaos done".into()).await;
    figures
}

/// Prints the figures straight to stderr: libtest captures `println!`, but
/// the chaos run's figures belong in the default test output.
fn report(name: &str, f: &Figures) {
    use std::io::Write;
    let text = format!(
        "chaos {name}: {:.1?}\n  messages {} (published {} with duplicates)\n  deliveries to handlers {}\n  \
         SIGKILLs {}, aborts after commit before ack {}\n  injected handler failures {}\n  \
         effects {} (= messages {} - dead-lettered only {}); dead-lettered {}\n  lost {}, applied twice {}\n",
        f.elapsed,
        f.messages,
        f.published,
        f.deliveries,
        f.kills,
        f.crashes_after_commit,
        f.injected_failures,
        f.effects,
        f.messages,
        f.dead_only,
        f.dead_lettered,
        f.lost,
        f.applied_twice
    );
    let _ = std::io::stderr().write_all(text.as_bytes());
}

fn check(f: &Figures) {
    assert_eq!(f.lost, 0, "no message lost");
    assert_eq!(f.applied_twice, 0, "no effect applied twice");
    assert_eq!(
        f.effects as usize + f.dead_only,
        f.messages,
        "every message applied once or dead-lettered"
    );
    assert!(
        f.kills > 0 && f.injected_failures > 0 && f.crashes_after_commit > 0,
        "the chaos happened: {f:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_failing_consumer_processes_apply_each_message_once() {
    let figures = run(Plan {
        messages: 300,
        duplicate_percent: 20,
        always_fail_percent: 2,
        consumers: 3,
        fail_percent: 10,
        crash_percent: 2,
        kills: 6,
        kill_every: (150, 500),
        deadline: Duration::from_secs(50),
    })
    .await;
    report("fast", &figures);
    check(&figures);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak() {
    if std::env::var("IDEMPOTENT_SOAK").as_deref() != Ok("1") {
        println!("soak skipped: set IDEMPOTENT_SOAK=1 to run it");
        return;
    }
    let messages: usize = std::env::var("IDEMPOTENT_SOAK_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    let figures = run(Plan {
        messages,
        duplicate_percent: 20,
        always_fail_percent: 1,
        consumers: 4,
        fail_percent: 10,
        crash_percent: 1,
        kills: messages / 333,
        kill_every: (500, 3000),
        deadline: Duration::from_secs(120 + messages as u64 / 10),
    })
    .await;
    report("soak", &figures);
    check(&figures);
}
