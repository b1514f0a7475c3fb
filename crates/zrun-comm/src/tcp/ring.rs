//! Ring algorithms over sockets: each step sends one chunk to the next rank while receiving
//! (and reducing) another from the previous one, so both directions stream at once.

use super::mesh::Ctx;
use super::{sub, Header, State, SEG};
use crate::buf::RawBuf;
use crate::kernels::{self, bytes_mut};
use crate::{chunk_offset, chunk_sizes, Error};

/// Byte offsets and lengths of the chunks of an `numel`-element buffer.
fn layout(numel: usize, world: usize, es: usize) -> Vec<(usize, usize)> {
    chunk_sizes(numel, world)
        .iter()
        .enumerate()
        .map(|(r, &n)| (chunk_offset(numel, world, r) * es, n * es))
        .collect()
}

fn neighbours(st: &State) -> (usize, usize) {
    (
        (st.rank + 1) % st.world,
        (st.rank + st.world - 1) % st.world,
    )
}

/// Sends `out` to `next` on a helper thread while `recv` runs here.
fn duplex<T>(
    st: &State,
    ctx: &Ctx,
    next: usize,
    out: &[u8],
    recv: impl FnOnce() -> Result<T, Error>,
) -> Result<T, Error> {
    let s = st.peer(ctx, next)?;
    std::thread::scope(|sc| {
        let sender = sc.spawn(|| ctx.send(s, next, out));
        let r = recv();
        if r.is_err() {
            // Unblock the sender: the error has already doomed this communicator.
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let sent = sender.join().unwrap_or_else(|_| {
            Err(Error::PeerLost {
                rank: ctx.rank,
                op: ctx.op,
                bytes: ctx.bytes,
                peer: next,
                detail: "sender thread panicked".into(),
            })
        });
        let v = r?;
        sent.map(|_| v)
    })
}

/// All-gather on the buffer `full` whose own chunk is already in place.
fn gather_in_place(st: &State, ctx: &Ctx, full: &RawBuf) -> Result<(), Error> {
    let (next, prev) = neighbours(st);
    let lay = layout(full.numel, st.world, full.dtype.size());
    for s in 0..st.world - 1 {
        let send = (st.rank + st.world - s) % st.world;
        let recv = (st.rank + 2 * st.world - s - 1) % st.world;
        // SAFETY: chunks `send` and `recv` are distinct chunks of `full`.
        let (out, inp) = unsafe {
            (
                sub(full.ptr, lay[send].0, lay[send].1),
                sub(full.ptr, lay[recv].0, lay[recv].1),
            )
        };
        let p = st.peer(ctx, prev)?;
        duplex(st, ctx, next, out, || ctx.recv(p, prev, inp))?;
    }
    Ok(())
}

pub(crate) fn all_gather(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    shard: &RawBuf,
    full: &RawBuf,
) -> Result<(), Error> {
    let (next, prev) = neighbours(st);
    st.exchange(ctx, h, 0, &[next], &[prev])?;
    let es = full.dtype.size();
    let off = chunk_offset(full.numel, st.world, st.rank) * es;
    if shard.ptr != full.ptr + off {
        // SAFETY: the shard and the full buffer are distinct tensors (or the shard is exactly
        // the own chunk, excluded above); lengths checked by `check_shard`.
        unsafe {
            sub(full.ptr, off, shard.bytes()).copy_from_slice(shard.as_mut());
        }
    }
    gather_in_place(st, ctx, full)
}

/// Ring reduce-scatter of `full` into `out` (the own chunk's result), in fp32 per hop.
fn scatter_reduce(
    st: &mut State,
    ctx: &Ctx,
    full: &RawBuf,
    out: &mut [u8],
    div: f32,
) -> Result<(), Error> {
    let (next, prev) = neighbours(st);
    let w = st.world;
    let dt = full.dtype;
    let lay = layout(full.numel, w, dt.size());
    let maxb = lay.iter().map(|c| c.1).max().unwrap_or(0);
    if w > 2 {
        for b in st.ring_bufs.iter_mut() {
            if b.len() * 8 < maxb {
                b.resize(maxb.div_ceil(8), 0);
            }
        }
    }
    let [mut a, mut b] = std::mem::take(&mut st.ring_bufs);
    let mut scratch = std::mem::take(&mut st.scratch);
    let mut acc = std::mem::take(&mut st.acc);
    let mut result = Ok(());
    for s in 0..w - 1 {
        let send = (st.rank + 2 * w - s - 1) % w;
        let recv = (st.rank + 2 * w - s - 2) % w;
        let last = s == w - 2;
        let (mine_ptr, mine_len) = (full.ptr + lay[recv].0, lay[recv].1);
        let outgoing: &[u8] = if s == 0 {
            // SAFETY: `send` differs from `recv`, the only chunk written in this step.
            unsafe { sub(full.ptr, lay[send].0, lay[send].1) }
        } else {
            &bytes_mut(&mut a)[..lay[send].1]
        };
        let p = match st.peer(ctx, prev) {
            Ok(p) => p,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        let dst: &mut [u8] = if last {
            &mut *out
        } else {
            &mut bytes_mut(&mut b)[..lay[recv].1]
        };
        let aliased = dst.as_ptr() as usize == mine_ptr;
        let (scr, acc) = (&mut scratch, &mut acc);
        let r = duplex(st, ctx, next, outgoing, || {
            let n = mine_len;
            let mut o = 0;
            while o < n {
                let m = SEG.min(n - o);
                let piece = &mut bytes_mut(scr)[..m];
                ctx.recv(p, prev, piece)?;
                if aliased {
                    // dst and mine are the same memory: load, add, store in place.
                    kernels::add_in_place(dt, &mut dst[o..o + m], piece, div, acc);
                } else {
                    // SAFETY: chunk `recv` of `full`, read only, distinct from `dst`.
                    let mine = unsafe { sub(mine_ptr, o, m) };
                    let d = if last { div } else { 1.0 };
                    kernels::add2(dt, mine, piece, d, &mut dst[o..o + m], acc);
                }
                o += m;
            }
            Ok(())
        });
        if let Err(e) = r {
            result = Err(e);
            break;
        }
        std::mem::swap(&mut a, &mut b);
    }
    st.ring_bufs = [a, b];
    st.scratch = scratch;
    st.acc = acc;
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
    let (next, prev) = neighbours(st);
    st.exchange(ctx, h, 0, &[next], &[prev])?;
    // SAFETY: the shard is this op's output and no other slice of it is live.
    let out = unsafe { shard.as_mut() };
    scatter_reduce(st, ctx, full, out, div)
}

pub(crate) fn all_reduce(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    t: &RawBuf,
    div: f32,
) -> Result<(), Error> {
    let (next, prev) = neighbours(st);
    st.exchange(ctx, h, 0, &[next], &[prev])?;
    let lay = layout(t.numel, st.world, t.dtype.size());
    let (off, len) = lay[st.rank];
    // SAFETY: the own chunk is written only by the last reduction step, which reads the same
    // chunk element by element (handled as the aliased case).
    let out = unsafe { sub(t.ptr, off, len) };
    scatter_reduce(st, ctx, t, out, div)?;
    gather_in_place(st, ctx, t)
}

pub(crate) fn broadcast(
    st: &mut State,
    ctx: &Ctx,
    h: &Header,
    t: &RawBuf,
    root: usize,
) -> Result<(), Error> {
    let (next, prev) = neighbours(st);
    st.exchange(ctx, h, 0, &[next], &[prev])?;
    // Chain root -> root+1 -> ... -> root-1, forwarding piece by piece.
    let pos = (st.rank + st.world - root) % st.world;
    // SAFETY: the tensor belongs to this op until its work is waited on.
    let data = unsafe { t.as_mut() };
    let (p, n) = (st.peer(ctx, prev)?, st.peer(ctx, next)?);
    for piece in data.chunks_mut(SEG) {
        if pos != 0 {
            ctx.recv(p, prev, piece)?;
        }
        if pos != st.world - 1 {
            ctx.send(n, next, piece)?;
        }
    }
    Ok(())
}
