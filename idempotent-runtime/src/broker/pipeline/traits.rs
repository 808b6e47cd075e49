//! The traits a broker implements to run on the pipeline, and the types
//! they exchange with it.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use super::super::options::ConsumerOptions;
use super::super::{CancellationToken, ConsumerError};

/// A broker: how a consumer connects to it and what it checks at build.
pub trait Broker: Send + Sync + 'static {
    /// The `broker` label of metrics, and the `messaging.system` of spans
    /// (`rabbitmq`, `nats`, `redis`).
    const NAME: &'static str;
    /// A connection with its subscription.
    type Session: Session;

    /// Checks the consumer's settings against the broker's and adjusts them
    /// (at build).
    fn prepare(&mut self, options: &mut ConsumerOptions) -> Result<(), ConsumerError>;

    /// Where it consumes from (queue, `stream/consumer`...).
    fn source(&self) -> String;

    /// What the spans of its deliveries say about the consumer, in
    /// OpenTelemetry's messaging terms; by default the destination is
    /// [`source`](Self::source).
    fn messaging(&self) -> Messaging {
        Messaging::new(self.source())
    }

    /// Connects, sets up what it needs (declarations, checks) and
    /// subscribes.
    fn connect(&self, options: &ConsumerOptions) -> impl Future<Output = Result<Self::Session, Connect>> + Send;
}

/// The OpenTelemetry messaging attributes of a consumer's spans (see
/// [`Broker::messaging`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Messaging {
    /// `messaging.destination.name`: what it consumes from (a queue, a
    /// stream), unless a delivery names its own ([`Meta::destination`]).
    pub destination: String,
    /// `messaging.consumer.group.name`: the group its instances share the
    /// messages in (a JetStream durable consumer, a Redis Streams group).
    pub consumer_group: Option<String>,
    /// `messaging.client.id`: this instance in the group (a Redis Streams
    /// consumer name).
    pub client_id: Option<String>,
}

impl Messaging {
    /// A consumer of `destination`.
    pub fn new(destination: impl Into<String>) -> Messaging {
        Messaging {
            destination: destination.into(),
            consumer_group: None,
            client_id: None,
        }
    }

    /// In the consumer group `group`.
    pub fn consumer_group(mut self, group: impl Into<String>) -> Messaging {
        self.consumer_group = Some(group.into());
        self
    }

    /// As the client `id`.
    pub fn client_id(mut self, id: impl Into<String>) -> Messaging {
        self.client_id = Some(id.into());
        self
    }
}

/// Why [`Broker::connect`] failed.
pub enum Connect {
    /// Retrying cannot help (configuration, topology): `run` returns it.
    Fatal(ConsumerError),
    /// The broker could not be reached: try again within the policy.
    Failed(String),
}

/// A live connection and subscription.
pub trait Session: Send + 'static {
    /// One delivery of this session.
    type Delivery: Delivery;

    /// The next delivery, asking the broker for at most `room` at a time.
    /// Cancel-safe: a call dropped before it returns loses nothing.
    fn next(&mut self, room: usize) -> impl Future<Output = Next<Self::Delivery>> + Send;

    /// Stops new deliveries (shutdown): what the broker already sent keeps
    /// coming from [`next`](Self::next), then [`Next::End`].
    fn stop(&mut self) -> impl Future<Output = ()> + Send;

    /// Closes the connection after a stop.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// What [`Session::next`] came to.
pub enum Next<D> {
    /// A message.
    Delivery(D),
    /// Nothing for now (a pull request expired empty).
    Idle,
    /// The subscription ended: after [`Session::stop`], or the broker
    /// cancelled it.
    End,
    /// The connection is gone.
    Lost(String),
}

/// What the pipeline knows of a delivery.
#[derive(Debug, Clone)]
pub struct Meta {
    /// From 1.
    pub attempt: u32,
    /// The broker delivered it before.
    pub redelivered: bool,
    /// The broker-level message id.
    pub message_id: Option<String>,
    /// The broker will not deliver it again if it is handed back.
    pub last: bool,
    /// Where it is in the broker (delivery tag, stream sequence, entry
    /// id), for the span.
    pub position: String,
    /// Its `messaging.destination.name`, when it says more than the
    /// consumer's ([`Messaging::destination`]): RabbitMQ's
    /// `{exchange}:{routing key}:{queue}`.
    pub destination: Option<String>,
    /// Its `messaging.rabbitmq.destination.routing_key` (RabbitMQ).
    pub routing_key: Option<String>,
    /// Its `messaging.rabbitmq.message.delivery_tag` (RabbitMQ).
    pub delivery_tag: Option<u64>,
    /// Its `messaging.destination.partition.id` (Kafka).
    pub partition: Option<i32>,
    /// Its `messaging.kafka.offset` (Kafka).
    pub offset: Option<i64>,
    /// Its `messaging.kafka.message.key` (Kafka; not UTF-8 bytes replaced).
    pub message_key: Option<String>,
}

