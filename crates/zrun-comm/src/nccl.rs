//! The `nccl` backend (cargo feature `cuda`): CUDA tensors, NCCL loaded at run time.
//!
//! Each rank works on the GPU [`crate::gpu_index`] gives it (the trainer uses the same rule),
//! on a communication thread whose current context is that GPU's primary context, the one
//! libtorch uses. NCCL's id travels through the rendezvous store, where every rank also marks
//! its arrival (nccl_rendezvous.rs); `ncclCommInitRank` then has `dist.timeout_s` too.
//!
//! Collectives run on a dedicated non-blocking stream, in stream order with libtorch's stream
//! (the legacy default stream, which libtorch uses unless a stream guard is set) and without
//! blocking the host: when a collective is issued, an event is recorded on libtorch's stream on
//! the issuing thread, so the collective waits for the kernels queued before it and for no
//! later ones; the communication thread makes its stream wait on that event, launches, and
//! records a completion event; `Work::wait` then makes libtorch's stream wait on that event
//! (kernels queued after the wait run after the collective) and returns at once. Meanwhile the
//! communication thread watches the launched collectives: one that has not completed within
//! `dist.timeout_s`, or an asynchronous NCCL error, aborts the communicator (which also ends
//! its kernels, so no stream stays blocked) and fails every later collective with that error.
//! Uneven chunks use grouped broadcasts/reduces.
//!
//! Buffers: a collective's tensors are kept until its work is waited on (libtorch's stream
//! is then ordered after it, so the caching allocator may hand the memory to later kernels),
//! or, for a work dropped unwaited, until the collective completes; the estimator counts them
//! that way. Health: the first failure is published before the communicator is aborted, and
//! [`Communicator::check`] reports it, so a host read that follows a collective cut short by
//! the abort is caught. Teardown: launched work is given a short while to complete, then the
//! communicator is aborted rather than destroyed (`ncclCommDestroy` would wait for a dead
//! peer forever). Connections are made at init (`NCCL_RUNTIME_CONNECT=0`, set by
//! [`crate::set_process_env`], and a warm-up collective), not inside the first large
//! collective at the step's peak memory.
//!
//! Sub-communicators ([`Communicator::split`]) are `ncclCommSplit`'s (NCCL 2.18 on), made and
//! used on the same thread and stream, watched and aborted with the world's communicator.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nc, sys as ncsys};
use tch::{Device, Tensor};

use crate::buf::{self, Placement, RawBuf};
use crate::nccl_rendezvous::{self, ID_BYTES};
use crate::work::Executor;

mod state;

use crate::{
    chunk_offset, chunk_sizes, Backend, Communicator, Error, ReduceOp, StoreClient, StoreServer,
    Topology, Work,
};
use state::{connect, cuerr, dtype, grouped, redop, Context, Event, Held, Issued, State};

fn backend_err(rank: usize, op: &'static str, detail: String) -> Error {
    Error::Backend {
        rank,
        backend: "nccl",
        op,
        detail,
    }
}

/// An NCCL failure as words: the result code's name and NCCL's last error message (cudarc's
/// `NcclError` prints neither).
fn nccl_detail(e: &nc::NcclError) -> String {
    // SAFETY: called only after the library was found (`check_libraries`); NCCL returns a
    // pointer to a NUL-terminated string it owns (or null), read here and not kept.
    let last = unsafe {
        let p = ncsys::ncclGetLastError(std::ptr::null_mut());
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    let what = if last.is_empty() {
        format!("{:?}", e.0)
    } else {
        format!("{:?}: {last}", e.0)
    };
    if e.0 == ncsys::ncclResult_t::ncclRemoteError {
        // Seen on the H100 when a peer was killed: the socket transport notices at once.
        format!("{what}; a peer rank failed, was killed or lost its connection (NCCL does not say which: the launcher's log or the other ranks' logs name it)")
    } else {
        what
    }
}

fn nccl_err(rank: usize, op: &'static str, e: &nc::NcclError) -> Error {
    backend_err(rank, op, nccl_detail(e))
}

/// Fails with a clear error when libcuda or libnccl cannot be loaded (instead of the panic
/// that calling into a missing library would give). Runs before any other CUDA or NCCL call.
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
            "libnccl.so was not found on the loader path (pip's nvidia-nccl wheel ships only libnccl.so.2); run `make setup` and `source scripts/env.sh` (they link .venv/zrun-lib/libnccl.so to the wheel's libnccl.so.2 and put that folder on LD_LIBRARY_PATH), or make such a link by hand in a folder on LD_LIBRARY_PATH".into(),
        ));
    }
    Ok(())
}

