//! Message fingerprints: a hash of the message stored with its marker, so a
//! key reused for a different message is an error instead of a silent skip.
//!
//! # The canonical form
//!
//! A fingerprint is a function of the value's *content*, never of the order
//! in which a `HashMap` or `HashSet` happens to iterate, so a redelivery of
//! the same bytes always has the same fingerprint. The value goes through
//! its `serde::Serialize` implementation into a canonical tree, which is
//! encoded without ambiguity and hashed with SHA-256:
//!
//! - maps and structs are sets of entries sorted by key, at every depth: two
//!   structs with the same fields in another declaration order, or two maps
//!   filled in another order, are equal;
//! - a map entry or struct field whose value is `null` (`None`, `()`) is the
//!   same as an absent one, so adding an optional field to a message type
//!   does not change the fingerprint of messages that leave it empty (an
//!   enum variant's content is not a field: `Approve(None)` and
//!   `Reject(None)` differ, as `{"Approve":null}` and `{"Reject":null}` do);
//! - sequences (`Vec`, slices, `HashSet`, `BTreeSet`...) are compared as
//!   multisets: serde does not tell a set from a list, so their order is
//!   ignored (`[1, 2]` and `[2, 1]` have one fingerprint). Tuples and arrays
//!   keep their order;
//! - numbers are compared by value: `5_u8`, `5_i64` and `5.0_f64` are equal;
//!   `-0.0` is `0`; integer map keys are the same as their decimal text (as
//!   in JSON);
//! - enums are encoded as serde's JSON does (`"Variant"` or
//!   `{"Variant": ..}`), newtype structs as their content.

use std::collections::BTreeMap;

use serde::ser::{self, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;

/// The SHA-256 of a value's canonical form (see the module
/// documentation), as 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// Hashes the canonical form of `value` (any `serde::Serialize` value:
    /// the whole message, or the fields that must not change between
    /// deliveries).
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<Self, Error> {
        let canon = value
            .serialize(Canonical)
            .map_err(|err| Error::Codec(<serde_json::Error as ser::Error>::custom(err.0)))?;
        let mut bytes = Vec::with_capacity(128);
        canon.encode(&mut bytes);
        Ok(Self::from_bytes(&bytes))
    }

    /// Hashes raw bytes.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self::from_chunks([bytes])
    }

    /// Hashes the concatenation of `chunks` (without copying them together).
    pub(crate) fn from_chunks<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut hasher = Sha256::new();
        for chunk in chunks {
            hasher.update(chunk);
        }
        let digest = hasher.finalize();
        let mut hex = String::with_capacity(64);
        for byte in digest {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        Fingerprint(hex)
    }

    /// The hex text stored with the marker.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// A value in canonical form.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Canon {
    Null,
    Bool(bool),
    /// Every integer, and every float that is a whole number in range.
    Int(i128),
    /// An unsigned integer above `i128::MAX`.
    BigUint(u128),
    /// The bits of a float that is not a whole number (`NaN` normalised).
    Float(u64),
    Str(String),
    Bytes(Vec<u8>),
    /// A sequence, sorted: order does not count.
    Multiset(Vec<Canon>),
    /// A tuple or array: order counts.
    Tuple(Vec<Canon>),
    /// Entries sorted by key, without `Null` values.
    Map(BTreeMap<Canon, Canon>),
}

