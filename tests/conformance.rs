//! One behavioural suite, run against every store.
//!
//! The same tests (exactly once under concurrent duplicates, replay (bit
//! for bit, and a result that would not read back refused before its
//! commit), failure/panic/cancellation release the claim, fingerprints,
//! missing and invalid keys, expiry, scopes, purge) are instantiated for each store by
//! `conformance!` at the bottom: memory, Postgres, SQLite, MySQL (MariaDB)
//! and Redis, and each SQL store again under the server settings users
//! change (PostgreSQL's default isolation, MariaDB's session isolation,
//! SQLite's journal mode), and Redis again on a Valkey 8.1 server, where the
//! completion is a native `SET .. IFEQ` instead of a script, and on a Redis
//! Cluster of Valkey nodes, with and without waiting for replicas. Where
//! transactional stores (Postgres, SQLite, MySQL) and lease stores (Redis,
//! memory) differ, the test says so through `Fixture::TRANSACTIONAL` rather
//! than hiding it:
//! - a concurrent duplicate *waits* for the first call on a transactional
//!   store and then replays its result; on a lease store it gets
//!   `Error::InProgress` while the first call runs;
//! - `purge_expired` deletes expired markers on SQL and memory stores; Redis
//!   expires keys by itself, so there it reports 0 (`Fixture::PURGES`);
//! - PostgreSQL's partitioned layout (`PgStore::builder(..).partitioned(..)`)
//!   runs here with one-second partitions, so that every claim of the suite
//!   lands in a partition of its own second and duplicates meet across
//!   partition boundaries; it keeps a taken-over marker as its own row until
//!   its partition is dropped (`Fixture::TAKEOVER_KEEPS_OLD_MARKER`).

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent_runtime::store::Store;
use idempotent_runtime::{Error, idempotent};
use tokio::sync::Notify;

/// A store under test, set up fresh (own table or key space) per test.
pub trait Fixture: Sized + Send + Sync + 'static {
    type S: Store + Clone + 'static;
    const TRANSACTIONAL: bool;
    /// `purge_expired` deletes markers itself (false where the backend
    /// expires them on its own, like Redis).
    const PURGES: bool = true;
    /// An expired marker taken over by a new claim stays as its own row
    /// until it is purged (PostgreSQL's partitioned layout), rather than
    /// being overwritten by the new marker.
    const TAKEOVER_KEEPS_OLD_MARKER: bool = false;
    fn setup() -> impl Future<Output = Self> + Send;
    fn store(&self) -> &Self::S;
    /// Deletes expired markers; how many.
    fn purge(&self) -> impl Future<Output = u64> + Send;
    fn teardown(self) -> impl Future<Output = ()> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum TestError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("the handler failed on purpose")]
    Failed,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Behavior {
    Succeed,
    Fail,
    Panic,
    /// Signal `started`, then wait for `release` (to hold the claim open).
    Block,
}

pub struct Msg {
    pub id: Option<String>,
    pub body: String,
    pub behavior: Behavior,
}

impl Msg {
    fn new(id: &str) -> Msg {
        Msg {
            id: Some(id.to_owned()),
            body: "body".into(),
            behavior: Behavior::Succeed,
        }
    }
    fn with(mut self, behavior: Behavior) -> Msg {
        self.behavior = behavior;
        self
    }
}

/// Counts how often each message's body ran; hands out run numbers so a
/// replay (same number) is told apart from a second run (new number).
#[derive(Default)]
pub struct Effects {
    runs: Mutex<HashMap<String, u32>>,
    seq: AtomicU64,
    pub started: Notify,
    pub release: Notify,
}

impl Effects {
    fn runs(&self, id: &str) -> u32 {
        self.runs.lock().unwrap().get(id).copied().unwrap_or(0)
    }

