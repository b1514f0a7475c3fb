//! Communicator trait with tcp, mpi and nccl backends, the rendezvous store and topology discovery.
//!
//! A rank finds its place from the environment ([`Topology::from_env`]), meets the others through
//! a token-authenticated key-value store ([`StoreServer`], [`StoreClient`]) and gets a
//! [`Communicator`] from [`init`]. Every collective is asynchronous and returns a [`Work`] handle
//! that must be waited on; every wait has a deadline.

mod buf;
mod device;
mod error;
mod greet;
mod group;
mod kernels;
#[cfg_attr(not(feature = "mpi"), path = "mpi_stub.rs")]
mod mpi;
#[cfg_attr(not(feature = "cuda"), path = "nccl_stub.rs")]
mod nccl;
// Used by nccl.rs only, but built (and tested) without the `cuda` feature too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod nccl_rendezvous;
mod secret;
pub mod share;
mod single;
mod store;
mod tcp;
mod topology;
mod work;

use std::time::{Duration, Instant};

pub use device::gpu_index;
pub use error::{list_ranges, Error};
pub use nccl::gpu_total_bytes;
pub use secret::{job_token, load_or_create_secret, secret_path, SECRET_FILE_ENV};
pub use store::{StoreClient, StoreLimits, StoreServer};
pub use topology::{Topology, TopologySource};
pub use work::Work;

use tch::Tensor;

/// Environment variable holding the job's secret token, shared by the store and every rank.
pub const TOKEN_ENV: &str = "ZRUN_JOB_TOKEN";
/// Environment variable that, when `1`, says the launcher hosts the store (rank 0 must not).
pub const STORE_EXTERNAL_ENV: &str = "ZRUN_STORE_EXTERNAL";
/// The default deadline of every collective and rendezvous wait (`dist.timeout_s = 600`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// The longest timeout or deadline zrun accepts from a flag or a config key, in seconds (one
/// year): far past any real wait, and short enough that `now + timeout` stays in range.
pub const MAX_TIMEOUT_S: u64 = 31_536_000;

/// The instant `d` from now; for a `d` too large to add to the clock, the instant
/// [`MAX_TIMEOUT_S`] from now (a wait that long never ends in practice).
pub fn deadline_in(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(MAX_TIMEOUT_S)))
        .unwrap_or(now)
}

/// Environment variable that, when `0`, turns off the same-host cross-memory path of `tcp`.
pub const CMA_ENV: &str = "ZRUN_COMM_CMA";

/// How a reduction combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (the sum divided by the world size).
    Avg,
}

/// A communication backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Built-in sockets (and cross-memory copies between ranks of one host); CPU tensors.
    Tcp,
    /// MPI (cargo feature `mpi`), started by `mpirun`; CPU tensors.
    Mpi,
    /// NCCL (cargo feature `cuda`); CUDA tensors.
    Nccl,
}

impl Backend {
    /// The lowercase name used in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Tcp => "tcp",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }
}

