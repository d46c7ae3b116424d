//! The language-model exercises: exercise1_nlp (the tutorial's Transformer, CPU vs GPU, or
//! data-parallel over ranks) and exercise3 pipeline (the 1.4B-parameter model cut into stages
//! over devices or ranks, replicated `--dp` times). Their flags, WikiText-2, the model, and what
//! their results add; everything around the training loop is [`crate::experiment`]'s.
use anyhow::Result;
use serde::Serialize;
use tch::Device;

use crate::comm::layout::{Coords, Groups, Layout};
use crate::data::text::{self, Corpus, TokenBatches, Tokenizer};
use crate::data::GENERATED_MARKER;
use crate::device::{self, DeviceChoice};
use crate::error::usage;
use crate::experiment::{self, Experiment, Sources};
use crate::flags::{ParallelArgs, RecipeArgs, RunArgs};
use crate::flops;
use crate::memory::estimate::{RankEstimate, TransformerJob};
use crate::models::transformer_names::{Place, TransformerVariable};
use crate::models::TransformerConfig;
use crate::optim::OptimizerKind;
use crate::parallelize::{PipelinePlan, TransformerPlan};
use crate::pipeline::{self, LayerCosts, Partition, PipelineOptions, Placement, Schedule, Stage};
use crate::presets::{ModelParallelism, Preset, TransformerPreset};
use crate::report::{self, RunRecord};
use crate::train::{EvalSums, FitReport, Metric, Observers, TrainStep};

/// The flags of the language-model exercises (names are a contract: the pipeline exercise
/// takes the same).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct LmArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub recipe: RecipeArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub parallel: ParallelArgs,
    /// Embedding and model width, d_model [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub emsize: Option<i64>,
    /// Feed-forward width of each encoder layer [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub d_hid: Option<i64>,
    /// Attention heads [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub nhead: Option<i64>,
    /// Encoder layers [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub nlayers: Option<i64>,
    /// [default: the preset's]
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub dropout: Option<f64>,
    /// Sequence length of a training batch [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Data")]
    pub bptt: Option<i64>,
    /// Streams side by side when evaluating [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Data")]
    pub eval_batch_size: Option<i64>,
    /// basic_english: the course tutorial's torchtext tokenizer; whitespace: word_language_model's.
    #[arg(long, value_enum, default_value = "basic_english")]
    #[arg(help_heading = "Data")]
    pub tokenizer: Tokenizer,
    /// Round the vocabulary up to a multiple of N (Megatron's --make-vocab-size-divisible-by):
    /// tensor parallelism cuts it into equal parts. The extra words never occur in the data.
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub pad_vocab: Option<i64>,
    /// Compute the output layer and the loss N chunks of a batch's tokens at a time (a fused
    /// linear + cross-entropy): only one chunk's logits exist at once, forward and backward,
    /// instead of the whole batch's (under autocast a float32 [tokens × vocabulary] tensor, and
    /// twice that in the backward pass); the backward pass makes each chunk's logits again
    /// (one more output-layer product). The model whole on each rank only (not with --tp,
    /// pipeline stages or --zero 3) [default: off, the whole batch's logits as the tutorial].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..=MAX_LOSS_CHUNKS))]
    #[arg(help_heading = "Model")]
    pub loss_chunks: Option<i64>,
    /// Tensor-parallel shards of every layer, one per rank (Megatron-LM's; keep them inside a
    /// node): the Transformer built from tensor-parallel layers, whose dropout masks are keyed
    /// so that the shards drop what one rank drops [default: exercise3 tp: the ranks left by
    /// --pp and --dp; otherwise 1].
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub tp: Option<usize>,
    /// With --tp N: sequence parallelism (Korthikanti et al. 2022, Megatron-LM's): between the
    /// tensor-parallel layers each shard holds 1/N of the sequence, so the layer norms and
    /// dropouts, and what they save for the backward pass, take 1/N of the memory; each
    /// all-reduce becomes a reduce-scatter and an all-gather (the same bytes). A sequence is
    /// padded at its end to a multiple of N (later positions: the causal model's earlier ones
    /// do not see them).
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub sequence_parallel: bool,
    #[command(flatten)]
    #[serde(flatten)]
    pub auto: crate::plan::auto::AutoLayoutArgs,
}

/// The most chunks `--loss-chunks` takes (more than a batch's tokens is one token a chunk).
pub const MAX_LOSS_CHUNKS: i64 = 1 << 20;

/// exercise3 pipeline's and exercise3 tp's flags: exercise1_nlp's, plus the model-parallel ones.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct PipelineArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub lm: LmArgs,
    /// One device per stage, comma-separated: cpu, cuda, cuda:N (a device may repeat)
    /// [default: cuda:0,cuda:1 with two GPUs, cuda:0,cuda:0 with one, cpu,cpu without or with
    /// --device cpu].
    #[arg(long, value_delimiter = ',')]
    #[arg(help_heading = "Parallelism")]
    pub devices: Vec<String>,
    /// Pipeline stages when they run as separate ranks [default: exercise3 pipeline: the ranks
    /// left by --tp and --dp; exercise3 tp: 1].
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub pp: Option<usize>,
    /// Micro-batches per mini-batch (GPipe's `chunks`) [default: 8 with pipeline stages, else 1].
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub chunks: Option<usize>,
    /// gpipe: all forwards, then all backwards; 1f1b: alternate, holding fewer activations;
    /// interleaved: 1F1B over several stages per device (Megatron-LM's), a smaller bubble.
    #[arg(long, value_enum, default_value = "gpipe")]
    #[arg(help_heading = "Parallelism")]
    pub schedule: Schedule,
    /// Stages per device with --schedule interleaved: the layers cut into devices × V stages,
    /// stage s on device s mod devices [default: 2 with interleaved, else 1].
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub virtual_stages: Option<usize>,
    /// Split the layers by their measured time (embedding and output layer included) instead
    /// of their number.
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub balance: bool,
    /// Keep only each stage's input in the forward pass and recompute the rest in the backward
    /// (less memory, about one more forward pass of time).
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub checkpoint_activations: bool,
    /// Data-parallel replicas of the model when its parts run in separate processes (the job
    /// then has stages × shards × dp ranks) [default: the ranks left by the stages and shards].
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub dp: Option<usize>,
}

