//! Deterministic parameter init straight into flat buffers, for any slice of any unit.

use crate::layout::ShardLayout;
use crate::{Context, Result};
use tch::{Device, Kind, Tensor};
use zrun_models::Model;

/// Which part of every unit a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Extent {
    /// Every unit's whole padded buffer, at `full_offsets`.
    Full,
    /// This rank's slice of every unit, at `shard_offsets`.
    Shard,
}

/// An fp32 CPU buffer holding `extent` of every unit, filled by the models' counter-based
/// init, so no rank materialises more than the extent it keeps.
pub(crate) fn init_buffer(
    model: &dyn Model,
    layout: &ShardLayout,
    seed: u64,
    extent: Extent,
) -> Result<Tensor> {
    let n = match extent {
        Extent::Full => layout.full_numel(),
        Extent::Shard => layout.shard_numel(),
    };
    let buf = Tensor::f_zeros([n], (Kind::Float, Device::Cpu)).ctx("allocate parameters", "-")?;
    // SAFETY: `buf` is a freshly allocated, contiguous fp32 CPU tensor of `n` elements that
    // nothing else references until this function returns; the slice does not outlive it.
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
    Ok(buf)
}
