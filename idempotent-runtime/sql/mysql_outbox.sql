-- Outgoing messages of idempotent handlers (the transactional outbox), for
-- idempotent_runtime::MySqlStore (MariaDB 10.6+ or MySQL 8, InnoDB: the
-- relay takes rows with FOR UPDATE SKIP LOCKED): written in the marker's
-- transaction, published by an outbox Relay, deleted by the janitor some
-- time after they are dispatched.
-- MySqlStore::migrate() runs this same file (with the configured outbox
-- table). Times are UTC (UTC_TIMESTAMP(3)), as in the marker table.
--
-- The indexes: pending rows in id order (the relay's query) and dispatched
-- rows by age (the cleanup) share (dispatched_at, id): pending rows have a
-- NULL dispatched_at; the ordering check looks for an earlier pending row
-- with the same key.
CREATE TABLE IF NOT EXISTS idempotent_outbox (
    id              BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    message_id      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    destination     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    ordering_key    VARBINARY(255) NULL,
    headers         LONGTEXT CHARACTER SET utf8mb4 NOT NULL,
    payload         LONGBLOB     NOT NULL,
    created_at      DATETIME(3)  NOT NULL,
    attempts        INT          NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(3)  NOT NULL,
    last_error      TEXT CHARACTER SET utf8mb4 NULL,
    dispatched_at   DATETIME(3)  NULL,
    PRIMARY KEY (id),
    INDEX idempotent_outbox_pending_idx (dispatched_at, id),
    INDEX idempotent_outbox_ordering_idx (ordering_key, dispatched_at, id)
) ENGINE = InnoDB;

-- Ordering keys: a stager locks its key's row here (inserting it the first
-- time) until its transaction ends, so that per key the rows above are
-- inserted in the order their transactions commit. The janitor deletes the
-- keys that have no pending message.
CREATE TABLE IF NOT EXISTS idempotent_outbox_keys (
    ordering_key    VARBINARY(255) NOT NULL,
    PRIMARY KEY (ordering_key)
) ENGINE = InnoDB;
