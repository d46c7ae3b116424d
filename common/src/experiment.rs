//! What every exercise does around the training loop, written once: start the ranks, lay them
//! out, pick the device, load the data, build the step ([`crate::parallelize`]) and the
//! optimizer, train ([`crate::train::fit`]), test, and report. An exercise is an
//! [`Experiment`] (its data, model and results) plus a [`Preset`]; the image exercises are
//! [`crate::image_classification`], the language models [`crate::language_model`].
use anyhow::{Context, Result};
use serde::Serialize;
use tch::Device;

use crate::device::{self, DeviceChoice};
use crate::dist::layout::{Groups, Layout};
use crate::dist::zero::ZeroStage;
use crate::dist::{launch, Backend, CommStats, LaunchEnv, ProcessGroup};
use crate::error::usage;
use crate::flags::{ParallelArgs, RecipeArgs, RunArgs};
use crate::memory::estimate::RankEstimate;
use crate::memory::{self, MemoryMeter, ModelState, PeakMemory};
use crate::parallelize::{parallelize, DataParallelPlan, ModelPlan};
use crate::precision::Precision;
use crate::presets::Preset;
use crate::profile::libtorch::TorchProfiler;
use crate::report::{self, RunInfo, RunRecord};
use crate::train::sinks::{CheckpointEveryEpoch, ConsoleLog, ProfileSink, ProgressBars, StepLosses, TensorBoardLog};
use crate::train::{self, BatchSource, CheckpointConfig, EvalSums, Event, FitReport, LrSchedule, Metric, Observer, Observers, TrainConfig, Warmup};

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

    fn preset(&self) -> &Preset;
    fn run_args(&self) -> &RunArgs;
    fn recipe_args(&self) -> &RecipeArgs;
    fn parallel_args(&self) -> &ParallelArgs;
    /// The flags as given, for the checkpoint's record.
    fn flags_json(&self) -> serde_json::Value;

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
    fn model(&self, data: &Self::Data, groups: &Groups, device: Device, observers: &mut Observers) -> Result<ModelPlan>;
    /// Says what was built (every rank calls it: a model spread over ranks is described by
    /// gathering its parts; rank 0 speaks).
    fn describe(&self, plan: &ModelPlan, step: &dyn train::TrainStep<'_>, groups: &Groups, device: Device, observers: &mut Observers) -> Result<()>;
    /// What a checkpoint must have been written for to resume this run.
    fn model_identity(&self, plan: &ModelPlan) -> serde_json::Value;
    /// Training FLOPs per example.
    fn flops_per_example(&self, plan: &ModelPlan) -> f64;
    /// This replica's batches (`shard` = (replica, replicas)) on `device`.
    fn sources(&self, data: &Self::Data, device: Device, shard: (usize, usize)) -> Result<Sources>;
    fn data_generated(&self, data: &Self::Data) -> bool;
    /// The devices this process trains on (a pipeline's stages in one process: theirs): their
    /// peaks count for its MFU, their memory is measured.
    fn devices(&self, _plan: &ModelPlan, device: Device) -> Vec<Device> {
        vec![device]
    }
    /// What each kind of rank of a job of `world` ranks will hold (`--estimate-memory`), the
    /// device kind `cuda` (its kernels save differently); `observers` hear what was read.
    fn memory_estimate(&self, world: usize, cuda: bool, observers: &mut Observers) -> Result<Vec<RankEstimate>>;
    /// Lines to print and fields to add to the results after the test evaluation (rank 0).
    fn report(&self, data: &Self::Data, plan: &ModelPlan, fit: &FitReport, test: &EvalSums, device: Device) -> (Vec<String>, serde_json::Value);
}

