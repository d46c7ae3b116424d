//! The slides' `Pipe` example (LRZ, "Pipeline Parallelism with Pytorch Pipe"):
//!
//! ```python
//! fc1 = nn.Linear(16, 8).cuda(0)
//! fc2 = nn.Linear(8, 4).cuda(1)
//! model = nn.Sequential(fc1, fc2)
//! model = Pipe(model, chunks=8)
//! input = torch.rand(16, 16).cuda(0)
//! outputs = model(input).local_value()
//! loss = criterion(outputs, targets.cuda(1))
//! ```
//!
//! as stages of this crate's pipeline (one `Linear` layer a stage, GPipe's fill-drain schedule),
//! and set beside naive model parallelism: the same layers on the same devices with the whole
//! batch in one piece, so each device waits while the other works. The slide leaves `criterion`
//! and `targets` undefined; here they are the mean squared error and `torch.rand` targets.
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};

use super::executor::{MicroBatches, PipelineStage, StageOptions};
use super::in_process::run_in_threads;
use super::schedule::{theoretical_bubble, Schedule};
use super::{split_along, Placement, StepReport};
use crate::comm::ProcessGroup;
use crate::device::{self, device_label};
use crate::error::usage;
use crate::models::Masks;
use crate::precision::Precision;

/// The flags of `exercise3 pipe`.
#[derive(Args, Debug, Clone)]
pub struct PipeArgs {
    /// One device per layer, comma-separated: cpu, cuda, cuda:N (a device may repeat)
    /// [default: cuda:0,cuda:1 with two GPUs, cuda:0,cuda:0 with one, cpu,cpu without].
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// The layers' widths: `16,8,4` is the slide's Linear(16, 8) then Linear(8, 4).
    #[arg(long, value_delimiter = ',', default_value = "16,8,4")]
    pub sizes: Vec<i64>,
    /// Rows of the input (the slide's `torch.rand(16, 16)`).
    #[arg(long, default_value_t = 16)]
    pub batch: i64,
    /// Micro-batches per batch (the slide's `chunks=8`).
    #[arg(long, default_value_t = 8)]
    pub chunks: usize,
    /// Timed steps of each, taken in turns (naive, pipeline, naive, ...) after one untimed step of each.
    #[arg(long, default_value_t = 20, value_parser = crate::cli::between(1, crate::cli::MAX_REPEATS))]
    pub steps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// One `Linear` layer of the example, on its own device.
pub struct LinearStage {
    index: usize,
    last: bool,
    vs: nn::VarStore,
    layer: nn::Linear,
}

impl LinearStage {
    /// Layer `index` of `stages`, `Linear(inputs, outputs)` with PyTorch's initialisation.
    pub fn new(index: usize, stages: usize, inputs: i64, outputs: i64, device: Device) -> LinearStage {
        let vs = nn::VarStore::new(device);
        let layer = nn::linear(vs.root() / format!("fc{}", index + 1), inputs, outputs, Default::default());
        LinearStage { index, last: index + 1 == stages, vs, layer }
    }

    /// Copies of the layer's weight and bias gradients, on the CPU (the next step zeroes the
    /// gradients in place).
    pub fn gradients(&self) -> Vec<Tensor> {
        [&self.layer.ws, self.layer.bs.as_ref().expect("a Linear layer with bias")].iter().map(|t| t.grad().to_device(Device::Cpu).copy()).collect()
    }

    fn zero_grad(&mut self) {
        for mut t in self.vs.trainable_variables() {
            t.zero_grad();
        }
    }
}

impl PipelineStage for LinearStage {
    fn index(&self) -> usize {
        self.index
    }

    fn device(&self) -> Device {
        self.vs.device()
    }

    fn is_first(&self) -> bool {
        self.index == 0
    }

    fn is_last(&self) -> bool {
        self.last
    }

    /// `Linear` has no dropout and no shards: `masks` and `tp` go unused.
    fn forward_masked(&self, input: &Tensor, _train: bool, _masks: Masks, _tp: Option<&ProcessGroup>) -> Result<Tensor> {
        Ok(self.layer.forward(input))
    }

