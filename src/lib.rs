//! The workspace root package: it owns the top-level `tests/`, `examples/`
//! and `benches/`, and compiles the README's examples as doctests.
#![doc = include_str!("../README.md")]
