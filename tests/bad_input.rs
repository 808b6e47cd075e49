//! Bad input gets a clear error and commits nothing, on every store:
//! malformed payloads, a missing key field, empty, 10 KB and NUL keys, a
//! hostile table name. Unicode keys work.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::store::Store;
use idempotent_runtime::{Error, MemoryStore, MySqlStore, PgStore, RedisStore, SqliteStore, idempotent};

#[derive(Debug, serde::Deserialize)]
struct Payment {
    message_id: Option<String>,
    #[allow(dead_code)]
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("malformed payload: {0}")]
    Payload(#[from] serde_json::Error),
}

#[idempotent(key = "msg.message_id", store = store)]
async fn handle<S: Store>(store: &S, msg: &Payment, runs: &AtomicU32) -> Result<(), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Decodes a delivery and handles it, as a consumer does.
async fn deliver<S: Store>(store: &S, payload: &[u8], runs: &AtomicU32) -> Result<(), AppError> {
    let msg: Payment = serde_json::from_slice(payload)?;
    handle(store, &msg, runs).await
}

/// Runs `check` against every store, each fresh; with `refused`, also
/// checks that no marker was committed.
async fn on_every_store<F, Fut>(refused: bool, check: F)
where
    F: Fn(&'static str, Box<dyn ErasedStore>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let pg_table = common::unique("bad_input");
    let pg = PgStore::builder(common::pg_pool(2).await)
        .table(&pg_table)
        .build()
        .unwrap();
    pg.migrate().await.unwrap();
    let my_table = common::unique("bad_input");
    let my = MySqlStore::builder(common::mysql_pool(2).await)
        .table(&my_table)
        .build()
        .unwrap();
    my.migrate().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lite = SqliteStore::open(dir.path().join("bad.db")).await.unwrap();
    lite.migrate().await.unwrap();
    let client = idempotent_runtime::redis::Client::open(common::REDIS_URL).unwrap();
    let prefix = format!("{}:", common::unique("bad_input"));
    let mut conn = client.get_connection_manager().await.unwrap();
    let redis = RedisStore::builder(conn.clone())
        .prefix(prefix.clone())
        .build()
        .unwrap();

    check("postgres", Box::new(pg.clone())).await;
    check("sqlite", Box::new(lite.clone())).await;
    check("mysql", Box::new(my.clone())).await;
    check("redis", Box::new(redis)).await;
    check("memory", Box::new(MemoryStore::new())).await;

    let markers = |table: &str| format!("SELECT count(*) FROM {table}");
    let pg_markers: i64 = sqlx::query_scalar(AssertSqlSafe(markers(&pg_table)))
        .fetch_one(pg.pool())
        .await
        .unwrap();
    let lite_markers: i64 = sqlx::query_scalar(AssertSqlSafe(markers("processed_messages")))
        .fetch_one(lite.pool())
        .await
        .unwrap();
    let my_markers: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM `{my_table}`")))
        .fetch_one(my.pool())
        .await
        .unwrap();
    common::drop_pg_table(pg.pool(), &pg_table).await;
    common::drop_mysql_table(my.pool(), &my_table).await;
    let redis_keys: Vec<String> = idempotent_runtime::redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !redis_keys.is_empty() {
        let () = idempotent_runtime::redis::cmd("DEL")
            .arg(&redis_keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    if refused {
        assert!(redis_keys.is_empty(), "bad input left no Redis marker: {redis_keys:?}");
        assert_eq!(
            (pg_markers, lite_markers, my_markers),
            (0, 0, 0),
            "bad input committed no marker"
        );
    }
}

/// The stores behind one object-safe face, so one check runs on all.
trait ErasedStore {
    fn deliver<'a>(
        &'a self,
        payload: &'a [u8],
        runs: &'a AtomicU32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), AppError>> + Send + 'a>>;
}

impl<S: Store + 'static> ErasedStore for S {
    fn deliver<'a>(
        &'a self,
        payload: &'a [u8],
        runs: &'a AtomicU32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), AppError>> + Send + 'a>> {
        Box::pin(deliver(self, payload, runs))
    }
}

fn payload(key: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "message_id": key, "amount": 10 })).unwrap()
}

async fn assert_refused(payload: &[u8], expect: fn(&AppError) -> bool, says: &'static str) {
    on_every_store(true, |name, store| async move {
        let runs = AtomicU32::new(0);
        let err = store.deliver(payload, &runs).await.unwrap_err();
        assert!(expect(&err), "{name}: {err:?}");
        assert!(
            err.to_string().contains(says),
            "{name}: the error says what is wrong: {err}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{name}: the body did not run");
    })
    .await;
}

#[tokio::test]
async fn malformed_payload_is_a_decode_error() {
    assert_refused(
        b"{\"message_id\": \"m-1\", \"amount\": ",
        |e| matches!(e, AppError::Payload(_)),
        "EOF",
    )
    .await;
    assert_refused(
        b"\xff\xfe not json",
        |e| matches!(e, AppError::Payload(_)),
        "expected value",
    )
    .await;
}

#[tokio::test]
async fn missing_key_field_is_missing_key() {
    assert_refused(
        b"{\"amount\": 10}",
        |e| matches!(e, AppError::Idem(Error::MissingKey { .. })),
        "no idempotency key",
    )
    .await;
    assert_refused(
        b"{\"message_id\": null, \"amount\": 10}",
        |e| matches!(e, AppError::Idem(Error::MissingKey { .. })),
        "no idempotency key",
    )
    .await;
}

#[tokio::test]
async fn empty_key_is_invalid() {
    assert_refused(
        &payload(""),
        |e| matches!(e, AppError::Idem(Error::InvalidKey { .. })),
        "the key is empty",
    )
    .await;
}

#[tokio::test]
async fn ten_kilobyte_key_is_invalid_and_not_truncated() {
    let key = "k".repeat(10 * 1024);
    assert_refused(
        &payload(&key),
        |e| matches!(e, AppError::Idem(Error::InvalidKey { .. })),
        "10240 bytes long; the limit is 255 bytes",
    )
    .await;
}

#[tokio::test]
async fn nul_in_a_key_is_invalid() {
    assert_refused(
        &payload("before\0after"),
        |e| matches!(e, AppError::Idem(Error::InvalidKey { .. })),
        "NUL character",
    )
    .await;
}

#[tokio::test]
async fn unicode_keys_work() {
    on_every_store(false, |name, store| async move {
        let runs = AtomicU32::new(0);
        for key in ["pagamento-ção-💳", "ПЛАТЁЖ-1", "支付-１", "e\u{301}"] {
            store
                .deliver(&payload(key), &runs)
                .await
                .unwrap_or_else(|e| panic!("{name}: {key}: {e}"));
            store.deliver(&payload(key), &runs).await.unwrap();
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            4,
            "{name}: each Unicode key processed once"
        );
    })
    .await;
}

#[tokio::test]
async fn hostile_table_name_is_refused_when_the_store_is_built() {
    let pool = common::pg_pool(1).await;
    for name in [
        "processed_messages; DROP TABLE payments; --",
        "pm\" OR 1=1 --",
        "pm`",
        "pm'--",
        "pm\0",
    ] {
        let err = PgStore::builder(pool.clone()).table(name).build().unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{name:?}");
        assert!(err.to_string().contains("invalid table name"), "{err}");
    }
}
