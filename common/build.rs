// The LibTorch link fixes shared by every crate that builds binaries or tests (see the file), and
// the C++ shim `csrc/torch_ext.cpp`: the few LibTorch C++ calls tch does not bind, compiled
// against the headers of the LibTorch we link (as torch-sys compiles its own C++).
include!("../build-support/link_libtorch.rs");

fn main() {
    link_libtorch();
    println!("cargo:rerun-if-changed=csrc/torch_ext.cpp");
    println!("cargo:rerun-if-changed=csrc/errors.h");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib = libtorch_lib_dir().expect("torch-sys tells where LibTorch is (DEP_TCH_LIBTORCH_LIB)");
    let root = lib.parent().expect("LibTorch's lib folder has a parent");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={}", cxx11_abi(&lib)))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/torch_ext.cpp")
        .compile("torch_ext");
    build_cuda_graph_library(&lib, root);
}

/// `--cuda-graph`'s library (csrc/cuda_graph.cpp): built as a shared library of its own, to be
/// embedded in the binaries and loaded at run time, where LibTorch is a CUDA build and the CUDA
/// runtime's headers are found (the pip wheel's `nvidia/cu*/include`, with `nvidia-cuda-crt`'s
/// `crt/` headers, which scripts/with-torch installs; or `CUDA_HOME`). Elsewhere the binaries
/// say that this build cannot capture CUDA graphs.
fn build_cuda_graph_library(lib: &std::path::Path, root: &std::path::Path) {
    println!("cargo:rustc-check-cfg=cfg(torch_ext_cuda_graph)");
    println!("cargo:rerun-if-changed=csrc/cuda_graph.cpp");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if !lib.join("libtorch_cuda.so").exists() || !root.join("include/ATen/cuda/CUDAGraph.h").exists() {
        return;
    }
    let site_packages = root.parent().map(std::path::Path::to_path_buf);
    let mut candidates: Vec<std::path::PathBuf> = Vec::new();
    if let Some(sp) = &site_packages {
        for sub in ["nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include", "nvidia/cuda_nvcc/include", "nvidia/cuda_crt/include"] {
            candidates.push(sp.join(sub));
        }
    }
    for home in [std::env::var("CUDA_HOME").ok(), Some("/usr/local/cuda".to_string())].into_iter().flatten() {
        candidates.push(std::path::Path::new(&home).join("include"));
    }
    let include: Vec<&std::path::PathBuf> = candidates.iter().filter(|dir| dir.is_dir()).collect();
    let has = |file: &str| include.iter().any(|dir| dir.join(file).exists());
    for dir in &include {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    if !has("cuda_runtime_api.h") || !has("crt/host_defines.h") {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("libtorch_ext_cuda_graph.so");
    let compiler = cc::Build::new().cpp(true).get_compiler();
    let mut command = compiler.to_command();
    command
        .args(["-shared", "-fPIC", "-O2", "-g0", "-s", "-std=c++17", "-w"])
        .arg(format!("-D_GLIBCXX_USE_CXX11_ABI={}", cxx11_abi(lib)))
        .arg("-DGLOG_USE_GLOG_EXPORT")
        .arg(format!("-I{}", root.join("include").display()))
        .arg(format!("-I{}", root.join("include/torch/csrc/api/include").display()));
    for dir in &include {
        command.arg(format!("-I{}", dir.display()));
    }
    command.arg("csrc/cuda_graph.cpp").arg(format!("-L{}", lib.display())).args(["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10", "-o"]).arg(&out);
    match command.status() {
        Ok(status) if status.success() => {
            println!("cargo:rustc-cfg=torch_ext_cuda_graph");
            println!("cargo:rustc-env=TORCH_EXT_CUDA_GRAPH_LIB={}", out.display());
        }
        _ => println!("cargo:warning=the CUDA graph library did not compile: this build cannot capture CUDA graphs"),
    }
}

/// Whether LibTorch was built with the new C++11 string ABI (`LIBTORCH_CXX11_ABI=0|1` to say
/// so; otherwise read off libc10's symbols, which name `std::__cxx11::basic_string` under it).
fn cxx11_abi(lib: &std::path::Path) -> &'static str {
    match std::env::var("LIBTORCH_CXX11_ABI").as_deref() {
        Ok("0") => return "0",
        Ok("1") => return "1",
        _ => {}
    }
    let c10 = std::fs::read(lib.join("libc10.so")).unwrap_or_default();
    if c10.windows(7).any(|w| w == b"__cxx11") {
        "1"
    } else {
        "0"
    }
}
