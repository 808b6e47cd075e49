//! Every variant of `benches/e2e.rs` on every broker, once, small, in the
//! default test run: the benchmark's code keeps compiling, settles every
//! message, and applies each the number of times its variant promises
//! (every delivery without idempotency, each distinct message once with
//! it). No timing is asserted here.

#[allow(dead_code)]
#[path = "../benches/e2e/brokers.rs"]
mod brokers;
#[allow(dead_code)]
#[path = "../benches/e2e/run.rs"]
mod run;

// The Tansu broker of the Kafka tests.
mod common;

use brokers::Kind;
use run::{Env, Feed, Variant};

#[path = "../benches/shared/unique.rs"]
mod names;
pub use names::unique;

async fn every_variant_on(kind: Kind) {
    let env = Env::new(8, kind == Kind::Kafka)
        .await
        .expect("PostgreSQL (and Tansu for Kafka)");
    let n = 60;
    let variants = [
        Variant::Plain,
        Variant::ByHand,
        Variant::PerMessage,
        Variant::Offsets,
        Variant::batch(8),
        Variant::lean(8),
        Variant::offsets_batch(8),
        Variant::parse("c8w5").expect("a batch with a wait"),
    ];
    let variants = variants.into_iter().filter(|v| v.applies_to(kind));
    for (seed, variant) in variants.enumerate() {
        for feed in [Feed::Drain, Feed::Steady(400.0)] {
            let sample = run::run(&env, kind, variant, 3, n, 30, feed, seed as u64)
                .await
                .unwrap_or_else(|e| panic!("{kind:?} {variant:?} {feed:?}: {e}"));
            let (rows, distinct) = sample.effects;
            assert!(sample.distinct < n, "the plan has duplicates");
            assert_eq!(
                sample.acked, n as u64,
                "{kind:?} {variant:?} {feed:?}: every message acknowledged"
            );
            assert_eq!(sample.dead_lettered, 0, "{kind:?} {variant:?} {feed:?}");
            assert_eq!(
                distinct, sample.distinct as i64,
                "{kind:?} {variant:?} {feed:?}: every message applied"
            );
            let expected = if variant == Variant::Plain { n } else { sample.distinct };
            assert_eq!(rows, expected as i64, "{kind:?} {variant:?} {feed:?}: times applied");
            assert!(sample.rate > 0.0);
            if let Feed::Steady(_) = feed {
                assert_eq!(sample.latencies_us.len(), n, "a latency per message");
            }
        }
    }
    env.drop_tables().await.expect("drop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_variants_settle_and_apply_as_promised() {
    every_variant_on(Kind::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_variants_settle_and_apply_as_promised() {
    every_variant_on(Kind::JetStream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_variants_settle_and_apply_as_promised() {
    every_variant_on(Kind::RedisStreams).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_variants_settle_and_apply_as_promised() {
    every_variant_on(Kind::Kafka).await;
}

#[test]
fn variant_labels_read_back() {
    for label in ["a", "s", "b", "d", "c32", "o32", "d32", "c32w5", "o8w0"] {
        let variant = Variant::parse(label).unwrap_or_else(|| panic!("`{label}` is a variant"));
        assert_eq!(variant.label(), label);
    }
    assert_eq!(Variant::parse("c"), Variant::parse("c32"));
    for wrong in ["", "x", "c0", "cw5", "c8w", "d8x"] {
        assert!(Variant::parse(wrong).is_none(), "`{wrong}` is not a variant");
    }
    assert!(!Variant::Offsets.applies_to(Kind::RabbitMq));
    assert!(Variant::Offsets.applies_to(Kind::Kafka));
}
