// Link-time fixes that Cargo cannot inherit from `torch-sys`, for every crate with binaries or
// tests (included by `exercises/build.rs` and `common/build.rs`, whose `main` calls
// `link_libtorch()`).
//
// * `libtorch_cuda.so` is only referenced through static initialisers, so the default
//   `--as-needed` linker drops it and CUDA then reports "unavailable" on a GPU machine.
//   torch-sys passes `--no-as-needed` for itself, but Cargo does not forward link args to
//   dependants: every binary that wants CUDA must link it again, here.
// * An rpath to LibTorch's lib folder so the binaries also start without LD_LIBRARY_PATH.
// * The PyTorch version the binaries were built against, for the results files.
use std::path::PathBuf;

/// LibTorch's lib folder (torch-sys's `DEP_TCH_LIBTORCH_LIB`), where it told us.
#[allow(dead_code)] // exercises/build.rs only links
fn libtorch_lib_dir() -> Option<PathBuf> {
    std::env::var("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from).ok()
}

fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=TORCH_VERSION");
    let lib_dir = libtorch_lib_dir();
    let version = std::env::var("TORCH_VERSION")
        .ok()
        .or_else(|| {
            let dir = lib_dir.as_ref()?.parent()?.join("version.py");
            let text = std::fs::read_to_string(dir).ok()?;
            let line = text.lines().find(|l| l.starts_with("__version__"))?;
            Some(line.split('\'').nth(1)?.to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TORCH_VERSION={version}");

    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    if let Some(dir) = lib_dir {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        if dir.join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        }
    }
}
