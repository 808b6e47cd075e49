-- Kafka consumer offsets kept in the database, for idempotent_runtime's
-- KafkaConsumer in offsets-in-the-database mode (`offsets_in(store)`): each
-- (consumer group, topic, partition)'s next offset to consume, written in
-- the same transaction as the handler's effect, and never moved backwards.
-- MySqlStore::migrate() runs this same file (with the configured table name).
-- Group and topic are compared byte for byte (utf8mb4_bin); the consumer
-- refuses names longer than 255 bytes at build.
CREATE TABLE IF NOT EXISTS idempotent_kafka_offsets (
    consumer_group  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    topic           VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    kafka_partition INT          NOT NULL,
    next_offset     BIGINT       NOT NULL,
    updated_at      DATETIME(3)  NOT NULL,
    PRIMARY KEY (consumer_group, topic, kafka_partition)
) ENGINE = InnoDB;
