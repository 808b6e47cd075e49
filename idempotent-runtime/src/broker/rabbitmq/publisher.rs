//! Publishing to RabbitMQ, for the consumer (retries, dead letters) and the
//! outbox relay ([`RabbitPublisher`]) alike: one confirmed publish,
//! [`ConfirmedPublisher::publish`], each publish's outcome its own.
//!
//! A `mandatory` message no queue takes comes back as a `basic.return`,
//! sent by the broker before the `basic.ack` of the same publish. lapin 4
//! does not tie the returned message to its publish: it queues it on the
//! channel and hands it to whichever confirmation it resolves next, and a
//! `multiple` ack resolves its confirmations in hash-map order. With several
//! publishes in flight on one channel, an unroutable message can so be
//! reported as confirmed and routed (and its row marked dispatched, or the
//! original of its dead letter acknowledged: lost), and a routed one as
//! returned. lapin gives no way to learn, once a confirmation resolved,
//! whether another one took its returned message.
//!
//! So each publish has a channel to itself until its confirmation arrives:
//! a pool of confirm-mode channels on one connection, one publish in flight
//! on each, as many channels as publishes at once (up to a bound). A
//! confirmation can then only carry its own publish's returned message. A
//! channel whose publish did not end with a confirmation (it failed, or the
//! caller stopped waiting) is never used again: dropping it closes it.

use std::fmt;
#[cfg(feature = "sqlx")]
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard};

#[cfg(feature = "sqlx")]
use lapin::ConnectionProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
#[cfg(feature = "sqlx")]
use lapin::tcp::OwnedTLSConfig;
use lapin::types::ShortString;
#[cfg(feature = "sqlx")]
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::Semaphore;

#[cfg(feature = "sqlx")]
use crate::outbox::{OutboxRow, PublishError, Publisher};

/// At most this many publishes in flight (so channels) per connection,
/// fewer when the broker allows fewer channels.
const MAX_CHANNELS: usize = 256;

/// Why a publish is not known to be stored by the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unconfirmed {
    /// No queue took the message: the broker returned it.
    Returned {
        /// The broker's reply code (312 `NO_ROUTE`).
        reply_code: u16,
        /// The broker's reply text.
        reply_text: String,
    },
    /// The broker refused the message (`basic.nack`).
    Nacked,
    /// The channel answered without a confirmation: it was not in confirm
    /// mode, so nothing says the broker holds the message.
    NotConfirmed,
    /// The channel or the connection failed before the confirmation.
    Failed(String),
}

impl fmt::Display for Unconfirmed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unconfirmed::Returned { reply_code, reply_text } => {
                write!(f, "the broker returned the message: {reply_code} {reply_text}")
            }
            Unconfirmed::Nacked => f.write_str("the broker refused the message (nack)"),
            Unconfirmed::NotConfirmed => f.write_str("the broker did not confirm the message"),
            Unconfirmed::Failed(why) => f.write_str(why),
        }
    }
}

/// What a confirmation of a `mandatory` publish on a channel with one
/// publish in flight says about that publish.
///
/// `NotRequested` is an error, not a success: only a channel that is not in
/// confirm mode answers it, and then nothing says the broker holds the
/// message (treating it as stored would acknowledge an original, or mark a
/// row dispatched, whose copy may be lost).
fn outcome(confirmation: Confirmation) -> Result<(), Unconfirmed> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(Unconfirmed::Returned {
            reply_code: returned.reply_code,
            reply_text: returned.reply_text.to_string(),
        }),
        Confirmation::Nack(_) => Err(Unconfirmed::Nacked),
        Confirmation::NotRequested => Err(Unconfirmed::NotConfirmed),
    }
}

/// A connection and its pool of confirm-mode publishing channels; see the
/// [module documentation](self).
pub(crate) struct ConfirmedPublisher {
    conn: Connection,
    /// Channels in confirm mode with no publish in flight.
    idle: Mutex<Vec<Channel>>,
    /// One permit per publish in flight.
    room: Semaphore,
}

impl fmt::Debug for ConfirmedPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConfirmedPublisher")
            .field("idle", &self.lock_idle().len())
            .finish_non_exhaustive()
    }
}

