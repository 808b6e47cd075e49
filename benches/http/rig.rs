//! What `benches/http.rs` measures, shared with its smoke run in
//! `tests/bench_smoke.rs`: an axum server on 127.0.0.1 with one handler (one
//! `INSERT`) on two routes, `/bare` without the layer and `/kept` behind an
//! `IdempotencyLayer` on the same database, and a reqwest client that keeps
//! N connections busy.
//!
//! - (a) `/bare`: the handler inserts on a pool connection (autocommit), as
//!   it would without the layer;
//! - (b) `/kept`, a fresh key per request: the claim, the handler's insert
//!   in the claim's transaction (`IdempotentTx`), the kept answer, one
//!   commit;
//! - (c) `/kept`, retries of known keys: each answered with the kept
//!   answer (the handler does not run);
//! - (h) `/hand`, a fresh key per request, without the layer: the same
//!   transaction written by hand (`BEGIN`, the key's `INSERT .. ON CONFLICT
//!   DO NOTHING`, the handler's insert, the answer's `UPDATE`, `COMMIT`),
//!   what a careful developer writes instead of the layer (no fingerprint,
//!   lease, durability check or metrics): the bound of (b).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::axum::body::Bytes;
use idempotent_runtime::axum::extract::State;
use idempotent_runtime::axum::http::{HeaderMap, StatusCode};
use idempotent_runtime::axum::response::{IntoResponse, Response};
use idempotent_runtime::axum::routing::post;
use idempotent_runtime::axum::{self, Router};
use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx};
use idempotent_runtime::sqlx::{self, AssertSqlSafe};
use idempotent_runtime::store::TransactionalStore;
use idempotent_runtime::{PgStore, SqliteStore};

pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The body every request sends (the fingerprint of a replay matches).
pub const BODY: &str = r#"{"order_id":"A-1042","amount":4200}"#;

/// What a request goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// (a) the handler without the layer.
    Bare,
    /// (b) the layer, a fresh key per request.
    Fresh,
    /// (c) the layer, a retry of a key already answered.
    Replay,
    /// (h) without the layer, (b)'s transaction written by hand.
    Hand,
}

/// A database the handler writes to, and the layer's store on it.
pub trait Db: Send + Sync + 'static {
    type S: TransactionalStore<Guard: 'static> + Clone + 'static;
    fn name(&self) -> &'static str;
    fn store(&self) -> Self::S;
    fn table(&self) -> &str;
    /// (a)'s insert, on a pool connection.
    fn insert_bare(&self, request: String) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// (b)'s insert, in the claim's transaction.
    fn insert_tx<'a>(
        tx: &'a mut IdempotentTx<Self::S>,
        table: &'a str,
        request: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// (h): the key's row, the insert and the answer in one transaction
    /// written by hand; the kept answer if the key was answered before.
    fn hand(&self, key: String, request: String) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;
    /// Rows the handler inserted.
    fn rows(&self) -> impl Future<Output = i64> + Send;
    /// Drops the tables (a SQLite file goes with its directory).
    fn cleanup(&self) -> impl Future<Output = ()> + Send;
}

/// PostgreSQL: a `PgStore` on tables of this run's own.
pub struct Pg {
    pool: sqlx::PgPool,
    store: PgStore,
    table: String,
    markers: String,
    hand: String,
}

impl Pg {
    pub async fn connect(max_connections: u32) -> Result<Pg, idempotent_runtime::Error> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(PG_URL)
            .await?;
        let pid = std::process::id();
        let (table, markers, hand) = (
            format!("bench_http_{pid}"),
            format!("bench_http_markers_{pid}"),
            format!("bench_http_hand_{pid}"),
        );
        let store = PgStore::builder(pool.clone()).table(&markers).build()?;
        store.migrate().await?;
        for create in [
            format!("CREATE TABLE IF NOT EXISTS {table} (id BIGSERIAL PRIMARY KEY, request TEXT NOT NULL)"),
            format!("CREATE TABLE IF NOT EXISTS {hand} (key TEXT PRIMARY KEY, answer TEXT)"),
        ] {
            sqlx::query(AssertSqlSafe(create)).execute(&pool).await?;
        }
        Ok(Pg {
            pool,
            store,
            table,
            markers,
            hand,
        })
    }
}

