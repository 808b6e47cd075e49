//! Chaos through the outbox: two services chained through RabbitMQ, each in
//! several **processes** (`src/bin/chain_process.rs`). The payments service
//! consumes payments and, in the marker's transaction, inserts the payment
//! and stages `payment.charged` on its outbox; relays (one in each payments
//! process, one on its own) publish the outbox; the notifications service
//! consumes `payment.charged`, idempotent on the event's message id, with
//! markers of its own, and inserts a notification.
//!
//! Processes abort at the chain's crash points (after a consumer's commit,
//! before its ack and before the event is published; in a relay with rows
//! taken, before publishing; in a relay after the broker confirmed, before
//! the row is marked dispatched), and the driver SIGKILLs processes at
//! random moments; the dead are restarted. At the end every payment has
//! exactly one effect, one outbox row and exactly one notification: nothing
//! lost, nothing applied twice at either end, and the republished events
//! were recognised downstream as duplicates.
//!
//! The fast run is part of the default test command. The soak runs with
//! `IDEMPOTENT_SOAK=1 cargo test --all-features --test outbox_chain soak -- --nocapture`;
//! `IDEMPOTENT_SOAK_MESSAGES` sizes it (default 20 000). It uses the
//! machine's PostgreSQL and RabbitMQ, with names of its own.

mod common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotent_runtime::PgStore;
use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgPool};
use rand::Rng;
use rand::seq::SliceRandom;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

struct Plan {
    payments: usize,
    duplicate_percent: u32,
    payments_processes: usize,
    relay_processes: usize,
    notification_processes: usize,
    /// Per mille, per handled message.
    abort_after_commit: u32,
    /// Per mille, per publish.
    abort_before_publish: u32,
    /// Per mille, per publish.
    abort_after_confirm: u32,
    kills: usize,
    deadline: Duration,
}

#[derive(Debug, Default)]
struct Figures {
    payments: usize,
    published: usize,
    processes: usize,
    kills: usize,
    restarts: usize,
    payments_aborts_after_commit: i64,
    relay_aborts_before_publish: i64,
    relay_aborts_after_confirm: i64,
    notifications_aborts_after_commit: i64,
    payments_duplicates: i64,
    republishes_deduplicated: i64,
    redeliveries_deduplicated: i64,
    effects: i64,
    outbox_rows: i64,
    outbox_pending: i64,
    notifications: i64,
    dead_lettered: u64,
    lost: usize,
    twice: usize,
    notifications_lost: usize,
    notifications_twice: usize,
    elapsed: Duration,
}

/// What one chain creates: tables and RabbitMQ topology, all named after
/// `prefix`.
struct Chain {
    prefix: String,
    pool: PgPool,
    channel: Channel,
    _connection: Connection,
}

