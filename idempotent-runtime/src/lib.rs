//! Idempotent message consumers: process each message once, whatever the
//! broker redelivers.
//!
//! Annotate an async handler with [`#[idempotent]`](idempotent) and give it a
//! key and a store. The handler's body then runs in a database transaction
//! together with the insert of a "processed" marker; a duplicate of a
//! processed message does not run the body and answers with the first run's
//! result.
//!
//! ```no_run
//! use idempotent_runtime::{idempotent, PgStore};
//! use idempotent_runtime::sqlx::PgConnection;
//!
//! struct PaymentMessage { message_id: String, order_id: String, amount: i64 }
//!
//! #[derive(Debug, thiserror::Error)]
//! enum AppError {
//!     #[error(transparent)] Idempotency(#[from] idempotent_runtime::Error),
//!     #[error(transparent)] Db(#[from] idempotent_runtime::sqlx::Error),
//! }
//!
//! struct PaymentConsumer { store: PgStore }
//!
//! impl PaymentConsumer {
//!     #[idempotent(key = "msg.message_id", store = self.store)]
//!     async fn process_payment(&self, msg: &PaymentMessage, tx: &mut PgConnection) -> Result<(), AppError> {
//!         idempotent_runtime::sqlx::query("INSERT INTO payments (order_id, amount) VALUES ($1, $2)")
//!             .bind(&msg.order_id)
//!             .bind(msg.amount)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//! // After expansion: async fn process_payment(&self, msg: &PaymentMessage) -> Result<(), AppError>
//! ```
//!
//! # Stores
//!
//! | store | feature | joins the transaction | concurrent duplicate |
//! | --- | --- | --- | --- |
//! | [`PgStore`] | `postgres` | yes | waits, then replays |
//! | [`SqliteStore`] | `sqlite` | yes | waits, then replays |
//! | `MySqlStore` | `mysql` | yes | waits, then replays |
//! | `RedisStore` | `redis` (`redis-cluster` for Redis Cluster) | no (lease) | [`Error::InProgress`] |
//! | [`MemoryStore`] | always | no (lease) | [`Error::InProgress`] |
//!
//! Stores that cannot join a transaction hold a lease while the body runs;
//! the body's effects are then not atomic with the marker and must be
//! idempotent by design.
//!
//! # HTTP endpoints
//!
//! With the `axum` feature, [`http::IdempotencyLayer`] gives POST endpoints
//! the same guarantee through the `Idempotency-Key` header, on the same
//! stores, and [`http::IdempotentTx`] lets an axum handler write in the
//! transaction that keeps its answer.
//!
//! # TLS
//!
//! The `tls-rustls` feature turns on rustls (with the *ring* provider) in
//! every re-exported driver whose feature is on: `sqlx` (`sslmode=verify-full`,
//! `ssl-mode=VERIFY_IDENTITY`), `redis` (`rediss://`); `lapin` (`amqps://`)
//! and `async_nats` (`tls://`) speak TLS with rustls and ring in any case.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
// `sqlx` is the internal feature the SQL stores turn on; on its own it
// builds their shared layer (the claim guard, batches, the outbox) with no
// store to use it, so that layer's crate-private parts are dead there and
// only there. Any store feature uses all of it.
#![cfg_attr(
    all(
        feature = "sqlx",
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite"))
    ),
    allow(dead_code, unused_imports, unused_macros)
)]

#[cfg(any(
    feature = "sqlx",
    feature = "rabbitmq",
    feature = "nats",
    feature = "redis-streams",
    feature = "kafka"
))]
mod backoff;
#[cfg(feature = "sqlx")]
pub mod batch;
mod call;
pub mod error;
mod fingerprint;
#[cfg(feature = "axum")]
pub mod http;
mod janitor;
mod key;
#[cfg(feature = "sqlx")]
pub mod outbox;
mod replay;
pub mod scope;
mod signal;
pub mod store;
mod table;

#[doc(hidden)]
pub mod __private;

// What handler authors use: the attribute, its error, key types, the stores
// and the janitor. Store authors find the traits in `store`.
pub use error::Error;
pub use idempotent_macros::idempotent;
pub use janitor::Janitor;
pub use key::{IdempotencyKey, MAX_KEY_BYTES, MAX_SCOPE_BYTES};
pub use store::{CachedStore, DEFAULT_LEASE, DEFAULT_TTL, MemoryStore};

#[cfg(feature = "mysql")]
pub use store::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::PgStore;
#[cfg(feature = "redis")]
pub use store::RedisStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;

#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams", feature = "kafka"))]
pub mod broker;
#[cfg(feature = "kafka")]
pub use broker::kafka;
#[cfg(feature = "nats")]
pub use broker::nats;
#[cfg(feature = "rabbitmq")]
pub use broker::rabbitmq;
#[cfg(feature = "redis-streams")]
pub use broker::redis_streams;

/// The sqlx crate the stores are built on (features `postgres`, `sqlite`,
/// `mysql`), so handlers use the very same version.
#[cfg(feature = "sqlx")]
pub use sqlx;

#[cfg(feature = "uuid")]
pub use uuid;

/// The axum crate the HTTP layer ([`http`]) is built for (feature `axum`),
/// so handlers and the layer agree on its version.
#[cfg(feature = "axum")]
pub use axum;

/// The tower crate of the HTTP layer's `Layer` and `Service` traits.
#[cfg(feature = "axum")]
pub use tower;

/// The redis crate [`RedisStore`] is built on.
#[cfg(feature = "redis")]
pub use redis;

/// The lapin crate the RabbitMQ adapter is built on.
#[cfg(feature = "rabbitmq")]
pub use lapin;

/// The async-nats crate the NATS JetStream adapter is built on.
#[cfg(feature = "nats")]
pub use async_nats;

/// The rdkafka crate (librdkafka) the Kafka adapter is built on.
#[cfg(feature = "kafka")]
pub use rdkafka;
