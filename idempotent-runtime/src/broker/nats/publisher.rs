//! Publishing to NATS JetStream from the outbox relay
//! ([`JetStreamPublisher`], re-exported as `outbox::JetStreamPublisher`),
//! beside the consumer that reads what it publishes.

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