impl Db for Pg {
    type S = PgStore;
    fn name(&self) -> &'static str {
        "PostgreSQL"
    }
    fn store(&self) -> PgStore {
        self.store.clone()
    }
    fn table(&self) -> &str {
        &self.table
    }
    async fn insert_bare(&self, request: String) -> Result<(), sqlx::Error> {
        let insert = format!("INSERT INTO {} (request) VALUES ($1)", self.table);
        sqlx::query(AssertSqlSafe(insert))
            .bind(request)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
    async fn insert_tx(tx: &mut IdempotentTx<PgStore>, table: &str, request: &str) -> Result<(), sqlx::Error> {
        let insert = format!("INSERT INTO {table} (request) VALUES ($1)");
        sqlx::query(AssertSqlSafe(insert))
            .bind(request)
            .execute(&mut ***tx)
            .await?;
        Ok(())
    }
    async fn hand(&self, key: String, request: String) -> Result<Option<String>, sqlx::Error> {
        let tx = self.pool.begin().await?;
        let tables = (self.table.as_str(), self.hand.as_str());
        hand_tx(tx, ["$1", "$2"], tables, key, request, |done| done.rows_affected()).await
    }
    async fn rows(&self) -> i64 {
        let count = format!("SELECT count(*) FROM {}", self.table);
        sqlx::query_scalar(AssertSqlSafe(count))
            .fetch_one(&self.pool)
            .await
            .unwrap_or(-1)
    }
    async fn cleanup(&self) {
        for table in [&self.table, &self.markers, &self.hand] {
            let drop = format!("DROP TABLE IF EXISTS {table}");
            let _ = sqlx::query(AssertSqlSafe(drop)).execute(&self.pool).await;
        }
    }
}

/// SQLite: a `SqliteStore` on a file in a temporary directory.
pub struct Lite {
    store: SqliteStore,
    table: String,
    _dir: tempfile::TempDir,
}

impl Lite {
    pub async fn open() -> Result<Lite, idempotent_runtime::Error> {
        let dir = tempfile::tempdir().map_err(|e| idempotent_runtime::Error::Config(e.to_string()))?;
        let store = SqliteStore::open(dir.path().join("bench_http.db")).await?;
        store.migrate().await?;
        let table = "bench_http".to_owned();
        for create in [
            format!("CREATE TABLE {table} (id INTEGER PRIMARY KEY, request TEXT NOT NULL)"),
            "CREATE TABLE bench_http_hand (key TEXT PRIMARY KEY, answer TEXT)".to_owned(),
        ] {
            sqlx::query(AssertSqlSafe(create)).execute(store.pool()).await?;
        }
        Ok(Lite {
            store,
            table,
            _dir: dir,
        })
    }
}

