//! The training loop's view of a data-parallel job: [`DataParallel`] implements
//! [`crate::train::Replicas`] over a [`ProcessGroup`].
use super::data_parallel::{
    broadcast_buffers, broadcast_optimizer_state, broadcast_parameters, DistributedOptimizer, GradientAverager,
};
use super::{ProcessGroup, ReduceOp};
use crate::optim::Optimizer;
use crate::train::Replicas;
use tch::{nn, Device, Kind, Tensor};

/// Where a replica averages its gradients: the two styles of the course's exercises, the same
/// collectives either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GradientSync {
    /// In the training loop, right after backward (PyTorch DDP's reducer).
    Ddp,
    /// Inside the optimizer's step, through a [`DistributedOptimizer`] (Horovod).
    Horovod,
}

/// One replica of a data-parallel job: rank 0's state at the start, gradients averaged in
/// buckets after every backward (by the loop or by the optimizer, see [`GradientSync`]),
/// metrics summed over the ranks.
pub struct DataParallel<'a> {
    group: &'a ProcessGroup,
    averager: GradientAverager,
    sync: GradientSync,
}

impl<'a> DataParallel<'a> {
    pub fn new(group: &'a ProcessGroup, averager: GradientAverager, sync: GradientSync) -> Self {
        DataParallel { group, averager, sync }
    }
}

impl Replicas for DataParallel<'_> {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn start_from_root(
        &self,
        vs: &nn::VarStore,
        optimizer: &mut dyn Optimizer,
        (epoch, step): (usize, usize),
    ) -> anyhow::Result<(usize, usize)> {
        broadcast_parameters(self.group, vs, 0)?;
        broadcast_optimizer_state(self.group, optimizer, 0)?;
        let mut progress = Tensor::from_slice(&[epoch as i64, step as i64]);
        self.group.broadcast(&mut progress, 0)?;
        let progress = Vec::<i64>::try_from(&progress)?;
        Ok((progress[0] as usize, progress[1] as usize))
    }

    fn distribute_optimizer<'s>(&'s self, optimizer: Box<dyn Optimizer + 's>, params: Vec<Tensor>) -> Box<dyn Optimizer + 's> {
        match self.sync {
            GradientSync::Ddp => optimizer,
            GradientSync::Horovod => Box::new(DistributedOptimizer::new(optimizer, params, self.group, self.averager)),
        }
    }

    fn average_gradients(&self, params: &[Tensor]) -> anyhow::Result<()> {
        match self.sync {
            GradientSync::Ddp => self.averager.average(self.group, params),
            GradientSync::Horovod => Ok(()), // the optimizer's step averages them
        }
    }

    fn sync_buffers(&self, vs: &nn::VarStore) -> anyhow::Result<()> {
        broadcast_buffers(self.group, vs, 0)
    }

    fn gather(&self, values: &[f64]) -> anyhow::Result<Vec<Vec<f64>>> {
        let mine = Tensor::from_slice(values).to_kind(Kind::Double).to_device(Device::Cpu);
        self.group.all_gather(&mine)?.iter().map(|t| Ok(Vec::<f64>::try_from(t)?)).collect()
    }

    fn sum(&self, values: &[f64]) -> anyhow::Result<Vec<f64>> {
        let mut sums = Tensor::from_slice(values).to_kind(Kind::Double).to_device(Device::Cpu);
        self.group.all_reduce(&mut sums, ReduceOp::Sum)?;
        Ok(Vec::<f64>::try_from(&sums)?)
    }
}
