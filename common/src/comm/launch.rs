//! Which rank this process is, read from the environment its launcher set up, and starting
//! local ranks through `mpirun` for `--nproc-per-node`.
//!
//! Launchers are recognised in this order (the first one whose variables are present wins):
//!
//! 1. an MPI launcher: OpenMPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`), MPICH / Intel MPI's Hydra
//!    (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`; also Slurm's
//!    `srun --mpi=pmi2`);
//! 2. Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NNODES`,
//!    `SLURM_NTASKS_PER_NODE` or `SLURM_TASKS_PER_NODE`);
//! 3. `torchrun` and other launchers following PyTorch's `env://` convention (`RANK`,
//!    `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_WORLD_SIZE`);
//! 4. none of them: a single process.
//!
//! `MASTER_ADDR` / `MASTER_PORT` (where rank 0 listens when the ranks exchange NCCL's id without
//! MPI) are read whatever the launcher. Inconsistent values are usage errors that name the
//! variables, so a misconfigured job fails at once instead of hanging in its first collective.
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use anyhow::{Context, Result};

use crate::device::{self, DeviceChoice};
use crate::error::{usage, Interrupted, UsageError};

/// What started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LaunchSource {
    /// No launcher: one process, rank 0 of 1.
    Single,
    /// `mpirun` / `mpiexec` (OpenMPI, MPICH, Intel MPI) or `srun --mpi=pmi2`.
    Mpi,
    /// Slurm's `srun`.
    Slurm,
    /// `torchrun` (PyTorch's `RANK` / `WORLD_SIZE` convention).
    Torchrun,
}

impl std::fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LaunchSource::Single => "single process",
            LaunchSource::Mpi => "mpirun",
            LaunchSource::Slurm => "srun",
            LaunchSource::Torchrun => "torchrun",
        })
    }
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// 0-based, unique in the job.
    pub rank: usize,
    pub world_size: usize,
    /// 0-based among the ranks on this node: picks the GPU.
    pub local_rank: usize,
    pub local_world_size: usize,
    pub nnodes: usize,
    pub source: LaunchSource,
    /// `MASTER_ADDR` and `MASTER_PORT`, when both are set.
    pub master: Option<(String, u16)>,
    /// Whether MPI's process manager started this rank (mpirun, Hydra, `srun --mpi=pmix` or
    /// `--mpi=pmi2`), so that `MPI_Init` joins the ranks into one world. A plain `srun` or
    /// torchrun does not: MPI would start a world of one.
    pub mpi: bool,
}

impl LaunchEnv {
    /// Rank 0 of 1, no launcher.
    pub fn single() -> LaunchEnv {
        LaunchEnv { rank: 0, world_size: 1, local_rank: 0, local_world_size: 1, nnodes: 1, source: LaunchSource::Single, master: None, mpi: false }
    }

    /// Reads the process environment (see the module docs).
    pub fn detect() -> Result<LaunchEnv> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`LaunchEnv::detect`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let vars = Vars(&var);
        let master = match (vars.get("MASTER_ADDR"), vars.num::<u16>("MASTER_PORT")?) {
            (Some(addr), Some(port)) => Some((addr, port)),
            _ => None,
        };
        // PMIx (OpenMPI's mpirun, `srun --mpi=pmix`) sets PMIX_RANK for every rank it starts.
        let pmix = vars.get("PMIX_RANK").is_some();
        let env = if let Some(env) = from_mpi(&vars)? {
            env
        } else if let Some(env) = from_slurm(&vars)? {
            LaunchEnv { mpi: pmix, ..env }
        } else if let Some(env) = from_torchrun(&vars)? {
            env
        } else {
            LaunchEnv::single()
        };
        // torchrun-style variables exported in a job script must not contradict the launcher.
        if env.source != LaunchSource::Torchrun {
            if let Some(size) = vars.num::<usize>("WORLD_SIZE")? {
                if size != env.world_size {
                    return usage(format!(
                        "WORLD_SIZE={size} disagrees with the {} launcher's world size {} ({}): unset WORLD_SIZE or make them agree",
                        env.source,
                        env.world_size,
                        env.size_var(),
                    ));
                }
            }
        }
        Ok(LaunchEnv { master, ..env })
    }

    /// More than one rank.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// The variable the world size was read from, for error messages.
    fn size_var(&self) -> &'static str {
        match self.source {
            LaunchSource::Mpi => "OMPI_COMM_WORLD_SIZE or PMI_SIZE",
            LaunchSource::Slurm => "SLURM_NTASKS",
            LaunchSource::Torchrun => "WORLD_SIZE",
            LaunchSource::Single => "no launcher",
        }
    }
}

