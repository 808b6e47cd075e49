//! The partitioned marker layout of `PgStore` (`.partitioned(period)`):
//! markers partitioned by `expires_at`, retention by dropping whole
//! partitions instead of deleting rows.
//!
//! The primary key is `(scope, message_id, expires_at)` (a partition key
//! must be part of every unique key), so it no longer makes a second live
//! marker of a key a conflict by itself. The claim restores that:
//!
//! 1. `pg_advisory_xact_lock` on a hash of (table, scope, key) serialises the
//!    claims of one key across all partitions until the claiming transaction
//!    ends. It is its own statement, so that
//! 2. the next statement takes a fresh snapshot (Read Committed) and sees a
//!    marker committed by the claim it waited for: it looks for a live marker
//!    (`expires_at > now()`, which prunes expired partitions at run time)
//!    and, only if there is none, inserts the new one into the parent (routed
//!    to the partition of its expiry), in one statement.
//!
//! Expired markers are never updated or deleted: they are ignored by the
//! lookup and vanish with their partition. A partition is named
//! `<table>_<YYYYMMDDHHMMSS>` after its lower bound (UTC); bounds are
//! multiples of the period since the Unix epoch.

use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};

use crate::Error;
use crate::table::TableName;

/// The most partitions `migrate` and the janitor keep ahead of now.
pub(crate) const MAX_PARTITIONS_AHEAD: u64 = 1000;

/// Partitioning settings, as given to the builder.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartitionSettings {
    pub(crate) period: Duration,
    pub(crate) horizon: Option<Duration>,
}

/// A partitioned marker table: its statements and how partitions are kept.
#[derive(Debug)]
pub(crate) struct Partitions {
    parent: TableName,
    /// The parent, quoted.
    quoted: String,
    period_secs: i64,
    horizon_millis: i64,
    /// `SELECT pg_advisory_xact_lock(..)` for `($1 scope, $2 key)`.
    pub(crate) claim_lock: Arc<str>,
    /// Finds a live marker or inserts the new one: one row `(fresh,
    /// fingerprint, result)`.
    pub(crate) claim: Arc<str>,
    /// Writes the result into the live marker the claim inserted.
    pub(crate) write_result: Arc<str>,
    /// Advisory lock key serialising partition creation for this table.
    create_key: i64,
    /// Advisory lock key serialising the drop passes for this table.
    drop_key: i64,
}

/// SQLSTATE `check_violation`: an insert found no partition for its row
/// (the marker table has no check constraint of its own).
const NO_PARTITION: &str = "23514";

