//! The delayed update, split (`zero.offload_delay_fresh`): the newest gradient's share of
//! each update is applied on the device at once, the rest by the CPU one step ahead.
//!
//! ZeRO-Offload's delay (`delay.rs`) runs step t+1's forward and backward on the model
//! without update t. Through AdamW's first moment that staleness costs stability: on a
//! quadratic with beta1 = 0.9 the largest stable `lr * curvature` drops from 38 to about 1.
//! But only one part of update t depends on step t's gradient g_t:
//!
//! `p_t = p_{t-1} (1 - lr wd) - lr / (1 - b1^t) (b1 m_{t-1} + (1 - b1) g_t) / D_t`.
//!
//! The CPU job of update t-1, which runs beside step t's forward and backward, also writes
//! the base `B_t = p_{t-1} (1 - lr_t wd) - lr_t b1 / (1 - b1^t) m_{t-1} / D_{t-1}` (in the
//! compute dtype, [`zrun_optim::CpuAdamW::predict`]) and v_{t-1} (bf16). At step t's end the
//! device sets its parameters to `B_t - lr_t (1 - b1) / (1 - b1^t) g_t / D_t`, with
//! `D_t = sqrt((b2 v_{t-1} + (1 - b2) g_t^2) / (1 - b2^t)) + eps` from the clipped, unscaled
//! g_t, and hands update t to the CPU as the plain delay does. So step t+1's forward runs on
//! update t but for D_{t-1} in place of D_t in the first moment's share and rounding: the
//! staleness is gone from the stability. The master stays exact AdamW, applied to gradients
//! taken at those parameters; each step's base overwrites the device's approximation, so its
//! error does not accumulate.
//!
//! Costs: the device keeps its gradient shard until the step's end (no gradients on the host
//! only) and v as bf16 (2 bytes an element); the host writes the base and v (2-4 more bytes an
//! element a step); the device's share is one pass at the step's end over the parameters,
//! gradients and v (zrun's kernel, `zrun_torch_ext::fresh_share`; five ATen passes where it
//! is not installed).
//!
//! Exactness: the base is a function of the stored state and the learning rate of the update
//! it prepares, so a resumed run (whose compute parameters come from the checkpoint) rebuilds
//! the same base at its first step from the loaded state and that step's learning rate; the
//! job wrote it with [`Engine::set_next_lr`]'s, the same number when the caller passes it.

use crate::delay::refresh_unit;
use crate::engine::Optimizer;
use crate::state::Mover;
use crate::{Context, Engine, Error, Result, Stage};
use tch::Tensor;

/// Elements per piece of the device's share in ATen's ops (one fp32 temporary of a piece).
const PIECE: i64 = 1 << 24;

/// Queues the copy of unit `u`'s slice of v (bf16, host, shard layout) to the device's.
pub(crate) fn copy_v(mover: &Mover, dev: &Tensor, host: &Tensor, u: usize) -> Result<()> {
    let dst = mover.shard_of(dev, u)?;
    let src = mover.shard_of(host, u)?;
    crate::delay::upload(&dst, &src).map_err(|e| {
        Error::Unsupported(format!(
            "copy v of unit `{}` to the device: {e}",
            mover.layout.units[u].unit
        ))
    })
}

fn no_host() -> Error {
    Error::Unsupported("zero.offload_delay needs zero.offload_optimizer = \"cpu\"".into())
}

fn kernel(e: zrun_torch_ext::Error) -> Error {
    Error::Kernel("the fresh share of a delayed update", e)
}

impl Engine {
    /// The learning rate of the update after this step's, for the base a split delayed
    /// update prepares (`fresh.rs`); without it, this step's is used. Taken by the next
    /// [`Engine::step`].
    pub fn set_next_lr(&mut self, lr: f64) {
        self.delay.next_lr = Some(lr);
    }

