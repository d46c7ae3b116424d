//! The operator table of a LibTorch profiler trace, as `torch.profiler`'s
//! `key_averages().table()` prints it: every operator (`aten::convolution`, an autograd node
//! such as `ConvolutionBackward0`, a `record_function` range) and every CUDA kernel, grouped by
//! name, with its calls, self and total CPU time and self and total device time.
//!
//! Read from the Chrome trace Kineto writes (the file is the one source of the figures):
//! `cpu_op` and `user_annotation` events are the operators, nested by time on their thread
//! (an operator's self time is its duration less its children's); `kernel`, `gpu_memcpy` and
//! `gpu_memset` events are the device's work, each charged to the operator that launched it
//! (the innermost one running, whose `External id` the event carries) and to that operator's
//! ancestors for their totals.
use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Deserialize;

/// One event of the trace, as far as the table needs it.
#[derive(Debug, Deserialize)]
struct TraceEvent {
    #[serde(default)]
    ph: String,
    #[serde(default)]
    cat: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    tid: serde_json::Value,
    #[serde(default)]
    ts: f64,
    #[serde(default)]
    dur: f64,
    #[serde(default)]
    args: serde_json::Map<String, serde_json::Value>,
}

impl TraceEvent {
    fn external_id(&self) -> Option<i64> {
        self.args.get("External id").and_then(serde_json::Value::as_i64)
    }
}

#[derive(Debug, Deserialize)]
struct Trace {
    #[serde(rename = "traceEvents")]
    trace_events: Vec<TraceEvent>,
}

/// One row: an operator or a kernel, all its calls together (microseconds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub name: String,
    /// A device kernel, copy or fill (no CPU time of its own).
    pub kernel: bool,
    pub calls: usize,
    pub self_cpu_us: f64,
    pub cpu_total_us: f64,
    pub self_device_us: f64,
    pub device_total_us: f64,
}

/// The operators and kernels of a trace.
#[derive(Debug, Clone, Default)]
pub struct OperatorTable {
    pub rows: Vec<Row>,
    /// The trace has device (CUDA) work.
    pub device: bool,
}

/// An operator while the tree is built.
struct Node {
    row: usize,
    end: f64,
    parent: Option<usize>,
}

/// `ProfilerStep#7` → `ProfilerStep*`, as torch's table shows the steps.
fn row_name(name: &str) -> String {
    match name.strip_prefix("ProfilerStep#") {
        Some(n) if n.chars().all(|c| c.is_ascii_digit()) => "ProfilerStep*".to_string(),
        _ => name.to_string(),
    }
}

impl OperatorTable {
    pub fn read(path: &Path) -> Result<OperatorTable> {
        let bytes = crate::input::read(path, u64::MAX, "give the Chrome trace LibTorch's profiler wrote").context("cannot read the profiler trace")?;
        let trace: Trace = serde_json::from_slice(&bytes).with_context(|| format!("{} is not a profiler trace (Chrome trace JSON)", path.display()))?;
        Ok(Self::from_events(trace.trace_events))
    }

