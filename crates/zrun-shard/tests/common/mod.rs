//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use zrun_optim::AdamWConfig;

/// One rank's communicator (no peers, no store).
pub fn single() -> Arc<dyn zrun_comm::Communicator> {
    let topo = zrun_comm::Topology::single();
    let comm = zrun_comm::init(
        &topo,
        zrun_comm::Backend::Tcp,
        std::time::Duration::from_secs(5),
    );
    Arc::from(comm.unwrap())
}

/// The AdamW hyper-parameters of these tests (GPT-2's betas, decay 0.1).
pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}
