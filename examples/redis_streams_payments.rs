//! The article's payment consumer as a small service on the real Redis
//! (Streams) and PostgreSQL (the demo is described in `payments/mod.rs`).
//!
//! A fresh stream read by three [`StreamConsumer`]s of one consumer group.
//! When consumer 1 dies after a commit, the entries it read stay pending in
//! the group, and the others reclaim them once they have been idle for the
//! group's `claim_idle` (1 s here).
//!
//! Needs the services of `.ci/run`: `cargo run --example redis_streams_payments`
//! (`REDIS_URL` and `DATABASE_URL` override the defaults).

mod payments;

use std::time::Duration;

use idempotent_runtime::broker::ConsumerBuilder;
use idempotent_runtime::redis::{self, AsyncCommands};
use idempotent_runtime::redis_streams::{RedisStream, StreamConsumer};
use payments::{BoxError, Demo, Tables};

const GROUP: &str = "payment-service";

struct Streams {
    client: redis::Client,
    conn: redis::aio::MultiplexedConnection,
    stream: String,
    dead_letters: String,
}

impl Demo for Streams {
    type B = RedisStream;
    const TITLE: &'static str = "Redis Streams";

    fn describe(&self) -> String {
        format!("stream `{}`", self.stream)
    }

    /// The consumers create the group (and the stream) themselves.
    async fn setup(&self) -> Result<(), BoxError> {
        Ok(())
    }

    async fn publish(&self, messages: Vec<(String, Vec<u8>)>) -> Result<(), BoxError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        for (id, body) in &messages {
            pipe.xadd(
                &self.stream,
                "*",
                &[("message_id", id.as_bytes()), ("body", body.as_slice())],
            );
        }
        let _: Vec<String> = pipe.query_async(&mut conn).await?;
        Ok(())
    }

    fn consumer(&self) -> ConsumerBuilder<RedisStream> {
        StreamConsumer::builder(self.client.clone(), &self.stream, GROUP)
            .dead_letter_stream(&self.dead_letters)
            .claim_idle(Duration::from_secs(1))
            .block(Duration::from_millis(500))
    }

    /// Entries not read yet, read and not acknowledged, and dead letters.
    async fn unsettled(&self) -> Result<u64, BoxError> {
        let mut conn = self.conn.clone();
        let groups: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(&self.stream).await?;
        let dead: u64 = conn.xlen(&self.dead_letters).await?;
        Ok(groups
            .groups
            .iter()
            .map(|g| g.pending as u64 + g.lag.unwrap_or(0) as u64)
            .sum::<u64>()
            + dead)
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        let mut conn = self.conn.clone();
        let _: () = conn.del(&[&self.stream, &self.dead_letters]).await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let client = redis::Client::open(url)?;
    let conn = client.get_multiplexed_async_connection().await?;
    let id = payments::run_id();
    let demo = Streams {
        client,
        conn,
        stream: format!("payments.demo.{id}"),
        dead_letters: format!("payments.demo.{id}.dlq"),
    };
    let tables = Tables {
        markers: format!("processed_messages_demo_{id}"),
        payments: format!("payments_demo_{id}"),
    };
    payments::run(demo, tables).await
}
