//! `--config FILE` for every exercise: the flags as keys of a TOML (or JSON) file, the command
//! line over them, and `--print-config` to write the resolved set. Every run keeps that set
//! beside its results (`<run>.config.toml`, [`given`]), so that it can be repeated from there.
//!
//! ```toml
//! model = "resnet34"
//! epochs = 3
//! lr = 1e-4
//! augment = true
//! ```
//!
//! A key is a flag's long name (`batch-size` or `batch_size`). A DeepSpeed configuration is read
//! too ([`deepspeed`]): its keys mapped to the matching flags, the ones that ask for something
//! this project does not do accepted and named in one line each ("note: ..."), before the run;
//! a key DeepSpeed itself does not know, an unknown flag or a value of the wrong type is one line
//! naming the key, exit 2, before anything runs.
mod deepspeed;

use std::ffi::OsString;
use std::path::Path;
use std::sync::OnceLock;

use clap::{Arg, ArgAction, ArgMatches, Command};
use serde_json::Value;

/// The command's matches with `--config FILE` applied under the command line's own flags, and
/// `--print-config` answered (the resolved flags printed as TOML, exit 0). Exits 2 with one
/// line on a configuration it cannot use, as clap does on a wrong flag.
pub fn get_matches(cmd: Command) -> ArgMatches {
    get_matches_from(cmd, std::env::args_os().collect())
}

pub fn get_matches_from(cmd: Command, argv: Vec<OsString>) -> ArgMatches {
    let cmd = with_config_flags(cmd);
    crate::cli::describe_if_asked(&cmd);
    let argv = match expand(&cmd, argv) {
        Ok((argv, notes)) => {
            if speaks_for_the_job(&argv) {
                notes.iter().for_each(|note| eprintln!("note: {note}"));
            }
            argv
        }
        Err(message) => {
            eprintln!("error: {message}");
            std::process::exit(2);
        }
    };
    // The program as it was called (`exercise3`), whatever the command is named inside.
    let program = argv.first().map(|p| Path::new(p).file_name().unwrap_or(p.as_os_str()).to_string_lossy().into_owned()).unwrap_or_default();
    let matches = crate::cli::matches(cmd.clone(), argv);
    let (sub, sub_matches) = match matches.subcommand() {
        Some((name, m)) => (cmd.find_subcommand(name).cloned(), m),
        None => (None, &matches),
    };
    let text = resolved(sub.as_ref().unwrap_or(&cmd), sub_matches);
    if sub_matches.get_flag("print_config") {
        print!("{text}");
        std::process::exit(0);
    }
    let command = [Some(program.as_str()), sub.as_ref().map(Command::get_name)].into_iter().flatten().collect::<Vec<_>>().join(" ");
    let _ = GIVEN.set(Given { command, toml: text });
    matches
}

/// Whether this process says what the job's configuration means, once per job: rank 0 of a
/// launcher's ranks, or a process started alone, but not one about to start the ranks itself
/// (`--nproc-per-node`, whose rank 0 will say it).
fn speaks_for_the_job(argv: &[OsString]) -> bool {
    match crate::comm::LaunchEnv::detect() {
        Ok(env) if env.is_distributed() => env.rank == 0,
        _ => !argv.iter().any(|a| a == "--nproc-per-node" || a.to_string_lossy().starts_with("--nproc-per-node=")),
    }
}

/// The flags this process was started with, resolved as `--print-config` prints them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Given {
    /// The command that took them (`exercise3 ddp`).
    pub command: String,
    pub toml: String,
}

/// Set once by [`get_matches`]: a run's results keep it ([`given`]).
static GIVEN: OnceLock<Given> = OnceLock::new();

/// The flags the command line (and its `--config`) gave this process, where a binary parsed
/// them with [`get_matches`]; None for a library caller (a notebook), which has no command line.
pub fn given() -> Option<&'static Given> {
    GIVEN.get()
}

impl Given {
    /// The `--config` file that repeats the run: the resolved flags under a comment saying so.
    pub fn config_file(&self) -> String {
        format!("# The flags of this run: `{} --config FILE` repeats it (the command line overrides the file).\n{}", self.command, self.toml)
    }
}

