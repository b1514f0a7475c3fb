"""zrun on a GPU: every check of the GPU validation in one command, each reported pass/fail with
its figures, written to one JSON file as it goes (a later check that hangs or times out leaves
the earlier results) and summed up in a table on stdout.

    python3 benches/gpu/checks.py --zrun .gpu/zrun --out "$OUT/results.json" [--only a,c]

Checks (one GPU; several ranks share it over the tcp backend, which stages CUDA tensors):
  u  ext       the unit tests of zrun's libtorch extension (zrun-torch-ext, packed beside the
               binary), whose CUDA parts run only on a GPU: side-stream copies ordered after
               the work before them (the delayed update's upload stream), pinned blocks,
               events, storage release; all pass, and libtorch sees the GPU
  x  kernels   zrun's own CUDA kernels (NVRTC): `zrun bench kernels`, the fused (and the chunked)
               loss, SwiGLU, the rotary embedding, the bias (alone and after GELU) and
               LayerNorm sums, AdamW with the bf16 parameters, the gradient layout and the
               split delayed update's fresh share against PyTorch's ops at gpt2-medium's and
               llama3.2-1b's shapes, bf16, forward and backward: time, peak memory, results
               apart (<= 2e-2)
  a  nccl      NCCL at world size 1: `zrun bench comm` in fp32 and bf16, no wrong element
  b  ranks     stages 0-3 at W=2 over tcp against W=1, fp32 (1e-5) and bf16 (3%), per step
  g  cpu       the same small model on CUDA and on CPU at W=1, stages 0-3, fp32 and bf16,
               offload on and off, the delayed update (plain and split) at stage 2, and a
               small Llama at stages 0 and 3 (its RMSNorm is
               ATen's fused kernel on CUDA; its SwiGLU and the full logits' loss zrun's own):
               per-step losses agree, and no run warns that zrun's kernels did not install
  c  speed     gpt2-medium bf16 at W=1, stages 0 and 3 (prefetch 1 and 0), against PyTorch
               eager and torch.compile (benches/gpu/torch_train.py), interleaved: tokens/s,
               MFU, max_memory_allocated; targets: >= 160K tokens/s, >= 1.0x compile, stage 3
               within 5% of stage 0
  p  profile   where one step's time goes (gpt2-medium bf16, 8 x 1024, W=1, stages 0 and 3;
               llama3.2-1b bf16, 8 x 2048, stage 0):
               log.profile_step's trace summed by benches/profile_table.py (GPU time by kind,
               the host gaps between kernels, the most expensive kernels)
  m  llama     the llama3.2-1b preset bf16 at 2048 tokens, W=1, at the largest micro-batch
               zrun's estimate fits on the GPU, against PyTorch eager and torch.compile at the
               same micro-batch, interleaved (where compile runs out of memory there, zrun
               stage 0 and compile again at the largest half compile fits); target >= 1.0x
               compile
  n  8b        the llama3.1-8b preset at 2048 tokens on one GPU: W=1, bf16, stage 3,
               offload_optimizer = "cpu" with bf16 moments, activation checkpointing, 20
               steps at micro-batch 1 (ZRUN_GPU_8B_MICRO_BATCH): tokens/s, MFU, device and
               host peaks against zrun's estimate
  d  memory    gpt2-medium bf16 at W=2 on one GPU, stages 0-3: CUDA peaks against the
               model-state formula and zrun's estimate
  e  offload   gpt2-medium bf16 stage 2 at W=1 with and without offload_optimizer = "cpu"
  f  oom       a micro-batch far too large at W=2: exit 4, a diagnosis naming rank, phase and
               bytes, every rank gone in time
  i  nccl_ranks stages 0-3 at W=2 over NCCL on the one GPU (ZRUN_NCCL_SHARE_GPU=1: a host id
               per rank, sockets over loopback) against W=1, fp32 (1e-5) and bf16 (3%), and
               `zrun bench comm --backend nccl --nproc 2` with no wrong element
  j  nccl_kill two NCCL ranks started without the launcher (as mpirun or srun would), one
               killed mid-run: the other's watchdog ends it within dist.timeout_s naming the
               timeout, and no process is left
  l  nccl_hybrid zero.shard_group = 2 at W=4 over NCCL on the one GPU (sub-communicators from
               ncclCommSplit), stages 1-3 in fp32, against W=4 over tcp (1e-5), per step
  k  delay     gpt2-medium bf16 stage 2 at W=1, 32 x 1024 (a batch where the GPU step is at
               least the CPU AdamW): no offload, offload, and offload with
               zero.offload_delay = 1 (ZeRO-Offload's delayed update), plain and split
               (zero.offload_delay_fresh; and the split with its copies to the device on the
               compute stream, ZRUN_UPLOAD_STREAM=0, and with each micro-batch read in line,
               ZRUN_READ_AHEAD=0), interleaved; target: the split's step
               <= 1.1 x max(the step without offload, the CPU AdamW alone),
               and the loss after 200 steps within 1% of the undelayed offload run (K:
               a 50-step learning-rate warm-up, and the delay on once it ends, its default;
               at lr 3e-4, the target, and 1e-4, every fifth step's loss recorded)
  h  limit     dist.memory_limit on CUDA (the caching allocator's per-process fraction) with
               train.on_oom = "shrink": a micro-batch that does not fit under the limit is
               halved until it does, and the allocator never passes the limit
"""
import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from delay_checks import check_delay, check_delay_loss
from nccl_checks import check_nccl, check_nccl_hybrid, check_nccl_kill, check_nccl_ranks
from runs import ROUNDS, compare, rank_pairs, steady
from table import table