impl Partitions {
    /// Validates the settings for `table`.
    pub(crate) fn new(table: &TableName, settings: PartitionSettings) -> Result<Partitions, Error> {
        let period = settings.period;
        if period < Duration::from_secs(1) || period.subsec_nanos() != 0 {
            return Err(Error::Config(format!(
                "partition period must be a whole number of seconds, at least 1 s (got {period:?})"
            )));
        }
        if period > Duration::from_secs(366 * 24 * 3600) {
            return Err(Error::Config(format!(
                "partition period must be at most 366 days (got {period:?})"
            )));
        }
        // By default the default ttl plus one period, or as many periods as
        // are allowed ahead when that is fewer (claims beyond the horizon
        // create their partition themselves).
        let horizon = settings.horizon.unwrap_or_else(|| {
            (crate::store::DEFAULT_TTL + period).min(period.saturating_mul((MAX_PARTITIONS_AHEAD - 1) as u32))
        });
        let ahead = horizon.as_secs().div_ceil(period.as_secs()) + 1;
        if ahead > MAX_PARTITIONS_AHEAD {
            return Err(Error::Config(format!(
                "a partition period of {period:?} and a horizon of {horizon:?} keep {ahead} partitions ahead \
                 (at most {MAX_PARTITIONS_AHEAD}): choose a longer period or a shorter partition_horizon"
            )));
        }
        let period_secs =
            i64::try_from(period.as_secs()).map_err(|_| Error::Config("partition period out of range".into()))?;
        let t = table.quoted('"');
        let seed = seed(table);
        Ok(Partitions {
            claim_lock: format!("SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, {seed}))").into(),
            // By the statement's clock, not the transaction's start: the
            // advisory lock may have waited on a holder that then rolled
            // back, and the marker lives its ttl from the end of that wait
            // (issue 43, hole 7). Its expiry is not set again at the commit
            // (that would move the row to another partition): a marker of
            // this layout counts its ttl from its claim.
            claim: format!(
                "WITH live AS (\
                   SELECT fingerprint, result FROM {t} \
                   WHERE scope = $1 AND message_id = $2 AND expires_at > clock_timestamp() LIMIT 1\
                 ), fresh AS (\
                   INSERT INTO {t} (scope, message_id, processed_at, expires_at, fingerprint) \
                   SELECT $1, $2, clock_timestamp(), clock_timestamp() + $3 * interval '1 millisecond', $4 \
                   WHERE NOT EXISTS (SELECT 1 FROM live) \
                   RETURNING true AS fresh\
                 ) \
                 SELECT true AS fresh, NULL::text AS fingerprint, NULL::text AS result FROM fresh \
                 UNION ALL SELECT false, fingerprint, result FROM live"
            )
            .into(),
            // Only the claim's own marker is live (the advisory lock made sure
            // of it), its expiry after the transaction's start plus the ttl.
            write_result: format!(
                "UPDATE {t} SET result = $1 WHERE scope = $2 AND message_id = $3 AND expires_at >= now()"
            )
            .into(),
            create_key: seed ^ 0x5041_5254_4e45_5731,
            drop_key: seed ^ 0x5041_5254_4452_4f50,
            parent: table.clone(),
            quoted: t,
            period_secs,
            horizon_millis: crate::store::sql::millis(horizon),
        })
    }

