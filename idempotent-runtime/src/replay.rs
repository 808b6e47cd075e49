//! How a handler's result is stored with its marker and read back for a
//! duplicate, exactly.
//!
//! # The stored form
//!
//! A result is stored as **JSON** (what `serde_json` writes) whenever JSON
//! carries it exactly, which is the case for nearly every result: numbers
//! (floats are written in their shortest form that reads back to the same
//! bits, and read back with exact parsing), strings, structs, maps, enums of
//! every serde tagging. `()` and other results that write `null` store
//! nothing at all.
//!
//! JSON cannot carry three things, and for a value holding any of them the
//! result is stored in the *lossless form* instead: the text `~1:` followed
//! by serde's data model written out node by node (strings as JSON strings,
//! floats by their bits), which keeps
//! - non-finite floats (`NaN`, `inf`, `-inf`), which JSON writes as `null`;
//! - an `Option` whose content writes `null` (`Some(None)`, `Some(())`,
//!   `Some(f64::NAN)`), which JSON cannot tell from `None`;
//! - map keys JSON refuses (tuples, structs, sequences).
//!
//! # Refused before the commit
//!
//! A result is read back before the commit, by the type's own
//! `Deserialize`: a result that does not read back (a `u128` above
//! `u64::MAX` inside an internally tagged enum, whose buffering serde does
//! not support; a `Serialize` and a `Deserialize` that disagree) fails the
//! call with [`Error::Codec`] and nothing is committed, rather than
//! committing an effect whose every duplicate would then fail.
//!
//! What comes back is what the type's `Deserialize` makes of what its
//! `Serialize` wrote: bit for bit for every type whose two agree (floats'
//! bits, `-0.0`, subnormals and `NaN` payloads included). A `HashMap` comes
//! back with the same entries, in its own iteration order.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde::ser::{self, Serialize};

use crate::Error;

/// The start of the lossless form (JSON text never starts with `~`).
const LOSSLESS: &str = "~1:";

/// How deep the lossless form nests before reading refuses it (as deep as
/// serde_json reads JSON: a result nested deeper is refused before its
/// commit, in either form).
const MAX_DEPTH: usize = 128;

/// Encodes `value` for storage (`None`: JSON `null`, stored as nothing),
/// after checking that it reads back as a `T`; a value that does not is
/// refused with [`Error::Codec`].
pub(crate) fn encode<T: Serialize + DeserializeOwned>(value: &T) -> Result<Option<String>, Error> {
    let node = value.serialize(Capture).map_err(codec_error)?;
    if node.json_exact() {
        match json_text(&node) {
            Ok(text) if decode::<T>(text.as_deref()).is_ok() => return Ok(text),
            // JSON refused a key, or wrote what does not read back through
            // it (a big integer buffered as a float): try the lossless form.
            _ => {}
        }
    }
    let mut text = String::from(LOSSLESS);
    node.write(&mut text);
    match decode::<T>(Some(&text)) {
        Ok(_) => Ok(Some(text)),
        Err(error) => Err(codec_error(format!(
            "the result cannot be stored and read back exactly, so it is not committed: {error}"
        ))),
    }
}

/// Decodes a stored result (`None`: JSON `null`).
pub(crate) fn decode<T: DeserializeOwned>(stored: Option<&str>) -> Result<T, Error> {
    match stored {
        Some(text) => match text.strip_prefix(LOSSLESS) {
            Some(rest) => {
                let node = Parser { rest, depth: 0 }.document().map_err(codec_error)?;
                T::deserialize(node).map_err(codec_error)
            }
            None => serde_json::from_str(text).map_err(Error::Codec),
        },
        None => serde_json::from_str("null").map_err(Error::Codec),
    }
}

fn codec_error(error: impl fmt::Display) -> Error {
    Error::Codec(<serde_json::Error as ser::Error>::custom(error))
}

/// The JSON text of a node, `None` for `null`.
fn json_text(node: &Node) -> Result<Option<String>, serde_json::Error> {
    let json = serde_json::to_string(node)?;
    Ok(if json == "null" { None } else { Some(json) })
}

