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
//! too, its keys mapped to the matching flags: `zero_optimization.stage` → `--zero`,
//! `zero_optimization.reduce_bucket_size` (elements of 4 bytes) → `--bucket-mb`,
//! `zero_optimization.overlap_comm` (the buckets' communication during the backward pass, which
//! our ZeRO-2 always overlaps: `true` only), `train_micro_batch_size_per_gpu` → `--batch-size`,
//! `gradient_accumulation_steps` → `--accumulate`, `fp16.enabled` / `bf16.enabled` →
//! `--precision 16-mixed` / `bf16-mixed`, `gradient_clipping` → `--clip`. An unknown key or a value
//! of the wrong type is one line naming the key, exit 2, before anything runs.
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
    let argv = match expand(&cmd, argv) {
        Ok(argv) => argv,
        Err(message) => {
            eprintln!("error: {message}");
            std::process::exit(2);
        }
    };
    // The program as it was called (`exercise3`), whatever the command is named inside.
    let program = argv.first().map(|p| Path::new(p).file_name().unwrap_or(p.as_os_str()).to_string_lossy().into_owned()).unwrap_or_default();
    let matches = cmd.clone().get_matches_from(argv);
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
                .arg(Arg::new("config").long("config").value_name("FILE").help_heading("Output").help(
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
/// subcommand's name, for a command that has subcommands).
fn expand(cmd: &Command, argv: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let Some(at) = argv.iter().position(|a| a == "--config" || a.to_string_lossy().starts_with("--config=")) else { return Ok(argv) };
    let file = match argv[at].to_string_lossy().strip_prefix("--config=") {
        Some(value) => value.to_string(),
        None => argv.get(at + 1).map(|v| v.to_string_lossy().into_owned()).ok_or("--config needs a FILE")?,
    };
    // The command the flags belong to: a subcommand named on the line, or the command itself.
    let (target, insert_at) = match argv.iter().enumerate().skip(1).find(|(_, a)| cmd.find_subcommand(a.to_string_lossy().as_ref()).is_some()) {
        Some((i, name)) => (cmd.find_subcommand(name.to_string_lossy().as_ref()).expect("found above"), i + 1),
        None => (cmd, 1),
    };
    let flags = flags_of(target, Path::new(&file))?;
    let mut out = argv[..insert_at].to_vec();
    out.extend(flags);
    out.extend(argv[insert_at..].iter().cloned());
    Ok(out)
}

/// The flags `file` gives for `cmd`: `--key value`, `--flag` for `true`, each checked against the
/// command (the key exists, the value parses) before anything runs.
fn flags_of(cmd: &Command, file: &Path) -> Result<Vec<OsString>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("--config {}: {e}", file.display()))?;
    let table: Value = if file.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|e| format!("--config {}: not JSON: {e}", file.display()))?
    } else {
        basic_toml::from_str(&text).map_err(|e| format!("--config {}: not TOML: {e}", file.display()))?
    };
    let Value::Object(table) = table else { return Err(format!("--config {}: not a table of flags", file.display())) };
    let mut flags = Vec::new();
    for (key, value) in deepspeed(table).map_err(|e| format!("--config {}: {e}", file.display()))? {
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

/// The table's keys as flags: DeepSpeed's sections and names mapped to ours, the rest as they are.
fn deepspeed(table: serde_json::Map<String, Value>) -> Result<Vec<(String, Value)>, String> {
    let mut out = Vec::new();
    for (key, value) in table {
        match (key.as_str(), value) {
            ("zero_optimization", Value::Object(zero)) => {
                for (k, v) in zero {
                    match (k.as_str(), &v) {
                        ("stage", _) => out.push(("zero".into(), v)),
                        ("reduce_bucket_size", Value::Number(n)) => {
                            let mib = n.as_f64().unwrap_or(0.0) * 4.0 / (1024.0 * 1024.0);
                            out.push(("bucket-mb".into(), serde_json::json!(mib)));
                        }
                        ("overlap_comm", Value::Bool(true)) => {} // what our ZeRO-2 does anyway
                        ("overlap_comm", _) => {
                            return Err(
                                "key `zero_optimization.overlap_comm`: only true (the gradients' buckets always communicate during the backward pass here)"
                                    .into(),
                            )
                        }
                        ("contiguous_gradients", Value::Bool(_)) => {} // a memory layout detail of DeepSpeed's
                        _ => return Err(format!("unknown key `zero_optimization.{k}`: stage, reduce_bucket_size and overlap_comm are read")),
                    }
                }
            }
            ("train_micro_batch_size_per_gpu", v) => out.push(("batch-size".into(), v)),
            ("gradient_accumulation_steps", v) => out.push(("accumulate".into(), v)),
            ("gradient_clipping", v) => out.push(("clip".into(), v)),
            ("fp16" | "bf16", Value::Object(section)) => {
                if section.get("enabled") == Some(&Value::Bool(true)) {
                    out.push(("precision".into(), Value::String(if key == "fp16" { "16-mixed" } else { "bf16-mixed" }.into())));
                }
            }
            (_, Value::Object(_)) => {
                return Err(format!(
                    "unknown section `{key}`: flags are keys of the top level (DeepSpeed's zero_optimization, fp16 and bf16 sections are read)"
                ))
            }
            (_, v) => out.push((key, v)),
        }
    }
    Ok(out)
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
        let m = with_config_flags(command()).get_matches_from(expand(&with_config_flags(command()), argv(&["x", "--config", p, "--lr", "0.1"])).unwrap());
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

    #[test]
    fn idris_zero2_deepspeed_json_reads_as_the_matching_flags() {
        let json = r#"{"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": true, "contiguous_gradients": true},
            "fp16": {"enabled": true}}"#;
        let cfg = file(json, ".json");
        let cmd = with_config_flags(command());
        let m = cmd.clone().get_matches_from(expand(&cmd, argv(&["x", "--config", cfg.to_str().unwrap()])).unwrap());
        assert_eq!(m.get_one::<u8>("zero"), Some(&2));
        assert_eq!(m.get_one::<usize>("batch_size"), Some(&64));
        assert_eq!(m.get_one::<usize>("accumulate"), Some(&2));
        assert_eq!(m.get_one::<String>("precision").map(String::as_str), Some("16-mixed"));
        assert!((m.get_one::<f64>("bucket_mb").unwrap() - 5e8 * 4.0 / 1048576.0).abs() < 1e-9);
        let bad = file(r#"{"zero_optimization": {"stage": 2, "overlap_comm": false}}"#, ".json");
        assert!(expand(&cmd, argv(&["x", "--config", bad.to_str().unwrap()])).unwrap_err().contains("zero_optimization.overlap_comm"));
    }
}
