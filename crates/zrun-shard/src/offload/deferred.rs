//! The delayed update's side of [`HostOptimizer`] (`zero.offload_delay`, `delay.rs`): the
//! update of a step handed to the worker thread without waiting for it, and its results
//! taken unit by unit.

use super::{HostOptimizer, Transfer};
use crate::layout::ShardLayout;
use crate::{Error, Result};
use tch::{Device, Tensor};

impl HostOptimizer {
    /// The units of the running delayed update that finished while backward waited for
    /// them ([`HostOptimizer::stage_unit`]) and whose new parameters have not been taken yet.
    /// The caller copies them to the device now: [`HostOptimizer::finish_each`] does not
    /// hand them out again.
    pub(crate) fn take_finished(&mut self) -> Vec<usize> {
        let done = std::mem::take(&mut self.finished);
        self.refreshed_early.extend(&done);
        done
    }

    /// A delayed update (`delay.rs`): stages the owned gradient `segments` (end to end in
    /// shard order; `None`: staged unit by unit during backward) on the host and waits for
    /// the copies, then begins a step and hands every unit's update with `lr` and
    /// `grad_scale` to the worker thread, last unit first (the order the next backward
    /// needs them back in), which writes the master (and the 16-bit staging buffer where
    /// parameters live on a device) only; returns at once. [`HostOptimizer::finish`] waits
    /// for it; the compute parameters are then refreshed from
    /// [`HostOptimizer::refreshed`] by the caller.
    pub(crate) fn submit_deferred(
        &mut self,
        layout: &ShardLayout,
        segments: Option<&[Tensor]>,
        lr: f64,
        grad_scale: f64,
        next_lr: f64,
    ) -> Result<()> {
        if !self.owns_grads {
            return Err(Error::Unsupported(
                "a delayed update needs host gradients of its own (the engine's are read in place)"
                    .into(),
            ));
        }
        // The engine overwrites (then accumulates into) its gradients as soon as this returns;
        // unit 0's copy, into its own buffer, is waited for by its job alone.
        let mut first = self.stage_segments(segments, true)?;
        self.begin_step()?;
        // The jobs overwrite the staging slices (and a split's v) the last update's new
        // values were copied to the device from: the first job (the worker runs them in
        // order) that could find a copy unfinished waits until the device has read them all
        // (`delay::waits_for_refresh`).
        let mut refreshed = self.refreshed_ready.take();
        let late = self.refreshed_late.take();
        let upload_stream = crate::delay::on_upload_stream();
        for u in (0..layout.units.len()).rev() {
            let mut job = self.job(layout, u, lr, grad_scale, None)?;
            job.split = self.split_out(layout, u, next_lr)?;
            if crate::delay::waits_for_refresh(u, late, upload_stream) {
                job.ready.extend(refreshed.take());
            }
            if u == 0 {
                job.ready.extend(first.take());
            }
            self.send(u, job)?;
        }
        Ok(())
    }

    /// Waits for a delayed update of `units` units unit by unit and calls `each(u)` once for
    /// every unit not refreshed during backward ([`HostOptimizer::take_finished`]), as soon
    /// as it is done: first the units backward already waited for, then
    /// in the order they finish (last unit first), so that their new parameters can travel
    /// to the device while the CPU still updates the others; then every unit an earlier
    /// [`HostOptimizer::finish`] (a checkpoint's) saw done. Returns the first error.
    pub(crate) fn finish_each(
        &mut self,
        units: usize,
        mut each: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let mut called = vec![false; units];
        for u in std::mem::take(&mut self.refreshed_early) {
            if let Some(c) = called.get_mut(u) {
                *c = true;
            }
        }
        let mut first = Ok(());
        let mut late = None;
        let mut call = |u: usize, r: Result<()>, first: &mut Result<()>| {
            let r = r.and_then(|()| match called.get_mut(u) {
                Some(c) if !*c => {
                    *c = true;
                    late = late.max(Some(u));
                    each(u)
                }
                _ => Ok(()),
            });
            if first.is_ok() {
                *first = r;
            }
        };
        for u in std::mem::take(&mut self.finished) {
            call(u, Ok(()), &mut first);
        }
        if let Some(w) = self.worker.as_mut() {
            while let Some(&u) = w.pending.front() {
                let r = w.next().and_then(|t| t.map_or(Ok(()), Transfer::apply));
                call(u, r, &mut first);
            }
        }
        let joined = self.finish();
        for u in 0..units {
            call(u, Ok(()), &mut first);
        }
        self.refreshed_late = late;
        first.and(joined)
    }

    /// After the new parameters' copies to the device are queued (on the upload stream,
    /// `delay::upload`): makes the compute stream wait for them, and records the event the
    /// next delayed update waits for before it overwrites what they read (CUDA; nothing to
    /// wait for on CPU, where the copies are done when queued).
    pub(crate) fn refreshed_queued(&mut self) -> Result<()> {
        if let Device::Cuda(i) = self.device {
            zrun_torch_ext::join_uploads(i).map_err(|e| {
                Error::Unsupported(format!("wait for the parameters' refresh: {e}"))
            })?;
            let e = zrun_torch_ext::CudaEvent::record_current(i)
                .map_err(|e| Error::Unsupported(format!("record the parameters' refresh: {e}")))?;
            self.refreshed_ready = Some(e);
        }
        Ok(())
    }

    /// What a finished delayed update left for the compute parameters, in shard layout:
    /// the pinned 16-bit staging buffer (16-bit parameters on a device: copied as they are,
    /// by DMA) or else the fp32 master; split (`zero.offload_delay_fresh`), the base of the
    /// next update, in the staging buffer or else the split's fp32 one.
    pub(crate) fn refreshed(&self) -> &Tensor {
        self.staging
            .as_ref()
            .or(self.split_base())
            .unwrap_or(&self.master)
    }
}
