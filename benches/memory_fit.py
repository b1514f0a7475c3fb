#!/usr/bin/env python3
"""How close `zrun estimate` is to what ranks really hold: a matrix of configurations, each
trained for 2 steps on CPU ranks, every rank's predicted peak (summary.json's
`estimated_peak_bytes`, the same figure `zrun estimate` prints as `peak_bytes`) against its
measured peak (`peak_rss_bytes - base_rss_bytes`: resident memory above what the rank held
before its model was built).

    python benches/memory_fit.py                 # the whole matrix (about 15 min on 2 cores)
    python benches/memory_fit.py --only small    # the small model's rows (about 2 min)
    python benches/memory_fit.py --json

Target: every row within 10%, erring high by at most 10% and low by at most 5% (a low
estimate is an out-of-memory): 0.95 <= estimate / measured <= 1.10.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Two model sizes: a small GPT, and gpt2-medium's shape (24 x 1024, vocab 50304) at 128 tokens.
# bf16 rows use the small model only: on CPUs without AVX-512 a bf16 step of the medium one
# takes over 20 minutes.
MODELS = {
    "small": ["model.vocab_size=512", "model.seq_len=128", "model.n_layer=4", "model.n_head=4", "model.d_model=256"],
    "medium": ['model.preset="gpt2-medium"', "model.vocab_size=50304", "model.seq_len=128", "model.n_layer=24",
               "model.n_head=16", "model.d_model=1024"],
}

# (model, ranks, stage, precision, activation checkpointing, offload, micro-batch[, train.loss_chunk])
# Without a loss chunk a row runs the default (2^24 logits: one chunk but for medium at
# micro-batch 4); the last three rows split the loss into many chunks, or run the full logits.
MATRIX = [
    ("small", 1, 0, "fp32", False, False, 8),
    ("small", 1, 0, "fp32", False, False, 1),
    ("small", 2, 1, "fp32", False, False, 8),
    ("small", 2, 2, "fp32", False, False, 8),
    ("small", 2, 3, "fp32", False, False, 8),
    ("small", 4, 3, "fp32", False, False, 4),
    ("small", 2, 0, "fp32", True, False, 8),
    ("small", 2, 3, "fp32", True, False, 8),
    ("small", 2, 2, "bf16", False, False, 4),
    ("small", 2, 3, "bf16", True, False, 4),
    ("small", 2, 1, "fp32", False, True, 8),
    ("small", 2, 2, "bf16", False, True, 2),
    ("small", 4, 3, "fp32", False, True, 1),
    ("medium", 1, 0, "fp32", False, False, 1),
    ("medium", 2, 3, "fp32", False, False, 2),
    ("medium", 2, 3, "fp32", True, False, 4),
    ("medium", 2, 2, "fp32", False, True, 1),
    ("medium", 4, 3, "fp32", False, False, 1),
    ("medium", 2, 3, "fp32", False, False, 4, 1 << 20),
    ("medium", 1, 0, "fp32", False, False, 1, 0),
    ("small", 2, 2, "bf16", False, False, 4, 1 << 14),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(MODELS), help="run one model's rows")
    ap.add_argument("--json", action="store_true", help="also print one JSON object per row")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    config = common.ROOT / "configs" / "bench-cpu.toml"
    work = Path(tempfile.mkdtemp(prefix="zrun-memory-fit-"))
    common.ensure_zrun(work)
    load0, t0 = common.load_average(), time.perf_counter()
    rows = []
    print(f"{'model':>6} {'W':>2} {'st':>2} {'prec':>4} {'ckpt':>4} {'offl':>4} {'mb':>2} {'chunk':>5} {'rank':>4} "
          f"{'estimate MiB':>12} {'measured MiB':>12} {'ratio':>6}  phase of the predicted peak", flush=True)
    for i, (model, w, stage, prec, ckpt, offload, mb, *chunk) in enumerate(MATRIX):
        if args.only and model != args.only:
            continue
        overrides = MODELS[model] + [
            f"train.micro_batch={mb}", "train.grad_accum=1", "train.steps=2", "train.eval_batches=1",
            f"zero.stage={stage}", f'zero.precision="{prec}"', f"zero.activation_checkpointing={str(ckpt).lower()}",
            f'zero.offload_optimizer="{"cpu" if offload else "none"}"', "log.every=1",
        ] + [f"train.loss_chunk={c}" for c in chunk]
        shown = "2^24" if not chunk else ("off" if chunk[0] == 0 else f"2^{chunk[0].bit_length() - 1}")
        s = common.run_zrun(config, overrides, w, work / f"row-{i}", threads=1, timeout_s=1800)
        for r in range(w):
            measured = s["peak_rss_bytes"][r] - s["base_rss_bytes"][r]
            est = s["estimated_peak_bytes"][r]
            row = {"model": model, "world": w, "stage": stage, "precision": prec, "checkpointing": ckpt,
                   "offload": offload, "micro_batch": mb, "loss_chunk": shown, "rank": r, "estimate_bytes": est,
                   "measured_bytes": measured, "ratio": est / measured, "phase": s["estimated_peak_phase"]}
            rows.append(row)
            print(f"{model:>6} {w:>2} {stage:>2} {prec:>4} {'on' if ckpt else 'off':>4} {'cpu' if offload else '-':>4} "
                  f"{mb:>2} {shown:>5} {r:>4} {common.fmt_mib(est):>12} {common.fmt_mib(measured):>12} {est / measured:>6.3f}  "
                  f"{row['phase']}", flush=True)
    ratios = [r["ratio"] for r in rows]
    inside = sum(0.95 <= x <= 1.10 for x in ratios)
    print(f"# {len(rows)} rank rows from {len({(r['model'], r['world'], r['stage'], r['precision'], r['checkpointing'], r['offload'], r['micro_batch'], r['loss_chunk']) for r in rows})} "
          f"configurations; ratio = estimate / measured: min {min(ratios):.3f}, max {max(ratios):.3f}; "
          f"{inside} of {len(rows)} within 0.95 .. 1.10")
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f}; {time.perf_counter() - t0:.0f} s; "
          f"1 libtorch thread per rank")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    common.clean_up(work, args.keep)


if __name__ == "__main__":
    main()