/// Runs an exercise as the course does: with `--nproc-per-node`, a launcher or a data-parallel
/// preset as the ranks of one job, otherwise once per `--device` (CPU then GPU) with the
/// comparison table at the end. `listeners` hear every event of rank 0 (a notebook's
/// [`train::EventLog`], say) besides the console, progress bars, TensorBoard and profile
/// sinks the flags ask for. Returns rank 0's records.
pub fn run<E: Experiment>(exp: &E, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    let (run, parallel) = (exp.run_args(), exp.parallel_args());
    // Before the data are read: the data set counts in the peak memory's baseline.
    memory::count_cpu_tensors()?;
    device::keep_freed_host_memory();
    run.check()?;
    run.matmul_precision.apply()?;
    exp.recipe_args().check()?;
    parallel.check()?;
    exp.check()?;
    // Found before the first step, not after the last one (whose results would be lost).
    writable_dir(&run.results_dir, "--results-dir")?;
    if let Some(dir) = &run.checkpoint_dir {
        writable_dir(dir, "--checkpoint-dir")?;
    }
    let env = LaunchEnv::detect();
    // Once per job: by the process itself, or by rank 0 of the ranks a launcher starts.
    let speaks = match &env {
        Ok(env) if env.is_distributed() => env.rank == 0,
        _ => parallel.nproc_per_node.is_none() || run.estimate_memory,
    };
    if let Some(note) = Precision::legacy_name_note(std::env::args()).filter(|_| speaks) {
        session_observers(exp, true, listeners).info(note)?;
    }
    if run.estimate_memory {
        return estimate_memory(exp, listeners).map(|()| Vec::new());
    }
    if let Some(n) = parallel.nproc_per_node.filter(|_| !env.as_ref().is_ok_and(|env| env.is_distributed())) {
        // What the ranks would each refuse, said once, before mpirun starts them.
        let layout = exp.layout(n)?;
        if layout.dp > 1 && run.precision.weights_kind().is_some() && run.device == DeviceChoice::Cpu {
            return usage(crate::parallelize::cannot_average(run.precision, layout.dp, "mpi", Device::Cpu));
        }
        if let Some(warning) = check_rank_count(n, run.device, parallel.max_ranks_per_core)? {
            session_observers(exp, true, listeners).warn(warning)?;
        }
    }
    if launch::start_ranks_if_asked(parallel.nproc_per_node)? {
        return Ok(Vec::new());
    }
    let env = env?;
    if exp.preset().per_device && !env.is_distributed() && parallel.backend == Backend::Auto {
        return run_per_device(exp, listeners);
    }
    // Errors on one rank abort every rank (MPI_Abort) instead of leaving the others waiting.
    ProcessGroup::run(parallel.backend, |world| {
        // Parameter-server hook (dist::parameter_server): the last --servers ranks serve and stop
        // here; the workers train as data-parallel replicas over a group of their own.
        let ps = crate::dist::parameter_server::Job::start(world, parallel.parameter_server())?;
        if let Some(job) = ps.as_ref().filter(|job| job.is_server()) {
            return job.serve().map(|()| Vec::new());
        }
        let world = ps.as_ref().map_or(world, |job| job.workers());
        let layout = exp.layout(world.world_size())?;
        let groups = Groups::new(world, layout)?.with_parameter_servers(ps.as_ref().map(|job| job.link()));
        let device = exp.device(&groups)?;
        run.precision.check(device)?;
        let mut session = session_observers(exp, world.is_root(), listeners);
        if run.threads == 0 && world.local_world_size() > 1 && device == Device::Cpu {
            // Ranks sharing a node share its cores (torchrun sets OMP_NUM_THREADS=1 for the same reason).
            device::set_threads((device::usable_cores() / world.local_world_size()).max(1))?;
        } else if let Some(warning) = device::set_threads(run.threads)? {
            session.warn(warning)?;
        }
        let data = exp.load(&mut session, world.is_root())?;
        let record = train_on(exp, &data, &groups, device, &mut session)?;
        if let (Some(record), true) = (&record, world.world_size() > 1) {
            let csv = run.results_dir.join(format!("{}.csv", exp.preset().name));
            if let Some(efficiency) = report::scaling_efficiency(&csv, record) {
                session.info(format!("scaling efficiency against the last 1-rank run: {:.1}%", 100.0 * efficiency))?;
            }
        }
        Ok(record.into_iter().collect())
    })
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
    let rows = exp.memory_estimate(world, cuda, &mut session)?;
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
    let json =
        serde_json::json!({ "run": name, "world_size": world, "device": device, "precision": run.precision.name(), "flags": exp.flags_json(), "ranks": rows });
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    session.info(format!("wrote {}", path.display()))
}

/// Where a run's checkpoints go and what it starts from: (folder, resume, a file to start from)
/// for --checkpoint-dir, --resume and --eval-only's --checkpoint FILE.
fn checkpoint_config(run: &RunArgs) -> Option<(std::path::PathBuf, bool, Option<std::path::PathBuf>)> {
    match (&run.checkpoint, &run.checkpoint_dir) {
        (Some(file), dir) => {
            let beside = file.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
            Some((dir.clone().unwrap_or(beside), true, Some(file.clone())))
        }
        (None, Some(dir)) => Some((dir.clone(), run.resume, None)),
        (None, None) => None,
    }
}

