//! The delivery pipeline, written once for every broker.
//!
//! `run` keeps a [`Session`] (a live connection and subscription),
//! making it again with backoff when it is lost, and takes deliveries while
//! handler slots are free. Each delivery goes through `process`: its span,
//! decoding (a body longer than the consumer's limit, or one that does not
//! decode, is dead-lettered as poison), the
//! handler call (panics caught; on the last delivery the broker allows,
//! only a check of whether the message was processed: its `#[idempotent]`
//! calls claim without running their bodies, and a message processed before
//! is acknowledged, one that was not dead-lettered), the verdict on a
//! failure (outage: run again in place, unless other messages were
//! processed meanwhile or the retries in place ran out, which spends an
//! attempt; retry: hand it to the broker with a delay; otherwise
//! dead-letter), and the settlement, never on a connection
//! other than the one it came on. A dead letter is stored, then the
//! delivery removed, each step retried by itself; a message whose dead
//! letter is stored is never handed to its handler again (`dead`). A delivery's progress is sent at its heartbeat
//! until it is settled, across the handler's runs and the waits between
//! them; in a batch, from the moment it is gathered, while the others run,
//! commit and settle. On shutdown, `drain` gives the handlers in flight
//! their time, then asks them to let go.
//!
//! The span of a delivery follows the OpenTelemetry messaging conventions
//! for a `process` operation (through `tracing-opentelemetry`, which reads
//! the `otel.*` fields as the span's name, kind and status): its name is
//! `process {destination}`, its kind `consumer`, and its fields are the
//! `messaging.*` attributes, from the broker's [`Broker::messaging`] and the
//! delivery's [`Meta`], with the `idempotency.outcome` of the handler's
//! `#[idempotent]` calls and, when the delivery failed, `error.type`.
//!
//! A broker supplies a [`Broker`] (how to connect), a [`Session`] (how to
//! receive) and a [`Delivery`] (how to settle one message): implement them
//! to run the pipeline on a broker of your own, as
//! [`rabbitmq`](super::rabbitmq), [`nats`](super::nats) and
//! [`redis_streams`](super::redis_streams) do.
//!
//! The code, by concern: `traits` (what a broker implements, and what it
//! exchanges with the pipeline), `run` (the loop and the drain), `deliver`
//! (one delivery: decoding, the handler's call, the verdict, acknowledging,
//! retrying, dead-lettering, releasing), `dead` (the memory of what was
//! dead-lettered), `batch` (several deliveries in one
//! database transaction), `offsets` (a Kafka consumer's offsets stored in
//! the handler's transaction), `span` (a delivery's `tracing` span) and `worker`
//! (what a consumer's delivery tasks share).

#[cfg(feature = "sqlx")]
mod batch;
mod dead;
mod deliver;
#[cfg(all(feature = "kafka", feature = "sqlx"))]
mod offsets;
mod run;
mod span;
mod traits;
mod worker;

pub(crate) use run::run;
pub use traits::{Broker, Connect, Delivery, Letter, Messaging, Meta, Next, Session, Settle};