impl Chain {
    fn table(&self, suffix: &str) -> String {
        format!("{}_{suffix}", self.prefix)
    }
    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }
    fn queues(&self) -> [String; 4] {
        [
            self.name("payments"),
            self.name("payments.dlq"),
            self.name("charged"),
            self.name("charged.dlq"),
        ]
    }
    fn tables(&self) -> [String; 7] {
        ["pay", "pm", "ob", "notif", "nm", "nob", "log"].map(|s| self.table(s))
    }

    async fn create() -> Chain {
        let prefix = common::unique("chain");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(common::PG_URL)
            .await
            .expect("PostgreSQL at 127.0.0.1:5432");
        let connection = Connection::connect(AMQP_URL, ConnectionProperties::default())
            .await
            .expect("RabbitMQ at 127.0.0.1:5672");
        let channel = connection.create_channel().await.unwrap();
        channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        let chain = Chain {
            prefix,
            pool,
            channel,
            _connection: connection,
        };
        // The payments' markers and outbox; the notifications' markers (and
        // an outbox table of their own that stays empty).
        for (markers, outbox) in [("pm", "ob"), ("nm", "nob")] {
            PgStore::builder(chain.pool.clone())
                .table(&chain.table(markers))
                .outbox_table(&chain.table(outbox))
                .build()
                .unwrap()
                .migrate()
                .await
                .unwrap();
        }
        for ddl in [
            format!(
                "CREATE TABLE {} (message_id TEXT NOT NULL, order_id TEXT NOT NULL, amount BIGINT NOT NULL, \
                 pid BIGINT NOT NULL)",
                chain.table("pay")
            ),
            format!(
                "CREATE TABLE {} (payment_id TEXT NOT NULL, message_id TEXT NOT NULL, pid BIGINT NOT NULL)",
                chain.table("notif")
            ),
            format!(
                "CREATE TABLE {} (message_id TEXT NOT NULL, event TEXT NOT NULL)",
                chain.table("log")
            ),
        ] {
            sqlx::query(AssertSqlSafe(ddl)).execute(&chain.pool).await.unwrap();
        }
        // Queues expire if the test dies before deleting them.
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        for queue in chain.queues() {
            chain
                .channel
                .queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), arguments.clone())
                .await
                .unwrap();
        }
        // The relays publish `payment.charged` on the chain's exchange.
        let exchange = chain.name("events");
        chain
            .channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    auto_delete: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        chain
            .channel
            .queue_bind(
                chain.name("charged").as_str().into(),
                exchange.as_str().into(),
                "payment.charged".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        chain
    }

    async fn publish(&self, bodies: Vec<(String, Vec<u8>)>) {
        let queue = self.name("payments");
        let mut confirms = Vec::new();
        for (id, body) in bodies {
            let props = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2);
            confirms.push(
                self.channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        props,
                    )
                    .await
                    .unwrap(),
            );
            if confirms.len() >= 1000 {
                for confirm in confirms.drain(..) {
                    assert!(confirm.await.unwrap().is_ack());
                }
            }
        }
        for confirm in confirms {
            assert!(confirm.await.unwrap().is_ack());
        }
    }

    /// Messages ready in `queue` (those held by a live consumer not counted).
    async fn ready(&self, queue: &str) -> Option<u64> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .ok()
            .map(|q| u64::from(q.message_count()))
    }

    async fn scalar(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn counts(&self, table: &str, column: &str) -> HashMap<String, i64> {
        let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {column}, count(*) FROM {table} GROUP BY {column}"
        )))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        rows.into_iter().collect()
    }

    async fn events(&self, event: &str) -> i64 {
        self.scalar(format!(
            "SELECT count(*) FROM {} WHERE event = '{event}'",
            self.table("log")
        ))
        .await
    }

    async fn drop_all(self) {
        for queue in self.queues() {
            let _ = self
                .channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(self.name("events").as_str().into(), ExchangeDeleteOptions::default())
            .await;
        for table in self.tables() {
            common::drop_pg_table(&self.pool, &table).await;
        }
    }
}

/// The chain's processes; the dead are restarted.
struct Fleet {
    prefix: String,
    faults: [String; 3],
    children: Vec<(&'static str, Child)>,
    restarts: usize,
}

impl Fleet {
    fn spawn(&self, role: &str) -> Child {
        Command::new(env!("CARGO_BIN_EXE_chain_process"))
            .arg(role)
            .arg(&self.prefix)
            .args(&self.faults)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chain_process")
    }

    fn start(&mut self, role: &'static str, count: usize) {
        for _ in 0..count {
            let child = self.spawn(role);
            self.children.push((role, child));
        }
    }

    /// Restarts the processes that died (aborted at a crash point).
    fn revive(&mut self) {
        for i in 0..self.children.len() {
            if self.children[i].1.try_wait().unwrap().is_some() {
                self.children[i].1 = self.spawn(self.children[i].0);
                self.restarts += 1;
            }
        }
    }

    fn kill_one(&mut self) {
        let i = rand::rng().random_range(0..self.children.len());
        let (role, child) = &mut self.children[i];
        let _ = child.kill(); // SIGKILL (it may have died by itself already)
        let _ = child.wait();
        let role = *role;
        self.children[i].1 = self.spawn(role);
    }

