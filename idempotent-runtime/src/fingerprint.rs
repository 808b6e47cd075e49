//! Message fingerprints: a hash of the message stored with its marker, so a
//! key reused for a different message is an error instead of a silent skip.

use sha2::{Digest, Sha256};

use crate::Error;

/// The SHA-256 of a value's JSON encoding, as 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// Hashes `value` (any `serde::Serialize` value: the whole message, or
    /// the fields that must not change between deliveries).
    pub fn of<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, Error> {
        let json = serde_json::to_vec(value).map_err(Error::Codec)?;
        Ok(Self::from_bytes(&json))
    }

    /// Hashes raw bytes.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let digest = Sha256::digest(bytes);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_hash_equal_and_different_values_differ() {
        let a = Fingerprint::of(&("order-1", 100)).unwrap();
        assert_eq!(a, Fingerprint::of(&("order-1", 100)).unwrap());
        assert_ne!(a, Fingerprint::of(&("order-1", 101)).unwrap());
        assert_eq!(a.as_str().len(), 64);
        assert_eq!(
            Fingerprint::from_bytes(b"").as_str(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
