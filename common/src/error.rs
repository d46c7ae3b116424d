//! How binaries fail: one clear line and an exit code, never a panic or a LibTorch backtrace.
//!
//! A [`UsageError`] anywhere in an error chain marks a user mistake that the command line
//! could have avoided (CUDA asked for but absent, an impossible flag combination): exit 2,
//! like clap's own flag errors. Everything else (bad data, I/O) exits 1.
use std::process::ExitCode;

/// A mistake in how the program was called.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Child processes (the ranks under mpirun) failed and have reported why: exit with their code.
#[derive(Debug, thiserror::Error)]
#[error("the ranks started through mpirun failed (exit code {0})")]
pub struct ChildExit(pub i32);

/// A run stopped by a signal ends with this code: EX_TEMPFAIL of sysexits.h, "a temporary
/// failure; the user is invited to retry", which is what a preempted run is. Neither success
/// (the run is not finished) nor a failure (nothing went wrong): a job script or a requeue can
/// tell it apart from both.
pub const STOPPED_EXIT_CODE: u8 = 75;

/// A job ended for a hang (a collective that waited past `--collective-timeout`, a start-up past
/// `--startup-timeout`: `comm::watchdog`, `comm::startup`): a rank has said in one line which
/// ranks did not answer or never arrived; the launcher adds nothing to it.
pub const HUNG_EXIT_CODE: i32 = 3;

/// The run stopped at a signal's request (`train::preemption`) after `step` optimizer steps,
/// its state checkpointed to `checkpoint` (none without `--checkpoint-dir`). Not a failure:
/// [`run_main`] says it without "error:", where `says` (the job's rank 0, or the process alone:
/// once for the job, however many of its processes caught the signal), and exits with
/// [`STOPPED_EXIT_CODE`]. `signal` is the one the ranks agreed to stop for, the same on every rank.
#[derive(Debug, thiserror::Error)]
#[error("stopped by {signal} after step {step}: {}", match checkpoint {
    Some(path) => format!("checkpointed to {}; --resume continues from there", path.display()),
    None => "no --checkpoint-dir, so nothing was saved".to_string(),
})]
pub struct Stopped {
    pub signal: &'static str,
    pub step: usize,
    pub checkpoint: Option<std::path::PathBuf>,
    pub says: bool,
}

/// What this rank depended on (the `--nproc-per-node` launcher, its mpirun) has ended
/// (`comm::orphan`): the rank stopped without another checkpoint. Exits with
/// [`STOPPED_EXIT_CODE`]: a resume continues from the last checkpoint committed.
#[derive(Debug, thiserror::Error)]
#[error("{gone} has ended: stopped {at} without another checkpoint; --resume continues from the last one committed")]
pub struct Orphaned {
    /// What ended ("the launcher (pid 123)").
    pub gone: String,
    /// Where this rank was ("after step 47", "in all_reduce").
    pub at: String,
}

/// The `--nproc-per-node` launcher was told to stop twice (Ctrl-C twice, `kill` again): it
/// passed the second signal on to mpirun as it is, which stopped the ranks at once; exit with the
/// shell's code for it, 128 + signal. (The first asks the ranks to stop at a step and
/// checkpoint: see `comm::launch`.)
#[derive(Debug, thiserror::Error)]
#[error("stopped by {}: passed on to mpirun, which stopped the ranks", signal_name(*.0))]
pub struct Interrupted(pub i32);

/// `SIGINT`, `SIGTERM`, or `signal N`.
fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// Shorthand for returning a [`UsageError`].
pub fn usage<T>(msg: impl Into<String>) -> anyhow::Result<T> {
    Err(UsageError(msg.into()).into())
}

/// Writes `line` and its newline to stderr in one write: ranks share mpirun's pipe, and a line
/// written in pieces interleaves with another rank's, character by character.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(format!("{line}\n").as_bytes());
}

/// Runs a binary's body, printing its error as one line (with its causes) and mapping it to an exit code.
pub fn run_main(body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    // LibTorch errors carry a C++ backtrace; only its first line is useful to a user.
    std::env::set_var("TORCH_SHOW_CPP_STACKTRACES", "0");
    quiet_panics();
    match catch_panic(body) {
        Ok(()) => ExitCode::SUCCESS,
        // `exercise3 plan ... | head`: the reader has what it wanted; nothing to report.
        Err(err) if closed_stdout(&format!("{err:#}")) => ExitCode::SUCCESS,
        Err(err) => {
            let message = first_line(&err);
            let first_line = message.as_str();
            match (err.downcast_ref::<Stopped>(), err.downcast_ref::<ChildExit>()) {
                (Some(stopped), _) if stopped.says => say(first_line),
                // Said without "error:" too: a stop, where the launcher's end asked for none.
                _ if err.chain().any(|cause| cause.is::<Orphaned>()) => say(first_line),
                // Another rank of the job says it, or ranks that stopped (their rank 0 said it).
                (Some(_), _) => {}
                // Ranks that stopped, or ended a hung job: one of them said why.
                (_, Some(ChildExit(code))) if *code == STOPPED_EXIT_CODE as i32 || *code == HUNG_EXIT_CODE => {}
                _ => say(&format!("error: {first_line}")),
            }
            ExitCode::from(exit_code(&err))
        }
    }
}

/// 2 for a usage error, the children's code when they failed, [`STOPPED_EXIT_CODE`] for a run a
/// signal stopped or whose launcher ended, 128 + the signal for a launcher whose ranks had to be
/// stopped at once, 1 otherwise.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    if err.chain().any(|cause| cause.is::<Stopped>() || cause.is::<Orphaned>()) {
        return STOPPED_EXIT_CODE;
    }
    if let Some(Interrupted(signal)) = err.downcast_ref::<Interrupted>() {
        return u8::try_from(128 + signal).unwrap_or(1);
    }
    if let Some(ChildExit(code)) = err.downcast_ref::<ChildExit>() {
        return u8::try_from(*code).ok().filter(|&c| c != 0).unwrap_or(1);
    }
    if err.chain().any(|cause| cause.is::<UsageError>()) {
        2
    } else {
        1
    }
}

