//! The article's payment consumer as a small service on the real NATS
//! JetStream and PostgreSQL (the demo is described in `payments/mod.rs`).
//!
//! A fresh stream with a durable pull consumer shared by three
//! [`JetStreamConsumer`]s, and a dead-letter stream. When consumer 1 dies
//! after a commit, JetStream redelivers what it held after the consumer's
//! `ack_wait` (1 s here).
//!
//! Needs the services of `.ci/run`: `cargo run --example nats_payments`
//! (`NATS_URL` and `DATABASE_URL` override the defaults).

mod payments;

use std::time::Duration;

use idempotent_runtime::async_nats;
use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, pull};
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::broker::ConsumerBuilder;
use idempotent_runtime::nats::{JetStream, JetStreamConsumer};
use payments::{BoxError, Demo, Tables};

/// How long JetStream waits for an ack before it redelivers.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// The durable pull consumer the three service instances share.
const DURABLE: &str = "payment-service";

struct Nats {
    js: jetstream::Context,
    consumer: std::sync::OnceLock<jetstream::consumer::PullConsumer>,
    stream: String,
    subject: String,
    dead_letter_stream: String,
    dead_letter_subject: String,
}

impl Demo for Nats {
    type B = JetStream;
    const TITLE: &'static str = "NATS JetStream";

    fn describe(&self) -> String {
        format!("stream `{}`", self.stream)
    }

    async fn setup(&self) -> Result<(), BoxError> {
        // The payments, and the dead letters (a stream must capture the
        // dead-letter subject); a durable pull consumer with explicit acks
        // and a short ack_wait.
        for (name, subject) in [
            (&self.stream, &self.subject),
            (&self.dead_letter_stream, &self.dead_letter_subject),
        ] {
            self.js
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![subject.clone()],
                    storage: stream::StorageType::Memory,
                    ..Default::default()
                })
                .await?;
        }
        let durable = pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            ..Default::default()
        };
        let consumer = self.js.get_stream(&self.stream).await?.create_consumer(durable).await?;
        let _ = self.consumer.set(consumer);
        Ok(())
    }

    /// No `Nats-Msg-Id` header: JetStream would drop a copy with the same id
    /// within the stream's duplicate window. That window catches quick
    /// publisher retries; the marker catches everything else (later
    /// retries, redeliveries, replays), which is what this shows.
    async fn publish(&self, messages: Vec<(String, Vec<u8>)>) -> Result<(), BoxError> {
        let mut acks = Vec::with_capacity(messages.len());
        for (_, body) in messages {
            acks.push(self.js.publish(self.subject.clone(), body.into()).await?);
        }
        for ack in acks {
            ack.await?;
        }
        Ok(())
    }

    fn consumer(&self) -> ConsumerBuilder<JetStream> {
        let pull = self.consumer.get().cloned().expect("set up before the consumers start");
        JetStreamConsumer::builder(self.js.clone(), pull)
            .dead_letter_subject(&self.dead_letter_subject)
            .fetch_expiry(Duration::from_millis(500))
    }

    async fn unsettled(&self) -> Result<u64, BoxError> {
        let info = self.js.get_stream(&self.stream).await?.consumer_info(DURABLE).await?;
        let dead = self
            .js
            .get_stream(&self.dead_letter_stream)
            .await?
            .get_info()
            .await?
            .state
            .messages;
        Ok(info.num_pending + info.num_ack_pending as u64 + dead)
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        for name in [&self.stream, &self.dead_letter_stream] {
            if self.js.get_stream(name).await.is_ok() {
                self.js.delete_stream(name).await?;
            }
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let id = payments::run_id();
    let demo = Nats {
        js: jetstream::new(async_nats::connect(&url).await?),
        consumer: std::sync::OnceLock::new(),
        stream: format!("PAYMENTS_DEMO_{id}"),
        subject: format!("payments_demo.{id}"),
        dead_letter_stream: format!("PAYMENTS_DEMO_{id}_DLQ"),
        dead_letter_subject: format!("payments_demo.{id}.dlq"),
    };
    let tables = Tables {
        markers: format!("processed_messages_demo_{id}"),
        payments: format!("payments_demo_{id}"),
    };
    payments::run(demo, tables).await
}
