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

/// The tutorial's block after training: `| End of training | test loss  5.49 | test ppl   242.78`.
pub fn tutorial_end_of_training(test_loss: f64) -> String {
    let rule = "=".repeat(TUTORIAL_WIDTH);
    let ppl = test_loss.exp();
    format!("{rule}\n| End of training | test loss {test_loss:5.2} | test ppl {ppl:8.2}\n{rule}")
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
            "        test_acc            0.6330000162124634",
            "        test_loss            1.051200032234192",
            &rule,
        ]
        .join("\n");
        assert_eq!(lightning_test_table(&[("test_loss", 1.0512), ("test_acc", 0.633)]), expected);
    }
}
