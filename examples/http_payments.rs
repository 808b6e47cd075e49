//! A payment endpoint made idempotent by the `Idempotency-Key` header, on
//! embedded SQLite: no server needed.
//!
//! `cargo run --example http_payments` serves the endpoint on a free port
//! of 127.0.0.1, calls it as clients that retry do, and prints the proof:
//! 20 concurrent retries of one payment charge it once, a retry with the
//! same key and another amount is refused (422), a later retry gets the
//! first answer again byte for byte, and another tenant's same key is its
//! own payment.
//!
//! `cargo run --example http_payments -- --serve 127.0.0.1:3000` serves it
//! until stopped (Ctrl-C), on the SQLite file `http_payments.db` (or the
//! file given after the address), for curl:
//!
//! ```text
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: "pay-1"' -H 'X-Tenant: acme' \
//!      -H 'Content-Type: application/json' -d '{"order_id": "A-1", "amount": 4200}'
//! curl -i localhost:3000/payments/A-1 -H 'X-Tenant: acme'
//! ```

use std::time::Duration;

use idempotent_runtime::SqliteStore;
use idempotent_runtime::axum::extract::{Path, State};
use idempotent_runtime::axum::http::{HeaderMap, StatusCode};
use idempotent_runtime::axum::routing::{get, post};
use idempotent_runtime::axum::{self, Json, Router};
use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx};
use idempotent_runtime::sqlx;
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Payment {
    order_id: String,
    amount: i64,
}

#[derive(Serialize)]
struct Charged {
    charge_id: i64,
    order_id: String,
    amount: i64,
}

#[derive(Serialize)]
struct Charges {
    order_id: String,
    charges: i64,
}

fn tenant(headers: &HeaderMap) -> String {
    headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// `POST /payments`: charges the order. The insert runs in the transaction
/// that keeps the answer for retries: both commit, or neither.
async fn pay(
    headers: HeaderMap,
    mut tx: IdempotentTx<SqliteStore>,
    Json(payment): Json<Payment>,
) -> Result<(StatusCode, Json<Charged>), (StatusCode, String)> {
    let failed = |e: sqlx::Error| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let charge_id: i64 =
        sqlx::query_scalar("INSERT INTO charges (tenant, order_id, amount) VALUES (?1, ?2, ?3) RETURNING id")
            .bind(tenant(&headers))
            .bind(&payment.order_id)
            .bind(payment.amount)
            .fetch_one(&mut **tx)
            .await
            .map_err(failed)?;
    // A payment provider takes its time: retries arrive meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((
        StatusCode::CREATED,
        Json(Charged {
            charge_id,
            order_id: payment.order_id,
            amount: payment.amount,
        }),
    ))
}

/// `GET /payments/{order_id}`: how many times the tenant's order was charged.
async fn charges(
    State(store): State<SqliteStore>,
    headers: HeaderMap,
    Path(order_id): Path<String>,
) -> Result<Json<Charges>, (StatusCode, String)> {
    let charges = sqlx::query_scalar("SELECT count(*) FROM charges WHERE tenant = ?1 AND order_id = ?2")
        .bind(tenant(&headers))
        .bind(&order_id)
        .fetch_one(store.pool())
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(Charges { order_id, charges }))
}

