//! Flat units: each unit's parameters in one padded buffer, a view table naming them, and
//! the contiguous slice of that buffer every rank owns.

use zrun_models::Unit;

/// One named parameter inside a unit's flat buffer.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct View {
    /// Full parameter name, e.g. `h.3.attn.qkv.weight`; checkpoints use it.
    pub name: String,
    /// Shape of the parameter.
    pub shape: Vec<i64>,
    /// Element offset inside the unit's flat buffer.
    pub offset: i64,
    /// Element count (product of `shape`).
    pub numel: i64,
    /// Whether weight decay applies (matrices and embeddings).
    pub decay: bool,
}

/// Elements every shard's length is a multiple of: 16 bytes of bf16 or fp16 (32 of fp32),
/// so each rank's slice, and each unit's slice in a rank's shard buffer, starts where
/// collective libraries' vectorised kernels want it (NCCL takes 2-byte aligned pointers, but
/// at a cost).
pub const SHARD_ALIGN: i64 = 8;

/// The view table of one unit, padded to a multiple of the world size times [`SHARD_ALIGN`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UnitLayout {
    /// Unit name (`embed`, `h.0`, ..., `head`).
    pub unit: String,
    /// Views in the unit's parameter order (the order its `forward` takes them).
    pub views: Vec<View>,
    /// Elements actually used by parameters.
    pub numel: i64,
    /// `numel` rounded up to a multiple of `world_size * SHARD_ALIGN`.
    pub padded: i64,
    /// World size the padding was computed for.
    pub world_size: i64,
}

impl UnitLayout {
    /// Lays out `unit`'s parameters for `world_size` ranks. In memory, parameters with weight
    /// decay come first, so a shard's decay region is at most one range per unit; the view
    /// table keeps the unit's own parameter order.
    pub fn new(unit: &dyn Unit, world_size: i64) -> UnitLayout {
        let specs = unit.params();
        let mut offsets = vec![0i64; specs.len()];
        let mut next = 0i64;
        for decay in [true, false] {
            for (i, s) in specs.iter().enumerate().filter(|(_, s)| s.decay == decay) {
                offsets[i] = next;
                next += s.numel();
            }
        }
        let views = specs
            .iter()
            .zip(offsets)
            .map(|(s, offset)| View {
                name: s.name.clone(),
                shape: s.shape.clone(),
                offset,
                numel: s.numel(),
                decay: s.decay,
            })
            .collect();
        let step = world_size * SHARD_ALIGN;
        let padded = (next + step - 1) / step * step;
        UnitLayout {
            unit: unit.name().to_string(),
            views,
            numel: next,
            padded,
            world_size,
        }
    }

    /// Elements each rank owns.
    pub fn shard_len(&self) -> i64 {
        self.padded / self.world_size
    }

    /// `(offset, len)` of rank `rank`'s slice of the flat buffer.
    pub fn shard_range(&self, rank: i64) -> (i64, i64) {
        (rank * self.shard_len(), self.shard_len())
    }

    /// The decay region `[0, d)` of the flat buffer intersected with `[start, start + len)`,
    /// relative to `start`; `None` when they do not meet.
    pub fn decay_range_in(&self, start: i64, len: i64) -> Option<(i64, i64)> {
        let d: i64 = self.views.iter().filter(|v| v.decay).map(|v| v.numel).sum();
        let end = d.min(start + len);
        (end > start).then(|| (0, end - start))
    }
}

/// Every unit's layout plus where this rank's slices sit in its contiguous shard buffer.
///
/// With hybrid sharding (`zero.shard_group` = G of W ranks) the model states are sharded
/// over a shard group of G consecutive ranks and replicated across the W/G groups: `rank`
/// and `world_size` are then the rank's position in its shard group and G (every shard
/// figure is per group), `replica` and `replicas` its group's index and the number of groups.
#[derive(Clone, Debug)]
pub struct ShardLayout {
    /// Unit layouts in model order.
    pub units: Vec<UnitLayout>,
    /// This rank's position in its shard group (its global rank without hybrid sharding).
    pub rank: i64,
    /// Ranks the model states are sharded over: the shard group's size (the world size
    /// without hybrid sharding).
    pub world_size: i64,
    /// This rank's shard group (replica) index, `global rank / world_size`: 0 without hybrid
    /// sharding.
    pub replica: i64,
    /// Shard groups, each holding a whole replica of the model states: 1 without hybrid
    /// sharding.
    pub replicas: i64,
    /// Offset of each unit's owned slice in the rank's contiguous shard buffer.
    pub shard_offsets: Vec<i64>,
    /// Offset of each unit's full flat buffer in a buffer of all units (stages 0-2).
    pub full_offsets: Vec<i64>,
}

