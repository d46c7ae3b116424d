//! Charts next to the results, as SVG (plotters): each run's training curves, and the course
//! slide's CPU-vs-GPU bar chart for an exercise run on both. The curves are drawn against the
//! optimizer step, as TensorBoard draws them: every step's training loss, faint, under its
//! smoothed trend, and the evaluations where the epochs ended (loss, and accuracy or perplexity),
//! so that a run of a few steps shows as much as a run of many epochs. SVG keeps the text as
//! text, so no fonts are needed to draw, and Markdown (results/README.md, GitHub) shows it as an
//! image.
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::RunRecord;
use crate::train::Metric;

/// Chart size in pixels.
pub const WIDTH: u32 = 900;
pub const HEIGHT: u32 = 360;

/// One epoch's evaluation as the results JSON's `history` holds it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct EpochPoint {
    pub epoch: usize,
    /// Optimizer steps done when the epoch ended, a resumed run's earlier ones included: where
    /// its evaluation sits on the step axis.
    pub end_step: usize,
    /// NaN where the JSON has null (a diverged run's loss).
    #[serde(deserialize_with = "null_is_nan")]
    pub eval_loss: f64,
    #[serde(default)]
    pub eval_acc: Option<f64>,
}

fn null_is_nan<'de, D: serde::Deserializer<'de>>(value: D) -> std::result::Result<f64, D::Error> {
    Ok(<Option<f64> as serde::Deserialize>::deserialize(value)?.unwrap_or(f64::NAN))
}

/// The course's published figure for the metric a run's curves show (accuracy as a share, or
/// perplexity), drawn as a dashed line labelled "course: <value> (<note>)".
#[derive(Debug, Clone, Copy)]
struct CourseMark<'a> {
    value: f64,
    /// Where the figure comes from, e.g. "PyTorch, 5 epochs"; may be empty.
    note: &'a str,
}

impl CourseMark<'_> {
    fn label(&self) -> String {
        match self.note {
            "" => format!("course: {}", significant(self.value)),
            note => format!("course: {} ({note})", significant(self.value)),
        }
    }
}

/// What drawing on the SVG backend fails with.
type Drawn<T = ()> = std::result::Result<T, DrawingAreaErrorKind<std::io::Error>>;
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
/// One panel: a chart whose axes are both [`Axis`]es.
type Panel<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<Axis, Axis>>;

/// Ticks an axis gets at most: enough to read a value off, few enough that labels never touch.
const MOST_TICKS: usize = 6;

/// An axis fitted to the values it shows: its range and ticks in drawing coordinates (a value's
/// logarithm on a log axis, so that log and linear panels share one coordinate type), or the
/// names of the bars of a bar chart. Plotters draws it as it is: its ticks, labelled by
/// [`Axis::label`].
#[derive(Debug, Clone)]
struct Axis {
    range: Range<f64>,
    ticks: Vec<f64>,
    log: bool,
    /// The fewest decimals that write every tick exactly.
    decimals: usize,
    /// What the axis measures, written along it (may be empty).
    title: &'static str,
    /// A bar chart's bars, one a unit wide from 0, labelled at their middles (empty for numbers).
    names: Vec<String>,
}

impl Axis {
    /// A linear axis over the finite `values`, padded so that no point sits on the frame, within
    /// `bounds` (an accuracy never shows below 0 or above 1).
    fn linear(values: impl IntoIterator<Item = f64>, bounds: Range<f64>) -> Axis {
        let (lo, hi) = extent(values.into_iter().filter(|v| v.is_finite())).unwrap_or((0.0, 1.0));
        // A single value (one evaluation) still gets a span: a twentieth of its size around it.
        let size = lo.abs().max(hi.abs());
        let pad = ((hi - lo) * 0.08).max(size * 0.05).max(if size == 0.0 { 0.05 } else { 0.0 });
        let range = (lo - pad).max(bounds.start)..(hi + pad).min(bounds.end);
        Axis::with_ticks(range.clone(), nice_ticks(range, 0.0), false)
    }

    /// A log axis over the positive finite `values`: perplexity falls by orders of magnitude
    /// in the first epochs, and a linear axis would flatten everything after them.
    fn log(values: impl IntoIterator<Item = f64>) -> Axis {
        let (lo, hi) = extent(values.into_iter().filter(|v| v.is_finite() && *v > 0.0)).unwrap_or((1.0, 10.0));
        let pad = ((hi / lo).ln() * 0.08).max(0.05);
        let range = (lo.ln() - pad)..(hi.ln() + pad);
        let ticks = log_ticks(range.start.exp()..range.end.exp());
        Axis::with_ticks(range, ticks.into_iter().map(f64::ln).collect(), true)
    }

    /// The optimizer steps from `first` (before the run's first step) to `last`, ticked at whole
    /// steps, with room on the right so that the last evaluation's point is not cut in half.
    fn steps(first: usize, last: usize) -> Axis {
        let (lo, hi) = (first as f64, last.max(first + 1) as f64);
        let range = lo..hi + ((hi - lo) * 0.04).max(0.25);
        Axis::with_ticks(range.clone(), nice_ticks(range, 1.0), false).titled("step")
    }

