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
        prop_assert_eq!(Fingerprint::of(&a).unwrap(), Fingerprint::of(&b).unwrap());
    }
}

// ---- fingerprints against serde_json's own output --------------------------

/// Values whose JSON collide in every way serde_json allows: a unit variant
/// and a string (`"Unit"`), a newtype variant and a one-entry map
/// (`{"Maybe": ..}`), a struct variant and nested maps, variants whose
/// content is `null` (`{"Maybe": null}`, `{"Also": null}`). Maps never hold
/// `null` (a `null` entry is documented as the same as an absent one), so
/// for these values two fingerprints are equal exactly when serde_json
/// writes the same content (up to key order and the order of lists, which
/// are multisets).
#[derive(Debug, Clone, serde::Serialize)]
#[serde(untagged)]
enum Json {
    Text(String),
    Number(i64),
    List(Vec<Json>),
    Dict(std::collections::BTreeMap<String, Json>),
    Tagged(Tagged),
}

#[derive(Debug, Clone, serde::Serialize)]
enum Tagged {
    Unit,
    Maybe(Option<Box<Json>>),
    Also(Option<Box<Json>>),
    Hold(()),
    Record { id: i64, tag: String },
}

fn json() -> impl Strategy<Value = Json> {
    // Few names and numbers, so that pairs often collide.
    let name = prop_oneof![Just("Unit"), Just("Maybe"), Just("Also"), Just("Hold"), Just("a")].prop_map(String::from);
    let leaf = prop_oneof![
        name.clone().prop_map(Json::Text),
        (0i64..3).prop_map(Json::Number),
        Just(Json::Tagged(Tagged::Unit)),
        Just(Json::Tagged(Tagged::Maybe(None))),
        Just(Json::Tagged(Tagged::Also(None))),
        Just(Json::Tagged(Tagged::Hold(()))),
        ((0i64..2), name.clone()).prop_map(|(id, tag)| Json::Tagged(Tagged::Record { id, tag })),
    ];
    leaf.prop_recursive(3, 16, 3, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Json::List),
            prop::collection::btree_map(name.clone(), inner.clone(), 0..3).prop_map(Json::Dict),
            inner
                .clone()
                .prop_map(|j| Json::Tagged(Tagged::Maybe(Some(Box::new(j))))),
            inner.prop_map(|j| Json::Tagged(Tagged::Also(Some(Box::new(j))))),
        ]
    })
}

/// serde_json's text of a value, with object keys sorted and the elements
/// of each list sorted (the two orders a fingerprint ignores).
fn normalized(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Array(items) => {
            let mut items: Vec<String> = items.iter().map(normalized).collect();
            items.sort();
            format!("[{}]", items.join(","))
        }
        serde_json::Value::Object(entries) => {
            let mut entries: Vec<String> = entries
                .iter()
                .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).unwrap(), normalized(v)))
                .collect();
            entries.sort();
            format!("{{{}}}", entries.join(","))
        }
        other => other.to_string(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn fingerprints_differ_exactly_when_serde_json_writes_different_content(a in json(), b in json()) {
        let (ja, jb) = (serde_json::to_value(&a).unwrap(), serde_json::to_value(&b).unwrap());
        let same_json = normalized(&ja) == normalized(&jb);
        let same_fingerprint = Fingerprint::of(&a).unwrap() == Fingerprint::of(&b).unwrap();
        prop_assert_eq!(
            same_fingerprint, same_json,
            "{} vs {}", serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap()
        );
    }
}

#[test]
fn variants_with_null_content_have_fingerprints_of_their_own() {
    let approve = Json::Tagged(Tagged::Maybe(None));
    let reject = Json::Tagged(Tagged::Also(None));
    assert_ne!(Fingerprint::of(&approve).unwrap(), Fingerprint::of(&reject).unwrap());
    assert_ne!(
        Fingerprint::of(&approve).unwrap(),
        Fingerprint::of(&serde_json::json!({})).unwrap(),
        "{{\"Maybe\": null}} is not an empty map"
    );
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
