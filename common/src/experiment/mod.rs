//! What every exercise does around the training loop, written once: start the ranks, lay them
//! out, pick the device, load the data, build the step ([`crate::parallelize`]) and the
//! optimizer, train ([`crate::train::fit`]), test, and report. An exercise is an
//! [`Experiment`] (its data, model and results) plus a [`Preset`]; the image exercises are
//! [`crate::image_classification`], the language models [`crate::language_model`].
mod built;
mod files;
mod recipe;
mod results;
mod train_run;

use anyhow::{Context, Result};
use tch::Device;

use built::Place;
pub use recipe::RunRecipe;
use train_run::train_on;

use crate::comm::layout::{Groups, Layout};
use crate::comm::{launch, Backend, LaunchEnv, ProcessGroup};
use crate::device::{self, DeviceChoice};
use crate::error::usage;
use crate::flags::{ParallelArgs, RecipeArgs, RunArgs};
use crate::memory;
use crate::memory::estimate::RankEstimate;
use crate::parallel::Job;
use crate::parallelize::Parallelize;
use crate::precision::Precision;
use crate::presets::Preset;
use crate::report::{self, RunRecord};
use crate::train::sinks::ConsoleLog;
use crate::train::{self, BatchSource, EvalSums, Event, FitReport, Metric, Observer, Observers};

/// The data sources of one run on one rank.
pub struct Sources {
    pub train: Box<dyn BatchSource>,
    /// Evaluated after every epoch (the test set for images, the validation split for text).
    pub eval: Box<dyn BatchSource>,
    /// Evaluated at the end: the test split (None: the last epoch's evaluation was on it).
    pub test: Option<Box<dyn BatchSource>>,
    /// Examples in an epoch of the whole training set (for the machine-time estimate).
    pub examples_per_epoch: usize,
}

/// An exercise's own part: its flags, data, model and results.
pub trait Experiment {
    /// What [`Experiment::load`] reads once per process.
    type Data;
    /// What it trains, and how that is laid out over a job's ranks.
    type Model: Parallelize;
    /// What its preset trains: an image model's architecture, a Transformer's shape.
    type ModelPreset;

    fn preset(&self) -> &Preset<Self::ModelPreset>;
    fn run_args(&self) -> &RunArgs;
    fn recipe_args(&self) -> &RecipeArgs;
    fn parallel_args(&self) -> &ParallelArgs;
    /// The flags as given, for the checkpoint's and the results' record ([`recorded_flags`]).
    fn flags_json(&self) -> serde_json::Result<serde_json::Value>;

