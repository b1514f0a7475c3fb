"""Helpers of the GPU checks: losses of a run, per-step comparisons of pairs of runs, and a
run's steady step time."""
import concurrent.futures
import os
import statistics

# ZRUN_GPU_ROUNDS=1 runs one interleaved round where a check runs several, and leaves out
# the speed check's side that only informs (stage 3 without prefetch): for a short lease.
# ZRUN_GPU_8B_TIMEOUT caps the 8B run (seconds; the steps it logged are still reported), and
# ZRUN_GPU_8B_MICRO_BATCH sets its micro-batch (1; "auto": the largest of 16, 8, 4, 2 the
# estimate fits).
ROUNDS = int(os.environ.get("ZRUN_GPU_ROUNDS", "0")) or None


def losses(run):
    return [m["loss"] for m in run.get("metrics", []) if "loss" in m]


def worst_rel(a, b):
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def compare(c, pairs, bound):
    """Runs (name, want_job, got_job) pairs, four jobs at a time (they barely load the GPU),
    and compares per-step losses; `bound(key)` is the relative bound of a pair."""
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for key, want, got in pairs:
            jobs[key] = (pool.submit(c.train, *want), pool.submit(c.train, *got))
    rows, ok = {}, True
    for key, (fw, fg) in jobs.items():
        w, g = fw.result(), fg.result()
        rel = worst_rel(losses(g), losses(w))
        # A kernel of zrun's own that did not install (the run goes on without it) fails the
        # pair: the check is there to run it.
        warned = [x for r in (w, g) for x in r.get("warnings", []) if "kernel" in x]
        good = (w["rc"] == 0 and g["rc"] == 0 and rel is not None and rel <= bound(key)
                and not warned)
        ok &= good
        row = {"pass": good, "worst_rel_loss": rel, "bound": bound(key),
               "final_loss": (losses(g) or [None])[-1]}
        if warned:
            row["kernel_warnings"] = warned
        for side, r in [("want", w), ("got", g)]:
            if r["rc"] != 0:
                row[f"{side}_rc"], row[f"{side}_output"] = r["rc"], r.get("output")
        rows[key] = row
    return {"pass": ok, "rows": rows}


def rank_pairs(tag, w2_sets=(), env=None):
    """(key, W=1 job, W=2 job) for the small model at stages 0-3 in fp32 and bf16, the same
    global batch on both sides (12 sequences); `w2_sets` and `env` go to the W=2 side."""
    pairs = []
    for prec in ["fp32", "bf16"]:
        for stage in range(4):
            common = [f"zero.stage={stage}", f'zero.precision="{prec}"']
            key = f"{prec}-stage{stage}"
            w2 = (f"{tag}2-{key}", "small", 2, common + ["train.micro_batch=6", *w2_sets])
            pairs.append((key, (f"{tag}1-{key}", "small", 1, common + ["train.micro_batch=12"]),
                          w2 + ((env,) if env else ())))
    return pairs


def steady(run, skip=5):
    """Median step time, tokens/s and MFU over the steps after the first `skip`."""
    ms = [m for m in run.get("metrics", []) if m.get("step", 0) > skip and "step_time_s" in m]
    if not ms:
        return None
    st = statistics.median(m["step_time_s"] for m in ms)
    tok = ms[0]["tokens"] / ms[0]["step"]
    mfu = [m["mfu"] for m in ms if m.get("mfu") is not None]
    return {"step_time_s": st, "tokens_per_s": tok / st,
            "mfu": statistics.median(mfu) if mfu else None}
