#!/usr/bin/env python3
"""Fault-injection soak of a 2-node zrun job.

Each run is one job driven the way a cluster scheduler drives it: two launchers
(`zrun --nnodes 2 --node-rank K --nproc 1 --max-restarts N`, one rank each) on loopback,
or each in its own network namespace joined by a veth pair; faults from a seeded schedule
are injected while it trains, and when the job exits (3 after a preemption, or a failure
once its restarts ran out) it is requeued, up to a bound. Fault kinds:

  kill_rank      SIGKILL of one rank
  kill_launcher  SIGKILL of one node's launcher (its rank dies with it)
  stop_rank      SIGSTOP of one rank for longer than dist.timeout_s, then SIGCONT
  preempt        SIGTERM or SIGUSR1 to one launcher, to both, or to one rank
  flip_ckpt      one byte flipped in a rank file of the newest complete checkpoint, either
                 while the job is down (before a requeue) or while it runs, followed by a
                 SIGKILL of a rank so that the restart reads it
  disk_full      checkpoint.dir (a small tmpfs) filled up, for a few seconds or until the
                 job ends
  link_down      `ip link set down` on node 0's veth for a while (namespace runs only)

After each attempt it checks that the job ended by a deadline (else: a hang, killed and
counted), that no process of the job is left (an orphan), and that every non-zero exit is
either 3 (preempted) or comes with an error line naming a fault injected in that attempt.
After the last attempt the final checkpoint, consolidated, must equal an uninterrupted
run's bit for bit (else: a silent divergence), and so must every rank's optimizer state.

  scripts/chaos.py --short               # a handful of faults, well under a minute
  scripts/chaos.py --long                # >= 200 faults (15-25 minutes on 2 cores)
  scripts/chaos.py --faults 60 --seed 7 --json

Exit status: 0 when there was no hang, divergence, orphan or unexplained error; 1
otherwise; 2 on bad usage. Needs root for disk_full (tmpfs) and link_down (namespaces);
without it those kinds are skipped with the reason printed.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos_env import (
    children,
    job_processes,
    kill_all,
    free_port,
    sh,
    Netns,
    can_mount_tmpfs,
    complete_checkpoints,
    flip_byte,
    compare_tensors,
)

from chaos_plan import (
    EVERY,
    GRACE_S,
    Fault,
    KINDS,
    MAX_ATTEMPTS,
    MAX_RESTARTS,
    RDZV_TIMEOUT_S,
    SHORT_STEPS,
    SIGNAL_DEADLINE_S,
    STEPS,
    TIMEOUT_S,
    VARIANTS,
    plan_run,
    short_schedule,
)

ROOT = Path(__file__).resolve().parent.parent

# Words an error line must contain to name each fault (lower case).
NAMES = {
    "kill_rank": ["sigkill", "killed", "connection", "closed", "reset", "lost", "peer"],
    "kill_launcher": ["lost", "heartbeat", "rendezvous", "store", "did not restart",
                      "connection", "closed", "reset", "peer", "sigkill"],
    "stop_rank": ["timed out", "timeout", "did not answer", "stopped answering", "sigkill"],
    "preempt": ["sigterm", "sigusr1", "received", "stopped"],
    "flip_ckpt": ["damaged", "hash", "checksum", "sigkill", "killed", "connection", "closed", "reset"],
    "disk_full": ["no space", "disk is full", "enospc", "os error 28"],
    "link_down": ["timed out", "timeout", "did not answer", "stopped answering", "lost", "heartbeat",
                  "connection", "unreachable", "closed", "reset", "rendezvous", "did not restart"],
}


def log(msg):
    print(f"chaos: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# One attempt: both launchers, faults, deadline, orphans


@dataclass
class Attempt:
    index: int
    codes: list = field(default_factory=list)  # per node: exit code, or -N for signal N
    errors: list = field(default_factory=list)  # the launchers' error lines
    rank_errors: list = field(default_factory=list)
    final_errors: list = field(default_factory=list)
    faults: list = field(default_factory=list)  # faults injected in it
    hang: bool = False
    orphans: list = field(default_factory=list)
    killed: set = field(default_factory=set)  # nodes whose launcher a fault killed
    signalled: set = field(default_factory=set)  # nodes whose launcher got a stop signal
    wall_s: float = 0.0
    verdict: str = ""


class Soak:
    def __init__(self, args):
        self.args = args
        self.zrun = str(Path(args.zrun).resolve())
        self.work = Path(args.workdir).resolve()
        self.rng = random.Random(args.seed)
        self.baselines = {}
        self.netns = None
        self.mounts = []
        self.skipped = {}
        self.results = []
        self.findings = []
        self.live_sessions = set()
        self.live_marker = None

    # -- environment

    def env(self):
        env = dict(os.environ)
        for k in list(env):
            if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "GROUP_RANK", "ZRUN_RUN_ID") or k.startswith(("SLURM_", "OMPI_", "PMI_")):
                del env[k]
        env.update({"OMP_NUM_THREADS": "1", "RUST_BACKTRACE": "0", "RUST_LOG": env.get("RUST_LOG", "info")})
        # libtorch of the project's .venv, as scripts/env.sh sets it, so the script runs
        # from a plain shell too.
        libs = sorted(ROOT.glob(".venv/lib/python3*/site-packages/torch/lib"))
        have = env.get("LD_LIBRARY_PATH", "")
        extra = [str(p) for p in libs[:1] + [ROOT / ".venv/zrun-lib"] if str(p) not in have.split(":")]
        env["LD_LIBRARY_PATH"] = ":".join(extra + ([have] if have else []))
        return env

    def probe(self):
        kinds = list(KINDS)
        if self.args.kinds:
            kinds = [k for k in kinds if k in self.args.kinds.split(",")]
        if "disk_full" in kinds:
            why = "not root" if os.geteuid() != 0 else can_mount_tmpfs(self.work)
            if why:
                self.skipped["disk_full"] = why
        if "link_down" in kinds:
            if self.args.short:
                self.skipped["link_down"] = "--short runs on loopback only"
            elif os.geteuid() != 0 or not shutil.which("ip"):
                self.skipped["link_down"] = "needs root and iproute2 for network namespaces"
            else:
                self.netns = Netns()
                why = self.netns.create()
                if why:
                    self.skipped["link_down"] = why
                    self.netns = None
        for k, why in self.skipped.items():
            log(f"skipping fault kind {k}: {why}")
        return [k for k in kinds if k not in self.skipped]

    def cleanup(self):
        if self.live_marker:
            kill_all(self.live_marker, self.live_sessions)
        for m in self.mounts:
            sh("umount", "-l", str(m))
        self.mounts = []
        if self.netns:
            self.netns.destroy()

    # -- config

    def config(self, run_dir, variant, ckpt_dir):
        v = VARIANTS[variant]
        text = f"""# scripts/chaos.py: variant {variant}
