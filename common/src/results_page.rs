//! `make report`: the tables and charts of the last runs in a results folder, rendered into a
//! section of its README.md between two markers (the rest of the file, written by hand, stays).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The generated section's bounds in README.md.
pub const BEGIN: &str = "<!-- make report: begin (generated from the *.json runs; edits inside are replaced) -->";
pub const END: &str = "<!-- make report: end -->";

/// One run's results file, as far as the page needs it.
#[derive(Debug, serde::Deserialize)]
struct Run {
    exercise: String,
    model: String,
    device: String,
    #[serde(default)]
    precision: Option<String>,
    /// Records written before runs had ranks (the committed reference run) are one process.
    #[serde(default = "one")]
    world_size: usize,
    steps: usize,
    batch_size: usize,
    throughput: f64,
    train_time_s: f64,
    test_loss: f64,
    test_acc: f64,
    #[serde(default)]
    mfu: Option<f64>,
    #[serde(default)]
    data_generated: bool,
    finished_at: u64,
}

fn one() -> usize {
    1
}

impl Run {
    fn name(&self) -> String {
        format!("{}-{}-{}", self.exercise, self.model, self.device)
    }

    fn language_model(&self) -> bool {
        self.exercise.contains("nlp") || self.exercise.contains("pipeline")
    }
}

/// A `*.json` file of the results folder that could not be read, so the page leaves it out.
#[derive(Debug, Clone, PartialEq)]
pub struct Unreadable {
    pub path: PathBuf,
    /// Why, in a few words (the parser's or the file system's).
    pub why: String,
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.why)
    }
}

/// The runs in a results folder, by exercise and model, and the files that could not be read.
/// The most bytes a results file may have (a run's history of a million steps is far smaller).
const MAX_RESULTS_BYTES: u64 = 256 << 20;

#[derive(Default)]
struct Runs {
    by_exercise: BTreeMap<(String, String), Vec<Run>>,
    unreadable: Vec<Unreadable>,
}

/// What one `*.json` file holds for the page.
fn read_run(path: &Path) -> Result<Option<Run>, String> {
    // (A FIFO or a device named `*.json` in a results folder is skipped and said, not waited on.)
    let text = crate::input::read_to_string(path, MAX_RESULTS_BYTES, "not a results file").map_err(|err| format!("cannot read it ({err:#})"))?;
    // A run's file cut short (a full disk, a kill while an older version wrote it) is no JSON.
    let value: serde_json::Value = crate::input::json_value(&text).map_err(|err| format!("not valid JSON ({err}): torn or truncated?"))?;
    // Other JSON files (traces, memory estimates, --eval-only's) are not runs.
    if value.get("exercise").is_none() {
        return Ok(None);
    }
    serde_json::from_value(value).map(Some).map_err(|err| format!("not a results record this page can read ({err})"))
}

/// The runs (`*.json` files with a results record) in `dir`.
fn runs(dir: &Path) -> Result<Runs> {
    let mut runs = Runs::default();
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot read the results folder {}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries.map(|entry| entry.map(|e| e.path())).collect::<Result<_, _>>()?;
    paths.sort();
    for path in paths.into_iter().filter(|p| p.extension().is_some_and(|e| e == "json")) {
        match read_run(&path) {
            Ok(Some(run)) => runs.by_exercise.entry((run.exercise.clone(), run.model.clone())).or_default().push(run),
            Ok(None) => {}
            Err(why) => runs.unreadable.push(Unreadable { path, why }),
        }
    }
    for runs in runs.by_exercise.values_mut() {
        runs.sort_by(|a, b| a.device.cmp(&b.device).then(a.finished_at.cmp(&b.finished_at)));
    }
    Ok(runs)
}