    /// One bar per name, in order.
    fn names<S: ToString>(names: &[S]) -> Axis {
        let ticks = (0..names.len()).map(|i| i as f64 + 0.5).collect();
        Axis { names: names.iter().map(S::to_string).collect(), ..Axis::with_ticks(0.0..names.len() as f64, ticks, false) }
    }

    fn with_ticks(range: Range<f64>, ticks: Vec<f64>, log: bool) -> Axis {
        let values: Vec<f64> = ticks.iter().map(|&t| if log { t.exp() } else { t }).collect();
        Axis { range, ticks, log, decimals: decimals(&values), title: "", names: Vec::new() }
    }

    fn titled(self, title: &'static str) -> Axis {
        Axis { title, ..self }
    }

    /// Where `value` is drawn.
    fn at(&self, value: f64) -> f64 {
        if self.log {
            value.ln()
        } else {
            value
        }
    }

    /// A tick's label, from where it is drawn.
    fn label(&self, at: f64) -> String {
        if !self.names.is_empty() {
            return self.names.get(at.floor() as usize).cloned().unwrap_or_default();
        }
        let value = if self.log { at.exp() } else { at };
        number(value, self.decimals)
    }
}

impl Ranged for Axis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, at: &f64, pixels: (i32, i32)) -> i32 {
        RangedCoordf64::from(self.range.clone()).map(at, pixels)
    }

    /// The ticks, with grid lines at them only (none between).
    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        match hint.weight().allow_light_points() {
            true => Vec::new(),
            false => self.ticks.clone(),
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

impl ValueFormatter<f64> for Axis {
    fn format_ext(&self, at: &f64) -> String {
        self.label(*at)
    }
}

/// The smallest and largest of `values`, none when there are none.
pub(crate) fn extent(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| Some(acc.map_or((v, v), |(lo, hi): (f64, f64)| (lo.min(v), hi.max(v)))))
}

/// At most [`MOST_TICKS`] ticks in `range`, a round spacing apart (1, 2 or 5 times a power of
/// ten, at least `least_spacing`: whole steps on a step axis).
fn nice_ticks(range: Range<f64>, least_spacing: f64) -> Vec<f64> {
    let rough = ((range.end - range.start) / MOST_TICKS as f64).max(least_spacing).max(f64::MIN_POSITIVE);
    let power = 10f64.powf(rough.log10().floor());
    let spacing = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * power).find(|&s| s >= rough * (1.0 - 1e-9)).unwrap_or(10.0 * power);
    let (first, last) = ((range.start / spacing).ceil() as i64, (range.end / spacing).floor() as i64);
    (first..=last).map(|i| i as f64 * spacing).collect()
}

/// Ticks for a log axis over `range` (values, not logarithms): 1, 2 and 5 times the powers of
/// ten in it, or 1 and 3 times, or the powers alone where those are too many. A range within
/// about a decade (perplexity from 200 to 570, or from 5,200 to 5,900), where fewer than three
/// of those fall, gets evenly spaced round ticks instead.
pub(crate) fn log_ticks(range: Range<f64>) -> Vec<f64> {
    let powers = range.start.log10().floor() as i32..=range.end.log10().ceil() as i32;
    let ticks = |mantissas: &[f64]| -> Vec<f64> {
        let in_range = powers.clone().flat_map(|p| mantissas.iter().map(move |m| m * 10f64.powi(p)));
        in_range.filter(|t| range.contains(t)).collect()
    };
    let dense = ticks(&[1.0, 2.0, 5.0]);
    if dense.len() < 3 {
        return nice_ticks(range.clone(), 0.0);
    }
    [dense, ticks(&[1.0, 3.0])].into_iter().find(|t| t.len() <= MOST_TICKS).unwrap_or_else(|| ticks(&[1.0]))
}

/// The fewest decimals (at most 8) that write each of `ticks` exactly: 0.25 needs two, 5500
/// none; every tick of an axis gets as many, so that their labels line up.
fn decimals(ticks: &[f64]) -> usize {
    (0..8)
        .find(|&d| {
            let scale = 10f64.powi(d as i32);
            ticks.iter().all(|t| ((t * scale).round() - t * scale).abs() < 1e-6)
        })
        .unwrap_or(8)
}

/// A value written beside its point: three significant digits (0.8734 → "0.873"), and no
/// decimals on a large one (5580.08 → "5580").
fn significant(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}");
    }
    let decimals = (2 - value.abs().log10().floor() as i64).max(0) as usize;
    number(value, decimals)
}

/// `value` with `decimals` decimals, its thousands grouped from 10,000 on (a perplexity of
/// 20,000, a GPU's images/s): five digits and more are hard to read at a glance.
fn number(value: f64, decimals: usize) -> String {
    match decimals == 0 && value.abs() >= 1e4 && value.abs() < 1e15 {
        true => crate::report::group_thousands(value.round() as i64),
        false => format!("{value:.decimals$}"),
    }
}

