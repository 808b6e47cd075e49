//! A clean start logs nothing above INFO that is not a problem, and nothing
//! per object that already exists (issue 33, item 5): a RabbitMQ consumer
//! starting on a queue that does not exist yet (no `ERROR lapin::channel:
//! Channel closed .. NOT_FOUND`), and `migrate()` on a database that is
//! already migrated (no "already exists, skipping" notices).
//!
//! Every event of the process (lapin logs from its own threads) goes to one
//! global subscriber at INFO; the tests take turns and each reads only what
//! was logged during its turn.

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use idempotent_runtime::broker::CancellationToken;
use idempotent_runtime::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::lapin::types::{AMQPValue, FieldTable};
use idempotent_runtime::lapin::{BasicProperties, Connection, ConnectionProperties};
use idempotent_runtime::rabbitmq::{RabbitConsumer, RabbitConsumerBuilder};
use idempotent_runtime::{MySqlStore, PgStore, SqliteStore};
use serde::{Deserialize, Serialize};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The log of the whole process, from the first test on.
fn log() -> &'static common::Captured {
    static LOG: OnceLock<common::Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let captured = common::Captured::default();
        tracing::subscriber::set_global_default(captured.subscriber(tracing::Level::INFO))
            .expect("the only global subscriber of this test binary");
        captured
    })
}

/// One test at a time reads the log.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What was logged since `from` (a length of the log's text).
fn since(from: usize) -> String {
    log().text()[from..].to_owned()
}

/// The lines of `text` above INFO, or that say something already exists.
fn noise(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|line| {
            line.contains(" WARN ") || line.contains(" ERROR ") || line.to_lowercase().contains("already exists")
        })
        .collect()
}

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    message_id: String,
}

async fn publish(conn: &Connection, queue: &str, id: &str) {
    let channel = conn.create_channel().await.unwrap();
    channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let body = serde_json::to_vec(&Payment { message_id: id.into() }).unwrap();
    // Not mandatory: before the queue exists the message is dropped
    // quietly (a returned message would be logged at WARN by lapin).
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let _ = channel.close(200, "published".into()).await;
}

/// Runs a consumer of `queue` until it has acknowledged a message (published
/// again and again until the consumer has made the queue), then stops it.
async fn start_consume_stop(conn: &Connection, queue: &str) {
    start_consume_stop_with(conn, queue, |builder| builder).await;
}

async fn start_consume_stop_with(
    conn: &Connection,
    queue: &str,
    configure: impl FnOnce(RabbitConsumerBuilder) -> RabbitConsumerBuilder,
) {
    let consumer = configure(RabbitConsumer::builder(AMQP_URL, queue)).build().unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(
        |_: Payment| async { Ok::<(), idempotent_runtime::Error>(()) },
        shutdown.clone(),
    ));
    let mut acked = false;
    for attempt in 0..150 {
        publish(conn, queue, &format!("m-{attempt}")).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        if stats.snapshot().acked > 0 {
            acked = true;
            break;
        }
    }
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert!(acked, "the consumer made its queue and consumed from it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_starting_on_a_missing_queue_logs_no_error() {
    let _turn = TURN.lock().await;
    let from = log().text().len();
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672");
    let queue = format!("idem.test.{}", common::unique("clean_start"));
    let dlq = format!("{queue}.dlq");

    // First start: neither the queue nor its dead-letter queue exists.
    start_consume_stop(&conn, &queue).await;
    let first = since(from);
    // Second start: both exist.
    let from = log().text().len();
    start_consume_stop(&conn, &queue).await;
    let second = since(from);

    let admin = conn.create_channel().await.unwrap();
    for q in [&queue, &dlq] {
        admin
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "test done".into()).await;
    assert!(
        noise(&first).is_empty(),
        "first start, queues missing: {:#?}\n{first}",
        noise(&first)
    );
    assert!(
        noise(&second).is_empty(),
        "second start, queues there: {:#?}\n{second}",
        noise(&second)
    );
}