    async fn run(&self, msg: &Msg) -> Result<u64, TestError> {
        match msg.behavior {
            Behavior::Fail => return Err(TestError::Failed),
            Behavior::Panic => panic!("handler panicked on purpose"),
            Behavior::Block => {
                self.started.notify_one();
                self.release.notified().await;
            }
            Behavior::Succeed => tokio::time::sleep(Duration::from_millis(5)).await,
        }
        *self
            .runs
            .lock()
            .unwrap()
            .entry(msg.id.clone().unwrap_or_default())
            .or_default() += 1;
        Ok(self.seq.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

#[idempotent(key = "msg.id", store = store, fingerprint = "msg.body")]
async fn handle<S: Store>(store: &S, msg: &Msg, effects: &Effects) -> Result<u64, TestError> {
    effects.run(msg).await
}

#[idempotent(key = "msg.id", store = store, scope = "scope_a")]
async fn handle_a<S: Store>(store: &S, msg: &Msg, effects: &Effects) -> Result<u64, TestError> {
    effects.run(msg).await
}

#[idempotent(key = "msg.id", store = store, scope = "scope_b")]
async fn handle_b<S: Store>(store: &S, msg: &Msg, effects: &Effects) -> Result<u64, TestError> {
    effects.run(msg).await
}

#[idempotent(key = "msg.id", store = store, ttl = "1s")]
async fn handle_short_ttl<S: Store>(store: &S, msg: &Msg, effects: &Effects) -> Result<u64, TestError> {
    effects.run(msg).await
}

fn key(tag: &str) -> String {
    common::unique(tag)
}

pub async fn duplicate_replays_the_first_result<F: Fixture>() {
    let f = F::setup().await;
    let effects = Effects::default();
    let id = key("replay");
    let first = handle(f.store(), &Msg::new(&id), &effects).await.unwrap();
    let second = handle(f.store(), &Msg::new(&id), &effects).await.unwrap();
    assert_eq!(first, second, "a duplicate answers with the first run's result");
    assert_eq!(effects.runs(&id), 1);
    f.teardown().await;
}

pub async fn concurrent_duplicates_run_the_body_once<F: Fixture>() {
    let f = F::setup().await;
    let effects = Arc::new(Effects::default());
    let id = key("concurrent");
    let calls = (0..16).map(|_| {
        let (store, effects, id) = (f.store().clone(), Arc::clone(&effects), id.clone());
        tokio::spawn(async move { handle(&store, &Msg::new(&id), &effects).await })
    });
    let results: Vec<_> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(effects.runs(&id), 1, "the body ran once");
    let oks: Vec<u64> = results.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
    assert!(!oks.is_empty());
    assert!(
        oks.iter().all(|v| *v == oks[0]),
        "every Ok carries the first run's result: {oks:?}"
    );
    if F::TRANSACTIONAL {
        assert_eq!(oks.len(), 16, "transactional duplicates wait and replay: {results:?}");
    } else {
        for r in &results {
            assert!(
                matches!(r, Ok(_) | Err(TestError::Idem(Error::InProgress { .. }))),
                "lease duplicates replay or get InProgress: {r:?}"
            );
        }
    }
    // Once the first call completed, every store replays.
    assert_eq!(handle(f.store(), &Msg::new(&id), &effects).await.unwrap(), oks[0]);
    f.teardown().await;
}

pub async fn failure_leaves_no_marker<F: Fixture>() {
    let f = F::setup().await;
    let effects = Effects::default();
    let id = key("fail");
    let err = handle(f.store(), &Msg::new(&id).with(Behavior::Fail), &effects)
        .await
        .unwrap_err();
    assert!(matches!(err, TestError::Failed));
    handle(f.store(), &Msg::new(&id), &effects).await.unwrap();
    assert_eq!(effects.runs(&id), 1, "the redelivery was processed");
    f.teardown().await;
}

pub async fn panic_leaves_no_marker<F: Fixture>() {
    let f = F::setup().await;
    let effects = Arc::new(Effects::default());
    let id = key("panic");
    let (store, fx, pid) = (f.store().clone(), Arc::clone(&effects), id.clone());
    let joined = tokio::spawn(async move { handle(&store, &Msg::new(&pid).with(Behavior::Panic), &fx).await }).await;
    assert!(joined.unwrap_err().is_panic());
    // The redelivery must not wait on anything the panicking call left.
    redeliver::<F>(f.store(), &Msg::new(&id), &effects).await;
    assert_eq!(effects.runs(&id), 1);
    f.teardown().await;
}

/// Redelivers a message whose first call panicked or was cancelled. A
/// transactional store has rolled back by then, so it must run at once (it
/// must not wait on a lock left behind). A lease store releases the lease
/// from the dropped guard on a spawned task, so a redelivery arriving in the
/// same instant may still see `InProgress` and is retried, as a broker would.
async fn redeliver<F: Fixture>(store: &F::S, msg: &Msg, effects: &Effects) {
    let attempt = async {
        loop {
            match handle(store, msg, effects).await {
                Err(TestError::Idem(Error::InProgress { .. })) if !F::TRANSACTIONAL => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                other => return other,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .expect("the redelivery was not blocked")
        .unwrap();
}

pub async fn cancellation_leaves_no_marker<F: Fixture>() {
    let f = F::setup().await;
    let effects = Arc::new(Effects::default());
    let id = key("cancel");
    let (store, fx, cid) = (f.store().clone(), Arc::clone(&effects), id.clone());
    let call = tokio::spawn(async move { handle(&store, &Msg::new(&cid).with(Behavior::Block), &fx).await });
    effects.started.notified().await;
    call.abort(); // drops the handler's future mid-body
    assert!(call.await.unwrap_err().is_cancelled());
    redeliver::<F>(f.store(), &Msg::new(&id), &effects).await;
    assert_eq!(effects.runs(&id), 1);
    f.teardown().await;
}

pub async fn different_fingerprint_is_key_reused<F: Fixture>() {
    let f = F::setup().await;
    let effects = Effects::default();
    let id = key("fingerprint");
    handle(f.store(), &Msg::new(&id), &effects).await.unwrap();
    let mut other = Msg::new(&id);
    other.body = "another message under the same id".into();
    let err = handle(f.store(), &other, &effects).await.unwrap_err();
    assert!(matches!(err, TestError::Idem(Error::KeyReused { .. })), "{err:?}");
    assert_eq!(effects.runs(&id), 1);
    f.teardown().await;
}

pub async fn missing_and_invalid_keys_are_refused<F: Fixture>() {
    let f = F::setup().await;
    let effects = Effects::default();
    let none = Msg {
        id: None,
        body: "b".into(),
        behavior: Behavior::Succeed,
    };
    let err = handle(f.store(), &none, &effects).await.unwrap_err();
    assert!(matches!(err, TestError::Idem(Error::MissingKey { .. })), "{err:?}");
    for bad in [String::new(), "k".repeat(256), "nul\0key".to_owned()] {
        let err = handle(f.store(), &Msg::new(&bad), &effects).await.unwrap_err();
        assert!(matches!(err, TestError::Idem(Error::InvalidKey { .. })), "{err:?}");
    }
    assert_eq!(effects.seq.load(Ordering::SeqCst), 0, "no body ran");
    // Hostile and Unicode keys are only data.
    let hostile = format!("{}'); DROP TABLE processed_messages; -- \"`\\ çãõ 💳", key("hostile"));
    let first = handle(f.store(), &Msg::new(&hostile), &effects).await.unwrap();
    assert_eq!(handle(f.store(), &Msg::new(&hostile), &effects).await.unwrap(), first);
    assert_eq!(effects.runs(&hostile), 1);
    // Keys are never truncated: two long keys differing in the last byte differ.
    let base = "x".repeat(254);
    handle(f.store(), &Msg::new(&format!("{base}a")), &effects)
        .await
        .unwrap();
    handle(f.store(), &Msg::new(&format!("{base}b")), &effects)
        .await
        .unwrap();
    assert_eq!(effects.runs(&format!("{base}b")), 1);
    f.teardown().await;
}

pub async fn two_scopes_each_process_the_key<F: Fixture>() {
    let f = F::setup().await;
    let (a, b) = (Effects::default(), Effects::default());
    let id = key("scopes");
    handle_a(f.store(), &Msg::new(&id), &a).await.unwrap();
    handle_b(f.store(), &Msg::new(&id), &b).await.unwrap();
    handle_a(f.store(), &Msg::new(&id), &a).await.unwrap();
    handle_b(f.store(), &Msg::new(&id), &b).await.unwrap();
    assert_eq!((a.runs(&id), b.runs(&id)), (1, 1));
    f.teardown().await;
}

pub async fn expired_marker_no_longer_blocks_and_is_purged<F: Fixture>() {
    let f = F::setup().await;
    let effects = Effects::default();
    let ids: Vec<String> = (0..3).map(|_| key("expiry")).collect();
    // The duplicate follows at once, well inside the 1 s ttl even on a
    // loaded machine.
    handle_short_ttl(f.store(), &Msg::new(&ids[0]), &effects).await.unwrap();
    handle_short_ttl(f.store(), &Msg::new(&ids[0]), &effects).await.unwrap();
    assert_eq!(effects.runs(&ids[0]), 1, "a live marker blocks");
    for id in &ids[1..] {
        handle_short_ttl(f.store(), &Msg::new(id), &effects).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    handle_short_ttl(f.store(), &Msg::new(&ids[0]), &effects).await.unwrap();
    assert_eq!(effects.runs(&ids[0]), 2, "an expired marker no longer blocks");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let purged = f.purge().await;
    if F::PURGES {
        let expected = if F::TAKEOVER_KEEPS_OLD_MARKER { 4 } else { 3 };
        assert_eq!(
            purged, expected,
            "purge_expired removes the expired markers and counts them"
        );
    } else {
        assert_eq!(purged, 0, "the backend expired them by itself");
    }
    assert_eq!(f.purge().await, 0, "nothing left to purge");
    f.teardown().await;
}

/// A result with what JSON loses or bends: floats that are not the
/// nearest double of their shortest text read inexactly, non-finite
/// floats, nested options, 128-bit integers, each serde tagging.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Exact {
    floats: Vec<f64>,
    narrow: Vec<f32>,
    nested: Vec<Option<Option<f64>>>,
    units: Vec<Option<()>>,
    internally: Vec<Internally>,
    adjacently: Vec<Adjacently>,
    untagged: Vec<Untagged>,
    wide: (i128, u128),
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind")]
pub enum Internally {
    Amount {
        value: f64,
        small: u64,
        note: Option<Option<String>>,
    },
    Nothing,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "t", content = "c")]
pub enum Adjacently {
    Value(f64),
    Maybe(Option<Option<u8>>),
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Untagged {
    Number(f64),
    Text(String),
}

impl Exact {
    fn sample() -> Exact {
        let mut floats: Vec<f64> = (1..40)
            .flat_map(|i| {
                let i = f64::from(i);
                [i / 3.0, i * 0.1, i.sqrt()]
            })
            .collect();
        floats.extend([-0.0, 5e-324, f64::MAX, f64::NAN, f64::INFINITY, f64::NEG_INFINITY]);
        Exact {
            floats,
            narrow: vec![0.1, 1.0 / 3.0, f32::NAN, f32::NEG_INFINITY, -0.0],
            nested: vec![None, Some(None), Some(Some(f64::NAN)), Some(Some(14.0 * 0.1))],
            units: vec![None, Some(())],
            internally: vec![
                Internally::Amount {
                    value: 14.0 * 0.1,
                    small: 7,
                    note: Some(None),
                },
                Internally::Nothing,
            ],
            adjacently: vec![Adjacently::Value(f64::INFINITY), Adjacently::Maybe(Some(None))],
            untagged: vec![Untagged::Number(0.1 + 0.2), Untagged::Text("x".into())],
            wide: (i128::MIN, u128::MAX),
        }
    }

    /// Every float's bits, then the rest as text.
    fn bits(&self) -> (Vec<u64>, String) {
        let mut bits: Vec<u64> = self.floats.iter().map(|f| f.to_bits()).collect();
        bits.extend(self.narrow.iter().map(|f| u64::from(f.to_bits())));
        bits.extend(self.nested.iter().flatten().flatten().map(|f| f.to_bits()));
        for value in &self.internally {
            if let Internally::Amount { value, .. } = value {
                bits.push(value.to_bits());
            }
        }
        for value in &self.adjacently {
            if let Adjacently::Value(value) = value {
                bits.push(value.to_bits());
            }
        }
        for value in &self.untagged {
            if let Untagged::Number(value) = value {
                bits.push(value.to_bits());
            }
        }
        let shape = format!(
            "{:?} {:?} {:?} {:?}",
            self.nested.iter().map(|n| n.map(|o| o.is_some())).collect::<Vec<_>>(),
            self.units,
            self.internally,
            self.wide
        );
        (bits, shape)
    }
}

#[idempotent(key = "id", store = store)]
async fn exact<S: Store>(store: &S, id: &str, runs: &AtomicU64) -> Result<Exact, TestError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Exact::sample())
}

#[idempotent(key = "id", store = store)]
async fn top_float<S: Store>(store: &S, id: &str, value: f64, runs: &AtomicU64) -> Result<f64, TestError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(value)
}

#[idempotent(key = "id", store = store)]
async fn top_option<S: Store>(
    store: &S,
    id: &str,
    value: Option<Option<f64>>,
    runs: &AtomicU64,
) -> Result<Option<Option<f64>>, TestError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(value)
}

#[idempotent(key = "id", store = store)]
async fn top_unit_option<S: Store>(
    store: &S,
    id: &str,
    value: Option<()>,
    runs: &AtomicU64,
) -> Result<Option<()>, TestError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(value)
}

/// An internally tagged enum holding a `u128` above `u64::MAX`: serde
/// writes it, but cannot read it back (its buffering has no `u128`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind")]
pub enum Unreadable {
    Big { n: u128 },
}

#[idempotent(key = "id", store = store)]
async fn unreadable<S: Store>(store: &S, id: &str, runs: &AtomicU64) -> Result<Unreadable, TestError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Unreadable::Big {
        n: u128::from(u64::MAX) + 1,
    })
}