impl ShardLayout {
    /// Layout of `units` for `rank` of `world_size`, sharded over all ranks.
    pub fn new(units: &[Box<dyn Unit>], rank: i64, world_size: i64) -> ShardLayout {
        ShardLayout::sharded(units, rank, world_size, 0, 1)
    }

    /// Layout of `units` for global `rank` of `world` ranks sharding over groups of `group`
    /// consecutive ranks (hybrid sharding): shard group `rank / group`, position
    /// `rank % group`. `group == world` is [`ShardLayout::new`]. Fails unless `group`
    /// divides `world`.
    pub fn hybrid(
        units: &[Box<dyn Unit>],
        rank: i64,
        world: i64,
        group: i64,
    ) -> crate::Result<ShardLayout> {
        if group < 1 || world < 1 || world % group != 0 {
            return Err(crate::Error::Unsupported(format!(
                "zero.shard_group = {group} does not divide the world size {world}: give a divisor of {world} (1 replicates the model states on every rank, {world} shards them over all ranks)"
            )));
        }
        if !(0..world).contains(&rank) {
            return Err(crate::Error::Unsupported(format!(
                "rank {rank} is not below the world size {world}"
            )));
        }
        Ok(ShardLayout::sharded(
            units,
            rank % group,
            group,
            rank / group,
            world / group,
        ))
    }

    /// Layout of `units` for position `rank` of a shard group of `world_size`, replica
    /// `replica` of `replicas`.
    fn sharded(
        units: &[Box<dyn Unit>],
        rank: i64,
        world_size: i64,
        replica: i64,
        replicas: i64,
    ) -> ShardLayout {
        let units: Vec<UnitLayout> = units
            .iter()
            .map(|u| UnitLayout::new(u.as_ref(), world_size))
            .collect();
        let prefix = |f: &dyn Fn(&UnitLayout) -> i64| {
            units
                .iter()
                .scan(0i64, |acc, u| {
                    let at = *acc;
                    *acc += f(u);
                    Some(at)
                })
                .collect::<Vec<_>>()
        };
        let shard_offsets = prefix(&|u| u.shard_len());
        let full_offsets = prefix(&|u| u.padded);
        ShardLayout {
            units,
            rank,
            world_size,
            replica,
            replicas,
            shard_offsets,
            full_offsets,
        }
    }

    /// Ranks in all: shard group size times shard groups.
    pub fn global_world_size(&self) -> i64 {
        self.world_size * self.replicas
    }

    /// This rank's global rank.
    pub fn global_rank(&self) -> i64 {
        self.replica * self.world_size + self.rank
    }

    /// Whether the run is this rank alone: a shard group of one without replicas, whose
    /// collectives are identities and whose shard of a unit is the whole unit.
    pub fn single_rank(&self) -> bool {
        self.world_size == 1 && self.replicas == 1
    }

    /// Elements of this rank's contiguous shard buffer (sum of owned slices).
    pub fn shard_numel(&self) -> i64 {
        self.units.iter().map(|u| u.shard_len()).sum()
    }

    /// Elements of all units' padded flat buffers together.
    pub fn full_numel(&self) -> i64 {
        self.units.iter().map(|u| u.padded).sum()
    }