impl Canon {
    /// A prefix-free encoding: a tag, then lengths before contents.
    fn encode(&self, out: &mut Vec<u8>) {
        fn len(out: &mut Vec<u8>, n: usize) {
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
        match self {
            Canon::Null => out.push(b'n'),
            Canon::Bool(b) => out.extend_from_slice(if *b { b"t" } else { b"f" }),
            Canon::Int(i) => {
                out.push(b'i');
                out.extend_from_slice(&i.to_be_bytes());
            }
            Canon::BigUint(u) => {
                out.push(b'u');
                out.extend_from_slice(&u.to_be_bytes());
            }
            Canon::Float(bits) => {
                out.push(b'd');
                out.extend_from_slice(&bits.to_be_bytes());
            }
            Canon::Str(s) => {
                out.push(b's');
                len(out, s.len());
                out.extend_from_slice(s.as_bytes());
            }
            Canon::Bytes(b) => {
                out.push(b'b');
                len(out, b.len());
                out.extend_from_slice(b);
            }
            Canon::Multiset(items) | Canon::Tuple(items) => {
                out.push(if matches!(self, Canon::Multiset(_)) { b'm' } else { b'a' });
                len(out, items.len());
                for item in items {
                    item.encode(out);
                }
            }
            Canon::Map(entries) => {
                out.push(b'o');
                len(out, entries.len());
                for (key, value) in entries {
                    key.encode(out);
                    value.encode(out);
                }
            }
        }
    }

    fn float(value: f64) -> Canon {
        const TWO_TO_THE_100: f64 = 1_267_650_600_228_229_401_496_703_205_376.0;
        if value.is_nan() {
            return Canon::Float(f64::NAN.to_bits());
        }
        if value.fract() == 0.0 && value.abs() < TWO_TO_THE_100 {
            // Whole and well inside i128: exact.
            return Canon::Int(value as i128);
        }
        Canon::Float(value.to_bits())
    }

    /// A map key: integers become their decimal text, as JSON keys do.
    fn key(self) -> Canon {
        match self {
            Canon::Int(i) => Canon::Str(i.to_string()),
            Canon::BigUint(u) => Canon::Str(u.to_string()),
            other => other,
        }
    }

    fn map(entries: Vec<(Canon, Canon)>) -> Canon {
        Canon::Map(
            entries
                .into_iter()
                .filter(|(_, value)| *value != Canon::Null)
                .map(|(key, value)| (key.key(), value))
                .collect(),
        )
    }

    fn multiset(mut items: Vec<Canon>) -> Canon {
        items.sort();
        Canon::Multiset(items)
    }

    /// An enum variant with content: `{variant: content}`, as serde_json
    /// writes it. Unlike a map entry, a `null` content is kept:
    /// `Approve(None)` and `Reject(None)` differ.
    fn variant(name: &str, value: Canon) -> Canon {
        Canon::Map(BTreeMap::from([(Canon::Str(name.to_owned()), value)]))
    }
}

/// What `Serialize` impls report through [`Canonical`].
#[derive(Debug)]
struct CanonError(String);

impl std::fmt::Display for CanonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CanonError {}

impl ser::Error for CanonError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        CanonError(msg.to_string())
    }
}

/// The serializer that builds a [`Canon`].
struct Canonical;

type Result<T, E = CanonError> = std::result::Result<T, E>;

impl ser::Serializer for Canonical {
    type Ok = Canon;
    type Error = CanonError;
    type SerializeSeq = Seq;
    type SerializeTuple = Seq;
    type SerializeTupleStruct = Seq;
    type SerializeTupleVariant = Variant<Seq>;
    type SerializeMap = MapBuilder;
    type SerializeStruct = MapBuilder;
    type SerializeStructVariant = Variant<MapBuilder>;

