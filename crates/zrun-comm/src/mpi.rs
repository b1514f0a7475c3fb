//! The `mpi` backend (cargo feature `mpi`): the system's MPI under `mpirun`, CPU tensors.
//!
//! MPI is initialised, used and finalised on the communicator's own thread. Reductions run in
//! fp32 (16-bit tensors are widened, reduced and rounded once). MPI's blocking collectives
//! cannot be interrupted: a wait still returns [`Error::Timeout`] at its deadline, and
//! mpirun ends the job when a rank dies.

use std::time::Duration;

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Count;
use tch::Tensor;

use crate::buf::{self, DType, Placement, RawBuf};
use crate::kernels;
use crate::work::Executor;
use crate::{chunk_offset, chunk_sizes, Backend, Communicator, Error, ReduceOp, Topology, Work};

struct State {
    _universe: mpi::environment::Universe,
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
}

pub(crate) struct MpiComm {
    rank: usize,
    world: usize,
    exec: Executor<State>,
}

fn count(rank: usize, op: &'static str, n: usize) -> Result<Count, Error> {
    Count::try_from(n).map_err(|_| Error::InvalidArgument {
        rank,
        op,
        detail: format!("{n} elements is over MPI's 2^31 count limit; split the tensor"),
    })
}

/// Initialises MPI and wraps `MPI_COMM_WORLD`.
pub(crate) fn init(topo: &Topology, timeout: Duration) -> Result<Box<dyn Communicator>, Error> {
    let rank = topo.rank;
    let exec = Executor::spawn(
        rank,
        timeout,
        move || {
            let (universe, _level) =
                mpi::initialize_with_threading(mpi::Threading::Serialized).ok_or_else(|| {
                    Error::Backend {
                        rank,
                        backend: "mpi",
                        op: "init",
                        detail: "MPI is already initialised in this process (one mpi communicator per process)".into(),
                    }
                })?;
            let world = universe.world();
            let (r, size) = (world.rank() as usize, world.size() as usize);
            Ok(State {
                _universe: universe,
                world,
                rank: r,
                size,
            })
        },
        |_| {},
    )?;
    // Ask the thread for MPI's own view of the world (authoritative under mpirun).
    let (tx, rx) = std::sync::mpsc::channel();
    exec.submit("init", 0, move |st| {
        let _ = tx.send((st.rank, st.size));
        Ok(())
    })?
    .wait()?;
    let (r, w) = rx.recv().map_err(|_| Error::Backend {
        rank,
        backend: "mpi",
        op: "init",
        detail: "the MPI thread stopped".into(),
    })?;
    if topo.world_size > 1 && (r, w) != (topo.rank, topo.world_size) {
        return Err(Error::Topology {
            source_name: "MPI".into(),
            detail: format!(
                "MPI says rank {r} of {w} but the environment says rank {} of {}; start the job with mpirun alone",
                topo.rank, topo.world_size
            ),
        });
    }
    Ok(Box::new(MpiComm {
        rank: r,
        world: w,
        exec,
    }))
}

/// fp32 copy of a buffer (16-bit widened).
fn widen(b: &RawBuf) -> Vec<f32> {
    let mut v = vec![0f32; b.numel];
    // SAFETY: the buffer belongs to this op until it is waited on.
    kernels::load(b.dtype, unsafe { b.as_mut() }, &mut v);
    v
}

impl MpiComm {
    fn raw(&self, t: &Tensor, op: &'static str, what: &str) -> Result<RawBuf, Error> {
        buf::raw(t, self.rank, op, what, Placement::Cpu)
    }
}

