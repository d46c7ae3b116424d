//! What ZeRO's stages cost (the estimator's and the planner's questions, [`Costs`]): the
//! model state of Rajbhandari et al. 2019 with float32 parameters and gradients, the buckets
//! this module's [`super::Shards`] makes, and the collectives of a step.
use super::{Zero, ZeroStage};
use crate::comm::group::Collective;
use crate::parallel::costs::{Costs, RankModel, Sharding, StateBytes, Talk};

impl Costs for Zero {
    /// The paper counts 2-byte parameters and gradients and K = 12 for mixed-precision Adam
    /// (its float32 copy of the parameters and two moments); here parameters and gradients are
    /// float32, 4 bytes each, Adam's K is 8, and ZeRO's float32 block (the rank's copy of its
    /// share, the paper's master weights) adds 4 bytes per sharded parameter to the optimizer's
    /// part; at stage 3 the block is the parameters themselves.
    fn model_state(&self, psi: f64, k: f64, n: f64) -> StateBytes {
        let (parameters, gradients, optimizer) = match self.0 {
            ZeroStage::OptimizerState => (4.0 * psi, 4.0 * psi, (4.0 + k) * psi / n),
            ZeroStage::Gradients => (4.0 * psi, 4.0 * psi / n, (4.0 + k) * psi / n),
            ZeroStage::Parameters => (4.0 * psi / n, 4.0 * psi / n, k * psi / n),
        };
        StateBytes { parameters, gradients, optimizer }
    }

    fn formula(&self) -> &'static str {
        match self.0 {
            ZeroStage::OptimizerState => "ZeRO-1: 8Ψ + (4 + K)Ψ/N",
            ZeroStage::Gradients => "ZeRO-2: 4Ψ + (8 + K)Ψ/N",
            ZeroStage::Parameters => "ZeRO-3: (8 + K)Ψ/N",
        }
    }

    fn state_sharded(&self) -> bool {
        true
    }

    fn parameters_sharded(&self) -> bool {
        self.0 == ZeroStage::Parameters
    }

    /// Stage 1: one bucket of every parameter; stage 2: `--bucket-mb` buckets in the order
    /// gradients arrive; stage 3: the model's parts.
    fn sharding(&self, rank: &RankModel) -> Option<Sharding> {
        let buckets = match self.0 {
            ZeroStage::OptimizerState => vec![rank.psi()],
            ZeroStage::Gradients => gradient_buckets(rank.params, rank.bucket_bytes),
            ZeroStage::Parameters => parts(rank.params),
        };
        Some(Sharding::of(&buckets, rank.state_shards))
    }

    fn update_bytes(&self, rank: &RankModel, gradients: f64) -> f64 {
        let sharding = self.sharding(rank).expect("ZeRO divides the state");
        match self.0 {
            // Reducing (the whole gradients flattened, this rank's slice and the block's
            // gradient), then publishing the blocks, the whole gradients still held.
            ZeroStage::OptimizerState => gradients + sharding.reduce(rank.psi()).max(sharding.block() + sharding.publish()),
            // Each bucket reduced as the backward pass ends its gradients (counted here without
            // the activations its earlier layers still hold), then publishing as ZeRO-1 (every
            // bucket's cat) beside the block's gradient.
            ZeroStage::Gradients => {
                let reduce = gradient_buckets(rank.params, rank.bucket_bytes).iter().map(|&b| 4.0 * b + sharding.reduce(b)).fold(0.0, f64::max);
                reduce.max(gradients + sharding.publish())
            }
            ZeroStage::Parameters => parts_update(rank, &sharding, gradients),
        }
    }

    /// A bucket of gradients flattened for the reduce-scatter, and (stages 1 and 2) the
    /// parameters gathered whole again after the update; at stage 3 a bucket alone (its parts
    /// are gathered in the passes, counted there).
    fn averaging_bytes(&self, psi: f64, bucket: f64) -> f64 {
        let (grads, bucket) = (4.0 * psi, bucket.min(4.0 * psi));
        match self.0 {
            ZeroStage::OptimizerState | ZeroStage::Gradients => bucket + grads,
            ZeroStage::Parameters => bucket,
        }
    }

    /// The gradients reduce-scattered and the blocks all-gathered back (an all-reduce's two
    /// halves); at stage 3 the parameters gathered twice, for the forward and the backward pass.
    fn communication(&self, replicas: usize, _state_shards: usize, gradient_bytes: f64) -> Vec<Talk> {
        let gathers = if self.0 == ZeroStage::Parameters { 2.0 } else { 1.0 };
        vec![Talk::replicas(Collective::ReduceScatter, replicas, gradient_bytes, 1.0), Talk::replicas(Collective::AllGather, replicas, gradient_bytes, gathers)]
    }

    /// Over several replicas only; stages 2 and 3 shard a whole model only (exercise1_nlp's step).
    fn shard_groups(&self, replicas: usize, whole_model: bool) -> Vec<Option<usize>> {
        let planned = replicas > 1 && (whole_model || self.0 == ZeroStage::OptimizerState);
        if planned {
            vec![None]
        } else {
            Vec::new()
        }
    }
}

