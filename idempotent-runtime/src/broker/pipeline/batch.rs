//! Batches: several deliveries gathered and run in one database
//! transaction.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::deliver::{Beat, process};
use super::span::delivery_span;
use super::traits::{Delivery, Next, Session};
use super::worker::Worker;
use crate::broker::options::{BatchMode, ConsumerOptions};
use crate::broker::stats::Recorder;
use crate::broker::{Called, Decoder, Handler, RetryPolicy, TRACING_TARGET};
use crate::signal::Noted;

/// Gathers a batch: `first`, then what the session has ready, up to the
/// batch's size, waiting at most its `max_wait`. Also returns what ended
/// the gathering when it was not a delivery (end, lost connection), for the
/// run loop.
pub(super) async fn gather<S: Session>(
    session: &mut S,
    first: S::Delivery,
    mode: &BatchMode,
    recorder: &Recorder,
) -> (Vec<S::Delivery>, Option<Next<S::Delivery>>) {
    let mut deliveries = vec![first];
    let deadline = Instant::now() + mode.max_wait;
    while deliveries.len() < mode.max {
        // `timeout_at` polls `next` before looking at the clock: with no
        // wait, this takes exactly what is ready.
        match tokio::time::timeout_at(deadline, session.next(mode.max - deliveries.len())).await {
            Ok(Next::Delivery(delivery)) => {
                recorder.received();
                deliveries.push(delivery);
            }
            Ok(Next::Idle) | Err(_) => break,
            Ok(other) => return (deliveries, Some(other)),
        }
    }
    (deliveries, None)
}

/// A batch of deliveries in one database transaction (see
/// [`ConsumerBuilder::batch`](super::ConsumerBuilder::batch)): the handlers
/// run together in the [`Batch`](crate::batch::Batch)
/// ([`run_all`](crate::batch::Batch::run_all)); after the commit each
/// delivery is settled on its handler's outcome, as alone, those whose
/// handler returned `Ok` acknowledged together ([`Delivery::ack_all`]).
/// A batch that cannot begin or commit ran for nothing (its transaction
/// rolled back): its deliveries then run again, one per transaction.
///
/// Every delivery of the batch is kept alive (its
/// [`progress`](Delivery::progress) sent at its heartbeat) from the moment
/// it is gathered until its settlement begins, whatever runs meanwhile: the
/// other members' handlers after its own returned, the commit, the
/// settlement of the members settled alone before it (the poison and last
/// deliveries). A delivery the broker took for stuck would be
/// redelivered, possibly on its last allowed delivery, while the batch
/// commits its effect.
pub(super) async fn process_batch<Dl, M, A, D, R, H>(worker: Arc<Worker<D, R, H>>, deliveries: Vec<Dl>)
where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<H::Error>,
    H: Handler<M, A>,
{
    let Some(mode) = &worker.options.batch else {
        for delivery in deliveries {
            process(Arc::clone(&worker), delivery).await;
        }
        return;
    };
    let kept = Kept::new(deliveries.len());
    // On the heap: the batch's work holds every handler's future.
    let work = Box::pin(run_batch(&worker, mode, &deliveries, &kept));
    tokio::select! {
        biased;
        () = work => {}
        () = keep_alive(&deliveries, &kept) => {}
    }
}