/// A queue the user declared with other properties (here quorum queues)
/// cannot be declared again without arguments: the broker refuses with
/// PRECONDITION_FAILED, lapin logs that at ERROR, and the consumer uses the
/// queue as it is. With declaring turned off the start is silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_is_used_as_it_is_and_declaring_off_starts_silently() {
    let _turn = TURN.lock().await;
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672");
    let queue = format!("idem.test.{}", common::unique("clean_start_quorum"));
    let dlq = format!("{queue}.dlq");
    let admin = conn.create_channel().await.unwrap();
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    for q in [&queue, &dlq] {
        admin
            .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), quorum.clone())
            .await
            .unwrap();
    }

    let from = log().text().len();
    start_consume_stop(&conn, &queue).await;
    let declaring = since(from);
    let from = log().text().len();
    start_consume_stop_with(&conn, &queue, |builder| {
        builder.declare_queue(false).declare_dead_letter_queue(false)
    })
    .await;
    let not_declaring = since(from);

    for q in [&queue, &dlq] {
        admin
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "test done".into()).await;
    let refusals = noise(&declaring);
    assert_eq!(refusals.len(), 2, "one refused declare per queue: {declaring}");
    assert!(
        refusals.iter().all(|line| line.contains("PRECONDITION_FAILED")),
        "{declaring}"
    );
    assert!(
        noise(&not_declaring).is_empty(),
        "declaring off: {:#?}\n{not_declaring}",
        noise(&not_declaring)
    );
}