pub async fn a_duplicate_returns_exactly_what_the_first_run_returned<F: Fixture>() {
    let f = F::setup().await;
    let runs = AtomicU64::new(0);
    let id = key("exact");
    let first = exact(f.store(), &id, &runs).await.unwrap();
    let again = exact(f.store(), &id, &runs).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the duplicate did not run the body");
    assert_eq!(
        again.bits(),
        first.bits(),
        "the replay is the first run's result, bit for bit"
    );
    assert_eq!(first.bits(), Exact::sample().bits());

    let floats = [
        14.0 * 0.1,
        1.0 / 3.0,
        2f64.sqrt(),
        -0.0,
        f64::INFINITY,
        f64::NAN,
        5e-324,
    ];
    for (i, value) in floats.into_iter().enumerate() {
        let (id, runs) = (key(&format!("float{i}")), AtomicU64::new(0));
        top_float(f.store(), &id, value, &runs).await.unwrap();
        let replayed = top_float(f.store(), &id, value + 1.0, &runs).await.unwrap();
        assert_eq!(
            replayed.to_bits(),
            value.to_bits(),
            "{value:?} came back as {replayed:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
    let options = [None, Some(None), Some(Some(f64::NAN)), Some(Some(0.1))];
    for (i, value) in options.into_iter().enumerate() {
        let (id, runs) = (key(&format!("option{i}")), AtomicU64::new(0));
        top_option(f.store(), &id, value, &runs).await.unwrap();
        let replayed = top_option(f.store(), &id, Some(Some(9.0)), &runs).await.unwrap();
        let shape = |v: Option<Option<f64>>| v.map(|o| o.map(f64::to_bits));
        assert_eq!(shape(replayed), shape(value), "{value:?} came back as {replayed:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
    for (i, value) in [None, Some(())].into_iter().enumerate() {
        let (id, runs) = (key(&format!("unit{i}")), AtomicU64::new(0));
        top_unit_option(f.store(), &id, value, &runs).await.unwrap();
        let replayed = top_unit_option(f.store(), &id, None, &runs).await.unwrap();
        assert_eq!(replayed, value);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
    f.teardown().await;
}

pub async fn a_result_that_cannot_be_read_back_is_refused_before_the_commit<F: Fixture>() {
    let f = F::setup().await;
    let runs = AtomicU64::new(0);
    let id = key("unreadable");
    for attempt in 1..=2 {
        let err = loop {
            match unreadable(f.store(), &id, &runs).await {
                // A lease store releases the lease on a spawned task: a call
                // in the same instant may still find it held.
                Err(TestError::Idem(Error::InProgress { .. })) if !F::TRANSACTIONAL => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                other => break other.unwrap_err(),
            }
        };
        assert!(matches!(err, TestError::Idem(Error::Codec(_))), "{err:?}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            attempt,
            "nothing was committed: the redelivery runs the body again"
        );
    }
    f.teardown().await;
}

/// A consumer generic over its effect, with the default scope: each
/// instantiation is its own handler.
pub struct Consumer<F> {
    effect: F,
    runs: AtomicU64,
}

impl<F: Fn() -> u64 + Send + Sync> Consumer<F> {
    fn new(effect: F) -> Self {
        Consumer {
            effect,
            runs: AtomicU64::new(0),
        }
    }

    #[idempotent(key = "id", store = store)]
    async fn handle<S: Store>(&self, store: &S, id: &str) -> Result<u64, TestError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok((self.effect)())
    }
}

pub async fn two_instantiations_of_a_generic_handler_keep_their_own_markers<F: Fixture>() {
    let f = F::setup().await;
    let id = key("generic");
    // Two closures of one function: Rust prints their types alike.
    let (a, b) = (Consumer::new(|| 1), Consumer::new(|| 2));
    for _ in 0..2 {
        assert_eq!(a.handle(f.store(), &id).await.unwrap(), 1);
        assert_eq!(
            b.handle(f.store(), &id).await.unwrap(),
            2,
            "the second instantiation answered with the first one's result"
        );
    }
    assert_eq!(
        (a.runs.load(Ordering::SeqCst), b.runs.load(Ordering::SeqCst)),
        (1, 1),
        "each body ran once"
    );
    f.teardown().await;
}

/// A decision whose variants may carry nothing.
#[derive(Debug, serde::Serialize)]
pub enum Decision {
    Approve(Option<u64>),
    Reject(Option<u64>),
}

#[idempotent(key = "id", store = store, fingerprint = "decision")]
async fn decide<S: Store>(store: &S, id: &str, decision: &Decision, runs: &AtomicU64) -> Result<String, TestError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(format!("{decision:?}"))
}

pub async fn variants_of_null_content_are_another_message<F: Fixture>() {
    let f = F::setup().await;
    let (id, runs) = (key("decision"), AtomicU64::new(0));
    let first = decide(f.store(), &id, &Decision::Approve(None), &runs).await.unwrap();
    assert_eq!(first, "Approve(None)");
    assert_eq!(
        decide(f.store(), &id, &Decision::Approve(None), &runs).await.unwrap(),
        first
    );
    let err = decide(f.store(), &id, &Decision::Reject(None), &runs)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TestError::Idem(Error::KeyReused { .. })),
        "Reject(None) under Approve(None)'s key: {err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    f.teardown().await;
}

/// A result of every shape serde writes, for the property test below.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Rich {
    Float(f64),
    Narrow(f32),
    Nested(Option<Option<f64>>),
    Units(Option<Option<()>>),
    Wide(i128, u128),
    Text(String),
    Map(std::collections::BTreeMap<String, Option<f64>>),
    Internally(Internally),
    Adjacently(Adjacently),
    Untagged(Untagged),
    List(Vec<Rich>),
}

impl Rich {
    /// The value with every float as its bits: equal exactly when the two
    /// values are bit for bit the same.
    fn bits(&self) -> String {
        match self {
            Rich::Float(f) => format!("f{:x}", f.to_bits()),
            Rich::Narrow(f) => format!("g{:x}", f.to_bits()),
            Rich::Nested(n) => format!("n{:?}", n.map(|o| o.map(f64::to_bits))),
            Rich::Map(m) => format!(
                "m{:?}",
                m.iter().map(|(k, v)| (k, v.map(f64::to_bits))).collect::<Vec<_>>()
            ),
            Rich::Internally(Internally::Amount { value, small, note }) => {
                format!("i{:x}{small}{note:?}", value.to_bits())
            }
            Rich::Adjacently(Adjacently::Value(f)) => format!("a{:x}", f.to_bits()),
            Rich::Untagged(Untagged::Number(f)) => format!("u{:x}", f.to_bits()),
            Rich::List(items) => format!("[{}]", items.iter().map(Rich::bits).collect::<Vec<_>>().join(",")),
            other => format!("{other:?}"),
        }
    }
}

fn rich() -> impl proptest::strategy::Strategy<Value = Rich> {
    use proptest::prelude::*;
    let float = proptest::num::f64::ANY;
    let leaf = prop_oneof![
        float.prop_map(Rich::Float),
        proptest::num::f32::ANY.prop_map(Rich::Narrow),
        proptest::option::of(proptest::option::of(float)).prop_map(Rich::Nested),
        proptest::option::of(proptest::option::of(Just(()))).prop_map(Rich::Units),
        (any::<i128>(), any::<u128>()).prop_map(|(i, u)| Rich::Wide(i, u)),
        any::<String>().prop_map(Rich::Text),
        proptest::collection::btree_map(any::<String>(), proptest::option::of(float), 0..4).prop_map(Rich::Map),
        (
            float,
            any::<u64>(),
            proptest::option::of(proptest::option::of(any::<String>()))
        )
            .prop_map(|(value, small, note)| Rich::Internally(Internally::Amount { value, small, note })),
        float.prop_map(|f| Rich::Adjacently(Adjacently::Value(f))),
        proptest::option::of(proptest::option::of(any::<u8>())).prop_map(|m| Rich::Adjacently(Adjacently::Maybe(m))),
        float.prop_map(|f| Rich::Untagged(Untagged::Number(f))),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        proptest::collection::vec(inner, 0..4).prop_map(Rich::List)
    })
}