/// Named variable lookups that parse numbers, with errors naming the variable.
struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.trim().is_empty())
    }

    fn num<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.trim().parse() {
                Ok(n) => Ok(Some(n)),
                Err(_) => usage(format!("{name}={v} is not a valid number")),
            },
        }
    }

    /// The first of `names` that is set, with its name.
    fn first<T: std::str::FromStr>(&self, names: &[&'static str]) -> Result<Option<(&'static str, T)>> {
        for &name in names {
            if let Some(n) = self.num(name)? {
                return Ok(Some((name, n)));
            }
        }
        Ok(None)
    }
}

/// One launcher's rank / size / local rank / local size, with the variables they came from.
struct Numbers {
    rank: (&'static str, usize),
    size: (&'static str, usize),
    local_rank: (&'static str, usize),
    local_size: (&'static str, usize),
}

impl Numbers {
    /// Checks the numbers against each other and builds the environment.
    fn into_env(self, source: LaunchSource, nnodes: Option<usize>, mpi: bool) -> Result<LaunchEnv> {
        let Numbers { rank: (rank_var, rank), size: (size_var, size), local_rank: (lr_var, local_rank), local_size: (ls_var, local_size) } = self;
        if size == 0 {
            return usage(format!("{size_var}=0: a job needs at least one rank"));
        }
        if rank >= size {
            return usage(format!("{rank_var}={rank} must be below {size_var}={size} (ranks count from 0)"));
        }
        if local_size == 0 || local_size > size {
            return usage(format!("{ls_var}={local_size} must be between 1 and {size_var}={size}"));
        }
        if local_rank >= local_size {
            return usage(format!("{lr_var}={local_rank} must be below {ls_var}={local_size} (local ranks count from 0)"));
        }
        Ok(LaunchEnv {
            rank,
            world_size: size,
            local_rank,
            local_world_size: local_size,
            // Without a node count, assume the ranks fill nodes of `local_size` each.
            nnodes: nnodes.unwrap_or_else(|| size.div_ceil(local_size)),
            source,
            master: None,
            mpi,
        })
    }
}

/// Requires both or neither of a rank and a size variable.
fn rank_and_size(vars: &Vars, rank_var: &'static str, size_var: &'static str) -> Result<Option<(usize, usize)>> {
    match (vars.num(rank_var)?, vars.num(size_var)?) {
        (Some(rank), Some(size)) => Ok(Some((rank, size))),
        (None, None) => Ok(None),
        (Some(_), None) => usage(format!("{rank_var} is set but {size_var} is not: set both or neither")),
        (None, Some(_)) => usage(format!("{size_var} is set but {rank_var} is not: set both or neither")),
    }
}

fn from_mpi(vars: &Vars) -> Result<Option<LaunchEnv>> {
    let (rank_var, size_var, local_vars) = if vars.get("OMPI_COMM_WORLD_SIZE").is_some() || vars.get("OMPI_COMM_WORLD_RANK").is_some() {
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ["OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"])
    } else {
        ("PMI_RANK", "PMI_SIZE", ["MPI_LOCALRANKID", "MPI_LOCALNRANKS"])
    };
    let Some((rank, size)) = rank_and_size(vars, rank_var, size_var)? else {
        return Ok(None);
    };
    let [lr_var, ls_var] = local_vars;
    let (local_rank, local_size) = match (vars.num(lr_var)?, vars.num(ls_var)?) {
        (Some(local_rank), Some(local_size)) => ((lr_var, local_rank), (ls_var, local_size)),
        // `srun --mpi=pmi2` sets no local numbers of its own, but Slurm's are there; without
        // either (an old Hydra), the ranks are taken to share one node.
        _ => match from_slurm(vars).ok().flatten() {
            Some(slurm) => (("SLURM_LOCALID", slurm.local_rank), ("SLURM_TASKS_PER_NODE", slurm.local_world_size)),
            None => ((rank_var, rank), (size_var, size)),
        },
    };
    Numbers { rank: (rank_var, rank), size: (size_var, size), local_rank, local_size }.into_env(LaunchSource::Mpi, None, true).map(Some)
}

fn from_slurm(vars: &Vars) -> Result<Option<LaunchEnv>> {
    // srun gives every task a rank and a task count. SLURM_NTASKS alone is a job script's
    // allocation, and a job script's own SLURM_PROCID (0) without a task count is one process.
    let (Some(rank), Some(size)) = (vars.num("SLURM_PROCID")?, vars.first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"])?) else {
        return Ok(None);
    };
    let local_rank = vars.first(&["SLURM_LOCALID"])?.unwrap_or(("SLURM_PROCID", rank));
    let local_size = match vars.first(&["SLURM_NTASKS_PER_NODE"])? {
        Some(n) => n,
        None => match vars.get("SLURM_STEP_TASKS_PER_NODE").or_else(|| vars.get("SLURM_TASKS_PER_NODE")) {
            Some(spec) => {
                let node = vars.num("SLURM_NODEID")?.unwrap_or(0);
                ("SLURM_TASKS_PER_NODE", tasks_on_node(&spec, node)?)
            }
            None => ("SLURM_NTASKS", size.1),
        },
    };
    let nnodes = vars.first::<usize>(&["SLURM_STEP_NUM_NODES", "SLURM_NNODES"])?.map(|(_, n)| n);
    Numbers { rank: ("SLURM_PROCID", rank), size, local_rank, local_size }.into_env(LaunchSource::Slurm, nnodes, false).map(Some)
}

/// The task count of node `node` in Slurm's compressed per-node list, e.g. `"2(x3),1"` is
/// 2, 2, 2, 1.
fn tasks_on_node(spec: &str, node: usize) -> Result<usize> {
    let bad = || UsageError(format!("SLURM_TASKS_PER_NODE={spec} is not Slurm's `N(xM),...` list"));
    let mut seen = 0;
    for part in spec.split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((count, rest)) => (count, rest.strip_suffix(')').ok_or_else(bad)?.parse().map_err(|_| bad())?),
            None => (part, 1usize),
        };
        let count: usize = count.trim().parse().map_err(|_| bad())?;
        seen += repeat;
        if node < seen {
            return Ok(count);
        }
    }
    Err(UsageError(format!("SLURM_NODEID={node} is beyond SLURM_TASKS_PER_NODE={spec}")).into())
}

fn from_torchrun(vars: &Vars) -> Result<Option<LaunchEnv>> {
    let Some((rank, size)) = rank_and_size(vars, "RANK", "WORLD_SIZE")? else {
        return Ok(None);
    };
    let local_rank = vars.first(&["LOCAL_RANK"])?.unwrap_or(("RANK", rank));
    let local_size = vars.first(&["LOCAL_WORLD_SIZE"])?.unwrap_or(("WORLD_SIZE", size));
    let nnodes = vars.num("GROUP_WORLD_SIZE")?;
    Numbers { rank: ("RANK", rank), size: ("WORLD_SIZE", size), local_rank, local_size }.into_env(LaunchSource::Torchrun, nnodes, false).map(Some)
}

// ---------------------------------------------------------------------------------------------
// --nproc-per-node: the binary starts its own ranks, as the course's `mp.spawn(fn, nprocs=N)`
// and `horovodrun -np N` do, by handing itself to mpirun.

/// Set for mpirun and so for every rank: this launcher's process id. The ranks stop once it
/// has ended ([`super::orphan`]).
pub const LAUNCHER_VAR: &str = "COURSE_LAUNCHER_PID";

/// Set for every rank: a folder where each marks its arrival at the job's start, so that one that
/// never arrives is named ([`super::startup`]).
pub const ARRIVALS_VAR: &str = "COURSE_STARTUP_DIR";

/// The message for a missing launcher.
const NO_MPIRUN: &str = "--nproc-per-node needs an MPI launcher (mpirun) on PATH; install OpenMPI \
                         (Debian: openmpi-bin) or start the ranks with srun/mpirun yourself";

/// Where the ranks stop when the launcher passes a stop signal on: what it tells the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopsAt {
    /// After a step they agree on (every strategy whose ranks step together).
    Step,
    /// At the end of the epoch (asynchronous parameter-server workers: they never wait for
    /// each other, so they can only meet there).
    EpochEnd,
}

