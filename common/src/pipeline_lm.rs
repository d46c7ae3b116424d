//! The pipeline-parallel language-model experiment behind `exercise3 pipeline`: the course's
//! 1.4B-parameter Transformer (12 layers, d_model 4096) cut into stages over several devices
//! and trained with micro-batches ([`crate::pipeline`]), with exercise1_nlp's recipe (SGD lr
//! 5.0, StepLR γ 0.95, gradient clipping 0.5) and flags. The stages run as threads of this
//! process, or, started by a launcher (`--nproc-per-node`, mpirun, srun), one per process,
//! replicated `--dp` times.
use std::time::Instant;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tch::{Device, Tensor};

use crate::checkpoint::{self, CheckpointMeta};
use crate::data::text::{Corpus, TokenBatches};
use crate::device::{self, DeviceChoice};
use crate::dist::launch::{self, LaunchEnv};
use crate::dist::{Backend, ProcessGroup};
use crate::error::usage;
use crate::language_model::{self, LmArgs};
use crate::models::{self, TransformerConfig};
use crate::optim::{Optimizer, Sgd, SgdConfig};
use crate::pipeline::process::{Placement, StageProcess};
use crate::precision::Precision;
use crate::profile::Profiler;
use crate::tensorboard::SummaryWriter;
use crate::pipeline::{self, EvalSums, LayerCosts, Partition, Pipeline, PipelineOptions, PipelineTrainer, Schedule, Stage, StepReport};
use crate::flops;
use crate::report::{self, RunInfo, RunRecord};
use crate::train::{BatchSource, EpochStats, FitReport, LrSchedule};
use crate::Exercise;

/// exercise3 pipeline's flags: exercise1_nlp's, plus the pipeline's own.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct PipelineArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub lm: LmArgs,
    /// One device per stage, comma-separated: cpu, cuda, cuda:N (a device may repeat)
    /// [default: cuda:0,cuda:1 with two GPUs, cuda:0,cuda:0 with one, cpu,cpu without or with
    /// --device cpu].
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// Micro-batches per mini-batch (GPipe's `chunks`).
    #[arg(long, default_value_t = 8)]
    pub chunks: usize,
    /// gpipe: all forwards, then all backwards; 1f1b: alternate, holding fewer activations.
    #[arg(long, value_enum, default_value = "gpipe")]
    pub schedule: Schedule,
    /// Split the layers by their measured time (embedding and output layer included) instead
    /// of their number.
    #[arg(long)]
    pub balance: bool,
    /// Keep only each stage's input in the forward pass and recompute the rest in the backward
    /// (less memory, about one more forward pass of time).
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Data-parallel replicas of the pipeline when the stages run in separate processes (the
    /// job then has stages × dp ranks) [default: ranks / stages].
    #[arg(long)]
    pub dp: Option<usize>,
    /// Start N local ranks (through mpirun), one stage each: the cross-process pipeline.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Engine for the point-to-point messages and collectives: NCCL for CUDA tensors and MPI
    /// for CPU tensors (auto), or one of them.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
}

impl PipelineArgs {
    fn check(&self) -> Result<()> {
        self.lm.run.check()?;
        self.lm.check()?;
        if self.lm.run.precision == Precision::Half {
            return usage(
                "exercise3 pipeline trains in --precision 32 or bf16-mixed: float16 would need a gradient scaler \
                 agreed across the stages, which the pipeline does not have yet",
            );
        }
        if self.dp == Some(0) || self.nproc_per_node == Some(0) {
            return usage("--dp and --nproc-per-node must be at least 1");
        }
        if self.chunks == 0 {
            return usage("--chunks must be at least 1");
        }
        if self.chunks as i64 > self.lm.batch_size {
            return usage(format!(
                "--chunks {} is more than --batch-size {}: every micro-batch needs at least one sequence",
                self.chunks, self.lm.batch_size
            ));
        }
        Ok(())
    }

