//! The store side of a configuration: its pools (with the settings users
//! change, applied per session), the store and its ledger, the effects
//! table, and what the checker does to the database from outside (kill the
//! store's connections, change settings at run time, read the effects,
//! sabotage).

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::outbox::OutboxStore;
use idempotent_runtime::redis;
use idempotent_runtime::sqlx::{self, AssertSqlSafe, MySqlPool, PgPool, SqlitePool};
use idempotent_runtime::{CachedStore, MemoryStore, MySqlStore, PgStore, RedisStore, SqliteStore};

use super::common;
use super::config::{Config, StoreKind};
use super::handlers::*;

/// Settings applied to each new session (what `ALTER ROLE .. SET` does for
/// new sessions), changeable while the run goes.
#[derive(Debug, Default)]
pub struct SessionSettings {
    pub pg_sync_commit_off: AtomicBool,
    pub pg_isolation: AtomicU8,
    pub my_isolation: AtomicU8,
}

fn pg_session_sql(s: &SessionSettings) -> Vec<&'static str> {
    let mut out = Vec::new();
    if s.pg_sync_commit_off.load(Ordering::SeqCst) {
        out.push("SET synchronous_commit = off");
    }
    match s.pg_isolation.load(Ordering::SeqCst) {
        common::settings::PG_REPEATABLE_READ => out.push("SET default_transaction_isolation = 'repeatable read'"),
        common::settings::PG_SERIALIZABLE => out.push("SET default_transaction_isolation = 'serializable'"),
        _ => {}
    }
    out
}

fn my_session_sql(s: &SessionSettings) -> Option<&'static str> {
    match s.my_isolation.load(Ordering::SeqCst) {
        common::settings::MY_READ_COMMITTED => Some("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"),
        common::settings::MY_REPEATABLE_READ => Some("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"),
        common::settings::MY_SERIALIZABLE => Some("SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"),
        _ => None,
    }
}

/// The store's database, for the checker.
pub enum Admin {
    Pg {
        /// The store's pool (its sessions carry the settings).
        store_pool: PgPool,
        /// The checker's own pool (never killed).
        admin: PgPool,
        backends: Arc<Mutex<Vec<i32>>>,
    },
    My {
        store_pool: MySqlPool,
        admin: MySqlPool,
        backends: Arc<Mutex<Vec<u64>>>,
    },
    Lite {
        pool: SqlitePool,
        /// Deleted with the configuration (`None` in a child consumer,
        /// which attaches to the parent's file).
        _dir: Option<tempfile::TempDir>,
    },
    Redis {
        conn: RedisConn,
    },
    Memory,
}

/// What the relay's own runtime needs to open the outbox again.
#[derive(Debug, Clone)]
pub enum RelayDb {
    Pg {
        url: String,
        markers: String,
        outbox: String,
        settings: Arc<SessionSettings>,
        partitioned: bool,
    },
    My {
        markers: String,
        outbox: String,
    },
    Lite {
        path: std::path::PathBuf,
        markers: String,
        outbox: String,
        wal: bool,
    },
}

/// The batch store a consumer's batches begin on.
#[derive(Clone)]
pub enum BatchTarget {
    Pg(PgStore),
    My(MySqlStore),
    Lite(SqliteStore),
}

pub struct Opened {
    pub ledger: Arc<dyn Ledger>,
    pub admin: Admin,
    pub batch: Option<BatchTarget>,
    pub relay: Option<RelayDb>,
    pub settings: Arc<SessionSettings>,
    pub markers: String,
    pub outbox: String,
    pub effects: String,
    /// `pending()` of the outbox, from the main runtime.
    pub pending: Option<Box<dyn Fn() -> BoxFut<'static, u64> + Send + Sync>>,
    /// Redis key prefix to clean up.
    pub redis_prefix: Option<String>,
    /// The SQLite database's file, for a child consumer to attach to.
    pub sqlite_path: Option<std::path::PathBuf>,
    /// The store Kafka consumers keep their offsets in
    /// (`Config::offsets_in_db`); `None` where the configuration does not.
    pub offsets: Option<BatchTarget>,
}

/// A child consumer (`child.rs`) attaches to the tables its parent
/// created: nothing is created or migrated, the SQLite file is the
/// parent's.
#[derive(Debug, Clone)]
pub struct Attach {
    pub sqlite: Option<std::path::PathBuf>,
}

