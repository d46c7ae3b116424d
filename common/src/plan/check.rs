//! The plan against runs (`make bench-plan`): for each layout that was planned and then run,
//! the predicted and measured step time and peak memory; over all of them, the errors, whether
//! the measured-best layout was among the predicted best, and how well the two rankings agree
//! (Spearman's rank correlation). A bench that runs each layout more than once, and profiles the
//! machine again after the runs, also says how far its own figures move when taken again: the
//! noise that no model can be checked closer than.
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::stats::{median, spearman};

/// One layout, planned and run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checked {
    /// The command the plan gave.
    pub layout: String,
    pub predicted_step_s: f64,
    pub measured_step_s: f64,
    /// The busiest rank's peak, bytes.
    pub predicted_memory_bytes: f64,
    pub measured_memory_bytes: f64,
}

impl Checked {
    /// Predicted over measured, less one: +0.1 predicts 10% too slow.
    pub fn time_error(&self) -> f64 {
        self.predicted_step_s / self.measured_step_s - 1.0
    }

    /// Predicted over measured, less one: −0.05 predicts 5% too little.
    pub fn memory_error(&self) -> f64 {
        self.predicted_memory_bytes / self.measured_memory_bytes - 1.0
    }
}

/// Signed relative errors, summarized.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Errors {
    /// Median of the errors' sizes.
    pub median_abs: f64,
    /// The largest size, with its sign.
    pub worst: f64,
    /// Median of the signed errors: which way the model leans.
    pub median: f64,
}

impl Errors {
    pub fn of(errors: impl IntoIterator<Item = f64>) -> Errors {
        let errors: Vec<f64> = errors.into_iter().collect();
        let worst = errors.iter().copied().fold(0.0, |w: f64, e| if e.abs() > w.abs() { e } else { w });
        Errors { median_abs: median(errors.iter().map(|e| e.abs())), worst, median: median(errors.iter().copied()) }
    }
}

/// What `make bench-plan` reports of one machine's layouts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub layouts: usize,
    pub time: Errors,
    pub memory: Errors,
    /// Where the measured-fastest layout stood in the plan's ranking (1 = first).
    pub measured_best_predicted_rank: usize,
    /// The measured-fastest layout.
    pub measured_best: String,
    /// Spearman's rank correlation of predicted against measured step times.
    pub spearman: f64,
    /// How far the bench's own figures moved when taken again.
    pub noise: Noise,
}

/// The bench's figures taken twice: the same layout's runs against each other, and the profile
/// taken after the runs against the one taken before.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Noise {
    /// Each layout run more than once: its slowest step time over its fastest, less one.
    pub repeat: Option<Errors>,
    /// Each layout's step time predicted from the later profile over the earlier, less one.
    pub profiles: Option<Errors>,
}

impl Summary {
    /// `None` for no layouts.
    pub fn of(rows: &[Checked]) -> Option<Summary> {
        let fastest = rows.iter().min_by(|a, b| a.measured_step_s.total_cmp(&b.measured_step_s))?;
        let predicted_rank = 1 + rows.iter().filter(|r| r.predicted_step_s < fastest.predicted_step_s).count();
        let predicted: Vec<f64> = rows.iter().map(|r| r.predicted_step_s).collect();
        let measured: Vec<f64> = rows.iter().map(|r| r.measured_step_s).collect();
        Some(Summary {
            layouts: rows.len(),
            time: Errors::of(rows.iter().map(Checked::time_error)),
            memory: Errors::of(rows.iter().map(Checked::memory_error)),
            measured_best_predicted_rank: predicted_rank,
            measured_best: fastest.layout.clone(),
            spearman: spearman(&predicted, &measured),
            noise: Noise::default(),
        })
    }
}

/// One row of `results/bench-plan.csv`.
#[derive(Debug, Clone, Deserialize)]
struct CsvRow {
    bench_started_at: u64,
    cluster: String,
    layout: String,
    predicted_step_s: f64,
    measured_step_s: f64,
    predicted_memory_bytes: f64,
    measured_memory_bytes: f64,
    /// The step time predicted from the profile taken after the runs, where one was (its `pass`
    /// column, which run of the layout a row is, only tells a reader).
    #[serde(default)]
    predicted_step_s_after: Option<f64>,
}

