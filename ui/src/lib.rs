//! Holds `tests/ui.rs`: every misuse of `#[idempotent]` in `tests/ui/fail`
//! fails with the error its `.stderr` shows, every handler shape in
//! `tests/ui/pass` compiles. Nothing here is published.
