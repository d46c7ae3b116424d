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
}

/// Where the course's figures come from, said under every table that shows them.
pub const SOURCE: &str = "course rows: the slides' published figures (V100/A100 nodes, PyTorch/Lightning), not measured here";

const fn row(device: &'static str, train_time_s: f64, test_acc: Option<f64>, test_loss: Option<f64>) -> CourseFigure {
    CourseFigure { device, train_time_s: Some(train_time_s), time_note: None, test_acc, test_loss, test_ppl: None }
}

/// The slide's rows for `exercise` (a preset's name) training `model`; none where the course
/// has no figure for it.
pub fn for_run(exercise: &str, model: &str) -> &'static [CourseFigure] {
    const CNN: [CourseFigure; 2] = [row("cpu", 129.9, Some(0.631), Some(1.06)), row("gpu", 52.3, Some(0.633), Some(1.05))];
    const RESNET34: [CourseFigure; 2] = [row("cpu", 509.7, Some(0.666), None), row("gpu", 116.3, Some(0.681), None)];
    const VGG19: [CourseFigure; 2] = [row("cpu", 2580.4, Some(0.100), None), row("gpu", 127.7, Some(0.100), None)];
    // The totals of the 3 epochs (4,748 s and 219 s), each epoch's time beside them.
    const NLP: [CourseFigure; 2] = [
        CourseFigure { device: "cpu", train_time_s: Some(4748.0), time_note: Some("≈1600 s/epoch"), test_acc: None, test_loss: None, test_ppl: Some(240.3) },
        CourseFigure {
            device: "gpu", train_time_s: Some(219.0), time_note: Some("≈70–79 s/epoch"), test_acc: None, test_loss: None, test_ppl: Some(221.61)
        },
    ];
    const EXERCISE2: [CourseFigure; 1] = [row("2 GPUs", 126.31, Some(0.8108), None)];
    const EXERCISE3_DDP: [CourseFigure; 2] = [
        row("2 GPUs", 234.65, Some(0.8176), None),
        CourseFigure {
            device: "2 GPUs, Lightning DDP",
            train_time_s: Some(81.2),
            time_note: Some("5 epochs"),
            test_acc: None,
            test_loss: None,
            test_ppl: None,
        },
    ];
    const PIPELINE: [CourseFigure; 1] =
        [CourseFigure { device: "2 GPUs", train_time_s: None, time_note: Some("≈28 s/epoch"), test_acc: None, test_loss: Some(0.20), test_ppl: None }];
    match (exercise, model) {
        ("exercise1", "cnn") => &CNN,
        ("exercise1", "resnet34") => &RESNET34,
        ("exercise1", "vgg19") => &VGG19,
        ("exercise1_nlp", _) => &NLP,
        ("exercise2", "resnet34") => &EXERCISE2,
        ("exercise3_ddp", "vgg19") => &EXERCISE3_DDP,
        ("exercise3_pipeline", _) => &PIPELINE,
        _ => &[],
    }
}

/// JSC's scaling table (ResNet50 on ImageNet, 10 epochs, JUWELS Booster's nodes of 4 A100s, as
/// the course's slide gives it): GPUs and the training time in minutes, from 1 GPU to 32 nodes.
pub const JSC_RESNET50_SCALING: [(usize, f64); 6] = [(1, 342.0), (4, 89.0), (16, 24.8), (32, 13.2), (64, 6.9), (128, 4.8)];

/// What [`JSC_RESNET50_SCALING`] is, where it is drawn.
pub const JSC_RESNET50_LABEL: &str = "JSC course (published): ResNet50, A100s";

/// JSC's speed-up over its 1 GPU at each GPU count: the time's ratio (a run is the same work).
pub fn jsc_resnet50_speedups() -> Vec<(usize, f64)> {
    let (_, one_gpu) = JSC_RESNET50_SCALING[0];
    JSC_RESNET50_SCALING.iter().map(|&(gpus, minutes)| (gpus, one_gpu / minutes)).collect()
}

impl CourseFigure {
    /// The time as the slide gives it.
    pub fn time(&self) -> String {
        match (self.train_time_s, self.time_note) {
            (Some(s), Some(note)) => format!("{s:.1} ({note})"),
            (Some(s), None) => format!("{s:.1}"),
            (None, Some(note)) => note.to_string(),
            (None, None) => "-".into(),
        }
    }

    /// A figure, or `-` where the slide gives none.
    pub fn figure(value: Option<f64>, decimals: usize) -> String {
        value.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_course_exercise_has_its_slides_figures() {
        assert_eq!(for_run("exercise1", "cnn")[1].train_time_s, Some(52.3));
        assert_eq!(for_run("exercise3_ddp", "vgg19")[0].test_acc, Some(0.8176));
        assert_eq!(for_run("exercise1_nlp", "transformer")[0].test_ppl, Some(240.3));
        assert_eq!(for_run("exercise1_nlp", "transformer")[1].time(), "219.0 (≈70–79 s/epoch)");
        assert_eq!(for_run("exercise1_nlp", "transformer")[1].test_ppl, Some(221.61));
        assert_eq!(for_run("exercise3_ddp", "vgg19")[1].time(), "81.2 (5 epochs)");
        assert!(for_run("exercise3_tp", "transformer").is_empty(), "the course has no tensor-parallel run");
        assert!(for_run("exercise2", "cnn").is_empty(), "the course's exercise 2 is ResNet34's");
    }

    #[test]
    fn jscs_scaling_is_its_times_ratio() {
        let speedups = jsc_resnet50_speedups();
        assert_eq!(speedups[0], (1, 1.0));
        let (gpus, speedup) = speedups[5];
        // 32 nodes: 342 / 4.8 = 71.25 times on 128 GPUs, 55.7% efficiency.
        assert_eq!(gpus, 128);
        assert!((speedup - 71.25).abs() < 1e-9 && (speedup / gpus as f64 - 0.5566).abs() < 1e-4, "{speedup}");
    }
}
