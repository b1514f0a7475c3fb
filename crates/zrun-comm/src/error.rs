//! The crate's error type.

use std::ops::Range;
use std::time::Duration;

/// Missing keys a [`Error::StoreTimeout`] names (the rest are counted).
pub(crate) const NAMED_KEYS: usize = 4;
/// Ranges a list of ranks or nodes shows before it only counts the rest ([`list_ranges`]).
const SHOWN_RANGES: usize = 8;

/// Everything that can go wrong while discovering the topology, talking to the rendezvous
/// store or running a collective.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The rank variables in the environment are missing, malformed or contradict each other.
    #[error("topology from the environment ({source_name}): {detail}; {hint}")]
    Topology {
        /// Which flavour of variables was being read (zrun/torchrun, OpenMPI, PMI/MPICH, Slurm).
        source_name: String,
        /// What is wrong, naming the variables.
        detail: String,
        /// What to do, for the launcher whose variables these are
        /// ([`crate::TopologySource::hint`]).
        hint: &'static str,
    },

    /// The rendezvous store could not be reached.
    #[error("rendezvous store at {addr}: cannot connect within {timeout:?}: {detail}; check that rank 0 or the launcher runs and that MASTER_ADDR/MASTER_PORT point at it")]
    StoreUnreachable {
        /// `host:port` of the store.
        addr: String,
        /// How long connecting was retried.
        timeout: Duration,
        /// The last connection error.
        detail: String,
    },

    /// The store refused this client's token.
    #[error("rendezvous store at {addr} refused this client: wrong job token; every node and rank must present the same token: export the same ZRUN_JOB_TOKEN on every node, or (zrun --nnodes > 1 without it) give every node the same secret file (ZRUN_SECRET_FILE, default ~/.config/zrun/secret: a home directory the nodes share, or node 0's file copied with mode 0600) and the same --run-id")]
    StoreRefused {
        /// `host:port` of the store.
        addr: String,
    },

    /// What answers at the store's address is not a zrun rendezvous store.
    #[error("rendezvous store at {addr}: what answers there is not a zrun store (it sent {answer:?}): another service listens on that port; pick a MASTER_PORT (zrun: --master-port) that nothing else uses")]
    NotAStore {
        /// `host:port` that was dialled.
        addr: String,
        /// The first bytes it sent, printable ASCII only.
        answer: String,
    },

    /// The store's host name does not resolve at all (not a passing DNS failure).
    #[error("rendezvous store at {addr}: host {host:?} does not resolve ({detail}); set MASTER_ADDR (zrun: --master-addr) to rank 0's host name or IP")]
    StoreHost {
        /// `host:port` of the store.
        addr: String,
        /// The host part.
        host: String,
        /// The resolver's answer.
        detail: String,
    },

    /// Keys did not appear in the store before the deadline.
    #[error("rendezvous store at {addr}: {} did not appear within {}; a rank did not start or stopped early, or dist.timeout_s is too short", missing_keys(.names, .missing, .asked), seconds(.timeout))]
    StoreTimeout {
        /// `host:port` of the store.
        addr: String,
        /// The keys still missing, as sorted, disjoint ranges of indices into the keys waited
        /// for.
        missing: Vec<Range<usize>>,
        /// The first few missing keys by name (at most 4), for the message.
        names: Vec<String>,
        /// How many keys were waited for.
        asked: usize,
        /// The deadline that passed.
        timeout: Duration,
    },

    /// Ranks did not join this communicator through the store before the deadline.
    #[error("rank {rank}: {} ({} of {world}) did not join within {} at the rendezvous store {addr}; they did not start or failed before connecting (see their logs), or dist.timeout_s is too short", ranks_named(.missing), count(.missing), seconds(.timeout))]
    NotJoined {
        /// This rank.
        rank: usize,
        /// `host:port` of the store.
        addr: String,
        /// The ranks that did not join, as sorted, disjoint ranges.
        missing: Vec<Range<usize>>,
        /// Ranks in the communicator.
        world: usize,
        /// The deadline that passed.
        timeout: Duration,
    },

    /// The secret file that multi-node job tokens are derived from is unusable.
    #[error("secret file {path}: {detail}")]
    Secret {
        /// The file (`ZRUN_SECRET_FILE`, default `~/.config/zrun/secret`).
        path: String,
        /// What is wrong and what to do.
        detail: String,
    },

    /// An I/O failure or a malformed message while talking to the store.
    #[error("rendezvous store at {addr}, {op}: {detail}")]
    Store {
        /// `host:port` of the store.
        addr: String,
        /// The store operation (connect, set, get, wait, add, serve).
        op: &'static str,
        /// What failed.
        detail: String,
    },

    /// A tensor passed to a collective has the wrong dtype, device, layout or size.
    #[error("rank {rank}, {op}: invalid argument: {detail}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// What is wrong with which tensor.
        detail: String,
    },

    /// A peer did not answer before the deadline.
    #[error("rank {rank}, {op} of {bytes} bytes: peer rank {peer} did not answer within {timeout:?}; that rank is stuck or dead (see its log), or dist.timeout_s is too short")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// Bytes of the collective's buffer on this rank.
        bytes: usize,
        /// The rank that did not answer, or the string `unknown`.
        peer: String,
        /// The deadline.
        timeout: Duration,
    },

    /// A peer closed its connection or the connection broke.
    #[error("rank {rank}, {op} of {bytes} bytes: lost peer rank {peer}: {detail}; that rank failed or was killed (see its log)")]
    PeerLost {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// Bytes of the collective's buffer on this rank.
        bytes: usize,
        /// The peer whose connection failed.
        peer: usize,
        /// The underlying failure.
        detail: String,
    },

    /// Ranks issued different collectives (or different sizes) at the same position.
    #[error("rank {rank}, {op} #{seq}: peer rank {peer} issued {theirs} instead; every rank must issue the same collectives in the same order with the same sizes")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The collective this rank issued.
        op: &'static str,
        /// Position of the collective in this communicator's issue order.
        seq: u64,
        /// The rank that disagreed.
        peer: usize,
        /// What that rank issued.
        theirs: String,
    },

    /// An earlier collective failed, so this communicator can no longer be used.
    #[error("rank {rank}, {op}: communicator unusable after an earlier failure: {first}; restart the job")]
    Poisoned {
        /// This rank.
        rank: usize,
        /// The collective that was refused.
        op: &'static str,
        /// The first failure.
        first: String,
    },

    /// Setting up the connections between ranks failed.
    #[error("rank {rank}: connecting to peers: {detail}")]
    Connect {
        /// This rank.
        rank: usize,
        /// What failed.
        detail: String,
    },

    /// A backend was asked for that this build does not contain.
    #[error(
        "backend {backend} is not compiled into this build; rebuild with `--features {feature}`"
    )]
    NotCompiled {
        /// The backend name.
        backend: &'static str,
        /// The cargo feature that enables it.
        feature: &'static str,
    },

    /// A backend's library is missing or failed (MPI, CUDA, NCCL).
    #[error("rank {rank}, backend {backend}, {op}: {detail}")]
    Backend {
        /// This rank.
        rank: usize,
        /// The backend name.
        backend: &'static str,
        /// What was being done.
        op: &'static str,
        /// What failed and what to do.
        detail: String,
    },

    /// This rank has no GPU of its own among the CUDA devices it sees ([`crate::gpu_index`]).
    #[error("LOCAL_RANK {local_rank} of {local_world_size} rank(s) on this node sees {visible} CUDA device(s): {detail}")]
    Device {
        /// This rank's place on its node.
        local_rank: usize,
        /// Ranks on this node.
        local_world_size: usize,
        /// CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`).
        visible: usize,
        /// What is wrong and what to do.
        detail: String,
    },

    /// A libtorch call failed.
    #[error("rank {rank}, {op}: libtorch: {source}")]
    Torch {
        /// This rank.
        rank: usize,
        /// What was being done.
        op: &'static str,
        /// The libtorch error.
        source: tch::TchError,
    },
}