    /// The stages' devices in one process: `--devices`, or two stages on what `--device` and
    /// the machine offer.
    pub fn stage_devices(&self) -> Result<Vec<Device>> {
        if !self.devices.is_empty() {
            return Ok(self.devices.iter().map(|name| device::parse_device(name)).collect::<Result<_, _>>()?);
        }
        let gpus = if device::cuda_available() { tch::Cuda::device_count() } else { 0 };
        Ok(match (self.lm.run.device, gpus) {
            (DeviceChoice::Cpu, _) => vec![Device::Cpu; 2],
            (DeviceChoice::Cuda, 0) => return usage(device::no_cuda_message()),
            (_, 0) => vec![Device::Cpu; 2],
            (_, 1) => vec![Device::Cuda(0); 2],
            (_, _) => vec![Device::Cuda(0), Device::Cuda(1)],
        })
    }
}


/// Runs exercise3 pipeline: the stages as threads of this process, or, where a launcher started
/// several ranks (or `--nproc-per-node` starts them), one stage per rank.
pub fn run(exercise: Exercise, args: &PipelineArgs) -> Result<()> {
    args.check()?;
    if launch::start_ranks_if_asked(args.nproc_per_node)? {
        return Ok(());
    }
    if LaunchEnv::detect()?.is_distributed() {
        // Errors on one rank abort every rank (MPI_Abort) instead of leaving the others waiting.
        return ProcessGroup::run(args.backend, |group| run_in_processes(exercise, args, group));
    }
    run_in_one_process(exercise, args)
}

/// One stage as the run reports it.
#[derive(Debug, Clone, Serialize)]
struct StageSummary {
    stage: usize,
    device: String,
    layers: [i64; 2],
    parameters: i64,
    parameter_bytes: usize,
}

impl StageSummary {
    fn of(stage: &Stage) -> StageSummary {
        StageSummary {
            stage: stage.index,
            device: device::device_label(stage.device()),
            layers: [stage.layer_range.start, stage.layer_range.end],
            parameters: models::param_count(&stage.vs),
            parameter_bytes: stage.parameter_bytes(),
        }
    }

    fn print(&self, stages: usize) {
        let mut pieces = Vec::new();
        if self.stage == 0 {
            pieces.push("embedding".to_string());
        }
        pieces.push(format!("layers {}..{}", self.layers[0], self.layers[1]));
        if self.stage + 1 == stages {
            pieces.push("output layer".to_string());
        }
        println!(
            "  stage {} on {}: {}; {} parameters, {:.1} MiB (and as much again for their gradients)",
            self.stage,
            self.device,
            pieces.join(" + "),
            report::group_thousands(self.parameters),
            self.parameter_bytes as f64 / (1024.0 * 1024.0)
        );
    }
}

/// What the training loop and the report need besides the pipeline itself.
struct Setup<'a> {
    exercise: Exercise,
    args: &'a PipelineArgs,
    corpus: &'a Corpus,
    unigram: f64,
    cfg: TransformerConfig,
    partition: Partition,
    stages: Vec<StageSummary>,
    /// Where this process keeps the token streams (its stage's device).
    data_device: Device,
    /// Prints, writes the results (and checkpoints).
    root: bool,
    /// This process's replica and the number of replicas: each trains on its shard.
    shard: (usize, usize),
    world_size: usize,
    /// Whether this run can checkpoint (all stages in this process).
    checkpoints: bool,
    /// Distinct devices this process drives (for the MFU).
    devices_per_process: usize,
    /// This process's rank in the job (0 in one process).
    world_rank: usize,
}

