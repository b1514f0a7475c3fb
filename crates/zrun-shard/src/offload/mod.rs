//! CPU offload of the optimizer: the fp32 master shard and AdamW m, v live in host memory
//! (pinned where CUDA is present); each unit's reduced gradient shard is copied to the host,
//! the CPU AdamW updates that unit's slice and writes the new parameters back in the compute
//! dtype (straight into the parameters when they are in host memory too).
//!
//! Updates run either inline at the optimizer step, or on a worker thread while backward goes
//! on with earlier units ([`HostOptimizer::submit`]); both run the same [`run`] per unit, so
//! their results are bitwise the same. A delayed update (`zero.offload_delay`, see `delay.rs`)
//! runs on the same worker but writes the master only: the compute parameters are refreshed
//! from it one step later.
//!
//! With CUDA every copy between device and host is asynchronous, from or to pinned memory
//! allocated pinned, of exactly the buffers' size (`buffers.rs`): a gradient's copy to the
//! host runs on a side stream once the kernels that made it are done, overlapping the
//! backward of the units before it, and the event recorded after it is what the CPU AdamW
//! waits for (the worker thread, not the thread driving the model); new parameters go back to
//! the device on the compute stream, without blocking the host, ahead of the next forward.

use crate::layout::ShardLayout;
use crate::{Context, Error, Precision, Result, Stage};
use std::sync::mpsc;
use std::thread::JoinHandle;
use tch::{Device, Kind, Tensor};
use zrun_optim::{AdamWConfig, Bf16, CpuAdamW, HalfKind, StateDtype};

mod buffers;
mod deferred;
mod split;

use buffers::HostBuffers;

/// What the host optimizer is made of, from the engine's configuration.
pub(crate) struct HostSetup {
    pub adamw: AdamWConfig,
    /// Storage of m and v.
    pub state: StateDtype,
    /// Threads of the CPU AdamW.
    pub threads: usize,
    /// Compute precision: the dtype the new parameters are written in.
    pub precision: Precision,
    /// Where the compute parameters live (pinned host buffers when it is CUDA).
    pub device: Device,
    /// Updates are delayed (`zero.offload_delay`): unit 0's gradient gets a second buffer.
    pub delayed: bool,
    /// Delayed updates are split (`zero.offload_delay_fresh`): their jobs also write the
    /// base of the next update and v ([`split::Split`]).
    pub fresh: bool,
    /// dtype of the host gradients: fp32, or bf16 where they are bf16 values
    /// (`host_grads::host_grad_kind`).
    pub grad_kind: Kind,
}

/// The optimizer side of a rank whose optimizer state is offloaded to the host.
pub(crate) struct HostOptimizer {
    /// The AdamW state; lent to the worker thread while updates are in flight.
    adam: Option<CpuAdamW>,
    /// fp32 master shard, units back to back in `shard_offsets` order.
    master: Tensor,
    /// fp32 gradient shard on the host, same layout: staged copies, or the engine's own
    /// gradient shard read in place when that is already fp32 host memory in this layout.
    grads: Tensor,
    /// Whether `grads` is a buffer of its own (not the engine's gradients read in place).
    owns_grads: bool,
    /// 16-bit copy of the new parameters when they must travel to a device.
    staging: Option<Tensor>,
    /// The split's buffers (`zero.offload_delay_fresh`).
    split: Option<split::Split>,
    /// The event after the last gradient copy staged during backward for the step (CUDA),
    /// unit 0's aside when it has a spare.
    staged: Option<zrun_torch_ext::CudaEvent>,
    /// With a delayed update, a second fp32 buffer for the gradient of unit 0, the unit the
    /// next backward finishes last: unit 0's gradients staged during backward alternate
    /// between it and unit 0's slice of `grads`, so the next one is copied at once, while the
    /// running update may still read the last, and the copy overlaps the CPU's work on unit 0
    /// instead of delaying the next update.
    spare: Option<Tensor>,
    /// Whether unit 0's newest staged gradient is in `spare` (else in `grads`).
    in_spare: bool,
    /// The event after unit 0's gradient copy into its spare's pair of buffers (CUDA): the
    /// next delayed update's job of unit 0 waits for it, not the host.
    staged_first: Option<zrun_torch_ext::CudaEvent>,
    /// The compute device (host buffers are pinned when it is CUDA).
    device: Device,
    /// Compute precision: the dtype the new parameters are written in.
    precision: Precision,
    /// Host bytes of master and moments (fixed at construction; the AdamW may be lent out).
    state_bytes: i64,
    /// Host bytes of the gradient and parameter staging buffers this owns.
    buffer_bytes: i64,
    worker: Option<Worker>,
    /// Units whose delayed update finished while backward waited for them
    /// ([`HostOptimizer::stage_unit`]) and whose new parameters have not been taken yet
    /// ([`HostOptimizer::finish_each`]).
    finished: Vec<usize>,
    /// Units of the running delayed update whose new parameters the engine already copied to
    /// the device during backward ([`HostOptimizer::take_finished`]):
    /// [`HostOptimizer::finish_each`] leaves them out.
    refreshed_early: Vec<usize>,
    /// The event after the copies of the last delayed update's new parameters to the device
    /// (CUDA): the next delayed update writes the buffers they read only once it completes.
    refreshed_ready: Option<zrun_torch_ext::CudaEvent>,
    /// The highest unit whose new parameters the last catch-up copied
    /// ([`HostOptimizer::finish_each`]; the others went during backward): see
    /// `delay::waits_for_refresh`.
    refreshed_late: Option<usize>,
}