HERE = Path(__file__).resolve().parent
H100_BF16_PEAK_TFLOPS = 989.0

SMALL = """
[model]
preset = "tiny"
vocab_size = 64
seq_len = 16
n_layer = 3
n_head = 4
d_model = 32
[data]
branching = 4
seed = 3
[train]
steps = 20
lr = 3e-3
warmup_steps = 4
weight_decay = 0.1
grad_clip = 0.5
eval_batches = 1
threads = 1
seed = 7
[dist]
device = "cuda"
[log]
every = 1
"""

# SMALL's shapes as a Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU).
SMALL_LLAMA = SMALL.replace('preset = "tiny"', 'arch = "llama"\npreset = "llama-tiny"').replace(
    "d_model = 32\n", "d_model = 32\nn_kv_head = 2\nhead_dim = 8\nffn_hidden = 64\n")

GPT2M = f"""
[model]
preset = "gpt2-medium"
[data]
source = "synthetic"
seed = 0
[train]
steps = 15
micro_batch = 8
lr = 3e-4
eval_batches = 1
seed = 1234
[zero]
precision = "bf16"
[dist]
device = "cuda"
[log]
every = 1
peak_tflops = {H100_BF16_PEAK_TFLOPS}
"""


class Checks:
    def __init__(self, zrun, out, work):
        self.zrun, self.out, self.work = zrun, Path(out), Path(work)
        self.results = {"device": gpu_name(), "checks": {}}
        self.configs = {}
        self.lock = threading.Lock()
        for name, text in [("small", SMALL), ("small-llama", SMALL_LLAMA), ("gpt2m", GPT2M)]:
            p = self.work / f"{name}.toml"
            p.write_text(text)
            self.configs[name] = p

    def add_config(self, name, text):
        p = self.work / f"{name}.toml"
        p.write_text(text)
        self.configs[name] = p

    def save(self):
        self.out.write_text(json.dumps(self.results, indent=1))

    def record(self, key, result):
        with self.lock:
            self.results["checks"][key] = result
            self.save()
        print(f"# {key}: {'PASS' if result.get('pass') else 'FAIL'}", flush=True)

    def cmd(self, args, timeout, env=None):
        """Runs zrun; returns (exit code, output, seconds). A run past `timeout` is killed
        with its whole process group and reported as exit code None."""
        t0 = time.time()
        p = subprocess.Popen(
            [str(self.zrun), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "ZRUN_QUIET": "1", **(env or {})},
        )
        try:
            out, _ = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            rc = None
        return rc, out, time.time() - t0

    def train(self, name, config, nproc, sets, env=None, timeout=240):
        """One zrun job; returns its exit code, output tail, metrics and summary."""
        d = self.work / name
        args = ["--nproc", str(nproc), str(self.configs[config]), "--set", f'log.dir="{d}"']
        for s in sets:
            args += ["--set", s]
        rc, out, secs = self.cmd(args, timeout, env=env)
        run = {"rc": rc, "seconds": round(secs, 1)}
        warnings = [x for x in out.splitlines() if "WARN" in x]
        if warnings:
            run["warnings"] = warnings[-5:]
        if rc != 0:
            run["output"] = out[-3000:]
            # a run cut short still reports the steps it logged
            if (d / "metrics.jsonl").exists():
                lines = (d / "metrics.jsonl").read_text().splitlines()
                run["partial_metrics"] = [json.loads(x) for x in lines if x.strip().startswith("{")]
            return run
        lines = (d / "metrics.jsonl").read_text().splitlines()
        run["metrics"] = [json.loads(x) for x in lines if x.strip()]
        run["summary"] = json.loads((d / "summary.json").read_text())
        return run


