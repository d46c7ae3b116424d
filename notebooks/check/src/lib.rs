//! The notebooks' code, compiled. Nothing here is for use: the crate's test target
//! (`tests/cells.rs`) includes every notebook's code cells, which `build.rs` turns into one
//! Rust function per notebook, so the test build type-checks each notebook against the
//! workspace's `common` and a notebook that no longer compiles fails `make test`. Running the
//! cells (with evcxr, data and charts) is `make notebooks`'s job.