    /// Parameters of the model (no padding).
    pub fn param_count(&self) -> i64 {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Decay ranges `(offset, len)` inside a full buffer of all units (stage 0's optimizer).
    pub fn full_decay_ranges(&self) -> Vec<(i64, i64)> {
        self.units
            .iter()
            .zip(&self.full_offsets)
            .filter_map(|(u, at)| u.decay_range_in(0, u.padded).map(|(off, n)| (at + off, n)))
            .collect()
    }

    /// Decay ranges `(offset, len)` inside this rank's contiguous shard buffer, merged where
    /// adjacent.
    pub fn shard_decay_ranges(&self) -> Vec<(i64, i64)> {
        let mut out: Vec<(i64, i64)> = Vec::new();
        for (u, at) in self.units.iter().zip(&self.shard_offsets) {
            let (start, len) = u.shard_range(self.rank);
            if let Some((off, n)) = u.decay_range_in(start, len) {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == at + off => last.1 += n,
                    _ => out.push((at + off, n)),
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zrun_models::{Gpt, GptConfig, Model};

    fn gpt() -> Gpt {
        Gpt::new(GptConfig {
            vocab_size: 61,
            seq_len: 16,
            n_layer: 3,
            n_head: 2,
            d_model: 14,
            init_std: 0.02,
            tied: false,
        })
        .unwrap()
    }

    #[test]
    fn views_tile_the_flat_buffer_with_decay_first() {
        let g = gpt();
        for w in 1..=5 {
            let l = ShardLayout::new(g.units(), 0, w);
            for u in &l.units {
                let mut spans: Vec<(i64, i64, bool)> = u
                    .views
                    .iter()
                    .map(|v| (v.offset, v.numel, v.decay))
                    .collect();
                spans.sort();
                let mut next = 0;
                for (off, n, _) in &spans {
                    assert_eq!(*off, next, "views of {} overlap or leave holes", u.unit);
                    next += n;
                }
                assert_eq!(next, u.numel);
                // Decay params come first in memory.
                let first_plain = spans.iter().position(|s| !s.2).unwrap_or(spans.len());
                assert!(spans[first_plain..].iter().all(|s| !s.2));
                assert_eq!(u.padded % (w * SHARD_ALIGN), 0);
                assert!(u.padded - u.numel < w * SHARD_ALIGN);
            }
            assert_eq!(l.param_count(), g.param_count());
        }
    }

    #[test]
    fn a_hybrid_layout_shards_within_its_group_and_checks_the_group_divides_the_world() {
        let g = gpt();
        let (w, group) = (6, 3);
        for r in 0..w {
            let h = ShardLayout::hybrid(g.units(), r, w, group).unwrap();
            let plain = ShardLayout::new(g.units(), r % group, group);
            assert_eq!((h.rank, h.world_size), (r % group, group));
            assert_eq!((h.replica, h.replicas), (r / group, w / group));
            assert_eq!((h.global_rank(), h.global_world_size()), (r, w));
            assert_eq!(h.units, plain.units, "rank {r}: the group's unit layouts");
            assert_eq!(h.shard_offsets, plain.shard_offsets);
            assert_eq!(h.shard_numel(), plain.shard_numel());
            // Sharded over all ranks, `hybrid` is `new`.
            let all = ShardLayout::hybrid(g.units(), r, w, w).unwrap();
            let new = ShardLayout::new(g.units(), r, w);
            assert_eq!((all.rank, all.world_size), (new.rank, new.world_size));
            assert_eq!((all.replica, all.replicas), (0, 1));
            assert_eq!((new.replica, new.replicas), (0, 1));
            assert_eq!(all.units, new.units);
        }
        for (world, group) in [(6, 4), (4, 0), (4, 8)] {
            let e = ShardLayout::hybrid(g.units(), 0, world, group)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("zero.shard_group = {group}"))
                    && e.contains(&format!("world size {world}")),
                "{e}"
            );
        }
    }

    #[test]
    fn shard_ranges_partition_each_unit_and_decay_ranges_match_views() {
        let g = gpt();
        let w = 3;
        for u in 0..g.units().len() {
            let mut covered = 0;
            for r in 0..w {
                let l = ShardLayout::new(g.units(), r, w);
                let (start, len) = l.units[u].shard_range(r);
                assert_eq!(start, covered);
                covered += len;
            }
            assert_eq!(covered, ShardLayout::new(g.units(), 0, w).units[u].padded);
        }
        // Every element of a rank's shard is in a decay range iff it belongs to a decay view.
        for r in 0..w {
            let l = ShardLayout::new(g.units(), r, w);
            let mut expected = vec![false; l.shard_numel() as usize];
            for (u, at) in l.units.iter().zip(&l.shard_offsets) {
                let (start, len) = u.shard_range(r);
                for v in u.views.iter().filter(|v| v.decay) {
                    for i in v.offset.max(start)..(v.offset + v.numel).min(start + len) {
                        expected[(at + i - start) as usize] = true;
                    }
                }
            }
            let mut got = vec![false; expected.len()];
            for (off, n) in l.shard_decay_ranges() {
                got[off as usize..(off + n) as usize]
                    .iter_mut()
                    .for_each(|x| *x = true);
            }
            assert_eq!(got, expected, "rank {r}");
        }
    }
}