impl Error {
    /// True when the fault is in what the user gave (the environment's rank variables, the
    /// store's address or port): such a rank should exit with code 2, not be restarted.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::Topology { .. } | Error::NotAStore { .. } | Error::StoreHost { .. }
        )
    }

    /// A [`Error::StoreTimeout`] of a wait for one key per rank (key `r` is rank `r`'s), as
    /// the ranks that did not join, seen from `rank` of `world`; any other error as it is.
    pub(crate) fn ranks_missing(self, rank: usize, world: usize) -> Error {
        match self {
            Error::StoreTimeout {
                addr,
                missing,
                timeout,
                ..
            } => Error::NotJoined {
                rank,
                addr,
                missing,
                world,
                timeout,
            },
            e => e,
        }
    }

    /// True when this error says another rank failed: its connection broke, it did not answer
    /// in time, or the communicator is unusable after such a failure. The rank reporting it
    /// is most likely not the cause, so its launcher should hear of the cause first.
    pub fn blames_a_peer(&self) -> bool {
        matches!(
            self,
            Error::PeerLost { .. } | Error::Timeout { .. } | Error::Poisoned { .. }
        )
    }
}

/// How many numbers `ranges` hold.
pub(crate) fn count(ranges: &[Range<usize>]) -> usize {
    ranges.iter().map(|r| r.len()).sum()
}