/// TensorBoard's smoothing of a noisy curve: an exponential moving average with `weight` on the
/// past, debiased as Adam debiases its moments (divided by 1 - weight^n after n values) so that
/// the first steps are not pulled towards zero. A value that is not finite (a diverged step)
/// is passed through and left out of the average, again as TensorBoard does.
fn smoothed(values: &[f64], weight: f64) -> Vec<f64> {
    let (mut average, mut counted) = (0.0, 0);
    values
        .iter()
        .map(|&v| {
            if !v.is_finite() {
                return v;
            }
            average = average * weight + (1.0 - weight) * v;
            counted += 1;
            average / (1.0 - weight.powi(counted))
        })
        .collect()
}

/// The smoothing weight for a run of `steps` steps: an average over about a twentieth of the
/// run, from TensorBoard's default 0.6 for a few dozen steps up to 0.9 (about the last ten
/// steps) from 200 steps on, so that a long run's trend stays close to its steps.
fn smoothing_weight(steps: usize) -> f64 {
    (1.0 - 20.0 / steps.max(1) as f64).clamp(0.6, 0.9)
}

/// The points of a curve that can be drawn (a diverged step's NaN cannot).
fn finite(points: impl IntoIterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    points.into_iter().filter(|(x, y)| x.is_finite() && y.is_finite()).collect()
}

fn text_style(size: u32, pos: Pos) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK).pos(pos)
}

/// A panel (one chart of a figure): its caption, both axes' ticks, labels and names, and
/// horizontal grid lines; vertical ones too where the horizontal axis is numeric.
fn panel<'a, 'b>(area: &'a Area<'b>, caption: &str, x: &Axis, y: &Axis) -> Drawn<Panel<'a, 'b>> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(10)
        .margin_right(20)
        .x_label_area_size(40)
        .y_label_area_size(if y.title.is_empty() { 50 } else { 60 })
        .build_cartesian_2d(x.clone(), y.clone())?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(x.title).y_desc(y.title).label_style(("sans-serif", 13)).axis_desc_style(("sans-serif", 13)).bold_line_style(BLACK.mix(0.12));
    if !x.names.is_empty() {
        mesh.disable_x_mesh();
    }
    mesh.draw()?;
    Ok(chart)
}

/// `text` drawn `offset` pixels from the point `at` of a panel, anchored at `anchor`.
fn text_at(chart: &mut Panel, text: String, at: (f64, f64), offset: (i32, i32), anchor: Pos) -> Drawn {
    chart.draw_series(std::iter::once(EmptyElement::at(at) + Text::new(text, offset, text_style(13, anchor))))?;
    Ok(())
}

/// The colour of each curve.
const TRAIN: RGBColor = BLUE;
const EVALUATION: RGBColor = RED;
const METRIC: RGBColor = RGBColor(0, 140, 60);

/// Training curves of one run, to `path`: on the left, the training loss of every step
/// (`step_losses`, faint) under its smoothed trend, and the evaluation loss where each epoch of
/// `history` ended; on the right, those evaluations' accuracy or perplexity (log scale), and
/// the course's published figure where `course` gives one.
/// Drawn in memory and written whole (the atomic writer: never half a chart, never through a
/// link planted at the chart's name).
fn training_curves(title: &str, step_losses: &[f64], history: &[EpochPoint], metric: Metric, course: Option<CourseMark>, path: &Path) -> Result<()> {
    let mut svg = String::new();
    draw_curves(title, step_losses, history, metric, course, &mut svg).map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    crate::output::write(path, svg)
}

fn draw_curves(title: &str, step_losses: &[f64], history: &[EpochPoint], metric: Metric, course: Option<CourseMark>, svg: &mut String) -> Drawn {
    let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    if step_losses.is_empty() && history.is_empty() {
        // A finished run resumed trains nothing: a sentence, not empty axes.
        let (width, height) = root.dim_in_pixel();
        let center = Pos::new(HPos::Center, VPos::Center);
        root.draw(&Text::new("no training steps in this run", (width as i32 / 2, height as i32 / 2), text_style(16, center)))?;
        return root.present();
    }
    // The losses are this process's steps: after a resume they follow the steps of the
    // epochs restored, which the last evaluation's step tells.
    let last = history.last().map_or(step_losses.len(), |p| p.end_step.max(step_losses.len()));
    let first = last - step_losses.len();
    let steps = Axis::steps(first, last);
    let (left, right) = root.split_horizontally(WIDTH / 2);
    loss_panel(&left, &steps, first, step_losses, history)?;
    metric_panel(&right, &steps, history, metric, course)?;
    root.present()
}

