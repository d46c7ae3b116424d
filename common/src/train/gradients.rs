//! Making a step's gradients final, the same for every kind of step: averaged over the
//! data-parallel replicas, unscaled (float16) with one inf/NaN verdict for the whole model, and
//! clipped by the norm over the whole model, however it is spread over ranks.
use anyhow::Result;
use tch::Tensor;

use super::step::Parallel;
use crate::dist::GradientSync;
use crate::optim::{NormScope, Optimizer};
use crate::precision::GradScaler;

/// See the module docs; returns the total gradient norm when clipping (before clipping, as
/// `torch.nn.utils.clip_grad_norm_` returns it). `counted`: which of `params` this rank counts
/// in the norm (see [`NormScope`]; empty: all).
pub fn finish(
    parallel: Parallel,
    params: &[Tensor],
    counted: &[bool],
    optimizer: &mut dyn Optimizer,
    scaler: Option<&GradScaler>,
    clip: Option<f64>,
) -> Result<Option<f64>> {
    if let Some(replicas) = &parallel.replicas {
        if replicas.sync == GradientSync::Ddp {
            replicas.averager.average(replicas.group, params)?;
        }
    }
    // A Horovod-style optimizer averages here; a local one does nothing.
    optimizer.synchronize()?;
    if let Some(scaler) = scaler {
        scaler.unscale(params);
        // One verdict for the model: a stage that saw an inf makes every stage skip the step
        // (the replicas agree already: the inf went into their averages).
        if let Some(model) = parallel.model {
            scaler.agree(model)?;
        }
    }
    match clip {
        Some(max_norm) => Ok(Some(optimizer.clip_grad_norm(params, max_norm, NormScope { model: parallel.model, counted })?)),
        None => Ok(None),
    }
}
