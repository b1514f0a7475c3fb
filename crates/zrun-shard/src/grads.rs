//! The gradient buffer between steps: instead of zeroing it after each step, every unit's
//! region is marked stale, and the first gradient that reaches a unit in the next step is
//! copied over it rather than added to zeros; a region still stale when the step reads the
//! gradients (a unit that received none) is zeroed then. On a GPU that saves a write of the
//! whole buffer and a read of it per step.

use crate::engine::{views, Engine};
use crate::{Context, Error, Result, Stage};
use tch::Tensor;

impl Engine {
    /// This rank's gradient region of unit `u`: the unit's full buffer at stages 0-1, its
    /// shard at stages 2-3; with gradients on the host, the one the backward is making.
    pub(crate) fn unit_grads(&self, u: usize) -> Result<Tensor> {
        if self.host_grads {
            let name = &self.mover.layout.units[u].unit;
            return self.held[u]
                .as_ref()
                .map(Tensor::shallow_clone)
                .ok_or_else(|| {
                    Error::Unsupported(format!("no gradient of unit `{name}` is being made"))
                });
        }
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero1 => self.mover.unit_full(&self.grads, u),
            Stage::Zero2 | Stage::Zero3 => self.mover.shard_of(&self.grads, u),
        }
    }

    /// Forgets the gradients: every unit's region is stale, to be overwritten by its next
    /// gradient (what zeroing them was for).
    pub(crate) fn discard_grads(&mut self) {
        self.stale.iter_mut().for_each(|s| *s = true);
        self.held.iter_mut().for_each(|h| *h = None);
        self.squares.clear();
    }

    /// Whether unit `u`'s region is stale, and from now on not: the caller overwrites it.
    pub(crate) fn take_stale(&mut self, u: usize) -> bool {
        std::mem::replace(&mut self.stale[u], false)
    }

    /// Zeroes the regions still stale, before the gradients are read as a whole.
    pub(crate) fn settle_grads(&mut self) -> Result<()> {
        if self.host_grads {
            // Settled at the step's start (`settle_host_grads`).
            return Ok(());
        }
        for u in 0..self.stale.len() {
            if self.take_stale(u) {
                let name = self.mover.layout.units[u].unit.clone();
                self.unit_grads(u)?
                    .f_zero_()
                    .done("zero gradients of a unit without any", &name)?;
            }
        }
        Ok(())
    }

    /// Stages 0-1, and 2-3 over a shard group of one without replicas (whose shard of a unit
    /// is the whole unit): adds `grads` (unit `u`'s parameter gradients in its parameter
    /// order, or parameter `only`'s alone) into the unit's full gradient, or copies them over
    /// it (and zeroes its padding) where it is stale.
    pub(crate) fn accumulate_full(
        &mut self,
        u: usize,
        only: Option<usize>,
        grads: &[Tensor],
    ) -> Result<()> {
        let (stale, mut acc) = if self.host_grads {
            self.held_grads(u)?
        } else {
            (self.take_stale(u), self.unit_grads(u)?)
        };
        let layout = &self.mover.layout.units[u];
        let name = layout.unit.as_str();
        if stale && only.is_some() {
            // Part of the unit: the rest must read as zeros.
            acc.f_zero_().done("zero unit gradient", name)?;
        }
        let overwrite = stale && only.is_none();
        lay_out(&pick(only, views(layout, &acc)?), grads, !overwrite, name)?;
        if overwrite && layout.padded > layout.numel {
            acc.f_narrow(0, layout.numel, layout.padded - layout.numel)
                .and_then(|mut pad| pad.f_zero_())
                .done("zero gradient padding", name)?;
        }
        Ok(())
    }

    /// Stages 2-3: adds a reduced shard of unit `u` into its gradient shard, or copies it
    /// over it where it is stale; returns the shard's region.
    pub(crate) fn accumulate_shard(&mut self, u: usize, shard: &Tensor) -> Result<Tensor> {
        let stale = self.take_stale(u);
        let mut acc = self.unit_grads(u)?;
        let name = &self.mover.layout.units[u].unit;
        if stale {
            acc.f_copy_(shard).done("lay out gradient shard", name)?;
        } else {
            acc.f_add_(shard).done("accumulate gradient shard", name)?;
        }
        Ok(acc)
    }

    /// Gradients accumulated so far, by name (stages 0-1, before `step`: the unreduced sum
    /// of this rank's micro-steps, times the loss scale).
    pub fn local_gradients(&self) -> Result<Vec<(String, Tensor)>> {
        if !matches!(self.cfg.stage, Stage::Zero0 | Stage::Zero1) {
            return Err(Error::Unsupported(
                "local_gradients needs full gradients (stage 0 or 1)".into(),
            ));
        }
        let mut out = Vec::new();
        for (u, l) in self.mover.layout.units.iter().enumerate() {
            let flat = self.mover.unit_full(&self.grads, u)?;
            // A stale region (no gradient yet this step) reads as zeros.
            let flat = if self.stale[u] {
                flat.f_zeros_like().ctx("zero gradients", &l.unit)?
            } else {
                flat
            };
            out.extend(l.views.iter().map(|v| v.name.clone()).zip(views(l, &flat)?));
        }
        Ok(out)
    }
}

/// Lays each gradient `srcs[i]` into `dsts[i]`, copied over it or (`add`) added to it, cast to
/// its dtype: on CUDA by zrun's layout kernel, one launch for them all, where it takes them
/// (bf16 into fp32; `zrun_torch_ext::cast_into`), else by ATen's copy or add, one each.
pub(crate) fn lay_out(dsts: &[Tensor], srcs: &[Tensor], add: bool, unit: &str) -> Result<()> {
    if zrun_torch_ext::kernels::optim::installed() {
        let pieces: Vec<zrun_torch_ext::CastPiece> = dsts
            .iter()
            .zip(srcs)
            .map(|(dst, src)| zrun_torch_ext::CastPiece { dst, src, add })
            .collect();
        if zrun_torch_ext::cast_into(&pieces).map_err(|e| Error::Kernel("lay out gradients", e))? {
            return Ok(());
        }
    }
    for (dst, g) in dsts.iter().zip(srcs) {
        let mut dst = dst.shallow_clone();
        if add {
            dst.f_add_(g).done("accumulate gradient", unit)?;
        } else {
            dst.f_copy_(g).done("lay out gradient", unit)?;
        }
    }
    Ok(())
}

/// The views of `all` (a unit's parameters in order) that a gradient of parameter `only`
/// (or of every parameter) goes to.
pub(crate) fn pick(only: Option<usize>, all: Vec<Tensor>) -> Vec<Tensor> {
    match only {
        Some(p) => all.into_iter().skip(p).take(1).collect(),
        None => all,
    }
}
