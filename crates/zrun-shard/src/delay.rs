//! ZeRO-Offload's delayed parameter update (DPU; Ren et al. 2021, arXiv 2101.06840, section
//! 5): `zero.offload_delay = 1` takes the CPU AdamW off the step's critical path.
//!
//! The first `zero.offload_delay_warmup` updates run as without the delay. After them, at the
//! end of step t the engine computes the global gradient norm as always (so clipping and the
//! fp16 overflow check see the whole gradient of step t), finishes the update of step t-1 and
//! copies the master into the compute parameters, copies step t's gradients to the host,
//! hands the update of step t to the CPU AdamW's thread and returns without waiting for it.
//! Step t+1's forward and backward then run while the CPU updates the master.
//!
//! Staleness, exactly: with P_k the master after k updates, the forward and backward of
//! step t run on P_{t-2} (one update stale) while the update of step t is applied to P_{t-1}:
//! P_t = AdamW(P_{t-1}, grad at P_{t-2}). During warm-up, and for the first delayed step,
//! the forward of step t runs on P_{t-1} as without the delay. A step whose gradients are not
//! finite (fp16 overflow) submits nothing; the pending update is still applied at its end.
//!
//! What sees which state: evaluation runs on the compute parameters (the model the next
//! step's forward uses, one update behind); [`Engine::full_parameters`] and checkpoints read
//! the master with the pending update finished (the newest model). A checkpoint taken while
//! the compute parameters are behind also holds them (`<unit>.delayed`, fp32), so a resumed
//! run's next forward uses the same stale parameters and continues bitwise; see
//! [`Engine::visit_delayed_params`] and [`Engine::load_delayed_params`].
//!
//! The delayed update needs its own host copy of the gradient shard (the CPU reads it while
//! the next step accumulates new gradients), so the engine never lends it its gradients in
//! place. At stages 2-3 the next step's backward still copies each unit's final gradient to
//! the host as the unit completes, once the running update has finished with that unit: the
//! update runs its units last first, the order backward makes them, so that wait is
//! normally nil. Unit 0, which backward finishes last and the update reaches last, has a
//! pair of host buffers its gradients alternate between: its copy goes out at once, and the
//! next update's job of unit 0 waits for it rather than the step's end (a copy that followed
//! the running update's end would leave the CPU idle meanwhile). With 16-bit parameters on
//! a device the update also writes their new values into the pinned staging buffer, so the
//! refresh is one DMA copy per unit (no cast on the host, no pageable copy), queued without
//! blocking the host as soon as the CPU has finished
//! that unit: by the next backward for the units it waited for (behind that unit's backward,
//! which is the last reader of its parameters in the step), by [`Engine::catch_up`] for the
//! rest. The copies overlap the CPU's work on the other units, and only the last unit's is
//! left when the update ends. The copies go on an upload stream (see [`upload`]), and the
//! next update's jobs write the buffers they read, so its first job waits for an event after
//! them all (with the copies on the compute stream, a read of the loss saw those of backward
//! done, and only the first job of a unit the catch-up copied waits).

use crate::engine::Optimizer;
use crate::offload::HostOptimizer;
use crate::state::Mover;
use crate::{Context, Engine, Error, Result, Stage};
use tch::{Device, Kind, Tensor};

/// The engine's state of the delayed update.
#[derive(Default)]
pub(crate) struct Delay {
    /// `Some(w)`: updates after the first `w` are delayed; `None`: the delay is off.
    pub warmup: Option<u64>,
    /// Updates applied or submitted so far (counted by `Engine::step`; a load restores it).
    pub updates: u64,
    /// The compute parameters are one update behind the master (which may still be running).
    pub behind: bool,
    /// The pending update was submitted by this process (not read from a checkpoint): its
    /// result is in [`HostOptimizer::refreshed`], staging included.
    pub submitted: bool,
    /// Stale parameters read from a checkpoint (fp32, this rank's shard), until the load
    /// completes.
    pub loaded: Option<Tensor>,
    /// The learning rate of the next update, for a split update's base (`fresh.rs`).
    pub next_lr: Option<f64>,
    /// A split update's v on the device (bf16, shard layout; allocated with the engine).
    pub v: Option<Tensor>,
}

