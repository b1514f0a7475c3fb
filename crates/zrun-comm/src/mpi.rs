//! The `mpi` backend (cargo feature `mpi`): the system's MPI under `mpirun`, CPU tensors.
//!
//! MPI is initialised, used and finalised on the communicator's own thread. Reductions run in
//! fp32 (16-bit tensors are widened, reduced and rounded once). MPI's blocking collectives
//! cannot be interrupted: a wait still returns [`Error::Timeout`] at its deadline, and
//! mpirun ends the job when a rank dies. Sub-communicators ([`Communicator::split`]) are
//! `MPI_Comm_split`'s, used on the same thread.

use std::sync::Arc;
use std::time::Duration;

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Count;
use tch::Tensor;

use crate::buf::{self, DType, Placement, RawBuf};
use crate::kernels;
use crate::work::Executor;
use crate::{chunk_offset, chunk_sizes, Backend, Communicator, Error, ReduceOp, Topology, Work};

struct State {
    /// Communicators split off the world. Declared before `_universe`: fields drop in
    /// declaration order, and a communicator must be freed before `MPI_Finalize`.
    subs: Vec<SimpleCommunicator>,
    _universe: mpi::environment::Universe,
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
}

impl State {
    /// The world (`None`) or sub-communicator `sub`.
    fn comm(&self, sub: Option<usize>) -> &SimpleCommunicator {
        sub.map_or(&self.world, |i| &self.subs[i])
    }
}

pub(crate) struct MpiComm {
    rank: usize,
    world: usize,
    /// This rank in `MPI_COMM_WORLD` (named by errors).
    me: usize,
    /// Which of the state's sub-communicators this is; `None` for the world.
    sub: Option<usize>,
    /// The MPI thread, shared by the world and every communicator split off it.
    exec: Arc<Executor<State>>,
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
                subs: Vec::new(),
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
                "MPI says rank {r} of {w} but the environment says rank {} of {}",
                topo.rank, topo.world_size
            ),
            hint: "start the job with mpirun alone",
        });
    }
    Ok(Box::new(MpiComm {
        rank: r,
        world: w,
        me: r,
        sub: None,
        exec: Arc::new(exec),
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
        buf::raw(t, self.me, op, what, Placement::Cpu)
    }

    /// Where this rank sits in this communicator, for [`buf::check_shard`].
    fn seat(&self) -> buf::Seat {
        buf::Seat {
            me: self.me,
            rank: self.rank,
            world: self.world,
            sub: self.sub.is_some(),
        }
    }
}

/// Sum of `src` over the ranks of `comm`, in fp32.
fn sum_f32(comm: &SimpleCommunicator, src: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; src.len()];
    comm.all_reduce_into(src, &mut out[..], SystemOperation::sum());
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
        buf::check_shard(&f, &s, self.seat(), OP)?;
        let es = f.dtype.size();
        let w = self.world;
        // Counted in 2- or 4-byte words so that large tensors stay under MPI's count limit.
        let counts = chunk_sizes(f.numel, w)
            .into_iter()
            .map(|c| count(self.me, OP, c))
            .collect::<Result<Vec<_>, _>>()?;
        let displs = (0..w)
            .map(|q| count(self.me, OP, chunk_offset(f.numel, w, q)))
            .collect::<Result<Vec<_>, _>>()?;
        let sub = self.sub;
        self.exec.submit(OP, f.bytes(), move |st| {
            let comm = st.comm(sub);
            // SAFETY: both buffers belong to this op until it is waited on; distinct tensors.
            let (sb, fb) = unsafe { (s.as_mut(), f.as_mut()) };
            if es == 4 {
                let sv = bytes_as::<f32>(sb);
                let fv = bytes_as_mut::<f32>(fb);
                let mut part = PartitionMut::new(fv, &counts[..], &displs[..]);
                comm.all_gather_varcount_into(sv, &mut part);
            } else {
                let sv = bytes_as::<u16>(sb);
                let fv = bytes_as_mut::<u16>(fb);
                let mut part = PartitionMut::new(fv, &counts[..], &displs[..]);
                comm.all_gather_varcount_into(sv, &mut part);
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "reduce_scatter";
        let (f, s) = (self.raw(full, OP, "full")?, self.raw(shard, OP, "shard")?);
        buf::check_shard(&f, &s, self.seat(), OP)?;
        count(self.me, OP, f.numel)?;
        let (rank, w, sub) = (self.rank, self.world, self.sub);
        self.exec.submit(OP, f.bytes(), move |st| {
            let sum = sum_f32(st.comm(sub), &widen(&f));
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
        count(self.me, OP, b.numel)?;
        let (w, sub) = (self.world, self.sub);
        self.exec.submit(OP, b.bytes(), move |st| {
            let sum = sum_f32(st.comm(sub), &widen(&b));
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
                rank: self.me,
                op: OP,
                detail: format!("root {root} is not below the world size {}", self.world),
            });
        }
        let b = self.raw(t, OP, "tensor")?;
        count(self.me, OP, b.numel)?;
        let sub = self.sub;
        self.exec.submit(OP, b.bytes(), move |st| {
            // SAFETY: the tensor belongs to this op until it is waited on.
            let data = unsafe { b.as_mut() };
            let p = st.comm(sub).process_at_rank(root as i32);
            if b.dtype == DType::F32 {
                p.broadcast_into(bytes_as_mut::<f32>(data));
            } else {
                p.broadcast_into(bytes_as_mut::<u16>(data));
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<Work, Error> {
        let sub = self.sub;
        self.exec.submit("barrier", 0, move |st| {
            st.comm(sub).barrier();
            Ok(())
        })
    }

    /// `MPI_Comm_split` of this communicator, on the MPI thread.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>, Error> {
        const OP: &str = "split";
        let (c, k) = (
            crate::group::c_int(self.me, "MPI", "color", color)?,
            crate::group::c_int(self.me, "MPI", "key", key)?,
        );
        let (me, sub) = (self.me, self.sub);
        let (tx, rx) = std::sync::mpsc::channel();
        self.exec
            .submit(OP, 0, move |st| {
                let new = st
                    .comm(sub)
                    .split_by_color_with_key(Color::with_value(c), k)
                    .ok_or_else(|| Error::Backend {
                        rank: me,
                        backend: "mpi",
                        op: OP,
                        detail: format!("MPI_Comm_split with color {c} gave no communicator"),
                    })?;
                let (rank, size) = (new.rank() as usize, new.size() as usize);
                // A group of one needs no MPI communicator (`new` is freed here).
                let index = (size > 1).then(|| {
                    st.subs.push(new);
                    st.subs.len() - 1
                });
                let _ = tx.send((index, rank, size));
                Ok(())
            })?
            .wait()?;
        let (index, rank, world) = rx.recv().map_err(|_| Error::Poisoned {
            rank: me,
            op: OP,
            first: "the MPI thread stopped".into(),
        })?;
        let Some(index) = index else {
            return Ok(crate::solo(Backend::Mpi));
        };
        Ok(Box::new(MpiComm {
            rank,
            world,
            me,
            sub: Some(index),
            exec: self.exec.clone(),
        }))
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