impl LmArgs {
    /// `model` (a preset's) with the shape flags given: `--emsize` (d_model), `--d-hid`,
    /// `--nhead`, `--nlayers`, `--dropout`.
    fn apply_to(&self, model: TransformerConfig) -> TransformerConfig {
        TransformerConfig {
            d_model: self.emsize.unwrap_or(model.d_model),
            d_hid: self.d_hid.unwrap_or(model.d_hid),
            nhead: self.nhead.unwrap_or(model.nhead),
            nlayers: self.nlayers.unwrap_or(model.nlayers),
            dropout: self.dropout.unwrap_or(model.dropout),
            ..model
        }
    }
}

impl PipelineArgs {
    /// Micro-batches per mini-batch: `--chunks`, or 8 where there are pipeline stages.
    pub fn chunks(&self, preset: &Preset<TransformerPreset>) -> usize {
        let staged = preset.parallelism == ModelParallelism::Pipeline || self.pp.is_some_and(|pp| pp > 1);
        self.chunks.unwrap_or(if staged { 8 } else { 1 })
    }

    /// Stages per device: `--virtual-stages`, or the schedule's default.
    pub fn virtual_stages(&self) -> Result<usize> {
        Placement::virtual_stages(self.schedule, self.virtual_stages)
    }
}

/// A language-model exercise: its preset, flags, and the pipeline's flags if it is one.
struct LmExperiment<'a> {
    preset: &'a Preset<TransformerPreset>,
    args: &'a LmArgs,
    pipeline: Option<&'a PipelineArgs>,
    /// A pipeline's stages as [`Experiment::describe`] found them, for the results.
    stages: std::cell::RefCell<Vec<StageSummary>>,
    /// What `--layout auto` chose and why, said with the model.
    chosen_layout: Option<String>,
}

impl<'a> LmExperiment<'a> {
    fn new(preset: &'a Preset<TransformerPreset>, args: &'a LmArgs, pipeline: Option<&'a PipelineArgs>) -> Self {
        LmExperiment { preset, args, pipeline, stages: Default::default(), chosen_layout: None }
    }
}

/// Runs exercise1_nlp-style `preset` with `args` (see [`experiment::run`]).
pub fn run(preset: &Preset<TransformerPreset>, args: &LmArgs, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    match auto_layout(preset, args, None)? {
        Some((lm, _, line)) => experiment::run(&LmExperiment { chosen_layout: Some(line), ..LmExperiment::new(preset, &lm, None) }, listeners),
        None => experiment::run(&LmExperiment::new(preset, args, None), listeners),
    }
}

/// Runs exercise3 pipeline-style or tp-style `preset` with `args`.
pub fn run_pipeline(preset: &Preset<TransformerPreset>, args: &PipelineArgs, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    match auto_layout(preset, &args.lm, Some(args))? {
        Some((lm, Some(pipeline), line)) => {
            let pipeline = PipelineArgs { lm: lm.clone(), ..pipeline };
            experiment::run(&LmExperiment { chosen_layout: Some(line), ..LmExperiment::new(preset, &lm, Some(&pipeline)) }, listeners)
        }
        _ => experiment::run(&LmExperiment::new(preset, &args.lm, Some(args)), listeners),
    }
}

