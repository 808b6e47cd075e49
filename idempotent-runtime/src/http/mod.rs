//! HTTP endpoints with the `Idempotency-Key` request header (feature
//! `axum`): [`IdempotencyLayer`], a tower layer for axum routes that runs
//! each (caller, route, key) once on any store of this crate and replays
//! the kept response to retries, and [`IdempotentTx`], the extractor that
//! lets a handler write in the transaction that keeps the response.
//!
//! ```no_run
//! use idempotent_runtime::SqliteStore;
//! use idempotent_runtime::axum::{Router, routing::post};
//! use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx};
//! use idempotent_runtime::sqlx;
//!
//! async fn charge(mut tx: IdempotentTx<SqliteStore>, body: String) -> Result<String, String> {
//!     sqlx::query("INSERT INTO charges (request) VALUES (?1)")
//!         .bind(&body)
//!         .execute(&mut **tx)
//!         .await
//!         .map_err(|e| e.to_string())?;
//!     Ok(format!("charged {body}"))
//! }
//!
//! # async fn run(store: SqliteStore) {
//! let layer = IdempotencyLayer::builder(store)
//!     .caller(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
//!     .build();
//! let app: Router = Router::new().route("/charges", post(charge)).route_layer(layer);
//! # }
//! ```
//!
//! # What a request goes through
//!
//! Requests with a safe method (`GET`, `HEAD`, `OPTIONS`, `TRACE`) pass
//! through untouched. For the others:
//!
//! 1. The key is read from `Idempotency-Key` as the IETF draft defines it, a
//!    structured-field string (`Idempotency-Key: "8e03978e-40d5"`); a bare
//!    value of visible ASCII without quotes, backslashes, commas, semicolons
//!    or spaces (`Idempotency-Key: 8e03978e-40d5`, as Stripe's clients send
//!    it) is accepted too. It is then checked by the rules of message keys:
//!    1 to [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES) bytes, never truncated.
//!    No key on a route that requires one (the default) is `400`; on a
//!    route where it is optional ([`IdempotencyLayerBuilder::optional`]) the
//!    request runs as if the layer were not there.
//! 2. The key is scoped by the caller ([`IdempotencyLayerBuilder::caller`]:
//!    a tenant or principal read from the request, so one customer's key
//!    never answers another's), the method and the route (axum's
//!    `MatchedPath`, the route's whole pattern under nested routers; for a
//!    request no route matched, a fallback's behind `Router::layer`, its
//!    path).
//! 3. The request is fingerprinted: its method, the path and query the
//!    client sent (axum's `OriginalUri`, not the part of it a nested router
//!    sees; the request's URI outside a router), and body. So a key is
//!    replayed only to a request for the same resource: the same key for
//!    `/accounts/bob/withdraw` after `/accounts/alice/withdraw`, one route's
//!    two resources, is `422`.
//!    The body is read up to a cap ([`IdempotencyLayerBuilder::body_limit`],
//!    1 MiB by default); a larger body is `413`, never fingerprinted in part.
//! 4. The key is claimed on the store. A key already completed with the same
//!    fingerprint replays the kept response with `Idempotent-Replayed: true`;
//!    with another fingerprint it is `422`. A key whose first request is
//!    still running is `409` with `Retry-After`, or, with
//!    [`InProgress::Wait`], waits for it and replays its answer.
//! 5. A fresh key runs the handler. Its answer is kept (status, the headers
//!    worth replaying, the body) and committed with the marker; then it is
//!    sent. A `5xx` answer, or one the handler marks [`NotKept`], is sent
//!    but not kept: the claim is released (and on a transactional store the
//!    handler's transaction rolls back), so a retry runs again. An answer
//!    that cannot be replayed (`101 Switching Protocols`, a
//!    `text/event-stream`, a body of unknown length or over
//!    [`IdempotencyLayerBuilder::response_limit`]) is not sent truncated:
//!    the claim is released and the request is answered `500`.
//!
//! Every answer of the layer itself is `application/problem+json` (RFC
//! 9457) with a `type` of the form `urn:idempotent:<what>`: `missing-key`,
//! `invalid-key`, `missing-caller` (400), `body-too-large` (413),
//! `in-progress` (409), `key-reused` (422), `not-replayable`,
//! `transaction-borrowed`, `outgoing-refused` (500), `store-failed` (503).
//!
//! # What is atomic
//!
//! On the transactional stores (`PgStore`, `SqliteStore`, `MySqlStore`) the
//! claim is a database transaction: what the handler writes through
//! [`IdempotentTx`] commits in the same transaction as the marker and the
//! kept response, or not at all. So do the outgoing messages it publishes on
//! it ([`IdempotentTx::publish`], the [transactional outbox](crate::outbox)):
//! a replay publishes nothing. A server that dies mid-request leaves
//! nothing, and the client's retry runs the handler again.
//!
//! On Redis and in memory the claim is a lease with a fencing token: the
//! handler's effects happen outside the store, so a server that dies after
//! the effect and before the response is kept (or a lease that expires
//! while the handler runs) lets a retry run the effect again. Make such
//! effects idempotent by design there.
//!
//! # Concurrent requests with one key
//!
//! In one process, a second request for a key in flight is answered `409`
//! at once (or waits, [`InProgress::Wait`]) without touching the store.
//! Across processes the store decides: a transactional store's claim waits
//! on the first request's marker until it commits, then replays; a lease
//! store answers `409`.
//!
//! # Expiry
//!
//! Keys are markers like messages' ones: they live
//! [`IdempotencyLayerBuilder::ttl`] (seven days by default) and are purged by
//! the same janitor.
//!
//! # Tracing and metrics
//!
//! A request with a key runs in an `idempotent_http` span (target
//! `idempotent`, debug level) with `idempotency.scope`, `idempotency.key`,
//! `idempotency.outcome`, `error.type`, `http.request.method` and
//! `http.route`. Its outcome is logged and counted by the code that logs and
//! counts `#[idempotent]` calls: with the `metrics` feature,
//! `idempotent_outcomes_total{scope, outcome}` with the scope label
//! `http:<METHOD>:<route>` (the caller left out; [`UNMATCHED_ROUTE`] for
//! a request no route matched, never its path; `_OTHER` for a method that
//! is not one of HTTP's standard ones), `processed` once the
//! answer committed, `duplicate` for a replay, `failed` for an answer that
//! was not kept (`5xx`, [`NotKept`]), `key_reused`, `in_progress`, and
//! `error` for a request refused before its claim, a store that failed or
//! an answer that cannot be kept.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ::axum::body::{Body, Bytes};
use ::axum::extract::{MatchedPath, OriginalUri};
use ::axum::http::request::Parts;
use ::axum::http::{Method, Request, Response, StatusCode, Uri, header};
use ::axum::response::IntoResponseParts;
use http_body::Body as _;
use http_body_util::BodyExt as _;
use tower::{Layer, Service};
use tracing::Instrument as _;

