//! An HTTP handler behind the `Idempotency-Key` layer that stages outgoing
//! messages in the outbox (`IdempotentTx::publish`), with a real relay to
//! the machine's RabbitMQ: each key's messages are delivered once by their
//! id, when the request is retried (a replay stages nothing), when 24
//! concurrent retries of one key race, when the handler fails after
//! staging (`5xx`, `NotKept`: nothing staged survives, the retry stages
//! once), when the outbox refuses a message (`500`, nothing committed), and
//! when the server process is SIGKILLed in the middle of a request and the
//! client retries. On PostgreSQL (plain and behind a `CachedStore`),
//! MariaDB and SQLite; the SIGKILL on PostgreSQL.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::http::{Backend, CachedPg, Lite, My, Pg, caller, tenant};
use idempotent_runtime::PgStore;
use idempotent_runtime::axum::extract::State;
use idempotent_runtime::axum::http::{HeaderMap, StatusCode};
use idempotent_runtime::axum::response::{IntoResponse, Response};
use idempotent_runtime::axum::routing::post;
use idempotent_runtime::axum::{self, Router};
use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx, InProgress, NotKept};
use idempotent_runtime::lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use idempotent_runtime::lapin::types::FieldTable;
use idempotent_runtime::lapin::{Channel, Connection, ConnectionProperties};
use idempotent_runtime::outbox::{OutboxStore, Outgoing, RabbitPublisher, Relay};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

// ---- the broker ------------------------------------------------------------------

/// A queue of its own on the machine's RabbitMQ, the relay's destination
/// (the default exchange routes by the queue's name).
struct Queue {
    conn: Connection,
    channel: Channel,
    name: String,
}

impl Queue {
    async fn new() -> Queue {
        let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
            .await
            .expect("RabbitMQ at 127.0.0.1:5672");
        let channel = conn.create_channel().await.unwrap();
        let name = common::unique("http_outbox");
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Queue { conn, channel, name }
    }

    /// Everything delivered so far: (message id, payload).
    async fn take(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(self.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let id = m
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            out.push((id, String::from_utf8_lossy(&m.delivery.data).into_owned()));
        }
        out
    }

    async fn delete(self) {
        let _ = self
            .channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self.conn.close(200, "done".into()).await;
    }
}

/// Waits until the store's outbox has nothing pending (the relay published
/// and marked every committed row), then takes what the queue holds.
async fn delivered<S: OutboxStore>(store: &S, queue: &Queue) -> Vec<(String, String)> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let (pending, _) = store.pending().await.unwrap();
        if pending == 0 {
            break;
        }
        assert!(Instant::now() < until, "{pending} outbox rows still pending after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    queue.take().await
}

/// Each payload's deliveries, and each message id's: every message once.
fn assert_once(messages: &[(String, String)], payloads: &[&str]) {
    let mut got: Vec<&str> = messages.iter().map(|(_, p)| p.as_str()).collect();
    got.sort_unstable();
    let mut want = payloads.to_vec();
    want.sort_unstable();
    assert_eq!(got, want, "the messages delivered: {messages:?}");
    let mut ids: Vec<&str> = messages.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    let before = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), before, "a message id delivered twice: {messages:?}");
    assert!(ids.iter().all(|id| !id.is_empty()), "{messages:?}");
}

// ---- the server --------------------------------------------------------------

#[derive(Clone)]
struct App {
    table: Arc<str>,
    destination: Arc<str>,
    /// How many times the handler's body ran.
    ran: Arc<AtomicUsize>,
    /// Requests whose body says `fail` / `not-kept` fail (after staging)
    /// while this is above zero.
    failures: Arc<AtomicUsize>,
    /// How long a body that says `slow` takes after staging.
    slow: Duration,
}

