//! The relay's publishers: RabbitMQ (publisher confirms), NATS JetStream
//! (`Nats-Msg-Id`), Redis Streams (`XADD`).

#[cfg(feature = "nats")]
pub use self::nats::JetStreamPublisher;
#[cfg(feature = "rabbitmq")]
pub use self::rabbitmq::RabbitPublisher;
#[cfg(feature = "redis-streams")]
pub use self::redis_streams::StreamPublisher;

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    use std::sync::Arc;

    use lapin::tcp::OwnedTLSConfig;
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use tokio::sync::Mutex;

    use crate::broker::rabbitmq::confirm::{ConfirmedPublisher, Unconfirmed};
    use crate::outbox::{OutboxRow, PublishError, Publisher};

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
    pub struct RabbitPublisher {
        uri: String,
        exchange: String,
        properties: ConnectionProperties,
        tls: OwnedTLSConfig,
        link: Mutex<Option<Arc<ConfirmedPublisher>>>,
    }

    impl std::fmt::Debug for RabbitPublisher {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("RabbitPublisher")
                .field("exchange", &self.exchange)
                .finish_non_exhaustive()
        }
    }

    impl RabbitPublisher {
        /// A publisher to the broker at `uri` (`amqp://` or `amqps://`), on
        /// the default exchange: destinations are queue names.
        pub fn new(uri: impl Into<String>) -> RabbitPublisher {
            RabbitPublisher {
                uri: uri.into(),
                exchange: String::new(),
                properties: ConnectionProperties::default(),
                tls: OwnedTLSConfig::default(),
                link: Mutex::new(None),
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
            let runtime = lapin::runtime::default_runtime()
                .map_err(|err| PublishError(format!("no runtime for lapin: {err}")))?;
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
            if link.as_ref().is_some_and(|current| Arc::ptr_eq(current, stale))
                && !stale.connection().status().connected()
            {
                link.take();
            }
        }
    }

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
}

#[cfg(feature = "nats")]
mod nats {
    use async_nats::HeaderMap;
    use async_nats::jetstream;

    use crate::outbox::{OutboxRow, PublishError, Publisher};

    /// Publishes outbox rows to NATS JetStream: the destination is the
    /// subject, the row's message id goes in `Nats-Msg-Id`, and a row is
    /// dispatched once a stream stored it. A row published again (its
    /// relay died before marking it) within the stream's duplicate window
    /// is dropped by JetStream itself; after it, the idempotent consumers
    /// downstream recognise the id.
    ///
    /// The client reconnects by itself.
    #[derive(Debug, Clone)]
    pub struct JetStreamPublisher {
        context: jetstream::Context,
    }

    impl JetStreamPublisher {
        /// A publisher through `context`.
        pub fn new(context: jetstream::Context) -> JetStreamPublisher {
            JetStreamPublisher { context }
        }
    }

    impl Publisher for JetStreamPublisher {
        fn system(&self) -> &'static str {
            "nats"
        }

        async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
            let mut headers = HeaderMap::new();
            for (name, value) in &row.headers {
                headers.append(name.as_str(), value.as_str());
            }
            headers.insert(async_nats::header::NATS_MESSAGE_ID, row.message_id.as_str());
            // A duplicate ack means the stream holds this very id already:
            // stored, which is all a relay needs.
            self.context
                .publish_with_headers(row.destination.clone(), headers, row.payload.clone().into())
                .await
                .map_err(|err| PublishError(format!("publishing to NATS failed: {err}")))?
                .await
                .map_err(|err| PublishError(format!("JetStream did not store the message: {err}")))?;
            Ok(())
        }
    }
}

#[cfg(feature = "redis-streams")]
mod redis_streams {
    use redis::aio::ConnectionManager;

    use crate::outbox::{OutboxRow, PublishError, Publisher};

    /// Publishes outbox rows to Redis Streams: `XADD <destination> *
    /// message_id <id> body <payload>` followed by the headers as fields,
    /// which is what a [`StreamConsumer`](crate::broker::redis_streams::StreamConsumer)
    /// reads by default. Redis does not deduplicate: a row published again
    /// (its relay died before marking it) is a second entry with the same
    /// `message_id`, which the idempotent consumer downstream skips.
    #[derive(Clone)]
    pub struct StreamPublisher {
        conn: ConnectionManager,
        max_len: Option<usize>,
    }

    impl std::fmt::Debug for StreamPublisher {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("StreamPublisher")
                .field("max_len", &self.max_len)
                .finish_non_exhaustive()
        }
    }

    impl StreamPublisher {
        /// A publisher on `conn`.
        pub fn new(conn: ConnectionManager) -> StreamPublisher {
            StreamPublisher { conn, max_len: None }
        }

        /// Trims each stream to about `entries` as it adds
        /// (`MAXLEN ~ entries`); keep it well above what consumer groups
        /// may still need.
        pub fn max_len(mut self, entries: usize) -> StreamPublisher {
            self.max_len = Some(entries);
            self
        }
    }

    impl Publisher for StreamPublisher {
        fn system(&self) -> &'static str {
            "redis"
        }

        async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
            let mut xadd = redis::cmd("XADD");
            xadd.arg(&row.destination);
            if let Some(max_len) = self.max_len {
                xadd.arg("MAXLEN").arg("~").arg(max_len);
            }
            xadd.arg("*")
                .arg("message_id")
                .arg(&row.message_id)
                .arg("body")
                .arg(&row.payload);
            for (name, value) in &row.headers {
                if name != "message_id" && name != "body" {
                    xadd.arg(name).arg(value);
                }
            }
            let mut conn = self.conn.clone();
            let _id: String = xadd
                .query_async(&mut conn)
                .await
                .map_err(|err| PublishError(format!("XADD to `{}` failed: {err}", row.destination)))?;
            Ok(())
        }
    }
}
