//! A rank's shard seen as a list of 1-D tensor views laid end to end.
//!
//! At ZeRO stages 1-2 the fp32 parameters a rank owns are one slice of each unit's full
//! buffer, not one contiguous tensor; the optimizer walks such lists in lockstep with the
//! contiguous moment buffers.

use crate::{torch, Result};
use tch::Tensor;

/// 1-D views whose concatenation is one logical buffer.
pub struct Segments<'a> {
    parts: &'a [Tensor],
    /// Start of each part in the logical buffer, plus the total at the end.
    starts: Vec<i64>,
}

impl<'a> Segments<'a> {
    /// Wraps `parts` (each 1-D).
    pub fn new(parts: &'a [Tensor]) -> Segments<'a> {
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut at = 0;
        starts.push(0);
        for p in parts {
            at += p.numel() as i64;
            starts.push(at);
        }
        Segments { parts, starts }
    }

    /// The parts, in order.
    pub fn parts(&self) -> &'a [Tensor] {
        self.parts
    }

    /// Total elements.
    pub fn len(&self) -> i64 {
        *self.starts.last().unwrap_or(&0)
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offsets inside `[off, off + len)` where a part ends (part boundaries).
    pub fn cuts(&self, off: i64, len: i64) -> impl Iterator<Item = i64> + '_ {
        self.starts
            .iter()
            .copied()
            .filter(move |&s| s > off && s < off + len)
    }

    /// The view of `[off, off + len)`, which must lie inside one part.
    pub fn view(&self, off: i64, len: i64) -> Result<Tensor> {
        let i = self.starts.partition_point(|&s| s <= off) - 1;
        torch(
            "segment view",
            self.parts[i].f_narrow(0, off - self.starts[i], len),
        )
    }

    /// Calls `f(offset, len)` for the pieces of `[off, off + len)` split at the part
    /// boundaries of every list in `lists`.
    pub fn pieces(
        lists: &[&Segments],
        off: i64,
        len: i64,
        mut f: impl FnMut(i64, i64) -> Result<()>,
    ) -> Result<()> {
        let mut cuts: Vec<i64> = lists.iter().flat_map(|s| s.cuts(off, len)).collect();
        cuts.push(off + len);
        cuts.sort_unstable();
        cuts.dedup();
        let mut at = off;
        for c in cuts {
            f(at, c - at)?;
            at = c;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_every_boundary() {
        let a = [
            Tensor::zeros([3], tch::kind::FLOAT_CPU),
            Tensor::zeros([5], tch::kind::FLOAT_CPU),
        ];
        let b = [
            Tensor::zeros([6], tch::kind::FLOAT_CPU),
            Tensor::zeros([2], tch::kind::FLOAT_CPU),
        ];
        let (sa, sb) = (Segments::new(&a), Segments::new(&b));
        let mut got = vec![];
        Segments::pieces(&[&sa, &sb], 1, 7, |o, l| {
            got.push((o, l));
            Ok(())
        })
        .unwrap();
        assert_eq!(got, vec![(1, 2), (3, 3), (6, 2)]);
        assert_eq!(sa.view(4, 2).unwrap().numel(), 2);
    }
}
