"""The fault-injection soak's job and its seeded schedule of faults (scripts/chaos.py)."""

from dataclasses import dataclass, field

# The job: a 137k-parameter GPT, one rank per node; a few seconds of training on 2 cores.
STEPS = 240
SHORT_STEPS = 160  # --short: shorter jobs
EVERY = 20  # checkpoint.every
TIMEOUT_S = 4  # dist.timeout_s: a stopped rank trips it quickly
SIGNAL_DEADLINE_S = 20
GRACE_S = 3
RDZV_TIMEOUT_S = 20
MAX_RESTARTS = 2
MAX_ATTEMPTS = 6  # launches of one run (the first and its requeues)

# Variants of the job: the stage, async saves and `keep` change what a fault can break.
VARIANTS = {
    "s1": {"stage": 1, "async": False, "keep": 3, "grad_accum": 1},
    "s3-async": {"stage": 3, "async": True, "keep": 2, "grad_accum": 1},
    "s2-accum": {"stage": 2, "async": False, "keep": 0, "grad_accum": 2},
}

KINDS = ["kill_rank", "kill_launcher", "stop_rank", "preempt", "flip_ckpt", "disk_full", "link_down"]


# ---------------------------------------------------------------------------------------
# Schedule


@dataclass
class Fault:
    kind: str
    step: int  # fires once the job has reached this step ...
    delay: float  # ... and this many seconds more
    params: dict = field(default_factory=dict)
    injected: bool = False
    attempt: int = -1
    detail: str = ""

    def label(self):
        p = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.kind}({p}) at step>={self.step}+{self.delay:.2f}s"


@dataclass
class RunPlan:
    index: int
    variant: str
    netns: bool
    faults: list


def fault_params(rng, kind):
    """The random choices of one fault of `kind`."""
    if kind in ("kill_rank", "kill_launcher", "stop_rank"):
        p = {"node": rng.randrange(2)}
        if kind == "stop_rank":
            p["hold_s"] = round(TIMEOUT_S + rng.uniform(1.0, 4.0), 2)
        return p
    if kind == "preempt":
        return {
            "target": rng.choice(["node0", "node1", "both", "rank0", "rank1"]),
            "sig": rng.choice(["SIGTERM", "SIGUSR1"]),
        }
    if kind == "flip_ckpt":
        return {"when": rng.choice(["requeue", "live"]), "rank": rng.randrange(2),
                "node": rng.randrange(2)}
    if kind == "disk_full":
        persist = rng.random() < 0.4
        return {"hold_s": None if persist else round(rng.uniform(1.0, 5.0), 2)}
    if kind == "link_down":
        return {"hold_s": round(rng.uniform(0.5, 2 * TIMEOUT_S + 3), 2)}
    raise ValueError(kind)


def plan_run(rng, index, n_faults, kinds, variants, netns_ok):
    """One run: a variant and `n_faults` faults, in firing order."""
    chosen = [rng.choice(kinds) for _ in range(n_faults)]
    netns = netns_ok and "link_down" in chosen
    groups = []
    for kind in chosen:
        step = rng.randrange(0, STEPS - EVERY)
        if rng.random() < 0.3:
            step = (step // EVERY) * EVERY  # at a save
        group = [Fault(kind, step, round(rng.uniform(0.0, 0.6), 3), fault_params(rng, kind))]
        if kind == "preempt" and "flip_ckpt" in kinds and rng.random() < 0.5:
            # A byte flipped while the job is down, before the requeue resumes from it.
            flip = Fault("flip_ckpt", 0, 0.0, fault_params(rng, "flip_ckpt"))
            flip.params["when"] = "requeue"
            group.append(flip)
        groups.append(group)
    groups.sort(key=lambda g: g[0].step)
    ordered = [f for g in groups for f in g]
    return RunPlan(index, rng.choice(variants), netns, ordered)


def short_schedule(rng, kinds):
    """`--short`: two runs that cover the main kinds with 6 faults."""
    def f(kind, step, **kw):
        p = fault_params(rng, kind)
        p.update(kw)
        return Fault(kind, step, round(rng.uniform(0.0, 0.4), 3), p)

    runs = [
        [f("kill_rank", 30), f("preempt", 80), f("flip_ckpt", 0, when="requeue")],
        [f("stop_rank", 50, hold_s=TIMEOUT_S + 1.5), f("flip_ckpt", 90, when="live"),
         f("disk_full", 130, hold_s=2.0)],
    ]
    plans = []
    for i, faults in enumerate(runs):
        faults = [x for x in faults if x.kind in kinds]
        plans.append(RunPlan(i, "s1", False, faults))
    return plans