    fn loss_and_hits(&self, output: &Tensor, targets: &Tensor, _tp: Option<&ProcessGroup>, _count_hits: bool) -> Result<(Tensor, Option<Tensor>)> {
        Ok((output.mse_loss(targets, Reduction::Mean), None))
    }
}

/// The example's model, input and targets.
pub struct PipeExample {
    pub stages: Vec<LinearStage>,
    pub input: Tensor,
    pub targets: Tensor,
    /// LibTorch threads per stage thread where the stages share the CPU.
    threads: Option<usize>,
}

impl PipeExample {
    /// Checks the flags and builds the layers on their devices, seeded by `args.seed`.
    pub fn new(args: &PipeArgs) -> Result<PipeExample> {
        if args.sizes.len() < 2 || args.sizes.iter().any(|&s| s < 1) {
            return usage(format!("--sizes {:?} needs at least two positive widths (16,8,4 is the slide's two layers)", args.sizes));
        }
        let layers = args.sizes.len() - 1;
        let devices: Vec<Device> = match args.devices.is_empty() {
            true => device::two_stage_devices().into_iter().cycle().take(layers).collect(),
            false => args.devices.iter().map(|name| device::parse_device(name)).collect::<Result<_, _>>()?,
        };
        if devices.len() != layers {
            return usage(format!("--devices names {} devices for the {layers} layers of --sizes {:?}: one device a layer", devices.len(), args.sizes));
        }
        if args.batch < 1 || args.chunks == 0 || args.chunks as i64 > args.batch {
            return usage(format!("--chunks {} must be between 1 and --batch {} (each micro-batch needs a row)", args.chunks, args.batch));
        }
        tch::manual_seed(args.seed as i64);
        let stages = (0..layers).map(|i| LinearStage::new(i, layers, args.sizes[i], args.sizes[i + 1], devices[i])).collect();
        let input = Tensor::rand([args.batch, args.sizes[0]], (Kind::Float, Device::Cpu)).to_device(devices[0]);
        let targets = Tensor::rand([args.batch, args.sizes[layers]], (Kind::Float, Device::Cpu)).to_device(devices[layers - 1]);
        let threads = devices.iter().all(|d| *d == Device::Cpu).then(|| (tch::get_num_threads() as usize / layers).max(1));
        Ok(PipeExample { stages, input, targets, threads })
    }

    /// `model(input)`: the layers one after the other, without gradients.
    pub fn forward(&self) -> Tensor {
        tch::no_grad(|| self.stages.iter().fold(self.input.shallow_clone(), |xs, stage| stage.layer.forward(&xs.to_device(stage.device()))))
    }

    /// One forward and backward pass of the whole batch in `chunks` micro-batches (1: naive
    /// model parallelism), from zeroed gradients.
    pub fn step(&mut self, chunks: usize) -> Result<StepReport> {
        for stage in self.stages.iter_mut() {
            stage.zero_grad();
        }
        let (inputs, weights) = split_along(&self.input, chunks, 0, "rows")?;
        let (targets, _) = split_along(&self.targets, chunks, 0, "rows")?;
        let batches = MicroBatches { inputs, targets, weights, positions: 0 };
        let options = StageOptions { dropout_key: 0, recompute: false, train: true, loss_scale: 1.0, precision: Precision::Full };
        let placement = Placement::one_stage_each(self.stages.len());
        run_in_threads(&mut self.stages, placement, Schedule::GPipe, self.threads, &batches, options)
    }

    /// Every layer's gradients after the last [`PipeExample::step`], in model order.
    pub fn gradients(&self) -> Vec<Tensor> {
        self.stages.iter().flat_map(LinearStage::gradients).collect()
    }

    /// `Linear(16, 8) on cpu, Linear(8, 4) on cpu`.
    pub fn describe_layers(&self) -> String {
        let layer = |s: &LinearStage| format!("Linear({}, {}) on {}", s.layer.ws.size()[1], s.layer.ws.size()[0], device_label(s.device()));
        self.stages.iter().map(layer).collect::<Vec<_>>().join(", ")
    }
}

/// One way of running the example: its step times and idle share.
#[derive(Debug, Clone)]
pub struct Timed {
    pub chunks: usize,
    pub steps: Vec<Duration>,
    /// The devices' measured idle share per step ([`StepReport::bubble_fraction`]).
    pub idle: Vec<f64>,
}

impl Timed {
    fn new(chunks: usize) -> Timed {
        Timed { chunks, steps: Vec::new(), idle: Vec::new() }
    }

    pub fn median_step(&self) -> Duration {
        let mut steps = self.steps.clone();
        steps.sort();
        steps[steps.len() / 2]
    }

    pub fn median_idle(&self) -> f64 {
        let mut idle = self.idle.clone();
        idle.sort_by(f64::total_cmp);
        idle[idle.len() / 2]
    }

