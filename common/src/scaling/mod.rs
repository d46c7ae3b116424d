//! The scaling study every course shows (JSC's ResNet50 table from 1 GPU to 32 nodes, Namal's
//! epoch time against GPUs, IDRIS's FP32-vs-AMP curves): one exercise run at 1, 2, 4, … ranks
//! with the global batch held (strong scaling) or the batch per rank held (weak scaling), its
//! results JSON files collected into one table (`scaling.csv`, [`write_csv`]) and one chart
//! (`scaling.svg`, [`chart`]).
//!
//! The runs lie in `<runs>/<mode>/<any folder>/<run>.json` (`bench/scaling.sh` and
//! `sbatch/scaling.sbatch` write `<runs>/strong/ranks-4/exercise2-cnn-cpu.json`): every run
//! writes a JSON file of the same name, so each needs a folder of its own, and the mode is the
//! one thing its JSON cannot say (at one rank both modes run the same job). Ranks, batches and
//! times come from the JSON.
//!
//! Both modes compare the same figure, the throughput (examples per second, all ranks):
//! speed-up = throughput / the baseline's, where the baseline is the run with the fewest ranks
//! (1 normally; 1 node of 4 GPUs for a study that starts there), and efficiency = speed-up /
//! (ranks / baseline ranks). Under strong scaling that is the epoch time's ratio (an epoch is
//! the same work); under weak scaling, the time per step's ratio (a step is the same work per
//! rank), the "scaled speed-up".
pub mod chart;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// What is held while the ranks grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The global batch: each rank's share shrinks as ranks are added.
    Strong,
    /// The batch per rank: the global batch grows with the ranks.
    Weak,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Strong => "strong",
            Mode::Weak => "weak",
        }
    }

    /// The mode a run folder is named for (`strong` or `weak`).
    pub fn from_folder(name: &str) -> Option<Mode> {
        match name {
            "strong" => Some(Mode::Strong),
            "weak" => Some(Mode::Weak),
            _ => None,
        }
    }
}

/// What the study reads from a run's results JSON (`report::save` writes it).
#[derive(Debug, Clone, Deserialize)]
pub struct Run {
    pub exercise: String,
    pub model: String,
    pub device: String,
    pub precision: String,
    pub world_size: usize,
    pub per_rank_batch: usize,
    /// Per optimizer step, all replicas and `--accumulate` batches together.
    pub global_batch: usize,
    /// Examples per second over the whole training time.
    pub throughput: f64,
    /// Examples per second after the warm-up steps, epoch ends and evaluation left out.
    #[serde(default)]
    pub steady_throughput: Option<f64>,
    pub train_time_s: f64,
    /// Rank 0's time averaging (and unscaling, clipping) the gradients: what it spent in the
    /// all-reduce, waiting for the slowest rank included.
    pub allreduce_time_s: f64,
    /// The training split's size (absent in results written before the study existed).
    #[serde(default)]
    pub examples_per_epoch: Option<usize>,
    /// Tokens per stream of a language model's batch (its examples are tokens).
    #[serde(default)]
    pub bptt: Option<usize>,
    /// Where it was read from, for messages.
    #[serde(skip)]
    pub path: PathBuf,
    /// The host of every rank (absent in results written before runs named their hosts).
    #[serde(default)]
    pub hosts: Vec<String>,
}

impl Run {
    /// The nodes the run's ranks ran on (1 where the results do not say).
    pub fn nodes(&self) -> usize {
        self.hosts.iter().collect::<std::collections::BTreeSet<_>>().len().max(1)
    }

    /// The speed the study compares: the steady state's when it was measured (a short CPU run's
    /// first steps are slow for reasons other than the ranks), else the whole run's.
    pub fn speed(&self) -> f64 {
        self.steady_throughput.filter(|s| *s > 0.0).unwrap_or(self.throughput)
    }

    /// Examples (images, or tokens) in one optimizer step, all ranks together.
    fn examples_per_step(&self) -> f64 {
        (self.global_batch * self.bptt.unwrap_or(1)) as f64
    }