impl Db for Lite {
    type S = SqliteStore;
    fn name(&self) -> &'static str {
        "SQLite"
    }
    fn store(&self) -> SqliteStore {
        self.store.clone()
    }
    fn table(&self) -> &str {
        &self.table
    }
    async fn insert_bare(&self, request: String) -> Result<(), sqlx::Error> {
        let insert = format!("INSERT INTO {} (request) VALUES (?1)", self.table);
        sqlx::query(AssertSqlSafe(insert))
            .bind(request)
            .execute(self.store.pool())
            .await?;
        Ok(())
    }
    async fn insert_tx(tx: &mut IdempotentTx<SqliteStore>, table: &str, request: &str) -> Result<(), sqlx::Error> {
        let insert = format!("INSERT INTO {table} (request) VALUES (?1)");
        sqlx::query(AssertSqlSafe(insert))
            .bind(request)
            .execute(&mut ***tx)
            .await?;
        Ok(())
    }
    async fn hand(&self, key: String, request: String) -> Result<Option<String>, sqlx::Error> {
        // `BEGIN IMMEDIATE`, as the store begins: a deferred transaction
        // that later writes can fail with SQLITE_BUSY under concurrency.
        let tx = self.store.pool().begin_with("BEGIN IMMEDIATE").await?;
        let tables = (self.table.as_str(), "bench_http_hand");
        hand_tx(tx, ["?1", "?2"], tables, key, request, |done| done.rows_affected()).await
    }
    async fn rows(&self) -> i64 {
        let count = format!("SELECT count(*) FROM {}", self.table);
        sqlx::query_scalar(AssertSqlSafe(count))
            .fetch_one(self.store.pool())
            .await
            .unwrap_or(-1)
    }
    async fn cleanup(&self) {}
}

/// Every handler's answer.
const CHARGED: &str = "charged";

/// (h)'s statements in `tx`, on either database (`marks`: its first and
/// second placeholders; `rows_affected`: what its statement result says):
/// the key's row into `hand`, or the kept answer if it was there; the
/// handler's insert into `table`; the answer; the commit.
async fn hand_tx<DB>(
    mut tx: sqlx::Transaction<'static, DB>,
    [p1, p2]: [&str; 2],
    (table, hand): (&str, &str),
    key: String,
    request: String,
    rows_affected: fn(&DB::QueryResult) -> u64,
) -> Result<Option<String>, sqlx::Error>
where
    DB: sqlx::Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    (Option<String>,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let claim = format!("INSERT INTO {hand} (key) VALUES ({p1}) ON CONFLICT DO NOTHING");
    let claimed = sqlx::query(AssertSqlSafe(claim))
        .bind(key.as_str())
        .execute(&mut *tx)
        .await?;
    if rows_affected(&claimed) == 0 {
        let kept = format!("SELECT answer FROM {hand} WHERE key = {p1}");
        return sqlx::query_scalar(AssertSqlSafe(kept))
            .bind(key.as_str())
            .fetch_one(&mut *tx)
            .await;
    }
    let insert = format!("INSERT INTO {table} (request) VALUES ({p1})");
    sqlx::query(AssertSqlSafe(insert))
        .bind(request)
        .execute(&mut *tx)
        .await?;
    let answer = format!("UPDATE {hand} SET answer = {p1} WHERE key = {p2}");
    sqlx::query(AssertSqlSafe(answer))
        .bind(CHARGED)
        .bind(key.as_str())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(None)
}

async fn bare<D: Db>(State(db): State<Arc<D>>, body: Bytes) -> (StatusCode, &'static str) {
    match db.insert_bare(String::from_utf8_lossy(&body).into_owned()).await {
        Ok(()) => (StatusCode::CREATED, CHARGED),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "insert failed"),
    }
}

/// (h): the key read and kept by hand; a known key's kept answer replayed.
async fn hand<D: Db>(State(db): State<Arc<D>>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return (StatusCode::BAD_REQUEST, "an Idempotency-Key is required").into_response();
    };
    match db
        .hand(key.to_owned(), String::from_utf8_lossy(&body).into_owned())
        .await
    {
        Ok(None) => (StatusCode::CREATED, CHARGED).into_response(),
        Ok(Some(kept)) => (StatusCode::CREATED, [("idempotent-replayed", "true")], kept).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "insert failed").into_response(),
    }
}

async fn kept<D: Db>(State(db): State<Arc<D>>, mut tx: IdempotentTx<D::S>, body: Bytes) -> (StatusCode, &'static str) {
    match D::insert_tx(&mut tx, db.table(), &String::from_utf8_lossy(&body)).await {
        Ok(()) => (StatusCode::CREATED, CHARGED),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "insert failed"),
    }
}

