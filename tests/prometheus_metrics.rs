//! The library's metrics reach a Prometheus endpoint (issue 33, item 6):
//! `metrics-exporter-prometheus` installed as the global recorder with its
//! HTTP listener, as `examples/prometheus_metrics.rs` does, a Redis Streams
//! consumer whose `#[idempotent]` handler processes, skips, refuses and
//! dead-letters messages, and a janitor; a GET of `/metrics` shows each
//! counter and histogram with its labels and values. (A binary of its own:
//! the recorder is process-wide.)

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use idempotent_runtime::broker::{Backoff, CancellationToken};
use idempotent_runtime::redis::{self, AsyncCommands};
use idempotent_runtime::redis_streams::StreamConsumer;
use idempotent_runtime::{Janitor, MemoryStore, idempotent};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    message_id: String,
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error("refused")]
    Refused,
}

#[idempotent(key = "msg.message_id", store = store, scope = "prom.payments")]
async fn charge(store: &MemoryStore, msg: &Payment) -> Result<(), AppError> {
    if msg.amount <= 0 {
        Err(AppError::Refused)
    } else {
        Ok(())
    }
}

/// A sample the scrape must show: name, some of its labels, value.
type Expected<'a> = (&'a str, Vec<(&'a str, &'a str)>, f64);

async fn scrape(addr: SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("the exporter listens");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

/// The value of the sample `name{labels..}` (its labels include `labels`,
/// in any order), or `None` when the text has no such sample.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (series_name, series_labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let all = labels.iter().all(|(key, value)| {
            series_labels
                .split(',')
                .any(|pair| pair == format!("{key}=\"{value}\""))
        });
        (series_name == name && all).then(|| value.parse().ok()).flatten()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_and_histograms_are_served_with_their_labels() {
    let addr: SocketAddr = ([127, 0, 0, 1], common::servers::free_port()).into();
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &[0.01, 0.1, 1.0])
        .unwrap()
        .install()
        .unwrap();

    let store = MemoryStore::new();
    let janitor = Janitor::spawn(store.clone(), Duration::from_millis(50)).unwrap();
    let client = redis::Client::open(common::REDIS_URL).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = common::unique("prometheus");
    let dead = format!("{stream}.dead");
    let consumer = StreamConsumer::builder(client.clone(), &stream, "billing")
        .dead_letter_stream(&dead)
        .max_attempts(2)
        .retry_backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(10)))
        .block(Duration::from_millis(100))
        .build()
        .unwrap();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let handler_store = store.clone();
    let run = tokio::spawn(consumer.run(
        move |msg: Payment| {
            let store = handler_store.clone();
            async move { charge(&store, &msg).await }
        },
        shutdown.clone(),
    ));

    // p-1 and p-2 processed, p-2 again a duplicate, p-3 refused twice then
    // dead-lettered, and one entry that is not JSON (poison).
    let mut bodies: Vec<Vec<u8>> = [("p-1", 10), ("p-2", 20), ("p-2", 20), ("p-3", -1)]
        .into_iter()
        .map(|(id, amount)| {
            serde_json::to_vec(&Payment {
                message_id: id.into(),
                amount,
            })
            .unwrap()
        })
        .collect();
    bodies.push(b"not json".to_vec());
    for (n, body) in bodies.iter().enumerate() {
        let _: String = conn
            .xadd(
                &stream,
                "*",
                &[("message_id", format!("e-{n}").as_bytes()), ("body", body.as_slice())],
            )
            .await
            .unwrap();
    }
    for _ in 0..200 {
        let s = stats.snapshot();
        if s.acked + s.dead_lettered + s.poison >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A janitor round or two more.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let text = scrape(addr).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    janitor.shutdown().await;
    let _: () = conn.del(&[&stream, &dead]).await.unwrap();

    let source = format!("{stream}/billing");
    let consumer_labels = [("broker", "redis"), ("source", source.as_str())];
    let with = |extra: (&'static str, &'static str)| {
        let mut labels = consumer_labels.to_vec();
        labels.push(extra);
        labels
    };
    let expected: Vec<Expected<'_>> = vec![
        (
            "idempotent_outcomes_total",
            vec![("scope", "prom.payments"), ("outcome", "processed")],
            2.0,
        ),
        (
            "idempotent_outcomes_total",
            vec![("scope", "prom.payments"), ("outcome", "duplicate")],
            1.0,
        ),
        (
            "idempotent_outcomes_total",
            vec![("scope", "prom.payments"), ("outcome", "failed")],
            2.0,
        ),
        ("idempotent_deliveries_total", with(("outcome", "processed")), 3.0),
        ("idempotent_deliveries_total", with(("outcome", "retried")), 1.0),
        ("idempotent_deliveries_total", with(("outcome", "dead_lettered")), 1.0),
        ("idempotent_deliveries_total", with(("outcome", "poison")), 1.0),
        ("idempotent_handler_errors_total", consumer_labels.to_vec(), 2.0),
        // Every handler call is timed: 3 processed, 2 refused.
        (
            "idempotent_handler_duration_seconds_count",
            consumer_labels.to_vec(),
            5.0,
        ),
        ("idempotent_handler_duration_seconds_bucket", with(("le", "+Inf")), 5.0),
    ];
    for (name, labels, value) in &expected {
        assert_eq!(
            sample(&text, name, labels),
            Some(*value),
            "{name}{labels:?} in:\n{text}"
        );
    }
    let rounds = sample(&text, "idempotent_janitor_rounds_total", &[("outcome", "purged")]);
    assert!(rounds.is_some_and(|n| n >= 1.0), "janitor rounds in:\n{text}");
    assert!(
        sample(&text, "idempotent_handler_duration_seconds_sum", &consumer_labels).is_some_and(|s| s > 0.0),
        "{text}"
    );
}

