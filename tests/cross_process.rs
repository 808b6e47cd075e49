//! Competing consumers in separate processes: the same message delivered to
//! four processes at the same instant is applied once.

mod common;

use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_runtime::PgStore;
use idempotent_runtime::sqlx::{self, AssertSqlSafe};

#[tokio::test]
async fn duplicates_delivered_to_four_processes_at_once_apply_one_effect() {
    let pool = common::pg_pool(4).await;
    let (markers, payments) = (common::unique("xp_markers"), common::unique("xp_payments"));
    PgStore::builder(pool.clone())
        .table(&markers)
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {payments} (message_id TEXT NOT NULL, pid BIGINT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let rounds = 5;
    for round in 0..rounds {
        let message_id = format!("msg-{round}");
        // Far enough ahead that all four processes have started and connected.
        let start_at = SystemTime::now().duration_since(UNIX_EPOCH).unwrap() + Duration::from_millis(1500);
        let children: Vec<_> = (0..4)
            .map(|_| {
                Command::new(env!("CARGO_BIN_EXE_consumer_process"))
                    .args([
                        "race",
                        &markers,
                        &payments,
                        &message_id,
                        &start_at.as_millis().to_string(),
                    ])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect::<Vec<_>>();
        let outputs: Vec<String> = children
            .into_iter()
            .map(|child| {
                let out = child.wait_with_output().unwrap();
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8(out.stdout).unwrap().trim().to_owned()
            })
            .collect();
        assert_eq!(
            outputs.iter().filter(|o| *o == "processed").count(),
            1,
            "round {round}: {outputs:?}"
        );
        assert_eq!(
            outputs.iter().filter(|o| *o == "duplicate").count(),
            3,
            "round {round}: {outputs:?}"
        );
        let count: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {payments} WHERE message_id = $1"
        )))
        .bind(&message_id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(count, 1, "round {round}: one effect");
    }
    common::drop_pg_table(&pool, &markers).await;
    common::drop_pg_table(&pool, &payments).await;
}
