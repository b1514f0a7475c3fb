//! The stage engine: forward unit by unit, backward unit by unit in reverse with one
//! autograd call per unit, gradients reduced per the ZeRO stage, and the AdamW step over the
//! rank's fp32 shard.
//!
//! | stage | parameters            | gradients        | AdamW state | reduce             | after step  |
//! |-------|-----------------------|------------------|-------------|--------------------|-------------|
//! | 0     | full                  | full             | full        | all-reduce         | —           |
//! | 1     | full                  | full             | shard       | reduce-scatter     | all-gather  |
//! | 2     | full                  | shard            | shard       | RS per unit        | all-gather  |
//! | 3     | shard (+ units gathered in flight) | shard | shard   | RS per unit        | —           |
//!
//! In fp32 the owned slice of the parameters is the master copy, so no second copy exists.

use crate::init::{init_buffer, Extent};
use crate::layout::{ShardLayout, UnitLayout};
use crate::state::{Mover, Pending};
use crate::{Context, Error, MemoryLedger, Precision, Result, Stage};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use zrun_comm::Communicator;
use zrun_models::{lm_loss, Model};
use zrun_optim::{clip_coefficient, AdamW, AdamWConfig};

/// What the engine needs to know, resolved from the config once.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// ZeRO stage.
    pub stage: Stage,
    /// Compute precision.
    pub precision: Precision,
    /// Device of compute and state.
    pub device: Device,
    /// Seed of the deterministic parameter init.
    pub seed: u64,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
}

/// Figures of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Factor the gradients were multiplied by (1 when not clipped).
    pub clip_coef: f64,
    /// False when the gradients held inf/NaN; the step was then not applied.
    pub applied: bool,
}

/// What one unit's forward leaves for its backward.
struct Saved {
    /// The unit's input as a leaf (None for the first unit, whose input is token ids).
    input: Option<Tensor>,
    /// The unit's flat parameters as a leaf whose gradient autograd computes.
    flat: Tensor,
    /// The unit's output (the loss for the last unit).
    output: Tensor,
    /// Stage 3: the gathered buffer behind `flat`.
    gathered: Option<Tensor>,
}

/// Drives one rank's training step unit by unit.
pub struct Engine {
    model: Arc<dyn Model>,
    cfg: EngineConfig,
    mover: Mover,
    /// Stages 0-2: every unit's full fp32 buffer back to back. Stage 3: this rank's shard.
    params: Tensor,
    /// Stages 0-1: full fp32 gradients. Stages 2-3: this rank's reduced shard.
    grads: Tensor,
    optimizer: AdamW,
}

impl Engine {
    /// Builds the engine of rank `comm.rank()` for `model`, initialising exactly the
    /// parameters this stage keeps on this rank from `cfg.seed`.
    pub fn new(
        model: Arc<dyn Model>,
        comm: Arc<dyn Communicator>,
        cfg: EngineConfig,
    ) -> Result<Engine> {
        if cfg.precision != Precision::Fp32 {
            return Err(Error::Unsupported(format!(
                "zero.precision = \"{}\" is not available in this version; use \"fp32\"",
                cfg.precision
            )));
        }
        let (rank, world) = (comm.rank() as i64, comm.world_size() as i64);
        let layout = ShardLayout::new(model.units(), rank, world);
        let sharded_params = cfg.stage == Stage::Zero3;
        let extent = if sharded_params {
            Extent::Shard
        } else {
            Extent::Full
        };
        let params = init_buffer(model.as_ref(), &layout, cfg.seed, extent)?
            .f_to_device(cfg.device)
            .ctx("move parameters to the device", "-")?;
        let grad_numel = match cfg.stage {
            Stage::Zero0 | Stage::Zero1 => layout.full_numel(),
            Stage::Zero2 | Stage::Zero3 => layout.shard_numel(),
        };
        let grads = Tensor::f_zeros([grad_numel], (Kind::Float, cfg.device))
            .ctx("allocate gradients", "-")?;
        let (opt_numel, decay) = match cfg.stage {
            Stage::Zero0 => (layout.full_numel(), layout.full_decay_ranges()),
            _ => (layout.shard_numel(), layout.shard_decay_ranges()),
        };
        let optimizer = AdamW::new(opt_numel, cfg.device, cfg.adamw, decay)?;
        Ok(Engine {
            model,
            cfg,
            mover: Mover::new(comm, layout),
            params,
            grads,
            optimizer,
        })
    }

    /// The layout (view tables) of every unit, for this rank.
    pub fn layout(&self) -> &ShardLayout {
        &self.mover.layout
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The communicator this engine uses.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.mover.comm
    }

    /// Bytes this rank holds, by category, counted from the buffers actually allocated.
    pub fn memory(&self) -> MemoryLedger {
        let bytes = |t: &Tensor| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        MemoryLedger {
            params: bytes(&self.params),
            grads: bytes(&self.grads),
            master: 0, // fp32: the owned parameters are the master copy
            optimizer: self.optimizer.state_bytes(),
            buffers: self.optimizer.scratch_bytes() + self.mover.peak_in_flight,
        }
    }