pub async fn pg_store_pool(
    url: &str,
    settings: Arc<SessionSettings>,
    backends: Arc<Mutex<Vec<i32>>>,
    max: u32,
) -> Result<PgPool, sqlx::Error> {
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .expect("PostgreSQL URL")
        .application_name("idempotent-checker");
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let settings = Arc::clone(&settings);
            let backends = Arc::clone(&backends);
            Box::pin(async move {
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *conn)
                    .await?;
                backends.lock().unwrap().push(pid);
                for sql in pg_session_sql(&settings) {
                    sqlx::query(sql).execute(&mut *conn).await?;
                }
                Ok(())
            })
        })
        .connect_with(options)
        .await
}

pub async fn my_store_pool(settings: Arc<SessionSettings>, backends: Arc<Mutex<Vec<u64>>>, max: u32) -> MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let settings = Arc::clone(&settings);
            let backends = Arc::clone(&backends);
            Box::pin(async move {
                let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                    .fetch_one(&mut *conn)
                    .await?;
                backends.lock().unwrap().push(id);
                if let Some(sql) = my_session_sql(&settings) {
                    sqlx::query(sql).execute(&mut *conn).await?;
                }
                Ok(())
            })
        })
        .connect(common::MYSQL_URL)
        .await
        .expect("MariaDB at 127.0.0.1:3306")
}

pub async fn lite_pool(path: &std::path::Path, wal: bool) -> SqlitePool {
    let mode = if wal {
        sqlx::sqlite::SqliteJournalMode::Wal
    } else {
        sqlx::sqlite::SqliteJournalMode::Delete
    };
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(mode)
        .busy_timeout(Duration::from_secs(10));
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("open SQLite")
}

fn variant(cfg: &Config) -> Variant {
    Variant {
        fingerprint: cfg.fingerprint,
        value: cfg.value_result,
        outbox: cfg.sink().is_some(),
        short: cfg.short_ttl,
    }
}

const CACHE: usize = 10_000;

/// The effects per message id from `(message_id, at_ms)` rows in that
/// order, and how many were made after the previous one's ttl (`ttl_ms`,
/// when short): those are allowed and not counted per id.
pub fn tally(rows: &[(String, i64)], ttl_ms: Option<u64>) -> (HashMap<String, i64>, u64) {
    let mut effects: HashMap<String, i64> = HashMap::new();
    let mut expired = 0;
    let mut last: Option<(&str, i64)> = None;
    for (id, at) in rows {
        match last {
            Some((previous, t)) if previous == id && super::handlers::after_ttl(at - t, ttl_ms) => expired += 1,
            _ => *effects.entry(id.clone()).or_default() += 1,
        }
        last = Some((id, *at));
    }
    (effects, expired)
}

