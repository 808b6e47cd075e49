//! The layer's error answers: `application/problem+json` (RFC 9457), each
//! with a `type` a client can branch on.

use std::time::Duration;

use ::axum::body::Body;
use ::axum::http::{HeaderValue, Response, StatusCode, header};

/// What went wrong, as the layer answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// 400: a route that requires a key got none.
    MissingKey,
    /// 400: the header cannot be read, or the key breaks the key rules.
    InvalidKey,
    /// 400: the caller (tenant, principal) could not be told.
    MissingCaller,
    /// 413: the body is over the fingerprinting cap.
    BodyTooLarge,
    /// 400: the body could not be read.
    BadBody,
    /// 409: the key's first request is still running.
    InProgress,
    /// 422: the key was used for a different request.
    KeyReused,
    /// 500: the handler's answer cannot be kept for replays.
    NotReplayable,
    /// 500: the handler left the transaction borrowed.
    TransactionBorrowed,
    /// 500: the outbox refused an outgoing message the handler published.
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    OutgoingRefused,
    /// 503: the store failed; nothing was committed on transactional stores.
    StoreFailed,
}

impl Kind {
    fn parts(self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Kind::MissingKey => (StatusCode::BAD_REQUEST, "missing-key", "Idempotency-Key is missing"),
            Kind::InvalidKey => (StatusCode::BAD_REQUEST, "invalid-key", "Idempotency-Key is invalid"),
            Kind::MissingCaller => (StatusCode::BAD_REQUEST, "missing-caller", "The caller is unknown"),
            Kind::BodyTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The request body is too large",
            ),
            Kind::BadBody => (
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "The request body could not be read",
            ),
            Kind::InProgress => (
                StatusCode::CONFLICT,
                "in-progress",
                "A request with this key is in progress",
            ),
            Kind::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                "Idempotency-Key is already used for a different request",
            ),
            Kind::NotReplayable => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "not-replayable",
                "The response cannot be kept for replays",
            ),
            Kind::TransactionBorrowed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "transaction-borrowed",
                "The handler kept its transaction past its answer",
            ),
            Kind::OutgoingRefused => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "outgoing-refused",
                "An outgoing message was refused",
            ),
            Kind::StoreFailed => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-failed",
                "The idempotency store failed",
            ),
        }
    }

    /// The answer: a problem document with `detail`; `retry_after` adds
    /// `Retry-After` (whole seconds, at least 1).
    pub(crate) fn response(self, detail: &str, retry_after: Option<Duration>) -> Response<Body> {
        let (status, slug, title) = self.parts();
        let document = serde_json::json!({
            "type": format!("urn:idempotent:{slug}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(Body::from(document.to_string()));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = retry_after {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response
    }
}
