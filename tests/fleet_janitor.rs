//! One janitor at a time across a fleet: replicas in separate processes run
//! `Janitor::spawn` against one PostgreSQL or MariaDB table; their purge
//! rounds never overlap, the others skip, and when the holder is SIGKILLed
//! mid-round another replica takes over.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotent_runtime::sqlx::{self, AssertSqlSafe, MySqlPool, PgPool};
use idempotent_runtime::store::PurgeExpired;
use idempotent_runtime::{Janitor, MySqlStore, PgStore};

/// How many expired markers each test starts with.
const EXPIRED: i64 = 40;

#[derive(Clone, Copy, Debug)]
enum Backend {
    Pg,
    MySql,
}

/// A marker table of one backend, with `EXPIRED` expired markers in it.
enum Table {
    Pg(PgPool, String),
    MySql(MySqlPool, String),
}

impl Table {
    async fn create(backend: Backend) -> Table {
        match backend {
            Backend::Pg => {
                let pool = common::pg_pool(2).await;
                let name = common::unique("fleet_pg");
                PgStore::builder(pool.clone())
                    .table(&name)
                    .build()
                    .unwrap()
                    .migrate()
                    .await
                    .unwrap();
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {name} (scope, message_id, expires_at) \
                     SELECT 'fleet', g::text, now() - interval '1 hour' FROM generate_series(1, {EXPIRED}) g"
                )))
                .execute(&pool)
                .await
                .unwrap();
                Table::Pg(pool, name)
            }
            Backend::MySql => {
                let pool = common::mysql_pool(2).await;
                let name = common::unique("fleet_my");
                MySqlStore::builder(pool.clone())
                    .table(&name)
                    .build()
                    .unwrap()
                    .migrate()
                    .await
                    .unwrap();
                let rows: Vec<String> = (1..=EXPIRED)
                    .map(|n| {
                        format!(
                            "('fleet', '{n}', UTC_TIMESTAMP(3) - INTERVAL 2 HOUR, UTC_TIMESTAMP(3) - INTERVAL 1 HOUR)"
                        )
                    })
                    .collect();
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO `{name}` (scope, message_id, processed_at, expires_at) VALUES {}",
                    rows.join(", ")
                )))
                .execute(&pool)
                .await
                .unwrap();
                Table::MySql(pool, name)
            }
        }
    }

    fn name(&self) -> &str {
        match self {
            Table::Pg(_, name) | Table::MySql(_, name) => name,
        }
    }

    fn backend_arg(&self) -> &'static str {
        match self {
            Table::Pg(..) => "pg",
            Table::MySql(..) => "mysql",
        }
    }

    async fn markers(&self) -> i64 {
        match self {
            Table::Pg(pool, name) => sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {name}")))
                .fetch_one(pool)
                .await
                .unwrap(),
            Table::MySql(pool, name) => sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM `{name}`")))
                .fetch_one(pool)
                .await
                .unwrap(),
        }
    }

    /// Waits (up to 15 s) until the janitor has purged every marker.
    async fn wait_until_purged(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.markers().await > 0 {
            assert!(Instant::now() < deadline, "the markers were never purged");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn drop_table(self) {
        match self {
            Table::Pg(pool, name) => common::drop_pg_table(&pool, &name).await,
            Table::MySql(pool, name) => common::drop_mysql_table(&pool, &name).await,
        }
    }
}

/// One line of a `janitor_process` log.
#[derive(Clone, Copy, Debug)]
struct Event {
    pid: u32,
    kind: Kind,
    at: u128,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Skip,
    Start,
    End,
}

fn read_log(path: &std::path::Path) -> Vec<Event> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|line| line.ends_with(|c: char| c.is_ascii_digit()))
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let kind = match fields[1] {
                "skip" => Kind::Skip,
                "start" => Kind::Start,
                "end" => Kind::End,
                other => panic!("unknown event {other}"),
            };
            Event {
                pid: fields[0].parse().unwrap(),
                kind,
                at: fields[2].parse().unwrap(),
            }
        })
        .collect()
}