/// Queues the copy of host `src` (pinned) into device `dst` without blocking the host: on
/// CUDA on the upload stream, where it overlaps the kernels queued after it (a delayed step's
/// backward) instead of holding them up; [`HostOptimizer::refreshed_queued`] makes the
/// compute stream wait for it before the step's end reads `dst`. `ZRUN_UPLOAD_STREAM=0`
/// queues it on the compute stream instead (to compare the two: benches/gpu check k).
pub(crate) fn upload(dst: &Tensor, src: &Tensor) -> std::result::Result<(), zrun_torch_ext::Error> {
    if on_upload_stream() {
        zrun_torch_ext::copy_to_device_on_side_stream(dst, src)
    } else {
        zrun_torch_ext::copy_async(dst, src)
    }
}

/// Whether [`upload`] queues its copies on the upload stream (the default) rather than the
/// compute stream: a read of the loss then does not wait for them.
pub(crate) fn on_upload_stream() -> bool {
    static SIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SIDE.get_or_init(|| std::env::var("ZRUN_UPLOAD_STREAM").as_deref() != Ok("0"))
}

/// Whether the next delayed update's job of unit `u`, the first it sends of those not sent
/// yet (they go last unit first and run in order), waits for the event after the last
/// update's copies to the device before it overwrites what they read. The units the last
/// catch-up copied (up to `late`) need it. Those copied during backward were complete when
/// the loss was read, where they were queued on the compute stream; on the upload stream
/// nothing waited for them but that event, so then the first job waits, whichever unit.
pub(crate) fn waits_for_refresh(u: usize, late: Option<usize>, upload_stream: bool) -> bool {
    upload_stream || late.is_none_or(|l| u <= l)
}

/// Queues the copy of unit `u`'s slice of `src` (the shard-layout buffer a finished delayed
/// update left, [`HostOptimizer::refreshed`]) into this rank's slice of the compute
/// parameters `params` ([`upload`]). Written through an alias with its own version counter,
/// so that it may run during backward, while autograd still holds views of the earlier units
/// (which share the parameters' counter); nothing queued after it in the step reads or
/// writes that slice.
pub(crate) fn refresh_unit(
    mover: &Mover,
    params: &Tensor,
    stage: Stage,
    src: &Tensor,
    u: usize,
) -> Result<()> {
    let dst = mover.owned_params(params, u, stage)?.data();
    let from = mover.shard_of(src, u)?;
    upload(&dst, &from).map_err(|e| {
        Error::Unsupported(format!(
            "copy parameters of unit `{}` to the device: {e}",
            mover.layout.units[u].unit
        ))
    })
}

impl Engine {
    /// Whether this step's update is delayed: the delay is on and past its warm-up.
    pub(crate) fn delay_active(&self) -> bool {
        matches!(self.optimizer, Optimizer::Host(_))
            && self.delay.warmup.is_some_and(|w| self.delay.updates >= w)
    }

    /// Whether the compute parameters are one update behind the master (a delayed update is
    /// pending): a checkpoint then saves them too.
    pub fn params_behind(&self) -> bool {
        self.delay.behind
    }

    /// The host optimizer (the delay exists only with offload).
    fn host(&mut self) -> Result<&mut HostOptimizer> {
        match &mut self.optimizer {
            Optimizer::Host(h) => Ok(h),
            Optimizer::Device(_) => Err(Error::Unsupported(
                "zero.offload_delay needs zero.offload_optimizer = \"cpu\"".into(),
            )),
        }
    }