fn run_in_one_process(exercise: Exercise, args: &PipelineArgs) -> Result<()> {
    if args.dp.is_some_and(|dp| dp > 1) {
        return usage("--dp replicates a pipeline whose stages run in separate processes: start them with --nproc-per-node (stages × dp) or a launcher");
    }
    let devices = args.stage_devices()?;
    device::set_threads(args.lm.run.threads)?;
    let (corpus, unigram) = language_model::load_corpus(exercise, &args.lm, true)?;
    let cfg = args.lm.model_config(corpus.vocab.len() as i64);
    let partition = partition(args, &cfg, devices.len(), devices[0])?;
    // CPU stages share the cores: each stage thread gets its share of LibTorch's threads.
    let threads_per_stage =
        devices.iter().all(|d| *d == Device::Cpu).then(|| (tch::get_num_threads() as usize / devices.len()).max(1));
    let options = PipelineOptions {
        schedule: args.schedule,
        chunks: args.chunks,
        checkpoint_activations: args.checkpoint_activations,
        threads_per_stage,
        precision: args.lm.run.precision,
    };
    if devices.iter().any(|d| d.is_cuda()) {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    let mut pipeline = Pipeline::new(&cfg, &partition, &devices, args.lm.run.seed, options)?;
    let setup = Setup {
        exercise,
        args,
        corpus: &corpus,
        unigram,
        cfg,
        partition,
        stages: pipeline.stages.iter().map(StageSummary::of).collect(),
        data_device: devices[0],
        root: true,
        shard: (0, 1),
        world_size: 1,
        checkpoints: true,
        devices_per_process: devices.iter().collect::<std::collections::HashSet<_>>().len(),
        world_rank: 0,
    };
    train_and_report(&setup, &mut pipeline)
}

fn run_in_processes(exercise: Exercise, args: &PipelineArgs, group: &ProcessGroup) -> Result<()> {
    if args.lm.run.checkpoint_dir.is_some() {
        return usage(
            "--checkpoint-dir: stages in separate processes do not checkpoint yet; run the stages in one process \
             (without a launcher) to checkpoint",
        );
    }
    let world = group.world_size();
    let stages = match (args.devices.len(), args.dp) {
        (0, Some(dp)) => world / dp.max(1),
        (0, None) => world,
        (n, _) => n,
    };
    let placement = Placement::of(group.rank(), world, stages, args.dp)?;
    let device = match (args.devices.get(placement.stage), args.lm.run.device) {
        (Some(name), _) => device::parse_device(name)?,
        (None, DeviceChoice::Cpu) => Device::Cpu,
        (None, DeviceChoice::Cuda) if !device::cuda_available() => return usage(device::no_cuda_message()),
        (None, _) => group.device(device::cuda_available()),
    };
    if args.lm.run.threads == 0 && group.local_world_size() > 1 && device == Device::Cpu {
        // Ranks sharing a node share its cores.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        device::set_threads((cores / group.local_world_size()).max(1))?;
    } else {
        device::set_threads(args.lm.run.threads)?;
    }
    let root = group.is_root();
    let (corpus, unigram) = language_model::load_corpus(exercise, &args.lm, root)?;
    let cfg = args.lm.model_config(corpus.vocab.len() as i64);
    // Every rank must cut the model alike: rank 0's partition (balanced by its measurements).
    let mine = if root { serde_json::to_vec(&partition(args, &cfg, stages, device)?)? } else { Vec::new() };
    let partition: Partition = serde_json::from_slice(&group.broadcast_bytes(&mine, 0)?)?;
    if device.is_cuda() {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    let range = partition.layers[placement.stage].clone();
    let stage = Stage::new(&cfg, placement.stage, stages, range, device, args.lm.run.seed);
    // Rank 0 reports every stage of its replica (ranks 0..stages).
    let me = StageSummary::of(&stage);
    let code = |d: Device| match d {
        Device::Cuda(i) => i as f64,
        _ => -1.0,
    };
    let all = group.all_gather(&Tensor::from_slice(&[me.parameters as f64, me.parameter_bytes as f64, code(device)]))?;
    let summaries = all[..stages]
        .iter()
        .enumerate()
        .map(|(s, t)| {
            let v = Vec::<f64>::try_from(t)?;
            let layers = &partition.layers[s];
            Ok(StageSummary {
                stage: s,
                device: if v[2] < 0.0 { "cpu".into() } else { format!("cuda:{} (rank {s})", v[2]) },
                layers: [layers.start, layers.end],
                parameters: v[0] as i64,
                parameter_bytes: v[1] as usize,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let options = PipelineOptions {
        schedule: args.schedule,
        chunks: args.chunks,
        checkpoint_activations: args.checkpoint_activations,
        threads_per_stage: None,
        precision: args.lm.run.precision,
    };
    let mut trainer = StageProcess::new(group, stage, placement, options)?;
    if root {
        println!(
            "{world} ranks: {} replica(s) of a {stages}-stage pipeline, rank r runs stage r mod {stages}; {}",
            placement.replicas,
            group.describe()
        );
    }
    let setup = Setup {
        exercise,
        args,
        corpus: &corpus,
        unigram,
        cfg,
        partition,
        stages: summaries,
        data_device: device,
        root,
        shard: (placement.replica, placement.replicas),
        world_size: world,
        checkpoints: false,
        devices_per_process: 1,
        world_rank: group.rank(),
    };
    train_and_report(&setup, &mut trainer)
}

fn progress_bar(show: bool, label: String, len: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(label);
    bar
}

/// The partition the flags ask for, printed with the measured costs when balancing (the costs
/// measured on `probe`, the first stage's device).
fn partition(args: &PipelineArgs, cfg: &TransformerConfig, stages: usize, probe: Device) -> Result<Partition> {
    let even = Partition::even(cfg.nlayers, stages)?; // also the clear error for too many stages
    if !args.balance {
        return Ok(even);
    }
    let micro_batch = (args.lm.batch_size as usize).div_ceil(args.chunks) as i64;
    let costs: LayerCosts = Stage::measure_costs(cfg, probe, args.lm.bptt, micro_batch);
    println!(
        "--balance: forward + backward of one micro-batch on {}: embedding {:.2} ms, each layer {:.2} ms, output layer {:.2} ms",
        device::device_label(probe),
        1e3 * costs.embedding,
        1e3 * costs.layers.first().copied().unwrap_or(0.0),
        1e3 * costs.head
    );
    Partition::balanced(&costs, stages)
}

/// Sums over training steps for the measured bubble.
#[derive(Default)]
struct BubbleMeter {
    busy_s: f64,
    stage_time_s: f64,
}

impl BubbleMeter {
    fn add(&mut self, step: &StepReport) {
        self.busy_s += step.stage_busy_s.iter().sum::<f64>();
        self.stage_time_s += step.stage_busy_s.len() as f64 * step.wall_s;
    }

    fn fraction(&self) -> f64 {
        if self.stage_time_s > 0.0 {
            (1.0 - self.busy_s / self.stage_time_s).max(0.0)
        } else {
            f64::NAN
        }
    }
}

/// This replica's equal share of a split's tokens (all of them with one replica).
fn shard(tokens: &Tensor, (index, count): (usize, usize)) -> Tensor {
    let len = tokens.numel() as i64 / count as i64;
    tokens.narrow(0, index as i64 * len, len)
}

/// Trains, evaluates on the test split, and (root) prints and writes the results.
fn train_and_report(setup: &Setup, trainer: &mut dyn PipelineTrainer) -> Result<()> {
    let args = setup.args;
    let stages = setup.stages.len();
    if setup.root {
        let params: i64 = setup.stages.iter().map(|s| s.parameters).sum();
        let cfg = &setup.cfg;
        println!(
            "Transformer LM: {} layers, d_model {}, d_hid {}, {} heads, vocabulary {}: {} parameters; \
             {stages} stages, {} micro-batches per batch of {}, {} schedule{}",
            cfg.nlayers,
            cfg.d_model,
            cfg.d_hid,
            cfg.nhead,
            cfg.ntoken,
            report::group_thousands(params),
            args.chunks,
            args.lm.batch_size,
            args.schedule.name(),
            if args.checkpoint_activations { ", activations recomputed" } else { "" }
        );
        setup.stages.iter().for_each(|s| s.print(stages));
    }
    let (fit, bubble) = train(setup, trainer)?;
    let test_data = TokenBatches::new(&shard(&setup.corpus.test, setup.shard), args.lm.eval_batch_size, args.lm.bptt, setup.data_device);
    let eval_start = Instant::now();
    let test = trainer.evaluate(&test_data)?;
    if !setup.root {
        return Ok(());
    }
    let mut fit = fit;
    fit.timings.eval_s += eval_start.elapsed().as_secs_f64();
    let theory = pipeline::schedule::theoretical_bubble(stages, args.chunks);
    println!("end of training: test loss {:.4}, test perplexity {:.2}", test.mean_loss(), test.mean_loss().exp());
    println!(
        "pipeline bubble: measured {:.1}% of the stages' time idle, theory (p−1)/(m+p−1) = {:.1}% for p = {stages}, m = {}",
        100.0 * bubble,
        100.0 * theory,
        args.chunks
    );
    let params: i64 = setup.stages.iter().map(|s| s.parameters).sum();
    let info = RunInfo {
        exercise: setup.exercise.name.into(),
        model: "transformer".into(),
        params,
        device: setup.data_device,
        dataset: "wikitext2".into(),
        data_generated: setup.corpus.generated,
        epochs: args.lm.run.epochs.unwrap_or(setup.exercise.default_epochs),
        batch_size: args.lm.batch_size as usize,
        lr: args.lm.lr,
        optimizer: "sgd".into(),
        seed: args.lm.run.seed,
        world_size: setup.world_size,
        precision: args.lm.run.precision,
        flops_per_example: flops::training_flops_per_token(&setup.cfg, args.lm.bptt),
        // Per process: the devices it drives (its stages' distinct devices in one process; one
        // stage's across processes) × one device's peak.
        peak_tflops: crate::image_classification::peak_tflops(setup.data_device, args.lm.run.precision, args.lm.run.peak_tflops, true)
            .map(|peak| peak * setup.devices_per_process as f64),
    };
    let record = RunRecord::new(info, &fit, (test.mean_loss(), test.accuracy()));
    println!("{}", report::compute_summary(&record, setup.corpus.train.numel()));
    let extra = serde_json::json!({
        "stages": stages,
        "dp": setup.shard.1,
        "devices": setup.stages.iter().map(|s| s.device.clone()).collect::<Vec<_>>(),
        "partition": setup.partition.layers.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
        "stage_parameter_bytes": setup.stages.iter().map(|s| s.parameter_bytes).collect::<Vec<_>>(),
        "chunks": args.chunks,
        "schedule": args.schedule,
        "checkpoint_activations": args.checkpoint_activations,
        "bubble_fraction": bubble,
        "bubble_fraction_theory": theory,
        "test_ppl": test.mean_loss().exp(),
        "valid_ppl": fit.eval_loss.exp(),
        "unigram_test_ppl": setup.unigram,
        "throughput_unit": "tokens/s",
        "vocab": setup.cfg.ntoken,
        "bptt": args.lm.bptt,
        "model_config": setup.cfg,
        "history": fit.history,
    });
    let path = report::save(&args.lm.run.results_dir, &record, extra)?;
    println!("{}", report::time_split(&record));
    println!("wrote {}", path.display());
    Ok(())
}

/// The training epochs: returns the totals as a [`FitReport`] (history included) and the
/// measured bubble fraction (the first step, a warm-up, left out when there are others).
fn train(setup: &Setup, trainer: &mut dyn PipelineTrainer) -> Result<(FitReport, f64)> {
    let args = setup.args;
    let exercise = setup.exercise;
    let train_data = TokenBatches::new(&shard(&setup.corpus.train, setup.shard), args.lm.batch_size, args.lm.bptt, setup.data_device);
    let valid_data = TokenBatches::new(&shard(&setup.corpus.valid, setup.shard), args.lm.eval_batch_size, args.lm.bptt, setup.data_device);
    let named = trainer.named_parameters();
    let params: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
    let mut optimizer = Sgd::new(named, SgdConfig { lr: args.lm.lr, ..SgdConfig::default() });
    let schedule = LrSchedule::Step { every: 1, gamma: args.lm.gamma };
    let epochs = args.lm.run.epochs.unwrap_or(exercise.default_epochs);
    let out_of_steps = |step: usize| args.lm.run.max_steps.is_some_and(|max| step >= max);
    let clip = (args.lm.clip > 0.0).then_some(args.lm.clip);

    // Checkpoints hold the variables under their whole-model names, whatever the partition:
    // a run resumes on another number of stages, and the model identity is exercise1_nlp's.
    let run = format!("{}-transformer-{}", exercise.name, device::device_name(setup.data_device));
    let model_identity = serde_json::json!({ "transformer": setup.cfg, "tokenizer": args.lm.tokenizer.name() });
    let checkpoint_path =
        args.lm.run.checkpoint_dir.as_ref().filter(|_| setup.checkpoints).map(|dir| checkpoint::path_for(dir, &run));
    let (mut start_epoch, mut step_count) = (0, 0);
    if let (Some(path), true) = (&checkpoint_path, args.lm.run.resume) {
        if path.exists() {
            let saved = checkpoint::load(path)?;
            saved.restore_variables(path, trainer.named_parameters(), &mut optimizer, &model_identity)?;
            (start_epoch, step_count) = (saved.meta.epoch, saved.meta.step);
            println!("resumed {run} from {} after epoch {start_epoch} (step {step_count})", path.display());
        } else {
            println!("--resume: no checkpoint at {} yet, starting {run} from scratch", path.display());
        }
    }

    let mut fit = FitReport::new(start_epoch);
    let (mut first_step, mut warm) = (BubbleMeter::default(), BubbleMeter::default());
    // --profile: every stage's forward (F<m>) and backward (B<m>) passes, one row per stage.
    let mut profiler = Profiler::new(args.lm.run.profile, setup.world_rank);
    let mut board = match (&args.lm.run.tensorboard, setup.root) {
        (Some(dir), true) => Some(SummaryWriter::new(&dir.join(&run))?),
        _ => None,
    };
    for epoch in start_epoch..epochs {
        if out_of_steps(step_count) {
            break;
        }
        tch::manual_seed(args.lm.run.seed.wrapping_add(epoch as u64) as i64);
        let lr = schedule.lr(args.lm.lr, epoch);
        optimizer.set_lr(lr);
        let label = format!("epoch {}/{epochs}", epoch + 1);
        let bar = progress_bar(setup.root && !args.lm.run.quiet, label, train_data.batches_per_epoch());
        let (mut loss_sum, mut tokens, mut steps) = (0.0, 0usize, 0usize);
        let epoch_start = Instant::now();
        let mut completed = true;
        for batch in train_data.epoch(epoch) {
            if out_of_steps(step_count) {
                completed = false;
                break;
            }
            let t0 = Instant::now();
            optimizer.zero_grad();
            let targets = batch.targets.reshape(batch.inputs.size());
            // Dropout keyed to (seed, step): the same masks whatever the stages and timing.
            let dropout_key = models::mix_key(&[args.lm.run.seed, step_count as u64]);
            let step = trainer.train_step(&batch.inputs, &targets, dropout_key)?;
            for trace in &step.traces {
                for interval in &trace.intervals {
                    let (name, m) = match interval.op {
                        pipeline::Op::Forward(m) => ("F", m),
                        pipeline::Op::Backward(m) => ("B", m),
                    };
                    let at = |s: f64| t0 + std::time::Duration::from_secs_f64(s.max(0.0));
                    profiler.record_on(format!("{name}{m}"), trace.stage, at(interval.start_s), at(interval.end_s), fit.steps);
                }
            }
            let t1 = Instant::now();
            trainer.finish_gradients(&params, clip)?;
            optimizer.step()?;
            device::synchronize(setup.data_device);
            let t2 = Instant::now();
            fit.timings.forward_backward_s += (t1 - t0).as_secs_f64();
            fit.timings.optimizer_s += (t2 - t1).as_secs_f64();
            match fit.steps {
                0 => first_step.add(&step),
                _ => warm.add(&step),
            }
            loss_sum += step.loss * targets.numel() as f64;
            tokens += targets.numel();
            steps += 1;
            fit.steps += 1;
            step_count += 1;
            bar.inc(1);
            if let Some(board) = board.as_mut().filter(|_| step_count % crate::train::TENSORBOARD_EVERY == 0) {
                board.add_scalar("train/loss", step.loss, step_count)?;
                board.add_scalar("train/lr", lr, step_count)?;
                board.add_scalar("train/bubble_fraction", step.bubble_fraction(), step_count)?;
            }
            if steps % 10 == 1 {
                let rate = (tokens * setup.shard.1) as f64 / epoch_start.elapsed().as_secs_f64();
                bar.set_message(format!("loss {:.4}  {rate:.0} tok/s", step.loss));
            }
        }
        bar.finish_and_clear();
        let train_time_s = epoch_start.elapsed().as_secs_f64();
        // Tokens of all replicas (each trained on its own shard).
        let all_tokens = tokens * setup.shard.1;
        fit.train_time_s += train_time_s;
        fit.examples += all_tokens;
        let eval_start = Instant::now();
        let valid: EvalSums = trainer.evaluate(&valid_data)?;
        fit.timings.eval_s += eval_start.elapsed().as_secs_f64();
        fit.eval_loss = valid.mean_loss();
        fit.eval_acc = valid.accuracy();
        let train_loss = loss_sum / tokens.max(1) as f64;
        if setup.root {
            println!(
                "epoch {}/{epochs}{}: train loss {train_loss:.4}, valid loss {:.4} ppl {:.2}, {train_time_s:.1} s, {:.0} tokens/s, lr {lr:.4}",
                epoch + 1,
                if completed { "" } else { " (stopped by --max-steps)" },
                fit.eval_loss,
                fit.eval_loss.exp(),
                all_tokens as f64 / train_time_s
            );
        }
        if let Some(board) = board.as_mut() {
            board.add_scalar("epoch/train_loss", train_loss, step_count)?;
            board.add_scalar("epoch/eval_loss", fit.eval_loss, step_count)?;
            board.add_scalar("epoch/eval_perplexity", fit.eval_loss.exp(), step_count)?;
            board.add_scalar("epoch/lr", lr, step_count)?;
            board.add_scalar("epoch/throughput", all_tokens as f64 / train_time_s, step_count)?;
            board.flush()?;
        }
        fit.history.push(EpochStats {
            epoch: epoch + 1,
            lr,
            steps,
            train_loss,
            train_acc: f64::NAN,
            eval_loss: fit.eval_loss,
            eval_acc: fit.eval_acc,
            train_time_s,
        });
        // Whole epochs only: a resume starts at an epoch boundary, where the data and dropout
        // streams are known.
        if let (Some(path), true) = (&checkpoint_path, completed) {
            let meta = CheckpointMeta {
                format: checkpoint::FORMAT_VERSION,
                run: run.clone(),
                model: model_identity.clone(),
                optimizer: optimizer.name().to_string(),
                epoch: epoch + 1,
                step: step_count,
                seed: args.lm.run.seed,
                config: serde_json::to_value(args).expect("flags serialise"),
                torch_version: crate::torch_version().to_string(),
                grad_scaler: None,
            };
            checkpoint::save_variables(path, trainer.named_parameters(), &optimizer, &meta)?;
        }
    }
    let bubble = if warm.stage_time_s > 0.0 { warm.fraction() } else { first_step.fraction() };
    if args.lm.run.profile {
        let path = args.lm.run.results_dir.join(format!("{run}-rank{}.trace.json", setup.world_rank));
        profiler.write_chrome_trace(&path)?;
        println!("wrote the Chrome trace of the stages' passes {} (one row per stage)", path.display());
    }
    Ok((fit, bubble))
}

/// The course's pipeline model's defaults, for a binary to put on the flags it shares with
/// exercise1_nlp: 12 layers, d_model 4096, d_hid 4096, 16 heads.
pub const COURSE_DEFAULTS: [(&str, &str); 4] = [("emsize", "4096"), ("d_hid", "4096"), ("nhead", "16"), ("nlayers", "12")];
