// The LibTorch link fixes shared by every crate that builds binaries or tests (see the file), and
// the C++ shim `csrc/torch_ext.cpp`: the few LibTorch C++ calls tch does not bind, compiled
// against the headers of the LibTorch we link (as torch-sys compiles its own C++).
include!("../build-support/link_libtorch.rs");

fn main() {
    link_libtorch();
    println!("cargo:rerun-if-changed=csrc/torch_ext.cpp");
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
