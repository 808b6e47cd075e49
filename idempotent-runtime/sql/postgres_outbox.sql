-- Outgoing messages of idempotent handlers (the transactional outbox), for
-- idempotent_runtime::PgStore: written in the marker's transaction, published
-- by an outbox Relay, deleted some time after they are dispatched.
-- PgStore::migrate() runs this same file (with the configured outbox table).
CREATE TABLE IF NOT EXISTS idempotent_outbox (
    id              BIGSERIAL   PRIMARY KEY,
    message_id      TEXT        NOT NULL,
    destination     TEXT        NOT NULL,
    ordering_key    TEXT,
    headers         TEXT        NOT NULL,
    payload         BYTEA       NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT,
    dispatched_at   TIMESTAMPTZ
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