    fn units_len(&self) -> usize {
        self.mover.layout.units.len()
    }

    /// Stage 3 starts gathering unit `u`; other stages have it resident.
    fn start_unit(&mut self, u: usize) -> Result<Option<Pending>> {
        if self.cfg.stage == Stage::Zero3 && u < self.units_len() {
            return Ok(Some(self.mover.start_gather(&self.params, u)?));
        }
        Ok(None)
    }

    /// Unit `u`'s full flat parameters: the resident region, or the finished gather.
    fn unit_params(
        &mut self,
        u: usize,
        pending: Option<Pending>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match pending {
            Some(p) => {
                let full = self.mover.finish_gather(p)?;
                Ok((full.shallow_clone(), Some(full)))
            }
            None => Ok((self.mover.unit_full(&self.params, u)?, None)),
        }
    }

    /// One micro-step: forward unit by unit, then backward unit by unit in reverse, adding
    /// `weight` times each unit's gradient into this rank's gradients (averaged over the
    /// ranks per unit as soon as its backward is done at stages 2-3). Returns this rank's
    /// micro-batch mean loss. `inputs` and `targets` are (B, T) int64.
    pub fn forward_backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        weight: f64,
    ) -> Result<f64> {
        let model = self.model.clone();
        let units = model.units();
        let dev = self.cfg.device;
        let mut x = inputs
            .f_to_device(dev)
            .ctx("move inputs to the device", "-")?;
        let targets = targets
            .f_to_device(dev)
            .ctx("move targets to the device", "-")?;
        let mut saved: Vec<Saved> = Vec::with_capacity(units.len());
        let mut next = self.start_unit(0)?;
        for (u, unit) in units.iter().enumerate() {
            let name = unit.name();
            let (flat, gathered) = self.unit_params(u, next.take())?;
            next = self.start_unit(u + 1)?; // prefetch overlaps this unit's compute
            let flat = flat.f_detach().ctx("detach", name)?.set_requires_grad(true);
            let input = if u == 0 {
                None
            } else {
                Some(x.f_detach().ctx("detach", name)?.set_requires_grad(true))
            };
            let params = views(&self.mover.layout.units[u], &flat)?;
            let output = unit.forward(&params, input.as_ref().unwrap_or(&x))?;
            x = output.shallow_clone();
            saved.push(Saved {
                input,
                flat,
                output,
                gathered,
            });
        }
        let loss = lm_loss(&x, &targets)?;
        let loss_value = loss.f_double_value(&[]).ctx("read loss", "head")?;
        let mut upstream: Option<Tensor> = None;
        let mut reducing: Vec<Pending> = Vec::new();
        for u in (0..units.len()).rev() {
            let s = saved.pop().expect("one saved entry per unit");
            let name = units[u].name();
            // The root whose gradient flows into this unit: the weighted loss for the last
            // unit, otherwise <output, upstream gradient> (its gradient wrt output is upstream).
            let root = match &upstream {
                None => loss.f_mul_scalar(weight).ctx("scale loss", name)?,
                Some(g) => s
                    .output
                    .f_mul(g)
                    .and_then(|t| t.f_sum(Kind::Float))
                    .ctx("backward root", name)?,
            };
            let mut wrt = vec![&s.flat];
            wrt.extend(s.input.as_ref());
            let mut g =
                Tensor::f_run_backward(&[&root], &wrt, false, false).ctx("backward", name)?;
            upstream = if s.input.is_some() { g.pop() } else { None };
            let unit_grad = g.swap_remove(0);
            drop(s.output);
            if let Some(full) = &s.gathered {
                self.mover.done_with(full);
            }
            match self.cfg.stage {
                Stage::Zero0 | Stage::Zero1 => {
                    let mut acc = self.mover.unit_full(&self.grads, u)?;
                    acc.f_add_(&unit_grad).done("accumulate gradient", name)?;
                }
                Stage::Zero2 | Stage::Zero3 => {
                    // Reduce this unit while the next one back computes; finish older ones.
                    reducing.push(self.mover.start_reduce_scatter(unit_grad, u)?);
                    if reducing.len() > 1 {
                        let p = reducing.remove(0);
                        self.accumulate_shard(p)?;
                    }
                }
            }
        }
        for p in reducing {
            self.accumulate_shard(p)?;
        }
        Ok(loss_value)
    }

    fn accumulate_shard(&mut self, p: Pending) -> Result<()> {
        let (u, shard) = self.mover.finish_reduce_scatter(p)?;
        let mut acc = self.mover.shard_of(&self.grads, u)?;
        acc.f_add_(&shard).done(
            "accumulate gradient shard",
            &self.mover.layout.units[u].unit,
        )
    }

    /// This rank's mean loss of a batch, without gradients.
    pub fn eval_loss(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<f64> {
        let _guard = tch::no_grad_guard();
        let model = self.model.clone();
        let mut x = inputs
            .f_to_device(self.cfg.device)
            .ctx("move inputs to the device", "-")?;
        let mut next = self.start_unit(0)?;
        for (u, unit) in model.units().iter().enumerate() {
            let (flat, gathered) = self.unit_params(u, next.take())?;
            next = self.start_unit(u + 1)?;
            x = unit.forward(&views(&self.mover.layout.units[u], &flat)?, &x)?;
            if let Some(full) = &gathered {
                self.mover.done_with(full);
            }
        }
        let targets = targets
            .f_to_device(self.cfg.device)
            .ctx("move targets to the device", "-")?;
        lm_loss(&x, &targets)?
            .f_double_value(&[])
            .ctx("read loss", "head")
    }

    /// The gradient slices this rank owns (what its optimizer updates), as 1-D views.
    fn owned_grads(&self) -> Result<Vec<Tensor>> {
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero2 | Stage::Zero3 => Ok(vec![self.grads.shallow_clone()]),
            Stage::Zero1 => (0..self.units_len())
                .map(|u| self.mover.owned(&self.grads, u))
                .collect(),
        }
    }

    /// The parameter slices this rank owns (its fp32 master), as 1-D views.
    fn owned_params(&self) -> Result<Vec<Tensor>> {
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero3 => Ok(vec![self.params.shallow_clone()]),
            Stage::Zero1 | Stage::Zero2 => (0..self.units_len())
                .map(|u| self.mover.owned(&self.params, u))
                .collect(),
        }
    }

    /// Finishes the gradient reduction of the step, clips to `max_norm` (<= 0: off) by the
    /// global norm, applies AdamW with `lr`, refreshes parameters where the stage needs it
    /// and clears the gradients. A step whose gradients are not finite is not applied.
    pub fn step(&mut self, lr: f64, max_norm: f64) -> Result<StepStats> {
        let _guard = tch::no_grad_guard();
        match self.cfg.stage {
            Stage::Zero0 => self.mover.all_reduce_units(&self.grads)?,
            Stage::Zero1 => self.mover.reduce_scatter_units(&self.grads)?,
            Stage::Zero2 | Stage::Zero3 => {} // reduced per unit during backward
        }
        let grads = self.owned_grads()?;
        let mut local = 0.0;
        for g in &grads {
            local += g
                .f_square()
                .and_then(|s| s.f_sum(Kind::Double))
                .and_then(|s| s.f_double_value(&[]))
                .ctx("gradient norm", "-")?;
        }
        // Stage 0 holds the whole reduced gradient on every rank; the others own a part.
        let sum_sq = if self.cfg.stage == Stage::Zero0 {
            local
        } else {
            self.mover.sum_over_ranks(local)?
        };
        let grad_norm = sum_sq.sqrt();
        let applied = grad_norm.is_finite();
        let clip_coef = clip_coefficient(grad_norm, max_norm);
        if applied {
            if clip_coef < 1.0 {
                for g in &grads {
                    g.shallow_clone()
                        .f_mul_scalar_(clip_coef)
                        .done("clip gradients", "-")?;
                }
            }
            let params = self.owned_params()?;
            self.optimizer.step_segments(&params, &grads, lr)?;
            if matches!(self.cfg.stage, Stage::Zero1 | Stage::Zero2) {
                self.mover.all_gather_units(&self.params)?;
            }
        }
        self.grads.f_zero_().done("zero gradients", "-")?;
        Ok(StepStats {
            grad_norm,
            clip_coef,
            applied,
        })
    }

    /// Every parameter by name as full tensors (gathered at stage 3: every rank must call).
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for u in 0..self.units_len() {
            let p = self.start_unit(u)?;
            let (flat, gathered) = self.unit_params(u, p)?;
            let l = &self.mover.layout.units[u];
            let flat = flat.f_detach_copy().ctx("copy parameters", &l.unit)?;
            out.extend(l.views.iter().map(|v| v.name.clone()).zip(views(l, &flat)?));
            if let Some(full) = &gathered {
                self.mover.done_with(full);
            }
        }
        Ok(out)
    }

    /// Gradients accumulated so far, by name (stages 0-1, before `step`: the unreduced sum
    /// of this rank's micro-steps).
    pub fn local_gradients(&self) -> Result<Vec<(String, Tensor)>> {
        if !matches!(self.cfg.stage, Stage::Zero0 | Stage::Zero1) {
            return Err(Error::Unsupported(
                "local_gradients needs full gradients (stage 0 or 1)".into(),
            ));
        }
        let mut out = Vec::new();
        for (u, l) in self.mover.layout.units.iter().enumerate() {
            let flat = self.mover.unit_full(&self.grads, u)?;
            out.extend(l.views.iter().map(|v| v.name.clone()).zip(views(l, &flat)?));
        }
        Ok(out)
    }
}

/// The named parameter tensors of a unit as views of its flat buffer, in the unit's order.
fn views(layout: &UnitLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    layout
        .views
        .iter()
        .map(|v| {
            flat.f_narrow(0, v.offset, v.numel)
                .and_then(|t| t.f_view(v.shape.as_slice()))
        })
        .collect::<std::result::Result<_, _>>()
        .ctx("view parameters", &layout.unit)
}
