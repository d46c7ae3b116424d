//! What a run asks of Slurm itself: to be queued again after it stopped for a preemption or a
//! time limit's warning signal (as Lightning's `SLURMEnvironment` requeues), so that the job
//! resumes from the checkpoint it just wrote without anyone resubmitting it.
use std::process::Command;

use anyhow::{bail, Context, Result};

/// `--requeue`: whether a run that a signal stopped puts its Slurm job back in the queue.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum Requeue {
    /// When running under Slurm in a job that may be requeued (`scontrol show job`: Requeue=1,
    /// from `#SBATCH --requeue` or the cluster's default).
    #[default]
    Auto,
    /// Always under Slurm (an error where there is no Slurm job to requeue).
    On,
    Off,
}

/// This job's id as `scontrol` wants it: an array task's `<array job>_<task>`, else the job's.
pub fn job_id() -> Option<String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    match (var("SLURM_ARRAY_JOB_ID"), var("SLURM_ARRAY_TASK_ID")) {
        (Some(array), Some(task)) => Some(format!("{array}_{task}")),
        _ => var("SLURM_JOB_ID"),
    }
}

/// Whether Slurm would requeue job `id` (its `Requeue=1`).
fn allows_requeue(id: &str) -> Result<bool> {
    let out = Command::new("scontrol").args(["show", "job", "-o", id]).output().context("cannot run scontrol to ask whether this job may be requeued")?;
    if !out.status.success() {
        bail!("scontrol show job {id} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).split_whitespace().any(|field| field == "Requeue=1"))
}

/// Puts this Slurm job back in the queue as `mode` asks; returns the job's id when it did. An
/// error only where `--requeue on` cannot be honoured or scontrol fails.
pub fn requeue(mode: Requeue) -> Result<Option<String>> {
    let id = match (mode, job_id()) {
        (Requeue::Off, _) => return Ok(None),
        (Requeue::On, None) => bail!("--requeue on: not running in a Slurm job (no SLURM_JOB_ID), so there is nothing to requeue"),
        (Requeue::Auto, None) => return Ok(None),
        (_, Some(id)) => id,
    };
    if mode == Requeue::Auto && !allows_requeue(&id)? {
        return Ok(None);
    }
    let out = Command::new("scontrol").args(["requeue", &id]).output().context("cannot run scontrol requeue")?;
    if !out.status.success() {
        bail!("scontrol requeue {id} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(Some(id))
}