/// A split too small for one full batch per replica trains nothing (and would report success,
/// a perplexity of 1) or trains a smaller batch than asked for: a usage error naming its size
/// and the batch instead.
fn check_batches<E: Experiment>(exp: &E, sources: &Sources, replicas: usize) -> Result<()> {
    let unit = match exp.metric() {
        Metric::Accuracy => "images",
        Metric::Perplexity => "tokens",
    };
    let batch = RunRecipe::resolve(exp.preset(), exp.recipe_args(), replicas, 1, 1).batch_size;
    if sources.train.batches_per_epoch() == 0 || sources.examples_per_epoch < batch * replicas {
        return usage(format!(
            "the training split ({} {unit}) holds no full batch of --batch-size {batch} for each of {replicas} replica(s): lower --batch-size, or use a larger data set",
            sources.examples_per_epoch
        ));
    }
    let evaluated = [Some(&sources.eval), sources.test.as_ref()];
    if evaluated.into_iter().flatten().any(|source| source.batches_per_epoch() == 0) {
        return usage(format!(
            "an evaluation split holds no batch for each of {replicas} replica(s): lower the batch size (--eval-batch-size for a language model)"
        ));
    }
    Ok(())
}

/// Creates `dir` if needed and writes a file there and removes it: a usage error naming `flag`
/// where that fails (read-only, not a folder, no permission, a full disk).
fn writable_dir(dir: &std::path::Path, flag: &str) -> Result<()> {
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&probe, b"x")).and_then(|()| std::fs::remove_file(&probe));
    match written {
        Ok(()) => Ok(()),
        Err(err) => usage(format!("{flag} {}: cannot write there ({err}); choose another folder", dir.display())),
    }
}

/// How many local ranks `--nproc-per-node` may start: no more GPU ranks than GPUs (NCCL takes
/// one GPU per rank); CPU ranks beyond the cores take turns (a warning), beyond
/// `max_per_core` per core they are refused: every rank is a LibTorch process with its own
/// memory, and a thousand of them end with the OOM killer.
fn check_rank_count(n: usize, choice: DeviceChoice, max_per_core: usize) -> Result<Option<String>> {
    let on_gpus = match choice {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Both => device::cuda_available(),
    };
    if on_gpus {
        let gpus = tch::Cuda::device_count().max(0) as usize;
        if n > gpus {
            return usage(format!(
                "--nproc-per-node {n}: this node has {gpus} GPU(s), and each rank needs its own (NCCL refuses two ranks on one GPU); use --nproc-per-node {} or --device cpu",
                gpus.max(1)
            ));
        }
        return Ok(None);
    }
    let cores = device::usable_cores();
    if n > max_per_core * cores {
        return usage(format!(
            "--nproc-per-node {n}: more than {max_per_core} CPU ranks per core on {cores} core(s), each a LibTorch process with its own memory; \
             use fewer, or raise --max-ranks-per-core"
        ));
    }
    Ok((n > cores).then(|| format!("warning: {n} CPU ranks on {cores} core(s): they take turns (right for testing, slow for timing)")))
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
    let groups = Groups::single(&world);
    let mut session = session_observers(exp, true, listeners);
    if let Some(warning) = device::set_threads(run.threads)? {
        session.warn(warning)?;
    }
    let data = exp.load(&mut session, true)?;
    let mut records = Vec::new();
    for device in devices {
        records.extend(train_on(exp, &data, &groups, device, &mut session)?);
    }
    if records.is_empty() {
        return Ok(records); // --eval-only: each device said its figures
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
    session.info(report::comparison_table(&records, missing))?;
    Ok(records)
}

/// The observers of a process: the console on rank 0, and the caller's listeners.
fn session_observers<'a, E: Experiment>(exp: &E, root: bool, listeners: &'a mut Observers) -> Observers<'a> {
    let mut observers = Observers::new().with(Forward(listeners));
    if root {
        observers.add(ConsoleLog::new(exp.metric()));
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

/// Measures what one training step moves: the collectives of all of this rank's groups between
/// the first and the last step's end of the first epoch (no evaluation or checkpoint between).
struct StepTraffic<'g> {
    groups: &'g Groups<'g>,
    /// The first step's number and the counts at its end.
    first: Option<(usize, CommStats)>,
    /// The first epoch has ended.
    done: bool,
    per_step: std::rc::Rc<std::cell::Cell<Option<CommStats>>>,
}