/// The loss panel: every step's training loss, faint, under its smoothed trend, and the
/// evaluation loss where each epoch ended.
fn loss_panel(area: &Area, x: &Axis, first: usize, losses: &[f64], history: &[EpochPoint]) -> Drawn {
    let at_steps = |values: &[f64]| finite(values.iter().enumerate().map(|(i, &v)| ((first + i + 1) as f64, v)));
    let evaluations = finite(history.iter().map(|p| (p.end_step as f64, p.eval_loss)));
    let y = Axis::linear(losses.iter().copied().chain(evaluations.iter().map(|p| p.1)), 0.0..f64::INFINITY);
    let mut chart = panel(area, "loss", x, &y)?;
    let weight = smoothing_weight(losses.len());
    let each_step = at_steps(losses);
    let legend_at = emptiest_corner(each_step.iter().chain(&evaluations), x, &y);
    let curves = [
        (each_step, TRAIN.mix(0.3).stroke_width(1), "train, each step".to_string(), 0),
        (at_steps(&smoothed(losses, weight)), TRAIN.stroke_width(2), format!("train, smoothed ({weight:.2})"), 0),
        (evaluations, EVALUATION.filled().stroke_width(2), "evaluation".to_string(), 3),
    ];
    for (points, style, label, point_size) in curves {
        chart
            .draw_series(LineSeries::new(points, style).point_size(point_size))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart.configure_series_labels().position(legend_at).label_font(("sans-serif", 13)).border_style(BLACK.mix(0.3)).background_style(WHITE.mix(0.85)).draw()
}

/// The metric panel: each evaluation's accuracy or perplexity where its epoch ended, the last
/// one's value written beside its point (a run of one epoch has a single point), and the
/// course's figure as a dashed line.
fn metric_panel(area: &Area, x: &Axis, history: &[EpochPoint], metric: Metric, course: Option<CourseMark>) -> Drawn {
    let (caption, value): (&str, fn(&EpochPoint) -> f64) = match metric {
        Metric::Accuracy => ("evaluation accuracy", |p| p.eval_acc.unwrap_or(f64::NAN)),
        Metric::Perplexity => ("evaluation perplexity (log scale)", |p| p.eval_loss.exp()),
    };
    let evaluations = finite(history.iter().map(|p| (p.end_step as f64, value(p))));
    let shown = evaluations.iter().map(|p| p.1).chain(course.map(|c| c.value));
    let y = match metric {
        Metric::Accuracy => Axis::linear(shown, 0.0..1.0),
        Metric::Perplexity => Axis::log(shown),
    };
    let mut chart = panel(area, caption, x, &y)?;
    if let Some(course) = course {
        let level = y.at(course.value);
        let dashed = DashedLineSeries::new([(x.range.start, level), (x.range.end, level)], 8, 5, BLACK.mix(0.7).stroke_width(1));
        chart.draw_series(dashed)?;
        text_at(&mut chart, course.label(), (x.range.start, level), (4, -3), Pos::new(HPos::Left, VPos::Bottom))?;
    }
    let points: Vec<(f64, f64)> = evaluations.iter().map(|&(step, v)| (step, y.at(v))).collect();
    chart.draw_series(LineSeries::new(points.clone(), METRIC.filled().stroke_width(2)).point_size(3))?;
    if let (Some(&(_, v)), Some(&at)) = (evaluations.last(), points.last()) {
        // Left of the point (it is at the step axis's right end), on the side away from the
        // line that comes into it: below when the curve falls to it, as perplexity does.
        let falling = points.len() > 1 && points[points.len() - 2].1 > at.1;
        let (dy, side) = if falling { (6, VPos::Top) } else { (-6, VPos::Bottom) };
        text_at(&mut chart, significant(v), at, (-6, dy), Pos::new(HPos::Right, side))?;
    }
    Ok(())
}

/// Where a panel's legend hides fewest of its `points` (drawing coordinates): the corner, of
/// the four, whose box of half the panel's width and a third of its height holds fewest, the
/// upper right where they tie (a falling loss leaves it empty).
fn emptiest_corner<'p>(points: impl Iterator<Item = &'p (f64, f64)> + Clone, x: &Axis, y: &Axis) -> SeriesLabelPosition {
    let share = |v: f64, range: &Range<f64>| (v - range.start) / (range.end - range.start);
    let corners = [
        (SeriesLabelPosition::UpperRight, true, true),
        (SeriesLabelPosition::UpperLeft, false, true),
        (SeriesLabelPosition::LowerRight, true, false),
        (SeriesLabelPosition::LowerLeft, false, false),
    ];
    let covered = |&(_, right, upper): &(SeriesLabelPosition, bool, bool)| {
        let inside = |&&(px, py): &&(f64, f64)| {
            let (sx, sy) = (share(px, &x.range), share(py, &y.range));
            (if right { sx > 0.5 } else { sx < 0.5 }) && (if upper { sy > 2.0 / 3.0 } else { sy < 1.0 / 3.0 })
        };
        points.clone().filter(inside).count()
    };
    corners.into_iter().min_by_key(covered).map_or(SeriesLabelPosition::UpperRight, |corner| corner.0)
}