    /// The exercise's own flag mistakes (the shared flags are checked by [`run`]).
    fn check(&self) -> Result<()>;
    /// Loads the data; `announce`: say what was read (rank 0).
    fn load(&self, observers: &mut Observers, announce: bool) -> Result<Self::Data>;
    /// How a job of `world` ranks divides the work.
    fn layout(&self, world: usize) -> Result<Layout> {
        Layout::new(world, 1, 1, None)
    }
    /// This rank's device for a job (with `--device both` on a job: its GPU where there is one).
    fn device(&self, groups: &Groups) -> Result<Device> {
        match self.run_args().device {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda if !device::cuda_available() => crate::error::usage(device::no_cuda_message()),
            DeviceChoice::Cuda | DeviceChoice::Both => Ok(groups.world.device(device::cuda_available())),
        }
    }
    /// The model name in the run's name and results (`cnn`, `transformer`, ...).
    fn model_name(&self) -> String;
    fn dataset_name(&self) -> String;
    fn metric(&self) -> Metric;
    /// What to train on `device` for `groups`' layout (every rank calls it; rank 0 may say how
    /// it decided).
    fn model(&self, data: &Self::Data, groups: &Groups, device: Device, observers: &mut Observers) -> Result<Self::Model>;
    /// Says what was built (every rank calls it: a model spread over ranks is described by
    /// gathering its parts; rank 0 speaks).
    fn describe(&self, plan: &Self::Model, step: &dyn train::TrainStep<'_>, groups: &Groups, device: Device, observers: &mut Observers) -> Result<()>;
    /// What a checkpoint must have been written for to resume this run.
    fn model_identity(&self, plan: &Self::Model) -> serde_json::Value;
    /// What the data mean to the model, where the model's shapes do not pin it down (a
    /// vocabulary: which word each embedding row is); a resume on other data is refused.
    fn data_identity(&self, _data: &Self::Data) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Training FLOPs per example.
    fn flops_per_example(&self, plan: &Self::Model) -> f64;
    /// This replica's batches (`shard` = (replica, replicas)) on `device`.
    fn sources(&self, data: &Self::Data, device: Device, shard: (usize, usize)) -> Result<Sources>;
    fn data_generated(&self, data: &Self::Data) -> bool;
    /// The devices this process trains on (a pipeline's stages in one process: theirs): their
    /// peaks count for its MFU, their memory is measured.
    fn devices(&self, _plan: &Self::Model, device: Device) -> Vec<Device> {
        vec![device]
    }
    /// What each kind of rank of a job of `world` ranks will hold (`--estimate-memory`), the
    /// device kind `cuda` (its kernels save differently); `observers` hear what was read.
    fn memory_estimate(&self, layout: Layout, cuda: bool, observers: &mut Observers) -> Result<Vec<RankEstimate>>;
    /// Lines to print and fields to add to the results after the test evaluation (rank 0).
    fn report(&self, data: &Self::Data, plan: &Self::Model, fit: &FitReport, test: &EvalSums, device: Device) -> (Vec<String>, serde_json::Value);
}

/// The flags as the results and the checkpoints record them, as JSON. A path that is not UTF-8
/// is a valid argument on Linux, but JSON and TOML text cannot hold it: it is refused when the
/// run starts ([`run`] asks first), not when its results are written.
pub fn recorded_flags<E: Experiment>(exp: &E) -> Result<serde_json::Value> {
    exp.flags_json().or_else(|_| {
        let path = std::env::args_os().find(|arg| arg.to_str().is_none()).map(|arg| format!(" ({})", arg.to_string_lossy())).unwrap_or_default();
        usage(format!("a path given is not UTF-8{path}: the results and checkpoints record the flags as text; rename it, or link to it from a UTF-8 name"))
    })
}

/// Runs an exercise as the course does: with `--nproc-per-node`, a launcher or a data-parallel
/// preset as the ranks of one job, otherwise once per `--device` (CPU then GPU) with the
/// comparison table at the end. `listeners` hear every event of rank 0 (a notebook's
/// [`train::EventLog`], say) besides the console, progress bars, TensorBoard and profile
/// sinks the flags ask for. Returns rank 0's records.
pub fn run<E: Experiment>(exp: &E, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    let (run, parallel) = (exp.run_args(), exp.parallel_args());
    let job_spec = check_flags(exp)?;
    set_up_process(run, parallel)?;
    exp.check()?;
    check_outputs(exp)?;
    let env = LaunchEnv::detect();
    // Once per job: by the process itself, or by rank 0 of the ranks a launcher starts.
    let speaks = match &env {
        Ok(env) if env.is_distributed() => env.rank == 0,
        _ => parallel.nproc_per_node.is_none() || run.estimate_memory,
    };
    // (args_os: a path that is not UTF-8 is a valid argument, where `args` would panic.)
    let args = std::env::args_os().map(|arg| arg.to_string_lossy().into_owned());
    if let Some(note) = Precision::legacy_name_note(args).filter(|_| speaks) {
        session_observers(exp, true, listeners).info(note)?;
    }
    if run.estimate_memory {
        return estimate_memory(exp, listeners).map(|()| Vec::new());
    }
    if let Some(n) = parallel.nproc_per_node.filter(|_| !env.as_ref().is_ok_and(|env| env.is_distributed())) {
        check_ranks_to_start(exp, n, job_spec, listeners)?;
    }
    if launch::start_ranks_if_asked(parallel.nproc_per_node, job_spec.stops_at())? {
        return Ok(Vec::new());
    }
    let env = env?;
    if exp.preset().per_device && !env.is_distributed() && parallel.backend == Backend::Auto {
        return run_per_device(exp, listeners);
    }
    // Before any engine starts: NCCL reads its host id once, at its first call.
    let shared_gpu = match (parallel.share_gpu, launch::on_gpus(run.device)) {
        (true, true) if env.is_distributed() => Some(crate::comm::shared_gpu::apply(&env, launch::gpu_count())?),
        (true, false) => Some("note: --share-gpu places ranks on GPUs; these train on the CPU, where it changes nothing".to_string()),
        _ => None,
    };
    // Errors on one rank abort every rank (MPI_Abort) instead of leaving the others waiting.
    ProcessGroup::run(Job::backend(parallel.backend, job_spec), |world| run_rank(exp, world, job_spec, shared_gpu.as_ref(), listeners))
}

/// The flags' own mistakes, before LibTorch starts (half a second): said at once. Also what the
/// style refuses of the run's flags, said before the ranks start; returns the style's job.
fn check_flags<E: Experiment>(exp: &E) -> Result<crate::parallel::JobSpec> {
    let (run, parallel) = (exp.run_args(), exp.parallel_args());
    run.check()?;
    exp.recipe_args().check()?;
    parallel.check()?;
    recorded_flags(exp)?;
    let job_spec = parallel.job();
    job_spec.check(run.checkpoint_every.is_some() || run.checkpoint_minutes.is_some())?;
    Ok(job_spec)
}

/// The process's settings the flags ask for: memory counted, matrix products' precision,
/// determinism, the collectives' and the start-up's timeouts.
fn set_up_process(run: &RunArgs, parallel: &ParallelArgs) -> Result<()> {
    // Before the data are read: the data set counts in the peak memory's baseline.
    memory::count_cpu_tensors()?;
    device::keep_freed_host_memory();
    run.matmul_precision.apply()?;
    if run.deterministic {
        device::deterministic()?;
    }
    crate::comm::watchdog::set_timeout(std::time::Duration::from_secs_f64(parallel.collective_timeout));
    crate::comm::startup::set_timeout(std::time::Duration::from_secs_f64(parallel.startup_timeout));
    Ok(())
}

/// The folders and files the run will write, found writable before the first step, not after
/// the last one (whose results would be lost).
fn check_outputs<E: Experiment>(exp: &E) -> Result<()> {
    let run = exp.run_args();
    writable_dir(&run.results_dir, "--results-dir")?;
    if let Some(dir) = &run.checkpoint_dir {
        writable_dir(dir, "--checkpoint-dir")?;
    }
    // Every name the run would write, on every device it may train on (a GPU asked for but
    // absent is said later, where it is checked).
    let named_devices = match run.device {
        DeviceChoice::Cpu => vec![Device::Cpu],
        DeviceChoice::Cuda => vec![Device::Cuda(0)],
        DeviceChoice::Both => vec![Device::Cpu, Device::Cuda(0)],
    };
    files::check(exp, &named_devices)
}

/// What the `n` ranks `--nproc-per-node` starts would each refuse, said once, before mpirun
/// starts them; and a warning for more ranks than the machine holds well.
fn check_ranks_to_start<E: Experiment>(exp: &E, n: usize, job_spec: crate::parallel::JobSpec, listeners: &mut Observers) -> Result<()> {
    let (run, parallel) = (exp.run_args(), exp.parallel_args());
    let layout = job_layout(exp, n)?;
    if layout.dp > 1 && run.precision.weights_kind().is_some() && run.device == DeviceChoice::Cpu {
        return usage(crate::parallelize::cannot_average(run.precision, layout.dp, "mpi", Device::Cpu));
    }
    if let Some(warning) = launch::check_rank_count(n, job_spec.ranks_apart(), run.device, parallel.max_ranks_per_core, parallel.share_gpu)? {
        session_observers(exp, true, listeners).warn(warning)?;
    }
    Ok(())
}

/// This rank's part of the job: serving (a rank the style sets apart works there until the job
/// is done), or training as a data-parallel replica over a group of the others' own.
fn run_rank<E: Experiment>(
    exp: &E,
    world: &ProcessGroup,
    job_spec: crate::parallel::JobSpec,
    shared_gpu: Option<&String>,
    listeners: &mut Observers,
) -> Result<Vec<RunRecord>> {
    let run = exp.run_args();
    let job = Job::start(world, job_spec)?;
    if job.serve()? {
        return Ok(Vec::new());
    }
    let world = job.ranks();
    let layout = job_layout(exp, world.world_size())?;
    let run_part = job.run_part();
    let groups = Groups::new(world, layout)?.with_traffic(run_part.clone().map(|part| part.traffic()));
    let device = exp.device(&groups)?;
    run.precision.check(device)?;
    let mut session = session_observers(exp, world.is_root(), listeners);
    if let Some(every) = run.course_log {
        session.add(train::sinks::CourseLog::new(world.rank(), world.world_size(), every, exp.metric(), exp.preset().script));
    }
    if let Some(placement) = crate::comm::hosts::placement() {
        session.info(placement)?;
    }
    if let Some(note) = shared_gpu.filter(|_| world.is_root()) {
        session.info(note.clone())?;
    }
    if run.threads == 0 && world.local_world_size() > 1 && device == Device::Cpu {
        // Ranks sharing a node share its cores (torchrun sets OMP_NUM_THREADS=1 for the same reason).
        device::set_threads((device::usable_cores() / world.local_world_size()).max(1))?;
    } else if let Some(warning) = device::set_threads(run.threads)? {
        session.warn(warning)?;
    }
    let data = exp.load(&mut session, world.is_root())?;
    let record = train_on(exp, &data, Place { groups: &groups, run_part: run_part.as_ref(), device }, &mut session)?;
    if let (Some(record), true) = (&record, world.world_size() > 1) {
        let csv = report::table_path(&run.results_dir, exp.preset().name);
        if let Some(efficiency) = report::scaling_efficiency(&csv, record) {
            session.info(format!("scaling efficiency against the last 1-rank run: {:.1}%", 100.0 * efficiency))?;
        }
    }
    Ok(record.into_iter().collect())
}

/// `--estimate-memory`: the job's ranks from `--nproc-per-node` or the launcher, the estimate
/// printed and written to `<results>/<exercise>-<model>-<device>.memory-estimate.json`.
fn estimate_memory<E: Experiment>(exp: &E, listeners: &mut Observers) -> Result<()> {
    let run = exp.run_args();
    if run.precision.weights_kind().is_some() {
        return usage(format!(
            "--estimate-memory models float32 weights (32 and the mixed precisions); --precision {} is not modelled yet",
            run.precision.name()
        ));
    }
    let world = match exp.parallel_args().nproc_per_node {
        Some(n) => n,
        None => LaunchEnv::detect()?.world_size,
    };
    // The GPU's kernels where the run would train on one (`both`: where there is one).
    let cuda = match run.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Both => device::cuda_available(),
    };
    let mut session = session_observers(exp, true, listeners);
    let rows = exp.memory_estimate(job_layout(exp, world)?, cuda, &mut session)?;
    let device = if cuda { "cuda" } else { "cpu" };
    let name = format!("{}-{}-{device}", exp.preset().name, exp.model_name());
    session.info(format!(
        "--estimate-memory: {name}, {world} rank(s), precision {}, per rank in MiB (nothing trained; {}):\n\n{}",
        run.precision.name(),
        if cuda { "CUDA's kernels, as counted from what they save (not measured on a GPU)" } else { "the CPU's kernels, as measured" },
        crate::memory::estimate::table(&rows)
    ))?;
    std::fs::create_dir_all(&run.results_dir).with_context(|| format!("cannot create results directory {}", run.results_dir.display()))?;
    let path = run.results_dir.join(format!("{name}.memory-estimate.json"));
    let json = serde_json::json!({ "run": name, "world_size": world, "device": device, "precision": run.precision.name(), "flags": recorded_flags(exp)?, "ranks": rows });
    crate::output::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    session.info(format!("wrote {}", path.display()))
}