/// The addresses of the Redis Cluster a configuration's Redis store runs
/// on (`Config::cluster`): the checker run's shared cluster in the test
/// process, the parent's in a child consumer.
pub static CLUSTER_URLS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Opens the configuration's store (PostgreSQL at `pg_url`: the shared
/// server or a private one), its tables and its ledger; `attach`: the
/// tables exist already (a child consumer's).
pub async fn open(cfg: &Config, name: &str, sink: Option<String>, pg_url: &str, attach: Option<&Attach>) -> Opened {
    let create = attach.is_none();
    let markers = format!("{name}_m");
    let outbox = format!("{name}_o");
    let effects = format!("{name}_e");
    let settings = Arc::new(SessionSettings {
        pg_sync_commit_off: AtomicBool::new(cfg.settings.pg_sync_commit_off),
        pg_isolation: AtomicU8::new(cfg.settings.pg_isolation),
        my_isolation: AtomicU8::new(cfg.settings.my_isolation),
    });
    let ctx = Arc::new(Ctx::new(cfg, effects.clone(), sink));
    let v = variant(cfg);
    let mut pending: Option<Box<dyn Fn() -> BoxFut<'static, u64> + Send + Sync>> = None;
    let mut relay = None;
    let mut redis_prefix = None;
    let mut sqlite_path = None;
    let (ledger, admin, batch): (Arc<dyn Ledger>, Admin, Option<BatchTarget>) = match cfg.store {
        StoreKind::Pg | StoreKind::PgPartitioned => {
            let backends = Arc::default();
            let pool = pg_store_pool(pg_url, Arc::clone(&settings), Arc::clone(&backends), 8)
                .await
                .expect("PostgreSQL");
            let admin = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(pg_url)
                .await
                .expect("PostgreSQL");
            let mut builder = PgStore::builder(pool.clone()).table(&markers).outbox_table(&outbox);
            if cfg.store == StoreKind::PgPartitioned {
                builder = builder.partitioned(Duration::from_secs(24 * 3600));
            }
            let store = builder.build().unwrap();
            if create {
                store.migrate().await.unwrap();
            }
            // Each effect row records, at COMMIT (a deferred constraint
            // trigger fires there), the `synchronous_commit` its commit ran
            // with: invariant 5 made observable without a server crash.
            // The slow commits (`FaultKind::SlowCommit`) sleep there too.
            let slow = cfg
                .schedule
                .slow_commit
                .iter()
                .map(|id| format!("'{id}'"))
                .collect::<Vec<_>>()
                .join(",");
            let ddls = [
                format!("CREATE TABLE {effects} (message_id TEXT NOT NULL, at_ms BIGINT NOT NULL DEFAULT 0)"),
                format!("CREATE TABLE {effects}_c (message_id TEXT NOT NULL, setting TEXT NOT NULL)"),
                format!(
                    "CREATE FUNCTION {effects}_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                     INSERT INTO {effects}_c VALUES (NEW.message_id, current_setting('synchronous_commit')); \
                     IF NEW.message_id = ANY (ARRAY[{slow}]::text[]) THEN PERFORM pg_sleep(0.15); END IF; \
                     RETURN NULL; END $$"
                ),
                format!(
                    "CREATE CONSTRAINT TRIGGER {effects}_t AFTER INSERT ON {effects} DEFERRABLE INITIALLY DEFERRED \
                     FOR EACH ROW EXECUTE FUNCTION {effects}_f()"
                ),
            ];
            for ddl in ddls.into_iter().filter(|_| create) {
                sqlx::query(AssertSqlSafe(ddl)).execute(&admin).await.unwrap();
            }
            let s = store.clone();
            pending = Some(Box::new(move || {
                let s = s.clone();
                Box::pin(async move { s.pending().await.map(|(n, _)| n).unwrap_or(u64::MAX) })
            }));
            relay = Some(RelayDb::Pg {
                url: pg_url.into(),
                markers: markers.clone(),
                outbox: outbox.clone(),
                settings: Arc::clone(&settings),
                partitioned: cfg.store == StoreKind::PgPartitioned,
            });
            let ledger: Arc<dyn Ledger> = if cfg.cached {
                Arc::new(PgCachedLedger {
                    store: CachedStore::new(store.clone(), CACHE),
                    ctx,
                    variant: v,
                })
            } else {
                Arc::new(PgLedger {
                    store: store.clone(),
                    ctx,
                    variant: v,
                })
            };
            (
                ledger,
                Admin::Pg {
                    store_pool: pool,
                    admin,
                    backends,
                },
                Some(BatchTarget::Pg(store)),
            )
        }
        StoreKind::MariaDb => {
            let backends = Arc::default();
            let pool = my_store_pool(Arc::clone(&settings), Arc::clone(&backends), 8).await;
            let admin = common::mysql_pool(2).await;
            let store = MySqlStore::builder(pool.clone())
                .table(&markers)
                .outbox_table(&outbox)
                .build()
                .unwrap();
            if create {
                store.migrate().await.unwrap();
                for ddl in [
                    format!(
                        "CREATE TABLE `{effects}` (message_id VARCHAR(64) NOT NULL, at_ms BIGINT NOT NULL DEFAULT 0) \
                         ENGINE=InnoDB"
                    ),
                    format!("CREATE TABLE `{effects}_l` (k VARCHAR(80) PRIMARY KEY) ENGINE=InnoDB"),
                    format!("CREATE TABLE `{effects}_h` (n INT NOT NULL) ENGINE=InnoDB"),
                ] {
                    sqlx::query(AssertSqlSafe(ddl)).execute(&admin).await.unwrap();
                }
            }
            let _ = ctx.deadlock.set(DeadlockRig {
                pool: common::mysql_pool(4).await,
                locks: format!("`{effects}_l`"),
                heavy: format!("`{effects}_h`"),
            });
            let s = store.clone();
            pending = Some(Box::new(move || {
                let s = s.clone();
                Box::pin(async move { s.pending().await.map(|(n, _)| n).unwrap_or(u64::MAX) })
            }));
            relay = Some(RelayDb::My {
                markers: markers.clone(),
                outbox: outbox.clone(),
            });
            let ledger: Arc<dyn Ledger> = if cfg.cached {
                Arc::new(MyCachedLedger {
                    store: CachedStore::new(store.clone(), CACHE),
                    ctx,
                    variant: v,
                })
            } else {
                Arc::new(MyLedger {
                    store: store.clone(),
                    ctx,
                    variant: v,
                })
            };
            (
                ledger,
                Admin::My {
                    store_pool: pool,
                    admin,
                    backends,
                },
                Some(BatchTarget::My(store)),
            )
        }
        StoreKind::Sqlite => {
            let (dir, path) = match attach.and_then(|a| a.sqlite.clone()) {
                Some(path) => (None, path),
                None => {
                    let dir = tempfile::tempdir().unwrap();
                    let path = dir.path().join("checker.db");
                    (Some(dir), path)
                }
            };
            sqlite_path = Some(path.clone());
            let wal = cfg.settings.sqlite_journal == common::settings::LITE_WAL;
            let pool = lite_pool(&path, wal).await;
            let store = SqliteStore::builder(pool.clone())
                .table(&markers)
                .outbox_table(&outbox)
                .build()
                .unwrap();
            if create {
                store.migrate().await.unwrap();
                sqlx::query(AssertSqlSafe(format!(
                    "CREATE TABLE {effects} (message_id TEXT NOT NULL, at_ms BIGINT NOT NULL DEFAULT 0)"
                )))
                .execute(&pool)
                .await
                .unwrap();
            }
            let s = store.clone();
            pending = Some(Box::new(move || {
                let s = s.clone();
                Box::pin(async move { s.pending().await.map(|(n, _)| n).unwrap_or(u64::MAX) })
            }));
            relay = Some(RelayDb::Lite {
                path,
                markers: markers.clone(),
                outbox: outbox.clone(),
                wal,
            });
            let ledger: Arc<dyn Ledger> = if cfg.cached {
                Arc::new(LiteCachedLedger {
                    store: CachedStore::new(store.clone(), CACHE),
                    ctx,
                    variant: v,
                })
            } else {
                Arc::new(LiteLedger {
                    store: store.clone(),
                    ctx,
                    variant: v,
                })
            };
            (ledger, Admin::Lite { pool, _dir: dir }, Some(BatchTarget::Lite(store)))
        }
        StoreKind::Redis => {
            let prefix = format!("{name}:");
            redis_prefix = Some(prefix.clone());
            let (conn, store) = if cfg.cluster {
                // The checker run's cluster (`CLUSTER_URLS`), with the
                // timeouts and retries that ride out a failover.
                let urls = CLUSTER_URLS.get().expect("the Redis Cluster's addresses").clone();
                let client = redis::cluster::ClusterClient::builder(urls)
                    .connection_timeout(Duration::from_millis(500))
                    .response_timeout(Duration::from_secs(2))
                    .retries(6)
                    .min_retry_wait(50)
                    .max_retry_wait(1000)
                    .build()
                    .expect("cluster client");
                let conn = client.get_async_connection().await.expect("the Redis Cluster");
                let mut builder = RedisStore::cluster_builder(conn.clone()).prefix(prefix.clone());
                if cfg.wait_replicas {
                    builder = builder.wait_for_replicas(1, Duration::from_millis(500));
                }
                (RedisConn::Cluster(conn), builder.build().unwrap())
            } else {
                let client = redis::Client::open(common::REDIS_URL).unwrap();
                let conn = redis::aio::ConnectionManager::new(client).await.expect("Redis");
                let store = RedisStore::builder(conn.clone())
                    .prefix(prefix.clone())
                    .build()
                    .unwrap();
                (RedisConn::One(conn), store)
            };
            let _ = ctx.redis_effects.set(RedisEffects {
                conn: conn.clone(),
                key: format!("{prefix}effects"),
            });
            let ledger: Arc<dyn Ledger> = if cfg.cached {
                Arc::new(RedisCachedLedger {
                    store: CachedStore::new(store, CACHE),
                    ctx,
                    variant: v,
                })
            } else {
                Arc::new(RedisLedger { store, ctx, variant: v })
            };
            (ledger, Admin::Redis { conn }, None)
        }
        StoreKind::Memory => {
            let store = MemoryStore::new();
            let ledger: Arc<dyn Ledger> = if cfg.cached {
                Arc::new(MemCachedLedger {
                    store: CachedStore::new(store, CACHE),
                    ctx,
                    variant: v,
                })
            } else {
                Arc::new(MemLedger { store, ctx, variant: v })
            };
            (ledger, Admin::Memory, None)
        }
    };
    Opened {
        ledger,
        admin,
        offsets: batch.clone().filter(|_| cfg.offsets_in_db()),
        batch: batch.filter(|_| cfg.batch.is_some()),
        relay: relay.filter(|_| cfg.sink().is_some()),
        settings,
        markers,
        outbox,
        effects,
        pending,
        redis_prefix,
        sqlite_path,
    }
}

