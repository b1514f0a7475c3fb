#!/usr/bin/env python3
"""Hybrid sharding across two nodes, measured on the two-node testbed (scripts/testbed.sh:
two network namespaces on one machine, the link between them rate-limited by tbf): ZeRO-3
sharding over all 4 ranks (`zero.shard_group = "all"`) against sharding within each node
(`"node"`, the model states replicated across the 2 nodes), at equal global batch, in
interleaved rounds at each link rate. Reports each side's median step time and their ratio.

    sudo python benches/hybrid_testbed.py                           # 1gbit and 200mbit, 2 rounds
    python benches/hybrid_testbed.py --rates 200mbit --rounds 3 --json
    python benches/hybrid_testbed.py --predict testbed.toml         # and zrun's step-time model

With `--predict FILE` (a cluster file: what `zrun bench comm --save` measured on the testbed,
plus the compute rate) each row also shows the step-time model's prediction for that config
and rate (`zrun plan --cluster FILE --predict`), so its error can be read off.

Target (the hybrid-sharding issue): "node" at most 0.6x "all"'s step time at the slower rate.
Needs root (network namespaces); 2 nodes x 2 ranks x 1 thread.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODES = ["all", "node"]


def step_times(log_dir):
    """Median step time (s) of a run's metrics.jsonl, its first 2 steps left out (warm-up)."""
    rows = [json.loads(l) for l in (log_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > 2]
    return statistics.median(times)


def run(zrun, config, mode, rate, steps, nproc, sets, work):
    log_dir = work / f"{mode}-{rate}-{len(list(work.iterdir()))}"
    args = [config, "--set", f'zero.shard_group="{mode}"', "--set", "zero.stage=3",
            "--set", f"train.steps={steps}", "--set", "train.eval_every=0",
            "--set", "checkpoint.every=0", "--set", f'log.dir="{log_dir}"']
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, **common.torch_env(), "ZRUN": str(zrun), "OMP_NUM_THREADS": "1",
           "TESTBED_LOG_DIR": str(log_dir / "testbed")}
    p = subprocess.run([str(common.ROOT / "scripts" / "testbed.sh"), "--rate", rate, "--nproc",
                        str(nproc), "--", *args], cwd=common.ROOT, env=env, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode == 77:
        sys.exit(p.stderr.strip())
    if p.returncode != 0:
        sys.exit(f"testbed run failed ({mode}, {rate}): {p.stderr[-2000:]}")
    return step_times(log_dir)


def predict(zrun, cluster, config, mode, rate, nproc, sets):
    """The step-time model's prediction (s) for this config on the testbed at `rate`."""
    args = [str(zrun), "plan", config, "--cluster", cluster, "--nodes", "2", "--nproc",
            str(nproc), "--link-rate", rate, "--predict", "--set", f'zero.shard_group="{mode}"',
            "--set", "zero.stage=3"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, cwd=common.ROOT, env={**os.environ, **common.torch_env()},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["step_time_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1gbit,200mbit", help="tbf rates of the link, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2, help="ranks per node")
    ap.add_argument("--config", default="configs/bench-cpu.toml")
    ap.add_argument("--set", action="append", default=["train.micro_batch=2"],
                    help="a config override, repeatable (default: train.micro_batch=2, so the link "
                         "rather than the 2 shared cores limits the step)")
    ap.add_argument("--predict", metavar="CLUSTER_TOML", help="also print the step-time model's prediction")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zrun-hybrid-testbed-"))
    zrun = common.ensure_zrun(work)
    load0 = common.load_average()
    rows = []
    print(f"{'rate':>8} {'shard_group':>11} {'step s by round':>24} {'median':>8} {'predicted':>9} "
          f"{'node/all':>8}", flush=True)
    for rate in args.rates.split(","):
        times = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for m in MODES:  # interleaved: one of each per round
                times[m].append(run(zrun, args.config, m, rate, args.steps, args.nproc, args.set, work))
        med = {m: statistics.median(times[m]) for m in MODES}
        for m in MODES:
            pred = predict(zrun, args.predict, args.config, m, rate, args.nproc, args.set) if args.predict else None
            ratio = med["node"] / med["all"]
            row = {"rate": rate, "shard_group": m, "step_s": times[m], "median_s": med[m],
                   "predicted_s": pred, "node_over_all": ratio}
            rows.append(row)
            shown = " ".join(f"{t:.3f}" for t in times[m])
            pred_s = f"{pred:.3f}" if pred is not None else "-"
            print(f"{rate:>8} {m:>11} {shown:>24} {med[m]:>8.3f} {pred_s:>9} "
                  f"{ratio if m == 'node' else 1.0:>8.2f}", flush=True)
            if args.json:
                print(json.dumps(row))
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f}; "
          f"{args.nproc} ranks per node x 2 nodes, 1 thread each; work dir {work}")


if __name__ == "__main__":
    main()