/// Charges the order (the body's first word), publishes `charged:<order>`
/// and `receipt:<order>`, then answers by the body's words: `slow` waits,
/// `fail` answers 500 and `not-kept` 429 `NotKept` (while `failures`
/// lasts), `refused` publishes a message without a destination; otherwise
/// 201 with the run's number.
async fn pay<D: Backend>(
    State(app): State<App>,
    headers: HeaderMap,
    mut tx: IdempotentTx<D::S>,
    body: String,
) -> Response {
    let run = app.ran.fetch_add(1, Ordering::SeqCst) + 1;
    let order = body.split_whitespace().next().unwrap_or("none").to_owned();
    if let Err(error) = D::insert(&mut tx, &app.table, &tenant(&headers), &order).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    tx.publish(Outgoing::new(
        &*app.destination,
        format!("charged:{order}").into_bytes(),
    ));
    tx.publish(Outgoing::new(&*app.destination, format!("receipt:{order}").into_bytes()).header("order", &order));
    assert_eq!(tx.published(), 2);
    if body.contains("refused") {
        tx.publish(Outgoing::new("", b"nowhere".to_vec()));
    }
    if body.contains("slow") {
        tokio::time::sleep(app.slow).await;
    }
    let failing = || {
        app.failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    };
    if body.contains("fail") && failing() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the charge failed after staging").into_response();
    }
    if body.contains("not-kept") && failing() {
        return (StatusCode::TOO_MANY_REQUESTS, NotKept, "later").into_response();
    }
    (StatusCode::CREATED, format!("charged {order} on run {run}")).into_response()
}

fn app(table: &str, destination: &str) -> App {
    App {
        table: Arc::from(table),
        destination: Arc::from(destination),
        ran: Arc::default(),
        failures: Arc::default(),
        slow: Duration::from_millis(300),
    }
}

fn router<D: Backend>(store: D::S, app: App) -> Router {
    Router::new()
        .route("/payments", post(pay::<D>))
        .route_layer(
            IdempotencyLayer::builder(store)
                .caller(caller)
                .in_progress(InProgress::default())
                .build(),
        )
        .with_state(app)
}

struct Answer {
    status: u16,
    replayed: bool,
    body: String,
    problem: String,
}

