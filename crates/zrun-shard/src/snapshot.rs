//! A rank's optimizer state unit by unit, for checkpoints: read out the slice of every unit's
//! fp32 master and AdamW moments this rank saves, and write back whatever slice it keeps
//! after a load (another world size, stage, precision or offload setting than the saver's).
//!
//! Element `e` of unit `u` is the same parameter element at every world size (the flat
//! buffer's order does not depend on W; only its padding does), so a checkpoint holds each
//! unit's elements `[0, numel)` split among the ranks that wrote it, and a loader asks for
//! the range it keeps: its shard range at stages 1-3, the whole unit at stage 0.

use crate::engine::Optimizer;
use crate::{Context, Engine, Error, Result, Stage, StateDtype};
use tch::{Device, Kind, Tensor};
use zrun_optim::MomentSlices;

/// Bytes (little-endian) of one unit's slice of this rank's optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitState {
    /// fp32 master weights.
    pub master: Vec<u8>,
    /// AdamW first moment, in [`Engine::moment_dtype`].
    pub exp_avg: Vec<u8>,
    /// AdamW second moment, in [`Engine::moment_dtype`].
    pub exp_avg_sq: Vec<u8>,
}

/// The engine's counters that a checkpoint carries beside the tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Counters {
    /// AdamW updates applied (fp16 overflow steps do not count).
    pub optimizer_steps: u64,
    /// The fp16 loss scale (1 otherwise).
    pub loss_scale: f64,
    /// Clean steps since the loss scale last changed.
    pub clean_steps: u64,
}

/// How a buffer holds a unit: at its offset in a buffer of all units' padded buffers, or as
/// this rank's slice in its contiguous shard buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Region {
    Full,
    Shard,
}

impl Engine {
    /// The storage type of the AdamW moments (bf16 only with offload and bf16 state).
    pub fn moment_dtype(&self) -> StateDtype {
        match &self.optimizer {
            Optimizer::Host(_) => self.cfg.optimizer_state_dtype,
            Optimizer::Device(_) => StateDtype::Fp32,
        }
    }

    /// `(start, len)`: the elements of unit `u` this rank writes into a checkpoint, its
    /// shard range without the padding (at stage 0 too, so the ranks share the writing).
    pub fn saved_range(&self, u: usize) -> (i64, i64) {
        let l = &self.mover.layout.units[u];
        let (start, len) = l.shard_range(self.mover.layout.rank);
        let start = start.min(l.numel);
        (start, (start + len).min(l.numel) - start)
    }

    /// `(start, len)`: the elements of unit `u` this rank reads from a checkpoint, the whole
    /// unit at stage 0 (every rank keeps all of it), else [`Engine::saved_range`].
    pub fn loaded_range(&self, u: usize) -> (i64, i64) {
        match self.cfg.stage {
            Stage::Zero0 => (0, self.mover.layout.units[u].numel),
            _ => self.saved_range(u),
        }
    }

    /// Where the fp32 master lives and how it holds each unit.
    fn master_region(&self) -> (Tensor, Region) {
        let stage = self.cfg.stage;
        match (&self.optimizer, &self.master) {
            (Optimizer::Host(h), _) => (h.master().shallow_clone(), Region::Shard),
            (_, Some(m)) if stage == Stage::Zero0 => (m.shallow_clone(), Region::Full),
            (_, Some(m)) => (m.shallow_clone(), Region::Shard),
            (_, None) if stage == Stage::Zero3 => (self.params.shallow_clone(), Region::Shard),
            (_, None) => (self.params.shallow_clone(), Region::Full),
        }
    }

    /// The offset in a `region` buffer of element `e` of unit `u` (inside what it holds).
    fn offset_of(&self, region: Region, u: usize, e: i64) -> i64 {
        let l = &self.mover.layout;
        match region {
            Region::Full => l.full_offsets[u] + e,
            Region::Shard => l.shard_offsets[u] + e - l.units[u].shard_range(l.rank).0,
        }
    }

    /// The device AdamW's moments region: the whole buffer at stage 0, else the shard.
    fn moment_region(&self) -> Region {
        match self.cfg.stage {
            Stage::Zero0 => Region::Full,
            _ => Region::Shard,
        }
    }

