//! Freezing the first blocks of a model (transfer learning): feature extraction trains the head
//! alone, fine-tuning the last few blocks, on top of pretrained ones that stay as they were.
//!
//! A frozen variable stops requiring gradients, so nothing downstream has to know about it:
//! [`super::named_parameters`] leaves it out, and with it the optimizer (no state for it), the
//! gradient averaging of data-parallel replicas, ZeRO's shards and the gradient norm. Backward
//! stops where the first trained block begins. A frozen block's batch norms normalise with their
//! running statistics and leave them unchanged ([`BatchNorm`]), as torchvision's recipe of
//! calling `eval()` on the frozen part does.
use anyhow::{bail, Result};
use tch::nn::{self, ModuleT};
use tch::Tensor;

use super::blocks::Blocks;

/// The last part of a batch norm's running mean's name (torchvision's, and tch's): one per
/// batch norm.
const RUNNING_MEAN: &str = ".running_mean";

/// Which blocks of a model train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trainable {
    /// Every block (training from scratch, or fine-tuning everything).
    #[default]
    All,
    /// The last N blocks (`--train-last N`; `--freeze backbone` is the head alone, N = 1).
    Last(usize),
}

/// What [`freeze`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frozen {
    /// The trained blocks' names, in order.
    pub trained: Vec<String>,
    /// The blocks of the model.
    pub blocks: usize,
    /// Batch norms in the frozen blocks (each with its running statistics).
    pub frozen_batch_norms: usize,
}

impl Frozen {
    /// One line for the console: which blocks train and how many are frozen.
    pub fn describe(&self) -> String {
        let frozen = self.blocks - self.trained.len();
        let batch_norms = match self.frozen_batch_norms {
            0 => String::new(),
            n => format!("; their {n} batch norms on their running statistics"),
        };
        format!(
            "training the last {} of {} blocks ({}); the {frozen} before them frozen (no gradients, no optimizer state{batch_norms})",
            self.trained.len(),
            self.blocks,
            self.trained.join(", ")
        )
    }
}

impl Trainable {
    /// Checks that `self` leaves something to train and names no more blocks than `blocks` of
    /// the model `arch` has.
    pub fn check(self, blocks: &Blocks, arch: &str) -> Result<()> {
        match self {
            Trainable::All => Ok(()),
            Trainable::Last(0) => bail!("--train-last 0 would train nothing: give at least 1 (the head)"),
            Trainable::Last(n) if n > blocks.len() => bail!(
                "--train-last {n}: {arch} has {} blocks ({}); give at most {}",
                blocks.len(),
                blocks.iter().map(|b| b.name.as_str()).collect::<Vec<_>>().join(", "),
                blocks.len()
            ),
            Trainable::Last(_) => Ok(()),
        }
    }
}

/// Makes the variables of every block before the last `n` of `blocks` non-trainable
/// (`requires_grad` false), parameters and batch-norm statistics alike. Nothing to do for
/// [`Trainable::All`]. Fails on a count the model does not have, and on a variable that belongs
/// to no block (the blocks would not describe this model).
pub fn freeze(vs: &nn::VarStore, blocks: &Blocks, trainable: Trainable, arch: &str) -> Result<Option<Frozen>> {
    let Trainable::Last(n) = trainable else { return Ok(None) };
    trainable.check(blocks, arch)?;
    let first_trained = blocks.len() - n;
    let mut frozen_batch_norms = 0;
    for (name, mut variable) in vs.variables() {
        let Some(position) = blocks.position(&name) else {
            bail!("variable {name} belongs to no block of {arch}");
        };
        if position < first_trained {
            let _ = variable.requires_grad_(false);
            frozen_batch_norms += usize::from(name.ends_with(RUNNING_MEAN));
        }
    }
    let trained = blocks.iter().skip(first_trained).map(|b| b.name.clone()).collect();
    Ok(Some(Frozen { trained, blocks: blocks.len(), frozen_batch_norms }))
}

/// A batch norm that trains only while its own parameters do: in a frozen block (its scale and
/// shift not requiring gradients) it runs as in evaluation even in training, normalising with
/// the running statistics and not updating them. Those statistics belong to the pretrained
/// weights as much as the scale and shift do; a few batches of another data set would
/// otherwise drift them under the frozen layers that expect them.
#[derive(Debug)]
pub(super) struct BatchNorm(pub(super) nn::BatchNorm);

impl BatchNorm {
    fn trains(&self) -> bool {
        self.0.ws.as_ref().is_none_or(Tensor::requires_grad)
    }
}

impl ModuleT for BatchNorm {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.0.forward_t(xs, train && self.trains())
    }
}