/// Each process's rounds as `(start, end)`, `end` None for a round in
/// progress (or cut short by a SIGKILL), sorted by start.
fn rounds(events: &[Event]) -> Vec<(u32, u128, Option<u128>)> {
    let mut open: BTreeMap<u32, u128> = BTreeMap::new();
    let mut rounds = Vec::new();
    for event in events {
        match event.kind {
            Kind::Start => assert!(open.insert(event.pid, event.at).is_none(), "two starts in a row"),
            Kind::End => {
                let start = open.remove(&event.pid).expect("an end without a start");
                rounds.push((event.pid, start, Some(event.at)));
            }
            Kind::Skip => {}
        }
    }
    rounds.extend(open.into_iter().map(|(pid, start)| (pid, start, None)));
    rounds.sort_by_key(|&(_, start, _)| start);
    rounds
}

/// Asserts that no round started before the previous one ended.
fn assert_no_overlap(rounds: &[(u32, u128, Option<u128>)]) {
    for pair in rounds.windows(2) {
        let (first_pid, _, first_end) = pair[0];
        let (second_pid, second_start, _) = pair[1];
        let first_end = first_end
            .unwrap_or_else(|| panic!("process {first_pid}'s round never ended, yet {second_pid} started one"));
        assert!(
            second_start >= first_end,
            "process {second_pid} started purging before process {first_pid} had finished: {rounds:?}"
        );
    }
}

