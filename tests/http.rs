//! The `Idempotency-Key` layer (feature `axum`, `idempotent_runtime::http`)
//! behind a real axum server on 127.0.0.1, called by real clients (`reqwest`
//! and `curl`): on SQLite, PostgreSQL (plain, partitioned, and behind a
//! `CachedStore`) and MariaDB, where the handler's insert commits with the
//! kept answer; on the lease stores (Redis, memory); with the janitor; and
//! its outcomes counted as messages' are.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::http::{Backend, CachedPg, Lite, My, Pg, PgPartitioned, PgPartitionedBySecond, caller, listen, tenant};
use idempotent_runtime::axum::Router;
use idempotent_runtime::axum::body::{Body, Bytes};
use idempotent_runtime::axum::extract::{Path, State};
use idempotent_runtime::axum::handler::Handler;
use idempotent_runtime::axum::http::{HeaderMap, StatusCode, Uri};
use idempotent_runtime::axum::response::{IntoResponse, Response};
use idempotent_runtime::axum::routing::post;
use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx, InProgress, NotKept};
use idempotent_runtime::store::{PurgeExpired, Store};
use idempotent_runtime::{Janitor, MemoryStore, RedisStore};

// ---- the server ----------------------------------------------------------------

#[derive(Clone)]
struct App {
    table: Arc<str>,
    /// How many times a handler's body ran.
    ran: Arc<AtomicUsize>,
    /// How long the charge handler takes (so that retries overlap it).
    delay: Duration,
    /// What a `hold` request waits for after its insert.
    gate: Arc<tokio::sync::Notify>,
}

/// Charges: inserts a row in the claim's transaction, then answers by the
/// body's words: `fail` 500, `not-kept` 429 marked [`NotKept`], `stream` a
/// body of unknown length; otherwise 201 with headers and a body that is
/// not UTF-8. `hold` waits for the app's gate after the insert; `abort`
/// runs a statement that fails (which aborts a PostgreSQL transaction) and
/// answers 201 all the same.
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
    if text.contains("hold") {
        app.gate.notified().await;
    }
    if text.contains("abort") {
        let refused = B::insert(&mut tx, "no_such_table", "", "").await;
        assert!(refused.is_err());
    }
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

fn layer<S: Store + 'static>(store: S, policy: InProgress) -> IdempotencyLayer<S> {
    IdempotencyLayer::builder(store)
        .caller(caller)
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
            .caller(caller)
            .build(),
    );
    listen(required.merge(optional).with_state(app)).await
}

fn app(table: &str, delay: Duration) -> App {
    App {
        table: Arc::from(table),
        ran: Arc::default(),
        delay,
        gate: Arc::default(),
    }
}

/// A backend behind [`serve`]'s routes, and a client.
struct Served<B> {
    backend: B,
    /// How many times a handler's body ran.
    ran: Arc<AtomicUsize>,
    /// What a `hold` request waits for after its insert.
    gate: Arc<tokio::sync::Notify>,
    client: reqwest::Client,
    /// The server's base URL.
    base: String,
    /// Its `/charges`.
    url: String,
}

/// A `B` set up and served, its charge handler taking `delay`, the layer
/// answering retries in progress by `policy`.
async fn served<B: Backend>(delay: Duration, policy: InProgress) -> Served<B> {
    let backend = B::setup().await;
    let app = app(backend.table(), delay);
    let (ran, gate) = (Arc::clone(&app.ran), Arc::clone(&app.gate));
    let base = serve(&backend, app, policy).await;
    Served {
        backend,
        ran,
        gate,
        client: reqwest::Client::new(),
        url: format!("{base}/charges"),
        base,
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
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::from_millis(300), InProgress::default()).await;
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
    let policy = InProgress::Wait {
        timeout: Duration::from_secs(30),
    };
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::from_millis(200), policy).await;
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
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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

