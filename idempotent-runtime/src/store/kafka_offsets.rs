//! The table where a Kafka consumer in offsets-in-the-database mode
//! ([`offsets_in`](crate::broker::ConsumerBuilder::offsets_in)) keeps
//! each partition's next offset: its DDL (`sql/*_kafka_offsets.sql`, run by
//! each SQL store's `migrate()`) and its statements, in each backend's SQL.
//!
//! A partition's row moves only forward, and only from where the record
//! being committed says it is: the transaction that commits the record at
//! offset `o` sets the next offset to `o + 1` only while the stored one is
//! at most `o`. A transaction that finds it past `o` (another consumer
//! committed the record meanwhile, or a later one) changes nothing and is
//! rolled back with its effect.

use std::sync::Arc;

use crate::table::TableName;

/// The default table of a Kafka consumer's offsets in the database
/// (`kafka_offsets_table` on the SQL stores' builder sets another).
pub const DEFAULT_KAFKA_OFFSETS_TABLE: &str = "idempotent_kafka_offsets";

/// A store's Kafka offsets table: its DDL and statements.
#[derive(Debug)]
pub struct OffsetSql {
    /// The table, as configured (for messages).
    pub(crate) table: TableName,
    /// `(next, group, topic, partition, first)`: advances the partition's
    /// row to `next` when its stored offset is at most `first`.
    pub(crate) advance: Arc<str>,
    /// `(group, topic, partition, next)`: the partition's first row;
    /// inserts nothing when it has one.
    pub(crate) insert: Arc<str>,
    /// `(group, topic)`: each partition's `(kafka_partition, next_offset)`.
    pub(crate) read: Arc<str>,
    /// What `migrate()` runs.
    pub(crate) ddl: Vec<String>,
}

impl OffsetSql {
    /// The statements on `table` quoted with `quote`, the backend's
    /// placeholders `param(n)` (1-based), its clock `now`, and its form of
    /// "insert unless the key exists" (`insert(table, values)`).
    fn new(
        table: &TableName,
        quote: char,
        template: &str,
        param: impl Fn(u8) -> String,
        now: &str,
        insert: impl Fn(&str, &str) -> String,
    ) -> OffsetSql {
        let t = table.quoted(quote);
        let (p1, p2, p3, p4, p5) = (param(1), param(2), param(3), param(4), param(5));
        let body: String = template
            .lines()
            .filter(|line| !line.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        OffsetSql {
            advance: format!(
                "UPDATE {t} SET next_offset = {p1}, updated_at = {now} \
                 WHERE consumer_group = {p2} AND topic = {p3} AND kafka_partition = {p4} AND next_offset <= {p5}"
            )
            .into(),
            insert: insert(
                &t,
                &format!("(consumer_group, topic, kafka_partition, next_offset, updated_at) VALUES ({p1}, {p2}, {p3}, {p4}, {now})"),
            )
            .into(),
            read: format!("SELECT kafka_partition, next_offset FROM {t} WHERE consumer_group = {p1} AND topic = {p2}")
                .into(),
            ddl: body
                .replace(DEFAULT_KAFKA_OFFSETS_TABLE, &t)
                .split(';')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            table: table.clone(),
        }
    }

    /// PostgreSQL's.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(table: &TableName) -> Arc<OffsetSql> {
        Arc::new(OffsetSql::new(
            table,
            '"',
            include_str!("../../sql/postgres_kafka_offsets.sql"),
            |n| format!("${n}"),
            "now()",
            |t, values| {
                format!("INSERT INTO {t} {values} ON CONFLICT (consumer_group, topic, kafka_partition) DO NOTHING")
            },
        ))
    }

    /// MySQL's and MariaDB's (`INSERT IGNORE`: the group and topic were
    /// checked at build, so only the duplicate key can be ignored).
    #[cfg(feature = "mysql")]
    pub(crate) fn mysql(table: &TableName) -> Arc<OffsetSql> {
        Arc::new(OffsetSql::new(
            table,
            '`',
            include_str!("../../sql/mysql_kafka_offsets.sql"),
            |_| "?".to_owned(),
            "UTC_TIMESTAMP(3)",
            |t, values| format!("INSERT IGNORE INTO {t} {values}"),
        ))
    }

    /// SQLite's.
    #[cfg(feature = "sqlite")]
    pub(crate) fn sqlite(table: &TableName) -> Arc<OffsetSql> {
        Arc::new(OffsetSql::new(
            table,
            '"',
            include_str!("../../sql/sqlite_kafka_offsets.sql"),
            |n| format!("?{n}"),
            crate::store::sqlite::NOW_MS,
            |t, values| {
                format!("INSERT INTO {t} {values} ON CONFLICT (consumer_group, topic, kafka_partition) DO NOTHING")
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "postgres")]
    #[test]
    fn the_ddl_and_statements_use_the_configured_table() {
        let sql = OffsetSql::postgres(&TableName::new("app.offsets").unwrap());
        assert_eq!(sql.ddl.len(), 1);
        assert!(
            sql.ddl[0].starts_with("CREATE TABLE IF NOT EXISTS \"app\".\"offsets\" ("),
            "{}",
            sql.ddl[0]
        );
        for statement in [&sql.advance, &sql.insert, &sql.read] {
            assert!(statement.contains("\"app\".\"offsets\""), "{statement}");
        }
        assert!(sql.advance.ends_with("next_offset <= $5"), "{}", sql.advance);
    }
}
