//! The `tracing` span of a delivery (see the pipeline's documentation).

use tracing::Span;
use tracing::field::Empty;

use super::traits::Delivery;
use super::worker::Worker;
use crate::broker::TRACING_TARGET;

/// The span of one delivery (see the module's documentation).
pub(super) fn delivery_span<Dl: Delivery, D, R, H>(worker: &Worker<D, R, H>, delivery: &Dl) -> Span {
    let meta = delivery.meta();
    let messaging = &worker.messaging;
    let destination = meta.destination.as_deref().unwrap_or(&messaging.destination);
    let partition = meta.partition.map(|p| p.to_string());
    let span = tracing::info_span!(
        target: TRACING_TARGET,
        "delivery",
        otel.name = format!("process {destination}").as_str(),
        otel.kind = "consumer",
        otel.status_code = Empty,
        messaging.system = worker.broker,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = destination,
        messaging.consumer.group.name = messaging.consumer_group.as_deref(),
        messaging.client.id = messaging.client_id.as_deref(),
        messaging.message.id = meta.message_id.as_deref(),
        messaging.message.body.size = otel_int(delivery.body().len()),
        messaging.rabbitmq.destination.routing_key = meta.routing_key.as_deref(),
        messaging.rabbitmq.message.delivery_tag = meta.delivery_tag.map(otel_int),
        messaging.destination.partition.id = partition.as_deref(),
        messaging.kafka.offset = meta.offset,
        messaging.kafka.message.key = meta.message_key.as_deref(),
        source = %worker.source,
        position = %meta.position,
        attempt = i64::from(meta.attempt),
        redelivered = meta.redelivered,
        outcome = Empty,
        idempotency.outcome = Empty,
        error.type = Empty,
    );
    span
}

/// A count as a signed integer: `tracing-opentelemetry` exports `i64`
/// fields as integer attributes, and unsigned ones as strings.
fn otel_int<N: TryInto<i64>>(n: N) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// Marks the current delivery's span as failed: `error.type` (`poison`,
/// `exhausted`, `handler_error`, `panic`, `ack_failed`, or the
/// idempotency outcome that failed the handler: `key_reused`,
/// `in_progress`, `error`) and an error status.
pub(super) fn trace_failure(error_type: &str) {
    let span = Span::current();
    span.record("error.type", error_type);
    span.record("otel.status_code", "error");
}