impl Observer for StepTraffic<'_> {
    fn on_event(&mut self, event: &Event) -> Result<train::Control> {
        match (event, self.first) {
            (Event::Step(_), _) if self.done => {}
            (Event::Step(step), None) => self.first = Some((step.step, self.groups.comm_stats())),
            (Event::Step(step), Some((first, at_first))) if step.step > first => {
                let steps = (step.step - first) as u64;
                self.per_step.set(Some(self.groups.comm_stats().since(at_first).per(steps)));
            }
            (Event::EpochEnded { .. }, Some(_)) => self.done = true,
            _ => {}
        }
        Ok(train::Control::Continue)
    }
}

/// What `--cuda-graph` cannot record, refused before anything trains: a step that communicates
/// (ranks), waits for the host (float16's scaler, `--profile`) or runs several batches.
fn check_cuda_graph<E: Experiment>(exp: &E, groups: &Groups, device: Device, recipe: &RunRecipe) -> Result<()> {
    let run = exp.run_args();
    if !device.is_cuda() {
        return usage(format!("--cuda-graph records GPU work, but this run trains on {}: drop it, or train on a GPU", device::device_name(device)));
    }
    if groups.world.world_size() > 1 {
        return usage("--cuda-graph records one process's step; with several ranks (their collectives) it is not supported yet");
    }
    if recipe.accumulate > 1 {
        return usage("--cuda-graph records a step of one batch: drop --accumulate (or use a larger --batch-size)");
    }
    if run.precision == Precision::Half {
        return usage("--cuda-graph with --precision 16-mixed (its scaler decides on the host) is not supported: use bf16-mixed or 32");
    }
    if run.profiling().is_some() {
        return usage("--cuda-graph replays the whole step at once: --profile cannot time its phases");
    }
    Ok(())
}

/// What ZeRO does not cover (yet), refused before anything trains.
fn check_zero<E: Experiment>(exp: &E, stage: ZeroStage, groups: &Groups) -> Result<()> {
    use crate::optim::OptimizerKind;
    let (run, recipe) = (exp.run_args(), exp.recipe_args());
    let n = stage.number();
    let optimizer = recipe.optimizer.unwrap_or(exp.preset().recipe_for(recipe).optimizer);
    if matches!(optimizer, OptimizerKind::Lars | OptimizerKind::Lamb) {
        return usage(format!("--zero {n} shards element-wise optimizers (adam, sgd); {} needs whole layers", optimizer.name()));
    }
    if run.precision == Precision::Half {
        return usage(format!("--zero {n} with --precision 16-mixed (a gradient scaler over the shards) is not built yet: use bf16-mixed or 32"));
    }
    if run.precision.weights_kind().is_some() {
        return usage(format!("--zero {n} with --precision {} (shards of 16-bit weights) is not built yet: use bf16-mixed", run.precision.name()));
    }
    if stage != ZeroStage::OptimizerState && groups.layout.pp * groups.layout.tp > 1 {
        return usage(format!("--zero {n} is for whole models on each replica; with pipeline stages or tensor-parallel shards use --zero 1"));
    }
    Ok(())
}

