//! The databases under the `Idempotency-Key` layer's tests (tests/http.rs,
//! tests/http_outbox.rs): a store on marker and outbox tables of the
//! test's own, a `charges` table beside them for the handler's effect,
//! counts of their rows, and a server on 127.0.0.1.

use std::future::Future;
use std::time::Duration;

use idempotent_runtime::axum::http::HeaderMap;
use idempotent_runtime::axum::http::request::Parts;
use idempotent_runtime::axum::{self, Router};
use idempotent_runtime::http::IdempotentTx;
use idempotent_runtime::outbox::OutboxStore;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, MySqlPool, PgPool};
use idempotent_runtime::store::{StagesOutbox, TransactionalStore};
use idempotent_runtime::{CachedStore, MySqlStore, PgStore, SqliteStore};

/// A database fixture: the store under test and the table the handler's
/// effect (a charge: the caller's tenant and its request) goes to.
pub trait Backend: Sized + Send + Sync + 'static {
    type S: TransactionalStore<Guard: 'static> + StagesOutbox + OutboxStore + Clone + 'static;
    fn setup() -> impl Future<Output = Self> + Send;
    fn store(&self) -> Self::S;
    /// The charges table.
    fn table(&self) -> &str;
    /// The handler's effect, in the claim's transaction, into `table`.
    fn insert<'a>(
        tx: &'a mut IdempotentTx<Self::S>,
        table: &'a str,
        tenant: &'a str,
        request: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// Rows the handler committed.
    fn charges(&self) -> impl Future<Output = i64> + Send;
    /// Markers in the store's table.
    fn markers(&self) -> impl Future<Output = i64> + Send;
    /// Rows in the store's outbox table (pending or dispatched).
    fn outbox_rows(&self) -> impl Future<Output = i64> + Send;
    fn teardown(self) -> impl Future<Output = ()> + Send;
}

/// The charges table's DDL (the same on the three databases).
fn charges_ddl(table: &str) -> String {
    format!("CREATE TABLE {table} (tenant TEXT NOT NULL, request TEXT NOT NULL)")
}

/// `SELECT count(*)` of `$table` (a name of ours: no quoting needed) on
/// `$pool`.
macro_rules! count_rows {
    ($pool:expr, $table:expr) => {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!("SELECT count(*) FROM {}", $table)))
            .fetch_one($pool)
            .await
            .unwrap()
    };
}

/// SQLite on a file of a temporary directory of its own (so the default
/// table names).
pub struct Lite {
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
        let table = super::unique("charges");
        sqlx::query(AssertSqlSafe(charges_ddl(&table)))
            .execute(store.pool())
            .await
            .unwrap();
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
        count_rows!(self.store.pool(), &self.table)
    }
    async fn markers(&self) -> i64 {
        count_rows!(self.store.pool(), self.store.table())
    }
    async fn outbox_rows(&self) -> i64 {
        count_rows!(self.store.pool(), idempotent_runtime::store::DEFAULT_OUTBOX_TABLE)
    }
    async fn teardown(self) {}
}