/// `--layout auto`: on a rank of the job (or a run of one process), the flags of the layout
/// the plan chooses for the ranks it was started on, and the line saying which and why. None
/// without `--layout`, and in a process that is about to start the ranks (they plan for
/// themselves).
fn auto_layout(preset: &Preset<TransformerPreset>, lm: &LmArgs, pipeline: Option<&PipelineArgs>) -> Result<Option<(LmArgs, Option<PipelineArgs>, String)>> {
    use crate::plan::auto::{self, RunShape, Trainer};
    if lm.auto.layout.is_none() {
        return Ok(None);
    }
    let trainer = match (preset.parallelism, pipeline) {
        (ModelParallelism::None, None) => Trainer::Exercise1Nlp,
        (ModelParallelism::Tensor, Some(_)) => Trainer::Exercise3Tp,
        _ => return usage("--layout auto plans exercise1_nlp and exercise3 tp (exercise3 pipeline's stages are threads of one process)"),
    };
    let chosen_by_auto = [
        ("--tp", lm.tp.is_some()),
        ("--zero", lm.parallel.zero != 0),
        ("--shard-group", lm.parallel.shard_group.is_some()),
        ("--sequence-parallel", lm.sequence_parallel),
        ("--batch-size", lm.recipe.batch_size.is_some()),
        ("--pp", pipeline.is_some_and(|p| p.pp.is_some())),
        ("--chunks", pipeline.is_some_and(|p| p.chunks.is_some())),
        ("--virtual-stages", pipeline.is_some_and(|p| p.virtual_stages.is_some())),
        ("--checkpoint-activations", pipeline.is_some_and(|p| p.checkpoint_activations)),
    ];
    if let Some((flag, _)) = chosen_by_auto.iter().find(|(_, given)| *given) {
        return usage(format!("--layout auto chooses {flag} itself: drop {flag}, or drop --layout auto"));
    }
    let env = crate::comm::launch::LaunchEnv::detect()?;
    if env.world_size == 1 && lm.parallel.nproc_per_node.is_some_and(|n| n > 1) {
        return Ok(None);
    }
    let TransformerPreset { model, bptt, .. } = preset.model;
    let shape = RunShape {
        model: lm.apply_to(model),
        bptt: lm.bptt.unwrap_or(bptt),
        precision: lm.run.precision,
        nodes: env.nnodes.max(1),
        ranks_per_node: env.local_world_size.max(1),
    };
    let (c, line) = auto::choose(&lm.auto, &shape, trainer)?;
    let mut lm = lm.clone();
    lm.tp = (trainer == Trainer::Exercise3Tp || c.tp > 1).then_some(c.tp);
    lm.parallel.zero = c.sync.zero_stage().map_or(0, |stage| stage.number());
    lm.parallel.shard_group = c.shard_group;
    lm.sequence_parallel = c.sequence_parallel;
    lm.recipe.batch_size = Some(c.replica_batch() as usize);
    let pipeline = pipeline.map(|p| PipelineArgs {
        lm: lm.clone(),
        pp: Some(c.pp),
        chunks: Some(c.chunks),
        schedule: c.schedule,
        virtual_stages: (c.virtual_stages > 1).then_some(c.virtual_stages),
        checkpoint_activations: c.recompute,
        ..p.clone()
    });
    Ok(Some((lm, pipeline, line)))
}

/// The corpus and its add-one unigram model's test perplexity (the baseline to beat).
struct LmData {
    corpus: Corpus,
    unigram: f64,
}

impl LmExperiment<'_> {
    /// The preset's Transformer and the batching of its text, `(model, bptt, eval_batch_size)`.
    fn preset_model(&self) -> (TransformerConfig, i64, i64) {
        let TransformerPreset { model, bptt, eval_batch_size } = self.preset.model;
        (model, bptt, eval_batch_size)
    }

    /// The model for a vocabulary of `ntoken` words: the preset's, with the flags given.
    fn config(&self, ntoken: i64) -> TransformerConfig {
        TransformerConfig { ntoken, ..self.args.apply_to(self.preset_model().0) }
    }

    /// Tokens per sequence of a batch: `--bptt`, or the preset's.
    fn bptt(&self) -> i64 {
        self.args.bptt.unwrap_or(self.preset_model().1)
    }

    /// Token streams per evaluation batch: `--eval-batch-size`, or the preset's.
    fn eval_batch_size(&self) -> i64 {
        self.args.eval_batch_size.unwrap_or(self.preset_model().2)
    }

    fn batch_size(&self) -> usize {
        self.args.recipe.batch_size.unwrap_or(self.preset.recipe_for(&self.args.recipe).batch_size)
    }

    /// The stages' devices in one process: `--devices`, or two stages on what `--device` and
    /// the machine offer.
    fn stage_devices(&self, pipeline: &PipelineArgs) -> Result<Vec<Device>> {
        if !pipeline.devices.is_empty() {
            return Ok(pipeline.devices.iter().map(|name| device::parse_device(name)).collect::<Result<_, _>>()?);
        }
        let devices = match self.args.run.device {
            DeviceChoice::Cpu => vec![Device::Cpu; 2],
            _ => device::two_stage_devices(),
        };
        match (self.args.run.device, devices[0]) {
            (DeviceChoice::Cuda, Device::Cpu) => usage(device::no_cuda_message()),
            _ => Ok(devices),
        }
    }

    /// `--loss-chunks` computes the whole output layer's loss on a rank holding the whole model:
    /// a usage error with tensor-parallel shards (their loss is the vocabulary-parallel one),
    /// pipeline stages, or parameters sharded over the replicas (ZeRO-3, HSDP).
    fn check_loss_chunks(&self, layout: Layout) -> Result<()> {
        if self.args.loss_chunks.is_none() {
            return Ok(());
        }
        if self.pipeline.is_some() || self.args.tp.is_some() || layout.tp > 1 || layout.pp > 1 {
            return usage(
                "--loss-chunks computes the whole output layer on one rank: it is not built for tensor-parallel shards (--tp, exercise3 tp) or pipeline stages; drop --loss-chunks",
            );
        }
        if self.args.parallel.sync(self.preset.sync, layout).strategy().parameters_sharded() {
            return usage("--loss-chunks is not built for parameters sharded over the replicas (--zero 3, --shard-group): drop one of them");
        }
        Ok(())
    }

    /// `--tp` asks for one process per shard: a usage error where the job has fewer ranks
    /// (one process started alone).
    fn check_shards_fit(&self, world: usize) -> Result<()> {
        match self.args.tp.filter(|&tp| tp > 1 && world == 1) {
            Some(tp) => usage(format!("--tp {tp} runs each shard of a layer in a process of its own: start {tp} ranks (--nproc-per-node {tp}, or a launcher)")),
            None => Ok(()),
        }
    }

    /// How a job of `world` ranks (more than one) divides the model: the flags given, the rest
    /// from the preset (exercise3 pipeline: stages fill the ranks; exercise3 tp: shards do).
    fn model_layout(&self, pipeline: &PipelineArgs, world: usize) -> Result<Layout> {
        let tensor = self.preset.parallelism == ModelParallelism::Tensor;
        let dp = pipeline.dp.unwrap_or(1).max(1);
        let pp = pipeline.pp.or((!pipeline.devices.is_empty()).then_some(pipeline.devices.len()));
        let rest = |other: usize| (world / (dp * other.max(1))).max(1);
        let (pp, tp) = match (pp, self.args.tp) {
            (Some(pp), Some(tp)) => (pp, tp),
            (Some(pp), None) => (pp, if tensor { rest(pp) } else { 1 }),
            (None, Some(tp)) => (if tensor { 1 } else { rest(tp) }, tp),
            (None, None) if tensor => (1, rest(1)),
            (None, None) => (rest(1), 1),
        };
        if !pipeline.devices.is_empty() && pipeline.devices.len() != pp {
            return usage(format!("--devices names {} devices for {pp} stages (--pp)", pipeline.devices.len()));
        }
        Layout::new(world, pp, tp, pipeline.dp)
    }

    /// The partition the flags ask for; with `--balance`, measured on `probe` by rank 0 and the
    /// same on every rank (the timings differ between machines: rank 0's cut wins).
    fn partition(
        &self,
        pipeline: &PipelineArgs,
        cfg: &TransformerConfig,
        stages: usize,
        probe: Device,
        groups: &Groups,
        observers: &mut Observers,
    ) -> Result<Partition> {
        let even = Partition::even(cfg.nlayers, stages)?; // also the clear error for too many stages
        if !pipeline.balance {
            return Ok(even);
        }
        let mine = if groups.is_root() {
            let micro_batch = (self.batch_size()).div_ceil(pipeline.chunks(self.preset)) as i64;
            let costs: LayerCosts = Stage::measure_costs(cfg, probe, self.bptt(), micro_batch);
            observers.info(format!(
                "--balance: forward + backward of one micro-batch on {}: embedding {:.2} ms, each layer {:.2} ms, output layer {:.2} ms",
                device::device_label(probe),
                1e3 * costs.embedding,
                1e3 * costs.layers.first().copied().unwrap_or(0.0),
                1e3 * costs.head
            ))?;
            serde_json::to_vec(&Partition::balanced(&costs, stages)?)?
        } else {
            Vec::new()
        };
        Ok(serde_json::from_slice(&groups.world.broadcast_bytes(&mine, 0)?)?)
    }
}

