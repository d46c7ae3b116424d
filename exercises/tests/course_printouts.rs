//! The course's printouts in their own shape, with our run's figures: Lightning's test-metric
//! table after the image exercises, the Transformer tutorial's end-of-epoch and end-of-training
//! blocks after the language model's, the pipeline exercise's shorter lines after the pipeline's.
mod support;

use std::process::{Command, Output};
use support::{read_json, stderr, wikitext_sample};

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin).args(args).env_remove("RUST_BACKTRACE").output().unwrap()
}

#[test]
fn the_image_exercise_prints_lightnings_test_table_with_its_figures() {
    let dir = tempfile::tempdir().unwrap();
    let (data, results) = (dir.path().join("data"), dir.path().join("results"));
    let out = run(env!("CARGO_BIN_EXE_prepare_data"), &["generate", "--dataset", "cifar10", "--train", "60", "--test", "20", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(
        env!("CARGO_BIN_EXE_exercise1"),
        &[
            "--device",
            "cpu",
            "--data-dir",
            data.to_str().unwrap(),
            "--batch-size",
            "20",
            "--epochs",
            "1",
            "--quiet",
            "--results-dir",
            results.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = read_json(&results.join("exercise1-cnn-cpu.json"));
    // The run's own test figures, as Lightning prints a float32 metric.
    let shown = |key: &str| ((json[key].as_f64().unwrap() as f32) as f64).to_string();
    let lines: Vec<&str> = stdout.lines().collect();
    let header = lines.iter().position(|l| l.trim_start().starts_with("Test metric")).unwrap_or_else(|| panic!("no Lightning table in:\n{stdout}"));
    assert!(lines[header].ends_with("DataLoader 0"), "{}", lines[header]);
    let rows: Vec<Vec<&str>> = lines[header + 2..header + 4].iter().map(|l| l.split_whitespace().collect()).collect();
    // Lightning's names: logged with on_epoch, they carry `_epoch` (the slides' table).
    assert_eq!(rows, [vec!["test_acc_epoch", shown("test_acc").as_str()], vec!["test_loss_epoch", shown("test_loss").as_str()]], "{stdout}");
    for rule in [header - 1, header + 1, header + 4] {
        assert_eq!(lines[rule], "─".repeat(120), "line {rule}");
    }
    // exercise1.py's line before the table: trainer.fit's seconds (training and validation) as
    // Python prints a float.
    let time = lines[header - 2].strip_prefix("Time for training on cpu: ").unwrap_or_else(|| panic!("no time line above the table:\n{stdout}"));
    let seconds: f64 = time.parse().unwrap();
    assert!(time.contains('.') && seconds >= json["train_time_s"].as_f64().unwrap(), "{time} against {}", json["train_time_s"]);
}

/// exercise1_CNN.py's printout for the pretrained models: the model named in the time line
/// (`resnet`), the metrics logged as `Test Acc` and `Test loss`.
#[test]
fn resnet34_prints_the_cnn_scripts_names() {
    let dir = tempfile::tempdir().unwrap();
    let (data, results) = (dir.path().join("data"), dir.path().join("results"));
    let out = run(env!("CARGO_BIN_EXE_prepare_data"), &["generate", "--dataset", "cifar10", "--train", "8", "--test", "8", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let args = ["--model", "resnet34", "--device", "cpu", "--data-dir", data.to_str().unwrap(), "--batch-size", "8", "--epochs", "1"];
    let out = run(env!("CARGO_BIN_EXE_exercise1"), &[&args[..], &["--quiet", "--results-dir", results.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let header = lines.iter().position(|l| l.trim_start().starts_with("Test metric")).unwrap_or_else(|| panic!("no Lightning table in:\n{stdout}"));
    assert!(lines[header - 2].starts_with("Time for training resnet on cpu: "), "{stdout}");
    let names: Vec<String> = lines[header + 2..header + 4].iter().map(|l| l.trim().rsplit_once(' ').unwrap().0.trim().to_string()).collect();
    assert_eq!(names, ["Test Acc", "Test loss"], "{stdout}");
    // The slide's ResNet34 started from ImageNet's weights; this run from scratch says so.
    assert!(
        stdout.contains("note: the course's resnet34 rows start from ImageNet-pretrained weights (IMAGENET1K_V1); this run trained from scratch"),
        "{stdout}"
    );
    assert_eq!(read_json(&results.join("exercise1-resnet34-cpu.json"))["weights"], "scratch");
}

/// A two-epoch run of a tiny language model on a WikiText-2 sample: `args` (the binary's
/// subcommand and its own flags) then the model's; its stdout and results JSON `results_name`.
fn tiny_language_model(bin: &str, args: &[&str], results_name: &str) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let (data, results) = (dir.path().join("data"), dir.path().join("results"));
    std::fs::create_dir(&data).unwrap();
    wikitext_sample(&data, [60, 20, 20]);
    let model = ["--emsize", "16", "--d-hid", "32", "--nhead", "2", "--tokenizer", "whitespace", "--epochs", "2", "--quiet"];
    let places = ["--data-dir", data.to_str().unwrap(), "--results-dir", results.to_str().unwrap()];
    let out = run(bin, &[args, &model, &places].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    (String::from_utf8_lossy(&out.stdout).into_owned(), read_json(&results.join(results_name)))
}

#[test]
fn the_language_model_prints_the_tutorials_epoch_and_final_blocks() {
    let (stdout, json) = tiny_language_model(env!("CARGO_BIN_EXE_exercise1_nlp"), &["--device", "cpu", "--nlayers", "1"], "exercise1_nlp-transformer-cpu.json");
    for (epoch, stats) in json["history"].as_array().unwrap().iter().enumerate() {
        let loss = stats["eval_loss"].as_f64().unwrap();
        let tail = format!(" | valid loss {loss:5.2} | valid ppl {:8.2}", loss.exp());
        let head = format!("| end of epoch {:3} | time: ", epoch + 1);
        let line = stdout.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no '{head}' in:\n{stdout}"));
        assert!(line.ends_with(&tail), "{line:?} does not end with {tail:?}");
    }
    // The tutorial script's first line, before the first epoch's block.
    let device = stdout.lines().position(|l| l == "Device: cpu").unwrap_or_else(|| panic!("no 'Device: cpu' line in:\n{stdout}"));
    assert!(stdout.lines().position(|l| l.starts_with("| end of epoch")).unwrap() > device, "{stdout}");
    let test_loss = json["test_loss"].as_f64().unwrap();
    let end = format!("| End of training | test loss {test_loss:5.2} | test ppl {:8.2}", test_loss.exp());
    let rule = "=".repeat(89);
    assert!(stdout.contains(&format!("{rule}\n{end}\n{rule}")), "no '{end}' block in:\n{stdout}");
}

/// exercise3.py's pipeline lines, `end of epoch 1 | time: 28.42s | valid loss 1.22` and `End of
/// training | test loss 0.20`, with our run's figures; then the slide's own under the table.
#[test]
fn the_pipeline_prints_the_pipeline_exercises_lines() {
    let args = ["pipeline", "--devices", "cpu,cpu", "--nlayers", "2", "--batch-size", "4", "--chunks", "2"];
    let (stdout, json) = tiny_language_model(env!("CARGO_BIN_EXE_exercise3"), &args, "exercise3_pipeline-transformer-cpu.json");
    for (epoch, stats) in json["history"].as_array().unwrap().iter().enumerate() {
        let head = format!("end of epoch {} | time: ", epoch + 1);
        let line = stdout.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no '{head}' in:\n{stdout}"));
        let tail = format!("s | valid loss {:.2}", stats["eval_loss"].as_f64().unwrap());
        assert!(line.ends_with(&tail), "{line:?} does not end with {tail:?}");
    }
    let end = format!("End of training | test loss {:.2}", json["test_loss"].as_f64().unwrap());
    assert!(stdout.lines().any(|l| l == end), "no '{end}' in:\n{stdout}");
    assert!(!stdout.contains("| end of epoch"), "the tutorial's block is exercise1_nlp's: {stdout}");
    assert!(stdout.contains("course: 2 GPUs, as the slide prints it:\n    end of epoch 1 | time: 28.42s | valid loss 1.22\n"), "{stdout}");
}
