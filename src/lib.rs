//! Workspace root package: owns tests/, examples/ and benches/.