async fn send(client: &reqwest::Client, url: &str, key: &str, body: &str) -> Result<Answer, reqwest::Error> {
    let response = client
        .post(url)
        .header("x-tenant", "acme")
        .header("idempotency-key", format!("\"{key}\""))
        .body(body.to_owned())
        .send()
        .await?;
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = response.text().await?;
    let problem = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|doc| doc["type"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Ok(Answer {
        status,
        replayed,
        body,
        problem,
    })
}

/// Sends until the answer is not `409` (a client honouring `Retry-After`,
/// faster).
async fn send_until_done(client: &reqwest::Client, url: &str, key: &str, body: &str) -> Answer {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = send(client, url, key, body).await.unwrap();
        if answer.status != 409 {
            return answer;
        }
        assert!(Instant::now() < until, "still 409 after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Rig<D: Backend> {
    db: D,
    queue: Queue,
    relay: idempotent_runtime::outbox::RelayHandle,
    url: String,
    app: App,
    client: reqwest::Client,
}

impl<D: Backend> Rig<D> {
    async fn start() -> Rig<D> {
        let db = D::setup().await;
        let queue = Queue::new().await;
        let relay = Relay::builder(db.store(), RabbitPublisher::new(AMQP_URL))
            .poll_interval(Duration::from_millis(50))
            .spawn();
        let app = app(db.table(), &queue.name);
        let url = format!(
            "{}/payments",
            common::http::listen(router::<D>(db.store(), app.clone())).await
        );
        Rig {
            db,
            queue,
            relay,
            url,
            app,
            client: reqwest::Client::new(),
        }
    }

    async fn stop(self) {
        self.relay.shutdown().await;
        self.queue.delete().await;
        self.db.teardown().await;
    }
}

// ---- the promises --------------------------------------------------------------

/// A key's messages are staged once: its retries are replays that stage
/// nothing, and another key's messages have other ids.
async fn retries_are_replays_that_stage_nothing<D: Backend>() {
    let rig = Rig::<D>::start().await;
    let first = send(&rig.client, &rig.url, "k-1", "order-1").await.unwrap();
    assert_eq!(first.status, 201, "{}", first.body);
    assert!(!first.replayed);
    for _ in 0..3 {
        let again = send(&rig.client, &rig.url, "k-1", "order-1").await.unwrap();
        assert_eq!((again.status, again.replayed), (201, true), "{}", again.body);
        assert_eq!(again.body, first.body, "a replay is the first answer");
    }
    let other = send(&rig.client, &rig.url, "k-2", "order-2").await.unwrap();
    assert_eq!((other.status, other.replayed), (201, false));
    assert_eq!(rig.app.ran.load(Ordering::SeqCst), 2, "one run per key");
    assert_eq!(rig.db.outbox_rows().await, 4, "two messages per key, staged once");
    let messages = delivered(&rig.db.store(), &rig.queue).await;
    assert_once(
        &messages,
        &[
            "charged:order-1",
            "receipt:order-1",
            "charged:order-2",
            "receipt:order-2",
        ],
    );
    // Nothing more arrives later (the replays staged nothing).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(rig.queue.take().await.is_empty());
    assert_eq!(rig.db.charges().await, 2);
    rig.stop().await;
}

/// 24 concurrent requests with one key, each retried while it gets `409`:
/// the body runs once, every client ends with the same answer, and the
/// key's two messages are delivered once each.
async fn concurrent_retries_of_one_key_publish_once<D: Backend>() {
    let rig = Rig::<D>::start().await;
    let answers = futures_util::future::join_all(
        (0..24).map(|_| send_until_done(&rig.client, &rig.url, "race-1", "order-9 slow")),
    )
    .await;
    let first = answers.iter().find(|a| !a.replayed).expect("one first answer");
    for answer in &answers {
        assert_eq!(answer.status, 201, "{}", answer.body);
        assert_eq!(answer.body, first.body);
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1);
    assert_eq!(rig.app.ran.load(Ordering::SeqCst), 1, "the body ran once");
    assert_eq!(rig.db.charges().await, 1);
    let messages = delivered(&rig.db.store(), &rig.queue).await;
    assert_once(&messages, &["charged:order-9", "receipt:order-9"]);
    rig.stop().await;
}

/// A handler that publishes and then answers `5xx` or `NotKept` leaves no
/// message (its transaction rolled back with the claim); the retry runs,
/// stages once, and its messages are delivered once. A message the outbox
/// refuses fails the request with `500` and commits nothing.
async fn a_failure_after_staging_leaves_no_message<D: Backend>() {
    let rig = Rig::<D>::start().await;
    rig.app.failures.store(1, Ordering::SeqCst);
    let failed = send(&rig.client, &rig.url, "f-1", "order-f fail").await.unwrap();
    assert_eq!(failed.status, 500, "{}", failed.body);
    rig.app.failures.store(1, Ordering::SeqCst);
    let later = send(&rig.client, &rig.url, "n-1", "order-n not-kept").await.unwrap();
    assert_eq!(later.status, 429, "{}", later.body);
    assert_eq!(rig.db.outbox_rows().await, 0, "nothing staged survives a failure");
    assert_eq!(rig.db.charges().await, 0);

    let refused = send(&rig.client, &rig.url, "r-1", "order-r refused").await.unwrap();
    assert_eq!(refused.status, 500, "{}", refused.body);
    assert_eq!(refused.problem, "urn:idempotent:outgoing-refused", "{}", refused.body);
    assert_eq!(rig.db.outbox_rows().await, 0, "a refused message commits nothing");
    assert_eq!(rig.db.charges().await, 0);

    let retried = send(&rig.client, &rig.url, "f-1", "order-f fail").await.unwrap();
    assert_eq!((retried.status, retried.replayed), (201, false), "{}", retried.body);
    let retried = send(&rig.client, &rig.url, "n-1", "order-n not-kept").await.unwrap();
    assert_eq!((retried.status, retried.replayed), (201, false), "{}", retried.body);
    let replay = send(&rig.client, &rig.url, "f-1", "order-f fail").await.unwrap();
    assert_eq!((replay.status, replay.replayed), (201, true));
    assert_eq!(rig.db.charges().await, 2);
    let messages = delivered(&rig.db.store(), &rig.queue).await;
    assert_once(
        &messages,
        &[
            "charged:order-f",
            "receipt:order-f",
            "charged:order-n",
            "receipt:order-n",
        ],
    );
    rig.stop().await;
}

macro_rules! on {
    ($module:ident, $db:ty) => {
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn retries_are_replays_that_stage_nothing() {
                super::retries_are_replays_that_stage_nothing::<$db>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_retries_of_one_key_publish_once() {
                super::concurrent_retries_of_one_key_publish_once::<$db>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_failure_after_staging_leaves_no_message() {
                super::a_failure_after_staging_leaves_no_message::<$db>().await;
            }
        }
    };
}

on!(postgres, super::Pg);
on!(postgres_cached, super::CachedPg);
on!(mariadb, super::My);
on!(sqlite, super::Lite);

// ---- SIGKILL -------------------------------------------------------------------

/// What the server child (`http_outbox_server_child`) serves on.
const CHILD_ENV: &str = "IDEMPOTENT_HTTP_OUTBOX_CHILD";

#[derive(serde::Serialize, serde::Deserialize)]
struct ChildSpec {
    addr: String,
    markers: String,
    outbox: String,
    table: String,
    destination: String,
}

/// The payment server in a process of its own: runs when
/// `postgres_server_sigkilled_mid_request_publishes_once_after_the_retry`
/// starts this binary again with `IDEMPOTENT_HTTP_OUTBOX_CHILD`, until it
/// is killed; does nothing otherwise. No relay here: the parent's relay
/// publishes what this process committed.
#[test]
fn http_outbox_server_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let spec: ChildSpec = serde_json::from_str(&spec).unwrap();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            let pool = common::pg_pool(8).await;
            let store = PgStore::builder(pool)
                .table(&spec.markers)
                .outbox_table(&spec.outbox)
                .build()
                .unwrap();
            let mut app = app(&spec.table, &spec.destination);
            app.slow = Duration::from_millis(1500);
            let listener = tokio::net::TcpListener::bind(&spec.addr).await.unwrap();
            axum::serve(listener, router::<Pg>(store, app)).await.unwrap();
        });
}

