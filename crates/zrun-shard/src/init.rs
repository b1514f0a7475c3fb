//! Deterministic parameter init straight into flat buffers, for any slice of any unit.

use crate::layout::ShardLayout;
use crate::{Context, Result};
use tch::{Device, Kind, TchError, Tensor};
use zrun_models::Model;

/// Which part of every unit a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Extent {
    /// Every unit's whole padded buffer, at `full_offsets`.
    Full,
    /// This rank's slice of every unit, at `shard_offsets`.
    Shard,
}

/// Elements of a buffer holding `extent` of every unit.
fn extent_numel(layout: &ShardLayout, extent: Extent) -> i64 {
    match extent {
        Extent::Full => layout.full_numel(),
        Extent::Shard => layout.shard_numel(),
    }
}

/// An fp32 CPU buffer holding `extent` of every unit, filled by the models' counter-based
/// init, so no rank materialises more than the extent it keeps.
pub(crate) fn init_buffer(
    model: &dyn Model,
    layout: &ShardLayout,
    seed: u64,
    extent: Extent,
) -> Result<Tensor> {
    let n = extent_numel(layout, extent);
    let buf = Tensor::f_zeros([n], (Kind::Float, Device::Cpu)).ctx("allocate parameters", "-")?;
    init_into(model, layout, seed, extent, &buf)?;
    Ok(buf)
}

/// Fills `buf`, a zeroed fp32 CPU buffer holding `extent` of every unit (the padding stays
/// zero), with the models' counter-based init: a buffer that is kept (the offloaded master)
/// is initialised where it lives, with no temporary of its size beside it.
pub(crate) fn init_into(
    model: &dyn Model,
    layout: &ShardLayout,
    seed: u64,
    extent: Extent,
    buf: &Tensor,
) -> Result<()> {
    let n = extent_numel(layout, extent);
    if buf.device() != Device::Cpu
        || buf.kind() != Kind::Float
        || !buf.is_contiguous()
        || buf.numel() as i64 != n
    {
        return Err(crate::Error::Unsupported(format!(
            "initialise parameters into a {:?} {:?} buffer of {} elements: want a contiguous fp32 host buffer of {n}",
            buf.device(),
            buf.kind(),
            buf.numel()
        )));
    }
    // SAFETY: `buf` is a contiguous fp32 CPU tensor of `n` elements (checked above) that the
    // caller lends for this call alone; the slice does not outlive it.
    let data = unsafe { std::slice::from_raw_parts_mut(buf.data_ptr() as *mut f32, n as usize) };
    for (u, (unit, l)) in model.units().iter().zip(&layout.units).enumerate() {
        let (start, len, at) = match extent {
            Extent::Full => (0, l.padded, layout.full_offsets[u]),
            Extent::Shard => {
                let (s, len) = l.shard_range(layout.rank);
                (s, len, layout.shard_offsets[u])
            }
        };
        let dst = &mut data[at as usize..(at + len) as usize];
        for (spec, v) in unit.params().iter().zip(&l.views) {
            // Intersection of this parameter [v.offset, v.offset + numel) with the extent.
            let lo = v.offset.max(start);
            let hi = (v.offset + v.numel).min(start + len);
            if lo < hi {
                let out = &mut dst[(lo - start) as usize..(hi - start) as usize];
                spec.init_into(seed, (lo - v.offset) as u64, out);
            }
        }
    }
    Ok(())
}

/// Elements cast on the host per copy to the device in [`place`].
const PLACE_CHUNK: i64 = 1 << 26;

/// The fp32 host buffer `t` as `kind` on `dev`: cast on the host a chunk at a time and
/// copied in, so a device never holds an fp32 copy beside the compute dtype's (at stage 2
/// over 8 ranks that copy would be more than the step's peak) and the host no whole second
/// copy.
pub(crate) fn place(t: Tensor, kind: Kind, dev: Device) -> std::result::Result<Tensor, TchError> {
    place_in_chunks(t, kind, dev, PLACE_CHUNK)
}

/// As [`place`], from a buffer that stays the caller's: a new tensor, never an alias of `t`.
pub(crate) fn place_copy(
    t: &Tensor,
    kind: Kind,
    dev: Device,
) -> std::result::Result<Tensor, TchError> {
    if t.kind() == kind && t.device() == dev {
        return t.f_empty_like().and_then(|mut p| p.f_copy_(t).map(|_| p));
    }
    place(t.shallow_clone(), kind, dev)
}

fn place_in_chunks(
    t: Tensor,
    kind: Kind,
    dev: Device,
    chunk: i64,
) -> std::result::Result<Tensor, TchError> {
    if t.kind() == kind {
        return t.f_to_device(dev);
    }
    let n = t.numel() as i64;
    let out = Tensor::f_empty([n], (kind, dev))?;
    for off in (0..n).step_by(chunk as usize) {
        let len = chunk.min(n - off);
        let src = t.f_narrow(0, off, len)?;
        let mut dst = out.f_narrow(0, off, len)?;
        if dev == Device::Cpu {
            // On the host the copy casts as it goes: no chunk beside it.
            dst.f_copy_(&src)?;
        } else {
            dst.f_copy_(&src.f_to_kind(kind)?)?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placing_in_chunks_casts_every_element_as_a_whole_cast_does() {
        let t = Tensor::randn([1000], (Kind::Float, Device::Cpu)) * 1e3;
        for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
            let want = t.to_kind(kind);
            for chunk in [1, 7, 999, 1000, 4096] {
                let got = place_in_chunks(t.copy(), kind, Device::Cpu, chunk).unwrap();
                assert_eq!(got.kind(), kind);
                assert!(got.equal(&want), "{kind:?} in chunks of {chunk}");
            }
        }
    }

    #[test]
    fn a_placed_copy_never_aliases_its_source() {
        let t = Tensor::randn([100], (Kind::Float, Device::Cpu));
        for kind in [Kind::Float, Kind::BFloat16] {
            let got = place_copy(&t, kind, Device::Cpu).unwrap();
            assert_ne!(got.data_ptr(), t.data_ptr(), "{kind:?}");
            assert!(got.equal(&t.to_kind(kind)), "{kind:?}");
        }
    }
}
