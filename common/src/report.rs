//! What a run leaves behind: one JSON file per run, a row in the exercise's CSV, and the
//! course's CPU-vs-GPU table on the terminal.
use crate::device;
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One finished run, flat so that it is also one CSV row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub exercise: String,
    pub model: String,
    pub params: i64,
    pub device: String,
    pub dataset: String,
    /// True when the data were a generated stand-in, not the real data set.
    pub data_generated: bool,
    /// Epochs the run was configured for.
    pub epochs: usize,
    /// Optimizer steps taken by this process.
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub optimizer: String,
    /// Seconds in training steps (evaluation excluded).
    pub train_time_s: f64,
    /// Training examples per second (images/s, or tokens/s for a language model), all
    /// data-parallel replicas together.
    pub throughput: f64,
    /// Training examples per second after the warm-up (`--steady-after` steps), epoch ends and
    /// evaluation left out: what benchmarks compare. Empty when too few steps ran.
    pub steady_throughput: Option<f64>,
    /// Data-parallel replicas (1 for a single process).
    pub world_size: usize,
    /// `32`, `16-mixed` or `bf16-mixed`.
    pub precision: String,
    /// Training FLOPs per example (image or token), from the model's shapes (`flops`).
    pub flops_per_example: f64,
    /// Achieved training TFLOP/s, all replicas together.
    pub tflops: f64,
    /// Peak TFLOP/s of one device in this precision, where known (`--peak-tflops`, or a known GPU).
    pub peak_tflops: Option<f64>,
    /// Model-FLOPs utilisation: tflops / (world_size × peak_tflops).
    pub mfu: Option<f64>,
    pub test_acc: f64,
    pub test_loss: f64,
    pub data_wait_s: f64,
    pub forward_backward_s: f64,
    pub optimizer_s: f64,
    pub eval_s: f64,
    /// The largest peak of bytes held by tensors on one rank's device during training
    /// (`peak_memory` in the results JSON has every rank's).
    pub peak_memory_bytes: Option<i64>,
    /// LibTorch intra-op threads.
    pub threads: usize,
    pub seed: u64,
    pub torch_version: String,
    /// Seconds since the Unix epoch when the run finished.
    pub finished_at: u64,
}

/// What describes a run before it starts; [`RunRecord::new`] adds what the training measured.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub exercise: String,
    pub model: String,
    pub params: i64,
    pub device: tch::Device,
    pub dataset: String,
    pub data_generated: bool,
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub optimizer: String,
    pub seed: u64,
    pub world_size: usize,
    pub precision: crate::precision::Precision,
    /// Training FLOPs per example (see `flops`).
    pub flops_per_example: f64,
    /// One device's peak TFLOP/s in this precision, where known.
    pub peak_tflops: Option<f64>,
}

impl RunRecord {
    /// The record of a finished run: its description, what [`crate::train::fit`] measured, and
    /// the final test loss and accuracy.
    pub fn new(info: RunInfo, fit: &crate::train::FitReport, (test_loss, test_acc): (f64, f64)) -> Self {
        let tflops = info.flops_per_example * fit.throughput() / 1e12;
        RunRecord {
            exercise: info.exercise,
            model: info.model,
            params: info.params,
            device: device::device_name(info.device).into(),
            dataset: info.dataset,
            data_generated: info.data_generated,
            epochs: info.epochs,
            steps: fit.steps,
            batch_size: info.batch_size,
            lr: info.lr,
            optimizer: info.optimizer,
            train_time_s: fit.train_time_s,
            throughput: fit.throughput(),
            steady_throughput: fit.steady.map(|s| s.throughput()),
            world_size: info.world_size,
            precision: info.precision.name().into(),
            flops_per_example: info.flops_per_example,
            tflops,
            peak_tflops: info.peak_tflops,
            mfu: info.peak_tflops.map(|peak| tflops / (info.world_size as f64 * peak)),
            test_acc,
            test_loss,
            data_wait_s: fit.timings.data_wait_s,
            forward_backward_s: fit.timings.forward_backward_s,
            optimizer_s: fit.timings.optimizer_s,
            eval_s: fit.timings.eval_s,
            peak_memory_bytes: None,
            threads: tch::get_num_threads() as usize,
            seed: info.seed,
            torch_version: crate::torch_version().into(),
            finished_at: unix_time(),
        }
    }