impl StopsAt {
    fn says(self) -> &'static str {
        match self {
            StopsAt::Step => "the ranks stop after their current step",
            StopsAt::EpochEnd => "the asynchronous workers stop at the end of this epoch",
        }
    }
}

/// Re-executes the current binary as `nproc` ranks on this node under `mpirun -np <nproc>`,
/// with the same arguments minus `--nproc-per-node` (so the ranks train instead of launching
/// again), and waits for it. Standard input, output and error are the caller's: the ranks'
/// lines appear as they print them.
///
/// The launcher is `mpirun` from `PATH`, or `$MPIRUN`. For OpenMPI it adds `--bind-to none`
/// (OpenMPI pins each rank of a small job to one core by default, which would squeeze LibTorch's
/// thread pool onto it), `--oversubscribe` (more ranks than cores is allowed, as with
/// `mp.spawn`) and, when running as root (containers), `--allow-run-as-root`.
///
/// When one rank fails, mpirun stops the others and exits non-zero, which is returned here.
///
/// The job ends with this process. The first SIGINT or SIGTERM (Ctrl-C, `kill`, Slurm's
/// `scancel`) reaches the ranks as SIGUSR1, which mpirun passes on and waits for (SIGTERM it
/// would follow with a kill within a second): they stop at a step they agree on, checkpoint and
/// exit 75, which is returned. A second one is passed on as it is: mpirun stops the ranks at
/// once, and this returns [`Interrupted`] (exit code 128 + the signal). When this process dies
/// otherwise (SIGKILL, a crash), the ranks, which watch it ([`LAUNCHER_VAR`]), stop at their
/// next step without another checkpoint, and the kernel sends mpirun SIGTERM
/// (`PR_SET_PDEATHSIG`). Open MPI's ranks end when their mpirun does, whichever way it ends (seen
/// with Open MPI 4.1 for SIGKILL to mpirun too: the ranks abort about a second later, having lost
/// their daemon), but not at once: a second or so of steps, which the ranks' watch stops.
pub fn relaunch_with_mpirun(nproc: usize, stops: StopsAt) -> Result<ExitStatus> {
    if nproc == 0 {
        return usage("--nproc-per-node must be at least 1");
    }
    let launcher = find_launcher(std::env::var_os("MPIRUN"), std::env::var_os("PATH"))?;
    let version = Command::new(&launcher).arg("--version").output();
    let version = match version {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        Err(err) => return Err(UsageError(format!("{NO_MPIRUN} ({} cannot run: {err})", launcher.display())).into()),
    };
    let exe = std::env::current_exe().context("cannot find this program's path to start its ranks")?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut command = Command::new(&launcher);
    command.args(mpirun_args(&version, is_root(), nproc)).arg(exe).args(args_without_nproc(&args));
    let parent = std::process::id();
    // The ranks watch this process: once it is gone, they stop (comm::orphan).
    command.env(LAUNCHER_VAR, parent.to_string());
    // Where they mark their arrival at start-up, so that one that never comes is named
    // (comm::startup); private, and removed when the job ends.
    let private = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o700);
    let arrivals = tempfile::Builder::new().prefix("course-startup-").permissions(private).tempdir().context("cannot make a folder for the ranks' start-up")?;
    command.env(ARRIVALS_VAR, arrivals.path());
    // SAFETY: the hook only makes async-signal-safe system calls (prctl, getppid) and does not
    // allocate, as code between fork and exec must.
    unsafe { command.pre_exec(move || die_with_parent(parent)) };
    // The ranks' stderr passes through here: Open MPI's notice that a rank called MPI_Abort
    // (a box of 8 lines, and a line per further rank) follows our own "error on rank N" line and
    // adds nothing to it.
    let mut child = command.stderr(Stdio::piped()).spawn().with_context(|| format!("could not start {}", launcher.display()))?;
    let forwarding = Forwarding::start(child.id(), stops)?;
    let Some(stderr) = child.stderr.take() else { anyhow::bail!("{}'s standard error was not connected", launcher.display()) };
    let mut notices = AbortNotices::default();
    // Locked per line, not for the whole job: the signal-forwarding thread writes here too.
    for line in std::io::BufReader::new(stderr).lines() {
        for line in notices.pass(line?) {
            writeln!(std::io::stderr().lock(), "{line}").ok();
        }
    }
    for line in notices.finish() {
        writeln!(std::io::stderr().lock(), "{line}").ok();
    }
    // Signals are passed on until mpirun has exited, and not once it is reaped (its process id
    // could then be another process's).
    wait_for_exit(child.id()).with_context(|| format!("waiting for {}", launcher.display()))?;
    let stopped_by = forwarding.stop();
    let status = child.wait().with_context(|| format!("waiting for {}", launcher.display()))?;
    match stopped_by {
        Some(signal) => Err(Interrupted(signal).into()),
        None => Ok(status),
    }
}

