//! Where each rank of the job runs: its host name, gathered once when the job's engines start
//! (MPI's `MPI_Allgather` at init), so that the results say where every rank ran and a hang's
//! line names the host of a rank that did not answer as well as its number: on a cluster, "rank
//! 5 (node2)" says which node to look at.
use std::sync::OnceLock;

/// Host names longer than this (Linux's `HOST_NAME_MAX`) are cut.
const NAME_BYTES: usize = 64;

static JOB_HOSTS: OnceLock<Vec<String>> = OnceLock::new();

/// This process's host name (its UTS namespace's, as `hostname` prints it).
pub fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// The machine this process runs on: its kernel's boot id (`/proc/sys/kernel/random/boot_id`),
/// which the network namespaces and containers of one machine share and two machines never
/// do. None where the kernel does not say (not Linux).
pub fn this_machine() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    u128::from_str_radix(&text.trim().replace('-', ""), 16).ok()
}

/// Each rank's machine, numbered from 0 in the order the machines first appear, from the
/// ranks' [`this_machine`] ids: ranks of one id share a machine; a rank whose id is unknown
/// counts as its host's (`host_of` its rank), a machine of its own.
pub fn machine_numbers(ids: &[Option<u128>], host_of: impl Fn(usize) -> usize) -> Vec<usize> {
    #[derive(PartialEq)]
    enum Key {
        Kernel(u128),
        Host(usize),
    }
    let mut seen: Vec<Key> = Vec::new();
    ids.iter()
        .enumerate()
        .map(|(rank, id)| {
            let key = id.map_or(Key::Host(host_of(rank)), Key::Kernel);
            seen.iter().position(|k| *k == key).unwrap_or_else(|| {
                seen.push(key);
                seen.len() - 1
            })
        })
        .collect()
}

/// Records the job's hosts by job rank (the first record stands: there is one job per process).
pub(crate) fn record(hosts: Vec<String>) {
    let _ = JOB_HOSTS.set(hosts);
}

/// The host of each job rank, where the engines gathered them (MPI), else none.
pub fn job_hosts() -> Option<&'static [String]> {
    JOB_HOSTS.get().map(Vec::as_slice)
}

/// A job rank's number with its host where the job spans several: `5 (node2)`; on one host
/// (or where not gathered) the number alone.
pub fn number_on_host(rank: usize) -> String {
    match job_hosts().and_then(|hosts| hosts.get(rank)) {
        Some(host) if host_count() > 1 => format!("{rank} ({host})"),
        _ => rank.to_string(),
    }
}

/// How many different hosts the job's ranks run on (1 where not gathered).
pub fn host_count() -> usize {
    job_hosts().map_or(1, |hosts| hosts.iter().collect::<std::collections::BTreeSet<_>>().len())
}

/// Which ranks run on which host, where the job spans several: `4 ranks on 2 hosts: node1
/// (ranks 0, 1), node2 (ranks 2, 3)`.
pub fn placement() -> Option<String> {
    let hosts = job_hosts().filter(|_| host_count() > 1)?;
    let mut by_host: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, host) in hosts.iter().enumerate() {
        match by_host.iter_mut().find(|(name, _)| name == host) {
            Some((_, ranks)) => ranks.push(rank),
            None => by_host.push((host, vec![rank])),
        }
    }
    let each: Vec<String> = by_host
        .iter()
        .map(|(host, ranks)| {
            format!("{host} (rank{} {})", if ranks.len() == 1 { "" } else { "s" }, ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", "))
        })
        .collect();
    Some(format!("{} ranks on {} hosts: {}", hosts.len(), by_host.len(), each.join(", ")))
}

/// The host of every job rank for the results: the gathered names, else this host's for each.
pub fn for_results(world_size: usize) -> Vec<String> {
    match job_hosts() {
        Some(hosts) if hosts.len() == world_size => hosts.to_vec(),
        _ => vec![this_host(); world_size],
    }
}

pub(crate) fn to_bytes(name: &str) -> [u8; NAME_BYTES] {
    let mut bytes = [0u8; NAME_BYTES];
    let name = name.as_bytes();
    let len = name.len().min(NAME_BYTES);
    bytes[..len].copy_from_slice(&name[..len]);
    bytes
}

pub(crate) fn from_bytes(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_travel_as_fixed_size_bytes_and_come_back_whole() {
        for name in ["node1", "", "a-rather-long-host.name.of.a.cluster.example.org"] {
            assert_eq!(from_bytes(&to_bytes(name)), name);
        }
        let long = "x".repeat(100);
        assert_eq!(from_bytes(&to_bytes(&long)), "x".repeat(NAME_BYTES));
        assert!(!this_host().is_empty());
    }

    #[test]
    fn ranks_of_one_kernel_share_a_machine_and_an_unknown_one_is_its_hosts() {
        // Two namespaces of one machine (ranks 0-3, hosts 0 and 1), another machine (4, 5),
        // and a host that does not say (6, 7: host 3).
        let ids = [Some(7), Some(7), Some(7), Some(7), Some(9), Some(9), None, None];
        assert_eq!(machine_numbers(&ids, |rank| rank / 2), vec![0, 0, 0, 0, 1, 1, 2, 2]);
        assert_eq!(machine_numbers(&[None, None, None], |rank| rank), vec![0, 1, 2]);
        // Linux says, and says the same each time.
        if cfg!(target_os = "linux") {
            assert!(this_machine().is_some_and(|id| Some(id) == this_machine()));
        }
    }
}