use crate::Error;
use crate::call::Report;
use crate::fingerprint::Fingerprint;
use crate::signal::Outcome;
use crate::store::{Claim, Guard, Store};

mod inflight;
mod key;
mod problem;
mod stored;
mod tx;

pub use key::IDEMPOTENCY_KEY;
pub use stored::REPLAYED_HEADER;
#[cfg(feature = "sqlx")]
pub use tx::IdempotentTx;

use inflight::Inflight;
use problem::Kind;
use stored::StoredResponse;
use tx::GuardCell;

/// The route a request no axum route matched is counted under, in the
/// `scope` label of `idempotent_outcomes_total` (`http:POST:<unmatched>`)
/// and the span's `http.route`: a request that reaches the layer through a
/// fallback (the layer added with `Router::layer`) or outside a router.
/// Its path, which the client chooses, is never a label; its keys are
/// still scoped by that path.
pub const UNMATCHED_ROUTE: &str = "<unmatched>";

/// The request body cap of [`IdempotencyLayerBuilder::body_limit`] by
/// default: 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// The kept response body cap of [`IdempotencyLayerBuilder::response_limit`]
/// by default: 1 MiB.
pub const DEFAULT_RESPONSE_LIMIT: usize = 1 << 20;

/// What a request gets while another request with its key is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProgress {
    /// `409 Conflict` with `Retry-After` (whole seconds, at least 1): the
    /// default, with one second.
    Conflict {
        /// The `Retry-After` sent.
        retry_after: Duration,
    },
    /// Waits up to `timeout` for the first request to end, then answers
    /// with its kept response (or runs, if the first was not kept); `409`
    /// if it is still running by then.
    Wait {
        /// How long a request waits.
        timeout: Duration,
    },
}

