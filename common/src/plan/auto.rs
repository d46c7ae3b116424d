//! `--layout auto`: the language-model exercises plan their own layout from a profile for the
//! ranks they were started on, say which they chose and why, and train with it.
use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;

use super::layouts::{self, Candidate, Space};
use super::predict::{self, Prediction};
use super::profile::{Profile, ProfileKey};
use crate::error::usage;
use crate::models::TransformerConfig;
use crate::precision::Precision;

/// `--layout`'s one choice so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutChoice {
    /// Plan it from --plan-profile and train with the fastest layout that fits --memory.
    Auto,
}

/// The flags of `--layout auto`.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct AutoLayoutArgs {
    /// auto: plan the layout for this job's ranks from --plan-profile (exercise3 plan) and train
    /// with the fastest that fits --memory; it chooses --tp, --pp, --zero, --shard-group,
    /// --chunks, --schedule, --virtual-stages, --checkpoint-activations, --sequence-parallel and
    /// the batch per replica (docs/plan.md).
    #[arg(long, value_enum)]
    #[arg(help_heading = "Parallelism")]
    pub layout: Option<LayoutChoice>,
    /// The machine's profile --layout auto plans from (exercise3 profile --out FILE).
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub plan_profile: Option<PathBuf>,
    /// One rank's memory, for --layout auto: bytes or with a unit (80GB, 16GiB).
    #[arg(long, value_parser = super::parse_bytes)]
    #[arg(help_heading = "Parallelism")]
    pub memory: Option<f64>,
    /// Sequences per optimizer step over all replicas, for --layout auto.
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub global_batch: Option<usize>,
}

/// Which exercise trains the chosen layout, so that only what it can run is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trainer {
    /// exercise1_nlp: the whole model per rank (ZeRO 1–3, HSDP) or tensor-parallel shards of it.
    Exercise1Nlp,
    /// exercise3 tp: shards and stages; ZeRO-3 and HSDP need exercise1_nlp's whole-model step.
    Exercise3Tp,
}

impl Trainer {
    fn runs(self, c: &Candidate) -> bool {
        match self {
            Trainer::Exercise1Nlp => c.pp == 1,
            Trainer::Exercise3Tp => !c.sync.strategy().parameters_sharded(),
        }
    }
}

/// The job the run was started as.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    /// The run's model (its vocabulary comes from the data: the profile's is planned with).
    pub model: TransformerConfig,
    pub bptt: i64,
    pub precision: Precision,
    pub nodes: usize,
    pub ranks_per_node: usize,
}

/// The layout `--layout auto` trains with, and a line saying what it chose and why.
pub fn choose(args: &AutoLayoutArgs, shape: &RunShape, trainer: Trainer) -> Result<(Candidate, String)> {
    let (Some(path), Some(memory), Some(global_batch)) = (&args.plan_profile, args.memory, args.global_batch) else {
        return usage("--layout auto plans from a profile for a memory and a batch: give --plan-profile FILE, --memory BYTES and --global-batch N");
    };
    let profile = Profile::read(path, None)?;
    let model = TransformerConfig { ntoken: profile.model.ntoken, dropout: profile.model.dropout, ..shape.model };
    profile.check(path, ProfileKey { model, precision: shape.precision })?;
    if profile.seq_len != shape.bptt {
        return usage(format!(
            "{} was measured at {} tokens per sequence, this run trains {} (--bptt): record one at {}",
            path.display(),
            profile.seq_len,
            shape.bptt,
            shape.bptt
        ));
    }
    let space = Space { nodes: shape.nodes, gpus_per_node: shape.ranks_per_node, global_batch, model, precision: shape.precision, hosts_per_machine: 1 };
    let links = predict::Links::of(&profile, None, None);
    let candidates: Vec<Candidate> = layouts::enumerate(&space).into_iter().filter(|c| trainer.runs(c)).collect();
    let predictions = candidates.iter().map(|c| predict::predict(&profile, &links, &space, c)).collect::<Result<Vec<Prediction>, _>>()?;
    let best =
        predictions.iter().filter(|p| p.memory_bytes <= memory).min_by(|a, b| a.step_s.total_cmp(&b.step_s).then(a.memory_bytes.total_cmp(&b.memory_bytes)));
    let Some(best) = best else {
        let smallest = predictions.iter().map(|p| p.memory_bytes).fold(f64::INFINITY, f64::min);
        return usage(format!(
            "--layout auto: none of the {} layouts of {} ranks fits in {:.2} GiB per rank (the smallest needs {:.2} GiB)",
            predictions.len(),
            shape.nodes * shape.ranks_per_node,
            memory / GIB,
            smallest / GIB
        ));
    };
    let fitting = predictions.iter().filter(|p| p.memory_bytes <= memory).count();
    let line = format!(
        "--layout auto: {} (predicted {:.3} s per step, {:.2} GiB per rank; the fastest of {fitting} layouts that fit in {:.2} GiB, of {}; from {})",
        best.candidate.layout_flags(),
        best.step_s,
        best.memory_bytes / GIB,
        memory / GIB,
        predictions.len(),
        path.display()
    );
    Ok((best.candidate, line))
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