/// ZeRO-3's update (and HSDP's): each part reduced at the end of its backward pass (the output
/// layer's is counted in the passes; here the others, without the activations the earlier
/// layers still hold); then the block's gradient, `gradients` (HSDP: with the all-reduce's
/// result buffer beside it).
pub(super) fn parts_update(rank: &RankModel, sharding: &Sharding, gradients: f64) -> f64 {
    let reduce = parts(rank.params).iter().map(|&p| 8.0 * p + sharding.reduce(p)).fold(0.0, f64::max);
    reduce.max(gradients)
}

/// ZeRO-2's buckets of `params` (elements each): in the order gradients arrive (the list
/// reversed), a bucket closed once it holds `bucket` bytes or more ([`super::Shards`]' build).
fn gradient_buckets(params: &[(String, f64)], bucket: f64) -> Vec<f64> {
    let mut buckets = vec![0.0];
    for (_, n) in params.iter().rev() {
        if 4.0 * buckets.last().expect("a bucket") >= bucket {
            buckets.push(0.0);
        }
        *buckets.last_mut().expect("a bucket") += n;
    }
    buckets
}

/// ZeRO-3's parts of `params` (elements each): the embedding, each encoder layer, the output
/// layer (`TransformerLm::part_of`).
fn parts(params: &[(String, f64)]) -> Vec<f64> {
    let mut parts: Vec<(String, f64)> = Vec::new();
    for (name, n) in params {
        let part = match name.strip_prefix("transformer_encoder.layers.") {
            Some(rest) => rest.split('.').next().unwrap_or_default().to_string(),
            None => name.split('.').next().unwrap_or_default().to_string(),
        };
        match parts.iter_mut().find(|(p, _)| *p == part) {
            Some((_, total)) => *total += n,
            None => parts.push((part, *n)),
        }
    }
    parts.into_iter().map(|(_, n)| n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_says_its_collectives_and_where_the_planner_may_lay_it_out() {
        let talks = |stage| Zero(stage).communication(4, 4, 100.0).iter().map(|t| (t.collective, t.times)).collect::<Vec<_>>();
        assert_eq!(talks(ZeroStage::OptimizerState), [(Collective::ReduceScatter, 1.0), (Collective::AllGather, 1.0)]);
        assert_eq!(talks(ZeroStage::Parameters), [(Collective::ReduceScatter, 1.0), (Collective::AllGather, 2.0)]);
        assert_eq!(Zero(ZeroStage::OptimizerState).shard_groups(2, false), [None]);
        assert!(Zero(ZeroStage::Gradients).shard_groups(2, false).is_empty());
        assert!(Zero(ZeroStage::Parameters).shard_groups(1, true).is_empty());
    }
}
