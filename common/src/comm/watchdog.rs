//! Deadlines for communication: a rank that stops (SIGSTOP, a hung GPU, a lost node whose MPI
//! connection stays open) would otherwise leave every other rank waiting in its collective
//! forever. Every collective and message of the MPI engine waits against a deadline
//! (`--collective-timeout`, 10 minutes by default, as PyTorch's NCCL watchdog; the first
//! operation of each group waits at least [`FIRST_AT_LEAST`], start-up and data loading in
//! mind). When it passes, the waiting ranks ask each other, on a communicator of their own, who
//! is there ([`Hang`]; ranks still waiting short of their own deadline answer too): the lowest
//! of them says in one line which operation of which group waited how long and which ranks did
//! not answer, and the job ends (`MPI_Abort`), at most [`grace`] (2 s) after the deadline. The NCCL
//! engine polls each operation's stream and the communicator's background error against the
//! same deadline and, past it, aborts the communicator and ends the process (NCCL has no side
//! channel for a roll call: the line names the operation, not the missing rank).
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The default deadline of one operation.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// The least a group's first operation waits.
pub const FIRST_AT_LEAST: Duration = Duration::from_secs(300);
pub use crate::error::HUNG_EXIT_CODE;

static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64);

/// The training loop's progress, for a hang's line to say what the job loses: the last step
/// taken, and the step of the last checkpoint committed ([`NONE`] while there is none).
static STEP: AtomicU64 = AtomicU64::new(NONE);
static COMMITTED: AtomicU64 = AtomicU64::new(NONE);
const NONE: u64 = u64::MAX;

/// The training loop took optimizer step `step` (from 1).
pub fn note_step(step: usize) {
    STEP.store(step as u64, Ordering::Relaxed);
}

/// The checkpoint of step `step` is committed: a resume would start there.
pub fn note_committed(step: usize) {
    COMMITTED.store(step as u64, Ordering::Relaxed);
}

/// This process does not see the job's checkpoints committed (another rank writes them).
pub fn note_committed_elsewhere() {
    COMMITTED.store(ELSEWHERE, Ordering::Relaxed);
}
const ELSEWHERE: u64 = u64::MAX - 1;

/// What a job ended now loses, where this process trains: `after step 20; the last checkpoint
/// is of step 14: a resume trains the 6 steps since again`.
pub fn at_stake() -> Option<String> {
    let step = STEP.load(Ordering::Relaxed);
    if step == NONE {
        return None;
    }
    Some(match COMMITTED.load(Ordering::Relaxed) {
        ELSEWHERE => format!("after step {step}; rank 0 writes the checkpoints: a resume starts from its last"),
        NONE => format!("after step {step}; no checkpoint committed in this run: a resume starts where this run started"),
        at if at >= step => format!("after step {step}, its checkpoint committed: nothing is lost"),
        at => {
            let since = step - at;
            format!("after step {step}; the last checkpoint is of step {at}: a resume trains the {since} step{} since again", if since == 1 { "" } else { "s" })
        }
    })
}

/// Sets the deadline of every later operation in this process (`--collective-timeout`).
pub fn set_timeout(timeout: Duration) {
    TIMEOUT_MS.store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
}

pub fn timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::Relaxed))
}

/// How long operation number `seq` (from 1) of a group may wait.
pub fn deadline(seq: u64) -> Duration {
    match seq {
        1 => timeout().max(FIRST_AT_LEAST),
        _ => timeout(),
    }
}

/// How long the ranks that timed out wait for the others' answers to their roll call: ranks
/// waiting in an operation of the same group answer within a tenth of a second, past or not past
/// their own deadline ([`crate::comm::mpi`]); one that does not answer in this time is stopped,
/// hung, or busy elsewhere. So a hung job ends within `--collective-timeout` plus this.
pub fn grace() -> Duration {
    timeout().clamp(Duration::from_millis(500), Duration::from_secs(2))
}

/// Test hook (`COURSE_TEST_STALL_COLLECTIVE=RANK:SEQ`): on rank RANK, the operation of a group
/// numbered SEQ (the first is 1) never completes as far as that rank can tell, as if a peer had
/// stopped, so that the watchdog's firing path runs on a real engine, with one rank or many
/// (`make gpu-check` over NCCL). The operation itself runs; only its completion is never seen.
/// RANK is the job rank on MPI and the rank in the communicator on NCCL (the same for the job's
/// whole group).
pub const TEST_STALL_COLLECTIVE: &str = "COURSE_TEST_STALL_COLLECTIVE";

/// Whether operation `seq` of a group is to be stalled on rank `rank` ([`TEST_STALL_COLLECTIVE`]).
pub fn stalled(rank: usize, seq: u64) -> bool {
    static STALL: std::sync::OnceLock<Option<(usize, u64)>> = std::sync::OnceLock::new();
    *STALL.get_or_init(|| std::env::var(TEST_STALL_COLLECTIVE).ok().and_then(|v| parse_stall(&v))) == Some((rank, seq))
}