#[idempotent(key = "id", store = store)]
async fn give_rich(store: &idempotent_runtime::MemoryStore, id: &str, value: &Rich) -> Result<Rich, TestError> {
    Ok(value.clone())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Whatever a result holds (any float: NaN with its payload, ±inf,
    /// -0.0, subnormals; nested options; 128-bit integers; each serde
    /// tagging), its duplicate gets it back bit for bit, or the first call
    /// is refused before its commit (an untagged enum of a float that
    /// serde reads back as another variant cannot happen here: the test
    /// type's variants are told apart).
    #[test]
    fn any_result_replays_bit_for_bit(value in rich()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let store = idempotent_runtime::MemoryStore::new();
            let first = give_rich(&store, "k", &value).await.unwrap();
            let again = give_rich(&store, "k", &Rich::Text("other".into())).await.unwrap();
            proptest::prop_assert_eq!(first.bits(), value.bits());
            proptest::prop_assert_eq!(again.bits(), value.bits());
            Ok(())
        })?;
    }
}

/// Instantiates the suite for one store fixture.
macro_rules! conformance {
    ($module:ident, $fixture:ty) => {
        mod $module {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn duplicate_replays_the_first_result() {
                super::duplicate_replays_the_first_result::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_duplicates_run_the_body_once() {
                super::concurrent_duplicates_run_the_body_once::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn failure_leaves_no_marker() {
                super::failure_leaves_no_marker::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn panic_leaves_no_marker() {
                super::panic_leaves_no_marker::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn cancellation_leaves_no_marker() {
                super::cancellation_leaves_no_marker::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn different_fingerprint_is_key_reused() {
                super::different_fingerprint_is_key_reused::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn missing_and_invalid_keys_are_refused() {
                super::missing_and_invalid_keys_are_refused::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn two_scopes_each_process_the_key() {
                super::two_scopes_each_process_the_key::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn expired_marker_no_longer_blocks_and_is_purged() {
                super::expired_marker_no_longer_blocks_and_is_purged::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_duplicate_returns_exactly_what_the_first_run_returned() {
                super::a_duplicate_returns_exactly_what_the_first_run_returned::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_result_that_cannot_be_read_back_is_refused_before_the_commit() {
                super::a_result_that_cannot_be_read_back_is_refused_before_the_commit::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn two_instantiations_of_a_generic_handler_keep_their_own_markers() {
                super::two_instantiations_of_a_generic_handler_keep_their_own_markers::<$fixture>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn variants_of_null_content_are_another_message() {
                super::variants_of_null_content_are_another_message::<$fixture>().await
            }
        }
    };
}

// ---- fixtures ----------------------------------------------------------

struct Memory(idempotent_runtime::MemoryStore);

impl Fixture for Memory {
    type S = idempotent_runtime::MemoryStore;
    const TRANSACTIONAL: bool = false;
    async fn setup() -> Self {
        Memory(idempotent_runtime::MemoryStore::new())
    }
    fn store(&self) -> &Self::S {
        &self.0
    }
    async fn purge(&self) -> u64 {
        self.0.purge_expired().await.unwrap()
    }
    async fn teardown(self) {}
}

/// PostgreSQL, its sessions defaulting to the isolation level `ISO`
/// (`common::settings::PG_*`).
struct Postgres<const ISO: u8> {
    store: idempotent_runtime::PgStore,
    table: String,
}

impl<const ISO: u8> Fixture for Postgres<ISO> {
    type S = idempotent_runtime::PgStore;
    const TRANSACTIONAL: bool = true;
    async fn setup() -> Self {
        let table = common::unique("conf");
        let pool = common::pg_pool_with(20, ISO).await;
        let store = idempotent_runtime::PgStore::builder(pool)
            .table(&table)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        Postgres { store, table }
    }
    fn store(&self) -> &Self::S {
        &self.store
    }
    async fn purge(&self) -> u64 {
        self.store.purge_expired().await.unwrap()
    }
    async fn teardown(self) {
        common::drop_pg_table(self.store.pool(), &self.table).await;
    }
}

/// PostgreSQL with markers partitioned by expiry, one partition per
/// second (created 5 s ahead; claims with a longer ttl create theirs), its
/// sessions defaulting to the isolation level `ISO`.
struct PgPartitioned<const ISO: u8> {
    store: idempotent_runtime::PgStore,
    table: String,
}

/// The partition period of the `PgPartitioned` fixture.
const PARTITION_PERIOD: Duration = Duration::from_secs(1);

impl<const ISO: u8> Fixture for PgPartitioned<ISO> {
    type S = idempotent_runtime::PgStore;
    const TRANSACTIONAL: bool = true;
    const TAKEOVER_KEEPS_OLD_MARKER: bool = true;
    async fn setup() -> Self {
        let table = common::unique("confpart");
        let pool = common::pg_pool_with(20, ISO).await;
        let store = idempotent_runtime::PgStore::builder(pool)
            .table(&table)
            .partitioned(PARTITION_PERIOD)
            .partition_horizon(Duration::from_secs(5))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        PgPartitioned { store, table }
    }
    fn store(&self) -> &Self::S {
        &self.store
    }
    async fn purge(&self) -> u64 {
        // An expired marker goes with its partition, which ends at most one
        // period after the marker expired.
        tokio::time::sleep(PARTITION_PERIOD + Duration::from_millis(100)).await;
        self.store.purge_expired().await.unwrap()
    }
    async fn teardown(self) {
        // Dropping the parent drops its partitions.
        common::drop_pg_table(self.store.pool(), &self.table).await;
    }
}

/// MariaDB, its sessions at the isolation level `ISO`
/// (`common::settings::MY_*`).
struct MySql<const ISO: u8> {
    store: idempotent_runtime::MySqlStore,
    table: String,
}

impl<const ISO: u8> Fixture for MySql<ISO> {
    type S = idempotent_runtime::MySqlStore;
    const TRANSACTIONAL: bool = true;
    async fn setup() -> Self {
        let table = common::unique("conf");
        let pool = common::mysql_pool_with(20, ISO).await;
        let store = idempotent_runtime::MySqlStore::builder(pool)
            .table(&table)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        MySql { store, table }
    }
    fn store(&self) -> &Self::S {
        &self.store
    }
    async fn purge(&self) -> u64 {
        self.store.purge_expired().await.unwrap()
    }
    async fn teardown(self) {
        common::drop_mysql_table(self.store.pool(), &self.table).await;
    }
}

/// SQLite in the journal mode `JOURNAL` (`common::settings::LITE_*`).
struct Sqlite<const JOURNAL: u8> {
    store: idempotent_runtime::SqliteStore,
    _dir: tempfile::TempDir,
}

impl<const JOURNAL: u8> Fixture for Sqlite<JOURNAL> {
    type S = idempotent_runtime::SqliteStore;
    const TRANSACTIONAL: bool = true;
    async fn setup() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = common::sqlite_store_with(dir.path(), JOURNAL).await;
        store.migrate().await.unwrap();
        Sqlite { store, _dir: dir }
    }
    fn store(&self) -> &Self::S {
        &self.store
    }
    async fn purge(&self) -> u64 {
        self.store.purge_expired().await.unwrap()
    }
    async fn teardown(self) {
        self.store.pool().close().await;
    }
}

struct Redis {
    store: idempotent_runtime::RedisStore,
    conn: idempotent_runtime::redis::aio::ConnectionManager,
    prefix: String,
}

impl Redis {
    async fn on(url: &str) -> Redis {
        let client = idempotent_runtime::redis::Client::open(url).unwrap();
        let conn = client
            .get_connection_manager()
            .await
            .unwrap_or_else(|err| panic!("Redis at {url}: {err}"));
        let prefix = format!("{}:", common::unique("conformance"));
        let store = idempotent_runtime::RedisStore::builder(conn.clone())
            .prefix(prefix.clone())
            .build()
            .unwrap();
        Redis { store, conn, prefix }
    }
}

impl Fixture for Redis {
    type S = idempotent_runtime::RedisStore;
    const TRANSACTIONAL: bool = false;
    const PURGES: bool = false;
    async fn setup() -> Self {
        Redis::on(common::REDIS_URL).await
    }
    fn store(&self) -> &Self::S {
        &self.store
    }
    async fn purge(&self) -> u64 {
        idempotent_runtime::store::PurgeExpired::purge_expired(&self.store)
            .await
            .unwrap()
    }
    async fn teardown(mut self) {
        let keys: Vec<String> = idempotent_runtime::redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut self.conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let () = idempotent_runtime::redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut self.conn)
                .await
                .unwrap();
        }
    }
}

/// `RedisStore` on a private Valkey 8.1 server, whose `SET .. IFEQ`
/// completes a claim in one native command (the machine's Redis 7.0 takes
/// the script).
struct Valkey {
    redis: Redis,
    _server: common::servers::ChildServer,
}

impl Fixture for Valkey {
    type S = idempotent_runtime::RedisStore;
    const TRANSACTIONAL: bool = false;
    const PURGES: bool = false;
    async fn setup() -> Self {
        let server = common::servers::ChildServer::valkey();
        Valkey {
            redis: Redis::on(&server.redis_url()).await,
            _server: server,
        }
    }
    fn store(&self) -> &Self::S {
        &self.redis.store
    }
    async fn purge(&self) -> u64 {
        self.redis.purge().await
    }
    async fn teardown(self) {
        self.redis.teardown().await
    }
}

/// `RedisStore` on a Redis Cluster of private Valkey 8.1 nodes (3
/// primaries with a replica each, shared by this binary's tests, stopped
/// when it exits); with `WAIT`, waiting for one replica after each claim
/// and completion (`wait_for_replicas`). Its keys go with the cluster: no
/// teardown.
struct RedisClusterStore<const WAIT: bool> {
    store: idempotent_runtime::RedisStore,
}

impl<const WAIT: bool> Fixture for RedisClusterStore<WAIT> {
    type S = idempotent_runtime::RedisStore;
    const TRANSACTIONAL: bool = false;
    const PURGES: bool = false;
    async fn setup() -> Self {
        let cluster = common::cluster::RedisCluster::shared();
        let mut builder = idempotent_runtime::RedisStore::cluster_builder(cluster.connection().await)
            .prefix(format!("{}:", common::unique("conformance")));
        if WAIT {
            builder = builder.wait_for_replicas(1, Duration::from_secs(1));
        }
        RedisClusterStore {
            store: builder.build().unwrap(),
        }
    }
    fn store(&self) -> &Self::S {
        &self.store
    }
    async fn purge(&self) -> u64 {
        idempotent_runtime::store::PurgeExpired::purge_expired(&self.store)
            .await
            .unwrap()
    }
    async fn teardown(self) {}
}

use common::settings::*;

conformance!(memory, Memory);
conformance!(redis, Redis);
conformance!(valkey, Valkey);
conformance!(redis_cluster, RedisClusterStore<false>);
conformance!(redis_cluster_waiting_for_replicas, RedisClusterStore<true>);
// Each SQL store under the settings users change: the promises must not
// depend on the server's default isolation or the journal mode.
conformance!(postgres, Postgres<PG_SERVER_DEFAULT>);
conformance!(postgres_repeatable_read_default, Postgres<PG_REPEATABLE_READ>);
conformance!(postgres_serializable_default, Postgres<PG_SERIALIZABLE>);
conformance!(postgres_partitioned, PgPartitioned<PG_SERVER_DEFAULT>);
conformance!(
    postgres_partitioned_repeatable_read_default,
    PgPartitioned<PG_REPEATABLE_READ>
);
conformance!(mysql, MySql<MY_SERVER_DEFAULT>);
conformance!(mysql_read_committed_session, MySql<MY_READ_COMMITTED>);
conformance!(mysql_repeatable_read_session, MySql<MY_REPEATABLE_READ>);
conformance!(mysql_serializable_session, MySql<MY_SERIALIZABLE>);
conformance!(sqlite, Sqlite<LITE_WAL>);
conformance!(sqlite_rollback_journal, Sqlite<LITE_ROLLBACK_JOURNAL>);