/// Whether `backend` is compiled into this build: tcp always, mpi with the cargo feature
/// `mpi`, nccl with `cuda`.
pub fn compiled(backend: Backend) -> bool {
    match backend {
        Backend::Tcp => true,
        Backend::Mpi => cfg!(feature = "mpi"),
        Backend::Nccl => cfg!(feature = "cuda"),
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tcp" => Ok(Backend::Tcp),
            "mpi" => Ok(Backend::Mpi),
            "nccl" => Ok(Backend::Nccl),
            other => Err(format!(
                "unknown backend `{other}`; allowed: tcp, mpi, nccl"
            )),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Collective communication between the ranks of one job.
///
/// Every call is asynchronous: it validates its arguments, queues the operation and returns a
/// [`Work`]. The tensors must not be read or written by the caller until the work is waited on.
/// All ranks must issue the same collectives in the same order.
pub trait Communicator: Send + Sync {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The backend behind this communicator.
    fn backend(&self) -> Backend;
    /// `full` has `chunk_sizes(full.numel(), W)` layout: rank r's shard is the r-th chunk
    /// (first n % W ranks one element longer when n is not divisible). `shard` must have
    /// this rank's chunk numel. Both contiguous, same dtype and device.
    fn all_gather(&self, shard: &Tensor, full: &Tensor) -> Result<Work, Error>;
    /// Reduces `full` over the ranks and writes this rank's chunk of the result into `shard`
    /// (layout as in [`Communicator::all_gather`]); `full` is left unchanged.
    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, op: ReduceOp) -> Result<Work, Error>;
    /// Reduces `t` over the ranks, in place.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work, Error>;
    /// Copies `t` of rank `root` into `t` of every rank.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Work, Error>;
    /// Completes once every rank has issued this barrier. Blocks the host until then (on
    /// every backend, so a clock started after it starts together with the peers').
    fn barrier(&self) -> Result<Work, Error>;
    /// Fails when the communicator has failed since it was created. Call it after reading
    /// on the host what collectives wrote: on CUDA a collective waited on only orders
    /// libtorch's stream, and one cut short by an abort (a timeout, a peer's death) ends
    /// without an error of its own, leaving unreduced data that such a read would take for
    /// the result. The CPU backends report failures at `wait`.
    fn check(&self) -> Result<(), Error> {
        Ok(())
    }
    /// A communicator of the ranks that pass the same `color`, ranked by `key` (ties broken
    /// by rank in this communicator), as `MPI_Comm_split` does.
    ///
    /// Collective over this communicator: every rank calls it, at the same point of its
    /// sequence of collectives. The new communicator shares this one's communication thread:
    /// the collectives of both run in the one order this rank issues them (so ranks that issue
    /// the collectives of all their communicators in one common order cannot deadlock, NCCL
    /// keeps one stream and MPI one thread). A group of one rank gets a communicator like
    /// [`solo`]'s. Backends without groups (test doubles) refuse with
    /// [`Error::InvalidArgument`].
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>, Error> {
        let _ = (color, key);
        Err(Error::InvalidArgument {
            rank: self.rank(),
            op: "split",
            detail: format!(
                "this {} communicator cannot be split into sub-communicators",
                self.backend()
            ),
        })
    }
}

/// The communicator of a group of one rank on `backend`: rank 0 of 1, whose collectives are
/// copies or no-ops (CPU or CUDA tensors alike). For callers that need a group of one without
/// a collective over the world ([`Communicator::split`] returns the same for a group of one).
pub fn solo(backend: Backend) -> Box<dyn Communicator> {
    Box::new(single::SingleComm::new(backend))
}

/// Sets what the communication libraries read from the environment, before any other thread
/// of the process starts (`zrun`'s `main` calls it first; a rank under mpirun or srun inherits
/// nothing from a zrun launcher):
/// - `NCCL_RUNTIME_CONNECT=0` unless set: NCCL (2.22 on) then connects every peer inside
///   `ncclCommInitRank` rather than inside the first collective that needs a connection,
///   where its allocations (outside libtorch's allocator) would land at the step's peak and
///   a failure would poison the communicator instead of taking the out-of-memory path;
/// - under `ZRUN_NCCL_SHARE_GPU=1`, this rank's NCCL host id ([`share`]).
pub fn set_process_env() {
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
    }
    share::apply_to_this_process();
}