/// A dead letter to publish.
pub struct Letter<'a> {
    /// `poison`, `exhausted` or `rejected` (the `x-idempotent-kind` header).
    pub kind: &'static str,
    /// Why, on one line, at most 4 KiB.
    pub reason: &'a str,
    /// Handler runs.
    pub attempts: u32,
    /// Where the message was consumed from.
    pub source: &'a str,
}

/// Why a settlement did not happen.
#[derive(Debug, Clone)]
pub enum Settle {
    /// The broker would not take a publish (unroutable, refused): the
    /// delivery can still be handed back.
    Refused(String),
    /// The connection is gone: the broker redelivers the message.
    Lost(String),
    /// No answer in time (a publish acknowledgement that did not come): the
    /// step may or may not have taken effect. The pipeline takes the same
    /// step again, which must be safe ([`Delivery::dead_letter`]).
    Unknown(String),
}

impl fmt::Display for Settle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Settle::Refused(why) | Settle::Lost(why) | Settle::Unknown(why) => f.write_str(why),
        }
    }
}

/// One message, and how to settle it.
pub trait Delivery: Send + Sync + 'static {
    /// The message's bytes, for the decoder.
    fn body(&self) -> &[u8];
    /// What the pipeline needs to know about it.
    fn meta(&self) -> &Meta;

    /// Why the delivery cannot carry a message at all (poison before
    /// decoding), if so.
    fn malformed(&self) -> Option<String> {
        None
    }

    /// The connection it came on is still the live one: settling it is
    /// allowed.
    fn is_current(&self) -> bool;

    /// How often to send [`progress`](Self::progress) while the consumer
    /// holds it unsettled: its handler runs, its outage retries wait, or
    /// its batch runs, commits and settles the others (brokers that
    /// redeliver what looks stuck).
    fn heartbeat(&self) -> Option<Duration> {
        None
    }

    /// "Still working on it".
    fn progress(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Done: remove it from the broker.
    fn ack(&self) -> impl Future<Output = Result<(), Settle>> + Send;

    /// Done, for several deliveries of one batch whose transaction has
    /// committed: removes them from the broker, in as few calls as the
    /// broker allows. One result per delivery, in order (a missing one
    /// counts as [`Settle::Lost`]). Called only with deliveries that are
    /// [`current`](Self::is_current).
    ///
    /// By default each is [`ack`](Self::ack)ed, one after another. A broker
    /// that can settle several at once (one call, or calls in flight
    /// together) overrides it: an acknowledgement must still never cover
    /// a delivery that is not in `deliveries`.
    fn ack_all<'a>(deliveries: &'a [&'a Self]) -> impl Future<Output = Vec<Result<(), Settle>>> + Send + 'a
    where
        Self: Sized,
    {
        async move {
            let mut acked = Vec::with_capacity(deliveries.len());
            for delivery in deliveries {
                acked.push(delivery.ack().await);
            }
            acked
        }
    }

    /// Have it delivered again as attempt `next_attempt` after `delay`.
    fn retry(
        &self,
        next_attempt: u32,
        delay: Duration,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<(), Settle>> + Send;

    /// What names this message across its redeliveries, on any connection
    /// (a stream sequence, an entry id, a partition and offset, a message
    /// id), if the broker gives one. The pipeline remembers the dead-lettered
    /// ones: a redelivery of a message whose dead letter is stored (its
    /// removal lost with the connection, refused, or not known to have
    /// happened) is settled without running its handler again. `None`: not
    /// recognised.
    fn identity(&self) -> Option<String> {
        None
    }

    /// The broker says this is the message's first delivery (RabbitMQ's
    /// `redelivered` flag clear): it cannot be the redelivery of a
    /// dead-lettered message, and is not looked up. A broker whose
    /// [`identity`](Self::identity) is the message's content rather than
    /// its place says so, so that a new message of the same bytes (a dead
    /// letter sent back by an operator) is handled. By default `false`.
    fn first_delivery(&self) -> bool {
        false
    }

    /// Publish it to the dead-letter destination; `Ok` once the broker
    /// stored the dead letter. The pipeline then removes the delivery
    /// ([`discard`](Self::discard)), as a step of its own that it retries
    /// by itself.
    ///
    /// Called again for the same delivery when a call's outcome was
    /// unknown ([`Settle::Unknown`], [`Settle::Lost`]) or on its redelivery:
    /// publishing the same letter again must be safe (the broker's
    /// deduplication id where it has one; a second copy in the dead-letter
    /// destination at worst, never a second run of the handler). A broker
    /// that can publish and remove in one atomic step does both here, and
    /// its `discard` does nothing.
    fn dead_letter(&self, letter: &Letter<'_>) -> impl Future<Output = Result<(), Settle>> + Send;

    /// Removes it after its dead letter is stored; by default
    /// [`ack`](Self::ack). Called again after a failure, and on a
    /// redelivery of a message whose dead letter is stored.
    fn discard(&self) -> impl Future<Output = Result<(), Settle>> + Send {
        self.ack()
    }

    /// Give it back for another delivery, after `delay` where the broker
    /// can wait.
    fn release(&self, delay: Duration) -> impl Future<Output = Result<(), Settle>> + Send;
}
