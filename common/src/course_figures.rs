//! The course's published figures (its slides: V100/A100 nodes with PyTorch/Lightning, as
//! `shared/GUIDE.md` §3 lists them), one place for every table that shows them beside ours.
//! Marked as the course's wherever printed: they were not measured here.

/// One row of a slide: a device's training time, and the test figures it reached.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CourseFigure {
    /// `cpu`, `gpu`, `2 GPUs`, ...
    pub device: &'static str,
    /// Training time of the whole run in seconds, as the slide gives it.
    pub train_time_s: Option<f64>,
    /// How the slide gives the time when not as a run's total (per epoch).
    pub time_note: Option<&'static str>,
    pub test_acc: Option<f64>,
    pub test_loss: Option<f64>,
    pub test_ppl: Option<f64>,
    /// The slide's printout of each epoch, where it shows one.
    pub epochs: &'static [CourseEpoch],
    /// What the step lines of the data-parallel printouts count (their `Epoch [2/10], Step
    /// [24960/25000]`), where the slide shows them.
    pub step_log: Option<StepLog>,
}

/// One epoch of a slide's printout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CourseEpoch {
    /// 1-based.
    pub epoch: usize,
    /// The epoch's seconds (training and validation), as the tutorial prints them.
    pub time_s: Option<f64>,
    pub valid_loss: Option<f64>,
    /// As printed: the exponential of the unrounded loss.
    pub valid_ppl: Option<f64>,
    /// The epoch's last step lines, in the slide's order: the rank that printed each (where
    /// mpirun tags it) and its loss.
    pub losses: &'static [(Option<usize>, f64)],
}

/// The step lines' counts: `Epoch [e/epochs], Step [examples/shard]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLog {
    pub epochs: usize,
    pub examples: usize,
    pub shard: usize,
}

/// Where the course's figures come from, said under every table that shows them.
pub const SOURCE: &str = "course rows: the slides' published figures (V100/A100 nodes, PyTorch/Lightning), not measured here";

const fn row(device: &'static str, train_time_s: f64, test_acc: Option<f64>, test_loss: Option<f64>) -> CourseFigure {
    CourseFigure { device, train_time_s: Some(train_time_s), time_note: None, test_acc, test_loss, test_ppl: None, epochs: &[], step_log: None }
}

/// exercise1.py: `Time for training on cpu: 129.9463222026825`, then Lightning's
/// `test_acc_epoch` and `test_loss_epoch`.
const EXERCISE1_CNN: [CourseFigure; 2] = [
    row("cpu", 129.9463222026825, Some(0.6310999989509583), Some(1.0603944063186646)),
    row("gpu", 52.2851619720459, Some(0.6330000162124634), Some(1.0520167350769043)),
];

/// exercise1_CNN.py, pretrained: `Time for training resnet on cpu: …`, `Test Acc`, `Test loss`.
const EXERCISE1_RESNET34: [CourseFigure; 2] = [
    row("cpu", 509.6669270992279, Some(0.6664999723434448), Some(1.0169105529785156)),
    row("gpu", 116.25382375717163, Some(0.6812999844551086), Some(0.9379943609237671)),
];

/// The same script with VGG19.
const EXERCISE1_VGG19: [CourseFigure; 2] = [
    row("cpu", 2580.444151163101, Some(0.10000000149011612), Some(2.3030905723571777)),
    row("gpu", 127.65016007423401, Some(0.10000000149011612), Some(2.303698778152466)),
];

/// exercise1_nlp.py: the totals of the 3 epochs (`4748.23 s`, `219.23 s`), the tutorial's
/// block after each epoch and its `| End of training | test loss 5.48 | test ppl 240.33`.
const EXERCISE1_NLP: [CourseFigure; 2] = [
    CourseFigure {
        device: "cpu",
        train_time_s: Some(4748.23),
        time_note: Some("≈1600 s/epoch"),
        test_acc: None,
        test_loss: Some(5.48),
        test_ppl: Some(240.33),
        epochs: &[tutorial_epoch(1, 1618.58, 5.75, 313.30), tutorial_epoch(2, 1635.81, 5.69, 296.32), tutorial_epoch(3, 1493.84, 5.57, 263.73)],
        step_log: None,
    },
    CourseFigure {
        device: "gpu",
        train_time_s: Some(219.23),
        time_note: Some("≈70–79 s/epoch"),
        test_acc: None,
        test_loss: Some(5.40),
        test_ppl: Some(221.61),
        epochs: &[tutorial_epoch(1, 79.06, 5.75, 314.83), tutorial_epoch(2, 70.25, 5.58, 265.83), tutorial_epoch(3, 69.92, 5.49, 242.84)],
        step_log: None,
    },
];