/// The server, SIGKILLed while a request's handler runs (its insert done,
/// its messages published on the `IdempotentTx`, nothing committed), then
/// started again on the same database: nothing of the killed request was
/// committed or published, the client's retry runs once and its messages
/// are delivered once by id; the retry after that is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_server_sigkilled_mid_request_publishes_once_after_the_retry() {
    let db = Pg::setup().await;
    let queue = Queue::new().await;
    let relay = Relay::builder(db.store(), RabbitPublisher::new(AMQP_URL))
        .poll_interval(Duration::from_millis(50))
        .spawn();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let spec = serde_json::to_string(&ChildSpec {
        addr: addr.clone(),
        markers: db.markers.clone(),
        outbox: db.outbox.clone(),
        table: db.table.clone(),
        destination: queue.name.clone(),
    })
    .unwrap();
    let serve = || {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["http_outbox_server_child", "--exact", "--nocapture"])
            .env(CHILD_ENV, &spec)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(started.elapsed() < Duration::from_secs(30), "the server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    };
    let url = format!("http://{addr}/payments");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    for round in 0..3i64 {
        let key = format!("kill-{round}");
        let order = format!("order-k{round}");
        let mut server = serve();
        let cut = {
            let (client, url, key) = (client.clone(), url.clone(), key.clone());
            let body = format!("{order} slow");
            tokio::spawn(async move { send(&client, &url, &key, &body).await })
        };
        // The handler sleeps 1.5 s after its insert and its publishes.
        tokio::time::sleep(Duration::from_millis(400 + 200 * round as u64)).await;
        server.kill().unwrap();
        server.wait().unwrap();
        match cut.await.unwrap() {
            Ok(answer) => panic!("the killed request was answered: {} {}", answer.status, answer.body),
            Err(error) => assert!(!error.is_timeout(), "{error}"),
        }
        assert_eq!(db.charges().await, round, "the killed request committed");
        assert_eq!(db.outbox_rows().await, 2 * round, "the killed request staged messages");

        let mut server = serve();
        let body = format!("{order} slow");
        let retry = send(&client, &url, &key, &body).await.unwrap();
        assert_eq!((retry.status, retry.replayed), (201, false), "{}", retry.body);
        let again = send(&client, &url, &key, &body).await.unwrap();
        assert_eq!((again.status, again.replayed), (201, true), "{}", again.body);
        assert_eq!(again.body, retry.body);
        server.kill().unwrap();
        server.wait().unwrap();
        let messages = delivered(&db.store(), &queue).await;
        let (charged, receipt) = (format!("charged:{order}"), format!("receipt:{order}"));
        assert_once(&messages, &[&charged, &receipt]);
    }
    assert_eq!(db.charges().await, 3);
    relay.shutdown().await;
    queue.delete().await;
    db.teardown().await;
}
