//! The run loop: connecting (again), taking deliveries while handler
//! slots are free, and the shutdown drain.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

#[cfg(feature = "sqlx")]
use super::batch::{gather, process_batch};
use super::dead::DeadLettered;
use super::deliver::process;
use super::traits::{Broker, Connect, Next, Session};
use super::worker::{Worker, millis};
use crate::broker::options::ConsumerOptions;
use crate::broker::stats::{ConnectionEvent, Recorder};
use crate::broker::{
    CancellationToken, ConsumerError, ConsumerStats, Decoder, Handler, RetryPolicy, RunStats, TRACING_TARGET,
    sleep_unless_cancelled,
};

/// How long handlers that were asked to let go (after the shutdown timeout)
/// get to release their deliveries before their tasks are aborted.
const ABANDON_GRACE: Duration = Duration::from_secs(5);

/// Runs a consumer of `broker` until shutdown (or idle, or a fatal error).
pub(crate) async fn run<B, M, A, D, R, H>(
    broker: B,
    options: ConsumerOptions,
    decoder: D,
    retry: R,
    handler: H,
    stats: ConsumerStats,
    shutdown: CancellationToken,
) -> Result<RunStats, ConsumerError>
where
    B: Broker,
    M: Send + 'static,
    A: 'static,
    D: Decoder<M>,
    R: RetryPolicy<H::Error>,
    H: Handler<M, A>,
{
    let source = broker.source();
    let recorder = Recorder::new(B::NAME, &source, stats.clone());
    let worker = Arc::new(Worker {
        source: source.clone(),
        broker: B::NAME,
        messaging: broker.messaging(),
        options: options.clone(),
        decoder,
        retry,
        handler,
        recorder: recorder.clone(),
        shutdown: shutdown.clone(),
        abandon: CancellationToken::new(),
        dead: DeadLettered::process(),
    });
    let concurrency = options.concurrency;
    #[cfg(feature = "sqlx")]
    let per_task = options.batch.as_ref().map_or(1, |batch| batch.max);
    #[cfg(not(feature = "sqlx"))]
    let per_task = 1;
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut fatal: Option<ConsumerError> = None;
    // Connection attempts failed in a row, and whether one was ever lost.
    let mut failures = 0u32;
    let mut lost = false;
    // The session that ended with the stop: closed after the drain, so the
    // handlers still running can settle on it.
    let mut stopped: Option<B::Session> = None;
    // When the stop was asked: the shutdown timeout counts from there, also
    // while the loop still waits for a handler slot (a delivery task stuck
    // on an unanswered connection must not hold the stop). With a slot
    // free, the loop goes on reading the session to its end (what it
    // fetched is released there, not dropped).
    let mut stop_asked: Option<Instant> = None;

    'connect: while !shutdown.is_cancelled() {
        // Raced against the shutdown: a broker that accepts the connection
        // and never answers must not hold the stop (nothing is received
        // before the connect returns, so nothing is dropped with it).
        let connected = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            connected = broker.connect(&options) => connected,
        };
        let mut session = match connected {
            Ok(session) => session,
            Err(Connect::Fatal(err)) => {
                fatal = Some(err);
                break;
            }
            Err(Connect::Failed(why)) => {
                failures = failures.saturating_add(1);
                if options.reconnect.max_attempts.is_some_and(|max| failures > max) {
                    tracing::error!(target: TRACING_TARGET, source = %source, error = %why, failures, "cannot connect: giving up");
                    fatal = Some(ConsumerError::Disconnected(format!(
                        "cannot connect to {} for `{source}` after {failures} attempts: {why}",
                        B::NAME
                    )));
                    break;
                }
                let delay = options.reconnect.backoff.delay(failures);
                tracing::warn!(
                    target: TRACING_TARGET,
                    source = %source,
                    error = %why,
                    failures,
                    delay_ms = millis(delay),
                    "cannot connect: retrying"
                );
                sleep_unless_cancelled(delay, &shutdown).await;
                continue;
            }
        };
        if lost {
            recorder.connection(ConnectionEvent::Reconnected);
            tracing::info!(target: TRACING_TARGET, broker = B::NAME, source = %source, after = failures, "reconnected");
        } else {
            tracing::info!(
                target: TRACING_TARGET,
                broker = B::NAME,
                source = %source,
                concurrency,
                max_attempts = options.max_attempts,
                "consumer started"
            );
        }
        failures = 0;
        // Idle time counts from the connection (a Kafka consumer's connect
        // includes joining its group, which takes seconds).
        let mut last_activity = Instant::now();
        let mut stopping = false;
        loop {
            while let Some(done) = tasks.try_join_next() {
                note_task(done);
                last_activity = Instant::now();
            }
            // A task is one delivery, or one batch of up to `per_task`.
            let room = concurrency.saturating_sub(tasks.len()).saturating_mul(per_task);
            let idle_at = options
                .stop_when_idle
                .filter(|_| !stopping && tasks.is_empty())
                .map(|idle| last_activity + idle);
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !stopping => {
                    stop_asked.get_or_insert_with(Instant::now);
                    session.stop().await;
                    stopping = true;
                    continue;
                }
                _ = sleep_until(idle_at), if idle_at.is_some() => {
                    tracing::info!(target: TRACING_TARGET, source = %source, "idle: stopping");
                    stop_asked.get_or_insert_with(Instant::now);
                    session.stop().await;
                    stopping = true;
                    continue;
                }
                _ = sleep_until(stop_asked.map(|at| at + options.shutdown_timeout)), if stopping && room == 0 => {
                    stopped = Some(session);
                    break 'connect;
                }
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    note_task(done);
                    last_activity = Instant::now();
                    continue;
                }
                next = session.next(room), if room > 0 => next,
            };
            #[cfg(feature = "sqlx")]
            let next = match (next, &options.batch) {
                (Next::Delivery(first), Some(mode)) => {
                    recorder.received();
                    last_activity = Instant::now();
                    let (deliveries, after) = gather(&mut session, first, mode, &recorder).await;
                    tasks.spawn(process_batch(Arc::clone(&worker), deliveries));
                    match after {
                        Some(next) => next,
                        None => continue,
                    }
                }
                (next, _) => next,
            };
            match next {
                Next::Delivery(delivery) => {
                    recorder.received();
                    last_activity = Instant::now();
                    tasks.spawn(process(Arc::clone(&worker), delivery));
                }
                Next::Idle => {}
                Next::End if stopping => {
                    stopped = Some(session);
                    break 'connect;
                }
                Next::End => {
                    fatal = Some(ConsumerError::Cancelled(source.clone()));
                    stopped = Some(session);
                    break 'connect;
                }
                Next::Lost(why) => {
                    recorder.connection(ConnectionEvent::Lost);
                    lost = true;
                    tracing::warn!(
                        target: TRACING_TARGET,
                        broker = B::NAME,
                        source = %source,
                        error = %why,
                        in_flight = tasks.len(),
                        "connection lost: reconnecting; what was in flight is redelivered by the broker"
                    );
                    if stopping {
                        break 'connect;
                    }
                    continue 'connect;
                }
            }
        }
    }

    tracing::info!(target: TRACING_TARGET, source = %source, in_flight = tasks.len(), "consumer stopping");
    let timeout = stop_asked.map_or(options.shutdown_timeout, |at| {
        options.shutdown_timeout.saturating_sub(at.elapsed())
    });
    drain(&mut tasks, timeout, &worker.abandon, &source).await;
    if let Some(session) = stopped {
        session.close().await;
    }
    let stats = stats.snapshot();
    tracing::info!(target: TRACING_TARGET, source = %source, ?stats, "consumer stopped");
    match fatal {
        Some(err) => Err(err),
        None => Ok(stats),
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Logs a delivery task that did not end normally (the handler's own panics
/// are caught inside the task: this is the adapter's).
fn note_task(done: Result<(), tokio::task::JoinError>) {
    if let Err(err) = done
        && err.is_panic()
    {
        tracing::error!(target: TRACING_TARGET, error = %err, "delivery task panicked");
    }
}

/// Waits for the in-flight delivery tasks, at most `timeout`; then asks
/// them to let go (they release their deliveries), and after a grace
/// period aborts what is left (those deliveries stay unsettled and the
/// broker redelivers them).
async fn drain(tasks: &mut JoinSet<()>, timeout: Duration, abandon: &CancellationToken, source: &str) {
    if join_within(tasks, timeout).await {
        return;
    }
    tracing::warn!(
        target: TRACING_TARGET,
        source,
        abandoned = tasks.len(),
        "shutdown timeout: abandoning in-flight handlers, their messages go back to the broker"
    );
    abandon.cancel();
    if !join_within(tasks, ABANDON_GRACE).await {
        tasks.shutdown().await;
    }
}

/// Joins the tasks as they end, for at most `limit`: `true` once none is
/// left, `false` when the time ran out first.
async fn join_within(tasks: &mut JoinSet<()>, limit: Duration) -> bool {
    let deadline = tokio::time::sleep(limit);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(done) => note_task(done),
                None => return true,
            },
            _ = &mut deadline => return false,
        }
    }
}