def gpu_name():
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_ranks(c):
    pairs = rank_pairs("w")
    r = compare(c, pairs, lambda k: 1e-5 if k.startswith("fp32") else 3e-2)
    r["what"] = "W=2 on one GPU over tcp against W=1, same global batch, per-step loss"
    return r


def check_cpu(c):
    pairs = []
    for prec in ["fp32", "bf16"]:
        for stage in range(4):
            for off in (["none", "cpu"] if stage else ["none"]):
                sets = [f"zero.stage={stage}", f'zero.precision="{prec}"',
                        f'zero.offload_optimizer="{off}"', "train.micro_batch=12"]
                key = f"{prec}-stage{stage}-offload_{off}"
                pairs.append((key, (f"cpu-{key}", "small", 1, sets + ['dist.device="cpu"']),
                              (f"cuda-{key}", "small", 1, sets)))
    # The delayed update, plain and split: on CUDA its copies to the device run on the upload
    # stream beside backward (delay.rs `upload`), on CPU in line.
    for prec in ["fp32", "bf16"]:
        for fresh in ["false", "true"]:
            sets = ["zero.stage=2", f'zero.precision="{prec}"', 'zero.offload_optimizer="cpu"',
                    "zero.offload_delay=1", "zero.offload_delay_warmup=2",
                    f"zero.offload_delay_fresh={fresh}", "train.micro_batch=12"]
            key = f"{prec}-stage2-delay-fresh_{fresh}"
            pairs.append((key, (f"cpu-{key}", "small", 1, sets + ['dist.device="cpu"']),
                          (f"cuda-{key}", "small", 1, sets)))
    # Llama's RMSNorm runs ATen's fused CUDA kernels on a GPU and plain ops on CPU.
    for prec in ["fp32", "bf16"]:
        for stage in [0, 3]:
            sets = [f"zero.stage={stage}", f'zero.precision="{prec}"', "train.micro_batch=12"]
            key = f"llama-{prec}-stage{stage}"
            pairs.append((key, (f"cpu-{key}", "small-llama", 1, sets + ['dist.device="cpu"']),
                          (f"cuda-{key}", "small-llama", 1, sets)))
    r = compare(c, pairs, lambda k: 1e-4 if "fp32" in k else 3e-2)
    r["what"] = "W=1 on CUDA against W=1 on CPU, per-step loss"
    return r