/// One unit's update: where its elements are and where the new parameters go.
struct Job {
    unit: String,
    off: usize,
    len: usize,
    lr: f64,
    grad_scale: f32,
    /// This rank's slice of the unit in the compute parameters (none: [`Route::Deferred`]).
    dst: Option<Tensor>,
    /// How the new parameters reach `dst`.
    route: Route,
    /// Complete once the unit's gradients have reached the host and the device has read what
    /// the job overwrites (CUDA).
    ready: Vec<zrun_torch_ext::CudaEvent>,
    /// The spare holding the unit's gradient (unit 0, delayed), else its slice of the host
    /// gradients.
    spare: Option<Tensor>,
    /// Where a split delayed update writes its prediction of the next update.
    split: Option<split::SplitOut>,
}

/// How a job's new parameters reach the compute parameters.
enum Route {
    /// `dst` is contiguous host memory of the compute dtype: written by the update itself.
    Direct,
    /// Through the 16-bit host staging slice, then a copy to `dst` (on a device).
    Staged(Tensor),
    /// fp32 parameters on a device: a copy from the master.
    FromMaster,
    /// The master only, and with 16-bit parameters on a device the pinned staging slice too:
    /// the compute parameters are refreshed from them later (delayed update), with no cast
    /// and no pageable copy on the step's path.
    Deferred(Option<Tensor>),
}

/// A copy into the compute parameters that the thread driving the model makes: libtorch
/// state that autograd watches is only touched there.
struct Transfer {
    unit: String,
    dst: Tensor,
    src: Tensor,
}

impl Transfer {
    /// Queues the copy on the current stream, ahead of the next forward: from pinned host
    /// memory it does not block the host.
    fn apply(self) -> Result<()> {
        zrun_torch_ext::copy_async(&self.dst, &self.src).map_err(|e| {
            Error::Unsupported(format!(
                "copy parameters of unit `{}` to the device: {e}",
                self.unit
            ))
        })
    }
}

/// The thread that runs submitted updates in order.
struct Worker {
    jobs: mpsc::Sender<Job>,
    results: mpsc::Receiver<Result<Option<Transfer>>>,
    handle: JoinHandle<CpuAdamW>,
    /// The unit of each submitted job not yet answered, in submission order.
    pending: std::collections::VecDeque<usize>,
}

impl Worker {
    /// Waits for the oldest submitted job's answer.
    fn next(&mut self) -> Result<Option<Transfer>> {
        self.pending.pop_front();
        self.results.recv().unwrap_or_else(|_| {
            Err(Error::Unsupported(
                "the CPU AdamW thread stopped mid-step".into(),
            ))
        })
    }
}