impl Opened {
    /// The Redis store's effects hash (see `Ctx::redis_effects`).
    fn redis_effects_key(&self) -> String {
        format!("{}effects", self.redis_prefix.as_deref().unwrap_or_default())
    }

    /// Lease-store effects made again for an id that had one.
    pub async fn reapplied(&self) -> u64 {
        match &self.admin {
            Admin::Redis { conn } => {
                let mut conn = conn.clone();
                let n: Option<u64> = redis::cmd("GET")
                    .arg(format!("{}:again", self.redis_effects_key()))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                n.unwrap_or(0)
            }
            _ => self.ledger.ctx().reapplied.load(Ordering::SeqCst),
        }
    }

    /// The transactional stores' effect rows, `(message_id, at_ms)` in that
    /// order; `None` on the lease stores (their effects are not rows).
    async fn effect_rows(&self) -> Option<Vec<(String, i64)>> {
        let sql = format!(
            "SELECT message_id, at_ms FROM {} ORDER BY message_id, at_ms",
            self.effects
        );
        Some(match &self.admin {
            Admin::Pg { admin, .. } => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(admin).await.unwrap(),
            Admin::My { admin, .. } => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(admin).await.unwrap(),
            Admin::Lite { pool, .. } => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await.unwrap(),
            Admin::Redis { .. } | Admin::Memory => return None,
        })
    }

