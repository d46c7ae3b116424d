//! The training loop every exercise uses: epochs of optimizer steps, evaluation without
//! gradients, a live progress bar, a timing split, and checkpoints at epoch ends.
//!
//! Resuming is exact: everything random in an epoch (order, augmentation, dropout) is a
//! function of (seed, epoch), and a checkpoint holds the whole model and optimizer state.
use crate::checkpoint::{self, CheckpointMeta};
use crate::device::synchronize;
use crate::optim::{self, Optimizer};
use crate::precision::{self, GradScaler, GradScalerState, Precision};
use crate::profile::Profiler;
use crate::tensorboard::SummaryWriter;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tch::{nn, Kind, Tensor};

/// One batch on the training device: model inputs and integer class (or next-token) targets.
#[derive(Debug)]
pub struct Batch {
    pub inputs: Tensor,
    pub targets: Tensor,
}

impl Batch {
    /// Examples (images, or tokens for a language model) in the batch.
    pub fn len(&self) -> usize {
        self.targets.numel()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Anything that yields an epoch of batches.
pub trait BatchSource {
    fn batches_per_epoch(&self) -> usize;
    /// The batches of epoch `epoch` (0-based), in a deterministic order.
    fn epoch(&self, epoch: usize) -> Box<dyn Iterator<Item = Batch> + '_>;
}

/// How the replicas of a data-parallel run agree (see `dist::data_parallel`); a single
/// process is [`SingleReplica`]. The loop calls it at the start, after every backward, and to
/// combine metrics, so the same loop trains one process or many.
pub trait Replicas {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn is_root(&self) -> bool {
        self.rank() == 0
    }
    /// Makes every replica start from rank 0's variables, optimizer state and progress
    /// (epochs, steps), which it returns on every rank.
    fn start_from_root(
        &self,
        vs: &nn::VarStore,
        optimizer: &mut dyn Optimizer,
        progress: (usize, usize),
    ) -> anyhow::Result<(usize, usize)>;
    /// The optimizer the loop steps: `optimizer` itself, or (Horovod style) a wrapper whose
    /// step averages the gradients of `params` over the replicas first.
    fn distribute_optimizer<'s>(&'s self, optimizer: Box<dyn Optimizer + 's>, params: Vec<Tensor>) -> Box<dyn Optimizer + 's> {
        let _ = params;
        optimizer
    }
    /// Averages the gradients of `params` over the replicas, after backward (DDP style; a
    /// no-op where [`Replicas::distribute_optimizer`] wrapped the optimizer to do it).
    fn average_gradients(&self, params: &[Tensor]) -> anyhow::Result<()>;
    /// Makes every replica's buffers (batch-norm statistics: each replica updates them from
    /// its own shard) rank 0's, before evaluating and checkpointing.
    fn sync_buffers(&self, vs: &nn::VarStore) -> anyhow::Result<()>;
    /// Element-wise sums of `values` over the replicas.
    fn sum(&self, values: &[f64]) -> anyhow::Result<Vec<f64>>;
    /// Every replica's `values`, in rank order.
    fn gather(&self, values: &[f64]) -> anyhow::Result<Vec<Vec<f64>>>;
}

/// A bitwise fingerprint of all variables (FNV-1a over their bytes, in name order), as two
/// exactly representable halves so that it travels through f64 collectives unchanged.
pub fn fingerprint(vs: &nn::VarStore) -> [f64; 2] {
    let mut vars: Vec<_> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, var) in vars {
        let var = var.detach().to_device(tch::Device::Cpu).contiguous();
        let mut bytes = vec![0u8; var.numel() * var.kind().elt_size_in_bytes()];
        var.copy_data_u8(&mut bytes, var.numel());
        for byte in bytes {
            hash = (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    [(hash >> 32) as f64, (hash & 0xffff_ffff) as f64]
}

/// Checks that every replica holds bit-identical variables (data parallelism's invariant);
/// an error names the ranks that diverged from rank 0.
pub fn check_replicas_agree(vs: &nn::VarStore, replicas: &dyn Replicas) -> anyhow::Result<()> {
    let all = replicas.gather(&fingerprint(vs))?;
    let diverged: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    anyhow::ensure!(diverged.is_empty(), "data-parallel replicas diverged: ranks {diverged:?} hold other parameters than rank 0");
    Ok(())
}

/// One process: nothing to agree on.
pub struct SingleReplica;

impl Replicas for SingleReplica {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn start_from_root(&self, _: &nn::VarStore, _: &mut dyn Optimizer, progress: (usize, usize)) -> anyhow::Result<(usize, usize)> {
        Ok(progress)
    }
    fn average_gradients(&self, _: &[Tensor]) -> anyhow::Result<()> {
        Ok(())
    }
    fn sync_buffers(&self, _: &nn::VarStore) -> anyhow::Result<()> {
        Ok(())
    }
    fn sum(&self, values: &[f64]) -> anyhow::Result<Vec<f64>> {
        Ok(values.to_vec())
    }
    fn gather(&self, values: &[f64]) -> anyhow::Result<Vec<Vec<f64>>> {
        Ok(vec![values.to_vec()])
    }
}

/// `--tensorboard` logs the training loss, learning rate and throughput every this many steps
/// (and every epoch's figures at its end).
pub const TENSORBOARD_EVERY: usize = 10;

/// Learning rate per epoch, relative to the optimizer's initial one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum LrSchedule {
    Constant,
    /// `StepLR`: multiply by `gamma` every `every` epochs.
    Step { every: usize, gamma: f64 },
    /// Gradual warm-up (Goyal et al. 2017): epoch `e < epochs` runs at
    /// `start + (1 − start)·e/epochs` of the learning rate, later epochs at all of it.
    Warmup { epochs: usize, start: f64 },
}

impl LrSchedule {
    pub fn lr(&self, base: f64, epoch: usize) -> f64 {
        match *self {
            LrSchedule::Constant => base,
            LrSchedule::Step { every, gamma } => base * gamma.powi((epoch / every.max(1)) as i32),
            LrSchedule::Warmup { epochs, start } if epoch < epochs => {
                base * (start + (1.0 - start) * epoch as f64 / epochs as f64)
            }
            LrSchedule::Warmup { .. } => base,
        }
    }
}

/// Where and whether a run checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    pub dir: PathBuf,
    /// Continue from the run's checkpoint in `dir` when there is one.
    pub resume: bool,
    /// Identity of the model (a resume must build the same one).
    pub model: serde_json::Value,
    /// The run's configuration, stored for the record.
    pub config: serde_json::Value,
}

/// How to train.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Name of the run, e.g. `exercise1-cnn-cpu` (checkpoint file name).
    pub run: String,
    pub epochs: usize,
    /// Stop after this many optimizer steps in total (smoke runs, benchmarks).
    pub max_steps: Option<usize>,
    pub seed: u64,
    pub lr_schedule: LrSchedule,
    pub clip_grad_norm: Option<f64>,
    pub checkpoint: Option<CheckpointConfig>,
    /// Show the progress bar (it hides itself anyway when stderr is not a terminal).
    pub progress: bool,
    /// Print one line per epoch.
    pub verbose: bool,
    /// What the epoch line reports besides the loss.
    pub metric: Metric,
    /// float32, or mixed precision (autocast, and a gradient scaler for float16).
    pub precision: Precision,
    /// `--profile`: where to write the Chrome trace (the table is printed too).
    pub profile: Option<PathBuf>,
    /// `--tensorboard`: the run's TensorBoard log directory.
    pub tensorboard: Option<PathBuf>,
}

/// The figure of merit printed beside the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Metric {
    /// Share of arg-max hits (image classification).
    Accuracy,
    /// exp(loss) (language modelling).
    Perplexity,
}