/// Waits, on the calling thread, for the device copies `ready` stands for (gradients to the
/// host, or the last update's parameters to the device).
fn wait_ready(
    ready: impl IntoIterator<Item = zrun_torch_ext::CudaEvent>,
    unit: &str,
) -> Result<()> {
    ready.into_iter().try_for_each(|e| {
        e.synchronize().map_err(|e| {
            Error::Unsupported(format!(
                "copies of unit `{unit}` to or from the device: {e}"
            ))
        })
    })
}

/// Elements `[off, off + len)` of the contiguous CPU tensor whose data starts at `base`.
///
/// # Safety
/// `base` must be the data of a contiguous CPU tensor whose elements are `T`, with
/// `off + len <= numel`, that outlives the slice; nothing else may access that range while
/// the slice lives.
unsafe fn slice_mut<'a, T>(base: *mut std::ffi::c_void, off: usize, len: usize) -> &'a mut [T] {
    // SAFETY: guaranteed by the caller (see above).
    unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(off), len) }
}

/// Elements per piece of a gradient staged at the step ([`HostOptimizer::step`]): with CUDA
/// and gradients narrower than the host's, the device casts each piece into a temporary of
/// 4 bytes an element (256 MiB).
pub(crate) const STAGE_PIECE: i64 = 1 << 26;

/// `(offset, length)` of consecutive pieces of at most `piece` elements covering `n`.
fn pieces(n: i64, piece: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..n)
        .step_by(piece.max(1) as usize)
        .map(move |off| (off, piece.min(n - off)))
}

/// Updates one unit's slice of the shard and writes its new parameters where they live in
/// host memory; returns the copy still to make when they live on a device. Touches no
/// libtorch state, only the memory of the buffers, so it may run on any thread.
///
/// The master and gradient ranges of a job belong to its unit alone: the unit's gradients are
/// final before the job starts (staged, or the engine's own shard read in place), and the
/// caller touches neither range until the job has finished.
fn run(
    adam: &mut CpuAdamW,
    master: &Tensor,
    grads: &Tensor,
    half: Option<HalfKind>,
    job: Job,
) -> Result<Option<Transfer>> {
    let Job {
        unit,
        off,
        len,
        lr,
        grad_scale,
        dst,
        route,
        ready,
        spare,
        split,
    } = job;
    wait_ready(ready, &unit)?;
    // SAFETY: master (fp32) and grads (fp32 or bf16) are contiguous host tensors of the
    // shard size, and
    // [off, off + len) is this job's unit, which nothing else touches while it runs (see
    // above); so is the spare of `len` elements holding its gradient instead; a 16-bit
    // target is the contiguous staging slice or the contiguous host slice `dst` of this unit
    // (`Route::Direct`), likewise untouched by others meanwhile.
    let m = unsafe { slice_mut::<f32>(master.data_ptr(), off, len) };
    let (g, g_off) = match &spare {
        Some(s) => (s, 0),
        None => (grads, off),
    };
    let out = match (half, &route, &dst) {
        (Some(kind), Route::Staged(st), _) => {
            Some((unsafe { slice_mut::<u16>(st.data_ptr(), 0, len) }, kind))
        }
        (Some(kind), Route::Direct, Some(dst)) => {
            Some((unsafe { slice_mut::<u16>(dst.data_ptr(), 0, len) }, kind))
        }
        // (A split update writes the base of the next update there instead, below.)
        (Some(kind), Route::Deferred(Some(st)), _) if split.is_none() => {
            Some((unsafe { slice_mut::<u16>(st.data_ptr(), 0, len) }, kind))
        }
        _ => None,
    };
    // A split delayed update writes the next update's prediction instead of `out`.
    // SAFETY: the prediction's slices are as `SplitOut::prediction` requires.
    let pred = split.as_ref().map(|s| unsafe { s.prediction(len) });
    match (g.kind(), pred) {
        (Kind::BFloat16, pred) => {
            // SAFETY: as for the master above; a bf16 element is 16 bits, as `Bf16`.
            let g = unsafe { slice_mut::<Bf16>(g.data_ptr(), g_off, len) };
            match pred {
                Some((next_lr, o)) => adam.update_predict(off, m, g, lr, grad_scale, next_lr, o)?,
                None => adam.update(off, m, g, lr, grad_scale, out)?,
            }
        }
        (_, pred) => {
            // SAFETY: as for the master above.
            let g = unsafe { slice_mut::<f32>(g.data_ptr(), g_off, len) };
            match pred {
                Some((next_lr, o)) => adam.update_predict(off, m, g, lr, grad_scale, next_lr, o)?,
                None => adam.update(off, m, g, lr, grad_scale, out)?,
            }
        }
    }
    let dst = match (route, dst) {
        (Route::Deferred(_), _) => return Ok(None),
        (route, Some(dst)) => (route, dst),
        (_, None) => {
            return Err(Error::Unsupported(format!(
                "unit `{unit}`: an update that writes parameters was given none"
            )))
        }
    };
    Ok(match (half, dst) {
        (None, (Route::Direct, dst)) => {
            // SAFETY: `dst` is this unit's contiguous fp32 host slice of `len` elements.
            unsafe { slice_mut::<f32>(dst.data_ptr(), 0, len) }.copy_from_slice(m);
            None
        }
        (Some(_), (Route::Direct, _)) => None, // written by the update
        (_, (Route::Staged(src), dst)) => Some(Transfer { unit, dst, src }),
        (_, (Route::FromMaster, dst)) => {
            let src = master
                .f_narrow(0, off as i64, len as i64)
                .ctx("slice master", &unit)?;
            Some(Transfer { unit, dst, src })
        }
        (_, (Route::Deferred(_), _)) => None,
    })
}