/// Total bytes of CUDA device `index` (after `CUDA_VISIBLE_DEVICES`) as the driver reports
/// them, or None where there is no driver or no such device. Asks the driver directly, so
/// libtorch's CUDA state (its caching allocator, which reads its settings once, when CUDA is
/// first initialised) is left untouched.
pub fn gpu_total_bytes(index: usize) -> Option<u64> {
    // SAFETY: only tries to load the library by its usual names.
    if !unsafe { cusys::is_culib_present() } {
        return None;
    }
    cu::init().ok()?;
    let dev = cu::device::get(i32::try_from(index).ok()?).ok()?;
    // SAFETY: a valid device handle.
    unsafe { cu::device::total_mem(dev) }.ok().map(|b| b as u64)
}

/// This rank's GPU: [`crate::gpu_index`] over the devices the driver sees, as the trainer
/// decides it over the devices libtorch sees (the same ones, after `CUDA_VISIBLE_DEVICES`).
fn this_rank_gpu(topo: &Topology) -> Result<usize, Error> {
    let rank = topo.rank;
    cu::init().map_err(cuerr(rank, "cuInit"))?;
    let visible = cu::device::get_count().map_err(cuerr(rank, "count CUDA devices"))?;
    let visible = usize::try_from(visible).unwrap_or(0);
    crate::share::check(
        crate::share::requested(),
        rank,
        topo.local_world_size,
        topo.world_size,
        visible,
    )?;
    topo.gpu_index(visible)
}

pub(crate) struct NcclComm {
    rank: usize,
    world: usize,
    /// This rank in the world (named by errors).
    me: usize,
    /// Which of the thread's split-off communicators this is; `None` for the world's.
    which: Option<usize>,
    /// This rank's GPU: the communication thread's device, and where tensors must be.
    device: usize,
    /// That GPU's primary context, retained here (released on drop).
    ctx: Context,
    cu_device: cusys::CUdevice,
    /// The communication thread, shared by the world and every communicator split off it.
    exec: Arc<Executor<State>>,
    /// `dist.timeout_s`: how long a barrier's host wait lasts.
    timeout: Duration,
    /// The store the world met through, kept as long as any of its communicators lives.
    _meeting: Arc<(Option<StoreClient>, Option<StoreServer>)>,
}

/// Creates the NCCL communicator on this rank's GPU; the id comes from rank 0 through the
/// store (none needed for one rank).
///
/// Deadlines: the meeting in the store names the ranks that never arrive; then
/// `ncclCommInitRank` (blocking: a non-blocking communicator would make every later
/// collective start a thread of NCCL's) is given up on after `timeout` too, leaving the
/// stuck thread to end with the process.
pub(crate) fn init(
    topo: &Topology,
    store: Option<StoreClient>,
    server: Option<StoreServer>,
    timeout: Duration,
) -> Result<Box<dyn Communicator>, Error> {
    let (rank, world) = (topo.rank, topo.world_size);
    check_libraries(rank)?;
    let gpu = this_rank_gpu(topo)?;
    let fresh = || nc::get_uniqueid().map_err(|e| nccl_err(rank, "ncclGetUniqueId", &e));
    let id = match &store {
        None => fresh()?,
        Some(s) => {
            let bytes =
                nccl_rendezvous::meet(s, crate::restart_round(), rank, world, timeout, || {
                    Ok(fresh()?.internal.iter().map(|&c| c as u8).collect())
                })?;
            let mut id = ncsys::ncclUniqueId {
                internal: [0; ID_BYTES],
            };
            for (d, b) in id.internal.iter_mut().zip(bytes) {
                *d = b as _;
            }
            id
        }
    };
    let late = move || {
        let met = if world > 1 {
            format!(", although all {world} ranks reached the store")
        } else {
            String::new()
        };
        backend_err(
            rank,
            "ncclCommInitRank",
            format!(
                "did not complete within {timeout:?} (dist.timeout_s) on cuda:{gpu}{met}: a rank failed inside NCCL's init (see its log), two ranks share one GPU, or the hosts cannot reach each other on NCCL's network interface (set NCCL_SOCKET_IFNAME; NCCL_DEBUG=INFO shows what NCCL tried)"
            ),
        )
    };
    let cuerr = |op| cuerr(rank, op);
    let cu_device = cu::device::get(gpu as i32).map_err(cuerr("get this rank's CUDA device"))?;
    // SAFETY: plain driver call on a valid device; released in NcclComm's Drop.
    let ctx = Context(
        unsafe { cu::primary_ctx::retain(cu_device) }.map_err(cuerr("retain primary context"))?,
    );
    let exec = Executor::spawn_within(
        rank,
        timeout,
        move || connect(rank, world, gpu, id, timeout),
        State::abort,
        timeout,
        late,
        Some((WATCH_EVERY, State::watch)),
    )?;
    Ok(Box::new(NcclComm {
        rank,
        world,
        me: rank,
        which: None,
        device: gpu,
        ctx,
        cu_device,
        exec: Arc::new(exec),
        timeout,
        _meeting: Arc::new((store, server)),
    }))
}

