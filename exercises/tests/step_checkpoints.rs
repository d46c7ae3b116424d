//! Step checkpoints and exact resumption in the middle of an epoch, as a user meets them: a run
//! checkpointing every N steps is ended abruptly after step k (a test hook that exits as a kill
//! would, so nothing depends on timing), resumed with the same command, and its losses are the
//! uninterrupted run's, bit for bit: for an image exercise, the language model (with dropout),
//! a pipeline, and two data-parallel ranks. Also: `--max-steps` saves its last step, a torn
//! newest checkpoint falls back to the previous one with a warning, and SIGTERM/SIGUSR1 stop a
//! run with a checkpoint from which a resume equals the uninterrupted run; a stop signal to any
//! process of a multi-rank job is said once; ranks whose launcher was killed commit nothing more.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::error::STOPPED_EXIT_CODE;
use common::train::{TEST_EXIT_AFTER_STEP, TEST_SIGNAL_AFTER_STEP};
use support::{ended, rank_process, read_json, shared_data, signal, stderr, wikitext_sample, Job};

fn run(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the exercise runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn losses(json: &serde_json::Value) -> Vec<f64> {
    json["step_losses"].as_array().expect("step_losses").iter().map(|v| v.as_f64().unwrap()).collect()
}

/// How a test interrupts a run: the hook's variable and value, the step of the checkpoint the
/// resume must start from, and the exit code the interrupted run ends with.
struct Interruption {
    hook: (&'static str, String),
    restored: usize,
    exit_code: i32,
}

/// Ended abruptly after step `k` (a kill), with checkpoints every `every` steps.
fn killed_after(k: usize, every: usize) -> Interruption {
    Interruption { hook: (TEST_EXIT_AFTER_STEP, k.to_string()), restored: k / every * every, exit_code: 137 }
}

/// Rank 0 sent `signal` after step `k`: every rank stops there, checkpointed, exit 75.
fn signalled_after(k: usize, signal: &str) -> Interruption {
    Interruption { hook: (TEST_SIGNAL_AFTER_STEP, format!("{k}:{signal}")), restored: k, exit_code: STOPPED_EXIT_CODE as i32 }
}

/// A command of `bin` with `args`, writing checkpoints (every `every` steps) and results to a
/// folder of its own, run straight through and, in another folder, interrupted as `how` says
/// and resumed by the same command: the resumed run's step losses are the straight run's last
/// ones, bit for bit, and its test loss the same. `results`: the results JSON's file name.
/// Returns what the interrupted run and the resumed one printed.
fn interrupted_equals_straight(bin: &str, args: &[&str], every: usize, how: Interruption, results: &str) -> (String, String) {
    let with_dir = |dir: &Path| {
        let dir = dir.to_str().unwrap().to_string();
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--checkpoint-dir", &dir, "--resume", "--checkpoint-every", &every.to_string(), "--results-dir", &dir, "--quiet"].map(String::from));
        all
    };
    let (straight_dir, interrupted_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight_args = with_dir(straight_dir.path());
    let straight = run(bin, &straight_args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let straight = read_json(&straight_dir.path().join(results));

    let interrupted_args = with_dir(interrupted_dir.path());
    let interrupted_args: Vec<&str> = interrupted_args.iter().map(String::as_str).collect();
    let interrupted = run(bin, &interrupted_args, &[(how.hook.0, &how.hook.1)]);
    let said = format!("{}{}", stdout(&interrupted), stderr(&interrupted));
    assert_eq!(interrupted.status.code(), Some(how.exit_code), "{said}");
    assert!(!interrupted_dir.path().join(results).exists(), "an interrupted run writes no results");
    let resumed = run(bin, &interrupted_args, &[]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let out = stdout(&resumed);
    let resumed = read_json(&interrupted_dir.path().join(results));

    let (all, tail) = (losses(&straight), losses(&resumed));
    assert!(out.contains(&format!("(step {})", how.restored)), "resumed from the checkpoint of step {}: {out}", how.restored);
    assert_eq!(tail.len(), all.len() - how.restored, "the resumed run took the steps after {}", how.restored);
    assert_eq!(tail, all[how.restored..], "the resumed run's losses are the uninterrupted run's");
    assert_eq!(resumed["test_loss"], straight["test_loss"]);
    (said, out)
}

fn generated_cifar(dir: &Path, train: usize) {
    let out = run(
        env!("CARGO_BIN_EXE_prepare_data"),
        &["generate", "--dataset", "cifar10", "--train", &train.to_string(), "--test", "40", "--out", dir.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn an_image_run_killed_mid_epoch_resumes_exactly() {
    let data = shared_data("mnist-5k");
    // 4,000 digits in batches of 200: 20 steps an epoch, checkpoints at 6, 12, 18; killed after
    // step 16 of epoch 1 (steps 21..40 are epoch 2): killed after 28, resumed from 24.
    let args = ["--dataset", "mnist", "--data-dir", data.to_str().unwrap(), "--device", "cpu", "--threads", "1", "--epochs", "2", "--batch-size", "200"];
    let (_, out) = interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise1"), &args, 6, killed_after(28, 6), "exercise1-cnn-cpu.json");
    assert!(out.contains("after epoch 1 and 4 steps into epoch 2 (step 24)"), "{out}");
}

#[test]
fn a_language_model_with_dropout_killed_mid_epoch_resumes_exactly() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 40, 40]);
    let args = small_language_model(data.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise1_nlp"), &args, 4, killed_after(7, 4), "exercise1_nlp-transformer-cpu.json");
}

#[test]
fn a_pipeline_killed_mid_epoch_resumes_exactly() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [120, 30, 30]);
    let args = [
        "pipeline",
        "--data-dir",
        data.path().to_str().unwrap(),
        "--chunks",
        "2",
        "--devices",
        "cpu,cpu",
        "--epochs",
        "2",
        "--emsize",
        "16",
        "--d-hid",
        "32",
        "--nhead",
        "2",
        "--nlayers",
        "2",
        "--threads",
        "1",
    ];
    interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise3"), &args, 3, killed_after(5, 3), "exercise3_pipeline-transformer-cpu.json");
}

#[test]
fn two_data_parallel_ranks_killed_mid_epoch_resume_exactly() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 160);
    // 160 images over 2 ranks in batches of 16: 5 steps an epoch.
    let args = two_cnn_ranks(data.path(), "3");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise2"), &args, 3, killed_after(8, 3), "exercise2-cnn-cpu.json");
}

/// exercise2's CNN on 2 ranks in batches of 16 for `epochs` epochs of `data` (generated, 160
/// images: 5 steps an epoch).
fn two_cnn_ranks(data: &Path, epochs: &str) -> Vec<String> {
    let args = ["--model", "cnn", "--num-classes", "10", "--device", "cpu", "--threads", "1", "--workers", "0", "--batch-size", "16", "--epochs", epochs];
    let mut args: Vec<String> = args.map(String::from).to_vec();
    args.extend(["--nproc-per-node".into(), "2".into(), "--data-dir".into(), data.to_str().unwrap().into()]);
    args
}

/// The language model of these tests: 2 epochs of 200 lines, dropout on.
fn small_language_model(data: &Path) -> Vec<String> {
    let args = ["--device", "cpu", "--threads", "1", "--emsize", "16", "--d-hid", "32", "--nhead", "2", "--nlayers", "2", "--tokenizer", "whitespace"];
    let mut args: Vec<String> = args.map(String::from).to_vec();
    args.extend(["--epochs", "2", "--dropout", "0.2", "--data-dir"].map(String::from));
    args.push(data.to_str().unwrap().into());
    args
}

#[test]
fn sigterm_and_sigusr1_stop_at_a_step_with_a_checkpoint_that_resumes_exactly() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 40, 40]);
    let args = small_language_model(data.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    for (signal, step) in [("SIGTERM", 6), ("SIGUSR1", 9)] {
        // Checkpoints every 4 steps: the signal's own checkpoint is the one resumed from.
        let (said, _) =
            interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise1_nlp"), &args, 4, signalled_after(step, signal), "exercise1_nlp-transformer-cpu.json");
        assert!(said.contains(&format!("stopped by {signal} after step {step}: checkpointed to")), "{said}");
    }
}