impl HostOptimizer {
    /// Host state for `layout`'s rank, the master initialised in place by `master_init` (given
    /// the zeroed fp32 host master), before any other buffer is allocated: no temporary of
    /// the master's size lives beside the host state.
    /// `grads_in_place`: the engine's gradient shard, when it is already contiguous fp32 host
    /// memory laid out as the shard (stages 2-3 on the host); updates read it where it is
    /// instead of from a staged copy.
    pub(crate) fn new(
        layout: &ShardLayout,
        master_init: impl FnOnce(&Tensor) -> Result<()>,
        setup: HostSetup,
        grads_in_place: Option<Tensor>,
    ) -> Result<HostOptimizer> {
        let HostSetup {
            adamw: cfg,
            state,
            threads,
            precision,
            device,
            delayed,
            fresh,
            grad_kind,
        } = setup;
        let n = layout.shard_numel();
        let mut alloc = HostBuffers::default();
        let (master, master_bytes) = alloc.zeros(n, Kind::Float, device)?;
        master_init(&master)?;
        let decay = layout
            .shard_decay_ranges()
            .into_iter()
            .map(|(o, l)| (o as usize, l as usize))
            .collect();
        let (staging, staging_bytes) = match precision {
            Precision::Fp32 => (None, 0),
            _ if device.is_cuda() => {
                let (t, bytes) = alloc.zeros(n, precision.kind(), device)?;
                (Some(t), bytes)
            }
            _ => (None, 0),
        };
        let adam = CpuAdamW::new(n as usize, cfg, decay, state, threads.max(1))?;
        let in_place = grads_in_place.filter(|g| {
            g.device() == Device::Cpu
                && grad_kind == Kind::Float
                && g.kind() == Kind::Float
                && g.is_contiguous()
                && g.numel() as i64 == n
        });
        let owns_grads = in_place.is_none();
        let (grads, grads_bytes) = match in_place {
            Some(g) => (g, 0),
            None => alloc.zeros(n, grad_kind, device)?,
        };
        let (spare, spare_bytes) = match layout.units.first() {
            Some(first) if delayed => {
                let (t, bytes) = alloc.zeros(first.shard_len(), grad_kind, device)?;
                (Some(t), bytes)
            }
            _ => (None, 0),
        };
        let (split, split_bytes) = if fresh {
            let (s, b) = split::Split::new(&mut alloc, n, staging.is_some(), device)?;
            (Some(s), b)
        } else {
            (None, 0)
        };
        alloc.warn_if_rounded();
        Ok(HostOptimizer {
            state_bytes: master_bytes + adam.state_bytes() as i64,
            buffer_bytes: grads_bytes + staging_bytes + spare_bytes + split_bytes,
            adam: Some(adam),
            master,
            grads,
            owns_grads,
            staging,
            split,
            staged: None,
            spare,
            in_spare: false,
            staged_first: None,
            device,
            precision,
            worker: None,
            finished: Vec::new(),
            refreshed_early: Vec::new(),
            refreshed_ready: None,
            refreshed_late: None,
        })
    }

