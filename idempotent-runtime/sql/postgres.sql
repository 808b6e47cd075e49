-- Markers of processed messages, for idempotent_runtime::PgStore.
-- PgStore::migrate() runs this same file (with the configured table name).
CREATE TABLE IF NOT EXISTS processed_messages (
    scope        TEXT        NOT NULL,
    message_id   TEXT        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at   TIMESTAMPTZ NOT NULL,
    fingerprint  TEXT,
    result       TEXT,
    PRIMARY KEY (scope, message_id)
);

CREATE INDEX IF NOT EXISTS processed_messages_expires_at_idx
    ON processed_messages (expires_at);
