//! Same-host collectives by cross-memory attach: each rank reads its peers' tensors directly
//! with `process_vm_readv` (one kernel copy, no staging buffer). The sockets only carry the
//! addresses and the "done" messages that keep a tensor alive until every peer has read it.

use std::sync::atomic::{AtomicU64, Ordering};

use super::mesh::Ctx;
use super::{sub, Header, State};
use crate::buf::RawBuf;
use crate::kernels::{self, bytes_mut, BLOCK};
use crate::{chunk_offset, chunk_sizes, Error};

/// A per-process random value that peers read to prove cross-memory reads reach this process.
static NONCE: AtomicU64 = AtomicU64::new(0);

/// Whether the environment allows the cross-memory path (`ZRUN_COMM_CMA=0` turns it off).
pub(crate) fn enabled() -> bool {
    std::env::var(crate::CMA_ENV).map_or(true, |v| v != "0")
}

/// An identifier of this host (hostname and boot id).
pub(crate) fn host_id() -> String {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is writable for its full length; gethostname NUL-terminates within it.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len()) };
    let host = if rc == 0 {
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        "?".into()
    };
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{host}/{}", boot.trim()).replace('|', "_")
}

/// This process's proof value for peers to read.
pub(crate) struct Probe {
    nonce: u64,
}

impl Probe {
    pub(crate) fn new() -> Probe {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let nonce = (t ^ (u64::from(std::process::id()) << 32)) | 1;
        NONCE.store(nonce, Ordering::SeqCst);
        // Allow peers to read this process's memory where Yama restricts ptrace-like access.
        // SAFETY: prctl with integer arguments; failure (no Yama) is harmless and ignored.
        unsafe {
            libc::prctl(
                0x5961_6d61, /* PR_SET_PTRACER */
                libc::c_ulong::MAX,
                0,
                0,
                0,
            );
        }
        Probe { nonce }
    }

    /// `pid|nonce address|nonce`.
    pub(crate) fn describe(&self) -> String {
        format!(
            "{}|{}|{}",
            std::process::id(),
            &NONCE as *const AtomicU64 as usize,
            self.nonce
        )
    }

    /// Whether every peer in `infos` (`addr|pid|nonce addr|nonce|host`) is on this host and
    /// readable.
    pub(crate) fn check_all(&self, rank: usize, infos: &[String]) -> bool {
        let me = host_id();
        infos.iter().enumerate().all(|(r, info)| {
            if r == rank {
                return true;
            }
            let f: Vec<&str> = info.split('|').collect();
            if f.len() != 5 || f[4] != me {
                return false;
            }
            let (Ok(pid), Ok(addr), Ok(nonce)) = (
                f[1].parse::<i32>(),
                f[2].parse::<usize>(),
                f[3].parse::<u64>(),
            ) else {
                return false;
            };
            let mut v = [0u8; 8];
            read_remote(pid, addr, &mut v).is_ok() && u64::from_ne_bytes(v) == nonce
        })
    }
}

/// The pid field of a published peer description.
pub(crate) fn pid_of(info: &str) -> i32 {
    info.split('|')
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst`.
fn read_remote(pid: i32, addr: usize, dst: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr() as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` covers writable memory we own; the kernel validates `remote` in the
        // other process and fails with EFAULT/ESRCH rather than touching anything else.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            return Err(std::io::Error::other("process_vm_readv copied nothing"));
        }
        done += n as usize;
    }
    Ok(())
}

fn read_peer(st: &State, ctx: &Ctx, q: usize, addr: usize, dst: &mut [u8]) -> Result<(), Error> {
    let pid = st.pids.as_ref().map_or(0, |p| p[q]);
    read_remote(pid, addr, dst).map_err(|e| Error::PeerLost {
        rank: ctx.rank,
        op: ctx.op,
        bytes: ctx.bytes,
        peer: q,
        detail: format!("reading its memory (pid {pid}): {e}"),
    })
}

/// Tells every peer this rank is done with their memory and waits for them to be done with
/// ours (so our tensor stays valid until then).
fn finish(st: &State, ctx: &Ctx, h: &Header) -> Result<(), Error> {
    let others = st.others();
    st.exchange(ctx, h, u64::MAX, &others, &others).map(|_| ())
}

pub(crate) fn all_gather(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    shard: &RawBuf,
    full: &RawBuf,
) -> Result<(), Error> {
    let others = st.others();
    let addrs = st.exchange(ctx, h, shard.ptr as u64, &others, &others)?;
    let es = full.dtype.size();
    let sizes = chunk_sizes(full.numel, st.world);
    let off = chunk_offset(full.numel, st.world, st.rank) * es;
    if shard.ptr != full.ptr + off {
        // SAFETY: distinct tensors (or the shard is exactly the own chunk, excluded above).
        unsafe { sub(full.ptr, off, shard.bytes()).copy_from_slice(shard.as_mut()) };
    }
    for &q in &others {
        let o = chunk_offset(full.numel, st.world, q) * es;
        // SAFETY: chunk q of `full`, written only here.
        let dst = unsafe { sub(full.ptr, o, sizes[q] * es) };
        read_peer(st, ctx, q, addrs[q] as usize, dst)?;
    }
    finish(st, ctx, h)
}

