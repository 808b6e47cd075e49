//! The workspace root package: it owns the top-level `tests/`, `examples/`
//! and `benches/`, and compiles the README's and the guides' examples as
//! doctests.
#![doc = include_str!("../README.md")]

/// The code blocks of `docs/handlers.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/handlers.md")]
pub struct HandlersGuide;

/// The code blocks of `docs/brokers.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/brokers.md")]
pub struct BrokersGuide;

/// The code blocks of `docs/outbox.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/outbox.md")]
pub struct OutboxGuide;

/// The code blocks of `docs/http.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/http.md")]
pub struct HttpGuide;

/// The code blocks of `docs/operations.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/operations.md")]
pub struct OperationsGuide;

/// The code blocks of `docs/observability.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/observability.md")]
pub struct ObservabilityGuide;

/// The code blocks of `docs/testing.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/testing.md")]
pub struct TestingGuide;

/// The code blocks of `docs/performance.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/performance.md")]
pub struct PerformanceGuide;

/// The code blocks of `CONTRIBUTING.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../CONTRIBUTING.md")]
pub struct Contributing;