fn parse_stall(value: &str) -> Option<(usize, u64)> {
    let (rank, seq) = value.trim().split_once(':')?;
    Some((rank.parse().ok()?, seq.parse().ok()?))
}

/// What a hang looked like from the ranks that were still there.
#[derive(Debug, Clone, PartialEq)]
pub struct Hang {
    /// The operation (`all_reduce`, `recv from rank 1`, ...).
    pub op: String,
    /// Its number among the group's operations, from 1, on the rank that reports.
    pub seq: u64,
    pub group_size: usize,
    pub waited: Duration,
    /// Job (world) ranks that answered, with the number of the operation each waited in.
    pub answered: Vec<(usize, u64)>,
    /// Job ranks of the group that did not answer.
    pub silent: Vec<usize>,
}

impl std::fmt::Display for Hang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // On several hosts, each rank with its host: "rank 5 (node2) does not answer".
        let ranks = |ranks: &[usize]| ranks.iter().map(|&rank| super::hosts::number_on_host(rank)).collect::<Vec<_>>().join(", ");
        let group = if self.group_size == 1 { String::from("1 rank") } else { format!("{} ranks", self.group_size) };
        write!(f, "{} (operation #{} of a group of {group}) waited {:.0} s (--collective-timeout): ", self.op, self.seq, self.waited.as_secs_f64())?;
        if self.silent.is_empty() {
            let at: Vec<String> = self.answered.iter().map(|(rank, seq)| format!("rank {} at #{seq}", super::hosts::number_on_host(*rank))).collect();
            return write!(f, "every rank is there but they wait in different operations ({}): the ranks called different collectives", at.join(", "));
        }
        let answered: Vec<usize> = self.answered.iter().map(|(rank, _)| *rank).collect();
        let (s, verb) = if self.silent.len() == 1 { ("", "does") } else { ("s", "do") };
        let waiting = if answered.len() == 1 { format!("rank {} was waiting", answered[0]) } else { format!("ranks {} were waiting", ranks(&answered)) };
        write!(f, "rank{s} {} {verb} not answer (stopped, hung, or still busy elsewhere; {waiting}): ending the job", ranks(&self.silent))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hung_job_ends_within_the_timeout_and_two_seconds() {
        for seconds in [0.1, 1.0, 5.0, 12.0, 600.0] {
            set_timeout(Duration::from_secs_f64(seconds));
            assert!(grace() <= Duration::from_secs(2) && grace() >= Duration::from_millis(500), "{seconds} s: grace {:?}", grace());
        }
        set_timeout(DEFAULT_TIMEOUT);
    }

    #[test]
    fn a_hang_says_what_a_resume_trains_again() {
        assert_eq!(at_stake(), None, "no training step yet");
        note_step(20);
        assert!(at_stake().unwrap().contains("no checkpoint committed in this run"));
        note_committed(14);
        assert_eq!(at_stake().unwrap(), "after step 20; the last checkpoint is of step 14: a resume trains the 6 steps since again");
        note_committed(19);
        assert!(at_stake().unwrap().ends_with("the 1 step since again"), "{:?}", at_stake());
        note_committed(20);
        assert!(at_stake().unwrap().contains("nothing is lost"));
    }

    #[test]
    fn the_stall_hook_names_one_rank_and_one_operation() {
        assert_eq!(parse_stall("1:3"), Some((1, 3)));
        assert_eq!(parse_stall(" 0:12\n"), Some((0, 12)));
        for bad in ["", "1", "a:3", "1:b", "1:3:4", "-1:3"] {
            assert_eq!(parse_stall(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_hang_names_the_silent_ranks_and_a_mismatch_says_so() {
        let hang = Hang {
            op: "all_reduce".into(),
            seq: 57,
            group_size: 4,
            waited: Duration::from_secs(60),
            answered: vec![(0, 57), (2, 57), (3, 57)],
            silent: vec![1],
        };
        assert_eq!(
            hang.to_string(),
            "all_reduce (operation #57 of a group of 4 ranks) waited 60 s (--collective-timeout): rank 1 does not answer (stopped, hung, or still busy elsewhere; ranks 0, 2, 3 were waiting): ending the job"
        );
        let mismatch = Hang { answered: vec![(0, 57), (1, 58)], silent: vec![], group_size: 2, ..hang };
        assert!(mismatch.to_string().contains("rank 0 at #57, rank 1 at #58"), "{mismatch}");
        let pair = Hang { answered: vec![(0, 9)], silent: vec![1], group_size: 2, ..mismatch };
        assert!(pair.to_string().contains("rank 1 does not answer (stopped, hung, or still busy elsewhere; rank 0 was waiting)"), "{pair}");
        assert_eq!(deadline(1), FIRST_AT_LEAST.max(timeout()));
    }
}