impl Default for InProgress {
    fn default() -> Self {
        InProgress::Conflict {
            retry_after: Duration::from_secs(1),
        }
    }
}

/// A marker a handler adds to its answer so that it is sent but not kept:
/// the claim is released (on a transactional store the handler's
/// transaction rolls back) and a retry with the same key runs again. Add it
/// as a response part: `(StatusCode::TOO_MANY_REQUESTS, NotKept, "slow down")`.
#[derive(Debug, Clone, Copy, Default)]
pub struct NotKept;

impl IntoResponseParts for NotKept {
    type Error = std::convert::Infallible;

    fn into_response_parts(
        self,
        mut res: ::axum::response::ResponseParts,
    ) -> Result<::axum::response::ResponseParts, Self::Error> {
        res.extensions_mut().insert(NotKept);
        Ok(res)
    }
}

type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

#[derive(Clone)]
struct Config {
    required: bool,
    caller: Option<Arc<CallerFn>>,
    scope: Option<String>,
    body_limit: usize,
    response_limit: usize,
    in_progress: InProgress,
    ttl: Duration,
    lease: Duration,
}

/// Builds an [`IdempotencyLayer`]; from [`IdempotencyLayer::builder`].
pub struct IdempotencyLayerBuilder<S> {
    store: S,
    config: Config,
}

impl<S> std::fmt::Debug for IdempotencyLayerBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder").finish_non_exhaustive()
    }
}

impl<S: Store + 'static> IdempotencyLayerBuilder<S> {
    /// Requests without `Idempotency-Key` run as if the layer were not there
    /// (by default they are refused with `400`).
    pub fn optional(mut self) -> Self {
        self.config.required = false;
        self
    }

    /// Whether requests must carry `Idempotency-Key` (the default: `true`).
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// Who is calling (a tenant, a principal), read from the request's
    /// parts: keys of different callers never meet. `None` refuses the
    /// request with `400` (`missing-caller`). Without it every caller
    /// shares the keys of a route.
    ///
    /// For a principal an authentication layer found, read the extension it
    /// put in `parts.extensions` (add this layer inside that one).
    pub fn caller<F>(mut self, caller: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.config.caller = Some(Arc::new(caller));
        self
    }

    /// Names the keys' namespace instead of the route: the keys then
    /// survive renaming the route, and two routes given one name share them.
    pub fn scope(mut self, name: impl Into<String>) -> Self {
        self.config.scope = Some(name.into());
        self
    }

    /// The largest request body, in bytes, that is fingerprinted; a larger
    /// one is refused with `413` (default [`DEFAULT_BODY_LIMIT`]).
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// The largest response body, in bytes, that is kept for replays; a
    /// larger answer is not sent (`500`, `not-replayable`) and its claim is
    /// released (default [`DEFAULT_RESPONSE_LIMIT`]).
    pub fn response_limit(mut self, bytes: usize) -> Self {
        self.config.response_limit = bytes;
        self
    }

    /// What a request gets while its key's first request runs (default
    /// `409` with `Retry-After: 1`).
    pub fn in_progress(mut self, policy: InProgress) -> Self {
        self.config.in_progress = policy;
        self
    }

    /// How long a completed key replays its answer (default
    /// [`DEFAULT_TTL`](crate::DEFAULT_TTL), seven days).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// How long a lease store's claim lives without renewal (default
    /// [`DEFAULT_LEASE`](crate::DEFAULT_LEASE)).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// The layer.
    pub fn build(self) -> IdempotencyLayer<S> {
        IdempotencyLayer {
            shared: Arc::new(Shared {
                store: self.store,
                config: self.config,
                inflight: Arc::default(),
            }),
        }
    }
}