    /// The host fp32 master shard (complete once [`HostOptimizer::finish`] has returned).
    pub(crate) fn master(&self) -> &Tensor {
        &self.master
    }

    /// The CPU AdamW, once no update is in flight (for checkpoints).
    pub(crate) fn adam_idle(&mut self) -> Result<&mut CpuAdamW> {
        self.finish()?;
        self.adam()
    }

    /// Host bytes of master and optimizer state.
    pub(crate) fn state_bytes(&self) -> i64 {
        self.state_bytes
    }

    /// The 16-bit kind the update writes the parameters in (none in fp32).
    fn half(&self) -> Option<HalfKind> {
        match self.precision {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(HalfKind::Bf16),
            Precision::Fp16 => Some(HalfKind::Fp16),
        }
    }

    /// Host bytes of staging buffers.
    pub(crate) fn buffer_bytes(&self) -> i64 {
        self.buffer_bytes
    }

    fn adam(&mut self) -> Result<&mut CpuAdamW> {
        self.adam.as_mut().ok_or_else(|| {
            Error::Unsupported("the CPU AdamW is busy: finish the submitted updates first".into())
        })
    }

    /// Starts an optimizer step (its bias corrections); updates of it may follow.
    pub(crate) fn begin_step(&mut self) -> Result<()> {
        self.adam()?.begin_step();
        Ok(())
    }

    /// Stages the owned gradient `segments` (end to end in shard order; `None`: staged unit
    /// by unit during backward already) on the host and waits until every staged copy is
    /// there, but for unit 0's staged during backward into its spare's pair when `defer_first`:
    /// that copy's event is returned instead, for the job of unit 0 to wait for.
    fn stage_segments(
        &mut self,
        segments: Option<&[Tensor]>,
        defer_first: bool,
    ) -> Result<Option<zrun_torch_ext::CudaEvent>> {
        let mut at = 0;
        let mut ready = self.staged.take();
        let mut first = self.staged_first.take();
        if let Some(segments) = segments {
            // Every unit's gradient goes to its slice of the host gradients, unit 0's too, in
            // pieces: from CUDA a copy into another dtype casts on the device first, into a
            // temporary of the piece (of the whole gradient shard otherwise).
            self.in_spare = false;
            for g in segments {
                for (off, len) in pieces(g.numel() as i64, STAGE_PIECE) {
                    let piece = g.f_narrow(0, off, len).ctx("stage gradients", "-")?;
                    let dst = self
                        .grads
                        .f_narrow(0, at + off, len)
                        .ctx("stage gradients", "-")?;
                    ready = self.stage_to(dst, &piece, "-")?.or(ready);
                }
                at += g.numel() as i64;
            }
        }
        if !defer_first {
            wait_ready(first.take(), "-")?;
        }
        wait_ready(ready, "-")?;
        Ok(first)
    }

    /// Where unit `u`'s gradient is staged: its slice of the host gradients, or for unit 0
    /// the spare when that holds its newest.
    fn grad_slot(&self, layout: &ShardLayout, u: usize) -> Result<Tensor> {
        match &self.spare {
            Some(s) if u == 0 && self.in_spare => Ok(s.shallow_clone()),
            _ => self
                .grads
                .f_narrow(0, layout.shard_offsets[u], layout.units[u].shard_len())
                .ctx("stage gradients", &layout.units[u].unit),
        }
    }

    /// Copies `grad` (any dtype and device) into the host buffer `dst`; nothing to do when
    /// `grad` is that very memory (gradients read in place). From CUDA the copy is queued
    /// without blocking; the returned event completes once it is done.
    fn stage_to(
        &mut self,
        mut dst: Tensor,
        grad: &Tensor,
        unit: &str,
    ) -> Result<Option<zrun_torch_ext::CudaEvent>> {
        if !self.owns_grads
            && grad.device() == Device::Cpu
            && grad.kind() == Kind::Float
            && grad.data_ptr() == dst.data_ptr()
        {
            return Ok(None);
        }
        let Device::Cuda(_) = grad.device() else {
            dst.f_copy_(grad).ctx("copy gradients to the host", unit)?;
            return Ok(None);
        };
        zrun_torch_ext::CudaEvent::copy_to_host(&dst, grad)
            .map(Some)
            .map_err(|e| {
                Error::Unsupported(format!("copy gradients of unit `{unit}` to the host: {e}"))
            })
    }

