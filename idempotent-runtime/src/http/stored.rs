//! The response kept with a completed key: its status, the headers worth
//! replaying and its body, as the JSON text the stores keep as a marker's
//! result (the body and any header value that is not printable ASCII in
//! base64, so both are replayed byte for byte).

use ::axum::body::{Body, Bytes};
use ::axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

use crate::Error;

/// The response header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Headers that are not kept for a replay: the hop-by-hop headers (they
/// describe one connection), `content-length` (the body's own length is
/// sent), `date` (a replay is sent now) and `set-cookie` (a credential
/// minted for the first answer is not handed out again).
const NOT_KEPT: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "content-length",
    "date",
    "set-cookie",
];

/// Whether a response header is kept for replays.
pub(crate) fn kept(name: &HeaderName) -> bool {
    !NOT_KEPT.contains(&name.as_str())
}

#[derive(Debug, Serialize, Deserialize)]
struct StoredHeader {
    n: String,
    v: String,
    /// `v` is base64 (the value was not printable ASCII).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    b64: bool,
}

/// A kept response (see the module documentation).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct StoredResponse {
    /// The format's version.
    v: u8,
    status: u16,
    headers: Vec<StoredHeader>,
    /// The body, base64.
    body: String,
}

impl StoredResponse {
    /// The response `status`, `headers` (those [`kept`]) and `body`.
    pub(crate) fn new(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| kept(name))
            .map(|(name, value)| match value.to_str() {
                Ok(text) => StoredHeader {
                    n: name.as_str().to_owned(),
                    v: text.to_owned(),
                    b64: false,
                },
                Err(_) => StoredHeader {
                    n: name.as_str().to_owned(),
                    v: STANDARD.encode(value.as_bytes()),
                    b64: true,
                },
            })
            .collect();
        StoredResponse {
            v: 1,
            status: status.as_u16(),
            headers,
            body: STANDARD.encode(body),
        }
    }

    /// The JSON text the store keeps.
    pub(crate) fn to_json(&self) -> Result<String, Error> {
        serde_json::to_string(self).map_err(Error::Codec)
    }

    /// Reads a kept response back.
    pub(crate) fn from_json(json: &str) -> Result<Self, Error> {
        serde_json::from_str(json).map_err(Error::Codec)
    }

    /// The replayed response: the kept status, headers and body, and
    /// `Idempotent-Replayed: true`.
    pub(crate) fn replay(&self) -> Result<Response<Body>, Error> {
        let corrupt = |what: String| Error::Config(format!("the kept response cannot be replayed: {what}"));
        let body = STANDARD
            .decode(&self.body)
            .map_err(|e| corrupt(format!("its body is not base64 ({e})")))?;
        let status = StatusCode::from_u16(self.status).map_err(|e| corrupt(e.to_string()))?;
        let mut response = Response::new(Body::from(Bytes::from(body)));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        for header in &self.headers {
            let name = HeaderName::from_bytes(header.n.as_bytes()).map_err(|e| corrupt(e.to_string()))?;
            let value = if header.b64 {
                let bytes = STANDARD
                    .decode(&header.v)
                    .map_err(|e| corrupt(format!("header {} is not base64 ({e})", header.n)))?;
                HeaderValue::from_bytes(&bytes)
            } else {
                HeaderValue::from_str(&header.v)
            }
            .map_err(|e| corrupt(e.to_string()))?;
            headers.append(name, value);
        }
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_kept_response_replays_byte_for_byte() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("one"));
        headers.append("x-multi", HeaderValue::from_static("two"));
        headers.insert("x-binary", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
        headers.insert("connection", HeaderValue::from_static("close"));
        let body: Vec<u8> = (0..=255u8).collect();
        let kept = StoredResponse::new(StatusCode::CREATED, &headers, &body);
        let json = kept.to_json().unwrap();
        let replay = StoredResponse::from_json(&json).unwrap().replay().unwrap();
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["content-type"], "application/json");
        let multi: Vec<_> = replay.headers().get_all("x-multi").iter().collect();
        assert_eq!(multi, ["one", "two"]);
        assert_eq!(replay.headers()["x-binary"].as_bytes(), b"caf\xe9");
        assert!(replay.headers().get("set-cookie").is_none());
        assert!(replay.headers().get("connection").is_none());
        assert_eq!(replay.headers()[REPLAYED_HEADER], "true");
        let replayed = ::axum::body::to_bytes(replay.into_body(), usize::MAX).await.unwrap();
        assert_eq!(&replayed[..], &body[..]);
    }

    #[test]
    fn a_corrupt_kept_response_is_an_error_not_a_panic() {
        assert!(StoredResponse::from_json("{").is_err());
        let bad = r#"{"v":1,"status":42,"headers":[],"body":""}"#;
        assert!(StoredResponse::from_json(bad).unwrap().replay().is_err());
        let bad = r#"{"v":1,"status":200,"headers":[],"body":"%%%"}"#;
        assert!(StoredResponse::from_json(bad).unwrap().replay().is_err());
    }
}
