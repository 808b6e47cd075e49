//! The stores, and the contract they implement: how a handler claims a
//! key, and how the claim ends. Handler authors need only the store types
//! (also at the crate root); this module is for those who write a store,
//! or name a store's guard, builder or settings.
//!
//! Two families implement it. Transactional stores ([`TransactionalStore`]:
//! Postgres, SQLite, MySQL) claim by inserting the marker inside a database
//! transaction that the handler's body then shares, so effect and marker
//! commit or roll back together. Lease stores (Redis, memory) claim with an
//! atomic set-if-absent lease and cannot make the effect atomic with the
//! marker: effects must be idempotent by design there.

use std::future::Future;
use std::time::Duration;

use crate::Error;

/// Marker lifetime used when `#[idempotent]` has no `ttl`: seven days.
pub const DEFAULT_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Lease length used when `#[idempotent]` has no `lease` (lease stores only).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// One handler call asking to process one key.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    scope: &'a str,
    key: &'a str,
    ttl: Duration,
    lease: Duration,
    fingerprint: Option<Fingerprint>,
    unit_result: bool,
}

impl<'a> Request<'a> {
    /// A request with the default ttl and lease and no fingerprint.
    ///
    /// Fails when the scope or key breaks the rules every store shares
    /// (see [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES)).
    pub fn new(scope: &'a str, key: &'a str) -> Result<Self, Error> {
        crate::key::validate_scope(scope)?;
        crate::key::validate(scope, key)?;
        Ok(Request {
            scope,
            key,
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            fingerprint: None,
            unit_result: false,
        })
    }

    /// With how long the completed marker blocks duplicates.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// With how long a lease store's claim lives without renewal.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// With the fingerprint that duplicates must match.
    pub fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// With whether the handler's result is `()` (`#[idempotent]` sets it
    /// when the declared `Result<T, E>` has `T` written `()`): a duplicate
    /// then replays `()` whatever the marker stores, so a store need not
    /// read the stored result (see [`needs_read`](Self::needs_read)).
    pub fn with_unit_result(mut self, unit: bool) -> Self {
        self.unit_result = unit;
        self
    }

    /// The namespace of the marker (by default the handler's path).
    pub fn scope(&self) -> &'a str {
        self.scope
    }

    /// The message's key, validated.
    pub fn key(&self) -> &'a str {
        self.key
    }

    /// How long the completed marker blocks duplicates.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long a lease store's claim lives without renewal.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The fingerprint of the message, if the handler declares one.
    pub fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }

    /// Whether the handler's result is `()`, so duplicates replay `()`.
    pub fn unit_result(&self) -> bool {
        self.unit_result
    }

    /// Whether a duplicate must read the stored marker: to check its
    /// fingerprint, or to replay a result other than `()`. When `false` a
    /// store answers a live completed marker with [`Replay::default`]
    /// (`()`) without reading its fingerprint or result.
    pub fn needs_read(&self) -> bool {
        !self.unit_result || self.fingerprint.is_some()
    }

    /// The marker lifetime in whole milliseconds, at least 1.
    pub fn ttl_millis(&self) -> i64 {
        duration_millis(self.ttl)
    }

    /// The lease lifetime in whole milliseconds, at least 1.
    pub fn lease_millis(&self) -> i64 {
        duration_millis(self.lease)
    }

    /// `Error::KeyReused` unless `stored` (the fingerprint kept with the
    /// marker) matches this request's.
    pub fn check_fingerprint(&self, stored: Option<&str>) -> Result<(), Error> {
        match (&self.fingerprint, stored) {
            (Some(mine), stored) if stored != Some(mine.as_str()) => Err(self.key_reused()),
            _ => Ok(()),
        }
    }

    /// The `KeyReused` error for this request.
    pub fn key_reused(&self) -> Error {
        Error::KeyReused {
            scope: self.scope.to_owned(),
            key: crate::error::DisplayKey::new(self.key),
        }
    }

    /// The `InProgress` error for this request.
    pub fn in_progress(&self) -> Error {
        Error::InProgress {
            scope: self.scope.to_owned(),
            key: crate::error::DisplayKey::new(self.key),
        }
    }
}

fn duration_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// Runs `f`, which tells something outside the database that a key is
/// done (the cache of completed keys, the outcome counters), once that is
/// committed: at once after a claim that committed alone, after the commit
/// of the batch whose member this task is (never, if the batch rolls back).
#[inline]
pub(crate) fn when_committed<F: FnOnce() + Send + 'static>(f: F) {
    #[cfg(feature = "sqlx")]
    crate::batch::when_committed(f);
    #[cfg(not(feature = "sqlx"))]
    f();
}

