//! The nccl backend's communication thread: its state (the communicator and those split off
//! it, the stream, the collectives in flight), how it connects, splits, launches, watches and
//! tears down, and the CUDA events and context that order its stream with libtorch's.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nc, sys as ncsys};

use super::{backend_err, nccl_err};
use crate::buf::{DType, RawBuf};
use crate::{Error, ReduceOp};

pub(super) struct State {
    rank: usize,
    dev: cusys::CUdevice,
    /// The world's communicator.
    comm: ncsys::ncclComm_t,
    /// Communicators split off it (`ncclCommSplit`): one stream and one issue order for all.
    subs: Vec<ncsys::ncclComm_t>,
    pub(super) stream: cusys::CUstream,
    one: cusys::CUdeviceptr,
    timeout: Duration,
    /// Launched collectives not yet seen complete, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Set once `ncclCommAbort` has freed the communicators.
    aborted: bool,
}

/// A CUDA event of the rank's context, destroyed when the last holder lets go (the
/// communication thread watching it, or the work whose wait orders libtorch's stream on it).
pub(super) struct Event(pub(super) cusys::CUevent);

// SAFETY: a CUDA event handle may be used and destroyed from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for Event {}

impl Event {
    pub(super) fn new() -> Result<Event, cu::DriverError> {
        cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map(Event)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `Event::new` and destroyed once; CUDA releases an event that is
        // still pending once it completes.
        let _ = unsafe { cu::event::destroy(self.0) };
    }
}

/// A collective launched on the communication stream.
struct InFlight {
    op: &'static str,
    bytes: usize,
    done: Arc<Event>,
    deadline: Instant,
    /// The tensors it reads and writes: taken (and released) by the work's wait once
    /// libtorch's stream is ordered after the collective, else released when it completes.
    _buffers: Held,
}

/// A collective's tensors, shared by the communication thread and the work.
pub(super) type Held = Arc<std::sync::Mutex<Option<Vec<RawBuf>>>>;

/// How long dropping the communicator waits for launched collectives to complete before
/// aborting it instead of destroying it.
const DRAIN: Duration = Duration::from_secs(5);

/// The rank's CUDA context (the primary one, libtorch's), made current on a thread that
/// issues or waits on collectives, so that events and the legacy stream are that GPU's.
#[derive(Clone, Copy)]
pub(super) struct Context(pub(super) cusys::CUcontext);

