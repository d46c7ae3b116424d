//! `--profile`: where the step time goes, seen twice.
//!
//! - The phases ([`Profiler`], this module): the training loop records each phase of each step
//!   (data wait, forward, backward, gradients, optimizer) and each evaluation as intervals, from
//!   its own timers, waiting for the device at every phase boundary so that the intervals are
//!   the device's work (which costs some throughput: profile separately from timing runs). The
//!   result is a table and a Chrome trace (`chrome://tracing`, <https://ui.perfetto.dev>).
//! - The operators and kernels ([`libtorch`], [`operators`]): LibTorch's own profiler over a
//!   window of steps, its trace, and the table `torch.profiler` prints.
pub mod libtorch;
pub mod operators;

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;

/// The phases' and operators' table `--profile` writes beside the trace `<run>.trace.json`:
/// `<run>.profile.md`.
pub fn table_path(trace: &Path) -> std::path::PathBuf {
    let name = trace.file_name().and_then(|n| n.to_str()).unwrap_or("profile.trace.json");
    trace.with_file_name(name.replace(".trace.json", ".profile.md"))
}

/// One interval of the trace.
#[derive(Debug, Clone, Serialize)]
struct TraceEvent {
    name: String,
    /// Complete event (begin and duration).
    ph: &'static str,
    /// Microseconds since the run started.
    ts: f64,
    dur: f64,
    /// The rank (one row per process in the viewer).
    pid: usize,
    tid: usize,
    args: EventArgs,
}

#[derive(Debug, Clone, Serialize)]
struct EventArgs {
    step: usize,
}