/// The launcher's restart round of this process's group (`TORCHELASTIC_RESTART_COUNT`, 0 for
/// the first start or without a launcher). The rendezvous store outlives a restarted group, so
/// the keys each round's communicators meet under are scoped by it.
pub fn restart_round() -> u64 {
    std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Element counts of the `world` chunks of an `n`-element buffer: `n / world` each, the first
/// `n % world` chunks one element longer.
pub fn chunk_sizes(n: usize, world: usize) -> Vec<usize> {
    let world = world.max(1);
    let (base, rem) = (n / world, n % world);
    (0..world).map(|r| base + usize::from(r < rem)).collect()
}

/// Element offset of chunk `r` in the [`chunk_sizes`] layout.
pub fn chunk_offset(n: usize, world: usize, r: usize) -> usize {
    let world = world.max(1);
    let (base, rem) = (n / world, n % world);
    r * base + r.min(rem)
}

/// Connects this rank: store (token from env `ZRUN_JOB_TOKEN`), peers, backend.
///
/// World size 1 needs no store and no sockets: its collectives are copies or no-ops. With the
/// `tcp` backend rank 0 hosts the store on `MASTER_ADDR:MASTER_PORT` unless
/// `ZRUN_STORE_EXTERNAL=1` says the launcher does. `timeout` bounds every wait.
pub fn init(
    topo: &Topology,
    backend: Backend,
    timeout: Duration,
) -> Result<Box<dyn Communicator>, Error> {
    if backend == Backend::Mpi {
        return mpi::init(topo, timeout);
    }
    if backend == Backend::Nccl {
        // Before touching the store: a machine without CUDA fails here, plainly.
        nccl::check_libraries(topo.rank)?;
    }
    if topo.world_size == 1 {
        return match backend {
            Backend::Nccl => nccl::init(topo, None, None, timeout),
            _ => Ok(Box::new(single::SingleComm::new(backend))),
        };
    }
    if topo.master_addr.is_empty() {
        return Err(Error::Topology {
            source_name: topo.source.name().into(),
            detail: format!(
                "backend {backend} needs the rendezvous store's host, but MASTER_ADDR is not set on this multi-host job; set MASTER_ADDR to the first host"
            ),
            hint: topo.source.hint(),
        });
    }
    // A name that does not exist fails here, on every rank, not after dist.timeout_s of
    // retries (a resolver that does not answer yet is retried by the store's client).
    let addr = format!("{}:{}", topo.master_addr, topo.master_port);
    if let Err(store::Unresolved::Unknown { detail, .. }) = store::resolve(&addr) {
        return Err(Error::Topology {
            source_name: topo.source.name().into(),
            detail: format!(
                "MASTER_ADDR={:?} does not resolve ({detail}); set it to rank 0's host name or IP",
                topo.master_addr
            ),
            hint: topo.source.hint(),
        });
    }
    let token = std::env::var(TOKEN_ENV).unwrap_or_default();
    if token.is_empty() {
        tracing::warn!(
            "{TOKEN_ENV} is not set: the rendezvous store accepts any client of this job's port"
        );
    }
    let external = std::env::var(STORE_EXTERNAL_ENV).is_ok_and(|v| v == "1");
    let server = if topo.rank == 0 && !external {
        let bind = store::bind_addr_for(&topo.master_addr, topo.master_port);
        Some(StoreServer::start(&bind, &token)?)
    } else {
        None
    };
    let store = StoreClient::connect(&addr, &token, timeout)?;
    match backend {
        Backend::Tcp => Ok(Box::new(tcp::TcpComm::new(
            topo, store, server, &token, timeout,
        )?)),
        Backend::Nccl => nccl::init(topo, Some(store), server, timeout),
        Backend::Mpi => unreachable!("handled above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_and_differ_by_at_most_one() {
        for n in [0usize, 1, 5, 7, 64, 1001] {
            for w in 1..6 {
                let c = chunk_sizes(n, w);
                assert_eq!(c.len(), w);
                assert_eq!(c.iter().sum::<usize>(), n);
                let (mx, mn) = (*c.iter().max().unwrap(), *c.iter().min().unwrap());
                assert!(mx - mn <= 1, "n {n} w {w}: {c:?}");
                // longer chunks first
                assert!(c.windows(2).all(|p| p[0] >= p[1]));
                let mut off = 0;
                for (r, len) in c.iter().enumerate() {
                    assert_eq!(chunk_offset(n, w, r), off);
                    off += len;
                }
            }
        }
        assert_eq!(chunk_sizes(7, 3), vec![3, 2, 2]);
    }

    #[test]
    fn nccl_without_cuda_or_the_feature_is_an_error_not_a_panic() {
        // On machines with CUDA and NCCL this would connect; the error path is what is
        // checked here, so only run it where one of the libraries is missing.
        #[cfg(feature = "cuda")]
        if nccl::check_libraries(0).is_ok() {
            return;
        }
        let e = init(&Topology::single(), Backend::Nccl, Duration::from_secs(1))
            .err()
            .expect("nccl must fail here");
        let msg = e.to_string();
        if cfg!(feature = "cuda") {
            assert!(
                msg.contains("libcuda") || msg.contains("libnccl.so"),
                "{msg}"
            );
        } else {
            assert!(msg.contains("--features cuda"), "{msg}");
        }
    }

    #[test]
    fn compiled_backends_follow_the_features() {
        assert!(compiled(Backend::Tcp));
        assert_eq!(compiled(Backend::Mpi), cfg!(feature = "mpi"));
        assert_eq!(compiled(Backend::Nccl), cfg!(feature = "cuda"));
    }

    #[test]
    fn backend_parses_names_and_rejects_others() {
        assert_eq!("tcp".parse::<Backend>(), Ok(Backend::Tcp));
        assert_eq!("nccl".parse::<Backend>(), Ok(Backend::Nccl));
        let e = "gloo".parse::<Backend>().unwrap_err();
        assert!(e.contains("tcp, mpi, nccl"), "{e}");
    }

    #[test]
    fn a_multi_host_job_without_master_addr_is_bad_input_with_its_launcher_s_hint() {
        for (source, hint) in [
            (TopologySource::OpenMpi, "mpirun -x"),
            (TopologySource::Pmi, "mpiexec -genv"),
            (TopologySource::Slurm, "srun"),
        ] {
            let topo = Topology {
                rank: 0,
                local_rank: 0,
                world_size: 4,
                local_world_size: 2,
                master_addr: String::new(),
                master_port: 29500,
                source,
            };
            let e = init(&topo, Backend::Tcp, Duration::from_secs(1))
                .err()
                .expect("no store host");
            let msg = e.to_string();
            assert!(e.is_bad_input(), "{msg}");
            assert!(
                msg.contains(&format!("({})", source.name()))
                    && msg.contains("MASTER_ADDR is not set")
                    && msg.contains(hint),
                "{msg}"
            );
            assert!(
                !msg.contains("set RANK/WORLD_SIZE") && !msg.contains("OpenMpi"),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_master_addr_that_does_not_exist_is_refused_at_once() {
        let topo = Topology {
            rank: 0,
            local_rank: 0,
            world_size: 2,
            local_world_size: 2,
            master_addr: "no-such-host.invalid".into(),
            master_port: 29500,
            source: TopologySource::Torchrun,
        };
        let t = Instant::now();
        let e = init(&topo, Backend::Tcp, Duration::from_secs(5))
            .err()
            .expect("no such host");
        let msg = e.to_string();
        // A machine without DNS may say "try again" for any name: then it is retried.
        if msg.contains("cannot connect within") {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(e.is_bad_input(), "{msg}");
        assert!(
            msg.contains("MASTER_ADDR=\"no-such-host.invalid\" does not resolve"),
            "{msg}"
        );
    }

    #[test]
    fn a_deadline_past_the_clock_s_range_is_far_not_a_panic() {
        let far = deadline_in(Duration::MAX);
        assert!(far >= Instant::now() + Duration::from_secs(MAX_TIMEOUT_S - 1));
        let soon = deadline_in(Duration::from_secs(5));
        assert!(soon <= Instant::now() + Duration::from_secs(5));
    }
}