    /// Finishes the pending update and copies the master into the compute parameters. An
    /// update this process submitted is taken unit by unit as the CPU finishes each: the
    /// copy of a unit's new parameters is queued at once (from pinned memory it does not
    /// block the host), while the CPU still updates the units after it.
    pub(crate) fn catch_up(&mut self) -> Result<()> {
        if !self.delay.behind {
            return Ok(());
        }
        if !self.delay.submitted {
            let h = self.host()?;
            h.finish()?;
            let src = h.master().shallow_clone();
            self.params_from_shard(&src)?;
        } else {
            let _guard = tch::no_grad_guard();
            let stage = self.cfg.stage;
            let src = self.host()?.refreshed().shallow_clone();
            let units = self.units_len();
            // The host optimizer, the layout and the parameters borrowed apart: each unit's
            // copy is made as it comes, with nothing gathered per step.
            let (mover, params) = (&self.mover, &self.params);
            let Optimizer::Host(h) = &mut self.optimizer else {
                return Err(Error::Unsupported(
                    "zero.offload_delay needs zero.offload_optimizer = \"cpu\"".into(),
                ));
            };
            let v = h.split_v().map(Tensor::shallow_clone);
            let dev_v = self.delay.v.as_ref();
            h.finish_each(units, |u| {
                refresh_unit(mover, params, stage, &src, u)?;
                // A split update's v too (`fresh.rs`), before a step that is not delayed.
                match (&v, dev_v) {
                    (Some(v), Some(d)) => crate::fresh::copy_v(mover, d, v, u),
                    _ => Ok(()),
                }
            })?;
            h.refreshed_queued()?;
            if matches!(stage, Stage::Zero1 | Stage::Zero2) {
                self.mover.all_gather_units(&self.params)?;
            }
        }
        self.delay.behind = false;
        self.delay.submitted = false;
        Ok(())
    }

    /// The end of a delayed step: applies the pending update to the compute parameters, then
    /// (when `applied`) submits this step's update of the owned gradient `segments` (`None`:
    /// staged during backward) with `lr` and `grad_scale` (unscaling and clipping) without
    /// waiting for it.
    pub(crate) fn delayed_step(
        &mut self,
        segments: Option<&[Tensor]>,
        lr: f64,
        grad_scale: f64,
        applied: bool,
    ) -> Result<()> {
        if self.cfg.fresh() {
            return self.fresh_step(segments, lr, grad_scale, applied);
        }
        self.catch_up()?;
        if !applied {
            return Ok(());
        }
        self.submit_delayed(segments, lr, grad_scale, lr)
    }

    /// Hands this step's update to the CPU AdamW's thread without waiting (`next_lr`: the
    /// rate a split update prepares the next base at, `fresh.rs`); the compute parameters are
    /// then one update behind.
    pub(crate) fn submit_delayed(
        &mut self,
        segments: Option<&[Tensor]>,
        lr: f64,
        grad_scale: f64,
        next_lr: f64,
    ) -> Result<()> {
        // Borrowing the two fields apart: no copy of the layout every step.
        let Optimizer::Host(h) = &mut self.optimizer else {
            return Err(Error::Unsupported(
                "zero.offload_delay needs zero.offload_optimizer = \"cpu\"".into(),
            ));
        };
        h.submit_deferred(&self.mover.layout, segments, lr, grad_scale, next_lr)?;
        self.delay.behind = true;
        self.delay.submitted = true;
        Ok(())
    }

    /// Copies the host master into this rank's slice of the compute parameters (cast to the
    /// compute dtype) and gathers them where every rank holds them all (stages 1-2).
    pub(crate) fn params_from_host_master(&mut self) -> Result<()> {
        let master = match &self.optimizer {
            Optimizer::Host(h) => h.master().shallow_clone(),
            Optimizer::Device(_) => return Ok(()),
        };
        self.params_from_shard(&master)
    }