/// One training run on `device`: the step, the optimizer, the loop, the test, the results
/// (rank 0's record).
fn train_on<E: Experiment>(exp: &E, data: &E::Data, groups: &Groups, device: Device, session: &mut Observers) -> Result<Option<RunRecord>> {
    let (run, preset, root) = (exp.run_args(), exp.preset(), groups.is_root());
    if device.is_cuda() {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    if root && run.precision == Precision::Full && run.matmul_precision != Default::default() {
        let what = match run.matmul_precision {
            crate::precision::MatmulPrecision::Medium => "bfloat16 inner products allowed",
            _ => "TF32 tensor cores where the GPU has them",
        };
        session.info(format!(
            "[{}] --matmul-precision {}: float32 matrix products with {what} (LibTorch's setting: {})",
            device::device_name(device),
            run.matmul_precision.name(),
            crate::torch_ext::float32_matmul_precision()
        ))?;
    }
    let plan = exp.model(data, groups, device, session)?;
    let zero = exp.parallel_args().zero_stage();
    if let Some(stage) = zero {
        check_zero(exp, stage, groups)?;
    }
    let sync = zero.map_or(preset.sync, crate::dist::GradientSync::Zero);
    // Parameter-server hook: the workers do not average among themselves.
    let ps = groups.parameter_servers();
    let sync = if ps.is_some() { crate::dist::GradientSync::ParameterServer } else { sync };
    let dp = DataParallelPlan { averager: exp.parallel_args().averager(), sync };
    let replicas = groups.layout.dp;
    let sources = exp.sources(data, device, (groups.coords.replica, replicas))?;
    check_batches(exp, &sources, replicas)?;
    // Peak memory from here, the data in place: the model's state, activations and temporaries.
    let meter = std::cell::RefCell::new(MemoryMeter::start(&exp.devices(&plan, device))?);
    let mut step = parallelize(&plan, groups, dp, device, run.seed, run.precision, session)?;
    exp.describe(&plan, step.as_ref(), groups, device, session)?;
    let recipe = RunRecipe::resolve(preset, exp.recipe_args(), replicas, sources.train.batches_per_epoch(), run.epochs.unwrap_or(preset.epochs));
    let build = |named| recipe.optimizer.build(named, recipe.lr, recipe.momentum, recipe.weight_decay, exp.recipe_args().optimizer_kernel);
    let mut optimizer = match step.parallel().replicas {
        Some(replication) => replication.distribute(step.as_ref(), build)?,
        None => build(step.named_parameters()),
    };
    // Parameter-server hook: the step pulls at each epoch's end, the optimizer runs on the servers.
    if let Some(link) = &ps {
        link.check(&plan, groups.layout.pp * groups.layout.tp, run.precision, run.cuda_graph)?;
        step = link.step(step);
        let kernel = exp.recipe_args().optimizer_kernel;
        optimizer = link.optimizer(step.named_parameters(), recipe.optimizer, recipe.lr, recipe.momentum, recipe.weight_decay, kernel);
    }
    // --straggler: this rank sleeps in every step (any strategy).
    optimizer = crate::dist::parameter_server::Straggled::wrap(optimizer, exp.parallel_args().straggler, groups.world.rank());
    // --cuda-graph records GPU steps; the CPU leg of a CPU-vs-GPU comparison trains as usual.
    let cuda_graph = run.cuda_graph && (device.is_cuda() || run.device == DeviceChoice::Cpu);
    if cuda_graph {
        check_cuda_graph(exp, groups, device, &recipe)?;
        optimizer.make_capturable()?;
    }
    let name = format!("{}-{}-{}", preset.name, exp.model_name(), device::device_name(device));
    let config = TrainConfig {
        run: name.clone(),
        epochs: recipe.epochs,
        max_steps: run.max_steps,
        seed: run.seed,
        lr_schedule: recipe.schedule,
        accumulate: recipe.accumulate,
        clip_grad_norm: (recipe.clip > 0.0).then_some(recipe.clip),
        checkpoint: checkpoint_config(run).map(|(dir, resume, from)| CheckpointConfig {
            dir,
            resume,
            model: exp.model_identity(&plan),
            config: exp.flags_json(),
            from,
            keep: run.keep_checkpoints,
        }),
        metric: exp.metric(),
        precision: run.precision,
        profile: run.profiling().is_some(),
        steady_after: run.steady_after,
        cuda_graph,
        eval_only: run.eval_only,
    };
    let mut observers = Observers::new().with(Forward(session)).with(CheckpointEveryEpoch);
    if root && !run.quiet {
        observers.add(ProgressBars::new());
    }
    if let (Some(dir), true) = (&run.tensorboard, root) {
        observers.add(TensorBoardLog::new(&dir.join(&name), exp.metric())?);
    }
    if let Some(window) = run.profiling() {
        // A model spread over ranks: traces per rank; otherwise rank 0's.
        let spread = groups.layout.pp * groups.layout.tp > 1;
        if spread || root {
            let rank = spread.then_some(groups.world.rank());
            let torch = TorchProfiler::new(window, device.is_cuda(), run.trace_path(&name, "torch-trace", rank));
            observers.add(ProfileSink::new(run.trace_path(&name, "trace", rank), torch, groups.world.rank(), root));
        }
    }
    let per_step = std::rc::Rc::new(std::cell::Cell::new(None));
    observers.add(StepTraffic { groups, first: None, done: false, per_step: per_step.clone() });
    observers.add(MemoryMeter::observer(&meter));
    let losses = StepLosses::new();
    let step_losses = losses.values();
    observers.add(losses);
    let before = groups.comm_stats();
    let fit = train::fit(step.as_mut(), optimizer.as_mut(), sources.train.as_ref(), sources.eval.as_ref(), &config, &mut observers)?;
    let communication = groups.comm_stats().since(before);
    // Parameter-server hook: every worker says it is done; worker 0 gets the servers' figures.
    let ps_report = ps.as_ref().map(|link| link.finish()).transpose()?.flatten();
    drop(observers);
    let per_step: Option<CommStats> = per_step.get();
    let replica_group = step.parallel().replica_group();
    if let Some(group) = replica_group {
        step.materialize()?;
        train::check_replicas_agree(&step.named_variables(), group)?;
        step.release(false)?;
    }
    let memory = ModelState::measure(&step.named_parameters(), &step.frozen_parameters(), optimizer.as_ref(), replicas, zero);
    let peaks = memory::gather(&meter.borrow().peaks(groups.world.rank())?, groups.world)?; // a collective: every rank
    let params = step_parameter_count(groups, step.as_ref())?; // a collective: every rank
    let mut fit = fit;
    let test = match &sources.test {
        Some(test) => {
            let started = std::time::Instant::now();
            let sums = step.evaluate(test.as_ref(), run.precision)?.over(replica_group)?;
            fit.timings.eval_s += started.elapsed().as_secs_f64();
            sums
        }
        None => EvalSums { loss_sum: fit.eval_loss, hits: fit.eval_acc, examples: 1.0 },
    };
    if !root {
        return Ok(None);
    }
    if run.eval_only {
        return report_evaluation(exp, data, &plan, &fit, &test, device, &name, session).map(|()| None);
    }
    if let Some(group) = replica_group {
        session.info(format!("parameters bit-identical on all {} ranks after training", group.world_size()))?;
    }
    if groups.world.world_size() > 1 {
        session.info(format!("rank 0's communication in training and evaluation: {}", communication.describe()))?;
        if let Some(per_step) = per_step {
            session.info(format!("rank 0's communication per training step: {}", per_step.describe()))?;
        }
    }
    session.info(memory.describe(device))?;
    session.info(format!("peak memory in training: {}", peaks.iter().map(PeakMemory::describe).collect::<Vec<_>>().join("; ")))?;
    let peak = crate::flops::peak_tflops(device, run.precision, run.matmul_precision, run.peak_tflops);
    if let Some((peak, source)) = &peak {
        session.info(format!("[{}] peak {peak:.1} TFLOP/s per device ({source})", device::device_name(device)))?;
    }
    let info = RunInfo {
        exercise: preset.name.into(),
        model: exp.model_name(),
        params,
        device,
        dataset: exp.dataset_name(),
        data_generated: exp.data_generated(data),
        epochs: recipe.epochs,
        batch_size: recipe.batch_size,
        lr: recipe.lr,
        optimizer: optimizer.name().into(),
        seed: run.seed,
        world_size: groups.world.world_size(),
        precision: run.precision,
        flops_per_example: exp.flops_per_example(&plan),
        peak_tflops: peak.map(|(p, _)| p * exp.devices(&plan, device).len() as f64),
    };
    let mut record = RunRecord::new(info, &fit, (test.mean_loss(), test.accuracy()));
    record.peak_memory_bytes = peaks.iter().map(PeakMemory::peak_bytes).max();
    let (lines, extra) = exp.report(data, &plan, &fit, &test, device);
    for line in lines {
        session.info(line)?;
    }
    session.info(report::compute_summary(&record, sources.examples_per_epoch))?;
    let csv = run.results_dir.join(format!("{}.csv", preset.name));
    let mut json = serde_json::json!({
        "history": fit.history,
        // Every step's mean loss on rank 0's replica (after a resume: the steps this run took).
        "step_losses": step_losses.borrow().clone(),
        "resumed_epochs": fit.resumed_epochs,
        "world_size": groups.world.world_size(),
        "layout": groups.layout,
        "dp": replicas,
        "per_rank_batch": recipe.batch_size,
        "accumulate": recipe.accumulate,
        "global_batch": recipe.batch_size * recipe.accumulate * replicas,
        // The training split's size: a whole epoch's time from the throughput, also when
        // --max-steps stopped the run inside its first epoch (the scaling study's column).
        "examples_per_epoch": sources.examples_per_epoch,
        "lr_schedule": recipe.schedule,
        "allreduce_time_s": fit.timings.allreduce_s,
        "scaling_efficiency": report::scaling_efficiency(&csv, &record),
        // Rank 0's collectives and messages during training and its evaluations, and in one
        // training step (between two steps' ends; none after fewer than two steps).
        "communication": communication,
        "communication_per_step": per_step,
        "zero": exp.parallel_args().zero,
        "model_state_memory": memory,
        "peak_memory": peaks,
    });
    if replicas > 1 {
        let parallel = exp.parallel_args();
        json["backend"] = groups.world.describe().into();
        json["gradient_sync"] = serde_json::to_value(preset.sync)?;
        json["bucket_mb"] = parallel.bucket_mb.into();
        json["fp16_allreduce"] = parallel.fp16_allreduce.into();
    }
    // Parameter-server hook: the strategy and the servers' staleness figures.
    if let Some(report) = &ps_report {
        session.info(report.describe())?;
        json["gradient_sync"] = "parameter-server".into();
        json["parameter_server"] = serde_json::to_value(report)?;
    }
    json["matmul_precision"] = run.matmul_precision.name().into();
    json["scale_lr"] = exp.recipe_args().scale_lr.into();
    json["warmup_epochs"] = exp.recipe_args().warmup_epochs.into();
    if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        object.extend(extra);
    }
    let saved = report::save(&run.results_dir, &record, json)?;
    match &saved.curves {
        Ok(svg) => session.info(format!("wrote the training curves {}", svg.display()))?,
        Err(err) => session.warn(format!("warning: {err:#}"))?,
    }
    session.info(report::time_split(&record))?;
    session.info(format!("wrote {}", saved.json.display()))?;
    if !preset.per_device || groups.world.world_size() > 1 {
        session.info(report::comparison_table(std::slice::from_ref(&record), None))?;
    }
    Ok(Some(record))
}

