//! The outbox relay's publishers against the real brokers (Kafka: a
//! private Tansu broker per test): what each sets on
//! the message (id, persistence, headers), what each refuses, a republished
//! row, and a relay draining a PostgreSQL outbox into each broker.

mod common;

use std::time::Duration;

use idempotent_runtime::async_nats::{self, jetstream};
use idempotent_runtime::lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{Channel, Connection, ConnectionProperties};
use idempotent_runtime::outbox::{
    JetStreamPublisher, KafkaPublisher, Outbox, OutboxRow, Outgoing, PublishError, Publisher, RabbitPublisher, Relay,
    StreamPublisher,
};
use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection};
use idempotent_runtime::{PgStore, idempotent, redis};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS_URL: &str = "127.0.0.1:4222";

fn row(id: i64, message_id: &str, destination: &str, payload: &[u8]) -> OutboxRow {
    OutboxRow::new(
        id,
        message_id.to_owned(),
        destination.to_owned(),
        None,
        r#"{"x-origin":"outbox-test"}"#,
        payload.to_vec(),
        0,
    )
}

async fn rabbit_queue() -> (Channel, String) {
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672");
    let channel = conn.create_channel().await.unwrap();
    let queue = common::unique("outbox_q");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (channel, queue)
}

async fn rabbit_drain(channel: &Channel, queue: &str) -> Vec<idempotent_runtime::lapin::message::BasicGetMessage> {
    let mut got = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got.push(message);
    }
    got
}

#[tokio::test]
async fn rabbitmq_publisher_sets_id_persistence_and_headers_and_refuses_unroutable_messages() {
    let (channel, queue) = rabbit_queue().await;
    let publisher = RabbitPublisher::new(AMQP_URL);
    publisher.publish(&row(1, "id-1", &queue, b"one")).await.unwrap();
    let got = rabbit_drain(&channel, &queue).await;
    assert_eq!(got.len(), 1);
    let properties = &got[0].delivery.properties;
    assert_eq!(got[0].delivery.data, b"one");
    assert_eq!(properties.message_id().as_ref().map(|id| id.as_str()), Some("id-1"));
    assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
    let header = properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get("x-origin").cloned());
    assert!(
        matches!(&header, Some(AMQPValue::LongString(value)) if value.as_bytes() == b"outbox-test"),
        "{header:?}"
    );

    // No queue behind the routing key: returned by the broker, so the row
    // stays pending instead of being marked dispatched and lost.
    let unroutable = publisher
        .publish(&row(2, "id-2", "no-such-queue-anywhere", b"two"))
        .await;
    match unroutable {
        Err(PublishError(message)) => assert!(message.contains("no queue is bound"), "{message}"),
        Ok(()) => panic!("an unroutable message counted as published"),
    }

    // An exchange that does not exist closes the channel; the next publish
    // opens a new one.
    let closed = RabbitPublisher::new(AMQP_URL).exchange(common::unique("no_such_exchange"));
    assert!(closed.publish(&row(3, "id-3", &queue, b"three")).await.is_err());
    assert!(closed.publish(&row(4, "id-4", &queue, b"four")).await.is_err());
    publisher.publish(&row(5, "id-5", &queue, b"five")).await.unwrap();
    assert_eq!(rabbit_drain(&channel, &queue).await.len(), 1);
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

async fn nats_stream() -> (jetstream::Context, String, String) {
    let client = async_nats::connect(NATS_URL).await.expect("NATS at 127.0.0.1:4222");
    let js = jetstream::new(client);
    let stream = common::unique("OUTBOX");
    let subject = format!("{stream}.events");
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    (js, stream, subject)
}