    /// Whether its examples are tokens (the Transformer language models) rather than images.
    pub fn is_language_model(&self) -> bool {
        self.model == "transformer"
    }

    /// `<exercise>-<model>-<device>`, the stem of its files.
    pub fn name(&self) -> String {
        run_name(&self.exercise, &self.model, &self.device)
    }
}

/// `<exercise>-<model>-<device>`: the name of a run, the stem of its files.
pub fn run_name(exercise: &str, model: &str, device: &str) -> String {
    format!("{exercise}-{model}-{device}")
}

/// `<dir>/<run>.json`: a run's results.
pub fn results_path(dir: &Path, run: &str) -> PathBuf {
    dir.join(format!("{run}.json"))
}

/// `<dir>/<run>.config.toml`: the flags a run was given, as a `--config` file.
pub fn config_path(dir: &Path, run: &str) -> PathBuf {
    dir.join(format!("{run}.config.toml"))
}

/// `<dir>/<exercise>.csv`: the table every run of an exercise appends its row to.
pub fn table_path(dir: &Path, exercise: &str) -> PathBuf {
    dir.join(format!("{exercise}.csv"))
}

/// `<dir>/<run>.eval-only.json`: what `--eval-only` measured (the run's results stay).
pub fn eval_only_path(dir: &Path, run: &str) -> PathBuf {
    dir.join(format!("{run}.eval-only.json"))
}

pub fn unix_time() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Where [`save`] put a run's results.
pub struct Saved {
    pub json: PathBuf,
    /// The flags the run was given, as a `--config` file that repeats it (for runs started from
    /// a command line, [`crate::config_file::given`]).
    pub config: Option<PathBuf>,
    /// What the caller should tell the user about the files (an old CSV moved aside).
    pub notes: Vec<String>,
}

/// Writes `<dir>/<exercise>-<model>-<device>.json` (the record plus `extra` fields such as the
/// per-epoch history), `<dir>/<exercise>-<model>-<device>.config.toml` (the flags given, where
/// a command line gave them) and appends the record to `<dir>/<exercise>.csv`. The training
/// curves are the caller's to draw from the same `extra` ([`crate::plots::curves_for_run`]).
pub fn save(dir: &Path, record: &RunRecord, extra: &serde_json::Value) -> anyhow::Result<Saved> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create results directory {}", dir.display()))?;
    let mut json = serde_json::to_value(record)?;
    if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        object.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    let path = results_path(dir, &record.name());
    crate::output::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    let config = match crate::config_file::given() {
        Some(given) => {
            let config = config_path(dir, &record.name());
            crate::output::write(&config, given.config_file())?;
            Some(config)
        }
        None => None,
    };
    let notes = append_csv(&table_path(dir, &record.exercise), record)?.into_iter().collect();
    Ok(Saved { json: path, config, notes })
}