    /// The end of a split delayed step: the compute parameters become the base of this
    /// step's update, minus (when `applied`) the share of the gradients on the device, with
    /// `grad_scale` (unscaling and clipping); then the update goes to the CPU as with the
    /// plain delay (`segments`: the owned gradients, `None` when staged during backward).
    pub(crate) fn fresh_step(
        &mut self,
        segments: Option<&[Tensor]>,
        lr: f64,
        grad_scale: f64,
        applied: bool,
    ) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let next_lr = self.delay.next_lr.take().unwrap_or(lr);
        self.fresh_base(lr)?;
        if applied {
            self.fresh_share(lr, grad_scale)?;
        }
        if matches!(self.cfg.stage, Stage::Zero1 | Stage::Zero2) {
            self.mover.all_gather_units(&self.params)?;
        }
        if !applied {
            return Ok(());
        }
        self.submit_delayed(segments, lr, grad_scale, next_lr)
    }

    /// This rank's compute parameters from the base of the update at `lr` and the device's v
    /// from v before it: what the running update wrote, unit by unit as it finishes, or
    /// (nothing running: the delay switching on, a resumed run, after a skipped step) the
    /// same written now from the state.
    fn fresh_base(&mut self, lr: f64) -> Result<()> {
        let stage = self.cfg.stage;
        let dev_v = self.delay.v.as_ref().map(Tensor::shallow_clone);
        let running = self.delay.behind && self.delay.submitted;
        let units = self.units_len();
        let (mover, params) = (&self.mover, &self.params);
        let Optimizer::Host(h) = &mut self.optimizer else {
            return Err(no_host());
        };
        if !running {
            h.predict_now(&mover.layout, lr)?;
        }
        let src = h.refreshed().shallow_clone();
        let (Some(host_v), Some(dev_v)) = (h.split_v().map(Tensor::shallow_clone), dev_v) else {
            return Err(Error::Unsupported(
                "a split delayed update without its v buffers".into(),
            ));
        };
        let each = |u: usize| {
            refresh_unit(mover, params, stage, &src, u)?;
            copy_v(mover, &dev_v, &host_v, u)
        };
        if running {
            h.finish_each(units, each)?;
        } else {
            (0..units).try_for_each(each)?;
            h.refreshed_all();
        }
        h.refreshed_queued()?;
        self.delay.behind = false;
        self.delay.submitted = false;
        Ok(())
    }

    /// Subtracts the share of this step's gradients (times `grad_scale`) in update
    /// `steps + 1` at `lr` from this rank's compute parameters (`fresh.rs`): one launch of
    /// zrun's kernel where it is installed, ATen's ops a piece at a time otherwise.
    fn fresh_share(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        let c = self.cfg.adamw;
        let t = match &mut self.optimizer {
            Optimizer::Host(h) => h.steps()? + 1,
            Optimizer::Device(_) => return Err(no_host()),
        };
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let coeffs = zrun_torch_ext::ShareCoeffs {
            grad_factor: grad_scale,
            beta2: c.beta2,
            eps: c.eps,
            step_size: lr * (1.0 - c.beta1) / (1.0 - c.beta1.powi(t)),
            bc2: 1.0 - c.beta2.powi(t),
        };
        let Some(dev_v) = self.delay.v.as_ref() else {
            return Err(Error::Unsupported(
                "a split delayed update without its v on the device".into(),
            ));
        };
        let stage = self.cfg.stage;
        let mut units = Vec::with_capacity(self.units_len());
        for u in 0..self.units_len() {
            let p = self.mover.owned_params(&self.params, u, stage)?.data();
            let g = match stage {
                Stage::Zero0 | Stage::Zero1 => self.mover.owned(&self.grads, u)?,
                Stage::Zero2 | Stage::Zero3 => self.mover.shard_of(&self.grads, u)?,
            };
            units.push((p, g, self.mover.shard_of(dev_v, u)?));
        }
        let pieces: Vec<_> = units
            .iter()
            .map(|(param, grad, v)| zrun_torch_ext::SharePiece { param, grad, v })
            .collect();
        if zrun_torch_ext::fresh_share(&pieces, &coeffs).map_err(kernel)? {
            return Ok(());
        }
        for (u, (p, g, v)) in units.iter().enumerate() {
            let unit = &self.mover.layout.units[u].unit;
            let n = p.numel() as i64;
            for off in (0..n).step_by(PIECE as usize) {
                let len = PIECE.min(n - off);
                let piece = |t: &Tensor| t.f_narrow(0, off, len).ctx("slice", unit);
                zrun_torch_ext::fresh_share_aten(&piece(p)?, &piece(g)?, &piece(v)?, &coeffs)
                    .map_err(kernel)?;
            }
        }
        Ok(())
    }
}
