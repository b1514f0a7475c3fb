//! Sub-communicators of the `tcp` backend: views over the world's sockets (every rank already
//! has a socket to every other, [`super::mesh`]), run on the world's communication thread.
//!
//! A group is what ring.rs and cma.rs read of [`State`] (rank, size, process ids, sequence
//! number, message tag) plus the world rank of each member; [`State::in_group`] swaps it in
//! for the length of one job. Messages carry the group's tag and its own sequence number, so
//! a message of one communicator is never taken for another's (it fails as a mismatch).

use super::{ctx, header, State};
use crate::buf::DType;
use crate::Error;

/// One sub-communicator's view, kept in [`State::groups`] while none of its jobs runs (and
/// holding the world's view while one does).
#[derive(Default)]
pub(crate) struct Group {
    rank: usize,
    world: usize,
    /// Process ids of the members when cross-memory copies work (the world's, restricted).
    pids: Option<Vec<i32>>,
    seq: u64,
    tag: u64,
    /// World rank of each member.
    members: Option<Vec<usize>>,
}

impl Group {
    fn swap(&mut self, st: &mut State) {
        std::mem::swap(&mut self.rank, &mut st.rank);
        std::mem::swap(&mut self.world, &mut st.world);
        std::mem::swap(&mut self.pids, &mut st.pids);
        std::mem::swap(&mut self.seq, &mut st.seq);
        std::mem::swap(&mut self.tag, &mut st.tag);
        std::mem::swap(&mut self.members, &mut st.members);
    }
}

impl State {
    /// Runs `f` on the view of group `g` (`None`: the world), then restores the world's view,
    /// also when `f` fails; errors then name peers by their world rank.
    pub(crate) fn in_group<T>(
        &mut self,
        g: Option<usize>,
        f: impl FnOnce(&mut State) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let Some(i) = g else {
            return f(self);
        };
        // Taken out (a placeholder in its slot) so that a split inside `f` may push groups.
        let mut view = std::mem::take(&mut self.groups[i]);
        view.swap(self);
        let r = f(self).map_err(|e| self.world_ranks_in(e));
        view.swap(self);
        self.groups[i] = view;
        r
    }

    /// `e` with the peer, a rank of the running group, replaced by its world rank.
    fn world_ranks_in(&self, e: Error) -> Error {
        let Some(m) = &self.members else {
            return e;
        };
        let w = |q: usize| m.get(q).copied().unwrap_or(q);
        match e {
            Error::PeerLost {
                rank,
                op,
                bytes,
                peer,
                detail,
            } => Error::PeerLost {
                rank,
                op,
                bytes,
                peer: w(peer),
                detail,
            },
            Error::Mismatch {
                rank,
                op,
                seq,
                peer,
                theirs,
            } => Error::Mismatch {
                rank,
                op,
                seq,
                peer: w(peer),
                theirs,
            },
            Error::Timeout {
                rank,
                op,
                bytes,
                peer,
                timeout,
            } => Error::Timeout {
                rank,
                op,
                bytes,
                peer: peer.parse().map_or(peer, |q| w(q).to_string()),
                timeout,
            },
            e => e,
        }
    }
}

/// The split of communicator `parent` (`None`: the world), on the communication thread: the
/// members exchange their colors and keys over the sockets (one all-to-all of headers), and
/// each rank records its group. Returns the group's index in [`State::groups`] (`None` for a
/// group of one, which needs no view), this rank's place in it and its size.
pub(super) fn split(
    st: &mut State,
    parent: Option<usize>,
    op: &'static str,
    color: u64,
    key: u64,
) -> Result<(Option<usize>, usize, usize), Error> {
    let (members, rank, tag) = st.in_group(parent, |st| {
        let h = header(8, DType::F32, 0, 0)(st);
        let c = ctx(st, op, 0);
        let others = st.others();
        let mut colors = st.exchange(&c, &h, color, &others, &others)?;
        let mut keys = st.exchange(&c, &h, key, &others, &others)?;
        colors[st.rank] = color;
        keys[st.rank] = key;
        let pairs: Vec<(u64, u64)> = colors.into_iter().zip(keys).collect();
        let mine = crate::group::members(&pairs, color);
        let rank = mine.iter().position(|&q| q == st.rank).unwrap_or(0);
        let world_ranks = mine
            .iter()
            .map(|&q| st.members.as_ref().map_or(q, |m| m[q]))
            .collect::<Vec<_>>();
        Ok((
            world_ranks,
            rank,
            crate::group::child_tag(st.tag, h.seq, color),
        ))
    })?;
    let world = members.len();
    if world == 1 {
        return Ok((None, 0, 1));
    }
    // Between jobs the state holds the world's view: its process ids are the world's.
    let pids = st
        .pids
        .as_ref()
        .map(|p| members.iter().map(|&q| p[q]).collect());
    st.groups.push(Group {
        rank,
        world,
        pids,
        seq: 0,
        tag,
        members: Some(members),
    });
    Ok((Some(st.groups.len() - 1), rank, world))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::SEG;
    use std::time::Duration;

    /// A world of 4 seen from rank 1, without sockets, with the group {2, 1} split off.
    fn state() -> State {
        let mut st = State {
            me: 1,
            rank: 1,
            world: 4,
            timeout: Duration::from_secs(1),
            peers: (0..4).map(|_| None).collect(),
            pids: Some(vec![10, 11, 12, 13]),
            seq: 7,
            tag: 0,
            members: None,
            groups: Vec::new(),
            scratch: vec![0u64; SEG / 8],
            acc: Vec::new(),
            ring_bufs: [Vec::new(), Vec::new()],
        };
        st.groups.push(Group {
            rank: 1,
            world: 2,
            pids: Some(vec![12, 11]),
            seq: 0,
            tag: 99,
            members: Some(vec![2, 1]),
        });
        st
    }

    #[test]
    fn a_job_sees_its_group_and_the_world_view_comes_back() {
        let mut st = state();
        let seen = st
            .in_group(Some(0), |st| {
                st.seq += 1;
                Ok((st.rank, st.world, st.tag, st.pids.clone(), st.others()))
            })
            .unwrap();
        assert_eq!(seen, (1, 2, 99, Some(vec![12, 11]), vec![0]));
        assert_eq!((st.rank, st.world, st.seq, st.tag), (1, 4, 7, 0));
        assert_eq!(st.pids, Some(vec![10, 11, 12, 13]));
        assert!(st.members.is_none());
        let seq = st.in_group(Some(0), |st| Ok(st.seq)).unwrap();
        assert_eq!(seq, 1, "the group keeps its own count");
    }

    #[test]
    fn errors_of_a_group_name_world_ranks_and_restore_the_view() {
        let mut st = state();
        let e = st
            .in_group(Some(0), |st| {
                let c = ctx(st, "all_reduce", 8);
                st.peer(&c, 0).map(|_| ())
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1, all_reduce of 8 bytes: lost peer rank 2"),
            "{e}"
        );
        let e = st
            .in_group(Some(0), |st| {
                let c = ctx(st, "barrier", 0);
                Err::<(), _>(c.io(0, "receive", std::io::ErrorKind::TimedOut.into()))
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("peer rank 2 did not answer"), "{e}");
        assert_eq!((st.rank, st.world), (1, 4));
    }
}
