//! The article's payment consumer as a small service on the real RabbitMQ
//! and PostgreSQL (the demo is described in `payments/mod.rs`).
//!
//! A fresh queue (and dead-letter queue) consumed by three competing
//! [`RabbitConsumer`]s, each on a connection of its own. When consumer 1
//! dies after a commit, its connection goes and RabbitMQ redelivers at once
//! everything it had not acked.
//!
//! Needs the services of `.ci/run`: `cargo run --example rabbitmq_payments`
//! (`AMQP_URL` and `DATABASE_URL` override the defaults).

mod payments;

use idempotent_runtime::broker::ConsumerBuilder;
use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::rabbitmq::{Rabbit, RabbitConsumer};
use payments::{BoxError, Demo, Tables};

struct RabbitMq {
    url: String,
    admin: Channel,
    _connection: Connection,
    queue: String,
    dead_letters: String,
}

impl RabbitMq {
    /// Messages ready in `queue` (not counting those delivered and unacked).
    async fn ready(&self, queue: &str) -> Result<u64, BoxError> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        Ok(u64::from(
            self.admin
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await?
                .message_count(),
        ))
    }
}

impl Demo for RabbitMq {
    type B = Rabbit;
    const TITLE: &'static str = "RabbitMQ";

    fn describe(&self) -> String {
        format!("queue `{}`", self.queue)
    }

    /// Fresh queues; `x-expires` removes them if this program dies before
    /// it deletes them itself.
    async fn setup(&self) -> Result<(), BoxError> {
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongInt(60_000));
        for queue in [&self.queue, &self.dead_letters] {
            self.admin
                .queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), arguments.clone())
                .await?;
        }
        Ok(())
    }

    async fn publish(&self, messages: Vec<(String, Vec<u8>)>) -> Result<(), BoxError> {
        self.admin.confirm_select(ConfirmSelectOptions::default()).await?;
        let mut confirms = Vec::with_capacity(messages.len());
        for (id, body) in &messages {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            confirms.push(
                self.admin
                    .basic_publish(
                        "".into(),
                        self.queue.as_str().into(),
                        BasicPublishOptions::default(),
                        body,
                        properties,
                    )
                    .await?,
            );
        }
        for confirm in confirms {
            if !confirm.await?.is_ack() {
                return Err("RabbitMQ refused a published payment".into());
            }
        }
        Ok(())
    }

    fn consumer(&self) -> ConsumerBuilder<Rabbit> {
        RabbitConsumer::builder(&self.url, &self.queue)
            .prefetch(8)
            .dead_letter_queue(&self.dead_letters)
            // `setup` declared both (with `x-expires`): only check them.
            .declare_queue(false)
            .declare_dead_letter_queue(false)
    }

    /// Ready in either queue: unacked messages are held by a live consumer
    /// (those of the killed one are back in the queue at once).
    async fn unsettled(&self) -> Result<u64, BoxError> {
        Ok(self.ready(&self.queue).await? + self.ready(&self.dead_letters).await?)
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        for queue in [&self.queue, &self.dead_letters] {
            self.admin
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let admin = connection.create_channel().await?;
    let id = payments::run_id();
    let demo = RabbitMq {
        url,
        admin,
        _connection: connection,
        queue: format!("payments.demo.{id}"),
        dead_letters: format!("payments.demo.{id}.dlq"),
    };
    let tables = Tables {
        markers: format!("processed_messages_demo_{id}"),
        payments: format!("payments_demo_{id}"),
    };
    payments::run(demo, tables).await
}
