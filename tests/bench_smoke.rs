//! Every variant of `benches/throughput.rs` delivers one fresh message and
//! its duplicate, once, in the default test run: the benchmark's code paths
//! (PostgreSQL, SQLite, Redis, memory) keep compiling and keep telling a
//! fresh message from a duplicate; the three modes of `benches/kafka.rs`
//! each consume a small topic once; so do the variants of `benches/http.rs`
//! (a request without the layer, a fresh key, a replay). No timing is
//! measured here.

mod common;

#[allow(dead_code)]
#[path = "../benches/throughput/harness.rs"]
mod harness;
#[allow(dead_code)]
#[path = "../benches/http/rig.rs"]
mod http_rig;
#[allow(dead_code)]
#[path = "../benches/kafka/run.rs"]
mod kafka_bench;
#[allow(dead_code)]
#[path = "../benches/throughput/redis.rs"]
mod kv;
#[allow(dead_code)]
#[path = "../benches/throughput/lite.rs"]
mod lite;
#[allow(dead_code)]
#[path = "../benches/throughput/mem.rs"]
mod mem;
#[allow(dead_code)]
#[path = "../benches/throughput/my.rs"]
mod my;
#[allow(dead_code)]
#[path = "../benches/throughput/pg.rs"]
mod pg;

use std::sync::atomic::{AtomicU64, Ordering};

use harness::{Outcome, Variant};
use idempotent_runtime::{CachedStore, MemoryStore};

#[path = "../benches/shared/unique.rs"]
mod names;
pub use names::unique;