[model]
preset = "tiny"
[data]
source = "synthetic"
branching = 4
seed = 0
[train]
steps = {STEPS}
micro_batch = {8 // v['grad_accum']}
grad_accum = {v['grad_accum']}
lr = 3e-3
warmup_steps = 10
eval_every = 0
eval_batches = 1
seed = 1234
[zero]
stage = {v['stage']}
precision = "fp32"
[dist]
backend = "tcp"
device = "cpu"
timeout_s = {TIMEOUT_S}
[checkpoint]
dir = "{ckpt_dir}"
every = {EVERY}
keep = {v['keep']}
async = {str(v['async']).lower()}
signal_deadline_s = {SIGNAL_DEADLINE_S}
[log]
dir = "{run_dir / 'log'}"
every = 1
"""
        path = run_dir / "train.toml"
        path.write_text(text)
        return path

    # -- launching

    def launch(self, run_dir, cfg, run_id, attempt, netns):
        port = free_port()
        addr = self.netns.addr[0] if netns else "127.0.0.1"
        procs, files = [], []
        for node in (0, 1):
            cmd = [self.zrun, "--nnodes", "2", "--node-rank", str(node), "--nproc", "1",
                   "--master-addr", addr, "--master-port", str(port), "--run-id", run_id,
                   "--max-restarts", str(MAX_RESTARTS), "--grace-s", str(GRACE_S),
                   "--rdzv-timeout-s", str(RDZV_TIMEOUT_S), "--log-format", "json",
                   "--log-dir", str(run_dir / "ranks"), str(cfg)]
            if netns:
                cmd = ["ip", "netns", "exec", self.netns.ns[node]] + cmd
            out = open(run_dir / f"attempt-{attempt}-node{node}.log", "wb")
            files.append(out)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        return procs, files

    def progress(self, metrics):
        """The step of the last metrics line (0 before any)."""
        try:
            with open(metrics, "rb") as fh:
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - 4096))
                lines = fh.read().splitlines()
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
        return 0

    # -- faults

    def worker(self, procs, node):
        if procs[node].poll() is not None:
            return None
        kids = children(procs[node].pid)
        return kids[0] if kids else None

    def inject(self, f, ctx):
        """Injects `f` now; returns False when it cannot be yet (no rank or checkpoint)."""
        procs, att, rng = ctx["procs"], ctx["attempt"], ctx["rng"]
        p = f.params
        if f.kind in ("kill_rank", "stop_rank"):
            pid = self.worker(procs, p["node"])
            if pid is None:
                return False
            if f.kind == "kill_rank":
                os.kill(pid, signal.SIGKILL)
                f.detail = f"SIGKILL to rank {p['node']} (pid {pid})"
            else:
                os.kill(pid, signal.SIGSTOP)
                ctx["releases"].append((time.monotonic() + p["hold_s"], "sigcont", pid))
                f.detail = f"SIGSTOP to rank {p['node']} (pid {pid}) for {p['hold_s']} s"
        elif f.kind == "kill_launcher":
            node = p["node"]
            if procs[node].poll() is not None:
                return False
            os.kill(procs[node].pid, signal.SIGKILL)
            att.killed.add(node)
            f.detail = f"SIGKILL to node {node}'s launcher"
        elif f.kind == "preempt":
            sig = getattr(signal, p["sig"])
            t = p["target"]
            if t.startswith("rank"):
                pid = self.worker(procs, int(t[-1]))
                if pid is None:
                    return False
                os.kill(pid, sig)
            else:
                nodes = [0, 1] if t == "both" else [int(t[-1])]
                if any(procs[n].poll() is not None for n in nodes):
                    return False
                for n in nodes:
                    os.kill(procs[n].pid, sig)
                    att.signalled.add(n)
            f.detail = f"{p['sig']} to {t}"
        elif f.kind == "flip_ckpt":
            ckpts = complete_checkpoints(ctx["ckpt_dir"])
            if not ckpts:
                return False
            victim = self.worker(procs, p["node"]) if procs else None
            if procs and victim is None:
                return False
            f.detail = "flipped " + flip_byte(ckpts[-1], p["rank"], rng)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                f.detail += f"; SIGKILL to rank {p['node']}"
        elif f.kind == "disk_full":
            f.detail = "filled checkpoint.dir: " + self.fill(ctx["ckpt_dir"])
            if p["hold_s"] is not None:
                ctx["releases"].append((time.monotonic() + p["hold_s"], "unfill", ctx["ckpt_dir"]))
                f.detail += f" for {p['hold_s']} s"
            else:
                ctx["releases"].append((float("inf"), "unfill", ctx["ckpt_dir"]))
                f.detail += " until the job ends"
        elif f.kind == "link_down":
            self.netns.link(False)
            ctx["releases"].append((time.monotonic() + p["hold_s"], "link_up", None))
            f.detail = f"node 0's link down for {p['hold_s']} s"
        f.injected = True
        f.attempt = att.index
        att.faults.append(f)
        return True

    def fill(self, ckpt_dir):
        filler = ckpt_dir / "chaos-filler"
        chunk = b"\0" * (1 << 16)
        n = 0
        try:
            with open(filler, "ab") as fh:
                while True:
                    fh.write(chunk)
                    fh.flush()
                    n += len(chunk)
        except OSError:
            pass
        return f"{n // 1024} KiB written, {shutil.disk_usage(ckpt_dir).free // 1024} KiB free"

    def release(self, what, arg):
        if what == "sigcont":
            try:
                os.kill(arg, signal.SIGCONT)
            except OSError:
                pass
        elif what == "unfill":
            try:
                os.unlink(arg / "chaos-filler")
            except OSError:
                pass
        elif what == "link_up":
            self.netns.link(True)

    # -- attempts

    def attempt(self, run_dir, cfg, ckpt_dir, run_id, index, pending, netns, rng):
        att = Attempt(index)
        # Faults that act while the job is down come first.
        while pending and pending[0].kind == "flip_ckpt" and pending[0].params["when"] == "requeue" and index > 0:
            f = pending[0]
            ctx = {"procs": None, "attempt": att, "rng": rng, "ckpt_dir": ckpt_dir, "releases": []}
            if not self.inject(f, ctx):
                break
            pending.pop(0)
        procs, files = self.launch(run_dir, cfg, run_id, index, netns)
        sessions = {p.pid for p in procs}
        self.live_sessions, self.live_marker = sessions, str(cfg)
        ctx = {"procs": procs, "attempt": att, "rng": rng, "ckpt_dir": ckpt_dir, "releases": []}
        metrics = run_dir / "log" / "metrics.jsonl"
        start = time.monotonic()
        deadline = start + self.args.deadline
        armed = None  # when the next fault's step was reached
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                att.hang = True
                break
            for r in [r for r in ctx["releases"] if r[0] <= now]:
                ctx["releases"].remove(r)
                self.release(r[1], r[2])
            live = [f for f in pending if not (f.kind == "flip_ckpt" and f.params["when"] == "requeue")]
            if live and live[0] is pending[0]:
                f = pending[0]
                if armed is None and self.progress(metrics) >= f.step:
                    armed = now + f.delay
                if armed is not None and now >= armed and self.inject(f, ctx):
                    log(f"  attempt {index}: {f.detail}")
                    pending.pop(0)
                    armed = None
            time.sleep(0.05)
        if att.hang:
            alive = job_processes(str(cfg), sessions)
            att.orphans = []
            self.findings.append({"what": "hang", "attempt": index, "alive": alive})
            kill_all(str(cfg), sessions)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for _, what, arg in ctx["releases"]:
            self.release(what, arg)
        att.wall_s = time.monotonic() - start
        att.codes = [p.returncode if p.returncode is not None else None for p in procs]
        for fh in files:
            fh.close()
        if not att.hang:
            att.orphans = self.orphans(str(cfg), sessions)
        self.live_sessions, self.live_marker = set(), None
        self.read_errors(run_dir, att)
        return att

    def orphans(self, marker, sessions):
        """Processes of the job still alive a few seconds after both launchers exited."""
        end = time.monotonic() + 5.0
        while True:
            left = job_processes(marker, sessions)
            if not left or time.monotonic() > end:
                break
            time.sleep(0.1)
        if left:
            kill_all(marker, sessions)
        return left

    def read_errors(self, run_dir, att):
        """The launchers' error lines, the ranks' error lines, and for each node still alive
        the errors of its last round (after its last "restarting the group"), each with the
        failing rank's last lines: what ended the attempt there."""
        att.final_errors = []
        for node in (0, 1):
            path = run_dir / f"attempt-{att.index}-node{node}.log"
            final = []
            for line in path.read_text(errors="replace").splitlines():
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                msg = str(obj.get("message", ""))
                level = str(obj.get("level", "")).lower()
                if "rank" in obj:
                    if level == "error":
                        att.rank_errors.append(f"node {node} rank {obj['rank']}: {msg}")
                    continue
                if "restarting the group" in msg:
                    final = []
                if level == "error":
                    att.errors.append(f"node {node}: {msg.splitlines()[0] if msg else msg}")
                    final.append("\n".join([msg] + [str(x) for x in obj.get("last_lines", [])]))
            if node not in att.killed:
                att.final_errors.append("\n".join(final))

    def judge(self, att):
        """The attempt's verdict: ok, preempted, error_named, error_unnamed, hang."""
        if att.hang:
            return "hang"
        codes = [c for n, c in enumerate(att.codes) if n not in att.killed]
        if not att.killed and all(c == 0 for c in codes):
            return "ok"
        signalled = {128 + getattr(signal, f.params["sig"]) for f in att.faults if f.kind == "preempt"}
        if codes and all(c in (0, 3) or c in signalled for c in codes) and any(c != 0 for c in codes):
            return "preempted"
        # A failure must be named by the error that ended it, on a node still alive.
        text = "\n".join(att.final_errors).lower()
        words = [w for f in att.faults for w in NAMES[f.kind]]
        return "error_named" if any(w in text for w in words) else "error_unnamed"

    # -- runs

    def baseline(self, variant):
        if variant in self.baselines:
            return self.baselines[variant]
        run_dir = self.work / f"baseline-{variant}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        ckpt_dir = run_dir / "ckpt"
        cfg = self.config(run_dir, variant, ckpt_dir)
        att = self.attempt(run_dir, cfg, ckpt_dir, f"chaos-base-{variant}", 0, [], False, self.rng)
        if att.hang or att.codes != [0, 0] or att.orphans:
            raise SystemExit(f"chaos: the uninterrupted {variant} run failed (codes {att.codes}); "
                             f"see {run_dir}")
        final = self.consolidate(ckpt_dir, run_dir)
        if isinstance(final, str):
            raise SystemExit(f"chaos: baseline {variant}: {final}")
        self.baselines[variant] = (final, ckpt_dir, att.wall_s)
        log(f"baseline {variant}: {att.wall_s:.1f} s")
        return self.baselines[variant]

    def consolidate(self, ckpt_dir, run_dir):
        """The final checkpoint consolidated, or why not."""
        ckpts = complete_checkpoints(ckpt_dir)
        if not ckpts:
            return "no complete checkpoint"
        last = ckpts[-1]
        if int(last.name[5:]) != STEPS:
            return f"the newest checkpoint is {last.name}, not step {STEPS}"
        out = run_dir / "final.safetensors"
        r = subprocess.run([self.zrun, "consolidate", str(last), "-o", str(out)], cwd=ROOT,
                           env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            return f"zrun consolidate {last} failed: {r.stdout.strip()[-500:]}"
        return out

    def run(self, plan):
        base, base_ckpt, _ = self.baseline(plan.variant)
        run_dir = self.work / f"run-{plan.index:03d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        (run_dir / "ckpt").mkdir(parents=True)
        ckpt_dir = run_dir / "ckpt"
        if any(f.kind == "disk_full" for f in plan.faults):
            r = sh("mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(ckpt_dir))
            if r.returncode != 0:
                raise SystemExit(f"chaos: mounting a tmpfs on {ckpt_dir}: {r.stdout}")
            self.mounts.append(ckpt_dir)
        cfg = self.config(run_dir, plan.variant, ckpt_dir)
        run_id = f"chaos-{self.args.seed}-{plan.index}"
        rng = random.Random(f"{self.args.seed}-{plan.index}")
        log(f"run {plan.index} ({plan.variant}{', namespaces' if plan.netns else ''}): "
            + "; ".join(f.label() for f in plan.faults))
        pending = list(plan.faults)
        attempts = []
        for a in range(MAX_ATTEMPTS):
            att = self.attempt(run_dir, cfg, ckpt_dir, run_id, a, pending, plan.netns, rng)
            att.verdict = self.judge(att)
            attempts.append(att)
            log(f"  attempt {a}: {att.verdict}, exit codes {att.codes}, {att.wall_s:.1f} s"
                + (f"; {att.errors[0]}" if att.errors and att.verdict != "ok" else ""))
            if att.orphans:
                self.findings.append({"what": "orphans", "run": plan.index, "attempt": a,
                                      "processes": att.orphans, "dir": str(run_dir)})
            if att.verdict == "error_unnamed":
                self.findings.append({"what": "unexplained error", "run": plan.index, "attempt": a,
                                      "faults": [f.label() for f in att.faults],
                                      "codes": att.codes, "errors": att.errors[:6],
                                      "rank_errors": att.rank_errors[:6], "dir": str(run_dir)})
            if att.verdict in ("ok", "hang"):
                break
        result = self.outcome(plan, attempts, run_dir, ckpt_dir, base, base_ckpt)
        if ckpt_dir in self.mounts:
            sh("umount", "-l", str(ckpt_dir))
            self.mounts.remove(ckpt_dir)
        clean = all(a["verdict"] != "error_unnamed" for a in result["attempts"])
        if not self.args.keep and result["outcome"] == "bitwise_equal" and not result["orphans"] and clean:
            shutil.rmtree(run_dir, ignore_errors=True)
        self.results.append(result)
        return result

    def outcome(self, plan, attempts, run_dir, ckpt_dir, base, base_ckpt):
        last = attempts[-1]
        res = {
            "run": plan.index,
            "variant": plan.variant,
            "netns": plan.netns,
            "faults": [{"kind": f.kind, "params": f.params, "step": f.step, "injected": f.injected,
                        "attempt": f.attempt, "detail": f.detail} for f in plan.faults],
            "attempts": [{"verdict": a.verdict, "codes": a.codes, "wall_s": round(a.wall_s, 2),
                          "errors": a.errors[:4]} for a in attempts],
            "orphans": sum(len(a.orphans) for a in attempts),
            "dir": str(run_dir),
        }
        if last.verdict == "hang":
            res["outcome"] = "hang"
        elif last.verdict != "ok":
            named = last.verdict in ("error_named", "preempted")
            res["outcome"] = "correct_error" if named else "wrong_error"
            res["error"] = last.errors[0] if last.errors else f"exit codes {last.codes}"
        else:
            final = self.consolidate(ckpt_dir, run_dir)
            if isinstance(final, str):
                res["outcome"] = "divergence"
                res["why"] = final
            else:
                diff = compare_tensors(final, base)
                last_ckpt = complete_checkpoints(ckpt_dir)[-1]
                for r in (0, 1):
                    name = f"rank-{r:05d}.safetensors"
                    # The generator state is left out: two uninterrupted runs differ in it.
                    theirs = base_ckpt / last_ckpt.name / name
                    diff += [f"{name}:{t}" for t in compare_tensors(last_ckpt / name, theirs)]
                res["outcome"] = "divergence" if diff else "bitwise_equal"
                if diff:
                    res["why"] = "tensors differ from the uninterrupted run: " + ", ".join(diff[:8])
        if res["outcome"] in ("divergence", "wrong_error", "hang"):
            self.findings.append({"what": res["outcome"], "run": plan.index, "seed": self.args.seed,
                                  "why": res.get("why") or res.get("error", ""),
                                  "faults": [f.label() + " -> " + f.detail for f in plan.faults if f.injected],
                                  "dir": str(run_dir)})
        log(f"  run {plan.index}: {res['outcome']}" + (f" ({res.get('why')})" if res.get("why") else ""))
        return res

    def rejudge(self):
        """Judges again the attempts of `--workdir`'s report that had an unexplained error,
        from their logs (kept for exactly those runs), and rewrites the report."""
        rep = json.loads((self.work / "report.json").read_text())
        self.results, self.skipped = rep["results"], rep["skipped_kinds"]
        self.args.seed = rep["seed"]
        self.findings = [f for f in rep["findings"] if f["what"] != "unexplained error"]
        for res in self.results:
            run_dir = Path(res["dir"])
            for i, a in enumerate(res["attempts"]):
                if a["verdict"] != "error_unnamed":
                    continue
                att = Attempt(i, codes=a["codes"])
                att.faults = [Fault(f["kind"], f["step"], 0.0, f["params"]) for f in res["faults"]
                              if f["injected"] and f["attempt"] == i]
                att.killed = {f.params["node"] for f in att.faults if f.kind == "kill_launcher"}
                self.read_errors(run_dir, att)
                a["verdict"] = self.judge(att)
                if a["verdict"] == "error_unnamed":
                    self.findings.append({"what": "unexplained error", "run": res["run"], "attempt": i,
                                          "faults": [f.label() for f in att.faults], "codes": att.codes,
                                          "errors": att.errors[:6], "rank_errors": att.rank_errors[:6],
                                          "dir": str(run_dir)})
            last = res["attempts"][-1]["verdict"]
            if res["outcome"] == "wrong_error" and last != "error_unnamed":
                res["outcome"] = "correct_error"
                self.findings = [f for f in self.findings
                                 if not (f["what"] == "wrong_error" and f["run"] == res["run"])]
        new = self.report(rep["wall_s"])
        new["rejudged"] = True
        return new

    # -- report

    def report(self, wall):
        by_kind = {k: 0 for k in KINDS}
        for r in self.results:
            for f in r["faults"]:
                if f["injected"]:
                    by_kind[f["kind"]] += 1
        outcomes = [r["outcome"] for r in self.results]
        verdicts = [a["verdict"] for r in self.results for a in r["attempts"]]
        unexplained = verdicts.count("error_unnamed")
        return {
            "seed": self.args.seed,
            "runs": len(self.results),
            "faults_injected": sum(by_kind.values()),
            "faults_by_kind": by_kind,
            "skipped_kinds": self.skipped,
            "bitwise_equal": outcomes.count("bitwise_equal"),
            "correct_error": outcomes.count("correct_error"),
            "wrong_error": outcomes.count("wrong_error"),
            "hangs": outcomes.count("hang"),
            "divergences": outcomes.count("divergence"),
            "orphans": sum(r["orphans"] for r in self.results),
            "attempts": len(verdicts),
            "attempts_by_verdict": {v: verdicts.count(v) for v in sorted(set(verdicts))},
            "unexplained_errors": unexplained,
            "wall_s": round(wall, 1),
            "findings": self.findings,
            "results": self.results,
        }

    def print_table(self, rep):
        rows = [("fault kind", "injected")]
        for k, n in rep["faults_by_kind"].items():
            rows.append((k, str(n) if k not in rep["skipped_kinds"] else f"skipped: {rep['skipped_kinds'][k]}"))
        rows.append(("total", str(rep["faults_injected"])))
        rows += [("", ""), ("runs", str(rep["runs"])),
                 ("completed bitwise equal", str(rep["bitwise_equal"])),
                 ("ended with a correct error", str(rep["correct_error"])),
                 ("ended with a wrong error", str(rep["wrong_error"])),
                 ("hangs", str(rep["hangs"])),
                 ("silent divergences", str(rep["divergences"])),
                 ("orphan processes", str(rep["orphans"])),
                 ("attempts (launches)", str(rep["attempts"]) + "  " + ", ".join(
                     f"{k} {v}" for k, v in rep["attempts_by_verdict"].items())),
                 ("unexplained errors", str(rep["unexplained_errors"])),
                 ("wall time", f"{rep['wall_s']} s (seed {rep['seed']})")]
        w = max(len(a) for a, _ in rows)
        for a, b in rows:
            print(f"{a:<{w}}  {b}" if a else "")
        for f in rep["findings"]:
            print(f"finding: {json.dumps(f)}")


def verdict_bad(rep):
    """How many hangs, divergences, orphans and unnamed errors the report counts."""
    return rep["hangs"] + rep["divergences"] + rep["orphans"] + rep["wrong_error"] + rep["unexplained_errors"]


def publish(soak, rep, args):
    """Writes the report into the workdir and prints it (JSON or a table)."""
    rep["workdir"] = args.workdir
    (Path(args.workdir) / "report.json").write_text(json.dumps(rep, indent=1))
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        soak.print_table(rep)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--short", action="store_true", help="2 runs, 6 faults (for make test)")
    mode.add_argument("--long", action="store_true", help="at least 200 faults")
    mode.add_argument("--faults", type=int, help="at least this many faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--zrun", default=str(ROOT / "target/release/zrun"))
    ap.add_argument("--workdir", help="where runs go [default: a new temporary directory]")
    ap.add_argument("--kinds", help="comma-separated fault kinds to use [default: all]")
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds an attempt may take before it counts as a hang")
    ap.add_argument("--keep", action="store_true", help="keep the directories of runs that passed")
    ap.add_argument("--rejudge", action="store_true",
                    help="judge again the unexplained errors of --workdir's finished soak from their logs")
    args = ap.parse_args(argv)
    if args.long:
        args.faults = 200
    if not args.short and not args.faults:
        args.short = True
    if not os.access(args.zrun, os.X_OK):
        ap.error(f"{args.zrun} is not an executable; build it with `cargo build --release -p zrun`")
    if args.kinds:
        bad = [k for k in args.kinds.split(",") if k not in KINDS]
        if bad:
            ap.error(f"unknown fault kind {bad[0]}; kinds: {', '.join(KINDS)}")
    return args


def main(argv):
    args = parse_args(argv)
    if args.short:
        global STEPS
        STEPS = SHORT_STEPS
    if args.rejudge:
        if not args.workdir:
            print("chaos: --rejudge needs --workdir", file=sys.stderr)
            return 2
        soak = Soak(args)
        rep = soak.rejudge()
        publish(soak, rep, args)
        return 1 if verdict_bad(rep) else 0
    own_dir = args.workdir is None
    if own_dir:
        args.workdir = tempfile.mkdtemp(prefix="zrun-chaos-")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    soak = Soak(args)

    def on_signal(sig, _frame):
        soak.cleanup()
        sys.exit(128 + sig)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    start = time.monotonic()
    try:
        kinds = soak.probe()
        if args.short:
            plans = short_schedule(soak.rng, kinds)
        else:
            plans, planned, i = [], 0, 0
            variants = list(VARIANTS)
            while planned < args.faults:
                plan = plan_run(soak.rng, i, soak.rng.randint(2, 5), kinds, variants, soak.netns is not None)
                plans.append(plan)
                planned += len(plan.faults)
                i += 1
        log(f"seed {args.seed}: {len(plans)} runs, {sum(len(p.faults) for p in plans)} faults planned, in {args.workdir}")
        injected = 0
        for plan in plans:
            soak.run(plan)
            injected = sum(f["injected"] for r in soak.results for f in r["faults"])
        # Faults planned past the end of a job are not injected: top up to the target.
        i = len(plans)
        while not args.short and injected < args.faults:
            plan = plan_run(soak.rng, i, soak.rng.randint(2, 5), kinds, list(VARIANTS), soak.netns is not None)
            soak.run(plan)
            injected = sum(f["injected"] for r in soak.results for f in r["faults"])
            i += 1
    finally:
        soak.cleanup()
    rep = soak.report(time.monotonic() - start)
    publish(soak, rep, args)
    bad = verdict_bad(rep)
    if own_dir and not bad and not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