    /// Effects per message id: on the transactional stores an effect made
    /// after the previous one's ttl (`Config::short_ttl`) is not counted
    /// (see [`Opened::expired_effects`]).
    pub async fn effects(&self) -> HashMap<String, i64> {
        match self.effect_rows().await {
            Some(rows) => tally(&rows, self.ledger.ctx().short_ttl).0,
            None => self.lease_effects().await,
        }
    }

    /// Effects made again after the previous one's ttl had passed
    /// (`Config::short_ttl`): allowed, counted apart.
    pub async fn expired_effects(&self) -> u64 {
        if let Some(rows) = self.effect_rows().await {
            return tally(&rows, self.ledger.ctx().short_ttl).1;
        }
        match &self.admin {
            Admin::Redis { conn } => {
                let mut conn = conn.clone();
                let n: Option<u64> = redis::cmd("GET")
                    .arg(format!("{}:expired", self.redis_effects_key()))
                    .query_async(&mut conn)
                    .await
                    .unwrap_or(None);
                n.unwrap_or(0)
            }
            _ => self.ledger.ctx().expired.load(Ordering::SeqCst),
        }
    }

    /// The lease stores' effects per message id.
    async fn lease_effects(&self) -> HashMap<String, i64> {
        match &self.admin {
            Admin::Pg { .. } | Admin::My { .. } | Admin::Lite { .. } => HashMap::new(),
            Admin::Redis { conn } => {
                let mut conn = conn.clone();
                redis::cmd("HGETALL")
                    .arg(self.redis_effects_key())
                    .query_async(&mut conn)
                    .await
                    .unwrap()
            }
            Admin::Memory => self.ledger.ctx().mem_effects.lock().unwrap().clone(),
        }
    }

    /// The outbox's rows staged with an ordering key, as (key, payload), in
    /// the order of their ids: per key, the order their transactions
    /// committed in (a transaction staging a key holds the key's lock from
    /// its rows' insert to its end).
    pub async fn outbox_order(&self) -> Vec<(String, Vec<u8>)> {
        let sql = format!(
            "SELECT ordering_key, payload FROM {} WHERE ordering_key IS NOT NULL ORDER BY id",
            self.outbox
        );
        let rows = match &self.admin {
            Admin::Pg { admin, .. } => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(admin).await,
            Admin::My { admin, .. } => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(admin).await,
            Admin::Lite { pool, .. } => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await,
            Admin::Redis { .. } | Admin::Memory => Ok(Vec::new()),
        };
        rows.unwrap_or_default()
    }

