//! `--share-gpu`: several ranks of a job on one GPU, to check the multi-rank GPU paths (NCCL's
//! collectives, its point-to-point messages, the watchdog) on a machine with fewer GPUs than
//! ranks. A check, not a way to train faster: the ranks' kernels take turns on the GPU, and
//! their collectives go through NCCL's network transport instead of NVLink or PCIe.
//!
//! NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected"). It decides what
//! "one host" is from a hash of the host's name, or of `NCCL_HOSTID` where that is set. So each
//! rank that shares a GPU is given a host id of its own: the ranks of a node are dealt out in
//! slots of one rank per GPU (local ranks 0..G-1 the first slot, G..2G-1 the next, ...), and each
//! slot is a host of its own to NCCL. Ranks of one slot are on different GPUs and still talk
//! through NCCL's intra-node paths; ranks of different slots meet over its Socket transport,
//! on the loopback interface (`NCCL_SOCKET_IFNAME=lo`) when the job is on one node and no
//! interface was chosen. A user's own `NCCL_SOCKET_IFNAME` is kept; a user's own `NCCL_HOSTID`
//! becomes the prefix of each slot's (kept as it is, it would put every slot back on one host).
use crate::error::usage;

/// The variable NCCL reads its host's identity from (NCCL's `getHostHash`).
pub const HOST_ID_VAR: &str = "NCCL_HOSTID";
/// The network interfaces NCCL's bootstrap and Socket transport may use.
pub const SOCKET_IFNAME_VAR: &str = "NCCL_SOCKET_IFNAME";

/// Where a rank with `local_rank` on a node of `gpus` GPUs sits: its GPU and its slot (the
/// host NCCL is told it is on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    pub gpu: usize,
    pub slot: usize,
}

impl Seat {
    pub fn of(local_rank: usize, gpus: usize) -> Seat {
        let gpus = gpus.max(1);
        Seat { gpu: local_rank % gpus, slot: local_rank / gpus }
    }
}

/// The NCCL variables a rank at `seat` sets, given the host's name, the job's node count and
/// the variables already set (`existing`): its host id, and the loopback interface on one node.
pub fn nccl_vars(host: &str, seat: Seat, nnodes: usize, existing: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
    let prefix = existing(HOST_ID_VAR).filter(|v| !v.trim().is_empty()).unwrap_or_else(|| host.to_string());
    let mut vars = vec![(HOST_ID_VAR, format!("{prefix}/share-gpu-slot-{}", seat.slot))];
    if nnodes == 1 && existing(SOCKET_IFNAME_VAR).is_none_or(|v| v.trim().is_empty()) {
        vars.push((SOCKET_IFNAME_VAR, "lo".to_string()));
    }
    vars
}

/// Sets this rank's NCCL variables for `--share-gpu` (before its first NCCL call, from the main
/// thread, before any other thread reads the environment) and returns the one line rank 0 says.
pub fn apply(env: &super::LaunchEnv, gpus: usize) -> anyhow::Result<String> {
    if gpus == 0 {
        return usage("--share-gpu puts several ranks on one GPU, but no CUDA device is available");
    }
    let seat = Seat::of(env.local_rank, gpus);
    for (name, value) in nccl_vars(&super::hosts::this_host(), seat, env.nnodes, |name| std::env::var(name).ok()) {
        std::env::set_var(name, value);
    }
    Ok(note(env.local_world_size, gpus))
}