impl Metric {
    fn describe(self, loss: f64, acc: f64) -> String {
        match self {
            Metric::Accuracy => format!("loss {loss:.4} acc {acc:.4}"),
            Metric::Perplexity => format!("loss {loss:.4} ppl {:.2}", loss.exp()),
        }
    }
}

/// Wall-clock time split of the training steps, and evaluation.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timings {
    /// Waiting for the loader's next batch.
    pub data_wait_s: f64,
    pub forward_backward_s: f64,
    /// Averaging gradients over data-parallel replicas.
    pub allreduce_s: f64,
    /// Gradient clipping and the optimizer step.
    pub optimizer_s: f64,
    pub eval_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EpochStats {
    /// 1-based, as printed.
    pub epoch: usize,
    pub lr: f64,
    pub steps: usize,
    pub train_loss: f64,
    pub train_acc: f64,
    pub eval_loss: f64,
    pub eval_acc: f64,
    pub train_time_s: f64,
}

/// What a call of [`fit`] did.
#[derive(Debug, Clone, Serialize)]
pub struct FitReport {
    pub history: Vec<EpochStats>,
    /// Epochs completed before this process started (resumed runs).
    pub resumed_epochs: usize,
    /// Optimizer steps taken in this process.
    pub steps: usize,
    /// Examples trained on in this process, by all replicas together.
    pub examples: usize,
    /// Time in training steps (loader wait, forward, backward, optimizer), evaluation excluded.
    pub train_time_s: f64,
    pub timings: Timings,
    pub eval_loss: f64,
    pub eval_acc: f64,
}