impl ConfirmedPublisher {
    /// Publishes on channels of `conn` (opened as needed).
    pub(crate) fn new(conn: Connection) -> ConfirmedPublisher {
        // Leaves a few channels for the caller's own (consuming, checking).
        let room = match usize::from(conn.configuration().channel_max()) {
            0 => MAX_CHANNELS,
            max => max.saturating_sub(8).clamp(1, MAX_CHANNELS),
        };
        ConfirmedPublisher {
            conn,
            idle: Mutex::new(Vec::new()),
            room: Semaphore::new(room),
        }
    }

    /// The connection.
    pub(crate) fn connection(&self) -> &Connection {
        &self.conn
    }

    fn lock_idle(&self) -> MutexGuard<'_, Vec<Channel>> {
        // The vector is consistent whatever panicked while holding it.
        self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An idle channel, or a new one in confirm mode.
    async fn channel(&self) -> Result<Channel, Unconfirmed> {
        loop {
            let Some(channel) = self.lock_idle().pop() else {
                break;
            };
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        let failed = |err: lapin::Error| Unconfirmed::Failed(format!("cannot open a RabbitMQ channel: {err}"));
        let channel = self.conn.create_channel().await.map_err(failed)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(failed)?;
        Ok(channel)
    }

    /// Publishes `payload` with `mandatory` and waits for the broker's
    /// confirmation of this very message: `Ok` only once the broker
    /// confirmed it and routed it to at least one queue.
    pub(crate) async fn publish(
        &self,
        exchange: ShortString,
        routing_key: ShortString,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), Unconfirmed> {
        let _permit = self
            .room
            .acquire()
            .await
            .map_err(|_| Unconfirmed::Failed("the RabbitMQ publisher is closed".into()))?;
        // Dropped without going back to the pool unless its publish ended
        // with a confirmation (a cancelled or failed publish may leave one
        // in flight on it).
        let channel = self.channel().await?;
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let confirmation = async {
            channel
                .basic_publish(exchange, routing_key, options, payload, properties)
                .await?
                .await
        }
        .await
        .map_err(|err| Unconfirmed::Failed(format!("publishing to RabbitMQ failed: {err}")))?;
        let outcome = outcome(confirmation);
        if outcome != Err(Unconfirmed::NotConfirmed) {
            self.lock_idle().push(channel);
        }
        outcome
    }
}

/// Publishes outbox rows to RabbitMQ: on an exchange (the default
/// exchange unless [`exchange`](Self::exchange) names one) with the
/// row's destination as routing key, persistent, with the row's
/// `message_id`, and `mandatory`: a row is dispatched only once the
/// broker confirmed it *and* routed it to a queue (an unroutable
/// message is returned and the row retried, not silently dropped).
/// Each row's outcome is its own, however many rows are in flight:
/// every publish has a channel of the connection to itself until the
/// broker confirmed it.
///
/// It connects on the first publish and again after a lost connection.
///
/// ```no_run
/// # async fn run(store: idempotent_runtime::PgStore) {
/// use idempotent_runtime::outbox::{RabbitPublisher, Relay};
/// let publisher = RabbitPublisher::new("amqp://127.0.0.1:5672/%2f").exchange("events");
/// let relay = Relay::builder(store, publisher).spawn();
/// # relay.shutdown().await;
/// # }
/// ```
#[cfg(feature = "sqlx")]
pub struct RabbitPublisher {
    uri: String,
    exchange: String,
    properties: ConnectionProperties,
    tls: OwnedTLSConfig,
    link: tokio::sync::Mutex<Option<Arc<ConfirmedPublisher>>>,
}

#[cfg(feature = "sqlx")]
impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "sqlx")]
impl RabbitPublisher {
    /// A publisher to the broker at `uri` (`amqp://` or `amqps://`), on
    /// the default exchange: destinations are queue names.
    pub fn new(uri: impl Into<String>) -> RabbitPublisher {
        RabbitPublisher {
            uri: uri.into(),
            exchange: String::new(),
            properties: ConnectionProperties::default(),
            tls: OwnedTLSConfig::default(),
            link: tokio::sync::Mutex::new(None),
        }
    }

    /// Publishes on `exchange`: destinations are its routing keys.
    pub fn exchange(mut self, exchange: impl Into<String>) -> RabbitPublisher {
        self.exchange = exchange.into();
        self
    }

