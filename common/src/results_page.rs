//! `make report`: the tables and charts of the last runs in a results folder, rendered into a
//! section of its README.md between two markers (the rest of the file, written by hand, stays).
use std::collections::BTreeMap;
use std::path::Path;

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

impl Run {
    fn name(&self) -> String {
        format!("{}-{}-{}", self.exercise, self.model, self.device)
    }

    fn language_model(&self) -> bool {
        self.exercise.contains("nlp") || self.exercise.contains("pipeline")
    }
}

/// The runs (`*.json` files with a results record) in `dir`, by exercise and model.
fn runs(dir: &Path) -> Result<BTreeMap<(String, String), Vec<Run>>> {
    let mut by_exercise: BTreeMap<(String, String), Vec<Run>> = BTreeMap::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot read the results folder {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        // Other JSON files (traces, say) are not runs.
        if let Ok(run) = serde_json::from_str::<Run>(&text) {
            by_exercise.entry((run.exercise.clone(), run.model.clone())).or_default().push(run);
        }
    }
    for runs in by_exercise.values_mut() {
        runs.sort_by(|a, b| a.device.cmp(&b.device).then(a.finished_at.cmp(&b.finished_at)));
    }
    Ok(by_exercise)
}

/// The generated section for the runs in `dir` (markers included).
pub fn render(dir: &Path) -> Result<String> {
    let mut out = format!("{BEGIN}\n\n## Last runs\n\n");
    let runs = runs(dir)?;
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
            let figure = crate::course_figures::CourseFigure::figure(if lm { c.test_ppl } else { c.test_acc }, if lm { 1 } else { 4 });
            let loss = crate::course_figures::CourseFigure::figure(c.test_loss, 2);
            out += &format!("| course: {} (slide) | | | | | {} | | {loss} | {figure} | |\n", c.device, c.time());
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
    Ok(out)
}

/// Replaces (or appends) the generated section of `dir/README.md`; returns the file's path.
pub fn update_readme(dir: &Path) -> Result<std::path::PathBuf> {
    let path = dir.join("README.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let section = render(dir)?;
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(begin), Some(end)) if begin < end => format!("{}{section}{}", &old[..begin], &old[end + END.len()..]),
        _ if old.is_empty() => format!("# results/\n\n{section}\n"),
        _ => format!("{}\n\n{section}\n", old.trim_end()),
    };
    std::fs::write(&path, new).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
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
