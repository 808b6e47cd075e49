//! The one validated-identifier type through which configuration reaches SQL.

use std::fmt;

use crate::Error;

/// A table name for the markers: one or two (`schema.table`) plain SQL
/// identifiers of ASCII letters, digits and `_`, not starting with a digit.
///
/// Validation happens when the store is configured, so nothing from
/// configuration can inject SQL; stores then quote each part in their
/// dialect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

/// The longest part of a table name. Postgres truncates identifiers past 63
/// bytes; the index name adds a 15-byte suffix to the table's.
pub const MAX_TABLE_NAME_BYTES: usize = 48;

impl TableName {
    /// The default table, `processed_messages`.
    pub fn default_table() -> Self {
        TableName {
            schema: None,
            table: "processed_messages".to_owned(),
        }
    }

    /// The default outbox table, `idempotent_outbox`.
    #[cfg(feature = "sqlx")]
    pub(crate) fn outbox() -> Self {
        TableName {
            schema: None,
            table: "idempotent_outbox".to_owned(),
        }
    }

    /// The default table of a Kafka consumer's offsets in the database,
    /// `idempotent_kafka_offsets`.
    #[cfg(all(feature = "kafka", feature = "sqlx"))]
    pub(crate) fn kafka_offsets() -> Self {
        TableName {
            schema: None,
            table: crate::store::kafka_offsets::DEFAULT_KAFKA_OFFSETS_TABLE.to_owned(),
        }
    }

    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, Error> {
        let mut parts = name.split('.');
        let (schema, table) = match (parts.next(), parts.next(), parts.next()) {
            (Some(table), None, None) => (None, table),
            (Some(schema), Some(table), None) => (Some(schema), table),
            _ => return Err(invalid(name, "use `table` or `schema.table`")),
        };
        for part in schema.iter().chain([&table]) {
            check_identifier(name, part)?;
        }
        Ok(TableName {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// The schema, when the name is qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table itself.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The name quoted with `quote` around each part (`"` for Postgres and
    /// SQLite, `` ` `` for MySQL). Safe because the parts were validated.
    pub fn quoted(&self, quote: char) -> String {
        match &self.schema {
            Some(schema) => format!("{quote}{schema}{quote}.{quote}{}{quote}", self.table),
            None => format!("{quote}{}{quote}", self.table),
        }
    }

    /// The quoted name of the `expires_at` index (unqualified: an index lives
    /// in its table's schema).
    pub fn expiry_index(&self, quote: char) -> String {
        format!("{quote}{}_expires_at_idx{quote}", self.table)
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self::default_table()
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.table),
            None => f.write_str(&self.table),
        }
    }
}

impl TryFrom<&str> for TableName {
    type Error = Error;
    fn try_from(name: &str) -> Result<Self, Error> {
        Self::new(name)
    }
}

fn check_identifier(name: &str, part: &str) -> Result<(), Error> {
    let mut chars = part.chars();
    match chars.next() {
        None => return Err(invalid(name, "a part of the name is empty")),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return Err(invalid(name, "each part must start with an ASCII letter or `_`"));
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(invalid(name, "only ASCII letters, digits and `_` are allowed"));
    }
    if part.len() > MAX_TABLE_NAME_BYTES {
        return Err(invalid(name, "each part is at most 48 bytes"));
    }
    Ok(())
}

fn invalid(name: &str, why: &str) -> Error {
    Error::Config(format!("invalid table name {name:?}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_qualified_names_are_accepted_and_quoted() {
        assert_eq!(TableName::new("processed").unwrap().quoted('"'), "\"processed\"");
        assert_eq!(TableName::new("app.seen_2").unwrap().quoted('`'), "`app`.`seen_2`");
        assert_eq!(TableName::default().to_string(), "processed_messages");
    }

    #[test]
    fn anything_that_is_not_a_plain_identifier_is_refused() {
        for bad in [
            "",
            "x; DROP TABLE users",
            "a\"b",
            "a`b",
            "1abc",
            "a.b.c",
            "a..b",
            "tábua",
            "name with space",
            "x--",
            &"t".repeat(49),
        ] {
            let err = TableName::new(bad).expect_err(bad);
            assert!(err.to_string().contains("invalid table name"), "{err}");
        }
    }
}
