//! The `Idempotency-Key` layer (feature `axum`, `idempotent_runtime::http`)
//! behind a real axum server on 127.0.0.1, called by real clients (`reqwest`
//! and `curl`), on SQLite, PostgreSQL and MariaDB (transactional: the handler's
//! insert commits with the kept answer) and on the in-memory store (lease).

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::axum::body::{Body, Bytes};
use idempotent_runtime::axum::extract::State;
use idempotent_runtime::axum::http::{HeaderMap, StatusCode};
use idempotent_runtime::axum::response::{IntoResponse, Response};
use idempotent_runtime::axum::routing::post;
use idempotent_runtime::axum::{self, Router};
use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx, InProgress, NotKept};
use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::store::TransactionalStore;
use idempotent_runtime::{MemoryStore, MySqlStore, PgStore, SqliteStore};

// ---- the backends ------------------------------------------------------------

trait Backend: Sized + Send + Sync + 'static {
    type S: TransactionalStore<Guard: 'static> + Clone + 'static;
    fn setup() -> impl Future<Output = Self> + Send;
    fn store(&self) -> Self::S;
    fn table(&self) -> &str;
    /// The handler's effect, in the claim's transaction.
    fn insert<'a>(
        tx: &'a mut IdempotentTx<Self::S>,
        table: &'a str,
        tenant: &'a str,
        request: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// Rows the handler committed.
    fn charges(&self) -> impl Future<Output = i64> + Send;
    fn teardown(self) -> impl Future<Output = ()> + Send;
}

struct Lite {
    store: SqliteStore,
    table: String,
    _dir: tempfile::TempDir,
}

impl Backend for Lite {
    type S = SqliteStore;
    async fn setup() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("http.db")).await.unwrap();
        store.migrate().await.unwrap();
        let table = common::unique("charges");
        let ddl = format!("CREATE TABLE {table} (tenant TEXT NOT NULL, request TEXT NOT NULL)");
        sqlx::query(AssertSqlSafe(ddl)).execute(store.pool()).await.unwrap();
        Lite {
            store,
            table,
            _dir: dir,
        }
    }
    fn store(&self) -> SqliteStore {
        self.store.clone()
    }
    fn table(&self) -> &str {
        &self.table
    }
    async fn insert(
        tx: &mut IdempotentTx<SqliteStore>,
        table: &str,
        tenant: &str,
        request: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} (tenant, request) VALUES (?1, ?2)"
        )))
        .bind(tenant)
        .bind(request)
        .execute(&mut ***tx)
        .await?;
        Ok(())
    }
    async fn charges(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {}", self.table)))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
    async fn teardown(self) {}
}

struct Pg {
    store: PgStore,
    markers: String,
    table: String,
}

impl Backend for Pg {
    type S = PgStore;
    async fn setup() -> Self {
        let pool = common::pg_pool(16).await;
        let (markers, table) = (common::unique("http_markers"), common::unique("http_charges"));
        let store = PgStore::builder(pool.clone()).table(&markers).build().unwrap();
        store.migrate().await.unwrap();
        let ddl = format!("CREATE TABLE {table} (tenant TEXT NOT NULL, request TEXT NOT NULL)");
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        Pg { store, markers, table }
    }
    fn store(&self) -> PgStore {
        self.store.clone()
    }
    fn table(&self) -> &str {
        &self.table
    }
    async fn insert(
        tx: &mut IdempotentTx<PgStore>,
        table: &str,
        tenant: &str,
        request: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} (tenant, request) VALUES ($1, $2)"
        )))
        .bind(tenant)
        .bind(request)
        .execute(&mut ***tx)
        .await?;
        Ok(())
    }
    async fn charges(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {}", self.table)))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
    async fn teardown(self) {
        common::drop_pg_table(self.store.pool(), &self.markers).await;
        common::drop_pg_table(self.store.pool(), &self.table).await;
    }
}

