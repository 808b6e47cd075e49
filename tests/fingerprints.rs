//! Fingerprints are a function of the message's content only.
//!
//! A message holding a `HashMap` or `HashSet` iterates in a random order,
//! so hashing its serialization as it comes made every redelivery of the
//! same bytes look like a reused key. Here: a property test over arbitrary
//! JSON-like values (maps, sets, nesting) whose map entries and sequence
//! elements are shuffled at every depth, and the handler-level promise on
//! real stores: the same bytes redelivered are duplicates, never
//! `KeyReused`, and a different message under the same key still is.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_runtime::store::{Fingerprint, Store};
use idempotent_runtime::{Error, MemoryStore, PgStore, idempotent};
use proptest::prelude::*;
use serde::ser::{SerializeMap, SerializeSeq};

/// A JSON-like value whose maps serialize their entries in the order held
/// (so a test can present one content in many orders).
#[derive(Debug, Clone)]
enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Value>),
    Map(Vec<(String, Value)>),
}

impl serde::Serialize for Value {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Null => s.serialize_none(),
            Value::Bool(b) => s.serialize_bool(*b),
            Value::Int(i) => s.serialize_i64(*i),
            Value::Float(f) => s.serialize_f64(*f),
            Value::Str(t) => s.serialize_str(t),
            Value::List(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Value::Map(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        (-1e9f64..1e9).prop_map(Value::Float),
        "[a-z0-9:é ]{0,6}".prop_map(Value::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
            // Distinct keys, as in a real map.
            prop::collection::btree_map("[a-z]{1,4}", inner, 0..6).prop_map(|m| Value::Map(m.into_iter().collect())),
        ]
    })
}

/// A step of a 64-bit LCG: the shuffles' randomness, from proptest's seed.
fn step(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 11
}

/// `items` in another order (Fisher-Yates).
fn permute<T>(items: &mut [T], seed: &mut u64) {
    for i in (1..items.len()).rev() {
        items.swap(i, (step(seed) % (i as u64 + 1)) as usize);
    }
}

/// `v` with every map's entries and every list's elements in another order
/// (chosen by `seed`), at every depth.
fn shuffled(v: &Value, seed: &mut u64) -> Value {
    match v {
        Value::List(items) => {
            let mut items: Vec<Value> = items.iter().map(|i| shuffled(i, seed)).collect();
            permute(&mut items, seed);
            Value::List(items)
        }
        Value::Map(entries) => {
            let mut entries: Vec<(String, Value)> =
                entries.iter().map(|(k, v)| (k.clone(), shuffled(v, seed))).collect();
            permute(&mut entries, seed);
            Value::Map(entries)
        }
        other => other.clone(),
    }
}