/// `--config` and `--print-config` on the command (and on each of its subcommands), later
/// occurrences of a flag overriding earlier ones (the command line comes after the file's).
fn with_config_flags(cmd: Command) -> Command {
    let add =
        |c: Command| {
            c.args_override_self(true)
                .arg(Arg::new("config").long("config").value_name("FILE").value_hint(clap::ValueHint::FilePath).help_heading("Output").help(
                    "Read flags from FILE (TOML, or JSON; a DeepSpeed configuration too): every flag's long name as a key; the command line overrides them",
                ))
                .arg(
                    Arg::new("print_config")
                        .long("print-config")
                        .action(ArgAction::SetTrue)
                        .help_heading("Output")
                        .help("Print the resolved flags (the file's and the command line's) as a TOML --config file, and exit"),
                )
        };
    if cmd.get_subcommands().next().is_some() {
        cmd.mut_subcommands(add)
    } else {
        add(cmd)
    }
}

/// `argv` with the flags of `--config FILE` put in front of the command line's own (after the
/// subcommand's name, for a command that has subcommands), and the notes on what the file asks
/// for that has no effect here.
fn expand(cmd: &Command, argv: Vec<OsString>) -> Result<(Vec<OsString>, Vec<String>), String> {
    let Some(at) = argv.iter().position(|a| a == "--config" || a.to_string_lossy().starts_with("--config=")) else { return Ok((argv, Vec::new())) };
    let file = match argv[at].to_string_lossy().strip_prefix("--config=") {
        Some(value) => value.to_string(),
        None => argv.get(at + 1).map(|v| v.to_string_lossy().into_owned()).ok_or("--config needs a FILE")?,
    };
    // The command the flags belong to: a subcommand named on the line, or the command itself.
    let (target, insert_at) = match argv.iter().enumerate().skip(1).find(|(_, a)| cmd.find_subcommand(a.to_string_lossy().as_ref()).is_some()) {
        Some((i, name)) => (cmd.find_subcommand(name.to_string_lossy().as_ref()).expect("found above"), i + 1),
        None => (cmd, 1),
    };
    let mut notes = Vec::new();
    let flags = flags_of(target, Path::new(&file), &mut notes)?;
    let mut out = argv[..insert_at].to_vec();
    out.extend(flags);
    out.extend(argv[insert_at..].iter().cloned());
    Ok((out, notes))
}

/// The most a configuration file may hold, and how deep its tables, arrays and dotted keys may
/// nest: a file of flags is a few hundred bytes and flat, DeepSpeed's a few kilobytes and three
/// levels deep. (TOML's parser recurses once a level: 100,000 levels overflowed its stack.)
const MAX_CONFIG_BYTES: u64 = 1 << 20;
const MAX_CONFIG_DEPTH: usize = 32;

/// `file`'s table: JSON (by its extension) or TOML, read only if it is a regular file within
/// [`MAX_CONFIG_BYTES`] and [`MAX_CONFIG_DEPTH`], a key given twice refused in both.
fn read_table(file: &Path) -> Result<Value, String> {
    let bytes = crate::input::read(file, MAX_CONFIG_BYTES, "give --config a file of flags").map_err(|e| format!("{e:#}"))?;
    let text = String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())?;
    let depth = nesting_depth(&text);
    if depth > MAX_CONFIG_DEPTH {
        return Err(format!("nested {depth} levels deep, more than the {MAX_CONFIG_DEPTH} a configuration may have"));
    }
    if file.extension().is_some_and(|e| e == "json") {
        crate::input::json_value(&text).map_err(|e| format!("not JSON: {e}"))
    } else {
        basic_toml::from_str(&text).map_err(|e| format!("not TOML: {e}"))
    }
}

/// The deepest nesting of `text`'s brackets and braces, or of a line's dotted key, outside
/// quoted strings (an upper bound on both formats' depth: enough to refuse a file before a
/// recursive parser reads it).
fn nesting_depth(text: &str) -> usize {
    let (mut deepest, mut open) = (0usize, 0usize);
    for line in text.lines() {
        let (mut quote, mut escaped, mut dots, mut in_value) = (None, false, 0usize, false);
        for c in line.chars() {
            match (quote, c) {
                (Some(_), '\\') if !escaped => {
                    escaped = true;
                    continue;
                }
                (Some(q), c) if c == q && !escaped => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') => quote = Some(c),
                (None, '#') => break,
                (None, '[' | '{') => open += 1,
                (None, ']' | '}') => open = open.saturating_sub(1),
                (None, '=' | ':') => in_value = true,
                (None, '.') if !in_value => dots += 1,
                _ => {}
            }
            escaped = false;
            deepest = deepest.max(open + dots);
        }
    }
    deepest
}

