//! Offsets in the database: a [`KafkaConsumer`](super::KafkaConsumer) that
//! keeps each partition's next offset in the same database transaction as
//! the handler's effect ([`offsets_in`](super::ConsumerBuilder::offsets_in)).
//!
//! The pieces: [`OffsetStore`], the stores that can (their claims join a
//! transaction the consumer opens); the table and its statements are each
//! store's (`store/kafka_offsets.rs`); the [`OffsetTable`] of one consumer
//! (its group and topic on one store) is what the pipeline writes through
//! before it commits a delivery's transaction, and what the consumer's
//! thread reads when the group assigns it partitions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::Error;
use crate::batch::{Batch, BatchStore};
use crate::store::kafka_offsets::OffsetSql;
use crate::store::sql::SqlBackend;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store that can keep a Kafka consumer's offsets in the handler's
/// transaction: `PgStore`, `MySqlStore` and `SqliteStore` (a
/// [`partitioned`](crate::store::PgStoreBuilder::partitioned) `PgStore` is
/// refused at build: its claims keep a transaction of their own). Redis and
/// the memory store cannot: there is no transaction to put the offset in.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot keep Kafka offsets in the handler's transaction",
    label = "not a store whose claims join a database transaction",
    note = "offsets in the database need `PgStore`, `MySqlStore` or `SqliteStore` (the same store as the \
            `#[idempotent]` handler's); `RedisStore` and `MemoryStore` have no transaction to put the offset in"
)]
pub trait OffsetStore: sealed::Sealed {}

pub(crate) mod sealed {
    use super::{Arc, OffsetTable};

    /// Builds the [`OffsetTable`] of one consumer (sealed: only the SQL
    /// stores).
    pub trait Sealed: Send + Sync + 'static {
        /// The table of `group`'s offsets of `topic` on this store, or why
        /// the store cannot keep them.
        fn offset_table(&self, group: &str, topic: &str) -> Result<Arc<dyn OffsetTable>, String>;
    }
}

/// A partition's offset to store with a transaction: it covers the records
/// from `first` to `next - 1`, and the partition's next offset becomes
/// `next`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advance {
    /// The partition.
    pub partition: i32,
    /// The offset of its first record in the transaction.
    pub first: i64,
    /// Its next offset once the transaction commits.
    pub next: i64,
}

impl Advance {
    /// The advances of a transaction's records `(partition, offset)`: per
    /// partition, from its lowest offset to its highest + 1.
    pub(crate) fn of(records: impl IntoIterator<Item = (i32, i64)>) -> Vec<Advance> {
        let mut by_partition: std::collections::BTreeMap<i32, (i64, i64)> = std::collections::BTreeMap::new();
        for (partition, offset) in records {
            let span = by_partition.entry(partition).or_insert((offset, offset));
            span.0 = span.0.min(offset);
            span.1 = span.1.max(offset);
        }
        by_partition
            .into_iter()
            .map(|(partition, (first, last))| Advance {
                partition,
                first,
                next: last.saturating_add(1),
            })
            .collect()
    }
}

/// One consumer's offsets (its group's, of its topic) on one store.
pub trait OffsetTable: Send + Sync {
    /// Where they are, for messages: `table (group/topic)`.
    fn describe(&self) -> String;

    /// Begins the transaction a delivery (or a batch of them) runs in.
    fn begin(&self) -> BoxFuture<'_, Result<Batch, Error>>;

    /// Moves the partitions' stored offsets in `batch`'s transaction (after
    /// its handlers ran): `true` when every one moved, `false` when one was
    /// already past the records (they were committed by another
    /// transaction: this one must roll back).
    fn advance<'a>(&'a self, batch: &'a Batch, advances: &'a [Advance]) -> BoxFuture<'a, Result<bool, Error>>;

    /// The stored next offset of each partition that has one.
    fn read(&self) -> BoxFuture<'_, Result<Vec<(i32, i64)>, Error>>;

    /// Moves one partition's offset past the record at `offset` in a
    /// transaction of its own (a dead-lettered record): `false` when it was
    /// already past it.
    fn advance_alone(&self, partition: i32, offset: i64) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            let batch = self.begin().await?;
            let advance = [Advance {
                partition,
                first: offset,
                next: offset.saturating_add(1),
            }];
            match self.advance(&batch, &advance).await {
                Ok(true) => batch.commit().await.map(|()| true),
                Ok(false) => {
                    batch.rollback().await;
                    Ok(false)
                }
                Err(error) => {
                    batch.rollback().await;
                    Err(error)
                }
            }
        })
    }
}