    /// PostgreSQL: the effects whose transaction committed with
    /// `synchronous_commit = off` (not durable when acknowledged).
    pub async fn non_durable_commits(&self) -> Vec<String> {
        match &self.admin {
            Admin::Pg { admin, .. } => sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT message_id FROM {}_c WHERE setting = 'off' ORDER BY message_id",
                self.effects
            )))
            .fetch_all(admin)
            .await
            .unwrap(),
            _ => Vec::new(),
        }
    }

    /// Whether `id`'s effect is committed (seen from outside the store's
    /// transactions).
    pub async fn committed(&self, id: &str) -> bool {
        let sql = |ph: &str| format!("SELECT COUNT(*) FROM {} WHERE message_id = {ph}", self.effects);
        let n: i64 = match &self.admin {
            Admin::Pg { admin, .. } => sqlx::query_scalar(AssertSqlSafe(sql("$1")))
                .bind(id)
                .fetch_one(admin)
                .await
                .unwrap_or(1),
            Admin::My { admin, .. } => sqlx::query_scalar(AssertSqlSafe(sql("?")))
                .bind(id)
                .fetch_one(admin)
                .await
                .unwrap_or(1),
            Admin::Lite { pool, .. } => sqlx::query_scalar(AssertSqlSafe(sql("?")))
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap_or(1),
            Admin::Redis { conn } => {
                let mut conn = conn.clone();
                let n: Option<i64> = redis::cmd("HGET")
                    .arg(self.redis_effects_key())
                    .arg(id)
                    .query_async(&mut conn)
                    .await
                    .unwrap_or(Some(1));
                n.unwrap_or(0)
            }
            Admin::Memory => self
                .ledger
                .ctx()
                .mem_effects
                .lock()
                .unwrap()
                .get(id)
                .copied()
                .unwrap_or(0),
        };
        n > 0
    }

    /// Sabotage: removes one effect of `id` (`delete`) or adds one.
    pub async fn tamper(&self, id: &str, delete: bool) {
        let t = &self.effects;
        let (pg, other) = if delete {
            (
                format!("DELETE FROM {t} WHERE ctid IN (SELECT ctid FROM {t} WHERE message_id = $1 LIMIT 1)"),
                format!("DELETE FROM {t} WHERE message_id = ? LIMIT 1"),
            )
        } else {
            // At the same time as the effect it doubles: within any ttl.
            (
                format!(
                    "INSERT INTO {t} (message_id, at_ms) SELECT $1, COALESCE(MAX(at_ms), 0) FROM {t} WHERE message_id = $1"
                ),
                format!(
                    "INSERT INTO {t} (message_id, at_ms) SELECT ?, COALESCE(MAX(at_ms), 0) FROM {t} WHERE message_id = ?"
                ),
            )
        };
        match &self.admin {
            Admin::Pg { admin, .. } => {
                sqlx::query(AssertSqlSafe(pg)).bind(id).execute(admin).await.unwrap();
            }
            Admin::My { admin, .. } => {
                let query = sqlx::query(AssertSqlSafe(other)).bind(id);
                let query = if delete { query } else { query.bind(id) };
                query.execute(admin).await.unwrap();
            }
            Admin::Lite { pool, .. } => {
                let sql = if delete {
                    format!("DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE message_id = ? LIMIT 1)")
                } else {
                    other
                };
                let query = sqlx::query(AssertSqlSafe(sql)).bind(id);
                let query = if delete { query } else { query.bind(id) };
                query.execute(pool).await.unwrap();
            }
            Admin::Redis { conn } => {
                let mut conn = conn.clone();
                let _: i64 = redis::cmd("HINCRBY")
                    .arg(self.redis_effects_key())
                    .arg(id)
                    .arg(if delete { -1 } else { 1 })
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            Admin::Memory => {
                let ctx = self.ledger.ctx();
                let mut effects = ctx.mem_effects.lock().unwrap();
                let n = effects.entry(id.to_owned()).or_default();
                *n += if delete { -1 } else { 1 };
            }
        }
    }

    /// Kills the store's database connections (the checker's own survive).
    /// Returns how many were killed.
    pub async fn kill_connections(&self) -> u64 {
        match &self.admin {
            Admin::Pg { admin, backends, .. } => {
                let pids: Vec<i32> = backends.lock().unwrap().drain(..).collect();
                let killed: Vec<bool> =
                    sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid")
                        .bind(&pids)
                        .fetch_all(admin)
                        .await
                        .unwrap_or_default();
                killed.into_iter().filter(|k| *k).count() as u64
            }
            Admin::My { admin, backends, .. } => {
                let ids: Vec<u64> = backends.lock().unwrap().drain(..).collect();
                let mut n = 0;
                for id in ids {
                    if sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {id}")))
                        .execute(admin)
                        .await
                        .is_ok()
                    {
                        n += 1;
                    }
                }
                n
            }
            _ => 0,
        }
    }

    /// Changes a server setting while the run goes: new sessions get it,
    /// and the live idle sessions of the pool are changed in place (a
    /// session `SET`, as `ALTER ROLE` does for new ones).
    pub async fn change_setting(&self, on: bool) {
        match &self.admin {
            Admin::Pg { store_pool, .. } => {
                // `synchronous_commit = off` and a serializable default
                // isolation, as `ALTER ROLE .. SET` both would.
                self.settings.pg_sync_commit_off.store(on, Ordering::SeqCst);
                let level = if on {
                    common::settings::PG_SERIALIZABLE
                } else {
                    common::settings::PG_SERVER_DEFAULT
                };
                self.settings.pg_isolation.store(level, Ordering::SeqCst);
                let sql = if on {
                    "SET synchronous_commit = off; SET default_transaction_isolation = 'serializable'"
                } else {
                    "SET synchronous_commit = on; SET default_transaction_isolation = 'read committed'"
                };
                let mut held = Vec::new();
                while let Some(mut conn) = store_pool.try_acquire() {
                    let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *conn).await;
                    held.push(conn);
                }
            }
            Admin::My { store_pool, .. } => {
                let level = if on {
                    common::settings::MY_SERIALIZABLE
                } else {
                    common::settings::MY_SERVER_DEFAULT
                };
                self.settings.my_isolation.store(level, Ordering::SeqCst);
                let sql = if on {
                    "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"
                } else {
                    "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"
                };
                let mut held = Vec::new();
                while let Some(mut conn) = store_pool.try_acquire() {
                    let _ = sqlx::query(sql).execute(&mut *conn).await;
                    held.push(conn);
                }
            }
            _ => {}
        }
    }

    /// Outbox rows not dispatched yet.
    pub async fn outbox_pending(&self) -> u64 {
        match &self.pending {
            Some(pending) => pending().await,
            None => 0,
        }
    }

    /// Drops the tables (or the Redis keys) of this configuration; returns
    /// what went wrong on the way.
    pub async fn teardown(&self) -> Vec<String> {
        let mut problems = Vec::new();
        match &self.admin {
            Admin::Pg {
                admin,
                store_pool,
                backends,
            } => {
                if tokio::time::timeout(POOL_CLOSE, store_pool.close()).await.is_err() {
                    problems.push(format!(
                        "hung: the store's PostgreSQL pool did not close within {POOL_CLOSE:?} (a connection was never returned to it)"
                    ));
                    // What the store's sessions still do, to tell a held
                    // connection from one waiting on the server.
                    let pids: Vec<i32> = backends.lock().unwrap().clone();
                    let sessions: Result<Vec<PgSession>, String> = sqlx::query_as(
                        "SELECT pid, state, wait_event, left(query, 160) FROM pg_stat_activity WHERE pid = ANY($1)",
                    )
                    .bind(&pids)
                    .fetch_all(admin)
                    .await
                    .map_err(|e| e.to_string());
                    problems.push(format!("hung: the store's sessions still open: {sessions:?}"));
                }
                let log = format!("{}_c", self.effects);
                for t in [&self.effects, &log, &self.markers, &self.outbox] {
                    common::drop_pg_table(admin, t).await;
                }
                let _ = sqlx::query(AssertSqlSafe(format!("DROP FUNCTION IF EXISTS {}_f()", self.effects)))
                    .execute(admin)
                    .await;
            }
            Admin::My {
                admin,
                store_pool,
                backends,
            } => {
                if tokio::time::timeout(POOL_CLOSE, store_pool.close()).await.is_err() {
                    problems.push(format!(
                        "hung: the store's MariaDB pool did not close within {POOL_CLOSE:?} (a connection was never returned to it)"
                    ));
                    let ids: Vec<u64> = backends.lock().unwrap().clone();
                    let list = ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
                    if !list.is_empty() {
                        let sessions: Result<Vec<MySession>, String> =
                            sqlx::query_as(AssertSqlSafe(format!(
                                "SELECT CAST(p.ID AS UNSIGNED), p.COMMAND, CAST(p.TIME AS SIGNED), p.STATE, CONCAT(LEFT(COALESCE(p.INFO, ''), 160), \
                                 ' trx: ', COALESCE(t.trx_state, 'none')) \
                                 FROM information_schema.PROCESSLIST p \
                                 LEFT JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = p.ID \
                                 WHERE p.ID IN ({list})"
                            )))
                            .fetch_all(admin)
                            .await
                            .map_err(|e| e.to_string());
                        problems.push(format!("hung: the store's sessions still open: {sessions:?}"));
                    }
                }
                let (locks, heavy) = (format!("{}_l", self.effects), format!("{}_h", self.effects));
                for t in [&self.effects, &locks, &heavy, &self.markers, &self.outbox] {
                    common::drop_mysql_table(admin, t).await;
                }
            }
            Admin::Lite { pool, .. } => pool.close().await,
            Admin::Redis { conn } => {
                if let Some(prefix) = &self.redis_prefix {
                    let mut conn = conn.clone();
                    let keys: Vec<String> = redis::cmd("KEYS")
                        .arg(format!("{prefix}*"))
                        .query_async(&mut conn)
                        .await
                        .unwrap_or_default();
                    // One by one: on a cluster they live in many slots.
                    for key in keys {
                        let _: Result<(), _> = redis::cmd("DEL").arg(&key).query_async(&mut conn).await;
                    }
                }
            }
            Admin::Memory => {}
        }
        problems
    }
}