/// The fingerprint is over the body's raw bytes (docs/http.md): the same
/// JSON with its keys reordered, or with other white space, is another
/// request (`422`); only the byte-identical retry is the replay.
async fn a_reordered_json_body_is_another_request_not_a_replay<B: Backend>() {
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
    let key = common::unique("key");
    let sent = r#"{"order":"A-1","amount":42}"#;
    let first = send(&client, &url, Some(&key), "acme", sent).await;
    assert_eq!((first.status, first.replayed()), (201, false));
    for other in [r#"{"amount":42,"order":"A-1"}"#, r#"{"order": "A-1", "amount": 42}"#] {
        let same: serde_json::Value = serde_json::from_str(other).unwrap();
        assert_eq!(same, serde_json::from_str::<serde_json::Value>(sent).unwrap());
        let answer = send(&client, &url, Some(&key), "acme", other).await;
        assert_eq!(answer.status, 422, "{other}: {}", String::from_utf8_lossy(&answer.body));
        assert_eq!(answer.problem_type(), "urn:idempotent:key-reused", "{other}");
    }
    let again = send(&client, &url, Some(&key), "acme", sent).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, first.body, "the replay is the first answer");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(backend.charges().await, 1);
    backend.teardown().await;
}

async fn missing_keys_and_callers_are_400<B: Backend>() {
    let Served {
        backend,
        ran,
        client,
        base,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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
    let Served {
        backend, client, url, ..
    } = served::<B>(Duration::ZERO, InProgress::default()).await;
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
            async fn a_reordered_json_body_is_another_request_not_a_replay() {
                super::a_reordered_json_body_is_another_request_not_a_replay::<$backend>().await
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
http_suite!(postgres_partitioned, PgPartitioned);
http_suite!(postgres_cached, CachedPg);

// ---- the janitor -----------------------------------------------------------------

/// A key's marker lives the layer's `ttl`; the janitor purges it once
/// expired, and the next request with the key runs again (a new charge,
/// not a replay).
async fn the_janitor_purges_expired_keys_and_the_next_request_runs_again<B: Backend>()
where
    B::S: PurgeExpired,
{
    let backend = B::setup().await;
    let app = app(backend.table(), Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let ttl = Duration::from_secs(2);
    let router = Router::new()
        .route("/charges", post(charge::<B>))
        .route_layer(
            IdempotencyLayer::builder(backend.store())
                .caller(caller)
                .ttl(ttl)
                .build(),
        )
        .with_state(app);
    let base = listen(router).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/charges");
    let key = common::unique("key");
    let first = send(&client, &url, Some(&key), "acme", "expiring").await;
    assert_eq!(first.status, 201);
    assert!(send(&client, &url, Some(&key), "acme", "expiring").await.replayed());
    assert_eq!(backend.markers().await, 1);
    let janitor = Janitor::spawn(backend.store(), Duration::from_millis(200)).unwrap();
    let deadline = tokio::time::Instant::now() + ttl + Duration::from_secs(20);
    while backend.markers().await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the expired key was not purged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    janitor.shutdown().await;
    let again = send(&client, &url, Some(&key), "acme", "expiring").await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed(), "an expired, purged key was replayed");
    assert_ne!(again.body, first.body);
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(backend.charges().await, 2);
    assert_eq!(backend.markers().await, 1);
    backend.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_janitor_purges_expired_keys_and_the_next_request_runs_again() {
    the_janitor_purges_expired_keys_and_the_next_request_runs_again::<Lite>().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_janitor_purges_expired_keys_and_the_next_request_runs_again() {
    the_janitor_purges_expired_keys_and_the_next_request_runs_again::<Pg>().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_the_janitor_purges_expired_keys_and_the_next_request_runs_again() {
    the_janitor_purges_expired_keys_and_the_next_request_runs_again::<My>().await
}

/// On the partitioned layout the janitor drops the expired key's partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_partitioned_the_janitor_drops_expired_keys_and_the_next_request_runs_again() {
    the_janitor_purges_expired_keys_and_the_next_request_runs_again::<PgPartitionedBySecond>().await
}

// ---- a cache in front of PostgreSQL --------------------------------------------------

/// `CachedStore` learns a key only from a commit: answers that were rolled
/// back (a 5xx, a transaction that PostgreSQL aborted under an answer the
/// handler meant to keep) leave nothing in the cache, so the retry runs
/// again instead of being answered from memory; the committed answer is
/// then replayed from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cached_a_rolled_back_key_is_never_answered_from_the_cache() {
    let Served {
        backend,
        ran,
        client,
        url,
        ..
    } = served::<CachedPg>(Duration::ZERO, InProgress::default()).await;
    let store = backend.store();
    let key = common::unique("key");
    let failed = send(&client, &url, Some(&key), "acme", "fail").await;
    assert_eq!(failed.status, 500);
    let aborted = send(&client, &url, Some(&key), "acme", "abort").await;
    assert_eq!(aborted.status, 503, "{}", String::from_utf8_lossy(&aborted.body));
    assert_eq!(aborted.problem_type(), "urn:idempotent:store-failed");
    assert!(store.is_empty(), "a rolled-back key is in the cache");
    assert_eq!(store.stats().inserts, 0);
    assert_eq!(backend.charges().await, 0);
    // The retry (another body is allowed: nothing was kept) runs.
    let first = send(&client, &url, Some(&key), "acme", "charge").await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    assert_eq!(store.stats().hits, 0);
    assert_eq!(store.len(), 1);
    // Its replay comes from the cache, without asking PostgreSQL.
    let replay = send(&client, &url, Some(&key), "acme", "charge").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(store.stats().hits, 1);
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    assert_eq!((backend.charges().await, backend.markers().await), (1, 1));
    backend.teardown().await;
}

// ---- metrics ------------------------------------------------------------------------

/// The layer counts outcomes through the code that counts messages':
/// `idempotent_outcomes_total{scope = "http:POST:/charges", outcome}`. A
/// fresh request is counted once, after its commit (not while its handler
/// runs); a retry while it runs is `in_progress`, after it a `duplicate`;
/// a rolled-back answer is `failed` (a 5xx) or `error` (PostgreSQL aborted
/// the transaction), never `processed`.
#[test]
fn outcomes_are_counted_like_messages_after_the_commit() {
    let counters = common::counters::Counters::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let count = |outcome: &str| {
        counters.get(&format!(
            "idempotent_outcomes_total{{outcome={outcome},scope=http:POST:/charges}}"
        ))
    };
    metrics::with_local_recorder(&counters, || {
        runtime.block_on(async {
            let Served {
                backend,
                ran,
                gate,
                client,
                url,
                ..
            } = served::<Pg>(Duration::ZERO, InProgress::default()).await;
            let key = common::unique("key");
            let first = tokio::spawn({
                let (client, url, key) = (client.clone(), url.clone(), key.clone());
                async move { send(&client, &url, Some(&key), "acme", "hold").await }
            });
            while ran.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The handler inserted; nothing is committed, nothing counted.
            assert_eq!(count("processed"), 0);
            let busy = send(&client, &url, Some(&key), "acme", "hold").await;
            assert_eq!(busy.status, 409);
            assert_eq!(count("in_progress"), 1);
            assert_eq!(count("processed"), 0);
            gate.notify_one();
            assert_eq!(first.await.unwrap().status, 201);
            assert_eq!(count("processed"), 1);
            assert!(send(&client, &url, Some(&key), "acme", "hold").await.replayed());
            assert_eq!(count("duplicate"), 1);
            let failed = send(&client, &url, Some(&common::unique("key")), "acme", "fail").await;
            assert_eq!(failed.status, 500);
            assert_eq!(count("failed"), 1);
            let aborted = send(&client, &url, Some(&common::unique("key")), "acme", "abort").await;
            assert_eq!(aborted.status, 503);
            assert_eq!(count("error"), 1);
            assert_eq!(send(&client, &url, Some(&key), "acme", "other").await.status, 422);
            assert_eq!(count("key_reused"), 1);
            assert_eq!(send(&client, &url, None, "acme", "x").await.status, 400);
            assert_eq!(count("error"), 2, "a missing key is refused as a message's is");
            assert_eq!(count("processed"), 1);
            assert_eq!(backend.charges().await, 1);
            backend.teardown().await;
        })
    });
}

// ---- the lease stores (Redis, memory) ----------------------------------------------

#[derive(Clone)]
struct Lease {
    /// How many times the handler's body ran.
    ran: Arc<AtomicUsize>,
    /// How long it takes.
    delay: Duration,
}

/// An effect outside any transaction (a lease store's handler): `fail`
/// answers 500; otherwise 201 with the run's number and bytes that are not
/// UTF-8.
async fn effect(State(app): State<Lease>, body: Bytes) -> Response {
    let run = app.ran.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(app.delay).await;
    if &body[..] == b"fail" {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the effect failed").into_response();
    }
    let mut answer = format!("effect of run {run} ").into_bytes();
    answer.extend_from_slice(&[0x00, 0xff]);
    (StatusCode::CREATED, [("x-run", run.to_string())], answer).into_response()
}

/// `/effects` behind a layer on `store` with `lease`, served; its URL.
async fn lease_server<S: Store<Guard: 'static> + 'static>(store: S, lease: Duration, app: Lease) -> String {
    let layer = IdempotencyLayer::builder(store).caller(caller).lease(lease).build();
    let router = Router::new()
        .route("/effects", post(effect))
        .route_layer(layer)
        .with_state(app);
    format!("{}/effects", listen(router).await)
}

fn lease_app(delay: Duration) -> Lease {
    Lease {
        ran: Arc::default(),
        delay,
    }
}

/// 50 concurrent requests with one key: the body runs once, every answer
/// is its answer, its replay or `409`.
async fn lease_concurrent_requests_run_the_body_once<S: Store<Guard: 'static> + 'static>(store: S) {
    let app = lease_app(Duration::from_millis(300));
    let ran = Arc::clone(&app.ran);
    let url = lease_server(store, idempotent_runtime::DEFAULT_LEASE, app).await;
    let client = reqwest::Client::new();
    let key = common::unique("key");
    let answers =
        futures_util::future::join_all((0..50).map(|_| send(&client, &url, Some(&key), "acme", "lease"))).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    let first: Vec<_> = answers.iter().filter(|a| a.status == 201 && !a.replayed()).collect();
    assert_eq!(first.len(), 1);
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, first[0].body),
            409 => assert_eq!(answer.problem_type(), "urn:idempotent:in-progress"),
            other => panic!("unexpected status {other}"),
        }
    }
    let retry = send(&client, &url, Some(&key), "acme", "lease").await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first[0].body);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// A retry gets the first answer byte for byte; a 5xx releases the lease,
/// so its retry runs again.
async fn lease_replays_the_first_answer_and_runs_failed_ones_again<S: Store<Guard: 'static> + 'static>(store: S) {
    let app = lease_app(Duration::ZERO);
    let ran = Arc::clone(&app.ran);
    let url = lease_server(store, idempotent_runtime::DEFAULT_LEASE, app).await;
    let client = reqwest::Client::new();
    let key = common::unique("key");
    let first = send(&client, &url, Some(&key), "acme", "pay").await;
    assert_eq!(first.status, 201);
    assert!(first.body.ends_with(&[0x00, 0xff]));
    let replay = send(&client, &url, Some(&key), "acme", "pay").await;
    assert!(replay.replayed());
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    assert_eq!(replay.headers["x-run"], first.headers["x-run"]);
    assert_eq!(send(&client, &url, Some(&key), "acme", "pay more").await.status, 422);
    let failing = common::unique("key");
    for _ in 0..2 {
        let answer = send(&client, &url, Some(&failing), "acme", "fail").await;
        assert_eq!(answer.status, 500);
        assert!(!answer.replayed());
    }
    assert_eq!(ran.load(Ordering::SeqCst), 3, "a failed answer was kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_concurrent_requests_run_the_body_once() {
    lease_concurrent_requests_run_the_body_once(MemoryStore::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_replays_the_first_answer_and_runs_failed_ones_again() {
    lease_replays_the_first_answer_and_runs_failed_ones_again(MemoryStore::new()).await
}

/// A `RedisStore` under a prefix of the test's own, and its connection.
async fn redis_store(renew: bool) -> (RedisStore, idempotent_runtime::redis::aio::ConnectionManager, String) {
    let client = idempotent_runtime::redis::Client::open(common::REDIS_URL).unwrap();
    let conn = client.get_connection_manager().await.expect("Redis at 127.0.0.1:6379");
    let prefix = format!("{}:", common::unique("http"));
    let store = RedisStore::builder(conn.clone())
        .prefix(prefix.clone())
        .renew(renew)
        .build()
        .unwrap();
    (store, conn, prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store_concurrent_requests_run_the_body_once() {
    let (store, mut conn, prefix) = redis_store(true).await;
    lease_concurrent_requests_run_the_body_once(store).await;
    common::delete_redis_prefix(&mut conn, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_replays_the_first_answer_and_runs_failed_ones_again() {
    let (store, mut conn, prefix) = redis_store(true).await;
    lease_replays_the_first_answer_and_runs_failed_ones_again(store).await;
    common::delete_redis_prefix(&mut conn, &prefix).await;
}

/// Two replicas (two layers, so that one's in-process registry does not
/// answer for the other) on one Redis, with a 1 s lease: the first request
/// goes to replica one, whose handler takes 2.5 s; 1.6 s later its retry
/// goes to replica two, whose handler is quick. The answers of both, how
/// many times the body ran, and a retry on replica two afterwards.
async fn a_slow_request_and_its_retry_on_another_replica(renew: bool) -> (Answer, Answer, usize, Answer) {
    let (store, mut conn, prefix) = redis_store(renew).await;
    let slow = lease_app(Duration::from_millis(2500));
    let ran = Arc::clone(&slow.ran);
    let quick = Lease {
        ran: Arc::clone(&ran),
        delay: Duration::ZERO,
    };
    let lease = Duration::from_secs(1);
    let one = lease_server(store.clone(), lease, slow).await;
    let two = lease_server(store, lease, quick).await;
    let client = reqwest::Client::new();
    let key = common::unique("key");
    let first = tokio::spawn({
        let (client, key) = (client.clone(), key.clone());
        async move { send(&client, &one, Some(&key), "acme", "slow").await }
    });
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retry = send(&client, &two, Some(&key), "acme", "slow").await;
    let first = first.await.unwrap();
    let later = send(&client, &two, Some(&key), "acme", "slow").await;
    common::delete_redis_prefix(&mut conn, &prefix).await;
    (first, retry, ran.load(Ordering::SeqCst), later)
}

/// A handler slower than its lease keeps the key, because the lease is
/// renewed while it runs: the other replica's retry is `409` from the
/// store, then a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store_renews_the_lease_of_a_slow_handler_for_the_other_replicas() {
    let (first, retry, ran, later) = a_slow_request_and_its_retry_on_another_replica(true).await;
    assert_eq!(retry.status, 409, "the lease was not renewed");
    assert_eq!(retry.problem_type(), "urn:idempotent:in-progress");
    assert_eq!(first.status, 201);
    assert!(later.replayed());
    assert_eq!(later.body, first.body);
    assert_eq!(ran, 1);
}

/// What a lease does not cover (docs/http.md): without renewal, a handler
/// that outlives its lease loses the key; the other replica's retry runs
/// the effect a second time, and the first request's completion is fenced
/// off (its token no longer matches), so it answers `503` although its
/// effect happened. The key then replays the second run's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store_without_renewal_an_expired_lease_runs_the_retry_again_and_fences_the_first() {
    let (first, retry, ran, later) = a_slow_request_and_its_retry_on_another_replica(false).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(first.status, 503);
    assert_eq!(first.problem_type(), "urn:idempotent:store-failed");
    assert_eq!(ran, 2, "the effect ran twice: not covered by a lease");
    assert!(later.replayed());
    assert_eq!(later.body, retry.body);
}

// ---- the resource a key answers for ------------------------------------------------

/// What the account routes ran: the account of each withdrawal (or the
/// path a fallback saw).
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Vec<String>>>);

impl Ledger {
    fn runs(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// `POST .../accounts/{account}/withdraw`: withdraws the body's amount.
async fn withdraw(State(ledger): State<Ledger>, Path(account): Path<String>, body: String) -> (StatusCode, String) {
    ledger.0.lock().unwrap().push(account.clone());
    (StatusCode::CREATED, format!("withdrew {body} from {account}"))
}

/// A fallback that withdraws too (it sees the path its router was given,
/// and numbers its runs).
async fn withdraw_anywhere(State(ledger): State<Ledger>, uri: Uri, body: String) -> (StatusCode, String) {
    let run = {
        let mut runs = ledger.0.lock().unwrap();
        runs.push(uri.path().to_owned());
        runs.len()
    };
    (
        StatusCode::CREATED,
        format!("withdrew {body} at {} (run {run})", uri.path()),
    )
}

/// The layouts of `/accounts/{account}/withdraw` a service is written in:
/// nested routers with the layer inside (`route_layer`, `layer`, on the
/// method router) or around the nest, a path parameter, a nested router's
/// fallback and the top router's fallback.
fn account_layouts<S: Store<Guard: 'static> + 'static>(
    layer: &IdempotencyLayer<S>,
    ledger: &Ledger,
) -> Vec<(&'static str, Router)> {
    let nest = |inner: Router<Ledger>| {
        Router::new()
            .nest("/accounts/{account}", inner)
            .with_state(ledger.clone())
    };
    vec![
        (
            "nested, route_layer",
            nest(
                Router::new()
                    .route("/withdraw", post(withdraw))
                    .route_layer(layer.clone()),
            ),
        ),
        (
            "nested, layer",
            nest(Router::new().route("/withdraw", post(withdraw)).layer(layer.clone())),
        ),
        (
            "nested, on the method router",
            nest(Router::new().route("/withdraw", post(withdraw).layer(layer.clone()))),
        ),
        (
            "layer around the nest",
            Router::new()
                .nest("/accounts/{account}", Router::new().route("/withdraw", post(withdraw)))
                .layer(layer.clone())
                .with_state(ledger.clone()),
        ),
        (
            "path parameter",
            Router::new()
                .route("/accounts/{account}/withdraw", post(withdraw))
                .route_layer(layer.clone())
                .with_state(ledger.clone()),
        ),
        (
            "nested fallback",
            nest(Router::new().fallback(withdraw_anywhere).layer(layer.clone())),
        ),
        (
            "fallback",
            Router::new()
                .route("/health", post(|| async { "ok" }))
                .fallback(withdraw_anywhere)
                .layer(layer.clone())
                .with_state(ledger.clone()),
        ),
    ]
}

/// A key is answered for the resource the client named (the path it
/// sent, whatever routers nest it): Alice's withdrawal is never replayed
/// to Bob's request with the same key and body. Under a matched route
/// (whose pattern is the same for both) Bob's request is `422` and runs
/// nothing; in a fallback, where the path stands for the route, Bob's key
/// is his own and runs. Alice's retry is her replay; Bob with a key of his
/// own runs.
async fn a_key_is_never_replayed_to_another_resource<S: Store<Guard: 'static> + Clone + 'static>(store: S) {
    let layer = IdempotencyLayer::new(store);
    let ledger = Ledger::default();
    let client = reqwest::Client::new();
    for (layout, router) in account_layouts(&layer, &ledger) {
        let fallback = layout.contains("fallback");
        let base = listen(router).await;
        let alice = format!("{base}/accounts/alice/withdraw");
        let bob = format!("{base}/accounts/bob/withdraw");
        let key = common::unique("key");
        let before = ledger.runs().len();
        let first = send(&client, &alice, Some(&key), "", "100").await;
        assert_eq!((first.status, first.replayed()), (201, false), "{layout}");
        if !fallback {
            assert_eq!(
                String::from_utf8_lossy(&first.body),
                "withdrew 100 from alice",
                "{layout}"
            );
        }
        let other = send(&client, &bob, Some(&key), "", "100").await;
        let what = format!(
            "{layout}: Bob's request with Alice's key got {} {:?} (replayed: {})",
            other.status,
            String::from_utf8_lossy(&other.body),
            other.replayed()
        );
        assert!(!other.replayed() && other.body != first.body, "{what}");
        if fallback {
            assert_eq!(other.status, 201, "{what}");
            assert_eq!(ledger.runs().len(), before + 2, "{what}");
        } else {
            assert_eq!(other.status, 422, "{what}");
            assert_eq!(other.problem_type(), "urn:idempotent:key-reused", "{layout}");
            assert_eq!(ledger.runs().len(), before + 1, "{what}: Bob's withdrawal ran");
        }
        let runs = ledger.runs().len();
        // Another query is another request for the resource: `422`.
        let query = send(&client, &format!("{alice}?to=bob"), Some(&key), "", "100").await;
        assert_eq!(query.status, 422, "{layout}");
        let retry = send(&client, &alice, Some(&key), "", "100").await;
        assert_eq!((retry.status, retry.replayed()), (201, true), "{layout}");
        assert_eq!(retry.body, first.body, "{layout}");
        let own = send(&client, &bob, Some(&common::unique("key")), "", "100").await;
        assert_eq!((own.status, own.replayed()), (201, false), "{layout}");
        if !fallback {
            assert_eq!(String::from_utf8_lossy(&own.body), "withdrew 100 from bob", "{layout}");
        }
        assert_eq!(ledger.runs().len(), runs + 1, "{layout}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_a_key_is_never_replayed_to_another_resource() {
    a_key_is_never_replayed_to_another_resource(MemoryStore::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_key_is_never_replayed_to_another_resource() {
    let backend = Lite::setup().await;
    a_key_is_never_replayed_to_another_resource(backend.store()).await;
    backend.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_key_is_never_replayed_to_another_resource() {
    let backend = Pg::setup().await;
    a_key_is_never_replayed_to_another_resource(backend.store()).await;
    backend.teardown().await;
}

// ---- metric labels ---------------------------------------------------------------------

/// With the layer on the whole router (`Router::layer`), requests no route
/// matched reach it through the fallback: their paths are the client's to
/// choose and never become a `scope` label. 40 random paths, with and
/// without a key, make one series per outcome, `http:POST:<unmatched>`;
/// 10 made-up methods on a route one, `http:_OTHER:/charges`.
#[test]
fn unmatched_paths_and_unknown_methods_never_become_metric_labels() {
    let counters = common::counters::Counters::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&counters, || {
        runtime.block_on(async {
            let router = Router::new()
                .route("/charges", post(|| async { (StatusCode::CREATED, "charged") }))
                .layer(IdempotencyLayer::new(MemoryStore::new()));
            let base = listen(router).await;
            let client = reqwest::Client::new();
            let mut probes = Vec::new();
            for _ in 0..40 {
                let probe = common::unique("probe");
                let url = format!("{base}/{probe}/x");
                assert_eq!(send(&client, &url, None, "", "x").await.status, 400, "{url}");
                assert_eq!(
                    send(&client, &url, Some(&common::unique("key")), "", "x").await.status,
                    404,
                    "{url}"
                );
                probes.push(probe);
            }
            let charged = send(&client, &format!("{base}/charges"), Some("k"), "", "x").await;
            assert_eq!(charged.status, 201);
            for _ in 0..10 {
                let probe = common::unique("PROBE").replace('_', "-");
                let method = reqwest::Method::from_bytes(probe.as_bytes()).unwrap();
                let answer = client
                    .request(method, format!("{base}/charges"))
                    .header("idempotency-key", common::unique("key"))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(answer.status(), 405, "{probe}");
                probes.push(probe);
            }
            let series: Vec<String> = counters
                .0
                .lock()
                .unwrap()
                .keys()
                .filter(|name| name.starts_with("idempotent_outcomes_total{"))
                .cloned()
                .collect();
            let mut scopes: Vec<&str> = series
                .iter()
                .filter_map(|name| name.split("scope=").nth(1))
                .map(|scope| scope.trim_end_matches('}'))
                .collect();
            scopes.sort();
            scopes.dedup();
            assert_eq!(
                scopes,
                ["http:POST:/charges", "http:POST:<unmatched>", "http:_OTHER:/charges"],
                "{} series: {series:?}",
                series.len()
            );
            assert!(
                !series
                    .iter()
                    .any(|name| probes.iter().any(|probe| name.contains(probe.as_str()))),
                "a path became a label: {series:?}"
            );
            let count = |outcome: &str| {
                counters.get(&format!(
                    "idempotent_outcomes_total{{outcome={outcome},scope=http:POST:<unmatched>}}"
                ))
            };
            assert_eq!(count("error"), 40, "the 400s of missing keys");
            assert_eq!(count("processed"), 40, "the fallback's 404s, kept");
        })
    });
}

// ---- the in-flight registry ------------------------------------------------------------

/// The handler of the registry's tests: `hold` waits for a permit of the
/// gate; `fail` answers 500 (not kept, so the key's waiter runs next).
#[derive(Clone)]
struct Gated {
    ran: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
}

async fn gated(State(app): State<Gated>, body: Bytes) -> Response {
    app.ran.fetch_add(1, Ordering::SeqCst);
    if body.windows(4).any(|w| w == b"hold") {
        app.gate.acquire().await.unwrap().forget();
    }
    if body.windows(4).any(|w| w == b"fail") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "failed").into_response();
    }
    (StatusCode::CREATED, "done").into_response()
}

/// Where a waiting request's client goes away.
#[derive(Clone, Copy, Debug)]
enum DroppedWhile {
    /// It waits for the first request with its key.
    Waiting,
    /// The first ended and handed it the key; it was not polled since.
    Woken,
    /// It claimed the key after the first failed, and its handler runs.
    Running,
}

/// Rounds of: a request with a fresh key holds it in its handler; a second
/// with the key waits for it (`InProgress::Wait`); the second's future is
/// dropped at `point`. Afterwards the layer's registry holds no key.
async fn dropped_waiters_leave_no_in_flight_key(point: DroppedWhile) {
    const ROUNDS: usize = 3000;
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .in_progress(InProgress::Wait {
            timeout: Duration::from_secs(30),
        })
        .build();
    let app = Gated {
        ran: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let service = gated.layer(layer.clone());
    let call = |key: &str, body: &'static str| {
        let request = idempotent_runtime::axum::http::Request::post("/gated")
            .header("idempotency-key", key)
            .body(Body::from(body))
            .unwrap();
        Box::pin(Handler::call(service.clone(), request, app.clone()))
    };
    // Polls `future` (which must not end) until the handler has run `runs` times.
    async fn until_ran<F: Future + Unpin>(future: &mut F, ran: &AtomicUsize, runs: usize) {
        while ran.load(Ordering::SeqCst) < runs {
            assert!(futures_util::poll!(&mut *future).is_pending());
            tokio::task::yield_now().await;
        }
    }
    for round in 0..ROUNDS {
        let key = format!("round-{round}");
        let first_body = if matches!(point, DroppedWhile::Running) {
            "hold fail"
        } else {
            "hold"
        };
        let tracked = layer.in_flight_keys();
        let mut first = call(&key, first_body);
        let runs = app.ran.load(Ordering::SeqCst);
        until_ran(&mut first, &app.ran, runs + 1).await;
        let mut waiter = call(&key, "hold");
        assert!(futures_util::poll!(&mut waiter).is_pending());
        assert_eq!(layer.in_flight_keys(), tracked + 1, "round {round}: the key is held");
        match point {
            DroppedWhile::Waiting => {
                drop(waiter);
                app.gate.add_permits(1);
                assert_eq!(first.await.status(), 201);
            }
            DroppedWhile::Woken => {
                app.gate.add_permits(1);
                assert_eq!(first.await.status(), 201);
                drop(waiter);
            }
            DroppedWhile::Running => {
                app.gate.add_permits(1);
                assert_eq!(first.await.status(), 500);
                until_ran(&mut waiter, &app.ran, runs + 2).await;
                drop(waiter);
            }
        }
    }
    assert_eq!(
        layer.in_flight_keys(),
        0,
        "{point:?}: {ROUNDS} dropped waiters left keys in the registry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_while_waiting_leaves_no_in_flight_key() {
    dropped_waiters_leave_no_in_flight_key(DroppedWhile::Waiting).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_after_being_woken_leaves_no_in_flight_key() {
    dropped_waiters_leave_no_in_flight_key(DroppedWhile::Woken).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_while_running_leaves_no_in_flight_key() {
    dropped_waiters_leave_no_in_flight_key(DroppedWhile::Running).await
}