    fn from_events(events: Vec<TraceEvent>) -> OperatorTable {
        let mut rows: Vec<Row> = Vec::new();
        let mut index: HashMap<(String, bool), usize> = HashMap::new();
        let mut row_of = |name: &str, kernel: bool, rows: &mut Vec<Row>| -> usize {
            let name = row_name(name);
            *index.entry((name.clone(), kernel)).or_insert_with(|| {
                rows.push(Row { name, kernel, ..Row::default() });
                rows.len() - 1
            })
        };
        // Operators, thread by thread, nested by time.
        let is_op = |e: &TraceEvent| e.ph == "X" && matches!(e.cat.as_deref(), Some("cpu_op" | "user_annotation"));
        let mut by_thread: HashMap<String, Vec<&TraceEvent>> = HashMap::new();
        for event in events.iter().filter(|e| is_op(e)) {
            by_thread.entry(event.tid.to_string()).or_default().push(event);
        }
        let mut nodes: Vec<Node> = Vec::new();
        let mut node_of_external: HashMap<i64, usize> = HashMap::new();
        for (_, mut ops) in by_thread {
            // Parents first: earlier start, then the longer of two that start together.
            ops.sort_by(|a, b| a.ts.total_cmp(&b.ts).then(b.dur.total_cmp(&a.dur)));
            let mut open: Vec<usize> = Vec::new();
            for op in ops {
                let (start, end) = (op.ts, op.ts + op.dur);
                // Trace times are rounded to nanoseconds: a child may seem to outlive its parent.
                while open.last().is_some_and(|&n| nodes[n].end <= start + 1e-3) {
                    open.pop();
                }
                let parent = open.last().copied();
                let row = row_of(&op.name, false, &mut rows);
                rows[row].calls += 1;
                rows[row].cpu_total_us += op.dur;
                rows[row].self_cpu_us += op.dur;
                if let Some(parent) = parent {
                    rows[nodes[parent].row].self_cpu_us -= op.dur;
                }
                nodes.push(Node { row, end, parent });
                let node = nodes.len() - 1;
                if let Some(id) = op.external_id() {
                    node_of_external.insert(id, node);
                }
                open.push(node);
            }
        }
        // The device's work, charged to the operator that launched it and its ancestors.
        let is_device = |e: &TraceEvent| e.ph == "X" && matches!(e.cat.as_deref(), Some("kernel" | "gpu_memcpy" | "gpu_memset"));
        let mut device = false;
        for event in events.iter().filter(|e| is_device(e)) {
            device = true;
            let row = row_of(&event.name, true, &mut rows);
            rows[row].calls += 1;
            rows[row].self_device_us += event.dur;
            rows[row].device_total_us += event.dur;
            let mut launcher = event.external_id().and_then(|id| node_of_external.get(&id).copied());
            if let Some(node) = launcher {
                rows[nodes[node].row].self_device_us += event.dur;
            }
            while let Some(node) = launcher {
                rows[nodes[node].row].device_total_us += event.dur;
                launcher = nodes[node].parent;
            }
        }
        for row in &mut rows {
            row.self_cpu_us = row.self_cpu_us.max(0.0);
        }
        OperatorTable { rows, device }
    }

    /// Rows by self device time on a GPU (self CPU time otherwise), longest first.
    pub fn sorted(&self) -> Vec<&Row> {
        let mut rows: Vec<&Row> = self.rows.iter().collect();
        let key = |r: &Row| if self.device { r.self_device_us } else { r.self_cpu_us };
        rows.sort_by(|a, b| key(b).total_cmp(&key(a)).then_with(|| a.name.cmp(&b.name)));
        rows
    }

    /// The row named `name` (an operator before a kernel of the same name).
    pub fn row(&self, name: &str) -> Option<&Row> {
        self.rows.iter().find(|r| r.name == name && !r.kernel).or_else(|| self.rows.iter().find(|r| r.name == name))
    }

