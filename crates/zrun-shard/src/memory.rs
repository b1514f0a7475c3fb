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
