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
    /// Optimizer state (AdamW m and v).
    pub optimizer: i64,
    /// Scratch and in-flight buffers (gathers, optimizer scratch).
    pub buffers: i64,
}

impl MemoryLedger {
    /// Model states: parameters, gradients, master and optimizer state (the ZeRO formula's terms).
    pub fn model_states(&self) -> i64 {
        self.params + self.grads + self.master + self.optimizer
    }

    /// Everything recorded, buffers included.
    pub fn total(&self) -> i64 {
        self.model_states() + self.buffers
    }
}

impl MemoryLedger {
    /// The model-state bytes the engine allocates for `layout`'s rank at `stage` in fp32
    /// (what `Engine::memory` then counts), computed without allocating; `buffers` is left 0
    /// because in-flight buffers depend on the run.
    pub fn plan(layout: &crate::ShardLayout, stage: crate::Stage) -> MemoryLedger {
        use crate::Stage::*;
        let (full, shard) = (layout.full_numel(), layout.shard_numel());
        MemoryLedger {
            params: 4 * if stage == Zero3 { shard } else { full },
            grads: 4 * if matches!(stage, Zero0 | Zero1) {
                full
            } else {
                shard
            },
            master: 0,
            optimizer: 8 * if stage == Zero0 { full } else { shard },
            buffers: 0,
        }
    }
}
