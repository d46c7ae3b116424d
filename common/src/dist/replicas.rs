//! The training loop's view of a data-parallel job: [`DataParallel`] implements
//! [`crate::train::Replicas`] over a [`ProcessGroup`].
use super::data_parallel::{broadcast_buffers, broadcast_optimizer_state, broadcast_parameters, GradientAverager};
use super::{ProcessGroup, ReduceOp};
use crate::optim::Optimizer;
use crate::train::Replicas;
use tch::{nn, Device, Kind, Tensor};

/// One replica of a data-parallel job: rank 0's state at the start, gradients averaged in
/// buckets after every backward, metrics summed over the ranks.
pub struct DataParallel<'a> {
    group: &'a ProcessGroup,
    averager: GradientAverager,
}

impl<'a> DataParallel<'a> {
    pub fn new(group: &'a ProcessGroup, averager: GradientAverager) -> Self {
        DataParallel { group, averager }
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

    fn average_gradients(&self, params: &[Tensor]) -> anyhow::Result<()> {
        self.averager.average(self.group, params)
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
