//! The `nccl` backend (cargo feature `cuda`): CUDA tensors, NCCL loaded at run time.
//!
//! NCCL's id travels through the rendezvous store. Collectives run on a dedicated non-blocking
//! stream: it first waits on an event recorded on libtorch's stream (the legacy default stream,
//! which libtorch uses unless a stream guard is set), and libtorch's stream then waits on the
//! collective's completion event, so kernels queued before and after stay ordered. The
//! communication thread polls that event against the deadline and aborts the NCCL
//! communicator when it passes. Uneven chunks use grouped broadcasts/reduces.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nc, sys as ncsys};
use tch::{Device, Tensor};

use crate::buf::{self, DType, Placement, RawBuf};
use crate::work::Executor;
use crate::{
    chunk_offset, chunk_sizes, Backend, Communicator, Error, ReduceOp, StoreClient, StoreServer,
    Topology, Work,
};

fn backend_err(rank: usize, op: &'static str, detail: String) -> Error {
    Error::Backend {
        rank,
        backend: "nccl",
        op,
        detail,
    }
}

/// Fails with a clear error when libcuda or libnccl cannot be loaded (instead of the panic
/// that calling into a missing library would give).
pub(crate) fn check_libraries(rank: usize) -> Result<(), Error> {
    // SAFETY: only tries to load the library by its usual names.
    if !unsafe { cusys::is_culib_present() } {
        return Err(backend_err(
            rank,
            "load libcuda",
            "libcuda (the NVIDIA driver library) was not found: the nccl backend needs a machine with an NVIDIA GPU and driver; use backend tcp on CPU".into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { ncsys::is_culib_present() } {
        return Err(backend_err(
            rank,
            "load libnccl",
            "libnccl.so was not found on the loader path; pip's nvidia-nccl ships only libnccl.so.2: add a symlink libnccl.so -> libnccl.so.2 in a directory on LD_LIBRARY_PATH".into(),
        ));
    }
    Ok(())
}

struct State {
    rank: usize,
    dev: cusys::CUdevice,
    comm: ncsys::ncclComm_t,
    stream: cusys::CUstream,
    start: cusys::CUevent,
    done: cusys::CUevent,
    one: cusys::CUdeviceptr,
    timeout: Duration,
    /// Set once `ncclCommAbort` has freed the communicator.
    aborted: bool,
}

impl Drop for State {
    fn drop(&mut self) {
        // SAFETY: every handle was created in `connect` and is destroyed exactly once here
        // (an aborted communicator is already freed).
        unsafe {
            if !self.aborted {
                let _ = nc::comm_destroy(self.comm);
            }
            let _ = cu::free_sync(self.one);
            let _ = cu::event::destroy(self.start);
            let _ = cu::event::destroy(self.done);
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

fn connect(
    rank: usize,
    world: usize,
    local: usize,
    id: ncsys::ncclUniqueId,
    timeout: Duration,
) -> Result<State, Error> {
    let cuerr =
        |op: &'static str| move |e: cu::DriverError| backend_err(rank, op, format!("{e:?}"));
    cu::init().map_err(cuerr("cuInit"))?;
    let dev = cu::device::get(local as i32).map_err(cuerr("get device (LOCAL_RANK)"))?;
    // SAFETY: plain driver calls on a valid device; the primary context is the one libtorch uses.
    let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(cuerr("retain primary context"))?;
    // SAFETY: `ctx` is a live context retained above.
    unsafe { cu::ctx::set_current(ctx) }.map_err(cuerr("set context"))?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(cuerr("create stream"))?;
    let flags = cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
    let start = cu::event::create(flags).map_err(cuerr("create event"))?;
    let done = cu::event::create(flags).map_err(cuerr("create event"))?;
    // SAFETY: a 4-byte device allocation for barriers, freed in Drop.
    let one = unsafe { cu::malloc_sync(4) }.map_err(cuerr("allocate"))?;
    let mut comm = std::mem::MaybeUninit::<ncsys::ncclComm_t>::uninit();
    // SAFETY: `comm` is written by NCCL on success; the id came from rank 0.
    unsafe { nc::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32) }
        .map_err(|e| backend_err(rank, "ncclCommInitRank", format!("{e:?}")))?;
    Ok(State {
        rank,
        dev,
        // SAFETY: initialised by the successful call above.
        comm: unsafe { comm.assume_init() },
        stream,
        start,
        done,
        one,
        timeout,
        aborted: false,
    })
}

impl State {
    /// Runs `launch` on the communication stream, ordered after and before libtorch's stream,
    /// and waits for it up to the deadline.
    fn run(
        &mut self,
        op: &'static str,
        bytes: usize,
        launch: impl FnOnce(&State) -> Result<(), nc::NcclError>,
    ) -> Result<(), Error> {
        let torch = cu::stream::null();
        let cuerr = |e: cu::DriverError| backend_err(self.rank, op, format!("{e:?}"));
        // SAFETY: live events and streams of this context.
        unsafe {
            cu::event::record(self.start, torch).map_err(cuerr)?;
            cu::stream::wait_event(
                self.stream,
                self.start,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(cuerr)?;
        }
        launch(self).map_err(|e| backend_err(self.rank, op, format!("{e:?}")))?;
        // SAFETY: as above.
        unsafe {
            cu::event::record(self.done, self.stream).map_err(cuerr)?;
            cu::stream::wait_event(
                torch,
                self.done,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(cuerr)?;
        }
        let start = Instant::now();
        loop {
            // SAFETY: live event.
            match unsafe { cu::event::query(self.done) } {
                Ok(()) => return Ok(()),
                Err(cu::DriverError(cusys::cudaError_enum::CUDA_ERROR_NOT_READY)) => {}
                Err(e) => return Err(cuerr(e)),
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout {
                    rank: self.rank,
                    op,
                    bytes,
                    peer: "unknown (NCCL does not say which rank is missing)".into(),
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn abort(&mut self) {
        if !self.aborted {
            // SAFETY: aborting a live communicator once; Drop then skips destroying it.
            let _ = unsafe { nc::comm_abort(self.comm) };
            self.aborted = true;
        }
    }
}

fn dtype(d: DType) -> ncsys::ncclDataType_t {
    match d {
        DType::F32 => ncsys::ncclDataType_t::ncclFloat32,
        DType::BF16 => ncsys::ncclDataType_t::ncclBfloat16,
        DType::F16 => ncsys::ncclDataType_t::ncclFloat16,
    }
}

fn redop(op: ReduceOp) -> ncsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncsys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncsys::ncclRedOp_t::ncclAvg,
    }
}

pub(crate) struct NcclComm {
    rank: usize,
    world: usize,
    device: usize,
    exec: Executor<State>,
    _store: Option<StoreClient>,
    _server: Option<StoreServer>,
}

/// Creates the NCCL communicator; the id comes from rank 0 through the store (none needed
/// for one rank).
pub(crate) fn init(
    topo: &Topology,
    store: Option<StoreClient>,
    server: Option<StoreServer>,
    timeout: Duration,
) -> Result<Box<dyn Communicator>, Error> {
    let (rank, world) = (topo.rank, topo.world_size);
    check_libraries(rank)?;
    let fresh =
        || nc::get_uniqueid().map_err(|e| backend_err(rank, "ncclGetUniqueId", format!("{e:?}")));
    let id = match &store {
        None => fresh()?,
        Some(s) => {
            let gen = s.add(&format!("zrun/nccl/gen/{rank}"), 1)?;
            let key = format!("zrun/nccl/{gen}/id");
            if rank == 0 {
                let id = fresh()?;
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                s.set(&key, &bytes)?;
                id
            } else {
                let bytes = s.get(&key)?;
                let mut id = ncsys::ncclUniqueId { internal: [0; 128] };
                if bytes.len() != id.internal.len() {
                    return Err(backend_err(
                        rank,
                        "ncclUniqueId",
                        format!("store holds {} bytes, want 128", bytes.len()),
                    ));
                }
                for (d, b) in id.internal.iter_mut().zip(bytes) {
                    *d = b as _;
                }
                id
            }
        }
    };
    let local = topo.local_rank;
    let exec = Executor::spawn(
        rank,
        timeout,
        move || connect(rank, world, local, id, timeout),
        State::abort,
    )?;
    Ok(Box::new(NcclComm {
        rank,
        world,
        device: local,
        exec,
        _store: store,
        _server: server,
    }))
}

impl NcclComm {
    fn raw(&self, t: &Tensor, op: &'static str, what: &str) -> Result<RawBuf, Error> {
        if t.device() != Device::Cuda(self.device) {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op,
                detail: format!(
                    "`{what}` is on {:?}; this rank's GPU is cuda:{} (LOCAL_RANK)",
                    t.device(),
                    self.device
                ),
            });
        }
        buf::raw(t, self.rank, op, what, Placement::Cuda)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> Backend {
        Backend::Nccl
    }

    fn all_gather(&self, shard: &Tensor, full: &Tensor) -> Result<Work, Error> {
        const OP: &str = "all_gather";
        let (s, f) = (self.raw(shard, OP, "shard")?, self.raw(full, OP, "full")?);
        buf::check_shard(&f, &s, self.rank, self.world, OP)?;
        let (w, bytes) = (self.world, f.bytes());
        self.exec.submit(OP, bytes, move |st| {
            st.run(OP, bytes, |st| {
                let (dt, es) = (dtype(f.dtype), f.dtype.size());
                // SAFETY: device pointers of live tensors kept by `s` and `f`; sizes checked.
                unsafe {
                    if f.numel % w == 0 {
                        nc::all_gather(
                            s.ptr as *const c_void,
                            f.ptr as *mut c_void,
                            s.numel,
                            dt,
                            st.comm,
                            st.stream as _,
                        )?;
                    } else {
                        nc::group_start()?;
                        for (q, &n) in chunk_sizes(f.numel, w).iter().enumerate() {
                            let dst = f.ptr + chunk_offset(f.numel, w, q) * es;
                            nc::broadcast(
                                s.ptr as *const c_void,
                                dst as *mut c_void,
                                n,
                                dt,
                                q as i32,
                                st.comm,
                                st.stream as _,
                            )?;
                        }
                        nc::group_end()?;
                    }
                }
                Ok(())
            })
        })
    }

    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "reduce_scatter";
        let (f, s) = (self.raw(full, OP, "full")?, self.raw(shard, OP, "shard")?);
        buf::check_shard(&f, &s, self.rank, self.world, OP)?;
        let (w, bytes) = (self.world, f.bytes());
        self.exec.submit(OP, bytes, move |st| {
            st.run(OP, bytes, |st| {
                let (dt, es, ro) = (dtype(f.dtype), f.dtype.size(), redop(op));
                // SAFETY: device pointers of live tensors kept by `s` and `f`; sizes checked.
                unsafe {
                    if f.numel % w == 0 {
                        nc::reduce_scatter(
                            f.ptr as *const c_void,
                            s.ptr as *mut c_void,
                            s.numel,
                            dt,
                            ro,
                            st.comm,
                            st.stream as _,
                        )?;
                    } else {
                        nc::group_start()?;
                        for (q, &n) in chunk_sizes(f.numel, w).iter().enumerate() {
                            let src = f.ptr + chunk_offset(f.numel, w, q) * es;
                            nc::reduce(
                                src as *const c_void,
                                s.ptr as *mut c_void,
                                n,
                                dt,
                                ro,
                                q as i32,
                                st.comm,
                                st.stream as _,
                            )?;
                        }
                        nc::group_end()?;
                    }
                }
                Ok(())
            })
        })
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "all_reduce";
        let b = self.raw(t, OP, "tensor")?;
        let bytes = b.bytes();
        self.exec.submit(OP, bytes, move |st| {
            st.run(OP, bytes, |st| {
                // SAFETY: device pointer of a live tensor kept by `b`; in place is allowed.
                unsafe {
                    nc::all_reduce(
                        b.ptr as *const c_void,
                        b.ptr as *mut c_void,
                        b.numel,
                        dtype(b.dtype),
                        redop(op),
                        st.comm,
                        st.stream as _,
                    )?;
                }
                Ok(())
            })
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
        let bytes = b.bytes();
        self.exec.submit(OP, bytes, move |st| {
            st.run(OP, bytes, |st| {
                // SAFETY: device pointer of a live tensor kept by `b`; in place is allowed.
                unsafe {
                    nc::broadcast(
                        b.ptr as *const c_void,
                        b.ptr as *mut c_void,
                        b.numel,
                        dtype(b.dtype),
                        root as i32,
                        st.comm,
                        st.stream as _,
                    )?;
                }
                Ok(())
            })
        })
    }

    fn barrier(&self) -> Result<Work, Error> {
        self.exec.submit("barrier", 0, move |st| {
            st.run("barrier", 0, |st| {
                // SAFETY: the state's own 4-byte device buffer.
                unsafe {
                    nc::all_reduce(
                        st.one as *const c_void,
                        st.one as *mut c_void,
                        1,
                        ncsys::ncclDataType_t::ncclFloat32,
                        ncsys::ncclRedOp_t::ncclSum,
                        st.comm,
                        st.stream as _,
                    )?;
                }
                Ok(())
            })
        })
    }
}
