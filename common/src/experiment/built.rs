//! What a run has once it is built (the model's plan, its step, optimizer, recipe and data)
//! and where it trains: handed from the builder to the loop and to the results.
use std::rc::Rc;

use tch::Device;

use super::{RunRecipe, Sources};
use crate::comm::layout::Groups;
use crate::optim::Optimizer;
use crate::parallel::{GradientSync, RunPart};
use crate::train::TrainStep;

/// What a run trains, built before its first step.
pub(super) struct Built<'g, M> {
    pub plan: M,
    pub step: Box<dyn TrainStep<'g> + 'g>,
    pub optimizer: Box<dyn Optimizer + 'g>,
    pub recipe: RunRecipe,
    pub sources: Sources,
    /// The data-parallel style the replicas keep their copies equal by.
    pub sync: GradientSync,
    /// `<exercise>-<model>-<device>`: the results' and checkpoints' name.
    pub name: String,
    /// [`Experiment::data_identity`], kept in its checkpoints.
    pub data_identity: serde_json::Value,
}

/// What the job's style keeps for the run ([`crate::parallel::Job::run_part`]: its link to the
/// ranks it set apart); none for most styles.
pub(super) type RunPartRef<'w> = Option<&'w Rc<dyn RunPart + 'w>>;

/// Where a run trains: the job's groups, what its style keeps for the run (if anything) and
/// this rank's device.
#[derive(Clone, Copy)]
pub(super) struct Place<'g> {
    pub groups: &'g Groups<'g>,
    pub run_part: RunPartRef<'g>,
    pub device: Device,
}
