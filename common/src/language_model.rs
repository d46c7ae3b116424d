//! The Transformer language-model experiment behind exercise1_nlp: the course's tutorial
//! recipe (SGD lr 5.0, StepLR γ 0.95 per epoch, gradient-norm clipping 0.5, bptt 35) on
//! WikiText-2, per device, with the same results, checkpoints and table as exercise1.
use crate::data::text::{self, Corpus, TokenBatches, Tokenizer};
use crate::data::GENERATED_MARKER;
use crate::device;
use crate::flags::RunArgs;
use crate::error::usage;
use crate::models::{self, TransformerConfig, TransformerLm};
use crate::optim::{Optimizer, Sgd, SgdConfig};
use crate::flops;
use crate::report::{self, RunInfo, RunRecord};
use crate::Exercise;
use crate::train::{self, CheckpointConfig, LrSchedule, Metric, SingleReplica, TrainConfig};
use serde::Serialize;
use std::path::PathBuf;
use tch::{nn, Device};

/// The flags of the language-model exercises (names are a contract: the pipeline exercise
/// takes the same).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct LmArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub run: RunArgs,
    /// Embedding and model width (d_model).
    #[arg(long, default_value_t = 1024)]
    pub emsize: i64,
    /// Feed-forward width of each encoder layer.
    #[arg(long, default_value_t = 1024)]
    pub d_hid: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub nhead: i64,
    /// Encoder layers.
    #[arg(long, default_value_t = 3)]
    pub nlayers: i64,
    #[arg(long, default_value_t = 0.2)]
    pub dropout: f64,
    /// Sequence length of a training batch.
    #[arg(long, default_value_t = 35)]
    pub bptt: i64,
    /// Token streams side by side in a training batch.
    #[arg(long, default_value_t = 20)]
    pub batch_size: i64,
    /// Streams side by side when evaluating.
    #[arg(long, default_value_t = 10)]
    pub eval_batch_size: i64,
    /// SGD learning rate.
    #[arg(long, default_value_t = 5.0)]
    pub lr: f64,
    /// StepLR factor applied to the learning rate after every epoch.
    #[arg(long, default_value_t = 0.95)]
    pub gamma: f64,
    /// Gradient-norm clipping threshold (0 turns it off).
    #[arg(long, default_value_t = 0.5)]
    pub clip: f64,
    /// basic_english: the course tutorial's torchtext tokenizer; whitespace: word_language_model's.
    #[arg(long, value_enum, default_value = "basic_english")]
    pub tokenizer: Tokenizer,
}

impl LmArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        for (flag, value) in [
            ("--emsize", self.emsize),
            ("--d-hid", self.d_hid),
            ("--nhead", self.nhead),
            ("--nlayers", self.nlayers),
            ("--bptt", self.bptt),
            ("--batch-size", self.batch_size),
            ("--eval-batch-size", self.eval_batch_size),
        ] {
            if value < 1 {
                return usage(format!("{flag} must be at least 1, got {value}"));
            }
        }
        if self.emsize % self.nhead != 0 {
            return usage(format!("--emsize {} must be divisible by --nhead {}", self.emsize, self.nhead));
        }
        if self.emsize % 2 != 0 {
            return usage(format!("--emsize {} must be even (sinusoidal positions come in sine/cosine pairs)", self.emsize));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return usage(format!("--dropout must be in [0, 1), got {}", self.dropout));
        }
        let positive = |x: f64| x > 0.0 && x.is_finite();
        if !positive(self.lr) || !positive(self.gamma) || self.clip < 0.0 {
            return usage("--lr and --gamma must be positive, --clip non-negative");
        }
        Ok(())
    }

    /// The model these flags describe, for a vocabulary of `ntoken` words.
    pub fn model_config(&self, ntoken: i64) -> TransformerConfig {
        TransformerConfig {
            ntoken,
            d_model: self.emsize,
            nhead: self.nhead,
            d_hid: self.d_hid,
            nlayers: self.nlayers,
            dropout: self.dropout,
        }
    }

    pub fn data_dir(&self) -> PathBuf {
        self.run.data_dir_or("wikitext-2")
    }
}

/// Reads the corpus once, then trains and evaluates on every requested device.
pub fn run(exercise: Exercise, args: &LmArgs) -> anyhow::Result<Vec<RunRecord>> {
    args.run.check()?;
    args.check()?;
    device::set_threads(args.run.threads)?;
    // A missing GPU, or a precision a device cannot train in, is reported before any data is read.
    for device in device::devices_for(args.run.device)? {
        args.run.precision.check(device)?;
    }
    let (corpus, unigram) = load_corpus(exercise, args, true)?;
    report::run_per_device(args.run.device, &args.run.results_dir, |device| {
        let (record, extra) = run_on(exercise, args, device, &corpus)?;
        let mut extra = extra;
        extra["unigram_test_ppl"] = unigram.into();
        Ok((record, extra))
    })
}

