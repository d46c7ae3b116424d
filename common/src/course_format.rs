//! The course material's own printouts, so that a participant can hold our run against the
//! slide line by line: the PyTorch Transformer tutorial's block after each epoch and at the end
//! of training (`exercise1_nlp`, the pipeline), and Lightning's test-metric table, as
//! `trainer.test` prints it without `rich` into a Slurm log (the image exercises).
//! [`crate::course_figures`] holds the slides' numbers; this module their shape.

/// The tutorial's rule lines are 89 characters wide.
const TUTORIAL_WIDTH: usize = 89;

/// Lightning centres its table in columns of at least 25 characters, between rules as wide as
/// the terminal, 120 where there is none (a batch job's log).
const LIGHTNING_COLUMN: usize = 25;
const LIGHTNING_WIDTH: usize = 120;

/// The tutorial's block after epoch `epoch` (1-based) of `seconds` (training and validation),
/// with the validation loss and its perplexity:
/// `| end of epoch   1 | time: 98.49s | valid loss  5.78 | valid ppl   324.03`.
pub fn tutorial_epoch_end(epoch: usize, seconds: f64, valid_loss: f64) -> String {
    let rule = "-".repeat(TUTORIAL_WIDTH);
    let ppl = valid_loss.exp();
    format!("{rule}\n| end of epoch {epoch:3} | time: {seconds:5.2}s | valid loss {valid_loss:5.2} | valid ppl {ppl:8.2}\n{rule}")
}

/// The course's Horovod script's line, as `mpirun --tag-output` (horovodrun) shows it from rank
/// `rank`: `[1,0]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.1234` (`epoch` 1-based; the
/// step in examples of this rank's shard).
pub fn horovod_step(rank: usize, epoch: usize, epochs: usize, examples: usize, shard: usize, loss: f64) -> String {
    format!("[1,{rank}]<stdout>:Epoch [{epoch}/{epochs}], Step [{examples}/{shard}], Loss: {loss:.4}")
}

/// The Horovod script's end: `Test set: Accuracy: 81.08%`.
pub fn horovod_test_set(accuracy: f64) -> String {
    format!("Test set: Accuracy: {:.2}%", 100.0 * accuracy)
}

/// The pipeline tutorial's count: `Total parameters in model: 1,444,261,998`.
pub fn tutorial_total_parameters(params: i64) -> String {
    format!("Total parameters in model: {}", crate::report::group_thousands(params))
}

/// The tutorial's block after training: `| End of training | test loss  5.49 | test ppl   242.78`.
pub fn tutorial_end_of_training(test_loss: f64) -> String {
    let rule = "=".repeat(TUTORIAL_WIDTH);
    let ppl = test_loss.exp();
    format!("{rule}\n| End of training | test loss {test_loss:5.2} | test ppl {ppl:8.2}\n{rule}")
}

/// The image scripts' line after `trainer.fit`, the seconds as Python prints a float:
/// `Time for training on cpu: 129.9463222026825` (exercise1.py, the CNN) or `Time for training
/// resnet on gpu: 116.25382375717163` (exercise1_CNN.py names its model: `resnet`, `vgg19`).
/// `device` is the script's word, `cpu` or `gpu`.
pub fn time_for_training(model: Option<&str>, device: &str, seconds: f64) -> String {
    match model {
        Some(model) => format!("Time for training {model} on {device}: {seconds:?}"),
        None => format!("Time for training on {device}: {seconds:?}"),
    }
}

/// The exercise1_nlp script's first line: `Device: cpu` or `Device: cuda` (torch's device type).
pub fn device_line(device_type: &str) -> String {
    format!("Device: {device_type}")
}

/// Lightning's table after `trainer.test`: the metrics sorted by name, each value as Python
/// prints a float32 tensor's `.item()` (`0.6330000162124634`).
pub fn lightning_test_table(metrics: &[(&str, f64)]) -> String {
    let mut metrics = metrics.to_vec();
    metrics.sort_by(|a, b| a.0.cmp(b.0));
    let header = "DataLoader 0";
    let longest = metrics.iter().map(|(name, _)| name.chars().count()).max().unwrap_or(0);
    let width = longest.max(header.len()).clamp(LIGHTNING_COLUMN, LIGHTNING_WIDTH / 2);
    let row = |a: &str, b: &str| format!("{a:^width$}{b:^width$}").trim_end().to_string();
    let rule = "─".repeat(LIGHTNING_WIDTH);
    let mut lines = vec![rule.clone(), row("Test metric", header), rule.clone()];
    lines.extend(metrics.iter().map(|(name, value)| row(name, &((*value as f32) as f64).to_string())));
    lines.push(rule);
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_horovod_script_and_pipeline_tutorial_lines() {
        assert_eq!(horovod_step(1, 2, 10, 24960, 25000, 0.123456), "[1,1]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.1235");
        assert_eq!(horovod_test_set(0.8108), "Test set: Accuracy: 81.08%");
        assert_eq!(tutorial_total_parameters(1_444_261_998), "Total parameters in model: 1,444,261,998");
    }

    /// The slide's lines (2. Fundamentals of Deep Learning), each from its own figure.
    #[test]
    fn the_image_scripts_time_line_and_the_nlp_scripts_device_line() {
        assert_eq!(time_for_training(None, "cpu", 129.9463222026825), "Time for training on cpu: 129.9463222026825");
        assert_eq!(time_for_training(Some("resnet"), "gpu", 116.25382375717163), "Time for training resnet on gpu: 116.25382375717163");
        assert_eq!(time_for_training(Some("vgg19"), "cpu", 2580.444151163101), "Time for training vgg19 on cpu: 2580.444151163101");
        // Python prints a whole float with its ".0".
        assert_eq!(time_for_training(None, "gpu", 52.0), "Time for training on gpu: 52.0");
        assert_eq!(device_line("cuda"), "Device: cuda");
    }

    // The expected blocks are the tutorial's and Lightning's own format strings run in Python
    // with the same numbers.

    #[test]
    fn the_tutorials_epoch_and_final_blocks() {
        let rule = "-".repeat(89);
        let valid_loss = 324.03f64.ln();
        assert_eq!(
            tutorial_epoch_end(1, 98.4912, valid_loss),
            format!("{rule}\n| end of epoch   1 | time: 98.49s | valid loss  5.78 | valid ppl   324.03\n{rule}")
        );
        let rule = "=".repeat(89);
        assert_eq!(tutorial_end_of_training(242.78f64.ln()), format!("{rule}\n| End of training | test loss  5.49 | test ppl   242.78\n{rule}"));
    }

    #[test]
    fn lightnings_test_table_sorted_centred_and_in_float32() {
        let rule = "─".repeat(120);
        let expected = [
            rule.as_str(),
            "       Test metric             DataLoader 0",
            &rule,
            "     test_acc_epoch         0.6330000162124634",
            "     test_loss_epoch         1.051200032234192",
            &rule,
        ]
        .join("\n");
        assert_eq!(lightning_test_table(&[("test_loss_epoch", 1.0512), ("test_acc_epoch", 0.633)]), expected);
    }
}