#[tokio::test]
async fn jetstream_publisher_sets_the_message_id_and_a_republished_row_is_stored_once() {
    let (js, stream, subject) = nats_stream().await;
    let publisher = JetStreamPublisher::new(js.clone());
    let first = row(1, "charged-1", &subject, b"one");
    publisher.publish(&first).await.unwrap();
    // The relay died before marking it: published again, same id.
    publisher.publish(&first).await.unwrap();
    publisher.publish(&row(2, "charged-2", &subject, b"two")).await.unwrap();
    let mut info = js.get_stream(&stream).await.unwrap();
    assert_eq!(
        info.info().await.unwrap().state.messages,
        2,
        "the duplicate was dropped by JetStream"
    );
    let stored = info.get_raw_message(1).await.unwrap();
    assert_eq!(stored.payload.as_ref(), b"one");
    let headers = stored.headers;
    assert_eq!(
        headers.get(async_nats::header::NATS_MESSAGE_ID).map(|v| v.as_str()),
        Some("charged-1")
    );
    assert_eq!(headers.get("x-origin").map(|v| v.as_str()), Some("outbox-test"));

    // No stream captures the subject: an error, not a silent drop.
    let nowhere = publisher
        .publish(&row(3, "lost-3", &common::unique("nowhere"), b"x"))
        .await;
    assert!(nowhere.is_err(), "publishing where no stream listens must fail");
    js.delete_stream(&stream).await.unwrap();
}

/// An `XRANGE` entry: its id and its fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