/// One cluster's newest bench: a row per layout (its runs' mean step time, the mean of its
/// predictions from the profiles before and after the runs), and the bench's noise.
#[derive(Debug, Clone, PartialEq)]
pub struct Bench {
    pub cluster: String,
    pub rows: Vec<Checked>,
    pub noise: Noise,
}

impl Bench {
    /// `rows`: one bench's CSV rows, a layout's runs in any order.
    fn of(cluster: String, rows: &[&CsvRow]) -> Bench {
        let layouts = first_appearances(rows.iter().map(|r| r.layout.as_str()));
        let (mut checked, mut repeat, mut profiles) = (Vec::new(), Vec::new(), Vec::new());
        for layout in layouts {
            let runs: Vec<&CsvRow> = rows.iter().copied().filter(|r| r.layout == layout).collect();
            let mean = |f: fn(&CsvRow) -> f64| runs.iter().map(|r| f(r)).sum::<f64>() / runs.len() as f64;
            let (fastest, slowest) = runs.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), r| (lo.min(r.measured_step_s), hi.max(r.measured_step_s)));
            if runs.len() > 1 {
                repeat.push(slowest / fastest - 1.0);
            }
            let before = runs[0].predicted_step_s;
            let predicted = match runs[0].predicted_step_s_after {
                Some(after) => {
                    profiles.push(after / before - 1.0);
                    (before + after) / 2.0
                }
                None => before,
            };
            checked.push(Checked {
                layout: layout.to_string(),
                predicted_step_s: predicted,
                measured_step_s: mean(|r| r.measured_step_s),
                predicted_memory_bytes: runs[0].predicted_memory_bytes,
                measured_memory_bytes: runs.iter().map(|r| r.measured_memory_bytes).fold(0.0, f64::max),
            });
        }
        let summarized = |errors: Vec<f64>| (!errors.is_empty()).then(|| Errors::of(errors));
        Bench { cluster, rows: checked, noise: Noise { repeat: summarized(repeat), profiles: summarized(profiles) } }
    }
}

/// The newest bench of each cluster in `csv` (`make bench-plan`'s rows), in the order the
/// clusters first appear.
pub fn newest_benches(csv: &Path) -> Result<Vec<Bench>> {
    let mut reader = crate::input::csv(csv, "give the bench's table")?;
    let rows: Vec<CsvRow> = reader.deserialize().collect::<Result<_, _>>().with_context(|| format!("{} is not bench-plan's CSV", csv.display()))?;
    Ok(first_appearances(rows.iter().map(|r| r.cluster.as_str()))
        .into_iter()
        .map(String::from)
        .map(|cluster| {
            let newest = rows.iter().filter(|r| r.cluster == cluster).map(|r| r.bench_started_at).max().unwrap_or(0);
            let bench: Vec<&CsvRow> = rows.iter().filter(|r| r.cluster == cluster && r.bench_started_at == newest).collect();
            Bench::of(cluster, &bench)
        })
        .collect())
}

impl Summary {
    /// The summary as the README gives it, one line.
    pub fn describe(&self, cluster: &str) -> String {
        let pct = |x: f64| format!("{:+.0}%", 100.0 * x);
        let mut line = format!(
            "{cluster}: {} layouts; step time off by {:.0}% (median), {} at worst, leaning {}; peak memory off by {:.1}% (median), {} at worst; \
             the measured-fastest ({}) was #{} of the plan; Spearman {:.2}",
            self.layouts,
            100.0 * self.time.median_abs,
            pct(self.time.worst),
            pct(self.time.median),
            100.0 * self.memory.median_abs,
            pct(self.memory.worst),
            self.measured_best,
            self.measured_best_predicted_rank,
            self.spearman
        );
        if let Some(repeat) = self.noise.repeat {
            line += &format!("; the noise: a layout's runs {:.0}% apart (median), {:.0}% at worst", 100.0 * repeat.median_abs, 100.0 * repeat.worst.abs());
        }
        if let Some(profiles) = self.noise.profiles {
            line += &format!("; the profile after the runs predicts {} (median) of the one before, {} at worst", pct(profiles.median), pct(profiles.worst));
        }
        line
    }
}

