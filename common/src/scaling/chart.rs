//! The scaling study's chart, as SVG: four panels against the ranks (a log₂ axis: 1, 2, 4, …):
//! time per epoch, speed-up and efficiency, each with the ideal line, and the share of the step
//! time spent in the all-reduce, one curve per series (strong or weak, per precision). The
//! speed-up and efficiency panels also draw JSC's published ResNet50 scaling from 1 GPU to 32
//! nodes (grey), the course's figure ours stand beside.
use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{Mode, Row};
use crate::plots::WIDTH;

/// Twice a training-curves chart's height: two rows of panels.
pub const HEIGHT: u32 = 2 * crate::plots::HEIGHT;

/// One line of a panel.
struct Curve {
    label: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    /// Perfect scaling from the series' baseline: dashed, in the series' colour.
    ideal: Vec<(f64, f64)>,
    /// A course's published figures, not a run of ours: named in its own panel's legend.
    published: bool,
}

/// The grey of the course's published curve.
const PUBLISHED: RGBColor = RGBColor(120, 120, 120);

/// JSC's ResNet50 scaling as a curve of `value(gpus, speed-up)`.
fn published(value: impl Fn(f64, f64) -> f64) -> Curve {
    let points = crate::course_figures::jsc_resnet50_speedups().into_iter().map(|(gpus, s)| (gpus as f64, value(gpus as f64, s))).collect();
    Curve { label: crate::course_figures::JSC_RESNET50_LABEL.into(), color: PUBLISHED, points, ideal: Vec::new(), published: true }
}

/// The rows of one series (they come grouped from [`super::rows`]), with its legend label.
fn series(rows: &[Row]) -> Vec<(String, &[Row])> {
    let precisions: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.precision.as_str()).collect();
    let mut out: Vec<(String, &[Row])> = Vec::new();
    let mut start = 0;
    for i in 1..=rows.len() {
        let same = |a: &Row, b: &Row| (a.mode, &a.exercise, &a.model, &a.device, &a.precision) == (b.mode, &b.exercise, &b.model, &b.device, &b.precision);
        if i == rows.len() || !same(&rows[i], &rows[start]) {
            let first = &rows[start];
            let mut label = match first.mode {
                Mode::Strong => format!("strong: global batch {}", first.global_batch),
                Mode::Weak => format!("weak: {} per rank", first.per_rank_batch),
            };
            // Named when it tells the curves apart (IDRIS's FP32 vs AMP) or is not the default.
            if precisions.len() > 1 || first.precision != "32" {
                label += if first.precision == "32" { ", fp32" } else { ", " };
                if first.precision != "32" {
                    label += &first.precision;
                }
            }
            out.push((label, &rows[start..i]));
            start = i;
        }
    }
    out
}

/// A colour per series: strong scaling in blues, weak in reds, one shade per precision.
fn color(mode: Mode, nth_of_mode: usize) -> RGBColor {
    const STRONG: [RGBColor; 3] = [RGBColor(31, 119, 180), RGBColor(23, 190, 207), RGBColor(44, 160, 44)];
    const WEAK: [RGBColor; 3] = [RGBColor(214, 39, 40), RGBColor(255, 127, 14), RGBColor(148, 103, 189)];
    let palette = if mode == Mode::Strong { STRONG } else { WEAK };
    palette[nth_of_mode % palette.len()]
}

/// The curves of one panel: `value` of each row, and `ideal` of each row given its series'
/// baseline (first) row.
fn curves(rows: &[Row], value: impl Fn(&Row) -> f64, ideal: impl Fn(&Row, &Row) -> f64) -> Vec<Curve> {
    let mut per_mode = [0usize; 2];
    series(rows)
        .into_iter()
        .map(|(label, rows)| {
            let mode = rows[0].mode;
            let nth = &mut per_mode[mode as usize];
            let color = color(mode, *nth);
            *nth += 1;
            Curve {
                label,
                color,
                points: rows.iter().map(|r| (r.ranks as f64, value(r))).collect(),
                ideal: rows.iter().map(|r| (r.ranks as f64, ideal(r, &rows[0]))).collect(),
                published: false,
            }
        })
        .collect()
}