/// One panel of [`log_log_chart`]: its caption, its axes' titles, and named curves of (x, y)
/// points.
pub struct LinePanel {
    pub caption: String,
    pub x_title: &'static str,
    pub y_title: &'static str,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// The colours of [`log_log_chart`]'s curves, in order (the first two the device chart's).
const CURVES: [RGBColor; 4] = [BLUE, METRIC, RED, RGBColor(120, 60, 160)];

/// `panels` side by side under `title`, both axes logarithmic (sizes and times that span orders
/// of magnitude), to `path`; written whole, as every chart.
pub fn log_log_chart(title: &str, panels: &[LinePanel], path: &Path) -> Result<()> {
    let mut svg = String::new();
    draw_log_log(title, panels, &mut svg).map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    crate::output::write(path, svg)
}

fn draw_log_log(title: &str, panels: &[LinePanel], svg: &mut String) -> Drawn {
    let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, p) in areas.iter().zip(panels) {
        let points: Vec<(f64, f64)> = p.series.iter().flat_map(|(_, pts)| pts.iter().copied()).collect();
        let x = Axis::log(points.iter().map(|pt| pt.0)).titled(p.x_title);
        let y = Axis::log(points.iter().map(|pt| pt.1)).titled(p.y_title);
        let mut chart = panel(area, &p.caption, &x, &y)?;
        let drawn: Vec<(f64, f64)> = points.iter().map(|&(a, b)| (x.at(a), y.at(b))).collect();
        let legend_at = emptiest_corner(drawn.iter(), &x, &y);
        for ((name, pts), colour) in p.series.iter().zip(CURVES.iter().cycle()) {
            let style = colour.filled().stroke_width(2);
            let at: Vec<(f64, f64)> = finite(pts.iter().map(|&(a, b)| (x.at(a), y.at(b))));
            chart
                .draw_series(LineSeries::new(at, style).point_size(3))?
                .label(name.clone())
                .legend(move |(px, py)| PathElement::new(vec![(px, py), (px + 20, py)], style));
        }
        chart
            .configure_series_labels()
            .position(legend_at)
            .label_font(("sans-serif", 13))
            .border_style(BLACK.mix(0.3))
            .background_style(WHITE.mix(0.85))
            .draw()?;
    }
    root.present()
}

/// One panel of [`against_diagonal`]: named sets of (predicted, measured) points.
pub struct ScatterPanel {
    pub caption: String,
    pub x_title: &'static str,
    pub y_title: &'static str,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// `panels` side by side under `title`: each set of points, predicted along and measured up,
/// both axes logarithmic over one range so that the diagonal is "predicted = measured"; it is
/// drawn, and faintly the lines 20% off it. Written whole, as every chart.
pub fn against_diagonal(title: &str, panels: &[ScatterPanel], path: &Path) -> Result<()> {
    let mut svg = String::new();
    draw_against_diagonal(title, panels, &mut svg).map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    crate::output::write(path, svg)
}

fn draw_against_diagonal(title: &str, panels: &[ScatterPanel], svg: &mut String) -> Drawn {
    let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT + 80)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, p) in areas.iter().zip(panels) {
        let values: Vec<f64> = p.series.iter().flat_map(|(_, pts)| pts.iter().flat_map(|&(a, b)| [a, b])).collect();
        let axis = Axis::log(values.iter().copied());
        let (x, y) = (axis.clone().titled(p.x_title), axis.titled(p.y_title));
        let mut chart = panel(area, &p.caption, &x, &y)?;
        let (lo, hi) = (x.range.start.exp(), x.range.end.exp());
        for (factor, style) in [(1.0, BLACK.mix(0.6).stroke_width(1)), (1.2, BLACK.mix(0.2).stroke_width(1)), (1.0 / 1.2, BLACK.mix(0.2).stroke_width(1))] {
            chart.draw_series(std::iter::once(PathElement::new(vec![(x.at(lo), y.at(lo * factor)), (x.at(hi), y.at(hi * factor))], style)))?;
        }
        let drawn: Vec<(f64, f64)> = p.series.iter().flat_map(|(_, pts)| pts.iter().map(|&(a, b)| (x.at(a), y.at(b)))).collect();
        let legend_at = emptiest_corner(drawn.iter(), &x, &y);
        for ((name, pts), colour) in p.series.iter().zip(CURVES.iter().cycle()) {
            let style = colour.mix(0.75).filled();
            let at = finite(pts.iter().map(|&(a, b)| (x.at(a), y.at(b))));
            chart
                .draw_series(at.into_iter().map(|pt| Circle::new(pt, 4, style)))?
                .label(name.clone())
                .legend(move |(px, py)| Circle::new((px + 10, py), 4, style));
        }
        chart
            .configure_series_labels()
            .position(legend_at)
            .label_font(("sans-serif", 13))
            .border_style(BLACK.mix(0.3))
            .background_style(WHITE.mix(0.85))
            .draw()?;
    }
    root.present()
}

/// The devices of the course's CPU-vs-GPU chart, in its order, and their bars' colours: each
/// has its place, and says so where it did not run.
const DEVICES: [(&str, RGBColor); 2] = [("cpu", BLUE), ("cuda", METRIC)];