/// The generated section for the runs in `dir` (markers included), and the files left out.
pub fn render(dir: &Path) -> Result<(String, Vec<Unreadable>)> {
    let mut out = format!("{BEGIN}\n\n## Last runs\n\n");
    let Runs { by_exercise: runs, unreadable } = runs(dir)?;
    if runs.is_empty() {
        out += "No runs in this folder yet: run an exercise (e.g. `make exercise1`), then `make report`.\n";
    }
    for ((exercise, model), runs) in &runs {
        let lm = runs[0].language_model();
        out += &format!("### {exercise} · {model}\n\n");
        out += &format!(
            "| device | precision | ranks | batch | steps | train time (s) | {} | test loss | {} | MFU |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            if lm { "tokens/s" } else { "images/s" },
            if lm { "test ppl" } else { "test acc" }
        );
        for run in runs {
            let metric = if lm { format!("{:.2}", run.test_loss.exp()) } else { format!("{:.4}", run.test_acc) };
            out += &format!(
                "| {}{} | {} | {} | {} | {} | {:.1} | {:.1} | {:.4} | {metric} | {} |\n",
                run.device,
                if run.data_generated { " (generated data)" } else { "" },
                run.precision.as_deref().unwrap_or("32"),
                run.world_size,
                run.batch_size,
                run.steps,
                run.train_time_s,
                run.throughput,
                run.test_loss,
                run.mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m)),
            );
        }
        let course = crate::course_figures::for_run(exercise, model);
        for c in course {
            out += &format!("| course: {} (slide) | | | | | {} | | {} | {} | |\n", c.device, c.time(), c.loss(lm), c.metric(lm));
        }
        if !course.is_empty() {
            out += &format!("\n{}.\n", crate::course_figures::SOURCE);
        }
        out += "\n";
        let devices = format!("{exercise}-{model}-devices.svg");
        if dir.join(&devices).exists() {
            out += &format!("![{exercise} {model}: throughput per device]({devices})\n\n");
        }
        for run in runs {
            let curves = format!("{}.svg", run.name());
            if dir.join(&curves).exists() {
                out += &format!("![{}: training curves]({curves})\n\n", run.name());
            }
        }
    }
    out += END;
    Ok((out, unreadable))
}

/// What [`update_readme`] did.
pub struct Updated {
    pub readme: PathBuf,
    /// The `*.json` files whose runs are not on the page: the caller says which, and why.
    pub unreadable: Vec<Unreadable>,
}