/// `cargo run --example prometheus_metrics` (on RabbitMQ): it exits 0 and
/// prints what its endpoint served, every metric of its run there.
#[test]
fn the_example_serves_the_metrics_of_its_run() {
    let exe = std::env::current_exe().expect("test binary path");
    // `target/<profile>/examples/`: cargo builds examples before it runs
    // the tests.
    let example = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .join("examples")
        .join(format!("prometheus_metrics{}", std::env::consts::EXE_SUFFIX));
    let addr = format!("127.0.0.1:{}", common::servers::free_port());
    let output = std::process::Command::new(&example)
        .env("METRICS_ADDR", &addr)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", example.display()));
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for (name, labels, value) in [
        (
            "idempotent_outcomes_total",
            vec![("scope", "payments.charge"), ("outcome", "processed")],
            3.0,
        ),
        (
            "idempotent_outcomes_total",
            vec![("scope", "payments.charge"), ("outcome", "duplicate")],
            1.0,
        ),
        (
            "idempotent_outcomes_total",
            vec![("scope", "payments.charge"), ("outcome", "failed")],
            2.0,
        ),
        (
            "idempotent_deliveries_total",
            vec![("broker", "rabbitmq"), ("outcome", "processed")],
            4.0,
        ),
        (
            "idempotent_deliveries_total",
            vec![("broker", "rabbitmq"), ("outcome", "retried")],
            1.0,
        ),
        (
            "idempotent_deliveries_total",
            vec![("broker", "rabbitmq"), ("outcome", "dead_lettered")],
            1.0,
        ),
        (
            "idempotent_deliveries_total",
            vec![("broker", "rabbitmq"), ("outcome", "poison")],
            1.0,
        ),
        ("idempotent_handler_errors_total", vec![("broker", "rabbitmq")], 2.0),
        (
            "idempotent_handler_duration_seconds_count",
            vec![("broker", "rabbitmq")],
            6.0,
        ),
    ] {
        assert_eq!(sample(&out, name, &labels), Some(value), "{name}{labels:?} in:\n{out}");
    }
    assert!(
        sample(&out, "idempotent_janitor_rounds_total", &[("outcome", "purged")]).is_some_and(|n| n >= 1.0),
        "{out}"
    );
}