/// A fixture on a server database: `$store` built by `$build` (which sees
/// the pool and the marker and outbox tables' names as `$pool`, `$markers`
/// and `$outbox`), the charges table beside it, all three dropped at the
/// end. PostgreSQL and MariaDB differ only in the pool, the drop, and the
/// placeholders.
macro_rules! server_backend {
    (
        $(#[$doc:meta])*
        $name:ident: $store:ty, $pool_ty:ty = $connect:path, drop = $drop:path, values = $values:literal,
        build = |$pool:ident, $markers:ident, $outbox:ident| $build:expr $(,)?
    ) => {
        $(#[$doc])*
        pub struct $name {
            store: $store,
            pool: $pool_ty,
            pub markers: String,
            pub outbox: String,
            pub table: String,
        }

        impl Backend for $name {
            type S = $store;
            async fn setup() -> Self {
                let pool = $connect(16).await;
                let (markers, outbox, table) = (
                    super::unique("http_markers"),
                    super::unique("http_outbox"),
                    super::unique("http_charges"),
                );
                let store = {
                    let $pool = pool.clone();
                    let $markers = markers.as_str();
                    let $outbox = outbox.as_str();
                    $build
                };
                sqlx::query(AssertSqlSafe(charges_ddl(&table))).execute(&pool).await.unwrap();
                $name {
                    store,
                    pool,
                    markers,
                    outbox,
                    table,
                }
            }
            fn store(&self) -> $store {
                self.store.clone()
            }
            fn table(&self) -> &str {
                &self.table
            }
            async fn insert(
                tx: &mut IdempotentTx<$store>,
                table: &str,
                tenant: &str,
                request: &str,
            ) -> Result<(), sqlx::Error> {
                let insert = format!("INSERT INTO {table} (tenant, request) VALUES {}", $values);
                sqlx::query(AssertSqlSafe(insert))
                    .bind(tenant)
                    .bind(request)
                    .execute(&mut ***tx)
                    .await?;
                Ok(())
            }
            async fn charges(&self) -> i64 {
                count_rows!(&self.pool, &self.table)
            }
            async fn markers(&self) -> i64 {
                count_rows!(&self.pool, &self.markers)
            }
            async fn outbox_rows(&self) -> i64 {
                count_rows!(&self.pool, &self.outbox)
            }
            async fn teardown(self) {
                for table in [&self.markers, &self.outbox, &self.table] {
                    $drop(&self.pool, table).await;
                }
            }
        }
    };
}

server_backend! {
    /// PostgreSQL.
    Pg: PgStore, PgPool = super::pg_pool, drop = super::drop_pg_table, values = "($1, $2)",
    build = |pool, markers, outbox| {
        let store = PgStore::builder(pool).table(markers).outbox_table(outbox).build().unwrap();
        store.migrate().await.unwrap();
        store
    },
}

server_backend! {
    /// MariaDB.
    My: MySqlStore, MySqlPool = super::mysql_pool, drop = super::drop_mysql_table, values = "(?, ?)",
    build = |pool, markers, outbox| {
        let store = MySqlStore::builder(pool).table(markers).outbox_table(outbox).build().unwrap();
        store.migrate().await.unwrap();
        store
    },
}

server_backend! {
    /// PostgreSQL's partitioned layout, a partition per day (the layer's
    /// keys live the default seven days).
    PgPartitioned: PgStore, PgPool = super::pg_pool, drop = super::drop_pg_table, values = "($1, $2)",
    build = |pool, markers, outbox| {
        let store = PgStore::builder(pool)
            .table(markers)
            .outbox_table(outbox)
            .partitioned(Duration::from_secs(24 * 3600))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        store
    },
}

server_backend! {
    /// The partitioned layout with a partition per second, for keys that
    /// expire in seconds (the janitor's test).
    PgPartitionedBySecond: PgStore, PgPool = super::pg_pool, drop = super::drop_pg_table, values = "($1, $2)",
    build = |pool, markers, outbox| {
        let store = PgStore::builder(pool)
            .table(markers)
            .outbox_table(outbox)
            .partitioned(Duration::from_secs(1))
            .partition_horizon(Duration::from_secs(5))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        store
    },
}

server_backend! {
    /// PostgreSQL behind a `CachedStore`: replays of completed keys come
    /// from the process's cache.
    CachedPg: CachedStore<PgStore>, PgPool = super::pg_pool, drop = super::drop_pg_table, values = "($1, $2)",
    build = |pool, markers, outbox| {
        let store = PgStore::builder(pool).table(markers).outbox_table(outbox).build().unwrap();
        store.migrate().await.unwrap();
        CachedStore::new(store, 1000)
    },
}

/// The request's tenant, its `X-Tenant` header ("" without one).
pub fn tenant(headers: &HeaderMap) -> String {
    headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// The layer's caller: the `X-Tenant` header (a request without one is
/// refused).
pub fn caller(parts: &Parts) -> Option<String> {
    parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)
}

/// `router` served on 127.0.0.1; its base URL (`http://127.0.0.1:<port>`).
pub async fn listen(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}
