//! The built-in `tcp` backend: ring algorithms over sockets between every pair of ranks, and
//! direct cross-memory copies (`process_vm_readv`, one kernel copy) when all ranks share a host.
//! CUDA tensors are staged through pinned host memory ([`stage`]). Sub-communicators are
//! views over the world's sockets, run on the world's thread ([`group`]).

mod cma;
mod group;
mod mesh;
mod ring;
mod stage;

use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;

use crate::buf::{self, DType, Placement, RawBuf};
use crate::work::Executor;
use crate::{Backend, Communicator, Error, ReduceOp, StoreClient, StoreServer, Topology, Work};
use group::Group;
use mesh::Ctx;

/// Bytes per socket transfer piece in the ring (the receive scratch of reductions).
pub(crate) const SEG: usize = 1 << 20;

/// Which collective a message belongs to; checked between ranks before any data moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) code: u8,
    pub(crate) dtype: u8,
    /// The communicator: 0 for the world, a sub-communicator's tag ([`crate::group`]).
    pub(crate) tag: u64,
    /// Position in that communicator's issue order.
    pub(crate) seq: u64,
    pub(crate) numel: u64,
    pub(crate) aux: u64,
}

const MSG: usize = 48;
const MSG_MAGIC: &[u8; 4] = b"ZRop";

impl Header {
    fn encode(&self, addr: u64) -> [u8; MSG] {
        let mut m = [0u8; MSG];
        m[..4].copy_from_slice(MSG_MAGIC);
        m[4] = self.code;
        m[5] = self.dtype;
        m[8..16].copy_from_slice(&self.seq.to_le_bytes());
        m[16..24].copy_from_slice(&self.numel.to_le_bytes());
        m[24..32].copy_from_slice(&self.aux.to_le_bytes());
        m[32..40].copy_from_slice(&addr.to_le_bytes());
        m[40..48].copy_from_slice(&self.tag.to_le_bytes());
        m
    }

    fn decode(m: &[u8; MSG]) -> Option<(Header, u64)> {
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(m[r].try_into().unwrap_or([0; 8]));
        (&m[..4] == MSG_MAGIC).then(|| {
            (
                Header {
                    code: m[4],
                    dtype: m[5],
                    seq: u(8..16),
                    numel: u(16..24),
                    aux: u(24..32),
                    tag: u(40..48),
                },
                u(32..40),
            )
        })
    }

    fn describe(&self) -> String {
        let op = match self.code {
            1 => "all_gather",
            2 => "reduce_scatter(sum)",
            3 => "reduce_scatter(avg)",
            4 => "all_reduce(sum)",
            5 => "all_reduce(avg)",
            6 => "broadcast",
            7 => "barrier",
            8 => "split",
            _ => "an unknown message",
        };
        let comm = match self.tag {
            0 => "the world communicator".to_string(),
            t => format!("sub-communicator {t:016x}"),
        };
        format!(
            "{op} #{} of {} elements (dtype code {}, arg {}) on {comm}",
            self.seq, self.numel, self.dtype, self.aux
        )
    }
}

/// State owned by the communication thread.
///
/// `rank`, `world`, `pids`, `seq`, `tag` and `members` describe the communicator whose job
/// runs: the world's between jobs, a sub-communicator's for the length of one of its jobs
/// ([`State::in_group`]), so that ring.rs and cma.rs, which see only these, work on any
/// group unchanged.
pub(crate) struct State {
    /// This rank in the world (named by errors).
    pub(crate) me: usize,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) timeout: Duration,
    /// A socket to every other rank of the world, indexed by world rank.
    pub(crate) peers: Vec<Option<TcpStream>>,
    /// Process ids of the ranks when cross-memory copies work between all of them.
    pub(crate) pids: Option<Vec<i32>>,
    pub(crate) seq: u64,
    /// The communicator's tag in every message header (0: the world).
    pub(crate) tag: u64,
    /// World rank of each rank of the communicator; `None` for the world itself.
    pub(crate) members: Option<Vec<usize>>,
    /// The sub-communicators split off the world (and off each other), while not running.
    pub(crate) groups: Vec<Group>,
    pub(crate) scratch: Vec<u64>,
    pub(crate) acc: Vec<f32>,
    pub(crate) ring_bufs: [Vec<u64>; 2],
}