/// `horovodrun -np 2 python exercise2.py`: each rank's last step of epochs 2, 4, …, 10, then
/// `Test set: Accuracy: 81.08%`, `Elapsed time: 126.31 s ≈ 2 min`.
const EXERCISE2_RESNET34: [CourseFigure; 1] = [CourseFigure {
    epochs: &[
        losses_at(2, &[(Some(1), 0.5788), (Some(0), 0.4635)]),
        losses_at(4, &[(Some(1), 0.3478), (Some(0), 0.2552)]),
        losses_at(6, &[(Some(1), 0.2159), (Some(0), 0.1682)]),
        losses_at(8, &[(Some(1), 0.1184), (Some(0), 0.0652)]),
        losses_at(10, &[(Some(0), 0.1116), (Some(1), 0.0584)]),
    ],
    step_log: Some(CIFAR_OVER_2),
    ..row("2 GPUs", 126.31, Some(0.8108), None)
}];

/// `python exercise3.py` (DDP, `mp.spawn`): the same lines, untagged, so whose is unknown.
const EXERCISE3_DDP_VGG19: [CourseFigure; 2] = [
    CourseFigure {
        epochs: &[
            losses_at(2, &[(None, 1.5240), (None, 1.4402)]),
            losses_at(4, &[(None, 0.7013), (None, 0.7268)]),
            losses_at(6, &[(None, 0.5393), (None, 0.4175)]),
            losses_at(8, &[(None, 0.3391), (None, 0.4450)]),
            losses_at(10, &[(None, 0.3889), (None, 0.3106)]),
        ],
        step_log: Some(CIFAR_OVER_2),
        ..row("2 GPUs", 234.65, Some(0.8176), None)
    },
    // Lightning's DDP slide: `Time for training vgg19 on gpu: 81.21439981460571`.
    CourseFigure {
        device: "2 GPUs, Lightning DDP",
        train_time_s: Some(81.21439981460571),
        time_note: Some("5 epochs"),
        test_acc: None,
        test_loss: None,
        test_ppl: None,
        epochs: &[],
        step_log: None,
    },
];

/// `python exercise3.py` (the pipeline): `end of epoch 1 | time: 28.42s | valid loss 1.22`, …,
/// `End of training | test loss 0.20`.
const EXERCISE3_PIPELINE: [CourseFigure; 1] = [CourseFigure {
    device: "2 GPUs",
    train_time_s: None,
    time_note: Some("≈28 s/epoch"),
    test_acc: None,
    test_loss: Some(0.20),
    test_ppl: None,
    epochs: &[
        CourseEpoch { epoch: 1, time_s: Some(28.42), valid_loss: Some(1.22), valid_ppl: None, losses: &[] },
        CourseEpoch { epoch: 2, time_s: Some(27.36), valid_loss: Some(0.25), valid_ppl: None, losses: &[] },
        CourseEpoch { epoch: 3, time_s: Some(27.49), valid_loss: Some(0.23), valid_ppl: None, losses: &[] },
    ],
    step_log: None,
}];

/// The slide's rows for `exercise` (a preset's name) training `model`; none where the course
/// has no figure for it. Every figure as the slide prints it, all its digits (Python's `repr`
/// of Lightning's float32 metrics, `time.time()` differences); printing rounds them
/// ([`CourseFigure::time`], [`CourseFigure::metric`], [`CourseFigure::loss`]).
pub fn for_run(exercise: &str, model: &str) -> &'static [CourseFigure] {
    match (exercise, model) {
        ("exercise1", "cnn") => &EXERCISE1_CNN,
        ("exercise1", "resnet34") => &EXERCISE1_RESNET34,
        ("exercise1", "vgg19") => &EXERCISE1_VGG19,
        ("exercise1_nlp", _) => &EXERCISE1_NLP,
        ("exercise2", "resnet34") => &EXERCISE2_RESNET34,
        ("exercise3_ddp", "vgg19") => &EXERCISE3_DDP_VGG19,
        ("exercise3_pipeline", _) => &EXERCISE3_PIPELINE,
        _ => &[],
    }
}

/// A tutorial epoch: its time, validation loss and perplexity.
const fn tutorial_epoch(epoch: usize, time_s: f64, valid_loss: f64, valid_ppl: f64) -> CourseEpoch {
    CourseEpoch { epoch, time_s: Some(time_s), valid_loss: Some(valid_loss), valid_ppl: Some(valid_ppl), losses: &[] }
}

/// A data-parallel epoch: its last step's loss lines.
const fn losses_at(epoch: usize, losses: &'static [(Option<usize>, f64)]) -> CourseEpoch {
    CourseEpoch { epoch, time_s: None, valid_loss: None, valid_ppl: None, losses }
}