/// Creates `dir` if needed and writes a file there and removes it: a usage error naming `flag`
/// where that fails (read-only, not a folder, no permission, a full disk).
fn writable_dir(dir: &std::path::Path, flag: &str) -> Result<()> {
    match crate::output::probe_folder(dir) {
        Ok(()) => Ok(()),
        Err(err) => usage(format!("{flag} {}: cannot write there ({err}); choose another folder", dir.display())),
    }
}

/// How a job of `world` ranks divides the work: the exercise's layout, its replicas in the
/// shard groups `--shard-group` asks for.
fn job_layout<E: Experiment>(exp: &E, world: usize) -> Result<Layout> {
    exp.layout(world)?.with_shard_group(exp.parallel_args().shard_group)
}

/// The course's CPU-vs-GPU comparison: one process, one run per device, then the table.
fn run_per_device<E: Experiment>(exp: &E, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    let run = exp.run_args();
    // A missing GPU, or a precision a device cannot train in, is reported before any data is read.
    let devices = device::devices_for(run.device)?;
    for &device in &devices {
        run.precision.check(device)?;
    }
    let world = ProcessGroup::single();
    // (A layout one process cannot hold, `--tp 2` say, is refused here, before the data.)
    let groups = Groups::new(&world, job_layout(exp, 1)?)?;
    let mut session = session_observers(exp, true, listeners);
    if let Some(every) = run.course_log {
        session.add(train::sinks::CourseLog::new(0, 1, every, exp.metric(), exp.preset().script));
    }
    if let Some(warning) = device::set_threads(run.threads)? {
        session.warn(warning)?;
    }
    let data = exp.load(&mut session, true)?;
    let mut records = Vec::new();
    for device in devices {
        records.extend(train_on(exp, &data, Place { groups: &groups, run_part: None, device }, &mut session)?);
    }
    if records.is_empty() {
        return Ok(records); // --eval-only, or a finished run resumed: each device said why
    }
    let missing = (run.device == DeviceChoice::Both && !device::cuda_available()).then_some("no CUDA device on this machine; the run above is CPU only");
    if run.device == DeviceChoice::Both {
        // The course slide's bar chart (one bar where only the CPU ran).
        let path = crate::plots::devices_path(&run.results_dir, &records[0]);
        match crate::plots::device_comparison(&records, &path) {
            Ok(()) => session.info(format!("wrote the device comparison {}", path.display()))?,
            Err(err) => session.warn(format!("warning: {err:#}"))?,
        }
    }
    session.info(results::comparison(exp.preset(), &records, missing))?;
    Ok(records)
}

/// The observers of a process: the console on rank 0, and the caller's listeners.
fn session_observers<'a, E: Experiment>(exp: &E, root: bool, listeners: &'a mut Observers) -> Observers<'a> {
    let mut observers = Observers::new().with(Forward(listeners));
    if root {
        observers.add(ConsoleLog::new(exp.metric(), exp.preset().script));
    }
    observers
}

/// Passes events on to another set of observers.
struct Forward<'a, 'b>(&'a mut Observers<'b>);

impl Observer for Forward<'_, '_> {
    fn on_event(&mut self, event: &Event) -> Result<train::Control> {
        self.0.emit(event)
    }
}
