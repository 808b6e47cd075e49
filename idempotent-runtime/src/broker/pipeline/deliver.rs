//! One delivery's way through the pipeline: decoding, the handler's call,
//! the verdict on a failure, and the settlement (acknowledgement, retry,
//! dead letter, release).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::dead::{Dead, Unsure};
use super::span::{delivery_span, trace_failure};
use super::traits::{Delivery, Letter, Meta, Settle};
use super::worker::{Worker, millis};
use crate::broker::stats::{DeadKind, Outcome};
use crate::broker::{
    Called, Decoder, DeliveryInfo, Handler, RetryPolicy, TRACING_TARGET, Verdict, sleep_unless_cancelled,
    truncate_reason,
};
use crate::signal::{Noted, Outcome as Idempotency};

/// One delivery, from its span to its settlement.
pub(super) async fn process<Dl, M, A, D, R, H>(worker: Arc<Worker<D, R, H>>, delivery: Dl)
where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<H::Error>,
    H: Handler<M, A>,
{
    worker.handle_alone(&delivery).await;
}

/// The clock of a delivery's progress: ticks every heartbeat period from
/// its start, across whatever its holder awaits in between (handler runs,
/// the waits between them); never ticks without a heartbeat.
pub(super) struct Beat(Option<tokio::time::Interval>);

impl Beat {
    pub(super) fn new(period: Option<Duration>) -> Beat {
        Beat(period.map(|period| {
            let period = period.max(Duration::from_millis(1));
            let mut ticker = tokio::time::interval_at(Instant::now() + period, period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker
        }))
    }

    /// The next tick (cancel-safe).
    pub(super) async fn tick(&mut self) {
        match &mut self.0 {
            Some(ticker) => {
                ticker.tick().await;
            }
            None => std::future::pending().await,
        }
    }
}

impl<D, R, H> Worker<D, R, H> {
    /// One delivery, in its span.
    pub(super) async fn handle_alone<Dl, M, A>(&self, delivery: &Dl)
    where
        Dl: Delivery,
        D: Decoder<M>,
        R: RetryPolicy<H::Error>,
        H: Handler<M, A>,
    {
        let span = delivery_span(self, delivery);
        self.handle_from(delivery, None).instrument(span).await;
    }

