//! Stand-in for the `mpi` backend when the crate is built without the `mpi` feature.

use std::time::Duration;

use crate::{Communicator, Error, Topology};

/// Always fails: this build has no MPI.
pub(crate) fn init(_topo: &Topology, _timeout: Duration) -> Result<Box<dyn Communicator>, Error> {
    Err(Error::NotCompiled {
        backend: "mpi",
        feature: "mpi",
    })
}
