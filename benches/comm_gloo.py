#!/usr/bin/env python3
"""PyTorch gloo collective bandwidth, in the same table format as `zrun bench comm`.

Usage: python benches/comm_gloo.py --nproc 2 --sizes 1M,16M,64M --dtype fp32 [--json]
Sizes are element counts of the full tensor (K/M/G suffixes are powers of 2), as in zrun.
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def chunk_sizes(n, w):
    base, rem = divmod(n, w)
    return [base + (1 if r < rem else 0) for r in range(w)]


def timed(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def worker(rank, world, port, args, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = DTYPES[args.dtype]
    rows = []
    for n in [parse_size(s) for s in args.sizes.split(",")]:
        chunks = chunk_sizes(n, world)
        if n % world != 0:
            n -= n % world  # gloo's tensor collectives need equal shards
            chunks = chunk_sizes(n, world)
        esz = torch.tensor([], dtype=dtype).element_size()
        # all-gather: rank r contributes r+1 everywhere
        shard = torch.full((chunks[rank],), float(rank + 1), dtype=dtype)
        full = torch.empty(n, dtype=dtype)
        t = timed(lambda: dist.all_gather_into_tensor(full, shard), args.iters, args.warmup)
        expect = torch.cat([torch.full((c,), float(r + 1), dtype=dtype) for r, c in enumerate(chunks)])
        wrong = int((full != expect).sum())
        rows.append(("all_gather", n * esz, t, (world - 1) / world, wrong))
        # reduce-scatter (sum): every element sums to world*(world+1)/2
        src = torch.full((n,), float(rank + 1), dtype=dtype)
        out = torch.empty(chunks[rank], dtype=dtype)
        t = timed(lambda: dist.reduce_scatter_tensor(out, src), args.iters, args.warmup)
        wrong = int((out != world * (world + 1) / 2).sum())
        rows.append(("reduce_scatter", n * esz, t, (world - 1) / world, wrong))
        # all-reduce (sum), in place: refill before each call so the check is exact
        buf = torch.full((n,), float(rank + 1), dtype=dtype)
        def ar():
            dist.all_reduce(buf)
        t = timed(ar, args.iters, args.warmup)
        buf.fill_(float(rank + 1))
        dist.all_reduce(buf)
        wrong = int((buf != world * (world + 1) / 2).sum())
        rows.append(("all_reduce", n * esz, t, 2 * (world - 1) / world, wrong))
    wrong_all = [0] * len(rows)
    wt = torch.tensor([r[4] for r in rows], dtype=torch.int64)
    dist.all_reduce(wt)
    if rank == 0:
        out = []
        for (op, nbytes, t, factor, _), w in zip(rows, wt.tolist()):
            algbw = nbytes / t / 1e9
            out.append(dict(op=op, backend="gloo", dtype=args.dtype, bytes=nbytes, time_s=t,
                            algbw_gbps=algbw, busbw_gbps=algbw * factor, wrong=w))
        q.put(out)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.nproc, port, args, q)) for r in range(args.nproc)]
    for pr in procs:
        pr.start()
    rows = q.get()
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            sys.exit(f"gloo rank exited with {pr.exitcode}")
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"# gloo  nproc {args.nproc}  dtype {args.dtype}")
    print(f"{'op':>15} {'size(B)':>12} {'time(ms)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}")
    for r in rows:
        print(f"{r['op']:>15} {r['bytes']:>12} {r['time_s']*1e3:>10.2f} {r['algbw_gbps']:>12.3f} "
              f"{r['busbw_gbps']:>12.3f} {r['wrong']:>7}")


if __name__ == "__main__":
    main()
