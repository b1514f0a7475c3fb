#!/usr/bin/env python3
"""The chunked loss (`train.loss_chunk`, the default) against the full logits
(`train.loss_chunk = 0`) side by side, interleaved, on CPU ranks: median tokens/s, each
rank's peak resident memory above its start (`peak_rss_bytes - base_rss_bytes`) and the
estimate of it, same config, threads and data on both sides.

    python benches/loss_chunk.py [--rounds 3] [--steps 10] [--nproc 2] [--stage 2] [--set KEY=VALUE ...]

The default shape has a large vocabulary for its width, where the logits dominate the step's
memory: GPT-2's 50304 tokens, 4 layers of 256, micro-batch 4 x 256 tokens, so 51.5M logits per
micro-batch, 4 chunks of 2^24.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPE = ["model.vocab_size=50304", "model.seq_len=256", "model.n_layer=4", "model.n_head=4", "model.d_model=256",
         "train.micro_batch=4"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="more config overrides (after the default shape)")
    args = ap.parse_args()
    config = common.ROOT / "configs" / "bench-cpu.toml"
    work = Path(tempfile.mkdtemp(prefix="zrun-loss-chunk-"))
    common.ensure_zrun(work)
    sides = {"chunked (2^24 logits)": ["train.loss_chunk=16777216"], "full logits": ["train.loss_chunk=0"]}
    rate = {k: [] for k in sides}
    peak = {k: [] for k in sides}
    est = {}
    load0, t0 = common.load_average(), time.perf_counter()
    overrides = SHAPE + [f"train.steps={args.steps}", f"zero.stage={args.stage}", "train.eval_batches=1"] + args.set
    for r in range(args.rounds):
        for name, extra in sides.items():
            s = common.run_zrun(config, overrides + extra, args.nproc, work / f"{r}-{name[:5]}", threads=1)
            rate[name].append(s["tokens_per_s"])
            peak[name].append(max(p - b for p, b in zip(s["peak_rss_bytes"], s["base_rss_bytes"])))
            est[name] = max(s["estimated_peak_bytes"])
    print(f"# bench-cpu GPT {' '.join(overrides)}, {args.nproc} CPU ranks x 1 thread, {args.rounds} interleaved rounds")
    print(f"{'loss':<24} {'tokens/s (median)':>18} {'peak above start (MiB)':>24} {'estimate (MiB)':>16}")
    for name in sides:
        print(f"{name:<24} {statistics.median(rate[name]):>18.0f} {common.fmt_mib(max(peak[name])):>24} "
              f"{common.fmt_mib(est[name]):>16}")
    a, b = sides
    print(f"# chunked / full logits: tokens/s {statistics.median(rate[a]) / statistics.median(rate[b]):.3f}, "
          f"peak {max(peak[a]) / max(peak[b]):.3f}; per round tokens/s {[round(x) for x in rate[a]]} vs "
          f"{[round(x) for x in rate[b]]}")
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f}; {time.perf_counter() - t0:.0f} s")
    common.clean_up(work, False)


if __name__ == "__main__":
    main()