/// The Horovod and DDP slides' step lines: 10 epochs, a shard of 25,000 images (CIFAR-10's
/// 50,000 over 2 ranks), the last line of each epoch at 24,960.
const CIFAR_OVER_2: StepLog = StepLog { epochs: 10, examples: 24960, shard: 25000 };

/// A `time` command's `real XmY.Zs` in minutes.
const fn minutes(whole_minutes: f64, seconds: f64) -> f64 {
    whole_minutes + seconds / 60.0
}

/// JSC's scaling table (ResNet50 on ImageNet, 10 epochs, JUWELS Booster's nodes of 4 A100s, as
/// the course's slides give it): GPUs and the training time in minutes, from 1 GPU to 32 nodes,
/// each the `real` line of the slide's `time srun python3 …` (the job's wall time). The 1-GPU
/// and the 1 node × 4 GPUs rows ran `gpu_training.py` (256 images per GPU), the 4 to 32 node
/// rows `ddp_training.py` (128 per GPU).
pub const JSC_RESNET50_SCALING: [(usize, f64); 6] = [
    (1, minutes(342.0, 11.864)),
    (4, minutes(89.0, 15.923)),
    (16, minutes(24.0, 48.169)),
    (32, minutes(13.0, 10.722)),
    (64, minutes(6.0, 56.457)),
    (128, minutes(4.0, 48.313)),
];

/// What [`JSC_RESNET50_SCALING`] is, where it is drawn.
pub const JSC_RESNET50_LABEL: &str = "JSC course (published): ResNet50, A100s";

/// JSC's speed-up over its 1 GPU at each GPU count: the time's ratio (a run is the same work).
pub fn jsc_resnet50_speedups() -> Vec<(usize, f64)> {
    let (_, one_gpu) = JSC_RESNET50_SCALING[0];
    JSC_RESNET50_SCALING.iter().map(|&(gpus, minutes)| (gpus, one_gpu / minutes)).collect()
}

impl CourseFigure {
    /// The time as the slide gives it, to its hundredths of a second (its `126.31 s`).
    pub fn time(&self) -> String {
        match (self.train_time_s, self.time_note) {
            (Some(s), Some(note)) => format!("{s:.2} ({note})"),
            (Some(s), None) => format!("{s:.2}"),
            (None, Some(note)) => note.to_string(),
            (None, None) => "-".into(),
        }
    }

    /// The test figure of the table's column: a language model's perplexity to 2 decimals (the
    /// tutorial's `{:8.2f}`), else the accuracy to 4 (Lightning's metrics hold more: 0.6311 is
    /// where 0.6310999989509583 and 0.6330000162124634 still differ).
    pub fn metric(&self, language_model: bool) -> String {
        if language_model {
            Self::figure(self.test_ppl, 2)
        } else {
            Self::figure(self.test_acc, 4)
        }
    }

    /// The test loss: a language model's to 2 decimals (the tutorial's `{:5.2f}`), an image
    /// model's to 4, as the accuracy.
    pub fn loss(&self, language_model: bool) -> String {
        Self::figure(self.test_loss, if language_model { 2 } else { 4 })
    }