/// The flags `file` gives for `cmd`: `--key value`, `--flag` for `true`, each checked against the
/// command (the key exists, the value parses) before anything runs.
fn flags_of(cmd: &Command, file: &Path, notes: &mut Vec<String>) -> Result<Vec<OsString>, String> {
    let table = read_table(file).map_err(|e| format!("--config {}: {e}", file.display()))?;
    let Value::Object(table) = table else { return Err(format!("--config {}: not a table of flags", file.display())) };
    let mut flags = Vec::new();
    let translation = deepspeed::translate(table).map_err(|e| format!("--config {}: {e}", file.display()))?;
    notes.extend(translation.notes.iter().map(|n| format!("--config {}: {n}", file.display())));
    for (key, value) in translation.flags {
        let name = key.replace('_', "-");
        let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(name.as_str())).filter(|a| !matches!(a.get_id().as_str(), "config" | "print_config"))
        else {
            return Err(format!(
                "--config {}: unknown key `{key}`: {} has no flag --{name} (`{} --help` lists them)",
                file.display(),
                cmd.get_name(),
                cmd.get_name()
            ));
        };
        let takes_value = !matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count | ArgAction::Help | ArgAction::Version);
        let given: Vec<OsString> = match (&value, takes_value) {
            (Value::Bool(true), false) => vec![format!("--{name}").into()],
            (Value::Bool(false), false) => continue,
            (_, false) => return Err(format!("--config {}: key `{key}`: --{name} is a switch: give true or false, not {value}", file.display())),
            (Value::String(s), true) => vec![format!("--{name}").into(), s.into()],
            (Value::Number(n), true) => vec![format!("--{name}").into(), n.to_string().into()],
            (Value::Array(items), true) => {
                let mut tokens = vec![OsString::from(format!("--{name}"))];
                for item in items {
                    tokens.push(
                        scalar(item).ok_or_else(|| format!("--config {}: key `{key}`: a list of numbers or strings, not {item}", file.display()))?.into(),
                    );
                }
                tokens
            }
            (other, true) => return Err(format!("--config {}: key `{key}`: a number or a string, not {other}", file.display())),
        };
        // The value as clap will parse it, checked alone so that a mistake names the key.
        let mut alone = cmd.clone().no_binary_name(true).ignore_errors(false);
        alone = alone.mut_args(|a| a.required(false));
        // (A flag that needs another, --keep-checkpoints needing --checkpoint-dir, is left to the
        // whole command line's parse.)
        if let Err(e) = alone.try_get_matches_from(given.iter()).or_else(|e| {
            if e.kind() == clap::error::ErrorKind::MissingRequiredArgument {
                Ok(ArgMatches::default())
            } else {
                Err(e)
            }
        }) {
            let said = e.to_string();
            let first = said.lines().next().unwrap_or_default().trim_start_matches("error: ");
            return Err(format!("--config {}: key `{key}`: {first}", file.display()));
        }
        flags.extend(given);
    }
    Ok(flags)
}

fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The flags `matches` resolved for `cmd` from the file and the command line, as a TOML
/// `--config` file.
fn resolved(cmd: &Command, matches: &ArgMatches) -> String {
    let mut table = serde_json::Map::new();
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        let Some(long) = arg.get_long() else { continue };
        if matches!(id, "config" | "print_config" | "help" | "version") {
            continue;
        }
        // What was given (in the file or on the line); defaults are left to the binary, so that
        // the file stays short and a later default's change reaches it.
        if matches.value_source(id) != Some(clap::parser::ValueSource::CommandLine) {
            continue;
        }
        let value = match arg.get_action() {
            ArgAction::SetTrue => Value::Bool(matches.get_flag(id)),
            ArgAction::SetFalse => Value::Bool(!matches.get_flag(id)),
            _ => match matches.get_raw(id) {
                Some(raw) => {
                    let items: Vec<Value> = raw.map(|v| typed(&v.to_string_lossy())).collect();
                    if items.len() == 1 && !matches!(arg.get_action(), ArgAction::Append) {
                        items.into_iter().next().expect("one")
                    } else {
                        Value::Array(items)
                    }
                }
                None => continue, // not given, no default: the exercise's preset decides
            },
        };
        table.insert(long.to_string(), value);
    }
    basic_toml::to_string(&Value::Object(table)).unwrap_or_default()
}

