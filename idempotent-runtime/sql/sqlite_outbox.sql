-- Outgoing messages of idempotent handlers (the transactional outbox), for
-- idempotent_runtime::SqliteStore: written in the marker's transaction,
-- published by an outbox Relay, deleted by the janitor some time after they
-- are dispatched. Times are milliseconds since the Unix epoch.
-- SqliteStore::migrate() runs this same file (with the configured outbox
-- table).
--
-- SQLite has no row locks: a relay reserves the rows it publishes by setting
-- leased_until, in a short write transaction, so the writer lock is never
-- held while the broker confirms. AUTOINCREMENT: ids are never reused, so id
-- order is staging order even after the cleanup deleted the newest rows.
CREATE TABLE IF NOT EXISTS idempotent_outbox (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id      TEXT    NOT NULL,
    destination     TEXT    NOT NULL,
    ordering_key    TEXT,
    headers         TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    created_at      INTEGER NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    leased_until    INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    dispatched_at   INTEGER
);

-- The relay's query: pending rows in id order.
CREATE INDEX IF NOT EXISTS idempotent_outbox_pending_idx
    ON idempotent_outbox (id) WHERE dispatched_at IS NULL;

-- Ordering: is there an earlier pending row with this key?
CREATE INDEX IF NOT EXISTS idempotent_outbox_ordering_idx
    ON idempotent_outbox (ordering_key, id) WHERE dispatched_at IS NULL;

-- Cleanup: dispatched rows by age.
CREATE INDEX IF NOT EXISTS idempotent_outbox_dispatched_idx
    ON idempotent_outbox (dispatched_at) WHERE dispatched_at IS NOT NULL;