impl State {
    /// The socket to rank `q` of the running communicator.
    pub(crate) fn peer(&self, ctx: &Ctx, q: usize) -> Result<&TcpStream, Error> {
        let world_rank = self.members.as_ref().map_or(q, |m| m[q]);
        self.peers[world_rank]
            .as_ref()
            .ok_or_else(|| Error::PeerLost {
                rank: ctx.rank,
                op: ctx.op,
                bytes: ctx.bytes,
                peer: q,
                detail: "no connection".into(),
            })
    }

    /// Sends `hdr` (with `addr`) to `to` and checks the headers received from `from`;
    /// returns the address each sender sent, indexed by rank.
    pub(crate) fn exchange(
        &self,
        ctx: &Ctx,
        hdr: &Header,
        addr: u64,
        to: &[usize],
        from: &[usize],
    ) -> Result<Vec<u64>, Error> {
        let msg = hdr.encode(addr);
        for &q in to {
            ctx.send(self.peer(ctx, q)?, q, &msg)?;
        }
        let mut addrs = vec![0u64; self.world];
        for &q in from {
            let mut m = [0u8; MSG];
            ctx.recv(self.peer(ctx, q)?, q, &mut m)?;
            let theirs = Header::decode(&m);
            match theirs {
                Some((h, a)) if h == *hdr => addrs[q] = a,
                other => {
                    return Err(Error::Mismatch {
                        rank: ctx.rank,
                        op: ctx.op,
                        seq: hdr.seq,
                        peer: q,
                        theirs: other.map_or("garbage".into(), |(h, _)| h.describe()),
                    })
                }
            }
        }
        Ok(addrs)
    }

    pub(crate) fn others(&self) -> Vec<usize> {
        (0..self.world).filter(|&q| q != self.rank).collect()
    }

    fn abort(&mut self) {
        for s in self.peers.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Sub-slice of a raw buffer in bytes.
///
/// # Safety
/// `base..base+off+len` must lie in memory the caller may write, and no other live slice may
/// overlap the returned one.
pub(crate) unsafe fn sub<'a>(base: usize, off: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut((base + off) as *mut u8, len) }
}

/// The `tcp` communicator: the world, or a sub-communicator viewing the world's sockets.
pub(crate) struct TcpComm {
    rank: usize,
    world: usize,
    /// This rank in the world (named by errors).
    me: usize,
    /// Which of the state's groups this is; `None` for the world.
    group: Option<usize>,
    /// The thread (and sockets) of the world and of every communicator split off it.
    exec: Arc<Executor<State>>,
    /// The store this world met through, kept as long as any of its communicators lives.
    _meeting: Arc<(StoreClient, Option<StoreServer>)>,
}

impl TcpComm {
    pub(crate) fn new(
        topo: &Topology,
        store: StoreClient,
        server: Option<StoreServer>,
        token: &str,
        timeout: Duration,
    ) -> Result<TcpComm, Error> {
        let (rank, world) = (topo.rank, topo.world_size);
        let cerr = |detail: String| Error::Connect { rank, detail };
        // Keys of the n-th communicator of this round of the job: every rank creates them in
        // one order. The count is kept per round, as the store outlives a restarted group: a
        // rank that died before counting must not leave the next round's ranks disagreeing.
        let round = crate::restart_round();
        let gen = store.add(&format!("zrun/comm/gen/{round}/{rank}"), 1)?;
        let key = |what: &str, r: usize| format!("zrun/comm/{round}.{gen}/{what}/{r}");
        let ip = store
            .local_ip()
            .ok_or_else(|| cerr("cannot tell which interface reaches the store".into()))?;
        let listener = mesh::listen_on(ip, rank)?;
        let me = listener
            .local_addr()
            .map_err(|e| cerr(format!("listener address: {e}")))?;
        let probe = cma::Probe::new();
        let info = format!("{me}|{}|{}", probe.describe(), cma::host_id());
        store.set(&key("peer", rank), info.as_bytes())?;
        let keys: Vec<String> = (0..world).map(|r| key("peer", r)).collect();
        store
            .wait(
                &keys.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                timeout,
            )
            .map_err(|e| e.ranks_missing(rank, world))?;
        let mut addrs: Vec<SocketAddr> = Vec::with_capacity(world);
        let mut infos: Vec<String> = Vec::with_capacity(world);
        for (r, k) in keys.iter().enumerate() {
            let v = String::from_utf8_lossy(&store.get(k)?).into_owned();
            let a = v.split('|').next().unwrap_or("");
            addrs
                .push(a.parse().map_err(|_| {
                    cerr(format!("rank {r} published an unreadable address {v:?}"))
                })?);
            infos.push(v);
        }
        let peers = mesh::connect_mesh(rank, listener, &addrs, token, timeout)?;
        // Cross-memory copies only when every rank can read every other one.
        let mine_ok = cma::enabled() && probe.check_all(rank, &infos);
        store.set(&key("cma", rank), &[u8::from(mine_ok)])?;
        let ckeys: Vec<String> = (0..world).map(|r| key("cma", r)).collect();
        store
            .wait(
                &ckeys.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                timeout,
            )
            .map_err(|e| e.ranks_missing(rank, world))?;
        let mut all_ok = true;
        for k in &ckeys {
            all_ok &= store.get(k)? == [1];
        }
        let pids = all_ok.then(|| infos.iter().map(|i| cma::pid_of(i)).collect());
        tracing::debug!(rank, world, cma = all_ok, "tcp communicator connected");
        let exec = Executor::spawn(
            rank,
            timeout,
            move || {
                Ok(State {
                    me: rank,
                    rank,
                    world,
                    timeout,
                    peers,
                    pids,
                    seq: 0,
                    tag: 0,
                    members: None,
                    groups: Vec::new(),
                    scratch: vec![0u64; SEG / 8],
                    acc: vec![0f32; crate::kernels::BLOCK],
                    ring_bufs: [Vec::new(), Vec::new()],
                })
            },
            State::abort,
        )?;
        let comm = TcpComm {
            rank,
            world,
            me: rank,
            group: None,
            exec: Arc::new(exec),
            _meeting: Arc::new((store, server)),
        };
        comm.barrier()?.wait()?;
        Ok(comm)
    }

