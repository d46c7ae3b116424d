//! Running a test binary's `rank_entry` test as the ranks of an MPI job: the launching test
//! starts `mpirun -np N <this test binary> --exact rank_entry` with `$TEST_SCENARIO` naming what
//! the ranks do; `rank_entry` does nothing when the variable is absent (a plain `cargo test`).
//! Every scenario ends with a line `scenario <name> passed on rank <r>`, which the launching
//! test looks for on every rank, so a rank that silently did nothing cannot pass.
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Names the scenario the ranks run.
pub const SCENARIO: &str = "TEST_SCENARIO";
/// A folder all ranks of a scenario see.
pub const SHARED_DIR: &str = "TEST_SHARED_DIR";

/// What a two-rank run printed, how it ended, and how long it took.
pub struct Run {
    pub status: ExitStatus,
    pub output: String,
    pub elapsed: Duration,
}

impl Run {
    /// Succeeded, and every one of `ranks` ranks finished the scenario.
    pub fn assert_passed(&self, scenario: &str, ranks: usize) {
        assert!(self.status.success(), "{scenario} failed ({}):\n{}", self.status, self.output);
        for rank in 0..ranks {
            let line = format!("scenario {scenario} passed on rank {rank}");
            assert!(self.output.contains(&line), "no `{line}` in:\n{}", self.output);
        }
    }
}

/// Runs `rank_entry` with `scenario` in a child process (under mpirun with `np` ranks, or
/// directly), killing it after `limit`.
pub fn launch(mpirun_np: Option<usize>, scenario: &str, vars: &[(&str, &str)], limit: Duration) -> Run {
    let exe = std::env::current_exe().unwrap();
    let mut command = match mpirun_np {
        Some(np) => {
            let mut c = Command::new("mpirun");
            // OpenMPI refuses root without the flag (containers); harmless otherwise.
            c.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &np.to_string()]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let shared = tempfile::tempdir().unwrap();
    let log_path = shared.path().join("output.log");
    let log = std::fs::File::create(&log_path).unwrap();
    command
        .args(["--exact", "rank_entry", "--nocapture", "--test-threads", "1"])
        .env(SCENARIO, scenario)
        .env(SHARED_DIR, shared.path())
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let start = Instant::now();
    let mut child = command.spawn().expect("mpirun is on PATH (OpenMPI: apt install openmpi-bin)");
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            // SIGTERM lets mpirun take its ranks down with it.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            let _ = child.wait();
            panic!("`{scenario}` still ran after {limit:?}, killed:\n{}", std::fs::read_to_string(&log_path).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run { status, output: std::fs::read_to_string(&log_path).unwrap(), elapsed: start.elapsed() }
}