fn spawn_replicas(table: &Table, log: &std::path::Path, count: usize, hold_ms: u64, run_ms: u64) -> Vec<Child> {
    (0..count)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_janitor_process"))
                .args([
                    table.backend_arg(),
                    table.name(),
                    &log.display().to_string(),
                    "25",
                    &hold_ms.to_string(),
                    &run_ms.to_string(),
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

async fn replicas_purge_one_at_a_time(backend: Backend) {
    let table = Table::create(backend).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("janitor.log");
    let children = spawn_replicas(&table, &log, 4, 150, 2000);
    for child in children {
        let out = tokio::task::spawn_blocking(move || child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "done");
    }

    let events = read_log(&log);
    let rounds = rounds(&events);
    assert!(rounds.len() >= 2, "too few rounds to compare: {rounds:?}");
    assert_no_overlap(&rounds);
    let skipped: BTreeSet<u32> = events.iter().filter(|e| e.kind == Kind::Skip).map(|e| e.pid).collect();
    assert!(
        skipped.len() >= 2,
        "the replicas without the lock should have skipped rounds: {events:?}"
    );
    assert_eq!(table.markers().await, 0, "the expired markers were purged");
    table.drop_table().await;
}

async fn sigkilled_holder_is_taken_over(backend: Backend) {
    let table = Table::create(backend).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("janitor.log");
    // Rounds of 1.5 s; the replicas would run for 20 s if not killed.
    let mut children = spawn_replicas(&table, &log, 3, 1500, 20_000);

    // The holder: a process in the middle of a round, while another one
    // skips its rounds.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (holder, holder_start) = loop {
        let events = read_log(&log);
        let open = rounds(&events).into_iter().find(|round| round.2.is_none());
        if let Some((pid, start, None)) = open
            && events
                .iter()
                .any(|e| e.kind == Kind::Skip && e.pid != pid && e.at > start)
        {
            break (pid, start);
        }
        assert!(
            Instant::now() < deadline,
            "no replica ever held a round while another skipped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let index = children.iter().position(|child| child.id() == holder).unwrap();
    let mut killed = children.swap_remove(index);
    // Taken before the SIGKILL: the holder is alive until then, and a
    // replica may take the lock over as soon as it dies, before `wait`
    // returns (a time read after it was once later than the takeover).
    let killed_at = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    killed.kill().unwrap(); // SIGKILL
    killed.wait().unwrap();

    // Another replica takes the lock over and purges.
    table.wait_until_purged().await;
    let events = read_log(&log);
    let rounds = rounds(&events);
    for child in &mut children {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let taken_over = rounds
        .iter()
        .find(|&&(pid, start, _)| pid != holder && start > holder_start)
        .unwrap_or_else(|| panic!("no replica took over: {rounds:?}"));
    assert!(
        taken_over.1 >= killed_at,
        "a replica started purging while the holder was alive: {rounds:?}"
    );
    // Every round but the killed one ended, and none overlapped.
    let ended: Vec<_> = rounds
        .iter()
        .copied()
        .filter(|round| round.0 != holder || round.1 != holder_start)
        .collect();
    assert_no_overlap(&ended);
    table.drop_table().await;
}

/// A second store on the same table (another pool, as in another replica).
async fn held_lock_blocks_the_janitor(backend: Backend) {
    let table = Table::create(backend).await;
    match &table {
        Table::Pg(_, name) => {
            let holder = PgStore::builder(common::pg_pool(1).await).table(name).build().unwrap();
            let other = PgStore::builder(common::pg_pool(1).await).table(name).build().unwrap();
            janitor_waits_for_the_lock(&table, holder, other).await;
        }
        Table::MySql(_, name) => {
            let holder = MySqlStore::builder(common::mysql_pool(1).await)
                .table(name)
                .build()
                .unwrap();
            let other = MySqlStore::builder(common::mysql_pool(1).await)
                .table(name)
                .build()
                .unwrap();
            janitor_waits_for_the_lock(&table, holder, other).await;
        }
    }
    table.drop_table().await;
}

async fn janitor_waits_for_the_lock<S: PurgeExpired + Clone>(table: &Table, holder: S, other: S) {
    let lock = holder.try_lock_janitor().await.unwrap().expect("the lock is free");
    assert!(other.try_lock_janitor().await.unwrap().is_none(), "the lock is held");
    let janitor = Janitor::spawn(other.clone(), Duration::from_millis(20)).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(table.markers().await, EXPIRED, "a janitor without the lock purged");
    lock.release().await;
    table.wait_until_purged().await;
    janitor.shutdown().await;

    // Dropping a lock without releasing it (a cancelled round) frees it too.
    let lock = holder
        .try_lock_janitor()
        .await
        .unwrap()
        .expect("the lock is free again");
    drop(lock);
    let deadline = Instant::now() + Duration::from_secs(10);
    while other.try_lock_janitor().await.unwrap().is_none() {
        assert!(Instant::now() < deadline, "a dropped lock was never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stores of other tables do not share the lock.
async fn lock_is_per_table(backend: Backend) {
    let (first, second) = (Table::create(backend).await, Table::create(backend).await);
    match (&first, &second) {
        (Table::Pg(pool, a), Table::Pg(_, b)) => {
            let a = PgStore::builder(pool.clone()).table(a).build().unwrap();
            let b = PgStore::builder(pool.clone()).table(b).build().unwrap();
            let held = a.try_lock_janitor().await.unwrap().expect("free");
            b.try_lock_janitor()
                .await
                .unwrap()
                .expect("another table's lock")
                .release()
                .await;
            held.release().await;
        }
        (Table::MySql(pool, a), Table::MySql(_, b)) => {
            let a = MySqlStore::builder(pool.clone()).table(a).build().unwrap();
            let b = MySqlStore::builder(pool.clone()).table(b).build().unwrap();
            let held = a.try_lock_janitor().await.unwrap().expect("free");
            b.try_lock_janitor()
                .await
                .unwrap()
                .expect("another table's lock")
                .release()
                .await;
            held.release().await;
        }
        _ => unreachable!(),
    }
    first.drop_table().await;
    second.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_replicas_in_four_processes_purge_one_at_a_time() {
    replicas_purge_one_at_a_time(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_replicas_in_four_processes_purge_one_at_a_time() {
    replicas_purge_one_at_a_time(Backend::MySql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_sigkilled_holder_is_taken_over() {
    sigkilled_holder_is_taken_over(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_sigkilled_holder_is_taken_over() {
    sigkilled_holder_is_taken_over(Backend::MySql).await;
}

#[tokio::test]
async fn pg_janitor_whose_lock_is_held_elsewhere_purges_nothing() {
    held_lock_blocks_the_janitor(Backend::Pg).await;
}

#[tokio::test]
async fn mysql_janitor_whose_lock_is_held_elsewhere_purges_nothing() {
    held_lock_blocks_the_janitor(Backend::MySql).await;
}

#[tokio::test]
async fn pg_janitor_lock_is_per_table() {
    lock_is_per_table(Backend::Pg).await;
}

#[tokio::test]
async fn mysql_janitor_lock_is_per_table() {
    lock_is_per_table(Backend::MySql).await;
}
