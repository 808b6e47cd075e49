use idempotent_runtime::sqlx::SqliteConnection;
use idempotent_runtime::{MemoryStore, SqliteStore, idempotent};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error(transparent)]
    Db(#[from] idempotent_runtime::sqlx::Error),
}

struct Msg {
    id: String,
    amount: i64,
}

struct Svc {
    store: SqliteStore,
    mem: MemoryStore,
}

impl Svc {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn pay(&self, msg: &Msg, tx: &mut SqliteConnection) -> Result<i64, AppError> {
        idempotent_runtime::sqlx::query("INSERT INTO payments (id, amount) VALUES (?, ?)")
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *tx)
            .await?;
        Ok(msg.amount * 2)
    }

    #[idempotent(key = msg.id, store = self.mem)]
    async fn notify(&self, msg: Msg) -> Result<(), AppError> {
        drop(msg);
        Ok(())
    }
}

#[tokio::test]
async fn smoke() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("db.sqlite")).await.unwrap();
    store.migrate().await.unwrap();
    idempotent_runtime::sqlx::query("CREATE TABLE payments (id TEXT PRIMARY KEY, amount INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    let svc = Svc {
        store,
        mem: MemoryStore::new(),
    };
    let m = Msg {
        id: "a".into(),
        amount: 5,
    };
    assert_eq!(svc.pay(&m).await.unwrap(), 10);
    assert_eq!(svc.pay(&m).await.unwrap(), 10);
    let n: i64 = idempotent_runtime::sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(svc.store.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
    svc.notify(Msg {
        id: "x".into(),
        amount: 1,
    })
    .await
    .unwrap();
    let fut = svc.pay(&m);
    fn is_send<T: Send>(_: &T) {}
    is_send(&fut);
    fut.await.unwrap();
}