/// [`process_batch`]'s work; each delivery is taken from the
/// [`keep_alive`] of the batch ([`Kept::take`]) when its settlement
/// begins.
async fn run_batch<Dl, M, A, D, R, H>(worker: &Worker<D, R, H>, mode: &BatchMode, deliveries: &[Dl], kept: &Kept)
where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<H::Error>,
    H: Handler<M, A>,
{
    // The last delivery of a message, what is poison, and a message
    // already dead-lettered are settled alone, as without batches.
    let mut ready = Vec::with_capacity(deliveries.len());
    for (index, delivery) in deliveries.iter().enumerate() {
        // A redelivery of a dead-lettered message too: it is not run.
        let dead = worker.dead.recall(&worker.source, delivery).is_some();
        let decoded = match (delivery.meta().last || dead, worker.refused_body(delivery)) {
            (false, None) => worker.decoder.decode(delivery.body()).ok(),
            _ => None,
        };
        match decoded {
            Some(message) => ready.push(((index, delivery), message)),
            None => {
                kept.take(index).await;
                worker.handle_alone(delivery).await;
            }
        }
    }
    if ready.is_empty() {
        return;
    }
    let batch = match begin(worker, mode).await {
        Ok(batch) => batch,
        Err(error) => {
            tracing::warn!(
                target: TRACING_TARGET,
                %error,
                deliveries = ready.len(),
                "cannot begin a batch: running its deliveries one by one"
            );
            for ((index, delivery), _) in ready {
                kept.take(index).await;
                worker.handle_alone(delivery).await;
            }
            return;
        }
    };
    batch.set_savepoints(mode.savepoints);
    let (members, messages): (Vec<(usize, &Dl)>, Vec<M>) = ready.into_iter().unzip();
    let spans: Vec<Span> = members
        .iter()
        .map(|(_, delivery)| delivery_span(worker, *delivery))
        .collect();
    // Their progress is the batch's keep-alive's.
    let calls = members
        .iter()
        .zip(messages)
        .zip(&spans)
        .map(|((&(_, delivery), message), span)| {
            worker
                .unless_abandoned(worker.call(delivery.meta(), message, false))
                .instrument(span.clone())
        })
        .collect();
    let outcomes = batch.run_all(calls).await;
    let members = members.into_iter().zip(spans);
    if outcomes.iter().any(Option::is_none) {
        // Shutdown timeout: nothing of the batch commits.
        batch.rollback().await;
        for ((index, delivery), span) in members {
            kept.take(index).await;
            worker.let_go(delivery).instrument(span).await;
        }
        return;
    }
    let ran: Vec<_> = members
        .zip(outcomes)
        .filter_map(|((member, span), outcome)| outcome.map(|outcome| (member, span, outcome)))
        .collect();
    let size = ran.len();
    let fresh = batch.fresh_claims();
    // Where the members that returned `Ok` are (offsets in the database).
    let committing: Vec<(i32, i64)> = ran
        .iter()
        .filter(|(_, _, (called, _))| matches!(called, Called::Ok))
        .filter_map(|((_, delivery), _, _)| Some((delivery.meta().partition?, delivery.meta().offset?)))
        .collect();
    // A member is all or nothing: one whose handler did not return `Ok`
    // after one of its calls completed (its marker, effects and outgoing
    // messages wait in the batch, past the call's savepoint) would leave
    // them in the commit without its offset or its success. Nothing of the
    // batch commits then; its deliveries run again one per transaction,
    // where a failing handler undoes what it wrote (offsets in the
    // database) or commits only its completed calls (markers), as alone.
    let half_done = ran
        .iter()
        .any(|(_, _, (called, noted))| !matches!(called, Called::Ok) && noted.processed);
    let committed = if half_done {
        batch.rollback().await;
        Err("a member's handler failed after one of its calls completed".to_owned())
    } else {
        commit(&worker.options, batch, committing).await
    };
    match committed {
        Ok(()) => {
            worker.recorder.batch(size);
            tracing::debug!(target: TRACING_TARGET, deliveries = size, fresh, "batch committed");
            settle_committed(worker, ran, kept).await;
        }
        Err(error) => {
            worker.recorder.batch_aborted();
            tracing::warn!(
                target: TRACING_TARGET,
                %error,
                deliveries = size,
                "batch not committed (nothing of it took effect): running its deliveries one by one"
            );
            for ((index, delivery), span, _) in ran {
                kept.take(index).await;
                worker.handle_from(delivery, None).instrument(span).await;
            }
        }
    }
}

/// A member of a batch whose handler ran: its index in the batch, its
/// delivery, its span and its handler's outcome.
type Ran<'a, Dl, E> = ((usize, &'a Dl), Span, (Called<E>, Noted));