    fn record(&mut self, report: &StepReport) {
        self.steps.push(Duration::from_secs_f64(report.wall_s));
        self.idle.push(report.bubble_fraction());
    }
}

/// What `exercise3 pipe` found.
#[derive(Debug, Clone)]
pub struct PipeComparison {
    pub layers: String,
    pub input_shape: Vec<i64>,
    pub output_shape: Vec<i64>,
    pub output_device: Device,
    pub loss: f64,
    /// The largest difference between a gradient of the pipelined step and the naive one's.
    pub gradient_difference: f64,
    pub naive: Timed,
    pub pipeline: Timed,
}

/// Runs the example: `model(input)`, the pipelined step's gradients against the naive step's,
/// then both timed in turns.
pub fn compare(args: &PipeArgs) -> Result<PipeComparison> {
    let mut example = PipeExample::new(args)?;
    let output = example.forward();
    example.step(1)?;
    let naive_gradients = example.gradients();
    let pipeline_report = example.step(args.chunks)?;
    let gradient_difference = naive_gradients.iter().zip(example.gradients()).map(|(a, b)| (a - b).abs().max().double_value(&[])).fold(0.0, f64::max);
    let (mut naive, mut pipeline) = (Timed::new(1), Timed::new(args.chunks));
    for _ in 0..args.steps {
        naive.record(&example.step(1)?);
        pipeline.record(&example.step(args.chunks)?);
    }
    Ok(PipeComparison {
        layers: example.describe_layers(),
        input_shape: example.input.size(),
        output_shape: output.size(),
        output_device: output.device(),
        loss: pipeline_report.loss,
        gradient_difference,
        naive,
        pipeline,
    })
}

impl PipeComparison {
    /// The printout: the model, its output, the gradients' agreement, then the two ways side by side.
    pub fn describe(&self) -> String {
        let stages = self.layers.matches(" on ").count();
        let rows = [("naive model parallelism", &self.naive), ("pipeline (GPipe)", &self.pipeline)];
        let mut lines = vec![
            format!("Pipe(Sequential({}), chunks={})", self.layers, self.pipeline.chunks),
            format!(
                "model(input {:?}): {:?} on {}; loss (mean squared error against random targets) {:.6}",
                self.input_shape,
                self.output_shape,
                device_label(self.output_device),
                self.loss
            ),
            format!("gradients of {} micro-batches against the whole batch at once: largest difference {:.1e}", self.pipeline.chunks, self.gradient_difference),
            String::new(),
            format!("{:<26} {:>7} {:>12} {:>14} {:>22}", "", "chunks", "step (ms)", "devices idle", "GPipe's (D−1)/(N+D−1)"),
        ];
        for (name, timed) in rows {
            lines.push(format!(
                "{name:<26} {:>7} {:>12.3} {:>13.1}% {:>21.1}%",
                timed.chunks,
                timed.median_step().as_secs_f64() * 1e3,
                100.0 * timed.median_idle(),
                100.0 * theoretical_bubble(stages, timed.chunks, 1)
            ));
        }
        lines.push(format!(
            "medians of {} steps each, taken in turns; the pipeline's step takes {:.2}× the naive one's",
            self.naive.steps.len(),
            self.pipeline.median_step().as_secs_f64() / self.naive.median_step().as_secs_f64()
        ));
        lines.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(chunks: usize) -> PipeArgs {
        PipeArgs { devices: vec!["cpu".into(), "cpu".into()], sizes: vec![16, 8, 4], batch: 16, chunks, steps: 1, seed: 3 }
    }

    /// The same layers with plain autograd on the whole batch: what `Pipe` must reproduce.
    fn reference(example: &PipeExample) -> (f64, Vec<Tensor>) {
        let (fc1, fc2) = (&example.stages[0].layer, &example.stages[1].layer);
        let leaves: Vec<Tensor> =
            [&fc1.ws, fc1.bs.as_ref().unwrap(), &fc2.ws, fc2.bs.as_ref().unwrap()].iter().map(|t| t.detach().set_requires_grad(true)).collect();
        let hidden = example.input.matmul(&leaves[0].tr()) + &leaves[1];
        let output = hidden.matmul(&leaves[2].tr()) + &leaves[3];
        let loss = (output - &example.targets).square().mean(Kind::Float);
        loss.backward();
        (loss.double_value(&[]), leaves.iter().map(Tensor::grad).collect())
    }

    #[test]
    fn every_chunking_gives_the_whole_batchs_loss_and_gradients() {
        let mut example = PipeExample::new(&args(8)).unwrap();
        let (loss, expected) = reference(&example);
        // 8 even micro-batches, 3 uneven ones (6, 5, 5 rows), and one (naive model parallelism).
        for chunks in [8, 3, 1] {
            let report = example.step(chunks).unwrap();
            assert!((report.loss - loss).abs() < 1e-6, "chunks {chunks}: loss {} against {loss}", report.loss);
            for (got, want) in example.gradients().iter().zip(&expected) {
                let difference = (got - want).abs().max().double_value(&[]);
                assert!(difference < 1e-6, "chunks {chunks}: a gradient differs by {difference}");
            }
        }
    }

    #[test]
    fn the_example_has_the_slides_layers_and_shapes() {
        let example = PipeExample::new(&args(8)).unwrap();
        assert_eq!(example.describe_layers(), "Linear(16, 8) on cpu, Linear(8, 4) on cpu");
        assert_eq!(example.forward().size(), [16, 4]);
    }

    #[test]
    fn impossible_flags_are_usage_errors() {
        let cases = [
            (PipeArgs { chunks: 17, ..args(8) }, "--chunks 17 must be between 1 and --batch 16"),
            (PipeArgs { chunks: 0, ..args(8) }, "--chunks 0 must be between 1"),
            (PipeArgs { devices: vec!["cpu".into()], ..args(8) }, "--devices names 1 devices for the 2 layers"),
            (PipeArgs { sizes: vec![16], ..args(8) }, "needs at least two positive widths"),
            (PipeArgs { sizes: vec![16, 0, 4], ..args(8) }, "needs at least two positive widths"),
        ];
        for (args, expected) in cases {
            let err = PipeExample::new(&args).err().expect("refused");
            assert!(err.is::<crate::error::UsageError>() && err.to_string().contains(expected), "{err}");
        }
    }
}
