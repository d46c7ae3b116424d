//! `common`: everything the course exercises share, one concept per module.
//!
//! Data flows one way: [`data`] (datasets, loaders) → [`models`] / [`optim`] (one training
//! step, [`parallelize`]d over the job's [`comm::Layout`]) → [`train`] (the one loop, its
//! events and their sinks) → [`report`] (tables, CSV/JSON results), with [`checkpoint`]
//! saving and restoring the whole training state on the way. [`experiment`] does what every
//! exercise does around the loop; [`presets`] are the course's exercises. Every file is read
//! through [`input`] and written through [`output`].
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod config_file;
pub mod course_figures;
pub mod course_format;
pub mod cuda_graph;
pub mod data;
pub mod device;
pub mod error;
pub mod experiment;
pub mod flags;
pub mod flops;
pub mod image_classification;
pub mod input;
pub mod language_model;
pub mod memory;
pub mod models;
pub mod optim;
pub mod output;
pub mod parallel;
pub mod parallelize;
pub mod pipeline;
pub mod plan;
pub mod plots;
pub mod precision;
pub mod presets;
pub mod profile;
pub mod ps_bench;
pub mod report;
pub mod resources;
pub mod results_page;
pub mod scaling;
pub mod seed_keys;
pub mod slurm;
pub mod tensorboard;
pub mod torch_ext;
pub mod train;
pub mod why_gpus;

/// The PyTorch version the binaries were built against (set by the build scripts).
pub fn torch_version() -> &'static str {
    option_env!("TORCH_VERSION").unwrap_or("unknown")
}