/// `out = (own chunk r of local `src` + chunk r of every peer's `src`) / div`, in fp32.
/// `out` may be the own chunk itself (all-reduce in place).
fn reduce_chunk(
    st: &mut State,
    ctx: &Ctx,
    src: &RawBuf,
    addrs: &[u64],
    out_ptr: usize,
    div: f32,
) -> Result<(), Error> {
    let dt = src.dtype;
    let es = dt.size();
    let off = chunk_offset(src.numel, st.world, st.rank) * es;
    let n = chunk_sizes(src.numel, st.world)[st.rank];
    let others = st.others();
    let mut acc = std::mem::take(&mut st.acc);
    let mut scratch = std::mem::take(&mut st.scratch);
    let mut result = Ok(());
    let mut i = 0;
    'blocks: while i < n {
        let m = BLOCK.min(n - i);
        let r = i * es;
        if dt == crate::buf::DType::F32 {
            // fp32: add each peer's block straight into the output (one pass per peer).
            for (k, &q) in others.iter().enumerate() {
                let piece = &mut bytes_mut(&mut scratch)[..m * es];
                if let Err(e) = read_peer(st, ctx, q, addrs[q] as usize + off + r, piece) {
                    result = Err(e);
                    break 'blocks;
                }
                let d = if k + 1 == others.len() { div } else { 1.0 };
                // SAFETY: the output block; no other slice of it is live.
                let dst = unsafe { sub(out_ptr, r, m * es) };
                if k == 0 && out_ptr != src.ptr + off {
                    // SAFETY: own chunk of the local source, distinct from the output.
                    let mine = unsafe { sub(src.ptr, off + r, m * es) };
                    kernels::add2(dt, mine, piece, d, dst, &mut acc);
                } else {
                    kernels::add_in_place(dt, dst, piece, d, &mut acc);
                }
            }
            i += m;
            continue;
        }
        {
            // SAFETY: own chunk of the local source, read before `out` is written below.
            let mine = unsafe { sub(src.ptr, off + r, m * es) };
            kernels::load(dt, mine, &mut acc[..m]);
        }
        for &q in &others {
            let piece = &mut bytes_mut(&mut scratch)[..m * es];
            if let Err(e) = read_peer(st, ctx, q, addrs[q] as usize + off + r, piece) {
                result = Err(e);
                break 'blocks;
            }
            kernels::accumulate(dt, piece, &mut acc[..m]);
        }
        // SAFETY: the output block; no other slice of it is live.
        let dst = unsafe { sub(out_ptr, r, m * es) };
        kernels::store(dt, &acc[..m], div, dst);
        i += m;
    }
    st.acc = acc;
    st.scratch = scratch;
    result
}

pub(crate) fn reduce_scatter(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    full: &RawBuf,
    shard: &RawBuf,
    div: f32,
) -> Result<(), Error> {
    let others = st.others();
    let addrs = st.exchange(ctx, h, full.ptr as u64, &others, &others)?;
    reduce_chunk(st, ctx, full, &addrs, shard.ptr, div)?;
    finish(st, ctx, h)
}

pub(crate) fn all_reduce(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    t: &RawBuf,
    div: f32,
) -> Result<(), Error> {
    let others = st.others();
    let addrs = st.exchange(ctx, h, t.ptr as u64, &others, &others)?;
    let es = t.dtype.size();
    // Phase 1: reduce the own chunk in place (peers read only their own chunks of ours).
    let own = t.ptr + chunk_offset(t.numel, st.world, st.rank) * es;
    reduce_chunk(st, ctx, t, &addrs, own, div)?;
    // Everyone's chunk is final before anyone overwrites the others' chunks.
    st.exchange(ctx, h, 1, &others, &others)?;
    let sizes = chunk_sizes(t.numel, st.world);
    for &q in &others {
        let o = chunk_offset(t.numel, st.world, q) * es;
        // SAFETY: chunk q of `t`, which no peer reads in this phase.
        let dst = unsafe { sub(t.ptr, o, sizes[q] * es) };
        read_peer(st, ctx, q, addrs[q] as usize + o, dst)?;
    }
    finish(st, ctx, h)
}

pub(crate) fn broadcast(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    t: &RawBuf,
    root: usize,
) -> Result<(), Error> {
    let others = st.others();
    let addrs = st.exchange(ctx, h, t.ptr as u64, &others, &others)?;
    if st.rank != root {
        // SAFETY: the tensor belongs to this op until its work is waited on.
        let dst = unsafe { t.as_mut() };
        read_peer(st, ctx, root, addrs[root] as usize, dst)?;
    }
    finish(st, ctx, h)
}
