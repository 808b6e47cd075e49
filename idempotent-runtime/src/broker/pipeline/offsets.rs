//! Offsets in the database (a Kafka consumer's
//! [`offsets_in`](crate::broker::ConsumerBuilder::offsets_in)): every
//! handler call runs in a transaction the consumer opens on the offsets'
//! store (the `#[idempotent]` claims on that store join it, as in a
//! [`Batch`](crate::batch::Batch)), and the transaction stores the
//! delivery's partition's next offset before it commits.
//!
//! The stored offset only moves forward, from where the committed records
//! say: a transaction whose record the stored offset already passed (a
//! revoked consumer's handler that outlived its partition, whose new owner
//! committed the record meanwhile) rolls back, effect included, and the
//! delivery is settled as a duplicate.

use super::traits::Meta;
use super::worker::Worker;
use crate::batch::Batch;
use crate::broker::kafka::offsets::{Advance, OffsetTable};
use crate::broker::{Called, Handler, TRACING_TARGET};
use crate::signal::{Noted, Outcome};

impl<D, R, H> Worker<D, R, H> {
    /// The handler's call on one delivery at `(partition, offset)`, in a
    /// transaction of `offsets`' store that also stores the partition's
    /// next offset. `Called::Unstored` when the transaction could not
    /// begin, store the offset or commit (nothing of the call took effect).
    pub(super) async fn call_storing_offset<M, A>(
        &self,
        offsets: &dyn OffsetTable,
        (partition, offset): (i32, i64),
        meta: &Meta,
        message: M,
        check_only: bool,
    ) -> (Called<H::Error>, Noted)
    where
        H: Handler<M, A>,
    {
        let batch = match offsets.begin().await {
            Ok(batch) => batch,
            Err(error) => {
                return (
                    Called::Unstored(format!("cannot begin the transaction of the record's offset: {error}")),
                    Noted::default(),
                );
            }
        };
        let (called, mut noted) = batch.run(Box::pin(self.call(meta, message, check_only))).await;
        if !matches!(called, Called::Ok) {
            batch.rollback().await;
            return (called, noted);
        }
        let advance = [Advance {
            partition,
            first: offset,
            next: offset.saturating_add(1),
        }];
        match store(offsets, batch, &advance).await {
            Stored::Committed => (called, noted),
            Stored::AlreadyPast => {
                tracing::info!(
                    target: TRACING_TARGET,
                    partition,
                    offset,
                    "the stored offset is already past this record (another consumer committed it): its effect was \
                     rolled back"
                );
                noted.outcome = Some(Outcome::Duplicate);
                (Called::Ok, noted)
            }
            Stored::Failed(why) => (Called::Unstored(why), noted),
        }
    }
}

/// What storing a transaction's offsets came to.
pub(super) enum Stored {
    /// The offsets and the effects committed together.
    Committed,
    /// A partition's stored offset was already past the transaction's
    /// records: rolled back.
    AlreadyPast,
    /// The offsets or the commit failed: rolled back.
    Failed(String),
}

/// Stores `advances` in `batch`'s transaction and commits it (or rolls it
/// back, when a stored offset is already past its records or a statement
/// failed).
pub(super) async fn store(offsets: &dyn OffsetTable, batch: Batch, advances: &[Advance]) -> Stored {
    let advanced = if advances.is_empty() {
        Ok(true)
    } else {
        offsets.advance(&batch, advances).await
    };
    match advanced {
        Ok(true) => match batch.commit().await {
            Ok(()) => Stored::Committed,
            Err(error) => Stored::Failed(format!("the transaction storing the offset did not commit: {error}")),
        },
        Ok(false) => {
            batch.rollback().await;
            Stored::AlreadyPast
        }
        Err(error) => {
            batch.rollback().await;
            Stored::Failed(format!("storing the offset in {} failed: {error}", offsets.describe()))
        }
    }
}