/// Replaces (or appends) the generated section of `dir/README.md`.
pub fn update_readme(dir: &Path) -> Result<Updated> {
    let path = dir.join("README.md");
    let old = match crate::output::Kind::of(&path).with_context(|| format!("cannot look at {}", path.display()))? {
        crate::output::Kind::Missing => String::new(),
        _ => crate::input::read_to_string(&path, MAX_RESULTS_BYTES, "the results page is rewritten in place: remove what is at its name")?,
    };
    let (section, unreadable) = render(dir)?;
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(begin), Some(end)) if begin < end => format!("{}{section}{}", &old[..begin], &old[end + END.len()..]),
        _ if old.is_empty() => format!("# results/\n\n{section}\n"),
        _ => format!("{}\n\n{section}\n", old.trim_end()),
    };
    crate::output::write(&path, new)?;
    Ok(Updated { readme: path, unreadable })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_json(device: &str, throughput: f64) -> String {
        serde_json::json!({
            "exercise": "exercise1", "model": "cnn", "device": device, "precision": "32", "world_size": 1, "steps": 3,
            "batch_size": 100, "throughput": throughput, "train_time_s": 1.5, "test_loss": 1.25, "test_acc": 0.5,
            "mfu": null, "data_generated": false, "finished_at": 1,
        })
        .to_string()
    }

    #[test]
    fn files_that_cannot_be_read_are_named_and_the_other_runs_shown() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("exercise1-cnn-cpu.json"), run_json("cpu", 500.0)).unwrap();
        // A record from before runs had ranks is a run of one.
        let mut older: serde_json::Value = serde_json::from_str(&run_json("cpu", 300.0)).unwrap();
        older.as_object_mut().unwrap().remove("world_size");
        older["model"] = "resnet34".into();
        std::fs::write(dir.path().join("exercise1-resnet34-cpu.json"), older.to_string()).unwrap();
        // A run's file cut short, and a record that lacks what the page shows.
        let whole = run_json("cuda", 4000.0);
        std::fs::write(dir.path().join("exercise1-cnn-cuda.json"), &whole[..whole.len() / 2]).unwrap();
        std::fs::write(dir.path().join("exercise2-cnn-cpu.json"), r#"{"exercise": "exercise2", "model": "cnn"}"#).unwrap();
        // Not runs: a trace, --eval-only's results, and a file that is not JSON by name.
        std::fs::write(dir.path().join("exercise1-cnn-cpu.trace.json"), "{\"traceEvents\": []}").unwrap();
        std::fs::write(dir.path().join("exercise1-cnn-cpu.eval-only.json"), r#"{"run": "exercise1-cnn-cpu", "eval_only": true}"#).unwrap();
        std::fs::write(dir.path().join("exercise1.csv"), "not json").unwrap();
        let updated = update_readme(dir.path()).unwrap();
        let named: Vec<_> = updated.unreadable.iter().map(|u| u.path.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(named, ["exercise1-cnn-cuda.json", "exercise2-cnn-cpu.json"]);
        let torn = updated.unreadable[0].to_string();
        assert!(torn.starts_with(&dir.path().join("exercise1-cnn-cuda.json").display().to_string()) && torn.contains("not valid JSON"), "{torn}");
        assert!(updated.unreadable[1].why.contains("missing field"), "{}", updated.unreadable[1]);
        let page = std::fs::read_to_string(updated.readme).unwrap();
        assert!(page.contains("| cpu | 32 | 1 | 100 | 3 | 1.5 | 500.0 |") && !page.contains("| cuda |") && !page.contains("exercise2"), "{page}");
        assert!(page.contains("### exercise1 · resnet34") && page.contains("| cpu | 32 | 1 | 100 | 3 | 1.5 | 300.0 |"), "{page}");
    }

    #[test]
    fn the_section_is_replaced_and_the_hand_written_text_kept() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("exercise1-cnn-cpu.json"), run_json("cpu", 500.0)).unwrap();
        std::fs::write(dir.path().join("exercise1-cnn-cpu.svg"), "<svg/>").unwrap();
        std::fs::write(dir.path().join("exercise1-cnn-cpu.trace.json"), "{\"traceEvents\": []}").unwrap();
        std::fs::write(dir.path().join("README.md"), "# results/\n\nNotes by hand.\n").unwrap();
        update_readme(dir.path()).unwrap();
        let first = std::fs::read_to_string(dir.path().join("README.md")).unwrap();
        assert!(first.starts_with("# results/\n\nNotes by hand.\n"), "{first}");
        assert!(first.contains("| cpu | 32 | 1 | 100 | 3 | 1.5 | 500.0 | 1.2500 | 0.5000 | - |"), "{first}");
        // exercise1.py's slide beside it: 129.9463222026825 s, test loss 1.0603944063186646,
        // accuracy 0.6310999989509583.
        assert!(first.contains("| course: cpu (slide) | | | | | 129.95 | | 1.0604 | 0.6311 | |"), "{first}");
        assert!(first.contains("![exercise1-cnn-cpu: training curves](exercise1-cnn-cpu.svg)"), "{first}");
        // A new run, and the section is rewritten in place, not appended again.
        std::fs::write(dir.path().join("exercise1-cnn-cuda.json"), run_json("cuda", 4000.0)).unwrap();
        std::fs::write(dir.path().join("README.md"), first.clone() + "\nMore notes.\n").unwrap();
        update_readme(dir.path()).unwrap();
        let second = std::fs::read_to_string(dir.path().join("README.md")).unwrap();
        assert_eq!(second.matches(BEGIN).count(), 1);
        assert!(second.contains("| cuda | 32 |") && second.ends_with("\nMore notes.\n"), "{second}");
    }
}
