//! Hostile input, generated from the binaries themselves (issue 62, item 6). Every flag and
//! positional of every binary and subcommand, as the binary's own description lists them
//! (`COURSE_CLI_JSON=1`, from clap), is given in turn 0, -1, NaN, inf, 1e30, 10^12, a string that is not
//! UTF-8 and an empty string, and where a path is expected a FIFO, a folder and a link (to the
//! FIFO), the other arguments those of a tiny run. Each run must end within its bound, either
//! refused (exit 2) or failed (exit 1) with one `error:` line, or accepted: exit 0, or 137 from
//! the hook that ends a training run right after its first step. Never a panic (which the
//! binaries turn into `internal error`), an abort, a signal, another exit code or a hang.
//!
//! Each test prints its counts (`cargo nextest run --test hostile --no-capture`): the flags, the
//! runs, and how many ended each way.
mod support;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What every flag is given (and every path also [`PathValue`]s).
/// (`1000000000000` reaches an integer's own range checks, which `1e30` never passes parsing.)
const VALUES: [&[u8]; 8] = [b"0", b"-1", b"nan", b"inf", b"1e30", b"1000000000000", b"caf\xe9", b""];

/// Where a path is expected, besides [`VALUES`].
#[derive(Clone, Copy, Debug)]
enum PathValue {
    Fifo,
    Folder,
    Link,
}

/// Longer than any run of the tiny data takes, even on a loaded machine; a run past it hangs.
const BOUND: Duration = Duration::from_secs(90);

/// The address space each run may take: LibTorch's libraries and a tiny run fit in it many
/// times over; a size that allocates without a check meets it.
const ADDRESS_SPACE: libc::rlim_t = 12 << 30;

/// How one run ended.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Ending {
    /// Exit 2 with clap's one line (`common::cli`: it ends `(see --help)`): refused as the
    /// command line was parsed, before the program's own code ran.
    Parsed,
    /// Exit 2 with one error line, from the program's checks.
    Refused,
    /// Exit 1 with one error line.
    Failed,
    /// Exit 0.
    Accepted,
    /// Exit 137 from `COURSE_TEST_EXIT_AFTER_STEP=1`: the run trained its first step.
    Trained,
    /// Anything else, and why.
    Wrong(String),
}

/// A binary (and subcommand) with the arguments of a tiny run: the flags as (long name, value)
/// pairs, a flag under test taking its pair's place, and the positionals' values in order.
struct Target {
    binary: &'static str,
    subcommand: Option<&'static str>,
    flags: Vec<(&'static str, Option<OsString>)>,
    positionals: Vec<OsString>,
}

impl Target {
    fn new(binary: &'static str, subcommand: Option<&'static str>) -> Target {
        Target { binary, subcommand, flags: Vec::new(), positionals: Vec::new() }
    }

    fn flag(mut self, long: &'static str, value: impl AsRef<OsStr>) -> Target {
        self.flags.push((long, Some(value.as_ref().to_os_string())));
        self
    }

    fn switch(mut self, long: &'static str) -> Target {
        self.flags.push((long, None));
        self
    }

    fn positional(mut self, value: impl AsRef<OsStr>) -> Target {
        self.positionals.push(value.as_ref().to_os_string());
        self
    }

    /// The arguments with `replaced` (a flag's long name, or a positional's index) given `value`.
    fn arguments(&self, replaced: &Replaced, value: &OsStr) -> Vec<OsString> {
        let mut args: Vec<OsString> = self.subcommand.iter().map(OsString::from).collect();
        for (long, given) in self.flags.iter().filter(|(long, _)| !matches!(replaced, Replaced::Flag(l) if l == long)) {
            args.push(format!("--{long}").into());
            args.extend(given.clone());
        }
        if let Replaced::Flag(long) = replaced {
            // `--flag=-1`: the value as a value, not a flag.
            let mut arg = OsString::from(format!("--{long}="));
            arg.push(value);
            args.push(arg);
        }
        if !self.positionals.is_empty() {
            args.push("--".into());
            for (i, given) in self.positionals.iter().enumerate() {
                args.push(if matches!(replaced, Replaced::Positional(p) if *p == i) { value.to_os_string() } else { given.clone() });
            }
        }
        args
    }
}

enum Replaced {
    Flag(String),
    Positional(usize),
}

fn binary_path(name: &str) -> &'static str {
    match name {
        "exercise1" => env!("CARGO_BIN_EXE_exercise1"),
        "exercise1_nlp" => env!("CARGO_BIN_EXE_exercise1_nlp"),
        "exercise2" => env!("CARGO_BIN_EXE_exercise2"),
        "exercise3" => env!("CARGO_BIN_EXE_exercise3"),
        "hello_ddp" => env!("CARGO_BIN_EXE_hello_ddp"),
        "prepare_data" => env!("CARGO_BIN_EXE_prepare_data"),
        "checkpoint" => env!("CARGO_BIN_EXE_checkpoint"),
        "report" => env!("CARGO_BIN_EXE_report"),
        "why_gpus" => env!("CARGO_BIN_EXE_why_gpus"),
        "bench_allreduce" => env!("CARGO_BIN_EXE_bench_allreduce"),
        "bench_data" => env!("CARGO_BIN_EXE_bench_data"),
        "bench_pipeline" => env!("CARGO_BIN_EXE_bench_pipeline"),
        other => panic!("no binary {other}"),
    }
}