struct My {
    store: MySqlStore,
    markers: String,
    table: String,
}

impl Backend for My {
    type S = MySqlStore;
    async fn setup() -> Self {
        let pool = common::mysql_pool(16).await;
        let (markers, table) = (common::unique("http_markers"), common::unique("http_charges"));
        let store = MySqlStore::builder(pool.clone()).table(&markers).build().unwrap();
        store.migrate().await.unwrap();
        let ddl = format!("CREATE TABLE `{table}` (tenant TEXT NOT NULL, request TEXT NOT NULL)");
        sqlx::query(AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
        My { store, markers, table }
    }
    fn store(&self) -> MySqlStore {
        self.store.clone()
    }
    fn table(&self) -> &str {
        &self.table
    }
    async fn insert(
        tx: &mut IdempotentTx<MySqlStore>,
        table: &str,
        tenant: &str,
        request: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{table}` (tenant, request) VALUES (?, ?)"
        )))
        .bind(tenant)
        .bind(request)
        .execute(&mut ***tx)
        .await?;
        Ok(())
    }
    async fn charges(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM `{}`", self.table)))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }
    async fn teardown(self) {
        common::drop_mysql_table(self.store.pool(), &self.markers).await;
        common::drop_mysql_table(self.store.pool(), &self.table).await;
    }
}

// ---- the server ----------------------------------------------------------------

#[derive(Clone)]
struct App {
    table: Arc<str>,
    /// How many times a handler's body ran.
    ran: Arc<AtomicUsize>,
    /// How long the charge handler takes (so that retries overlap it).
    delay: Duration,
}

fn tenant(headers: &HeaderMap) -> String {
    headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// Charges: inserts a row in the claim's transaction, then answers by the
/// body's words: `fail` 500, `not-kept` 429 marked [`NotKept`], `stream` a
/// body of unknown length; otherwise 201 with headers and a body that is
/// not UTF-8.
async fn charge<B: Backend>(
    State(app): State<App>,
    headers: HeaderMap,
    mut tx: IdempotentTx<B::S>,
    body: Bytes,
) -> Response {
    let run = app.ran.fetch_add(1, Ordering::SeqCst) + 1;
    let text = String::from_utf8_lossy(&body).into_owned();
    if let Err(error) = B::insert(&mut tx, &app.table, &tenant(&headers), &text).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    tokio::time::sleep(app.delay).await;
    if text.contains("fail") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the charge failed").into_response();
    }
    if text.contains("not-kept") {
        return (StatusCode::TOO_MANY_REQUESTS, NotKept, "try again").into_response();
    }
    if text.contains("stream") {
        let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"part"))]);
        return (StatusCode::OK, Body::from_stream(chunks)).into_response();
    }
    let mut answer = format!("charged {text} on run {run} ").into_bytes();
    answer.extend_from_slice(&[0x00, 0xff, 0xfe, b'\n']);
    (
        StatusCode::CREATED,
        [
            ("x-charge-run", run.to_string()),
            ("content-type", "application/octet-stream".to_owned()),
            ("set-cookie", "session=first-answer-only".to_owned()),
        ],
        answer,
    )
        .into_response()
}

async fn plain(State(app): State<App>) -> (StatusCode, &'static str) {
    app.ran.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, "plain")
}

fn layer<S: idempotent_runtime::store::Store + 'static>(store: S, policy: InProgress) -> IdempotencyLayer<S> {
    IdempotencyLayer::builder(store)
        .caller(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
        .body_limit(1024)
        .in_progress(policy)
        .build()
}

/// `/charges` (key required, caller from `X-Tenant`) and `/optional` (key
/// optional), served on 127.0.0.1; its base URL.
async fn serve<B: Backend>(backend: &B, app: App, policy: InProgress) -> String {
    let required = Router::new()
        .route("/charges", post(charge::<B>))
        .route_layer(layer(backend.store(), policy));
    let optional = Router::new().route("/optional", post(plain)).route_layer(
        IdempotencyLayer::builder(backend.store())
            .optional()
            .caller(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
            .build(),
    );
    listen(required.merge(optional).with_state(app)).await
}

async fn listen(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

fn app(table: &str, delay: Duration) -> App {
    App {
        table: Arc::from(table),
        ran: Arc::default(),
        delay,
    }
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }
    fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"],
            "application/problem+json",
            "status {}: {}",
            self.status,
            String::from_utf8_lossy(&self.body)
        );
        let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(doc["status"], self.status);
        doc["type"].as_str().unwrap().to_owned()
    }
}

async fn send(client: &reqwest::Client, url: &str, key: Option<&str>, tenant: &str, body: &str) -> Answer {
    let mut request = client.post(url).header("x-tenant", tenant).body(body.to_owned());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.send().await.unwrap();
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.bytes().await.unwrap().to_vec(),
    }
}

// ---- the promises --------------------------------------------------------------

async fn concurrent_requests_with_one_key_run_the_body_once<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::from_millis(300));
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = format!("\"{}\"", common::unique("key"));
    let answers = futures_util::future::join_all(
        (0..50).map(|_| send(&client, &url, Some(&key), "acme", r#"{"order":"A-1","amount":42}"#)),
    )
    .await;
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the body ran more than once");
    assert_eq!(backend.charges().await, 1);
    let first: Vec<_> = answers.iter().filter(|a| a.status == 201 && !a.replayed()).collect();
    assert_eq!(first.len(), 1, "exactly one answer is the first run's");
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, first[0].body, "a replay differs from the first answer"),
            409 => {
                assert_eq!(answer.problem_type(), "urn:idempotent:in-progress");
                assert_eq!(answer.headers["retry-after"], "1");
            }
            other => panic!("unexpected status {other}: {}", String::from_utf8_lossy(&answer.body)),
        }
    }
    // After the first answer, a retry is the replay.
    let retry = send(&client, &url, Some(&key), "acme", r#"{"order":"A-1","amount":42}"#).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first[0].body);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    backend.teardown().await;
}

async fn waiting_retries_get_the_first_answer<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::from_millis(200));
    let ran = Arc::clone(&app.ran);
    let policy = InProgress::Wait {
        timeout: Duration::from_secs(30),
    };
    let base = serve(&backend, app, policy).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = common::unique("key");
    let answers =
        futures_util::future::join_all((0..10).map(|_| send(&client, &url, Some(&key), "acme", "order W"))).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(backend.charges().await, 1);
    assert!(answers.iter().all(|a| a.status == 201 && a.body == answers[0].body));
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    backend.teardown().await;
}

async fn a_different_request_with_a_used_key_is_422<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = common::unique("key");
    assert_eq!(send(&client, &url, Some(&key), "acme", "amount 42").await.status, 201);
    let mismatched = send(&client, &url, Some(&key), "acme", "amount 43").await;
    assert_eq!(mismatched.status, 422);
    assert_eq!(mismatched.problem_type(), "urn:idempotent:key-reused");
    // The query is part of the request too.
    let other_query = send(&client, &format!("{url}?currency=usd"), Some(&key), "acme", "amount 42").await;
    assert_eq!(other_query.status, 422);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(backend.charges().await, 1);
    backend.teardown().await;
}

async fn missing_keys_and_callers_are_400<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let missing = send(&client, &format!("{base}/charges"), None, "acme", "x").await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem_type(), "urn:idempotent:missing-key");
    let no_tenant = client
        .post(format!("{base}/charges"))
        .header("idempotency-key", "k-1")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(no_tenant.status(), 400);
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // A route where the key is optional runs without one, every time.
    for _ in 0..2 {
        assert_eq!(
            send(&client, &format!("{base}/optional"), None, "acme", "x")
                .await
                .status,
            201
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    // ...and with one, once.
    let key = common::unique("key");
    for _ in 0..2 {
        assert_eq!(
            send(&client, &format!("{base}/optional"), Some(&key), "acme", "x")
                .await
                .status,
            201
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    backend.teardown().await;
}

async fn hostile_keys_and_bodies_are_refused<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let long = "k".repeat(256);
    for key in [
        "\"\"",
        "\"unterminated",
        "\"a\";param=1",
        "a,b",
        "two words",
        "\"esc\\ape\"",
        long.as_str(),
    ] {
        let answer = send(&client, &url, Some(key), "acme", "x").await;
        assert_eq!(answer.status, 400, "key {key:?}");
        assert_eq!(answer.problem_type(), "urn:idempotent:invalid-key", "key {key:?}");
    }
    // Bytes that are not ASCII, and two headers.
    let answer = client
        .post(&url)
        .header("x-tenant", "acme")
        .header(
            "idempotency-key",
            reqwest::header::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 400);
    let answer = client
        .post(&url)
        .header("x-tenant", "acme")
        .header("idempotency-key", "one")
        .header("idempotency-key", "two")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 400);
    // The longest key is accepted, never truncated.
    let longest = "k".repeat(255);
    assert_eq!(send(&client, &url, Some(&longest), "acme", "x").await.status, 201);
    // A body over the cap (1 KiB here) is 413, by its length or by reading it.
    let big = "b".repeat(1025);
    let answer = send(&client, &url, Some("big-1"), "acme", &big).await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.problem_type(), "urn:idempotent:body-too-large");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big.txt");
    std::fs::write(&file, &big).unwrap();
    let chunked = curl(&[
        "-X",
        "POST",
        "-H",
        "Transfer-Encoding: chunked",
        "-H",
        "Expect:",
        "-H",
        "Idempotency-Key: big-2",
        "-H",
        "X-Tenant: acme",
        "--data-binary",
        &format!("@{}", file.display()),
        &url,
    ])
    .await;
    assert!(chunked.starts_with("HTTP/1.1 413"), "{chunked}");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(backend.charges().await, 1);
    backend.teardown().await;
}

async fn two_tenants_with_one_key_are_independent<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = common::unique("key");
    let acme = send(&client, &url, Some(&key), "acme", "same").await;
    let globex = send(&client, &url, Some(&key), "globex", "same").await;
    assert_eq!((acme.status, globex.status), (201, 201));
    assert!(!acme.replayed() && !globex.replayed());
    assert_ne!(acme.body, globex.body, "one tenant got the other's answer");
    // A tenant whose name contains the other's does not meet it either.
    let tricky = send(&client, &url, Some(&key), "acme:POST", "same").await;
    assert!(!tricky.replayed());
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    assert_eq!(backend.charges().await, 3);
    assert!(send(&client, &url, Some(&key), "acme", "same").await.replayed());
    backend.teardown().await;
}

async fn server_errors_and_not_kept_answers_are_not_stored<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    for (body, status) in [("fail", 500), ("not-kept", 429)] {
        let key = common::unique("key");
        let before = ran.load(Ordering::SeqCst);
        for _ in 0..2 {
            let answer = send(&client, &url, Some(&key), "acme", body).await;
            assert_eq!(answer.status, status);
            assert!(!answer.replayed());
        }
        assert_eq!(
            ran.load(Ordering::SeqCst),
            before + 2,
            "{body}: the retry did not run again"
        );
    }
    // The handler inserted before failing: rolled back with the claim.
    assert_eq!(backend.charges().await, 0);
    backend.teardown().await;
}

async fn a_streaming_answer_is_refused_not_truncated<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = common::unique("key");
    for _ in 0..2 {
        let answer = send(&client, &url, Some(&key), "acme", "stream").await;
        assert_eq!(answer.status, 500);
        assert_eq!(answer.problem_type(), "urn:idempotent:not-replayable");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(backend.charges().await, 0);
    backend.teardown().await;
}

async fn a_replay_is_the_first_answer_byte_for_byte<B: Backend>() {
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let base = serve(&backend, app, InProgress::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = common::unique("key");
    let first = send(&client, &url, Some(&key), "acme", "replay me").await;
    assert_eq!(first.status, 201);
    assert!(first.body.ends_with(&[0x00, 0xff, 0xfe, b'\n']));
    let replay = send(&client, &url, Some(&format!("\"{key}\"")), "acme", "replay me").await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    for name in ["x-charge-run", "content-type", "content-length"] {
        assert_eq!(replay.headers[name], first.headers[name], "{name}");
    }
    assert!(first.headers.get("set-cookie").is_some());
    assert!(
        replay.headers.get("set-cookie").is_none(),
        "a cookie was handed out again"
    );
    // curl, another client, gets the same bytes.
    let dir = tempfile::tempdir().unwrap();
    let body_file = dir.path().join("body");
    let head = curl(&[
        "-X",
        "POST",
        "-H",
        &format!("Idempotency-Key: {key}"),
        "-H",
        "X-Tenant: acme",
        "--data-binary",
        "replay me",
        "-o",
        &body_file.display().to_string(),
        &url,
    ])
    .await;
    assert!(head.starts_with("HTTP/1.1 201"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("idempotent-replayed: true"),
        "{head}"
    );
    assert_eq!(std::fs::read(&body_file).unwrap(), first.body);
    backend.teardown().await;
}

/// Runs curl with `args`; its response headers (`-D -`, and the body too
/// unless `-o` sends it elsewhere).
async fn curl(args: &[&str]) -> String {
    let output = tokio::process::Command::new("curl")
        .args(["-sS", "-D", "-", "--max-time", "30"])
        .args(args)
        .output()
        .await
        .expect("curl");
    assert!(
        output.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

macro_rules! http_suite {
    ($name:ident, $backend:ty) => {
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_requests_with_one_key_run_the_body_once() {
                super::concurrent_requests_with_one_key_run_the_body_once::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn waiting_retries_get_the_first_answer() {
                super::waiting_retries_get_the_first_answer::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_different_request_with_a_used_key_is_422() {
                super::a_different_request_with_a_used_key_is_422::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn missing_keys_and_callers_are_400() {
                super::missing_keys_and_callers_are_400::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn hostile_keys_and_bodies_are_refused() {
                super::hostile_keys_and_bodies_are_refused::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_tenants_with_one_key_are_independent() {
                super::two_tenants_with_one_key_are_independent::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn server_errors_and_not_kept_answers_are_not_stored() {
                super::server_errors_and_not_kept_answers_are_not_stored::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_streaming_answer_is_refused_not_truncated() {
                super::a_streaming_answer_is_refused_not_truncated::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replay_is_the_first_answer_byte_for_byte() {
                super::a_replay_is_the_first_answer_byte_for_byte::<$backend>().await
            }
        }
    };
}

http_suite!(sqlite, Lite);
http_suite!(postgres, Pg);
http_suite!(mariadb, My);

// ---- a lease store ---------------------------------------------------------------

/// On a lease store the handler takes no transaction; concurrent retries
/// still run the body once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_concurrent_requests_run_the_body_once() {
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&ran);
    let router = Router::new()
        .route(
            "/charges",
            post(move |body: Bytes| {
                let counter = Arc::clone(&counter);
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    (StatusCode::CREATED, body)
                }
            }),
        )
        .route_layer(layer(MemoryStore::new(), InProgress::default()));
    let base = listen(router).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let answers =
        futures_util::future::join_all((0..50).map(|_| send(&client, &url, Some("m-1"), "acme", "lease"))).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert!(answers.iter().all(|a| a.status == 201 || a.status == 409));
    let retry = send(&client, &url, Some("m-1"), "acme", "lease").await;
    assert!(retry.replayed());
    assert_eq!(retry.body, b"lease");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}