    /// Copies the shard-layout buffer `src` into this rank's slice of the compute parameters
    /// and gathers them at stages 1-2. Every rank calls it.
    fn params_from_shard(&mut self, src: &Tensor) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let stage = self.cfg.stage;
        for u in 0..self.units_len() {
            let mut dst = self.mover.owned_params(&self.params, u, stage)?;
            let from = self.mover.shard_of(src, u)?;
            dst.f_copy_(&from).ctx(
                "copy master to parameters",
                &self.mover.layout.units[u].unit,
            )?;
        }
        if matches!(stage, Stage::Zero1 | Stage::Zero2) {
            self.mover.all_gather_units(&self.params)?;
        }
        Ok(())
    }

    /// Hands `put` the little-endian fp32 bytes of this rank's [`Engine::saved_range`] of
    /// unit `u`'s compute parameters: what the next forward runs on while they are behind
    /// the master ([`Engine::params_behind`]).
    pub fn visit_delayed_params<E: From<Error>>(
        &mut self,
        u: usize,
        put: impl FnOnce(&[u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let _guard = tch::no_grad_guard();
        let (_, len) = self.saved_range(u);
        let unit = self.mover.layout.units[u].unit.clone();
        let own = self
            .mover
            .owned_params(&self.params, u, self.cfg.stage)?
            .f_narrow(0, 0, len)
            .and_then(|t| t.f_to_device(Device::Cpu))
            .and_then(|t| t.f_to_kind(Kind::Float))
            .and_then(|t| t.f_contiguous())
            .ctx("copy delayed parameters for a checkpoint", &unit)?;
        crate::snapshot::with_bytes(&own, 0, len, &unit, put)
    }

    /// Lets `fill` write this rank's [`Engine::loaded_range`] of unit `u`'s stale compute
    /// parameters (fp32, read from a checkpoint whose parameters were behind its master);
    /// [`Engine::finish_load`] then puts them in place of the master's, so the next step's
    /// forward runs on them and its end applies the master. Ignored (nothing is read) when
    /// the delay is off: the loaded master, the pending update applied, is then used.
    pub fn load_delayed_params<E: From<Error>>(
        &mut self,
        u: usize,
        fill: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if self.delay.warmup.is_none() {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        if self.delay.loaded.is_none() {
            let n = self.mover.layout.shard_numel();
            let t = Tensor::f_zeros([n], (Kind::Float, Device::Cpu))
                .ctx("allocate delayed parameters", "-")?;
            self.delay.loaded = Some(t);
        }
        let (start, len) = self.loaded_range(u);
        let l = &self.mover.layout;
        let at = l.shard_offsets[u] + start - l.units[u].shard_range(l.rank).0;
        let unit = l.units[u].unit.clone();
        let buf = self.delay.loaded.as_ref().map(Tensor::shallow_clone);
        match buf {
            Some(b) => crate::snapshot::fill_tensor(&b, at, len, &unit, fill),
            None => Ok(()),
        }
    }

    /// The end of a load: the compute parameters from stale ones read by
    /// [`Engine::load_delayed_params`] (then behind the loaded master), else from the master.
    pub(crate) fn finish_delayed_load(&mut self) -> Result<()> {
        self.delay.behind = false;
        self.delay.submitted = false;
        match self.delay.loaded.take() {
            Some(stale) => {
                self.params_from_shard(&stale)?;
                self.delay.behind = true;
            }
            None => self.params_from_host_master()?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::waits_for_refresh;

    /// The copies of units refreshed during backward: on the compute stream a read of the
    /// loss saw them done, so the next update starts on those units at once; on the upload
    /// stream nothing did, so its first job waits whichever unit it is.
    #[test]
    fn the_next_update_waits_for_uploads_nothing_else_waited_for() {
        // Units 3 and 2 went during backward, 1 and 0 at the catch-up.
        let late = Some(1);
        assert!(!waits_for_refresh(3, late, false));
        assert!(waits_for_refresh(1, late, false));
        assert!(waits_for_refresh(3, late, true));
        // Every unit at the catch-up (or all at once after a prediction).
        assert!(waits_for_refresh(3, None, false));
    }
}
