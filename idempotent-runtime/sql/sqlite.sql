-- Markers of processed messages, for idempotent_runtime::SqliteStore.
-- Times are milliseconds since the Unix epoch.
-- SqliteStore::migrate() runs this same file (with the configured table name).
CREATE TABLE IF NOT EXISTS processed_messages (
    scope        TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    fingerprint  TEXT,
    result       TEXT,
    PRIMARY KEY (scope, message_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS processed_messages_expires_at_idx
    ON processed_messages (expires_at);
