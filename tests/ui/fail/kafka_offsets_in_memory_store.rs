//! Offsets in the database need a store whose claims join a database
//! transaction: the memory store (like Redis) has none, and asking it to
//! keep a Kafka consumer's offsets is a compile error.
use idempotent_runtime::MemoryStore;
use idempotent_runtime::kafka::KafkaConsumer;
use idempotent_runtime::rdkafka::ClientConfig;

fn main() {
    let _ = KafkaConsumer::builder(ClientConfig::new(), "payments", "payment-service")
        .offsets_in(MemoryStore::new());
}