/// Appends a row, writing the header first when the file is new. A file written with other
/// columns (by an older version) is renamed to `<name>.<unix time>.old` first, so rows never
/// land under the wrong header; the returned note says so.
fn append_csv(path: &Path, record: &RunRecord) -> anyhow::Result<Option<String>> {
    let header = {
        let mut w = csv::Writer::from_writer(Vec::new());
        w.serialize(record)?;
        let bytes = w.into_inner().map_err(|e| anyhow::anyhow!("{e}"))?;
        String::from_utf8(bytes)?.lines().next().unwrap_or_default().to_string()
    };
    let mut note = None;
    if crate::output::Kind::of(path).with_context(|| format!("cannot look at {}", path.display()))? == crate::output::Kind::File {
        use std::io::BufRead;
        let mut first = String::new();
        std::io::BufReader::new(crate::input::open(path, "the results table is appended to")?)
            .read_line(&mut first)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if !first.is_empty() && first.trim_end_matches(['\n', '\r']) != header {
            let aside = path.with_extension(format!("{}.old", unix_time()));
            // Moved to a free name only: never over what someone put at the aside's name.
            if crate::output::Kind::of(&aside).with_context(|| format!("cannot look at {}", aside.display()))? != crate::output::Kind::Missing {
                anyhow::bail!("cannot move {} aside: {} is taken", path.display(), aside.display());
            }
            std::fs::rename(path, &aside).with_context(|| format!("cannot move {} aside", path.display()))?;
            note = Some(format!("note: {} had other columns; moved it to {}", path.display(), aside.display()));
        }
    }
    let is_new = std::fs::metadata(path).map(|m| m.len() == 0).unwrap_or(true);
    let file = crate::output::append(path)?;
    let mut writer = csv::WriterBuilder::new().has_headers(is_new).from_writer(file);
    writer.serialize(record).and_then(|()| Ok(writer.flush()?)).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(note)
}

/// Throughput of this run over `world_size` × that of the latest single-process run of the
/// same exercise, model, device, precision and per-rank batch in `csv` (None without such a run).
pub fn scaling_efficiency(csv: &Path, record: &RunRecord) -> Option<f64> {
    let baseline = read_csv(csv).ok()?.into_iter().rev().find(|r| {
        r.world_size == 1
            && r.precision == record.precision
            && (r.exercise.as_str(), r.model.as_str(), r.device.as_str(), r.batch_size)
                == (record.exercise.as_str(), record.model.as_str(), record.device.as_str(), record.batch_size)
    })?;
    Some(record.throughput / (record.world_size as f64 * baseline.throughput))
}

/// Reads every record of an exercise's CSV.
pub fn read_csv(path: &Path) -> anyhow::Result<Vec<RunRecord>> {
    let mut reader = crate::input::csv(path, "give an exercise's results table")?;
    reader.deserialize().collect::<Result<_, _>>().with_context(|| format!("{}: unreadable results row", path.display()))
}

/// The course's comparison table: one row per device, the speed-up when both ran, and a
/// plain statement when the GPU column is missing.
pub fn comparison_table(records: &[RunRecord], missing: Option<&str>) -> String {
    let mut out = String::new();
    let first = &records[0];
    let unit = if first.is_language_model() { "tok/s" } else { "img/s" };
    let _ = writeln!(
        out,
        "\n{} · {} · {} parameters · {}{}",
        first.exercise,
        first.model,
        group_thousands(first.params),
        first.dataset,
        if first.data_generated { " (GENERATED stand-in data)" } else { "" }
    );
    // A language model's figure is the perplexity, as the tutorial prints it.
    let lm = first.is_language_model();
    let _ = writeln!(
        out,
        "| device | steps | train time (s) | throughput ({unit}) | {} | test loss | peak memory (MiB) |",
        if lm { "test ppl" } else { "test acc" }
    );
    let _ = writeln!(out, "|--------|------:|---------------:|-----------------:|---------:|----------:|------------------:|");
    for r in records {
        let memory = r.peak_memory_bytes.map_or_else(|| "-".to_string(), |b| format!("{:.1}", b as f64 / crate::memory::MIB));
        let figure = if lm { r.test_loss.exp() } else { r.test_acc };
        let _ = writeln!(
            out,
            "| {:<6} | {:>5} | {:>14.1} | {:>16.1} | {:>8.4} | {:>9.4} | {:>17} |",
            r.device, r.steps, r.train_time_s, r.throughput, figure, r.test_loss, memory
        );
    }
    if let Some(reason) = missing {
        let _ = writeln!(out, "| cuda   | GPU column missing: {reason} |");
    }
    // The slide's figures beside ours, marked as the course's.
    let course = crate::course_figures::for_run(&first.exercise, &first.model);
    for c in course {
        let _ = writeln!(out, "| course: {} | - | {:>14} | - | {:>8} | {:>9} | - |", c.device, c.time(), c.metric(lm), c.loss(lm));
    }
    if !course.is_empty() {
        let _ = writeln!(out, "{}; ours: this machine, these flags", crate::course_figures::SOURCE);
    }

    if let [cpu, gpu] = records {
        if gpu.train_time_s > 0.0 {
            let _ = writeln!(out, "GPU speed-up: {:.1}× (throughput ratio)", gpu.throughput / cpu.throughput.max(f64::EPSILON));
        }
    }
    out
}