    /// Handles a delivery from its handler's run: `ran` when the handler
    /// already ran (in a committed batch), otherwise from the checks that
    /// come before it.
    ///
    /// On the last delivery the broker allows (its earlier ones ended
    /// unsettled: a crash, a shutdown timeout, a dead letter refused), the
    /// handler is called only to check whether the message was processed
    /// ([`signal::checking`](crate::signal::checking)): each
    /// `#[idempotent]` call claims its key without running its body. A
    /// message whose effect is committed (its keys replay) is acknowledged;
    /// one whose key was not processed is dead-lettered (`exhausted`); one
    /// whose check cannot tell yet (the store down, the key held by a
    /// transaction that may still commit) waits, in progress, as an outage.
    pub(super) async fn handle_from<Dl, M, A>(&self, delivery: &Dl, mut ran: Option<(Called<H::Error>, Noted)>)
    where
        Dl: Delivery,
        D: Decoder<M>,
        R: RetryPolicy<H::Error>,
        H: Handler<M, A>,
    {
        let meta = delivery.meta();
        let attempt = meta.attempt;
        // Its progress, across the handler's runs and the waits between
        // them.
        let mut beat = Beat::new(delivery.heartbeat());
        let check_only = ran.is_none() && meta.last;
        if ran.is_none() && self.settled_as_dead(delivery).await {
            return;
        }
        if let Some(reason) = self.refused_body(delivery).filter(|_| ran.is_none()) {
            tracing::error!(target: TRACING_TARGET, %reason, "malformed or oversized (poison) message: dead-lettering it");
            trace_failure("poison");
            self.dead_letter(delivery, DeadKind::Poison, &reason, 0, Outcome::Poison)
                .await;
            return;
        }
        if check_only {
            tracing::warn!(
                target: TRACING_TARGET,
                attempt,
                "last allowed delivery: checking whether the message was processed, without running its handler's \
                 bodies"
            );
        }
        let mut outages = 0u32;
        // Deliveries the consumer processed and acknowledged (see
        // `Recorder::processed`) when this one's first outage was seen, and
        // when its latest run started.
        let mut acked_at_first_outage: Option<u64> = None;
        let mut acked_at_start = self.recorder.processed();
        let (reason, verdict, error_type) = loop {
            let (called, noted) = match ran.take() {
                Some(ran) => ran,
                None => {
                    let decoded = match self.decoder.decode(delivery.body()) {
                        Ok(decoded) => decoded,
                        Err(reason) => {
                            tracing::error!(target: TRACING_TARGET, %reason, "undecodable (poison) message: dead-lettering it");
                            trace_failure("poison");
                            self.dead_letter(delivery, DeadKind::Poison, &reason, 0, Outcome::Poison)
                                .await;
                            return;
                        }
                    };
                    acked_at_start = self.recorder.processed();
                    let call = self.call_alone(meta, decoded, check_only);
                    let Some(outcome) = self.watched(delivery, &mut beat, call).await else {
                        self.let_go(delivery).await;
                        return;
                    };
                    outcome
                }
            };
            if let Some(outcome) = noted.outcome {
                Span::current().record("idempotency.outcome", outcome.as_str());
            }
            if check_only && noted.not_processed {
                // Not processed, and the broker will not deliver it again:
                // settle it now, without its effect.
                let reason = format!(
                    "delivered {attempt} times (as often as the broker allows) without being settled, and not \
                     processed: the consumer crashed or stopped while handling it, or its dead letter could not \
                     be published; the last delivery is kept for dead-lettering it"
                );
                tracing::error!(
                    target: TRACING_TARGET,
                    attempt,
                    "last allowed delivery of a message not processed: dead-lettering it"
                );
                trace_failure("exhausted");
                self.dead_letter(
                    delivery,
                    DeadKind::Exhausted,
                    &reason,
                    attempt.saturating_sub(1),
                    Outcome::DeadLettered,
                )
                .await;
                return;
            }
            // A handler that failed because an `#[idempotent]` call did is
            // named by that call's outcome.
            let handler_error = match noted.outcome {
                Some(
                    outcome @ (Idempotency::KeyReused
                    | Idempotency::InProgress
                    | Idempotency::NotProcessed
                    | Idempotency::Error),
                ) => outcome.as_str(),
                _ => "handler_error",
            };
            let (reason, verdict, error_type) = match called {
                Called::Ok => {
                    // Evidence that the consumer's dependencies are up,
                    // unless every call only replayed (a cache can answer
                    // duplicates while the database is down).
                    let processed = noted.outcome != Some(Idempotency::Duplicate);
                    self.ack(delivery, processed).await;
                    return;
                }
                Called::Err(err) if noted.store_failed => (err.to_string(), Verdict::Outage, handler_error),
                Called::Err(err) => {
                    let verdict = self.retry.verdict(&err);
                    (err.to_string(), verdict, handler_error)
                }
                Called::Panicked(reason) => (reason, Verdict::Retry, "panic"),
                // The database is down (or the transaction failed): as an
                // outage of the handler's store.
                Called::Unstored(reason) => (reason, Verdict::Outage, "offset_store"),
            };
            self.recorder.handler_failed();
            if verdict != Verdict::Outage {
                break (reason, verdict, error_type);
            }
            // An outage that is this message's own (the consumer processes
            // other messages meanwhile), or that outlived the
            // retries in place allowed, spends an attempt. A key another
            // consumer holds waits for it, and the last delivery's check
            // for the store.
            let waits = check_only || noted.outcome == Some(Idempotency::InProgress);
            let escalated = if waits {
                None
            } else if self.options.max_outage_retries.is_some_and(|max| outages >= max) {
                Some("its outage retries in place ran out (max_outage_retries)")
            } else if acked_at_first_outage.is_some_and(|first| acked_at_start > first) {
                Some("other messages were processed since its first outage")
            } else {
                None
            };
            if let Some(why) = escalated {
                tracing::warn!(
                    target: TRACING_TARGET,
                    error = %reason,
                    outages,
                    "outage of this message alone: {why}; spending an attempt"
                );
                break (reason, Verdict::Retry, error_type);
            }
            acked_at_first_outage.get_or_insert_with(|| self.recorder.processed());
            // A dependency is down: keep the message, run it again later,
            // without spending an attempt.
            outages = outages.saturating_add(1);
            self.recorder.outage_retry();
            let delay = self.options.outage_backoff.delay(outages);
            tracing::warn!(
                target: TRACING_TARGET,
                error = %reason,
                outages,
                delay_ms = millis(delay),
                "a dependency is down: keeping the message and running it again"
            );
            if self
                .watched(delivery, &mut beat, sleep_unless_cancelled(delay, &self.shutdown))
                .await
                .is_none()
                || self.shutdown.is_cancelled()
            {
                self.let_go(delivery).await;
                return;
            }
        };
        trace_failure(error_type);

        if verdict == Verdict::Retry && attempt < self.options.max_attempts {
            let delay = self.options.retry_backoff.delay(attempt);
            tracing::warn!(
                target: TRACING_TARGET,
                error = %reason,
                error_type,
                attempt,
                max_attempts = self.options.max_attempts,
                delay_ms = millis(delay),
                "handler failed: retrying"
            );
            let retried = on_own_connection(delivery, || delivery.retry(attempt + 1, delay, &self.shutdown)).await;
            match retried {
                Ok(()) => self.recorder.outcome(Outcome::Retried),
                Err(Settle::Refused(why) | Settle::Unknown(why)) => {
                    tracing::error!(target: TRACING_TARGET, error = %why, "could not schedule the retry: handing the message back");
                    self.release(delivery).await;
                }
                Err(Settle::Lost(why)) => {
                    tracing::warn!(target: TRACING_TARGET, error = %why, "connection lost: the broker redelivers the message");
                    self.recorder.outcome(Outcome::Released);
                }
            }
            return;
        }
        let kind = if verdict == Verdict::Reject {
            DeadKind::Rejected
        } else {
            DeadKind::Exhausted
        };
        tracing::error!(
            target: TRACING_TARGET,
            error = %reason,
            error_type,
            attempt,
            max_attempts = self.options.max_attempts,
            kind = kind.as_str(),
            "handler failed: dead-lettering the message"
        );
        self.dead_letter(delivery, kind, &reason, attempt, Outcome::DeadLettered)
            .await;
    }