impl FitReport {
    /// Nothing trained yet, `resumed_epochs` done before this process started.
    pub fn new(resumed_epochs: usize) -> FitReport {
        FitReport {
            history: Vec::new(),
            resumed_epochs,
            steps: 0,
            examples: 0,
            train_time_s: 0.0,
            timings: Timings::default(),
            eval_loss: f64::NAN,
            eval_acc: f64::NAN,
        }
    }

    /// Examples per second of training.
    pub fn throughput(&self) -> f64 {
        if self.train_time_s > 0.0 {
            self.examples as f64 / self.train_time_s
        } else {
            0.0
        }
    }
}

/// Mean cross-entropy over the last dimension of `logits` (classes, or vocabulary) and, when
/// asked, the number of arg-max hits (a pass over all logits: skipped in language-model
/// training, whose figure of merit is the perplexity).
fn loss_and_hits(logits: &Tensor, targets: &Tensor, count_hits: bool) -> (Tensor, Option<Tensor>) {
    let classes = *logits.size().last().expect("logits have a class dimension");
    let logits = logits.reshape([-1, classes]);
    let targets = targets.reshape([-1]);
    let loss = logits.cross_entropy_for_logits(&targets);
    let hits = count_hits.then(|| logits.argmax(-1, false).eq_tensor(&targets).sum(Kind::Int64));
    (loss, hits)
}

/// Loss and accuracy over one pass of `source` (each replica's shard of it, combined), in
/// evaluation mode and without gradients.
pub fn evaluate(
    model: &dyn nn::ModuleT,
    source: &dyn BatchSource,
    replicas: &dyn Replicas,
    precision: Precision,
) -> anyhow::Result<(f64, f64)> {
    let local = tch::no_grad(|| {
        let (mut loss_sum, mut hits, mut count) = (0.0, 0i64, 0usize);
        for batch in source.epoch(0) {
            let device = batch.inputs.device();
            let (loss, batch_hits) = precision::autocast(precision, device, || {
                let logits = model.forward_t(&batch.inputs, false);
                loss_and_hits(&logits, &batch.targets, true)
            });
            loss_sum += loss.double_value(&[]) * batch.len() as f64;
            hits += batch_hits.map_or(0, |h| h.int64_value(&[]));
            count += batch.len();
        }
        [loss_sum, hits as f64, count as f64]
    });
    let [loss_sum, hits, count] = replicas.sum(&local)?[..] else { unreachable!("three sums") };
    let n = count.max(1.0);
    Ok((loss_sum / n, hits / n))
}

