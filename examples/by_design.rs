//! Idempotency by design, the article's other half: effects that are safe to
//! repeat even without a marker. Runs on embedded SQLite.
//!
//! 1. `INSERT .. ON CONFLICT DO NOTHING` on a natural key: a repeated insert
//!    is a no-op.
//! 2. Versioned updates, `UPDATE .. WHERE version < $new`: an older or
//!    repeated version arriving late changes nothing.
//!
//! These are what a handler on a store that cannot join a transaction
//! (Redis, memory) should do: the marker there is not atomic with the
//! effect, so the effect itself must tolerate a repeat.
//!
//! Run it with `cargo run --example by_design`.

use idempotent_runtime::SqliteStore;
use idempotent_runtime::sqlx::{self, SqlitePool};

/// Records a shipment once per order, whatever the number of deliveries.
async fn record_shipment(pool: &SqlitePool, order_id: &str, carrier: &str) -> Result<bool, sqlx::Error> {
    let inserted =
        sqlx::query("INSERT INTO shipments (order_id, carrier) VALUES (?1, ?2) ON CONFLICT (order_id) DO NOTHING")
            .bind(order_id)
            .bind(carrier)
            .execute(pool)
            .await?
            .rows_affected();
    Ok(inserted == 1)
}

/// Applies a customer's address change only if it is newer than what is
/// stored (the event carries the version of the customer it describes).
async fn apply_address(pool: &SqlitePool, customer: &str, address: &str, version: i64) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query(
        "INSERT INTO customers (id, address, version) VALUES (?1, ?2, ?3) \
         ON CONFLICT (id) DO UPDATE SET address = excluded.address, version = excluded.version \
         WHERE customers.version < excluded.version",
    )
    .bind(customer)
    .bind(address)
    .bind(version)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(updated == 1)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("by_design.db")).await?;
    let pool = store.pool();
    sqlx::query("CREATE TABLE shipments (order_id TEXT PRIMARY KEY, carrier TEXT NOT NULL)")
        .execute(pool)
        .await?;
    sqlx::query("CREATE TABLE customers (id TEXT PRIMARY KEY, address TEXT NOT NULL, version INTEGER NOT NULL)")
        .execute(pool)
        .await?;

    println!("1. ON CONFLICT DO NOTHING on a natural key (order_id)");
    for (n, order) in ["order-1", "order-2", "order-1", "order-1"].iter().enumerate() {
        let applied = record_shipment(pool, order, "correios").await?;
        println!(
            "   delivery {}: shipment for {order:<8} {}",
            n + 1,
            if applied { "recorded" } else { "already there, no-op" }
        );
    }
    let shipments: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments")
        .fetch_one(pool)
        .await?;
    println!("   shipments in the table: {shipments} (2 orders)");

    println!();
    println!("2. Versioned updates: UPDATE .. WHERE version < new");
    let events = [(1, "Rua A, 1"), (3, "Rua C, 3"), (2, "Rua B, 2"), (3, "Rua C, 3")];
    for (version, address) in events {
        let applied = apply_address(pool, "customer-42", address, version).await?;
        println!(
            "   address v{version} ({address}) {}",
            if applied {
                "applied"
            } else {
                "ignored: stored version is newer or equal"
            }
        );
    }
    let (address, version): (String, i64) =
        sqlx::query_as("SELECT address, version FROM customers WHERE id = 'customer-42'")
            .fetch_one(pool)
            .await?;
    println!("   final: {address} (v{version}), whatever the delivery order");

    if shipments != 2 || version != 3 {
        return Err("an effect was applied twice or out of order".into());
    }
    Ok(())
}
