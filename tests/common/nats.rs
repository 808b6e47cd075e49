//! NATS JetStream helpers: a stream of the test's own with its dead-letter
//! stream and a durable pull consumer on the machine's NATS, publishing
//! with a message id, and reading back the dead letters and the backlog.

use std::collections::HashMap;
use std::time::Duration;

use idempotent_runtime::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use idempotent_runtime::async_nats::jetstream::{self, stream};
use idempotent_runtime::async_nats::{self, HeaderMap};

/// The machine's NATS (JetStream enabled).
pub const NATS_URL: &str = "127.0.0.1:4222";

/// A stream and its dead-letter stream, of names of the test's own, and
/// the durable consumer `worker` of the first.
pub struct Streams {
    pub js: jetstream::Context,
    pub stream: String,
    pub dlq_stream: String,
    pub subject: String,
    pub dlq_subject: String,
    pub consumer: PullConsumer,
}

/// Creates each `(name, subject)` stream, with the server's defaults (a
/// stream and its dead-letter stream).
pub async fn create_streams(js: &jetstream::Context, streams: [(&String, &String); 2]) {
    for (name, subject) in streams {
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    }
}

impl Streams {
    /// With `id` = `unique(name)`: the stream `<PREFIX>_<ID>` on the
    /// subject `<prefix>.<id>.in`, the stream `<PREFIX>_<ID>_DLQ` on
    /// `<prefix>.<id>.dlq`, and the consumer `worker` (explicit acks,
    /// `ack_wait`, and `max_deliver` if given; NATS's default if not).
    pub async fn setup(prefix: &str, name: &str, ack_wait: Duration, max_deliver: Option<i64>) -> Streams {
        let js = jetstream::new(async_nats::connect(NATS_URL).await.expect("NATS at 127.0.0.1:4222"));
        let id = super::unique(name);
        let stream_name = format!("{}_{}", prefix.to_uppercase(), id.to_uppercase());
        let subject = format!("{prefix}.{id}.in");
        let dlq_subject = format!("{prefix}.{id}.dlq");
        let dlq_stream = format!("{stream_name}_DLQ");
        create_streams(&js, [(&stream_name, &subject), (&dlq_stream, &dlq_subject)]).await;
        let mut config = pull::Config {
            durable_name: Some("worker".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            filter_subject: subject.clone(),
            ..Default::default()
        };
        if let Some(max_deliver) = max_deliver {
            config.max_deliver = max_deliver;
        }
        let consumer = js
            .get_stream(&stream_name)
            .await
            .unwrap()
            .get_or_create_consumer("worker", config)
            .await
            .unwrap();
        Streams {
            js,
            stream: stream_name,
            dlq_stream,
            subject,
            dlq_subject,
            consumer,
        }
    }

    /// Publishes `body` with the message id `id` (`Nats-Msg-Id`),
    /// acknowledged by JetStream.
    pub async fn publish(&self, body: Vec<u8>, id: &str) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        self.js
            .publish_with_headers(self.subject.clone(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The dead letters: each one's payload and headers.
    pub async fn dead_letters(&self) -> Vec<(Vec<u8>, HashMap<String, String>)> {
        let mut stream = self.js.get_stream(&self.dlq_stream).await.unwrap();
        let cached = stream.cached_info().state.last_sequence;
        let last = stream.info().await.map(|i| i.state.last_sequence).unwrap_or(cached);
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(msg) = stream.get_raw_message(seq).await {
                let headers = msg
                    .headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            v.first().map(|v| v.as_str().to_owned()).unwrap_or_default(),
                        )
                    })
                    .collect();
                out.push((msg.payload.to_vec(), headers));
            }
        }
        out
    }

    /// The consumer's messages not delivered yet, and those delivered and
    /// waiting for an ack.
    pub async fn backlog(&self) -> (u64, usize) {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let info = stream.consumer_info("worker").await.unwrap();
        (info.num_pending, info.num_ack_pending)
    }

    /// Deletes both streams.
    pub async fn teardown(&self) {
        for name in [&self.stream, &self.dlq_stream] {
            self.js.delete_stream(name).await.unwrap();
        }
    }
}