/// `v` with its first scalar leaf (depth first) replaced by a value it
/// cannot equal; `None` when it has no scalar leaf.
fn mutated(v: &Value) -> Option<Value> {
    match v {
        Value::Null => None,
        Value::Bool(b) => Some(Value::Bool(!b)),
        Value::Int(i) => Some(Value::Int(i.wrapping_add(1))),
        Value::Float(f) => Some(Value::Float(f + 0.5)),
        Value::Str(s) => Some(Value::Str(format!("{s}!"))),
        Value::List(items) => {
            for (i, item) in items.iter().enumerate() {
                if let Some(changed) = mutated(item) {
                    let mut items = items.clone();
                    items[i] = changed;
                    return Some(Value::List(items));
                }
            }
            None
        }
        Value::Map(entries) => {
            for (i, (k, item)) in entries.iter().enumerate() {
                if let Some(changed) = mutated(item) {
                    let mut entries = entries.clone();
                    entries[i] = (k.clone(), changed);
                    return Some(Value::Map(entries));
                }
            }
            None
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn a_fingerprint_does_not_depend_on_order(v in value(), seed in 1u64..) {
        let mut seed = seed;
        let a = Fingerprint::of(&v).unwrap();
        for _ in 0..4 {
            prop_assert_eq!(&Fingerprint::of(&shuffled(&v, &mut seed)).unwrap(), &a);
        }
    }

    #[test]
    fn a_changed_value_changes_the_fingerprint(v in value()) {
        if let Some(changed) = mutated(&v) {
            prop_assert_ne!(Fingerprint::of(&changed).unwrap(), Fingerprint::of(&v).unwrap());
        }
    }

    #[test]
    fn json_text_in_any_key_order_has_one_fingerprint(v in value(), seed in 1u64..) {
        // What a broker redelivers is bytes: decode the same content written
        // in two orders into serde_json's value and into typed maps.
        let mut seed = seed;
        let text_a = serde_json::to_string(&v).unwrap();
        let text_b = serde_json::to_string(&shuffled(&v, &mut seed)).unwrap();
        let a: serde_json::Value = serde_json::from_str(&text_a).unwrap();
        let b: serde_json::Value = serde_json::from_str(&text_b).unwrap();
        // (Not compared with `v` itself: serde_json parses some floats one
        // unit in the last place away from what it printed.)
        prop_assert_eq!(Fingerprint::of(&a).unwrap(), Fingerprint::of(&b).unwrap());
    }
}

// ---- through a handler, on real stores ------------------------------------

#[derive(Debug, serde::Deserialize, serde::Serialize)]
struct Order {
    message_id: String,
    lines: HashMap<String, u32>,
    tags: HashSet<String>,
    meta: HashMap<String, HashMap<String, Vec<u8>>>,
}

/// The same message as another service writes it: other field order, the
/// maps as `BTreeMap`s, an optional field left out.
#[derive(Debug, serde::Serialize)]
struct OrderElsewhere {
    meta: std::collections::BTreeMap<String, std::collections::BTreeMap<String, Vec<u8>>>,
    tags: Vec<String>,
    note: Option<String>,
    lines: std::collections::BTreeMap<String, u32>,
    message_id: String,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
}

#[idempotent(key = "order.message_id", store = store, fingerprint = "order")]
async fn take<S: Store>(store: &S, order: &Order, runs: &AtomicU32) -> Result<u32, AppError> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

fn order_bytes(id: &str) -> Vec<u8> {
    let lines: String = (0..30).map(|i| format!("\"sku-{i}\":{i},")).collect();
    let tags: String = (0..30).map(|i| format!("\"tag-{i}\",")).collect();
    format!(
        r#"{{"message_id":"{id}","lines":{{{}}},"tags":[{}],"meta":{{"a":{{"x":[1,2],"y":[3]}},"b":{{"z":[]}}}}}}"#,
        lines.trim_end_matches(','),
        tags.trim_end_matches(',')
    )
    .into_bytes()
}

async fn redeliveries_of_the_same_bytes_are_duplicates<S: Store>(store: &S) {
    let id = common::unique("fp-order");
    let bytes = order_bytes(&id);
    let runs = AtomicU32::new(0);
    for delivery in 0..20 {
        // Each decode builds new hash maps with their own iteration order.
        let order: Order = serde_json::from_slice(&bytes).unwrap();
        let result = take(store, &order, &runs).await;
        assert!(
            matches!(result, Ok(1)),
            "delivery {delivery} of the same bytes: {result:?} (KeyReused is the bug)"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The same content from a service that writes it differently.
    let order: Order = serde_json::from_slice(&bytes).unwrap();
    let elsewhere = OrderElsewhere {
        meta: order
            .meta
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_iter().collect()))
            .collect(),
        tags: {
            let mut tags: Vec<String> = order.tags.iter().cloned().collect();
            tags.sort_by(|a, b| b.cmp(a));
            tags
        },
        note: None,
        lines: order.lines.clone().into_iter().collect(),
        message_id: order.message_id.clone(),
    };
    assert_eq!(Fingerprint::of(&elsewhere).unwrap(), Fingerprint::of(&order).unwrap());

    // Another message under the same key is still refused.
    let mut other: Order = serde_json::from_slice(&bytes).unwrap();
    other.lines.insert("sku-0".into(), 1000);
    let err = take(store, &other, &runs).await.unwrap_err();
    assert!(matches!(err, AppError::Idem(Error::KeyReused { .. })), "{err:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn redelivered_messages_with_maps_and_sets_are_duplicates_not_reused_keys() {
    redeliveries_of_the_same_bytes_are_duplicates(&MemoryStore::new()).await;

    let pool = common::pg_pool(2).await;
    let table = common::unique("fingerprints");
    let pg = PgStore::builder(pool.clone()).table(&table).build().unwrap();
    pg.migrate().await.unwrap();
    redeliveries_of_the_same_bytes_are_duplicates(&pg).await;
    common::drop_pg_table(&pool, &table).await;
}