struct Shared<S> {
    store: S,
    config: Config,
    inflight: Arc<Inflight>,
}

/// A tower layer that makes non-safe requests idempotent by their
/// `Idempotency-Key` header, on store `S` (see the [module
/// documentation](self)). Add it to axum routes with `route_layer` (or on a
/// method router with `layer`), so that it sees the matched route.
pub struct IdempotencyLayer<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> std::fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer").finish_non_exhaustive()
    }
}

impl<S> IdempotencyLayer<S> {
    /// How many keys this layer's in-process registry tracks (held or
    /// waited for): zero once no request holds or waits on a key. For
    /// tests; not part of the stable API.
    #[doc(hidden)]
    pub fn in_flight_keys(&self) -> usize {
        self.shared.inflight.len()
    }
}

impl<S: Store + 'static> IdempotencyLayer<S> {
    /// A layer on `store` with the defaults: the key required, no caller,
    /// 1 MiB caps, `409` for a key in progress.
    pub fn new(store: S) -> Self {
        Self::builder(store).build()
    }

    /// A builder for the rest.
    pub fn builder(store: S) -> IdempotencyLayerBuilder<S> {
        IdempotencyLayerBuilder {
            store,
            config: Config {
                required: true,
                caller: None,
                scope: None,
                body_limit: DEFAULT_BODY_LIMIT,
                response_limit: DEFAULT_RESPONSE_LIMIT,
                in_progress: InProgress::default(),
                ttl: crate::DEFAULT_TTL,
                lease: crate::DEFAULT_LEASE,
            },
        }
    }
}

impl<S, I> Layer<I> for IdempotencyLayer<S> {
    type Service = IdempotencyService<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        IdempotencyService {
            shared: Arc::clone(&self.shared),
            inner,
        }
    }
}

/// The service of [`IdempotencyLayer`] around the service `I`.
pub struct IdempotencyService<S, I> {
    shared: Arc<Shared<S>>,
    inner: I,
}

impl<S, I: Clone> Clone for IdempotencyService<S, I> {
    fn clone(&self) -> Self {
        IdempotencyService {
            shared: Arc::clone(&self.shared),
            inner: self.inner.clone(),
        }
    }
}

impl<S, I> std::fmt::Debug for IdempotencyService<S, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService").finish_non_exhaustive()
    }
}

impl<S, I> Service<Request<Body>> for IdempotencyService<S, I>
where
    S: Store + 'static,
    S::Guard: 'static,
    I: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    I::Future: Send,
    I::Error: Send,
{
    type Response = Response<Body>;
    type Error = I::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, I::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was driven to readiness serves this request.
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        Box::pin(serve(Arc::clone(&self.shared), ready, request))
    }
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE)
}

/// The keys' scope: `http:<caller length>:<caller>:<METHOD>:<route>`, or
/// `http#<sha-256>` of that when it is longer than a scope may be.
fn scope_of(caller: &str, method: &Method, route: &str) -> String {
    let scope = format!("http:{}:{caller}:{method}:{route}", caller.len());
    if scope.len() <= crate::MAX_SCOPE_BYTES && !scope.contains('\0') {
        scope
    } else {
        format!("http#{}", Fingerprint::from_bytes(scope.as_bytes()).as_str())
    }
}

/// The `scope` label of the request's counted outcome
/// (`idempotent_outcomes_total`): `http:<METHOD>:<route>`, without the
/// caller, so that a route has one series per outcome whatever the number
/// of tenants. `route` is never a path the client chose, and a method
/// outside the standard ones (a client can send any token) is `_OTHER`, as
/// OpenTelemetry's conventions name it.
fn label_of(method: &Method, route: &str) -> String {
    let standard = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ];
    let method = if standard.contains(method) {
        method.as_str()
    } else {
        "_OTHER"
    };
    format!("http:{method}:{route}")
}