    /// The `limit` first rows of [`OperatorTable::sorted`] as a Markdown table, with each
    /// one's share of the self time and a closing line with the totals.
    pub fn markdown(&self, limit: usize) -> String {
        let self_cpu: f64 = self.rows.iter().map(|r| r.self_cpu_us).sum();
        let self_device: f64 = self.rows.iter().filter(|r| r.kernel).map(|r| r.self_device_us).sum();
        let ms = |us: f64| format!("{:.3}", us / 1e3);
        let share = |part: f64, all: f64| if all > 0.0 { format!("{:.1}%", 100.0 * part / all) } else { "-".into() };
        let mut out = String::from("| name | calls | self CPU (ms) | self CPU | CPU total (ms) |");
        out += if self.device {
            " self CUDA (ms) | self CUDA | CUDA total (ms) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
        } else {
            "\n|---|---:|---:|---:|---:|\n"
        };
        for row in self.sorted().into_iter().take(limit) {
            let mut name: String = row.name.chars().take(70).collect();
            if name.len() < row.name.len() {
                name += "…";
            }
            let name = name.replace('|', "\\|");
            out += &format!("| {name} | {} | {} | {} | {} |", row.calls, ms(row.self_cpu_us), share(row.self_cpu_us, self_cpu), ms(row.cpu_total_us));
            if self.device {
                out += &format!(" {} | {} | {} |", ms(row.self_device_us), share(row.self_device_us, self_device), ms(row.device_total_us));
            }
            out += "\n";
        }
        out += &format!("\nself CPU time total: {} ms", ms(self_cpu));
        if self.device {
            out += &format!("; self CUDA time total: {} ms", ms(self_device));
        }
        out += &format!(" ({} of {} rows shown)\n", limit.min(self.rows.len()), self.rows.len());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(cat: &str, name: &str, tid: i64, ts: f64, dur: f64, external: i64) -> serde_json::Value {
        serde_json::json!({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": {"External id": external}})
    }

    /// A step with a linear layer (addmm under linear) and a backward node on another thread,
    /// each launching kernels; times in microseconds.
    fn trace() -> serde_json::Value {
        serde_json::json!({"traceEvents": [
            event("user_annotation", "ProfilerStep#3", 1, 0.0, 100.0, 1),
            event("cpu_op", "aten::linear", 1, 10.0, 40.0, 2),
            event("cpu_op", "aten::addmm", 1, 15.0, 30.0, 3),
            event("cuda_runtime", "cudaLaunchKernel", 1, 20.0, 5.0, 3),
            event("kernel", "sm90_gemm", 7, 30.0, 25.0, 3),
            event("cpu_op", "AddmmBackward0", 2, 60.0, 30.0, 4),
            event("cpu_op", "aten::mm", 2, 62.0, 20.0, 5),
            event("kernel", "sm90_gemm", 7, 70.0, 35.0, 5),
            event("gpu_memcpy", "Memcpy HtoD", 7, 5.0, 2.0, 1),
            event("user_annotation", "ProfilerStep#4", 1, 100.0, 10.0, 6),
            {"ph": "i", "cat": "cpu_instant_event", "name": "marker", "ts": 1.0},
        ]})
    }

    #[test]
    fn self_times_subtract_children_and_kernels_charge_their_launchers() {
        let events: Trace = serde_json::from_value(trace()).unwrap();
        let table = OperatorTable::from_events(events.trace_events);
        assert!(table.device);
        let row = |name: &str| table.row(name).unwrap_or_else(|| panic!("no row {name}")).clone();
        let step = row("ProfilerStep*");
        assert_eq!(step.calls, 2, "both steps in one row");
        assert_eq!((step.cpu_total_us, step.self_cpu_us), (110.0, 70.0), "100 + 10, less the linear layer's 40");
        assert_eq!((row("aten::linear").self_cpu_us, row("aten::linear").cpu_total_us), (10.0, 40.0));
        assert_eq!(row("aten::addmm").self_cpu_us, 30.0);
        assert_eq!(row("AddmmBackward0").self_cpu_us, 10.0, "its own thread's child aten::mm");
        // Device time: addmm launched one gemm, mm the other; totals climb to the ancestors.
        assert_eq!((row("aten::addmm").self_device_us, row("aten::linear").self_device_us, row("aten::linear").device_total_us), (25.0, 0.0, 25.0));
        assert_eq!((row("aten::mm").self_device_us, row("AddmmBackward0").device_total_us), (35.0, 35.0));
        assert_eq!(row("ProfilerStep*").device_total_us, 27.0, "the forward's gemm and the copy");
        let gemm = row("sm90_gemm");
        assert!(gemm.kernel && gemm.calls == 2 && gemm.self_device_us == 60.0);
        // Sorted by self device time; the Markdown names the rows and the totals.
        assert_eq!(table.sorted()[0].name, "sm90_gemm");
        let text = table.markdown(3);
        assert!(text.contains("| sm90_gemm | 2 | 0.000 | 0.0% | 0.000 | 0.060 | 96.8% | 0.060 |"), "{text}");
        assert!(text.contains("self CUDA time total: 0.062 ms (3 of 7 rows shown)"), "{text}");
    }

    #[test]
    fn a_cpu_trace_sorts_by_self_cpu_time() {
        let events: Trace = serde_json::from_value(serde_json::json!({"traceEvents": [
            event("cpu_op", "aten::convolution", 1, 0.0, 50.0, 1),
            event("cpu_op", "aten::mkldnn_convolution", 1, 5.0, 40.0, 2),
            event("cpu_op", "aten::relu", 1, 60.0, 5.0, 3),
        ]}))
        .unwrap();
        let table = OperatorTable::from_events(events.trace_events);
        assert!(!table.device);
        let names: Vec<&str> = table.sorted().iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["aten::mkldnn_convolution", "aten::convolution", "aten::relu"]);
        let text = table.markdown(10);
        assert!(!text.contains("CUDA"), "{text}");
        assert!(text.contains("| aten::convolution | 1 | 0.010 | 18.2% | 0.050 |"), "{text}");
    }

    #[test]
    fn a_file_that_is_not_a_trace_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        std::fs::write(&path, b"{\"nope\": 1}").unwrap();
        let err = OperatorTable::read(&path).unwrap_err();
        assert!(format!("{err:#}").contains("is not a profiler trace"), "{err:#}");
    }
}
