//! The course material's own printouts, so that a participant can hold our run against the
//! slide line by line: the PyTorch Transformer tutorial's block after each epoch and at the end
//! of training (`exercise1_nlp`), the pipeline exercise's shorter lines, the Horovod and DDP
//! scripts' step lines, and Lightning's test-metric table, as `trainer.test` prints it without
//! `rich` into a Slurm log (the image exercises). [`CourseScript`] says which script an
//! exercise's printout follows. [`crate::course_figures`] holds the slides' numbers; this module
//! their shape.
use serde::Serialize;

use crate::course_figures::CourseFigure;

/// The course script whose printout an exercise follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CourseScript {
    /// exercise1.py and exercise1_CNN.py: Lightning's `trainer.fit`, then `trainer.test`'s table.
    Lightning,
    /// exercise1_nlp.py: the PyTorch Transformer tutorial's blocks.
    Tutorial,
    /// exercise2.py under `horovodrun`: every line tagged by mpirun with its rank,
    /// `[1,RANK]<stdout>:`.
    Horovod,
    /// exercise3.py's DDP part under `mp.spawn`: the Horovod script's lines, untagged.
    Ddp,
    /// exercise3.py's pipeline: the tutorial's lines without their rules, padding and perplexity,
    /// `end of epoch 1 | time: 28.42s | valid loss 1.22`.
    Pipeline,
}

impl CourseScript {
    /// A training step's line from rank `rank`: [`ddp_step`]'s, tagged under Horovod
    /// (`[1,0]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.1234`).
    pub fn step_line(self, rank: usize, epoch: usize, epochs: usize, examples: usize, shard: usize, loss: f64) -> String {
        self.tagged(rank, ddp_step(epoch, epochs, examples, shard, loss))
    }

    /// The script's last lines on rank 0: `Test set: Accuracy: 81.08%` (where there is an
    /// accuracy) and `Elapsed time: 126.31 s ≈ 2 min`.
    pub fn final_lines(self, accuracy: Option<f64>, seconds: f64) -> Vec<String> {
        let lines = accuracy.map(horovod_test_set).into_iter().chain([elapsed_time(seconds)]);
        lines.map(|line| self.tagged(0, line)).collect()
    }

    /// The language model's line or block after each epoch of `seconds` (training and
    /// validation); none for the image scripts, which print no such line.
    pub fn epoch_end(self, epoch: usize, seconds: f64, valid_loss: f64) -> Option<String> {
        match self {
            CourseScript::Tutorial => Some(tutorial_epoch_end(epoch, seconds, valid_loss)),
            CourseScript::Pipeline => Some(pipeline_epoch_end(epoch, seconds, valid_loss)),
            _ => None,
        }
    }

    /// The language model's line or block after training.
    pub fn end_of_training(self, test_loss: f64) -> String {
        match self {
            CourseScript::Pipeline => pipeline_end_of_training(test_loss),
            _ => tutorial_end_of_training(test_loss),
        }
    }

    /// A slide's printout rebuilt from its numbers ([`crate::course_figures`]) in this script's
    /// shape: each epoch's lines, then the end's. Empty where the slide shows no epochs.
    pub fn slide_printout(self, figure: &CourseFigure) -> Vec<String> {
        let mut lines = Vec::new();
        for e in figure.epochs {
            let (time, loss) = (e.time_s.unwrap_or(f64::NAN), e.valid_loss.unwrap_or(f64::NAN));
            match (self, figure.step_log) {
                (CourseScript::Tutorial, _) => lines.push(tutorial_epoch_line(e.epoch, time, loss, e.valid_ppl.unwrap_or(loss.exp()))),
                (CourseScript::Pipeline, _) => lines.push(pipeline_epoch_end(e.epoch, time, loss)),
                (_, Some(log)) => {
                    lines.extend(e.losses.iter().map(|&(rank, loss)| self.step_line(rank.unwrap_or(0), e.epoch, log.epochs, log.examples, log.shard, loss)))
                }
                (_, None) => {}
            }
        }
        if figure.epochs.is_empty() {
            return lines;
        }
        match (self, figure.test_loss) {
            (CourseScript::Tutorial, Some(loss)) => lines.push(tutorial_end_line(loss, figure.test_ppl.unwrap_or(loss.exp()))),
            (CourseScript::Pipeline, Some(loss)) => lines.push(pipeline_end_of_training(loss)),
            _ if figure.step_log.is_some() => lines.extend(self.final_lines(figure.test_acc, figure.train_time_s.unwrap_or(f64::NAN))),
            _ => {}
        }
        lines
    }

