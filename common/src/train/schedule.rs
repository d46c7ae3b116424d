//! The learning rate of every optimizer step: a per-epoch StepLR (the tutorial's), cosine
//! annealing, or the one-cycle policy, each optionally after a linear warm-up over the first
//! steps (Goyal et al. 2017, for large batches).
//!
//! Everything is a closed-form function of (step, epoch), so a resumed run continues the
//! schedule exactly where it stopped, whatever happened before.
use serde::Serialize;

/// The `--lr-schedule` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// The learning rate as given.
    Constant,
    /// `StepLR`: × `--gamma` after every epoch (the course's language-model recipe).
    Step,
    /// `CosineAnnealingLR` over all steps of the run, down to 0.
    Cosine,
    /// `OneCycleLR` (fastai's one-cycle policy): from lr/25 up to lr over the first 30% of
    /// the steps, then down to lr/(25·10⁴), both along cosines.
    OneCycle,
}

/// A learning rate per optimizer step, relative to the base (peak) rate the optimizer starts
/// with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    /// StepLR's factor per epoch.
    pub gamma: f64,
    /// Optimizer steps of the whole run (cosine and one-cycle need to know where they end).
    pub total_steps: usize,
    /// A linear warm-up (not with one-cycle, which warms up by itself).
    pub warmup: Option<Warmup>,
    /// One-cycle's share of the steps spent going up (`pct_start`, torch's 0.3).
    pub pct_start: f64,
    /// One-cycle's initial rate is lr / `div_factor` (torch's 25)...
    pub div_factor: f64,
    /// ...and its final one the initial rate / `final_div_factor` (torch's 10⁴).
    pub final_div_factor: f64,
}

/// Linear warm-up: step `s < steps` runs at `start + (1 − start)·s/steps` of the scheduled rate
/// (torch's `LinearLR(start_factor=start, total_iters=steps)`); Goyal et al. start from the
/// rate of the small batch, `start = 1/k` for a batch k times larger.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Warmup {
    pub steps: usize,
    pub start: f64,
}

impl LrSchedule {
    /// The base rate throughout.
    pub fn constant() -> LrSchedule {
        LrSchedule::new(ScheduleKind::Constant, 0)
    }

    /// `kind` over a run of `total_steps` steps, with torch's defaults for the rest.
    pub fn new(kind: ScheduleKind, total_steps: usize) -> LrSchedule {
        LrSchedule { kind, gamma: 1.0, total_steps, warmup: None, pct_start: 0.3, div_factor: 25.0, final_div_factor: 1e4 }
    }

    /// The rate of optimizer step `step` (0-based, counted over the whole run), in epoch
    /// `epoch`, for the base rate `base`.
    pub fn lr(&self, base: f64, step: usize, epoch: usize) -> f64 {
        let scheduled = match self.kind {
            ScheduleKind::Constant => base,
            ScheduleKind::Step => base * self.gamma.powi(epoch as i32),
            ScheduleKind::Cosine => {
                // After a warm-up, the cosine covers the remaining steps.
                let offset = self.warmup.map_or(0, |w| w.steps);
                let span = self.total_steps.saturating_sub(offset).max(1) as f64;
                let t = (step.saturating_sub(offset) as f64).min(span);
                base * (1.0 + (std::f64::consts::PI * t / span).cos()) / 2.0
            }
            ScheduleKind::OneCycle => return self.one_cycle(base, step),
        };
        match self.warmup {
            Some(Warmup { steps, start }) if step < steps => scheduled * (start + (1.0 - start) * step as f64 / steps as f64),
            _ => scheduled,
        }
    }

    /// torch's `OneCycleLR` (two phases, cosine annealing) at step `step`, computed as torch
    /// computes it: each phase anneals from its start to its end rate as `pct` goes from 0 to 1,
    /// `pct = (step − phase start) / (phase end − phase start)`, the first phase ending at step
    /// `pct_start · total − 1`.
    fn one_cycle(&self, max_lr: f64, step: usize) -> f64 {
        let initial = max_lr / self.div_factor;
        let min = initial / self.final_div_factor;
        let total = self.total_steps.max(1) as f64;
        let first_end = self.pct_start * total - 1.0;
        let anneal = |start: f64, end: f64, pct: f64| end + (start - end) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0);
        let step = step as f64;
        if step <= first_end {
            anneal(initial, max_lr, step / first_end)
        } else {
            anneal(max_lr, min, (step - first_end) / (total - 1.0 - first_end))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_lr_multiplies_by_gamma_per_epoch_and_a_warmup_ramps_linearly() {
        let mut s = LrSchedule { gamma: 0.5, ..LrSchedule::new(ScheduleKind::Step, 100) };
        assert_eq!((s.lr(2.0, 0, 0), s.lr(2.0, 55, 1), s.lr(2.0, 99, 2)), (2.0, 1.0, 0.5));
        s.warmup = Some(Warmup { steps: 4, start: 0.25 });
        let ramp: Vec<f64> = (0..6).map(|step| s.lr(1.0, step, 0)).collect();
        assert_eq!(ramp, [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0]);
    }

    #[test]
    fn cosine_goes_from_the_base_to_zero_after_its_warmup() {
        let mut s = LrSchedule::new(ScheduleKind::Cosine, 10);
        assert_eq!(s.lr(1.0, 0, 0), 1.0);
        assert!((s.lr(1.0, 5, 0) - 0.5).abs() < 1e-12);
        assert!(s.lr(1.0, 10, 0).abs() < 1e-12);
        s.warmup = Some(Warmup { steps: 2, start: 0.0 });
        assert_eq!((s.lr(1.0, 0, 0), s.lr(1.0, 1, 0), s.lr(1.0, 2, 0)), (0.0, 0.5, 1.0));
        assert!((s.lr(1.0, 6, 0) - 0.5).abs() < 1e-12, "halfway through the 8 steps after the warm-up");
    }
}
