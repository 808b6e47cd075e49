//! Consumers outlive their broker: each broker, a private server of its own,
//! is restarted while a consumer is processing (RabbitMQ with
//! `stop_app`/`start_app`, NATS and Redis killed with SIGKILL and started
//! again on their storage). The consumer reports the loss, reconnects,
//! resumes, and every message's effect happens exactly once.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::servers::{PrivateNats, PrivateRabbit, PrivateRedis};
use idempotent_runtime::broker::{Backoff, CancellationToken, Consumer, ConsumerBuilder, Reconnect, pipeline::Broker};
use idempotent_runtime::{MemoryStore, idempotent};

const MESSAGES: usize = 60;
const WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Payment {
    message_id: String,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
}

#[derive(Default)]
struct Ledger {
    store: MemoryStore,
    effects: Mutex<HashMap<String, u32>>,
}

impl Ledger {
    #[idempotent(key = "msg.message_id", store = self.store, scope = "restarts.payments")]
    async fn pay(&self, msg: &Payment) -> Result<(), AppError> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        *self.effects.lock().unwrap().entry(msg.message_id.clone()).or_default() += 1;
        Ok(())
    }

    fn applied(&self) -> usize {
        self.effects.lock().unwrap().len()
    }
}

fn body(i: usize) -> Vec<u8> {
    serde_json::to_vec(&Payment {
        message_id: format!("pay-{i:03}"),
    })
    .unwrap()
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Runs a consumer built from `builder` through `restart` (called once a
/// third of the messages are in), until every message's effect is in.
async fn through_a_restart<B: Broker>(builder: ConsumerBuilder<B>, restart: impl FnOnce() + Send + 'static) {
    let ledger = Arc::new(Ledger::default());
    let consumer: Consumer<B> = builder
        .concurrency(4)
        .reconnect(Reconnect::forever(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(500),
        )))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_ledger = Arc::clone(&ledger);
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let ledger = Arc::clone(&handler_ledger);
            async move { ledger.pay(&msg).await }
        },
        shutdown.clone(),
    ));
    wait_until("a third of the messages", || ledger.applied() >= MESSAGES / 3).await;
    tokio::task::spawn_blocking(restart).await.unwrap();
    wait_until("every message", || ledger.applied() == MESSAGES).await;
    assert!(!run.is_finished(), "the consumer kept running: {:?}", stats.snapshot());
    // What was in flight at the loss comes back as duplicates; let them
    // settle before stopping.
    tokio::time::sleep(Duration::from_secs(2)).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    let effects = ledger.effects.lock().unwrap().clone();
    assert_eq!(effects.len(), MESSAGES, "none lost");
    assert!(effects.values().all(|&n| n == 1), "none applied twice: {effects:?}");
    assert!(
        stats.connection_losses >= 1 && stats.reconnections >= 1,
        "the loss and the reconnection are reported: {stats:?}"
    );
    assert_eq!(stats.dead_lettered + stats.poison, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_consumer_survives_a_broker_restart() {
    use idempotent_runtime::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use idempotent_runtime::lapin::{BasicProperties, Connection, ConnectionProperties};
    use idempotent_runtime::rabbitmq::RabbitConsumer;

    let rabbit = Arc::new(tokio::task::spawn_blocking(PrivateRabbit::start).await.unwrap());
    let queue = "payments".to_owned();
    let consumer = RabbitConsumer::builder(rabbit.url(), &queue).prefetch(8);
    // The consumer declares the queue; wait for it, then publish.
    let conn = Connection::connect(&rabbit.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            idempotent_runtime::lapin::options::QueueDeclareOptions::durable(),
            Default::default(),
        )
        .await
        .unwrap();
    for i in 0..MESSAGES {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body(i),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    drop(channel);
    let _ = conn.close(200, "published".into()).await;
    let restarting = Arc::clone(&rabbit);
    through_a_restart(consumer, move || restarting.restart(Duration::from_millis(500))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jetstream_consumer_survives_a_server_restart() {
    use idempotent_runtime::async_nats::{self, jetstream};
    use idempotent_runtime::nats::JetStreamConsumer;

    let nats = Arc::new(Mutex::new(
        tokio::task::spawn_blocking(PrivateNats::nats).await.unwrap(),
    ));
    let url = nats.lock().unwrap().nats_url();
    let client = async_nats::connect(&url).await.unwrap();
    let js = jetstream::new(client);
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: "PAYMENTS".into(),
            subjects: vec!["payments.in".into(), "payments.dlq".into()],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    let pull = stream
        .get_or_create_consumer(
            "worker",
            jetstream::consumer::pull::Config {
                durable_name: Some("worker".into()),
                filter_subject: "payments.in".into(),
                ack_wait: Duration::from_secs(2),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    for i in 0..MESSAGES {
        js.publish("payments.in", body(i).into()).await.unwrap().await.unwrap();
    }
    let consumer = JetStreamConsumer::builder(js.clone(), pull)
        .dead_letter_subject("payments.dlq")
        .fetch_expiry(Duration::from_millis(500));
    let restarting = Arc::clone(&nats);
    through_a_restart(consumer, move || {
        restarting.lock().unwrap().restart(Duration::from_millis(500))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_streams_consumer_survives_a_server_restart() {
    use idempotent_runtime::redis::{self, AsyncCommands};
    use idempotent_runtime::redis_streams::StreamConsumer;

    let server = Arc::new(Mutex::new(
        tokio::task::spawn_blocking(PrivateRedis::redis).await.unwrap(),
    ));
    let client = redis::Client::open(server.lock().unwrap().redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for i in 0..MESSAGES {
        let _: String = conn.xadd("payments", "*", &[("body", body(i))]).await.unwrap();
    }
    let consumer = StreamConsumer::builder(client, "payments", "workers")
        .claim_idle(Duration::from_secs(1))
        .block(Duration::from_millis(300));
    let restarting = Arc::clone(&server);
    through_a_restart(consumer, move || {
        restarting.lock().unwrap().restart(Duration::from_millis(500))
    })
    .await;
}