fn app(store: SqliteStore) -> Router {
    let layer = IdempotencyLayer::builder(store.clone())
        .caller(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
        .build();
    Router::new()
        .route("/payments", post(pay))
        .route("/payments/{order_id}", get(charges))
        .route_layer(layer)
        .with_state(store)
}

async fn open(path: &std::path::Path) -> Result<SqliteStore, Box<dyn std::error::Error>> {
    let store = SqliteStore::open(path).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, order_id TEXT NOT NULL, \
         amount INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    Ok(store)
}

struct Answer {
    status: u16,
    replayed: bool,
    body: Vec<u8>,
}

async fn post_payment(client: &reqwest::Client, base: &str, key: &str, tenant: &str, body: &str) -> Answer {
    let sent = client
        .post(format!("{base}/payments"))
        .header("idempotency-key", key)
        .header("x-tenant", tenant)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await;
    match sent {
        Ok(response) => Answer {
            status: response.status().as_u16(),
            replayed: response.headers().get("idempotent-replayed").is_some(),
            body: response.bytes().await.map(|b| b.to_vec()).unwrap_or_default(),
        },
        Err(error) => Answer {
            status: 0,
            replayed: false,
            body: error.to_string().into_bytes(),
        },
    }
}

async fn charged(client: &reqwest::Client, base: &str, tenant: &str, order: &str) -> i64 {
    let answer = client
        .get(format!("{base}/payments/{order}"))
        .header("x-tenant", tenant)
        .send()
        .await;
    match answer {
        Ok(response) => response
            .bytes()
            .await
            .ok()
            .and_then(|body| serde_json::from_slice::<serde_json::Value>(&body).ok())
            .and_then(|v| v["charges"].as_i64())
            .unwrap_or(-1),
        Err(_) => -1,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, addr, rest @ ..] = args.as_slice()
        && flag == "--serve"
        && rest.len() <= 1
    {
        let db = rest.first().map_or("http_payments.db", String::as_str);
        let store = open(std::path::Path::new(db)).await?;
        let listener = tokio::net::TcpListener::bind(addr.as_str()).await?;
        println!("serving POST /payments and GET /payments/{{order_id}} on http://{addr} ({db}); Ctrl-C stops");
        axum::serve(listener, app(store))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        return Ok(());
    }
    if !args.is_empty() {
        return Err("usage: http_payments [--serve 127.0.0.1:PORT [DATABASE_FILE]]".into());
    }

    let dir = tempfile::tempdir()?;
    let store = open(&dir.path().join("http_payments.db")).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app(store)).await });
    let client = reqwest::Client::new();
    let payment = r#"{"order_id": "A-1", "amount": 4200}"#;

    // 1. A client times out and retries, 20 times at once, with one key.
    let answers =
        futures_util::future::join_all((0..20).map(|_| post_payment(&client, &base, "\"pay-A-1\"", "acme", payment)))
            .await;
    let created = answers.iter().filter(|a| a.status == 201).count();
    let conflicts = answers.iter().filter(|a| a.status == 409).count();
    let first = answers.iter().find(|a| a.status == 201 && !a.replayed);
    println!("20 concurrent retries of one payment: {created} answered 201, {conflicts} answered 409 (in progress)");
    let once = charged(&client, &base, "acme", "A-1").await;
    println!("order A-1 of acme charged: {once}");

    // 2. The same key with another amount: refused.
    let mismatched = post_payment(
        &client,
        &base,
        "\"pay-A-1\"",
        "acme",
        r#"{"order_id": "A-1", "amount": 9900}"#,
    )
    .await;
    println!("same key, another amount: {}", mismatched.status);

    // 3. A retry after the answer: the first answer again, byte for byte.
    let replay = post_payment(&client, &base, "\"pay-A-1\"", "acme", payment).await;
    let identical = first.is_some_and(|first| first.body == replay.body);
    println!(
        "a later retry: {} replayed={} identical to the first answer={identical}: {}",
        replay.status,
        replay.replayed,
        String::from_utf8_lossy(&replay.body)
    );

    // 4. Another tenant may use the same key: its own payment.
    let other = post_payment(&client, &base, "\"pay-A-1\"", "globex", payment).await;
    let globex = charged(&client, &base, "globex", "A-1").await;
    println!(
        "another tenant, same key: {} (globex's A-1 charged: {globex})",
        other.status
    );
    let acme = charged(&client, &base, "acme", "A-1").await;
    println!("order A-1 of acme charged after every retry: {acme}");

    let proof = created + conflicts == 20
        && first.is_some()
        && once == 1
        && acme == 1
        && mismatched.status == 422
        && replay.status == 201
        && replay.replayed
        && identical
        && other.status == 201
        && !other.replayed
        && globex == 1;
    if proof {
        println!("proof: every payment was charged exactly once.");
        Ok(())
    } else {
        Err("the proof failed: see above".into())
    }
}