/// The request's fingerprint: method, the path and query the client sent
/// (`target`, the original URI), body.
fn fingerprint_of(method: &Method, target: &Uri, body: &[u8]) -> Fingerprint {
    let target = target.path_and_query().map_or("/", |pq| pq.as_str());
    Fingerprint::from_chunks([method.as_str().as_bytes(), b"\0", target.as_bytes(), b"\0", body])
}

/// What a request's keys are scoped by and its outcomes counted under.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    /// The name given to [`IdempotencyLayerBuilder::scope`], or the route
    /// axum matched (its pattern, `/accounts/{account}/withdraw`).
    Named(String),
    /// No route matched (the layer runs in a fallback, or outside the
    /// router): the keys are scoped by the path the client sent, which is
    /// never a label ([`UNMATCHED_ROUTE`] is).
    Unmatched {
        /// The original URI's path.
        path: String,
    },
}

impl Route {
    fn of(name: Option<&str>, matched: Option<&MatchedPath>, target: &Uri) -> Route {
        match (name, matched) {
            (Some(name), _) => Route::Named(name.to_owned()),
            (None, Some(matched)) => Route::Named(matched.as_str().to_owned()),
            (None, None) => Route::Unmatched {
                path: target.path().to_owned(),
            },
        }
    }

    /// The route in the keys' scope.
    fn scope(&self) -> &str {
        match self {
            Route::Named(name) => name,
            Route::Unmatched { path } => path,
        }
    }

    /// The route in the metric label and the span's `http.route`: never a
    /// path the client chose.
    fn label(&self) -> &str {
        match self {
            Route::Named(name) => name,
            Route::Unmatched { .. } => UNMATCHED_ROUTE,
        }
    }
}

/// Why a response cannot be kept for replays, if it cannot.
fn not_replayable(response: &Response<Body>, limit: usize) -> Option<String> {
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        return Some("it switches protocols (an upgrade cannot be replayed)".into());
    }
    let event_stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("text/event-stream"));
    if event_stream {
        return Some("it is an event stream".into());
    }
    match response.body().size_hint().upper() {
        None => Some("its body is a stream of unknown length".into()),
        Some(len) if len > limit as u64 => Some(format!(
            "its body is {len} bytes, over the {limit}-byte limit of kept responses"
        )),
        Some(_) => None,
    }
}

