//! The pipeline-parallel language-model experiment behind `exercise3 pipeline`: the course's
//! 1.4B-parameter Transformer (12 layers, d_model 4096) cut into stages over several devices
//! and trained with micro-batches ([`crate::pipeline`]), with exercise1_nlp's recipe (SGD lr
//! 5.0, StepLR γ 0.95, gradient clipping 0.5) and flags.
use std::time::Instant;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{self, CheckpointMeta};
use crate::data::text::{Corpus, TokenBatches};
use crate::device::{self, DeviceChoice};
use crate::error::usage;
use crate::language_model::{self, LmArgs};
use crate::models::{self, TransformerConfig};
use crate::optim::{self, Optimizer, Sgd, SgdConfig};
use crate::pipeline::{self, LayerCosts, Partition, Pipeline, PipelineOptions, Schedule, Stage};
use crate::report::{self, RunInfo, RunRecord};
use crate::train::{BatchSource, EpochStats, FitReport, LrSchedule, Timings};
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
}

impl PipelineArgs {
    fn check(&self) -> Result<()> {
        self.lm.run.check()?;
        self.lm.check()?;
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

    /// The stages' devices: `--devices`, or two stages on what `--device` and the machine offer.
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

/// What a pass over a split measured.
struct Evaluation {
    loss: f64,
    accuracy: f64,
}

/// Mean next-token loss and accuracy of the pipeline over `source`, stage after stage without
/// gradients (evaluation needs no pipelining to be correct; it is a small share of the time).
fn evaluate(pipeline: &Pipeline, source: &TokenBatches) -> Evaluation {
    tch::no_grad(|| {
        let (mut loss_sum, mut hits, mut tokens) = (0.0, 0i64, 0usize);
        for batch in source.epoch(0) {
            let logits = pipeline.forward_t(&batch.inputs, false);
            let targets = batch.targets.to_device(logits.device()).reshape(batch.inputs.size());
            loss_sum += Stage::loss(&logits, &targets).double_value(&[]) * targets.numel() as f64;
            hits += logits.argmax(-1, false).eq_tensor(&targets).sum(Kind::Int64).int64_value(&[]);
            tokens += targets.numel();
        }
        let n = tokens.max(1) as f64;
        Evaluation { loss: loss_sum / n, accuracy: hits as f64 / n }
    })
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

/// The partition the flags ask for, printed with the measured costs when balancing.
fn partition(args: &PipelineArgs, cfg: &TransformerConfig, devices: &[Device]) -> Result<Partition> {
    let stages = devices.len();
    if !args.balance {
        return Partition::even(cfg.nlayers, stages);
    }
    Partition::even(cfg.nlayers, stages)?; // the same clear error for too many stages
    let micro_batch = (args.lm.batch_size as usize).div_ceil(args.chunks) as i64;
    let costs: LayerCosts = Stage::measure_costs(cfg, devices[0], args.lm.bptt, micro_batch);
    println!(
        "--balance: forward + backward of one micro-batch on {}: embedding {:.2} ms, each layer {:.2} ms, output layer {:.2} ms",
        device::device_name(devices[0]),
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
    fn add(&mut self, step: &pipeline::StepReport) {
        self.busy_s += step.traces.iter().map(|t| t.busy_s()).sum::<f64>();
        self.stage_time_s += step.traces.len() as f64 * step.wall_s;
    }

    fn fraction(&self) -> f64 {
        if self.stage_time_s > 0.0 {
            (1.0 - self.busy_s / self.stage_time_s).max(0.0)
        } else {
            f64::NAN
        }
    }
}

/// Runs exercise3 pipeline in this process: reads the corpus, builds the stages, trains,
/// evaluates, writes the results.
pub fn run(exercise: Exercise, args: &PipelineArgs) -> Result<RunRecord> {
    args.check()?;
    let devices = args.stage_devices()?;
    device::set_threads(args.lm.run.threads)?;
    let (corpus, unigram) = language_model::load_corpus(exercise, &args.lm)?;
    let cfg = args.lm.model_config(corpus.vocab.len() as i64);
    let partition = partition(args, &cfg, &devices)?;
    // CPU stages share the cores: each stage thread gets its share of LibTorch's threads.
    let threads_per_stage = devices.iter().all(|d| *d == Device::Cpu).then(|| (tch::get_num_threads() as usize / devices.len()).max(1));
    let options = PipelineOptions {
        schedule: args.schedule,
        chunks: args.chunks,
        checkpoint_activations: args.checkpoint_activations,
        threads_per_stage,
    };
    if devices.iter().any(|d| d.is_cuda()) {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    let mut pipeline = Pipeline::new(&cfg, &partition, &devices, args.lm.run.seed, options)?;
    let params: i64 = pipeline.stages.iter().map(|s| models::param_count(&s.vs)).sum();
    println!(
        "Transformer LM: {} layers, d_model {}, d_hid {}, {} heads, vocabulary {}: {} parameters; \
         {} stages, {} micro-batches per batch of {}, {} schedule{}",
        cfg.nlayers,
        cfg.d_model,
        cfg.d_hid,
        cfg.nhead,
        cfg.ntoken,
        report::group_thousands(params),
        devices.len(),
        args.chunks,
        args.lm.batch_size,
        args.schedule.name(),
        if args.checkpoint_activations { ", activations recomputed" } else { "" }
    );
    for stage in &pipeline.stages {
        let mut pieces = Vec::new();
        if stage.is_first() {
            pieces.push("embedding".to_string());
        }
        pieces.push(format!("layers {}..{}", stage.layer_range.start, stage.layer_range.end));
        if stage.is_last() {
            pieces.push("output layer".to_string());
        }
        println!(
            "  stage {} on {}: {}; {} parameters, {:.1} MiB (and as much again for their gradients)",
            stage.index,
            device::device_label(stage.device()),
            pieces.join(" + "),
            report::group_thousands(models::param_count(&stage.vs)),
            stage.parameter_bytes() as f64 / (1024.0 * 1024.0)
        );
    }
    let (history, fit, bubble) = train(exercise, args, &mut pipeline, &corpus)?;
    let test_data = TokenBatches::new(&corpus.test, args.lm.eval_batch_size, args.lm.bptt, devices[0]);
    let eval_start = Instant::now();
    let test = evaluate(&pipeline, &test_data);
    let theory = pipeline::schedule::theoretical_bubble(devices.len(), args.chunks);
    println!("end of training: test loss {:.4}, test perplexity {:.2}", test.loss, test.loss.exp());
    println!(
        "pipeline bubble: measured {:.1}% of the stages' time idle, theory (p−1)/(m+p−1) = {:.1}% for p = {}, m = {}",
        100.0 * bubble,
        100.0 * theory,
        devices.len(),
        args.chunks
    );
    let mut fit = fit;
    fit.timings.eval_s += eval_start.elapsed().as_secs_f64();
    let info = RunInfo {
        exercise: exercise.name.into(),
        model: "transformer".into(),
        params,
        device: devices[0],
        dataset: "wikitext2".into(),
        data_generated: corpus.generated,
        epochs: args.lm.run.epochs.unwrap_or(exercise.default_epochs),
        batch_size: args.lm.batch_size as usize,
        lr: args.lm.lr,
        optimizer: "sgd".into(),
        seed: args.lm.run.seed,
        world_size: 1,
    };
    let record = RunRecord::new(info, &fit, (test.loss, test.accuracy));
    let extra = serde_json::json!({
        "stages": devices.len(),
        "devices": devices.iter().map(|&d| device::device_label(d)).collect::<Vec<_>>(),
        "partition": partition.layers.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
        "stage_parameter_bytes": pipeline.stages.iter().map(Stage::parameter_bytes).collect::<Vec<_>>(),
        "chunks": args.chunks,
        "schedule": args.schedule,
        "checkpoint_activations": args.checkpoint_activations,
        "bubble_fraction": bubble,
        "bubble_fraction_theory": theory,
        "test_ppl": test.loss.exp(),
        "valid_ppl": fit.eval_loss.exp(),
        "unigram_test_ppl": unigram,
        "throughput_unit": "tokens/s",
        "vocab": cfg.ntoken,
        "bptt": args.lm.bptt,
        "model_config": cfg,
        "history": history,
    });
    let path = report::save(&args.lm.run.results_dir, &record, extra)?;
    println!("{}", report::time_split(&record));
    println!("wrote {}", path.display());
    Ok(record)
}

/// The training epochs: returns the per-epoch history, the totals as a [`FitReport`], and the
/// measured bubble fraction (the first step, a warm-up, left out when there are others).
fn train(exercise: Exercise, args: &PipelineArgs, pipeline: &mut Pipeline, corpus: &Corpus) -> Result<(Vec<EpochStats>, FitReport, f64)> {
    let first_device = pipeline.stages[0].device();
    let train_data = TokenBatches::new(&corpus.train, args.lm.batch_size, args.lm.bptt, first_device);
    let valid_data = TokenBatches::new(&corpus.valid, args.lm.eval_batch_size, args.lm.bptt, first_device);
    let named = pipeline.named_parameters();
    let params: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
    let mut optimizer = Sgd::new(named, SgdConfig { lr: args.lm.lr, ..SgdConfig::default() });
    let schedule = LrSchedule::Step { every: 1, gamma: args.lm.gamma };
    let epochs = args.lm.run.epochs.unwrap_or(exercise.default_epochs);
    let out_of_steps = |step: usize| args.lm.run.max_steps.is_some_and(|max| step >= max);
    // Checkpoints hold the variables under their whole-model names, whatever the partition:
    // a run resumes on another number of stages, and the model identity is exercise1_nlp's.
    let run = format!("{}-transformer-{}", exercise.name, device::device_name(first_device));
    let model_identity = serde_json::json!({ "transformer": pipeline.config, "tokenizer": args.lm.tokenizer.name() });
    let checkpoint_path = args.lm.run.checkpoint_dir.as_ref().map(|dir| checkpoint::path_for(dir, &run));
    let (mut start_epoch, mut step_count) = (0, 0);
    if let (Some(path), true) = (&checkpoint_path, args.lm.run.resume) {
        if path.exists() {
            let saved = checkpoint::load(path)?;
            saved.restore_variables(path, pipeline.named_parameters(), &mut optimizer, &model_identity)?;
            (start_epoch, step_count) = (saved.meta.epoch, saved.meta.step);
            println!("resumed {run} from {} after epoch {start_epoch} (step {step_count})", path.display());
        } else {
            println!("--resume: no checkpoint at {} yet, starting {run} from scratch", path.display());
        }
    }

    let mut history = Vec::new();
    let mut fit = FitReport {
        history: Vec::new(),
        resumed_epochs: 0,
        steps: 0,
        examples: 0,
        train_time_s: 0.0,
        timings: Timings::default(),
        eval_loss: f64::NAN,
        eval_acc: f64::NAN,
    };
    let (mut bubble, mut warm_bubble) = (BubbleMeter::default(), BubbleMeter::default());
    fit.resumed_epochs = start_epoch;
    for epoch in start_epoch..epochs {
        if out_of_steps(step_count) {
            break;
        }
        tch::manual_seed(args.lm.run.seed.wrapping_add(epoch as u64) as i64);
        let lr = schedule.lr(args.lm.lr, epoch);
        optimizer.set_lr(lr);
        let bar = progress_bar(!args.lm.run.quiet, format!("epoch {}/{epochs}", epoch + 1), train_data.batches_per_epoch());
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
            let step = pipeline.train_step(&batch.inputs, &targets)?;
            let t1 = Instant::now();
            if args.lm.clip > 0.0 {
                optim::clip_grad_norm(&params, args.lm.clip);
            }
            optimizer.step()?;
            for stage in &pipeline.stages {
                device::synchronize(stage.device());
            }
            let t2 = Instant::now();
            fit.timings.forward_backward_s += (t1 - t0).as_secs_f64();
            fit.timings.optimizer_s += (t2 - t1).as_secs_f64();
            if fit.steps == 0 {
                bubble.add(&step);
            } else {
                warm_bubble.add(&step);
            }
            loss_sum += step.loss * targets.numel() as f64;
            tokens += targets.numel();
            steps += 1;
            fit.steps += 1;
            step_count += 1;
            bar.inc(1);
            if steps % 10 == 1 {
                bar.set_message(format!("loss {:.4}  {:.0} tok/s", step.loss, tokens as f64 / epoch_start.elapsed().as_secs_f64()));
            }
        }
        bar.finish_and_clear();
        let train_time_s = epoch_start.elapsed().as_secs_f64();
        fit.train_time_s += train_time_s;
        fit.examples += tokens;
        let eval_start = Instant::now();
        let valid = evaluate(pipeline, &valid_data);
        fit.timings.eval_s += eval_start.elapsed().as_secs_f64();
        fit.eval_loss = valid.loss;
        fit.eval_acc = valid.accuracy;
        let train_loss = loss_sum / tokens.max(1) as f64;
        println!(
            "epoch {}/{epochs}: train loss {train_loss:.4}, valid loss {:.4} ppl {:.2}, {train_time_s:.1} s, {:.0} tokens/s, lr {lr:.4}",
            epoch + 1,
            valid.loss,
            valid.loss.exp(),
            tokens as f64 / train_time_s
        );
        history.push(EpochStats {
            epoch: epoch + 1,
            lr,
            steps,
            train_loss,
            train_acc: f64::NAN,
            eval_loss: valid.loss,
            eval_acc: valid.accuracy,
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
            };
            checkpoint::save_variables(path, pipeline.named_parameters(), &optimizer, &meta)?;
        }
    }
    let bubble = if warm_bubble.stage_time_s > 0.0 { warm_bubble.fraction() } else { bubble.fraction() };
    fit.history = history.clone();
    Ok((history, fit, bubble))
}

/// The course's pipeline model's defaults, for a binary to put on the flags it shares with
/// exercise1_nlp: 12 layers, d_model 4096, d_hid 4096, 16 heads.
pub const COURSE_DEFAULTS: [(&str, &str); 4] = [("emsize", "4096"), ("d_hid", "4096"), ("nhead", "16"), ("nlayers", "12")];
