#!/usr/bin/env python3
"""The CPU allocators of zrun's ranks side by side: the caching CPU allocator (the default:
freed tensors kept and reused), glibc's defaults (`ZRUN_CPU_ALLOCATOR=glibc`: a dynamic mmap
threshold that rises to the largest block freed, up to 32 MiB), and glibc with the mmap
threshold fixed at 64 KiB and huge pages (`MALLOC_MMAP_THRESHOLD_=65536`,
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: zrun's setting before the caching allocator, every
large tensor a fresh mapping), interleaved: median tokens/s and peak resident memory above
the rank's start (`peak_rss_bytes - base_rss_bytes`), same config, threads and data on every
side.

    python benches/malloc.py [--rounds 3] [--steps 20] [--stage 2] [--nproc 2] [--set KEY=VALUE ...]
    python benches/malloc.py --steps 6 --micro-batch 4 --set model.d_model=768 --set model.n_head=12 --set model.seq_len=256
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing on")
    ap.add_argument("--set", action="append", default=[], help="more config overrides")
    args = ap.parse_args()
    config = common.ROOT / "configs" / "bench-cpu.toml"
    work = Path(tempfile.mkdtemp(prefix="zrun-malloc-"))
    common.ensure_zrun(work)
    sides = {"caching (zrun's default)": {"ZRUN_CPU_ALLOCATOR": "caching"},
             "glibc defaults": {"ZRUN_CPU_ALLOCATOR": "glibc"},
             "glibc, mmap 64 KiB, huge pages": {"ZRUN_CPU_ALLOCATOR": "glibc", "MALLOC_MMAP_THRESHOLD_": "65536",
                                                "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}
    rate = {k: [] for k in sides}
    peak = {k: [] for k in sides}
    load0, t0 = common.load_average(), time.perf_counter()
    overrides = [f"train.steps={args.steps}", f"zero.stage={args.stage}", f"train.micro_batch={args.micro_batch}",
                 "train.eval_batches=1", f"zero.activation_checkpointing={str(args.ckpt).lower()}"] + args.set
    for r in range(args.rounds):
        for name, env in sides.items():
            import os
            saved = dict(os.environ)
            os.environ.update(env)
            try:
                s = common.run_zrun(config, overrides, args.nproc, work / f"{r}-{len(rate[name])}-{name[:4]}", threads=1)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            rate[name].append(s["tokens_per_s"])
            peak[name].append(max(p - b for p, b in zip(s["peak_rss_bytes"], s["base_rss_bytes"])))
    print(f"# bench-cpu GPT {' '.join(args.set)}, {args.nproc} CPU ranks x 1 thread, stage {args.stage}, micro-batch "
          f"{args.micro_batch}{', checkpointing' if args.ckpt else ''}, {args.steps} steps, "
          f"{args.rounds} interleaved rounds")
    print(f"{'allocator':<30} {'tokens/s (median)':>18} {'peak above start (MiB)':>24}")
    for name in sides:
        print(f"{name:<30} {statistics.median(rate[name]):>18.0f} {common.fmt_mib(max(peak[name])):>24}")
    a = next(iter(sides))
    print(f"# per round tokens/s, {a}: {[round(x) for x in rate[a]]}")
    for b in list(sides)[1:]:
        print(f"# ratio caching / {b}: tokens/s {statistics.median(rate[a]) / statistics.median(rate[b]):.3f}, "
              f"peak {max(peak[a]) / max(peak[b]):.3f}; per round tokens/s {[round(x) for x in rate[b]]}")
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f}; {time.perf_counter() - t0:.0f} s")
    common.clean_up(work, False)


if __name__ == "__main__":
    main()