/// `ranges` as `1-3, 5, 9-12`, the first few ranges only and then how many numbers the rest
/// hold (`…, and 40 more`): a message stays a line however many ranks are listed.
pub fn list_ranges(ranges: &[Range<usize>]) -> String {
    let mut parts: Vec<String> = ranges
        .iter()
        .filter(|r| !r.is_empty())
        .take(SHOWN_RANGES)
        .map(|r| match r.len() {
            1 => r.start.to_string(),
            _ => format!("{}-{}", r.start, r.end - 1),
        })
        .collect();
    let rest = count(ranges.get(SHOWN_RANGES..).unwrap_or_default());
    if rest > 0 {
        parts.push(format!("and {rest} more"));
    }
    parts.join(", ")
}

/// `d` in seconds for a message: `5 s`, `0.25 s`.
fn seconds(d: &Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// `rank 3` or `ranks 1-999999`.
fn ranks_named(missing: &[Range<usize>]) -> String {
    let word = if count(missing) == 1 { "rank" } else { "ranks" };
    format!("{word} {}", list_ranges(missing))
}

/// The missing keys of a [`Error::StoreTimeout`]: `key "a"`, or `keys "a", "b", … (7 of 9)`.
fn missing_keys(names: &[String], missing: &[Range<usize>], asked: &usize) -> String {
    let n = count(missing);
    let shown: Vec<String> = names.iter().map(|k| format!("{k:?}")).collect();
    match n {
        1 => format!("key {}", shown.join(", ")),
        _ if shown.len() < n => format!("keys {}, … ({n} of {asked})", shown.join(", ")),
        _ => format!("keys {} ({n} of {asked})", shown.join(", ")),
    }
}

#[cfg(test)]
// Lists of one range of ranks or keys are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_listed_briefly_however_many() {
        assert_eq!(list_ranges(&[1..4, 5..6, 9..13]), "1-3, 5, 9-12");
        let many: Vec<Range<usize>> = (0..1000).map(|i| 2 * i..2 * i + 1).collect();
        let s = list_ranges(&many);
        assert_eq!(s, "0, 2, 4, 6, 8, 10, 12, 14, and 992 more");
        let e = Error::NotJoined {
            rank: 0,
            addr: "h:1".into(),
            missing: vec![1..1_000_000],
            world: 1_000_000,
            timeout: Duration::from_secs(5),
        };
        let msg = e.to_string();
        assert!(
            msg.contains("rank 0: ranks 1-999999 (999999 of 1000000) did not join within 5 s"),
            "{msg}"
        );
        let e = Error::StoreTimeout {
            addr: "h:1".into(),
            missing: vec![1..1_000_000],
            names: vec!["k/1".into(), "k/2".into()],
            asked: 1_000_000,
            timeout: Duration::from_millis(250),
        };
        let msg = e.to_string();
        assert!(
            msg.contains(
                "keys \"k/1\", \"k/2\", … (999999 of 1000000) did not appear within 0.25 s"
            ),
            "{msg}"
        );
        assert!(msg.len() < 400, "{msg}");
    }
}
