//! The nccl backend's meeting before `ncclCommInitRank`, through the rendezvous store: every
//! rank marks its arrival, rank 0 publishes NCCL's unique id, and each rank waits for all of
//! it up to `dist.timeout_s`.
//!
//! `ncclCommInitRank` blocks until every rank has called it and never says who is missing.
//! Meeting first turns a rank that never comes into an error listing it, and leaves NCCL's
//! own init (which has the same deadline, see nccl.rs) to ranks that all arrived. Kept apart
//! from nccl.rs so that it builds, and is tested, without the `cuda` feature.

use std::ops::Range;
use std::time::Duration;

use crate::error::{count, list_ranges};
use crate::{Error, StoreClient};

/// Bytes of NCCL's `ncclUniqueId`.
pub(crate) const ID_BYTES: usize = 128;

/// What the store's keys of one meeting are called.
struct Keys {
    /// The restart round ([`crate::restart_round`]) and the communicator's number within it.
    gen: String,
}

impl Keys {
    fn id(&self) -> String {
        format!("zrun/nccl/{}/id", self.gen)
    }

    fn arrived(&self, rank: usize) -> String {
        format!("zrun/nccl/{}/arrived/{rank}", self.gen)
    }
}

/// The ranks missing from a meeting of `world` ranks, from the missing indices of its keys
/// (`arrived/0..world`, then the id, whose absence means rank 0's), as sorted, disjoint
/// ranges.
fn ranks(missing: &[Range<usize>], world: usize) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let id_missing = missing.iter().any(|r| r.contains(&world));
    let clipped = missing
        .iter()
        .map(|r| r.start.min(world)..r.end.min(world))
        .filter(|r| !r.is_empty());
    for r in id_missing.then_some(0..1).into_iter().chain(clipped) {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Meets the other ranks of this communicator in restart round `round`: marks `rank` as arrived (rank 0 first
/// publishes the id `make_id` returns), waits up to `timeout` for all `world` ranks and
/// rank 0's id, and returns that id. A rank that did not arrive in time is named in the error.
pub(crate) fn meet(
    store: &StoreClient,
    round: u64,
    rank: usize,
    world: usize,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<Vec<u8>, Error>,
) -> Result<Vec<u8>, Error> {
    // The n-th NCCL communicator of this round on every rank: a restarted group keeps the
    // store, and a rank that died before counting must not shift the next round's numbers.
    let n = store.add(&format!("zrun/nccl/gen/{round}/{rank}"), 1)?;
    let keys = Keys {
        gen: format!("{round}.{n}"),
    };
    if rank == 0 {
        store.set(&keys.id(), &make_id()?)?;
    }
    store.set(&keys.arrived(rank), b"1")?;
    let mut all: Vec<String> = (0..world).map(|r| keys.arrived(r)).collect();
    all.push(keys.id());
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    match store.wait(&refs, timeout) {
        Ok(()) => {}
        Err(Error::StoreTimeout { missing, .. }) => {
            let absent = ranks(&missing, world);
            return Err(Error::Backend {
                rank,
                backend: "nccl",
                op: "meeting before ncclCommInitRank",
                detail: format!(
                    "rank(s) {} ({} of {world}) did not arrive within {} s: they did not start, failed before connecting (see their logs), or dist.timeout_s is too short",
                    list_ranges(&absent),
                    count(&absent),
                    timeout.as_secs_f64()
                ),
            });
        }
        Err(e) => return Err(e),
    }
    let id = store.get(&keys.id())?;
    if id.len() != ID_BYTES {
        return Err(Error::Backend {
            rank,
            backend: "nccl",
            op: "ncclUniqueId",
            detail: format!(
                "the store holds {} bytes for rank 0's NCCL id, want {ID_BYTES}; every rank must run the same zrun",
                id.len()
            ),
        });
    }
    Ok(id)
}

#[cfg(test)]
// Lists of one range of ranks or keys are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::StoreServer;

    fn store() -> (StoreServer, String) {
        let s = StoreServer::start("127.0.0.1:0", "t").unwrap();
        let a = format!("127.0.0.1:{}", s.port());
        (s, a)
    }

    fn client(addr: &str) -> StoreClient {
        StoreClient::connect(addr, "t", Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn missing_keys_name_ranks_and_the_id_is_rank_zeros() {
        // world of 6: keys arrived/0..6, then the id (index 6)
        assert_eq!(ranks(&[0..1, 2..3, 5..7], 6), vec![0..1, 2..3, 5..6]);
        assert_eq!(ranks(&[2..3, 6..7], 6), vec![0..1, 2..3]);
        assert_eq!(ranks(&[1..7], 6), vec![0..6]);
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let (_s, addr) = store();
        let world = 3;
        let threads: Vec<_> = (0..world)
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    meet(&client(&addr), 0, r, world, Duration::from_secs(10), || {
                        Ok(vec![7u8; ID_BYTES])
                    })
                    .unwrap()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), vec![7u8; ID_BYTES]);
        }
    }

    #[test]
    fn ranks_that_never_arrive_are_named_within_the_deadline() {
        let (_s, addr) = store();
        // world of 4, only ranks 1 and 3 come: rank 0 (and its id) and rank 2 are missing
        let threads: Vec<_> = [1usize, 3]
            .into_iter()
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let t = std::time::Instant::now();
                    let e = meet(&client(&addr), 0, r, 4, Duration::from_millis(300), || {
                        unreachable!("only rank 0 makes the id")
                    })
                    .unwrap_err();
                    assert!(t.elapsed() < Duration::from_secs(5));
                    e.to_string()
                })
            })
            .collect();
        for t in threads {
            let e = t.join().unwrap();
            assert!(
                e.contains("rank(s) 0, 2 (2 of 4) did not arrive")
                    && e.contains("backend nccl")
                    && e.contains("ncclCommInitRank"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_second_communicator_meets_under_a_new_generation() {
        let (_s, addr) = store();
        for round in 0..2u8 {
            let threads: Vec<_> = (0..2)
                .map(|r| {
                    let addr = addr.clone();
                    std::thread::spawn(move || {
                        meet(&client(&addr), 0, r, 2, Duration::from_secs(10), || {
                            Ok(vec![round; ID_BYTES])
                        })
                        .unwrap()
                    })
                })
                .collect();
            for t in threads {
                assert_eq!(t.join().unwrap(), vec![round; ID_BYTES]);
            }
        }
    }

    #[test]
    fn a_round_after_a_rank_died_before_meeting_meets_under_one_generation() {
        let (_s, addr) = store();
        // Round 0: rank 0 counts its meeting and waits; rank 1 dies before it counts.
        let e = meet(&client(&addr), 0, 0, 2, Duration::from_millis(200), || {
            Ok(vec![1u8; ID_BYTES])
        })
        .unwrap_err();
        assert!(e.to_string().contains("rank(s) 1 (1 of 2)"), "{e}");
        // Round 1, the restarted group: both ranks meet again on the same store.
        let threads: Vec<_> = (0..2)
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    meet(&client(&addr), 1, r, 2, Duration::from_secs(5), || {
                        Ok(vec![2u8; ID_BYTES])
                    })
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), vec![2u8; ID_BYTES]);
        }
    }
}