/// One fresh delivery, then the same key again: a duplicate, unless the
/// variant has no idempotency (`bare`).
async fn once(name: &str, variant: &impl Variant, bare: bool) {
    variant.reset().await;
    let key = unique("smoke");
    let first = variant
        .deliver(key.clone())
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(matches!(first, Outcome::Fresh), "{name}: first delivery is fresh");
    let again = variant.deliver(key).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    let expected = if bare { "Fresh" } else { "Duplicate" };
    let got = match again {
        Outcome::Fresh => "Fresh",
        Outcome::Duplicate => "Duplicate",
        Outcome::Busy => "Busy",
    };
    assert_eq!(got, expected, "{name}: second delivery");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_variants_run_once() {
    let env = pg::PgEnv::connect(2).await.expect("PostgreSQL at 127.0.0.1:5432");
    once("pg (a)", &pg::Bare::new(env.tables("a").await), true).await;
    once("pg (b)", &pg::Article::new(env.tables("b").await), false).await;
    once("pg (c)", &pg::ClaimFirst::new(env.tables("c").await, false), false).await;
    once("pg (c')", &pg::ClaimFirst::new(env.tables("c3").await, true), false).await;
    let td = env.tables("d").await;
    once("pg (d)", &pg::Macro::new(td.clone(), td.store()), false).await;
    let tk = env.tables("dk").await;
    let cached = pg::cached(&tk, 100);
    once("pg (d+cache)", &pg::Macro::new(tk, cached), false).await;
    once(
        "pg (s)",
        &pg::ClaimFirst::store_statements(env.tables("s").await),
        false,
    )
    .await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_batches_run_once() {
    let env = pg::PgEnv::connect(2).await.expect("PostgreSQL at 127.0.0.1:5432");
    let batched = pg::Batched::new(env.tables("e").await, 4);
    batched.reset().await;
    assert_eq!(batched.batch(), 4);
    let (k1, k2) = (unique("smoke"), unique("smoke"));
    let keys = vec![k1.clone(), k2.clone(), k1.clone(), unique("smoke")];
    let outcomes = batched.deliver_batch(keys).await.unwrap();
    assert!(
        matches!(
            outcomes[..],
            [Outcome::Fresh, Outcome::Fresh, Outcome::Duplicate, Outcome::Fresh]
        ),
        "a repeated key inside the batch is a duplicate"
    );
    let again = batched
        .deliver_batch(vec![k2, k1, unique("smoke"), unique("smoke")])
        .await
        .unwrap();
    assert!(matches!(
        again[..],
        [Outcome::Duplicate, Outcome::Duplicate, Outcome::Fresh, Outcome::Fresh]
    ));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_variants_run_once() {
    let env = my::MyEnv::connect(2).await.expect("MariaDB at 127.0.0.1:3306");
    let (version, _, _) = env.server().await;
    assert!(!version.is_empty());
    once("mysql (a)", &my::Bare::new(env.tables("a").await), true).await;
    once("mysql (b)", &my::Article::new(env.tables("b").await), false).await;
    once("mysql (c)", &my::ClaimFirst::new(env.tables("c").await), false).await;
    let td = env.tables("d").await;
    let store = td.store.clone();
    once("mysql (d)", &my::Macro::new(td, store), false).await;
    once("mysql (s)", &my::StoreStatements::new(env.tables("s").await), false).await;
    env.cleanup().await;
    env.pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_variants_run_once() {
    let env = lite::LiteEnv::open().await;
    once("sqlite (a)", &lite::Bare::new(env.tables("a").await), true).await;
    once("sqlite (b)", &lite::Article::new(env.tables("b").await), false).await;
    once("sqlite (c)", &lite::ClaimFirst::new(env.tables("c").await), false).await;
    once("sqlite (d)", &lite::Macro::new(env.tables("d").await), false).await;
    once(
        "sqlite (s)",
        &lite::ClaimFirst::store_statements(env.tables("s").await),
        false,
    )
    .await;
}

/// Runs the Redis rows once on the server at `url`; whether (s) fell back
/// to the completion script.
async fn redis_variants_run_once_on(url: &str) -> bool {
    let conn = kv::connect(url).await.expect("the Redis server");
    let base = format!("{}:", unique("idem-smoke"));
    let article = kv::Article {
        conn: conn.clone(),
        prefix: format!("{base}article:"),
        effects: AtomicU64::new(0),
    };
    once("redis (b)", &article, false).await;
    let claim_first = kv::ClaimFirst {
        conn: conn.clone(),
        prefix: format!("{base}claimfirst:"),
        effects: AtomicU64::new(0),
    };
    once("redis (c)", &claim_first, false).await;
    let store = kv::Macro {
        store: kv::store(conn.clone(), &format!("{base}store:")),
        effects: AtomicU64::new(0),
    };
    once("redis (d)", &store, false).await;
    let no_renewal = kv::Macro {
        store: kv::store_without_renewal(conn.clone(), &format!("{base}norenew:")),
        effects: AtomicU64::new(0),
    };
    once("redis (d')", &no_renewal, false).await;
    let cached = kv::Macro {
        store: kv::cached(conn.clone(), &format!("{base}cached:"), 100),
        effects: AtomicU64::new(0),
    };
    once("redis (d+cache)", &cached, false).await;
    let by_hand = kv::StoreCommands::new(conn.clone(), format!("{base}storecmds:"));
    once("redis (s)", &by_hand, false).await;
    let deleted = kv::delete_prefix(&mut conn.clone(), &base).await;
    assert_eq!(deleted, 6, "one marker per variant");
    by_hand.scripted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_variants_run_once() {
    let scripted = redis_variants_run_once_on(kv::REDIS_URL).await;
    assert!(scripted, "Redis 7.0 has no SET .. IFEQ: (s) completes with the script");
}

/// On Valkey 8.1, (s) completes with `SET .. IFEQ` as `RedisStore` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_variants_run_once_on_valkey() {
    let server = common::servers::ChildServer::valkey();
    let scripted = redis_variants_run_once_on(&server.redis_url()).await;
    assert!(!scripted, "Valkey 8.1 takes SET .. IFEQ");
}

#[tokio::test]
async fn memory_variants_run_once() {
    once("memory (a)", &mem::Bare::default(), true).await;
    once("memory (d)", &mem::Macro::new(MemoryStore::new()), false).await;
    once(
        "memory (d+cache)",
        &mem::Macro::new(CachedStore::new(MemoryStore::new(), 100)),
        false,
    )
    .await;
}

/// Each mode of `benches/kafka.rs` (no idempotency, markers, offsets in the
/// database) consumes a small topic once, every record's effect applied
/// once (the measurement checks the count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_modes_run_once() {
    let kafka = common::kafka::Kafka::start();
    let pool = common::pg_pool(8).await;
    let topic = kafka_bench::topic(&kafka, 2, 20).await;
    for mode in kafka_bench::Mode::ALL {
        let rate = kafka_bench::measure(&kafka, &pool, &topic, mode, 20)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", mode.label()));
        assert!(rate > 0.0, "{}", mode.label());
    }
}

/// One request of each variant of `benches/http.rs`, and one short timed
/// run of each: (a), (b) and (h) insert once per request, (c) and a
/// repeated (h) replay without inserting.
async fn http_variants_run_once_on<D: http_rig::Db>(db: D) {
    use http_rig::Variant;
    let rig = http_rig::Rig::start(db).await;
    let name = rig.db.name();
    assert_eq!(
        rig.request(Variant::Bare, None).await.unwrap(),
        (201, false),
        "{name} (a)"
    );
    let key = http_rig::fresh_key();
    assert_eq!(
        rig.request(Variant::Fresh, Some(&key)).await.unwrap(),
        (201, false),
        "{name} (b)"
    );
    assert_eq!(
        rig.request(Variant::Replay, Some(&key)).await.unwrap(),
        (201, true),
        "{name} (c)"
    );
    let hand = http_rig::fresh_key();
    assert_eq!(
        rig.request(Variant::Hand, Some(&hand)).await.unwrap(),
        (201, false),
        "{name} (h)"
    );
    assert_eq!(
        rig.request(Variant::Hand, Some(&hand)).await.unwrap(),
        (201, true),
        "{name} (h) again: the kept answer"
    );
    assert_eq!(rig.db.rows().await, 3, "{name}: (a), (b) and (h) inserted once each");
    let keys = rig.answered_keys(4).await;
    for variant in [Variant::Bare, Variant::Fresh, Variant::Replay, Variant::Hand] {
        let sample = rig.run(variant, 2, 0.05, &keys).await;
        assert!(!sample.latencies.is_empty(), "{name} {variant:?}");
    }
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_variants_run_once() {
    let pg = http_rig::Pg::connect(4).await.expect("PostgreSQL at 127.0.0.1:5432");
    http_variants_run_once_on(pg).await;
    let lite = http_rig::Lite::open().await.expect("a SQLite file");
    http_variants_run_once_on(lite).await;
}