/// Where the training time went, in one line.
pub fn time_split(record: &RunRecord) -> String {
    let total = record.train_time_s.max(f64::EPSILON);
    let share = |s: f64| 100.0 * s / total;
    format!(
        "[{}] training {:.1} s: data wait {:.1} s ({:.0}%), forward+backward {:.1} s ({:.0}%), optimizer {:.1} s ({:.0}%); evaluation {:.1} s",
        record.device,
        record.train_time_s,
        record.data_wait_s,
        share(record.data_wait_s),
        record.forward_backward_s,
        share(record.forward_backward_s),
        record.optimizer_s,
        share(record.optimizer_s),
        record.eval_s
    )
}

/// The compute the run achieved, its utilisation of the hardware where the peak is known, and
/// the course's machine-time estimate for a whole run of `examples_per_epoch` × the configured
/// epochs: time = FLOPs / (devices × peak × utilisation).
pub fn compute_summary(record: &RunRecord, examples_per_epoch: usize) -> String {
    let unit = if record.is_language_model() { "token" } else { "image" };
    let mut line = format!(
        "[{}] compute: {:.3} TFLOP/s achieved ({:.3} GFLOP per {unit} for forward + backward)",
        record.device,
        record.tflops,
        record.flops_per_example / 1e9
    );
    let total = record.flops_per_example * examples_per_epoch as f64 * record.epochs as f64;
    // devices × peak × utilisation is the achieved rate.
    let hours = total / (record.tflops * 1e12).max(f64::MIN_POSITIVE) / 3600.0;
    if let (Some(peak), Some(mfu)) = (record.peak_tflops, record.mfu) {
        line += &format!("; MFU {:.2}% of {peak:.1} TFLOP/s per device", 100.0 * mfu);
    } else {
        line += "; MFU: give the device's peak with --peak-tflops";
    }
    line + &format!("; {} epochs = {total:.3e} FLOP = {hours:.2} h at this rate", record.epochs)
}