    fn raw(&self, t: &Tensor, op: &'static str, what: &str) -> Result<RawBuf, Error> {
        buf::raw(t, self.me, op, what, Placement::Cpu)
    }

    fn stage(&self, t: &Tensor, input: bool, op: &'static str) -> Result<stage::Staged, Error> {
        stage::stage(t, input, self.me, op)
    }

    /// Where this rank sits in this communicator, for [`buf::check_shard`].
    fn seat(&self) -> buf::Seat {
        buf::Seat {
            me: self.me,
            rank: self.rank,
            world: self.world,
            sub: self.group.is_some(),
        }
    }

    /// Queues `job` to run on this communicator's view of the state.
    fn submit(
        &self,
        op: &'static str,
        bytes: usize,
        job: impl FnOnce(&mut State) -> Result<(), Error> + Send + 'static,
    ) -> Result<Work, Error> {
        let group = self.group;
        self.exec
            .submit(op, bytes, move |st| st.in_group(group, job))
    }
}

fn header(code: u8, dtype: DType, numel: usize, aux: u64) -> impl FnOnce(&mut State) -> Header {
    move |st: &mut State| {
        st.seq += 1;
        Header {
            code,
            dtype: dtype.code(),
            tag: st.tag,
            seq: st.seq,
            numel: numel as u64,
            aux,
        }
    }
}

fn ctx(st: &State, op: &'static str, bytes: usize) -> Ctx {
    Ctx {
        rank: st.me,
        op,
        bytes,
        timeout: st.timeout,
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> Backend {
        Backend::Tcp
    }

    fn all_gather(&self, shard: &Tensor, full: &Tensor) -> Result<Work, Error> {
        const OP: &str = "all_gather";
        let (sh, fh) = (self.stage(shard, true, OP)?, self.stage(full, false, OP)?);
        let (s, f) = (
            self.raw(&sh.host, OP, "shard")?,
            self.raw(&fh.host, OP, "full")?,
        );
        buf::check_shard(&f, &s, self.seat(), OP)?;
        let bytes = f.bytes();
        let work = self.submit(OP, bytes, move |st| {
            let h = header(1, f.dtype, f.numel, 0)(st);
            let c = ctx(st, OP, bytes);
            if st.pids.is_some() {
                cma::all_gather(st, &c, &h, &s, &f)
            } else {
                ring::all_gather(st, &c, &h, &s, &f)
            }
        });
        Ok(stage::copy_back(work?, fh, self.rank, OP))
    }

    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "reduce_scatter";
        let (fh, sh) = (self.stage(full, true, OP)?, self.stage(shard, false, OP)?);
        let (f, s) = (
            self.raw(&fh.host, OP, "full")?,
            self.raw(&sh.host, OP, "shard")?,
        );
        buf::check_shard(&f, &s, self.seat(), OP)?;
        let bytes = f.bytes();
        let code = if op == ReduceOp::Sum { 2 } else { 3 };
        let work = self.submit(OP, bytes, move |st| {
            let h = header(code, f.dtype, f.numel, 0)(st);
            let c = ctx(st, OP, bytes);
            let div = if op == ReduceOp::Avg {
                st.world as f32
            } else {
                1.0
            };
            if st.pids.is_some() {
                cma::reduce_scatter(st, &c, &h, &f, &s, div)
            } else {
                ring::reduce_scatter(st, &c, &h, &f, &s, div)
            }
        });
        Ok(stage::copy_back(work?, sh, self.rank, OP))
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work, Error> {
        const OP: &str = "all_reduce";
        let th = self.stage(t, true, OP)?;
        let b = self.raw(&th.host, OP, "tensor")?;
        let bytes = b.bytes();
        let code = if op == ReduceOp::Sum { 4 } else { 5 };
        let work = self.submit(OP, bytes, move |st| {
            let h = header(code, b.dtype, b.numel, 0)(st);
            let c = ctx(st, OP, bytes);
            let div = if op == ReduceOp::Avg {
                st.world as f32
            } else {
                1.0
            };
            if st.pids.is_some() {
                cma::all_reduce(st, &c, &h, &b, div)
            } else {
                ring::all_reduce(st, &c, &h, &b, div)
            }
        });
        Ok(stage::copy_back(work?, th, self.rank, OP))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Work, Error> {
        const OP: &str = "broadcast";
        if root >= self.world {
            return Err(Error::InvalidArgument {
                rank: self.me,
                op: OP,
                detail: format!("root {root} is not below the world size {}", self.world),
            });
        }
        let th = self.stage(t, true, OP)?;
        let b = self.raw(&th.host, OP, "tensor")?;
        let bytes = b.bytes();
        let work = self.submit(OP, bytes, move |st| {
            let h = header(6, b.dtype, b.numel, root as u64)(st);
            let c = ctx(st, OP, bytes);
            if st.pids.is_some() {
                cma::broadcast(st, &c, &h, &b, root)
            } else {
                ring::broadcast(st, &c, &h, &b, root)
            }
        });
        Ok(stage::copy_back(work?, th, self.rank, OP))
    }

    fn barrier(&self) -> Result<Work, Error> {
        const OP: &str = "barrier";
        self.submit(OP, 0, move |st| {
            let h = header(7, DType::F32, 0, 0)(st);
            let c = ctx(st, OP, 0);
            let others = st.others();
            st.exchange(&c, &h, 0, &others, &others).map(|_| ())
        })
    }

    /// A view over the world's sockets (no new connections): the members exchange colors
    /// and keys with one another, then each records the group on the shared thread.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>, Error> {
        const OP: &str = "split";
        let (tx, rx) = std::sync::mpsc::channel();
        let parent = self.group;
        self.exec
            .submit(OP, 0, move |st| {
                let made = group::split(st, parent, OP, color as u64, key as u64)?;
                let _ = tx.send(made);
                Ok(())
            })?
            .wait()?;
        let lost = || Error::Poisoned {
            rank: self.me,
            op: OP,
            first: "the communication thread stopped".into(),
        };
        let (index, rank, world) = rx.recv().map_err(|_| lost())?;
        let Some(index) = index else {
            return Ok(crate::solo(Backend::Tcp));
        };
        Ok(Box::new(TcpComm {
            rank,
            world,
            me: self.me,
            group: Some(index),
            exec: self.exec.clone(),
            _meeting: self._meeting.clone(),
        }))
    }
}
