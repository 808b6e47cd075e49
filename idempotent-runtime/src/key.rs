//! Idempotency keys: which types can identify a message, and the rules every
//! store applies to them (never empty, never truncated, no NUL).

use std::borrow::Cow;

use crate::Error;

/// 32 hex digits (128 bits of SHA-256) naming `parts`, each prefixed by
/// its length so that no two lists of parts run together: the derived ids
/// of the outbox's messages and of the brokers' dead letters and
/// deliveries.
#[cfg_attr(not(any(feature = "sqlx", feature = "rabbitmq", feature = "nats")), allow(dead_code))]
pub(crate) fn digest_hex(parts: &[&[u8]]) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    let digest = hash.finalize();
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The longest key, in bytes of UTF-8, that every store accepts.
///
/// Longer keys are refused with [`Error::InvalidKey`], never truncated
/// (truncation would make two different messages collide).
pub const MAX_KEY_BYTES: usize = 255;

/// A value that identifies a message: the result of the `key = ..`
/// expression of `#[idempotent]`.
///
/// Implemented for strings, integers, `uuid::Uuid` (feature `uuid`),
/// references to those and `Option` of those (`None` is
/// [`Error::MissingKey`]). Implement it for your own id types by returning
/// their canonical text.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency key",
    label = "this key expression has type `{Self}`",
    note = "keys are strings, integers, `uuid::Uuid` (feature `uuid`) or `Option` of those; implement `idempotent_runtime::IdempotencyKey` for your own id type"
)]
pub trait IdempotencyKey {
    /// The key as text, or `None` when the message has no key.
    fn key_text(&self) -> Option<Cow<'_, str>>;
}

impl IdempotencyKey for str {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl IdempotencyKey for String {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl IdempotencyKey for Cow<'_, str> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl<K: IdempotencyKey + ?Sized> IdempotencyKey for &K {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        (**self).key_text()
    }
}

impl<K: IdempotencyKey + ?Sized> IdempotencyKey for Box<K> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        (**self).key_text()
    }
}

impl<K: IdempotencyKey + ?Sized> IdempotencyKey for std::sync::Arc<K> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        (**self).key_text()
    }
}

impl<K: IdempotencyKey> IdempotencyKey for Option<K> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        self.as_ref().and_then(IdempotencyKey::key_text)
    }
}

macro_rules! integer_keys {
    ($($t:ty),*) => {$(
        impl IdempotencyKey for $t {
            fn key_text(&self) -> Option<Cow<'_, str>> {
                Some(Cow::Owned(self.to_string()))
            }
        }
    )*};
}
integer_keys!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);

#[cfg(feature = "uuid")]
impl IdempotencyKey for uuid::Uuid {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        let mut buf = uuid::Uuid::encode_buffer();
        Some(Cow::Owned(self.hyphenated().encode_lower(&mut buf).to_owned()))
    }
}

/// The text of a key, or `MissingKey` when it is `None`.
pub(crate) fn require<'k>(scope: &str, key: Option<Cow<'k, str>>) -> Result<Cow<'k, str>, Error> {
    key.ok_or_else(|| Error::MissingKey {
        scope: scope.to_owned(),
    })
}

/// Checks a key against the rules every store shares.
pub(crate) fn validate(scope: &str, key: &str) -> Result<(), Error> {
    let invalid = |reason: String| Error::InvalidKey {
        scope: scope.to_owned(),
        reason,
    };
    if key.is_empty() {
        return Err(invalid("the key is empty".into()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(invalid(format!(
            "the key is {} bytes long; the limit is {MAX_KEY_BYTES} bytes (keys are never truncated)",
            key.len()
        )));
    }
    if key.contains('\0') {
        return Err(invalid("the key contains a NUL character".into()));
    }
    Ok(())
}

/// The longest scope, in bytes, that every store accepts.
pub const MAX_SCOPE_BYTES: usize = 128;

/// Checks a scope (the namespace of a handler's markers).
pub(crate) fn validate_scope(scope: &str) -> Result<(), Error> {
    if scope.is_empty() || scope.len() > MAX_SCOPE_BYTES || scope.contains('\0') {
        return Err(Error::Config(format!(
            "scope {scope:?} must be 1 to {MAX_SCOPE_BYTES} bytes without NUL"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(k: &dyn IdempotencyKey) -> Result<String, Error> {
        let key = require("s", k.key_text())?;
        validate("s", &key)?;
        Ok(key.into_owned())
    }

    #[test]
    fn strings_integers_and_options_are_keys() {
        assert_eq!(check(&"abc").unwrap(), "abc");
        assert_eq!(check(&String::from("x-1")).unwrap(), "x-1");
        assert_eq!(check(&42u64).unwrap(), "42");
        assert_eq!(check(&-7i32).unwrap(), "-7");
        assert_eq!(check(&Some("id")).unwrap(), "id");
    }

    #[test]
    fn none_is_a_missing_key() {
        assert!(matches!(check(&None::<String>), Err(Error::MissingKey { .. })));
    }

    #[test]
    fn empty_long_and_nul_keys_are_refused_not_truncated() {
        assert!(matches!(check(&""), Err(Error::InvalidKey { .. })));
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        let err = check(&long.as_str()).unwrap_err().to_string();
        assert!(err.contains("256 bytes"), "{err}");
        assert_eq!(check(&"k".repeat(MAX_KEY_BYTES).as_str()).unwrap().len(), MAX_KEY_BYTES);
        assert!(matches!(check(&"a\0b"), Err(Error::InvalidKey { .. })));
    }

    #[test]
    fn unicode_keys_are_kept_as_they_are() {
        assert_eq!(check(&"pagamento-ção-💳").unwrap(), "pagamento-ção-💳");
    }
}
