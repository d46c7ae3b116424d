// The LibTorch link fixes shared by every crate that builds binaries or tests; see the file.
include!("../build-support/link_libtorch.rs");

fn main() {
    link_libtorch();
}
