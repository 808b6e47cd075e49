//! No two different `(scope, key)` pairs share a marker, in any store.
//!
//! The pairs are drawn from an alphabet chosen to collide: separators the
//! Redis layout uses (`:` and digits), trailing spaces (MySQL's PAD SPACE
//! collations), case, and Unicode that normalises or case-folds to another
//! spelling (`é` and `e` + U+0301, `ß` and `ss`). Each pair is claimed and
//! completed with itself as the result, then claimed again: every pair must
//! be fresh the first time and replay its own result the second.

mod common;

use std::collections::BTreeSet;

use idempotent_runtime::store::{Claim, Guard, Request, Store};
use idempotent_runtime::{MemoryStore, PgStore, RedisStore};
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec![
            "a", "b", ":", "1", "2", " ", "é", "e\u{301}", "ß", "ss", "S", "A", "{", "}",
        ]),
        1..6,
    )
    .prop_map(|parts| parts.concat())
}

fn pairs() -> impl Strategy<Value = BTreeSet<(String, String)>> {
    prop::collection::btree_set((text(), text()), 1..14)
}

/// Pairs that defeat naive encodings.
fn adversarial() -> BTreeSet<(String, String)> {
    [
        ("a", "b:c"),
        ("a:b", "c"),
        ("1:a", "b"),
        ("1", "a:b"),
        ("2:a:", "b"),
        ("a", "k"),
        ("a", "k "),
        ("a", "K"),
        ("A", "k"),
        ("a", "é"),
        ("a", "e\u{301}"),
        ("a", "ß"),
        ("a", "ss"),
        ("a ", "k"),
    ]
    .into_iter()
    .map(|(s, k)| (s.to_owned(), k.to_owned()))
    .collect()
}

/// Claims every pair on `store` (all fresh), completes each with itself as
/// the result, then claims again (each replays its own pair).
async fn every_pair_is_its_own_marker<S: Store>(store: &S, tag: &str, pairs: &BTreeSet<(String, String)>) {
    // Keys made unique per run, scopes kept as drawn.
    let pairs: Vec<(String, String)> = pairs.iter().map(|(s, k)| (s.clone(), format!("{k}|{tag}"))).collect();
    for (scope, key) in &pairs {
        let req = Request::new(scope, key).unwrap();
        match store.claim(&req).await.unwrap() {
            Claim::Fresh(guard) => guard
                .complete(Some(serde_json::to_string(&(scope, key)).unwrap()))
                .await
                .unwrap(),
            Claim::Done(replay) => panic!(
                "({scope:?}, {key:?}) found the marker of {:?}",
                replay.decode::<(String, String)>()
            ),
        }
    }
    for (scope, key) in &pairs {
        let req = Request::new(scope, key).unwrap();
        match store.claim(&req).await.unwrap() {
            Claim::Done(replay) => {
                assert_eq!(
                    replay.decode::<(String, String)>().unwrap(),
                    (scope.clone(), key.clone())
                )
            }
            Claim::Fresh(_) => panic!("({scope:?}, {key:?}) lost its marker"),
        }
    }
}

/// The stores under test, each on a fresh table or prefix.
struct Stores {
    memory: MemoryStore,
    pg: PgStore,
    pg_table: String,
    mysql: idempotent_runtime::MySqlStore,
    mysql_table: String,
    sqlite: idempotent_runtime::SqliteStore,
    _dir: tempfile::TempDir,
    redis: RedisStore,
    redis_conn: idempotent_runtime::redis::aio::ConnectionManager,
    redis_prefix: String,
}

impl Stores {
    async fn new() -> Stores {
        let pg_pool = common::pg_pool(2).await;
        let pg_table = common::unique("keys");
        let pg = PgStore::builder(pg_pool).table(&pg_table).build().unwrap();
        pg.migrate().await.unwrap();
        let my_pool = common::mysql_pool(2).await;
        let mysql_table = common::unique("keys");
        let mysql = idempotent_runtime::MySqlStore::builder(my_pool)
            .table(&mysql_table)
            .build()
            .unwrap();
        mysql.migrate().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let sqlite = idempotent_runtime::SqliteStore::open(dir.path().join("k.db"))
            .await
            .unwrap();
        sqlite.migrate().await.unwrap();
        let client = idempotent_runtime::redis::Client::open(common::REDIS_URL).unwrap();
        let redis_conn = client.get_connection_manager().await.unwrap();
        let redis_prefix = format!("{}:", common::unique("keys"));
        let redis = RedisStore::builder(redis_conn.clone())
            .prefix(redis_prefix.clone())
            .build()
            .unwrap();
        Stores {
            memory: MemoryStore::new(),
            pg,
            pg_table,
            mysql,
            mysql_table,
            sqlite,
            _dir: dir,
            redis,
            redis_conn,
            redis_prefix,
        }
    }

    async fn check(&self, tag: &str, pairs: &BTreeSet<(String, String)>) {
        every_pair_is_its_own_marker(&self.memory, tag, pairs).await;
        every_pair_is_its_own_marker(&self.pg, tag, pairs).await;
        every_pair_is_its_own_marker(&self.mysql, tag, pairs).await;
        every_pair_is_its_own_marker(&self.sqlite, tag, pairs).await;
        every_pair_is_its_own_marker(&self.redis, tag, pairs).await;
    }

    async fn teardown(mut self) {
        common::drop_pg_table(self.pg.pool(), &self.pg_table).await;
        common::drop_mysql_table(self.mysql.pool(), &self.mysql_table).await;
        let keys: Vec<String> = idempotent_runtime::redis::cmd("KEYS")
            .arg(format!("{}*", self.redis_prefix))
            .query_async(&mut self.redis_conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let () = idempotent_runtime::redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut self.redis_conn)
                .await
                .unwrap();
        }
    }
}

#[test]
fn no_two_pairs_share_a_marker_in_any_store() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stores = runtime.block_on(Stores::new());
    runtime.block_on(stores.check("adversarial", &adversarial()));
    let case = std::sync::atomic::AtomicU32::new(0);
    proptest!(ProptestConfig::with_cases(24), |(pairs in pairs())| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(stores.check(&format!("case{n}"), &pairs));
    });
    runtime.block_on(stores.teardown());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The Redis layout `{prefix}{len(scope)}:{scope}:{key}` is injective.
    #[test]
    fn the_redis_key_layout_is_injective(a in (text(), text()), b in (text(), text())) {
        let layout = |(scope, key): &(String, String)| format!("p:{}:{scope}:{key}", scope.len());
        prop_assert_eq!(layout(&a) == layout(&b), a == b);
    }
}

#[tokio::test]
async fn the_redis_store_uses_the_documented_layout() {
    let client = idempotent_runtime::redis::Client::open(common::REDIS_URL).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let store = RedisStore::builder(conn).prefix("p:").build().unwrap();
    assert_eq!(store.redis_key("a:b", "c"), "p:3:a:b:c");
    assert_eq!(store.redis_key("a", "b:c"), "p:1:a:b:c");
}
