//! How every binary reads its command line: as OS strings (a path need not be UTF-8), a mistake
//! in it said in one line (clap's message with its tip, exit 2), and, for the test that gives
//! every flag hostile values, the command's own description as JSON.
use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Arg, ArgAction, ArgMatches, Command, FromArgMatches, Parser, ValueHint};
use serde_json::{json, Value};

/// `COURSE_CLI_JSON=1 <binary>` prints the command's flags, positionals and subcommands as JSON
/// ([`describe`]) and exits 0: the hostile-input test reads every binary's flags from it rather
/// than from a list kept by hand.
pub const DESCRIBE: &str = "COURSE_CLI_JSON";

/// The binary's flags from this process's arguments.
pub fn parse<T: Parser>() -> T {
    from_matches(&matches(T::command(), std::env::args_os().collect()))
}

/// The longest wait a flag may ask for, in seconds: a year. (A longer one overflows the clocks'
/// arithmetic; none is meant.)
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// A flag's number of seconds (a timeout): positive, at most [`MAX_SECONDS`]. The value parsers
/// here check a number as clap reads it, a `--config` file's too, so that a value out of range
/// is one line and exit 2 before anything runs.
pub fn seconds(value: &str) -> Result<f64, String> {
    match number(value)? {
        s if s > 0.0 && s <= MAX_SECONDS => Ok(s),
        _ => Err(format!("a positive number of seconds, at most {MAX_SECONDS} (a year), e.g. 300")),
    }
}

/// A flag's number of minutes: positive, at most a year's.
pub fn minutes(value: &str) -> Result<f64, String> {
    match number(value)? {
        m if m > 0.0 && m <= MAX_SECONDS / 60.0 => Ok(m),
        _ => Err(format!("a positive number of minutes, at most {} (a year)", MAX_SECONDS / 60.0)),
    }
}

/// A count of at least 1 (batches, steps, rounds).
pub fn count(value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("a whole number, at least 1".into()),
    }
}

/// The most repetitions a bench's flag may ask for (timed steps, rounds, iterations): a million
/// of its shortest measurement is already hours; more is a slip of the keyboard.
pub const MAX_REPEATS: usize = 1_000_000;

/// A whole number from `min` to `max`, as a value parser: `value_parser = cli::between(1, cli::MAX_REPEATS)`.
pub fn between(min: usize, max: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |value| match value.trim().parse::<usize>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("a whole number from {min} to {max}")),
    }
}

/// A positive, finite number.
pub fn positive(value: &str) -> Result<f64, String> {
    match number(value)? {
        x if x > 0.0 => Ok(x),
        _ => Err("a positive number".into()),
    }
}

/// A finite number, 0 or more.
pub fn non_negative(value: &str) -> Result<f64, String> {
    match number(value)? {
        x if x >= 0.0 => Ok(x),
        _ => Err("a number, 0 or more".into()),
    }
}

/// A finite number (not NaN, not infinite).
fn number(value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        Ok(_) => Err("a finite number".into()),
        Err(_) => Err("a number".into()),
    }
}

/// `argv` parsed by `cmd`: a mistake is one line and exit 2; `--help` and `--version` print as
/// clap prints them.
pub fn matches(cmd: Command, argv: Vec<OsString>) -> ArgMatches {
    describe_if_asked(&cmd);
    cmd.try_get_matches_from(argv).unwrap_or_else(|e| exit_with(e))
}

/// The typed flags out of `matches` (a flag given twice through a config and the command line,
/// a value that does not convert), a mistake said as [`matches`] says it.
pub fn from_matches<T: FromArgMatches>(matches: &ArgMatches) -> T {
    T::from_arg_matches(matches).unwrap_or_else(|e| exit_with(e))
}

/// Answers [`DESCRIBE`] where it is set: prints [`describe`] and exits 0.
pub fn describe_if_asked(cmd: &Command) {
    if std::env::var_os(DESCRIBE).is_some() {
        println!("{}", describe(cmd));
        std::process::exit(0);
    }
}

fn exit_with(e: clap::Error) -> ! {
    if !e.use_stderr() {
        e.exit() // --help, --version
    }
    crate::error::say(&one_line(&e.to_string()));
    std::process::exit(2)
}

/// clap's error in one line: its first line, the lines that continue it (the arguments it names)
/// and its tips, without the usage block and the pointer to `--help`, which ends the line.
pub fn one_line(rendered: &str) -> String {
    let mut line = String::new();
    for part in rendered.lines().map(str::trim).take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information")) {
        match part {
            "" => {}
            tip if tip.starts_with("tip:") => line += &format!("; {tip}"),
            part if line.is_empty() => line += part,
            part => line += &format!(" {part}"),
        }
    }
    let line = if line.is_empty() { "error: the command line was not understood".to_string() } else { line };
    format!("{line} (see --help)")
}

/// The command's arguments and subcommands, recursively: for each argument its long name (or
/// its id for a positional), whether it takes a value, and the kind of value (`path`, `integer`,
/// `number`, `choice` with its choices, `text`).
pub fn describe(cmd: &Command) -> Value {
    let mut cmd = cmd.clone();
    cmd.build();
    describe_built(&cmd)
}

fn describe_built(cmd: &Command) -> Value {
    let args: Vec<Value> = cmd.get_arguments().filter(|a| !matches!(a.get_action(), ArgAction::Help | ArgAction::Version)).map(describe_arg).collect();
    let subcommands: Vec<Value> = cmd.get_subcommands().filter(|s| s.get_name() != "help").map(describe_built).collect();
    json!({ "name": cmd.get_name(), "args": args, "subcommands": subcommands })
}