/// NATS JetStream: a durable pull consumer on a fresh stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jetstream_consumer_starts_without_noise() {
    use idempotent_runtime::async_nats::jetstream::{self, consumer::pull, stream};
    use idempotent_runtime::nats::JetStreamConsumer;

    let _turn = TURN.lock().await;
    let client = idempotent_runtime::async_nats::connect("127.0.0.1:4222")
        .await
        .expect("NATS at 127.0.0.1:4222");
    let js = jetstream::new(client);
    let name = common::unique("clean_start");
    let (subject, dead_subject) = (format!("{name}.in"), format!("{name}.dead"));
    let dead_stream = format!("{name}_dead");
    for (stream_name, subject) in [(&name, &subject), (&dead_stream, &dead_subject)] {
        js.create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            storage: stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let durable = pull::Config {
        durable_name: Some("clean".into()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ..Default::default()
    };
    let pull = js
        .get_stream(&name)
        .await
        .unwrap()
        .create_consumer(durable)
        .await
        .unwrap();

    let from = log().text().len();
    let consumer = JetStreamConsumer::builder(js.clone(), pull)
        .dead_letter_subject(&dead_subject)
        .fetch_expiry(Duration::from_millis(500))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(
        |_: Payment| async { Ok::<(), idempotent_runtime::Error>(()) },
        shutdown.clone(),
    ));
    let body = serde_json::to_vec(&Payment {
        message_id: "n-1".into(),
    })
    .unwrap();
    js.publish(subject.clone(), body.into()).await.unwrap().await.unwrap();
    for _ in 0..150 {
        if stats.snapshot().acked > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let text = since(from);
    for stream_name in [&name, &dead_stream] {
        js.delete_stream(stream_name).await.unwrap();
    }
    assert_eq!(stats.snapshot().acked, 1, "{text}");
    assert!(noise(&text).is_empty(), "{:#?}\n{text}", noise(&text));
}

/// Redis Streams: the consumer creates its group and the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_streams_consumer_starts_without_noise() {
    use idempotent_runtime::redis::{self, AsyncCommands};
    use idempotent_runtime::redis_streams::StreamConsumer;

    let _turn = TURN.lock().await;
    let client = redis::Client::open(common::REDIS_URL).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = common::unique("clean_start");
    let dead = format!("{stream}.dead");

    let from = log().text().len();
    let consumer = StreamConsumer::builder(client.clone(), &stream, "clean")
        .dead_letter_stream(&dead)
        .block(Duration::from_millis(200))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(consumer.run(
        |_: Payment| async { Ok::<(), idempotent_runtime::Error>(()) },
        shutdown.clone(),
    ));
    let body = serde_json::to_vec(&Payment {
        message_id: "r-1".into(),
    })
    .unwrap();
    let _: String = conn
        .xadd(
            &stream,
            "*",
            &[("message_id", b"r-1".as_slice()), ("body", body.as_slice())],
        )
        .await
        .unwrap();
    for _ in 0..150 {
        if stats.snapshot().acked > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let text = since(from);
    let _: () = conn.del(&[&stream, &dead]).await.unwrap();
    assert_eq!(stats.snapshot().acked, 1, "{text}");
    assert!(noise(&text).is_empty(), "{:#?}\n{text}", noise(&text));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_a_migrated_database_logs_nothing_per_object() {
    let _turn = TURN.lock().await;
    log();

    // PostgreSQL: marker table, its index, the outbox table and its indexes.
    let pool = common::pg_pool(2).await;
    let table = common::unique("clean_start");
    let outbox = common::unique("clean_start_outbox");
    let pg = PgStore::builder(pool.clone())
        .table(&table)
        .outbox_table(&outbox)
        .build()
        .unwrap();
    let from = log().text().len();
    pg.migrate().await.unwrap();
    let first_pg = since(from);
    let from = log().text().len();
    pg.migrate().await.unwrap();
    let second_pg = since(from);
    common::drop_pg_table(&pool, &table).await;
    common::drop_pg_table(&pool, &outbox).await;

    // MariaDB and SQLite: the same, once migrated.
    let my_pool = common::mysql_pool(2).await;
    let my_table = common::unique("clean_start");
    let my_outbox = common::unique("clean_start_outbox");
    let my = MySqlStore::builder(my_pool.clone())
        .table(&my_table)
        .outbox_table(&my_outbox)
        .build()
        .unwrap();
    my.migrate().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lite = SqliteStore::open(dir.path().join("clean.db")).await.unwrap();
    lite.migrate().await.unwrap();
    let from = log().text().len();
    my.migrate().await.unwrap();
    lite.migrate().await.unwrap();
    let second_others = since(from);
    common::drop_mysql_table(&my_pool, &my_table).await;
    common::drop_mysql_table(&my_pool, &my_outbox).await;

    for (what, text) in [
        ("first PostgreSQL migrate", &first_pg),
        ("second PostgreSQL migrate", &second_pg),
        ("second MariaDB and SQLite migrate", &second_others),
    ] {
        assert!(noise(text).is_empty(), "{what}: {:#?}\n{text}", noise(text));
    }
    // Nothing at all per existing object: the second migration is silent
    // at INFO.
    assert!(second_pg.trim().is_empty(), "second PostgreSQL migrate: {second_pg}");
    assert!(
        second_others.trim().is_empty(),
        "second MariaDB and SQLite migrate: {second_others}"
    );
}

/// The capture itself sees what it must flag: a notice PostgreSQL sends
/// for an object that exists reaches the log at INFO through sqlx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_shows_what_a_noisy_statement_says() {
    let _turn = TURN.lock().await;
    let pool = common::pg_pool(1).await;
    let table = common::unique("clean_start_probe");
    let from = log().text().len();
    let create = format!("CREATE TABLE IF NOT EXISTS {table} (id int)");
    for _ in 0..2 {
        idempotent_runtime::sqlx::query(idempotent_runtime::sqlx::AssertSqlSafe(create.clone()))
            .execute(&pool)
            .await
            .unwrap();
    }
    let text = since(from);
    common::drop_pg_table(&pool, &table).await;
    assert_eq!(noise(&text).len(), 1, "{text}");
}