#[test]
fn a_signal_to_one_rank_stops_every_rank_at_the_same_step() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 160);
    let args = two_cnn_ranks(data.path(), "3");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Rank 0 alone is signalled, after step 7 (mid-epoch 2); checkpoints every 5 would have
    // given step 5: the resume starts at 7, so both ranks stopped and saved there.
    let (said, _) = interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise2"), &args, 5, signalled_after(7, "SIGTERM"), "exercise2-cnn-cpu.json");
    assert!(said.contains("stopped by SIGTERM after step 7"), "{said}");
}

#[test]
fn max_steps_saves_its_last_step_and_a_longer_run_resumes_from_it() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 40, 40]);
    let base = small_language_model(data.path());
    let (straight, stepped) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let go = |dir: &Path, max_steps: &str| {
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        let dir = dir.to_str().unwrap();
        args.extend(["--max-steps", max_steps, "--checkpoint-dir", dir, "--resume", "--results-dir", dir, "--quiet"]);
        let out = run(env!("CARGO_BIN_EXE_exercise1_nlp"), &args, &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        (read_json(&Path::new(dir).join("exercise1_nlp-transformer-cpu.json")), stdout(&out))
    };
    let (all, _) = go(straight.path(), "11");
    go(stepped.path(), "5");
    let meta = common::checkpoint::load(&stepped.path().join("exercise1_nlp-transformer-cpu.safetensors")).unwrap().meta;
    assert_eq!((meta.step, meta.epoch), (5, 0), "--max-steps 5 saved its last step, in the first epoch");
    assert_eq!(meta.epoch_step, 5);
    let (rest, out) = go(stepped.path(), "11");
    assert!(out.contains("(step 5)"), "{out}");
    assert_eq!(losses(&rest), losses(&all)[5..]);
}

