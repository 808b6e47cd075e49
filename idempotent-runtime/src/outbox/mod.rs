//! Outgoing messages: a handler's messages to other services, published
//! exactly once and atomically with its effect (the transactional outbox).
//!
//! An `#[idempotent]` handler with a transactional store takes an
//! `outbox: &mut Outbox` parameter (removed from the signature, like the
//! transaction) and stages messages on it. When the body returns `Ok`, the
//! staged messages are written to the store's outbox table **in the
//! marker's transaction**: effect, marker and outgoing messages commit
//! together or not at all. A duplicate stages nothing (the first run's
//! messages are already committed).
//!
//! A [`Relay`] publishes committed rows to a broker ([`Publisher`]:
//! RabbitMQ, NATS JetStream, Redis Streams) and marks them dispatched only
//! after the broker confirmed; a crash between the publish and the mark
//! publishes the row again with the same message id, which the consumers
//! downstream (idempotent themselves) recognise. Several relays can run at
//! once (rows are taken with `FOR UPDATE SKIP LOCKED`, or leased on
//! SQLite); messages given an ordering key are published, per key, in the
//! order their transactions committed, which is the order they were
//! inserted (a transaction staging a key holds that key's lock until it
//! ends; see [`Outgoing::ordered_by`]).
//! The relay is woken right after a commit that staged messages in the same
//! process, and polls for rows left by processes that died. The
//! [`Janitor`](crate::Janitor) deletes dispatched rows once they are older
//! than the store's `outbox_retention`.
//!
//! ```no_run
//! use idempotent_runtime::outbox::{Outbox, Outgoing};
//! use idempotent_runtime::sqlx::{self, PgConnection};
//! use idempotent_runtime::{PgStore, idempotent};
//!
//! #[derive(serde::Deserialize)]
//! struct Payment { message_id: String, order_id: String, amount: i64 }
//!
//! #[derive(serde::Serialize)]
//! struct PaymentCharged<'a> { order_id: &'a str, amount: i64 }
//!
//! #[derive(Debug, thiserror::Error)]
//! enum AppError {
//!     #[error(transparent)] Idempotency(#[from] idempotent_runtime::Error),
//!     #[error(transparent)] Database(#[from] sqlx::Error),
//! }
//!
//! struct Payments { store: PgStore }
//!
//! impl Payments {
//!     #[idempotent(key = "msg.message_id", store = self.store, scope = "payments.charge")]
//!     async fn charge(&self, msg: &Payment, tx: &mut PgConnection, outbox: &mut Outbox) -> Result<(), AppError> {
//!         sqlx::query("INSERT INTO payments (order_id, amount) VALUES ($1, $2)")
//!             .bind(&msg.order_id)
//!             .bind(msg.amount)
//!             .execute(&mut *tx)
//!             .await?;
//!         let event = PaymentCharged { order_id: &msg.order_id, amount: msg.amount };
//!         outbox.publish(Outgoing::json("payment.charged", &event)?.ordered_by(&msg.order_id));
//!         Ok(())
//!     }
//! }
//! ```

use std::fmt;

use serde::Serialize;

use crate::Error;

mod relay;

pub use relay::{
    OutboxBatch, OutboxRow, OutboxStats, OutboxStore, PublishError, Publisher, Relay, RelayBuilder, RelayHandle,
};

// The relay's publishers live beside their broker's consumer.
#[cfg(feature = "kafka")]
pub use crate::broker::kafka::publisher::KafkaPublisher;
#[cfg(feature = "nats")]
pub use crate::broker::nats::publisher::JetStreamPublisher;
#[cfg(feature = "rabbitmq")]
pub use crate::broker::rabbitmq::publisher::RabbitPublisher;
#[cfg(feature = "redis-streams")]
pub use crate::broker::redis_streams::publisher::StreamPublisher;

/// The longest destination, ordering key or message id, in bytes.
pub const MAX_OUTBOX_NAME_BYTES: usize = 255;

/// A message to publish once the handler's transaction commits.
#[derive(Clone, PartialEq, Eq)]
pub struct Outgoing {
    destination: String,
    payload: Vec<u8>,
    message_id: Option<String>,
    ordering_key: Option<String>,
    headers: Vec<(String, String)>,
}

impl fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outgoing")
            .field("destination", &self.destination)
            .field("message_id", &self.message_id)
            .field("ordering_key", &self.ordering_key)
            .field("payload_bytes", &self.payload.len())
            .finish_non_exhaustive()
    }
}

impl Outgoing {
    /// A message with `payload` for `destination`: a routing key (RabbitMQ,
    /// on the publisher's exchange), a subject (NATS) or a stream (Redis).
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Outgoing {
        Outgoing {
            destination: destination.into(),
            payload: payload.into(),
            message_id: None,
            ordering_key: None,
            headers: Vec::new(),
        }
    }

    /// A message whose payload is `value` as JSON.
    pub fn json<T: Serialize + ?Sized>(destination: impl Into<String>, value: &T) -> Result<Outgoing, Error> {
        Ok(Outgoing::new(
            destination,
            serde_json::to_vec(value).map_err(Error::Codec)?,
        ))
    }

    /// Its message id (default: derived from the handler's scope, the
    /// incoming message's key and the message's place among those staged,
    /// so it is the same however often it is published).
    pub fn message_id(mut self, id: impl Into<String>) -> Outgoing {
        self.message_id = Some(id.into());
        self
    }

