-- Markers of processed messages, for idempotent_runtime::PgStore built with
-- `.partitioned(period)`: the same columns, partitioned by expiry so that
-- retention drops whole partitions instead of deleting rows.
-- PgStore::migrate() runs this same file (with the configured table name),
-- then creates the partitions `<table>_<YYYYMMDDHHMMSS>` (their lower bound,
-- UTC) covering expiries from now to now + the store's horizon.
-- The partition key must be part of the primary key: the claim finds a live
-- marker of a key across partitions under a per-key advisory lock.
CREATE TABLE IF NOT EXISTS processed_messages (
    scope        TEXT        NOT NULL,
    message_id   TEXT        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at   TIMESTAMPTZ NOT NULL,
    fingerprint  TEXT,
    result       TEXT,
    PRIMARY KEY (scope, message_id, expires_at)
) PARTITION BY RANGE (expires_at);
