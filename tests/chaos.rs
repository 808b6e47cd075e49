//! Chaos: several consumer **processes** against a real broker and
//! PostgreSQL while a driver injects the faults real deployments see:
//! consumers SIGKILLed at random moments (mid-body, between commit and ack,
//! mid-retry) and restarted, the broker restarted (RabbitMQ `stop_app` /
//! `start_app`, NATS killed and started again on its storage), the
//! consumers' database connections killed (`pg_terminate_backend`) and
//! PostgreSQL itself restarted; handlers fail at random and some messages
//! always fail. At the end every message's effect is in the database exactly
//! once, or the message is in the dead-letter destination: nothing is lost,
//! nothing is applied twice.
//!
//! The broker and PostgreSQL are private servers started by the test (so
//! the machine's shared ones, used by every other test, are not restarted).
//!
//! On Kafka (a private Tansu broker, memory storage: it is not restarted)
//! the members of one consumer group over a topic of 4 partitions are
//! SIGKILLed and started again, and a member joins and leaves (SIGTERM: a
//! clean leave), each a rebalance, with the default partition order and
//! with order by key; `kafka_soak` is its long form
//! (`IDEMPOTENT_KAFKA_SOAK=1`, `IDEMPOTENT_SOAK_MESSAGES` messages, default
//! 20 000; `IDEMPOTENT_SOAK_KAFKA_ORDER=key` for order by key).
//!
//! The fast runs are part of the default test command. The soak runs with
//! `IDEMPOTENT_SOAK=1 cargo test --test chaos soak -- --nocapture` and prints
//! its figures (docs/testing.md quotes the last one); `IDEMPOTENT_SOAK_MESSAGES`
//! sizes it (default 100 000) and `IDEMPOTENT_SOAK_BROKER` picks `rabbitmq`
//! (default) or `nats`.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::servers::{ChildServer, PrivatePostgres, PrivateRabbit};
use idempotent_runtime::PgStore;
use idempotent_runtime::async_nats::{self, jetstream};
use idempotent_runtime::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use idempotent_runtime::lapin::types::FieldTable;
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgPool};
use rand::Rng;
use rand::seq::SliceRandom;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BrokerKind {
    RabbitMq,
    Nats,
    Kafka,
}

impl BrokerKind {
    fn name(self) -> &'static str {
        match self {
            BrokerKind::RabbitMq => "rabbitmq",
            BrokerKind::Nats => "nats",
            BrokerKind::Kafka => "kafka",
        }
    }
}

/// The partitions of the Kafka chaos run's topic.
const KAFKA_PARTITIONS: i32 = 4;

struct Plan {
    broker: BrokerKind,
    messages: usize,
    duplicate_percent: u32,
    always_fail_percent: u32,
    consumers: usize,
    fail_percent: u32,
    crash_percent: u32,
    kills: usize,
    broker_restarts: usize,
    connection_kills: usize,
    database_restarts: usize,
    deadline: Duration,
    /// Batches of up to this many deliveries per transaction.
    batch: Option<usize>,
    /// Kafka: a consumer joins the group, or (every other time) leaves it
    /// cleanly (SIGTERM), this many times.
    member_changes: usize,
    /// The first delivery of each message whose id ends so crashes its
    /// process after the commit, before the ack (once per message).
    forced_crash_suffix: &'static str,
    /// Kafka: the members order by key within a partition (`Order::Key`;
    /// the record key is the message id, so the ids of a partition run
    /// concurrently and a duplicate waits for its original).
    kafka_key_order: bool,
}

#[derive(Debug, Default)]
struct Figures {
    broker: &'static str,
    messages: usize,
    published: usize,
    deliveries: i64,
    kills: usize,
    broker_restarts: usize,
    connection_kills: usize,
    connections_killed: i64,
    database_restarts: usize,
    /// Kafka: members that joined and left the group (besides the kills).
    joins: usize,
    leaves: usize,
    /// Kafka: times a partition's records went from one process to another
    /// (in the delivery log's order): the rebalances' visible effect.
    handovers: usize,
    /// Kafka: effects inserted before the effect of an earlier record of
    /// their partition (by the first offset of each message): none under
    /// partition order, where a record starts only after the previous one
    /// committed; some under key order, where a partition's keys overlap.
    out_of_order: usize,
    crashes_after_commit: i64,
    crashes_mid_batch: i64,
    injected_failures: i64,
    effects: i64,
    dead_lettered: usize,
    /// Dead-lettered and never applied.
    dead_only: usize,
    lost: usize,
    applied_twice: usize,
    elapsed: Duration,
}