/// The line that says what `--share-gpu` does to a job of `ranks` local ranks on `gpus` GPUs.
pub fn note(ranks: usize, gpus: usize) -> String {
    let slots = ranks.div_ceil(gpus.max(1));
    format!(
        "--share-gpu: {ranks} rank(s) on {gpus} GPU(s), in {slots} NCCL host id(s) (NCCL_HOSTID) that talk over NCCL's socket transport: \
         a check of the multi-rank paths, not a way to train faster (the ranks' kernels take turns on each GPU)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars_of(local_rank: usize, gpus: usize, nnodes: usize, set: &[(&str, &str)]) -> Vec<(&'static str, String)> {
        let set: Vec<(String, String)> = set.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        nccl_vars("node7", Seat::of(local_rank, gpus), nnodes, |name| set.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    fn host_id(vars: &[(&'static str, String)]) -> String {
        vars.iter().find(|(k, _)| *k == HOST_ID_VAR).unwrap().1.clone()
    }

    #[test]
    fn ranks_sharing_a_gpu_get_host_ids_apart_and_ranks_on_other_gpus_may_share_one() {
        // Two ranks on one GPU: two slots, two host ids, the same GPU.
        assert_eq!((Seat::of(0, 1), Seat::of(1, 1)), (Seat { gpu: 0, slot: 0 }, Seat { gpu: 0, slot: 1 }));
        assert_ne!(host_id(&vars_of(0, 1, 1, &[])), host_id(&vars_of(1, 1, 1, &[])));
        // Four ranks on two GPUs: ranks 0 and 1 (GPUs 0 and 1) are one host, 2 and 3 another;
        // the two ranks of each GPU are never in one slot.
        let seats: Vec<Seat> = (0..4).map(|r| Seat::of(r, 2)).collect();
        assert_eq!(seats.iter().map(|s| (s.gpu, s.slot)).collect::<Vec<_>>(), [(0, 0), (1, 0), (0, 1), (1, 1)]);
        let ids: Vec<String> = (0..4).map(|r| host_id(&vars_of(r, 2, 1, &[]))).collect();
        assert_eq!((ids[0] == ids[1], ids[2] == ids[3], ids[0] == ids[2]), (true, true, false), "{ids:?}");
        for (a, sa) in ids.iter().zip(&seats) {
            for (b, sb) in ids.iter().zip(&seats) {
                assert!(!(sa.gpu == sb.gpu && a == b) || sa == sb, "two ranks on GPU {} share host id {a}", sa.gpu);
            }
        }
        assert!(ids[0].starts_with("node7/"), "the host's name leads: {}", ids[0]);
    }

    #[test]
    fn a_users_nccl_settings_are_kept_and_loopback_is_chosen_on_one_node_only() {
        assert!(vars_of(1, 1, 1, &[]).contains(&(SOCKET_IFNAME_VAR, "lo".to_string())));
        // Several nodes: loopback would not reach the others.
        assert!(vars_of(1, 1, 2, &[]).iter().all(|(k, _)| *k != SOCKET_IFNAME_VAR));
        // An interface the user chose stays.
        assert!(vars_of(1, 1, 1, &[(SOCKET_IFNAME_VAR, "eth0")]).iter().all(|(k, _)| *k != SOCKET_IFNAME_VAR));
        // A host id the user set is the prefix; the slots still part the ranks.
        let (a, b) = (host_id(&vars_of(0, 1, 1, &[(HOST_ID_VAR, "mine")])), host_id(&vars_of(1, 1, 1, &[(HOST_ID_VAR, "mine")])));
        assert!(a.starts_with("mine/") && b.starts_with("mine/") && a != b, "{a} {b}");
    }

    #[test]
    fn a_rank_sets_its_host_id_in_its_own_environment_and_without_a_gpu_is_refused() {
        // (This process's environment: nextest runs each test in a process of its own.)
        std::env::remove_var(HOST_ID_VAR);
        std::env::remove_var(SOCKET_IFNAME_VAR);
        let env = crate::comm::LaunchEnv { rank: 1, world_size: 2, local_rank: 1, local_world_size: 2, ..crate::comm::LaunchEnv::single() };
        let refused = apply(&env, 0).unwrap_err();
        assert!(refused.is::<crate::error::UsageError>() && refused.to_string().contains("no CUDA device"), "{refused}");
        assert!(std::env::var_os(HOST_ID_VAR).is_none(), "nothing set when refused");
        let line = apply(&env, 1).unwrap();
        assert!(std::env::var(HOST_ID_VAR).unwrap().ends_with("/share-gpu-slot-1"), "{:?}", std::env::var(HOST_ID_VAR));
        assert_eq!(std::env::var(SOCKET_IFNAME_VAR).unwrap(), "lo");
        assert_eq!(line, note(2, 1));
    }

    #[test]
    fn the_note_says_it_is_a_check_and_counts_the_host_ids() {
        let line = note(2, 1);
        assert!(line.contains("2 rank(s) on 1 GPU(s), in 2 NCCL host id(s)") && line.contains("not a way to train faster"), "{line}");
        assert!(note(4, 2).contains("in 2 NCCL host id(s)"));
        assert!(!line.contains('\n'));
    }
}
