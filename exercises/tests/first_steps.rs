//! The first hands-on steps of the course, as a participant types them: the "why GPUs"
//! demonstration (`why_gpus`) and DDP's hello world (`hello_ddp`, two processes).
mod support;

use std::process::Command;
use support::stderr;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

/// On the CPU, every size of both kinds of work is timed, and the table, the CSV and the slide's
/// two plots are written; sizes below the first one are a usage error.
#[test]
fn why_gpus_times_scalar_and_matrix_work_at_every_size() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_why_gpus"))
        .args(["--device", "cpu", "--max-scalars", "1000", "--max-side", "256", "--repeats", "1", "--results-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("| 1000 scalar multiplications | 1000 |") && table.contains("| 256×256 matrix product | 256 |"), "{table}");
    let csv = std::fs::read_to_string(dir.path().join("why_gpus.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
    let sizes: Vec<(&str, &str)> = rows.iter().map(|r| (r[0], r[1])).collect();
    assert_eq!(sizes, [("scalar", "10"), ("scalar", "100"), ("scalar", "1000"), ("matrix", "64"), ("matrix", "128"), ("matrix", "256")]);
    assert!(rows.iter().all(|r| r[2] == "cpu" && r[3].parse::<f64>().unwrap() > 0.0), "{csv}");
    let svg = std::fs::read_to_string(dir.path().join("why_gpus.svg")).unwrap();
    assert!(svg.contains("scalar multiplications, one at a time") && svg.contains("one matrix multiplication"));

    let out = Command::new(env!("CARGO_BIN_EXE_why_gpus")).args(["--device", "cpu", "--max-side", "32"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// Two ranks, each its own batch: different losses, and after the one step the same
/// parameters, those of SGD at the slide's rate on the average of the two ranks' gradients
/// (recomputed here).
#[test]
fn hello_ddp_steps_two_ranks_to_the_same_parameters() {
    // The DDP hello world's slide: torch.optim.SGD(ddp_model.parameters(), lr=0.01).
    const SLIDE_LR: f64 = 0.01;
    let out = Command::new(env!("CARGO_BIN_EXE_hello_ddp")).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut ranks: Vec<(usize, f64, f64)> = stdout
        .lines()
        .filter_map(|l| {
            let rank = l.strip_prefix("rank ")?.split(' ').next()?.parse().ok()?;
            let loss = l.split("loss ").nth(1)?.split(',').next()?.parse().ok()?;
            let sum = l.rsplit(' ').next()?.parse().ok()?;
            Some((rank, loss, sum))
        })
        .collect();
    ranks.sort_by_key(|r| r.0);
    assert_eq!(ranks.len(), 2, "{stdout}");
    assert!((ranks[0].1 - ranks[1].1).abs() > 1e-3, "each rank its own data: {stdout}");
    assert_eq!(ranks[0].2, ranks[1].2, "the same parameters after the step: {stdout}");

    // The same step by hand: rank 0's initial weights, each rank's gradient, their average.
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root() / "net", 10, 10, Default::default());
    let mut optimizer = nn::Sgd::default().build(&vs, SLIDE_LR).unwrap();
    let params = vs.trainable_variables();
    let mut grads: Vec<Tensor> = params.iter().map(Tensor::zeros_like).collect();
    for rank in 0..2 {
        tch::manual_seed(1 + rank);
        let inputs = Tensor::randn([20, 10], (Kind::Float, Device::Cpu));
        let labels = Tensor::randn([20, 10], (Kind::Float, Device::Cpu));
        optimizer.zero_grad();
        model.forward(&inputs).mse_loss(&labels, Reduction::Mean).backward();
        for (g, p) in grads.iter_mut().zip(&params) {
            *g += p.grad() / 2.0;
        }
    }
    tch::no_grad(|| {
        for (p, g) in params.iter().zip(&grads) {
            let _ = p.shallow_clone().f_sub_(&(g * SLIDE_LR)).unwrap();
        }
    });
    let expected: f64 = params.iter().map(|p| p.sum(Kind::Double).double_value(&[])).sum();
    assert!((expected - ranks[0].2).abs() < 1e-6, "by hand {expected:.9}, the ranks {:.9}", ranks[0].2);
}

/// `--course-log N`: every rank's loss in the shape of the course's Horovod printout, the step in
/// examples of the rank's shard (64 images over 2 ranks: 32 each, 8 per step), then rank 0's
/// `Test set: Accuracy` and elapsed time (exercise3 ddp's, untagged: `data_parallel`'s test).
#[test]
fn course_log_prints_every_ranks_loss_as_the_horovod_slide_shows_it() {
    let dir = tempfile::tempdir().unwrap();
    support::generated_cifar10(&dir.path().join("data"), 64, 16);
    let out = Command::new(env!("CARGO_BIN_EXE_exercise2"))
        .args([
            "--nproc-per-node",
            "2",
            "--device",
            "cpu",
            "--model",
            "cnn",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--quiet",
            "--course-log",
            "2",
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .arg("--results-dir")
        .arg(dir.path().join("results"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        for step in [16, 32] {
            let prefix = format!("[1,{rank}]<stdout>:Epoch [1/1], Step [{step}/32], Loss: ");
            let line = stdout.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no `{prefix}…` in:\n{stdout}"));
            assert!(line[prefix.len()..].parse::<f64>().is_ok_and(|loss| loss > 0.0), "{line}");
        }
    }
    // Rank 0's last lines, tagged as horovodrun's mpirun tags them: `[1,0]<stdout>:Elapsed time: 126.31 s ≈ 2 min`.
    let test = stdout.lines().find(|l| l.starts_with("[1,0]<stdout>:Test set: Accuracy: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(test.ends_with('%'), "{test}");
    let elapsed = stdout.lines().find(|l| l.starts_with("[1,0]<stdout>:Elapsed time: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(elapsed.ends_with(" s ≈ 0 min") || elapsed.ends_with(" s ≈ 1 min"), "{elapsed}");
}

/// A rank count no node takes is one line and exit 2, before mpirun starts anything: the
/// exercises' cap (4 CPU ranks per core).
#[test]
fn hello_ddp_refuses_more_ranks_than_a_node_takes() {
    let out = Command::new(env!("CARGO_BIN_EXE_hello_ddp")).args(["--nproc-per-node", "100000"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).trim().starts_with("error: --nproc-per-node 100000: more than 4 CPU ranks per core") && stderr(&out).lines().count() == 1,
        "{}",
        stderr(&out)
    );
}
