//! Stopping cleanly when the job is told to end: Slurm's warning signal before a time limit or a
//! preemption (`#SBATCH --signal=B:USR1@120`), the SIGTERM that `scancel`, a preemption or a
//! node's shutdown sends, and Ctrl-C (SIGINT). The handler only raises a flag; the training
//! loop reads it between optimizer steps, every rank agrees on the step to stop at and on the
//! signal (one small collective), the run checkpoints there and ends with [`Stopped`] (exit code
//! [`STOPPED_EXIT_CODE`], 75), said once for the job, by its rank 0. A second signal while it does
//! so ends the process at once, as the signal's default action would have (an impatient Ctrl-C
//! still works).
//!
//! A process of the job that does not train (a parameter server) passes the signal it caught on
//! in its replies; a worker that reads it [`relay`]s it here, and the workers stop as if they had
//! caught it themselves.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::Result;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};

/// The signals that ask a run to stop, with their names.
pub const SIGNALS: [(i32, &str); 3] = [(SIGUSR1, "SIGUSR1"), (SIGTERM, "SIGTERM"), (SIGINT, "SIGINT")];

pub use crate::error::{Stopped, STOPPED_EXIT_CODE};

/// The signal received (0: none yet). One per process: signals are.
fn received() -> &'static Arc<AtomicUsize> {
    static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    RECEIVED.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// A signal another process of the job caught and told this one of (0: none).
static RELAYED: AtomicUsize = AtomicUsize::new(0);

/// Catches [`SIGNALS`] from now on (once per process; later calls do nothing), and watches the
/// processes that started this rank ([`crate::comm::orphan`]).
pub fn install() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let (flag, armed) = (Arc::clone(received()), Arc::new(AtomicBool::new(false)));
            for (signal, name) in SIGNALS {
                let caught = || -> std::io::Result<()> {
                    // In this order: a signal arriving once one has been caught takes the default
                    // action; the first is only recorded (armed, and which signal it was).
                    signal_hook::flag::register_conditional_default(signal, Arc::clone(&armed))?;
                    signal_hook::flag::register(signal, Arc::clone(&armed))?;
                    signal_hook::flag::register_usize(signal, Arc::clone(&flag), signal as usize)?;
                    Ok(())
                };
                caught().map_err(|e| format!("cannot catch {name}: {e}"))?;
            }
            crate::comm::orphan::watch();
            Ok(())
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// The number of the signal that asks this process to stop, caught here or [`relay`]ed from
/// another process of the job; 0 while none has.
pub fn requested_signal() -> i32 {
    match received().load(Ordering::Relaxed) {
        0 => RELAYED.load(Ordering::Relaxed) as i32,
        caught => caught as i32,
    }
}

/// The name of the signal that asks this process to stop ([`requested_signal`]), if one does.
pub fn requested() -> Option<&'static str> {
    name(requested_signal())
}

/// The name of stop signal `signal`; none for 0 or any other number.
pub fn name(signal: i32) -> Option<&'static str> {
    SIGNALS.iter().find(|(s, _)| *s == signal).map(|(_, name)| *name)
}

/// Another process of the job (a parameter server) caught stop signal `signal`: this one stops
/// as if it had (a number that is not a stop signal is ignored).
pub fn relay(signal: i32) {
    if name(signal).is_some() {
        RELAYED.store(signal as usize, Ordering::Relaxed);
    }
}
