//! Throughput benchmark (placeholder until written).
fn main() {}