    /// Every slide's printout of `figures` that has one, under a line naming its device, to
    /// print under the results table: `course: gpu, as the slide prints it:` and its lines,
    /// indented. Empty where no slide shows epochs.
    pub fn slide_printouts(self, figures: &[CourseFigure]) -> String {
        let mut out = String::new();
        for figure in figures {
            let lines = self.slide_printout(figure);
            if !lines.is_empty() {
                out += &format!("course: {}, as the slide prints it:\n    {}\n", figure.device, lines.join("\n    "));
            }
        }
        out
    }

    /// `line` as mpirun's `--tag-output` shows it from `rank` under Horovod, else as it is.
    fn tagged(self, rank: usize, line: String) -> String {
        match self {
            CourseScript::Horovod => format!("[1,{rank}]<stdout>:{line}"),
            _ => line,
        }
    }
}

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
    format!("{rule}\n{}\n{rule}", tutorial_epoch_line(epoch, seconds, valid_loss, valid_loss.exp()))
}

/// The middle line of [`tutorial_epoch_end`], the perplexity given (a slide's, printed from the
/// unrounded loss).
pub fn tutorial_epoch_line(epoch: usize, seconds: f64, valid_loss: f64, valid_ppl: f64) -> String {
    format!("| end of epoch {epoch:3} | time: {seconds:5.2}s | valid loss {valid_loss:5.2} | valid ppl {valid_ppl:8.2}")
}

/// The pipeline exercise's line after each epoch: `end of epoch 1 | time: 28.42s | valid loss 1.22`.
pub fn pipeline_epoch_end(epoch: usize, seconds: f64, valid_loss: f64) -> String {
    format!("end of epoch {epoch} | time: {seconds:.2}s | valid loss {valid_loss:.2}")
}

/// The pipeline exercise's last line: `End of training | test loss 0.20`.
pub fn pipeline_end_of_training(test_loss: f64) -> String {
    format!("End of training | test loss {test_loss:.2}")
}

/// The course's DDP script's line: `Epoch [2/10], Step [24960/25000], Loss: 0.1234` (`epoch`
/// 1-based; the step in examples of this rank's shard).
pub fn ddp_step(epoch: usize, epochs: usize, examples: usize, shard: usize, loss: f64) -> String {
    format!("Epoch [{epoch}/{epochs}], Step [{examples}/{shard}], Loss: {loss:.4}")
}

/// The data-parallel scripts' test line: `Test set: Accuracy: 81.08%`.
pub fn horovod_test_set(accuracy: f64) -> String {
    format!("Test set: Accuracy: {:.2}%", 100.0 * accuracy)
}

/// The data-parallel scripts' last line: `Elapsed time: 126.31 s ≈ 2 min` (the minutes rounded).
pub fn elapsed_time(seconds: f64) -> String {
    format!("Elapsed time: {seconds:.2} s ≈ {:.0} min", seconds / 60.0)
}

/// The pipeline tutorial's count: `Total parameters in model: 1,444,261,998`.
pub fn tutorial_total_parameters(params: i64) -> String {
    format!("Total parameters in model: {}", crate::report::group_thousands(params))
}

