//! A rank whose launcher is gone stops. The `--nproc-per-node` launcher starts mpirun, which
//! starts the ranks: killed (SIGKILL, an OOM kill), the launcher takes no one down itself, and
//! mpirun, told by the kernel (`PR_SET_PDEATHSIG`), took a second or two to end its ranks, in
//! which they went on training and committed a checkpoint at every step they were asked to. So
//! every rank watches the processes it depends on:
//!
//! - the launcher, whose process id it passes on in [`LAUNCHER_VAR`] (taken only where that
//!   process is an ancestor of this one: a variable inherited from elsewhere is ignored);
//! - this rank's parent where MPI's process manager started it (mpirun, or Open MPI's orted on
//!   another node): without it the rank can no longer take part in its job.
//!
//! [`gone`] asks the kernel, without waiting, whether one has ended: through a pidfd (a process
//! handle, readable once the process has ended; Linux 5.3 and later), else by walking this
//! process's ancestors in /proc. The training loop asks after every step, so a step decided
//! after the launcher's end commits nothing: the ranks agree on it (as on a signal) and stop
//! without another checkpoint; MPI's waits ask too, and end with
//! [`Orphaned`](crate::error::Orphaned) instead of waiting for ranks that have stopped.
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use super::launch::{LaunchEnv, LAUNCHER_VAR};

/// A process this rank depends on.
struct Watched {
    pid: i32,
    /// Its pidfd, where the kernel has them.
    handle: Option<OwnedFd>,
    /// What to call it.
    who: String,
}

impl Watched {
    fn new(pid: i32, who: String) -> Watched {
        // SAFETY: pidfd_open takes a process id and flags and returns a new descriptor, or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as libc::c_int;
        // SAFETY: a descriptor just opened, owned from here on.
        let handle = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) });
        Watched { pid, handle, who }
    }

    /// Whether the process has ended (asked without waiting).
    fn ended(&self) -> bool {
        match &self.handle {
            Some(handle) => {
                let mut poll = libc::pollfd { fd: handle.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd, no waiting.
                unsafe { libc::poll(&mut poll, 1, 0) > 0 }
            }
            None => !is_ancestor(self.pid),
        }
    }
}

static WATCHED: OnceLock<Vec<Watched>> = OnceLock::new();
static GONE: OnceLock<String> = OnceLock::new();

/// Starts watching (once per process; later calls do nothing). A process no launcher started
/// watches nothing.
pub fn watch() {
    WATCHED.get_or_init(|| {
        let watched: Vec<Watched> = depended_on().into_iter().map(|(pid, who)| Watched::new(pid, who)).collect();
        // Opened after it was found an ancestor: the handle could be of a later process of the
        // same id, had the watched one ended in between; it is the ancestor's if it still is one.
        watched.into_iter().filter(|w| is_ancestor(w.pid)).collect()
    });
}

/// What this rank depended on and has ended ("the launcher (pid 123)"); none while all is
/// there, or nothing is watched. Once one has ended, always that one.
pub fn gone() -> Option<&'static str> {
    if GONE.get().is_none() {
        let ended = WATCHED.get()?.iter().find(|w| w.ended())?;
        let _ = GONE.set(ended.who.clone());
    }
    GONE.get().map(String::as_str)
}

/// The processes to watch, with what to call them.
fn depended_on() -> Vec<(i32, String)> {
    let launcher = std::env::var(LAUNCHER_VAR).ok().and_then(|v| v.trim().parse::<i32>().ok()).filter(|&pid| pid > 1 && is_ancestor(pid));
    let mut out: Vec<(i32, String)> = launcher.map(|pid| (pid, format!("the launcher (pid {pid})"))).into_iter().collect();
    let by_mpi = LaunchEnv::detect().is_ok_and(|env| env.mpi);
    // SAFETY: getppid has no preconditions and cannot fail.
    let parent = unsafe { libc::getppid() };
    if by_mpi && parent > 1 && Some(parent) != launcher {
        out.push((parent, format!("this rank's parent {} (pid {parent})", command_of(parent).unwrap_or_else(|| "process".into()))));
    }
    out
}

/// Whether process `pid` is this process's parent, or its parent's, and so on.
fn is_ancestor(pid: i32) -> bool {
    // SAFETY: getppid has no preconditions and cannot fail.
    let mut at = unsafe { libc::getppid() };
    // Bounded: a chain of processes is never this deep, and a cycle cannot loop forever.
    for _ in 0..256 {
        if at == pid {
            return true;
        }
        match parent_of(at) {
            Some(parent) if parent > 0 && parent != at => at = parent,
            _ => return false,
        }
    }
    false
}

/// Process `pid`'s parent, from /proc (none where it has ended or cannot be read).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (command) state ppid ...`: the command may hold spaces and parentheses.
    let fields = &stat[stat.rfind(')')? + 1..];
    fields.split_whitespace().nth(1)?.parse().ok()
}

/// Process `pid`'s command name (`mpirun`, `orted`), from /proc.
fn command_of(pid: i32) -> Option<String> {
    Some(std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_are_found_and_others_are_not() {
        // SAFETY: getppid and getpid have no preconditions.
        let (parent, me) = unsafe { (libc::getppid(), libc::getpid()) };
        assert!(is_ancestor(parent));
        assert!(!is_ancestor(me), "a process is not its own ancestor");
        let child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        assert!(!is_ancestor(child.id() as i32), "a child is not an ancestor");
        let mut child = child;
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(parent_of(me), Some(parent));
    }

    #[test]
    fn a_watched_process_is_seen_ended_once_it_has_ended() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let watched = Watched::new(child.id() as i32, "sleep".into());
        // Through the pidfd the kernel answers for any process; the walk through /proc, only
        // for ancestors (this child never is one).
        if watched.handle.is_some() {
            assert!(!watched.ended(), "a running process has not ended");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(watched.ended());
    }
}