/// A raw value as TOML would type it: an integer, a float, or a string.
fn typed(raw: &str) -> Value {
    if let Ok(n) = raw.parse::<i64>() {
        return Value::from(n);
    }
    match raw.parse::<f64>() {
        Ok(x) if x.is_finite() => Value::from(x),
        _ => Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command() -> Command {
        Command::new("exercise")
            .arg(Arg::new("lr").long("lr").value_parser(clap::value_parser!(f64)))
            .arg(Arg::new("batch_size").long("batch-size").value_parser(clap::value_parser!(usize)))
            .arg(Arg::new("augment").long("augment").action(ArgAction::SetTrue))
            .arg(Arg::new("zero").long("zero").value_parser(clap::value_parser!(u8)).default_value("0"))
            .arg(Arg::new("bucket_mb").long("bucket-mb").value_parser(clap::value_parser!(f64)))
            .arg(Arg::new("precision").long("precision"))
            .arg(Arg::new("accumulate").long("accumulate").value_parser(clap::value_parser!(usize)))
            .arg(Arg::new("optimizer").long("optimizer"))
            .arg(Arg::new("weight_decay").long("weight-decay").value_parser(clap::value_parser!(f64)))
    }

    fn file(text: &str, ext: &str) -> tempfile::TempPath {
        let f = tempfile::Builder::new().suffix(ext).tempfile().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f.into_temp_path()
    }

    fn argv(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_files_flags_come_first_and_the_command_line_wins() {
        let cfg = file("lr = 0.5\nbatch_size = 32\naugment = true\n", ".toml");
        let p = cfg.to_str().unwrap();
        let m = with_config_flags(command()).get_matches_from(expand(&with_config_flags(command()), argv(&["x", "--config", p, "--lr", "0.1"])).unwrap().0);
        assert_eq!(m.get_one::<f64>("lr"), Some(&0.1));
        assert_eq!(m.get_one::<usize>("batch_size"), Some(&32));
        assert!(m.get_flag("augment"));
        let text = resolved(&with_config_flags(command()), &m);
        assert!(text.contains("lr = 0.1") && text.contains("batch-size = 32") && text.contains("augment = true") && !text.contains("zero"), "{text}");
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_the_key() {
        let cmd = with_config_flags(command());
        let err = |text: &str, ext: &str| expand(&cmd, argv(&["x", "--config", file(text, ext).to_str().unwrap()])).unwrap_err();
        let e = err("learning_rate = 0.1\n", ".toml");
        assert!(e.contains("unknown key `learning_rate`") && e.contains("no flag --learning-rate"), "{e}");
        let e = err("batch_size = \"big\"\n", ".toml");
        assert!(e.contains("key `batch_size`") && e.contains("big"), "{e}");
        let e = err("augment = 3\n", ".toml");
        assert!(e.contains("key `augment`") && e.contains("true or false"), "{e}");
        let e = err("lr = [\n", ".toml");
        assert!(e.contains("not TOML"), "{e}");
        let e = err("{\"lr\": {\"x\": 1}}", ".json");
        assert!(e.contains("unknown section `lr`"), "{e}");
    }

    /// What a configuration file must be before it is parsed: a regular file, small, shallow,
    /// each key once (TOML's parser refuses a repeated key itself; serde_json kept the last).
    #[test]
    fn a_config_that_is_not_a_small_shallow_file_of_unique_keys_is_refused() {
        let cmd = with_config_flags(command());
        let err = |path: &Path| expand(&cmd, argv(&["x", "--config", path.to_str().unwrap()])).unwrap_err();
        let e = err(&file("{\"lr\": 0.1, \"batch_size\": 8, \"lr\": 0.5}", ".json"));
        assert!(e.contains("not JSON: the key `lr` is given twice"), "{e}");
        let e = err(&file("{\"zero_optimization\": {\"stage\": 2, \"stage\": 3}}", ".json"));
        assert!(e.contains("the key `stage` is given twice"), "{e}");
        assert!(err(&file("lr = 0.1\nlr = 0.5\n", ".toml")).contains("not TOML"));
        let deep = format!("x = {}1{}\n", "[".repeat(100_000), "]".repeat(100_000));
        assert!(err(&file(&deep, ".toml")).contains("nested 100000 levels deep, more than the 32"), "before the parser recurses");
        let dotted = format!("{} = 1\n", vec!["a"; 50].join("."));
        assert!(err(&file(&dotted, ".toml")).contains("nested 49 levels deep"));
        assert!(err(&file(&" ".repeat(2 << 20), ".toml")).contains("more than the 1048576"));
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("flags.toml");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let e = err(&fifo);
        assert!(e.contains("is not a regular file (a FIFO): give --config a file of flags"), "without waiting for a writer: {e}");
        assert!(err(dir.path()).contains("is not a regular file (a folder)"));
        // Strings may hold brackets, dots and a `#`: a flat file stays flat.
        assert_eq!(nesting_depth("run_name = \"a.b.c [[[{{\" # x.y.z\ndevices = [\"cpu\", \"cpu\"]\n"), 1);
    }

    fn expand_file(text: &str) -> Result<(ArgMatches, Vec<String>), String> {
        let cmd = with_config_flags(command());
        let cfg = file(text, ".json");
        let (argv, notes) = expand(&cmd, argv(&["x", "--config", cfg.to_str().unwrap()]))?;
        Ok((cmd.get_matches_from(argv), notes))
    }

    #[test]
    fn the_idris_slides_zero2_file_reads_verbatim_as_the_matching_flags() {
        // IDRIS's DLO-JZ slide, verbatim (../shared/course/001_…, the "ZeRO" slide).
        let text = include_str!("../../../exercises/tests/reference/ds_config_zero2.json");
        assert!(text.contains("\"reduce_scatter\": true") && text.contains("\"allgather_bucket_size\": 5e8"), "{text}");
        let (m, notes) = expand_file(text).unwrap();
        assert_eq!(m.get_one::<u8>("zero"), Some(&2));
        assert!((m.get_one::<f64>("bucket_mb").unwrap() - 5e8 * 4.0 / 1048576.0).abs() < 1e-9);
        // Every key there is what this project does but the all-gather's bucket, which it does
        // not cut (one all-gather per step): named, once.
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("`zero_optimization.allgather_bucket_size` = 500000000.0 has no effect here"), "{notes:?}");
    }

    #[test]
    fn deepspeeds_other_keys_map_or_are_named_and_unknown_ones_are_errors() {
        let json = r#"{"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 2, "fp16": {"enabled": true, "loss_scale": 0},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": false, "allgather_bucket_size": 2e8,
                                  "offload_optimizer": {"device": "cpu"}, "round_robin_gradients": false},
            "optimizer": {"type": "Adam", "params": {"lr": 0.0003, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
            "train_batch_size": 256, "wall_clock_breakdown": false, "tensorboard": {"enabled": false}}"#;
        let (m, notes) = expand_file(json).unwrap();
        assert_eq!((m.get_one::<u8>("zero"), m.get_one::<usize>("batch_size"), m.get_one::<usize>("accumulate")), (Some(&2), Some(&64), Some(&2)));
        assert_eq!(m.get_one::<String>("precision").map(String::as_str), Some("16-mixed"));
        assert_eq!((m.get_one::<String>("optimizer").map(String::as_str), m.get_one::<f64>("lr")), (Some("adam"), Some(&0.0003)));
        assert_eq!(m.get_one::<f64>("weight_decay"), Some(&0.01));
        // Named, one line each: what it asks for and why it does nothing here; silent at what
        // this project does or at DeepSpeed's default for what it lacks.
        let named = |key: &str| notes.iter().filter(|n| n.contains(&format!("`{key}`"))).count();
        for key in ["zero_optimization.overlap_comm", "zero_optimization.allgather_bucket_size", "zero_optimization.offload_optimizer", "train_batch_size"] {
            assert_eq!(named(key), 1, "{key}: {notes:?}");
        }
        for key in ["fp16.loss_scale", "zero_optimization.round_robin_gradients", "wall_clock_breakdown", "tensorboard", "optimizer.params.betas"] {
            assert_eq!(named(key), 0, "{key}: {notes:?}");
        }
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(notes.iter().all(|n| n.contains("has no effect here: ") && !n.contains('\n')), "{notes:?}");
        // An optimizer this project lacks is named, not swapped in silently.
        let (_, notes) = expand_file(r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#).unwrap();
        assert!(notes.iter().any(|n| n.contains("`optimizer.type` = \"adamw\" has no effect here")), "{notes:?}");
        // A key DeepSpeed itself does not know is an error naming it.
        let e = expand_file(r#"{"zero_optimization": {"stage": 2, "reduce_scater": true}}"#).unwrap_err();
        assert!(e.contains("unknown key `zero_optimization.reduce_scater`") && e.contains("DeepSpeed has no such key"), "{e}");
        let e = expand_file(r#"{"fp16": {"enabled": true, "scale": 8}}"#).unwrap_err();
        assert!(e.contains("unknown key `fp16.scale`"), "{e}");
        let e = expand_file(r#"{"zero_optimisation": {"stage": 2}}"#).unwrap_err();
        assert!(e.contains("unknown section `zero_optimisation`"), "{e}");
    }
}
