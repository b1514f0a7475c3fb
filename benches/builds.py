"""Two zrun builds on one config, interleaved: median step time after warm-up, tokens/s and the
last loss of each, and their ratio. For a change's speed on this machine (or a GPU one), with
the same threads, allocator and settings on both sides.

    python benches/builds.py --base /tmp/zrun-old [--new target/release/zrun] configs/bench-cpu.toml \\
        [--rounds 3] [--set zero.stage=0 ...] [--json]

One rank per run (the config's `dist` otherwise), started directly; each run's metrics.jsonl
gives the step times (the first `--skip` steps left out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(binary, config, sets, log_dir, threads):
    args = [binary, config, "--set", f'log.dir="{log_dir}"']
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{binary} exited with {p.returncode}:\n{(p.stdout + p.stderr)[-2000:]}")
    return [json.loads(x) for x in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--base", required=True, help="the build to compare against")
    ap.add_argument("--new", default=str(ROOT / "target/release/zrun"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS on both sides")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sides = {"base": a.base, "new": a.new}
    times = {k: [] for k in sides}
    loss = {}
    tokens = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, binary in sides.items():
                rows = run(binary, a.config, a.sets, f"{tmp}/{name}{r}", a.threads)
                steps = [x for x in rows if "step_time_s" in x]
                if len(steps) <= a.skip:
                    sys.exit(f"{len(steps)} steps: give more than --skip {a.skip}")
                times[name].append(statistics.median(x["step_time_s"] for x in steps[a.skip:]))
                tokens = steps[0]["tokens"] / steps[0]["step"]
                loss[name] = steps[-1]["loss"]
                print(f"round {r} {name}: {times[name][-1] * 1e3:.1f} ms", file=sys.stderr)
    out = {k: {"step_time_s": statistics.median(v), "tokens_per_s": tokens / statistics.median(v),
               "last_loss": loss[k], "rounds": v} for k, v in times.items()}
    out["new_over_base_step_time"] = out["new"]["step_time_s"] / out["base"]["step_time_s"]
    if a.json:
        print(json.dumps(out))
        return
    for k in sides:
        o = out[k]
        print(f"{k:5} {o['step_time_s'] * 1e3:8.1f} ms/step {o['tokens_per_s']:10.0f} tokens/s "
              f"last loss {o['last_loss']:.6f}")
    print(f"new / base step time: {out['new_over_base_step_time']:.3f}")


if __name__ == "__main__":
    main()
