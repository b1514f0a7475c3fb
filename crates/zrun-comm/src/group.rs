//! Who belongs to a sub-communicator ([`crate::Communicator::split`]), computed the same way
//! on every rank from every rank's `(color, key)`.

/// `v` (a color or key) as a C `int` of `lib` (MPI, NCCL), or an error naming rank `me`.
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) fn c_int(me: usize, lib: &str, what: &str, v: usize) -> Result<i32, crate::Error> {
    i32::try_from(v).map_err(|_| crate::Error::InvalidArgument {
        rank: me,
        op: "split",
        detail: format!("{what} {v} is over {lib}'s limit of 2^31 - 1"),
    })
}

/// The ranks (of the communicator being split) that passed `color`, ordered by their key,
/// ties broken by rank: position `i` of the result is the new communicator's rank `i`.
/// `pairs[q]` is rank q's `(color, key)`.
pub(crate) fn members(pairs: &[(u64, u64)], color: u64) -> Vec<usize> {
    let mut m: Vec<usize> = (0..pairs.len()).filter(|&q| pairs[q].0 == color).collect();
    m.sort_by_key(|&q| (pairs[q].1, q));
    m
}

/// A value every member of a new group derives alike and that differs between groups: the
/// parent's tag, the position of the split in the parent's issue order and the color (the
/// tcp backend marks each message with it, so a message of one group is never taken for
/// another's). Never 0, the world's tag.
pub(crate) fn child_tag(parent: u64, seq: u64, color: u64) -> u64 {
    mix(parent ^ mix(seq ^ mix(color.wrapping_add(0x5eed)))).max(1)
}

/// SplitMix64's finaliser: a fixed, well-spread 64-bit mix (the same on every host).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_have_the_color_and_follow_key_then_rank() {
        // ranks 0..6: color r % 2, key reversing the order, ranks 4 and 2 tie on key 1
        let pairs = [(0, 9), (1, 5), (0, 1), (1, 4), (0, 1), (1, 0)];
        assert_eq!(members(&pairs, 0), vec![2, 4, 0]);
        assert_eq!(members(&pairs, 1), vec![5, 3, 1]);
        assert!(members(&pairs, 7).is_empty());
        // contiguous shard groups and strided replica groups of a world of 4
        let shard: Vec<(u64, u64)> = (0..4).map(|r| (r / 2, r)).collect();
        assert_eq!(members(&shard, 1), vec![2, 3]);
        let replica: Vec<(u64, u64)> = (0..4).map(|r| (r % 2, r)).collect();
        assert_eq!(members(&replica, 1), vec![1, 3]);
    }

    #[test]
    fn tags_differ_between_siblings_splits_and_nesting() {
        let mut seen = std::collections::HashSet::new();
        for parent in [0u64, 1, child_tag(0, 3, 0)] {
            for seq in 0..20 {
                for color in 0..20 {
                    let t = child_tag(parent, seq, color);
                    assert_ne!(t, 0);
                    assert!(seen.insert(t), "tag {t} repeats");
                }
            }
        }
        assert_eq!(child_tag(0, 3, 1), child_tag(0, 3, 1));
    }
}