/// A value in serde's data model, as its `Serialize` wrote it.
#[derive(Debug)]
enum Node {
    None,
    Some(Box<Node>),
    /// `()` and unit structs.
    Unit,
    Bool(bool),
    I64(i64),
    I128(i128),
    U64(u64),
    U128(u128),
    F32(f32),
    F64(f64),
    Char(char),
    Str(Cow<'static, str>),
    Bytes(Vec<u8>),
    /// A newtype struct, with its name when captured (JSON writes it as
    /// its content, except for serde_json's own `RawValue`).
    Newtype(&'static str, Box<Node>),
    /// Sequences, tuples and tuple structs.
    Seq(Vec<Node>),
    /// Maps and structs (whose keys are their fields' names).
    Map(Vec<(Node, Node)>),
    /// An enum variant: unit (`None`), newtype, tuple (a `Seq`) or struct
    /// (a `Map`).
    Variant(Cow<'static, str>, Option<Box<Node>>),
}

impl Node {
    /// Whether JSON writes this node as `null`.
    fn nullish(&self) -> bool {
        match self {
            Node::None | Node::Unit => true,
            Node::F32(f) => !f.is_finite(),
            Node::F64(f) => !f.is_finite(),
            Node::Some(inner) | Node::Newtype(_, inner) => inner.nullish(),
            _ => false,
        }
    }

    /// Whether JSON carries this node exactly: no non-finite float, no
    /// `Some` of something JSON writes as `null`.
    fn json_exact(&self) -> bool {
        match self {
            Node::F32(f) => f.is_finite(),
            Node::F64(f) => f.is_finite(),
            Node::Some(inner) => !inner.nullish() && inner.json_exact(),
            Node::Newtype(_, inner) => inner.json_exact(),
            Node::Seq(items) => items.iter().all(Node::json_exact),
            Node::Map(entries) => entries.iter().all(|(k, v)| k.json_exact() && v.json_exact()),
            Node::Variant(_, content) => content.as_deref().is_none_or(Node::json_exact),
            _ => true,
        }
    }

    /// Appends the lossless form of this node to `out`.
    fn write(&self, out: &mut String) {
        use std::fmt::Write as _;
        match self {
            Node::None => out.push('n'),
            Node::Some(inner) => {
                out.push('s');
                inner.write(out);
            }
            Node::Unit => out.push('u'),
            Node::Bool(true) => out.push('t'),
            Node::Bool(false) => out.push('f'),
            Node::I64(v) => {
                let _ = write!(out, "i{v};");
            }
            Node::I128(v) => {
                let _ = write!(out, "I{v};");
            }
            Node::U64(v) => {
                let _ = write!(out, "p{v};");
            }
            Node::U128(v) => {
                let _ = write!(out, "P{v};");
            }
            Node::F32(v) => {
                let _ = write!(out, "e{:08x}", v.to_bits());
            }
            Node::F64(v) => {
                let _ = write!(out, "d{:016x}", v.to_bits());
            }
            Node::Char(c) => {
                out.push('c');
                write_str(out, c.encode_utf8(&mut [0; 4]));
            }
            Node::Str(s) => write_str(out, s),
            Node::Bytes(bytes) => {
                let _ = write!(out, "b{}:", bytes.len());
                for byte in bytes {
                    let _ = write!(out, "{byte:02x}");
                }
            }
            Node::Newtype(_, inner) => {
                out.push('w');
                inner.write(out);
            }
            Node::Seq(items) => {
                out.push('[');
                for item in items {
                    item.write(out);
                }
                out.push(']');
            }
            Node::Map(entries) => {
                out.push('{');
                for (key, value) in entries {
                    key.write(out);
                    value.write(out);
                }
                out.push('}');
            }
            Node::Variant(name, None) => {
                out.push('v');
                write_str(out, name);
            }
            Node::Variant(name, Some(content)) => {
                out.push('V');
                write_str(out, name);
                content.write(out);
            }
        }
    }
}

/// A string as a JSON string literal (escaped: any text, `NUL` included,
/// fits a text column).
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Writes a node as JSON through serde_json: structs as maps and variants
/// as serde_json writes them (`"Variant"`, `{"Variant": content}`), which
/// is byte for byte what serde_json writes for the value itself.
impl Serialize for Node {
    fn serialize<S: ser::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use ser::{SerializeMap, SerializeSeq};
        match self {
            Node::None => s.serialize_none(),
            Node::Some(inner) => s.serialize_some(inner),
            Node::Unit => s.serialize_unit(),
            Node::Bool(v) => s.serialize_bool(*v),
            Node::I64(v) => s.serialize_i64(*v),
            Node::I128(v) => s.serialize_i128(*v),
            Node::U64(v) => s.serialize_u64(*v),
            Node::U128(v) => s.serialize_u128(*v),
            Node::F32(v) => s.serialize_f32(*v),
            Node::F64(v) => s.serialize_f64(*v),
            Node::Char(v) => s.serialize_char(*v),
            Node::Str(v) => s.serialize_str(v),
            Node::Bytes(v) => s.serialize_bytes(v),
            Node::Newtype(name, inner) => s.serialize_newtype_struct(name, inner),
            Node::Seq(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Node::Map(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (key, value) in entries {
                    map.serialize_entry(key, value)?;
                }
                map.end()
            }
            Node::Variant(name, None) => s.serialize_str(name),
            Node::Variant(name, Some(content)) => {
                let mut map = s.serialize_map(Some(1))?;
                map.serialize_entry(name.as_ref(), content)?;
                map.end()
            }
        }
    }
}

/// What capturing, parsing or reading a node reports.
#[derive(Debug)]
struct CodecError(String);

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodecError {}

impl ser::Error for CodecError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        CodecError(msg.to_string())
    }
}

impl de::Error for CodecError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        CodecError(msg.to_string())
    }
}