    /// Whether `error` is an insert that found no partition for its expiry.
    pub(crate) fn is_missing_partition(error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some(NO_PARTITION))
    }

    /// The comment `migrate` puts on the parent: how it is partitioned.
    fn comment(&self) -> String {
        format!(
            "idempotent: markers partitioned by expires_at every {} s",
            self.period_secs
        )
    }

    /// Checks that the parent (created by `migrate`'s DDL, in `tx`) is a
    /// partitioned table with this store's period, and records the period on
    /// a new one.
    pub(crate) async fn check_parent(&self, conn: &mut sqlx::PgConnection) -> Result<(), Error> {
        let row = sqlx::query(
            "SELECT c.relkind::text AS kind, obj_description(c.oid, 'pg_class') AS comment \
             FROM pg_class c WHERE c.oid = to_regclass($1)",
        )
        .bind(&self.quoted)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = row else {
            return Err(Error::Config(format!("marker table {} was not created", self.parent)));
        };
        let kind: String = row.try_get("kind")?;
        if kind != "p" {
            return Err(Error::Config(format!(
                "marker table {} exists and is not partitioned: a partitioned store needs its own table \
                 (build it with another `.table(..)`, or drop the old one once its markers have expired)",
                self.parent
            )));
        }
        let comment: Option<String> = row.try_get("comment")?;
        match comment {
            None => {
                sqlx::query(AssertSqlSafe(format!(
                    "COMMENT ON TABLE {} IS '{}'",
                    self.quoted,
                    self.comment()
                )))
                .execute(&mut *conn)
                .await?;
            }
            Some(comment) if comment == self.comment() => {}
            Some(comment) => {
                return Err(Error::Config(format!(
                    "marker table {} is partitioned differently ({comment:?}); this store is configured for \
                     every {} s: keep the table's period or use another table",
                    self.parent, self.period_secs
                )));
            }
        }
        Ok(())
    }

    /// Creates the partitions ahead: expiries from now to now + the horizon.
    pub(crate) async fn create_ahead(&self, pool: &PgPool) -> Result<u64, Error> {
        self.ensure(pool, 0, self.horizon_millis).await
    }

    /// Creates the partitions a claim with `ttl_millis` would insert into
    /// (that of `now() + ttl` and the next one, should the clock cross a
    /// boundary before the retry).
    pub(crate) async fn create_for_ttl(&self, pool: &PgPool, ttl_millis: i64) -> Result<u64, Error> {
        let period_millis = self.period_secs.saturating_mul(1000);
        self.ensure(pool, ttl_millis, ttl_millis.saturating_add(period_millis))
            .await
    }

    /// Creates the missing partitions covering expiries from `now() + from`
    /// to `now() + to` (milliseconds), each attached to the parent with a
    /// `SHARE UPDATE EXCLUSIVE` lock (claims keep running); returns how many.
    async fn ensure(&self, pool: &PgPool, from_millis: i64, to_millis: i64) -> Result<u64, Error> {
        // Read Committed whatever the sessions' default (at Repeatable Read
        // the snapshot would predate the lock, and a partition another
        // claim created while this one waited would look missing).
        let mut tx = pool.begin_with(crate::store::postgres::BEGIN_READ_COMMITTED).await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.create_key)
            .execute(&mut *tx)
            .await?;
        let missing = sqlx::query(
            "SELECT n, to_char(to_timestamp(n * $3) AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISS') AS suffix \
             FROM generate_series(\
               floor(extract(epoch FROM now() + $1 * interval '1 millisecond') / $3)::bigint, \
               floor(extract(epoch FROM now() + $2 * interval '1 millisecond') / $3)::bigint) AS n \
             WHERE NOT EXISTS (\
               SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
               WHERE i.inhparent = to_regclass($4) \
                 AND c.relname = $5 || '_' || to_char(to_timestamp(n * $3) AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISS'))",
        )
        .bind(from_millis)
        .bind(to_millis)
        .bind(self.period_secs)
        .bind(&self.quoted)
        .bind(self.parent.table())
        .fetch_all(&mut *tx)
        .await?;
        let mut created = 0;
        for row in missing {
            let n: i64 = row.try_get("n")?;
            let suffix: String = row.try_get("suffix")?;
            let child = self.child(&suffix)?;
            let lower = n.saturating_mul(self.period_secs);
            let upper = lower.saturating_add(self.period_secs);
            // A plain table attached afterwards: `CREATE TABLE .. PARTITION
            // OF` would take an ACCESS EXCLUSIVE lock on the parent and wait
            // for (and block) every claim in flight.
            sqlx::query(AssertSqlSafe(format!(
                "CREATE TABLE {child} (LIKE {} INCLUDING DEFAULTS)",
                self.quoted
            )))
            .execute(&mut *tx)
            .await?;
            sqlx::query(AssertSqlSafe(format!(
                "ALTER TABLE {} ATTACH PARTITION {child} FOR VALUES FROM (to_timestamp({lower})) TO \
                 (to_timestamp({upper}))",
                self.quoted
            )))
            .execute(&mut *tx)
            .await?;
            created += 1;
        }
        tx.commit().await?;
        if created > 0 {
            tracing::debug!(target: "idempotent", table = %self.parent, created, "marker partitions created");
        }
        Ok(created)
    }

    /// Detaches (concurrently: claims keep running) and drops the partitions
    /// whose upper bound is in the past, so all their markers have expired;
    /// returns how many markers they held. Another process's janitor
    /// dropping at the same time makes this pass a no-op.
    pub(crate) async fn drop_expired(&self, pool: &PgPool) -> Result<u64, Error> {
        let mut conn = pool.acquire().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(self.drop_key)
            .fetch_one(&mut *conn)
            .await?;
        if !locked {
            return Ok(0);
        }
        let dropped = self.drop_expired_locked(&mut conn).await;
        let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(self.drop_key)
            .execute(&mut *conn)
            .await;
        if unlocked.is_err() {
            // Never hand a connection that may still hold the lock back to
            // the pool: closing it releases the lock.
            let _ = conn.close().await;
        }
        dropped
    }

    async fn drop_expired_locked(&self, conn: &mut PoolConnection<Postgres>) -> Result<u64, Error> {
        let expired = sqlx::query(
            "SELECT c.relname::text AS name, i.inhdetachpending AS pending \
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1) AND (i.inhdetachpending OR \
               substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']*)''\\)')::timestamptz <= now()) \
             ORDER BY c.relname",
        )
        .bind(&self.quoted)
        .fetch_all(&mut **conn)
        .await?;
        let mut markers = 0;
        for row in expired {
            let name: String = row.try_get("name")?;
            let pending: bool = row.try_get("pending")?;
            let Some(suffix) = name
                .strip_prefix(self.parent.table())
                .and_then(|rest| rest.strip_prefix('_'))
            else {
                tracing::warn!(target: "idempotent", table = %self.parent, partition = %name,
                    "expired partition not created by this store: left in place");
                continue;
            };
            let Ok(child) = self.child(suffix) else {
                tracing::warn!(target: "idempotent", table = %self.parent, partition = %name,
                    "expired partition not created by this store: left in place");
                continue;
            };
            let count: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {child}")))
                .fetch_one(&mut **conn)
                .await?;
            // A detach interrupted by a crash is finished first.
            let detach = if pending { "FINALIZE" } else { "CONCURRENTLY" };
            sqlx::query(AssertSqlSafe(format!(
                "ALTER TABLE {} DETACH PARTITION {child} {detach}",
                self.quoted
            )))
            .execute(&mut **conn)
            .await?;
            sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {child}")))
                .execute(&mut **conn)
                .await?;
            markers += u64::try_from(count).unwrap_or(0);
            tracing::debug!(target: "idempotent", table = %self.parent, partition = %name, markers = count,
                "expired marker partition dropped");
        }
        Ok(markers)
    }

    /// The quoted partition `<table>_<suffix>` in the parent's schema; the
    /// suffix must be the 14 digits of a lower bound.
    fn child(&self, suffix: &str) -> Result<String, Error> {
        if suffix.len() != 14 || !suffix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Error::Config(format!("unexpected partition suffix {suffix:?}")));
        }
        let table = format!("{}_{suffix}", self.parent.table());
        Ok(match self.parent.schema() {
            Some(schema) => format!("\"{schema}\".\"{table}\""),
            None => format!("\"{table}\""),
        })
    }
}

