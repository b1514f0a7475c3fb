#!/usr/bin/env python3
"""Measured memory per rank against the ZeRO formula, at every stage (fp32 + AdamW).

    python benches/memory.py                         # gpt2-medium, 2 CPU ranks, 1 x 256 tokens
    python benches/memory.py --stages 0,3 --json
    python benches/memory.py --preset gpt2-small --seq-len 512 --micro-batch 2

For each stage zrun trains 2 steps on `--nproc` CPU ranks (one libtorch thread each), and
each rank's peak RSS minus its RSS before the model was built (summary.json's
`base_rss_bytes`) is compared with
    model states  stage 0: 16Ψ   stage 1: 8Ψ + 8Ψ/W   stage 2: 4Ψ + 12Ψ/W   stage 3: 16Ψ/W
    (4 bytes of parameters + 4 of gradients + 8 of Adam m, v per element; fp32 parameters are
    the master weights, so there is no separate master copy)
plus the activations autograd keeps for one micro-batch (`common.activation_bytes`: per block
16·C elements per token, the head 2·C + 3·V, at 4 bytes). Ψ is the parameter count with each
unit's flat buffer padded to a multiple of W, computed here from the architecture and checked
against the engine's own count (`model_state_bytes`). Where summary.json has no
`base_rss_bytes` the table shows the raw peak and says so.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# The GPT-2 presets' shapes (docs/config.md): vocab, layers, heads, width.
PRESETS = {
    "gpt2-small": (50304, 12, 12, 768),
    "gpt2-medium": (50304, 24, 16, 1024),
    "gpt2-large": (50304, 36, 20, 1280),
    "gpt2-xl": (50304, 48, 25, 1600),
}


def formula_model_states(stage, psi, w):
    """Bytes of model states per rank at `stage` for fp32 parameters + AdamW, Ψ elements."""
    return {
        0: 16 * psi,
        1: 8 * psi + 8 * psi // w,
        2: 4 * psi + 12 * psi // w,
        3: 16 * psi // w,
    }[stage]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-medium", choices=sorted(PRESETS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--config", default=str(common.ROOT / "configs" / "bench-cpu.toml"),
                    help="base config; model shape, batch, steps and stage are overridden")
    ap.add_argument("--json", action="store_true", help="also print one JSON object per stage")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (rank logs, summaries)")
    args = ap.parse_args()

    vocab, n_layer, n_head, d_model = PRESETS[args.preset]
    w, T, B = args.nproc, args.seq_len, args.micro_batch
    psi = common.padded_params(vocab, T, n_layer, d_model, w)
    act = common.activation_bytes(B, T, n_layer, d_model, n_head, vocab)
    work = Path(tempfile.mkdtemp(prefix="zrun-memory-"))
    common.ensure_zrun(work)
    load0 = common.load_average()
    t0 = time.perf_counter()
    rows = []
    for stage in [int(s) for s in args.stages.split(",")]:
        overrides = [
            f'model.preset="{args.preset}"',
            f"model.vocab_size={vocab}",
            f"model.n_layer={n_layer}",
            f"model.n_head={n_head}",
            f"model.d_model={d_model}",
            f"model.seq_len={T}",
            f"train.micro_batch={B}",
            f"train.steps={args.steps}",
            "train.eval_batches=1",
            f"zero.stage={stage}",
            "log.every=1",
        ]
        s = common.run_zrun(args.config, overrides, w, work / f"stage-{stage}", threads=1)
        lines = (work / f"stage-{stage}" / "metrics.jsonl").read_text().splitlines()
        engine_total = max(json.loads(line).get("engine_bytes", 0) for line in lines)
        states = formula_model_states(stage, psi, w)
        base = s.get("base_rss_bytes")
        peak = s["peak_rss_bytes"]
        measured = [p - b for p, b in zip(peak, base)] if base else list(peak)
        rows.append({
            "stage": stage,
            "psi_padded": psi,
            "params": s["params"],
            "formula_model_state_bytes": states,
            "engine_model_state_bytes": s["model_state_bytes"],
            "engine_total_bytes_rank0": engine_total,
            "activation_bytes": act,
            "expected_bytes": states + act,
            "peak_rss_bytes": peak,
            "base_rss_bytes": base,
            "measured_bytes": measured,
            "ratio": [m / (states + act) for m in measured],
            "base_subtracted": bool(base),
            "wall_time_s": s["wall_time_s"],
        })
    elapsed = time.perf_counter() - t0

    print(f"# {args.preset} (Ψ = {rows[0]['params']} params, {psi} padded to W={w}), {w} CPU ranks x 1 thread, "
          f"fp32 + AdamW, micro-batch {B} x {T} tokens, {args.steps} steps per stage")
    print(f"# activations of one micro-batch: {common.fmt_mib(act)} MiB (16·C per token per block + 2·C + 3·V "
          f"for the head, 4 bytes each; see common.activation_bytes)")
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f}; {elapsed:.0f} s")
    if not all(r["base_subtracted"] for r in rows):
        print("# summary.json has no base_rss_bytes: 'measured' is the raw peak RSS (base NOT subtracted)")
    hdr = "measured peak-base" if all(r["base_subtracted"] for r in rows) else "measured peak (raw)"
    print(f"{'stage':>5} {'formula states':>15} {'engine states':>14} {'engine total':>13} {'+ activations':>14} "
          f"{hdr + ' (MiB/rank)':>32} {'ratio':>13} {'base (MiB)':>16}")
    for r in rows:
        eng = max(r["engine_model_state_bytes"])
        meas = " / ".join(common.fmt_mib(m) for m in r["measured_bytes"])
        ratio = " / ".join(f"{x:.2f}" for x in r["ratio"])
        base = " / ".join(common.fmt_mib(b) for b in r["base_rss_bytes"]) if r["base_rss_bytes"] else "n/a"
        print(f"{r['stage']:>5} {common.fmt_mib(r['formula_model_state_bytes']):>15} {common.fmt_mib(eng):>14} "
              f"{common.fmt_mib(r['engine_total_bytes_rank0']):>13} {common.fmt_mib(r['expected_bytes']):>14} {meas:>32} {ratio:>13} {base:>16}")
    print("# MiB. 'engine states': summary.json's model_state_bytes (largest rank); 'engine total': every byte")
    print("# the engine allocated on rank 0, buffers included (metrics.jsonl's engine_bytes, largest logged);")
    print("# '+ activations' = formula states + one micro-batch's activations; ratio = measured / that.")
    print("# Target: within 15% (0.85 .. 1.15).")
    mismatch = [r["stage"] for r in rows if max(r["engine_model_state_bytes"]) != r["formula_model_state_bytes"]]
    if mismatch:
        print(f"# engine's model_state_bytes differs from the formula at stage(s) {mismatch}")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    common.clean_up(work, args.keep)


if __name__ == "__main__":
    main()
