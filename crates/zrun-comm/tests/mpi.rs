//! The `mpi` backend under `mpirun -np 2` and `-np 3`: the same checks as the `tcp` suite;
//! under `-np 4`, its sub-communicators (`MPI_Comm_split`) as tests/split.rs checks tcp's.
#![cfg(feature = "mpi")]

mod common;

use std::time::Duration;

use common::{assert_all_ok, is_worker, spawn_mpirun, worker};
use zrun_comm::{init, Backend, Topology, TopologySource};

fn collectives() {
    worker(|| {
        let topo = Topology::from_env()?;
        anyhow::ensure!(
            topo.source == TopologySource::OpenMpi,
            "not under mpirun: {topo:?}"
        );
        let c = init(&topo, Backend::Mpi, Duration::from_secs(30))?;
        anyhow::ensure!(c.backend() == Backend::Mpi);
        anyhow::ensure!((c.rank(), c.world_size()) == (topo.rank, topo.world_size));
        common::check_collectives(c.as_ref()).unwrap_or_else(|e| common::fail_now(e));
        Ok(())
    });
}

#[test]
fn mpirun_np2_every_collective_and_dtype() {
    const NAME: &str = "mpirun_np2_every_collective_and_dtype";
    if is_worker(NAME) {
        return collectives();
    }
    let outs = spawn_mpirun(NAME, 2, Duration::from_secs(120));
    assert_all_ok(NAME, &outs);
}

#[test]
fn mpirun_np3_every_collective_and_dtype() {
    const NAME: &str = "mpirun_np3_every_collective_and_dtype";
    if is_worker(NAME) {
        return collectives();
    }
    let outs = spawn_mpirun(NAME, 3, Duration::from_secs(120));
    assert_all_ok(NAME, &outs);
}

#[test]
fn mpirun_np4_groups_replicas_reordered_and_alone() {
    const NAME: &str = "mpirun_np4_groups_replicas_reordered_and_alone";
    if is_worker(NAME) {
        return worker(|| {
            let topo = Topology::from_env()?;
            let world = init(&topo, Backend::Mpi, Duration::from_secs(30))?;
            common::split::check_splits(world.as_ref()).unwrap_or_else(|e| common::fail_now(e));
            // MPI is finalised after every split-off communicator is freed: dropped first here,
            // and freed before the universe when the thread's state drops.
            Ok(())
        });
    }
    let outs = spawn_mpirun(NAME, 4, Duration::from_secs(120));
    assert_all_ok(NAME, &outs);
}
