//! The notebooks, as far as `make test` can check them without the evcxr kernel (`make
//! notebooks` builds the kernel and executes them all; see notebooks/README.md):
//! the committed notebooks are clean, valid nbformat 4 for our kernel, load `common` from the
//! workspace and show a chart; and the checker that `make notebooks` runs after nbconvert
//! fails exactly on what evcxr does not report as a cell error.
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use support::stderr;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn notebooks() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> =
        std::fs::read_dir(root().join("notebooks")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "ipynb")).collect();
    paths.sort();
    paths
}

fn source(cell: &serde_json::Value) -> String {
    cell["source"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect()
}

#[test]
fn there_is_a_clean_notebook_per_exercise_for_our_kernel() {
    let names: Vec<String> = notebooks().iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["exercise1.ipynb", "exercise1_nlp.ipynb", "exercise2.ipynb", "exercise3_ddp.ipynb", "exercise3_pipeline.ipynb", "exercise3_tp.ipynb"]);
    for path in notebooks() {
        let name = path.display();
        let nb: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(nb["nbformat"], 4, "{name}");
        assert_eq!(nb["metadata"]["kernelspec"]["name"], "rust-hpc-course", "{name}: the kernel scripts/notebooks installs");
        let cells = nb["cells"].as_array().unwrap();
        let code: Vec<&serde_json::Value> = cells.iter().filter(|c| c["cell_type"] == "code").collect();
        // Committed without outputs: executed copies go to target/notebooks/.
        for cell in &code {
            assert!(cell["outputs"].as_array().unwrap().is_empty() && cell["execution_count"].is_null(), "{name}: a cell has outputs");
        }
        let mut ids: Vec<&str> = cells.iter().map(|c| c["id"].as_str().expect("every cell has an id (nbformat 4.5)")).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), cells.len(), "{name}: cell ids are unique");
        let setup = source(code[0]);
        assert!(setup.contains(r#":dep common = { path = "../common""#), "{name}: the first cell loads the workspace's crate:\n{setup}");
        assert!(setup.contains(r#":dep tch = "=0.24.0""#), "{name}: tch pinned as in Cargo.toml");
        assert!(code.iter().any(|c| source(c).contains("plots::Svg::open")), "{name}: shows a chart");
    }
}

/// An executed notebook as nbconvert writes it: one code cell per `outputs` entry.
fn executed(dir: &Path, name: &str, cells: &[serde_json::Value]) -> PathBuf {
    let cells: Vec<serde_json::Value> = cells
        .iter()
        .enumerate()
        .map(|(i, outputs)| {
            serde_json::json!({"cell_type": "code", "id": format!("c{i}"), "metadata": {}, "source": ["x;"],
                               "execution_count": if outputs.is_null() { serde_json::Value::Null } else { (i + 1).into() },
                               "outputs": if outputs.is_null() { serde_json::json!([]) } else { outputs.clone() }})
        })
        .collect();
    let path = dir.join(name);
    let nb = serde_json::json!({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5});
    std::fs::write(&path, nb.to_string()).unwrap();
    path
}

fn check(path: &Path) -> (bool, String) {
    let python = std::env::var_os("TORCH_PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new(python).arg(root().join("scripts/check_notebook.py")).arg(path).output().expect("python runs");
    (out.status.success(), stderr(&out))
}

#[test]
fn the_checker_fails_on_what_evcxr_does_not_report_as_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let text = |name: &str, text: &str| serde_json::json!({"output_type": "stream", "name": name, "text": [text]});
    let chart = serde_json::json!({"output_type": "display_data", "metadata": {}, "data": {"image/svg+xml": "<svg/>"}});
    let warning = text("stderr", "WARNING: cifar10 in ../data/cifar10 is a GENERATED stand-in\n");
    let good =
        executed(dir.path(), "good.ipynb", &[serde_json::json!([text("stdout", "loss 2.3 → 0.5\n"), warning.clone()]), serde_json::json!([chart.clone()])]);
    let (ok, why) = check(&good);
    assert!(ok, "a notebook that ran, warned and drew a chart passes: {why}");

    let cases = [
        // evcxr prints a panic on stderr and goes on with the next cell.
        ("panic", serde_json::json!([text("stderr", "thread '<unnamed>' panicked at src/lib.rs:6:1:\nboom\n")]), "boom"),
        // An error returned by `?` is printed on stderr, likewise.
        ("question-mark", serde_json::json!([warning.clone(), text("stderr", "cannot read ../data/cifar10/data_batch_1.bin\n")]), "data_batch_1.bin"),
        // A compile error is a real error output (nbconvert --allow-errors keeps it).
        (
            "compile",
            serde_json::json!([{"output_type": "error", "ename": "Error", "evalue": "mismatched types",
                                        "traceback": ["\u{1b}[31mmismatched types\u{1b}[0m"]}]),
            "mismatched types",
        ),
        // A cell that never ran (nbconvert stopped before it).
        ("not-run", serde_json::Value::Null, "did not run"),
    ];
    for (name, outputs, expected) in cases {
        let path = executed(dir.path(), &format!("{name}.ipynb"), &[outputs, serde_json::json!([chart.clone()])]);
        let (ok, why) = check(&path);
        assert!(!ok, "{name}: the checker passed a failed notebook");
        assert!(why.contains(expected), "{name}: the message should say `{expected}`:\n{why}");
        assert!(!why.contains('\u{1b}'), "{name}: colour codes are stripped:\n{why}");
    }
    let no_chart = executed(dir.path(), "no-chart.ipynb", &[serde_json::json!([text("stdout", "done\n")])]);
    let (ok, why) = check(&no_chart);
    assert!(!ok && why.contains("no chart"), "a notebook without its chart fails: {why}");
}