/// The serializer that captures a value as a [`Node`].
struct Capture;

impl ser::Serializer for Capture {
    type Ok = Node;
    type Error = CodecError;
    type SerializeSeq = Items;
    type SerializeTuple = Items;
    type SerializeTupleStruct = Items;
    type SerializeTupleVariant = Items;
    type SerializeMap = Entries;
    type SerializeStruct = Entries;
    type SerializeStructVariant = Entries;

    fn serialize_bool(self, v: bool) -> Result<Node, CodecError> {
        Ok(Node::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Node, CodecError> {
        Ok(Node::I64(v.into()))
    }
    fn serialize_i16(self, v: i16) -> Result<Node, CodecError> {
        Ok(Node::I64(v.into()))
    }
    fn serialize_i32(self, v: i32) -> Result<Node, CodecError> {
        Ok(Node::I64(v.into()))
    }
    fn serialize_i64(self, v: i64) -> Result<Node, CodecError> {
        Ok(Node::I64(v))
    }
    fn serialize_i128(self, v: i128) -> Result<Node, CodecError> {
        Ok(Node::I128(v))
    }
    fn serialize_u8(self, v: u8) -> Result<Node, CodecError> {
        Ok(Node::U64(v.into()))
    }
    fn serialize_u16(self, v: u16) -> Result<Node, CodecError> {
        Ok(Node::U64(v.into()))
    }
    fn serialize_u32(self, v: u32) -> Result<Node, CodecError> {
        Ok(Node::U64(v.into()))
    }
    fn serialize_u64(self, v: u64) -> Result<Node, CodecError> {
        Ok(Node::U64(v))
    }
    fn serialize_u128(self, v: u128) -> Result<Node, CodecError> {
        Ok(Node::U128(v))
    }
    fn serialize_f32(self, v: f32) -> Result<Node, CodecError> {
        Ok(Node::F32(v))
    }
    fn serialize_f64(self, v: f64) -> Result<Node, CodecError> {
        Ok(Node::F64(v))
    }
    fn serialize_char(self, v: char) -> Result<Node, CodecError> {
        Ok(Node::Char(v))
    }
    fn serialize_str(self, v: &str) -> Result<Node, CodecError> {
        Ok(Node::Str(Cow::Owned(v.to_owned())))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Node, CodecError> {
        Ok(Node::Bytes(v.to_owned()))
    }
    fn serialize_none(self) -> Result<Node, CodecError> {
        Ok(Node::None)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Node, CodecError> {
        Ok(Node::Some(Box::new(value.serialize(Capture)?)))
    }
    fn serialize_unit(self) -> Result<Node, CodecError> {
        Ok(Node::Unit)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Node, CodecError> {
        Ok(Node::Unit)
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<Node, CodecError> {
        Ok(Node::Variant(Cow::Borrowed(variant), None))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result<Node, CodecError> {
        Ok(Node::Newtype(name, Box::new(value.serialize(Capture)?)))
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<Node, CodecError> {
        Ok(Node::Variant(
            Cow::Borrowed(variant),
            Some(Box::new(value.serialize(Capture)?)),
        ))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<Items, CodecError> {
        Ok(Items::new(len, None))
    }
    fn serialize_tuple(self, len: usize) -> Result<Items, CodecError> {
        Ok(Items::new(Some(len), None))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<Items, CodecError> {
        Ok(Items::new(Some(len), None))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Items, CodecError> {
        Ok(Items::new(Some(len), Some(variant)))
    }
    fn serialize_map(self, len: Option<usize>) -> Result<Entries, CodecError> {
        Ok(Entries::new(len, None))
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<Entries, CodecError> {
        Ok(Entries::new(Some(len), None))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Entries, CodecError> {
        Ok(Entries::new(Some(len), Some(variant)))
    }
}

/// Wraps `content` in its variant, if it has one.
fn in_variant(variant: Option<&'static str>, content: Node) -> Node {
    match variant {
        Some(name) => Node::Variant(Cow::Borrowed(name), Some(Box::new(content))),
        None => content,
    }
}

/// A sequence, tuple, tuple struct or tuple variant being captured.
struct Items {
    items: Vec<Node>,
    variant: Option<&'static str>,
}

impl Items {
    fn new(len: Option<usize>, variant: Option<&'static str>) -> Items {
        Items {
            items: Vec::with_capacity(len.unwrap_or(0).min(4096)),
            variant,
        }
    }

    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CodecError> {
        self.items.push(value.serialize(Capture)?);
        Ok(())
    }

    fn finish(self) -> Result<Node, CodecError> {
        Ok(in_variant(self.variant, Node::Seq(self.items)))
    }
}

/// The four sequence shapes serde hands a serializer all capture [`Items`].
macro_rules! items_serializer {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Items {
            type Ok = Node;
            type Error = CodecError;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CodecError> {
                self.push(value)
            }
            fn end(self) -> Result<Node, CodecError> {
                self.finish()
            }
        }
    )*};
}

items_serializer!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

/// A map, struct or struct variant being captured.
struct Entries {
    entries: Vec<(Node, Node)>,
    key: Option<Node>,
    variant: Option<&'static str>,
}

impl Entries {
    fn new(len: Option<usize>, variant: Option<&'static str>) -> Entries {
        Entries {
            entries: Vec::with_capacity(len.unwrap_or(0).min(4096)),
            key: None,
            variant,
        }
    }

    fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), CodecError> {
        self.entries
            .push((Node::Str(Cow::Borrowed(key)), value.serialize(Capture)?));
        Ok(())
    }

    fn finish(self) -> Result<Node, CodecError> {
        Ok(in_variant(self.variant, Node::Map(self.entries)))
    }
}

impl ser::SerializeMap for Entries {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), CodecError> {
        self.key = Some(key.serialize(Capture)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CodecError> {
        let key = self
            .key
            .take()
            .ok_or_else(|| CodecError("a map value was serialized before its key".into()))?;
        self.entries.push((key, value.serialize(Capture)?));
        Ok(())
    }
    fn end(self) -> Result<Node, CodecError> {
        self.finish()
    }
}

impl ser::SerializeStruct for Entries {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), CodecError> {
        self.field(key, value)
    }
    fn end(self) -> Result<Node, CodecError> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Entries {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), CodecError> {
        self.field(key, value)
    }
    fn end(self) -> Result<Node, CodecError> {
        self.finish()
    }
}

/// Reads the lossless form back into a [`Node`].
struct Parser<'a> {
    rest: &'a str,
    depth: usize,
}

impl<'a> Parser<'a> {
    /// The whole text: one node and nothing after it.
    fn document(mut self) -> Result<Node, CodecError> {
        let node = self.node()?;
        if self.rest.is_empty() {
            Ok(node)
        } else {
            Err(self.error("text after the value"))
        }
    }

    fn error(&self, what: &str) -> CodecError {
        let near: String = self.rest.chars().take(16).collect();
        CodecError(format!("stored result unreadable: {what} at {near:?}"))
    }

    fn peek(&self) -> Option<u8> {
        self.rest.as_bytes().first().copied()
    }

    fn bump(&mut self) -> Result<u8, CodecError> {
        let byte = self.peek().ok_or_else(|| self.error("end of text"))?;
        // Every tag and delimiter is ASCII; strings are read by `string`.
        self.rest = self
            .rest
            .get(1..)
            .ok_or_else(|| self.error("a character where a tag was expected"))?;
        Ok(byte)
    }

    /// The text up to `end` (consumed, not returned with it).
    fn until(&mut self, end: u8) -> Result<&'a str, CodecError> {
        let at = self
            .rest
            .bytes()
            .position(|b| b == end)
            .ok_or_else(|| self.error("an unterminated number"))?;
        let (text, rest) = self.rest.split_at(at);
        self.rest = &rest[1..];
        Ok(text)
    }

    fn number<N: std::str::FromStr>(&mut self) -> Result<N, CodecError> {
        let text = self.until(b';')?;
        text.parse().map_err(|_| self.error("a malformed number"))
    }

    fn hex(&mut self, digits: usize) -> Result<u64, CodecError> {
        let text = self.rest.get(..digits).ok_or_else(|| self.error("a short float"))?;
        let bits = u64::from_str_radix(text, 16).map_err(|_| self.error("a malformed float"))?;
        self.rest = &self.rest[digits..];
        Ok(bits)
    }

    /// A JSON string literal.
    fn string(&mut self) -> Result<String, CodecError> {
        if self.peek() != Some(b'"') {
            return Err(self.error("a string"));
        }
        let bytes = self.rest.as_bytes();
        let mut at = 1;
        loop {
            match bytes.get(at) {
                Some(b'"') => break,
                Some(b'\\') => at += 2,
                Some(_) => at += 1,
                None => return Err(self.error("an unterminated string")),
            }
        }
        let literal = self.rest.get(..=at).ok_or_else(|| self.error("a string"))?;
        let text = serde_json::from_str(literal).map_err(|e| self.error(&e.to_string()))?;
        self.rest = &self.rest[at + 1..];
        Ok(text)
    }

    fn node(&mut self) -> Result<Node, CodecError> {
        if self.peek() == Some(b'"') {
            return Ok(Node::Str(Cow::Owned(self.string()?)));
        }
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        let node = match self.bump()? {
            b'n' => Node::None,
            b's' => Node::Some(Box::new(self.node()?)),
            b'u' => Node::Unit,
            b't' => Node::Bool(true),
            b'f' => Node::Bool(false),
            b'i' => Node::I64(self.number()?),
            b'I' => Node::I128(self.number()?),
            b'p' => Node::U64(self.number()?),
            b'P' => Node::U128(self.number()?),
            b'e' => Node::F32(f32::from_bits(
                u32::try_from(self.hex(8)?).map_err(|_| self.error("a malformed float"))?,
            )),
            b'd' => Node::F64(f64::from_bits(self.hex(16)?)),
            b'c' => {
                let text = self.string()?;
                let mut chars = text.chars();
                match (chars.next(), chars.next()) {
                    (Some(c), None) => Node::Char(c),
                    _ => return Err(self.error("a malformed char")),
                }
            }
            b'b' => {
                let len: usize = self
                    .until(b':')?
                    .parse()
                    .map_err(|_| self.error("a malformed length"))?;
                let mut bytes = Vec::with_capacity(len.min(self.rest.len() / 2));
                for _ in 0..len {
                    let byte = self.hex(2)?;
                    bytes.push(u8::try_from(byte).map_err(|_| self.error("a malformed byte"))?);
                }
                Node::Bytes(bytes)
            }
            b'w' => Node::Newtype("", Box::new(self.node()?)),
            b'[' => {
                let mut items = Vec::new();
                while self.peek() != Some(b']') {
                    items.push(self.node()?);
                }
                self.bump()?;
                Node::Seq(items)
            }
            b'{' => {
                let mut entries = Vec::new();
                while self.peek() != Some(b'}') {
                    let key = self.node()?;
                    entries.push((key, self.node()?));
                }
                self.bump()?;
                Node::Map(entries)
            }
            b'v' => Node::Variant(Cow::Owned(self.string()?), None),
            b'V' => {
                let name = self.string()?;
                Node::Variant(Cow::Owned(name), Some(Box::new(self.node()?)))
            }
            _ => return Err(self.error("an unknown tag")),
        };
        self.depth -= 1;
        Ok(node)
    }
}

/// Reads a [`Node`] as the JSON it stands for would be read by
/// `serde_json`, except where JSON loses what the node keeps (`Some` of a
/// `null`, non-finite floats, 128-bit integers, map keys).
impl<'de> de::Deserializer<'de> for Node {
    type Error = CodecError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            Node::None => visitor.visit_none(),
            Node::Some(inner) => visitor.visit_some(*inner),
            Node::Unit => visitor.visit_unit(),
            Node::Bool(v) => visitor.visit_bool(v),
            Node::I64(v) => visitor.visit_i64(v),
            // As JSON reads a number: 64 bits where it fits (serde's
            // buffering of tagged and untagged enums has no 128-bit integer).
            Node::I128(v) => match (i64::try_from(v), u64::try_from(v)) {
                (Ok(v), _) => visitor.visit_i64(v),
                (_, Ok(v)) => visitor.visit_u64(v),
                _ => visitor.visit_i128(v),
            },
            Node::U64(v) => visitor.visit_u64(v),
            Node::U128(v) => match u64::try_from(v) {
                Ok(v) => visitor.visit_u64(v),
                Err(_) => visitor.visit_u128(v),
            },
            Node::F32(v) => visitor.visit_f32(v),
            Node::F64(v) => visitor.visit_f64(v),
            Node::Char(v) => visitor.visit_char(v),
            Node::Str(Cow::Borrowed(v)) => visitor.visit_str(v),
            Node::Str(Cow::Owned(v)) => visitor.visit_string(v),
            Node::Bytes(v) => visitor.visit_byte_buf(v),
            Node::Newtype(_, inner) => inner.deserialize_any(visitor),
            Node::Seq(items) => visitor.visit_seq(de::value::SeqDeserializer::new(items.into_iter())),
            Node::Map(entries) => visitor.visit_map(de::value::MapDeserializer::new(entries.into_iter())),
            Node::Variant(name, None) => visitor.visit_string(name.into_owned()),
            Node::Variant(name, Some(content)) => visitor.visit_map(de::value::MapDeserializer::new(std::iter::once(
                (Node::Str(name), *content),
            ))),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            Node::None | Node::Unit => visitor.visit_none(),
            Node::Some(inner) => visitor.visit_some(*inner),
            other => visitor.visit_some(other),
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            Node::None | Node::Unit => visitor.visit_unit(),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, CodecError> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        match self {
            Node::Newtype(_, inner) => visitor.visit_newtype_struct(*inner),
            other => visitor.visit_newtype_struct(other),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        match self {
            Node::Variant(variant, content) => visitor.visit_enum(Variant {
                name: variant,
                content: Content(content),
            }),
            Node::Str(variant) => visitor.visit_enum(Variant {
                name: variant,
                content: Content(None),
            }),
            Node::Newtype(_, inner) => inner.deserialize_enum(name, variants, visitor),
            Node::Map(mut entries) if entries.len() == 1 => match entries.pop() {
                Some((Node::Str(variant), content)) => visitor.visit_enum(Variant {
                    name: variant,
                    content: Content(Some(Box::new(content))),
                }),
                _ => Err(de::Error::custom("an enum's variant must be named by a string")),
            },
            other => Err(de::Error::invalid_type(other.unexpected(), &visitor)),
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            Node::Char(c) => visitor.visit_string(c.to_string()),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char bytes byte_buf
        seq tuple tuple_struct map struct
    }
}

impl Node {
    fn unexpected(&self) -> de::Unexpected<'_> {
        match self {
            Node::None | Node::Some(_) => de::Unexpected::Option,
            Node::Unit => de::Unexpected::Unit,
            Node::Bool(v) => de::Unexpected::Bool(*v),
            Node::I64(v) => de::Unexpected::Signed(*v),
            Node::U64(v) => de::Unexpected::Unsigned(*v),
            Node::I128(_) | Node::U128(_) => de::Unexpected::Other("a 128-bit integer"),
            Node::F32(v) => de::Unexpected::Float(f64::from(*v)),
            Node::F64(v) => de::Unexpected::Float(*v),
            Node::Char(v) => de::Unexpected::Char(*v),
            Node::Str(v) => de::Unexpected::Str(v),
            Node::Bytes(v) => de::Unexpected::Bytes(v),
            Node::Newtype(..) => de::Unexpected::NewtypeStruct,
            Node::Seq(_) => de::Unexpected::Seq,
            Node::Map(_) => de::Unexpected::Map,
            Node::Variant(..) => de::Unexpected::Enum,
        }
    }
}

impl<'de> IntoDeserializer<'de, CodecError> for Node {
    type Deserializer = Node;

    fn into_deserializer(self) -> Node {
        self
    }
}

/// An enum's variant being read: its name and content.
struct Variant {
    name: Cow<'static, str>,
    content: Content,
}

/// A variant's content: none for a unit variant.
struct Content(Option<Box<Node>>);

impl Content {
    fn node(self) -> Node {
        self.0.map_or(Node::Unit, |content| *content)
    }
}

impl<'de> de::EnumAccess<'de> for Variant {
    type Error = CodecError;
    type Variant = Content;

    fn variant_seed<S: de::DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Self::Variant), CodecError> {
        let name = seed.deserialize(Node::Str(self.name))?;
        Ok((name, self.content))
    }
}

impl<'de> de::VariantAccess<'de> for Content {
    type Error = CodecError;

    fn unit_variant(self) -> Result<(), CodecError> {
        match self.0.as_deref() {
            None | Some(Node::Unit | Node::None) => Ok(()),
            Some(other) => Err(de::Error::invalid_type(other.unexpected(), &"a unit variant")),
        }
    }

    fn newtype_variant_seed<S: de::DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, CodecError> {
        seed.deserialize(self.node())
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, CodecError> {
        de::Deserializer::deserialize_seq(self.node(), visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        de::Deserializer::deserialize_map(self.node(), visitor)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use serde::{Deserialize, Serialize};

    use super::*;

    /// Encodes, then decodes what was stored.
    fn again<T: Serialize + DeserializeOwned>(value: &T) -> (Option<String>, T) {
        let stored = encode(value).expect("encodes");
        let back = decode::<T>(stored.as_deref()).expect("decodes");
        (stored, back)
    }

    #[test]
    fn json_is_kept_where_it_is_exact_and_byte_for_byte_what_serde_json_writes() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        enum Shape {
            Unit,
            New(u8),
            Tuple(i32, String),
            Struct { a: Option<u8>, b: Vec<f64> },
        }
        let values = vec![
            Shape::Unit,
            Shape::New(3),
            Shape::Tuple(-4, "x\"y".into()),
            Shape::Struct {
                a: None,
                b: vec![0.1, -0.0, 1e300, f64::MIN_POSITIVE / 4.0],
            },
        ];
        let (stored, back) = again(&values);
        assert_eq!(
            stored.as_deref(),
            Some(serde_json::to_string(&values).unwrap().as_str())
        );
        assert_eq!(back, values);
        let map: BTreeMap<u32, (char, u128)> = [(1, ('é', u128::MAX)), (7, ('\0', 0))].into();
        let (stored, back) = again(&map);
        assert_eq!(stored.as_deref(), Some(serde_json::to_string(&map).unwrap().as_str()));
        assert_eq!(back, map);
        assert_eq!(again(&()).0, None, "() stores nothing");
        assert_eq!(again(&None::<u8>).0, None, "None stores nothing");
    }

    #[test]
    fn floats_come_back_bit_for_bit() {
        for f in [14.0 * 0.1, 1.0 / 3.0, 2f64.sqrt(), -0.0, 5e-324, f64::MAX] {
            assert_eq!(again(&f).1.to_bits(), f.to_bits(), "{f:?}");
        }
        for f in [
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::from_bits(0x7ff8_0000_0000_0001),
        ] {
            let (stored, back) = again(&f);
            assert!(stored.as_deref().is_some_and(|s| s.starts_with(LOSSLESS)), "{stored:?}");
            assert_eq!(back.to_bits(), f.to_bits());
        }
        let f = f32::from_bits(0xffc0_0001);
        assert_eq!(again(&f).1.to_bits(), f.to_bits());
    }

    #[test]
    fn nested_options_stay_distinct() {
        assert_eq!(again(&None::<Option<u8>>).1, None);
        assert_eq!(again(&Some(None::<u8>)).1, Some(None));
        assert_eq!(again(&Some(Some(1u8))).1, Some(Some(1)));
        assert_eq!(again(&Some(())).1, Some(()));
        assert_eq!(again(&None::<()>).1, None);
        let nan = again(&Some(f64::NAN)).1;
        assert!(nan.is_some_and(f64::is_nan));
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Patch {
            name: Option<Option<String>>,
        }
        let patch = Patch { name: Some(None) };
        assert_eq!(again(&patch).1, patch);
    }

    #[test]
    fn keys_json_refuses_are_kept() {
        let map: HashMap<(u8, u8), String> = [((1, 2), "a".into()), ((3, 4), "b".into())].into();
        assert_eq!(again(&map).1, map);
    }

    #[test]
    fn a_result_that_does_not_read_back_is_refused() {
        #[derive(Serialize, Deserialize, Debug)]
        #[serde(tag = "type")]
        enum Tagged {
            Big { n: u128 },
        }
        let error = encode(&Tagged::Big {
            n: u128::from(u64::MAX) + 1,
        })
        .unwrap_err();
        assert!(matches!(error, Error::Codec(_)), "{error}");
        assert!(error.to_string().contains("not committed"), "{error}");
        // serde reads no `u128` through an internally tagged enum, whatever
        // its value; a `u64` comes back, NaN and all.
        #[derive(Serialize, Deserialize, Debug)]
        #[serde(tag = "type")]
        enum Small {
            Small { n: u64, f: f64 },
        }
        let Small::Small { n, f } = again(&Small::Small {
            n: u64::MAX,
            f: f64::NAN,
        })
        .1;
        assert_eq!((n, f.to_bits()), (u64::MAX, f64::NAN.to_bits()));
    }

    #[test]
    fn strings_with_any_character_survive_the_lossless_form() {
        let value = Some(Some((
            "\0\"\\\n\u{1f}é\u{10ffff}".to_string(),
            serde_bytes_like(&[0, 255, 16]),
            Option::<()>::None,
        )));
        let (stored, back) = again(&(value.clone(), Some(())));
        assert!(stored.is_some_and(|s| s.starts_with(LOSSLESS)));
        assert_eq!(back, (value, Some(())));
    }

    fn serde_bytes_like(bytes: &[u8]) -> Vec<u8> {
        bytes.to_vec()
    }

    #[test]
    fn unreadable_stored_text_is_an_error_not_a_panic() {
        for text in [
            "~1:", "~1:i12", "~1:[i1;", "~1:d12", "~1:\"abc", "~1:x", "~1:u u", "~1:b3:00",
        ] {
            assert!(decode::<serde_json::Value>(Some(text)).is_err(), "{text}");
        }
        let deep = format!("{LOSSLESS}{}n", "s".repeat(MAX_DEPTH + 1));
        assert!(decode::<serde_json::Value>(Some(&deep)).is_err());
    }
}

/// The cost of the stored form against plain serde_json, on a typical
/// result: `cargo test --release -p idempotent-runtime --all-features --lib
/// replay::cost -- --ignored --nocapture` prints nanoseconds per call (a
/// measurement, not a check).
#[cfg(test)]
mod cost {
    use std::hint::black_box;
    use std::time::Instant;

    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    struct Receipt {
        order_id: String,
        amount: f64,
        lines: Vec<u32>,
        note: Option<String>,
    }

    fn per_call(rounds: u32, mut f: impl FnMut()) -> f64 {
        let start = Instant::now();
        for _ in 0..rounds {
            f();
        }
        start.elapsed().as_nanos() as f64 / f64::from(rounds)
    }

    #[test]
    #[ignore = "a measurement: run it alone, in release"]
    fn encode_and_decode_against_serde_json() {
        let receipt = Receipt {
            order_id: "order-000123".into(),
            amount: 14.0 * 0.1,
            lines: vec![1, 2, 3],
            note: None,
        };
        let text = serde_json::to_string(&receipt).unwrap();
        for round in 0..3 {
            let json_encode = per_call(200_000, || {
                black_box(serde_json::to_string(black_box(&receipt)).unwrap());
            });
            let encode = per_call(200_000, || {
                black_box(super::encode(black_box(&receipt)).unwrap());
            });
            let json_decode = per_call(200_000, || {
                black_box(serde_json::from_str::<Receipt>(black_box(&text)).unwrap());
            });
            let decode = per_call(200_000, || {
                black_box(super::decode::<Receipt>(black_box(Some(text.as_str()))).unwrap());
            });
            println!(
                "round {round}: encode {encode:.0} ns (serde_json {json_encode:.0} ns, {:.2}x); \
                 decode {decode:.0} ns (serde_json {json_decode:.0} ns, {:.2}x)",
                encode / json_encode,
                decode / json_decode
            );
        }
    }
}
