//! `make bench-ps`'s chart: of the runs bench/ps.sh appended to `bench-ps.csv`, the latest of
//! each strategy, drawn as throughput (bars from zero) beside test accuracy after the same
//! samples (points on a fitted axis), into `bench-ps.svg`: asynchrony buys the first and can
//! cost the second, so the chart shows both side by side.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use plotters::style::RGBColor;

use crate::plots::{Bar, BarPanel};

/// One run of the bench: a row of `bench-ps.csv` (the columns bench/ps.sh writes).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Row {
    pub finished_at: u64,
    pub model: String,
    /// all-reduce, ps-sync, ps-async or ps-bounded.
    pub strategy: String,
    pub workers: usize,
    pub servers: usize,
    pub per_worker_batch: usize,
    pub epochs: usize,
    pub straggler_s: f64,
    pub steps: usize,
    pub train_time_s: f64,
    /// Training images per second.
    pub throughput: f64,
    pub test_acc: f64,
    pub test_loss: f64,
    pub mean_staleness: f64,
    pub max_staleness: usize,
}

/// The strategies in the bench's order, each with its colour in the chart.
const STRATEGIES: [(&str, RGBColor); 4] =
    [("all-reduce", RGBColor(31, 119, 180)), ("ps-sync", RGBColor(44, 160, 44)), ("ps-async", RGBColor(214, 39, 40)), ("ps-bounded", RGBColor(255, 127, 14))];

/// The newest row of each strategy in `csv`, in the bench's order (a strategy never run is
/// left out; one the bench does not know is an error, not a silent omission).
pub fn latest(csv: &Path) -> Result<Vec<Row>> {
    let mut reader = crate::input::csv(csv, "give the table `make bench-ps` writes").context("run `make bench-ps` first")?;
    let mut newest: Vec<Option<Row>> = vec![None; STRATEGIES.len()];
    for (line, row) in reader.deserialize::<Row>().enumerate() {
        let row = row.with_context(|| format!("{}: row {} is not a bench-ps row", csv.display(), line + 1))?;
        let Some(slot) = STRATEGIES.iter().position(|(name, _)| *name == row.strategy) else {
            bail!("{}: row {}: unknown strategy `{}`", csv.display(), line + 1, row.strategy);
        };
        if newest[slot].as_ref().is_none_or(|seen| seen.finished_at <= row.finished_at) {
            newest[slot] = Some(row);
        }
    }
    let rows: Vec<Row> = newest.into_iter().flatten().collect();
    if rows.is_empty() {
        bail!("{}: no runs (run `make bench-ps` first)", csv.display());
    }
    Ok(rows)
}

/// Throughput and accuracy of `rows`, side by side, to `path`.
pub fn chart(rows: &[Row], path: &Path) -> Result<()> {
    let bar = |row: &Row, value: f64, label: String| {
        let color = STRATEGIES.iter().find(|(name, _)| *name == row.strategy).map_or(RGBColor(0, 0, 0), |(_, color)| *color);
        Bar { name: row.strategy.clone(), value, label, color }
    };
    let first = &rows[0];
    let setting = format!("{} workers × {}, straggler {} s/step", first.workers, first.per_worker_batch, first.straggler_s);
    let throughput = BarPanel {
        caption: format!("exercise2 {}: throughput ({setting})", first.model),
        unit: "images/s",
        bars: rows.iter().map(|row| bar(row, row.throughput, format!("{:.0}", row.throughput))).collect(),
        from_zero: true,
        bounds: 0.0..f64::INFINITY,
    };
    let accuracy = BarPanel {
        caption: format!("test accuracy after {} epochs (staleness max)", first.epochs),
        unit: "accuracy",
        bars: rows.iter().map(|row| bar(row, row.test_acc, format!("{:.3} ({})", row.test_acc, row.max_staleness))).collect(),
        from_zero: false,
        bounds: 0.0..1.0,
    };
    crate::plots::bar_chart(&[throughput, accuracy], crate::plots::WIDTH, path)
}