    /// Publishes it after every earlier message with the same `key`
    /// (staged by any handler), and holds the later ones back while it
    /// cannot be published. Per key, messages are published in the order
    /// their transactions committed (staging a key waits for another open
    /// transaction that staged the same key; other keys never wait).
    pub fn ordered_by(mut self, key: impl Into<String>) -> Outgoing {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds a header (an AMQP header, a NATS header, a Redis field).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Outgoing {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Where it goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// What it carries.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// What a handler stages its outgoing messages on: written in the marker's
/// transaction when the body returns `Ok`.
#[derive(Debug, Default)]
pub struct Outbox {
    staged: Vec<Outgoing>,
}

impl Outbox {
    /// An empty outbox (the expansion makes one per call).
    pub fn new() -> Outbox {
        Outbox::default()
    }

    /// Stages `message`: it is published once the handler's transaction
    /// commits, and never if it rolls back.
    pub fn publish(&mut self, message: Outgoing) {
        self.staged.push(message);
    }

    /// How many messages are staged.
    pub fn len(&self) -> usize {
        self.staged.len()
    }

    /// `true` when nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.staged.is_empty()
    }

    /// The rows to write for a call of `scope` on `key`: validated, with
    /// their message ids.
    pub(crate) fn into_rows(self, scope: &str, key: &str) -> Result<Vec<StagedRow>, Error> {
        self.staged
            .into_iter()
            .enumerate()
            .map(|(index, message)| StagedRow::new(message, scope, key, index))
            .collect()
    }
}

/// A staged message as the store writes it.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct StagedRow {
    pub(crate) message_id: String,
    pub(crate) destination: String,
    pub(crate) ordering_key: Option<String>,
    /// JSON object of the headers.
    pub(crate) headers: String,
    pub(crate) payload: Vec<u8>,
}

impl StagedRow {
    fn new(message: Outgoing, scope: &str, key: &str, index: usize) -> Result<StagedRow, Error> {
        let invalid = |what: &str, value: &str| {
            Error::Config(format!(
                "outgoing message {what} {value:?} must be 1 to {MAX_OUTBOX_NAME_BYTES} bytes"
            ))
        };
        let check = |what: &str, value: &str| {
            if value.is_empty() || value.len() > MAX_OUTBOX_NAME_BYTES || value.contains('\0') {
                Err(invalid(what, value))
            } else {
                Ok(())
            }
        };
        check("destination", &message.destination)?;
        if let Some(id) = &message.message_id {
            check("id", id)?;
        }
        if let Some(ordering_key) = &message.ordering_key {
            check("ordering key", ordering_key)?;
        }
        let message_id = message
            .message_id
            .unwrap_or_else(|| derived_message_id(scope, key, index));
        let headers: serde_json::Map<String, serde_json::Value> = message
            .headers
            .into_iter()
            .map(|(name, value)| (name, serde_json::Value::String(value)))
            .collect();
        Ok(StagedRow {
            message_id,
            destination: message.destination,
            ordering_key: message.ordering_key,
            headers: serde_json::Value::Object(headers).to_string(),
            payload: message.payload,
        })
    }
}

/// The distinct ordering keys of `rows`, in byte order: the keys whose
/// lock a stager takes before it inserts them (each SQL backend's
/// `stage_outbox`, with its own statement), so that per ordering key the
/// rows are inserted in the order their transactions commit.
///
/// The lock is held until the stager's transaction ends: a second
/// transaction staging the same key waits there, *before* its insert, so
/// its row gets a later id and becomes visible after the first one's.
/// Taking them in one order (bytes, the order of the keys' index) keeps two
/// stagers of the same keys from waiting on each other in a cycle.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn ordering_keys(rows: &[StagedRow]) -> Vec<&str> {
    let mut keys: Vec<&str> = rows.iter().filter_map(|row| row.ordering_key.as_deref()).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// The id of the `index`-th message staged by `scope` for `key`.
fn derived_message_id(scope: &str, key: &str, index: usize) -> String {
    crate::key::digest_hex(&[scope.as_bytes(), key.as_bytes(), index.to_string().as_bytes()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_rows_get_stable_distinct_ids_and_checked_names() {
        let mut outbox = Outbox::new();
        outbox.publish(Outgoing::new("a", b"1".to_vec()));
        outbox.publish(Outgoing::new("a", b"2".to_vec()).header("h", "v"));
        outbox.publish(Outgoing::new("b", b"3".to_vec()).message_id("mine"));
        let rows = outbox.into_rows("scope", "key").unwrap();
        assert_ne!(rows[0].message_id, rows[1].message_id);
        assert_eq!(rows[0].message_id, derived_message_id("scope", "key", 0));
        assert_ne!(rows[0].message_id, derived_message_id("scope", "key2", 0));
        assert_eq!(rows[2].message_id, "mine");
        assert_eq!(rows[1].headers, r#"{"h":"v"}"#);
        let mut keyed = Outbox::new();
        for key in ["b", "a", "b"] {
            keyed.publish(Outgoing::new("d", b"x".to_vec()).ordered_by(key));
        }
        keyed.publish(Outgoing::new("d", b"x".to_vec()));
        let keyed = keyed.into_rows("s", "k").unwrap();
        assert_eq!(ordering_keys(&keyed), ["a", "b"], "distinct, in byte order");
        let mut bad = Outbox::new();
        bad.publish(Outgoing::new("", b"x".to_vec()));
        assert!(matches!(bad.into_rows("s", "k"), Err(Error::Config(_))));
    }
}
