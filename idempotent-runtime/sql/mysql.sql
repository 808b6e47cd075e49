-- Markers of processed messages, for idempotent_runtime::MySqlStore
-- (MariaDB 10.3+ or MySQL 8, InnoDB).
-- MySqlStore::migrate() runs this same file (with the configured table name).
--
-- scope and message_id are VARBINARY: compared byte for byte, so keys that
-- differ only in case, accents or trailing spaces are different markers
-- (utf8mb4_bin is a PAD SPACE collation: it treats 'k' and 'k ' as equal).
-- Their lengths are the byte limits the runtime enforces (MAX_SCOPE_BYTES,
-- MAX_KEY_BYTES), so a valid key always fits and is never truncated.
-- Times are UTC, computed by the database clock (UTC_TIMESTAMP(3)); DATETIME
-- rather than TIMESTAMP so the session time zone plays no part and there is
-- no 2038 limit.
-- The expires_at index is declared inside CREATE TABLE, so the whole
-- migration is one statement (MySQL has no CREATE INDEX IF NOT EXISTS).
CREATE TABLE IF NOT EXISTS processed_messages (
    scope        VARBINARY(128) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    processed_at DATETIME(3)    NOT NULL,
    expires_at   DATETIME(3)    NOT NULL,
    fingerprint  CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL,
    result       LONGTEXT CHARACTER SET utf8mb4 NULL,
    PRIMARY KEY (scope, message_id),
    INDEX processed_messages_expires_at_idx (expires_at)
) ENGINE = InnoDB;