    /// The job of unit `u`, its parameters going to `dst` (none: the master only).
    fn job(
        &self,
        layout: &ShardLayout,
        u: usize,
        lr: f64,
        grad_scale: f64,
        dst: Option<Tensor>,
    ) -> Result<Job> {
        let l = &layout.units[u];
        let (off, len) = (layout.shard_offsets[u], l.shard_len());
        // Host parameters are written in place, device ones through a copy.
        let direct = dst.as_ref().map(|dst| {
            dst.device() == Device::Cpu
                && dst.is_contiguous()
                && dst.kind() == self.precision.kind()
        });
        let route = match (self.half(), direct, &self.staging) {
            (Some(_), None, Some(st)) => Route::Deferred(Some(
                st.f_narrow(0, off, len).ctx("slice staging", &l.unit)?,
            )),
            (_, None, _) => Route::Deferred(None),
            (_, Some(true), _) => Route::Direct,
            (None, Some(false), _) => Route::FromMaster,
            (Some(_), Some(false), Some(st)) => {
                Route::Staged(st.f_narrow(0, off, len).ctx("slice staging", &l.unit)?)
            }
            (Some(_), Some(false), None) => {
                return Err(Error::Unsupported(format!(
                    "unit `{}`: 16-bit parameters off the host need a staging buffer",
                    l.unit
                )))
            }
        };
        Ok(Job {
            unit: l.unit.clone(),
            off: off as usize,
            len: len as usize,
            lr,
            grad_scale: grad_scale as f32,
            dst,
            route,
            ready: Vec::new(),
            spare: match &self.spare {
                Some(s) if u == 0 && self.in_spare => Some(s.shallow_clone()),
                _ => None,
            },
            split: None,
        })
    }

    /// Copies unit `u`'s final reduced gradient shard `grad` to the host, ahead of the step,
    /// once a delayed update of the unit still running has finished with its host slices.
    pub(crate) fn stage_unit(
        &mut self,
        layout: &ShardLayout,
        u: usize,
        grad: &Tensor,
    ) -> Result<()> {
        let spared = u == 0 && self.spare.is_some();
        if spared {
            // The running update may still read unit 0's gradient: the new one goes to the
            // other buffer of the pair, now (the update before it, which read that one, has
            // finished: it was waited for before the running one was submitted).
            self.in_spare = !self.in_spare;
        } else {
            self.wait_unit(u)?;
        }
        let dst = self.grad_slot(layout, u)?;
        let ready = self.stage_to(dst, grad, &layout.units[u].unit)?;
        // Read at the step: the last unit's event covers every copy queued before it.
        if ready.is_some() {
            if spared {
                self.staged_first = ready;
            } else {
                self.staged = ready;
            }
        }
        Ok(())
    }

    /// One whole AdamW step at the optimizer step: stages the owned gradient `segments`
    /// (laid end to end in shard order; `None`: staged already, unit by unit during
    /// backward) on the host, updates every unit's slice with `lr` and
    /// `grad_scale` (unscaling and clipping), and writes the new compute-dtype parameters into
    /// `params_of(u)`, this rank's slice of unit `u` in the compute parameters.
    pub(crate) fn step(
        &mut self,
        layout: &ShardLayout,
        segments: Option<&[Tensor]>,
        lr: f64,
        grad_scale: f64,
        params_of: impl Fn(usize) -> Result<Tensor>,
    ) -> Result<()> {
        self.stage_segments(segments, false)?;
        self.begin_step()?;
        let half = self.half();
        for u in 0..layout.units.len() {
            let job = self.job(layout, u, lr, grad_scale, Some(params_of(u)?))?;
            let adam = self.adam.as_mut().expect("begin_step checked it is here");
            if let Some(t) = run(adam, &self.master, &self.grads, half, job)? {
                t.apply()?;
            }
        }
        Ok(())
    }

