//! `--profile`'s view of the kernels: LibTorch's own profiler (Kineto, what `torch.profiler`
//! drives) recording a window of training steps (`--profile-steps A..B`, after the warm-up),
//! each step a `ProfilerStep#N` range as torch.profiler marks them, then its Chrome trace and
//! the table of operators and kernels ([`super::operators`]).
use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Context, Result};

use super::operators::OperatorTable;
use crate::torch_ext::{self, RecordRange};

/// Training steps to record, 1-based and inclusive (`3..7`: steps 3, 4, 5, 6 and 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StepWindow {
    pub first: usize,
    pub last: usize,
}

impl StepWindow {
    /// Five steps after `warmup` (the run's `--steady-after`): kernels chosen, caches warm.
    pub fn after_warmup(warmup: usize) -> StepWindow {
        StepWindow { first: warmup + 1, last: warmup + 5 }
    }

    pub fn steps(&self) -> usize {
        self.last + 1 - self.first
    }

    fn contains(&self, step: usize) -> bool {
        (self.first..=self.last).contains(&step)
    }
}

impl FromStr for StepWindow {
    type Err = String;

    /// `A..B` (steps A to B), or `A` (that step alone).
    fn from_str(text: &str) -> Result<StepWindow, String> {
        let number =
            |s: &str| s.trim().parse::<usize>().map_err(|_| format!("'{text}' is not a window of steps: write A..B (steps A to B, from 1), e.g. 3..7"));
        let (first, last) = match text.split_once("..") {
            Some((a, b)) => (number(a)?, number(b.trim_start_matches('='))?),
            None => (number(text)?, number(text)?),
        };
        if first == 0 || last < first {
            return Err(format!("--profile-steps {text}: steps count from 1 and the window must not end before it starts"));
        }
        Ok(StepWindow { first, last })
    }
}

/// The profiler's life over a run: waiting for the window, recording it, done.
enum State {
    Waiting,
    /// Recording; the range of the step under way.
    Recording(Option<RecordRange>),
    Done,
}

/// What a finished window recorded.
pub struct Recorded {
    /// Steps inside the window that ran (the run may end before the window does).
    pub steps: usize,
    pub trace: PathBuf,
    pub table: OperatorTable,
}

/// LibTorch's profiler around `window`, writing its trace to `trace`.
pub struct TorchProfiler {
    window: StepWindow,
    cuda: bool,
    trace: PathBuf,
    state: State,
    steps: usize,
}

impl TorchProfiler {
    /// `cuda`: record the GPU's kernels too.
    pub fn new(window: StepWindow, cuda: bool, trace: PathBuf) -> TorchProfiler {
        TorchProfiler { window, cuda, trace, state: State::Waiting, steps: 0 }
    }

    pub fn window(&self) -> StepWindow {
        self.window
    }

    /// Step `step` is about to run: the recording starts with the window's first step (or the
    /// first step this process runs inside the window, when it resumed there).
    pub fn step_starts(&mut self, step: usize) -> Result<()> {
        if !self.window.contains(step) {
            return Ok(());
        }
        if matches!(self.state, State::Waiting) {
            torch_ext::profiler_start(self.cuda, false)?;
            self.state = State::Recording(None);
        }
        if let State::Recording(range) = &mut self.state {
            *range = Some(RecordRange::enter(&format!("ProfilerStep#{step}")));
        }
        Ok(())
    }

    /// Step `step` ended; the recording ends with the window's last step.
    pub fn step_ended(&mut self, step: usize) -> Result<Option<Recorded>> {
        if let State::Recording(range) = &mut self.state {
            if range.take().is_some() {
                self.steps += 1;
            }
            if step >= self.window.last {
                return self.stop().map(Some);
            }
        }
        Ok(None)
    }

    /// The run ended: what was recorded, if the window had begun and not yet been written.
    pub fn finish(&mut self) -> Result<Option<Recorded>> {
        match self.state {
            State::Recording(_) => self.stop().map(Some),
            _ => Ok(None),
        }
    }

    fn stop(&mut self) -> Result<Recorded> {
        if let State::Recording(range) = &mut self.state {
            drop(range.take());
        }
        self.state = State::Done;
        if let Some(dir) = self.trace.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        // LibTorch names (and renames) its files itself: in a private folder, then moved into place.
        crate::output::write_by_name(&self.trace, torch_ext::profiler_stop)?;
        Ok(Recorded { steps: self.steps, trace: self.trace.clone(), table: OperatorTable::read(&self.trace)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_window_reads_as_steps_a_to_b() {
        assert_eq!("3..7".parse::<StepWindow>(), Ok(StepWindow { first: 3, last: 7 }));
        assert_eq!("3..=7".parse::<StepWindow>(), Ok(StepWindow { first: 3, last: 7 }));
        assert_eq!("4".parse::<StepWindow>(), Ok(StepWindow { first: 4, last: 4 }));
        assert_eq!(StepWindow::after_warmup(2), StepWindow { first: 3, last: 7 });
        assert_eq!(StepWindow { first: 3, last: 7 }.steps(), 5);
        for bad in ["0..3", "5..2", "a..b", "3-7", ""] {
            assert!(bad.parse::<StepWindow>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_window_records_its_steps_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut profiler = TorchProfiler::new(StepWindow { first: 2, last: 3 }, false, dir.path().join("t.json"));
        let x = Tensor::ones([16, 16], (Kind::Float, Device::Cpu));
        let ops = ["aten::sigmoid", "aten::tanh", "aten::exp", "aten::sqrt"];
        let mut recorded = None;
        for (i, op) in ops.iter().enumerate() {
            let step = i + 1;
            profiler.step_starts(step).unwrap();
            let _ = match *op {
                "aten::sigmoid" => x.sigmoid(),
                "aten::tanh" => x.tanh(),
                "aten::exp" => x.exp(),
                _ => x.sqrt(),
            };
            if let Some(r) = profiler.step_ended(step).unwrap() {
                recorded = Some(r);
            }
        }
        assert!(profiler.finish().unwrap().is_none(), "written once");
        let recorded = recorded.expect("the window closed at step 3");
        assert_eq!(recorded.steps, 2);
        let table = recorded.table;
        assert!(table.row("aten::tanh").is_some() && table.row("aten::exp").is_some());
        assert!(table.row("aten::sigmoid").is_none() && table.row("aten::sqrt").is_none(), "outside the window");
        assert_eq!(table.row("ProfilerStep*").map(|r| r.calls), Some(2));
    }

    #[test]
    fn a_run_that_ends_inside_the_window_still_writes_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut profiler = TorchProfiler::new(StepWindow { first: 1, last: 10 }, false, dir.path().join("t.json"));
        profiler.step_starts(1).unwrap();
        let _ = Tensor::ones([4], (Kind::Float, Device::Cpu)).cos();
        assert!(profiler.step_ended(1).unwrap().is_none());
        let recorded = profiler.finish().unwrap().expect("recorded step 1");
        assert_eq!(recorded.steps, 1);
        assert!(recorded.table.row("aten::cos").is_some());
    }
}
