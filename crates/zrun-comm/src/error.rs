//! The crate's error type.

use std::time::Duration;

/// Everything that can go wrong while discovering the topology, talking to the rendezvous
/// store or running a collective.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The rank variables in the environment are missing, malformed or contradict each other.
    #[error("topology from the environment ({source_name}): {detail}; set RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT consistently (or start under zrun, torchrun, mpirun or srun)")]
    Topology {
        /// Which flavour of variables was being read (zrun/torchrun, OpenMPI, PMI, Slurm).
        source_name: String,
        /// What is wrong, naming the variables.
        detail: String,
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

    /// Keys did not appear in the store before the deadline.
    #[error("rendezvous store at {addr}: keys {missing:?} did not appear within {timeout:?}; a rank did not start or stopped early, or dist.timeout_s is too short")]
    StoreTimeout {
        /// `host:port` of the store.
        addr: String,
        /// The keys still missing.
        missing: Vec<String>,
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