/// Records phases when enabled; does nothing (and costs nothing) otherwise.
pub struct Profiler {
    enabled: bool,
    rank: usize,
    origin: Instant,
    events: Vec<TraceEvent>,
    /// Seconds per phase counted in the table but drawn otherwise in the trace (a pipeline's
    /// steps, whose trace shows the stages' passes), with the step (from 0).
    table_only: Vec<(&'static str, usize, f64)>,
}

/// The phases in the order the table lists them.
/// (The phase between backward and optimizer is named for what it does: see
/// [`crate::train::GRADIENT_PHASES`]; it follows the backward pass in the table.)
pub const PHASES: [&str; 5] = ["data wait", "forward", "backward", "optimizer", "evaluation"];

impl Profiler {
    pub fn new(enabled: bool, rank: usize) -> Profiler {
        Profiler { enabled, rank, origin: Instant::now(), events: Vec::new(), table_only: Vec::new() }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records `name` (one of [`PHASES`]) from `start` to `end`, in step `step`.
    pub fn record(&mut self, name: &'static str, start: Instant, end: Instant, step: usize) {
        self.record_on(name.to_string(), 0, start, end, step);
    }

    /// Records `name` on row `tid` of this process (a pipeline stage, say).
    pub fn record_on(&mut self, name: String, tid: usize, start: Instant, end: Instant, step: usize) {
        if !self.enabled {
            return;
        }
        let us = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        self.events.push(TraceEvent { name, ph: "X", ts: us(start), dur: us(end) - us(start), pid: self.rank, tid, args: EventArgs { step } });
    }

    /// Counts `seconds` of `phase` in step `step` in the table, without an interval in the
    /// trace.
    pub fn add_to_table(&mut self, phase: &'static str, step: usize, seconds: f64) {
        if self.enabled {
            self.table_only.push((phase, step, seconds));
        }
    }

    /// Seconds spent in each phase: those of [`PHASES`] and any other recorded (a pipeline's
    /// `forward+backward`, the gradients' phase), in the order a step runs them.
    pub fn totals(&self) -> Vec<(&'static str, f64)> {
        // (An empty f64 sum is −0.0; adding 0.0 keeps "-0.000" out of the table.)
        let total = |phase: &str| -> f64 {
            self.events.iter().filter(|e| e.name == phase).map(|e| e.dur / 1e6).sum::<f64>()
                + self.table_only.iter().filter(|(p, _, _)| *p == phase).map(|(_, _, s)| s).sum::<f64>()
                + 0.0
        };
        let mut phases: Vec<&'static str> = PHASES.to_vec();
        let recorded = self.events.iter().filter_map(|e| crate::train::GRADIENT_PHASES.iter().chain(&["forward+backward"]).find(|p| **p == e.name));
        for phase in recorded.copied().chain(self.table_only.iter().map(|(p, _, _)| *p)) {
            if !phases.contains(&phase) {
                // Where a step runs it: after the passes, before the update.
                let at = phases.iter().position(|p| *p == "optimizer").unwrap_or(phases.len());
                phases.insert(at, phase);
            }
        }
        phases.into_iter().map(|phase| (phase, total(phase))).collect()
    }

    /// The median over `typical` steps (from 0) of each step's seconds in `phase`, where it
    /// ran in any of them.
    fn median_per_step(&self, phase: &str, typical: &dyn Fn(usize) -> bool) -> Option<f64> {
        let mut per_step = std::collections::BTreeMap::<usize, f64>::new();
        let recorded = self.events.iter().filter(|e| e.name == phase).map(|e| (e.args.step, e.dur / 1e6));
        let counted = self.table_only.iter().filter(|(p, _, _)| *p == phase).map(|(_, step, s)| (*step, *s));
        for (step, seconds) in recorded.chain(counted).filter(|(step, _)| typical(*step)) {
            *per_step.entry(step).or_default() += seconds;
        }
        let mut seconds: Vec<f64> = per_step.into_values().collect();
        seconds.sort_by(f64::total_cmp);
        (!seconds.is_empty()).then(|| seconds[seconds.len() / 2])
    }

    /// The table `--profile` prints: each phase's total, share and mean time per training step
    /// (`steps` of them, the first ones' warm-up included), and its median over the `typical`
    /// steps (from 0): the ones a timing should be read from, which a run's warm-up and
    /// LibTorch's profiler (whose recording of every operator slows the phases of many small
    /// operators most, the gradients' buckets and clipping) leave out.
    pub fn table(&self, steps: usize, typical: &dyn Fn(usize) -> bool) -> String {
        let totals = self.totals();
        let all: f64 = totals.iter().map(|(_, s)| s).sum::<f64>().max(f64::EPSILON);
        let mut out = String::from("| phase | total (s) | share | per step (ms) | median, typical steps (ms) |\n|---|---:|---:|---:|---:|\n");
        for (phase, seconds) in totals {
            let (mean, median) = match phase {
                "evaluation" => (String::from("-"), String::from("-")),
                _ => (
                    format!("{:.2}", 1e3 * seconds / steps.max(1) as f64),
                    self.median_per_step(phase, typical).map_or_else(|| String::from("-"), |s| format!("{:.2}", 1e3 * s)),
                ),
            };
            out += &format!("| {phase} | {seconds:.3} | {:.1}% | {mean} | {median} |\n", 100.0 * seconds / all);
        }
        out
    }

    /// Writes the Chrome trace (JSON object format) to `path`.
    pub fn write_chrome_trace(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let trace = serde_json::json!({ "traceEvents": self.events, "displayTimeUnit": "ms" });
        crate::output::write(path, serde_json::to_vec(&trace)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn phases_add_up_in_the_table_and_the_trace() {
        let mut profiler = Profiler::new(true, 3);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for step in 0..2 {
            let base = 100 * step as u64;
            profiler.record("forward", at(base), at(base + 30), step);
            profiler.record("backward", at(base + 30), at(base + 90), step);
        }
        profiler.record("evaluation", at(200), at(300), 2);
        let totals: std::collections::HashMap<_, _> = profiler.totals().into_iter().collect();
        assert!((totals["forward"] - 0.06).abs() < 1e-9 && (totals["backward"] - 0.12).abs() < 1e-9);
        assert_eq!(totals["data wait"], 0.0);
        assert!(totals["data wait"].is_sign_positive(), "no -0.000 in the table");
        let table = profiler.table(2, &|_| true);
        assert!(table.contains("| forward | 0.060 | 21.4% | 30.00 | 30.00 |"), "{table}");
        assert!(table.contains("| evaluation | 0.100 | 35.7% | - | - |"), "{table}");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/trace.json");
        profiler.write_chrome_trace(&path).unwrap();
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 5);
        assert_eq!((events[1]["name"].as_str(), events[1]["ph"].as_str(), events[1]["pid"].as_u64()), (Some("backward"), Some("X"), Some(3)));
        assert!((events[1]["dur"].as_f64().unwrap() - 60_000.0).abs() < 1.0, "microseconds");
    }

    #[test]
    fn the_median_per_step_is_of_the_typical_steps_with_each_steps_pieces_summed() {
        let mut profiler = Profiler::new(true, 0);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Step 0 warms up (900 ms), step 2 is profiled (500 ms); the others take 100, 120 and
        // 140 ms, step 3's in two pieces (an accumulated step), step 4's counted by a pipeline.
        for (step, ms) in [(0, 900), (1, 100), (2, 500), (5, 140)] {
            profiler.record("forward", at(0), at(ms), step);
        }
        profiler.record("forward", at(0), at(70), 3);
        profiler.record("forward", at(0), at(50), 3);
        profiler.add_to_table("forward", 4, 0.130);
        let typical = |step: usize| step != 0 && step != 2;
        let table = profiler.table(6, &typical);
        // Mean: 1.89 s over 6 steps; median of 100, 120, 130, 140 ms: the upper middle one.
        assert!(table.contains("| forward | 1.890 | 100.0% | 315.00 | 130.00 |"), "{table}");
        assert!(table.contains("| backward | 0.000 | 0.0% | 0.00 | - |"), "a phase no typical step ran: {table}");
        assert!(profiler.table(6, &|_| false).contains("| forward | 1.890 | 100.0% | 315.00 | - |"), "no typical step");
    }

    #[test]
    fn a_disabled_profiler_records_nothing() {
        let mut profiler = Profiler::new(false, 0);
        profiler.record("forward", Instant::now(), Instant::now(), 0);
        assert!(profiler.totals().iter().all(|(_, s)| *s == 0.0));
    }
}
