//! The course's "why GPUs" demonstration, measured: scalar multiplications one at a time (each
//! a separate operation, as a Python loop over numbers runs them) against one matrix
//! multiplication of growing size, on the CPU and on the GPU. A GPU loses on the first (every
//! operation pays a kernel launch, and there is nothing to do in parallel) and wins on the
//! second once the matrices are large enough to fill it.
//!
//! The binary `why_gpus` prints the table and draws the slide's two plots (`plots::log_log_chart`);
//! the notebook of exercise 1 calls the same functions.
use anyhow::Result;
use serde::Serialize;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// What is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Work {
    /// `count` scalar multiplications, one operation each.
    Scalar,
    /// One `size`×`size` matrix multiplication.
    Matrix,
}

impl Work {
    /// As the CSV writes it: `scalar` or `matrix`.
    pub fn name(self) -> &'static str {
        match self {
            Work::Scalar => "scalar",
            Work::Matrix => "matrix",
        }
    }
}

/// One measurement: the work, its size (scalars multiplied, or the matrices' side), the device
/// and the seconds it took (the best of the repetitions).
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    pub work: Work,
    pub size: usize,
    pub device: String,
    pub seconds: f64,
}

/// Sizes: scalar counts 10, 100, … up to `max_scalars`; matrix sides 64, 128, … up to `max_side`.
pub fn sizes(max_scalars: usize, max_side: usize) -> (Vec<usize>, Vec<usize>) {
    let scalars = std::iter::successors(Some(10usize), |n| n.checked_mul(10)).take_while(|&n| n <= max_scalars).collect();
    let sides = std::iter::successors(Some(64usize), |n| n.checked_mul(2)).take_while(|&n| n <= max_side).collect();
    (scalars, sides)
}

/// Times both kinds of work at every size on `device`, each the best of `repeats` runs after a
/// warm-up run (a GPU's first use of a kernel loads it).
pub fn measure(device: Device, scalar_counts: &[usize], matrix_sides: &[usize], repeats: usize) -> Result<Vec<Timing>> {
    let name = crate::device::device_name(device).to_string();
    let mut timings = Vec::new();
    let best = |work: &dyn Fn() -> Result<()>| -> Result<f64> {
        work()?;
        let mut best = f64::INFINITY;
        for _ in 0..repeats.max(1) {
            crate::device::synchronize(device);
            let start = Instant::now();
            work()?;
            crate::device::synchronize(device);
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let (a, b) = (Tensor::from(1.0001f32).to_device(device), Tensor::from(0.9999f32).to_device(device));
    for &count in scalar_counts {
        let seconds = best(&|| {
            let mut x = a.shallow_clone();
            for _ in 0..count {
                x = x.f_mul(&b)?;
            }
            Ok(())
        })?;
        timings.push(Timing { work: Work::Scalar, size: count, device: name.clone(), seconds });
    }
    for &side in matrix_sides {
        let m = Tensor::f_randn([side as i64, side as i64], (Kind::Float, device))?;
        let seconds = best(&|| m.f_matmul(&m).map(|_| ()).map_err(Into::into))?;
        timings.push(Timing { work: Work::Matrix, size: side, device: name.clone(), seconds });
    }
    Ok(timings)
}

/// The table of `timings` (Markdown): one row per work and size, a column per device.
pub fn table(timings: &[Timing]) -> String {
    let mut devices: Vec<&str> = timings.iter().map(|t| t.device.as_str()).collect();
    devices.dedup();
    let mut rows: Vec<(Work, usize)> = timings.iter().map(|t| (t.work, t.size)).collect();
    rows.dedup();
    let mut out = format!(
        "| work | size | {} |\n|---|---:|{}\n",
        devices.iter().map(|d| format!("{d} (s)")).collect::<Vec<_>>().join(" | "),
        "---:|".repeat(devices.len())
    );
    for (work, size) in rows {
        let what = match work {
            Work::Scalar => format!("{size} scalar multiplications"),
            Work::Matrix => format!("{size}×{size} matrix product"),
        };
        let cells: Vec<String> = devices
            .iter()
            .map(|d| timings.iter().find(|t| t.work == work && t.size == size && t.device == *d).map_or("-".into(), |t| format!("{:.6}", t.seconds)))
            .collect();
        out.push_str(&format!("| {what} | {size} | {} |\n", cells.join(" | ")));
    }
    out
}

/// The slide's two plots, side by side, to `path`: time against the number of scalar
/// multiplications, and against the matrices' side, one curve per device.
pub fn chart(timings: &[Timing], path: &std::path::Path) -> Result<()> {
    let mut devices: Vec<&str> = timings.iter().map(|t| t.device.as_str()).collect();
    devices.dedup();
    let curves = |work: Work| -> Vec<(String, Vec<(f64, f64)>)> {
        devices
            .iter()
            .map(|d| (d.to_string(), timings.iter().filter(|t| t.work == work && t.device == *d).map(|t| (t.size as f64, t.seconds)).collect()))
            .collect()
    };
    let panels = [
        crate::plots::LinePanel {
            caption: "scalar multiplications, one at a time".into(),
            x_title: "multiplications",
            y_title: "seconds",
            series: curves(Work::Scalar),
        },
        crate::plots::LinePanel { caption: "one matrix multiplication".into(), x_title: "matrix side", y_title: "seconds", series: curves(Work::Matrix) },
    ];
    crate::plots::log_log_chart("why GPUs: CPU and GPU on scalar and on matrix work", &panels, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_grow_tenfold_and_twofold_up_to_their_bounds() {
        assert_eq!(sizes(1000, 256), (vec![10, 100, 1000], vec![64, 128, 256]));
        assert_eq!(sizes(5, 32), (vec![], vec![]));
    }

    #[test]
    fn every_size_is_timed_and_tabled() {
        let timings = measure(Device::Cpu, &[10, 100], &[64], 1).unwrap();
        assert_eq!(timings.len(), 3);
        assert!(timings.iter().all(|t| t.seconds > 0.0 && t.device == "cpu"));
        let table = table(&timings);
        assert!(table.contains("| 100 scalar multiplications | 100 |") && table.contains("| 64×64 matrix product | 64 |"), "{table}");
    }
}
