//! Helpers shared by the binaries' integration tests.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::Output;

/// The real data samples beside the checkout (`../shared/data/<sub>`), or `$SHARED_DATA/<sub>`.
/// Missing data fails the test with the reason: these tests are never skipped silently.
pub fn shared_data(sub: &str) -> PathBuf {
    let base = std::env::var_os("SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data"));
    let dir = base.join(sub);
    assert!(dir.is_dir(), "this test needs the real data sample at {} (or set SHARED_DATA)", dir.display());
    dir
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}
