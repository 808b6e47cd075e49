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

use brokers::Kind;
use run::{Env, Feed, Variant};

#[path = "../benches/shared/unique.rs"]
mod names;
pub use names::unique;

async fn every_variant_on(kind: Kind) {
    let env = Env::new(8).await.expect("PostgreSQL");
    let n = 60;
    let variants = [
        Variant::Plain,
        Variant::ByHand,
        Variant::PerMessage,
        Variant::Batch(8),
        Variant::Lean(8),
    ];
    for (seed, variant) in variants.into_iter().enumerate() {
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
