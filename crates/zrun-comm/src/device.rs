//! Which GPU a rank computes and communicates on: one rule, used by the trainer (and through
//! it the engine's config), `zrun bench comm` and the nccl backend, so that libtorch's tensors
//! and NCCL's communicator always sit on the same device.

use crate::{Error, Topology};

/// The index, among the CUDA devices this process sees, of the GPU of the rank that is
/// `local_rank` of the `local_world_size` ranks on its node, when `visible` devices are
/// visible (after `CUDA_VISIBLE_DEVICES`):
///
/// - exactly one device visible: 0. Each rank was given its own GPU (a per-rank
///   `CUDA_VISIBLE_DEVICES`, `srun --gpus-per-task=1`), or the node's ranks share one GPU
///   (the tcp backend's case; NCCL refuses two ranks on one device at its init);
/// - at least as many devices as ranks on the node: `local_rank` (one GPU per rank, as
///   `zrun --nproc N` and torchrun start them);
/// - otherwise (no device, or fewer devices than ranks): an error naming LOCAL_RANK, the
///   visible count and the fix. Every rank of such a node fails the same way.
pub fn gpu_index(
    local_rank: usize,
    local_world_size: usize,
    visible: usize,
) -> Result<usize, Error> {
    let err = |detail: String| Error::Device {
        local_rank,
        local_world_size,
        visible,
        detail,
    };
    match visible {
        0 => Err(err(
            "this rank has no GPU to compute on; check CUDA_VISIBLE_DEVICES and nvidia-smi, or set dist.device = \"cpu\"".into(),
        )),
        1 => Ok(0),
        v if local_world_size <= v => Ok(local_rank),
        v => Err(err(format!(
            "more ranks than GPUs on this node; start at most {v} ranks per node (--nproc {v}), or give each rank one GPU of its own (a per-rank CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1)"
        ))),
    }
}

impl Topology {
    /// This rank's GPU among `visible` CUDA devices: [`gpu_index`] of its local rank.
    pub fn gpu_index(&self, visible: usize) -> Result<usize, Error> {
        gpu_index(self.local_rank, self.local_world_size, visible)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_gpu_per_rank_is_the_local_rank() {
        for lws in 1..=8 {
            for lr in 0..lws {
                assert_eq!(gpu_index(lr, lws, 8).unwrap(), lr);
                assert_eq!(gpu_index(lr, lws, lws.max(2)).unwrap(), lr);
            }
        }
    }

    #[test]
    fn one_visible_device_is_device_zero_for_every_rank() {
        // srun --gpus-per-task=1 or a per-rank CUDA_VISIBLE_DEVICES: each rank sees only its
        // own GPU, as device 0; or several ranks share the one GPU.
        for lws in 1..=8 {
            for lr in 0..lws {
                assert_eq!(gpu_index(lr, lws, 1).unwrap(), 0);
            }
        }
    }

    #[test]
    fn no_device_or_fewer_devices_than_ranks_is_an_error_naming_the_fix() {
        let e = gpu_index(0, 1, 0).unwrap_err().to_string();
        assert!(
            e.contains("LOCAL_RANK 0 of 1")
                && e.contains("sees 0 CUDA device")
                && e.contains("CUDA_VISIBLE_DEVICES")
                && e.contains("dist.device = \"cpu\""),
            "{e}"
        );
        // every rank of an oversubscribed node fails, not only the ones past the last GPU
        for lr in 0..4 {
            let e = gpu_index(lr, 4, 2).unwrap_err().to_string();
            assert!(
                e.contains(&format!("LOCAL_RANK {lr} of 4"))
                    && e.contains("sees 2 CUDA device")
                    && e.contains("--nproc 2")
                    && e.contains("--gpus-per-task"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_topology_uses_its_local_rank() {
        let mut t = Topology::single();
        t.rank = 5;
        t.world_size = 8;
        t.local_rank = 1;
        t.local_world_size = 4;
        assert_eq!(t.gpu_index(4).unwrap(), 1);
        assert_eq!(t.gpu_index(1).unwrap(), 0);
        assert!(t.gpu_index(3).is_err());
    }
}
