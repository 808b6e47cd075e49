-- Kafka consumer offsets kept in the database, for idempotent_runtime's
-- KafkaConsumer in offsets-in-the-database mode (`offsets_in(store)`): each
-- (consumer group, topic, partition)'s next offset to consume, written in
-- the same transaction as the handler's effect, and never moved backwards.
-- Times are milliseconds since the Unix epoch.
-- SqliteStore::migrate() runs this same file (with the configured table name).
CREATE TABLE IF NOT EXISTS idempotent_kafka_offsets (
    consumer_group  TEXT    NOT NULL,
    topic           TEXT    NOT NULL,
    kafka_partition INTEGER NOT NULL,
    next_offset     INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (consumer_group, topic, kafka_partition)
) WITHOUT ROWID;
