//! `common`: everything the course exercises share, one concept per module.
//!
//! Data flows one way: [`data`] (datasets, loaders) → [`models`] / [`optim`] (one training
//! step) → [`train`] (the loop, metrics, timing) → [`report`] (tables, CSV/JSON results),
//! with [`checkpoint`] saving and restoring the whole training state on the way.
pub mod checkpoint;
pub mod data;
pub mod device;
pub mod dist;
pub mod error;
pub mod flops;
pub mod flags;
pub mod image_classification;
pub mod language_model;
pub mod models;
pub mod optim;
pub mod plots;
pub mod pipeline;
pub mod pipeline_lm;
pub mod precision;
pub mod profile;
pub mod report;
pub mod results_page;
pub mod tensorboard;
pub mod torch_ext;
pub mod train;

/// Which exercise is running: names its results and checkpoint files, and sets defaults.
#[derive(Debug, Clone, Copy)]
pub struct Exercise {
    pub name: &'static str,
    pub default_epochs: usize,
}

/// The PyTorch version the binaries were built against (set by the build scripts).
pub fn torch_version() -> &'static str {
    option_env!("TORCH_VERSION").unwrap_or("unknown")
}