/// Settles the members of a committed batch, each on its handler's
/// outcome, as alone: those that returned `Ok` are acknowledged together
/// (in as few broker calls as the broker allows: [`Delivery::ack_all`]),
/// the others (retried, dead-lettered, run again after an outage) each
/// settled on its own, all at once, so that one's backoff does not hold
/// the others back. Each leaves the batch's keep-alive when its
/// settlement begins.
async fn settle_committed<Dl, M, A, D, R, H>(worker: &Worker<D, R, H>, ran: Vec<Ran<'_, Dl, H::Error>>, kept: &Kept)
where
    Dl: Delivery,
    D: Decoder<M>,
    R: RetryPolicy<H::Error>,
    H: Handler<M, A>,
{
    let mut acks = Vec::with_capacity(ran.len());
    let mut others = Vec::new();
    let mut taken = Vec::with_capacity(ran.len());
    for ((index, delivery), span, (called, noted)) in ran {
        match called {
            Called::Ok => {
                taken.push(index);
                acks.push((delivery, span, noted));
            }
            called => others.push(((index, delivery), span, (called, noted))),
        }
    }
    kept.take_all(&taken).await;
    let settled_alone =
        futures_util::future::join_all(others.into_iter().map(|((index, delivery), span, outcome)| async move {
            kept.take(index).await;
            worker.handle_from(delivery, Some(outcome)).instrument(span).await;
        }));
    futures_util::future::join(worker.ack_committed(acks), settled_alone).await;
}

/// Begins a batch: on the offsets' store with offsets in the database
/// (the transaction stores them), else on the batch's store.
async fn begin<D, R, H>(worker: &Worker<D, R, H>, mode: &BatchMode) -> Result<crate::batch::Batch, crate::Error> {
    #[cfg(feature = "kafka")]
    if let Some(offsets) = &worker.options.offsets {
        return offsets.0.begin().await;
    }
    #[cfg(not(feature = "kafka"))]
    let _ = worker;
    (mode.begin)().await
}

/// Commits a batch whose handlers ran. With offsets in the database, its
/// transaction first stores the next offset of each partition of
/// `committing` (the `(partition, offset)` of the members whose handler
/// returned `Ok`); it is rolled back, as a batch that did not commit, when
/// a stored offset is already past one of them (another consumer committed
/// it).
async fn commit(
    options: &ConsumerOptions,
    batch: crate::batch::Batch,
    committing: Vec<(i32, i64)>,
) -> Result<(), String> {
    #[cfg(feature = "kafka")]
    if let Some(offsets) = &options.offsets {
        use super::offsets::{Stored, store};
        let advances = crate::broker::kafka::offsets::Advance::of(committing);
        return match store(offsets.0.as_ref(), batch, &advances).await {
            Stored::Committed => Ok(()),
            Stored::AlreadyPast => Err("a stored offset is already past a record of the batch".into()),
            Stored::Failed(why) => Err(why),
        };
    }
    #[cfg(not(feature = "kafka"))]
    let _ = (options, committing);
    batch.commit().await.map_err(|error| error.to_string())
}

/// Which deliveries of a batch its [`keep_alive`] still sends progress
/// for: each until its settlement begins (from then on, the settlement
/// keeps it alive, as a delivery alone).
struct Kept(tokio::sync::Mutex<Vec<bool>>);

impl Kept {
    fn new(deliveries: usize) -> Kept {
        Kept(tokio::sync::Mutex::new(vec![true; deliveries]))
    }

    /// Takes delivery `index` out of the keep-alive, once the progress
    /// being sent (if any) has been: none of its progress follows its
    /// settlement (a JetStream "in progress" after a delayed `nak` would
    /// cut the delay short).
    async fn take(&self, index: usize) {
        if let Some(kept) = self.0.lock().await.get_mut(index) {
            *kept = false;
        }
    }

    /// [`take`](Self::take)s the deliveries `indexes`, at once.
    async fn take_all(&self, indexes: &[usize]) {
        if indexes.is_empty() {
            return;
        }
        let mut kept = self.0.lock().await;
        for &index in indexes {
            if let Some(kept) = kept.get_mut(index) {
                *kept = false;
            }
        }
    }
}

/// Sends the progress of every delivery of a batch still [`Kept`], at the
/// shortest of their heartbeats; never returns (pending for ever when they
/// have no heartbeat).
async fn keep_alive<Dl: Delivery>(deliveries: &[Dl], kept: &Kept) {
    let mut beat = Beat::new(deliveries.iter().filter_map(Delivery::heartbeat).min());
    loop {
        beat.tick().await;
        let kept = kept.0.lock().await;
        let alive = deliveries
            .iter()
            .zip(kept.iter())
            .filter(|(_, kept)| **kept)
            .map(|(delivery, _)| delivery.progress());
        futures_util::future::join_all(alive).await;
    }
}