    /// Copies this rank's [`Engine::saved_range`] of unit `u`'s master and moments out of the
    /// engine (waiting for any offloaded update in flight).
    pub fn unit_state(&mut self, u: usize) -> Result<UnitState> {
        let _guard = tch::no_grad_guard();
        let (start, len) = self.saved_range(u);
        let unit = self.mover.layout.units[u].unit.clone();
        let (master, region) = self.master_region();
        let at = self.offset_of(region, u, start);
        let master = bytes_of(&master, at, len, &unit)?;
        let moment_at = self.offset_of(self.moment_region(), u, start);
        let host_at = self.mover.layout.shard_offsets[u] as usize;
        let (exp_avg, exp_avg_sq) = match &mut self.optimizer {
            Optimizer::Device(a) => {
                let (m, v) = a.moments();
                (
                    bytes_of(m, moment_at, len, &unit)?,
                    bytes_of(v, moment_at, len, &unit)?,
                )
            }
            Optimizer::Host(h) => match h.adam_idle()?.moments_range(host_at, len as usize)? {
                MomentSlices::F32(m, v) => (
                    m.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
                MomentSlices::Bf16(m, v) => (
                    m.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
            },
        };
        Ok(UnitState {
            master,
            exp_avg,
            exp_avg_sq,
        })
    }

    /// Writes unit `u`'s [`Engine::loaded_range`] of master and moments, read from a
    /// checkpoint, into the engine. Call [`Engine::finish_load`] after the last unit.
    pub fn load_unit(
        &mut self,
        u: usize,
        master: &[f32],
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
    ) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let (start, len) = self.loaded_range(u);
        let unit = self.mover.layout.units[u].unit.clone();
        for (what, got) in [
            ("master", master.len()),
            ("exp_avg", exp_avg.len()),
            ("exp_avg_sq", exp_avg_sq.len()),
        ] {
            if got as i64 != len {
                return Err(Error::Unsupported(format!(
                    "load of unit `{unit}`: {what} has {got} elements, this rank keeps {len}"
                )));
            }
        }
        let (dst, region) = self.master_region();
        put(&dst, self.offset_of(region, u, start), master, &unit)?;
        let moment_at = self.offset_of(self.moment_region(), u, start);
        match &mut self.optimizer {
            Optimizer::Device(a) => {
                let (m, v) = a.moments();
                put(m, moment_at, exp_avg, &unit)?;
                put(v, moment_at, exp_avg_sq, &unit)?;
            }
            Optimizer::Host(h) => {
                let off = self.mover.layout.shard_offsets[u] as usize;
                h.adam_idle()?.load_range(off, exp_avg, exp_avg_sq)?;
            }
        }
        Ok(())
    }

    /// Completes a load: the compute parameters from the loaded master (cast to the compute
    /// dtype, gathered where every rank holds them all) and the counters. Every rank calls it.
    pub fn finish_load(&mut self, c: Counters) -> Result<()> {
        let _guard = tch::no_grad_guard();
        match &mut self.optimizer {
            Optimizer::Device(a) => a.set_steps(c.optimizer_steps),
            Optimizer::Host(h) => h.adam_idle()?.set_steps(c.optimizer_steps),
        }
        self.scaler.restore(c.loss_scale, c.clean_steps);
        let stage = self.cfg.stage;
        let gathers = matches!(stage, Stage::Zero1 | Stage::Zero2);
        match (&self.optimizer, &self.master) {
            (Optimizer::Host(h), _) => {
                let master = h.master().shallow_clone();
                for u in 0..self.units_len() {
                    let mut dst = self.mover.owned_params(&self.params, u, stage)?;
                    let src = self.mover.shard_of(&master, u)?;
                    dst.f_copy_(&src).ctx(
                        "copy master to parameters",
                        &self.mover.layout.units[u].unit,
                    )?;
                }
                if gathers {
                    self.mover.all_gather_units(&self.params)?;
                }
            }
            (_, Some(_)) => self.refresh_params()?,
            (_, None) if gathers => self.mover.all_gather_units(&self.params)?,
            (_, None) => {}
        }
        Ok(())
    }

    /// The counters a checkpoint saves (waiting for any offloaded update in flight).
    pub fn counters(&mut self) -> Result<Counters> {
        Ok(Counters {
            optimizer_steps: match &mut self.optimizer {
                Optimizer::Device(a) => a.steps(),
                Optimizer::Host(h) => h.adam_idle()?.steps(),
            },
            loss_scale: self.scaler.scale(),
            clean_steps: self.scaler.clean_steps(),
        })
    }
}

/// The bytes of elements `[at, at + len)` of the 1-D tensor `t`, copied to the host.
fn bytes_of(t: &Tensor, at: i64, len: i64, unit: &str) -> Result<Vec<u8>> {
    let part = t
        .f_narrow(0, at, len)
        .ctx("slice state for a checkpoint", unit)?;
    let part = if part.device() == Device::Cpu {
        part
    } else {
        part.f_to_device(Device::Cpu)
            .ctx("copy state to the host", unit)?
    };
    let mut out = vec![0u8; len as usize * part.kind().elt_size_in_bytes()];
    part.f_copy_data_u8(&mut out, len as usize)
        .ctx("copy state for a checkpoint", unit)?;
    Ok(out)
}

/// Writes `src` (fp32) into elements `[at, at + src.len())` of the 1-D tensor `t` (any
/// device; cast to its dtype).
fn put(t: &Tensor, at: i64, src: &[f32], unit: &str) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    let mut dst = t
        .f_narrow(0, at, src.len() as i64)
        .ctx("slice state to load", unit)?;
    let from = Tensor::f_from_slice(src).ctx("load state", unit)?;
    let from = if dst.kind() == Kind::Float {
        from
    } else {
        from.f_to_kind(dst.kind()).ctx("load state", unit)?
    };
    dst.f_copy_(&from).ctx("load state", unit).map(drop)
}