fn describe_arg(arg: &Arg) -> Value {
    let takes_value = matches!(arg.get_action(), ArgAction::Set | ArgAction::Append);
    let type_id = arg.get_value_parser().type_id();
    let is = |t: std::any::TypeId| type_id == t;
    use std::any::TypeId;
    let choices: Vec<String> = arg.get_possible_values().iter().map(|v| v.get_name().to_string()).collect();
    let kind = if !takes_value {
        "switch"
    } else if !choices.is_empty() {
        "choice"
    } else if is(TypeId::of::<PathBuf>()) || matches!(arg.get_value_hint(), ValueHint::AnyPath | ValueHint::FilePath | ValueHint::DirPath) {
        "path"
    } else if [
        TypeId::of::<usize>(),
        TypeId::of::<u64>(),
        TypeId::of::<u32>(),
        TypeId::of::<u16>(),
        TypeId::of::<u8>(),
        TypeId::of::<i64>(),
        TypeId::of::<i32>(),
    ]
    .into_iter()
    .any(is)
    {
        "integer"
    } else if is(TypeId::of::<f64>()) || is(TypeId::of::<f32>()) {
        "number"
    } else {
        "text"
    };
    json!({
        "id": arg.get_id().as_str(),
        "long": arg.get_long(),
        "positional": arg.is_positional(),
        "required": arg.is_required_set(),
        "takes_value": takes_value,
        "kind": kind,
        "choices": choices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn between_takes_its_bounds_and_refuses_beyond_them() {
        let repeats = between(1, MAX_REPEATS);
        assert_eq!(repeats("1"), Ok(1));
        assert_eq!(repeats(" 1000000 "), Ok(MAX_REPEATS));
        for refused in ["0", "1000001", "1000000000000", "-1", "1e3", "nan", ""] {
            assert_eq!(repeats(refused), Err("a whole number from 1 to 1000000".to_string()), "{refused:?}");
        }
        assert_eq!(between(0, 256)("0"), Ok(0));
    }

    #[test]
    fn a_clap_error_is_one_line_with_its_tip_and_without_the_usage() {
        let rendered = "error: unexpected argument '--epoch' found\n\n  tip: a similar argument exists: '--epochs'\n\nUsage: exercise1 --epochs <EPOCHS>\n\nFor more information, try '--help'.\n";
        assert_eq!(one_line(rendered), "error: unexpected argument '--epoch' found; tip: a similar argument exists: '--epochs' (see --help)");
        let missing = "error: the following required arguments were not provided:\n  --out <OUT>\n  <FILE>\n\nUsage: x --out <OUT> <FILE>\n";
        assert_eq!(one_line(missing), "error: the following required arguments were not provided: --out <OUT> <FILE> (see --help)");
    }

    #[test]
    fn numbers_out_of_their_range_are_refused_as_they_are_read() {
        assert_eq!(seconds("2.5"), Ok(2.5));
        assert_eq!(seconds("31536000"), Ok(MAX_SECONDS));
        for bad in ["0", "-1", "nan", "inf", "1e30", "31536001", "", "soon"] {
            assert!(seconds(bad).is_err(), "{bad:?}");
        }
        assert_eq!(minutes("0.5"), Ok(0.5));
        assert!(minutes("525601").is_err() && minutes("1e30").is_err());
        assert_eq!((positive("1e30"), non_negative("0")), (Ok(1e30), Ok(0.0)));
        assert_eq!(count("3"), Ok(3));
        for bad in ["0", "-1", "1.5", "nan", ""] {
            assert!(count(bad).is_err(), "{bad:?}");
        }
        for bad in ["0", "-1", "nan", "inf", "-inf", ""] {
            assert!(positive(bad).is_err(), "{bad:?}");
        }
        for bad in ["-1", "nan", "inf", "-0.5"] {
            assert!(non_negative(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_description_names_each_flag_with_the_kind_of_its_value() {
        #[derive(Parser)]
        struct Cli {
            #[arg(long)]
            data_dir: Option<PathBuf>,
            #[arg(long, default_value_t = 1)]
            epochs: usize,
            #[arg(long)]
            lr: Option<f64>,
            #[arg(long)]
            quiet: bool,
            #[arg(long, value_parser = ["a", "b"])]
            mode: Option<String>,
            file: PathBuf,
        }
        let described = describe(&Cli::command());
        let kind = |id: &str| described["args"].as_array().unwrap().iter().find(|a| a["id"] == id).map(|a| a["kind"].as_str().unwrap().to_string());
        assert_eq!(kind("data_dir").as_deref(), Some("path"));
        assert_eq!(kind("epochs").as_deref(), Some("integer"));
        assert_eq!(kind("lr").as_deref(), Some("number"));
        assert_eq!(kind("quiet").as_deref(), Some("switch"));
        assert_eq!(kind("mode").as_deref(), Some("choice"));
        assert_eq!(kind("file").as_deref(), Some("path"));
        assert_eq!(kind("help"), None);
        let file = described["args"].as_array().unwrap().iter().find(|a| a["id"] == "file").unwrap();
        assert_eq!((file["positional"].as_bool(), file["required"].as_bool()), (Some(true), Some(true)));
    }
}