    /// The TLS settings of an `amqps://` connection (feature
    /// `tls-rustls`).
    pub fn tls_config(mut self, tls: OwnedTLSConfig) -> RabbitPublisher {
        self.tls = tls;
        self
    }

    /// The open connection, connecting first if there is none.
    async fn link(&self) -> Result<Arc<ConfirmedPublisher>, PublishError> {
        let mut link = self.link.lock().await;
        if let Some(publisher) = link.as_ref()
            && publisher.connection().status().connected()
        {
            return Ok(Arc::clone(publisher));
        }
        let runtime =
            lapin::runtime::default_runtime().map_err(|err| PublishError(format!("no runtime for lapin: {err}")))?;
        let conn = Connection::connect_with_config(&self.uri, self.properties.clone(), self.tls.clone(), runtime)
            .await
            .map_err(|err| PublishError(format!("cannot connect to RabbitMQ: {err}")))?;
        let publisher = Arc::new(ConfirmedPublisher::new(conn));
        *link = Some(Arc::clone(&publisher));
        Ok(publisher)
    }

    /// Forgets `stale`'s connection once it is lost (not a newer one).
    async fn forget(&self, stale: &Arc<ConfirmedPublisher>) {
        let mut link = self.link.lock().await;
        if link.as_ref().is_some_and(|current| Arc::ptr_eq(current, stale)) && !stale.connection().status().connected()
        {
            link.take();
        }
    }
}

#[cfg(feature = "sqlx")]
impl Publisher for RabbitPublisher {
    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    /// `{exchange}:{routing key}`, as OpenTelemetry's RabbitMQ
    /// conventions put it on the producer side (the routing key alone
    /// on the default exchange).
    fn destination_name(&self, row: &OutboxRow) -> String {
        match (self.exchange.as_str(), row.destination.as_str()) {
            ("", "") => "amq.default".to_owned(),
            ("", key) => key.to_owned(),
            (exchange, "") => exchange.to_owned(),
            (exchange, key) => format!("{exchange}:{key}"),
        }
    }

    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        let publisher = self.link().await?;
        let mut headers = FieldTable::default();
        for (name, value) in &row.headers {
            headers.insert(
                ShortString::from(name.as_str()),
                AMQPValue::LongString(LongString::from(value.as_bytes())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(row.message_id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let published = publisher
            .publish(
                self.exchange.as_str().into(),
                row.destination.as_str().into(),
                &row.payload,
                properties,
            )
            .await;
        match published {
            Ok(()) => Ok(()),
            Err(Unconfirmed::Returned { .. }) => Err(PublishError(format!(
                "no queue is bound to routing key `{}` on exchange `{}`: the message was returned",
                row.destination, self.exchange
            ))),
            Err(Unconfirmed::Nacked) => Err(PublishError("RabbitMQ refused the message (nack)".into())),
            Err(Unconfirmed::NotConfirmed) => Err(PublishError("RabbitMQ did not confirm the message".into())),
            Err(Unconfirmed::Failed(why)) => {
                self.forget(&publisher).await;
                Err(PublishError(why))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_ack_without_a_returned_message_is_a_success() {
        assert_eq!(outcome(Confirmation::Ack(None)), Ok(()));
        assert_eq!(outcome(Confirmation::Nack(None)), Err(Unconfirmed::Nacked));
        // A channel that is not in confirm mode: the broker may not hold
        // the message, so the publish is not a success.
        assert_eq!(outcome(Confirmation::NotRequested), Err(Unconfirmed::NotConfirmed));
    }

    /// The consumer's retries and dead letters and the outbox relay publish
    /// through this one function: a publish that got no confirmation
    /// proves nothing, for either of them.
    #[test]
    fn a_publish_without_a_confirmation_is_not_stored() {
        let unconfirmed = outcome(Confirmation::NotRequested);
        assert!(unconfirmed.is_err(), "NotRequested accepted as stored");
        assert_eq!(
            unconfirmed.map_err(|why| why.to_string()),
            Err("the broker did not confirm the message".to_owned())
        );
    }

    #[test]
    fn the_reasons_read_well() {
        let returned = Unconfirmed::Returned {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        };
        assert_eq!(returned.to_string(), "the broker returned the message: 312 NO_ROUTE");
        assert_eq!(Unconfirmed::Nacked.to_string(), "the broker refused the message (nack)");
    }
}
