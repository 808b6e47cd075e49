//! Reading the `Idempotency-Key` request header as the IETF draft
//! (draft-ietf-httpapi-idempotency-key-header) defines it: an Item
//! Structured Header whose value is a String (RFC 8941 `sf-string`,
//! `"..."`), plus the bare form many clients send (Stripe's libraries among
//! them), a run of visible ASCII with no quote, backslash, comma, semicolon
//! or space.

use ::axum::http::HeaderMap;

/// The request header the layer reads.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Why a request's `Idempotency-Key` header cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyHeaderError(pub(crate) String);

/// The key of `headers`: `None` when the header is absent.
pub(crate) fn read(headers: &HeaderMap) -> Result<Option<String>, KeyHeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError(
            "the request has more than one Idempotency-Key header; send exactly one".into(),
        ));
    }
    parse(value.as_bytes()).map(Some)
}

/// Parses one header value (see the module documentation).
pub(crate) fn parse(raw: &[u8]) -> Result<String, KeyHeaderError> {
    let value = trim_ows(raw);
    match value.first() {
        None => Err(KeyHeaderError("the Idempotency-Key header is empty".into())),
        Some(b'"') => sf_string(&value[1..]),
        Some(_) => bare(value),
    }
}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// The rest of an `sf-string` after its opening quote: printable ASCII,
/// `\"` and `\\` escapes, a closing quote and nothing after it.
fn sf_string(rest: &[u8]) -> Result<String, KeyHeaderError> {
    let mut key = String::with_capacity(rest.len());
    let mut bytes = rest.iter().copied();
    while let Some(byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                _ => {
                    return Err(KeyHeaderError(
                        "the Idempotency-Key string has a backslash not followed by `\"` or `\\`".into(),
                    ));
                }
            },
            b'"' => {
                return if bytes.next().is_none() {
                    Ok(key)
                } else {
                    Err(KeyHeaderError(
                        "the Idempotency-Key header has something after its closing quote (parameters are not \
                         supported)"
                            .into(),
                    ))
                };
            }
            0x20..=0x7e => key.push(char::from(byte)),
            _ => {
                return Err(KeyHeaderError(
                    "the Idempotency-Key string has a character outside printable ASCII".into(),
                ));
            }
        }
    }
    Err(KeyHeaderError("the Idempotency-Key string has no closing quote".into()))
}

/// A bare key: visible ASCII without `"`, `\`, `,` or `;` (which would make
/// it ambiguous with a structured value).
fn bare(value: &[u8]) -> Result<String, KeyHeaderError> {
    if let Some(bad) = value
        .iter()
        .find(|&&b| !(0x21..=0x7e).contains(&b) || matches!(b, b'"' | b'\\' | b',' | b';'))
    {
        return Err(KeyHeaderError(format!(
            "the bare Idempotency-Key has the byte 0x{bad:02x}: send the key as a quoted string (\"...\") of \
             printable ASCII, or bare without quotes, backslashes, commas, semicolons, spaces or control characters"
        )));
    }
    // Only ASCII bytes were accepted.
    Ok(value.iter().map(|&b| char::from(b)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_structured_string_is_unquoted_and_unescaped() {
        assert_eq!(parse(br#""8e03978e-40d5-43e8""#).unwrap(), "8e03978e-40d5-43e8");
        assert_eq!(parse(br#""a \"b\" \\c""#).unwrap(), r#"a "b" \c"#);
        assert_eq!(parse(b"  \"x y\"\t").unwrap(), "x y");
    }

    #[test]
    fn a_bare_token_is_accepted() {
        assert_eq!(
            parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse(b"key:with/odd=chars").unwrap(), "key:with/odd=chars");
    }

    #[test]
    fn malformed_values_are_refused() {
        for bad in [
            &b""[..],
            b"   ",
            b"\"unterminated",
            b"\"x\";p=1",
            b"\"x\" trailing",
            b"\"bad \\n escape\"",
            b"\"tab\tinside\"",
            b"\"\xc3\xa7\"",
            b"two words",
            b"a,b",
            b"a;b",
            b"\xc3\xa7",
        ] {
            assert!(parse(bad).is_err(), "{:?} was accepted", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn an_empty_structured_string_is_read_as_empty() {
        // Refused later by the key rules, with their message.
        assert_eq!(parse(b"\"\"").unwrap(), "");
    }
}