// SAFETY: a context handle may be made current on any thread.
unsafe impl Send for Context {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn make_current(self, rank: usize, op: &'static str) -> Result<(), Error> {
        // SAFETY: a primary context retained by `NcclComm` for its whole life.
        unsafe { cu::ctx::set_current(self.0) }.map_err(|e| backend_err(rank, op, format!("{e:?}")))
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // Launched work that does not complete soon waits for a peer that is gone: destroying
        // the communicator would wait for it too, so abort it (which ends its kernels).
        let until = crate::deadline_in(DRAIN.min(self.timeout));
        while !self.aborted && !self.in_flight.is_empty() && Instant::now() < until {
            if self.watch().is_err() {
                break;
            }
            if !self.in_flight.is_empty() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if !self.in_flight.is_empty() {
            self.abort();
        }
        // SAFETY: every handle was created in `connect` or `split` and is destroyed exactly
        // once here (aborted communicators are already freed); split ones before their parent.
        unsafe {
            if !self.aborted {
                for &c in self.subs.iter().rev() {
                    let _ = nc::comm_destroy(c);
                }
                let _ = nc::comm_destroy(self.comm);
            }
            let _ = cu::free_sync(self.one);
            self.in_flight.clear();
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

pub(super) fn cuerr(rank: usize, op: &'static str) -> impl Fn(cu::DriverError) -> Error {
    move |e| backend_err(rank, op, format!("{e:?}"))
}

/// Runs on the communication thread: makes `gpu`'s primary context current there (so every
/// CUDA and NCCL call of this thread is on the rank's GPU), then creates the communicator.
pub(super) fn connect(
    rank: usize,
    world: usize,
    gpu: usize,
    id: ncsys::ncclUniqueId,
    timeout: Duration,
) -> Result<State, Error> {
    let cuerr = |op: &'static str| cuerr(rank, op);
    cu::init().map_err(cuerr("cuInit"))?;
    let dev = cu::device::get(gpu as i32).map_err(cuerr("get this rank's CUDA device"))?;
    // SAFETY: plain driver calls on a valid device; the primary context is the one libtorch uses.
    let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(cuerr("retain primary context"))?;
    // SAFETY: `ctx` is a live context retained above.
    unsafe { cu::ctx::set_current(ctx) }.map_err(cuerr("set context"))?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(cuerr("create stream"))?;
    // SAFETY: a 4-byte device allocation for barriers, freed in Drop.
    let one = unsafe { cu::malloc_sync(4) }.map_err(cuerr("allocate"))?;
    let mut comm = std::mem::MaybeUninit::<ncsys::ncclComm_t>::uninit();
    // SAFETY: `comm` is written by NCCL on success; the id came from rank 0. A blocking
    // init: `init` gives up on it after the deadline (see there).
    unsafe { nc::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32) }
        .map_err(|e| nccl_err(rank, "ncclCommInitRank", &e))?;
    let state = State {
        rank,
        dev,
        // SAFETY: initialised by the successful call above.
        comm: unsafe { comm.assume_init() },
        subs: Vec::new(),
        stream,
        one,
        timeout,
        in_flight: VecDeque::new(),
        aborted: false,
    };
    // A first collective, completed here: whatever NCCL still connects or allocates on first
    // use fails now, under init's deadline, rather than inside the first step.
    if world > 1 {
        // SAFETY: the state's own 4-byte device buffer on its own stream.
        unsafe { state.barrier_launch(None) }
            .map_err(|e| nccl_err(rank, "warm-up all_reduce", &e))?;
        // SAFETY: the state's own live stream.
        unsafe { cu::stream::synchronize(stream) }.map_err(cuerr("warm-up all_reduce"))?;
    }
    Ok(state)
}

impl State {
    /// The world's communicator (`None`) or split-off communicator `which`.
    pub(super) fn comm(&self, which: Option<usize>) -> ncsys::ncclComm_t {
        which.map_or(self.comm, |i| self.subs[i])
    }

    /// Splits communicator `parent` (`ncclCommSplit`, a collective over it; NCCL 2.18 on,
    /// checked by the caller) and connects the new one at once with a warm-up all-reduce, as
    /// `connect` does. Returns its index (`None` for a group of one, which needs no NCCL
    /// communicator), this rank's place in it and its size.
    pub(super) fn split(
        &mut self,
        parent: Option<usize>,
        color: i32,
        key: i32,
    ) -> Result<(Option<usize>, usize, usize), Error> {
        const OP: &str = "ncclCommSplit";
        let rank = self.rank;
        let mut new: ncsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live communicator (a job runs only before an abort); NCCL writes `new` on
        // success. A null config inherits the parent's (blocking, like `connect`'s).
        unsafe {
            ncsys::ncclCommSplit(
                self.comm(parent),
                color,
                key,
                &mut new,
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| nccl_err(rank, OP, &e))?;
        if new.is_null() {
            return Err(backend_err(
                rank,
                OP,
                format!("color {color} gave no communicator"),
            ));
        }
        // SAFETY: `new` is the live communicator made above.
        let (size, mine) = unsafe { (nc::comm_count(new), nc::comm_user_rank(new)) };
        let checked = size.and_then(|n| mine.map(|r| (n, r)));
        let (size, mine) = match checked {
            Ok((n, r)) => (
                usize::try_from(n).unwrap_or(0),
                usize::try_from(r).unwrap_or(0),
            ),
            Err(e) => {
                // SAFETY: destroyed once, never used again.
                let _ = unsafe { nc::comm_destroy(new) };
                return Err(nccl_err(rank, "ncclCommCount", &e));
            }
        };
        if size <= 1 {
            // SAFETY: a 1-rank communicator with no work launched, destroyed once.
            let _ = unsafe { nc::comm_destroy(new) };
            return Ok((None, 0, 1));
        }
        self.subs.push(new);
        let i = self.subs.len() - 1;
        // SAFETY: the state's own 4-byte device buffer on its own stream, the new communicator.
        unsafe { self.barrier_launch(Some(i)) }
            .map_err(|e| nccl_err(rank, "split warm-up all_reduce", &e))?;
        self.drain("split warm-up all_reduce")?;
        Ok((Some(i), mine, size))
    }

    /// Waits until everything launched on the stream has completed, for at most the timeout
    /// (polling, so that a peer that never comes fails this job instead of blocking the
    /// thread forever).
    fn drain(&self, op: &'static str) -> Result<(), Error> {
        let err = cuerr(self.rank, op);
        let done = Event::new().map_err(&err)?;
        // SAFETY: a live event and stream of this thread's context.
        unsafe { cu::event::record(done.0, self.stream) }.map_err(&err)?;
        let until = crate::deadline_in(self.timeout);
        loop {
            // SAFETY: a live event of this context.
            match unsafe { cu::event::query(done.0) } {
                Ok(()) => return Ok(()),
                Err(cu::DriverError(cusys::cudaError_enum::CUDA_ERROR_NOT_READY)) => {}
                Err(e) => return Err(err(e)),
            }
            if Instant::now() > until {
                return Err(Error::Timeout {
                    rank: self.rank,
                    op,
                    bytes: 0,
                    peer: "unknown (NCCL does not say which rank is missing)".into(),
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Launches a collective on the communication stream after `start` (recorded on
    /// libtorch's stream when it was issued) and records `done` after it; returns once it is
    /// queued. `buffers` stay alive until it completes or the work's wait takes them.
    pub(super) fn run(
        &mut self,
        op: &'static str,
        bytes: usize,
        issued: Issued,
        buffers: Held,
        launch: impl FnOnce(&State) -> Result<(), nc::NcclError>,
    ) -> Result<(), Error> {
        let cuerr = |e: cu::DriverError| backend_err(self.rank, op, format!("{e:?}"));
        // SAFETY: live events and stream of this context.
        unsafe {
            cu::stream::wait_event(
                self.stream,
                issued.start.0,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(cuerr)?;
        }
        launch(self).map_err(|e| nccl_err(self.rank, op, &e))?;
        // SAFETY: as above.
        unsafe { cu::event::record(issued.done.0, self.stream) }.map_err(cuerr)?;
        self.in_flight.push_back(InFlight {
            op,
            bytes,
            done: issued.done,
            deadline: crate::deadline_in(self.timeout),
            _buffers: buffers,
        });
        Ok(())
    }

    /// The watch between jobs: forgets the collectives that completed, and fails when the
    /// oldest one still running is past its deadline or NCCL reports an asynchronous error.
    pub(super) fn watch(&mut self) -> Result<(), Error> {
        while let Some(f) = self.in_flight.front() {
            // SAFETY: a live event of this context.
            match unsafe { cu::event::query(f.done.0) } {
                Ok(()) => {
                    self.in_flight.pop_front();
                }
                Err(cu::DriverError(cusys::cudaError_enum::CUDA_ERROR_NOT_READY)) => {
                    if Instant::now() > f.deadline {
                        return Err(Error::Timeout {
                            rank: self.rank,
                            op: f.op,
                            bytes: f.bytes,
                            peer: "unknown (NCCL does not say which rank is missing)".into(),
                            timeout: self.timeout,
                        });
                    }
                    break;
                }
                Err(e) => return Err(backend_err(self.rank, f.op, format!("{e:?}"))),
            }
        }
        if self.in_flight.is_empty() || self.aborted {
            return Ok(());
        }
        for &comm in std::iter::once(&self.comm).chain(&self.subs) {
            let mut state = ncsys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator; NCCL writes the result code.
            unsafe { ncsys::ncclCommGetAsyncError(comm, &mut state) };
            match state {
                ncsys::ncclResult_t::ncclSuccess | ncsys::ncclResult_t::ncclInProgress => {}
                e => {
                    return Err(nccl_err(
                        self.rank,
                        self.in_flight.front().map_or("collective", |f| f.op),
                        &nc::NcclError(e),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Launches the one-element all-reduce of `one` on communicator `which` ([`State::comm`])
    /// that barriers and the warm-ups use.
    ///
    /// # Safety
    /// The communicator and stream are live (they are for a `State` not yet aborted).
    pub(super) unsafe fn barrier_launch(&self, which: Option<usize>) -> Result<(), nc::NcclError> {
        // SAFETY: the state's own 4-byte device buffer, in place.
        unsafe {
            nc::all_reduce(
                self.one as *const c_void,
                self.one as *mut c_void,
                1,
                ncsys::ncclDataType_t::ncclFloat32,
                ncsys::ncclRedOp_t::ncclSum,
                self.comm(which),
                self.stream as _,
            )?;
        }
        Ok(())
    }

    /// Aborts every communicator of the thread (one failure ends them all: they share the
    /// stream and the issue order).
    pub(super) fn abort(&mut self) {
        if !self.aborted {
            // SAFETY: aborting each live communicator once, split ones before their parent;
            // Drop then skips destroying them.
            unsafe {
                for &c in self.subs.iter().rev() {
                    let _ = nc::comm_abort(c);
                }
                let _ = nc::comm_abort(self.comm);
            }
            self.aborted = true;
        }
    }
}

/// Runs `launches` inside one NCCL group; the group is ended whether they succeed or not (a
/// group left open would swallow every later collective of this thread). The first error
/// wins.
pub(super) fn grouped(
    launches: impl FnOnce() -> Result<(), nc::NcclError>,
) -> Result<(), nc::NcclError> {
    nc::group_start()?;
    let r = launches();
    let end = nc::group_end();
    r.and(end.map(drop))
}

pub(super) fn dtype(d: DType) -> ncsys::ncclDataType_t {
    match d {
        DType::F32 => ncsys::ncclDataType_t::ncclFloat32,
        DType::BF16 => ncsys::ncclDataType_t::ncclBfloat16,
        DType::F16 => ncsys::ncclDataType_t::ncclFloat16,
    }
}

pub(super) fn redop(op: ReduceOp) -> ncsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncsys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncsys::ncclRedOp_t::ncclAvg,
    }
}

/// The events of one issued collective: `start`, recorded on libtorch's stream when it was
/// issued, and `done`, recorded after it on the communication stream.
pub(super) struct Issued {
    pub(super) start: Event,
    pub(super) done: Arc<Event>,
}