/// `make bench-ps`'s chart from `<results>/bench-ps.csv` to `<results>/bench-ps.svg`; returns
/// the rows drawn and where.
pub fn collect(results: &Path) -> Result<(Vec<Row>, PathBuf)> {
    let rows = latest(&results.join("bench-ps.csv"))?;
    let svg = results.join("bench-ps.svg");
    chart(&rows, &svg)?;
    Ok((rows, svg))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "finished_at,model,strategy,workers,servers,per_worker_batch,epochs,straggler_s,steps,train_time_s,throughput,test_acc,test_loss,mean_staleness,max_staleness\n";

    fn csv_with(rows: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench-ps.csv");
        std::fs::write(&path, format!("{HEADER}{rows}")).unwrap();
        (dir, path)
    }

    #[test]
    fn the_newest_run_of_each_strategy_in_the_bench_order() {
        let (_dir, csv) = csv_with(
            "100,cnn,ps-async,2,1,50,2,0.05,80,12.2,656.9,0.903,0.38,0.93,3\n\
             100,cnn,all-reduce,2,0,50,2,0.05,80,14.8,540.6,0.954,0.14,0.0,0\n\
             200,cnn,all-reduce,2,0,50,2,0.05,80,7.8,1028.9,0.954,0.14,0.0,0\n\
             200,cnn,ps-async,2,1,50,2,0.05,80,3.3,2446.0,0.913,0.30,0.71,3\n",
        );
        let rows = latest(&csv).unwrap();
        let seen: Vec<(&str, f64)> = rows.iter().map(|r| (r.strategy.as_str(), r.throughput)).collect();
        assert_eq!(seen, [("all-reduce", 1028.9), ("ps-async", 2446.0)]);
    }

    #[test]
    fn an_unknown_strategy_or_an_empty_file_is_an_error() {
        let (_dir, csv) = csv_with("100,cnn,gossip,2,1,50,2,0.05,80,12.2,656.9,0.903,0.38,0.93,3\n");
        assert!(format!("{:#}", latest(&csv).unwrap_err()).contains("unknown strategy `gossip`"));
        let (_dir, csv) = csv_with("");
        assert!(format!("{:#}", latest(&csv).unwrap_err()).contains("no runs"));
        assert!(format!("{:#}", latest(Path::new("/nonexistent/bench-ps.csv")).unwrap_err()).contains("make bench-ps"));
    }

    #[test]
    fn the_chart_shows_each_strategy_with_its_throughput_and_accuracy() {
        let (dir, csv) = csv_with(
            "200,cnn,all-reduce,2,0,50,2,0.05,80,7.8,1028.9,0.954,0.14,0.0,0\n\
             200,cnn,ps-sync,2,1,50,2,0.05,80,7.5,1063.0,0.954,0.14,0.0,0\n\
             200,cnn,ps-async,2,1,50,2,0.05,80,3.3,2446.0,0.913,0.30,0.71,3\n\
             200,cnn,ps-bounded,2,1,50,2,0.05,80,6.8,1169.3,0.959,0.15,0.51,2\n",
        );
        std::fs::rename(&csv, dir.path().join("bench-ps.csv")).unwrap();
        let (rows, svg) = collect(dir.path()).unwrap();
        assert_eq!(rows.len(), 4);
        let text = std::fs::read_to_string(svg).unwrap();
        for label in ["all-reduce", "ps-sync", "ps-async", "ps-bounded", "1029", "2446", "0.913 (3)", "0.959 (2)", "images/s", "accuracy"] {
            assert!(text.contains(label), "no `{label}` in the chart");
        }
        // Four throughput bars from zero; four accuracy points (not bars).
        assert_eq!(text.matches("<rect").count() - text.matches("<rect x=\"0\" y=\"0\"").count(), 4, "{text}");
        assert_eq!(text.matches("<circle").count(), 4);
    }
}
