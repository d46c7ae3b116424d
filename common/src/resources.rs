//! What the machine has left for this process, memory and disk, so that a size a flag asks for
//! is refused up front in one sentence where its closed-form estimate is beyond it: found by
//! allocating, it ends in an abort, or grows until the kernel's OOM killer ends the job (on a
//! shared node, other jobs with it), or fills the disk.
use std::path::Path;

use anyhow::Result;

use crate::error::usage;

/// The bytes this process may still allocate: the least of the memory the kernel says is
/// available, what its cgroup (a Slurm job's) has left, and its address-space limit (`ulimit -v`).
/// None where none of them can be read.
pub fn available_memory() -> Option<f64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        text.lines().find(|l| l.starts_with("MemAvailable:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()).map(|kib| kib * 1024.0)
    });
    [meminfo, cgroup_left(), address_space_limit()].into_iter().flatten().reduce(f64::min)
}

/// What the process's cgroup (v2) may still take: `memory.max` less `memory.current`.
fn cgroup_left() -> Option<f64> {
    let line = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let relative = line.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = Path::new("/sys/fs/cgroup").join(relative.trim_start_matches('/'));
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok()?.trim().parse::<f64>().ok();
    Some(read("memory.max")? - read("memory.current")?)
}

fn address_space_limit() -> Option<f64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } == 0;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as f64)
}

/// The bytes free to an unprivileged user on the file system where `path` is, or would be
/// created (its nearest existing folder).
pub fn free_disk(path: &Path) -> Option<f64> {
    let existing = path.ancestors().find(|p| p.exists() || p.as_os_str().is_empty())?;
    let existing = if existing.as_os_str().is_empty() { Path::new(".") } else { existing };
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(existing.as_os_str())).ok()?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a struct statvfs fills.
    let ok = unsafe { libc::statvfs(c.as_ptr(), &mut stat) } == 0;
    ok.then_some(stat.f_bavail as f64 * stat.f_frsize as f64)
}

/// Refuses (a usage error) `what`, which would hold `bytes` in memory at once, where the
/// machine has less left; `lower` says what to change.
pub fn refuse_beyond_memory(what: &str, bytes: f64, lower: &str) -> Result<()> {
    match available_memory() {
        Some(left) if bytes > left => usage(format!("{what} would need {} of memory, and this machine has {} left: {lower}", gib(bytes), gib(left))),
        _ => Ok(()),
    }
}

/// Refuses `what`, which would write `bytes` under `dir`, where its file system has less free.
pub fn refuse_beyond_disk(dir: &Path, what: &str, bytes: f64, lower: &str) -> Result<()> {
    match free_disk(dir) {
        Some(free) if bytes > free => usage(format!("{what} would write {} into {}, where {} are free: {lower}", gib(bytes), dir.display(), gib(free))),
        _ => Ok(()),
    }
}

/// Bytes in GiB, as the messages give them.
fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_machine_has_left_is_known_and_a_size_beyond_it_is_refused() {
        let memory = available_memory().expect("/proc/meminfo");
        assert!(memory > 0.0);
        let disk = free_disk(&std::env::temp_dir().join("not/yet/made")).expect("statvfs of the nearest folder");
        assert!(disk > 0.0);
        assert!(refuse_beyond_memory("this", memory / 2.0, "lower it").is_ok());
        let refused = refuse_beyond_memory("--train 1e12", memory * 2.0, "lower --train").unwrap_err();
        assert!(refused.is::<crate::error::UsageError>());
        assert!(refused.to_string().starts_with("--train 1e12 would need ") && refused.to_string().ends_with("left: lower --train"), "{refused}");
        assert!(refuse_beyond_disk(&std::env::temp_dir(), "it", disk * 2.0, "write less").unwrap_err().to_string().contains("are free: write less"));
        assert!(refuse_beyond_disk(&std::env::temp_dir(), "it", 1.0, "write less").is_ok());
    }
}