/// Trains `model` on `train`, evaluating on `eval` after every epoch (the test set in the image
/// exercises, the validation split for the language model), from a checkpoint when asked to
/// resume and one exists.
pub fn fit(
    model: &dyn nn::ModuleT,
    vs: &nn::VarStore,
    optimizer: &mut dyn Optimizer,
    train: &dyn BatchSource,
    eval: &dyn BatchSource,
    config: &TrainConfig,
    replicas: &dyn Replicas,
) -> anyhow::Result<FitReport> {
    let device = vs.device();
    config.precision.check(device)?;
    let mut scaler = config.precision.needs_scaler().then(|| GradScaler::new(device));
    let mut saved_scaler = None;
    let base_lr = optimizer.lr();
    let root = replicas.is_root();
    let mut progress = (0, 0);
    // Rank 0 alone reads the checkpoint; every replica then starts from rank 0's state.
    if let Some(ck) = config.checkpoint.as_ref().filter(|ck| ck.resume && root) {
        let path = checkpoint::path_for(&ck.dir, &config.run);
        if path.exists() {
            let saved = checkpoint::load(&path)?;
            saved.restore(&path, vs, optimizer, &ck.model)?;
            progress = (saved.meta.epoch, saved.meta.step);
            saved_scaler = saved.meta.grad_scaler;
            println!("resumed {} from {} after epoch {} (step {})", config.run, path.display(), progress.0, progress.1);
        } else {
            println!("--resume: no checkpoint at {} yet, starting {} from scratch", path.display(), config.run);
        }
    }
    let (start_epoch, mut step) = replicas.start_from_root(vs, optimizer, progress)?;
    if let Some(scaler) = &mut scaler {
        // Rank 0's restored scale, on every replica (NaN: none saved, keep the initial one).
        let mine = saved_scaler.map_or([f64::NAN; 2], |s: GradScalerState| [s.scale, s.growth_tracker as f64]);
        let from_root = &replicas.gather(&mine)?[0];
        if !from_root[0].is_nan() {
            scaler.load_state(GradScalerState { scale: from_root[0], growth_tracker: from_root[1] as i64 });
        }
    }
    let params: Vec<Tensor> = vs.trainable_variables();
    let mut report = FitReport::new(start_epoch);
    let out_of_steps = |step: usize| config.max_steps.is_some_and(|max| step >= max);
    let mut profiler = Profiler::new(config.profile.is_some(), replicas.rank());
    let mut board = match (&config.tensorboard, root) {
        (Some(dir), true) => Some(SummaryWriter::new(dir)?),
        _ => None,
    };
    let mut last_logged = (Instant::now(), 0usize); // time and examples at the last step logged

    for epoch in start_epoch..config.epochs {
        if out_of_steps(step) {
            break;
        }
        // Dropout and any other LibTorch randomness: a function of (seed, epoch).
        tch::manual_seed(config.seed.wrapping_add(epoch as u64) as i64);
        let lr = config.lr_schedule.lr(base_lr, epoch);
        optimizer.set_lr(lr);
        let bar = progress_bar(config, root, epoch, train.batches_per_epoch());

        // Sums stay on the device: no extra host synchronisation per step.
        let mut loss_sum = Tensor::zeros([], (Kind::Double, device));
        let mut hits_sum = Tensor::zeros([], (Kind::Int64, device));
        let (mut seen, mut epoch_steps) = (0usize, 0usize);
        let epoch_start = Instant::now();
        let data_wait_before = report.timings.data_wait_s;
        let mut batches = train.epoch(epoch);
        let mut completed = true;
        loop {
            if out_of_steps(step) {
                completed = false;
                break;
            }
            let t0 = Instant::now();
            let Some(batch) = batches.next() else { break };
            let t1 = Instant::now();
            let (loss, batch_hits) = precision::autocast(config.precision, device, || {
                let logits = model.forward_t(&batch.inputs, true);
                loss_and_hits(&logits, &batch.targets, config.metric == Metric::Accuracy)
            });
            if profiler.enabled() {
                synchronize(device);
            }
            let t_forward = Instant::now();
            optimizer.zero_grad();
            match &scaler {
                Some(scaler) => scaler.scale(&loss).backward(),
                None => loss.backward(),
            }
            synchronize(device);
            let t2 = Instant::now();
            replicas.average_gradients(&params)?;
            optimizer.synchronize()?; // a distributed optimizer averages here, before clipping
            let t_avg = Instant::now();
            if let Some(scaler) = &scaler {
                scaler.unscale(&params);
            }
            if let Some(max_norm) = config.clip_grad_norm {
                optim::clip_grad_norm(&params, max_norm);
            }
            match &mut scaler {
                // An inf/NaN step is skipped (the same on every replica: the gradients were
                // averaged before the check).
                Some(scaler) => {
                    scaler.step(&params, || optimizer.step())?;
                    scaler.update();
                }
                None => optimizer.step()?,
            }
            synchronize(device);
            let t3 = Instant::now();

            for (phase, start, end) in
                [("data wait", t0, t1), ("forward", t1, t_forward), ("backward", t_forward, t2), ("all-reduce", t2, t_avg), ("optimizer", t_avg, t3)]
            {
                profiler.record(phase, start, end, step);
            }
            report.timings.data_wait_s += (t1 - t0).as_secs_f64();
            report.timings.forward_backward_s += (t2 - t1).as_secs_f64();
            report.timings.allreduce_s += (t_avg - t2).as_secs_f64();
            report.timings.optimizer_s += (t3 - t_avg).as_secs_f64();
            loss_sum += loss.detach().to_kind(Kind::Double) * batch.len() as f64;
            if let Some(batch_hits) = batch_hits {
                hits_sum += batch_hits;
            }
            seen += batch.len();
            epoch_steps += 1;
            step += 1;
            if let Some(board) = board.as_mut().filter(|_| step % TENSORBOARD_EVERY == 0) {
                // Every few steps only: reading the loss waits for the device.
                let examples = seen * replicas.world_size();
                let rate = examples.saturating_sub(last_logged.1) as f64 / last_logged.0.elapsed().as_secs_f64();
                board.add_scalar("train/loss", loss.double_value(&[]), step)?;
                board.add_scalar("train/lr", lr, step)?;
                board.add_scalar("train/throughput", rate, step)?;
                last_logged = (Instant::now(), examples);
            }
            if !bar.is_hidden() && (epoch_steps % 10 == 0 || epoch_steps == 1) {
                let rate = (seen * replicas.world_size()) as f64 / epoch_start.elapsed().as_secs_f64();
                bar.set_message(format!("loss {:.4}  {rate:.0}/s", loss.double_value(&[])));
            }
            bar.inc(1);
        }
        drop(batches);
        let train_time = epoch_start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        // Every replica's examples count: sum over the replicas.
        let local_hits = if config.metric == Metric::Accuracy { hits_sum.int64_value(&[]) as f64 } else { f64::NAN };
        let [loss_total, hits_total, seen_total] = replicas.sum(&[loss_sum.double_value(&[]), local_hits, seen as f64])?[..]
        else {
            unreachable!("three sums")
        };
        let n = seen_total.max(1.0);
        let train_loss = loss_total / n;

        replicas.sync_buffers(vs)?;
        let eval_start = Instant::now();
        let (eval_loss, eval_acc) = evaluate(model, eval, replicas, config.precision)?;
        synchronize(device);
        report.timings.eval_s += eval_start.elapsed().as_secs_f64();
        profiler.record("evaluation", eval_start, Instant::now(), step);

        last_logged = (Instant::now(), 0);
        if let Some(board) = board.as_mut() {
            board.add_scalar("epoch/train_loss", train_loss, step)?;
            board.add_scalar("epoch/eval_loss", eval_loss, step)?;
            match config.metric {
                Metric::Accuracy => board.add_scalar("epoch/eval_accuracy", eval_acc, step)?,
                Metric::Perplexity => board.add_scalar("epoch/eval_perplexity", eval_loss.exp(), step)?,
            }
            board.add_scalar("epoch/lr", lr, step)?;
            board.add_scalar("epoch/throughput", n / train_time.max(f64::EPSILON), step)?;
            board.flush()?;
        }
        let stats = EpochStats {
            epoch: epoch + 1,
            lr,
            steps: epoch_steps,
            train_loss,
            // Not counted in language-model training (NaN: null in the JSON).
            train_acc: hits_total / n,
            eval_loss,
            eval_acc,
            train_time_s: train_time,
        };
        if config.verbose && root {
            println!(
                "[{}] epoch {}/{}{}: {} steps in {:.1} s ({:.0}/s, data wait {:.1}%), lr {:.4}  train {}  eval {}",
                config.run,
                stats.epoch,
                config.epochs,
                if completed { "" } else { " (stopped by --max-steps)" },
                epoch_steps,
                train_time,
                n / train_time.max(f64::EPSILON),
                100.0 * (report.timings.data_wait_s - data_wait_before) / train_time.max(f64::EPSILON),
                lr,
                config.metric.describe(train_loss, stats.train_acc),
                config.metric.describe(eval_loss, eval_acc),
            );
        }
        report.steps += epoch_steps;
        report.examples += seen_total as usize;
        report.train_time_s += train_time;
        report.eval_loss = eval_loss;
        report.eval_acc = eval_acc;
        report.history.push(stats);

        // Only whole epochs are checkpointed: a resume then starts at an epoch boundary, where
        // the order, augmentation and dropout streams are known.
        if let (Some(ck), true, true) = (&config.checkpoint, completed, root) {
            let meta = CheckpointMeta {
                format: checkpoint::FORMAT_VERSION,
                run: config.run.clone(),
                model: ck.model.clone(),
                optimizer: optimizer.name().to_string(),
                epoch: epoch + 1,
                step,
                seed: config.seed,
                config: ck.config.clone(),
                torch_version: crate::torch_version().to_string(),
                grad_scaler: scaler.as_ref().map(GradScaler::state),
            };
            let path = checkpoint::path_for(&ck.dir, &config.run);
            checkpoint::save(&path, vs, optimizer, &meta).with_context(|| format!("after epoch {}", epoch + 1))?;
        }
    }
    if report.history.is_empty() {
        // Nothing left to train (a finished run resumed): still report where the model stands.
        let eval_start = Instant::now();
        (report.eval_loss, report.eval_acc) = evaluate(model, eval, replicas, config.precision)?;
        report.timings.eval_s += eval_start.elapsed().as_secs_f64();
    }
    if let (Some(path), true) = (&config.profile, root) {
        println!("--profile: {} (device waited for at every phase boundary)\n{}", config.run, profiler.table(report.steps));
        profiler.write_chrome_trace(path)?;
        println!("wrote the Chrome trace {} (open in chrome://tracing or ui.perfetto.dev)", path.display());
    }
    Ok(report)
}

fn progress_bar(config: &TrainConfig, root: bool, epoch: usize, batches: usize) -> ProgressBar {
    if !config.progress || !root {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(batches as u64);
    let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(format!("{} epoch {}/{}", config.run, epoch + 1, config.epochs));
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}