#[tokio::test]
async fn stream_publisher_writes_what_the_stream_consumer_reads() {
    let client = redis::Client::open(common::REDIS_URL).unwrap();
    let conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let stream = common::unique("outbox_stream");
    let publisher = StreamPublisher::new(conn.clone()).max_len(1000);
    publisher.publish(&row(1, "id-1", &stream, b"one")).await.unwrap();
    publisher.publish(&row(2, "id-2", &stream, b"two")).await.unwrap();
    let mut conn = conn;
    let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(entries.len(), 2);
    let fields = &entries[0].1;
    let field = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    assert_eq!(field("message_id").as_deref(), Some(&b"id-1"[..]));
    assert_eq!(field("body").as_deref(), Some(&b"one"[..]));
    assert_eq!(field("x-origin").as_deref(), Some(&b"outbox-test"[..]));
    let _: () = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_publisher_keys_by_the_ordering_key_and_sets_the_ids_and_headers() {
    let kafka = common::kafka::Kafka::start();
    let topic = common::unique("outbox.kafka");
    kafka.create_topic(&topic, 3).await;
    let publisher = KafkaPublisher::new(&kafka.config()).unwrap();
    let keyed = |id: i64, message_id: &str, key: &str| {
        OutboxRow::new(
            id,
            message_id.to_owned(),
            topic.clone(),
            Some(key.to_owned()),
            r#"{"x-origin":"outbox-test"}"#,
            format!("payload-{id}").into_bytes(),
            0,
        )
    };
    for (id, key) in [(1, "order-a"), (2, "order-b"), (3, "order-a"), (4, "order-a")] {
        publisher.publish(&keyed(id, &format!("m-{id}"), key)).await.unwrap();
    }
    publisher.publish(&row(5, "m-5", &topic, b"no key")).await.unwrap();
    let records = kafka.read_all(&topic).await;
    assert_eq!(records.len(), 5, "{records:?}");
    for record in &records {
        let id = record.headers["x-idempotent-outbox-row"].clone();
        assert_eq!(record.headers["message_id"], format!("m-{id}"));
        assert_eq!(record.headers["x-origin"], "outbox-test");
    }
    // The rows of one key: in one partition, in their order.
    let order_a: Vec<&common::kafka::Record> = records.iter().filter(|r| r.key.as_deref() == Some("order-a")).collect();
    assert_eq!(order_a.len(), 3);
    assert!(order_a.iter().all(|r| r.partition == order_a[0].partition));
    let ids: Vec<&str> = order_a.iter().map(|r| r.headers["message_id"].as_str()).collect();
    assert_eq!(ids, ["m-1", "m-3", "m-4"]);
    let unkeyed = records.iter().find(|r| r.headers["message_id"] == "m-5").unwrap();
    assert_eq!(
        (unkeyed.key.as_deref(), unkeyed.value.as_slice()),
        (None, &b"no key"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_drains_postgres_into_kafka() {
    let kafka = common::kafka::Kafka::start();
    let topic = common::unique("outbox.kafka");
    kafka.create_topic(&topic, 2).await;
    let (ids, tables) = stage_and_relay(&topic, 25, KafkaPublisher::new(&kafka.config()).unwrap()).await;
    let mut got: Vec<String> = kafka
        .read_all(&topic)
        .await
        .into_iter()
        .map(|r| r.headers["message_id"].clone())
        .collect();
    let mut ids = ids;
    got.sort();
    ids.sort();
    assert_eq!(got, ids);
    drop_tables(&tables).await;
}

// ---- A relay draining PostgreSQL into each broker -------------------------

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

struct Payments {
    store: PgStore,
    destination: String,
}

impl Payments {
    #[idempotent(key = "id", store = self.store, scope = "outbox_brokers.charge")]
    async fn charge(&self, id: &str, outbox: &mut Outbox, tx: &mut PgConnection) -> Result<(), AppError> {
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        outbox.publish(Outgoing::new(self.destination.clone(), id.as_bytes().to_vec()));
        Ok(())
    }
}

/// Stages `count` messages through the handler (each charged twice: the
/// duplicate stages nothing), runs a relay with `publisher` until the
/// outbox is drained, and returns the message ids the rows carried.
async fn stage_and_relay<P: Publisher>(destination: &str, count: usize, publisher: P) -> (Vec<String>, Tables) {
    let pool = common::pg_pool(8).await;
    let tables = Tables {
        pool: pool.clone(),
        markers: common::unique("markers"),
        outbox: common::unique("outbox"),
    };
    let store = PgStore::builder(pool.clone())
        .table(&tables.markers)
        .outbox_table(&tables.outbox)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let payments = Payments {
        store: store.clone(),
        destination: destination.to_owned(),
    };
    for i in 0..count {
        payments.charge(&format!("p{i}")).await.unwrap();
        payments.charge(&format!("p{i}")).await.unwrap();
    }
    let relay = Relay::builder(store.clone(), publisher)
        .poll_interval(Duration::from_millis(50))
        .spawn();
    let outbox = &tables.outbox;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pending: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {outbox} WHERE dispatched_at IS NULL"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        if pending == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{pending} rows still pending");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.shutdown().await;
    let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT message_id FROM {outbox} ORDER BY id")))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids.len(), count, "one row per charge, none for the duplicates");
    (ids, tables)
}

/// A test's marker and outbox tables.
struct Tables {
    pool: sqlx::PgPool,
    markers: String,
    outbox: String,
}

async fn drop_tables(tables: &Tables) {
    common::drop_pg_table(&tables.pool, &tables.outbox).await;
    common::drop_pg_table(&tables.pool, &tables.markers).await;
}

#[tokio::test]
async fn a_relay_drains_postgres_into_rabbitmq() {
    let (channel, queue) = rabbit_queue().await;
    let (ids, tables) = stage_and_relay(&queue, 25, RabbitPublisher::new(AMQP_URL)).await;
    let got: Vec<String> = rabbit_drain(&channel, &queue)
        .await
        .iter()
        .map(|m| m.delivery.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    let (mut got, mut ids) = (got, ids);
    got.sort();
    ids.sort();
    assert_eq!(got, ids);
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    drop_tables(&tables).await;
}

/// One round of many rows published at once on the relay's connection,
/// routable rows (to a queue) and unroutable ones (to no queue) interleaved:
/// each row is settled by its own outcome. An unroutable row marked
/// dispatched is lost (never delivered, never retried); a routed row
/// reported as returned is held back and published a second time later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_round_settles_each_row_by_its_own_confirm_among_unroutable_ones() {
    const ROWS: usize = 200;
    // A transient queue: the broker confirms a routed message at once, so
    // routed and unroutable messages share the broker's `multiple` acks (a
    // durable queue confirms after its disk write, later).
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672");
    let channel = conn.create_channel().await.unwrap();
    let queue = common::unique("outbox_mixed");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let pool = common::pg_pool(8).await;
    let tables = Tables {
        pool: pool.clone(),
        markers: common::unique("markers"),
        outbox: common::unique("outbox"),
    };
    let store = PgStore::builder(pool.clone())
        .table(&tables.markers)
        .outbox_table(&tables.outbox)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    // A queue name nobody declares: the default exchange routes it nowhere.
    let nowhere = common::unique("outbox_nowhere");
    let routed = Payments {
        store: store.clone(),
        destination: queue.clone(),
    };
    let unroutable = Payments {
        store: store.clone(),
        destination: nowhere.clone(),
    };
    for i in 0..ROWS {
        if i % 2 == 0 {
            routed.charge(&format!("r{i}")).await.unwrap();
        } else {
            unroutable.charge(&format!("u{i}")).await.unwrap();
        }
    }
    // One round takes every row; a failed row is not tried again during the
    // test.
    let relay = Relay::builder(store.clone(), RabbitPublisher::new(AMQP_URL))
        .batch_size(ROWS as u32)
        .poll_interval(Duration::from_millis(50))
        .retry_backoff(Duration::from_secs(600), Duration::from_secs(600))
        .spawn();
    let stats = relay.stats();
    let started = tokio::time::Instant::now();
    while stats.published() + stats.retried() < ROWS as u64 {
        assert!(started.elapsed() < Duration::from_secs(30), "the round did not settle");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    relay.shutdown().await;
    assert_eq!(stats.rounds(), 1, "one round published every row");

    let outbox = &tables.outbox;
    let rows: Vec<(String, String, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, destination, dispatched_at IS NOT NULL FROM {outbox} ORDER BY id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), ROWS);
    let mut routed_ids: Vec<String> = rows
        .iter()
        .filter(|(_, destination, _)| *destination == queue)
        .map(|(id, _, _)| id.clone())
        .collect();
    // Unroutable rows marked dispatched: lost.
    let lost = rows
        .iter()
        .filter(|(_, destination, dispatched)| *destination == nowhere && *dispatched)
        .count();
    // Routed rows reported as returned: published again later.
    let held_back = rows
        .iter()
        .filter(|(_, destination, dispatched)| *destination == queue && !*dispatched)
        .count();
    let mut delivered: Vec<String> = rabbit_drain(&channel, &queue)
        .await
        .iter()
        .map(|m| m.delivery.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    eprintln!(
        "{ROWS} rows ({} routable, {} unroutable) published in one round in {elapsed:?}: \
         {lost} unroutable rows marked dispatched, {held_back} routed rows reported returned \
         ({} wrong outcomes of {ROWS})",
        routed_ids.len(),
        ROWS - routed_ids.len(),
        lost + held_back
    );
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    drop_tables(&tables).await;
    assert_eq!(
        (lost, held_back),
        (0, 0),
        "each row's outcome is its own publish's: unroutable rows failed, routed rows dispatched"
    );
    assert_eq!(stats.published(), routed_ids.len() as u64);
    assert_eq!(stats.retried(), (ROWS - routed_ids.len()) as u64);
    delivered.sort();
    routed_ids.sort();
    assert_eq!(delivered, routed_ids, "every routed row delivered once");
}

#[tokio::test]
async fn a_relay_drains_postgres_into_jetstream() {
    let (js, stream, subject) = nats_stream().await;
    let (ids, tables) = stage_and_relay(&subject, 25, JetStreamPublisher::new(js.clone())).await;
    let mut info = js.get_stream(&stream).await.unwrap();
    let count = info.info().await.unwrap().state.messages;
    assert_eq!(count, 25);
    let mut got = Vec::new();
    for sequence in 1..=count {
        let message = info.get_raw_message(sequence).await.unwrap();
        got.push(
            message
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .unwrap()
                .to_string(),
        );
    }
    let mut ids = ids;
    got.sort();
    ids.sort();
    assert_eq!(got, ids);
    js.delete_stream(&stream).await.unwrap();
    drop_tables(&tables).await;
}

#[tokio::test]
async fn a_relay_drains_postgres_into_a_redis_stream() {
    let client = redis::Client::open(common::REDIS_URL).unwrap();
    let mut conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let stream = common::unique("outbox_stream");
    let (ids, tables) = stage_and_relay(&stream, 25, StreamPublisher::new(conn.clone())).await;
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut got: Vec<String> = entries
        .iter()
        .map(|(_, fields)| fields.iter().find(|(n, _)| n == "message_id").unwrap().1.clone())
        .collect();
    let mut ids = ids;
    got.sort();
    ids.sort();
    assert_eq!(got, ids);
    let _: () = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
    drop_tables(&tables).await;
}