/// `--eval-only`'s report: the exercise's own lines on the test split, one line with the
/// figures, and `<results>/<run>.eval-only.json` (the training run's results stay as they are).
#[allow(clippy::too_many_arguments)]
fn report_evaluation<E: Experiment>(
    exp: &E,
    data: &E::Data,
    plan: &ModelPlan,
    fit: &FitReport,
    test: &EvalSums,
    device: Device,
    name: &str,
    session: &mut Observers,
) -> Result<()> {
    let run = exp.run_args();
    let (lines, extra) = exp.report(data, plan, fit, test, device);
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
        "test_loss": loss, "test_acc": if accuracy.is_finite() { Some(accuracy) } else { None }, "eval_loss": fit.eval_loss, "flags": exp.flags_json(),
    });
    if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        object.extend(extra);
    }
    let path = run.results_dir.join(format!("{name}.eval-only.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    session.info(format!("wrote {}", path.display()))
}

/// The model's parameters, counted where they live (every stage of a pipeline and every
/// tensor-parallel shard across ranks; what all shards hold whole, once).
fn step_parameter_count(groups: &Groups, step: &dyn train::TrainStep<'_>) -> Result<i64> {
    let mine = train::counted_parameters(step);
    let Some(model) = groups.model() else { return Ok(mine) };
    let mut total = tch::Tensor::from(mine as f64);
    model.all_reduce(&mut total, crate::dist::ReduceOp::Sum)?;
    Ok(total.double_value(&[]) as i64)
}

/// The recipe a run trains with: the preset's [`crate::presets::Recipe`] with the flags given,
/// the learning rate scaled and its schedule laid out over the run's steps.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RunRecipe {
    pub epochs: usize,
    pub batch_size: usize,
    pub accumulate: usize,
    pub optimizer: crate::optim::OptimizerKind,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub clip: f64,
    pub schedule: LrSchedule,
}