/// The binary's description of itself (`common::cli::describe`), at the subcommand.
fn description(target: &Target) -> serde_json::Value {
    let out = Command::new(binary_path(target.binary)).env("COURSE_CLI_JSON", "1").output().unwrap();
    assert!(out.status.success(), "{} describes itself: {}", target.binary, support::stderr(&out));
    let whole: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    match target.subcommand {
        None => whole,
        Some(name) => whole["subcommands"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("{} has no subcommand {name}", target.binary))
            .clone(),
    }
}

/// One run of `target` with `args` in `dir`, ended within [`BOUND`].
fn run(target: &Target, args: &[OsString], dir: &Path) -> Ending {
    let out = dir.join("run.out");
    let err = dir.join("run.err");
    let mut command = Command::new(binary_path(target.binary));
    command
        .args(args)
        .current_dir(dir)
        .env_remove("RUST_BACKTRACE")
        .env("COURSE_TEST_EXIT_AFTER_STEP", "1")
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        // Its own process group: a hung run is ended with everything it started.
        .process_group(0);
    // A size nobody checked allocates until this limit, not until the machine's memory is gone.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: ADDRESS_SPACE, rlim_max: ADDRESS_SPACE };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = command.spawn().unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > BOUND {
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            return Ending::Wrong(format!("still running after {} s", BOUND.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Whatever the run left running in its group (mpirun's ranks) ends with it.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let stderr = String::from_utf8_lossy(&std::fs::read(&err).unwrap()).into_owned();
    classify(status, &stderr)
}

fn classify(status: std::process::ExitStatus, stderr: &str) -> Ending {
    if let Some(signal) = status.signal() {
        return Ending::Wrong(format!("ended by signal {signal}: {}", last_lines(stderr)));
    }
    if stderr.contains("internal error") || stderr.contains("panicked") || stderr.contains("stack backtrace") {
        return Ending::Wrong(format!("a panic: {}", last_lines(stderr)));
    }
    match status.code() {
        Some(0) => Ending::Accepted,
        Some(137) => Ending::Trained,
        Some(code @ (1 | 2)) => {
            let errors = stderr.lines().filter(|l| l.starts_with("error:")).count();
            // Besides the error, only the one-line notes and warnings a run may say before it.
            let others: Vec<&str> = stderr.lines().filter(|l| !["error:", "warning:", "WARNING:", "note:"].iter().any(|p| l.starts_with(p))).collect();
            if errors != 1 || !others.is_empty() {
                return Ending::Wrong(format!("exit {code} without exactly one error line: {}", last_lines(stderr)));
            }
            if code == 2 && stderr.lines().any(|l| l.starts_with("error:") && l.ends_with("(see --help)")) {
                Ending::Parsed
            } else if code == 2 {
                Ending::Refused
            } else {
                Ending::Failed
            }
        }
        other => Ending::Wrong(format!("exit code {other:?}: {}", last_lines(stderr))),
    }
}

fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(4)..].join(" | ")
}

/// Makes a FIFO, a folder and a link to the FIFO in a fresh folder under `dir`; the value of `which`.
fn path_value(dir: &Path, which: PathValue) -> PathBuf {
    let place = tempfile::Builder::new().prefix("planted").tempdir_in(dir).unwrap().keep();
    let fifo = place.join("fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let folder = place.join("folder");
    std::fs::create_dir(&folder).unwrap();
    let link = place.join("link");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    match which {
        PathValue::Fifo => fifo,
        PathValue::Folder => folder,
        PathValue::Link => link,
    }
}

/// The values of a flag (its long name and kind) that an earlier binary of the same family (one
/// struct of flags, parsed by the same clap code and checked by the same checks) accepted, or
/// that clap refused while parsing: not run again, counted as covered. What the program's own
/// checks refused is tried in every binary.
type Covered = BTreeMap<(String, String), Vec<String>>;

/// Tries every value on every flag and positional of `target`, in `dir` (its fixtures there);
/// prints the counts and returns every run that ended wrongly (named).
fn try_every_argument(target: Target, dir: &Path, covered: &mut Covered) -> Vec<String> {
    let described = description(&target);
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut wrong = Vec::new();
    let mut arguments = 0;
    let mut positional = 0;
    for arg in described["args"].as_array().unwrap() {
        let kind = arg["kind"].as_str().unwrap();
        if kind == "switch" {
            continue;
        }
        let replaced = if arg["positional"].as_bool().unwrap() {
            positional += 1;
            Replaced::Positional(positional - 1)
        } else {
            Replaced::Flag(arg["long"].as_str().unwrap().to_string())
        };
        arguments += 1;
        let mut values: Vec<(String, OsString)> =
            VALUES.iter().map(|v| (format!("{:?}", String::from_utf8_lossy(v)), OsStr::from_bytes(v).to_os_string())).collect();
        if kind == "path" {
            for which in [PathValue::Fifo, PathValue::Folder, PathValue::Link] {
                values.push((format!("{which:?}"), path_value(dir, which).into_os_string()));
            }
        }
        let key = (arg["long"].as_str().unwrap_or_default().to_string(), kind.to_string());
        for (shown, value) in values {
            if !key.0.is_empty() && covered.get(&key).is_some_and(|values| values.contains(&shown)) {
                *counts.entry("covered".into()).or_default() += 1;
                continue;
            }
            let args = target.arguments(&replaced, &value);
            let ending = run(&target, &args, dir);
            let name = match &ending {
                Ending::Wrong(_) => "wrong".to_string(),
                other => format!("{other:?}").to_lowercase(),
            };
            if matches!(ending, Ending::Accepted | Ending::Trained | Ending::Parsed) {
                covered.entry(key.clone()).or_default().push(shown.clone());
            }
            *counts.entry(name).or_default() += 1;
            if let Ending::Wrong(why) = ending {
                let flag = match &replaced {
                    Replaced::Flag(long) => format!("--{long}"),
                    Replaced::Positional(i) => format!("positional {i}"),
                };
                wrong.push(format!("{flag} {shown}: {why}"));
            }
        }
    }
    let tried: usize = counts.values().sum();
    let name = [Some(target.binary), target.subcommand].into_iter().flatten().collect::<Vec<_>>().join(" ");
    println!("hostile: {name}: {arguments} arguments, {tried} runs: {counts:?}");
    wrong.into_iter().map(|w| format!("{name} {w}")).collect()
}

/// Fails naming every run that ended wrongly.
fn none_wrong(wrong: Vec<String>) {
    assert!(wrong.is_empty(), "{} runs ended wrongly:\n{}", wrong.len(), wrong.join("\n"));
}

/// The fixtures the targets' tiny runs read, made in `dir`.
struct Fixtures {
    dir: tempfile::TempDir,
}

impl Fixtures {
    fn new() -> Fixtures {
        Fixtures { dir: tempfile::tempdir().unwrap() }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn results(&self) -> PathBuf {
        let results = self.path("results");
        std::fs::create_dir_all(&results).unwrap();
        results
    }

    fn cifar(&self) -> PathBuf {
        let cifar = self.path("cifar10");
        if !cifar.exists() {
            support::generated_cifar10(&cifar, 40, 20);
        }
        cifar
    }

    fn wikitext(&self) -> PathBuf {
        let wikitext = self.path("wikitext-2");
        if !wikitext.exists() {
            std::fs::create_dir_all(&wikitext).unwrap();
            support::wikitext_sample(&wikitext, [60, 20, 20]);
        }
        wikitext
    }

    fn image_folder(&self) -> PathBuf {
        let folder = self.path("imagefolder");
        if !folder.exists() {
            let out = Command::new(binary_path("prepare_data"))
                .args(["generate-images", "--classes", "2", "--train", "4", "--val", "2", "--sizes", "small", "--out"])
                .arg(&folder)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", support::stderr(&out));
        }
        folder
    }

    /// A checkpoint of a tiny exercise1 run.
    fn checkpoint(&self) -> PathBuf {
        let dir = self.path("checkpoints");
        let out = Command::new(binary_path("exercise1"))
            .args(["--device", "cpu", "--model", "cnn", "--batch-size", "8", "--max-steps", "1", "--quiet", "--checkpoint-dir"])
            .arg(&dir)
            .arg("--data-dir")
            .arg(self.cifar())
            .arg("--results-dir")
            .arg(self.results())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", support::stderr(&out));
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == "safetensors")).expect("a checkpoint")
    }

    /// A planner's profile of a tiny Transformer on this machine's CPU.
    fn profile(&self) -> PathBuf {
        let profile = self.path("profile.json");
        let out = Command::new(binary_path("exercise3"))
            .args([
                "profile",
                "--device",
                "cpu",
                "--emsize",
                "16",
                "--d-hid",
                "16",
                "--nhead",
                "2",
                "--nlayers",
                "2",
                "--bptt",
                "8",
                "--vocab",
                "100",
                "--micro-batches",
                "1",
                "--shards",
                "2",
                "--out",
            ])
            .arg(&profile)
            .current_dir(self.dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", support::stderr(&out));
        profile
    }
}

/// A tiny image-classification run on the CPU.
fn image_run(binary: &'static str, subcommand: Option<&'static str>, f: &Fixtures) -> Target {
    Target::new(binary, subcommand)
        .flag("device", "cpu")
        .flag("model", "cnn")
        .flag("batch-size", "8")
        .flag("max-steps", "1")
        .flag("data-dir", f.cifar())
        .flag("results-dir", f.results())
        .switch("quiet")
}

/// A tiny Transformer language-model run on the CPU.
fn text_run(binary: &'static str, subcommand: Option<&'static str>, f: &Fixtures) -> Target {
    Target::new(binary, subcommand)
        .flag("emsize", "16")
        .flag("d-hid", "16")
        .flag("nhead", "2")
        .flag("nlayers", "2")
        .flag("bptt", "8")
        .flag("batch-size", "4")
        .flag("max-steps", "1")
        .flag("data-dir", f.wikitext())
        .flag("results-dir", f.results())
        .switch("quiet")
}

/// The image classifiers: exercise1, exercise2 and exercise3 ddp share their flags (`ImageArgs`).
#[test]
fn image_classifiers_every_argument() {
    let f = Fixtures::new();
    let mut covered = Covered::new();
    let mut wrong = Vec::new();
    for (binary, subcommand) in [("exercise1", None), ("exercise2", None), ("exercise3", Some("ddp"))] {
        wrong.extend(try_every_argument(image_run(binary, subcommand, &f), f.dir.path(), &mut covered));
    }
    none_wrong(wrong);
}

/// The Transformer language models: exercise1_nlp, exercise3 pipeline and tp share most flags.
#[test]
fn language_models_every_argument() {
    let f = Fixtures::new();
    let mut covered = Covered::new();
    let mut wrong = try_every_argument(text_run("exercise1_nlp", None, &f).flag("device", "cpu"), f.dir.path(), &mut covered);
    wrong.extend(try_every_argument(text_run("exercise3", Some("pipeline"), &f).flag("devices", "cpu,cpu"), f.dir.path(), &mut covered));
    wrong.extend(try_every_argument(text_run("exercise3", Some("tp"), &f).flag("device", "cpu"), f.dir.path(), &mut covered));
    none_wrong(wrong);
}

#[test]
fn exercise3_pipe_every_argument() {
    let f = Fixtures::new();
    none_wrong(try_every_argument(Target::new("exercise3", Some("pipe")).flag("devices", "cpu,cpu"), f.dir.path(), &mut Covered::new()));
}

#[test]
fn exercise3_profile_every_argument() {
    let f = Fixtures::new();
    let target = Target::new("exercise3", Some("profile"))
        .flag("device", "cpu")
        .flag("emsize", "16")
        .flag("d-hid", "16")
        .flag("nhead", "2")
        .flag("nlayers", "2")
        .flag("bptt", "8")
        .flag("vocab", "100")
        .flag("micro-batches", "1")
        .flag("shards", "2")
        .flag("out", f.path("profile.json"));
    none_wrong(try_every_argument(target, f.dir.path(), &mut Covered::new()));
}

#[test]
fn exercise3_plan_every_argument() {
    let f = Fixtures::new();
    let target = Target::new("exercise3", Some("plan"))
        .flag("profile", f.profile())
        .flag("nodes", "1")
        .flag("gpus-per-node", "2")
        .flag("memory", "1GB")
        .flag("global-batch", "8");
    none_wrong(try_every_argument(target, f.dir.path(), &mut Covered::new()));
}

#[test]
fn hello_ddp_every_argument() {
    let f = Fixtures::new();
    none_wrong(try_every_argument(Target::new("hello_ddp", None).flag("nproc-per-node", "1").flag("device", "cpu"), f.dir.path(), &mut Covered::new()));
}

#[test]
fn prepare_data_every_argument() {
    let f = Fixtures::new();
    let generated = f.path("generated");
    let targets = [
        Target::new("prepare_data", Some("generate")).flag("dataset", "cifar10").flag("train", "10").flag("test", "10").flag("out", &generated).switch("force"),
        Target::new("prepare_data", Some("generate-images"))
            .flag("classes", "2")
            .flag("train", "2")
            .flag("val", "1")
            .flag("sizes", "small")
            .flag("out", &generated)
            .switch("force"),
        Target::new("prepare_data", Some("generate-text")).flag("out", &generated).switch("force"),
        Target::new("prepare_data", Some("check-text")).flag("dir", f.wikitext()),
        Target::new("prepare_data", Some("check")).flag("dataset", "cifar10").flag("dir", f.cifar()),
        Target::new("prepare_data", Some("weights")).positional("resnet34"),
        Target::new("prepare_data", Some("pack")).flag("data-dir", f.image_folder()).flag("out", f.path("shards")).flag("shard-size", "4"),
    ];
    none_wrong(targets.into_iter().flat_map(|target| try_every_argument(target, f.dir.path(), &mut Covered::new())).collect());
}

#[test]
fn checkpoint_every_argument() {
    let f = Fixtures::new();
    let checkpoint = f.checkpoint();
    let mut wrong = try_every_argument(Target::new("checkpoint", Some("show")).positional(&checkpoint), f.dir.path(), &mut Covered::new());
    wrong.extend(try_every_argument(
        Target::new("checkpoint", Some("export")).positional(&checkpoint).positional(f.path("model.safetensors")),
        f.dir.path(),
        &mut Covered::new(),
    ));
    none_wrong(wrong);
}

#[test]
fn report_why_gpus_and_benches_every_argument() {
    let f = Fixtures::new();
    let results = f.results();
    // The benches' committed tables, which `report ps` and `report plan` draw.
    let benches = f.path("benches");
    std::fs::create_dir(&benches).unwrap();
    for table in ["bench-ps.csv", "bench-plan.csv"] {
        std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("../results").join(table), benches.join(table)).unwrap();
    }
    let targets = [
        Target::new("report", None).flag("results-dir", &results),
        Target::new("report", Some("scaling")).flag("results-dir", &results),
        Target::new("report", Some("ps")).flag("results-dir", &benches),
        Target::new("report", Some("plan")).flag("results-dir", &benches),
        Target::new("why_gpus", None)
            .flag("device", "cpu")
            .flag("max-scalars", "1000")
            .flag("max-side", "64")
            .flag("repeats", "1")
            .flag("results-dir", &results),
        Target::new("bench_allreduce", None)
            .flag("device", "cpu")
            .flag("min-bytes", "1024")
            .flag("max-bytes", "4096")
            .flag("iters", "1")
            .flag("csv", results.join("allreduce.csv")),
        Target::new("bench_data", None).flag("data-dir", f.image_folder()).flag("batch-size", "2").flag("batches", "1").flag("warmup", "0"),
        Target::new("bench_pipeline", None)
            .flag("devices", "cpu,cpu")
            .flag("chunks", "1,2")
            .flag("emsize", "16")
            .flag("d-hid", "16")
            .flag("nhead", "2")
            .flag("nlayers", "2")
            .flag("ntoken", "50")
            .flag("bptt", "8")
            .flag("batch-size", "4")
            .flag("steps", "1")
            .flag("rounds", "1")
            .flag("csv", results.join("pipeline.csv")),
    ];
    none_wrong(targets.into_iter().flat_map(|target| try_every_argument(target, f.dir.path(), &mut Covered::new())).collect());
}