/// 191935 → "191,935".
pub fn group_thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A run of the course CNN on `device` (the charts' tests use it too).
    pub(crate) fn record(device: &str, throughput: f64) -> RunRecord {
        RunRecord {
            exercise: "exercise1".into(),
            model: "cnn".into(),
            params: 191_935,
            device: device.into(),
            dataset: "cifar10".into(),
            data_generated: true,
            epochs: 5,
            steps: 10,
            batch_size: 100,
            lr: 1e-3,
            optimizer: "adam".into(),
            train_time_s: 1000.0 / throughput,
            throughput,
            steady_throughput: Some(throughput),
            world_size: 1,
            precision: "32".into(),
            flops_per_example: 1.0,
            tflops: 0.0,
            peak_tflops: None,
            mfu: None,
            test_acc: 0.5,
            test_loss: 1.2,
            data_wait_s: 0.0,
            forward_backward_s: 0.0,
            optimizer_s: 0.0,
            eval_s: 0.0,
            peak_memory_bytes: Some(300 << 20),
            threads: 2,
            seed: 1,
            torch_version: "2.11.0".into(),
            finished_at: 0,
        }
    }

    #[test]
    fn thousands() {
        assert_eq!(group_thousands(191_935), "191,935");
        assert_eq!(group_thousands(143_667_240), "143,667,240");
        assert_eq!(group_thousands(999), "999");
        assert_eq!(group_thousands(-1000), "-1,000");
    }

    #[test]
    fn table_shows_speedup_or_missing_gpu() {
        let both = comparison_table(&[record("cpu", 100.0), record("cuda", 400.0)], None);
        assert!(both.contains("GPU speed-up: 4.0×"), "{both}");
        assert!(both.contains("191,935 parameters"));
        assert!(both.contains(" 300.0 |"), "peak memory in MiB: {both}");
        let cpu_only = comparison_table(&[record("cpu", 100.0)], Some("no CUDA device"));
        assert!(cpu_only.contains("GPU column missing: no CUDA device"), "{cpu_only}");
        assert!(!cpu_only.contains("speed-up"));
        assert!(cpu_only.contains("throughput (img/s)"), "{cpu_only}");
        // The pipeline exercise trains the language model: tokens, whatever the exercise's name.
        let pipeline = RunRecord { exercise: "exercise3_pipeline".into(), model: "transformer".into(), ..record("cpu", 100.0) };
        let table = comparison_table(&[pipeline], None);
        assert!(table.contains("throughput (tok/s)") && table.contains("test ppl"), "{table}");
        // Its perplexity is exp(test loss) = exp(1.2).
        assert!(table.contains(&format!("{:>8.4}", 1.2f64.exp())), "{table}");
    }

    #[test]
    fn the_course_figures_stand_beside_ours_marked_as_the_courses() {
        let table = comparison_table(&[record("cpu", 100.0), record("cuda", 400.0)], None);
        // exercise1.py's slide: 129.9463222026825 s, test_acc_epoch 0.6310999989509583,
        // test_loss_epoch 1.0603944063186646; on the GPU 52.2851619720459 s, 0.6330000162124634.
        assert!(table.contains("| course: cpu | - |         129.95 | - |   0.6311 |    1.0604 | - |"), "{table}");
        assert!(table.contains("| course: gpu | - |          52.29 | - |   0.6330 |    1.0520 | - |"), "{table}");
        assert!(table.contains(crate::course_figures::SOURCE), "{table}");
        let nlp = RunRecord { exercise: "exercise1_nlp".into(), model: "transformer".into(), ..record("cpu", 100.0) };
        let table = comparison_table(&[nlp], None);
        // The tutorial's `| End of training | test loss 5.48 | test ppl 240.33`, in 4748.23 s.
        assert!(table.contains("| course: cpu | - | 4748.23 (≈1600 s/epoch) | - |   240.33 |      5.48 | - |"), "{table}");
        assert!(table.contains("| course: gpu | - | 219.23 (≈70–79 s/epoch) | - |   221.61 |      5.40 | - |"), "{table}");
        let tp = RunRecord { exercise: "exercise3_tp".into(), model: "transformer".into(), ..record("cpu", 100.0) };
        assert!(!comparison_table(&[tp], None).contains("course"), "no slide for tensor parallelism");
    }

    #[test]
    fn a_csv_with_other_columns_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exercise1.csv");
        std::fs::write(&path, "exercise,model,params\nexercise1,cnn,1\n").unwrap();
        let note = append_csv(&path, &record("cpu", 100.0)).unwrap();
        assert!(note.is_some_and(|n| n.contains("had other columns")), "the caller is told");
        assert_eq!(read_csv(&path).unwrap(), vec![record("cpu", 100.0)]);
        let moved: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).filter(|n| n.ends_with(".old")).collect();
        assert_eq!(moved.len(), 1, "the old file is kept beside the new one");
        assert!(std::fs::read_to_string(dir.path().join(&moved[0])).unwrap().contains("exercise1,cnn,1"));
    }

    #[test]
    fn csv_appends_rows_under_one_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exercise1.csv");
        assert_eq!(append_csv(&path, &record("cpu", 100.0)).unwrap(), None);
        assert_eq!(append_csv(&path, &record("cuda", 200.0)).unwrap(), None);
        let rows = read_csv(&path).unwrap();
        assert_eq!(rows, vec![record("cpu", 100.0), record("cuda", 200.0)]);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches("exercise,model").count(), 1);
    }
}
