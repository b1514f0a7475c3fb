//! What a rank's optimizer reads and writes: its owned slices of the gradients, of the fp32
//! master and of the compute parameters, and the compute parameters brought up to date from
//! the master after an update; and every parameter whole, from the master.

use crate::engine::{views, Engine, Optimizer};
use crate::{Context, Result, Stage};
use tch::Tensor;

impl Engine {
    /// The gradient slices this rank owns (what its optimizer reads), as 1-D views.
    pub(crate) fn owned_grads(&self) -> Result<Vec<Tensor>> {
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero2 | Stage::Zero3 => Ok(vec![self.grads.shallow_clone()]),
            Stage::Zero1 => (0..self.units_len())
                .map(|u| self.mover.owned(&self.grads, u))
                .collect(),
        }
    }

    /// The fp32 master this rank owns, as 1-D views: the separate master buffer, or in fp32
    /// the owned slices of the parameters themselves.
    pub(crate) fn owned_master(&self) -> Result<Vec<Tensor>> {
        if let Some(m) = &self.master {
            return Ok(vec![m.shallow_clone()]);
        }
        self.owned_params()
    }

    /// The compute parameters this rank updates, in the master's order: the whole flat
    /// buffer at stages 0 and 3, the owned slice of each unit at stages 1-2.
    pub(crate) fn owned_params(&self) -> Result<Vec<Tensor>> {
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero3 => Ok(vec![self.params.shallow_clone()]),
            Stage::Zero1 | Stage::Zero2 => (0..self.units_len())
                .map(|u| self.mover.owned(&self.params, u))
                .collect(),
        }
    }

    /// Writes the updated master into the compute parameters (cast to the compute dtype) and
    /// gathers them where every rank holds full parameters (stages 1-2).
    pub(crate) fn refresh_params(&mut self) -> Result<()> {
        self.cast_master()?;
        self.gather_params()
    }

    /// Gathers the compute parameters where every rank holds them whole (stages 1-2).
    pub(crate) fn gather_params(&mut self) -> Result<()> {
        if matches!(self.cfg.stage, Stage::Zero1 | Stage::Zero2) {
            self.mover.all_gather_units(&self.params)?;
        }
        Ok(())
    }

    /// Writes the updated master into the compute parameters this rank owns (cast to the
    /// compute dtype).
    pub(crate) fn cast_master(&mut self) -> Result<()> {
        if let Some(master) = &self.master {
            match self.cfg.stage {
                Stage::Zero0 | Stage::Zero3 => self
                    .params
                    .f_copy_(master)
                    .ctx("copy master to parameters", "-")?,
                Stage::Zero1 | Stage::Zero2 => {
                    for u in 0..self.units_len() {
                        let mut own = self.mover.owned(&self.params, u)?;
                        let src = self.mover.shard_of(master, u)?;
                        own.f_copy_(&src).ctx(
                            "copy master to parameters",
                            &self.mover.layout.units[u].unit,
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Every parameter by name as full fp32 tensors from the master copy (gathered from all
    /// ranks where sharded: every rank must call). With a delayed update pending the master
    /// includes it: these are the newest parameters, one update ahead of the compute ones.
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        let _guard = tch::no_grad_guard();
        if let Optimizer::Host(h) = &mut self.optimizer {
            h.finish()?;
        }
        // The fp32 source: the separate master, else the parameters themselves; it is a
        // shard (to gather) except for stage 0's master and stages 0-2's fp32 parameters.
        let (source, is_shard) = match (&self.optimizer, &self.master) {
            (Optimizer::Host(h), _) => (
                h.master()
                    .f_to_device(self.cfg.device)
                    .ctx("copy host master", "-")?,
                true,
            ),
            (_, Some(m)) => (m.shallow_clone(), self.cfg.stage != Stage::Zero0),
            (_, None) => (self.params.shallow_clone(), self.cfg.stage == Stage::Zero3),
        };
        let mut out = Vec::new();
        for u in 0..self.units_len() {
            let l = self.mover.layout.units[u].clone();
            // A shard group of one holds each unit whole in its shard: copied as it is.
            let flat = if is_shard && !self.mover.group_of_one() {
                let p = self.mover.start_gather(&source, u)?;
                let full = self.mover.finish_gather(p)?;
                self.mover.untrack(&full);
                full
            } else {
                self.mover
                    .unit_full(&source, u)?
                    .f_detach_copy()
                    .ctx("copy parameters", &l.unit)?
            };
            out.extend(
                l.views
                    .iter()
                    .map(|v| v.name.clone())
                    .zip(views(&l, &flat)?),
            );
        }
        Ok(out)
    }
}