impl Experiment for LmExperiment<'_> {
    type Data = LmData;
    type Model = TransformerPlan;
    type ModelPreset = TransformerPreset;

    fn preset(&self) -> &Preset<TransformerPreset> {
        self.preset
    }

    fn run_args(&self) -> &RunArgs {
        &self.args.run
    }

    fn recipe_args(&self) -> &RecipeArgs {
        &self.args.recipe
    }

    fn parallel_args(&self) -> &ParallelArgs {
        &self.args.parallel
    }

    fn flags_json(&self) -> serde_json::Result<serde_json::Value> {
        match self.pipeline {
            Some(pipeline) => serde_json::to_value(pipeline),
            None => serde_json::to_value(self.args),
        }
    }

    fn check(&self) -> Result<()> {
        for (flag, value) in [("--bptt", self.bptt()), ("--eval-batch-size", self.eval_batch_size())] {
            if value < 1 {
                return usage(format!("{flag} must be at least 1, got {value}"));
            }
        }
        // The model's own checks, on the flags, before any data is read.
        self.config(1).validate()?;
        if self.args.pad_vocab.is_some_and(|n| n < 1) {
            return usage("--pad-vocab must be at least 1");
        }
        if self.args.tp == Some(0) {
            return usage("--tp must be at least 1");
        }
        if let Some(pipeline) = self.pipeline {
            for (flag, value) in [("--dp", pipeline.dp), ("--pp", pipeline.pp), ("--chunks", pipeline.chunks)] {
                if value == Some(0) {
                    return usage(format!("{flag} must be at least 1"));
                }
            }
            pipeline.virtual_stages()?;
            let chunks = pipeline.chunks(self.preset);
            if chunks > self.batch_size() {
                return usage(format!("--chunks {chunks} is more than --batch-size {}: every micro-batch needs at least one sequence", self.batch_size()));
            }
        }
        Ok(())
    }

    fn load(&self, observers: &mut Observers, announce: bool) -> Result<LmData> {
        let args = self.args;
        let dir = args.run.data_dir_or("wikitext-2");
        let corpus = text::load_corpus(&dir, args.tokenizer)?;
        let vocab = corpus.vocab.len() as i64;
        let unigram = text::unigram_perplexity(&corpus.train, &corpus.test, vocab);
        if announce {
            if corpus.generated {
                observers.warn(format!(
                    "WARNING: WikiText-2 in {} is a GENERATED stand-in, not the real corpus (see {GENERATED_MARKER}); perplexities are not comparable to the course's",
                    dir.display()
                ))?;
            }
            observers.info(format!(
                "{}: WikiText-2 from {} ({} tokenizer): {} / {} / {} tokens (train / valid / test), vocabulary {}; \
                 unigram test perplexity {unigram:.1}; LibTorch {}",
                self.preset.name,
                dir.display(),
                args.tokenizer.name(),
                corpus.train.numel(),
                corpus.valid.numel(),
                corpus.test.numel(),
                vocab,
                crate::torch_version()
            ))?;
        }
        Ok(LmData { corpus, unigram })
    }

    fn layout(&self, world: usize) -> Result<Layout> {
        match self.pipeline {
            // Stages as threads of one process (or the whole model), or parts of it on ranks.
            Some(pipeline) if world == 1 => {
                if pipeline.dp.is_some_and(|dp| dp > 1) {
                    return usage(
                        "--dp replicates a model whose parts run in separate processes: start them with --nproc-per-node (stages × shards × dp) or a launcher",
                    );
                }
                self.check_shards_fit(world)?;
                if self.preset.parallelism == ModelParallelism::Tensor && pipeline.pp.is_some_and(|pp| pp > 1) {
                    return usage("--pp runs each stage in a process of its own here: start stages × shards ranks (--nproc-per-node, or a launcher)");
                }
                Ok(Layout::SINGLE)
            }
            Some(pipeline) => self.model_layout(pipeline, world),
            None => {
                self.check_shards_fit(world)?;
                Layout::new(world, 1, self.args.tp.unwrap_or(1), None)
            }
        }
    }

    fn device(&self, groups: &Groups) -> Result<Device> {
        match self.pipeline {
            Some(pipeline) if groups.world.world_size() == 1 => Ok(self.stage_devices(pipeline)?[0]),
            Some(pipeline) if !pipeline.devices.is_empty() => Ok(device::parse_device(&pipeline.devices[groups.coords.stage])?),
            _ => match self.args.run.device {
                DeviceChoice::Cpu => Ok(Device::Cpu),
                DeviceChoice::Cuda if !device::cuda_available() => usage(device::no_cuda_message()),
                DeviceChoice::Cuda | DeviceChoice::Both => Ok(groups.world.device(device::cuda_available())),
            },
        }
    }

    fn model_name(&self) -> String {
        "transformer".into()
    }

    fn dataset_name(&self) -> String {
        "wikitext2".into()
    }

    fn metric(&self) -> Metric {
        Metric::Perplexity
    }

    fn model(&self, data: &LmData, groups: &Groups, device: Device, observers: &mut Observers) -> Result<TransformerPlan> {
        let vocab = data.corpus.vocab.len() as i64;
        let multiple = self.args.pad_vocab.unwrap_or(1);
        let ntoken = (vocab + multiple - 1) / multiple * multiple;
        let config = self.config(ntoken);
        config.validate_shards(groups.layout.tp)?;
        let optimizer = self.args.recipe.optimizer.unwrap_or(self.preset.recipe_for(&self.args.recipe).optimizer);
        if groups.layout.tp > 1 && matches!(optimizer, OptimizerKind::Lars | OptimizerKind::Lamb) {
            return usage(format!(
                "--optimizer {} scales each weight by its whole norm, which no tensor-parallel shard holds: use adam or sgd with tensor parallelism",
                optimizer.name()
            ));
        }
        if ntoken != vocab && groups.is_root() {
            observers.info(format!("--pad-vocab {multiple}: the vocabulary of {vocab} words padded to {ntoken}"))?;
        }
        if let Some(line) = self.chosen_layout.as_ref().filter(|_| groups.is_root()) {
            observers.info(line.clone())?;
        }
        let init = self.preset.recipe_for(&self.args.recipe).output_init;
        let sequence_parallel = self.args.sequence_parallel;
        if sequence_parallel && groups.layout.tp < 2 {
            return usage(format!(
                "--sequence-parallel cuts the sequence over the tensor-parallel shards of a layer: it needs --tp 2 or more (this job's layout is {})",
                groups.layout.describe()
            ));
        }
        self.check_loss_chunks(groups.layout)?;
        let loss_chunks = self.args.loss_chunks;
        let Some(pipeline) = self.pipeline else {
            // --tp, even 1: the model of tensor-parallel layers, one stage cut over the shards,
            // its dropout masks keyed so that N shards train what one rank trains.
            let pipeline = self.args.tp.map(|_| PipelinePlan::single_stage(config.nlayers)).transpose()?;
            return Ok(TransformerPlan { config, pipeline, init, sequence_parallel, loss_chunks });
        };
        // Stages as threads of this process: exercise3 pipeline started alone.
        let in_process = groups.world.world_size() == 1 && self.preset.parallelism == ModelParallelism::Pipeline;
        let devices = if in_process { self.stage_devices(pipeline)? } else { Vec::new() };
        let placement = Placement { devices: if in_process { devices.len() } else { groups.layout.pp }, virtual_stages: pipeline.virtual_stages()? };
        let chunks = pipeline.chunks(self.preset);
        placement.check(pipeline.schedule, chunks)?;
        placement.check_layers(config.nlayers)?;
        let partition = self.partition(pipeline, &config, placement.stages(), device, groups, observers)?;
        // CPU stages in one process share the cores: each stage thread gets its share.
        let threads_per_stage = (in_process && devices.iter().all(|d| *d == Device::Cpu)).then(|| (tch::get_num_threads() as usize / devices.len()).max(1));
        let options = PipelineOptions {
            schedule: pipeline.schedule,
            virtual_stages: placement.virtual_stages,
            chunks,
            checkpoint_activations: pipeline.checkpoint_activations,
            threads_per_stage,
        };
        Ok(TransformerPlan { config, pipeline: Some(PipelinePlan { partition, options, devices }), init, sequence_parallel, loss_chunks })
    }

    fn describe(&self, plan: &TransformerPlan, step: &dyn TrainStep<'_>, groups: &Groups, device: Device, observers: &mut Observers) -> Result<()> {
        let TransformerPlan { config: cfg, pipeline, .. } = plan;
        let Some(pipeline_plan) = pipeline else {
            if groups.is_root() {
                let params: i64 = step.named_parameters().iter().map(|(_, t)| t.numel() as i64).sum();
                observers.info(format!(
                    "[{}] Transformer LM: {} layers, d_model {}, d_hid {}, {} heads, vocabulary {}: {} parameters{}",
                    device::device_name(device),
                    cfg.nlayers,
                    cfg.d_model,
                    cfg.d_hid,
                    cfg.nhead,
                    cfg.ntoken,
                    report::group_thousands(params),
                    if groups.layout.dp > 1 { format!(", {} replicas × batch {}", groups.layout.dp, self.batch_size()) } else { String::new() }
                ))?;
                // The tutorial script's first line, to hold against its printout.
                observers.info(crate::course_format::device_line(if device.is_cuda() { "cuda" } else { "cpu" }))?;
            }
            return Ok(());
        };
        let summaries = stage_summaries(step, pipeline_plan, groups)?;
        *self.stages.borrow_mut() = summaries.clone();
        if !groups.is_root() {
            return Ok(());
        }
        let layout = groups.layout;
        let virtual_stages = pipeline_plan.options.virtual_stages;
        if groups.world.world_size() > 1 {
            let placement = match (layout.tp, virtual_stages) {
                (1, 1) => format!("rank r runs stage r mod {}", layout.pp),
                (1, v) => format!("rank r runs stages r mod {pp}, r mod {pp} + {pp}, … ({v} of them)", pp = layout.pp),
                (tp, _) => format!(
                    "each stage's layers cut over {tp} tensor-parallel shards on neighbouring ranks (rank = (replica × {} + stage) × {tp} + shard)",
                    layout.pp
                ),
            };
            observers.info(format!(
                "{} ranks: {} replica(s) of a {}-stage pipeline, {placement}; {}",
                groups.world.world_size(),
                layout.dp,
                layout.pp,
                groups.world.describe()
            ))?;
        }
        let params: i64 = summaries.iter().map(|s| s.parameters).sum();
        let shards = if layout.tp > 1 { format!(", every layer cut over {} tensor-parallel shards (Megatron-LM)", layout.tp) } else { String::new() };
        let stages = match virtual_stages {
            1 => format!("{} stage(s)", summaries.len()),
            v => format!("{} devices × {v} virtual stages", summaries.len()),
        };
        observers.info(format!(
            "Transformer LM: {} layers, d_model {}, d_hid {}, {} heads, vocabulary {}: {} parameters; \
             {stages}, {} micro-batches per batch of {}, {} schedule{}{shards}",
            cfg.nlayers,
            cfg.d_model,
            cfg.d_hid,
            cfg.nhead,
            cfg.ntoken,
            report::group_thousands(params),
            pipeline_plan.options.chunks,
            self.batch_size(),
            pipeline_plan.options.schedule.name(),
            if pipeline_plan.options.checkpoint_activations { ", activations recomputed" } else { "" }
        ))?;
        // The pipeline tutorial's own line, to hold against its printout.
        observers.info(crate::course_format::tutorial_total_parameters(params))?;
        for summary in &summaries {
            observers.info(summary.line(pipeline_plan.partition.stages(), layout.tp))?;
        }
        Ok(())
    }

    /// The vocabulary (its words in id order), as a checksum: the same corpus, tokenizer and
    /// vocabulary rules give the same one.
    fn data_identity(&self, data: &LmData) -> serde_json::Value {
        let words = data.corpus.vocab.itos();
        let checksum = words.iter().fold(0u32, |crc, word| crc32c::crc32c_append(crc32c::crc32c_append(crc, word.as_bytes()), b"\n"));
        serde_json::json!({ "vocabulary": words.len(), "vocabulary_crc32c": format!("{checksum:08x}") })
    }

    fn model_identity(&self, plan: &TransformerPlan) -> serde_json::Value {
        let config = &plan.config;
        // Whatever the partition: checkpoints resume on another number of stages.
        serde_json::json!({ "transformer": config, "tokenizer": self.args.tokenizer.name() })
    }

    fn flops_per_example(&self, plan: &TransformerPlan) -> f64 {
        flops::training_flops_per_token(&plan.config, self.bptt())
    }

    fn sources(&self, data: &LmData, device: Device, shard: (usize, usize)) -> Result<Sources> {
        let (bptt, eval_batch_size, corpus) = (self.bptt(), self.eval_batch_size(), &data.corpus);
        // Evaluation windows go side by side, about four training batches' worth of streams per
        // pass (a pipeline's micro-batches then carry whole streams): the same losses in far
        // fewer, larger passes.
        let group = (4 * self.batch_size()).div_ceil(eval_batch_size as usize);
        let evaluation = |tokens: &tch::Tensor| TokenBatches::evaluation_share(tokens, eval_batch_size, bptt, device, shard).grouped(group);
        Ok(Sources {
            train: Box::new(TokenBatches::sharded(&corpus.train, self.batch_size() as i64, bptt, device, shard)),
            eval: Box::new(evaluation(&corpus.valid)),
            test: Some(Box::new(evaluation(&corpus.test))),
            examples_per_epoch: corpus.train.numel(),
        })
    }

    fn data_generated(&self, data: &LmData) -> bool {
        data.corpus.generated
    }

    fn devices(&self, plan: &TransformerPlan, device: Device) -> Vec<Device> {
        match plan {
            TransformerPlan { pipeline: Some(p), .. } if !p.devices.is_empty() => {
                let mut devices: Vec<Device> = Vec::new();
                for d in &p.devices {
                    if !devices.contains(d) {
                        devices.push(*d);
                    }
                }
                devices
            }
            _ => vec![device],
        }
    }

    fn memory_estimate(&self, layout: Layout, cuda: bool, observers: &mut Observers) -> Result<Vec<RankEstimate>> {
        let data = self.load(observers, true)?;
        let vocab = data.corpus.vocab.len() as i64;
        let multiple = self.args.pad_vocab.unwrap_or(1);
        let config = self.config((vocab + multiple - 1) / multiple * multiple);
        config.validate_shards(layout.tp)?;
        self.check_loss_chunks(layout)?;
        let recipe = experiment::RunRecipe::resolve(self.preset, &self.args.recipe, layout.dp, 1, 1);
        let (mut placement, mut shared_device, mut schedule, mut chunks, mut recompute) = (Placement::one_stage_each(1), false, Schedule::GPipe, 1, false);
        if let Some(pipeline) = self.pipeline {
            let in_process = layout.world_size() == 1 && self.preset.parallelism == ModelParallelism::Pipeline;
            let devices = if in_process { self.stage_devices(pipeline)? } else { Vec::new() };
            placement = Placement { devices: if in_process { devices.len() } else { layout.pp }, virtual_stages: pipeline.virtual_stages()? };
            shared_device = in_process && devices.windows(2).all(|w| w[0] == w[1]);
            (schedule, chunks, recompute) = (pipeline.schedule, pipeline.chunks(self.preset), pipeline.checkpoint_activations);
            placement.check(schedule, chunks)?;
            placement.check_layers(config.nlayers)?;
        }
        let job = TransformerJob {
            partition: Partition::even(config.nlayers, placement.stages())?,
            config,
            bptt: self.bptt(),
            batch: recipe.batch_size as i64,
            chunks,
            accumulate: recipe.accumulate,
            sequence_parallel: self.args.sequence_parallel,
            state_shards: layout.state_shards(),
            replicas: layout.dp,
            tp: layout.tp,
            placement,
            schedule,
            checkpoint_activations: recompute,
            stages_share_a_device: shared_device,
            keyed_masks: self.pipeline.is_some() || layout.tp > 1,
            sync: self.args.parallel.sync(self.preset.sync, layout),
            optimizer_k: crate::memory::optimizer_bytes_per_parameter(recipe.optimizer, recipe.momentum),
            update_bytes_per_parameter: crate::memory::update_bytes_per_parameter(recipe.optimizer),
            bucket_bytes: self.args.parallel.bucket_mb * crate::memory::MIB,
            precision: self.args.run.precision,
            cuda,
            loss_chunks: self.args.loss_chunks,
        };
        observers.info(format!(
            "Transformer LM: {} layers, d_model {}, d_hid {}, {} heads, vocabulary {}; {}; batch {} × {} tokens per replica in {} micro-batch(es); {}",
            job.config.nlayers,
            job.config.d_model,
            job.config.d_hid,
            job.config.nhead,
            job.config.ntoken,
            layout.describe(),
            job.batch,
            job.bptt,
            job.chunks,
            if placement.stages() > 1 { format!("{} schedule", schedule.name()) } else { "no pipeline".into() }
        ))?;
        Ok(job.estimate())
    }

    fn report(&self, data: &LmData, plan: &TransformerPlan, fit: &FitReport, test: &EvalSums, device: Device) -> (Vec<String>, serde_json::Value) {
        let TransformerPlan { config, pipeline, .. } = plan;
        let test_loss = test.mean_loss();
        let mut lines = vec![format!("[{}] end of training: test loss {test_loss:.4}, test perplexity {:.2}", device::device_name(device), test_loss.exp())];
        lines.push(self.preset.script.end_of_training(test_loss));
        let mut extra = serde_json::json!({
            "test_ppl": test_loss.exp(),
            "valid_ppl": fit.eval_loss.exp(),
            "unigram_test_ppl": data.unigram,
            "throughput_unit": "tokens/s",
            "vocab": config.ntoken,
            "tokenizer": self.args.tokenizer.name(),
            "bptt": self.bptt(),
            "model_config": config,
        });
        if let Some(plan) = pipeline {
            let (chunks, virtual_stages) = (plan.options.chunks, plan.options.virtual_stages);
            let stages = plan.partition.stages() / virtual_stages;
            let theory = pipeline::schedule::theoretical_bubble(stages, chunks, virtual_stages);
            let ratio_theory = pipeline::schedule::theoretical_bubble_ratio(stages, chunks, virtual_stages);
            let bubble = fit.bubble_fraction.unwrap_or(f64::NAN);
            // Idle over busy time: Narayanan et al.'s measure, (p−1)/(V·m) in theory.
            let ratio = bubble / (1.0 - bubble);
            if stages > 1 {
                lines.push(match virtual_stages {
                    1 => format!(
                        "pipeline bubble: measured {:.1}% of the stages' time idle, theory (p−1)/(m+p−1) = {:.1}% for p = {stages}, m = {chunks}",
                        100.0 * bubble,
                        100.0 * theory,
                    ),
                    v => format!(
                        "pipeline bubble: measured {:.1}% of the devices' time idle ({ratio:.3} of their compute), theory {:.1}% \
                         ((p−1)/(V·m) = {ratio_theory:.3} of the compute) for p = {stages}, m = {chunks}, V = {v}",
                        100.0 * bubble,
                        100.0 * theory,
                    ),
                });
            }
            extra["stages"] = stages.into();
            extra["virtual_stages"] = virtual_stages.into();
            extra["partition"] = plan.partition.layers.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>().into();
            extra["chunks"] = chunks.into();
            extra["schedule"] = serde_json::to_value(plan.options.schedule).expect("a schedule serialises");
            extra["checkpoint_activations"] = plan.options.checkpoint_activations.into();
            extra["bubble_fraction"] = bubble.into();
            extra["bubble_fraction_theory"] = theory.into();
            extra["bubble_ratio"] = ratio.into();
            extra["bubble_ratio_theory"] = ratio_theory.into();
            let summaries = self.stages.borrow();
            extra["devices"] = summaries.iter().map(|s| s.device.clone()).collect::<Vec<_>>().into();
            extra["stage_parameter_bytes"] = summaries.iter().map(|s| s.parameter_bytes).collect::<Vec<_>>().into();
        }
        (lines, extra)
    }
}