/// `report plan`: the newest bench of each cluster in `<results>/bench-plan.csv`, summarized,
/// and drawn predicted against measured (step time, peak memory) into `bench-plan.svg`.
pub fn report(results_dir: &Path) -> Result<(Vec<(String, Summary)>, PathBuf)> {
    let benches = newest_benches(&results_dir.join("bench-plan.csv"))?;
    let summaries = benches.iter().filter_map(|bench| Some((bench.cluster.clone(), Summary { noise: bench.noise, ..Summary::of(&bench.rows)? }))).collect();
    let panel = |caption: &str, title_x: &'static str, title_y: &'static str, point: fn(&Checked) -> (f64, f64)| crate::plots::ScatterPanel {
        caption: caption.into(),
        x_title: title_x,
        y_title: title_y,
        series: benches.iter().map(|bench| (bench.cluster.clone(), bench.rows.iter().map(point).collect())).collect(),
    };
    let svg = results_dir.join("bench-plan.svg");
    crate::plots::against_diagonal(
        "The plan against runs: one point per layout (the line: predicted = measured)",
        &[
            panel("step time", "predicted (s)", "measured (s)", |c| (c.predicted_step_s, c.measured_step_s)),
            panel("busiest rank's peak memory", "predicted (MiB)", "measured (MiB)", |c| {
                (c.predicted_memory_bytes / 1048576.0, c.measured_memory_bytes / 1048576.0)
            }),
        ],
        &svg,
    )?;
    Ok((summaries, svg))
}

