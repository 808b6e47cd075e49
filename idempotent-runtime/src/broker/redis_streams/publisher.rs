//! Publishing to Redis Streams from the outbox relay
//! ([`StreamPublisher`], re-exported as `outbox::StreamPublisher`), beside
//! the consumer that reads what it publishes.

use redis::aio::ConnectionManager;

use crate::outbox::{OutboxRow, PublishError, Publisher};
use crate::store::redis_conn::RedisConn;

/// Publishes outbox rows to Redis Streams: `XADD <destination> *
/// message_id <id> body <payload>` followed by the headers as fields,
/// which is what a [`StreamConsumer`](crate::broker::redis_streams::StreamConsumer)
/// reads by default. Redis does not deduplicate: a row published again
/// (its relay died before marking it) is a second entry with the same
/// `message_id`, which the idempotent consumer downstream skips.
///
/// On a Redis Cluster ([`StreamPublisher::cluster`], feature
/// `redis-cluster`) each `XADD` goes to the primary of its stream's slot.
#[derive(Clone)]
pub struct StreamPublisher {
    conn: RedisConn,
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
        StreamPublisher {
            conn: RedisConn::Manager(conn),
            max_len: None,
        }
    }

    /// A publisher on a Redis Cluster. Feature `redis-cluster`.
    #[cfg(feature = "redis-cluster")]
    pub fn cluster(conn: redis::cluster_async::ClusterConnection) -> StreamPublisher {
        StreamPublisher {
            conn: RedisConn::Cluster(conn),
            max_len: None,
        }
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
