//! What a rank's optimizer reads and writes: its owned slices of the gradients, of the fp32
//! master and of the compute parameters, and the compute parameters brought up to date from
//! the master after an update.

use crate::engine::Engine;
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
}
