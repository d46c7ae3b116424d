//! Helpers shared by the integration tests.
#![allow(dead_code)]
use std::path::PathBuf;

/// The real data samples beside the checkout (`../shared/data`), or `$SHARED_DATA`.
/// Missing data fails the test with the reason: these tests are never skipped silently.
pub fn shared_data(sub: &str) -> PathBuf {
    let base = std::env::var_os("SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data"));
    let path = base.join(sub);
    assert!(
        path.is_dir(),
        "this test needs the real data sample {} (the course's ../shared/data beside the checkout, or set SHARED_DATA)",
        path.display()
    );
    path
}