/// The smallest and largest values (1 when there are none: an axis still gets drawn).
fn extent(values: impl Iterator<Item = f64>) -> (f64, f64) {
    crate::plots::extent(values.filter(|v| v.is_finite())).unwrap_or((1.0, 1.0))
}

/// The x axis's tick marks: each number of ranks with its number of nodes.
type Ticks = Vec<(f64, usize)>;

/// Which curves a panel's legend names.
enum Legend {
    /// Every series and the ideal (the first panel's, for all of them).
    Every,
    /// Only a published curve, where it leaves the panel's curves clear.
    Published(SeriesLabelPosition),
    None,
}

/// Draws `curves` on `area` against the ranks (`ranks`: the tick marks; 0 nodes where the
/// tick is a published curve's, not a run's), `y` the vertical axis, named as `legend` says.
fn panel<Y>(area: &DrawingArea<SVGBackend, Shift>, caption: &str, y: Y, y_desc: &str, ranks: &Ticks, curves: &[Curve], legend: Legend) -> Result<(), String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let fail = |e: &dyn std::fmt::Debug| format!("{caption}: {e:?}");
    let ranks_at: Vec<f64> = ranks.iter().map(|(r, _)| *r).collect();
    let top = ranks_at.iter().copied().fold(1.0, f64::max);
    let bottom = ranks_at.iter().copied().fold(top, f64::min);
    let x = ((bottom / 1.3)..(top * 1.3)).log_scale().with_key_points(ranks_at);
    // On several nodes each tick says how many: "8 (2 nodes)".
    let multi_node = ranks.iter().any(|(_, nodes)| *nodes > 1);
    let label = |r: &f64| match ranks.iter().find(|(at, _)| (at - r).abs() < 1e-9) {
        Some((_, nodes)) if multi_node && *nodes > 0 => format!("{r:.0} ({nodes} node{})", if *nodes == 1 { "" } else { "s" }),
        _ => format!("{r:.0}"),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(x, y)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc(if multi_node { "ranks (nodes)" } else { "ranks" })
        .y_desc(y_desc)
        .x_label_formatter(&label)
        // A log axis's light lines, one per unit, would grey the panel out.
        .max_light_lines(0)
        .draw()
        .map_err(|e| fail(&e))?;
    for curve in curves {
        let color = curve.color;
        let series = chart.draw_series(LineSeries::new(curve.points.iter().copied(), color.stroke_width(2))).map_err(|e| fail(&e))?;
        if matches!(legend, Legend::Every) || (curve.published && matches!(legend, Legend::Published(_))) {
            series.label(curve.label.clone()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        chart.draw_series(curve.points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| fail(&e))?;
        if !curve.ideal.is_empty() {
            chart.draw_series(DashedLineSeries::new(curve.ideal.iter().copied(), 6, 4, color.stroke_width(1))).map_err(|e| fail(&e))?;
        }
    }
    if let Legend::Every = legend {
        // The dashed lines' entry once, in black: each is its series' own ideal.
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
            .map_err(|e| fail(&e))?
            .label("ideal (dashed)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 6, y), (x + 10, y), (x + 16, y)], BLACK));
    }
    let position = match legend {
        Legend::Every => Some(SeriesLabelPosition::UpperRight),
        Legend::Published(at) => Some(at),
        Legend::None => None,
    };
    if let Some(position) = position {
        chart.configure_series_labels().position(position).border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(|e| fail(&e))?;
    }
    Ok(())
}

/// The study's chart of `rows` (as [`super::rows`] orders them) to `path`, drawn in memory and
/// written whole (the atomic writer).
pub fn draw(rows: &[Row], path: &Path) -> Result<()> {
    if rows.is_empty() {
        anyhow::bail!("no runs to chart in {}", path.display());
    }
    let mut svg = String::new();
    draw_into(rows, path, &mut svg)?;
    crate::output::write(path, svg)
}

fn draw_into(rows: &[Row], path: &Path, svg: &mut String) -> Result<()> {
    let fail = |e: String| anyhow!("cannot draw {}: {e}", path.display());
    let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(format!("{e:?}")))?;
    let first = &rows[0];
    let title = format!("{} · {} · {}: scaling over ranks", first.exercise, first.model, first.device);
    let root = root.titled(&title, ("sans-serif", 18)).map_err(|e| fail(format!("{e:?}")))?;
    let panels = root.split_evenly((2, 2));
    let mut ranks: Ticks = rows.iter().map(|r| (r.ranks as f64, r.nodes)).collect();
    ranks.sort_by(|a, b| a.0.total_cmp(&b.0));
    ranks.dedup_by(|a, b| a.0 == b.0);

    // Time: per epoch where every run knows its epoch's size, else per step; perfect scaling
    // divides the baseline's time by the ranks' growth (an epoch is fixed work in both modes).
    let per_epoch = rows.iter().all(|r| r.epoch_time_s.is_some());
    let time = move |r: &Row| if per_epoch { r.epoch_time_s.unwrap_or(f64::NAN) } else { r.step_time_s };
    let times = curves(rows, time, move |r, base| time(base) / r.ideal_speedup);
    let (lo, hi) = extent(times.iter().flat_map(|c| c.points.iter().chain(&c.ideal)).map(|p| p.1));
    let caption = if per_epoch { "time per epoch" } else { "time per step" };
    let (lo, hi) = (lo / 1.3, hi * 1.3);
    panel(&panels[0], caption, (lo..hi).log_scale().with_key_points(crate::plots::log_ticks(lo..hi)), "seconds", &ranks, &times, Legend::Every)
        .map_err(fail)?;

    // Speed-up and efficiency beside JSC's published ones, on an axis that reaches its GPUs.
    let mut with_published = ranks.clone();
    with_published.extend(crate::course_figures::JSC_RESNET50_SCALING.iter().map(|&(gpus, _)| (gpus as f64, 0)));
    with_published.sort_by(|a, b| a.0.total_cmp(&b.0));
    with_published.dedup_by(|a, b| a.0 == b.0);
    let mut speedups = curves(rows, |r| r.speedup, |r, _| r.ideal_speedup);
    speedups.push(published(|_, speedup| speedup));
    let (lo, hi) = extent(speedups.iter().flat_map(|c| c.points.iter().chain(&c.ideal)).map(|p| p.1));
    // Marked where the ideal lands: 1, 2, 4, … times.
    let (lo, hi) = (lo / 1.3, hi * 1.3);
    let ticks = (-6..16).map(|k| 2f64.powi(k)).filter(|t| (lo..=hi).contains(t)).collect();
    let caption = "speed-up (throughput over the fewest ranks')";
    panel(&panels[1], caption, (lo..hi).log_scale().with_key_points(ticks), "×", &with_published, &speedups, Legend::Published(SeriesLabelPosition::UpperLeft))
        .map_err(fail)?;

    let mut efficiency = curves(rows, |r| 100.0 * r.efficiency, |_, _| 100.0);
    efficiency.push(published(|gpus, speedup| 100.0 * speedup / gpus));
    let (_, hi) = extent(efficiency.iter().flat_map(|c| &c.points).map(|p| p.1));
    panel(
        &panels[2],
        "efficiency (speed-up / ideal)",
        0.0..(hi.max(100.0) * 1.1),
        "%",
        &with_published,
        &efficiency,
        Legend::Published(SeriesLabelPosition::LowerLeft),
    )
    .map_err(fail)?;

    // No ideal here: perfect scaling would spend nothing in the all-reduce.
    let mut shares = curves(rows, |r| 100.0 * r.allreduce_share, |_, _| 0.0);
    shares.iter_mut().for_each(|c| c.ideal.clear());
    let (_, hi) = extent(shares.iter().flat_map(|c| &c.points).map(|p| p.1));
    panel(&panels[3], "all-reduce share of the training time (rank 0)", 0.0..(hi.max(1.0) * 1.2), "%", &ranks, &shares, Legend::None).map_err(fail)?;
    root.present().map_err(|e| fail(format!("{e:?}")))?;
    Ok(())
}
