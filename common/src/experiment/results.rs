//! What rank 0 says and writes after a run: the console's lines, the run's record (CSV), and
//! its results document, one typed [`RunResults`] serialised once (with the exercise's own
//! fields beside it).
use anyhow::Result;
use serde::Serialize;
use tch::Device;

use super::built::Built;
use super::files::checkpoint_config;
use super::Experiment;
use crate::comm::layout::{Groups, Layout};
use crate::comm::CommStats;
use crate::device;
use crate::memory::{ModelState, PeakMemory};
use crate::presets::Preset;
use crate::report::{self, RunInfo, RunRecord};
use crate::train::{self, EvalSums, FitReport, LrSchedule, Metric, Observers, TrainStep};

/// What one training step moved: in all, and over each of the mesh's groups that carried
/// anything (HSDP's `dp_replicate`: what crosses between shard groups).
#[derive(Debug, Clone)]
pub(super) struct StepCommunication {
    pub all: CommStats,
    pub by_group: std::collections::BTreeMap<&'static str, CommStats>,
}

/// What a run measured, on every rank (rank 0's is reported).
pub(super) struct Measured {
    pub fit: FitReport,
    pub test: EvalSums,
    /// This rank's collectives and messages during training and its evaluations.
    pub communication: CommStats,
    /// In one training step (between two steps' ends; none after fewer than two steps).
    pub per_step: Option<StepCommunication>,
    pub memory: ModelState,
    pub peaks: Vec<PeakMemory>,
    /// The model's parameters, counted over the ranks holding its parts.
    pub params: i64,
    /// Every step's mean loss on rank 0's replica (after a resume: the steps this run took).
    pub step_losses: Vec<f64>,
    /// The style's own figures ([`crate::parallel::RunPart::finish`]), on rank 0.
    pub style_report: Option<crate::parallel::StyleReport>,
    /// Every rank's time in the gradients' averaging, by rank of the training group.
    pub allreduce_by_rank: Vec<f64>,
}

/// The results document of a run, besides its [`RunRecord`] and the exercise's own fields.
#[derive(Serialize)]
struct RunResults<'a> {
    history: &'a [train::EpochStats],
    step_losses: &'a [f64],
    resumed_epochs: usize,
    world_size: usize,
    /// The host each job rank ran on (ranks a style set apart included), by job rank.
    hosts: Vec<String>,
    layout: Layout,
    dp: usize,
    per_rank_batch: usize,
    accumulate: usize,
    global_batch: usize,
    /// The training split's size: a whole epoch's time from the throughput, also when
    /// --max-steps stopped the run inside its first epoch (the scaling study's column).
    examples_per_epoch: usize,
    lr_schedule: LrSchedule,
    allreduce_time_s: f64,
    /// Each rank's time in the gradients' averaging: the rank that spent the least is the one
    /// the others waited for.
    allreduce_time_s_by_rank: &'a [f64],
    scaling_efficiency: Option<f64>,
    communication: CommStats,
    communication_per_step: Option<CommStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    communication_per_step_by_group: Option<&'a std::collections::BTreeMap<&'static str, CommStats>>,
    zero: u8,
    model_state_memory: ModelState,
    peak_memory: &'a [PeakMemory],
    /// With data-parallel replicas: how they averaged.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    replicas: Option<ReplicaResults>,
    /// The style's own figures, under its name.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    style_report: Option<&'a crate::parallel::StyleReport>,
    /// What checkpointing cost: training time blocked (gathering, copying to host memory) and
    /// the background writes' time, on rank 0.
    checkpoints: train::CheckpointStats,
    matmul_precision: &'static str,
    scale_lr: bool,
    warmup_epochs: usize,
}

/// How data-parallel replicas averaged their gradients.
#[derive(Serialize)]
struct ReplicaResults {
    backend: String,
    gradient_sync: crate::parallel::GradientSync,
    bucket_mb: f64,
    fp16_allreduce: bool,
}

