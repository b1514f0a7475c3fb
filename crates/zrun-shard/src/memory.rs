//! Byte accounting: the engine records every buffer it allocates, by category.

use serde::Serialize;

/// Bytes the engine holds on one rank, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryLedger {
    /// Compute-dtype parameters resident on the device (full or shard, per stage).
    pub params: i64,
    /// Gradient buffers (full or shard, per stage).
    pub grads: i64,
    /// fp32 master parameters, when separate from the compute parameters.
    pub master: i64,
    /// Optimizer state (AdamW m and v) on the compute device.
    pub optimizer: i64,
    /// fp32 master and AdamW state offloaded to host memory.
    pub host: i64,
    /// Scratch and in-flight buffers (gathers, optimizer scratch, and at stages 2-3 the
    /// reserve for recovering from an out-of-memory without allocating).
    pub buffers: i64,
}

impl MemoryLedger {
    /// Model states: parameters, gradients, master and optimizer state (the ZeRO formula's
    /// terms), wherever they live.
    pub fn model_states(&self) -> i64 {
        self.params + self.grads + self.master + self.optimizer + self.host
    }

    /// Model states held on the compute device (all of them unless offloaded).
    pub fn device_model_states(&self) -> i64 {
        self.model_states() - self.host
    }

    /// Everything recorded, buffers included.
    pub fn total(&self) -> i64 {
        self.model_states() + self.buffers
    }
}

impl MemoryLedger {
    /// The model-state bytes the engine allocates for `layout`'s rank, computed without
    /// allocating (what `Engine::memory` then counts); `buffers` is left 0 because in-flight
    /// buffers depend on the run.
    pub fn plan(
        layout: &crate::ShardLayout,
        stage: crate::Stage,
        precision: crate::Precision,
        reduce: crate::ReduceDtype,
    ) -> MemoryLedger {
        use crate::Stage::*;
        let (full, shard) = (layout.full_numel(), layout.shard_numel());
        let grad_bytes = reduce.kind().elt_size_in_bytes() as i64;
        // The fp32 master and AdamW state: full at stage 0, else this rank's shard.
        let owned = if stage == Zero0 { full } else { shard };
        MemoryLedger {
            params: precision.bytes() * if stage == Zero3 { shard } else { full },
            grads: grad_bytes
                * if matches!(stage, Zero0 | Zero1) {
                    full
                } else {
                    shard
                },
            master: if precision == crate::Precision::Fp32 {
                0
            } else {
                4 * owned
            },
            optimizer: 8 * owned,
            host: 0,
            buffers: 0,
        }
    }
}