/// A tch call that failed inside LibTorch panics (most of tch's API unwraps its `Result`), with
/// the C++ exception's text and frames. Such a panic is caught where a rank or a binary ends
/// ([`catch_panic`]) and becomes an error of one line; the default hook would first print the
/// whole message and its frames, so it stays silent unless `RUST_BACKTRACE` asks for them.
pub fn quiet_panics() {
    let backtraces = std::env::var_os("RUST_BACKTRACE").is_some();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let text = info.payload().downcast_ref::<String>().map(String::as_str).or_else(|| info.payload().downcast_ref::<&str>().copied());
        // A reader that closed our stdout (`| head`) is not a fault to show frames for.
        if backtraces && !text.is_some_and(closed_stdout) {
            default(info);
        }
    }));
}

/// Whether `message` is `println!`'s panic on a stdout whose reader has gone (`| head`): Rust
/// ignores SIGPIPE, so the write fails instead of ending the process as it would a C tool.
/// (SIGPIPE stays ignored: a rank's write to a dead peer's socket must fail with an error the
/// run reports, not kill the rank without a word.)
fn closed_stdout(message: &str) -> bool {
    message.contains("failed printing to stdout") && message.contains("Broken pipe")
}

/// Runs `body`, turning a panic in it into an error: [`OutOfMemory`] when LibTorch could not
/// allocate, otherwise the panic's first line.
pub fn catch_panic<T>(body: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => Err(panic_error(payload.as_ref())),
    }
}

/// What a user is told of `err`: its first line, with its causes; LibTorch's failure to
/// allocate, returned rather than panicked (`Internal torch error: [enforce fail at
/// alloc_cpu.cpp:127] ...`), as the [`OutOfMemory`] line, saying what to lower.
pub fn first_line(err: &anyhow::Error) -> String {
    let message = format!("{err:#}");
    let line = message.lines().next().unwrap_or_default();
    if !err.chain().any(|cause| cause.is::<OutOfMemory>()) && OOM_PHRASES.iter().any(|phrase| line.contains(phrase)) {
        return OutOfMemory(torch_message(line)).to_string();
    }
    line.to_string()
}

/// What LibTorch and the C++ runtime say when an allocation fails.
const OOM_PHRASES: [&str; 4] = ["out of memory", "not enough memory", "can't allocate memory", "std::bad_alloc"];

/// LibTorch could not allocate: what it said, and what to lower.
#[derive(Debug, thiserror::Error)]
#[error("out of memory: {0}; lower --batch-size (or the model's size: --emsize, --nlayers, --model), or train in bf16-mixed, with --checkpoint-activations, or on more ranks")]
pub struct OutOfMemory(pub String);

/// The error a panic's payload stands for.
pub fn panic_error(payload: &(dyn std::any::Any + Send)) -> anyhow::Error {
    let text = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("a panic without a message");
    let what = torch_message(text);
    if OOM_PHRASES.iter().any(|o| what.contains(o)) {
        OutOfMemory(what).into()
    } else {
        anyhow::anyhow!("internal error: {what} (RUST_BACKTRACE=1 shows where)")
    }
}

/// The first line of what LibTorch said, out of a panic's text: tch's unwraps print the error's
/// Debug form (`Torch("...\nException raised from ...")`, newlines escaped).
fn torch_message(text: &str) -> String {
    let text = text.strip_prefix("called `Result::unwrap()` on an `Err` value: ").unwrap_or(text);
    let text = text.strip_prefix("Torch(\"").unwrap_or(text);
    let end = [text.find("\\n"), text.find('\n'), text.find("Exception raised from")].into_iter().flatten().min().unwrap_or(text.len());
    let line = text[..end].trim().trim_end_matches("\")").trim();
    // LibTorch's CPU allocator prefixes its source location and the failed check
    // (`[enforce fail at alloc_cpu.cpp:117] data. ` or `err == 0. `): the rest is the message.
    match line.find("DefaultCPUAllocator") {
        Some(i) => line[i..].to_string(),
        None => line.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_libtorch_allocation_failure_is_out_of_memory_in_one_line() {
        let cpu = r#"called `Result::unwrap()` on an `Err` value: Torch("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate 80000000000 bytes.\nException raised from alloc_cpu at /pytorch/c10/core/impl/alloc_cpu.cpp:117 (most recent call first):\nframe #0: c10::ThrowEnforceNotMet")"#;
        let err = panic_error(&cpu.to_string());
        assert!(err.is::<OutOfMemory>(), "{err}");
        let line = err.to_string();
        assert!(line.starts_with("out of memory: DefaultCPUAllocator: not enough memory: you tried to allocate 80000000000 bytes."), "{line}");
        assert!(!line.contains("frame #0") && !line.contains('\n') && line.contains("--batch-size"), "{line}");
        let cuda = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB";
        assert!(panic_error(&cuda).is::<OutOfMemory>());
        assert_eq!(exit_code(&panic_error(&cuda)), 1);
    }

    #[test]
    fn another_panic_is_an_internal_error_of_one_line() {
        let err = catch_panic::<()>(|| panic!("index out of bounds: the len is 3 but the index is 7")).unwrap_err();
        assert_eq!(err.to_string(), "internal error: index out of bounds: the len is 3 but the index is 7 (RUST_BACKTRACE=1 shows where)");
        assert_eq!(catch_panic(|| Ok(5)).unwrap(), 5);
    }
}
