//! Safe on a shared cluster, where folders are shared with a project group and data come from
//! others: outputs never written through a planted link, images that would exhaust the memory or
//! block refused, indexes that reach outside their folder refused, one writer per run's
//! checkpoints, nothing evaluated that is not what it claims, every stop signal honoured, and one
//! clear line where something is wrong. Each test here failed on the tree the sweep looked at.
mod support;

use std::os::unix::fs::{symlink, FileTypeExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use support::{rank_process, read_json, signal, stderr, wikitext_sample, Job};

fn binary(name: &str) -> &'static str {
    match name {
        "exercise1" => env!("CARGO_BIN_EXE_exercise1"),
        "exercise1_nlp" => env!("CARGO_BIN_EXE_exercise1_nlp"),
        "exercise2" => env!("CARGO_BIN_EXE_exercise2"),
        "prepare_data" => env!("CARGO_BIN_EXE_prepare_data"),
        "checkpoint" => env!("CARGO_BIN_EXE_checkpoint"),
        "report" => env!("CARGO_BIN_EXE_report"),
        other => panic!("no binary {other}"),
    }
}

fn run(name: &str, args: &[&str]) -> Output {
    Command::new(binary(name)).args(args).env_remove("RUST_BACKTRACE").output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_link(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// A generated CIFAR-10 of `train` images in `dir`.
fn cifar(dir: &Path, train: usize) {
    let out = run("prepare_data", &["generate", "--dataset", "cifar10", "--train", &train.to_string(), "--test", "20", "--out", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A generated image folder of 2 classes × `train` small JPEGs (2 validation ones each).
fn photos(dir: &Path, train: usize) {
    let out = run(
        "prepare_data",
        &["generate-images", "--sizes", "small", "--classes", "2", "--train", &train.to_string(), "--val", "2", "--out", dir.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// exercise1 on the CPU (the rest of the flags given).
fn exercise1(data: &Path, results: &Path, more: &[&str]) -> Output {
    let mut args = vec!["--device", "cpu", "--quiet", "--threads", "1", "--data-dir", data.to_str().unwrap(), "--results-dir", results.to_str().unwrap()];
    args.extend(more);
    run("exercise1", &args)
}

/// The one error line of a failed run, checked to name every part of `says`.
fn one_error(out: &Output, code: i32, says: &[&str]) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(code), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "one error line:\n{err}");
    for part in says {
        assert!(errors[0].contains(part), "'{part}' not in: {}", errors[0]);
    }
    assert!(!err.contains("panicked") && !err.contains("memory allocation of"), "{err}");
    errors[0].to_string()
}

/// Runs `command` to its end, or kills it after `limit` (a run that blocks forever fails the
/// test instead of hanging it).
fn within(mut command: Command, limit: Duration) -> Output {
    let child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let started = Instant::now();
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    while !waiter.is_finished() {
        if started.elapsed() > limit {
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            let out = waiter.join().unwrap();
            panic!("still running after {limit:?} (killed): {}", stderr(&out));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    waiter.join().unwrap()
}

#[test]
fn outputs_are_never_written_through_links_planted_in_a_shared_folder() {
    let dir = tempfile::tempdir().unwrap();
    let (data, res, victim) = (dir.path().join("data"), dir.path().join("res"), dir.path().join("victim"));
    cifar(&data, 40);
    std::fs::create_dir(&res).unwrap();
    std::fs::write(&victim, "precious\n").unwrap();
    // What the writer used to name its temporary files (`<file>.tmp-<pid>-<n>`), planted for
    // the run's own pid (the shell's, which exec keeps), and links at the charts' final names.
    let plant = "for n in 0 1 2 3 4 5 6 7; do for f in exercise1-cnn-cpu.json exercise1-cnn-cpu.safetensors; do ln -s \"$V\" \"$R/$f.tmp-$$-$n\"; done; done; \
                 ln -s \"$V\" \"$R/exercise1-cnn-cpu.svg\"; exec \"$@\"";
    let out = Command::new("sh")
        .args([
            "-c",
            plant,
            "plant",
            binary("exercise1"),
            "--device",
            "cpu",
            "--quiet",
            "--threads",
            "1",
            "--epochs",
            "1",
            "--batch-size",
            "20",
            "--max-steps",
            "2",
        ])
        .args(["--data-dir", data.to_str().unwrap(), "--results-dir", res.to_str().unwrap(), "--checkpoint-dir", res.to_str().unwrap()])
        .env("V", &victim)
        .env("R", &res)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n", "a planted link was written through");
    for name in ["exercise1-cnn-cpu.json", "exercise1-cnn-cpu.safetensors", "exercise1-cnn-cpu.svg"] {
        assert!(!is_link(&res.join(name)) && res.join(name).is_file(), "{name} is the run's own file");
    }
    assert!(std::fs::read_to_string(res.join("exercise1-cnn-cpu.svg")).unwrap().starts_with("<svg"));
    assert!(!std::fs::read_dir(&res).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with(".write-test")), "the folder probe is gone");

    // The results table that runs append to: a link there is refused before training.
    let res2 = dir.path().join("res2");
    std::fs::create_dir(&res2).unwrap();
    symlink(&victim, res2.join("exercise1.csv")).unwrap();
    let out = exercise1(&data, &res2, &["--batch-size", "20", "--max-steps", "2"]);
    one_error(&out, 2, &["exercise1.csv is a symbolic link"]);
    assert!(!res2.join("exercise1-cnn-cpu.json").exists(), "refused before training");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
}

/// A copy of `jpeg` whose frame header claims `width` × `height` pixels.
fn claiming(jpeg: &[u8], width: u16, height: u16) -> Vec<u8> {
    let mut bytes = jpeg.to_vec();
    let sof = bytes.windows(2).position(|w| w[0] == 0xFF && (0xC0..=0xC2).contains(&w[1])).expect("a JPEG frame header");
    bytes[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
    bytes[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
    bytes
}

#[test]
fn images_that_would_exhaust_the_memory_or_block_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("photos");
    photos(&data, 3);
    let class = data.join("train/c000");
    let first = std::fs::read_dir(&class).unwrap().flatten().map(|e| e.path()).min().unwrap();
    let results = dir.path().join("results");
    let train = |extra: &Path| {
        let mut command = Command::new("sh");
        // 6 GB of address space (LibTorch maps much of it itself): the 60000 × 60000 image alone
        // would take 10.8 GB decoded.
        command
            .args(["-c", "ulimit -v 6000000 && exec \"$@\"", "limited", binary("exercise1")])
            .args(["--device", "cpu", "--quiet", "--threads", "1", "--workers", "1", "--model", "resnet50", "--image-size", "32", "--batch-size", "4"])
            .args(["--max-steps", "2", "--epochs", "1", "--dataset", "imagefolder", "--data-dir", data.to_str().unwrap(), "--results-dir"])
            .arg(&results)
            .env_remove("RUST_BACKTRACE");
        let out = within(command, Duration::from_secs(300));
        std::fs::remove_file(extra).unwrap();
        out
    };

    // A 5 kB JPEG whose header claims 60000 × 60000 pixels: refused before it is decoded.
    let bomb = class.join("aaa-bomb.jpg");
    std::fs::write(&bomb, claiming(&std::fs::read(&first).unwrap(), 60000, 60000)).unwrap();
    one_error(&train(&bomb), 1, &["aaa-bomb.jpg", "60000 × 60000", "more than the 178956970 allowed"]);

    // An image file larger than any image (an 8 GB sparse file): refused, not read.
    let sparse = class.join("aaa-sparse.jpg");
    std::fs::File::create(&sparse).unwrap().set_len(8 << 30).unwrap();
    one_error(&train(&sparse), 1, &["aaa-sparse.jpg is 8589934592 bytes, more than the 268435456"]);

    // A link to /dev/zero and a FIFO with an image's name: refused at the listing (a FIFO
    // used to block the run forever).
    let zero = class.join("aaa-zero.jpg");
    symlink("/dev/zero", &zero).unwrap();
    one_error(&train(&zero), 1, &["aaa-zero.jpg is not a regular file"]);
    let fifo = class.join("aaa-fifo.jpg");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    one_error(&train(&fifo), 1, &["aaa-fifo.jpg is not a regular file"]);
}

#[test]
fn a_symbolic_link_loop_in_an_image_folder_is_listed_once_and_said() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("photos");
    photos(&data, 6);
    symlink("..", data.join("train/c000/loop")).unwrap();
    let shards = dir.path().join("shards");
    let out = run("prepare_data", &["pack", "--data-dir", data.to_str().unwrap(), "--out", shards.to_str().unwrap(), "--shard-size", "100"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // 2 classes × 6 images, not the same images again and again under c000's label.
    assert!(stdout(&out).contains("train: 12 samples of 2 classes"), "{}", stdout(&out));
    assert!(stderr(&out).contains("1 folder(s) reached again through a symbolic link were skipped") && stderr(&out).contains("c000/loop"), "{}", stderr(&out));
    let results = dir.path().join("results");
    let out = exercise1(
        &data,
        &results,
        &["--model", "resnet50", "--image-size", "32", "--batch-size", "4", "--max-steps", "1", "--epochs", "1", "--dataset", "imagefolder"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("were skipped"), "{}", stderr(&out));
}

#[test]
fn checkpoint_export_never_replaces_a_checkpoint_of_its_run() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck) = (dir.path().join("data"), dir.path().join("ck"));
    cifar(&data, 40);
    // Two epochs: the first checkpoint is kept as the previous one.
    let out = exercise1(&data, &ck, &["--batch-size", "20", "--max-steps", "4", "--epochs", "2", "--checkpoint-dir", ck.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let checkpoint = ck.join("exercise1-cnn-cpu.safetensors");
    let previous = ck.join("exercise1-cnn-cpu.previous.safetensors");
    let before = (std::fs::read(&checkpoint).unwrap(), std::fs::read(&previous).unwrap());
    let same_through_dots = ck.join("..").join("ck").join("exercise1-cnn-cpu.safetensors");
    for out_path in [&checkpoint, &previous, &same_through_dots, &ck.join("exercise1-cnn-cpu-epoch1.safetensors")] {
        let out = run("checkpoint", &["export", checkpoint.to_str().unwrap(), out_path.to_str().unwrap()]);
        one_error(&out, 2, &["exporting there would replace what the export reads"]);
    }
    assert_eq!((std::fs::read(&checkpoint).unwrap(), std::fs::read(&previous).unwrap()), before, "nothing was touched");
    let model = dir.path().join("model.safetensors");
    let out = run("checkpoint", &["export", checkpoint.to_str().unwrap(), model.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// The safetensors file `path` with its first tensor's entry given a second time in its header:
/// the same name, shape and place, so the safetensors crate alone takes the file as it was.
fn with_an_entry_twice(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + length]).unwrap().trim_end();
    let table: serde_json::Map<String, serde_json::Value> = serde_json::from_str(header).unwrap();
    let (name, entry) = table.iter().find(|(name, _)| *name != "__metadata__").unwrap();
    let twice = format!("{},{}:{}}}", header.strip_suffix('}').unwrap(), serde_json::to_string(name).unwrap(), entry);
    let mut out = (twice.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(twice.as_bytes());
    out.extend_from_slice(&bytes[8 + length..]);
    std::fs::write(path, out).unwrap();
}

/// A name given twice where one is meant, in a checkpoint's or a weights file's tensor table or
/// in a results table's header, was taken silently (the last one won): refused, naming it.
#[test]
fn a_tensor_or_a_column_named_twice_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck) = (dir.path().join("data"), dir.path().join("ck"));
    cifar(&data, 40);
    let out = exercise1(&data, &ck, &["--batch-size", "20", "--max-steps", "1", "--checkpoint-dir", ck.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let checkpoint = ck.join("exercise1-cnn-cpu.safetensors");
    let model = dir.path().join("model.safetensors");
    let out = run("checkpoint", &["export", checkpoint.to_str().unwrap(), model.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    with_an_entry_twice(&checkpoint);
    with_an_entry_twice(&model);
    let out = run("checkpoint", &["show", checkpoint.to_str().unwrap()]);
    one_error(&out, 1, &[&checkpoint.display().to_string(), "is given twice"]);
    let out = exercise1(&data, &dir.path().join("r"), &["--batch-size", "20", "--max-steps", "1", "--weights", model.to_str().unwrap()]);
    one_error(&out, 1, &[&model.display().to_string(), "is given twice"]);
    // A results table with a column named twice.
    let benches = dir.path().join("benches");
    std::fs::create_dir(&benches).unwrap();
    let committed = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../results/bench-ps.csv")).unwrap();
    let twice: String = committed.lines().enumerate().map(|(i, line)| format!("{line},{}\n", if i == 0 { "strategy" } else { "ps-sync" })).collect();
    std::fs::write(benches.join("bench-ps.csv"), twice).unwrap();
    let out = run("report", &["ps", "--results-dir", benches.to_str().unwrap()]);
    one_error(&out, 1, &["bench-ps.csv", "the column `strategy` is named twice"]);
    std::fs::write(benches.join("bench-ps.csv"), committed).unwrap();
    let out = run("report", &["ps", "--results-dir", benches.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_second_run_on_one_runs_checkpoints_is_refused_while_the_first_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck) = (dir.path().join("data"), dir.path().join("ck"));
    cifar(&data, 200);
    let args = |results: &str| -> Vec<String> {
        let mut args: Vec<String> =
            ["--device", "cpu", "--quiet", "--threads", "1", "--batch-size", "10", "--epochs", "30"].iter().map(|s| s.to_string()).collect();
        args.extend(["--data-dir".into(), data.display().to_string(), "--checkpoint-dir".into(), ck.display().to_string()]);
        args.extend(["--results-dir".into(), dir.path().join(results).display().to_string()]);
        args
    };
    let mut first = Command::new(binary("exercise1")).args(args("first")).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    // Stopped (SIGSTOP) once it holds the run's lock: whatever this machine's speed, it is
    // writing that run when the second starts.
    let lock = ck.join("exercise1-cnn-cpu.lock");
    let started = Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|t| t.starts_with(&first.id().to_string())) {
        assert!(started.elapsed() < Duration::from_secs(300) && first.try_wait().unwrap().is_none(), "the first run never took its lock");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGSTOP) }, 0);
    let second = Command::new(binary("exercise1")).args(args("second")).env_remove("RUST_BACKTRACE").output().unwrap();
    unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGCONT) };
    let line = one_error(&second, 2, &["run exercise1-cnn-cpu is being written there by process", &first.id().to_string(), "exercise1-cnn-cpu.lock"]);
    println!("{line}");
    unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGTERM) };
    let status = first.wait().unwrap();
    // The first run, stopped by its SIGTERM, checkpointed and ended as a stopped run does.
    assert_eq!(status.code(), Some(75), "{status:?}");
    // Its lock went with it: a third run takes the run's checkpoints and resumes them.
    let mut third = args("third");
    third.extend(["--resume".into(), "--max-steps".into(), "1".into()]);
    let out = Command::new(binary("exercise1")).args(third).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A sharded checkpoint of a small language model (2 ZeRO-3 ranks) in `ck`; its step folder.
fn sharded_checkpoint(data: &Path, ck: &Path) -> PathBuf {
    let out = run(
        "exercise1_nlp",
        &["--device", "cpu", "--quiet", "--emsize", "16", "--d-hid", "32", "--nhead", "2", "--nlayers", "1", "--tokenizer", "whitespace", "--max-steps", "3"]
            .iter()
            .copied()
            .chain(["--epochs", "1", "--nproc-per-node", "2", "--zero", "3", "--checkpoint-format", "sharded", "--data-dir", data.to_str().unwrap()])
            .chain(["--checkpoint-dir", ck.to_str().unwrap(), "--results-dir", ck.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let run_folder = ck.join("exercise1_nlp-transformer-cpu.shards");
    std::fs::read_dir(&run_folder).unwrap().flatten().map(|e| e.path()).find(|p| p.join("checkpoint.json").exists()).expect("a committed step")
}

#[test]
fn indexes_that_reach_outside_their_folder_or_were_tampered_with_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Shards: a name outside the folder, and a shard listed twice.
    let data = dir.path().join("photos");
    photos(&data, 4);
    let shards = dir.path().join("shards");
    let out = run("prepare_data", &["pack", "--data-dir", data.to_str().unwrap(), "--out", shards.to_str().unwrap(), "--shard-size", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let index_path = shards.join("shards.json");
    let index: serde_json::Value = read_json(&index_path);
    let tampered = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let mut copy = index.clone();
        edit(&mut copy);
        std::fs::write(&index_path, copy.to_string()).unwrap();
        let out = exercise1(
            &shards,
            &dir.path().join("r"),
            &["--model", "resnet50", "--image-size", "32", "--batch-size", "2", "--max-steps", "1", "--epochs", "1", "--dataset", "shards"],
        );
        one_error(&out, 1, &["shards.json", says]);
    };
    tampered(&|i| i["splits"]["train"][0]["file"] = "../outside.tar".into(), "\"../outside.tar\", not a file name in its folder");
    tampered(&|i| i["splits"]["train"][0]["file"] = "/etc/passwd".into(), "not a file name in its folder");
    tampered(
        &|i| {
            let first = i["splits"]["train"][0].clone();
            i["splits"]["train"][1] = first;
        },
        "twice",
    );

    // A sharded checkpoint's index: a piece in another folder, a region past its tensor, and
    // a flipped byte in a rank file.
    let text = dir.path().join("text");
    std::fs::create_dir(&text).unwrap();
    wikitext_sample(&text, [120, 20, 20]);
    let ck = dir.path().join("ck");
    let step = sharded_checkpoint(&text, &ck);
    let index_path = step.join("checkpoint.json");
    let original = std::fs::read_to_string(&index_path).unwrap();
    let export = |says: &str| {
        let out = run("checkpoint", &["export", step.to_str().unwrap(), dir.path().join("model.safetensors").to_str().unwrap()]);
        one_error(&out, 1, &[says]);
    };
    let mut index: serde_json::Value = serde_json::from_str(&original).unwrap();
    let piece = &mut index["tensors"]["model.embedding.weight"]["pieces"][0];
    piece["file"] = "../step-elsewhere/rank-00000.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    export("not one of its 2 rank files");
    let mut index: serde_json::Value = serde_json::from_str(&original).unwrap();
    index["tensors"]["model.embedding.weight"]["pieces"][0]["region"]["flat"] = serde_json::json!([0, 1_000_000_000]);
    std::fs::write(&index_path, index.to_string()).unwrap();
    export("does not fit");
    std::fs::write(&index_path, &original).unwrap();
    let rank_file = step.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&rank_file).unwrap();
    let last = bytes.len() - 5;
    bytes[last] ^= 0x40;
    std::fs::write(&rank_file, bytes).unwrap();
    export("is damaged (checksum");
}

#[test]
fn eval_only_and_resume_refuse_what_is_not_the_checkpoint_they_claim() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck, results) = (dir.path().join("data"), dir.path().join("ck"), dir.path().join("results"));
    cifar(&data, 40);
    // A folder without a checkpoint: nothing to evaluate (a fresh model used to be).
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = exercise1(&data, &results, &["--batch-size", "20", "--eval-only", "--checkpoint", empty.to_str().unwrap()]);
    one_error(&out, 2, &["--eval-only: no checkpoint at", "empty"]);
    assert!(!results.join("exercise1-cnn-cpu.eval-only.json").exists());

    // A checkpoint whose weights hold a NaN (a diverged run's).
    let out = exercise1(&data, &ck, &["--batch-size", "20", "--max-steps", "2", "--epochs", "1", "--checkpoint-dir", ck.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let checkpoint = ck.join("exercise1-cnn-cpu.safetensors");
    let mut bytes = std::fs::read(&checkpoint).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header["model.fc1.weight"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header_len;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&checkpoint, bytes).unwrap();
    let out = exercise1(&data, &results, &["--batch-size", "20", "--eval-only", "--checkpoint", checkpoint.to_str().unwrap()]);
    one_error(&out, 1, &["holds NaN or infinite values in fc1.weight", "not evaluating it"]);
    assert!(!results.join("exercise1-cnn-cpu.eval-only.json").exists());
}

#[test]
fn a_language_model_resumes_only_on_the_vocabulary_it_was_trained_on() {
    let dir = tempfile::tempdir().unwrap();
    let (text, ck) = (dir.path().join("text"), dir.path().join("ck"));
    std::fs::create_dir(&text).unwrap();
    wikitext_sample(&text, [120, 20, 20]);
    let lm = |more: &[&str]| {
        let mut args = vec!["--device", "cpu", "--quiet", "--emsize", "16", "--d-hid", "32", "--nhead", "2", "--nlayers", "1", "--tokenizer", "whitespace"];
        args.extend(["--data-dir", text.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()]);
        args.extend(["--results-dir", ck.to_str().unwrap()]);
        args.extend(more);
        run("exercise1_nlp", &args)
    };
    let out = lm(&["--epochs", "1", "--max-steps", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Another seed: resumed, and said.
    let out = lm(&["--resume", "--epochs", "2", "--max-steps", "3", "--seed", "7"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("was written by a run with --seed 42, this one has --seed 7"), "{}", stderr(&out));
    // The same number of words, but one of them another word: every id past it means another.
    for split in ["train.txt", "valid.txt", "test.txt"] {
        let path = text.join(split);
        let changed = std::fs::read_to_string(&path).unwrap().replace(" the ", " thé ");
        std::fs::write(&path, changed).unwrap();
    }
    let out = lm(&["--resume", "--epochs", "3", "--max-steps", "4"]);
    one_error(&out, 2, &["was trained on other data", "vocabulary_crc32c", "use the same --data-dir and --tokenizer"]);
}

#[test]
fn stop_signals_end_parameter_server_runs_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    cifar(&data, 200);
    let ps = |mode: &str, ck: &Path, more: &[&str], env: &[(&str, &str)]| {
        let mut command = Command::new(binary("exercise2"));
        command
            .args(["--device", "cpu", "--quiet", "--model", "cnn", "--batch-size", "10", "--nproc-per-node", "3", "--strategy", "parameter-server", mode])
            .args(["--data-dir", data.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap(), "--results-dir", ck.to_str().unwrap()])
            .args(more)
            .env_remove("RUST_BACKTRACE");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().unwrap()
    };
    // Synchronous workers step together: Slurm's warning signal to rank 0 after step 3 stops
    // every rank there, with a checkpoint (exit 75), and the run resumes from it.
    let ck = dir.path().join("sync");
    let out = ps("--sync", &ck, &["--epochs", "2"], &[("COURSE_TEST_SIGNAL_AFTER_STEP", "3:SIGUSR1")]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains("stopped by SIGUSR1"), "{}", stderr(&out));
    let meta = |ck: &Path| {
        let out = run("checkpoint", &["show", ck.join("exercise2-cnn-cpu.safetensors").to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert!(meta(&ck).contains("step 3"), "{}", meta(&ck));
    let out = ps("--sync", &ck, &["--epochs", "2", "--resume"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Its first epoch's figures are over the steps since the resume, and it says so.
    assert!(stdout(&out).contains("(resumed after its step 3: train figures over the steps since)"), "{}", stdout(&out));
    // Asynchronous workers never wait for each other: they stop at the end of the epoch the
    // signal came in, with that epoch's checkpoint.
    let ck = dir.path().join("async");
    let out = ps("--async", &ck, &["--epochs", "3"], &[("COURSE_TEST_SIGNAL_AFTER_STEP", "2:SIGUSR1")]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(meta(&ck).contains("epoch 1"), "{}", meta(&ck));

    // Ctrl-C to the launcher: it says where asynchronous workers stop, and they stop there.
    use std::io::{BufRead, BufReader};
    let ck = dir.path().join("launcher");
    let mut job = Command::new(binary("exercise2"))
        .args(["--device", "cpu", "--model", "cnn", "--batch-size", "10", "--nproc-per-node", "3", "--strategy", "parameter-server", "--async"])
        .args(["--epochs", "100000", "--data-dir", data.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap(), "--results-dir", ck.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(job.stdout.take().unwrap()).lines().map_while(Result::ok);
    for line in lines {
        if line.contains("epoch 1/") {
            break;
        }
    }
    assert_eq!(unsafe { libc::kill(job.id() as libc::pid_t, libc::SIGINT) }, 0);
    let out = job.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains("SIGINT: the asynchronous workers stop at the end of this epoch"), "{}", stderr(&out));
}

/// SIGUSR1 to the parameter server alone (rank 2 of 3) stops the job as one to a worker does:
/// the workers read it in the server's replies, agree on a step and checkpoint it there (exit
/// 75, said once). The server used to ignore it and serve on.
#[test]
fn a_signal_to_the_parameter_server_alone_stops_the_job_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck) = (dir.path().join("data"), dir.path().join("ck"));
    cifar(&data, 200);
    let mut job = Job::start(
        Command::new(binary("exercise2"))
            .args(["--device", "cpu", "--quiet", "--model", "cnn", "--batch-size", "10", "--nproc-per-node", "3", "--strategy", "parameter-server", "--sync"])
            .args(["--epochs", "100000", "--data-dir", data.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap(), "--results-dir", ck.to_str().unwrap()])
            .env_remove("RUST_BACKTRACE"),
    );
    assert!(job.wait_for_line("epoch 1/", Duration::from_secs(600)), "no epoch ended: {:?}", job.seen);
    signal(rank_process(job.id(), 2).expect("the server's process"), "-USR1");
    // Generous: a step, a checkpoint and the ranks' exit, on loaded cores.
    let Some(status) = job.wait(Duration::from_secs(300)) else { panic!("the job went on after the server's signal: {}", job.kill_all()) };
    let err = job.stderr();
    assert_eq!(status.code(), Some(75), "{err}");
    let said: Vec<&str> = err.lines().filter(|l| l.starts_with("stopped by")).collect();
    assert_eq!(said.len(), 1, "once for the job: {err}");
    let step = common::checkpoint::load(&ck.join("exercise2-cnn-cpu.safetensors")).unwrap().meta.step;
    assert!(said[0].starts_with(&format!("stopped by SIGUSR1 after step {step}: checkpointed to")), "its checkpoint is of its step: {err}");
}

#[test]
fn what_can_be_said_before_training_is_said_then_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    cifar(&data, 40);
    let results = dir.path().join("results");
    // A file given as the data folder, or a folder as the weights file.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    one_error(&exercise1(&file, &results, &[]), 1, &["is a file, not a folder"]);
    one_error(
        &exercise1(&data, &results, &["--batch-size", "20", "--weights", dir.path().to_str().unwrap()]),
        1,
        &["is not a regular file (a folder)", "--weights"],
    );
    // --requeue on outside Slurm, --tensorboard on a file: usage errors before the first step.
    let out = Command::new(binary("exercise1"))
        .args([
            "--device",
            "cpu",
            "--quiet",
            "--batch-size",
            "20",
            "--max-steps",
            "1",
            "--requeue",
            "on",
            "--data-dir",
            data.to_str().unwrap(),
            "--results-dir",
        ])
        .arg(&results)
        .env_remove("SLURM_JOB_ID")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    one_error(&out, 2, &["--requeue on: not running in a Slurm job"]);
    one_error(
        &exercise1(&data, &results, &["--batch-size", "20", "--max-steps", "1", "--tensorboard", file.to_str().unwrap()]),
        2,
        &["--tensorboard", "a file, not a folder"],
    );
    assert!(!results.join("exercise1-cnn-cpu.json").exists(), "nothing trained");
    // --workers far beyond the cores: capped, with a warning, and the run goes on.
    let images = dir.path().join("photos");
    photos(&images, 2);
    let out = exercise1(
        &images,
        &results,
        &[
            "--model",
            "resnet50",
            "--image-size",
            "32",
            "--batch-size",
            "2",
            "--max-steps",
            "1",
            "--epochs",
            "1",
            "--dataset",
            "imagefolder",
            "--workers",
            "100000",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("warning: --workers 100000 is more than the"), "{}", stderr(&out));
}

#[test]
fn a_data_set_larger_than_the_memory_left_is_one_line_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = run("prepare_data", &["generate", "--dataset", "cifar10", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The full training split (150 MB) in an address space LibTorch leaves too little of.
    let out = Command::new("sh")
        .args(["-c", "ulimit -v 2900000 && exec \"$@\"", "limited", binary("exercise1"), "--device", "cpu", "--quiet", "--max-steps", "1", "--data-dir"])
        .arg(&data)
        .arg("--results-dir")
        .arg(dir.path().join("results"))
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    if out.status.success() {
        println!("this machine's LibTorch left room for the data set under 2.9 GB: nothing to refuse here");
        return;
    }
    let line = one_error(&out, 1, &[]);
    assert!(line.contains("do not fit in the memory") || line.contains("out of memory"), "{line}");
}

/// What is planted at a name in the tests below.
#[derive(Debug, Clone, Copy)]
enum Planted {
    /// A symbolic link to a victim file (or, at a folder's name, a victim folder).
    Link,
    Fifo,
    /// A folder (or, at a folder's name, a regular file).
    Other,
}

/// Plants `what` at `path`; `folder`: the run makes a folder there.
fn plant(path: &Path, what: Planted, folder: bool, victims: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    match (what, folder) {
        (Planted::Link, false) => symlink(victims.join("file"), path).unwrap(),
        (Planted::Link, true) => symlink(victims.join("folder"), path).unwrap(),
        (Planted::Fifo, _) => assert!(Command::new("mkfifo").arg(path).status().unwrap().success()),
        (Planted::Other, false) => std::fs::create_dir(path).unwrap(),
        (Planted::Other, true) => std::fs::write(path, "someone's file\n").unwrap(),
    }
}

/// The names a run of exercise1 with every output on writes into `out`, as the writer itself
/// lists them (`COURSE_WRITTEN_LOG`), relative to `out`, each with whether it is a folder; names
/// inside a folder the run makes (its TensorBoard event file, its checkpoint's step folders) are
/// the folder's. Also the run's exit status and its stderr.
fn run_with_every_output(data: &Path, out: &Path, log: &Path) -> Output {
    let tb = out.join("tb");
    let mut command = Command::new(binary("exercise1"));
    command
        .args(["--device", "cpu", "--quiet", "--threads", "1", "--epochs", "1", "--batch-size", "20", "--max-steps", "2", "--profile"])
        .args(["--checkpoint-format", "sharded"])
        .arg("--data-dir")
        .arg(data)
        .arg("--results-dir")
        .arg(out)
        .arg("--checkpoint-dir")
        .arg(out.join("ck"))
        .arg("--tensorboard")
        .arg(&tb)
        .env(common::output::WRITTEN_LOG, log)
        .env_remove("RUST_BACKTRACE");
    within(command, Duration::from_secs(300))
}

fn written_names(out: &Path, log: &Path) -> Vec<(PathBuf, bool)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let paths: Vec<PathBuf> = text.lines().map(PathBuf::from).collect();
    let folders: Vec<&PathBuf> = paths.iter().filter(|p| p.is_dir()).collect();
    let mut names: Vec<(PathBuf, bool)> = Vec::new();
    for path in &paths {
        if folders.iter().any(|f| path != *f && path.starts_with(f)) {
            continue;
        }
        let name = path.strip_prefix(out).unwrap_or_else(|_| panic!("{} was written outside the run's folders", path.display())).to_path_buf();
        if !names.iter().any(|(n, _)| *n == name) {
            names.push((name, path.is_dir()));
        }
    }
    names
}

#[test]
fn every_name_a_run_writes_refuses_a_link_a_fifo_or_a_folder_planted_there() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    cifar(&data, 40);
    let victims = dir.path().join("victims");
    std::fs::create_dir_all(victims.join("folder")).unwrap();
    std::fs::write(victims.join("file"), "precious\n").unwrap();

    // A clean run: what it writes, from the writer's own list.
    let (clean, log) = (dir.path().join("clean"), dir.path().join("clean.log"));
    let out = run_with_every_output(&data, &clean, &log);
    assert!(out.status.success(), "{}", stderr(&out));
    let names = written_names(&clean, &log);
    let listed: Vec<String> = names.iter().map(|(n, f)| format!("{}{}", n.display(), if *f { "/" } else { "" })).collect();
    for expected in [
        "exercise1-cnn-cpu.json",
        "exercise1.csv",
        "exercise1-cnn-cpu.svg",
        "exercise1-cnn-cpu.trace.json",
        "exercise1-cnn-cpu.profile.md",
        "tb/exercise1-cnn-cpu/",
    ] {
        assert!(listed.iter().any(|l| l == expected), "{expected} is not among what the writer listed: {listed:?}");
    }
    assert!(listed.iter().any(|l| l.starts_with("ck/")), "the checkpoint is listed: {listed:?}");

    // Then each name in turn, with a link, a FIFO and a folder (a file at a folder's name) there.
    let mut tried = 0;
    for (name, folder) in &names {
        for what in [Planted::Link, Planted::Fifo, Planted::Other] {
            let out_dir = dir.path().join(format!("try-{tried}"));
            let log = dir.path().join(format!("try-{tried}.log"));
            tried += 1;
            let path = out_dir.join(name);
            plant(&path, what, *folder, &victims);
            let out = run_with_every_output(&data, &out_dir, &log);
            let err = stderr(&out);
            let case = format!("{what:?} at {}{}", name.display(), if *folder { "/" } else { "" });
            assert!(!err.contains("panicked"), "{case}: {err}");
            assert_eq!(std::fs::read_to_string(victims.join("file")).unwrap(), "precious\n", "{case}: written through");
            assert_eq!(std::fs::read_dir(victims.join("folder")).unwrap().count(), 0, "{case}: written into the victim folder");
            let replaced_link = matches!(what, Planted::Link) && !folder && out.status.success();
            if replaced_link {
                // A link at a file written whole is replaced by the run's own file, never followed.
                assert!(!is_link(&path) && path.is_file(), "{case}: the run's own file is there now");
                continue;
            }
            // Everything else is refused before the first step, naming the name: nothing written.
            let line = one_error(&out, 2, &[&path.display().to_string()]);
            assert!(
                ["symbolic link", "a FIFO", "a folder", "a regular file"].iter().any(|word| line.contains(word)),
                "{case}: the line says what is there: {line}"
            );
            let wrote = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(wrote.is_empty(), "{case}: refused before the first step, yet it wrote:\n{wrote}");
            match what {
                Planted::Fifo => assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_fifo(), "{case}: left as it was"),
                Planted::Link => assert!(is_link(&path), "{case}: left as it was"),
                Planted::Other => assert_eq!(path.is_dir(), !folder, "{case}: left as it was"),
            }
        }
    }
    println!("{tried} plantings at the {} names the run wrote", names.len());
}

#[test]
fn checkpoint_export_never_replaces_a_device_node_or_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let (data, res) = (dir.path().join("data"), dir.path().join("res"));
    cifar(&data, 40);
    let out = exercise1(&data, &res, &["--batch-size", "20", "--max-steps", "1", "--epochs", "1", "--checkpoint-dir", res.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ck = res.join("exercise1-cnn-cpu.safetensors");
    let fifo = dir.path().join("fifo.safetensors");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let mut targets = vec![(fifo, "a FIFO")];
    // A device node as /dev/full is (char 1:7), made in the temporary folder: root only.
    if unsafe { libc::geteuid() } == 0 {
        let node = dir.path().join("full");
        assert!(Command::new("mknod").arg(&node).args(["c", "1", "7"]).status().unwrap().success());
        targets.push((node, "a device"));
    } else {
        println!("not root: no device node to make; the FIFO takes the same path through the writer");
    }
    for (target, kind) in targets {
        let out = within(
            {
                let mut c = Command::new(binary("checkpoint"));
                c.arg("export").arg(&ck).arg(&target).env_remove("RUST_BACKTRACE");
                c
            },
            Duration::from_secs(60),
        );
        one_error(&out, 2, &[&target.display().to_string(), &format!("is {kind}, not a regular file")]);
        let meta = std::fs::symlink_metadata(&target).unwrap();
        assert!(!meta.is_file(), "{kind} left in place");
    }
}

#[test]
fn readers_refuse_a_fifo_at_once_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (data, res) = (dir.path().join("data"), dir.path().join("res"));
    cifar(&data, 40);
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo_s = fifo.to_str().unwrap();
    // A checkpoint folder whose run checkpoint is a FIFO, for --resume.
    let ck = dir.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    assert!(Command::new("mkfifo").arg(ck.join("exercise1-cnn-cpu.safetensors")).status().unwrap().success());
    // A shard folder whose index is a FIFO.
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    assert!(Command::new("mkfifo").arg(shards.join("shards.json")).status().unwrap().success());
    let base = ["--device", "cpu", "--quiet", "--batch-size", "20", "--max-steps", "1", "--epochs", "1"];
    let d = data.to_str().unwrap();
    let r = res.to_str().unwrap();
    let cases: Vec<(&str, Vec<&str>, String)> = vec![
        ("checkpoint", vec!["show", fifo_s], fifo.display().to_string()),
        ("exercise1", [&base[..], &["--data-dir", d, "--results-dir", r, "--eval-only", "--checkpoint", fifo_s]].concat(), fifo.display().to_string()),
        (
            "exercise1",
            [&base[..], &["--data-dir", d, "--results-dir", r, "--checkpoint-dir", ck.to_str().unwrap(), "--resume"]].concat(),
            "exercise1-cnn-cpu.safetensors".into(),
        ),
        (
            "exercise1",
            [&base[..], &["--data-dir", shards.to_str().unwrap(), "--results-dir", r, "--dataset", "shards", "--model", "resnet50"]].concat(),
            "shards.json".into(),
        ),
        ("exercise1", [&base[..], &["--data-dir", d, "--results-dir", r, "--weights", fifo_s]].concat(), fifo.display().to_string()),
        ("exercise1", [&base[..], &["--data-dir", d, "--results-dir", r, "--config", fifo_s]].concat(), fifo.display().to_string()),
    ];
    for (bin, args, names) in cases {
        let mut command = Command::new(binary(bin));
        command.args(&args).env_remove("RUST_BACKTRACE");
        let out = within(command, Duration::from_secs(120));
        let err = stderr(&out);
        assert!(matches!(out.status.code(), Some(1 | 2)), "{bin} {args:?}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{bin} {args:?}: one error line:\n{err}");
        // (--resume's FIFO is also a name the run writes: the check before the first step says so.)
        assert!(errors[0].contains(&names) && errors[0].contains("a FIFO"), "{bin} {args:?}: {}", errors[0]);
    }
}

#[test]
fn generated_data_never_replace_data_the_tool_did_not_generate_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("mnist");
    std::fs::create_dir(&real).unwrap();
    // What `make data` would have downloaded (any bytes: it is not read), no GENERATED.txt.
    for name in ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"] {
        std::fs::write(real.join(name), format!("the real {name}\n")).unwrap();
    }
    let out_dir = real.to_str().unwrap();
    let out = run("prepare_data", &["generate", "--dataset", "mnist", "--train", "10", "--test", "10", "--out", out_dir]);
    one_error(&out, 2, &[out_dir, "did not generate", "--force"]);
    assert_eq!(std::fs::read_to_string(real.join("train-images-idx3-ubyte")).unwrap(), "the real train-images-idx3-ubyte\n");
    for (tool, args) in [
        ("generate-text", vec!["--out", out_dir]),
        ("generate-images", vec!["--out", out_dir, "--classes", "1", "--train", "1", "--val", "1", "--sizes", "small"]),
    ] {
        let out = run("prepare_data", &[&[tool][..], &args].concat());
        one_error(&out, 2, &["did not generate"]);
    }
    // Told to: replaced, and marked; a folder it generated is replaced again without asking.
    let out = run("prepare_data", &["generate", "--dataset", "mnist", "--train", "10", "--test", "10", "--out", out_dir, "--force"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(real.join("GENERATED.txt").is_file());
    let out = run("prepare_data", &["generate", "--dataset", "mnist", "--train", "20", "--test", "10", "--out", out_dir]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn an_unreadable_data_folder_is_said_unreadable_not_missing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    cifar(&data, 40);
    let results = dir.path().join("results");
    std::fs::create_dir(&results).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o000)).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&results, std::fs::Permissions::from_mode(0o777)).unwrap();
    // Root reads any folder: the run is made as nobody there (setpriv, util-linux).
    let mut command = if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("setpriv");
        c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]).arg(binary("exercise1"));
        c
    } else {
        Command::new(binary("exercise1"))
    };
    command.args(["--device", "cpu", "--quiet", "--max-steps", "1", "--data-dir"]).arg(&data).arg("--results-dir").arg(&results).env_remove("RUST_BACKTRACE");
    let out = within(command, Duration::from_secs(120));
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    one_error(&out, 1, &[&data.display().to_string(), "is not readable"]);
}

#[test]
fn what_was_accepted_without_a_word_is_refused_or_said() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck) = (dir.path().join("data"), dir.path().join("ck"));
    cifar(&data, 40);
    let ck_s = ck.to_str().unwrap();
    // A resume with another batch size takes other samples from there on: said.
    let out = exercise1(&data, &ck, &["--batch-size", "20", "--max-steps", "1", "--epochs", "2", "--checkpoint-dir", ck_s]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = exercise1(&data, &ck, &["--batch-size", "10", "--max-steps", "2", "--epochs", "2", "--checkpoint-dir", ck_s, "--resume"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("was written by a job of 20 examples per step, this one takes 10"), "{}", stderr(&out));
    let out = exercise1(&data, &ck, &["--batch-size", "10", "--max-steps", "3", "--epochs", "2", "--checkpoint-dir", ck_s, "--resume"]);
    assert!(!stderr(&out).contains("examples per step"), "the same batch: nothing to say: {}", stderr(&out));

    // `pack --out` inside the image folder it packs.
    let photos_dir = dir.path().join("photos");
    photos(&photos_dir, 2);
    let inside = photos_dir.join("train").join("shards");
    let out = run("prepare_data", &["pack", "--data-dir", photos_dir.to_str().unwrap(), "--out", inside.to_str().unwrap()]);
    one_error(&out, 2, &["is inside --data-dir"]);
    assert!(!inside.exists(), "nothing written");
}

/// A full disk (a 256 KiB tmpfs, mounted as root in a temporary folder) loses nothing and tears
/// nothing: `generate` is refused before it writes, from its closed-form size against the free
/// space; `generate-text`, whose size is known only as it draws, fails at the split that does not
/// fit, in one line, leaving no torn split and no temporary: every split there is whole, byte for
/// byte the one a roomy disk gets. (`generate-text` on a full disk left a torn file.)
#[test]
fn a_full_disk_leaves_no_torn_file_and_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    std::fs::create_dir(&full).unwrap();
    if unsafe { libc::geteuid() } != 0
        || !Command::new("mount").args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"]).arg(&full).status().is_ok_and(|s| s.success())
    {
        println!("not root, or mount refused: no small file system to fill; the writer's own tests cover a failed write");
        return;
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&full);
    let images = full.join("cifar");
    let out = run("prepare_data", &["generate", "--dataset", "cifar10", "--train", "1000", "--test", "10", "--out", images.to_str().unwrap()]);
    one_error(&out, 2, &["1000 train + 10 test images of cifar10 would write", "are free", "write elsewhere (--out)"]);
    assert!(!images.exists(), "nothing written");

    let text = full.join("wikitext");
    let out = run("prepare_data", &["generate-text", "--out", text.to_str().unwrap()]);
    one_error(&out, 1, &["No space left on device"]);
    let roomy = dir.path().join("roomy");
    let reference = run("prepare_data", &["generate-text", "--out", roomy.to_str().unwrap()]);
    assert!(reference.status.success(), "{}", stderr(&reference));
    for entry in std::fs::read_dir(&text).unwrap().flatten() {
        let name = entry.file_name();
        assert!(!name.to_string_lossy().ends_with(".tmp"), "a temporary left: {name:?}");
        assert_eq!(std::fs::read(entry.path()).unwrap(), std::fs::read(roomy.join(&name)).unwrap(), "{name:?} torn");
    }
    assert!(!text.join("wiki.train.tokens").exists(), "the train split does not fit in 256 KiB");
}
