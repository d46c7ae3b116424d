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

/// Shorthand for returning a [`UsageError`].
pub fn usage<T>(msg: impl Into<String>) -> anyhow::Result<T> {
    Err(UsageError(msg.into()).into())
}

/// Runs a binary's body, printing its error as one line (with its causes) and mapping it to an exit code.
pub fn run_main(body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    // LibTorch errors carry a C++ backtrace; only its first line is useful to a user.
    std::env::set_var("TORCH_SHOW_CPP_STACKTRACES", "0");
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let message = format!("{err:#}");
            let first_line = message.lines().next().unwrap_or_default();
            eprintln!("error: {first_line}");
            ExitCode::from(exit_code(&err))
        }
    }
}

/// 2 for a usage error, the children's code when they failed, 1 otherwise.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    if let Some(ChildExit(code)) = err.downcast_ref::<ChildExit>() {
        return u8::try_from(*code).ok().filter(|&c| c != 0).unwrap_or(1);
    }
    if err.chain().any(|cause| cause.is::<UsageError>()) {
        2
    } else {
        1
    }
}
