-- Kafka consumer offsets kept in the database, for idempotent_runtime's
-- KafkaConsumer in offsets-in-the-database mode (`offsets_in(store)`): each
-- (consumer group, topic, partition)'s next offset to consume, written in
-- the same transaction as the handler's effect, and never moved backwards.
-- PgStore::migrate() runs this same file (with the configured table name).
CREATE TABLE IF NOT EXISTS idempotent_kafka_offsets (
    consumer_group  TEXT        NOT NULL,
    topic           TEXT        NOT NULL,
    kafka_partition INTEGER     NOT NULL,
    next_offset     BIGINT      NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, kafka_partition)
);