async fn serve<S, I>(shared: Arc<Shared<S>>, mut inner: I, request: Request<Body>) -> Result<Response<Body>, I::Error>
where
    S: Store + 'static,
    S::Guard: 'static,
    I: Service<Request<Body>, Response = Response<Body>> + Send,
    I::Future: Send,
{
    if is_safe(request.method()) {
        return inner.call(request).await;
    }
    let config = &shared.config;
    let (mut parts, body) = request.into_parts();
    // The path the client sent, whatever routers nest this one (a nested
    // router sees its own part of it).
    let target = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0)
        .clone();
    let route = Route::of(config.scope.as_deref(), parts.extensions.get::<MatchedPath>(), &target);
    let label = label_of(&parts.method, route.label());
    // Refused before the claim: counted and logged like a message refused
    // before its claim, under the route's label.
    let refuse = |kind: Kind, key: &str, detail: &str| {
        Report::request(&label, key, label.clone()).refused(Outcome::Error, &detail);
        kind.response(detail, None)
    };
    let key = match key::read(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if config.required => {
            return Ok(refuse(
                Kind::MissingKey,
                "",
                "this endpoint requires an Idempotency-Key header (a unique string per operation, e.g. a UUID, \
                 sent again with every retry)",
            ));
        }
        Ok(None) => return inner.call(Request::from_parts(parts, body)).await,
        Err(error) => return Ok(refuse(Kind::InvalidKey, "", &error.0)),
    };
    let caller = match &config.caller {
        None => String::new(),
        Some(caller) => match caller(&parts) {
            Some(caller) => caller,
            None => {
                return Ok(refuse(
                    Kind::MissingCaller,
                    &key,
                    "the request does not say who is calling",
                ));
            }
        },
    };
    let scope = scope_of(&caller, &parts.method, route.scope());

    let too_large = format!("the body is over the {}-byte limit of this endpoint", config.body_limit);
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > config.body_limit as u64) {
        return Ok(refuse(Kind::BodyTooLarge, &key, &too_large));
    }
    let bytes = match http_body_util::Limited::new(body, config.body_limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            return Ok(refuse(Kind::BodyTooLarge, &key, &too_large));
        }
        Err(error) => return Ok(refuse(Kind::BadBody, &key, &error.to_string())),
    };
    let fingerprint = fingerprint_of(&parts.method, &target, &bytes);
    let claim_request = match crate::store::Request::new(&scope, &key) {
        Ok(request) => request
            .with_ttl(config.ttl)
            .with_lease(config.lease)
            .with_fingerprint(Some(fingerprint)),
        Err(Error::InvalidKey { reason, .. }) => return Ok(refuse(Kind::InvalidKey, &key, &reason)),
        Err(error) => return Ok(refuse(Kind::InvalidKey, &key, &error.to_string())),
    };

    let span = tracing::debug_span!(
        target: "idempotent",
        "idempotent_http",
        idempotency.scope = %scope,
        idempotency.key = %key,
        idempotency.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        http.request.method = %parts.method,
        http.route = %route.label(),
    );
    let report = Report::request(&scope, &key, label.clone());
    let (wait, retry_after) = match config.in_progress {
        InProgress::Conflict { retry_after } => (None, retry_after),
        InProgress::Wait { timeout } => (Some(timeout), Duration::from_secs(1)),
    };
    let in_progress = || {
        Kind::InProgress.response(
            "a request with this Idempotency-Key is still being processed; retry after the time in Retry-After",
            Some(retry_after),
        )
    };

    let started = Instant::now();
    let Some(_held) = shared.inflight.hold(format!("{scope}\0{key}"), wait).await else {
        // Held by a request of this process: the store is not asked.
        report.claimed::<S::Guard>(&Err(claim_request.in_progress()), &span);
        return Ok(in_progress());
    };
    let claim = loop {
        match shared.store.claim(&claim_request).instrument(span.clone()).await {
            Err(Error::InProgress { .. }) if wait.is_some_and(|wait| started.elapsed() < wait) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            claim => break claim,
        }
    };
    let guard = match claim {
        Ok(Claim::Fresh(guard)) => guard,
        Ok(Claim::Done(replay)) => {
            let replayed = match replay.json() {
                Some(json) => StoredResponse::from_json(json).and_then(|kept| kept.replay()),
                None => Err(Error::Config(
                    "the key is completed but no response was kept with it".into(),
                )),
            };
            return Ok(match replayed {
                Ok(response) => {
                    report.claimed::<S::Guard>(&Ok(Claim::Done(replay)), &span);
                    response
                }
                Err(error) => {
                    report.error(&span, &error, "kept response cannot be replayed");
                    Kind::NotReplayable.response(&error.to_string(), None)
                }
            });
        }
        Err(error) => {
            let answer = match &error {
                Error::KeyReused { .. } => Kind::KeyReused.response(
                    "this Idempotency-Key was already used for a request with a different method, path or body; use \
                     a new key for a new request",
                    None,
                ),
                Error::InProgress { .. } => in_progress(),
                Error::InvalidKey { reason, .. } => Kind::InvalidKey.response(reason, None),
                _ => Kind::StoreFailed.response("the idempotency store failed; nothing was run: retry later", None),
            };
            report.claimed::<S::Guard>(&Err(error), &span);
            return Ok(answer);
        }
    };

    // Fresh: the handler runs with the claim lent through the extensions.
    let cell = GuardCell::new(guard);
    parts.extensions.insert(cell.clone());
    let outcome = inner
        .call(Request::from_parts(parts, Body::from(bytes)))
        .instrument(span.clone())
        .await;
    let guard = cell.take();
    #[cfg(feature = "sqlx")]
    let staged = cell.take_staged();
    drop(cell);
    let response = match outcome {
        Ok(response) => response,
        Err(error) => {
            if let Some(guard) = guard {
                guard.abort().await;
            }
            report.failed(&span, std::any::type_name::<I::Error>());
            return Err(error);
        }
    };
    let Some(guard) = guard else {
        let detail =
            "the handler still held its IdempotentTx when it answered (moved into a task?): nothing was committed";
        report.error(
            &span,
            &Error::Config(detail.into()),
            "the handler kept its transaction past its answer: rolled back",
        );
        return Ok(Kind::TransactionBorrowed.response(detail, None));
    };
    let status = response.status();
    if status.is_server_error() || response.extensions().get::<NotKept>().is_some() {
        guard.abort().await;
        report.failed(
            &span,
            if status.is_server_error() {
                status.as_str()
            } else {
                "not_kept"
            },
        );
        return Ok(response);
    }
    if let Some(reason) = not_replayable(&response, config.response_limit) {
        guard.abort().await;
        let detail = format!("the handler's answer cannot be replayed to a retry: {reason}; nothing was kept");
        report.error(
            &span,
            &Error::Config(detail.clone()),
            "answer cannot be kept for replays; claim released",
        );
        return Ok(Kind::NotReplayable.response(&detail, None));
    }
    let (response_parts, response_body) = response.into_parts();
    let body: Bytes = match http_body_util::Limited::new(response_body, config.response_limit)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            guard.abort().await;
            let detail = format!("the handler's answer could not be read whole ({error}); nothing was kept");
            report.error(
                &span,
                &Error::Config(detail.clone()),
                "answer cannot be kept for replays; claim released",
            );
            return Ok(Kind::NotReplayable.response(&detail, None));
        }
    };
    // The outgoing messages the handler published, into the outbox in the
    // claim's transaction: they commit with the kept answer or not at all.
    #[cfg(feature = "sqlx")]
    let mut guard = guard;
    #[cfg(feature = "sqlx")]
    let staged = match staged {
        Some((outbox, stage)) => stage(&mut guard, outbox).instrument(span.clone()).await,
        None => Ok(()),
    };
    #[cfg(feature = "sqlx")]
    if let Err(error) = staged {
        guard.abort().await;
        let (kind, detail) = match &error {
            Error::Config(reason) => (
                Kind::OutgoingRefused,
                format!("an outgoing message the handler published was refused ({reason}); nothing was kept"),
            ),
            _ => (
                Kind::StoreFailed,
                "the outgoing messages could not be staged with the answer; nothing was kept: retry".to_owned(),
            ),
        };
        report.error(&span, &error, "outgoing messages not staged; claim released");
        return Ok(kind.response(&detail, None));
    }
    let kept = StoredResponse::new(response_parts.status, &response_parts.headers, &body).to_json();
    let completed = match kept {
        Ok(json) => guard.complete(Some(json)).instrument(span.clone()).await,
        Err(error) => {
            guard.abort().await;
            Err(error)
        }
    };
    match completed {
        // Counted and sent only now, after the commit (invariant 4).
        Ok(()) => {
            report.processed(&span);
            Ok(Response::from_parts(response_parts, Body::from(body)))
        }
        Err(error) => {
            report.error(&span, &error, "answer not committed");
            Ok(Kind::StoreFailed.response(
                "the answer could not be committed with the key: on a transactional store nothing was kept; retry",
                None,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_keep_callers_methods_and_routes_apart() {
        let a = scope_of("acme", &Method::POST, "/payments");
        assert_eq!(a, "http:4:acme:POST:/payments");
        assert_ne!(a, scope_of("acme:POST", &Method::POST, "/payments"));
        assert_ne!(a, scope_of("acme", &Method::PUT, "/payments"));
        assert_ne!(a, scope_of("", &Method::POST, "/payments"));
        let long = scope_of(&"t".repeat(500), &Method::POST, "/payments");
        assert!(
            long.starts_with("http#") && long.len() <= crate::MAX_SCOPE_BYTES,
            "{long}"
        );
        assert_ne!(long, scope_of(&"t".repeat(501), &Method::POST, "/payments"));
    }

    #[test]
    fn retry_after_is_whole_seconds_at_least_one() {
        let r = Kind::InProgress.response("x", Some(Duration::from_millis(200)));
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let r = Kind::InProgress.response("x", Some(Duration::from_millis(2500)));
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(r.status(), StatusCode::CONFLICT);
    }
}