/// The outcome of a claim.
#[derive(Debug)]
pub enum Claim<G> {
    /// This caller owns the key: run the body, then [`Guard::complete`] or
    /// [`Guard::abort`].
    Fresh(G),
    /// The key was already processed: here is what the first run returned.
    Done(Replay),
}

/// The stored result of a completed first run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replay {
    result: Option<String>,
}

impl Replay {
    /// A replay of `result`, the text stored with the marker (`None`
    /// stands for JSON `null`, which is what `()` encodes to).
    pub fn new(result: Option<String>) -> Self {
        Replay { result }
    }

    /// The stored text, `None` for `null`: JSON, or the lossless form
    /// (starting with `~1:`) for a result JSON cannot carry exactly (see
    /// [`Replay::decode`]).
    pub fn json(&self) -> Option<&str> {
        self.result.as_deref()
    }

    /// Decodes the stored result. What `#[idempotent]` stores reads back
    /// exactly: JSON where JSON carries the value (floats read back to the
    /// same bits), otherwise a lossless form that keeps what JSON cannot
    /// (non-finite floats, `Some(None)`, `Some(())`, map keys that are not
    /// strings); a result that would not read back is refused before its
    /// commit.
    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> Result<T, Error> {
        crate::replay::decode(self.result.as_deref())
    }
}

/// A key store: claims keys for handlers and remembers completed ones.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "the `store = ..` expression must give a store",
    note = "use one of `PgStore`, `SqliteStore`, `MySqlStore`, `RedisStore` or `MemoryStore` (or a reference or `Arc` to one)"
)]
pub trait Store: Send + Sync {
    /// The claim held while the body runs.
    type Guard: Guard;

    /// Claims `req`'s key: `Fresh` when this caller must run the body,
    /// `Done` when the key was already processed (after checking the
    /// fingerprint), or an error (`InProgress` for a live lease of another
    /// consumer, `KeyReused`, `Store`).
    fn claim(&self, req: &Request<'_>) -> impl Future<Output = Result<Claim<Self::Guard>, Error>> + Send;

    /// What identifies the markers this store keeps (the database and table,
    /// the key prefix...), interned with
    /// [`intern_namespace`]. In one process,
    /// two different handlers claiming one scope on stores with the same
    /// namespace get [`Error::ScopeConflict`] (see [`crate::scope`]).
    /// `None` (the default) leaves the store out of that check.
    fn namespace(&self) -> Option<&'static str> {
        None
    }
}

/// A claim in progress. Dropping it without `complete` (panic, cancellation)
/// releases it like `abort`: the transaction rolls back, or the lease is
/// given up, so the redelivery can be processed at once.
pub trait Guard: Send {
    /// Stores `result` (JSON, `None` for `null`) with the marker and makes it
    /// durable: commits the transaction, or turns the lease into a completed
    /// marker if this caller still holds it.
    fn complete(self, result: Option<String>) -> impl Future<Output = Result<(), Error>> + Send;

    /// Gives the claim up after the body failed: rolls back, or releases the
    /// lease if this caller still holds it.
    fn abort(self) -> impl Future<Output = ()> + Send;
}

#[cfg(feature = "sqlx")]
/// A store whose claim is a database transaction that the handler's body
/// joins: effect and marker commit or roll back together.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot run the handler in a database transaction",
    label = "this handler takes a transaction parameter, so its store must be transactional",
    note = "Redis and in-memory stores cannot join a database transaction: remove the transaction parameter and make the effect idempotent by design, or use `PgStore`, `SqliteStore` or `MySqlStore`"
)]
pub trait TransactionalStore: Store<Guard: TransactionGuard<Database = Self::Database>> {
    /// The database the transaction runs on.
    type Database: sqlx::Database;
}

#[cfg(feature = "sqlx")]
/// A transactional store whose claims write a handler's outgoing messages
/// into its outbox table, in the marker's transaction
/// ([`TransactionGuard::stage`]): what a handler taking an
/// [`Outbox`](crate::outbox::Outbox) needs.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot write outgoing messages in the marker's transaction",
    label = "this handler takes an outbox, so its store must keep an outbox table in the marker's database",
    note = "the outbox's rows commit with the marker and the effect: use `PgStore`, `SqliteStore` or `MySqlStore` (Redis and in-memory stores cannot join a database transaction)"
)]
pub trait StagesOutbox: TransactionalStore {}

#[cfg(feature = "sqlx")]
/// The claim of a transactional store: an open transaction holding the
/// freshly inserted marker.
pub trait TransactionGuard: Guard {
    /// The database of the transaction.
    type Database: sqlx::Database;

    /// The open transaction, for the handler's body.
    fn transaction(&mut self) -> &mut sqlx::Transaction<'static, Self::Database>;