/// How often the communication thread looks at launched collectives while idle.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// The first NCCL with `ncclCommSplit` (2.18.0, as `ncclGetVersion` reports it).
const SPLIT_VERSION: i32 = 21800;

/// `ncclGetVersion`'s code as `major.minor.patch` (codes below 2.9 have one digit less).
fn version_words(v: i32) -> String {
    if v >= 10000 {
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: retained once in `init`, released once here.
        let _ = unsafe { cu::primary_ctx::release(self.cu_device) };
    }
}

impl NcclComm {
    /// Issues a collective: records its start on libtorch's stream (this thread's), queues
    /// its launch on the communication thread, and returns a work whose wait makes
    /// libtorch's stream wait for its completion, without blocking the host.
    fn issue(
        &self,
        op: &'static str,
        bytes: usize,
        buffers: Vec<RawBuf>,
        launch: impl FnOnce(&State) -> Result<(), nc::NcclError> + Send + 'static,
    ) -> Result<Work, Error> {
        self.issue_then(op, bytes, buffers, launch, |_| Ok(()))
    }

    /// As [`NcclComm::issue`], with `after` run by the wait once libtorch's stream is
    /// ordered after the collective (given its completion event).
    fn issue_then(
        &self,
        op: &'static str,
        bytes: usize,
        buffers: Vec<RawBuf>,
        launch: impl FnOnce(&State) -> Result<(), nc::NcclError> + Send + 'static,
        after: impl FnOnce(&Event) -> Result<(), Error> + Send + 'static,
    ) -> Result<Work, Error> {
        let rank = self.me;
        let cuerr = move |e: cu::DriverError| backend_err(rank, op, format!("{e:?}"));
        self.ctx.make_current(rank, op)?;
        let start = Event::new().map_err(cuerr)?;
        let done = Arc::new(Event::new().map_err(cuerr)?);
        // SAFETY: a live event of the current context, recorded on its legacy stream.
        unsafe { cu::event::record(start.0, cu::stream::null()) }.map_err(cuerr)?;
        let issued = Issued {
            start,
            done: done.clone(),
        };
        let held: Held = Arc::new(std::sync::Mutex::new(Some(buffers)));
        let on_thread = held.clone();
        let work = self.exec.submit(op, bytes, move |st| {
            st.run(op, bytes, issued, on_thread, launch)
        })?;
        let ctx = self.ctx;
        Ok(work.then(move || {
            ctx.make_current(rank, op)?;
            // SAFETY: `done` was recorded by the launch this work waited for, and is kept
            // alive by this closure until the wait is queued.
            unsafe {
                cu::stream::wait_event(
                    cu::stream::null(),
                    done.0,
                    cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(cuerr)?;
            // Kernels that reuse the buffers' memory now run after the collective.
            drop(held.lock().map(|mut h| h.take()));
            after(&done)
        }))
    }

    fn raw(&self, t: &Tensor, op: &'static str, what: &str) -> Result<RawBuf, Error> {
        if t.device() != Device::Cuda(self.device) {
            return Err(Error::InvalidArgument {
                rank: self.me,
                op,
                detail: format!(
                    "`{what}` is on {:?}; this rank's GPU is cuda:{} (zrun_comm::gpu_index of its LOCAL_RANK); put the tensors there",
                    t.device(),
                    self.device
                ),
            });
        }
        buf::raw(t, self.me, op, what, Placement::Cuda)
    }

    /// Where this rank sits in this communicator, for [`buf::check_shard`].
    fn seat(&self) -> buf::Seat {
        buf::Seat {
            me: self.me,
            rank: self.rank,
            world: self.world,
            sub: self.which.is_some(),
        }
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
        buf::check_shard(&f, &s, self.seat(), OP)?;
        let (w, bytes, which) = (self.world, f.bytes(), self.which);
        let keep = vec![s.keeper(), f.keeper()];
        self.issue(OP, bytes, keep, move |st| {
            let (dt, es) = (dtype(f.dtype), f.dtype.size());
            // SAFETY: device pointers of live tensors kept by `s` and `f`; sizes checked.
            unsafe {
                if f.numel % w == 0 {
                    nc::all_gather(
                        s.ptr as *const c_void,
                        f.ptr as *mut c_void,
                        s.numel,
                        dt,
                        st.comm(which),
                        st.stream as _,
                    )?;
                } else {
                    grouped(|| {
                        for (q, &n) in chunk_sizes(f.numel, w).iter().enumerate() {
                            let dst = f.ptr + chunk_offset(f.numel, w, q) * es;
                            nc::broadcast(
                                s.ptr as *const c_void,
                                dst as *mut c_void,
                                n,
                                dt,
                                q as i32,
                                st.comm(which),
                                st.stream as _,
                            )?;
                        }
                        Ok(())
                    })?;
                }
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "reduce_scatter";
        let (f, s) = (self.raw(full, OP, "full")?, self.raw(shard, OP, "shard")?);
        buf::check_shard(&f, &s, self.seat(), OP)?;
        let (w, bytes, which) = (self.world, f.bytes(), self.which);
        let keep = vec![s.keeper(), f.keeper()];
        self.issue(OP, bytes, keep, move |st| {
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
                        st.comm(which),
                        st.stream as _,
                    )?;
                } else {
                    grouped(|| {
                        for (q, &n) in chunk_sizes(f.numel, w).iter().enumerate() {
                            let src = f.ptr + chunk_offset(f.numel, w, q) * es;
                            nc::reduce(
                                src as *const c_void,
                                s.ptr as *mut c_void,
                                n,
                                dt,
                                ro,
                                q as i32,
                                st.comm(which),
                                st.stream as _,
                            )?;
                        }
                        Ok(())
                    })?;
                }
            }
            Ok(())
        })
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "all_reduce";
        let b = self.raw(t, OP, "tensor")?;
        let (bytes, which) = (b.bytes(), self.which);
        let keep = vec![b.keeper()];
        self.issue(OP, bytes, keep, move |st| {
            // SAFETY: device pointer of a live tensor kept by `b`; in place is allowed.
            unsafe {
                nc::all_reduce(
                    b.ptr as *const c_void,
                    b.ptr as *mut c_void,
                    b.numel,
                    dtype(b.dtype),
                    redop(op),
                    st.comm(which),
                    st.stream as _,
                )?;
            }
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
        let (bytes, which) = (b.bytes(), self.which);
        let keep = vec![b.keeper()];
        self.issue(OP, bytes, keep, move |st| {
            // SAFETY: device pointer of a live tensor kept by `b`; in place is allowed.
            unsafe {
                nc::broadcast(
                    b.ptr as *const c_void,
                    b.ptr as *mut c_void,
                    b.numel,
                    dtype(b.dtype),
                    root as i32,
                    st.comm(which),
                    st.stream as _,
                )?;
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<Work, Error> {
        const OP: &str = "barrier";
        let (rank, timeout, which) = (self.me, self.timeout, self.which);
        let failure = self.exec.failure_handle();
        self.issue_then(
            OP,
            0,
            vec![],
            // SAFETY: a live state's own buffer and stream.
            move |st| unsafe { st.barrier_launch(which) },
            // The host waits too: every rank leaves the barrier once all arrived.
            move |done| {
                let until = crate::deadline_in(timeout);
                loop {
                    // SAFETY: a live event of this context.
                    match unsafe { cu::event::query(done.0) } {
                        Ok(()) => break,
                        Err(cu::DriverError(cusys::cudaError_enum::CUDA_ERROR_NOT_READY)) => {}
                        Err(e) => return Err(backend_err(rank, OP, format!("{e:?}"))),
                    }
                    if let Some(first) = failure.get() {
                        return Err(Error::Poisoned {
                            rank,
                            op: OP,
                            first: first.clone(),
                        });
                    }
                    if Instant::now() > until {
                        return Err(Error::Timeout {
                            rank,
                            op: OP,
                            bytes: 0,
                            peer: "unknown (NCCL does not say which rank is missing)".into(),
                            timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                // An aborted barrier completes too: only a healthy one counts.
                failure.get().map_or(Ok(()), |first| {
                    Err(Error::Poisoned {
                        rank,
                        op: OP,
                        first: first.clone(),
                    })
                })
            },
        )
    }

    fn check(&self) -> Result<(), Error> {
        self.exec.failure().map_or(Ok(()), |first| {
            Err(Error::Poisoned {
                rank: self.me,
                op: "read of a collective's result",
                first: first.to_string(),
            })
        })
    }

    /// `ncclCommSplit` of this communicator on the communication thread, then a warm-up
    /// all-reduce on the new one (its connections are made now, not in the first step).
    /// Needs NCCL 2.18 or newer. The split blocks the thread until every rank of this
    /// communicator calls it; a wait still returns [`Error::Timeout`] at its deadline.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>, Error> {
        const OP: &str = "ncclCommSplit";
        let me = self.me;
        // Checked first: with NCCL loaded at run time a missing symbol would panic.
        let v = nc::get_nccl_version().map_err(|e| nccl_err(me, "ncclGetVersion", &e))?;
        if v < SPLIT_VERSION {
            return Err(backend_err(
                me,
                OP,
                format!(
                    "NCCL {} has no ncclCommSplit, which sub-communicators need: install NCCL 2.18 or newer (pip's nvidia-nccl wheel for this CUDA, then `make setup`)",
                    version_words(v)
                ),
            ));
        }
        let (c, k) = (
            crate::group::c_int(self.me, "NCCL", "color", color)?,
            crate::group::c_int(self.me, "NCCL", "key", key)?,
        );
        let which = self.which;
        let (tx, rx) = std::sync::mpsc::channel();
        self.exec
            .submit("split", 0, move |st| {
                let made = st.split(which, c, k)?;
                let _ = tx.send(made);
                Ok(())
            })?
            .wait()?;
        let (index, rank, world) = rx.recv().map_err(|_| Error::Poisoned {
            rank: me,
            op: "split",
            first: "the communication thread stopped".into(),
        })?;
        let Some(index) = index else {
            return Ok(crate::solo(Backend::Nccl));
        };
        // SAFETY: plain driver call on a valid device; released in the new NcclComm's Drop.
        let ctx = unsafe { cu::primary_ctx::retain(self.cu_device) }
            .map_err(cuerr(me, "retain primary context"))?;
        Ok(Box::new(NcclComm {
            rank,
            world,
            me,
            which: Some(index),
            device: self.device,
            ctx: Context(ctx),
            cu_device: self.cu_device,
            exec: self.exec.clone(),
            timeout: self.timeout,
            _meeting: self._meeting.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    /// `make setup` links .venv/zrun-lib/libnccl.so to the pip wheel's libnccl.so.2 and
    /// scripts/env.sh puts that folder on LD_LIBRARY_PATH: cudarc then finds NCCL by its name
    /// and loads its symbols (no GPU needed for the version).
    #[test]
    fn the_projects_libnccl_link_is_found_and_loads() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let Ok(dir) = root.join(".venv/zrun-lib").canonicalize() else {
            eprintln!("skipped: no .venv/zrun-lib (run make setup)");
            return;
        };
        let on_path = std::env::var("LD_LIBRARY_PATH").is_ok_and(|p| {
            p.split(':')
                .any(|d| PathBuf::from(d).canonicalize().ok().as_ref() == Some(&dir))
        });
        if !dir.join("libnccl.so").exists() || !on_path {
            eprintln!("skipped: the libnccl.so link or its folder on LD_LIBRARY_PATH is missing (make setup; source scripts/env.sh)");
            return;
        }
        // SAFETY: only tries to load the library by its usual names.
        assert!(
            unsafe { ncsys::is_culib_present() },
            "cudarc does not find libnccl.so"
        );
        let v = nc::get_nccl_version().unwrap_or_else(|e| panic!("{}", nccl_detail(&e)));
        assert!(v >= 21400, "NCCL {v} is older than 2.14");
        assert!(
            v >= SPLIT_VERSION,
            "NCCL {} is older than 2.18: no ncclCommSplit for sub-communicators",
            version_words(v)
        );
    }

    #[test]
    fn nccl_versions_read_as_words() {
        assert_eq!(version_words(21805), "2.18.5");
        assert_eq!(version_words(22703), "2.27.3");
        assert_eq!(version_words(2708), "2.7.8");
    }
}
