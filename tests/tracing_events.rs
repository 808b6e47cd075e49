//! Every call emits a `tracing` event with its outcome (processed,
//! duplicate, failed) in a span carrying the scope and the key.

use std::io::Write;
use std::sync::{Arc, Mutex};

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idempotent_runtime::Error),
    #[error("boom")]
    Boom,
}

#[idempotent(key = "id", store = store, scope = "traced")]
async fn handle(store: &MemoryStore, id: &str, fail: bool) -> Result<u32, AppError> {
    if fail { Err(AppError::Boom) } else { Ok(7) }
}

#[tokio::test]
async fn outcomes_are_traced_with_scope_and_key() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let store = MemoryStore::new();
    handle(&store, "m-1", true).await.unwrap_err();
    handle(&store, "m-1", false).await.unwrap();
    handle(&store, "m-1", false).await.unwrap();
    handle(&store, "", false).await.unwrap_err();

    let out = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    let find = |outcome: &str| {
        lines
            .iter()
            .find(|l| l.contains(&format!("outcome=\"{outcome}\"")))
            .copied()
            .unwrap_or_default()
    };
    for outcome in ["failed", "processed", "duplicate"] {
        let line = find(outcome);
        assert!(
            line.contains("scope=\"traced\"") && line.contains("key=\"m-1\""),
            "{outcome}: {out}"
        );
    }
    assert!(find("duplicate").contains("INFO"), "{out}");
    assert_eq!(
        lines.iter().filter(|l| l.contains("outcome=\"processed\"")).count(),
        1,
        "{out}"
    );
}
