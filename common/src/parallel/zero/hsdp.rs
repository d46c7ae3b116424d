//! HSDP, hybrid sharded data parallelism (PyTorch FSDP's `HYBRID_SHARD`, torchtitan's
//! `dp_shard × dp_replicate`, DeepSpeed ZeRO++'s hpZ): ZeRO-3 within each shard group of
//! replicas (`--shard-group G`: G consecutive ranks, a node's), plain replication across the
//! groups. The parameters are gathered, and the gradients reduce-scattered, over the shard group
//! only (the fast links); across the groups each rank all-reduces its block of the gradient,
//! 1/G of them, once per step (the slow links carry 2(R − 1)/R of Ψ/G rather than ZeRO-3's
//! three passes over Ψ). Each rank holds (8 + K)Ψ/G of model state.
//!
//! The sharding is ZeRO's ([`Shards::hybrid`]); what this strategy decides is where it runs
//! over, and that only the first shard group's blocks go into checkpoints (the other groups
//! hold copies of them).
use std::rc::Rc;

use anyhow::{Context, Result};
use tch::Tensor;

use super::{Shards, Zero, ZeroStage};
use crate::comm::group::Collective;
use crate::error::usage;
use crate::optim::Optimizer;
use crate::parallel::costs::{Among, Costs, RankModel, Sharding, StateBytes, Talk};
use crate::parallel::{BuildOptimizer, GradientSync, Replication, Strategy};
use crate::train::GradientCollective;

pub struct Hsdp;

impl Strategy for Hsdp {
    fn sync(&self) -> GradientSync {
        GradientSync::Hsdp
    }

    fn shard_parameters<'g>(
        &self,
        replication: &Replication<'g>,
        named: Vec<(String, Tensor)>,
        part_of: &dyn Fn(&str) -> Result<usize>,
    ) -> Result<Option<Rc<Shards<'g>>>> {
        let groups = replication.shard_groups.context("HSDP shards over the replicas' shard groups, and this job's mesh has none")?;
        let parts = super::parts(&named, part_of)?;
        Ok(Some(Shards::hybrid(groups.shard, groups.replicate, named, parts, replication.averager.bucket_bytes)?))
    }

    /// ZeRO-3's: the optimizer of the block the step's shards already are.
    fn optimizer<'g: 'o, 'o>(
        &self,
        replication: &Replication<'g>,
        params: Vec<(String, Tensor)>,
        zero3: Option<Rc<Shards<'g>>>,
        build: BuildOptimizer<'_, 'o>,
    ) -> Result<Box<dyn Optimizer + 'o>> {
        Zero(ZeroStage::Parameters).optimizer(replication, params, zero3, build)
    }

    /// Within the shard group; the all-reduce across the groups follows in the optimizer's
    /// `synchronize`.
    fn gradient_collective(&self, _clip: bool) -> GradientCollective {
        GradientCollective::ReduceScatter
    }

    fn check_stages(&self) -> Result<()> {
        usage("--shard-group shards whole models (HSDP); with pipeline stages or tensor-parallel shards use --zero 1 without it")
    }
}

/// ZeRO-3's costs within a shard group (its N is the group's size), and what the groups add:
/// the block's gradient all-reduced across them.
impl Costs for Hsdp {
    fn model_state(&self, psi: f64, k: f64, n: f64) -> StateBytes {
        Zero(ZeroStage::Parameters).model_state(psi, k, n)
    }

    fn formula(&self) -> &'static str {
        Zero(ZeroStage::Parameters).formula()
    }

    fn state_sharded(&self) -> bool {
        true
    }

    fn parameters_sharded(&self) -> bool {
        true
    }

    fn sharding(&self, rank: &RankModel) -> Option<Sharding> {
        Zero(ZeroStage::Parameters).sharding(rank)
    }

    /// ZeRO-3's, the block's gradient averaged over the shard groups beside it (the
    /// all-reduce's result buffer), where there are several.
    fn update_bytes(&self, rank: &RankModel, gradients: f64) -> f64 {
        let sharding = self.sharding(rank).expect("HSDP divides the state");
        let groups_average = rank.state_shards < rank.replicas;
        super::costs::parts_update(rank, &sharding, gradients * if groups_average { 2.0 } else { 1.0 })
    }

    fn averaging_bytes(&self, psi: f64, bucket: f64) -> f64 {
        Zero(ZeroStage::Parameters).averaging_bytes(psi, bucket)
    }

    /// ZeRO-3's within the shard group (the fast links); across the groups, each rank's block
    /// of the gradient, 1/G of them, all-reduced once.
    fn communication(&self, replicas: usize, state_shards: usize, gradient_bytes: f64) -> Vec<Talk> {
        let group = state_shards;
        let within = Among::Replicas { count: group, stride: 1 };
        vec![
            Talk { collective: Collective::ReduceScatter, among: within, bytes: gradient_bytes, times: 1.0 },
            Talk { collective: Collective::AllGather, among: within, bytes: gradient_bytes, times: 2.0 },
            Talk {
                collective: Collective::AllReduce,
                among: Among::Replicas { count: replicas / group, stride: group },
                bytes: gradient_bytes / group as f64,
                times: 1.0,
            },
        ]
    }

    /// Whole models only, in every shard group size that divides the replicas, between plain
    /// ZeRO-3 (one group) and plain replication (groups of one).
    fn shard_groups(&self, replicas: usize, whole_model: bool) -> Vec<Option<usize>> {
        if !whole_model {
            return Vec::new();
        }
        (2..replicas).filter(|g| replicas.is_multiple_of(*g)).map(Some).collect()
    }
}