/// The broker of a chaos run: a private server, its input and dead-letter
/// destination, and the driver's view of them (reconnecting after
/// restarts).
enum Broker {
    Rabbit {
        server: Arc<PrivateRabbit>,
        queue: String,
        admin: Option<(Connection, Channel)>,
    },
    Nats {
        server: Arc<std::sync::Mutex<ChildServer>>,
        js: jetstream::Context,
        stream: String,
        dead_letter_stream: String,
        /// Stream sequence of the last dead letter read.
        read_up_to: u64,
    },
    Kafka {
        kafka: common::kafka::Kafka,
        topic: String,
        /// The partition of each message id (every copy of a message is
        /// keyed by its id: one partition) and its first copy's offset.
        first_at: HashMap<String, (i32, i64)>,
        /// Each partition's end (the offset after its last record).
        ends: HashMap<i32, i64>,
    },
}

impl Broker {
    async fn start(kind: BrokerKind, name: &str) -> Broker {
        match kind {
            BrokerKind::RabbitMq => {
                let server = tokio::task::spawn_blocking(PrivateRabbit::start).await.unwrap();
                let mut broker = Broker::Rabbit {
                    server: Arc::new(server),
                    queue: name.to_owned(),
                    admin: None,
                };
                let channel = broker.rabbit_admin().await;
                for q in [name.to_owned(), format!("{name}.dlq")] {
                    channel
                        .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
                        .await
                        .unwrap();
                }
                broker
            }
            BrokerKind::Nats => {
                let server = tokio::task::spawn_blocking(ChildServer::nats).await.unwrap();
                let js = jetstream::new(async_nats::connect(server.nats_url()).await.unwrap());
                let stream = name.to_uppercase().replace('.', "_");
                let dead_letter_stream = format!("{stream}_DLQ");
                for (n, subject) in [
                    (&stream, stream.clone()),
                    (&dead_letter_stream, format!("{stream}.dlq")),
                ] {
                    js.create_stream(jetstream::stream::Config {
                        name: n.clone(),
                        subjects: vec![subject],
                        storage: jetstream::stream::StorageType::File,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                }
                js.get_stream(&stream)
                    .await
                    .unwrap()
                    .create_consumer(jetstream::consumer::pull::Config {
                        durable_name: Some("chaos".into()),
                        ack_wait: Duration::from_secs(3),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                Broker::Nats {
                    server: Arc::new(std::sync::Mutex::new(server)),
                    js,
                    stream,
                    dead_letter_stream,
                    read_up_to: 0,
                }
            }
            BrokerKind::Kafka => {
                let kafka = tokio::task::spawn_blocking(common::kafka::Kafka::start).await.unwrap();
                kafka.create_topic(name, KAFKA_PARTITIONS).await;
                kafka.create_topic(&format!("{name}.dlq"), 1).await;
                Broker::Kafka {
                    kafka,
                    topic: name.to_owned(),
                    first_at: HashMap::new(),
                    ends: HashMap::new(),
                }
            }
        }
    }

    /// The source consumers read (queue, or stream) and their environment.
    fn consumer_env(&self) -> (String, String) {
        match self {
            Broker::Rabbit { server, queue, .. } => (queue.clone(), server.url()),
            Broker::Nats { server, stream, .. } => (stream.clone(), server.lock().unwrap().nats_url()),
            Broker::Kafka { kafka, topic, .. } => (topic.clone(), kafka.bootstrap()),
        }
    }

    /// The admin channel, connected again after a restart.
    async fn rabbit_admin(&mut self) -> Channel {
        let Broker::Rabbit { server, admin, .. } = self else {
            unreachable!("a RabbitMQ broker")
        };
        if let Some((conn, channel)) = admin
            && conn.status().connected()
            && channel.status().connected()
        {
            return channel.clone();
        }
        for _ in 0..200 {
            if let Ok(conn) = Connection::connect(&server.url(), ConnectionProperties::default()).await
                && let Ok(channel) = conn.create_channel().await
                && channel.confirm_select(ConfirmSelectOptions::default()).await.is_ok()
            {
                *admin = Some((conn, channel.clone()));
                return channel;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("cannot reach the private RabbitMQ node");
    }

    async fn publish(&mut self, bodies: Vec<Vec<u8>>) {
        match self {
            Broker::Rabbit { .. } => {
                let queue = match self {
                    Broker::Rabbit { queue, .. } => queue.clone(),
                    _ => unreachable!(),
                };
                let channel = self.rabbit_admin().await;
                let mut confirms = Vec::new();
                for body in bodies {
                    let props = BasicProperties::default().with_delivery_mode(2);
                    confirms.push(
                        channel
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
            Broker::Nats { js, stream, .. } => {
                let mut acks = Vec::new();
                for body in bodies {
                    acks.push(js.publish(stream.clone(), body.into()).await.unwrap());
                    if acks.len() >= 1000 {
                        for ack in acks.drain(..) {
                            ack.await.unwrap();
                        }
                    }
                }
                for ack in acks {
                    ack.await.unwrap();
                }
            }
            Broker::Kafka {
                kafka,
                topic,
                first_at,
                ends,
            } => {
                let (kafka, topic) = (&*kafka, topic.as_str());
                for chunk in bodies.chunks(500) {
                    let sends = chunk.iter().map(|body| {
                        let value: serde_json::Value = serde_json::from_slice(body).unwrap();
                        let id = value["message_id"].as_str().unwrap().to_owned();
                        async move {
                            let at = kafka.produce_one(topic, &id, body).await;
                            (id, at)
                        }
                    });
                    for (id, (partition, offset)) in futures_util::future::join_all(sends).await {
                        let first = first_at.entry(id).or_insert((partition, offset));
                        first.1 = first.1.min(offset);
                        let end = ends.entry(partition).or_default();
                        *end = (*end).max(offset + 1);
                    }
                }
            }
        }
    }

    /// Messages not settled yet (ready, or held by a consumer), or `None`
    /// while the broker cannot say (restarting).
    async fn backlog(&mut self) -> Option<u64> {
        match self {
            Broker::Rabbit { queue, .. } => {
                let queue = queue.clone();
                let channel = self.rabbit_admin().await;
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                let declared = channel
                    .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                    .await;
                // Ready only: the unacked ones are with a live consumer, or
                // back in the queue once it is gone.
                declared.ok().map(|q| u64::from(q.message_count()))
            }
            Broker::Nats { js, stream, .. } => {
                let stream = js.get_stream(stream.as_str()).await.ok()?;
                let info = stream.consumer_info("chaos").await.ok()?;
                Some(info.num_pending + info.num_ack_pending as u64)
            }
            // Not committed by the group: not fetched, buffered or in
            // flight.
            Broker::Kafka { kafka, topic, ends, .. } => {
                let committed = kafka.committed("chaos", topic).await;
                Some(
                    ends.iter()
                        .map(|(p, end)| {
                            let at = committed.get(*p as usize).copied().flatten().unwrap_or(0);
                            (end - at).max(0) as u64
                        })
                        .sum(),
                )
            }
        }
    }

    /// Takes what reached the dead-letter destination since the last call:
    /// message ids.
    async fn drain_dead_letters(&mut self, into: &mut HashSet<String>) {
        let id_of = |body: &[u8]| -> String {
            let body: serde_json::Value = serde_json::from_slice(body).unwrap();
            body["message_id"].as_str().unwrap().to_owned()
        };
        match self {
            Broker::Rabbit { queue, .. } => {
                let dlq = format!("{queue}.dlq");
                let channel = self.rabbit_admin().await;
                while let Ok(Some(msg)) = channel
                    .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })
                    .await
                {
                    into.insert(id_of(&msg.delivery.data));
                }
            }
            Broker::Nats {
                js,
                dead_letter_stream,
                read_up_to,
                ..
            } => {
                let Ok(mut stream) = js.get_stream(dead_letter_stream.as_str()).await else {
                    return;
                };
                let Ok(info) = stream.info().await else {
                    return;
                };
                let last = info.state.last_sequence;
                while *read_up_to < last {
                    match stream.get_raw_message(*read_up_to + 1).await {
                        Ok(msg) => into.insert(id_of(&msg.payload)),
                        Err(_) => return,
                    };
                    *read_up_to += 1;
                }
            }
            Broker::Kafka { kafka, topic, .. } => {
                for record in kafka.read_all(&format!("{topic}.dlq")).await {
                    into.insert(id_of(&record.value));
                }
            }
        }
    }

    /// Restarts the broker (blocking; run it off the async threads).
    fn restart(&self) -> impl FnOnce() + Send + 'static {
        let down = Duration::from_millis(rand::rng().random_range(200..1500));
        match self {
            Broker::Rabbit { server, .. } => {
                let server = Arc::clone(server);
                Box::new(move || server.restart(down)) as Box<dyn FnOnce() + Send>
            }
            Broker::Nats { server, .. } => {
                let server = Arc::clone(server);
                Box::new(move || server.lock().unwrap().restart(down))
            }
            // Plans on Kafka restart nothing: Tansu's memory storage would
            // lose every record and offset.
            Broker::Kafka { .. } => Box::new(|| panic!("the Kafka chaos run does not restart its broker")),
        }
    }
}

struct Consumers {
    args: Vec<String>,
    env: Vec<(String, String)>,
    children: Vec<Child>,
    restarts: usize,
    /// Kafka: the member that joined (until it leaves).
    extra: Option<Child>,
    joins: usize,
    leaves: usize,
}

impl Consumers {
    fn spawn(&self) -> Child {
        Command::new(env!("CARGO_BIN_EXE_consumer_process"))
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
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
        if let Some(extra) = &mut self.extra
            && extra.try_wait().unwrap().is_some()
        {
            self.extra = Some(self.spawn());
            self.restarts += 1;
        }
    }

    /// A consumer joins the group, or the one that joined leaves it
    /// cleanly: SIGTERM, and it finishes its handlers, commits its offsets
    /// and leaves (killed if it has not exited after 30 s).
    async fn change_membership(&mut self) {
        let Some(mut member) = self.extra.take() else {
            self.extra = Some(self.spawn());
            self.joins += 1;
            return;
        };
        let _ = Command::new("kill").args(["-TERM", &member.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while member.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = member.kill();
                let _ = member.wait();
                panic!("a member that was asked to leave (SIGTERM) did not exit within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.leaves += 1;
    }

    fn kill_one(&mut self) {
        let i = rand::rng().random_range(0..self.children.len());
        self.children[i].kill().unwrap(); // SIGKILL
        self.children[i].wait().unwrap();
        self.children[i] = self.spawn();
    }

    fn stop(&mut self) {
        for child in self.children.iter_mut().chain(&mut self.extra) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Consumers {
    /// A failing run leaves no consumer process behind.
    fn drop(&mut self) {
        self.stop();
    }
}

/// A fault kind's schedule: the share of the messages settled at which
/// each of its faults fires, spread between 10 % and 80 % so that every
/// fault hits consumers at work.
struct Schedule {
    at: Vec<f64>,
    next: usize,
}

impl Schedule {
    fn new(count: usize) -> Schedule {
        let mut rng = rand::rng();
        let mut at: Vec<f64> = (0..count)
            .map(|i| {
                let slot = 0.7 / count.max(1) as f64;
                0.1 + slot * (i as f64 + rng.random_range(0.0..1.0))
            })
            .collect();
        at.sort_by(f64::total_cmp);
        Schedule { at, next: 0 }
    }

    /// `true` (and the fault counted) when the next one is due at `progress`.
    fn due(&mut self, progress: f64) -> bool {
        if self.next < self.at.len() && progress >= self.at[self.next] {
            self.next += 1;
            return true;
        }
        false
    }

    /// Gives a fault that did not happen another chance.
    fn again(&mut self) {
        self.next -= 1;
    }

    fn left(&self) -> usize {
        self.at.len() - self.next
    }
}

async fn scalar(pool: &PgPool, sql: String) -> Option<i64> {
    sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await.ok()
}

async fn applied_count(pool: &PgPool, payments: &str) -> Option<i64> {
    scalar(pool, format!("SELECT count(DISTINCT message_id) FROM {payments}")).await
}

async fn applied_ids(pool: &PgPool, payments: &str) -> Option<HashSet<String>> {
    let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT DISTINCT message_id FROM {payments}")))
        .fetch_all(pool)
        .await
        .ok()?;
    Some(rows.into_iter().collect())
}

/// Kafka: effects inserted (in `payments`' sequence) after the effect of a
/// later record of their partition, each message at its first copy's offset
/// (a dead-lettered message's effect, if any, came from a later copy: left
/// out).
async fn out_of_order(
    pool: &PgPool,
    payments: &str,
    first_at: &HashMap<String, (i32, i64)>,
    dead: &HashSet<String>,
) -> usize {
    let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT message_id FROM {payments} ORDER BY seq")))
        .fetch_all(pool)
        .await
        .unwrap();
    let mut highest: HashMap<i32, i64> = HashMap::new();
    let mut late = 0;
    for id in ids.iter().filter(|id| !dead.contains(*id)) {
        let Some((partition, offset)) = first_at.get(id) else {
            continue;
        };
        let high = highest.entry(*partition).or_insert(*offset);
        if *offset < *high {
            late += 1;
        }
        *high = (*high).max(*offset);
    }
    late
}

/// Kafka: how many times a partition's deliveries went from one process to
/// another, in the delivery log's order (each delivery logs its process's
/// id).
async fn handovers(pool: &PgPool, log: &str, first_at: &HashMap<String, (i32, i64)>) -> usize {
    let rows: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, event FROM {log} WHERE event LIKE 'delivery%' ORDER BY seq"
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    let mut owner: HashMap<i32, String> = HashMap::new();
    let mut handovers = 0;
    for (id, event) in rows {
        let (Some((partition, _)), Some(pid)) = (first_at.get(&id), event.rsplit_once(" pid=")) else {
            continue;
        };
        let pid = pid.1.to_owned();
        if owner
            .insert(*partition, pid.clone())
            .is_some_and(|before| before != pid)
        {
            handovers += 1;
        }
    }
    handovers
}

async fn run(plan: Plan) -> Figures {
    let started = Instant::now();
    let database = tokio::task::spawn_blocking(PrivatePostgres::start).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&database.url())
        .await
        .expect("the private PostgreSQL");
    let source = common::unique("idem.chaos");
    let (markers, payments, log) = ("chaos_markers", "chaos_payments", "chaos_log");
    PgStore::builder(pool.clone())
        .table(markers)
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    for ddl in [
        format!(
            "CREATE TABLE {payments} (seq BIGSERIAL, message_id TEXT NOT NULL, amount BIGINT NOT NULL, pid BIGINT NOT NULL)"
        ),
        format!("CREATE TABLE {log} (seq BIGSERIAL, message_id TEXT NOT NULL, event TEXT NOT NULL)"),
    ] {
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    }
    let mut broker = Broker::start(plan.broker, &source).await;

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
    broker.publish(bodies).await;

    let (source_name, broker_url) = broker.consumer_env();
    let mut consumers = Consumers {
        args: [
            "chaos",
            plan.broker.name(),
            &source_name,
            markers,
            payments,
            log,
            &plan.fail_percent.to_string(),
            &plan.crash_percent.to_string(),
        ]
        .map(str::to_owned)
        .to_vec(),
        env: vec![
            ("IDEMPOTENT_BROKER_URL".into(), broker_url),
            (
                "IDEMPOTENT_CHAOS_BATCH".into(),
                plan.batch.map_or_else(String::new, |n| n.to_string()),
            ),
            ("IDEMPOTENT_PG_URL".into(), database.url()),
            ("IDEMPOTENT_CHAOS_CRASH_SUFFIX".into(), plan.forced_crash_suffix.into()),
            (
                "IDEMPOTENT_CHAOS_KAFKA_ORDER".into(),
                if plan.kafka_key_order { "key" } else { "partition" }.into(),
            ),
        ],
        children: Vec::new(),
        restarts: 0,
        extra: None,
        joins: 0,
        leaves: 0,
    };
    consumers.children = (0..plan.consumers).map(|_| consumers.spawn()).collect();

    let database = Arc::new(database);
    let mut kills = Schedule::new(plan.kills);
    let mut broker_restarts = Schedule::new(plan.broker_restarts);
    let mut connection_kills = Schedule::new(plan.connection_kills);
    let mut database_restarts = Schedule::new(plan.database_restarts);
    let mut member_changes = Schedule::new(plan.member_changes);
    let mut connections_killed = 0i64;
    let mut dead: HashSet<String> = HashSet::new();
    let all_ids: Vec<String> = (0..plan.messages).map(|i| format!("pay-{i:06}")).collect();
    let deadline = Instant::now() + plan.deadline;
    // Poll less often on big runs (each poll counts the applied messages).
    let poll = Duration::from_millis((plan.messages as u64 / 200).clamp(100, 1000));
    let mut settled_polls = 0;
    let mut progress = 0.0;
    loop {
        consumers.revive();
        if kills.due(progress) {
            consumers.kill_one();
        }
        if member_changes.due(progress) {
            consumers.change_membership().await;
        }
        if broker_restarts.due(progress) {
            tokio::task::spawn_blocking(broker.restart()).await.unwrap();
        }
        if connection_kills.due(progress) {
            let killed = scalar(
                &pool,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = 'chaos_consumer'"
                    .into(),
            )
            .await
            .unwrap_or(0);
            if killed == 0 {
                // No consumer connection at this instant: try again soon.
                connection_kills.again();
            }
            connections_killed += killed;
        }
        if database_restarts.due(progress) {
            let database = Arc::clone(&database);
            let down = Duration::from_millis(rand::rng().random_range(200..1500));
            tokio::task::spawn_blocking(move || database.restart(down))
                .await
                .unwrap();
        }
        broker.drain_dead_letters(&mut dead).await;
        if let Some(applied) = applied_count(&pool, payments).await {
            progress = (applied as f64 + dead.len() as f64) / plan.messages as f64;
        }
        // Done when every fault happened, every message is applied or
        // dead-lettered, and the broker holds nothing more.
        let faults_done = kills.left()
            + broker_restarts.left()
            + connection_kills.left()
            + database_restarts.left()
            + member_changes.left()
            == 0;
        let applied = if progress >= 1.0 || Instant::now() >= deadline {
            applied_ids(&pool, payments).await
        } else {
            None
        };
        let settled = applied
            .as_ref()
            .is_some_and(|applied| all_ids.iter().all(|id| applied.contains(id) || dead.contains(id)));
        if faults_done && settled && broker.backlog().await == Some(0) {
            settled_polls += 1;
            if settled_polls >= 3 {
                break;
            }
        } else {
            settled_polls = 0;
        }
        if Instant::now() >= deadline {
            let missing: Vec<&String> = all_ids
                .iter()
                .filter(|id| !dead.contains(*id) && !applied.as_ref().is_some_and(|a| a.contains(*id)))
                .take(20)
                .collect();
            consumers.stop();
            panic!(
                "not settled in time: progress {progress:.3}, faults left (kills {}, broker {}, connections {}, \
                 database {}), backlog {:?}, messages neither applied nor dead-lettered (first 20): {missing:?}",
                kills.left(),
                broker_restarts.left(),
                connection_kills.left(),
                database_restarts.left(),
                broker.backlog().await
            );
        }
        tokio::time::sleep(poll).await;
    }
    consumers.stop();
    broker.drain_dead_letters(&mut dead).await;

    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, count(*) FROM {payments} GROUP BY message_id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let effects: HashMap<String, i64> = rows.into_iter().collect();
    let lost = all_ids
        .iter()
        .filter(|id| !effects.contains_key(*id) && !dead.contains(*id))
        .count();
    // A duplicate copy can exhaust its attempts while the other copy
    // succeeds, and a message that failed at random on each of its attempts
    // is dead-lettered: such a message is applied at most once and may be
    // dead-lettered too.
    let dead_only = dead.iter().filter(|id| !effects.contains_key(*id)).count();
    let events = |event: &'static str| {
        let pool = pool.clone();
        async move {
            scalar(&pool, format!("SELECT count(*) FROM {log} WHERE event LIKE '{event}%'"))
                .await
                .unwrap_or(0)
        }
    };
    for id in &always_fail {
        assert!(!effects.contains_key(id), "{id} always fails: it has no effect");
    }
    let (handovers, out_of_order) = match &broker {
        Broker::Kafka { first_at, .. } => (
            handovers(&pool, log, first_at).await,
            out_of_order(&pool, payments, first_at, &dead).await,
        ),
        _ => (0, 0),
    };
    Figures {
        broker: plan.broker.name(),
        messages: plan.messages,
        published,
        deliveries: events("delivery").await,
        kills: plan.kills,
        broker_restarts: plan.broker_restarts,
        connection_kills: plan.connection_kills,
        connections_killed,
        database_restarts: plan.database_restarts,
        joins: consumers.joins,
        leaves: consumers.leaves,
        handovers,
        out_of_order,
        crashes_after_commit: events("crash").await,
        crashes_mid_batch: events("mid-batch crash").await,
        injected_failures: events("failure").await,
        effects: effects.values().sum(),
        dead_lettered: dead.len(),
        dead_only,
        lost,
        applied_twice: effects.values().filter(|n| **n > 1).count(),
        elapsed: started.elapsed(),
    }
}

/// Prints the figures straight to stderr: libtest captures `println!`, but
/// the chaos run's figures belong in the default test output.
fn report(name: &str, f: &Figures) {
    use std::io::Write;
    let text = format!(
        "chaos {name} ({}): {:.1?}\n  messages {} (published {} with duplicates)\n  deliveries to handlers {} \
         (logged best effort)\n  SIGKILLs {}, aborts after commit before ack {}, mid-batch aborts {}\n  members joined {}, left {}, \
         partition handovers {}, effects out of offset order {}\n  broker restarts {}, \
         database connection kills {} ({} connections), database restarts {}\n  injected handler failures {}\n  \
         effects {} (= messages {} - dead-lettered only {}); dead-lettered {}\n  lost {}, applied twice {}\n",
        f.broker,
        f.elapsed,
        f.messages,
        f.published,
        f.deliveries,
        f.kills,
        f.crashes_after_commit,
        f.crashes_mid_batch,
        f.joins,
        f.leaves,
        f.handovers,
        f.out_of_order,
        f.broker_restarts,
        f.connection_kills,
        f.connections_killed,
        f.database_restarts,
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
        f.injected_failures > 0 && f.crashes_after_commit > 0,
        "the chaos happened: {f:?}"
    );
    assert!(
        f.connection_kills == 0 || f.connections_killed > 0,
        "database connections were killed: {f:?}"
    );
}

fn fast(broker: BrokerKind) -> Plan {
    Plan {
        broker,
        messages: 300,
        duplicate_percent: 20,
        always_fail_percent: 2,
        consumers: 3,
        fail_percent: 10,
        crash_percent: 2,
        kills: 6,
        broker_restarts: 1,
        connection_kills: 1,
        database_restarts: 1,
        deadline: Duration::from_secs(120),
        batch: None,
        member_changes: 0,
        forced_crash_suffix: "07",
        kafka_key_order: false,
    }
}

/// A Kafka run of `messages`: 3 members of one group over 4 partitions,
/// SIGKILLed and started again, a member joining and leaving; each kill
/// stalls its partitions for the group's session timeout (6 s), so the
/// crashes after commit are fewer than on the other brokers (the first
/// commit of every thousandth message). The broker is not restarted
/// (Tansu's memory storage would lose everything).
fn kafka(messages: usize) -> Plan {
    Plan {
        broker: BrokerKind::Kafka,
        messages,
        duplicate_percent: 20,
        always_fail_percent: 1,
        consumers: 3,
        fail_percent: 10,
        crash_percent: 0,
        kills: (messages / 1500).max(3),
        broker_restarts: 0,
        connection_kills: (messages / 10_000).max(1),
        database_restarts: (messages / 20_000).max(1),
        deadline: Duration::from_secs(300 + messages as u64 / 15),
        batch: None,
        member_changes: 2 * (messages / 6000).max(1),
        forced_crash_suffix: "007",
        kafka_key_order: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_consumers_apply_each_message_once_through_every_fault() {
    let figures = run(fast(BrokerKind::RabbitMq)).await;
    report("fast", &figures);
    check(&figures);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_consumers_apply_each_message_once_through_every_fault() {
    let figures = run(fast(BrokerKind::Nats)).await;
    report("fast", &figures);
    check(&figures);
}

/// The same faults with batch transactions (`ConsumerBuilder::batch`):
/// SIGKILLs and aborts land mid-batch (nothing of the batch committed) and
/// right after a batch's commit, before its acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_batches_apply_each_message_once_through_every_fault() {
    let figures = run(Plan {
        batch: Some(16),
        crash_percent: 3,
        ..fast(BrokerKind::RabbitMq)
    })
    .await;
    report("batches", &figures);
    check(&figures);
    assert!(figures.crashes_mid_batch > 0, "aborts landed mid-batch: {figures:?}");
}

/// Kafka: members SIGKILLed and started again, one joining and leaving
/// (rebalances each), crashes after commit before the offset commit, a
/// database connection kill and restart, duplicates published upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_group_members_apply_each_message_once_through_sigkills_and_rebalances() {
    let figures = run(kafka(1200)).await;
    report("fast", &figures);
    check(&figures);
    check_group(&figures, false);
}

/// A Kafka run: a member joined and left and partitions moved; each
/// partition's effects in offset order under partition order, some out of
/// it under key order (a partition's keys ran concurrently).
fn check_group(f: &Figures, key_order: bool) {
    assert!(
        f.joins == 1 && f.leaves == 1 && f.handovers > 0,
        "a member joined and left, and partitions moved: {f:?}"
    );
    check_order(f, key_order);
}

fn check_order(f: &Figures, key_order: bool) {
    assert_eq!(
        f.out_of_order == 0,
        !key_order,
        "effects in offset order under partition order, some out of it under key order: {f:?}"
    );
}

/// The same on members that order by key within a partition
/// (`Order::Key`): the records of a partition run concurrently (each
/// message id is its own key), a duplicate waits for its original, and the
/// committed offset stays at the lowest unfinished record while later ones
/// finish, so a SIGKILL or a rebalance hands those later records to the
/// next owner again (the marker skips them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_key_order_members_apply_each_message_once_through_sigkills_and_rebalances() {
    let figures = run(Plan {
        kafka_key_order: true,
        ..kafka(1200)
    })
    .await;
    report("key order", &figures);
    check(&figures);
    check_group(&figures, true);
}

/// The long form on Kafka: `IDEMPOTENT_KAFKA_SOAK=1`, `IDEMPOTENT_SOAK_MESSAGES`
/// messages (default 20 000); `IDEMPOTENT_SOAK_KAFKA_ORDER=key` orders by
/// key within a partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_soak() {
    if std::env::var("IDEMPOTENT_KAFKA_SOAK").as_deref() != Ok("1") {
        println!("Kafka soak skipped: set IDEMPOTENT_KAFKA_SOAK=1 to run it");
        return;
    }
    let messages: usize = std::env::var("IDEMPOTENT_SOAK_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    let kafka_key_order = std::env::var("IDEMPOTENT_SOAK_KAFKA_ORDER").as_deref() == Ok("key");
    let figures = run(Plan {
        kafka_key_order,
        ..kafka(messages)
    })
    .await;
    report(if kafka_key_order { "soak, key order" } else { "soak" }, &figures);
    check(&figures);
    check_order(&figures, kafka_key_order);
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
        .unwrap_or(100_000);
    let broker = match std::env::var("IDEMPOTENT_SOAK_BROKER").as_deref() {
        Ok("nats") => BrokerKind::Nats,
        _ => BrokerKind::RabbitMq,
    };
    // Faults spread over the run (between 10 % and 80 % of the messages).
    let figures = run(Plan {
        broker,
        messages,
        duplicate_percent: 20,
        always_fail_percent: 1,
        consumers: 4,
        fail_percent: 10,
        crash_percent: 1,
        kills: (messages / 800).max(10),
        broker_restarts: (messages / 25_000).max(3),
        connection_kills: (messages / 25_000).max(3),
        database_restarts: (messages / 50_000).max(1),
        deadline: Duration::from_secs(300 + messages as u64 / 20),
        batch: std::env::var("IDEMPOTENT_SOAK_BATCH").ok().and_then(|n| n.parse().ok()),
        member_changes: 0,
        forced_crash_suffix: "07",
        kafka_key_order: false,
    })
    .await;
    report("soak", &figures);
    check(&figures);
}