    /// Why the delivery's body is poison before decoding, if it is: the
    /// broker says it carries no message, or it is longer than
    /// [`max_body_bytes`](super::ConsumerBuilder::max_body_bytes).
    pub(super) fn refused_body<Dl: Delivery>(&self, delivery: &Dl) -> Option<String> {
        let size = delivery.body().len();
        let max = self.options.max_body_bytes;
        delivery
            .malformed()
            .or_else(|| (size > max).then(|| format!("body of {size} bytes exceeds the limit of {max}")))
    }

    /// The handler's call on the decoded `message` of the delivery `meta`
    /// describes: its outcome and what its `#[idempotent]` calls noted.
    /// With `check_only`, the calls only check whether their key is
    /// processed (see [`handle_from`](Self::handle_from)).
    pub(super) fn call<M, A>(
        &self,
        meta: &Meta,
        message: M,
        check_only: bool,
    ) -> impl Future<Output = (Called<H::Error>, Noted)>
    where
        H: Handler<M, A>,
    {
        let info = DeliveryInfo {
            message_id: meta.message_id.clone(),
            attempt: meta.attempt,
            redelivered: meta.redelivered,
        };
        // On the heap, once: the handler's future is large (a store's
        // claim, its queries), and the futures around it (the outcome's
        // watch, the catch of a panic, the shutdown's select, the task, a
        // batch's members) each held it again by value, moved and copied
        // it: 120-130 kB per delivery, past the allocator's mmap threshold
        // (`docs/performance.md`, end to end, "Batches").
        let handler = Box::pin(self.handler.call(message, info));
        crate::broker::call(crate::signal::checking(check_only, handler), &self.recorder)
    }