/// In mpirun's process before it starts: the kernel is to send it SIGTERM when the launcher
/// (`parent`) dies, on which mpirun stops its ranks. (The signal follows the thread that
/// started it: [`relaunch_with_mpirun`] waits for mpirun on that same thread.)
fn die_with_parent(parent: u32) -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid have no memory preconditions.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The launcher died before the line above: there will be no signal; do not start.
        if libc::getppid() as u32 != parent {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

/// SIGINT and SIGTERM to this process passed on to mpirun (`pid`) while it runs, by a thread
/// of ours (signal-hook's handler only wakes it): the first as SIGUSR1 (stop at a step, with a
/// checkpoint), later ones as they are (stop now); the last of those is the exit's reason.
struct Forwarding {
    handle: signal_hook::iterator::Handle,
    thread: Option<std::thread::JoinHandle<Option<i32>>>,
}

impl Forwarding {
    fn start(pid: u32, stops: StopsAt) -> Result<Forwarding> {
        let mut signals =
            signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM]).context("cannot catch SIGINT and SIGTERM to pass them on to mpirun")?;
        let handle = signals.handle();
        let thread = std::thread::Builder::new()
            .name("signals to mpirun".into())
            .spawn(move || {
                let (mut asked, mut forced) = (false, None);
                for signal in signals.forever() {
                    let passed = if asked { signal } else { libc::SIGUSR1 };
                    if !asked {
                        let name = if signal == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
                        eprintln!("{name}: {} (passed on as SIGUSR1); a second signal stops them at once", stops.says());
                    }
                    // SAFETY: kill has no memory preconditions; `pid` is mpirun's, not yet reaped
                    // (see [`wait_for_exit`]).
                    unsafe { libc::kill(pid as libc::pid_t, passed) };
                    forced = asked.then_some(signal).or(forced);
                    asked = true;
                }
                forced
            })
            .context("cannot start the thread that passes signals on to mpirun")?;
        Ok(Forwarding { handle, thread: Some(thread) })
    }

    /// Stops passing signals on; the last one passed on as it is (a second signal), if any.
    fn stop(mut self) -> Option<i32> {
        self.handle.close();
        self.thread.take().and_then(|thread| thread.join().ok()).flatten()
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        self.handle.close();
    }
}