/// A stable 64-bit hash of the table name (FNV-1a): the claims of two
/// stores on different tables never wait on each other's advisory locks.
fn seed(table: &TableName) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in table.to_string().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(period: u64, horizon: Option<u64>) -> PartitionSettings {
        PartitionSettings {
            period: Duration::from_secs(period),
            horizon: horizon.map(Duration::from_secs),
        }
    }

    #[test]
    fn periods_and_horizons_are_checked() {
        let table = TableName::default();
        assert!(Partitions::new(&table, settings(86_400, None)).is_ok());
        assert!(Partitions::new(&table, settings(1, Some(10))).is_ok());
        assert!(
            Partitions::new(&table, settings(1, None)).is_ok(),
            "a capped default horizon"
        );
        for bad in [settings(0, None), settings(1, Some(5000)), settings(400 * 86_400, None)] {
            let err = Partitions::new(&table, bad).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{err}");
        }
        let sub_second = PartitionSettings {
            period: Duration::from_millis(1500),
            horizon: None,
        };
        assert!(Partitions::new(&table, sub_second).is_err());
    }

    #[test]
    fn partition_names_are_validated_and_quoted_in_the_parent_schema() {
        let p = Partitions::new(&TableName::new("app.seen").unwrap(), settings(3600, None)).unwrap();
        assert_eq!(p.child("20261201000000").unwrap(), "\"app\".\"seen_20261201000000\"");
        assert!(p.child("2026120100000x").is_err());
        assert!(p.child("\"; DROP TABLE x; --").is_err());
        assert_ne!(seed(&TableName::new("a").unwrap()), seed(&TableName::new("b").unwrap()));
    }
}
