//! Faults a test plants in a run, as a kill, a signal or a slow node would bring them, at a step
//! it names rather than at a moment it would have to time. The driver reads them from the
//! environment once ([`Faults::from_env`]) and hands them to the loop in
//! [`super::TrainConfig::faults`]; the loop itself reads no environment. A run without these
//! variables has [`Faults::NONE`].
use std::time::Duration;

use super::preemption;

/// (An environment variable holding a step number): the process ends right after that
/// optimizer step, its checkpoint writes complete, with exit code 137 as if killed, without
/// unwinding or writing results. Tests of exact resumption interrupt runs with it instead of
/// timing a kill.
pub const TEST_EXIT_AFTER_STEP: &str = "COURSE_TEST_EXIT_AFTER_STEP";

/// (`STEP:SIGNAL`, e.g. `5:SIGTERM`): the job's rank 0 sends itself the signal after that
/// optimizer step, through the real handler, as Slurm or a user would at that moment; the other
/// ranks learn of it as they would of a real one (the per-step agreement).
pub const TEST_SIGNAL_AFTER_STEP: &str = "COURSE_TEST_SIGNAL_AFTER_STEP";

/// (`RANK:MS`, e.g. `1:200`): on job rank RANK every training step waits MS milliseconds before
/// its forward pass, as on a slower node, so that the others wait for it in the gradients'
/// averaging (which [`crate::comm::waits`] reports).
pub const TEST_SLOW_RANK: &str = "COURSE_TEST_SLOW_RANK";

/// The faults planted in a run (none in a user's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// [`TEST_EXIT_AFTER_STEP`].
    pub exit_after: Option<usize>,
    /// [`TEST_SIGNAL_AFTER_STEP`]: (step, signal number), raised on the root rank.
    pub signal_after: Option<(usize, i32)>,
    /// [`TEST_SLOW_RANK`]: (job rank, delay of its every step).
    pub slow_rank: Option<(usize, Duration)>,
}

impl Faults {
    pub const NONE: Faults = Faults { exit_after: None, signal_after: None, slow_rank: None };

    /// The faults the environment plants; a value that does not parse plants nothing.
    pub fn from_env() -> Faults {
        let var = |name| std::env::var(name).ok();
        Faults {
            exit_after: var(TEST_EXIT_AFTER_STEP).and_then(|v| v.parse().ok()),
            signal_after: var(TEST_SIGNAL_AFTER_STEP).and_then(|v| {
                let (step, name) = v.split_once(':')?;
                let signal = preemption::SIGNALS.iter().find(|(_, n)| *n == name)?.0;
                Some((step.parse().ok()?, signal))
            }),
            slow_rank: var(TEST_SLOW_RANK).and_then(|v| {
                let (rank, ms) = v.split_once(':')?;
                Some((rank.trim().parse().ok()?, Duration::from_millis(ms.trim().parse().ok()?)))
            }),
        }
    }

    /// How much longer each step of job rank `rank` takes.
    pub(super) fn slow_by(&self, rank: usize) -> Option<Duration> {
        self.slow_rank.filter(|(slow, _)| *slow == rank).map(|(_, by)| by)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_as_documented_and_anything_else_plants_none() {
        let parsed = |exit: &str, signal: &str, slow: &str| {
            // (One test touches these variables: the process's environment is shared.)
            std::env::set_var(TEST_EXIT_AFTER_STEP, exit);
            std::env::set_var(TEST_SIGNAL_AFTER_STEP, signal);
            std::env::set_var(TEST_SLOW_RANK, slow);
            Faults::from_env()
        };
        let faults = parsed("7", "5:SIGTERM", "1:250");
        assert_eq!(faults.exit_after, Some(7));
        assert_eq!(faults.signal_after, Some((5, libc::SIGTERM)));
        assert_eq!(faults.slow_by(1), Some(Duration::from_millis(250)));
        assert_eq!(faults.slow_by(0), None);
        assert_eq!(parsed("x", "5", "1"), Faults::NONE);
        assert_eq!(parsed("", "5:SIGNOPE", ":3").signal_after, None);
        for name in [TEST_EXIT_AFTER_STEP, TEST_SIGNAL_AFTER_STEP, TEST_SLOW_RANK] {
            std::env::remove_var(name);
        }
        assert_eq!(Faults::from_env(), Faults::NONE);
    }
}