/// The course slide's chart: training throughput per device, one bar each, a device that did
/// not run (no GPU on the machine) marked "not run", to `path`.
pub fn device_comparison(records: &[RunRecord], path: &Path) -> Result<()> {
    let mut svg = String::new();
    draw_devices(records, &mut svg).map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    crate::output::write(path, svg)
}

fn draw_devices(records: &[RunRecord], svg: &mut String) -> Drawn {
    let first = records.first();
    let unit = if first.is_some_and(RunRecord::is_language_model) { "tokens/s" } else { "images/s" };
    let caption = first.map_or(String::new(), |r| format!("{} {}: training throughput", r.exercise, r.model));
    let bars = DEVICES.map(|(device, color)| {
        let throughput = records.iter().find(|r| r.device == device).map_or(f64::NAN, |r| r.throughput);
        Bar { name: device.to_string(), value: throughput, label: significant(throughput), color }
    });
    draw_bars(&[BarPanel { caption, unit, bars: bars.to_vec(), from_zero: true, bounds: 0.0..f64::INFINITY }], WIDTH / 2, svg)
}

/// One bar of a [`BarPanel`]: its name under it, its height (NaN: did not run, said so in its
/// place), the text over it, its colour.
#[derive(Debug, Clone)]
pub(crate) struct Bar {
    pub name: String,
    pub value: f64,
    pub label: String,
    pub color: RGBColor,
}

/// One panel of a bar chart, its bars in order.
#[derive(Debug, Clone)]
pub(crate) struct BarPanel {
    pub caption: String,
    pub unit: &'static str,
    pub bars: Vec<Bar>,
    /// Bars from zero, compared by their lengths (a throughput); otherwise points on an axis
    /// fitted to them within `bounds`, for values whose differences are small beside their size
    /// (accuracies of 0.91 and 0.95 would look alike as bars from zero).
    pub from_zero: bool,
    pub bounds: Range<f64>,
}

/// `panels` side by side, `width` pixels in all, to `path`.
pub(crate) fn bar_chart(panels: &[BarPanel], width: u32, path: &Path) -> Result<()> {
    let mut svg = String::new();
    draw_bars(panels, width, &mut svg).map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    crate::output::write(path, svg)
}

