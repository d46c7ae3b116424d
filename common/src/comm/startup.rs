//! A deadline for a job's start. MPI's start-up (`MPI_Init`, then the ranks' host names
//! exchanged) waits for every rank of the job, and has no timeout of its own: a rank that ended
//! or stopped before it (a program that returned early with exit code 0 before the others had
//! got there, which mpirun does not notice; a process stopped or stuck on the way) left the
//! others waiting inside `MPI_Init` for ever, without a word. So a thread waits beside it on every rank: past
//! `--startup-timeout` (300 s by default, as the TCP rendezvous of ranks that torchrun starts),
//! the job ends, exit code [`super::watchdog::HUNG_EXIT_CODE`], with one line naming the ranks
//! that never arrived.
//!
//! Naming them: before `MPI_Init` each rank marks its arrival with a file (`rank-<r>`) in the
//! folder [`ARRIVALS_VAR`] names, which the `--nproc-per-node` launcher makes for the ranks it
//! starts (private, all of them on its node; emptied and removed once start-up is over). The
//! lowest rank that marked its arrival reports; the ranks without a mark are the ones that never
//! arrived. Without that folder (ranks that mpirun or srun started, perhaps on several nodes: no
//! folder all of them see), rank 0 reports that a rank never arrived, without naming it.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use super::launch::{LaunchEnv, ARRIVALS_VAR};

/// `--startup-timeout`'s default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Test hook (`RANK`): that rank never arrives, waiting for ever before MPI's start-up, as one
/// stuck before it would. (One that ends before it with exit code 0 leaves the others waiting
/// the same way where it ended before any of them had called `MPI_Init`; after that, mpirun
/// notices and ends the job itself: a hook that ended the rank would test whichever came first.)
pub const TEST_NEVER_ARRIVES: &str = "COURSE_TEST_NEVER_ARRIVES";

static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64);

/// Sets how long the job's start may take on each rank (`--startup-timeout`).
pub fn set_timeout(timeout: Duration) {
    TIMEOUT_MS.store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
}

pub fn timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::Relaxed))
}

/// The deadline of this rank's start-up, armed until dropped (start-up done, or failed with an
/// error of its own).
pub struct Deadline {
    _armed: Option<mpsc::Sender<()>>,
    /// This rank's mark, removed once start-up is over (and the folder with the last one: a
    /// launcher killed later leaves nothing behind).
    mark: Option<PathBuf>,
}

impl Deadline {
    /// Marks this rank's arrival and starts the clock; a job of one rank waits for no one.
    pub fn arm(env: &LaunchEnv) -> Deadline {
        if !env.is_distributed() {
            return Deadline { _armed: None, mark: None };
        }
        if std::env::var(TEST_NEVER_ARRIVES).ok().and_then(|v| v.trim().parse::<usize>().ok()) == Some(env.rank) {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        let arrivals = std::env::var_os(ARRIVALS_VAR).map(PathBuf::from);
        let mark = arrivals.as_deref().and_then(|dir| mark(dir, env.rank));
        let arrivals = arrivals.filter(|_| mark.is_some());
        let (armed, done) = mpsc::channel::<()>();
        let (rank, size, timeout) = (env.rank, env.world_size, timeout());
        let watch = move || {
            // Start-up ends by dropping the sender (disconnected); only the time running out
            // ends the job.
            if let Err(mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(timeout) {
                expire(rank, size, arrivals.as_deref(), timeout);
            }
        };
        match std::thread::Builder::new().name("start-up deadline".into()).spawn(watch) {
            Ok(_) => Deadline { _armed: Some(armed), mark },
            // Without the thread, start-up waits as it did before there was one.
            Err(_) => Deadline { _armed: None, mark },
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(mark) = self.mark.take() {
            let _ = std::fs::remove_file(&mark);
            // Only where empty: the last rank's removal takes the folder.
            if let Some(dir) = mark.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// Marks the arrival of `rank` in `dir`: the mark's path, where it could be made.
fn mark(dir: &Path, rank: usize) -> Option<PathBuf> {
    let path = dir.join(format!("rank-{rank}"));
    std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&path).ok().map(|_| path)
}

/// The ranks that marked their arrival in `dir`.
fn arrived(dir: &Path) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut ranks: Vec<usize> = entries.flatten().filter_map(|e| e.file_name().to_str()?.strip_prefix("rank-")?.parse().ok()).collect();
    ranks.sort_unstable();
    ranks
}

/// The time ran out on `rank`: the rank that reports says which ranks never arrived, and every
/// one ends the process (the others a moment later, so that the line is out first).
fn expire(rank: usize, size: usize, arrivals: Option<&Path>, waited: Duration) -> ! {
    let arrived = arrivals.map(arrived);
    let reports = match &arrived {
        Some(arrived) => arrived.first() == Some(&rank),
        None => rank == 0,
    };
    if reports {
        let missing = arrived.map(|arrived| (0..size).filter(|r| !arrived.contains(r)).collect::<Vec<_>>());
        crate::error::say(&format!("error on rank {rank}: {}", never_arrived(size, missing.as_deref(), waited)));
    } else {
        std::thread::sleep(Duration::from_secs(2));
    }
    // SAFETY: _exit ends the process at once: MPI is not initialised (MPI_Init has not returned),
    // so there is nothing to finalise, and the thread stuck in it must not be waited for.
    unsafe { libc::_exit(super::watchdog::HUNG_EXIT_CODE) }
}

/// The line of a start-up that did not complete in `waited`: the ranks of `size` that never
/// arrived, where known (`missing`).
fn never_arrived(size: usize, missing: Option<&[usize]>, waited: Duration) -> String {
    let waited = format!("MPI start-up waited {:.0} s (--startup-timeout)", waited.as_secs_f64());
    match missing {
        Some([]) => format!("{waited}, every rank of the {size} arrived but start-up did not complete (MPI could not connect them): ending the job"),
        Some(missing) => {
            let names: Vec<String> = missing.iter().map(usize::to_string).collect();
            let (s, they) = if missing.len() == 1 { ("", "it") } else { ("s", "they") };
            format!("{waited}: rank{s} {} of the {size} never arrived ({they} ended or stopped before MPI start-up): ending the job", names.join(", "))
        }
        None => format!("{waited}: a rank of the {size} never arrived (ended or stopped before MPI start-up): ending the job"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_ranks_that_never_arrived() {
        let waited = Duration::from_secs(300);
        assert_eq!(
            never_arrived(2, Some(&[1]), waited),
            "MPI start-up waited 300 s (--startup-timeout): rank 1 of the 2 never arrived (it ended or stopped before MPI start-up): ending the job"
        );
        assert!(never_arrived(4, Some(&[1, 3]), waited).contains("ranks 1, 3 of the 4 never arrived"));
        assert!(never_arrived(4, None, waited).contains("a rank of the 4 never arrived"));
        assert!(never_arrived(4, Some(&[]), waited).contains("every rank of the 4 arrived"));
    }

    #[test]
    fn arrivals_are_read_from_their_marks() {
        let dir = tempfile::tempdir().unwrap();
        assert!(mark(dir.path(), 2).is_some() && mark(dir.path(), 0).is_some());
        std::fs::write(dir.path().join("something-else"), b"").unwrap();
        assert_eq!(arrived(dir.path()), [0, 2]);
        assert!(mark(&dir.path().join("missing"), 1).is_none(), "no folder, no mark");
    }
}
