#!/usr/bin/env python3
"""Where a profiled step's time goes: sums a trace that `log.profile_step` wrote
(`profile-rank{R}.json`, libtorch's profiler as a Chrome trace) by kind.

    python benches/profile_table.py runs/x/profile-rank0.json [--json] [--top 10]

On CUDA: the GPU time of its kernels, copies and memsets by kind (matmuls, attention, norms,
elementwise, loss, optimizer, copies, collectives, other), their share of the step's window
(the first operator's start to the last event's end), and the idle time between them (host
gaps: the GPU waiting for the host or for a collective's peer). On CPU, with no kernels: each
operator's self time (its time less that of the operators it called) on every thread, by the
same kinds. Prints a table, or with --json one object.
"""
import argparse
import collections
import json
import sys

# First match wins, on the lower-cased name.
KINDS = [
    ("collectives", ["nccl", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "c10d"]),
    ("attention", ["flash", "fmha", "attention", "sdpa", "_efficient_attention", "cudnn_generated_fort_native"]),
    ("matmuls", ["gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                 "aten::baddbmm", "aten::matmul", "aten::linear"]),
    ("norms", ["layer_norm", "layernorm", "rms_norm", "rmsnorm"]),
    ("loss", ["cross_entropy", "crossentropy", "log_softmax", "logsumexp", "nll_loss", "softmax"]),
    ("optimizer", ["adam", "foreach", "multi_tensor", "norm_of", "_amp_", "lerp"]),
    ("copies", ["memcpy", "memset", "aten::copy_", "aten::_to_copy", "aten::to", "aten::cat", "copy_kernel",
                "zr_cast_into"]),
    # Host-only work (no kernel): views, allocation, autograd's bookkeeping.
    ("framework", ["aten::view", "aten::slice", "aten::as_strided", "aten::transpose", "aten::t",
                   "aten::narrow", "aten::reshape", "aten::empty", "aten::zeros", "aten::expand",
                   "aten::permute", "aten::detach", "aten::unsqueeze", "autograd::", "backward0"]),
    ("elementwise", ["elementwise", "vectorized", "aten::add", "aten::mul", "aten::sub", "aten::div", "gelu",
                     "silu", "aten::fill_", "aten::zero_", "aten::where", "aten::neg", "aten::exp", "aten::rsqrt",
                     "aten::pow", "aten::sum", "aten::mean", "reduce_kernel", "aten::clamp"]),
]
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name):
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def union_length(intervals):
    """Total length covered by (start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def self_times(ops):
    """(name, self time) of nested complete events on one thread: each event's duration less
    its direct children's."""
    out = []
    stack = []  # [end, name, child time]
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        s, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= s:
            done = stack.pop()
            out.append((done[1], done[3] - done[2]))
        if stack:
            stack[-1][2] += e["dur"]
        stack.append([end, e["name"], 0.0, e["dur"]])
    while stack:
        done = stack.pop()
        out.append((done[1], done[3] - done[2]))
    return out


def summarize(trace):
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not ops and not gpu:
        sys.exit("no operators or kernels in the trace: was it written by log.profile_step?")
    start = min(e["ts"] for e in (ops or gpu))
    end = max(e["ts"] + e["dur"] for e in events)
    window = end - start
    by_kind = collections.defaultdict(float)
    by_name = collections.defaultdict(float)
    if gpu:
        for e in gpu:
            k = kind_of(e["name"]) if e["cat"] == "kernel" else "copies"
            by_kind[k] += e["dur"]
            by_name[e["name"]] += e["dur"]
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
        device = "cuda"
    else:
        threads = collections.defaultdict(list)
        for e in ops:
            threads[(e.get("pid"), e.get("tid"))].append(e)
        for evs in threads.values():
            for name, t in self_times(evs):
                by_kind[kind_of(name)] += t
                by_name[name] += t
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in ops])
        device = "cpu"
    return {
        "device": device,
        "window_ms": window / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (window - busy) / 1e3,
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_ms": {k: v / 1e3 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--top", type=int, default=10, help="the most expensive names to list")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"{args.trace}: cannot read the trace: {e}")
    s = summarize(trace)
    s["top_ms"] = dict(list(s["top_ms"].items())[: args.top])
    if args.json:
        print(json.dumps(s))
        return
    what = "GPU time" if s["device"] == "cuda" else "self time over all threads"
    print(f"# {args.trace}: step window {s['window_ms']:.2f} ms on {s['device']}; {what} by kind")
    print(f"{'kind':<20} {'ms':>10} {'% of window':>12}")
    for k, v in s["by_kind_ms"].items():
        print(f"{k:<20} {v:>10.2f} {100 * v / s['window_ms']:>11.1f}%")
    label = "idle (host gaps)" if s["device"] == "cuda" else "no operator running"
    print(f"{label:<20} {s['idle_ms']:>10.2f} {100 * s['idle_ms'] / s['window_ms']:>11.1f}%")
    print(f"# the {args.top} most expensive names:")
    for k, v in s["top_ms"].items():
        print(f"  {v:>10.2f} ms  {k}")


if __name__ == "__main__":
    main()