/// Each distinct value once, in the order it first appears.
fn first_appearances<'a>(values: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut seen: Vec<&str> = Vec::new();
    for value in values {
        if !seen.contains(&value) {
            seen.push(value);
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(layout: &str, predicted: f64, measured: f64) -> Checked {
        Checked { layout: layout.into(), predicted_step_s: predicted, measured_step_s: measured, predicted_memory_bytes: 95.0, measured_memory_bytes: 100.0 }
    }

    #[test]
    fn the_report_takes_each_clusters_newest_bench_and_draws_it() {
        let dir = tempfile::tempdir().unwrap();
        let header = "bench_started_at,cluster,predicted_rank,layout,predicted_step_s,measured_step_s,predicted_memory_bytes,measured_memory_bytes,compute_s,tp_comm_s,bubble_s,exposed_comm_s,optimizer_s";
        let lines = [
            header,
            r#"100,"1x4",1,"exercise1_nlp --batch-size 4",0.1,0.5,1000,1000,0,0,0,0,0"#,
            r#"200,"1x4",1,"exercise1_nlp --batch-size 4",0.1,0.11,1000,1100,0,0,0,0,0"#,
            r#"200,"1x4",2,"exercise3 tp --tp 2 --batch-size 8",0.2,0.19,2000,2000,0,0,0,0,0"#,
            r#"300,"2x2 over 1gbit",1,"exercise3 tp --tp 2 --batch-size 8",0.3,0.3,2000,2000,0,0,0,0,0"#,
        ];
        std::fs::write(dir.path().join("bench-plan.csv"), lines.join("\n")).unwrap();
        let (summaries, svg) = report(dir.path()).unwrap();
        assert_eq!(summaries.len(), 2);
        let (cluster, one_host) = &summaries[0];
        assert_eq!((cluster.as_str(), one_host.layouts), ("1x4", 2), "the older bench of 1x4 is left out");
        assert!((one_host.memory.worst + 1.0 / 11.0).abs() < 1e-12, "{one_host:?}");
        let text = one_host.describe(cluster);
        assert!(text.starts_with("1x4: 2 layouts; step time off by ") && text.contains("was #1 of the plan"), "{text}");
        let drawn = std::fs::read_to_string(svg).unwrap();
        assert!(drawn.contains("<svg") && drawn.contains("2x2 over 1gbit") && drawn.contains("step time"), "the chart names its clusters and panels");
        std::fs::write(dir.path().join("bench-plan.csv"), "what,ever\n1,2\n").unwrap();
        assert!(report(dir.path()).unwrap_err().to_string().contains("is not bench-plan's CSV"));
    }

    #[test]
    fn a_layout_run_twice_is_checked_by_its_mean_and_the_spread_of_runs_and_profiles_is_the_noise() {
        let dir = tempfile::tempdir().unwrap();
        let header = "bench_started_at,cluster,predicted_rank,layout,predicted_step_s,measured_step_s,predicted_memory_bytes,measured_memory_bytes,compute_s,tp_comm_s,bubble_s,exposed_comm_s,optimizer_s,pass,predicted_step_s_after";
        let lines = [
            header,
            // An older bench of the same cluster, each layout once, without the new columns' values.
            r#"100,"1x2",1,"a",0.1,0.5,1000,1000,0,0,0,0,0,1,"#,
            // The newest: a and b twice each (the second pass in reverse), profiled again after.
            r#"200,"1x2",1,"a",1.0,1.0,1000,1000,0,0,0,0,0,1,1.15"#,
            r#"200,"1x2",2,"b",2.0,2.5,2000,2000,0,0,0,0,0,1,1.9"#,
            r#"200,"1x2",2,"b",2.0,1.5,2000,2100,0,0,0,0,0,2,1.9"#,
            r#"200,"1x2",1,"a",1.0,1.2,1000,1000,0,0,0,0,0,2,1.15"#,
        ];
        std::fs::write(dir.path().join("bench-plan.csv"), lines.join("\n")).unwrap();
        let benches = newest_benches(&dir.path().join("bench-plan.csv")).unwrap();
        assert_eq!(benches.len(), 1);
        let bench = &benches[0];
        let [a, b] = &bench.rows[..] else { panic!("a row per layout, not per run: {bench:?}") };
        assert_eq!((a.layout.as_str(), b.layout.as_str()), ("a", "b"), "in the order the plan ranked them");
        // Measured: the runs' mean; predicted: the two profiles' mean; memory: the higher peak.
        assert!((a.measured_step_s - 1.1).abs() < 1e-12 && (a.predicted_step_s - 1.075).abs() < 1e-12, "{a:?}");
        assert!((b.measured_step_s - 2.0).abs() < 1e-12 && (b.predicted_step_s - 1.95).abs() < 1e-12, "{b:?}");
        assert_eq!(b.measured_memory_bytes, 2100.0);
        // a's runs 20% apart, b's 2.5/1.5 − 1 = 66.7%; the later profile +15% and −5%.
        let repeat = bench.noise.repeat.unwrap();
        assert!((repeat.worst - 2.0 / 3.0).abs() < 1e-12 && (repeat.median_abs - (0.2 + 2.0 / 3.0) / 2.0).abs() < 1e-12, "{repeat:?}");
        let profiles = bench.noise.profiles.unwrap();
        assert!((profiles.worst - 0.15).abs() < 1e-12 && (profiles.median - 0.05).abs() < 1e-12, "{profiles:?}");
        let (summaries, _) = report(dir.path()).unwrap();
        let text = summaries[0].1.describe("1x2");
        assert!(text.contains("; the noise: a layout's runs 43% apart (median), 67% at worst"), "{text}");
        assert!(text.contains("; the profile after the runs predicts +5% (median) of the one before, +15% at worst"), "{text}");
        // A bench of single runs and one profile has no noise to tell.
        let once = [header, r#"300,"1x2",1,"a",1.0,1.0,1000,1000,0,0,0,0,0,1,"#];
        std::fs::write(dir.path().join("bench-plan.csv"), once.join("\n")).unwrap();
        let (summaries, _) = report(dir.path()).unwrap();
        assert_eq!(summaries[0].1.noise, Noise::default());
        assert!(!summaries[0].1.describe("1x2").contains("noise"));
    }

    #[test]
    fn the_summary_finds_where_the_fastest_run_was_ranked_and_the_worst_error_with_its_sign() {
        let rows = [row("a", 1.0, 1.1), row("b", 2.0, 1.0), row("c", 3.0, 3.0), row("d", 4.0, 5.0)];
        let s = Summary::of(&rows).unwrap();
        // b ran fastest; the plan put a first and b second.
        assert_eq!((s.measured_best.as_str(), s.measured_best_predicted_rank), ("b", 2));
        // Errors: −9.1%, +100%, 0%, −20%.
        assert!((s.time.worst - 1.0).abs() < 1e-12, "{s:?}");
        assert!((s.time.median_abs - (0.2 + 1.0 / 11.0) / 2.0).abs() < 1e-12, "{s:?}");
        assert!((s.time.median - (-1.0 / 11.0 + 0.0) / 2.0).abs() < 1e-12, "{s:?}");
        assert!((s.memory.worst + 0.05).abs() < 1e-12 && (s.memory.median + 0.05).abs() < 1e-12, "{s:?}");
        assert!((s.spearman - 0.8).abs() < 1e-12, "{s:?}");
        assert_eq!(Summary::of(&[]), None);
    }
}