#[test]
fn a_torn_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 40, 40]);
    let base = small_language_model(data.path());
    let (straight, torn) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let go = |dir: &Path, env: &[(&str, &str)]| {
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        let dir = dir.to_str().unwrap();
        args.extend(["--checkpoint-every", "3", "--checkpoint-dir", dir, "--resume", "--results-dir", dir, "--quiet"]);
        run(env!("CARGO_BIN_EXE_exercise1_nlp"), &args, env)
    };
    assert!(go(straight.path(), &[]).status.success());
    let killed = go(torn.path(), &[(TEST_EXIT_AFTER_STEP, "7")]);
    assert_eq!(killed.status.code(), Some(137));
    // Checkpoints of steps 3 and 6 were written; the newest (6) is torn in half.
    let newest = torn.path().join("exercise1_nlp-transformer-cpu.safetensors");
    let previous = common::checkpoint::previous_path(&newest);
    assert_eq!(common::checkpoint::load(&previous).unwrap().meta.step, 3);
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    // A killed writer's temporary file is removed at the start.
    let stale = newest.with_file_name(format!("{}AbC123.tmp", common::output::temporary_prefix(&newest, 999_999_999)));
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    let resumed = go(torn.path(), &[]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let warned = stderr(&resumed);
    assert!(warned.contains("is corrupt") && warned.contains("resuming from the previous complete checkpoint"), "{warned}");
    assert!(warned.contains(".999999999.AbC123.tmp"), "the stale temporary file is named: {warned}");
    assert!(!stale.exists());
    assert!(stdout(&resumed).contains("(step 3)"));
    let name = "exercise1_nlp-transformer-cpu.json";
    assert_eq!(losses(&read_json(&torn.path().join(name))), losses(&read_json(&straight.path().join(name)))[3..]);
}