fn draw_bars(panels: &[BarPanel], width: u32, svg: &mut String) -> Drawn {
    let root = SVGBackend::with_string(svg, (width, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    for (area, bars) in root.split_evenly((1, panels.len().max(1))).iter().zip(panels) {
        draw_bar_panel(area, bars)?;
    }
    root.present()
}

fn draw_bar_panel(area: &Area, panel_bars: &BarPanel) -> Drawn {
    let names: Vec<&str> = panel_bars.bars.iter().map(|bar| bar.name.as_str()).collect();
    let x = Axis::names(&names);
    let values = panel_bars.bars.iter().map(|bar| bar.value);
    let y = match panel_bars.from_zero {
        true => Axis::linear(values.chain([0.0]), panel_bars.bounds.clone()),
        false => Axis::linear(values, panel_bars.bounds.clone()),
    }
    .titled(panel_bars.unit);
    let mut chart = panel(area, &panel_bars.caption, &x, &y)?;
    for (slot, bar) in panel_bars.bars.iter().enumerate() {
        let middle = slot as f64 + 0.5;
        if !bar.value.is_finite() {
            let height = (y.range.start + y.range.end) / 2.0;
            text_at(&mut chart, "not run".into(), (middle, height), (0, 0), Pos::new(HPos::Center, VPos::Center))?;
            continue;
        }
        match panel_bars.from_zero {
            true => {
                let rectangle = Rectangle::new([(slot as f64 + 0.15, 0.0), (slot as f64 + 0.85, bar.value)], bar.color.mix(0.7).filled());
                chart.draw_series(std::iter::once(rectangle))?;
            }
            false => {
                chart.draw_series(std::iter::once(Circle::new((middle, bar.value), 5, bar.color.filled())))?;
            }
        }
        text_at(&mut chart, bar.label.clone(), (middle, bar.value), (0, -7), Pos::new(HPos::Center, VPos::Bottom))?;
    }
    Ok(())
}

/// Where a run's training curves go: beside its results JSON.
pub fn curves_path(results_dir: &Path, record: &RunRecord) -> PathBuf {
    curves_path_of(results_dir, &record.name())
}

/// Where the training curves of the run named `run` go.
pub fn curves_path_of(results_dir: &Path, run: &str) -> PathBuf {
    results_dir.join(format!("{run}.svg"))
}

/// Where an exercise's CPU-vs-GPU chart goes.
pub fn devices_path(results_dir: &Path, record: &RunRecord) -> PathBuf {
    devices_path_of(results_dir, &record.exercise, &record.model)
}

/// Where the CPU-vs-GPU chart of `exercise`'s `model` goes.
pub fn devices_path_of(results_dir: &Path, exercise: &str, model: &str) -> PathBuf {
    results_dir.join(format!("{exercise}-{model}-devices.svg"))
}

/// Draws a run's curves from its results JSON (`step_losses` and `history`), beside it, with
/// the course slide's accuracy or perplexity for the same exercise, model and device as a
/// reference line ([`crate::course_figures`]) where the slide gives one.
pub fn curves_for_run(results_dir: &Path, record: &RunRecord, json: &serde_json::Value) -> Result<PathBuf> {
    let history: Vec<EpochPoint> = results_field(json, "history")?;
    // A diverged step's NaN is written as null.
    let step_losses: Vec<f64> = results_field::<Vec<Option<f64>>>(json, "step_losses")?.into_iter().map(|l| l.unwrap_or(f64::NAN)).collect();
    let path = curves_path(results_dir, record);
    let metric = if record.is_language_model() { Metric::Perplexity } else { Metric::Accuracy };
    let title = format!("{} · {} · {} ({} precision)", record.exercise, record.model, record.device, record.precision);
    training_curves(&title, &step_losses, &history, metric, course_mark(record), &path)?;
    Ok(path)
}

/// The slide's figure for `record`'s exercise, model and kind of device, if it gives one.
fn course_mark(record: &RunRecord) -> Option<CourseMark<'static>> {
    let device = match (record.device.as_str(), record.world_size) {
        ("cpu", _) => "cpu",
        (_, 1) => "gpu",
        _ => "2 GPUs",
    };
    let row = crate::course_figures::for_run(&record.exercise, &record.model).iter().find(|c| c.device == device)?;
    let value = if record.is_language_model() { row.test_ppl } else { row.test_acc }?;
    Some(CourseMark { value, note: "slide" })
}

fn results_field<T: serde::de::DeserializeOwned>(json: &serde_json::Value, name: &str) -> Result<T> {
    serde_json::from_value(json[name].clone()).with_context(|| format!("the results JSON's `{name}` is not what the charts read"))
}

/// An SVG file's text, shown as a picture by the evcxr Jupyter kernel when it is a cell's value
/// (evcxr calls `evcxr_display` by name and reads the MIME-tagged block it prints).
#[derive(Debug, Clone)]
pub struct Svg(pub String);

impl Svg {
    pub fn open(path: impl AsRef<Path>) -> Result<Svg> {
        let path = path.as_ref();
        let text = crate::input::read_to_string(path, 64 << 20, "give an SVG chart")?;
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

    /// How many points each line of an SVG chart joins.
    fn line_lengths(svg: &str) -> Vec<usize> {
        svg.split("<polyline").skip(1).map(|line| line.split("points=\"").nth(1).unwrap().split('"').next().unwrap().split_whitespace().count()).collect()
    }

    /// The texts of an SVG chart, as written.
    fn texts(svg: &str) -> Vec<&str> {
        svg.split("<text").skip(1).map(|t| t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()].trim()).collect()
    }

    fn epoch(epoch: usize, end_step: usize, eval_loss: f64, eval_acc: f64) -> EpochPoint {
        EpochPoint { epoch, end_step, eval_loss, eval_acc: Some(eval_acc) }
    }

    fn draw(step_losses: &[f64], history: &[EpochPoint], metric: Metric, course: Option<CourseMark>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.svg");
        training_curves("exercise1 · cnn", step_losses, history, metric, course, &path).unwrap();
        std::fs::read_to_string(&path).unwrap()
    }

    #[test]
    fn curves_are_an_svg_of_the_chart_size_with_both_panels() {
        let losses: Vec<f64> = (1..=40).map(|s| 2.0 / s as f64).collect();
        let history: Vec<EpochPoint> = (1..=4).map(|e| epoch(e, 10 * e, 2.2 / e as f64, 0.2 * e as f64)).collect();
        let svg = draw(&losses, &history, Metric::Accuracy, None);
        assert_eq!(svg_size(&svg), (WIDTH, HEIGHT));
        for text in ["exercise1 · cnn", "loss", "evaluation accuracy", "train, each step", "train, smoothed (0.60)", "evaluation", "step"] {
            assert!(texts(&svg).contains(&text), "no `{text}` in the chart");
        }
        // Each step's loss and its smoothed trend, the evaluations' loss and accuracy.
        let lines = line_lengths(&svg);
        assert_eq!(lines.iter().filter(|&&n| n == 40).count(), 2, "{lines:?}");
        assert_eq!(lines.iter().filter(|&&n| n == 4).count(), 2, "{lines:?}");
        assert!(!svg.contains("course:"), "no course figure given, none drawn");
    }

    #[test]
    fn a_run_of_a_few_steps_draws_every_step_and_its_one_evaluation() {
        let svg = draw(&[2.31, 2.40, 2.28, 2.25], &[epoch(1, 4, 2.27, 0.11)], Metric::Accuracy, None);
        assert!(line_lengths(&svg).contains(&4), "a line through the 4 steps: {:?}", line_lengths(&svg));
        assert!(texts(&svg).contains(&"0.110"), "the one evaluation's accuracy beside its point");
        for step in 0..=4 {
            assert!(texts(&svg).contains(&step.to_string().as_str()), "step {step} ticked");
        }
        assert!(!texts(&svg).contains(&"0.5") && !texts(&svg).contains(&"1.5"), "whole steps only");
    }

    #[test]
    fn a_resumed_run_draws_its_steps_after_the_restored_ones() {
        // 20 steps restored, 10 taken: the losses are steps 21 to 30.
        let svg = draw(&[1.0; 10], &[epoch(3, 30, 1.0, 0.5)], Metric::Accuracy, None);
        assert!(texts(&svg).contains(&"20") && texts(&svg).contains(&"30") && !texts(&svg).contains(&"0"), "the step axis starts at 20");
    }

    #[test]
    fn a_run_that_trained_nothing_says_so() {
        let svg = draw(&[], &[], Metric::Accuracy, None);
        assert!(svg.contains("no training steps in this run"));
        assert!(line_lengths(&svg).is_empty());
    }

    #[test]
    fn perplexity_is_on_a_log_axis_with_the_course_figure_dashed() {
        let history: Vec<EpochPoint> = [(110, 6.35), (220, 5.78), (330, 5.37)].into_iter().enumerate().map(|(e, (s, l))| epoch(e + 1, s, l, 0.0)).collect();
        let course = CourseMark { value: 150.0, note: "PyTorch, 3 epochs" };
        let svg = draw(&vec![7.0; 330], &history, Metric::Perplexity, Some(course));
        assert!(texts(&svg).contains(&"evaluation perplexity (log scale)"));
        assert!(texts(&svg).contains(&"course: 150 (PyTorch, 3 epochs)"), "the course's figure, labelled");
        assert!(texts(&svg).contains(&"215"), "the last perplexity, e^5.37, beside its point");
        // Perplexity from 150 to 573: ticks at 200 and 500, a log axis's round values.
        assert!(texts(&svg).contains(&"200") && texts(&svg).contains(&"500"), "log ticks");
        assert!(line_lengths(&svg).iter().filter(|&&n| n == 2).count() > 10, "a dashed line is many short ones");
    }

    #[test]
    fn ticks_are_round_and_written_as_precisely_as_they_need() {
        // One perplexity: an axis around it, ticked at round values written without decimals.
        let axis = Axis::log([5580.0826]);
        let labels: Vec<String> = axis.ticks.iter().map(|&t| axis.label(t)).collect();
        assert_eq!(labels, ["5400", "5500", "5600", "5700", "5800"]);
        let axis = Axis::linear([0.42], 0.0..1.0);
        let labels: Vec<String> = axis.ticks.iter().map(|&t| axis.label(t)).collect();
        assert_eq!(labels, ["0.40", "0.41", "0.42", "0.43", "0.44"]);
        // An accuracy of 0 is not shown below 0.
        assert!(Axis::linear([0.0], 0.0..1.0).range.start == 0.0);
        assert_eq!(log_ticks(30.0..3000.0), [50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]);
        assert_eq!(log_ticks(2.0..2e6), [10.0, 100.0, 1e3, 1e4, 1e5, 1e6]);
        assert_eq!(nice_ticks(0.0..1.25, 1.0), [0.0, 1.0], "whole steps");
        assert_eq!(decimals(&[0.25, 0.5]), 2);
        assert_eq!((significant(0.8734), significant(5580.0826), significant(55.13)), ("0.873".into(), "5580".into(), "55.1".into()));
    }

    #[test]
    fn smoothing_is_debiased_and_follows_the_steps() {
        let flat = smoothed(&[2.0; 5], 0.9);
        assert!(flat.iter().all(|v| (v - 2.0).abs() < 1e-12), "no pull towards zero: {flat:?}");
        let step = smoothed(&[1.0, 1.0, f64::NAN, 3.0], 0.6);
        assert!(step[2].is_nan() && step[3] > 1.0 && step[3] < 3.0, "{step:?}");
        assert_eq!((smoothing_weight(6), smoothing_weight(100), smoothing_weight(5000)), (0.6, 0.8, 0.9));
    }

    #[test]
    fn the_device_chart_has_a_bar_per_device_and_says_which_did_not_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("devices.svg");
        let record = crate::report::tests::record;
        device_comparison(&[record("cpu", 55.13), record("cuda", 41_000.0)], &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert_eq!(svg_size(&svg), (WIDTH / 2, HEIGHT));
        for text in ["exercise1 cnn: training throughput", "images/s", "cpu", "cuda", "55.1", "41,000", "40,000"] {
            assert!(texts(&svg).contains(&text), "no `{text}` in the chart");
        }
        assert!(!texts(&svg).contains(&"not run"));
        device_comparison(&[record("cpu", 55.13)], &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(texts(&svg).contains(&"cuda") && texts(&svg).contains(&"not run"), "the GPU's place says it did not run");
    }

    #[test]
    fn a_chart_is_shown_to_evcxr_as_one_svg_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.svg");
        training_curves("run", &[2.0, 1.8], &[epoch(1, 2, 1.5, 0.4)], Metric::Accuracy, None, &path).unwrap();
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