/// One device of the pipeline (a stage thread or a rank) as the run reports it: its stage, or
/// with interleaving its stages.
#[derive(Debug, Clone, Serialize)]
struct StageSummary {
    /// Its place in the pipeline.
    index: usize,
    device: String,
    /// The stages it holds, in model order, and their encoder layers.
    stages: Vec<usize>,
    layers: Vec<[i64; 2]>,
    /// The device's parameters (all its shards together).
    parameters: i64,
    /// Bytes of parameters one rank of it holds (one shard's).
    parameter_bytes: usize,
}

impl StageSummary {
    fn new(index: usize, device: String, plan: &PipelinePlan, parameters: i64, parameter_bytes: usize) -> StageSummary {
        let placement = Placement { devices: plan.partition.stages() / plan.options.virtual_stages, virtual_stages: plan.options.virtual_stages };
        let stages: Vec<usize> = placement.stages_of(index).collect();
        let layers = stages.iter().map(|&s| [plan.partition.layers[s].start, plan.partition.layers[s].end]).collect();
        StageSummary { index, device, stages, layers, parameters, parameter_bytes }
    }

    /// `stage 0 on cpu: embedding + layers 0..6; …`, or with interleaving `device 0 on cpu:
    /// stage 0 (embedding + layers 0..3), stage 2 (layers 6..9); …`, of a model of `stages`.
    fn line(&self, stages: usize, shards: usize) -> String {
        let holds = |(stage, [start, end]): (&usize, &[i64; 2])| {
            let mut pieces = Vec::new();
            if *stage == 0 {
                pieces.push("embedding".to_string());
            }
            pieces.push(format!("layers {start}..{end}"));
            if stage + 1 == stages {
                pieces.push("output layer".to_string());
            }
            pieces.join(" + ")
        };
        let held: Vec<String> = self.stages.iter().zip(&self.layers).map(holds).collect();
        let what = match &held[..] {
            [one] => format!("stage {} on {}: {one}", self.index, self.device),
            several => {
                let named: Vec<String> = self.stages.iter().zip(several).map(|(s, pieces)| format!("stage {s} ({pieces})")).collect();
                format!("device {} on {}: {}", self.index, self.device, named.join(", "))
            }
        };
        format!(
            "  {what}; {} parameters, {:.1} MiB{} (and as much again for their gradients)",
            report::group_thousands(self.parameters),
            self.parameter_bytes as f64 / (1024.0 * 1024.0),
            if shards > 1 { format!(" per shard on each of {shards} ranks") } else { String::new() }
        )
    }
}