/// Rank 0's report of a training run: its lines, the record appended to the exercise's CSV,
/// the results document and the curves beside it, the closing table.
pub(super) fn write_results<E: Experiment>(
    exp: &E,
    data: &E::Data,
    built: &Built<'_, E::Model>,
    measured: &Measured,
    groups: &Groups,
    device: Device,
    session: &mut Observers,
) -> Result<RunRecord> {
    let (run, preset) = (exp.run_args(), exp.preset());
    say_measurements(measured, groups, device, session)?;
    let peak = crate::flops::peak_tflops(device, run.precision, run.matmul_precision, run.peak_tflops);
    if let Some((peak, source)) = &peak {
        session.info(format!("[{}] peak {peak:.1} TFLOP/s per device ({source})", device::device_name(device)))?;
    }
    let recipe = &built.recipe;
    let info = RunInfo {
        exercise: preset.name.into(),
        model: exp.model_name(),
        params: measured.params,
        device,
        dataset: exp.dataset_name(),
        data_generated: exp.data_generated(data),
        epochs: recipe.epochs,
        batch_size: recipe.batch_size,
        lr: recipe.lr,
        optimizer: built.optimizer.name().into(),
        seed: run.seed,
        world_size: groups.world.world_size(),
        precision: run.precision,
        flops_per_example: exp.flops_per_example(&built.plan),
        peak_tflops: peak.map(|(p, _)| p * exp.devices(&built.plan, device).len() as f64),
    };
    let (fit, test) = (&measured.fit, &measured.test);
    let mut record = RunRecord::new(info, fit, (test.mean_loss(), test.accuracy()));
    record.peak_memory_bytes = measured.peaks.iter().map(PeakMemory::peak_bytes).max();
    let (lines, extra) = exp.report(data, &built.plan, fit, test, device);
    for line in lines {
        session.info(line)?;
    }
    session.info(report::compute_summary(&record, built.sources.examples_per_epoch))?;
    let results = run_results(exp, built, measured, groups, &record);
    let mut json = serde_json::to_value(&results)?;
    if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        object.extend(extra);
    }
    let saved = report::save(&run.results_dir, &record, &json)?;
    saved.notes.iter().try_for_each(|note| session.warn(note.clone()))?;
    match crate::plots::curves_for_run(&run.results_dir, &record, &json) {
        Ok(svg) => session.info(format!("wrote the training curves {}", svg.display()))?,
        Err(err) => session.warn(format!("warning: {err:#}"))?,
    }
    session.info(report::time_split(&record))?;
    session.info(format!("wrote {}", saved.json.display()))?;
    if let Some(config) = &saved.config {
        session.info(format!("wrote {} (the flags given: --config {0} repeats the run)", config.display()))?;
    }
    if !preset.per_device || groups.world.world_size() > 1 {
        session.info(comparison(preset, std::slice::from_ref(&record), None))?;
    }
    Ok(record)
}

/// The replicas' agreement, the traffic, the memory: one line each.
fn say_measurements(measured: &Measured, groups: &Groups, device: Device, session: &mut Observers) -> Result<()> {
    if groups.layout.dp > 1 {
        session.info(format!("parameters bit-identical on all {} ranks after training", groups.layout.dp))?;
    }
    if groups.world.world_size() > 1 {
        if let Some(line) = crate::comm::waits::describe(&measured.allreduce_by_rank, groups.world) {
            session.info(line)?;
        }
        session.info(format!("rank 0's communication in training and evaluation: {}", measured.communication.describe()))?;
        if let Some(per_step) = &measured.per_step {
            session.info(format!("rank 0's communication per training step: {}", per_step.all.describe()))?;
        }
    }
    if let Some(report) = &measured.style_report {
        session.info(report.describe())?;
    }
    let saved = measured.fit.checkpoints;
    if saved.saved > 0 {
        session.info(format!(
            "{} checkpoints ({:.1} MB each): training blocked {:.3} s per checkpoint (at most {:.3} s), written in the background in {:.3} s each",
            saved.saved,
            saved.bytes as f64 / 1e6,
            saved.blocked_s / saved.saved as f64,
            saved.max_blocked_s,
            saved.write_s / saved.saved as f64
        ))?;
    }
    session.info(measured.memory.describe(device))?;
    session.info(format!("peak memory in training: {}", measured.peaks.iter().map(PeakMemory::describe).collect::<Vec<_>>().join("; ")))
}

