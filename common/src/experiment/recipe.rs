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
    pub fn resolve<M>(preset: &Preset<M>, args: &RecipeArgs, replicas: usize, batches_per_epoch: usize, epochs: usize) -> RunRecipe {
        let base = preset.recipe_for(args);
        // Linear scaling: the effective batch grows by --accumulate × replicas.
        let growth = (args.accumulate * replicas) as f64;
        let lr = args.lr.unwrap_or(base.lr) * if args.scale_lr || base.scale_lr { growth } else { 1.0 };
        let steps_per_epoch = batches_per_epoch.div_ceil(args.accumulate).max(1);
        // A warm-up asked for (0: none, the preset's neither), else the preset's.
        let asked = args.warmup_steps.or(args.warmup_epochs.map(|epochs| epochs * steps_per_epoch));
        let mut schedule = LrSchedule::new(args.lr_schedule.unwrap_or(base.schedule), epochs * steps_per_epoch);
        schedule.gamma = args.gamma.unwrap_or(base.gamma);
        schedule.warmup = match (asked, base.warmup_steps) {
            (Some(0), _) | (None, 0) => None,
            (None, steps) => Some(Warmup { steps, start: args.warmup_start.unwrap_or(crate::presets::WARMUP_START) }),
            (Some(steps), _) => Some(Warmup { steps, start: args.warmup_start.unwrap_or(1.0 / growth) }),
        };
        RunRecipe {
            epochs,
            batch_size: Self::batch_size(preset, args),
            accumulate: args.accumulate,
            optimizer: args.optimizer.unwrap_or(base.optimizer),
            lr,
            momentum: args.momentum.unwrap_or(base.momentum),
            weight_decay: args.weight_decay.unwrap_or(base.weight_decay),
            clip: args.clip.unwrap_or(base.clip),
            schedule,
        }
    }

    /// Examples per batch on each replica: `--batch-size`, else the recipe's.
    pub fn batch_size<M>(preset: &Preset<M>, args: &RecipeArgs) -> usize {
        args.batch_size.unwrap_or(preset.recipe_for(args).batch_size)
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
        let args = RecipeArgs { accumulate: 4, scale_lr: true, warmup_epochs: Some(2), lr: Some(0.1), ..RecipeArgs::default() };
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
    fn the_courses_resnet50_recipes_keep_the_batch_per_gpu_and_scale_the_rate_over_the_gpus() {
        use crate::flags::RecipeSource;
        use crate::models::Arch;
        use crate::presets::EXERCISE1;
        let course = RecipeArgs { recipe: RecipeSource::Course, ..RecipeArgs::default() };
        // JSC's ddp_training.py: Adam at 0.02 and 128 images per GPU whatever the GPUs (each
        // Lightning process its own DataLoader(batch_size=128)), max_epochs=10.
        let jsc = EXERCISE2.with_image_model(Arch::Resnet50);
        for gpus in [1, 3, 4, 16, 128] {
            let recipe = RunRecipe::resolve(&jsc, &course, gpus, 10, 1);
            assert_eq!((recipe.batch_size, recipe.lr, recipe.optimizer), (128, 0.02, crate::optim::OptimizerKind::Adam), "{gpus} GPUs");
        }
        for exercise in [EXERCISE1, EXERCISE2] {
            let jsc = exercise.with_image_model(Arch::Resnet50);
            assert_eq!((jsc.epochs_for(&course), jsc.epochs_for(&RecipeArgs::default())), (10, exercise.epochs), "{}: JSC's max_epochs=10", exercise.name);
        }
        assert_eq!(RunRecipe::resolve(&jsc, &RecipeArgs { batch_size: Some(32), ..course.clone() }, 4, 10, 1).batch_size, 32, "--batch-size wins");
        assert_eq!(RunRecipe::resolve(&jsc, &RecipeArgs::default(), 4, 10, 1).batch_size, 100, "the exercise's own recipe");
        // Namal/BSC: SGD without momentum at 0.01 × the GPUs, 256 per GPU (MirroredStrategy's
        // --batch_size 256/512/1024 on --n_gpus 1/2/4 is the global batch), --epochs 5.
        let namal = EXERCISE2.with_image_model(Arch::Resnet50v2);
        for (gpus, lr) in [(1, 0.01), (2, 0.02), (4, 0.04)] {
            let recipe = RunRecipe::resolve(&namal, &course, gpus, 10, 1);
            assert_eq!((recipe.optimizer, recipe.momentum, recipe.batch_size), (crate::optim::OptimizerKind::Sgd, 0.0, 256), "{gpus} GPUs");
            assert!((recipe.lr - lr).abs() < 1e-12, "{gpus} GPUs: {}", recipe.lr);
        }
        for exercise in [EXERCISE1, EXERCISE2] {
            let namal = exercise.with_image_model(Arch::Resnet50v2);
            assert_eq!(
                (namal.epochs_for(&course), namal.epochs_for(&RecipeArgs::default())),
                (5, exercise.epochs),
                "{}: Namal/BSC's --epochs 5",
                exercise.name
            );
        }
        assert_eq!(RunRecipe::resolve(&namal, &RecipeArgs { lr: Some(0.1), ..course.clone() }, 2, 10, 1).lr, 0.2, "--lr is the one GPU's rate");
        // Other models keep the exercise's course recipe.
        assert_eq!(EXERCISE2.with_image_model(Arch::Vgg19).course, EXERCISE2.course);
    }

    #[test]
    fn a_warmup_of_zero_turns_the_presets_off() {
        // exercise3's 1.4B recipe warms up over 100 steps; --warmup-steps 0 (or --warmup-epochs 0)
        // means none, not "not given".
        let preset = &crate::presets::EXERCISE3_PIPELINE;
        assert_eq!(RunRecipe::resolve(preset, &RecipeArgs::default(), 1, 10, 1).schedule.warmup.map(|w| w.steps), Some(100));
        for args in [RecipeArgs { warmup_steps: Some(0), ..RecipeArgs::default() }, RecipeArgs { warmup_epochs: Some(0), ..RecipeArgs::default() }] {
            assert!(RunRecipe::resolve(preset, &args, 1, 10, 1).schedule.warmup.is_none());
        }
        assert_eq!(
            RunRecipe::resolve(preset, &RecipeArgs { warmup_steps: Some(7), ..RecipeArgs::default() }, 1, 10, 1).schedule.warmup.map(|w| w.steps),
            Some(7)
        );
    }

    #[test]
    fn a_warmup_needs_to_know_where_it_starts() {
        let err = RecipeArgs { warmup_steps: Some(10), ..RecipeArgs::default() }.check().unwrap_err();
        assert!(format!("{err}").contains("use it with --scale-lr"), "{err}");
        assert!(RecipeArgs { warmup_steps: Some(10), warmup_start: Some(0.0), ..RecipeArgs::default() }.check().is_ok());
        let err = RecipeArgs { accumulate: 0, ..RecipeArgs::default() }.check().unwrap_err();
        assert!(format!("{err}").contains("--accumulate must be at least 1"));
        let one_cycle = RecipeArgs { scale_lr: true, warmup_epochs: Some(1), lr_schedule: Some(ScheduleKind::OneCycle), ..RecipeArgs::default() };
        assert!(format!("{}", one_cycle.check().unwrap_err()).contains("warms up by itself"));
    }
}