/// Sum of `src` over the ranks, in fp32.
fn sum_f32(st: &State, src: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; src.len()];
    st.world
        .all_reduce_into(src, &mut out[..], SystemOperation::sum());
    out
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> Backend {
        Backend::Mpi
    }

    fn all_gather(&self, shard: &Tensor, full: &Tensor) -> Result<Work, Error> {
        const OP: &str = "all_gather";
        let (s, f) = (self.raw(shard, OP, "shard")?, self.raw(full, OP, "full")?);
        buf::check_shard(&f, &s, self.rank, self.world, OP)?;
        let es = f.dtype.size();
        let w = self.world;
        // Counted in 2- or 4-byte words so that large tensors stay under MPI's count limit.
        let counts = chunk_sizes(f.numel, w)
            .into_iter()
            .map(|c| count(self.rank, OP, c))
            .collect::<Result<Vec<_>, _>>()?;
        let displs = (0..w)
            .map(|q| count(self.rank, OP, chunk_offset(f.numel, w, q)))
            .collect::<Result<Vec<_>, _>>()?;
        self.exec.submit(OP, f.bytes(), move |st| {
            // SAFETY: both buffers belong to this op until it is waited on; distinct tensors.
            let (sb, fb) = unsafe { (s.as_mut(), f.as_mut()) };
            if es == 4 {
                let sv = bytes_as::<f32>(sb);
                let fv = bytes_as_mut::<f32>(fb);
                let mut part = PartitionMut::new(fv, &counts[..], &displs[..]);
                st.world.all_gather_varcount_into(sv, &mut part);
            } else {
                let sv = bytes_as::<u16>(sb);
                let fv = bytes_as_mut::<u16>(fb);
                let mut part = PartitionMut::new(fv, &counts[..], &displs[..]);
                st.world.all_gather_varcount_into(sv, &mut part);
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "reduce_scatter";
        let (f, s) = (self.raw(full, OP, "full")?, self.raw(shard, OP, "shard")?);
        buf::check_shard(&f, &s, self.rank, self.world, OP)?;
        count(self.rank, OP, f.numel)?;
        let (rank, w) = (self.rank, self.world);
        self.exec.submit(OP, f.bytes(), move |st| {
            let sum = sum_f32(st, &widen(&f));
            let off = chunk_offset(f.numel, w, rank);
            let div = if op == ReduceOp::Avg { w as f32 } else { 1.0 };
            // SAFETY: the shard belongs to this op until it is waited on.
            kernels::store(s.dtype, &sum[off..off + s.numel], div, unsafe {
                s.as_mut()
            });
            Ok(())
        })
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "all_reduce";
        let b = self.raw(t, OP, "tensor")?;
        count(self.rank, OP, b.numel)?;
        let w = self.world;
        self.exec.submit(OP, b.bytes(), move |st| {
            let sum = sum_f32(st, &widen(&b));
            let div = if op == ReduceOp::Avg { w as f32 } else { 1.0 };
            // SAFETY: the tensor belongs to this op until it is waited on.
            kernels::store(b.dtype, &sum, div, unsafe { b.as_mut() });
            Ok(())
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Work, Error> {
        const OP: &str = "broadcast";
        if root >= self.world {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: OP,
                detail: format!("root {root} is not below the world size {}", self.world),
            });
        }
        let b = self.raw(t, OP, "tensor")?;
        count(self.rank, OP, b.numel)?;
        self.exec.submit(OP, b.bytes(), move |st| {
            // SAFETY: the tensor belongs to this op until it is waited on.
            let data = unsafe { b.as_mut() };
            let p = st.world.process_at_rank(root as i32);
            if b.dtype == DType::F32 {
                p.broadcast_into(bytes_as_mut::<f32>(data));
            } else {
                p.broadcast_into(bytes_as_mut::<u16>(data));
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<Work, Error> {
        self.exec.submit("barrier", 0, |st| {
            st.world.barrier();
            Ok(())
        })
    }
}

fn bytes_as<T: Copy>(b: &[u8]) -> &[T] {
    if b.is_empty() {
        return &[];
    }
    // SAFETY: tensor memory of `T`-sized elements, aligned (tensor storage is aligned and
    // the dtype matches T's size); length rounded down.
    unsafe {
        std::slice::from_raw_parts(b.as_ptr() as *const T, b.len() / std::mem::size_of::<T>())
    }
}

fn bytes_as_mut<T: Copy>(b: &mut [u8]) -> &mut [T] {
    if b.is_empty() {
        return &mut [];
    }
    // SAFETY: as in `bytes_as`, and the borrow is unique.
    unsafe {
        std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, b.len() / std::mem::size_of::<T>())
    }
}
