//! The recipe a run trains with: the preset's defaults, the flags given, the learning rate
//! scaled for the effective batch and its schedule laid out over the run's steps.
use serde::Serialize;

use crate::flags::RecipeArgs;
use crate::presets::Preset;
use crate::train::{LrSchedule, Warmup};

/// The recipe a run trains with: the preset's [`crate::presets::Recipe`] with the flags given,
/// the learning rate scaled and its schedule laid out over the run's steps.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RunRecipe {
    pub epochs: usize,
    pub batch_size: usize,
    pub accumulate: usize,
    pub optimizer: crate::optim::OptimizerKind,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub clip: f64,
    pub schedule: LrSchedule,
}

impl RunRecipe {
    /// `preset`'s recipe with `args` applied, for `replicas` data-parallel replicas whose
    /// epochs have `batches_per_epoch` batches each.
    pub fn resolve(preset: &Preset, args: &RecipeArgs, replicas: usize, batches_per_epoch: usize, epochs: usize) -> RunRecipe {
        let base = preset.recipe_for(args);
        // Linear scaling: the effective batch grows by --accumulate × replicas.
        let growth = (args.accumulate * replicas) as f64;
        let lr = args.lr.unwrap_or(base.lr) * if args.scale_lr { growth } else { 1.0 };
        let steps_per_epoch = batches_per_epoch.div_ceil(args.accumulate).max(1);
        let warmup_steps = args.warmup_steps.max(args.warmup_epochs * steps_per_epoch);
        let mut schedule = LrSchedule::new(args.lr_schedule.unwrap_or(base.schedule), epochs * steps_per_epoch);
        schedule.gamma = args.gamma.unwrap_or(base.gamma);
        schedule.warmup = match (warmup_steps, base.warmup_steps) {
            (0, 0) => None,
            (0, steps) => Some(Warmup { steps, start: args.warmup_start.unwrap_or(crate::presets::WARMUP_START) }),
            (steps, _) => Some(Warmup { steps, start: args.warmup_start.unwrap_or(1.0 / growth) }),
        };
        RunRecipe {
            epochs,
            batch_size: args.batch_size.unwrap_or(base.batch_size),
            accumulate: args.accumulate,
            optimizer: args.optimizer.unwrap_or(base.optimizer),
            lr,
            momentum: args.momentum.unwrap_or(base.momentum),
            weight_decay: args.weight_decay.unwrap_or(base.weight_decay),
            clip: args.clip.unwrap_or(base.clip),
            schedule,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::EXERCISE2;
    use crate::train::ScheduleKind;

    #[test]
    fn linear_scaling_and_warmup_follow_the_effective_batch() {
        // 2 replicas × --accumulate 4: an 8 times larger batch, so 8 times the rate, reached
        // after 2 epochs of 25 steps (100 batches / 4) from the small batch's rate.
        let args = RecipeArgs { accumulate: 4, scale_lr: true, warmup_epochs: 2, lr: Some(0.1), ..RecipeArgs::default() };
        let recipe = RunRecipe::resolve(&EXERCISE2, &args, 2, 100, 10);
        assert_eq!((recipe.lr, recipe.accumulate, recipe.batch_size), (0.8, 4, 100));
        assert_eq!(recipe.schedule.warmup, Some(Warmup { steps: 50, start: 0.125 }));
        assert_eq!(recipe.schedule.total_steps, 250);
        assert!((recipe.schedule.lr(recipe.lr, 0, 0) - 0.1).abs() < 1e-12, "starts at the unscaled rate");
        assert!((recipe.schedule.lr(recipe.lr, 50, 2) - 0.8).abs() < 1e-12);
        // Without --scale-lr nothing is scaled; the preset fills what is not given.
        let plain = RunRecipe::resolve(&EXERCISE2, &RecipeArgs::default(), 4, 100, 10);
        assert_eq!((plain.lr, plain.schedule.kind, plain.schedule.warmup), (1e-3, ScheduleKind::Constant, None));
    }

    #[test]
    fn a_warmup_needs_to_know_where_it_starts() {
        let err = RecipeArgs { warmup_steps: 10, ..RecipeArgs::default() }.check().unwrap_err();
        assert!(format!("{err}").contains("use it with --scale-lr"), "{err}");
        assert!(RecipeArgs { warmup_steps: 10, warmup_start: Some(0.0), ..RecipeArgs::default() }.check().is_ok());
        let err = RecipeArgs { accumulate: 0, ..RecipeArgs::default() }.check().unwrap_err();
        assert!(format!("{err}").contains("--accumulate must be at least 1"));
        let one_cycle = RecipeArgs { scale_lr: true, warmup_epochs: 1, lr_schedule: Some(ScheduleKind::OneCycle), ..RecipeArgs::default() };
        assert!(format!("{}", one_cycle.check().unwrap_err()).contains("warms up by itself"));
    }
}