    fn stop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Fleet {
    /// A failing run leaves no process behind.
    fn drop(&mut self) {
        self.stop();
    }
}

/// When each SIGKILL fires: at shares of the progress spread between 5 %
/// and 90 %, so that every kill hits processes at work.
fn kill_schedule(count: usize) -> Vec<f64> {
    let mut rng = rand::rng();
    let slot = 0.85 / count.max(1) as f64;
    let mut at: Vec<f64> = (0..count)
        .map(|i| 0.05 + slot * (i as f64 + rng.random_range(0.0..1.0)))
        .collect();
    at.sort_by(f64::total_cmp);
    at
}

async fn run(plan: Plan) -> Figures {
    let started = Instant::now();
    let chain = Chain::create().await;

    // Payments, a share of them published twice (a producer's retry).
    let mut rng = rand::rng();
    let mut bodies = Vec::new();
    for i in 0..plan.payments {
        let id = format!("pay-{i:06}");
        let body = serde_json::to_vec(&serde_json::json!({
            "message_id": id, "order_id": format!("order-{i:06}"), "amount": 100 + i,
        }))
        .unwrap();
        if rng.random_ratio(plan.duplicate_percent, 100) {
            bodies.push((id.clone(), body.clone()));
        }
        bodies.push((id, body));
    }
    bodies.shuffle(&mut rng);
    let published = bodies.len();
    chain.publish(bodies).await;

    let mut fleet = Fleet {
        prefix: chain.prefix.clone(),
        faults: [
            plan.abort_after_commit,
            plan.abort_before_publish,
            plan.abort_after_confirm,
        ]
        .map(|n| n.to_string()),
        children: Vec::new(),
        restarts: 0,
    };
    fleet.start("payments", plan.payments_processes);
    fleet.start("relay", plan.relay_processes);
    fleet.start("notifications", plan.notification_processes);

    let kills = kill_schedule(plan.kills);
    let mut next_kill = 0;
    let total = plan.payments as f64 * 2.0;
    let poll = Duration::from_millis((plan.payments as u64 / 100).clamp(100, 1000));
    let deadline = Instant::now() + plan.deadline;
    let (pay, notif, outbox) = (chain.table("pay"), chain.table("notif"), chain.table("ob"));
    let mut settled_polls = 0;
    loop {
        fleet.revive();
        let charged = chain
            .scalar(format!("SELECT count(DISTINCT message_id) FROM {pay}"))
            .await;
        let notified = chain
            .scalar(format!("SELECT count(DISTINCT payment_id) FROM {notif}"))
            .await;
        let progress = (charged + notified) as f64 / total;
        while next_kill < kills.len() && progress >= kills[next_kill] {
            fleet.kill_one();
            next_kill += 1;
        }
        let pending = chain
            .scalar(format!("SELECT count(*) FROM {outbox} WHERE dispatched_at IS NULL"))
            .await;
        let mut backlog = 0;
        for queue in chain.queues() {
            backlog += chain.ready(&queue).await.unwrap_or(u64::MAX / 8);
        }
        let done = charged as usize == plan.payments
            && notified as usize == plan.payments
            && pending == 0
            && backlog == 0
            && next_kill == kills.len();
        if done {
            settled_polls += 1;
            if settled_polls >= 3 {
                break;
            }
        } else {
            settled_polls = 0;
        }
        if Instant::now() >= deadline {
            fleet.stop();
            panic!(
                "not settled in time: {charged} payments charged, {notified} notified of {}, {pending} events \
                 pending in the outbox, {backlog} messages ready in the queues, {} of {} kills done",
                plan.payments,
                next_kill,
                kills.len()
            );
        }
        tokio::time::sleep(poll).await;
    }
    fleet.stop();

    let effects = chain.counts(&pay, "message_id").await;
    let notifications = chain.counts(&notif, "payment_id").await;
    let ids: Vec<String> = (0..plan.payments).map(|i| format!("pay-{i:06}")).collect();
    // Each notification carries the id of its payment's one outbox row.
    let foreign: i64 = chain
        .scalar(format!(
            "SELECT count(*) FROM {notif} n WHERE NOT EXISTS (SELECT 1 FROM {outbox} o \
             WHERE o.message_id = n.message_id AND convert_from(o.payload, 'UTF8')::json->>'payment_id' = n.payment_id)"
        ))
        .await;
    assert_eq!(foreign, 0, "a notification whose message id is not its payment's event");
    let mut dead_lettered = 0;
    for queue in [chain.name("payments.dlq"), chain.name("charged.dlq")] {
        dead_lettered += chain.ready(&queue).await.unwrap();
    }
    let figures = Figures {
        payments: plan.payments,
        published,
        processes: fleet.children.len(),
        kills: plan.kills,
        restarts: fleet.restarts,
        payments_aborts_after_commit: chain.events("pay-abort-after-commit").await,
        relay_aborts_before_publish: chain.events("relay-abort-before-publish").await,
        relay_aborts_after_confirm: chain.events("relay-abort-after-confirm").await,
        notifications_aborts_after_commit: chain.events("notify-abort-after-commit").await,
        payments_duplicates: chain.events("pay-duplicate").await + chain.events("pay-duplicate-redelivered").await,
        republishes_deduplicated: chain.events("notify-duplicate-republished").await,
        redeliveries_deduplicated: chain.events("notify-duplicate-redelivered").await,
        effects: effects.values().sum(),
        outbox_rows: chain.scalar(format!("SELECT count(*) FROM {outbox}")).await,
        outbox_pending: chain
            .scalar(format!("SELECT count(*) FROM {outbox} WHERE dispatched_at IS NULL"))
            .await,
        notifications: notifications.values().sum(),
        dead_lettered,
        lost: ids.iter().filter(|id| !effects.contains_key(*id)).count(),
        twice: effects.values().filter(|n| **n > 1).count(),
        notifications_lost: ids.iter().filter(|id| !notifications.contains_key(*id)).count(),
        notifications_twice: notifications.values().filter(|n| **n > 1).count(),
        elapsed: started.elapsed(),
    };
    chain.drop_all().await;
    figures
}

/// Prints the figures straight to stderr: libtest captures `println!`, but
/// the run's figures belong in the default test output.
fn report(name: &str, f: &Figures) {
    use std::io::Write;
    let text = format!(
        "outbox chain {name}: {:.1?}\n  payments {} (published {} with duplicates), processes {}\n  \
         SIGKILLs {}, processes restarted after an abort {}\n  aborts: payments after commit before ack and \
         publish {}, relay before publish {}, relay after the broker's confirm before the mark {}, \
         notifications after commit before ack {}\n  duplicates skipped by payments {}\n  \
         duplicates skipped by notifications: republished events {}, redeliveries {}\n  \
         payment effects {}, outbox rows {} (pending {}), notifications {}, dead-lettered {}\n  \
         lost {}, applied twice {}; notifications lost {}, sent twice {}\n",
        f.elapsed,
        f.payments,
        f.published,
        f.processes,
        f.kills,
        f.restarts,
        f.payments_aborts_after_commit,
        f.relay_aborts_before_publish,
        f.relay_aborts_after_confirm,
        f.notifications_aborts_after_commit,
        f.payments_duplicates,
        f.republishes_deduplicated,
        f.redeliveries_deduplicated,
        f.effects,
        f.outbox_rows,
        f.outbox_pending,
        f.notifications,
        f.dead_lettered,
        f.lost,
        f.twice,
        f.notifications_lost,
        f.notifications_twice,
    );
    let _ = std::io::stderr().write_all(text.as_bytes());
}

fn check(f: &Figures) {
    assert_eq!((f.lost, f.twice), (0, 0), "each payment applied once: {f:?}");
    assert_eq!(
        (f.notifications_lost, f.notifications_twice),
        (0, 0),
        "each payment notified once: {f:?}"
    );
    assert_eq!(f.effects as usize, f.payments, "{f:?}");
    assert_eq!(
        f.outbox_rows as usize, f.payments,
        "one event staged per payment: {f:?}"
    );
    assert_eq!(f.outbox_pending, 0, "every event dispatched: {f:?}");
    assert_eq!(f.notifications as usize, f.payments, "{f:?}");
    assert_eq!(f.dead_lettered, 0, "nothing dead-lettered: {f:?}");
    // The crash points were hit, and the republished events reached the
    // notifications service and were skipped there.
    assert!(
        f.payments_aborts_after_commit > 0
            && f.relay_aborts_before_publish > 0
            && f.relay_aborts_after_confirm > 0
            && f.notifications_aborts_after_commit > 0,
        "every crash point was hit: {f:?}"
    );
    assert!(
        f.republishes_deduplicated > 0,
        "republished events were deduplicated: {f:?}"
    );
    assert!(f.payments_duplicates > 0, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chained_services_apply_and_notify_each_payment_once_through_crashes() {
    let figures = run(Plan {
        payments: 300,
        duplicate_percent: 20,
        payments_processes: 2,
        relay_processes: 1,
        notification_processes: 2,
        // Enough that each crash point is hit several times in 300 payments.
        abort_after_commit: 50,
        abort_before_publish: 40,
        abort_after_confirm: 40,
        kills: 6,
        deadline: Duration::from_secs(180),
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
    let payments: usize = std::env::var("IDEMPOTENT_SOAK_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    let figures = run(Plan {
        payments,
        duplicate_percent: 20,
        payments_processes: 2,
        relay_processes: 1,
        notification_processes: 2,
        abort_after_commit: 3,
        abort_before_publish: 2,
        abort_after_confirm: 3,
        kills: (payments / 400).max(10),
        deadline: Duration::from_secs(300 + payments as u64 / 10),
    })
    .await;
    report("soak", &figures);
    check(&figures);
}