    /// Writes the handler's outgoing messages into the store's outbox, in
    /// this transaction (before [`Guard::complete`] commits it). Stores
    /// without an outbox refuse any message.
    fn stage(&mut self, outbox: crate::outbox::Outbox) -> impl Future<Output = Result<(), Error>> + Send {
        let refused = if outbox.is_empty() {
            Ok(())
        } else {
            Err(Error::Config("this store keeps no outbox".into()))
        };
        std::future::ready(refused)
    }
}

#[cfg(feature = "sqlx")]
/// A type a handler's transaction parameter can have for a store of
/// database `DB`: `&mut sqlx::Transaction<'_, DB>` or `&mut DB`'s connection.
#[diagnostic::on_unimplemented(
    message = "the transaction parameter `{Self}` does not belong to the store's database `{DB}`",
    label = "this parameter must be a transaction or connection of `{DB}`",
    note = "use `&mut sqlx::Transaction<'_, {DB}>` or the `&mut` connection type of `{DB}`, or a store for the database this handler writes to"
)]
pub trait FromTransaction<'a, DB: sqlx::Database>: Sized {
    /// Borrows the transaction as the handler's parameter type.
    fn from_transaction(tx: &'a mut sqlx::Transaction<'static, DB>) -> Self;
}

#[cfg(feature = "sqlx")]
impl<'a, DB: sqlx::Database> FromTransaction<'a, DB> for &'a mut sqlx::Transaction<'static, DB> {
    fn from_transaction(tx: &'a mut sqlx::Transaction<'static, DB>) -> Self {
        tx
    }
}

macro_rules! connection_param {
    ($feature:literal, $db:ty, $conn:ty) => {
        #[cfg(feature = $feature)]
        impl<'a> FromTransaction<'a, $db> for &'a mut $conn {
            fn from_transaction(tx: &'a mut sqlx::Transaction<'static, $db>) -> Self {
                &mut **tx
            }
        }
    };
}
connection_param!("postgres", sqlx::Postgres, sqlx::PgConnection);
connection_param!("sqlite", sqlx::Sqlite, sqlx::SqliteConnection);
connection_param!("mysql", sqlx::MySql, sqlx::MySqlConnection);

macro_rules! forward_store {
    ($($ptr:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $ptr {
            type Guard = S::Guard;
            fn claim(&self, req: &Request<'_>) -> impl Future<Output = Result<Claim<Self::Guard>, Error>> + Send {
                (**self).claim(req)
            }
            fn namespace(&self) -> Option<&'static str> {
                (**self).namespace()
            }
        }

        #[cfg(feature = "sqlx")]
        impl<S: TransactionalStore + ?Sized> TransactionalStore for $ptr {
            type Database = S::Database;
        }

        #[cfg(feature = "sqlx")]
        impl<S: StagesOutbox + ?Sized> StagesOutbox for $ptr {}
    )*};
}
forward_store!(&S, std::sync::Arc<S>);

pub use crate::fingerprint::Fingerprint;
pub use crate::janitor::{JanitorLock, PurgeExpired};
pub use crate::scope::intern_namespace;
pub use crate::table::{MAX_TABLE_NAME_BYTES, TableName};
pub use cached::{CacheStats, CachedGuard, CachedStore, DEFAULT_CACHE_MAX_AGE};
#[cfg(all(feature = "kafka", feature = "sqlx"))]
pub use kafka_offsets::DEFAULT_KAFKA_OFFSETS_TABLE;
pub use memory::{MemoryGuard, MemoryStore};
#[cfg(feature = "mysql")]
pub use mysql::outbox::MySqlOutboxBatch;
#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::outbox::PgOutboxBatch;
#[cfg(feature = "postgres")]
pub use postgres::{PgBuilderSettings, PgStore, PgStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{NotReplicated, RedisGuard, RedisStore, RedisStoreBuilder};
#[cfg(feature = "sqlx")]
pub use sql::{DEFAULT_OUTBOX_RETENTION, DEFAULT_OUTBOX_TABLE, DEFAULT_PURGE_BATCH, SqlGuard, SqlStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sqlite::outbox::SqliteOutboxBatch;
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteStoreBuilder};

#[cfg(feature = "sqlx")]
pub(crate) mod backend;
pub(crate) mod cached;
#[cfg(all(feature = "kafka", feature = "sqlx"))]
pub(crate) mod kafka_offsets;
pub(crate) mod memory;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "redis")]
pub(crate) mod redis_conn;
#[cfg(feature = "redis")]
mod redis_renewal;
#[cfg(feature = "sqlx")]
pub(crate) mod sql;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
#[cfg(feature = "sqlx")]
pub(crate) mod tx;