/// Reads the WikiText-2 corpus the flags name and, with `announce`, announces it (a warning for
/// generated data), with the add-one unigram model's test perplexity, the baseline a language
/// model must beat (returned either way).
pub fn load_corpus(exercise: Exercise, args: &LmArgs, announce: bool) -> anyhow::Result<(Corpus, f64)> {
    let dir = args.data_dir();
    let corpus = text::load_corpus(&dir, args.tokenizer)?;
    let vocab = corpus.vocab.len() as i64;
    let unigram = text::unigram_perplexity(&corpus.train, &corpus.test, vocab);
    if !announce {
        return Ok((corpus, unigram));
    }
    if corpus.generated {
        eprintln!(
            "WARNING: WikiText-2 in {} is a GENERATED stand-in, not the real corpus (see {GENERATED_MARKER}); perplexities are not comparable to the course's",
            dir.display()
        );
    }
    println!(
        "{}: WikiText-2 from {} ({} tokenizer): {} / {} / {} tokens (train / valid / test), vocabulary {}; \
         unigram test perplexity {unigram:.1}; LibTorch {}",
        exercise.name,
        dir.display(),
        args.tokenizer.name(),
        corpus.train.numel(),
        corpus.valid.numel(),
        corpus.test.numel(),
        vocab,
        crate::torch_version()
    );
    Ok((corpus, unigram))
}

fn run_on(exercise: Exercise, args: &LmArgs, device: Device, corpus: &Corpus) -> anyhow::Result<(RunRecord, serde_json::Value)> {
    if device.is_cuda() {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    tch::manual_seed(args.run.seed as i64);
    let vs = nn::VarStore::new(device);
    let config = args.model_config(corpus.vocab.len() as i64);
    let model = TransformerLm::new(&vs.root(), &config);
    let params = models::param_count(&vs);
    println!(
        "[{}] Transformer LM: {} layers, d_model {}, d_hid {}, {} heads, vocabulary {}: {} parameters",
        device::device_name(device),
        config.nlayers,
        config.d_model,
        config.d_hid,
        config.nhead,
        config.ntoken,
        report::group_thousands(params)
    );
    let mut optimizer = Sgd::new(models::named_parameters(&vs), SgdConfig { lr: args.lr, ..SgdConfig::default() });
    let train_data = TokenBatches::new(&corpus.train, args.batch_size, args.bptt, device);
    let valid_data = TokenBatches::new(&corpus.valid, args.eval_batch_size, args.bptt, device);
    let test_data = TokenBatches::new(&corpus.test, args.eval_batch_size, args.bptt, device);

    let epochs = args.run.epochs.unwrap_or(exercise.default_epochs);
    let model_identity = serde_json::json!({
        "transformer": config,
        "tokenizer": args.tokenizer.name(),
    });
    let run = format!("{}-transformer-{}", exercise.name, device::device_name(device));
    let train_config = TrainConfig {
        run: run.clone(),
        epochs,
        max_steps: args.run.max_steps,
        seed: args.run.seed,
        lr_schedule: LrSchedule::Step { every: 1, gamma: args.gamma },
        clip_grad_norm: (args.clip > 0.0).then_some(args.clip),
        checkpoint: args.run.checkpoint_dir.as_ref().map(|dir| CheckpointConfig {
            dir: dir.clone(),
            resume: args.run.resume,
            model: model_identity.clone(),
            config: serde_json::to_value(args).expect("flags serialise"),
        }),
        progress: !args.run.quiet,
        verbose: true,
        metric: Metric::Perplexity,
        precision: args.run.precision,
        profile: args.run.profile.then(|| args.run.results_dir.join(format!("{run}.trace.json"))),
        tensorboard: args.run.tensorboard.as_ref().map(|dir| dir.join(&run)),
    };
    let fit = train::fit(&model, &vs, &mut optimizer, &train_data, &valid_data, &train_config, &SingleReplica)?;
    let (test_loss, test_acc) = train::evaluate(&model, &test_data, &SingleReplica, args.run.precision)?;
    println!(
        "[{}] end of training: test loss {test_loss:.4}, test perplexity {:.2}",
        device::device_name(device),
        test_loss.exp()
    );
    let info = RunInfo {
        exercise: exercise.name.into(),
        model: "transformer".into(),
        params,
        device,
        dataset: "wikitext2".into(),
        data_generated: corpus.generated,
        epochs,
        batch_size: args.batch_size as usize,
        lr: args.lr,
        optimizer: optimizer.name().into(),
        seed: args.run.seed,
        world_size: 1,
        precision: args.run.precision,
        flops_per_example: flops::training_flops_per_token(&config, args.bptt),
        peak_tflops: crate::image_classification::peak_tflops(device, args.run.precision, args.run.peak_tflops, true),
    };
    let record = RunRecord::new(info, &fit, (test_loss, test_acc));
    println!("{}", report::compute_summary(&record, corpus.train.numel()));
    let extra = serde_json::json!({
        "test_ppl": test_loss.exp(),
        "valid_ppl": fit.eval_loss.exp(),
        "throughput_unit": "tokens/s",
        "vocab": config.ntoken,
        "tokenizer": args.tokenizer.name(),
        "bptt": args.bptt,
        "model_config": config,
        "history": fit.history,
        "resumed_epochs": fit.resumed_epochs,
    });
    Ok((record, extra))
}