def torch_side(args, timeout=900):
    """One run of benches/gpu/torch_train.py: its JSON row, or (None, the output's tail)."""
    p = subprocess.run([sys.executable, str(HERE / "torch_train.py"), *args],
                       capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not rows:
        return None, (p.stdout + p.stderr)[-2000:]
    return rows[0], None


def interleaved_round(c, i, config, runs, torch_args, sides, errors, skip=5, timeout=240,
                      torch_sides=("pytorch eager", "pytorch compile")):
    """One round: each zrun side of `runs` (side: its --set lines) at W=1, then the PyTorch
    sides (eager, torch.compile) with `torch_args`; appends each side's figures to
    `sides[side]`, or its output to `errors[side]`."""
    for side, sets in runs.items():
        sets, env = sets if isinstance(sets, tuple) else (sets, None)
        r = c.train(f"{config}-{i}-{side.replace(' ', '_')}", config, 1, sets, env=env,
                    timeout=timeout)
        s = steady(r, skip=skip)
        if s is None:
            errors[side] = r.get("output")
        else:
            s["cuda_allocated_peak"] = r["summary"].get("cuda_peak_bytes", [None])[0]
            sides[side].append(s)
    for side, extra in [("pytorch eager", []), ("pytorch compile", ["--compile"])]:
        if side not in torch_sides:
            continue
        row, err = torch_side([*torch_args, *extra])
        if row is None or row.get("oom"):
            errors[side] = err or "out of memory"
        else:
            row["cuda_allocated_peak"] = row["max_memory_allocated"]
            sides[side].append(row)


def with_mfu(best, zrun_side):
    """The PyTorch sides' MFU from zrun's (the same model and FLOPs per token)."""
    z = best.get(zrun_side)
    for k, v in best.items():
        if k.startswith("pytorch") and z and z.get("mfu") and v.get("mfu") is None:
            v["mfu"] = z["mfu"] * v["tokens_per_s"] / z["tokens_per_s"]


def check_speed(c, rounds=3):
    rounds = ROUNDS or rounds
    sides = {"zrun stage 0": [], "zrun stage 3": [], "zrun stage 3 prefetch 0": [],
             "zrun stage 0 chunked loss": [], "zrun stage 0 unfused loss": [], "pytorch eager": [],
             "pytorch compile": []}
    runs = {
        "zrun stage 0": ["zero.stage=0"],
        "zrun stage 3": ["zero.stage=3"],
        **({} if ROUNDS else {"zrun stage 3 prefetch 0": ["zero.stage=3", "zero.prefetch=0"]}),
        # loss_chunk "auto" (the default) takes the full logits where they fit, as here; the
        # chunked loss's cost beside it.
        "zrun stage 0 chunked loss": ["zero.stage=0", "train.loss_chunk=16777216"],
        # The full logits through PyTorch's cross_entropy instead of zrun's fused kernel.
        "zrun stage 0 unfused loss": (["zero.stage=0"], {"ZRUN_FUSED_LOSS": "0"}),
    }
    errors = {}
    for i in range(rounds):
        interleaved_round(c, i, "gpt2m", runs, ["--micro-batch", "8"], sides, errors)
    best = {k: max(v, key=lambda s: s["tokens_per_s"]) for k, v in sides.items() if v}
    with_mfu(best, "zrun stage 0")
    out = {"best_of_rounds": best, "rounds": sides, "errors": errors,
           "batch": "8 x 1024 tokens", "precision": "bf16 compute, fp32 master and AdamW"}
    z0, z3, pt, pc = (best.get(k) for k in ["zrun stage 0", "zrun stage 3", "pytorch eager",
                                            "pytorch compile"])
    if z0 and pt:
        out["zrun_s0_over_pytorch"] = z0["tokens_per_s"] / pt["tokens_per_s"]
    if z0 and pc:
        out["zrun_s0_over_compile"] = z0["tokens_per_s"] / pc["tokens_per_s"]
    if z0 and z3:
        out["zrun_s3_over_s0"] = z3["tokens_per_s"] / z0["tokens_per_s"]
    chunked = best.get("zrun stage 0 chunked loss")
    if z0 and chunked:
        out["chunked_over_full_logits"] = {
            "tokens_per_s": chunked["tokens_per_s"] / z0["tokens_per_s"],
            "cuda_allocated_peak": (chunked["cuda_allocated_peak"] or 0) / max(1, z0["cuda_allocated_peak"] or 0),
        }
    unfused = best.get("zrun stage 0 unfused loss")
    if z0 and unfused:
        out["unfused_over_fused_loss"] = {
            "tokens_per_s": unfused["tokens_per_s"] / z0["tokens_per_s"],
            "cuda_allocated_peak": (unfused["cuda_allocated_peak"] or 0) / max(1, z0["cuda_allocated_peak"] or 0),
        }
    out["targets"] = {
        "gpt2-medium >= 160K tokens/s": bool(z0 and z0["tokens_per_s"] >= 160e3),
        ">= 1.0x torch.compile": bool(pc and out["zrun_s0_over_compile"] >= 1.0),
        "stage 3 within 5% of stage 0": bool(z3 and out["zrun_s3_over_s0"] >= 0.95),
    }
    out["pass"] = all(out["targets"].values())
    return out


# gpt2-medium's settings with the llama3.2-1b preset (2048 tokens); the check sets micro_batch.
LLAMA1B = GPT2M.replace('preset = "gpt2-medium"', 'arch = "llama"\npreset = "llama3.2-1b"').replace(
    "steps = 15\nmicro_batch = 8\n", "steps = 12\n")


def device_memory():
    """The GPU's memory as `zrun estimate --device-mem` reads it (bytes)."""
    mib = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.split()[0]
    return int(mib) * 2**20


def estimate(c, config, sets):
    """zrun estimate's rank-0 JSON line for `config` with `sets` on this GPU's memory."""
    args = ["estimate", str(c.configs[config]), "--json", "--device-mem", f"{device_memory() // 2**20}MiB"]
    for x in sets:
        args += ["--set", x]
    rc, out, _ = c.cmd(args, 120)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return rows[0] if rc == 0 and rows else None


def check_profile(c):
    tables, ok = {}, True
    c.add_config("llama1b", LLAMA1B)
    for key, config, sets in [("stage 0", "gpt2m", ["zero.stage=0"]),
                              ("stage 3", "gpt2m", ["zero.stage=3"]),
                              ("llama3.2-1b stage 0", "llama1b",
                               ["zero.stage=0", "train.micro_batch=8"])]:
        name = f"profile-{key.replace(' ', '_')}"
        r = c.train(name, config, 1, [*sets, "train.steps=8", "log.profile_step=6"], timeout=400)
        trace = c.work / name / "profile-rank0.json"
        if r["rc"] != 0 or not trace.exists():
            tables[key] = {"rc": r["rc"], "output": r.get("output")}
            ok = False
            continue
        p = subprocess.run([sys.executable, str(HERE.parent / "profile_table.py"), str(trace), "--json",
                            "--top", "40"], capture_output=True, text=True)
        if p.returncode != 0:
            tables[key] = {"error": p.stderr[-2000:]}
            ok = False
            continue
        tables[key] = {**json.loads(p.stdout), "step": steady(r, skip=5)}
    return {"pass": ok, "tables": tables,
            "what": "gpt2-medium bf16, 8 x 1024 tokens, and llama3.2-1b bf16, 8 x 2048, W=1, step 6"}


def check_llama(c, rounds=2):
    rounds = ROUNDS or rounds
    c.add_config("llama1b", LLAMA1B)
    fits = [b for b in [32, 16, 8, 4, 2, 1]
            if (e := estimate(c, "llama1b", ["zero.stage=0", f"train.micro_batch={b}"])) and e["fits"]]
    if not fits:
        return {"pass": False, "error": "zrun estimate fits no micro-batch"}
    b = fits[0]
    # A micro-batch the estimate fits but the GPU does not: halve (reported).
    while b >= 1:
        r = c.train(f"llama-probe-{b}", "llama1b", 1, ["zero.stage=0", f"train.micro_batch={b}",
                                                        "train.steps=2"], timeout=400)
        if r["rc"] == 0:
            break
        b //= 2
    if b < 1:
        return {"pass": False, "rc": r["rc"], "output": r.get("output")}
    sides = {"zrun stage 0": [], "zrun stage 3": [], "zrun stage 0 aten only": [],
             "pytorch eager": [], "pytorch compile": []}
    runs = {f"zrun stage {st}": [f"zero.stage={st}", f"train.micro_batch={b}"] for st in [0, 3]}
    # Without zrun's CUDA kernels and fused loss (PyTorch's cross_entropy, ATen's silu and mul):
    # what they gain.
    runs["zrun stage 0 aten only"] = (["zero.stage=0", f"train.micro_batch={b}"],
                                      {"ZRUN_KERNELS": "0", "ZRUN_FUSED_LOSS": "0"})
    torch_args = ["--arch", "llama", "--micro-batch", str(b), "--steps", "12", "--warmup", "4"]
    errors = {}
    for i in range(rounds):
        interleaved_round(c, i, "llama1b", runs, torch_args, sides, errors, skip=4, timeout=400)
    # torch.compile out of memory at zrun's micro-batch: both again at the largest half that
    # compile fits, for a ratio at one batch.
    b2 = b
    while "pytorch compile" in errors and not sides["pytorch compile"] and b2 > 1:
        b2 //= 2
        errors.pop("pytorch compile")
        side = f"zrun stage 0 at micro-batch {b2}"
        sides[side], sides["pytorch compile"] = [], []
        interleaved_round(c, 0, "llama1b", {side: ["zero.stage=0", f"train.micro_batch={b2}"]},
                          ["--arch", "llama", "--micro-batch", str(b2), "--steps", "12", "--warmup",
                           "4"], sides, errors, skip=4, timeout=400, torch_sides=["pytorch compile"])
    best = {k: max(v, key=lambda s: s["tokens_per_s"]) for k, v in sides.items() if v}
    with_mfu(best, "zrun stage 0")
    out = {"micro_batch": b, "estimate_fits": fits, "best_of_rounds": best, "rounds": sides,
           "errors": errors, "batch": f"{b} x 2048 tokens"}
    z0, pc = best.get("zrun stage 0"), best.get("pytorch compile")
    if b2 != b:
        out["compile_micro_batch"] = b2
        z0 = best.get(f"zrun stage 0 at micro-batch {b2}")
    if z0 and pc:
        out["zrun_s0_over_compile"] = z0["tokens_per_s"] / pc["tokens_per_s"]
    pe = best.get("pytorch eager")
    if z0 and pe:
        out["zrun_s0_over_pytorch"] = z0["tokens_per_s"] / pe["tokens_per_s"]
    z, aten = best.get("zrun stage 0"), best.get("zrun stage 0 aten only")
    if z and aten:
        out["aten_only_over_zrun_s0"] = {
            "tokens_per_s": aten["tokens_per_s"] / z["tokens_per_s"],
            "cuda_allocated_peak": (aten["cuda_allocated_peak"] or 0) / max(1, z["cuda_allocated_peak"] or 0),
        }
    out["pass"] = bool(z0 and pc and out["zrun_s0_over_compile"] >= 1.0)
    return out


LLAMA8B = """
[model]
arch = "llama"
preset = "llama3.1-8b"
[data]
source = "synthetic"
seed = 0
[train]
steps = 20
micro_batch = 1
lr = 3e-4
eval_every = 0
seed = 1234
[zero]
stage = 3
precision = "bf16"
offload_optimizer = "cpu"
optimizer_state_dtype = "bf16"
activation_checkpointing = true
[checkpoint]
every = 0
[dist]
device = "cuda"
[log]
every = 1
peak_tflops = %s
""" % H100_BF16_PEAK_TFLOPS


def check_8b(c):
    c.add_config("llama8b", LLAMA8B)
    # ZRUN_GPU_8B_MICRO_BATCH: 1 (default), a number, or "auto": the largest of 16, 8, 4, 2
    # the estimate fits (offload is bound by the CPU AdamW at micro-batch 1; larger batches
    # give the GPU's share of the step its weight).
    mb = os.environ.get("ZRUN_GPU_8B_MICRO_BATCH", "1")
    if mb == "auto":
        mb = next((b for b in [16, 8, 4, 2]
                   if (e := estimate(c, "llama8b", [f"train.micro_batch={b}"])) and e["fits"]), 1)
    sets = [f"train.micro_batch={mb}"]
    # ZRUN_GPU_8B_SETS: more `--set` lines, separated by ";" (for example
    # 'zero.offload_delay=1', or 'train.on_oom="shrink"', which keeps the gradients on the
    # device: docs/memory.md).
    sets += [x for x in os.environ.get("ZRUN_GPU_8B_SETS", "").split(";") if x.strip()]
    e = estimate(c, "llama8b", sets)
    r = c.train("llama8b", "llama8b", 1, sets,
                timeout=int(os.environ.get("ZRUN_GPU_8B_TIMEOUT", "580")))
    out = {"micro_batch": int(mb), "sets": sets, "estimate": e, "rc": r["rc"], "seconds": r["seconds"]}
    if r["rc"] != 0:
        part = r.get("partial_metrics", [])
        return {**out, "pass": False, "output": r.get("output"), "partial_metrics": part[-8:],
                "partial_steady": steady({"metrics": part}, skip=2)}
    s = steady(r, skip=5)
    summ = r["summary"]
    dev = summ.get("cuda_peak_bytes", [None])[0]
    host = summ["peak_rss_bytes"][0] - summ["base_rss_bytes"][0]
    ms = [m for m in r["metrics"] if m.get("step", 0) > 5 and m.get("ranks")]
    parts = {k: statistics.median(m["ranks"][0][k] for m in ms)
             for k in ["forward_s", "backward_s", "comm_wait_s", "optimizer_s", "data_s"]} if ms else {}
    mem = (summ.get("ranks") or [{}])[0].get("memory", {})
    out.update({
        "steady": s, "steps": summ["steps"], "step_parts_s": parts,
        "device_peak": dev, "host_peak": host,
        # 0 where the gradients live on the host only (one micro-step a step, "stop")
        "device_gradient_bytes": mem.get("grads"), "host_buffer_bytes": mem.get("buffers"),
        "device_estimate": e and e["peak_bytes"], "host_estimate": e and e["host_bytes"],
    })
    if e and dev:
        out["device_estimate_over_peak"] = e["peak_bytes"] / dev
    if e and host:
        out["host_estimate_over_peak"] = e["host_bytes"] / host
    out["pass"] = summ["steps"] == 20 and bool(dev)
    return out


def model_state_formula(psi, stage, w):
    """bf16 compute, fp32 gradients, master and AdamW: bytes per rank (docs/config.md)."""
    return {0: 18 * psi, 1: 6 * psi + 12 * psi / w, 2: 2 * psi + 16 * psi / w,
            3: 18 * psi / w}[stage]


def check_memory(c):
    rows, ok = {}, True
    for stage in range(4):
        r = c.train(f"mem-s{stage}", "gpt2m", 2,
                    [f"zero.stage={stage}", "train.steps=3", "train.micro_batch=4"])
        if r["rc"] != 0:
            rows[f"stage{stage}"] = {"pass": False, "rc": r["rc"], "output": r.get("output")}
            ok = False
            continue
        s = r["summary"]
        psi = s["params"]
        formula = model_state_formula(psi, stage, 2)
        ranks = []
        for i, rk in enumerate(s["ranks"]):
            m = rk["memory"]
            ranks.append({
                "rank": i,
                "model_states": s["model_state_bytes"][i],
                "formula": formula,
                "states_over_formula": s["model_state_bytes"][i] / formula,
                "max_memory_allocated": m.get("cuda_allocated_peak"),
                "max_memory_reserved": m.get("cuda_reserved_peak"),
                "estimate": s["estimated_peak_bytes"][i],
                "estimate_over_allocated": s["estimated_peak_bytes"][i]
                / max(1, m.get("cuda_allocated_peak") or 1),
            })
        good = all(0.98 <= x["states_over_formula"] <= 1.02
                   and 0.95 <= x["estimate_over_allocated"] <= 1.10 for x in ranks)
        ok &= good
        rows[f"stage{stage}"] = {"pass": good, "ranks": ranks}
    return {"pass": ok, "rows": rows, "what": "gpt2-medium bf16, micro-batch 4, W=2 on one GPU"}


def check_offload(c):
    """Stage 2 with and without the optimizer on the host: at the step (gradient clipping on,
    the default), and overlapped with backward (grad_clip = 0: each unit updated on the
    host as soon as its gradient is reduced)."""
    res = {}
    for off, clip in [("none", 1.0), ("cpu", 1.0), ("none", 0.0), ("cpu", 0.0)]:
        key = f"{off}, grad_clip {clip:g}"
        r = c.train(f"offload-{off}-{clip:g}", "gpt2m", 1,
                    ["zero.stage=2", f'zero.offload_optimizer="{off}"', "train.steps=10",
                     f"train.grad_clip={clip}"])
        s = steady(r, skip=4)
        if s is None:
            return {"pass": False, "run": key, "rc": r["rc"], "output": r.get("output")}
        s["cuda_allocated_peak"] = r["summary"]["cuda_peak_bytes"][0]
        res[key] = s
    base, off = res["none, grad_clip 1"], res["cpu, grad_clip 1"]
    out = {
        "runs": res,
        "step_time_ratio": off["step_time_s"] / base["step_time_s"],
        "step_time_ratio_overlapped": res["cpu, grad_clip 0"]["step_time_s"]
        / res["none, grad_clip 0"]["step_time_s"],
        "device_bytes_saved": base["cuda_allocated_peak"] - off["cuda_allocated_peak"],
    }
    out["pass"] = out["device_bytes_saved"] > 0
    return out


def check_oom(c):
    rc, out, secs = c.cmd(
        ["--nproc", "2", str(c.configs["gpt2m"]), "--set", f'log.dir="{c.work / "oom"}"',
         "--set", "train.micro_batch=1024", "--set", "zero.stage=3"], 300)
    text = out.lower()
    # the error names the rank, the phase (forward/backward of a unit) and the bytes asked for
    needles = ["out of memory", "rank 0", "of unit", "gib"]
    found = {n: n in text for n in needles}
    leftover = subprocess.run(["pgrep", "-f", str(c.zrun)], capture_output=True, text=True).stdout
    return {
        "pass": rc == 4 and all(found.values()) and not leftover.strip(),
        "rc": rc, "exit_after_s": round(secs, 1), "found": found,
        "processes_left": leftover.split(), "output": out[-2500:],
    }


def check_limit(c):
    limit = 16 << 30
    r = c.train("limit", "gpt2m", 1,
                ["zero.stage=0", "train.micro_batch=16", "train.steps=6",
                 'dist.memory_limit="16GiB"', 'train.on_oom="shrink"'])
    if r["rc"] != 0:
        return {"pass": False, "rc": r["rc"], "output": r.get("output")}
    s = r["summary"]
    peak = s["cuda_peak_bytes"][0]
    return {
        "pass": bool(s["shrinks"]) and peak <= limit,
        "limit": limit,
        "cuda_allocated_peak": peak,
        "shrinks": s["shrinks"],
        "final_micro_batch": r["metrics"][-1].get("micro_batch"),
    }



def check_kernels(c):
    """`zrun bench kernels`: zrun's fused loss, SwiGLU, rope, bias gradient, LayerNorm, AdamW,
    gradient layout and the split delayed update's fresh share against PyTorch's ops at the
    speed checks' shapes (bf16, forward and backward): time, peak memory, and how far apart."""
    rc, out, secs = c.cmd(["bench", "kernels", "--json", "--rounds", str(ROUNDS or 5)], 600)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    installed = "zrun's CUDA kernels" in out and "not installed" not in out
    # bf16: the loss within 1e-3, the gradients within a bf16 rounding or two of the largest.
    ok = rc == 0 and installed and len(rows) == 20 and all(r["apart"] <= 2e-2 for r in rows)
    return {"pass": ok, "rc": rc, "seconds": round(secs, 1), "kernels_installed": installed,
            "rows": rows, **({} if ok else {"output": out[-3000:]})}


def check_ext(c):
    """The CUDA extension's unit tests on the GPU (`cargo test -p zrun-torch-ext --features
    cuda --lib`, built by `run.sh pack`), one thread, with ZRUN_EXPECT_CUDA=1."""
    exe = c.zrun.parent / "torch-ext-tests"
    if not exe.exists():
        return {"pass": False, "error": f"{exe} missing: run benches/gpu/run.sh pack"}
    t0 = time.time()
    try:
        p = subprocess.run([str(exe), "--test-threads", "1"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "ZRUN_EXPECT_CUDA": "1"})
    except subprocess.TimeoutExpired:
        return {"pass": False, "error": "timed out after 300 s"}
    out = p.stdout + p.stderr
    ran = [x for x in out.splitlines() if x.startswith("test ") and " ... " in x]
    failed = [x for x in ran if x.endswith(" FAILED")]
    return {"pass": p.returncode == 0 and bool(ran) and not failed, "rc": p.returncode,
            "tests": len(ran), "failed": failed, "seconds": round(time.time() - t0, 1),
            **({} if p.returncode == 0 else {"output": out[-3000:]})}


CHECKS = {"u": ("ext", check_ext), "x": ("kernels", check_kernels), "a": ("nccl", check_nccl), "i": ("nccl_ranks", check_nccl_ranks), "m": ("llama", check_llama),
          "p": ("profile", check_profile),
          "n": ("8b", check_8b),
          "j": ("nccl_kill", check_nccl_kill), "l": ("nccl_hybrid", check_nccl_hybrid), "k": ("delay", check_delay), "K": ("delay_loss", check_delay_loss), "c": ("speed", check_speed), "e": ("offload", check_offload),
          "d": ("memory", check_memory), "b": ("ranks", check_ranks), "g": ("cpu", check_cpu),
          "f": ("oom", check_oom), "h": ("limit", check_limit)}


def run_check(c, k):
    name, fn = CHECKS[k]
    t0 = time.time()
    try:
        r = fn(c)
    except Exception as e:  # a check that breaks must not hide the others
        r = {"pass": False, "error": repr(e)}
    r["seconds"] = round(time.time() - t0, 1)
    c.record(name, r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zrun", required=True, help="the zrun binary built with --features cuda")
    ap.add_argument("--out", required=True, help="the JSON file of results")
    ap.add_argument("--only", default="u,x,a,i,l,j,p,c,m,n,e,K,k,d,b,g,f,h",
                    help="checks to run, in this order; checks joined by + run side by side "
                    "(for those that time nothing: i+l+j+K)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zrun-gpu-") as work:
        c = Checks(Path(args.zrun).resolve(), args.out, work)
        for group in args.only.split(","):
            keys = group.split("+")
            with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
                list(pool.map(lambda k: run_check(c, k), keys))
        print(table(c.results))


if __name__ == "__main__":
    main()