#[test]
fn checkpoint_minutes_agreed_over_the_ranks_checkpoint_when_due() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 160);
    let ck = tempfile::tempdir().unwrap();
    let mut args = two_cnn_ranks(data.path(), "1");
    // A period shorter than any step: due after every one, on every rank's clock.
    let dir = ck.path().to_str().unwrap().to_string();
    args.extend(["--checkpoint-minutes", "1e-9", "--checkpoint-dir", &dir, "--results-dir", &dir, "--quiet"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run(env!("CARGO_BIN_EXE_exercise2"), &args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = read_json(&ck.path().join("exercise2-cnn-cpu.json"));
    // 5 steps: after steps 1 to 4 by the clock, and the epoch's end (which step 5 is).
    assert_eq!(json["steps"], 5);
    assert_eq!(json["checkpoints"]["saved"], 5, "{}", json["checkpoints"]);
    let meta = common::checkpoint::load(&ck.path().join("exercise2-cnn-cpu.safetensors")).unwrap().meta;
    assert_eq!((meta.epoch, meta.epoch_step, meta.step), (1, 0, 5));
    let previous = common::checkpoint::load(&common::checkpoint::previous_path(&ck.path().join("exercise2-cnn-cpu.safetensors"))).unwrap().meta;
    assert_eq!((previous.epoch, previous.epoch_step, previous.step), (0, 4, 4), "the one before: step 4, by the clock");
}

/// exercise2's two CNN ranks (5 steps an epoch) with checkpoints in `ck`, for as many epochs as
/// it takes to stop them: started, and past their first epoch.
fn two_ranks_training(data: &Path, ck: &Path, more: &[&str]) -> Job {
    let mut args = two_cnn_ranks(data, "100000");
    let dir = ck.to_str().unwrap().to_string();
    args.extend(["--checkpoint-dir", &dir, "--results-dir", &dir, "--quiet"].map(String::from));
    args.extend(more.iter().map(|a| a.to_string()));
    let mut job = Job::start(Command::new(env!("CARGO_BIN_EXE_exercise2")).args(&args));
    assert!(job.wait_for_line("epoch 1/", Duration::from_secs(600)), "no epoch ended: {:?}", job.seen);
    job
}

/// The step of the newest checkpoint in `ck` (one file: a data-parallel run's).
fn newest_step(ck: &Path) -> usize {
    common::checkpoint::load(&ck.join("exercise2-cnn-cpu.safetensors")).unwrap().meta.step
}

/// A stop signal to any one process of a job stops every rank at one step, checkpointed there,
/// said once for the job (exit 75): SIGUSR1 to rank 1 alone, or SIGINT to the launcher, which
/// passes it on to every rank as SIGUSR1 (each rank used to say it had caught it: two lines).
#[test]
fn a_signal_to_any_process_of_a_job_stops_it_at_one_step_said_once() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 160);
    for target in ["rank 1", "the launcher"] {
        let ck = tempfile::tempdir().unwrap();
        let mut job = two_ranks_training(data.path(), ck.path(), &[]);
        match target {
            "rank 1" => signal(rank_process(job.id(), 1).expect("rank 1's process"), "-USR1"),
            _ => signal(job.id(), "-INT"),
        }
        // Generous: a step, a checkpoint and the ranks' exit, on loaded cores.
        let Some(status) = job.wait(Duration::from_secs(300)) else { panic!("{target}: the job went on after the signal: {}", job.kill_all()) };
        let err = job.stderr();
        assert_eq!(status.code(), Some(STOPPED_EXIT_CODE as i32), "{target}: {err}");
        let said: Vec<&str> = err.lines().filter(|l| l.starts_with("stopped by")).collect();
        assert_eq!(said.len(), 1, "{target}: once for the job: {err}");
        let step = newest_step(ck.path());
        assert!(said[0].starts_with(&format!("stopped by SIGUSR1 after step {step}: checkpointed to")), "{target}: its checkpoint is of its step: {err}");
    }
}

/// The launcher killed (SIGKILL) while its ranks train and checkpoint every step: no checkpoint
/// decided after its end is committed (they used to commit about 20 more in the second mpirun
/// took to end them). Independent of speed: the ranks and mpirun are stopped (SIGSTOP) while the
/// launcher is killed and reaped, then the ranks alone go on (mpirun, still stopped, cannot end
/// them), so that every step they take is after the launcher's end. At most two checkpoints
/// follow the newest committed when they were stopped: the one being written then, and the one
/// whose step was decided before (one write in flight at most). Without the watch, the ranks
/// train on and never end.
#[test]
fn ranks_whose_launcher_was_killed_commit_no_checkpoint_decided_after() {
    let (data, ck) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generated_cifar(data.path(), 160);
    let mut job = two_ranks_training(data.path(), ck.path(), &["--checkpoint-every", "1"]);
    let ranks: Vec<u32> = (0..2).map(|r| rank_process(job.id(), r).expect("the ranks' processes")).collect();
    let mpirun = parent_of(ranks[0]);
    for &pid in ranks.iter().chain([&mpirun]) {
        signal(pid, "-STOP");
    }
    // Stopped, the writers too: the newest committed checkpoint stays what it is.
    let before = newest_step(ck.path());
    job.kill_launcher();
    for &pid in &ranks {
        signal(pid, "-CONT");
    }
    let until = Instant::now() + Duration::from_secs(120);
    while !ranks.iter().all(|&pid| ended(pid)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let all_ended = ranks.iter().all(|&pid| ended(pid));
    let after = newest_step(ck.path());
    // Nothing left behind: the ranks (zombies of the stopped mpirun, or still training) and mpirun.
    for &pid in ranks.iter().chain([&mpirun]) {
        signal(pid, "-KILL");
    }
    assert!(all_ended, "the ranks trained on after their launcher's end: checkpoints of steps {before} to {after}");
    assert!(after <= before + 2, "checkpoints committed after the launcher's end: steps {before} to {after}");
}

/// Process `pid`'s parent, from /proc.
fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(1).unwrap().parse().unwrap()
}