    /// The handler's call on a delivery handled alone: [`call`](Self::call);
    /// with offsets in the database, in a transaction of the consumer's that
    /// also stores the delivery's offset.
    async fn call_alone<M, A>(&self, meta: &Meta, message: M, check_only: bool) -> (Called<H::Error>, Noted)
    where
        H: Handler<M, A>,
    {
        #[cfg(all(feature = "kafka", feature = "sqlx"))]
        if let (Some(offsets), Some(partition), Some(offset)) = (&self.options.offsets, meta.partition, meta.offset) {
            // On the heap: the transaction's future holds the handler's.
            return Box::pin(self.call_storing_offset(
                offsets.0.as_ref(),
                (partition, offset),
                meta,
                message,
                check_only,
            ))
            .await;
        }
        self.call(meta, message, check_only).await
    }

    /// Runs `fut` while sending the delivery's progress at each `beat`;
    /// `None` when the consumer asks in-flight handlers to let go (shutdown
    /// timeout).
    async fn watched<Dl: Delivery, F: Future>(&self, delivery: &Dl, beat: &mut Beat, fut: F) -> Option<F::Output> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return Some(out),
                _ = self.abandon.cancelled() => return None,
                _ = beat.tick() => delivery.progress().await,
            }
        }
    }

    /// Runs `fut`; `None` when the consumer asks in-flight handlers to let
    /// go (shutdown timeout).
    #[cfg(feature = "sqlx")]
    pub(super) async fn unless_abandoned<F: Future>(&self, fut: F) -> Option<F::Output> {
        tokio::select! {
            biased;
            out = fut => Some(out),
            _ = self.abandon.cancelled() => None,
        }
    }

    /// Acknowledges a processed delivery, on its own connection only.
    /// `processed`: the handler ran for real (see [`Recorder::processed`]).
    async fn ack<Dl: Delivery>(&self, delivery: &Dl, processed: bool) {
        if processed {
            self.recorder.note_processed();
        }
        let acked = on_own_connection(delivery, || delivery.ack()).await;
        self.acked(acked);
    }

    /// Acknowledges the members of a committed batch whose handler returned
    /// `Ok` (what [`handle_from`](Self::handle_from) does for each), in as
    /// few broker calls as the broker allows ([`Delivery::ack_all`]); each
    /// member's outcome is recorded in its own span. A member whose
    /// connection is no longer the live one is not acknowledged (the broker
    /// redelivers it, and its committed marker answers it).
    #[cfg(feature = "sqlx")]
    pub(super) async fn ack_committed<Dl: Delivery>(&self, members: Vec<(&Dl, Span, Noted)>) {
        let mut current = Vec::with_capacity(members.len());
        let mut spans = Vec::with_capacity(members.len());
        for (delivery, span, noted) in members {
            if let Some(outcome) = noted.outcome {
                span.record("idempotency.outcome", outcome.as_str());
            }
            // As `handle_from`: evidence that the consumer's dependencies
            // are up, unless every call only replayed.
            if noted.outcome != Some(Idempotency::Duplicate) {
                self.recorder.note_processed();
            }
            if delivery.is_current() {
                current.push(delivery);
                spans.push(span);
            } else {
                let _entered = span.enter();
                self.acked(Err(Settle::Lost("the connection it came on was lost".into())));
            }
        }
        if current.is_empty() {
            return;
        }
        let mut acked = Dl::ack_all(&current).await.into_iter();
        for span in spans {
            let _entered = span.enter();
            let result = acked
                .next()
                .unwrap_or_else(|| Err(Settle::Lost("the broker did not settle it".into())));
            self.acked(result);
        }
    }

    /// Records an acknowledgement's result, in the delivery's span.
    fn acked(&self, result: Result<(), Settle>) {
        match result {
            Ok(()) => {
                self.recorder.outcome(Outcome::Processed);
                tracing::debug!(target: TRACING_TARGET, "processed and acknowledged");
            }
            Err(err) => {
                self.recorder.outcome(Outcome::AckFailed);
                trace_failure("ack_failed");
                tracing::warn!(
                    target: TRACING_TARGET,
                    error = %err,
                    "acknowledgement failed: the broker will redeliver the message (a duplicate for the handler)"
                );
            }
        }
    }

    /// Hands a delivery back after the consumer stopped wanting it.
    pub(super) async fn let_go<Dl: Delivery>(&self, delivery: &Dl) {
        tracing::warn!(target: TRACING_TARGET, "the consumer is stopping: handing the message back");
        if delivery.is_current()
            && let Err(err) = delivery.release(Duration::ZERO).await
        {
            tracing::debug!(target: TRACING_TARGET, error = %err, "release failed: the broker redelivers it");
        }
        self.recorder.outcome(Outcome::Released);
    }

    /// Hands a delivery back after a publish the broker refused.
    async fn release<Dl: Delivery>(&self, delivery: &Dl) {
        if delivery.is_current()
            && let Err(err) = delivery.release(self.options.retry_backoff.initial).await
        {
            tracing::debug!(target: TRACING_TARGET, error = %err, "release failed: the broker redelivers it");
        }
        self.recorder.outcome(Outcome::Released);
    }

    /// A redelivery of a message a consumer of this source dead-lettered in
    /// this process (see [`dead`](super::dead)): settles it without running
    /// its handler, and says so. Costs one flag's load on every delivery
    /// until the process dead-letters something.
    pub(super) async fn settled_as_dead<Dl: Delivery>(&self, delivery: &Dl) -> bool {
        let Some(dead) = self.dead.recall(&self.source, delivery) else {
            return false;
        };
        tracing::warn!(
            target: TRACING_TARGET,
            "redelivered after its dead letter was published (its removal was lost or not confirmed): settling it \
             without running its handler"
        );
        match dead {
            Dead::Stored => self.discard(delivery, Outcome::DeadLettered).await,
            Dead::Unsure(Unsure { kind, reason, attempts }) => {
                self.dead_letter(delivery, kind, &reason, attempts, Outcome::DeadLettered)
                    .await;
            }
        }
        true
    }

    /// Publishes the dead letter, then removes the delivery
    /// ([`discard`](Self::discard)). A publish the broker refused hands the
    /// delivery back, except on its last delivery, where it is tried again
    /// until it works or the consumer stops; one whose outcome is unknown
    /// (no answer in time) is tried again, as safe. From the moment the
    /// dead letter may be stored, the message is remembered
    /// ([`dead`](super::dead)): its redelivery is settled without its
    /// handler.
    async fn dead_letter<Dl: Delivery>(
        &self,
        delivery: &Dl,
        kind: DeadKind,
        reason: &str,
        attempts: u32,
        outcome: Outcome,
    ) {
        let reason = truncate_reason(reason);
        let letter = Letter {
            kind: kind.as_str(),
            reason: &reason,
            attempts,
            source: &self.source,
        };
        let identity = delivery.identity();
        // An earlier publish of it (on a delivery before this one) may have
        // stored it.
        let mut maybe_stored = identity
            .as_deref()
            .is_some_and(|identity| self.dead.recall_identity(&self.source, identity).is_some());
        // Remembered before the first publish: the task may be dropped
        // while it waits for the broker's answer (a consumer aborted, its
        // shutdown timeout run out), the dead letter stored all the same.
        if let Some(identity) = &identity {
            let letter = Unsure {
                kind,
                reason: reason.clone(),
                attempts,
            };
            self.dead.remember(&self.source, identity, Dead::Unsure(letter));
        }
        let last = delivery.meta().last;
        let mut failures = 0u32;
        loop {
            let published = on_own_connection(delivery, || delivery.dead_letter(&letter)).await;
            // A publish whose outcome is not known may have stored it.
            maybe_stored |= matches!(published, Err(Settle::Unknown(_)));
            match published {
                Ok(()) => break,
                Err(Settle::Lost(why)) => {
                    tracing::warn!(
                        target: TRACING_TARGET,
                        error = %why,
                        "connection lost while publishing the dead letter: the broker redelivers the message, whose \
                         dead letter is then published again"
                    );
                    self.recorder.outcome(Outcome::Released);
                    return;
                }
                Err(Settle::Unknown(why)) if !self.shutdown.is_cancelled() => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(
                        target: TRACING_TARGET,
                        error = %why,
                        failures,
                        "the dead letter's publish was not confirmed in time: publishing it again"
                    );
                    delivery.progress().await;
                    sleep_unless_cancelled(self.options.retry_backoff.delay(failures), &self.shutdown).await;
                }
                Err(Settle::Unknown(why)) => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        "the dead letter's publish was not confirmed before shutdown: handing the message back (its \
                         redelivery to this consumer publishes it again)"
                    );
                    self.release(delivery).await;
                    return;
                }
                Err(Settle::Refused(why)) if last && !self.shutdown.is_cancelled() => {
                    failures = failures.saturating_add(1);
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        failures,
                        "could not publish the dead letter of a message on its last delivery: retrying"
                    );
                    delivery.progress().await;
                    sleep_unless_cancelled(self.options.retry_backoff.delay(failures), &self.shutdown).await;
                }
                Err(Settle::Refused(why)) if last => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        "could not publish the dead letter of a message on its last delivery before shutdown: \
                         handing it to the broker, which may not deliver it again (see its max-deliveries advisory)"
                    );
                    // The broker's own last word on it (JetStream tries its
                    // dead letter once more).
                    self.let_go(delivery).await;
                    return;
                }
                Err(Settle::Refused(why)) => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        "could not publish the dead letter: handing the message back"
                    );
                    // Nothing stored: its redelivery is handled as any.
                    if let Some(identity) = identity.as_deref().filter(|_| !maybe_stored) {
                        self.dead.forget(&self.source, identity);
                    }
                    self.release(delivery).await;
                    return;
                }
            }
        }
        if let Some(identity) = &identity {
            self.dead.remember(&self.source, identity, Dead::Stored);
        }
        self.discard(delivery, outcome).await;
    }

    /// Removes a delivery whose dead letter is stored, trying again until
    /// the broker takes it, the connection is lost (the broker redelivers
    /// it, and [`settled_as_dead`](Self::settled_as_dead) settles the
    /// redelivery) or the consumer stops.
    async fn discard<Dl: Delivery>(&self, delivery: &Dl, outcome: Outcome) {
        let mut failures = 0u32;
        loop {
            match on_own_connection(delivery, || delivery.discard()).await {
                Ok(()) => break,
                Err(Settle::Lost(why)) => {
                    tracing::warn!(
                        target: TRACING_TARGET,
                        error = %why,
                        "connection lost after the dead letter was stored: the broker redelivers the message, which \
                         is then settled without running its handler"
                    );
                    break;
                }
                Err(why) if !self.shutdown.is_cancelled() => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(
                        target: TRACING_TARGET,
                        error = %why,
                        failures,
                        "the dead letter is stored, but removing the message failed: trying the removal again"
                    );
                    delivery.progress().await;
                    sleep_unless_cancelled(self.options.retry_backoff.delay(failures), &self.shutdown).await;
                }
                Err(why) => {
                    tracing::error!(
                        target: TRACING_TARGET,
                        error = %why,
                        "the dead letter is stored, but removing the message failed before shutdown: a redelivery \
                         to this consumer is settled without its handler, one after a restart runs it again"
                    );
                    break;
                }
            }
        }
        self.recorder.outcome(outcome);
    }
}

/// Settles `delivery` with `settle`, on the connection it came on only:
/// once that connection is lost, the broker redelivers it.
async fn on_own_connection<Dl, F>(delivery: &Dl, settle: impl FnOnce() -> F) -> Result<(), Settle>
where
    Dl: Delivery,
    F: Future<Output = Result<(), Settle>>,
{
    if delivery.is_current() {
        settle().await
    } else {
        Err(Settle::Lost("the connection it came on was lost".into()))
    }
}
