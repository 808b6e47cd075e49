//! Publishing to Kafka from the outbox relay ([`KafkaPublisher`],
//! re-exported as `outbox::KafkaPublisher`), beside the consumer that reads
//! what it publishes.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::DEFAULT_MESSAGE_ID_HEADER;
use crate::outbox::{OutboxRow, PublishError, Publisher};

/// Header of a published record holding its outbox row's id (the row's
/// order in its store).
pub const HEADER_OUTBOX_ROW: &str = "x-idempotent-outbox-row";

/// How long a record may wait in the producer's queue before its publish
/// fails (and the relay tries again later).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes outbox rows to Kafka with an idempotent producer
/// (`enable.idempotence=true`, so librdkafka's own retries write a record
/// once): the destination is the topic, the row's ordering key (if any) is
/// the record's key, so the rows sharing it land in one partition in their
/// order; the row's message id goes in the `message_id` header (what a
/// [`KafkaConsumer`](crate::kafka::KafkaConsumer) reports as the message
/// id) and its row id in [`HEADER_OUTBOX_ROW`](crate::kafka::HEADER_OUTBOX_ROW), with the row's headers. A
/// row is dispatched once the partition leader acknowledged it (`acks=all`).
///
/// Kafka does not deduplicate across producer sessions: a row published
/// again (its relay died before marking it) is a second record with the
/// same `message_id`, which the idempotent consumer downstream skips.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher").finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher with the client configuration `config`
    /// (`bootstrap.servers`, security...); it sets
    /// `enable.idempotence=true` and `acks=all`.
    pub fn new(config: &ClientConfig) -> Result<KafkaPublisher, KafkaError> {
        let mut config = config.clone();
        config.set("enable.idempotence", "true").set("acks", "all");
        Ok(KafkaPublisher {
            producer: config.create()?,
        })
    }

    /// A publisher on a producer you configured (keep
    /// `enable.idempotence=true`).
    pub fn from_producer(producer: FutureProducer) -> KafkaPublisher {
        KafkaPublisher { producer }
    }
}

impl Publisher for KafkaPublisher {
    fn system(&self) -> &'static str {
        "kafka"
    }

    async fn publish(&self, row: &OutboxRow) -> Result<(), PublishError> {
        let row_id = row.id.to_string();
        let mut headers = OwnedHeaders::new_with_capacity(row.headers.len() + 2);
        for (name, value) in &row.headers {
            if name != DEFAULT_MESSAGE_ID_HEADER && name != HEADER_OUTBOX_ROW {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
        }
        headers = headers
            .insert(Header {
                key: DEFAULT_MESSAGE_ID_HEADER,
                value: Some(row.message_id.as_bytes()),
            })
            .insert(Header {
                key: HEADER_OUTBOX_ROW,
                value: Some(row_id.as_bytes()),
            });
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&row.destination)
            .payload(row.payload.as_slice())
            .headers(headers);
        if let Some(key) = &row.ordering_key {
            record = record.key(key.as_str());
        }
        self.producer
            .send(record, PUBLISH_TIMEOUT)
            .await
            .map_err(|(err, _)| PublishError(format!("producing to `{}` failed: {err}", row.destination)))?;
        Ok(())
    }
}