    /// A line's series: runs that differ only in their ranks.
    fn series(&self, mode: Mode) -> SeriesKey {
        SeriesKey { mode, exercise: self.exercise.clone(), model: self.model.clone(), device: self.device.clone(), precision: self.precision.clone() }
    }
}

/// What a series of runs holds fixed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct SeriesKey {
    mode: Mode,
    exercise: String,
    model: String,
    device: String,
    precision: String,
}

/// One run of the study: a row of `scaling.csv`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub mode: Mode,
    pub exercise: String,
    pub model: String,
    pub device: String,
    pub precision: String,
    pub ranks: usize,
    pub global_batch: usize,
    pub per_rank_batch: usize,
    /// Seconds per optimizer step (the step's examples at the compared speed).
    pub step_time_s: f64,
    /// Seconds for one pass over the training split at that speed (what JSC's table counts).
    pub epoch_time_s: Option<f64>,
    /// Examples per second, all ranks ([`Run::speed`]).
    pub throughput: f64,
    /// Throughput over the baseline's (the series' run with the fewest ranks).
    pub speedup: f64,
    /// Ranks over the baseline's ranks: the speed-up of perfect scaling.
    pub ideal_speedup: f64,
    /// speedup / ideal_speedup.
    pub efficiency: f64,
    /// Rank 0's share of its training time spent averaging the gradients.
    pub allreduce_share: f64,
    /// The nodes (hosts) the ranks ran on: the study's second axis on a cluster (last, so that
    /// the columns before keep their places).
    pub nodes: usize,
}

/// Reads every run under `dir` (`<dir>/<mode>/<folder>/<run>.json`); other JSON files (traces,
/// memory estimates) are passed over, a folder that is neither mode is an error.
pub fn read_runs(dir: &Path) -> Result<Vec<(Mode, Run)>> {
    if !dir.is_dir() {
        // A usage error (exit 2): the study has not been run, or --runs names another folder.
        return crate::error::usage(format!("no scaling runs folder {} (run `make scaling` first, or give --runs)", dir.display()));
    }
    let mut runs = Vec::new();
    let modes = std::fs::read_dir(dir).with_context(|| format!("cannot read the scaling runs folder {}", dir.display()))?;
    for entry in modes {
        let mode_dir = entry?.path();
        if !mode_dir.is_dir() {
            continue;
        }
        let name = mode_dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let Some(mode) = Mode::from_folder(&name) else {
            bail!("{}: a scaling runs folder holds `strong/` and `weak/` only, not `{name}/`", dir.display());
        };
        for json in json_files(&mode_dir)? {
            let text = crate::input::read_to_string(&json, 256 << 20, "a scaling runs folder holds results files")?;
            let value: serde_json::Value = crate::input::json_value(&text).with_context(|| format!("{} is not JSON", json.display()))?;
            // A results record has these; a trace or a memory estimate does not.
            if value.get("throughput").is_none() || value.get("world_size").is_none() {
                continue;
            }
            let mut run: Run = serde_json::from_value(value).with_context(|| format!("{}: not a results record the scaling study can read", json.display()))?;
            run.path = json;
            runs.push((mode, run));
        }
    }
    if runs.is_empty() {
        bail!("no runs under {} (expected <mode>/<folder>/<run>.json: run `make scaling` first)", dir.display());
    }
    Ok(runs)
}