fn run_results<'a, E: Experiment>(exp: &E, built: &'a Built<'_, E::Model>, measured: &'a Measured, groups: &Groups, record: &RunRecord) -> RunResults<'a> {
    let (run, parallel, recipe) = (exp.run_args(), exp.parallel_args(), &built.recipe);
    let replicas = groups.layout.dp;
    let csv = report::table_path(&run.results_dir, exp.preset().name);
    RunResults {
        history: &measured.fit.history,
        step_losses: &measured.step_losses,
        resumed_epochs: measured.fit.resumed_epochs,
        world_size: groups.world.world_size(),
        hosts: crate::comm::hosts::for_results(groups.world.env().world_size),
        layout: groups.layout,
        dp: replicas,
        per_rank_batch: recipe.batch_size,
        accumulate: recipe.accumulate,
        global_batch: recipe.batch_size * recipe.accumulate * replicas,
        examples_per_epoch: built.sources.examples_per_epoch,
        lr_schedule: recipe.schedule,
        allreduce_time_s: measured.fit.timings.allreduce_s,
        allreduce_time_s_by_rank: &measured.allreduce_by_rank,
        scaling_efficiency: report::scaling_efficiency(&csv, record),
        communication: measured.communication,
        checkpoints: measured.fit.checkpoints,
        communication_per_step: measured.per_step.as_ref().map(|p| p.all),
        communication_per_step_by_group: measured.per_step.as_ref().map(|p| &p.by_group),
        zero: parallel.zero,
        model_state_memory: measured.memory,
        peak_memory: &measured.peaks,
        replicas: (replicas > 1).then(|| ReplicaResults {
            backend: groups.world.describe(),
            gradient_sync: built.sync,
            bucket_mb: parallel.bucket_mb,
            fp16_allreduce: parallel.fp16_allreduce,
        }),
        style_report: measured.style_report.as_ref(),
        matmul_precision: run.matmul_precision.name(),
        scale_lr: exp.recipe_args().scale_lr || exp.preset().recipe_for(exp.recipe_args()).scale_lr,
        warmup_epochs: exp.recipe_args().warmup_epochs.unwrap_or(0),
    }
}

/// `--eval-only`'s report: the exercise's own lines on the test split, one line with the
/// figures, and `<results>/<run>.eval-only.json` (the training run's results stay as they are).
pub(super) fn report_evaluation<E: Experiment>(
    exp: &E,
    data: &E::Data,
    built: &Built<'_, E::Model>,
    measured: &Measured,
    device: Device,
    session: &mut Observers,
) -> Result<()> {
    let (run, name, fit, test) = (exp.run_args(), &built.name, &measured.fit, &measured.test);
    let (lines, extra) = exp.report(data, &built.plan, fit, test, device);
    for line in lines {
        session.info(line)?;
    }
    let (loss, accuracy) = (test.mean_loss(), test.accuracy());
    let figure = match exp.metric() {
        Metric::Accuracy => format!("test accuracy {accuracy:.4}"),
        Metric::Perplexity => format!("test perplexity {:.2}", loss.exp()),
    };
    let source = checkpoint_config(run).and_then(|(dir, _, from)| from.or(Some(crate::checkpoint::path_for(&dir, name)))).unwrap_or_default();
    session.info(format!(
        "[{}] --eval-only: {} from {} (nothing trained): {figure}, test loss {loss:.4}",
        device::device_name(device),
        name,
        source.display()
    ))?;
    let mut json = serde_json::json!({
        "run": name, "eval_only": true, "checkpoint": source, "device": device::device_name(device),
        "test_loss": loss, "test_acc": if accuracy.is_finite() { Some(accuracy) } else { None }, "eval_loss": fit.eval_loss, "flags": super::recorded_flags(exp)?,
    });
    if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        object.extend(extra);
    }
    let path = report::eval_only_path(&run.results_dir, name);
    crate::output::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    session.info(format!("wrote {}", path.display()))
}

/// The model's parameters, counted where they live (every stage of a pipeline and every
/// tensor-parallel shard across ranks; what all shards hold whole, once).
pub(super) fn step_parameter_count(groups: &Groups, step: &dyn TrainStep<'_>) -> Result<i64> {
    let mine = train::counted_parameters(step);
    let Some(model) = groups.model() else { return Ok(mine) };
    let mut total = tch::Tensor::from(mine as f64);
    model.all_reduce(&mut total, crate::comm::ReduceOp::Sum)?;
    Ok(total.double_value(&[]) as i64)
}

/// The course's comparison table of `records` (one run, or one per device), and under it the
/// slides' own printouts of their epochs in the shape of `preset`'s script, to hold against ours
/// line by line.
pub fn comparison<M>(preset: &Preset<M>, records: &[RunRecord], missing: Option<&str>) -> String {
    let figures = crate::course_figures::for_run(&records[0].exercise, &records[0].model);
    report::comparison_table(records, missing) + &preset.script.slide_printouts(figures)
}
