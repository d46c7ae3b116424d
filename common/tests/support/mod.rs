//! Helpers shared by the integration tests.
#![allow(dead_code)]
use std::path::PathBuf;

pub mod lm;
pub mod ranks;

/// The real data samples beside the checkout (`../shared/data`), or `$SHARED_DATA`.
/// Missing data fails the test with the reason: these tests are never skipped silently.
pub fn shared_data(sub: &str) -> PathBuf {
    let base = std::env::var_os("SHARED_DATA").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data"));
    let path = base.join(sub);
    assert!(path.is_dir(), "this test needs the real data sample {} (the course's ../shared/data beside the checkout, or set SHARED_DATA)", path.display());
    path
}

/// What a PyTorch reference script (`tests/reference/<script>`) wrote to its `.npz`: tensors by
/// name. The script runs under `$TORCH_PYTHON`, which `scripts/with-torch` sets; without it the
/// test fails and says how to run it.
pub struct Reference(std::collections::HashMap<String, tch::Tensor>);

impl Reference {
    /// Runs `tests/reference/<script> ARGS... OUT.npz` and reads OUT.npz.
    pub fn compute(script: &str, args: &[&str]) -> Reference {
        let dir = tempfile::tempdir().unwrap();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference").join(script);
        let python = std::env::var_os("TORCH_PYTHON").unwrap_or_else(|| {
            panic!(
                "TORCH_PYTHON is not set, so the PyTorch reference {} cannot run; run the tests through \
                 scripts/with-torch (e.g. `scripts/with-torch cargo test --release -p common`), which points \
                 it at a Python with torch 2.11",
                script.display()
            )
        });
        let npz = dir.path().join("reference.npz");
        let output = std::process::Command::new(&python)
            .arg(&script)
            .args(args)
            .arg(&npz)
            .output()
            .unwrap_or_else(|e| panic!("cannot run TORCH_PYTHON={}: {e}", python.to_string_lossy()));
        assert!(
            output.status.success(),
            "{} {} {args:?} failed ({}):\n{}",
            python.to_string_lossy(),
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let tensors = tch::Tensor::read_npz(&npz).unwrap_or_else(|e| panic!("cannot read {}: {e}", npz.display()));
        Reference(tensors.into_iter().collect())
    }

    pub fn get(&self, key: &str) -> &tch::Tensor {
        self.0.get(key).unwrap_or_else(|| panic!("the reference .npz has no `{key}`"))
    }

    /// The tensors named `<prefix><name>`, by name.
    pub fn with_prefix(&self, prefix: &str) -> std::collections::HashMap<String, &tch::Tensor> {
        self.0.iter().filter_map(|(k, t)| Some((k.strip_prefix(prefix)?.to_string(), t))).collect()
    }
}