/// The tutorial's block after training: `| End of training | test loss  5.49 | test ppl   242.78`.
pub fn tutorial_end_of_training(test_loss: f64) -> String {
    let rule = "=".repeat(TUTORIAL_WIDTH);
    format!("{rule}\n{}\n{rule}", tutorial_end_line(test_loss, test_loss.exp()))
}

/// The middle line of [`tutorial_end_of_training`], the perplexity given.
pub fn tutorial_end_line(test_loss: f64, test_ppl: f64) -> String {
    format!("| End of training | test loss {test_loss:5.2} | test ppl {test_ppl:8.2}")
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
    // Debug, not Display: Python prints a whole float with its ".0" (`0.0`, `1.0`), Rust's
    // Display without; both print the shortest digits that read back the same otherwise.
    lines.extend(metrics.iter().map(|(name, value)| row(name, &format!("{:?}", (*value as f32) as f64))));
    lines.push(rule);
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_horovod_script_and_pipeline_tutorial_lines() {
        assert_eq!(CourseScript::Horovod.step_line(1, 2, 10, 24960, 25000, 0.123456), "[1,1]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.1235");
        assert_eq!(horovod_test_set(0.8108), "Test set: Accuracy: 81.08%");
        assert_eq!(elapsed_time(126.31), "Elapsed time: 126.31 s ≈ 2 min");
        assert_eq!(elapsed_time(234.65), "Elapsed time: 234.65 s ≈ 4 min");
        assert_eq!(CourseScript::Ddp.step_line(1, 2, 10, 24960, 25000, 1.524), "Epoch [2/10], Step [24960/25000], Loss: 1.5240");
        assert_eq!(
            CourseScript::Horovod.final_lines(Some(0.8108), 126.31),
            ["[1,0]<stdout>:Test set: Accuracy: 81.08%", "[1,0]<stdout>:Elapsed time: 126.31 s ≈ 2 min"]
        );
        assert_eq!(CourseScript::Ddp.final_lines(None, 81.2), ["Elapsed time: 81.20 s ≈ 1 min"]);
        assert_eq!(CourseScript::Pipeline.epoch_end(1, 28.4213, 1.2249).unwrap(), "end of epoch 1 | time: 28.42s | valid loss 1.22");
        assert_eq!(CourseScript::Pipeline.end_of_training(0.2021), "End of training | test loss 0.20");
        assert_eq!(CourseScript::Lightning.epoch_end(1, 1.0, 1.0), None);
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

    /// Every epoch line and end line the slides print, rebuilt from the stored figures, against
    /// the slides' text (LRZ's material: its conversion to text collapsed the padding, so spaces
    /// are compared collapsed).
    #[test]
    fn the_slides_printouts_rebuilt_from_their_figures() {
        use crate::presets::{EXERCISE1, EXERCISE1_NLP, EXERCISE2, EXERCISE3_DDP, EXERCISE3_PIPELINE};
        fn slide<M>(preset: &crate::presets::Preset<M>, model: &str, row: usize) -> Vec<String> {
            let collapse = |line: &str| line.split_whitespace().collect::<Vec<_>>().join(" ");
            preset.script.slide_printout(&crate::course_figures::for_run(preset.name, model)[row]).iter().map(|l| collapse(l)).collect::<Vec<_>>()
        }
        assert_eq!(
            slide(&EXERCISE1_NLP, "transformer", 0),
            [
                "| end of epoch 1 | time: 1618.58s | valid loss 5.75 | valid ppl 313.30",
                "| end of epoch 2 | time: 1635.81s | valid loss 5.69 | valid ppl 296.32",
                "| end of epoch 3 | time: 1493.84s | valid loss 5.57 | valid ppl 263.73",
                "| End of training | test loss 5.48 | test ppl 240.33",
            ]
        );
        assert_eq!(
            slide(&EXERCISE1_NLP, "transformer", 1),
            [
                "| end of epoch 1 | time: 79.06s | valid loss 5.75 | valid ppl 314.83",
                "| end of epoch 2 | time: 70.25s | valid loss 5.58 | valid ppl 265.83",
                "| end of epoch 3 | time: 69.92s | valid loss 5.49 | valid ppl 242.84",
                "| End of training | test loss 5.40 | test ppl 221.61",
            ]
        );
        assert_eq!(
            slide(&EXERCISE2, "resnet34", 0),
            [
                "[1,1]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.5788",
                "[1,0]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.4635",
                "[1,1]<stdout>:Epoch [4/10], Step [24960/25000], Loss: 0.3478",
                "[1,0]<stdout>:Epoch [4/10], Step [24960/25000], Loss: 0.2552",
                "[1,1]<stdout>:Epoch [6/10], Step [24960/25000], Loss: 0.2159",
                "[1,0]<stdout>:Epoch [6/10], Step [24960/25000], Loss: 0.1682",
                "[1,1]<stdout>:Epoch [8/10], Step [24960/25000], Loss: 0.1184",
                "[1,0]<stdout>:Epoch [8/10], Step [24960/25000], Loss: 0.0652",
                "[1,0]<stdout>:Epoch [10/10], Step [24960/25000], Loss: 0.1116",
                "[1,1]<stdout>:Epoch [10/10], Step [24960/25000], Loss: 0.0584",
                "[1,0]<stdout>:Test set: Accuracy: 81.08%",
                "[1,0]<stdout>:Elapsed time: 126.31 s ≈ 2 min",
            ]
        );
        assert_eq!(
            slide(&EXERCISE3_DDP, "vgg19", 0),
            [
                "Epoch [2/10], Step [24960/25000], Loss: 1.5240",
                "Epoch [2/10], Step [24960/25000], Loss: 1.4402",
                "Epoch [4/10], Step [24960/25000], Loss: 0.7013",
                "Epoch [4/10], Step [24960/25000], Loss: 0.7268",
                "Epoch [6/10], Step [24960/25000], Loss: 0.5393",
                "Epoch [6/10], Step [24960/25000], Loss: 0.4175",
                "Epoch [8/10], Step [24960/25000], Loss: 0.3391",
                "Epoch [8/10], Step [24960/25000], Loss: 0.4450",
                "Epoch [10/10], Step [24960/25000], Loss: 0.3889",
                "Epoch [10/10], Step [24960/25000], Loss: 0.3106",
                "Test set: Accuracy: 81.76%",
                "Elapsed time: 234.65 s ≈ 4 min",
            ]
        );
        assert_eq!(
            slide(&EXERCISE3_PIPELINE, "transformer", 0),
            [
                "end of epoch 1 | time: 28.42s | valid loss 1.22",
                "end of epoch 2 | time: 27.36s | valid loss 0.25",
                "end of epoch 3 | time: 27.49s | valid loss 0.23",
                "End of training | test loss 0.20",
            ]
        );
        // Under the results table, each with its device.
        let figures = crate::course_figures::for_run("exercise3_ddp", "vgg19");
        let block = CourseScript::Ddp.slide_printouts(figures);
        assert!(block.starts_with("course: 2 GPUs, as the slide prints it:\n    Epoch [2/10], Step [24960/25000], Loss: 1.5240\n"), "{block}");
        assert!(block.ends_with("    Elapsed time: 234.65 s ≈ 4 min\n") && !block.contains("Lightning DDP"), "{block}");
        // The slides without epoch lines rebuild none.
        assert!(slide(&EXERCISE1, "cnn", 0).is_empty() && slide(&EXERCISE3_DDP, "vgg19", 1).is_empty());
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
        // An accuracy of nothing right, and a whole loss, as Python prints them.
        let table = lightning_test_table(&[("test_acc_epoch", 0.0), ("test_loss_epoch", 2.0)]);
        assert!(table.contains("     test_acc_epoch                 0.0\n") && table.contains("     test_loss_epoch                2.0\n"), "{table}");
    }
}