    /// Stages unit `u`'s final reduced gradient shard `grad` and hands its update to the
    /// worker thread, which runs it while the caller goes on (backward of earlier units).
    /// The step must have begun; [`HostOptimizer::finish`] waits for every submitted update.
    pub(crate) fn submit(
        &mut self,
        layout: &ShardLayout,
        u: usize,
        grad: &Tensor,
        lr: f64,
        dst: Tensor,
    ) -> Result<()> {
        let slot = self.grad_slot(layout, u)?;
        let ready = self.stage_to(slot, grad, &layout.units[u].unit)?;
        let mut job = self.job(layout, u, lr, 1.0, Some(dst))?;
        job.ready.extend(ready);
        self.send(u, job)?;
        let w = self.worker.as_mut().expect("sent above");
        // Device copies of the units already updated go out while backward continues.
        while let Ok(r) = w.results.try_recv() {
            w.pending.pop_front();
            if let Some(t) = r? {
                t.apply()?;
            }
        }
        Ok(())
    }

    /// Waits until no submitted update of unit `u` is still running: its host gradients,
    /// master and staging slices are then free (a delayed update of the last step may still
    /// be reading them while this step's backward makes the unit's gradient).
    fn wait_unit(&mut self, u: usize) -> Result<()> {
        let Some(w) = self.worker.as_mut() else {
            return Ok(());
        };
        while w.pending.contains(&u) {
            let done = w.pending.front().copied();
            if let Some(t) = w.next()? {
                t.apply()?;
            }
            self.finished.extend(done);
        }
        Ok(())
    }

    /// Hands `job` (of unit `u`) to the worker thread, starting it (with the AdamW) if it is
    /// not running.
    fn send(&mut self, u: usize, job: Job) -> Result<()> {
        if self.worker.is_none() {
            let adam = self.adam.take().ok_or_else(|| {
                Error::Unsupported("the CPU AdamW is lent to another update".into())
            })?;
            self.worker = Some(self.start_worker(adam)?);
        }
        let w = self.worker.as_mut().expect("started above");
        w.jobs
            .send(job)
            .map_err(|_| Error::Unsupported("the CPU AdamW worker stopped".into()))?;
        w.pending.push_back(u);
        Ok(())
    }

    fn start_worker(&self, mut adam: CpuAdamW) -> Result<Worker> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, results) = mpsc::channel();
        let (master, grads, half) = (
            self.master.shallow_clone(),
            self.grads.shallow_clone(),
            self.half(),
        );
        // No CUDA device is made current here: the thread touches host memory only (`run`
        // reads and writes the host buffers; a job's device `dst` only passes through, in the
        // `Transfer` that the model's thread applies); its one CUDA call waits on a job's
        // event, which needs no current device.
        let handle = std::thread::Builder::new()
            .name("zrun-cpu-adamw".into())
            .spawn(move || {
                for job in inbox {
                    let r = run(&mut adam, &master, &grads, half, job);
                    if outbox.send(r).is_err() {
                        break;
                    }
                }
                adam
            })
            .map_err(|e| Error::Unsupported(format!("start the CPU AdamW thread: {e}")))?;
        Ok(Worker {
            jobs,
            results,
            handle,
            pending: Default::default(),
        })
    }

    /// Waits for every submitted update; returns the first error among them.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let Some(mut w) = self.worker.take() else {
            return Ok(());
        };
        let mut first = Ok(());
        while !w.pending.is_empty() {
            let r = w.next().and_then(|t| t.map_or(Ok(()), Transfer::apply));
            if first.is_ok() {
                first = r;
            }
        }
        drop(w.jobs);
        match w.handle.join() {
            Ok(adam) => self.adam = Some(adam),
            Err(_) => {
                return Err(Error::Unsupported(
                    "the CPU AdamW thread panicked; its state is lost".into(),
                ))
            }
        }
        first
    }
}

impl Drop for HostOptimizer {
    fn drop(&mut self) {
        // The worker holds views of the host buffers: let it finish before they go.
        let _ = self.finish();
    }
}

/// Whether offload applies at `stage` (stages 1-3 shard the optimizer state).
pub(crate) fn supported(stage: Stage) -> bool {
    stage != Stage::Zero0
}

#[cfg(test)]
mod tests;
