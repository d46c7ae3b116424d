//! Charts next to the results, as SVG (plotters): each run's training curves (loss, and
//! accuracy or perplexity, per epoch), and the course slide's CPU-vs-GPU bar chart for an
//! exercise run on both. SVG keeps the text as text, so no fonts are needed to draw, and
//! Markdown (results/README.md, GitHub) shows it as an image.
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::report::RunRecord;

/// Chart size in pixels.
pub const WIDTH: u32 = 900;
pub const HEIGHT: u32 = 360;

/// One epoch's figures as the results JSON's `history` holds them.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct EpochPoint {
    pub epoch: usize,
    pub train_loss: f64,
    pub eval_loss: f64,
    #[serde(default)]
    pub eval_acc: Option<f64>,
}

fn plot_error<E: std::fmt::Debug>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("cannot draw {}: {e:?}", path.display())
}

/// A figure of one epoch, for a curve.
type Figure = fn(&EpochPoint) -> f64;

/// The range of `values` (finite ones), widened a little so that lines do not touch the frame.
fn range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.1).max(1e-3);
    (lo - pad)..(hi + pad)
}

/// Training curves of one run: loss (train and evaluation) on the left, accuracy (or
/// perplexity, `perplexity`) on the right, per epoch, to `path`.
pub fn training_curves(title: &str, history: &[EpochPoint], perplexity: bool, path: &Path) -> Result<()> {
    let fail = plot_error(path);
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(&fail)?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(&fail)?;
    let (left, right) = root.split_horizontally(WIDTH / 2);
    let epochs = 1.0..(history.len().max(2) as f64);
    let x = |p: &EpochPoint| p.epoch as f64;

    let loss_range = range(history.iter().flat_map(|p| [p.train_loss, p.eval_loss]));
    let mut chart = ChartBuilder::on(&left)
        .caption("loss", ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(epochs.clone(), loss_range)
        .map_err(&fail)?;
    chart.configure_mesh().x_desc("epoch").draw().map_err(&fail)?;
    let curves: [(&str, RGBColor, Figure); 2] =
        [("train", BLUE, |p| p.train_loss), ("evaluation", RED, |p| p.eval_loss)];
    for (label, color, value) in curves {
        chart
            .draw_series(LineSeries::new(history.iter().map(|p| (x(p), value(p))), color.stroke_width(2)))
            .map_err(&fail)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(&fail)?;

    let (name, metric): (&str, Figure) = match perplexity {
        true => ("evaluation perplexity", |p| p.eval_loss.exp()),
        false => ("evaluation accuracy", |p| p.eval_acc.unwrap_or(f64::NAN)),
    };
    let mut chart = ChartBuilder::on(&right)
        .caption(name, ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(epochs, range(history.iter().map(metric)))
        .map_err(&fail)?;
    chart.configure_mesh().x_desc("epoch").draw().map_err(&fail)?;
    chart
        .draw_series(LineSeries::new(history.iter().map(|p| (x(p), metric(p))), GREEN.stroke_width(2)))
        .map_err(&fail)?;
    chart.draw_series(history.iter().map(|p| Circle::new((x(p), metric(p)), 3, GREEN.filled()))).map_err(&fail)?;
    root.present().map_err(&fail)?;
    Ok(())
}

/// The course slide's chart: training throughput per device (one bar each), to `path`.
pub fn device_comparison(records: &[RunRecord], path: &Path) -> Result<()> {
    let fail = plot_error(path);
    let unit = if records.first().is_some_and(|r| r.exercise.contains("nlp")) { "tokens/s" } else { "images/s" };
    let root = SVGBackend::new(path, (WIDTH / 2, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(&fail)?;
    let top = records.iter().map(|r| r.throughput).fold(0.0, f64::max) * 1.15;
    let title = records.first().map_or(String::new(), |r| format!("{} {}: training throughput", r.exercise, r.model));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d((0..records.len()).into_segmented(), 0.0..top.max(1.0))
        .map_err(&fail)?;
    chart
        .configure_mesh()
        .y_desc(unit)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => records.get(*i).map_or(String::new(), |r| r.device.clone()),
            _ => String::new(),
        })
        .draw()
        .map_err(&fail)?;
    chart
        .draw_series(records.iter().enumerate().map(|(i, r)| {
            let color = if r.device == "cpu" { BLUE } else { GREEN };
            Rectangle::new([(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), r.throughput)], color.mix(0.7).filled())
        }))
        .map_err(&fail)?;
    root.present().map_err(&fail)?;
    Ok(())
}

/// Where a run's training curves go: beside its results JSON.
pub fn curves_path(results_dir: &Path, record: &RunRecord) -> PathBuf {
    results_dir.join(format!("{}.svg", record.name()))
}

/// Where an exercise's CPU-vs-GPU chart goes.
pub fn devices_path(results_dir: &Path, record: &RunRecord) -> PathBuf {
    results_dir.join(format!("{}-{}-devices.svg", record.exercise, record.model))
}

/// Draws a run's curves from its results JSON (`history`), beside it.
pub fn curves_for_run(results_dir: &Path, record: &RunRecord, json: &serde_json::Value) -> Result<PathBuf> {
    let history: Vec<EpochPoint> = serde_json::from_value(json["history"].clone()).unwrap_or_default();
    let path = curves_path(results_dir, record);
    let perplexity = record.exercise.contains("nlp") || record.exercise.contains("pipeline");
    let title = format!("{} · {} · {} ({} precision)", record.exercise, record.model, record.device, record.precision);
    training_curves(&title, &history, perplexity, &path)?;
    Ok(path)
}

/// An SVG file's text, shown as a picture by the evcxr Jupyter kernel when it is a cell's value
/// (evcxr calls `evcxr_display` by name and reads the MIME-tagged block it prints).
#[derive(Debug, Clone)]
pub struct Svg(pub String);

impl Svg {
    pub fn open(path: impl AsRef<Path>) -> Result<Svg> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| anyhow!("cannot read the chart {}: {e}", path.display()))?;
        Ok(Svg(text))
    }

    /// What evcxr reads from the cell's stdout to show the picture.
    pub fn evcxr_block(&self) -> String {
        format!("EVCXR_BEGIN_CONTENT image/svg+xml\n{}\nEVCXR_END_CONTENT", self.0.trim_end())
    }

    pub fn evcxr_display(&self) {
        println!("{}", self.evcxr_block());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `width` and `height` attributes of an SVG document's root element.
    fn svg_size(svg: &str) -> (u32, u32) {
        let root = &svg[svg.find("<svg").expect("an <svg> element")..];
        let root = &root[..root.find('>').unwrap()];
        let attr = |name: &str| -> u32 {
            let start = root.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
            root[start..].split('"').next().unwrap().parse().unwrap()
        };
        (attr("width"), attr("height"))
    }

    #[test]
    fn curves_are_an_svg_of_the_chart_size_with_both_panels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.svg");
        let history: Vec<EpochPoint> = (1..=4)
            .map(|e| EpochPoint { epoch: e, train_loss: 2.0 / e as f64, eval_loss: 2.2 / e as f64, eval_acc: Some(0.2 * e as f64) })
            .collect();
        training_curves("exercise1 · cnn", &history, false, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert_eq!(svg_size(&svg), (WIDTH, HEIGHT));
        for text in ["exercise1 · cnn", "loss", "evaluation accuracy", "train", "evaluation"] {
            assert!(svg.contains(text), "no `{text}` in the chart");
        }
        assert!(svg.matches("<polyline").count() >= 3, "three curves");
    }

    #[test]
    fn a_chart_is_shown_to_evcxr_as_one_svg_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.svg");
        let history = [EpochPoint { epoch: 1, train_loss: 2.0, eval_loss: 1.5, eval_acc: Some(0.4) }];
        training_curves("run", &history, false, &path).unwrap();
        let block = Svg::open(&path).unwrap().evcxr_block();
        let lines: Vec<&str> = block.lines().collect();
        assert_eq!(lines[0], "EVCXR_BEGIN_CONTENT image/svg+xml");
        assert_eq!(*lines.last().unwrap(), "EVCXR_END_CONTENT");
        assert!(lines[1].starts_with("<svg") || lines[1].starts_with("<?xml"), "{}", lines[1]);
        assert_eq!(block.matches("EVCXR_END_CONTENT").count(), 1);
        let missing = Svg::open(dir.path().join("none.svg")).unwrap_err().to_string();
        assert!(missing.contains("none.svg"), "{missing}");
    }
}
