//! A rank's optimizer state unit by unit, for checkpoints: read out the slice of every unit's
//! fp32 master and AdamW moments this rank saves, and write back whatever slice it keeps
//! after a load (another world size, stage, precision or offload setting than the saver's).
//!
//! Element `e` of unit `u` is the same parameter element at every world size (the flat
//! buffer's order does not depend on W; only its padding does), so a checkpoint holds each
//! unit's elements `[0, numel)` split among the ranks that wrote it, and a loader asks for
//! the range it keeps: its shard range at stages 1-3, the whole unit at stage 0. With
//! hybrid sharding the first shard group writes and every group reads its replica.

#[cfg(target_endian = "big")]
compile_error!(
    "checkpoints are written from memory as little-endian: zrun needs a little-endian host"
);

use crate::engine::Optimizer;
use crate::{Context, Engine, Error, Result, Stage, StateDtype};
use tch::{Device, Kind, Tensor};
use zrun_optim::MomentSlices;

/// One of the tensors of a unit's optimizer state, in the order they are visited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatePart {
    /// fp32 master weights.
    Master,
    /// AdamW first moment, in [`Engine::moment_dtype`].
    ExpAvg,
    /// AdamW second moment, in [`Engine::moment_dtype`].
    ExpAvgSq,
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
    /// The compute parameters are one update behind the master (`zero.offload_delay`): the
    /// checkpoint holds them too ([`Engine::visit_delayed_params`]). Not read by a load.
    pub params_behind: bool,
}

/// Where one element range of a unit lives in the engine.
struct Place {
    unit: String,
    len: i64,
    /// The fp32 master buffer, and the range's offset in it.
    master: Tensor,
    master_at: i64,
    /// The device AdamW's m and v and the range's offset in them (`None` when offloaded).
    moments: Option<(Tensor, Tensor, i64)>,
    /// The range's offset in the offloaded optimizer's shard.
    host_at: usize,
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

    /// `(start, len)`: the elements of unit `u` this rank owns, its shard range (in its
    /// shard group) without the padding; at stage 0, where every rank keeps the whole unit,
    /// the range it writes into a checkpoint.
    pub fn owned_range(&self, u: usize) -> (i64, i64) {
        let l = &self.mover.layout.units[u];
        let (start, len) = l.shard_range(self.mover.layout.rank);
        let start = start.min(l.numel);
        (start, (start + len).min(l.numel) - start)
    }

    /// `(start, len)`: the elements of unit `u` this rank writes into a checkpoint: its
    /// [`Engine::owned_range`] (at stage 0 too, so the ranks share the writing), except with
    /// hybrid sharding outside the first shard group, whose replica the first one writes:
    /// nothing, `(numel, 0)`.
    pub fn saved_range(&self, u: usize) -> (i64, i64) {
        if self.mover.layout.replica != 0 {
            return (self.mover.layout.units[u].numel, 0);
        }
        self.owned_range(u)
    }

