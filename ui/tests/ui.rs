//! Compile-time diagnostics of `#[idempotent]`: every misuse in `ui/fail`
//! fails with the error its `.stderr` shows, every handler shape in
//! `ui/pass` compiles. Regenerate with
//! `TRYBUILD=overwrite cargo test -p idempotent-ui --test ui`
//! and read every diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
