"""torch.optim.AdamW throughput on one flat fp32 tensor, and a STREAM-style triad bandwidth.

    python benches/adam.py [--params 10M,50M] [--threads 1,2] [--iters 10] [--half bf16] [--json]

Rows: impl, params, threads, gparams_per_s (best of --iters steps, after one untimed step):
  torch_fused        AdamW(fused=True).step()
  torch_fused_copy   the same step, then the half-precision copy of the parameters that a
                     mixed-precision trainer computes in (`half.copy_(p)`, --half's dtype);
                     the work `zrun bench adam` does in its one pass (no row with --half none)
  torch_foreach      AdamW(foreach=True).step()
plus one `triad` row per thread count: a = b + s*c over fp32 arrays of the largest size, GB/s
counting 12 bytes per element (STREAM's convention, no write-allocate).
Same hyper-parameters as `zrun bench adam` (betas 0.9/0.95, eps 1e-8, weight decay 0.1).
"""

import argparse
import json
import time

import torch

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_counts(s):
    out = []
    for p in s.split(","):
        p = p.strip().upper()
        mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(p[-1:], 1)
        out.append(int(float(p[:-1] if mult > 1 else p) * mult))
    return out


def adam_row(impl, n, threads, iters, half):
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(((torch.arange(n) % 1013).float() - 506.0) * 1e-3)
    p.grad = ((torch.arange(n) % 997).float() - 498.0) * 1e-4
    kw = {"foreach": True} if impl == "foreach" else {"fused": True}
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    copy = torch.empty(n, dtype=HALF[half]) if impl == "fused_copy" else None
    best = float("inf")
    for i in range(iters + 1):
        t0 = time.perf_counter()
        opt.step()
        if copy is not None:
            with torch.no_grad():
                copy.copy_(p)
        dt = time.perf_counter() - t0
        if i > 0:
            best = min(best, dt)
    return {"impl": f"torch_{impl}", "params": n, "threads": threads, "best_s": best,
            "gparams_per_s": n / best / 1e9}


def triad_row(n, threads, iters):
    torch.set_num_threads(threads)
    a, b, c = torch.empty(n), torch.ones(n), torch.full((n,), 2.0)
    best = float("inf")
    for i in range(iters + 1):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        dt = time.perf_counter() - t0
        if i > 0:
            best = min(best, dt)
    return {"impl": "triad", "params": n, "threads": threads, "best_s": best,
            "gb_per_s": 12 * n / best / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="10M,50M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--half", default="bf16", choices=["bf16", "fp16", "none"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sizes, threads = parse_counts(a.params), parse_counts(a.threads)
    rows = []
    for t in threads:
        rows.append(triad_row(max(sizes), t, a.iters))
    for n in sizes:
        for t in threads:
            impls = ("fused", "foreach") if a.half == "none" else ("fused", "fused_copy", "foreach")
            for impl in impls:
                rows.append(adam_row(impl, n, t, a.iters, a.half))
    for r in rows:
        if a.json:
            print(json.dumps(r))
        elif r["impl"] == "triad":
            print(f"triad {r['params']:>10} x fp32, {r['threads']} threads: {r['gb_per_s']:.2f} GB/s")
        else:
            print(f"{r['impl']:>17} {r['params']:>10} {r['threads']:>3} {r['gparams_per_s']:.3f} Gparam/s")


if __name__ == "__main__":
    main()
