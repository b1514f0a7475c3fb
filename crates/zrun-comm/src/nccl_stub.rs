//! Stand-in for the `nccl` backend when the crate is built without the `cuda` feature.

use std::time::Duration;

use crate::{Communicator, Error, StoreClient, StoreServer, Topology};

/// Always fails: this build has no CUDA support.
pub(crate) fn check_libraries(_rank: usize) -> Result<(), Error> {
    Err(Error::NotCompiled {
        backend: "nccl",
        feature: "cuda",
    })
}

/// Always fails: this build has no CUDA support.
pub(crate) fn init(
    _topo: &Topology,
    _store: Option<StoreClient>,
    _server: Option<StoreServer>,
    _timeout: Duration,
) -> Result<Box<dyn Communicator>, Error> {
    Err(Error::NotCompiled {
        backend: "nccl",
        feature: "cuda",
    })
}

/// None: this build has no CUDA support.
pub fn gpu_total_bytes(_index: usize) -> Option<u64> {
    None
}