    fn serialize_bool(self, v: bool) -> Result<Canon> {
        Ok(Canon::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_i16(self, v: i16) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_i32(self, v: i32) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_i64(self, v: i64) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_i128(self, v: i128) -> Result<Canon> {
        Ok(Canon::Int(v))
    }
    fn serialize_u8(self, v: u8) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_u16(self, v: u16) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_u32(self, v: u32) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_u64(self, v: u64) -> Result<Canon> {
        Ok(Canon::Int(v.into()))
    }
    fn serialize_u128(self, v: u128) -> Result<Canon> {
        Ok(i128::try_from(v).map_or(Canon::BigUint(v), Canon::Int))
    }
    fn serialize_f32(self, v: f32) -> Result<Canon> {
        Ok(Canon::float(f64::from(v)))
    }
    fn serialize_f64(self, v: f64) -> Result<Canon> {
        Ok(Canon::float(v))
    }
    fn serialize_char(self, v: char) -> Result<Canon> {
        Ok(Canon::Str(v.to_string()))
    }
    fn serialize_str(self, v: &str) -> Result<Canon> {
        Ok(Canon::Str(v.to_owned()))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Canon> {
        Ok(Canon::Bytes(v.to_owned()))
    }
    fn serialize_none(self) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Canon> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_unit_variant(self, _name: &'static str, _index: u32, variant: &'static str) -> Result<Canon> {
        Ok(Canon::Str(variant.to_owned()))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _name: &'static str, value: &T) -> Result<Canon> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<Canon> {
        Ok(Canon::variant(variant, value.serialize(Canonical)?))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<Seq> {
        Ok(Seq::new(len, false))
    }
    fn serialize_tuple(self, len: usize) -> Result<Seq> {
        Ok(Seq::new(Some(len), true))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<Seq> {
        Ok(Seq::new(Some(len), true))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Variant<Seq>> {
        Ok(Variant {
            name: variant,
            inner: Seq::new(Some(len), true),
        })
    }
    fn serialize_map(self, len: Option<usize>) -> Result<MapBuilder> {
        Ok(MapBuilder::new(len))
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<MapBuilder> {
        Ok(MapBuilder::new(Some(len)))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Variant<MapBuilder>> {
        Ok(Variant {
            name: variant,
            inner: MapBuilder::new(Some(len)),
        })
    }
}

/// A sequence (a multiset) or a tuple (ordered) being built.
struct Seq {
    items: Vec<Canon>,
    ordered: bool,
}

impl Seq {
    fn new(len: Option<usize>, ordered: bool) -> Seq {
        Seq {
            items: Vec::with_capacity(len.unwrap_or(0).min(4096)),
            ordered,
        }
    }

    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.items.push(value.serialize(Canonical)?);
        Ok(())
    }

    fn finish(self) -> Canon {
        if self.ordered {
            Canon::Tuple(self.items)
        } else {
            Canon::multiset(self.items)
        }
    }
}

/// The three sequence shapes serde hands a serializer all build a [`Seq`].
macro_rules! seq_serializer {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Seq {
            type Ok = Canon;
            type Error = CanonError;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
                self.push(value)
            }
            fn end(self) -> Result<Canon> {
                Ok(self.finish())
            }
        }
    )*};
}

seq_serializer!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field
);

/// A map or struct being built.
struct MapBuilder {
    entries: Vec<(Canon, Canon)>,
    key: Option<Canon>,
}

impl MapBuilder {
    fn new(len: Option<usize>) -> MapBuilder {
        MapBuilder {
            entries: Vec::with_capacity(len.unwrap_or(0).min(4096)),
            key: None,
        }
    }
}

impl ser::SerializeMap for MapBuilder {
    type Ok = Canon;
    type Error = CanonError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<()> {
        self.key = Some(key.serialize(Canonical)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        let key = self
            .key
            .take()
            .ok_or_else(|| CanonError("a map value was serialized before its key".into()))?;
        self.entries.push((key, value.serialize(Canonical)?));
        Ok(())
    }
    fn end(self) -> Result<Canon> {
        Ok(Canon::map(self.entries))
    }
}

impl ser::SerializeStruct for MapBuilder {
    type Ok = Canon;
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<()> {
        self.entries
            .push((Canon::Str(key.to_owned()), value.serialize(Canonical)?));
        Ok(())
    }
    fn end(self) -> Result<Canon> {
        Ok(Canon::map(self.entries))
    }
}

/// An enum variant with content: `{variant: content}`.
struct Variant<B> {
    name: &'static str,
    inner: B,
}

impl ser::SerializeTupleVariant for Variant<Seq> {
    type Ok = Canon;
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.inner.push(value)
    }
    fn end(self) -> Result<Canon> {
        Ok(Canon::variant(self.name, self.inner.finish()))
    }
}

impl ser::SerializeStructVariant for Variant<MapBuilder> {
    type Ok = Canon;
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<()> {
        ser::SerializeStruct::serialize_field(&mut self.inner, key, value)
    }
    fn end(self) -> Result<Canon> {
        Ok(Canon::variant(self.name, Canon::map(self.inner.entries)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap, HashSet};

    use super::*;

    fn fp<T: Serialize + ?Sized>(value: &T) -> Fingerprint {
        Fingerprint::of(value).unwrap()
    }

    #[test]
    fn equal_values_hash_equal_and_different_values_differ() {
        let a = fp(&("order-1", 100));
        assert_eq!(a, fp(&("order-1", 100)));
        assert_ne!(a, fp(&("order-1", 101)));
        assert_ne!(a, fp(&(100, "order-1")), "tuples keep their order");
        assert_eq!(a.as_str().len(), 64);
        assert_eq!(
            Fingerprint::from_bytes(b"").as_str(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn hash_maps_and_sets_hash_the_same_whatever_their_iteration_order() {
        // Each HashMap gets its own random hasher: iteration orders differ.
        let build = || {
            let mut m: HashMap<String, HashSet<u32>> = HashMap::new();
            for i in 0..40u32 {
                m.insert(format!("k{i}"), (0..i % 7).map(|j| j * 31 + i).collect());
            }
            m
        };
        let first = fp(&build());
        for _ in 0..20 {
            assert_eq!(fp(&build()), first);
        }
        let mut changed = build();
        changed.get_mut("k3").unwrap().insert(999);
        assert_ne!(fp(&changed), first);
    }

    #[test]
    fn struct_field_order_and_absent_nulls_do_not_count() {
        #[derive(serde::Serialize)]
        struct A {
            id: &'static str,
            amount: i64,
            note: Option<String>,
        }
        #[derive(serde::Serialize)]
        struct B {
            amount: u32,
            id: String,
        }
        let a = A {
            id: "x",
            amount: 5,
            note: None,
        };
        let b = B {
            amount: 5,
            id: "x".into(),
        };
        assert_eq!(fp(&a), fp(&b));
        let c = A {
            note: Some("n".into()),
            ..a
        };
        assert_ne!(fp(&c), fp(&b));
    }

    #[test]
    fn numbers_are_compared_by_value_and_keys_like_json() {
        assert_eq!(fp(&5u8), fp(&5.0f64));
        assert_eq!(fp(&-0.0f64), fp(&0i32));
        assert_ne!(fp(&0.5f64), fp(&0i32));
        assert_eq!(fp(&u128::MAX), fp(&u128::MAX));
        assert_ne!(fp(&u128::MAX), fp(&(u128::MAX - 1)));
        let ints: HashMap<u32, &str> = [(1, "a"), (2, "b")].into();
        let strings: HashMap<String, &str> = [("1".into(), "a"), ("2".into(), "b")].into();
        assert_eq!(fp(&ints), fp(&strings));
        let json: serde_json::Value = serde_json::from_str(r#"{"2":"b","1":"a"}"#).unwrap();
        assert_eq!(fp(&json), fp(&ints));
    }

    #[test]
    fn sequences_are_multisets_and_sets_of_either_kind_agree() {
        let set: HashSet<&str> = ["a", "b", "c"].into();
        let tree: BTreeSet<&str> = ["c", "b", "a"].into();
        assert_eq!(fp(&set), fp(&tree));
        assert_eq!(fp(&vec![1, 2, 2]), fp(&vec![2, 1, 2]));
        assert_ne!(fp(&vec![1, 2, 2]), fp(&vec![1, 2]), "multiplicity counts");
    }

    #[test]
    fn enums_and_nested_values_are_encoded_without_ambiguity() {
        #[derive(serde::Serialize)]
        enum E {
            Unit,
            New(u8),
            Tuple(u8, u8),
            Struct { a: u8 },
        }
        let all = [
            fp(&E::Unit),
            fp(&E::New(1)),
            fp(&E::Tuple(1, 2)),
            fp(&E::Tuple(2, 1)),
            fp(&E::Struct { a: 1 }),
            fp(&"Unit"),
            fp(&("ab", "c")),
            fp(&("a", "bc")),
        ];
        assert_eq!(fp(&E::Unit), fp(&"Unit"), "as serde_json encodes it");
        for (i, a) in all.iter().enumerate().skip(1).take(4) {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_ne!(all[6], all[7]);
    }

    #[test]
    fn variants_with_null_content_are_told_apart() {
        #[derive(serde::Serialize)]
        enum Decision {
            Approve(Option<u8>),
            Reject(Option<u8>),
            Hold(()),
            Wait { until: Option<u8> },
        }
        let all = [
            fp(&Decision::Approve(None)),
            fp(&Decision::Reject(None)),
            fp(&Decision::Hold(())),
            fp(&Decision::Wait { until: None }),
            fp(&serde_json::json!({})),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // A field left empty inside a variant is still the same as absent.
        assert_eq!(
            fp(&Decision::Wait { until: None }),
            fp(&serde_json::json!({"Wait": {}}))
        );
    }
}