/// Waits until child `pid` has exited, leaving it to be reaped (`waitid` with `WNOWAIT`).
fn wait_for_exit(pid: u32) -> std::io::Result<()> {
    loop {
        // SAFETY: `info` is a valid siginfo_t for waitid to fill.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let done = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if done == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Drops Open MPI's MPI_Abort notices from the lines of a job's stderr: the dashed box that
/// says MPI_ABORT was invoked, and the help-aggregation lines after it, and the boxes about ranks
/// that exited with the stop code; every other line (and every other box) passes, in order.
#[derive(Default)]
struct AbortNotices {
    /// The lines of a dashed box being read (from its opening line on).
    boxed: Option<Vec<String>>,
}

impl AbortNotices {
    fn is_rule(line: &str) -> bool {
        line.len() >= 20 && line.chars().all(|c| c == '-')
    }

    /// The lines to print now, `line` read.
    fn pass(&mut self, line: String) -> Vec<String> {
        // A rank's line still unfinished when mpirun writes its box (they share the pipe): the
        // box's opening rule arrives glued to that line's end. Read them as the two lines.
        let dashes = line.len() - line.trim_end_matches('-').len();
        if dashes >= 20 && dashes < line.len() && self.boxed.is_none() {
            let (text, rule) = line.split_at(line.len() - dashes);
            let mut out = self.pass(text.to_string());
            out.extend(self.pass(rule.to_string()));
            return out;
        }
        match self.boxed.as_mut() {
            None if Self::is_rule(&line) => {
                self.boxed = Some(vec![line]);
                Vec::new()
            }
            // And Open MPI's own error logs about the abort's aftermath (`ORTE_ERROR_LOG: Out of
            // resource in file ...show_help.c`): said by mpirun, about mpirun, after our line.
            None if line.contains("help-mpi-api.txt / mpi-abort") || line.contains("orte_base_help_aggregate") || line.contains("ORTE_ERROR_LOG") => Vec::new(),
            None => vec![line],
            Some(lines) => {
                let closes = Self::is_rule(&line);
                lines.push(line);
                if !closes {
                    return Vec::new();
                }
                let lines = self.boxed.take().unwrap_or_default();
                // Also mpirun's two boxes for ranks that ended together with the stop code (a
                // signal's checkpointed stop, which rank 0 has reported) or the hang code (a
                // start-up past its deadline, which a rank has named): nothing to add.
                let stopped = format!("Exit code:    {}", crate::error::STOPPED_EXIT_CODE);
                let hung = format!("Exit code:    {}", crate::error::HUNG_EXIT_CODE);
                let silent = ["MPI_ABORT was invoked", "Per user-direction, the job has been aborted", stopped.as_str(), hung.as_str()];
                if lines.iter().any(|l| silent.iter().any(|s| l.contains(s))) {
                    Vec::new()
                } else {
                    lines
                }
            }
        }
    }

    /// What is left at the end (a box never closed).
    fn finish(&mut self) -> Vec<String> {
        self.boxed.take().unwrap_or_default()
    }
}

/// `$MPIRUN` if set, else `mpirun` from `path`; a usage error if it is not an executable file.
fn find_launcher(mpirun: Option<OsString>, path: Option<OsString>) -> Result<PathBuf> {
    let found = match mpirun {
        Some(explicit) => {
            let explicit = PathBuf::from(explicit);
            if explicit.components().count() > 1 {
                Some(explicit).filter(|p| is_executable(p))
            } else {
                search_path(explicit.as_os_str(), path.as_deref())
            }
        }
        None => search_path(OsStr::new("mpirun"), path.as_deref()),
    };
    found.ok_or_else(|| UsageError(NO_MPIRUN.to_string()).into())
}

fn search_path(name: &OsStr, path: Option<&OsStr>) -> Option<PathBuf> {
    std::env::split_paths(path?).map(|dir| dir.join(name)).find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The launcher's options before the program, for the flavour `--version` printed.
fn mpirun_args(version: &str, root: bool, nproc: usize) -> Vec<String> {
    let mut args = Vec::new();
    if version.contains("Open MPI") || version.contains("OpenRTE") {
        if root {
            args.push("--allow-run-as-root".to_string());
        }
        args.extend(["--oversubscribe", "--bind-to", "none"].map(String::from));
    }
    // MPICH / Intel MPI's Hydra neither binds nor refuses root or oversubscription by default.
    args.extend(["-np".to_string(), nproc.to_string()]);
    args
}

/// `args` without `--nproc-per-node N` / `--nproc-per-node=N` (before a `--`, after which
/// everything is a positional argument).
pub fn args_without_nproc(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if arg == "--" {
            out.push(arg.clone());
            out.extend(iter.cloned());
            break;
        }
        if arg == "--nproc-per-node" {
            iter.next(); // its value
        } else if !arg.to_str().is_some_and(|a| a.starts_with("--nproc-per-node=")) {
            out.push(arg.clone());
        }
    }
    out
}

/// `--nproc-per-node N`: from a plain shell, starts N ranks of this binary through mpirun and
/// waits for them. Returns `true` when this process only started the ranks (they have run, and
/// succeeded), `false` when it is to run itself (no flag, or already a rank of a launcher).
/// Failed ranks have reported why; their exit code comes back as a [`ChildExit`] error.
pub fn start_ranks_if_asked(nproc_per_node: Option<usize>, stops: StopsAt) -> anyhow::Result<bool> {
    let Some(n) = nproc_per_node else { return Ok(false) };
    if LaunchEnv::detect()?.world_size > 1 {
        return Ok(false);
    }
    match relaunch_with_mpirun(n, stops)?.code() {
        Some(0) => Ok(true),
        code => Err(crate::error::ChildExit(code.unwrap_or(1)).into()),
    }
}

/// `--max-ranks-per-core`'s default: more CPU ranks than this per core are refused.
pub const MAX_RANKS_PER_CORE: usize = 4;

/// Whether a run of `choice` trains on GPUs (`both`: where there is one).
pub fn on_gpus(choice: DeviceChoice) -> bool {
    match choice {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Both => device::cuda_available(),
    }
}

/// The GPUs this process sees.
pub fn gpu_count() -> usize {
    tch::Cuda::device_count().max(0) as usize
}

/// How many local ranks `--nproc-per-node` may start (every launcher's cap: the exercises',
/// `hello_ddp`'s): no more GPU ranks than GPUs (NCCL takes
/// one GPU per rank) unless `share_gpu` (`--share-gpu`, a check; rank 0 says so); CPU ranks
/// beyond the cores take turns (a warning), beyond `max_per_core` per core they are refused:
/// every rank is a LibTorch process with its own memory, and a thousand of them end with the
/// OOM killer.
pub fn check_rank_count(n: usize, servers: usize, choice: DeviceChoice, max_per_core: usize, share_gpu: bool) -> Result<Option<String>> {
    if on_gpus(choice) {
        let gpus = gpu_count();
        return match too_many_gpu_ranks(n, servers, gpus) {
            Some(_) if share_gpu && gpus > 0 => Ok(None),
            Some(refusal) => usage(refusal),
            None => Ok(None),
        };
    }
    let cores = device::usable_cores();
    if n > max_per_core * cores {
        return usage(format!(
            "--nproc-per-node {n}: more than {max_per_core} CPU ranks per core on {cores} core(s), each a LibTorch process with its own memory; \
             use fewer, or raise --max-ranks-per-core"
        ));
    }
    Ok((n > cores).then(|| format!("warning: {n} CPU ranks on {cores} core(s): they take turns (right for testing, slow for timing)")))
}

/// The cap of [`check_rank_count`] for a launcher with no flags of its own for it (`hello_ddp`,
/// `bench_allreduce`, `exercise3 profile`): `--nproc-per-node n` on `choice`, checked in the
/// process that would start the ranks (a rank already started has nothing to check). Returns the
/// warning to say, if any.
pub fn check_launch(nproc_per_node: Option<usize>, choice: DeviceChoice) -> Result<Option<String>> {
    match nproc_per_node {
        Some(n) if n > 1 && LaunchEnv::detect()?.world_size == 1 => check_rank_count(n, 0, choice, MAX_RANKS_PER_CORE, false),
        _ => Ok(None),
    }
}

/// The refusal of `n` local ranks on a node of `gpus` GPUs, `servers` of them parameter servers
/// (which keep their copy on the CPU, needing no GPU): each other rank needs a GPU of its own.
pub fn too_many_gpu_ranks(n: usize, servers: usize, gpus: usize) -> Option<String> {
    let on_gpus = n.saturating_sub(servers);
    if on_gpus <= gpus {
        return None;
    }
    let fits = gpus.max(1) + servers;
    let servers_note = match servers {
        0 => String::new(),
        s => format!(" ({s} of the {n} serve parameters on the CPU; the other {on_gpus} train on GPUs)"),
    };
    let share = if gpus > 0 { " (--share-gpu allows it as a check of the multi-rank paths, not to train faster)" } else { "" };
    Some(format!(
        "--nproc-per-node {n}: this node has {gpus} GPU(s), and each training rank needs its own (NCCL refuses two ranks on one GPU){servers_note}; \
         use --nproc-per-node {fits} or --device cpu{share}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ranks_beyond_the_cores_are_warned_about_and_beyond_the_limit_refused() {
        let cores = device::usable_cores();
        assert_eq!(check_rank_count(cores, 0, DeviceChoice::Cpu, 4, false).unwrap(), None);
        let warning = check_rank_count(cores + 1, 0, DeviceChoice::Cpu, 4, false).unwrap().unwrap();
        assert!(warning.contains(&format!("{} CPU ranks on {cores} core(s)", cores + 1)), "{warning}");
        assert!(check_rank_count(4 * cores, 0, DeviceChoice::Cpu, 4, false).unwrap().is_some());
        let refused = check_rank_count(4 * cores + 1, 0, DeviceChoice::Cpu, 4, false).unwrap_err();
        assert!(refused.is::<crate::error::UsageError>() && refused.to_string().contains("--max-ranks-per-core"), "{refused}");
        // Raised explicitly, the limit lets them start.
        assert!(check_rank_count(4 * cores + 1, 0, DeviceChoice::Cpu, 5, false).is_ok());
    }

    #[test]
    fn more_gpu_ranks_than_gpus_are_refused() {
        let gpus = tch::Cuda::device_count() as usize;
        let err = check_rank_count(gpus + 1, 0, DeviceChoice::Cuda, 4, false).unwrap_err();
        assert!(err.to_string().contains(&format!("this node has {gpus} GPU(s)")), "{err}");
        assert_eq!(err.to_string().contains("--share-gpu allows it"), gpus > 0, "the opt-in is named where it would help: {err}");
        // The opt-in lets them start where there is a GPU to share, and only there.
        let shared = check_rank_count(gpus + 1, 0, DeviceChoice::Cuda, 4, true);
        match gpus {
            0 => assert!(shared.unwrap_err().to_string().contains("this node has 0 GPU(s)")),
            _ => assert_eq!(shared.unwrap(), None),
        }
    }

    #[test]
    fn parameter_servers_need_no_gpu_of_their_own() {
        // One GPU: one worker and its server fit (the server keeps its copy on the CPU) ...
        assert_eq!(too_many_gpu_ranks(2, 1, 1), None);
        assert_eq!(too_many_gpu_ranks(4, 2, 2), None);
        // ... two workers do not, and the refusal counts the server in what fits.
        let refusal = too_many_gpu_ranks(3, 1, 1).unwrap();
        assert!(refusal.contains("1 of the 3 serve parameters on the CPU; the other 2 train on GPUs") && refusal.contains("--nproc-per-node 2"), "{refusal}");
        // Without servers every rank needs a GPU.
        let refusal = too_many_gpu_ranks(2, 0, 1).unwrap();
        assert!(refusal.contains("this node has 1 GPU(s)") && refusal.contains("use --nproc-per-node 1 or --device cpu"), "{refusal}");
        assert!(refusal.contains("--share-gpu allows it as a check"), "{refusal}");
        assert!(!too_many_gpu_ranks(2, 0, 0).unwrap().contains("--share-gpu"), "no GPU to share");
        assert_eq!(too_many_gpu_ranks(1, 0, 1), None);
    }

    #[test]
    fn slurm_task_lists() {
        assert_eq!(tasks_on_node("4", 0).unwrap(), 4);
        assert_eq!(tasks_on_node("2(x3),1", 2).unwrap(), 2);
        assert_eq!(tasks_on_node("2(x3),1", 3).unwrap(), 1);
        assert!(tasks_on_node("2(x3),1", 4).is_err());
        assert!(tasks_on_node("2(x3", 0).is_err());
    }

    #[test]
    fn launcher_flags_follow_the_flavour() {
        let ompi = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/";
        assert_eq!(mpirun_args(ompi, true, 2), ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2"]);
        assert_eq!(mpirun_args(ompi, false, 3), ["--oversubscribe", "--bind-to", "none", "-np", "3"]);
        assert_eq!(mpirun_args("HYDRA build details:", true, 2), ["-np", "2"]);
    }

    #[test]
    fn open_mpis_abort_notice_is_dropped_and_everything_else_kept() {
        let stderr = "error on rank 0: --tp 3 does not divide 2 ranks
--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD
with errorcode 2.

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
--------------------------------------------------------------------------
[vm:07783] 1 more process has sent help message help-mpi-api.txt / mpi-abort
[vm:07783] Set MCA parameter \"orte_base_help_aggregate\" to 0 to see all help / error messages
[vm:07783] [[41221,0],0] ORTE_ERROR_LOG: Out of resource in file ../../orte/util/show_help.c at line 501
--------------------------------------------------------------------------
A process failed to start: not an abort
--------------------------------------------------------------------------
last line";
        let mut notices = AbortNotices::default();
        let mut kept: Vec<String> = stderr.lines().flat_map(|l| notices.pass(l.to_string())).collect();
        kept.extend(notices.finish());
        let rule = "-".repeat(74);
        assert_eq!(kept, ["error on rank 0: --tp 3 does not divide 2 ranks", &rule, "A process failed to start: not an abort", &rule, "last line"]);
    }

    #[test]
    fn an_abort_notice_glued_to_an_unfinished_rank_line_is_dropped_too() {
        let rule = "-".repeat(74);
        // Seen in CI: a rank's warning, its newline not yet written when mpirun's box began.
        let stderr = format!(
            "WARNING: a GENERATED stand-in{rule}\nMPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\nwith errorcode 2.\n{rule}\n\nerror on rank 0: --zero 1"
        );
        let mut notices = AbortNotices::default();
        let mut kept: Vec<String> = stderr.lines().flat_map(|l| notices.pass(l.to_string())).collect();
        kept.extend(notices.finish());
        assert_eq!(kept, ["WARNING: a GENERATED stand-in", "", "error on rank 0: --zero 1"]);
    }

    #[test]
    fn mpiruns_boxes_about_ranks_that_ended_with_the_stop_or_hang_code_are_dropped_others_kept() {
        let rule = "-".repeat(74);
        let stderr = format!(
            "stopped by SIGTERM after step 7: checkpointed\n{rule}\nPrimary job  terminated normally, but 1 process returned\na non-zero exit code. Per user-direction, the job has been aborted.\n{rule}\n\
             {rule}\nmpirun detected that one or more processes exited with non-zero status, thus causing\n  Exit code:    75\n{rule}\n\
             {rule}\nmpirun detected that one or more processes exited with non-zero status, thus causing\n  Exit code:    3\n{rule}\n\
             {rule}\nmpirun noticed that process rank 1 exited on signal 11 (Segmentation fault).\n{rule}"
        );
        let mut notices = AbortNotices::default();
        let mut kept: Vec<String> = stderr.lines().flat_map(|l| notices.pass(l.to_string())).collect();
        kept.extend(notices.finish());
        assert_eq!(
            kept,
            ["stopped by SIGTERM after step 7: checkpointed", &rule, "mpirun noticed that process rank 1 exited on signal 11 (Segmentation fault).", &rule]
        );
    }

    #[test]
    fn launcher_lookup() {
        assert!(find_launcher(Some("/nonexistent/mpirun".into()), None).is_err());
        assert_eq!(find_launcher(Some("/bin/sh".into()), None).unwrap(), PathBuf::from("/bin/sh"));
        assert_eq!(find_launcher(Some("sh".into()), Some("/nonexistent:/bin".into())).unwrap(), PathBuf::from("/bin/sh"));
        let err = find_launcher(None, Some("/nonexistent".into())).unwrap_err();
        assert!(err.is::<UsageError>());
    }
}