/// The `*.json` files in `dir` and its sub-folders, sorted.
fn json_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            found.extend(json_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "json") {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// The table: one row per run, by series (mode, exercise, model, device, precision) and ranks.
/// A series whose runs do not hold what its mode holds (the global batch, or the batch per
/// rank), or that has two runs at one number of ranks, is an error naming the files.
pub fn rows(runs: &[(Mode, Run)]) -> Result<Vec<Row>> {
    let mut series: BTreeMap<SeriesKey, Vec<&Run>> = BTreeMap::new();
    for (mode, run) in runs {
        series.entry(run.series(*mode)).or_default().push(run);
    }
    let mut rows = Vec::new();
    for (key, mut runs) in series {
        runs.sort_by_key(|r| r.world_size);
        let base = runs[0];
        for pair in runs.windows(2) {
            if pair[0].world_size == pair[1].world_size {
                bail!("two {} runs at {} ranks: {} and {}", key.mode.name(), pair[0].world_size, pair[0].path.display(), pair[1].path.display());
            }
        }
        for run in &runs {
            let (held, what) = match key.mode {
                Mode::Strong => ((run.global_batch, base.global_batch), "global batch"),
                Mode::Weak => ((run.per_rank_batch, base.per_rank_batch), "batch per rank"),
            };
            if held.0 != held.1 {
                bail!("{} scaling holds the {what}, but {} has {} and {} has {}", key.mode.name(), run.path.display(), held.0, base.path.display(), held.1);
            }
            let speed = run.speed();
            let speedup = speed / base.speed();
            let ideal = run.world_size as f64 / base.world_size as f64;
            rows.push(Row {
                mode: key.mode,
                exercise: key.exercise.clone(),
                model: key.model.clone(),
                device: key.device.clone(),
                precision: key.precision.clone(),
                ranks: run.world_size,
                global_batch: run.global_batch,
                per_rank_batch: run.per_rank_batch,
                step_time_s: run.examples_per_step() / speed,
                epoch_time_s: run.examples_per_epoch.map(|n| n as f64 / speed),
                throughput: speed,
                speedup,
                ideal_speedup: ideal,
                efficiency: speedup / ideal,
                allreduce_share: run.allreduce_time_s / run.train_time_s.max(f64::MIN_POSITIVE),
                nodes: run.nodes(),
            });
        }
    }
    Ok(rows)
}

/// Writes the rows to `path` as CSV (to a temporary file first: jobs finishing together each
/// rewrite it, and a reader never sees half a table).
pub fn write_csv(path: &Path, rows: &[Row]) -> Result<()> {
    let mut writer = csv::Writer::from_writer(Vec::new());
    for row in rows {
        writer.serialize(row)?;
    }
    let bytes = writer.into_inner().map_err(|e| anyhow::anyhow!("{e}"))?;
    crate::output::write(path, bytes)
}

/// The rows as a Markdown table, for the terminal and README.
pub fn markdown(rows: &[Row]) -> String {
    let unit = if rows.iter().any(|r| r.model == "transformer") { "tokens/s" } else { "images/s" };
    let mut out = format!(
        "| mode | precision | ranks | nodes | global batch | per-rank batch | time/epoch (s) | time/step (ms) | {unit} | speed-up | ideal | efficiency | all-reduce share |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.2}× | {:.0}× | {:.0}% | {:.1}% |",
            r.mode.name(),
            r.precision,
            r.ranks,
            r.nodes,
            r.global_batch,
            r.per_rank_batch,
            r.epoch_time_s.map_or("-".into(), |t| format!("{t:.2}")),
            1e3 * r.step_time_s,
            r.throughput,
            r.speedup,
            r.ideal_speedup,
            100.0 * r.efficiency,
            100.0 * r.allreduce_share,
        );
    }
    out
}

/// Where `report scaling` writes what it makes of `<results>/scaling/`.
#[derive(Debug)]
pub struct Outputs {
    pub csv: PathBuf,
    pub svg: PathBuf,
    pub rows: Vec<Row>,
}

/// The whole study from the runs under `runs`: `<results>/scaling.csv` and `<results>/scaling.svg`.
pub fn collect(runs: &Path, results: &Path) -> Result<Outputs> {
    let rows = rows(&read_runs(runs)?)?;
    std::fs::create_dir_all(results).with_context(|| format!("cannot create {}", results.display()))?;
    let (csv, svg) = (results.join("scaling.csv"), results.join("scaling.svg"));
    write_csv(&csv, &rows)?;
    chart::draw(&rows, &svg)?;
    Ok(Outputs { csv, svg, rows })
}
