#!/usr/bin/env python3
"""Hybrid sharding across two nodes, measured on the two-node testbed (scripts/testbed.sh:
two network namespaces on one machine, the link between them rate-limited by tbf): ZeRO-3
sharding over all 4 ranks (`zero.shard_group = "all"`) against sharding within each node
(`"node"`, the model states replicated across the 2 nodes), at equal global batch, in
interleaved rounds at each link rate. Reports each side's median step time and their ratio.

    sudo python benches/hybrid_testbed.py                           # 1gbit and 200mbit, 2 rounds
    python benches/hybrid_testbed.py --rates 200mbit --rounds 3 --json
    python benches/hybrid_testbed.py --predict                      # and zrun's step-time model
    python benches/hybrid_testbed.py --against /tmp/zrun-old        # "node" with another build too

With `--predict` the step-time model is calibrated on the testbed first, at each rate
(`zrun bench comm --save` on one node and across the link, and the compute rate from a
one-node run at stage 0), and each row shows its prediction for that config (`zrun plan
--cluster FILE --json`) and the ratio predicted / measured.

With `--against BIN` the "node" side also runs with another zrun binary (an older build, say),
in the same rounds, and the table adds its row and the ratio of this build's median to it.

Target (the hybrid-sharding issue): "node" at most 0.6x "all"'s step time at the slower rate.
Needs root (network namespaces); 2 nodes x 2 ranks x 1 thread.
"""
import argparse
import json
import os
import shutil
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


SIZES = "64K,256K,1M,4M"


def calibrate(zrun, config, rate, nproc, sets, work):
    """A cluster file for the testbed at `rate`, measured: [intra] by `zrun bench comm --save`
    on one node of `nproc` ranks, [inter] by the same across the testbed's link, and the
    compute rate from a one-node run of the config (2 x `nproc` ranks at stage 0, so no
    gathers): its forward + backward time per rank against the FLOPs the model counts."""
    path = work / f"cluster-{rate}.toml"
    env = {**os.environ, **common.torch_env(), "OMP_NUM_THREADS": "1"}
    subprocess.run([str(zrun), "bench", "comm", "--nproc", str(nproc), "--sizes", SIZES, "--iters", "3",
                    "--save", str(path)], cwd=common.ROOT, env=env, check=True, capture_output=True)
    p = subprocess.run([str(common.ROOT / "scripts" / "testbed.sh"), "--rate", rate, "--nproc", str(nproc),
                        "--", "exec", "--", str(zrun), "bench", "comm", "--sizes", SIZES, "--iters", "3",
                        "--save", str(path)], cwd=common.ROOT, env={**env, "ZRUN": str(zrun)},
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench comm on the testbed failed: {p.stderr[-2000:]}")
    # The compute rate: per rank, the model's FLOPs over the measured forward + backward.
    log_dir = work / f"compute-{rate}"
    args = [str(zrun), "--nproc", str(2 * nproc), config, "--set", "zero.stage=0", "--set", "train.steps=8",
            "--set", "train.eval_every=0", "--set", "checkpoint.every=0", "--set", f'log.dir="{log_dir}"']
    for x in sets:
        args += ["--set", x]
    subprocess.run(args, cwd=common.ROOT, env=env, check=True, capture_output=True)
    last = json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[-1])
    fb = statistics.mean(r["forward_s"] + r["backward_s"] for r in last["ranks"])
    text = path.read_text()
    probe = "[cluster]\nnodes = 2\ngpus_per_node = %d\ndevice = \"cpu\"\ndevice_memory = \"4GiB\"\nflops = 1e10\n" % nproc
    path.write_text(probe + text)
    ref = plan(zrun, path, config, "all", sets, stage=0)["compute_s"]
    flops = 1e10 * ref / fb
    path.write_text(probe.replace("flops = 1e10", f"flops = {flops:.4g}") + text)
    return path, flops


def plan(zrun, cluster, config, mode, sets, stage=3):
    """The step-time model's breakdown for this config on the cluster file (`zrun plan --json`)."""
    args = [str(zrun), "plan", config, "--cluster", str(cluster), "--json", "--set", f'zero.shard_group="{mode}"',
            "--set", f"zero.stage={stage}"]
    for x in sets:
        args += ["--set", x]
    out = subprocess.run(args, cwd=common.ROOT, env={**os.environ, **common.torch_env()},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["config"]["step"]


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
    ap.add_argument("--predict", action="store_true",
                    help="calibrate the step-time model on the testbed (bench comm --save, a compute run) "
                         "and print its prediction beside each measurement")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (rank logs)")
    ap.add_argument("--against", help="another zrun binary to run the \"node\" side with too")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zrun-hybrid-testbed-"))
    zrun = common.ensure_zrun(work)
    # Each side: its label, shard group and binary.
    sides = [(m, m, zrun) for m in MODES]
    if args.against:
        other = work / "zrun-against"
        shutil.copy2(args.against, other)
        sides.append(("node@against", "node", other))
    load0 = common.load_average()
    rows = []
    print(f"{'rate':>8} {'shard_group':>11} {'step s by round':>24} {'median':>8} {'predicted':>9} "
          f"{'pred/meas':>9} {'/all':>8}", flush=True)
    for rate in args.rates.split(","):
        cluster = None
        if args.predict:
            cluster, flops = calibrate(zrun, args.config, rate, args.nproc, args.set, work)
            print(f"# {rate}: calibrated {cluster} (compute {flops / 1e9:.1f} GFLOP/s per rank)", flush=True)
        times = {label: [] for label, _, _ in sides}
        for _ in range(args.rounds):
            for label, m, binary in sides:  # interleaved: one of each per round
                times[label].append(run(binary, args.config, m, rate, args.steps, args.nproc, args.set, work))
        med = {label: statistics.median(t) for label, t in times.items()}
        for label, m, binary in sides:
            pred = plan(binary, cluster, args.config, m, args.set)["step_s"] if cluster else None
            ratio = med[label] / med["all"]
            row = {"rate": rate, "shard_group": label, "step_s": times[label], "median_s": med[label],
                   "predicted_s": pred, "predicted_over_measured": pred / med[label] if pred else None,
                   "over_all": ratio}
            rows.append(row)
            shown = " ".join(f"{t:.3f}" for t in times[label])
            pred_s = f"{pred:.3f}" if pred is not None else "-"
            err = f"{pred / med[label]:.2f}" if pred is not None else "-"
            print(f"{rate:>8} {label:>11} {shown:>24} {med[label]:>8.3f} {pred_s:>9} {err:>9} "
                  f"{ratio:>8.2f}", flush=True)
            if args.json:
                print(json.dumps(row))
        if args.against:
            print(f"# {rate}: node, this build / --against: {med['node'] / med['node@against']:.3f}", flush=True)
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f}; "
          f"{args.nproc} ranks per node x 2 nodes, 1 thread each")
    common.clean_up(work, args.keep)


if __name__ == "__main__":
    main()