/// What an SQL store gives its [`SqlOffsets`].
pub(crate) trait SqlOffsetStore: BatchStore + Clone + Send + Sync + 'static {
    type Db: SqlBackend;
    fn offsets_pool(&self) -> &sqlx::Pool<Self::Db>;
    fn offsets_sql(&self) -> &Arc<OffsetSql>;
}

/// The [`OffsetTable`] of a SQL store.
struct SqlOffsets<S: SqlOffsetStore> {
    store: S,
    sql: Arc<OffsetSql>,
    group: String,
    topic: String,
}

impl<S: SqlOffsetStore> OffsetTable for SqlOffsets<S> {
    fn describe(&self) -> String {
        format!("{} ({}/{})", self.sql.table, self.group, self.topic)
    }

    fn begin(&self) -> BoxFuture<'_, Result<Batch, Error>> {
        Box::pin(self.store.begin_batch())
    }

    fn advance<'a>(&'a self, batch: &'a Batch, advances: &'a [Advance]) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            if batch.is_aborted() {
                return Err(Error::BatchAborted);
            }
            let Some(mut tx) = batch.take_transaction::<S::Db>() else {
                return Err(Error::BatchAborted);
            };
            for advance in advances {
                let at = (self.group.as_str(), self.topic.as_str(), advance.partition);
                match S::Db::advance_offset(&mut *tx, &self.sql, at, advance.first, advance.next).await {
                    Ok(true) => {}
                    Ok(false) => {
                        batch.give_back_transaction(tx);
                        return Ok(false);
                    }
                    Err(error) => return Err(batch.fail_transaction(tx, error)),
                }
            }
            batch.give_back_transaction(tx);
            Ok(true)
        })
    }

    fn read(&self) -> BoxFuture<'_, Result<Vec<(i32, i64)>, Error>> {
        Box::pin(async move {
            Ok(S::Db::read_offsets(self.store.offsets_pool(), &self.sql, &self.group, &self.topic).await?)
        })
    }
}

fn sql_offsets<S: SqlOffsetStore>(store: &S, group: &str, topic: &str) -> Arc<dyn OffsetTable> {
    Arc::new(SqlOffsets {
        sql: Arc::clone(store.offsets_sql()),
        store: store.clone(),
        group: group.to_owned(),
        topic: topic.to_owned(),
    })
}

/// Implements the offset traits for a SQL store.
macro_rules! offset_store {
    ($store:ty, $db:ty, $check:expr) => {
        impl SqlOffsetStore for $store {
            type Db = $db;
            fn offsets_pool(&self) -> &sqlx::Pool<$db> {
                self.pool()
            }
            fn offsets_sql(&self) -> &Arc<OffsetSql> {
                self.kafka_offsets()
            }
        }

        impl sealed::Sealed for $store {
            fn offset_table(&self, group: &str, topic: &str) -> Result<Arc<dyn OffsetTable>, String> {
                let check: fn(&$store) -> Result<(), String> = $check;
                check(self)?;
                Ok(sql_offsets(self, group, topic))
            }
        }

        impl OffsetStore for $store {}
    };
}

#[cfg(feature = "postgres")]
offset_store!(crate::PgStore, sqlx::Postgres, |store| {
    if store.is_partitioned() {
        return Err(
            "a partitioned PgStore cannot keep Kafka offsets: its claims keep a transaction of their own, \
                    so the offset and the effect would not commit together"
                .into(),
        );
    }
    Ok(())
});
#[cfg(feature = "mysql")]
offset_store!(crate::MySqlStore, sqlx::MySql, |_| Ok(()));
#[cfg(feature = "sqlite")]
offset_store!(crate::SqliteStore, sqlx::Sqlite, |_| Ok(()));

#[cfg(test)]
mod tests {
    use super::Advance;

    #[test]
    fn a_transaction_advances_each_partition_from_its_first_record_past_its_last() {
        let advances = Advance::of([(1, 7), (0, 3), (1, 5), (0, 4)]);
        assert_eq!(
            advances,
            vec![
                Advance {
                    partition: 0,
                    first: 3,
                    next: 5
                },
                Advance {
                    partition: 1,
                    first: 5,
                    next: 8
                },
            ]
        );
    }
}