/// A PostgreSQL session left open: pid, state, wait event, query.
type PgSession = (i32, Option<String>, Option<String>, Option<String>);
/// A MariaDB session left open: id, command, seconds, state, query and
/// transaction.
type MySession = (u64, String, i64, Option<String>, Option<String>);

/// How long the store's pool may take to close at the end of a run.
const POOL_CLOSE: Duration = Duration::from_secs(20);

/// Where the sink received an ordering key's messages out of the order
/// their transactions committed in: `order` is the outbox's keyed rows in
/// commit order per key ([`Opened::outbox_order`]), `delivered` what the
/// sink holds, in its order (a message published again counts where it
/// first arrived). One line per key out of order.
pub fn out_of_commit_order(order: &[(String, Vec<u8>)], delivered: &[(String, Vec<u8>)]) -> Vec<String> {
    use std::collections::{BTreeMap, HashSet};
    let key_of: HashMap<&[u8], &str> = order.iter().map(|(k, p)| (p.as_slice(), k.as_str())).collect();
    let mut expected: BTreeMap<&str, Vec<&[u8]>> = BTreeMap::new();
    let mut staged = HashSet::new();
    for (key, payload) in order {
        if staged.insert(payload.as_slice()) {
            expected.entry(key.as_str()).or_default().push(payload.as_slice());
        }
    }
    let mut got: BTreeMap<&str, Vec<&[u8]>> = BTreeMap::new();
    let mut arrived = HashSet::new();
    for (_, payload) in delivered {
        if let Some(key) = key_of.get(payload.as_slice())
            && arrived.insert(payload.as_slice())
        {
            got.entry(key).or_default().push(payload.as_slice());
        }
    }
    let text = |p: &&[u8]| String::from_utf8_lossy(p).into_owned();
    let mut violations = Vec::new();
    for (key, committed) in expected {
        let received = got.remove(key).unwrap_or_default();
        let received_set: HashSet<&[u8]> = received.iter().copied().collect();
        let committed: Vec<&[u8]> = committed.into_iter().filter(|p| received_set.contains(p)).collect();
        if let Some(at) = committed.iter().zip(&received).position(|(a, b)| a != b) {
            let end = (at + 3).min(committed.len());
            violations.push(format!(
                "outbox: key {key} received out of commit order at position {at}: committed {:?}, received {:?}",
                committed[at..end].iter().map(text).collect::<Vec<_>>(),
                received[at..end].iter().map(text).collect::<Vec<_>>(),
            ));
        }
    }
    violations
}
