//! `ZRUN_NCCL_SHARE_GPU=1`: a test mode in which several NCCL ranks share one GPU.
//!
//! NCCL refuses two ranks of one communicator on one device: its duplicate-GPU check compares
//! each rank's host hash and the device's bus id. The host hash is taken from `NCCL_HOSTID`
//! when that is set (NCCL 2.28, src/misc/utils.cc), so ranks in separate processes that each
//! set their own `NCCL_HOSTID` look like ranks of separate hosts; with `NCCL_NET=Socket` and
//! `NCCL_SOCKET_IFNAME=lo` they then form one communicator over loopback sockets on one GPU.
//! That is slow (every byte crosses a socket), so the mode is for checking the NCCL path's
//! correctness with several ranks where only one GPU is at hand, never for speed.
//!
//! The launchers (`zrun --nproc N`, `zrun bench comm`) give each rank its variables
//! ([`rank_env`]); a rank started by mpirun or srun sets them on itself before any thread
//! starts ([`apply_to_this_process`]). The mode is refused where the ranks have GPUs of their
//! own, and across nodes (loopback does not reach another host): [`check`].

use crate::Error;

/// The switch: `1` turns the mode on.
pub const SHARE_GPU_ENV: &str = "ZRUN_NCCL_SHARE_GPU";

/// Whether this process was asked to share one GPU between NCCL ranks.
pub fn requested() -> bool {
    std::env::var(SHARE_GPU_ENV).is_ok_and(|v| v.trim() == "1")
}

/// The NCCL variables of global rank `rank` in the mode: a host id of its own, sockets over
/// loopback. A variable the user set already is left to them.
pub fn rank_env(rank: usize) -> Vec<(String, String)> {
    [
        ("NCCL_HOSTID", format!("zrun-shared-gpu-rank-{rank}")),
        ("NCCL_NET", "Socket".to_string()),
        ("NCCL_SOCKET_IFNAME", "lo".to_string()),
    ]
    .into_iter()
    .filter(|(k, _)| std::env::var_os(k).is_none())
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// What a launcher adds to global rank `rank`'s environment: [`rank_env`] in the mode, else
/// nothing.
pub fn launch_env(rank: usize) -> Vec<(String, String)> {
    if requested() {
        rank_env(rank)
    } else {
        Vec::new()
    }
}

/// In the mode, sets [`rank_env`] of this process's `RANK` (or `OMPI_COMM_WORLD_RANK`,
/// `PMI_RANK`, `SLURM_PROCID`) on this process: for ranks no zrun launcher started. Must run
/// before any other thread starts (it changes the environment).
pub fn apply_to_this_process() {
    if !requested() {
        return;
    }
    let rank = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok());
    if let Some(rank) = rank {
        for (k, v) in rank_env(rank) {
            std::env::set_var(k, v);
        }
    }
}

/// Refuses the mode (`on`: [`requested`]) where it does not apply: `local_world_size` ranks
/// of a `world_size`-rank job that see `visible` GPUs. Ok when the mode is off.
pub fn check(
    on: bool,
    rank: usize,
    local_world_size: usize,
    world_size: usize,
    visible: usize,
) -> Result<(), Error> {
    if !on {
        return Ok(());
    }
    let refuse = |detail: String| Error::Backend {
        rank,
        backend: "nccl",
        op: SHARE_GPU_ENV,
        detail,
    };
    if visible > 1 && local_world_size <= visible {
        return Err(refuse(format!(
            "{SHARE_GPU_ENV}=1 shares one GPU between ranks, but the {local_world_size} rank(s) of this node have GPUs of their own ({visible} visible); unset it (it is a slow test mode)"
        )));
    }
    if world_size > local_world_size {
        return Err(refuse(format!(
            "{SHARE_GPU_ENV}=1 connects the ranks over loopback, which does not reach the other nodes of this {world_size}-rank job; use it on one node only"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_gets_its_own_host_id_over_loopback_sockets() {
        let a = rank_env(0);
        let b = rank_env(1);
        let get = |env: &[(String, String)], k: &str| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        if std::env::var_os("NCCL_HOSTID").is_none() {
            assert_ne!(get(&a, "NCCL_HOSTID"), get(&b, "NCCL_HOSTID"));
            assert!(get(&a, "NCCL_HOSTID").is_some());
        }
        if std::env::var_os("NCCL_NET").is_none() {
            assert_eq!(get(&a, "NCCL_NET").as_deref(), Some("Socket"));
        }
    }

    #[test]
    fn the_mode_is_refused_where_ranks_have_their_own_gpus_or_other_nodes() {
        // two ranks on the one visible GPU: the mode's case
        assert!(check(true, 0, 2, 2, 1).is_ok());
        // off: anything goes here (the backend decides)
        assert!(check(false, 0, 8, 8, 8).is_ok());
        let e = check(true, 1, 2, 2, 2).unwrap_err().to_string();
        assert!(
            e.contains("GPUs of their own (2 visible)") && e.contains(SHARE_GPU_ENV),
            "{e}"
        );
        let e = check(true, 0, 2, 4, 1).unwrap_err().to_string();
        assert!(e.contains("one node only"), "{e}");
    }
}
