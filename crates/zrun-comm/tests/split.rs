//! Sub-communicators of the `tcp` backend in real processes: shard and replica groups of a
//! world of 4 (both transports), keys that reorder, groups of one, a group of a group, and
//! ranks that mix up communicators.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use std::time::Duration;

use anyhow::{bail, ensure};
use common::{assert_all_ok, is_worker, spawn_ranks, worker};
use tch::{Device, Kind, Tensor};
use zrun_comm::{init, Backend, Communicator, ReduceOp, Topology, CMA_ENV};

const LIMIT: Duration = Duration::from_secs(120);

fn splits() {
    worker(|| {
        let topo = Topology::from_env()?;
        let world = init(&topo, Backend::Tcp, Duration::from_secs(30))?;
        common::split::check_splits(world.as_ref()).unwrap_or_else(|e| common::fail_now(e));
        Ok(())
    });
}

macro_rules! split_test {
    ($name:ident, $cma:expr) => {
        #[test]
        fn $name() {
            if is_worker(stringify!($name)) {
                return splits();
            }
            let outs = spawn_ranks(stringify!($name), 4, &[(CMA_ENV, $cma)], LIMIT);
            assert_all_ok(stringify!($name), &outs);
        }
    };
}

split_test!(ring_world4_groups_replicas_reordered_and_alone, "0");
split_test!(cma_world4_groups_replicas_reordered_and_alone, "1");

/// Rank 0 all-reduces in a group of both ranks (keys reversed: it is the group's rank 1)
/// while rank 1 all-reduces in the world: both must fail at once with a mismatch that names
/// the other by its world rank, instead of mixing the two collectives' data.
#[test]
fn ranks_that_mix_up_communicators_fail_naming_world_ranks() {
    const NAME: &str = "ranks_that_mix_up_communicators_fail_naming_world_ranks";
    if is_worker(NAME) {
        return worker(|| {
            let topo = Topology::from_env()?;
            let world = init(&topo, Backend::Tcp, Duration::from_secs(5))?;
            let me = world.rank();
            let group = world.split(0, 1 - me)?;
            ensure!(group.rank() == 1 - me, "group rank {}", group.rank());
            let t = Tensor::ones([16], (Kind::Float, Device::Cpu));
            let c = if me == 0 { &group } else { &world };
            match c.all_reduce(&t, ReduceOp::Sum)?.wait() {
                Ok(()) => bail!("rank {me}: a group all-reduce met a world all-reduce"),
                Err(e) => {
                    let msg = e.to_string();
                    let other = format!("peer rank {} issued all_reduce(sum)", 1 - me);
                    ensure!(
                        msg.contains(&format!("rank {me}, all_reduce #"))
                            && msg.contains(&other)
                            && msg.contains("communicator"),
                        "{msg}"
                    );
                    println!("rank {me} failed as expected: {msg}");
                }
            }
            Ok(())
        });
    }
    let outs = spawn_ranks(NAME, 2, &[(CMA_ENV, "0")], LIMIT);
    assert_all_ok(NAME, &outs);
}

/// The default body of `split` (test doubles of other crates): a clear error, not a panic.
#[test]
fn a_communicator_without_groups_refuses_to_split() {
    struct Plain;
    impl Communicator for Plain {
        fn rank(&self) -> usize {
            3
        }
        fn world_size(&self) -> usize {
            4
        }
        fn backend(&self) -> Backend {
            Backend::Tcp
        }
        fn all_gather(&self, _: &Tensor, _: &Tensor) -> Result<zrun_comm::Work, zrun_comm::Error> {
            Ok(zrun_comm::Work::ready())
        }
        fn reduce_scatter(
            &self,
            _: &Tensor,
            _: &Tensor,
            _: ReduceOp,
        ) -> Result<zrun_comm::Work, zrun_comm::Error> {
            Ok(zrun_comm::Work::ready())
        }
        fn all_reduce(&self, _: &Tensor, _: ReduceOp) -> Result<zrun_comm::Work, zrun_comm::Error> {
            Ok(zrun_comm::Work::ready())
        }
        fn broadcast(&self, _: &Tensor, _: usize) -> Result<zrun_comm::Work, zrun_comm::Error> {
            Ok(zrun_comm::Work::ready())
        }
        fn barrier(&self) -> Result<zrun_comm::Work, zrun_comm::Error> {
            Ok(zrun_comm::Work::ready())
        }
    }
    let e = Plain.split(0, 0).err().expect("no groups").to_string();
    assert!(
        e.contains("rank 3, split") && e.contains("cannot be split"),
        "{e}"
    );
    let solo = zrun_comm::solo(Backend::Nccl);
    assert_eq!(
        (solo.rank(), solo.world_size(), solo.backend()),
        (0, 1, Backend::Nccl)
    );
}