/// The server on `db` and a client of it.
pub struct Rig<D: Db> {
    pub db: Arc<D>,
    client: Client,
    server: tokio::task::JoinHandle<()>,
}

/// The requests of one timed run.
pub struct Sample {
    pub per_sec: f64,
    pub latencies: Vec<Duration>,
}

impl<D: Db> Rig<D> {
    /// Serves `/bare` and `/kept` on 127.0.0.1.
    pub async fn start(db: D) -> Rig<D> {
        let db = Arc::new(db);
        let layer = IdempotencyLayer::new(db.store());
        let router = Router::new()
            .route("/bare", post(bare::<D>))
            .route("/hand", post(hand::<D>))
            .merge(Router::new().route("/kept", post(kept::<D>)).route_layer(layer))
            .with_state(Arc::clone(&db));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let base = format!("http://{}", listener.local_addr().expect("its address"));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let client = Client {
            base,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .expect("the client"),
        };
        Rig { db, client, server }
    }

    /// One request; its status and whether it was a replay.
    pub async fn request(&self, variant: Variant, key: Option<&str>) -> Result<(u16, bool), reqwest::Error> {
        self.client.request(variant, key).await
    }

    /// `n` keys answered once, for (c) to retry.
    pub async fn answered_keys(&self, n: usize) -> Arc<Vec<String>> {
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            let key = fresh_key();
            let (status, _) = self.request(Variant::Fresh, Some(&key)).await.expect("a request");
            assert_eq!(status, 201, "preparing the replays");
            keys.push(key);
        }
        Arc::new(keys)
    }

    /// `variant` for `secs` with `connections` requests in flight; `keys`
    /// are (c)'s.
    pub async fn run(&self, variant: Variant, connections: usize, secs: f64, keys: &Arc<Vec<String>>) -> Sample {
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let start = Instant::now();
        let tasks: Vec<_> = (0..connections)
            .map(|task| {
                let (client, keys) = (self.client.clone(), Arc::clone(keys));
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    let mut next = task;
                    while Instant::now() < deadline {
                        let key = match variant {
                            Variant::Bare => None,
                            Variant::Fresh | Variant::Hand => Some(fresh_key()),
                            Variant::Replay => {
                                next = (next + connections) % keys.len();
                                Some(keys[next].clone())
                            }
                        };
                        let sent = Instant::now();
                        let (status, replayed) = client.request(variant, key.as_deref()).await.expect("a request");
                        latencies.push(sent.elapsed());
                        assert_eq!(status, 201, "{variant:?}");
                        assert_eq!(replayed, variant == Variant::Replay, "{variant:?}");
                    }
                    latencies
                })
            })
            .collect();
        let mut latencies = Vec::new();
        for task in tasks {
            latencies.extend(task.await.expect("a client task"));
        }
        Sample {
            per_sec: latencies.len() as f64 / start.elapsed().as_secs_f64(),
            latencies,
        }
    }

    /// Stops the server and drops the tables.
    pub async fn stop(self) {
        self.server.abort();
        self.db.cleanup().await;
    }
}

/// The client of a [`Rig`]'s server (clones share its connections).
#[derive(Clone)]
struct Client {
    base: String,
    client: reqwest::Client,
}

impl Client {
    async fn request(&self, variant: Variant, key: Option<&str>) -> Result<(u16, bool), reqwest::Error> {
        let path = match variant {
            Variant::Bare => "bare",
            Variant::Hand => "hand",
            Variant::Fresh | Variant::Replay => "kept",
        };
        let mut request = self.client.post(format!("{}/{path}", self.base)).body(BODY);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await?;
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status().as_u16();
        response.bytes().await?;
        Ok((status, replayed))
    }
}

/// A key no other request of this process (or of another run) used.
pub fn fresh_key() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("bench-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}