/// Every device of replica 0: read off the stages in this process, or gathered from the ranks.
fn stage_summaries(step: &dyn TrainStep<'_>, plan: &PipelinePlan, groups: &Groups) -> Result<Vec<StageSummary>> {
    if !plan.devices.is_empty() {
        // In this process: group the parameters by device through their stages' layer names.
        let params = step.named_parameters();
        let devices = plan.devices.len();
        let stages: Vec<usize> = params.iter().map(|(name, _)| stage_of(name, &plan.partition)).collect::<Result<_>>()?;
        return Ok((0..devices)
            .map(|d| {
                let mine: Vec<&tch::Tensor> = params.iter().zip(&stages).filter(|(_, stage)| *stage % devices == d).map(|((_, t), _)| t).collect();
                let parameters = mine.iter().map(|t| t.numel() as i64).sum();
                let bytes = mine.iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum();
                StageSummary::new(d, device::device_label(plan.devices[d]), plan, parameters, bytes)
            })
            .collect());
    }
    let params = step.named_parameters();
    let count = crate::train::counted_parameters(step);
    let bytes: usize = params.iter().map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes()).sum();
    let code = match step.input_device() {
        Device::Cuda(i) => i as f64,
        _ => -1.0,
    };
    let all = groups.world.all_gather(&tch::Tensor::from_slice(&[count as f64, bytes as f64, code]))?;
    let all: Vec<Vec<f64>> = all.iter().map(Vec::<f64>::try_from).collect::<Result<_, _>>()?;
    let layout = groups.layout;
    Ok((0..layout.pp)
        .map(|s| {
            let ranks: Vec<usize> = (0..layout.tp).map(|shard| layout.rank(Coords { replica: 0, stage: s, shard })).collect();
            let first = &all[ranks[0]];
            let device = if first[2] < 0.0 { "cpu".into() } else { format!("cuda:{} (rank {})", first[2], ranks[0]) };
            StageSummary::new(s, device, plan, ranks.iter().map(|&r| all[r][0] as i64).sum(), first[1] as usize)
        })
        .collect())
}

/// The stage holding the variable `name` of the whole model.
fn stage_of(name: &str, partition: &Partition) -> Result<usize> {
    let last = partition.stages() - 1;
    Ok(match TransformerVariable::parse(name)?.place {
        Place::Embedding => 0,
        Place::Output => last,
        Place::Layer(layer) => partition.layers.iter().position(|r| r.contains(&layer)).unwrap_or(last),
    })
}
