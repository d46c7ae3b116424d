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
use crate::error::usage;
use crate::optim::Optimizer;
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
