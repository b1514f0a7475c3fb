//! The host side of the delayed update's split (`zero.offload_delay_fresh`, `fresh.rs`): each
//! delayed job also writes the base of the next update and v, which the device needs to
//! apply the next gradient's share at once ([`zrun_optim::CpuAdamW::predict`]).

use super::{slice_mut, HostBuffers, HostOptimizer};
use crate::layout::ShardLayout;
use crate::{Context, Error, Result};
use tch::{Device, Kind, Tensor};
use zrun_optim::{BaseOut, HalfKind, Prediction};

/// The buffers of the split: the base where no 16-bit staging buffer holds it, and v.
pub(crate) struct Split {
    /// fp32 base of the next update (fp32 compute parameters); with 16-bit parameters on a
    /// device the staging buffer holds it instead.
    base: Option<Tensor>,
    /// v as bf16, in shard layout (pinned where the device is CUDA).
    v: Tensor,
}

impl Split {
    /// The buffers for a shard of `n` elements; `staged`: the 16-bit staging buffer exists.
    pub(super) fn new(
        alloc: &mut HostBuffers,
        n: i64,
        staged: bool,
        device: Device,
    ) -> Result<(Split, i64)> {
        let (v, v_bytes) = alloc.zeros(n, Kind::BFloat16, device)?;
        let (base, base_bytes) = if staged {
            (None, 0)
        } else {
            let (t, b) = alloc.zeros(n, Kind::Float, device)?;
            (Some(t), b)
        };
        Ok((Split { base, v }, v_bytes + base_bytes))
    }
}

/// Where one job writes its prediction, and the learning rate of the update it predicts.
pub(super) struct SplitOut {
    pub lr: f64,
    /// The base's 16-bit kind (none: fp32).
    pub half: Option<HalfKind>,
    /// The unit's slice of the base (the 16-bit staging buffer's or the fp32 one).
    pub base: Tensor,
    /// The unit's slice of v.
    pub v: Tensor,
}

impl SplitOut {
    /// The learning rate and the slices the prediction of `len` elements goes to.
    ///
    /// # Safety
    /// `base` and `v` are this job's unit slices of contiguous host buffers of the base's
    /// dtype (16-bit where `half` is set, else fp32) and bf16, `len` elements each; nothing
    /// else touches them while the returned slices live (the device read them before the job
    /// started).
    pub(super) unsafe fn prediction(&self, len: usize) -> (f64, Prediction<'_>) {
        // SAFETY: guaranteed by the caller (see above).
        let base = match self.half {
            Some(kind) => BaseOut::Half(
                unsafe { slice_mut::<u16>(self.base.data_ptr(), 0, len) },
                kind,
            ),
            None => BaseOut::F32(unsafe { slice_mut::<f32>(self.base.data_ptr(), 0, len) }),
        };
        let v = unsafe { slice_mut::<u16>(self.v.data_ptr(), 0, len) };
        (self.lr, Prediction { base, v })
    }
}

impl HostOptimizer {
    /// Where unit `u`'s job writes its prediction of the update at `lr` (none without the
    /// split).
    pub(super) fn split_out(
        &self,
        layout: &ShardLayout,
        u: usize,
        lr: f64,
    ) -> Result<Option<SplitOut>> {
        let Some(s) = &self.split else {
            return Ok(None);
        };
        let l = &layout.units[u];
        let (off, len) = (layout.shard_offsets[u], l.shard_len());
        let base = self
            .refreshed()
            .f_narrow(0, off, len)
            .ctx("slice base", &l.unit)?;
        let v = s.v.f_narrow(0, off, len).ctx("slice v", &l.unit)?;
        let half = if self.staging.is_some() {
            self.half()
        } else {
            None
        };
        Ok(Some(SplitOut { lr, half, base, v }))
    }

    /// Steps the CPU AdamW has begun (none may be running).
    pub(crate) fn steps(&mut self) -> Result<u64> {
        Ok(self.adam()?.steps())
    }

    /// After [`HostOptimizer::predict_now`]'s values were copied to the device, every unit at
    /// once: the next delayed update's first job waits for those copies.
    pub(crate) fn refreshed_all(&mut self) {
        self.refreshed_early.clear();
        self.refreshed_late = None;
    }

    /// v as bf16 in shard layout, as the last prediction wrote it.
    pub(crate) fn split_v(&self) -> Option<&Tensor> {
        self.split.as_ref().map(|s| &s.v)
    }

    /// The split's fp32 base, where no 16-bit staging buffer holds it.
    pub(super) fn split_base(&self) -> Option<&Tensor> {
        self.split.as_ref().and_then(|s| s.base.as_ref())
    }

    /// Waits for the running update, then writes the prediction of the next update at `lr`
    /// for the whole shard from the state as it is (the delay switching on, a resumed run, a
    /// step after a skipped one): the same values a job that had just updated it writes.
    pub(crate) fn predict_now(&mut self, layout: &ShardLayout, lr: f64) -> Result<()> {
        self.finish()?;
        // The device may still read these buffers (copies queued on its upload stream): wait.
        if let Device::Cuda(i) = self.device {
            zrun_torch_ext::join_uploads(i)
                .and_then(|()| zrun_torch_ext::CudaEvent::record_current(i))
                .and_then(|e| e.synchronize())
                .map_err(|e| Error::Unsupported(format!("wait for the device's copies: {e}")))?;
        }
        let master = self.master.shallow_clone();
        for u in 0..layout.units.len() {
            let Some(s) = self.split_out(layout, u, lr)? else {
                return Ok(());
            };
            let (off, len) = (layout.shard_offsets[u] as usize, s.v.numel());
            // SAFETY: the master is a contiguous fp32 host tensor of the shard size, and the
            // split's buffers are as `SplitOut::prediction` requires: no update runs
            // (finished above) and the device's copies from them were waited for.
            let m = unsafe { slice_mut::<f32>(master.data_ptr(), off, len) };
            let (lr, out) = unsafe { s.prediction(len) };
            self.adam()?
                .predict(off, m, lr, out)
                .map_err(|e| Error::Unsupported(format!("predict the next update: {e}")))?;
        }
        Ok(())
    }
}
