//! The plan against runs (`make bench-plan`): for each layout that was planned and then run,
//! the predicted and measured step time and peak memory; over all of them, the errors, whether
//! the measured-best layout was among the predicted best, and how well the two rankings agree
//! (Spearman's rank correlation).
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

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
}

/// The newest bench of each cluster in `csv` (`make bench-plan`'s rows), in the order the
/// clusters first appear.
pub fn newest_benches(csv: &Path) -> Result<Vec<(String, Vec<Checked>)>> {
    let mut reader = csv::Reader::from_path(csv).with_context(|| format!("cannot read {}", csv.display()))?;
    let rows: Vec<CsvRow> = reader.deserialize().collect::<Result<_, _>>().with_context(|| format!("{} is not bench-plan's CSV", csv.display()))?;
    let mut clusters: Vec<String> = Vec::new();
    for row in &rows {
        if !clusters.contains(&row.cluster) {
            clusters.push(row.cluster.clone());
        }
    }
    Ok(clusters
        .into_iter()
        .map(|cluster| {
            let newest = rows.iter().filter(|r| r.cluster == cluster).map(|r| r.bench_started_at).max().unwrap_or(0);
            let checked = rows
                .iter()
                .filter(|r| r.cluster == cluster && r.bench_started_at == newest)
                .map(|r| Checked {
                    layout: r.layout.clone(),
                    predicted_step_s: r.predicted_step_s,
                    measured_step_s: r.measured_step_s,
                    predicted_memory_bytes: r.predicted_memory_bytes,
                    measured_memory_bytes: r.measured_memory_bytes,
                })
                .collect();
            (cluster, checked)
        })
        .collect())
}

impl Summary {
    /// The summary as the README gives it, one line.
    pub fn describe(&self, cluster: &str) -> String {
        let pct = |x: f64| format!("{:+.0}%", 100.0 * x);
        format!(
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
        )
    }
}

/// `report plan`: the newest bench of each cluster in `<results>/bench-plan.csv`, summarized,
/// and drawn predicted against measured (step time, peak memory) into `bench-plan.svg`.
pub fn report(results_dir: &Path) -> Result<(Vec<(String, Summary)>, PathBuf)> {
    let benches = newest_benches(&results_dir.join("bench-plan.csv"))?;
    let summaries = benches.iter().filter_map(|(cluster, rows)| Some((cluster.clone(), Summary::of(rows)?))).collect();
    let panel = |caption: &str, title_x: &'static str, title_y: &'static str, point: fn(&Checked) -> (f64, f64)| crate::plots::ScatterPanel {
        caption: caption.into(),
        x_title: title_x,
        y_title: title_y,
        series: benches.iter().map(|(cluster, rows)| (cluster.clone(), rows.iter().map(point).collect())).collect(),
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

/// The median (the mean of the middle two for an even count); NaN for none.
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Each value's rank from 1, ties sharing the mean of the ranks they span.
fn ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut ranks = vec![0.0; values.len()];
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && values[order[end]] == values[order[start]] {
            end += 1;
        }
        let shared = (start + end + 1) as f64 / 2.0;
        for &i in &order[start..end] {
            ranks[i] = shared;
        }
        start = end;
    }
    ranks
}

/// Spearman's rank correlation: Pearson's of the ranks (ties averaged). NaN for fewer than two
/// values or a ranking without spread.
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "two rankings of the same layouts");
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let (va, vb): (f64, f64) = (ra.iter().map(|x| (x - ma).powi(2)).sum(), rb.iter().map(|y| (y - mb).powi(2)).sum());
    cov / (va * vb).sqrt()
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
    fn spearman_is_one_for_the_same_order_minus_one_for_the_reverse_and_averages_ties() {
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 30.0, 400.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // Two swapped of five: 1 − 6·Σd²/(n(n²−1)) = 1 − 6·2/120 = 0.9.
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[2.0, 1.0, 3.0, 4.0, 5.0]) - 0.9).abs() < 1e-12);
        assert_eq!(ranks(&[5.0, 1.0, 5.0, 2.0]), vec![3.5, 1.0, 3.5, 2.0]);
        assert!(spearman(&[1.0, 1.0], &[1.0, 2.0]).is_nan(), "no spread, no correlation");
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
        assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
    }
}