    /// `(start, len)`: the elements of unit `u` this rank reads from a checkpoint, the whole
    /// unit at stage 0 (every rank keeps all of it), else [`Engine::owned_range`] (every
    /// shard group reads its replica).
    pub fn loaded_range(&self, u: usize) -> (i64, i64) {
        match self.cfg.stage {
            Stage::Zero0 => (0, self.mover.layout.units[u].numel),
            _ => self.owned_range(u),
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

    /// Where elements `[start, start + len)` of unit `u` live in the engine, once no
    /// offloaded update is in flight.
    fn place(&mut self, u: usize, (start, len): (i64, i64)) -> Result<Place> {
        if let Optimizer::Host(h) = &mut self.optimizer {
            h.adam_idle()?;
        }
        let (master, region) = self.master_region();
        let moment_at = self.offset_of(self.moment_region(), u, start);
        Ok(Place {
            unit: self.mover.layout.units[u].unit.clone(),
            len,
            master_at: self.offset_of(region, u, start),
            master,
            moments: match &self.optimizer {
                Optimizer::Device(a) => {
                    let (m, v) = a.moments();
                    Some((m.shallow_clone(), v.shallow_clone(), moment_at))
                }
                Optimizer::Host(_) => None,
            },
            host_at: self.mover.layout.shard_offsets[u] as usize,
        })
    }

    /// The CPU AdamW of an offloaded optimizer (idle).
    fn host_adam(&mut self) -> Result<&mut zrun_optim::CpuAdamW> {
        match &mut self.optimizer {
            Optimizer::Host(h) => h.adam_idle(),
            Optimizer::Device(_) => Err(Error::Unsupported(
                "the optimizer state is on the device, not offloaded".into(),
            )),
        }
    }

    /// Hands `put` the little-endian bytes of this rank's [`Engine::saved_range`] of unit
    /// `u`'s master, then its moments, straight from the engine's memory where it is host
    /// memory (through a host copy from a device). Waits for any offloaded update in flight.
    pub fn visit_unit_state<E: From<Error>>(
        &mut self,
        u: usize,
        mut put: impl FnMut(StatePart, &[u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let _guard = tch::no_grad_guard();
        let p = self.place(u, self.saved_range(u))?;
        let (unit, len) = (&p.unit, p.len);
        with_bytes(&p.master, p.master_at, len, unit, |b| {
            put(StatePart::Master, b)
        })?;
        if let Some((m, v, at)) = &p.moments {
            with_bytes(m, *at, len, unit, |b| put(StatePart::ExpAvg, b))?;
            return with_bytes(v, *at, len, unit, |b| put(StatePart::ExpAvgSq, b));
        }
        match self
            .host_adam()?
            .moments_range(p.host_at, len as usize)
            .map_err(Error::from)?
        {
            MomentSlices::F32(m, v) => {
                put(StatePart::ExpAvg, as_bytes(m))?;
                put(StatePart::ExpAvgSq, as_bytes(v))
            }
            MomentSlices::Bf16(m, v) => {
                put(StatePart::ExpAvg, as_bytes(m))?;
                put(StatePart::ExpAvgSq, as_bytes(v))
            }
        }
    }

    /// Lets `fill` write unit `u`'s [`Engine::loaded_range`] of master, then moments (as
    /// fp32, read from a checkpoint) into the engine: in place where the destination is fp32
    /// host memory, else through a buffer copied over. Units are loaded in order from unit 0
    /// (which starts a load); call [`Engine::finish_load`] after the last unit.
    pub fn load_unit_with<E: From<Error>>(
        &mut self,
        u: usize,
        mut fill: impl FnMut(StatePart, &mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let _guard = tch::no_grad_guard();
        if u == 0 {
            // A new load: stale parameters an earlier (damaged) attempt read do not count.
            self.delay.loaded = None;
        }
        let p = self.place(u, self.loaded_range(u))?;
        let (unit, len) = (&p.unit, p.len);
        fill_tensor(&p.master, p.master_at, len, unit, |b| {
            fill(StatePart::Master, b)
        })?;
        if let Some((m, v, at)) = &p.moments {
            fill_tensor(m, *at, len, unit, |b| fill(StatePart::ExpAvg, b))?;
            return fill_tensor(v, *at, len, unit, |b| fill(StatePart::ExpAvgSq, b));
        }
        let (adam, n) = (self.host_adam()?, len as usize);
        if let Some((m, v)) = adam.moments_mut(p.host_at, n).map_err(Error::from)? {
            fill(StatePart::ExpAvg, m)?;
            return fill(StatePart::ExpAvgSq, v);
        }
        // bf16 moments: read as fp32, rounded to nearest even.
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        fill(StatePart::ExpAvg, &mut m)?;
        fill(StatePart::ExpAvgSq, &mut v)?;
        adam.load_range(p.host_at, &m, &v).map_err(Error::from)?;
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
        self.delay.updates = c.optimizer_steps;
        let gathers = matches!(self.cfg.stage, Stage::Zero1 | Stage::Zero2);
        match (&self.optimizer, &self.master) {
            // From the master, or from stale parameters a delayed checkpoint held.
            (Optimizer::Host(_), _) => self.finish_delayed_load()?,
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
            params_behind: self.params_behind(),
        })
    }
}

/// Calls `f` with the bytes of elements `[at, at + len)` of the 1-D tensor `t`: in place
/// for a host tensor, else through a host copy.
pub(crate) fn with_bytes<E: From<Error>>(
    t: &Tensor,
    at: i64,
    len: i64,
    unit: &str,
    f: impl FnOnce(&[u8]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if len == 0 {
        return f(&[]);
    }
    let part = t
        .f_narrow(0, at, len)
        .ctx("slice state for a checkpoint", unit)?;
    let host = match part.device() {
        Device::Cpu => part,
        _ => part
            .f_to_device(Device::Cpu)
            .ctx("copy state to the host", unit)?,
    };
    let n = len as usize * host.kind().elt_size_in_bytes();
    // SAFETY: `host` is a contiguous (a narrowed 1-D contiguous tensor) CPU tensor of `len`
    // elements, alive until the call returns; the engine is borrowed mutably and no update is
    // in flight, so nothing writes to it meanwhile.
    let bytes = unsafe { std::slice::from_raw_parts(host.data_ptr() as *const u8, n) };
    f(bytes)
}

/// Lets `f` write elements `[at, at + len)` of the 1-D tensor `t` as fp32: in place for a
/// host fp32 tensor, else into a buffer then copied over (any device, cast to its dtype).
pub(crate) fn fill_tensor<E: From<Error>>(
    t: &Tensor,
    at: i64,
    len: i64,
    unit: &str,
    f: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if len == 0 {
        return Ok(());
    }
    let mut part = t.f_narrow(0, at, len).ctx("slice state to load", unit)?;
    if part.device() == Device::Cpu && part.kind() == Kind::Float && part.is_contiguous() {
        // SAFETY: `part` is a contiguous fp32 CPU tensor of `len` elements, alive until the
        // call returns; the engine is borrowed mutably and no update is in flight, so nothing
        // else reads or writes it meanwhile.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(part.data_ptr() as *mut f32, len as usize) };
        return f(dst);
    }
    let mut buf = vec![0f32; len as usize];
    f(&mut buf)?;
    let from = Tensor::f_from_slice(&buf)
        .and_then(|b| b.f_to_kind(part.kind()))
        .ctx("load state", unit)?;
    part.f_copy_(&from).ctx("load state", unit)?;
    Ok(())
}

/// The bytes of a slice of plain numbers, in memory order (little-endian on the hosts zrun
/// runs on; see the check at the top of this file).
fn as_bytes<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: any initialised memory is valid as bytes; the length is the slice's size.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}
