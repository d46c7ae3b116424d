//! Who a step's rank works with: its replicas and the strategy they keep their gradients equal
//! by ([`Replication`]), the ranks holding the rest of its model, the tensor-parallel shards
//! ([`Parallel`]).
use super::{DataParallelPlan, Strategy};
use crate::comm::data_parallel::GradientAverager;
use crate::comm::layout::{Groups, ShardGroups};
use crate::comm::tensor_parallel::{SplitTable, TensorShards};
use crate::comm::ProcessGroup;

/// How the replicas of a data-parallel job keep their gradients equal: the group of ranks
/// holding the same variables, the bucketed averager (`--bucket-mb`, `--fp16-allreduce`), the
/// strategy that averages, and the replicas' shard groups where the mesh groups them
/// (`--shard-group`, for HSDP).
#[derive(Clone, Copy)]
pub struct Replication<'g> {
    pub group: &'g ProcessGroup,
    pub averager: GradientAverager,
    pub strategy: &'static dyn Strategy,
    pub shard_groups: Option<ShardGroups<'g>>,
}

/// Who a step's rank works with: its place in the job's mesh ([`Groups`]) seen from one step.
#[derive(Clone, Default)]
pub struct Parallel<'g> {
    /// The data-parallel replicas of this rank's variables.
    pub replicas: Option<Replication<'g>>,
    /// The ranks holding the other parts of this replica's model (pipeline stages): gradient
    /// norms, the scaler's verdict and checkpoints are agreed or gathered over them.
    pub model: Option<&'g ProcessGroup>,
    /// The whole job (its rank 0 reads and writes checkpoints).
    pub world: Option<&'g ProcessGroup>,
    /// This rank's replica (0 holds the copy a checkpoint is gathered from).
    pub replica: usize,
    /// The tensor-parallel shards of this rank's layers, which one it is and how the model's
    /// variables are cut: checkpoints hold the whole tensors, put together from the shards and
    /// cut again on resume.
    pub tp: Option<TensorShards<'g>>,
}

impl<'g> Parallel<'g> {
    /// This rank's place in `groups`' layout, its replicas keeping their gradients equal as
    /// `dp` says, its model's variables cut over tensor-parallel shards as `splits` (its layers'
    /// report) says:
    /// the one place a step learns who it works with.
    pub fn of(groups: &'g Groups<'g>, dp: DataParallelPlan, splits: SplitTable) -> Parallel<'g> {
        let splits = std::sync::Arc::new(splits);
        Parallel {
            replicas: groups.dp().map(|group| Replication { group, averager: dp.averager, strategy: dp.sync.strategy(), shard_groups: groups.shard_groups() }),
            model: groups.model(),
            world: Some(groups.world),
            replica: groups.coords.replica,
            tp: groups.tp().map(|group| TensorShards { group, shard: groups.shard(), splits: splits.clone() }),
        }
    }

    pub fn replica_group(&self) -> Option<&'g ProcessGroup> {
        self.replicas.map(|r| r.group)
    }
}