    /// A figure, or `-` where the slide gives none.
    pub fn figure(value: Option<f64>, decimals: usize) -> String {
        value.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every figure the course rows print, against the slide's text: its digits as stored, and
    /// as printed.
    #[test]
    fn every_course_row_holds_and_prints_its_slides_figures() {
        // (exercise, model, row, the slide's time, accuracy, test loss, perplexity; printed:
        // time, accuracy or perplexity, loss)
        type Case = (&'static str, &'static str, usize, &'static str, &'static str, &'static str, &'static str, [&'static str; 3]);
        let cases: [Case; 12] = [
            ("exercise1", "cnn", 0, "129.9463222026825", "0.6310999989509583", "1.0603944063186646", "-", ["129.95", "0.6311", "1.0604"]),
            ("exercise1", "cnn", 1, "52.2851619720459", "0.6330000162124634", "1.0520167350769043", "-", ["52.29", "0.6330", "1.0520"]),
            ("exercise1", "resnet34", 0, "509.6669270992279", "0.6664999723434448", "1.0169105529785156", "-", ["509.67", "0.6665", "1.0169"]),
            ("exercise1", "resnet34", 1, "116.25382375717163", "0.6812999844551086", "0.9379943609237671", "-", ["116.25", "0.6813", "0.9380"]),
            ("exercise1", "vgg19", 0, "2580.444151163101", "0.10000000149011612", "2.3030905723571777", "-", ["2580.44", "0.1000", "2.3031"]),
            ("exercise1", "vgg19", 1, "127.65016007423401", "0.10000000149011612", "2.303698778152466", "-", ["127.65", "0.1000", "2.3037"]),
            ("exercise1_nlp", "transformer", 0, "4748.23", "-", "5.48", "240.33", ["4748.23 (≈1600 s/epoch)", "240.33", "5.48"]),
            ("exercise1_nlp", "transformer", 1, "219.23", "-", "5.4", "221.61", ["219.23 (≈70–79 s/epoch)", "221.61", "5.40"]),
            ("exercise2", "resnet34", 0, "126.31", "0.8108", "-", "-", ["126.31", "0.8108", "-"]),
            ("exercise3_ddp", "vgg19", 0, "234.65", "0.8176", "-", "-", ["234.65", "0.8176", "-"]),
            ("exercise3_ddp", "vgg19", 1, "81.21439981460571", "-", "-", "-", ["81.21 (5 epochs)", "-", "-"]),
            ("exercise3_pipeline", "transformer", 0, "-", "-", "0.2", "-", ["≈28 s/epoch", "-", "0.20"]),
        ];
        let verbatim = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        for (exercise, model, i, time, acc, loss, ppl, printed) in cases {
            let c = &for_run(exercise, model)[i];
            let lm = exercise.contains("nlp") || exercise.contains("pipeline");
            let stored = [verbatim(c.train_time_s), verbatim(c.test_acc), verbatim(c.test_loss), verbatim(c.test_ppl)];
            assert_eq!(stored, [time, acc, loss, ppl], "{exercise} {model} {}: the slide's figures", c.device);
            assert_eq!([c.time(), c.metric(lm), c.loss(lm)], printed, "{exercise} {model} {}: as printed", c.device);
        }
        assert!(for_run("exercise3_tp", "transformer").is_empty(), "the course has no tensor-parallel run");
        assert!(for_run("exercise2", "cnn").is_empty(), "the course's exercise 2 is ResNet34's");
    }

    /// The six times are the slides' `real` lines, to the millisecond.
    #[test]
    fn jscs_scaling_times_are_its_real_lines() {
        let real = ["342m11.864s", "89m15.923s", "24m48.169s", "13m10.722s", "6m56.457s", "4m48.313s"];
        for (&(gpus, minutes), real) in JSC_RESNET50_SCALING.iter().zip(real) {
            let (m, s) = real.trim_end_matches('s').split_once('m').unwrap();
            let seconds = m.parse::<f64>().unwrap() * 60.0 + s.parse::<f64>().unwrap();
            assert!((minutes * 60.0 - seconds).abs() < 1e-9, "{gpus} GPUs: {minutes} min, the slide's {real}");
        }
        // 342.1977, 89.2654, 24.8028, 13.1787, 6.94095 and 4.8052 minutes, as docs/scaling.md
        // rounds them.
        let rounded: Vec<String> = JSC_RESNET50_SCALING.iter().map(|(_, m)| format!("{m:.2}")).collect();
        assert_eq!(rounded, ["342.20", "89.27", "24.80", "13.18", "6.94", "4.81"]);
    }

    /// docs/scaling.md's JSC table is these times, their ratios and the efficiencies.
    #[test]
    fn the_scaling_page_quotes_jscs_table() {
        let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scaling.md")).unwrap();
        let row = |name: &str, cells: Vec<String>| format!("| {name} | {} |", cells.join(" | "));
        let speedups = jsc_resnet50_speedups();
        let times = row("time (min)", JSC_RESNET50_SCALING.iter().map(|(_, m)| format!("{m:.2}")).collect());
        let ratios = row("speed-up", speedups.iter().map(|&(_, s)| if s == 1.0 { "1×".into() } else { format!("{s:.2}×") }).collect());
        let efficiency = row("efficiency", speedups.iter().map(|&(gpus, s)| format!("{:.0}%", 100.0 * s / gpus as f64)).collect());
        for line in [times, ratios, efficiency] {
            assert!(page.contains(&line), "docs/scaling.md should have {line}");
        }
    }

    #[test]
    fn jscs_scaling_is_its_times_ratio() {
        let speedups = jsc_resnet50_speedups();
        assert_eq!(speedups[0], (1, 1.0));
        let (gpus, speedup) = speedups[5];
        // 32 nodes: 342.1977 / 4.8052 = 71.21 times on 128 GPUs, 55.64% efficiency.
        assert_eq!(gpus, 128);
        assert!((speedup - 71.21).abs() < 5e-3 && (speedup / gpus as f64 - 0.5564).abs() < 5e-5, "{speedup}");
    }
}