impl RunRecipe {
    /// `preset`'s recipe with `args` applied, for `replicas` data-parallel replicas whose
    /// epochs have `batches_per_epoch` batches each.
    pub fn resolve(preset: &Preset, args: &RecipeArgs, replicas: usize, batches_per_epoch: usize, epochs: usize) -> RunRecipe {
        let base = preset.recipe_for(args);
        // Linear scaling: the effective batch grows by --accumulate × replicas.
        let growth = (args.accumulate * replicas) as f64;
        let lr = args.lr.unwrap_or(base.lr) * if args.scale_lr { growth } else { 1.0 };
        let steps_per_epoch = batches_per_epoch.div_ceil(args.accumulate).max(1);
        let warmup_steps = args.warmup_steps.max(args.warmup_epochs * steps_per_epoch);
        let mut schedule = LrSchedule::new(args.lr_schedule.unwrap_or(base.schedule), epochs * steps_per_epoch);
        schedule.gamma = args.gamma.unwrap_or(base.gamma);
        schedule.warmup = match (warmup_steps, base.warmup_steps) {
            (0, 0) => None,
            (0, steps) => Some(Warmup { steps, start: args.warmup_start.unwrap_or(crate::presets::WARMUP_START) }),
            (steps, _) => Some(Warmup { steps, start: args.warmup_start.unwrap_or(1.0 / growth) }),
        };
        RunRecipe {
            epochs,
            batch_size: args.batch_size.unwrap_or(base.batch_size),
            accumulate: args.accumulate,
            optimizer: args.optimizer.unwrap_or(base.optimizer),
            lr,
            momentum: args.momentum.unwrap_or(base.momentum),
            weight_decay: args.weight_decay.unwrap_or(base.weight_decay),
            clip: args.clip.unwrap_or(base.clip),
            schedule,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::EXERCISE2;
    use crate::train::ScheduleKind;

    #[test]
    fn linear_scaling_and_warmup_follow_the_effective_batch() {
        // 2 replicas × --accumulate 4: an 8 times larger batch, so 8 times the rate, reached
        // after 2 epochs of 25 steps (100 batches / 4) from the small batch's rate.
        let args = RecipeArgs { accumulate: 4, scale_lr: true, warmup_epochs: 2, lr: Some(0.1), ..RecipeArgs::default() };
        let recipe = RunRecipe::resolve(&EXERCISE2, &args, 2, 100, 10);
        assert_eq!((recipe.lr, recipe.accumulate, recipe.batch_size), (0.8, 4, 100));
        assert_eq!(recipe.schedule.warmup, Some(Warmup { steps: 50, start: 0.125 }));
        assert_eq!(recipe.schedule.total_steps, 250);
        assert!((recipe.schedule.lr(recipe.lr, 0, 0) - 0.1).abs() < 1e-12, "starts at the unscaled rate");
        assert!((recipe.schedule.lr(recipe.lr, 50, 2) - 0.8).abs() < 1e-12);
        // Without --scale-lr nothing is scaled; the preset fills what is not given.
        let plain = RunRecipe::resolve(&EXERCISE2, &RecipeArgs::default(), 4, 100, 10);
        assert_eq!((plain.lr, plain.schedule.kind, plain.schedule.warmup), (1e-3, ScheduleKind::Constant, None));
    }

    #[test]
    fn a_warmup_needs_to_know_where_it_starts() {
        let err = RecipeArgs { warmup_steps: 10, ..RecipeArgs::default() }.check().unwrap_err();
        assert!(format!("{err}").contains("use it with --scale-lr"), "{err}");
        assert!(RecipeArgs { warmup_steps: 10, warmup_start: Some(0.0), ..RecipeArgs::default() }.check().is_ok());
        let err = RecipeArgs { accumulate: 0, ..RecipeArgs::default() }.check().unwrap_err();
        assert!(format!("{err}").contains("--accumulate must be at least 1"));
        let one_cycle = RecipeArgs { scale_lr: true, warmup_epochs: 1, lr_schedule: Some(ScheduleKind::OneCycle), ..RecipeArgs::default() };
        assert!(format!("{}", one_cycle.check().unwrap_err()).contains("warms up by itself"));
    }

    #[test]
    fn cpu_ranks_beyond_the_cores_are_warned_about_and_beyond_the_limit_refused() {
        let cores = device::usable_cores();
        assert_eq!(check_rank_count(cores, DeviceChoice::Cpu, 4).unwrap(), None);
        let warning = check_rank_count(cores + 1, DeviceChoice::Cpu, 4).unwrap().unwrap();
        assert!(warning.contains(&format!("{} CPU ranks on {cores} core(s)", cores + 1)), "{warning}");
        assert!(check_rank_count(4 * cores, DeviceChoice::Cpu, 4).unwrap().is_some());
        let refused = check_rank_count(4 * cores + 1, DeviceChoice::Cpu, 4).unwrap_err();
        assert!(refused.is::<crate::error::UsageError>() && refused.to_string().contains("--max-ranks-per-core"), "{refused}");
        // Raised explicitly, the limit lets them start.
        assert!(check_rank_count(4 * cores + 1, DeviceChoice::Cpu, 5).is_ok());
    }

    #[test]
    fn more_gpu_ranks_than_gpus_are_refused() {
        let gpus = tch::Cuda::device_count() as usize;
        let err = check_rank_count(gpus + 1, DeviceChoice::Cuda, 4).unwrap_err();
        assert!(err.to_string().contains(&format!("this node has {gpus} GPU(s)")), "{err}");
    }
}
