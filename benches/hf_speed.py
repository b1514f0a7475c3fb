#!/usr/bin/env python3
"""zrun against Hugging Face transformers on CPU: Llama training speed and checkpoint import.

    python benches/hf_speed.py                          # everything, one JSON under benches/results/
    python benches/hf_speed.py --only speed --rounds 3 --precisions fp32
    python benches/hf_speed.py --only import --import-rounds 2
    python benches/hf_speed.py --malloc glibc,mmap64    # both malloc settings, on both sides
    python benches/hf_speed.py --quiet-wait 120          # on a shared machine: wait for quiet first

Speed. transformers builds a Llama (LLAMA below: vocab 32000, hidden 768, 12 layers, 12 heads,
4 key/value heads, intermediate 2048, untied head: 124.7M parameters, 100.3M of them in
matmuls) with random weights and saves it; zrun starts from those files (`model.init_from`,
stage 0, one rank) and transformers' `LlamaForCausalLM` (attn_implementation="sdpa",
model.train(); Llama has no dropout) loads the same files, so both run identical weights.
Both train `warmup + steps` steps of the same batch shape (fp32: `--batch` x `--seq-len`,
4 x 256; bf16: `--bf16-batch` x `--bf16-seq-len`, 1 x 32, kept short because libtorch's
bf16 matmul is slow on CPUs without AVX-512 BF16 or AMX) with the same libtorch thread
count (OMP_NUM_THREADS, torch.set_num_threads, train.threads) and the same malloc settings
(`--malloc`), runs alternating zrun / transformers, the order flipping every round. Per step:
  zrun          forward_s and backward_s from metrics.jsonl (log.every = 1): the units'
                forward with the loss, then the unit-by-unit backward with the gradients
                accumulated into the flat fp32 gradient buffer; optimizer_s apart (global
                norm, clipping to 1.0, AdamW, in bf16 also the refresh of the bf16 weights).
  transformers  forward = model(ids).logits and F.cross_entropy(logits.float(), targets)
                over all B*T positions (zrun's loss); backward = loss.backward(); optimizer
                = clip_grad_norm_(1.0) + torch.optim.AdamW(fused=True) + zero_grad.
The figure compared is forward+backward: the median over the steps after the warmup of each
run, then the median over rounds; tokens/s = B*T / that. The optimizer is reported beside it.
zrun trains on its synthetic chain, transformers on uniformly random tokens (data time is
not in either figure). fp32: fp32 weights and compute on both sides. bf16: zrun's
`zero.precision = "bf16"` (bf16 weights copied from fp32 masters after each step, bf16
compute, RMSNorm statistics, rotary angles and the loss in fp32, fp32 gradient buffer);
transformers: fp32 weights under `torch.autocast("cpu", dtype=torch.bfloat16)` (linear and
attention in bf16, the weights cast per forward, RMSNorm and the loss in fp32 as its code
writes them, the residual stream fp32 where zrun's is bf16), backward outside autocast: the
standard mixed-precision equivalent.

Import. transformers builds a GPT-2 with gpt2-medium's shapes (n_embd 1024, 24 layers, 16
heads, vocab 50257; n_positions `--gpt2-positions`) and saves it (one model.safetensors,
fp32). Then, per round and side, with the file evicted from the page cache (fsync and
POSIX_FADV_DONTNEED: a cold read) and again with it cached (warm):
  zrun          one rank, stage 0, fp32: the "initialised from DIR in X s" line (the weights
                read into the engine, 0.1 s resolution) and the time from the process's
                start to its "training steps" line (libtorch start-up, engine allocation
                and its random init, the load); each rank is stopped there (SIGKILL: the
                training step is not part of an import); then 2 ranks at stage 3.
  transformers  AutoModelForCausalLM.from_pretrained(dir) (fp32) and one read of every
                weight (fp32 weights stay zero-copy views of the mapped file, unread, until
                then), and the time from the process's start (interpreter, imports).
Memory: every process's /proc status is sampled every 20 ms: peak RSS (VmHWM, exact), and
the largest anonymous (RssAnon) and file-backed (RssFile: mapped safetensors pages, plus
the program's own code) resident sizes seen, with RssFile growth over its value before
loading started. zrun's ranks report their model-state bytes (`model_state_mib`).

Load from other processes moves every figure (with 2 threads on 2 cores, one core taken by
other work makes each parallel region wait for a descheduled thread: steps ran 3-6x longer):
each run records the CPU time the machine spent on other work while it ran (/proc/stat less
this script's children), in cores, and `--quiet-wait S` waits up to S seconds before each run
for that to fall below 0.25 cores.
"""
import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LLAMA = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
GPT2_MEDIUM = {"n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 50257}

# Environment variables that change malloc; cleared, then set per `--malloc` mode.
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "ZRUN_CPU_ALLOCATOR", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")
POLL_S = 0.02
HZ = os.sysconf("SC_CLK_TCK")


def malloc_env(mode, side):
    """glibc's malloc on both sides (zrun: `ZRUN_CPU_ALLOCATOR=glibc`, instead of its caching
    CPU allocator, which PyTorch has no counterpart of). `glibc`: glibc's defaults. `mmap64`:
    the mmap threshold fixed at 64 KiB with huge pages for mapped blocks (zrun's CPU setting
    before the caching allocator)."""
    zrun = {"ZRUN_CPU_ALLOCATOR": "glibc"} if side == "zrun" else {}
    if mode == "glibc":
        return zrun
    return {**zrun, "MALLOC_MMAP_THRESHOLD_": str(64 << 10), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def base_env(threads):
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS}
    env.update(common.torch_env())
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false")
    return env


# ----------------------------------------------------------------------------------------------
# transformers side (worker processes; torch and transformers are imported there only).


def worker_make(a):
    """Builds a model with random weights (seeded) and saves it with save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(a["seed"])
    if a["kind"] == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**a["config"]))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**a["config"]))
    model.save_pretrained(a["dir"])
    for f in Path(a["dir"]).iterdir():  # on disk, so that a later eviction leaves no dirty page
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))


def worker_train(a):
    """Trains `warmup + steps` steps; writes per-step forward, backward, optimizer seconds."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.set_num_threads(a["threads"])
    model = LlamaForCausalLM.from_pretrained(a["dir"], attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    B, T, V = a["batch"], a["seq_len"], model.config.vocab_size
    gen = torch.Generator().manual_seed(a["seed"])
    bf16 = a["precision"] == "bf16"
    steps = []
    for _ in range(a["warmup"] + a["steps"]):
        x = torch.randint(0, V, (B, T), generator=gen)
        y = torch.randint(0, V, (B, T), generator=gen)
        c0, t0 = time.process_time(), time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        del logits
        steps.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                      "step_time_s": t3 - t0, "cpu_s": time.process_time() - c0, "loss": loss.item()})
    Path(a["out"]).write_text(json.dumps({"steps": steps, "params": sum(p.numel() for p in model.parameters())}))


def worker_load(a):
    """Imports transformers, loads the model, prints one READY line with the timings."""
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a["threads"])
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a["dir"], dtype=torch.float32)
    t2 = time.perf_counter()
    # fp32 weights stay views of the memory-mapped file until first read: read each once.
    with torch.no_grad():
        n = sum(p.numel() for p in model.parameters() if p.sum().isfinite())
    t3 = time.perf_counter()
    print("READY " + json.dumps({"import_s": t1 - t0, "from_pretrained_s": t2 - t1, "read_s": t3 - t2,
                                 "load_s": t3 - t1, "params": n}), flush=True)
    time.sleep(0.2)  # the parent reads the process's status after this line


def run_worker(name, arg, threads, env_extra, log, timeout_s=900):
    """Runs one worker of this script to completion; raises with its last lines on failure."""
    env = base_env(threads)
    env.update(env_extra)
    with open(log, "wb") as f:
        p = subprocess.run([sys.executable, __file__, "--worker", name, json.dumps(arg)], env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=common.ROOT)
    if p.returncode != 0:
        tail = Path(log).read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"transformers {name} exited with {p.returncode}; last lines of {log}:\n" + "\n".join(tail))
    return Path(log).read_text(errors="replace")


# ----------------------------------------------------------------------------------------------
# Watching processes: output, memory, CPU.


def machine_busy_s():
    """CPU seconds the whole machine has spent busy (not idle or waiting for I/O)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / HZ


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit_s, cores=0.25, window_s=3.0):
    """Waits (up to `limit_s`) until other work keeps fewer than `cores` cores busy over a
    `window_s` window (nothing of this script runs meanwhile); returns that load."""
    deadline = time.monotonic() + limit_s
    while True:
        b0, t0 = machine_busy_s(), time.perf_counter()
        time.sleep(window_s)
        other = (machine_busy_s() - b0) / (time.perf_counter() - t0)
        if other < cores or time.monotonic() > deadline:
            return other


class Load:
    """CPU the machine spent on other work during a run, in cores (whole machine busy time
    less this script's waited-for children, over the wall time)."""

    quiet_wait_s = 0.0

    def __init__(self):
        if Load.quiet_wait_s > 0:
            wait_quiet(Load.quiet_wait_s)
        self.t, self.busy, self.own = time.perf_counter(), machine_busy_s(), children_cpu_s()

    def other_cores(self):
        wall = time.perf_counter() - self.t
        busy = machine_busy_s() - self.busy
        own = children_cpu_s() - self.own
        return max(0.0, (busy - own) / wall) if wall > 0 else float("nan")


def proc_status(pid):
    """VmHWM, VmRSS, RssAnon, RssFile of `pid` in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        return {}
    return out


def proc_cpu_s(pid):
    """(user + system, system) CPU seconds of `pid` so far (None once it is gone)."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / HZ, int(f[12]) / HZ


class Watched:
    """One started process: its output file, the time each output line was first seen, and
    memory samples."""

    def __init__(self, argv, env, log):
        self.log = Path(log)
        self.fh = open(self.log, "wb")
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen(argv, env=env, stdout=self.fh, stderr=subprocess.STDOUT, cwd=common.ROOT)
        self.lines = []  # (seconds since start, line)
        self.partial = ""
        self.offset = 0
        self.samples = []  # (seconds since start, status dict)

    def poll(self):
        now = time.perf_counter() - self.t0
        st = proc_status(self.p.pid)
        if st:
            self.samples.append((now, st))
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *full, self.partial = text.split("\n")
        self.lines += [(now, line) for line in full]

    def first(self, pattern):
        """(time, match) of the first output line matching `pattern`, or None."""
        for t, line in self.lines:
            m = re.search(pattern, line)
            if m:
                return t, m
        return None

    def peak(self, key, until=None):
        vals = [s[key] for t, s in self.samples if key in s and (until is None or t <= until)]
        return max(vals) if vals else None

    def at(self, key, t):
        """The last sample of `key` taken before time `t`."""
        vals = [s[key] for ts, s in self.samples if key in s and ts <= t]
        return vals[-1] if vals else None

    def tail(self, n=20):
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def watch(procs, done, what, timeout_s=900, on_poll=None):
    """Polls `procs` every POLL_S until `done(procs)`; then kills what still runs (SIGKILL).
    A process that exits non-zero first, or a timeout, raises with its last lines."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for w in procs:
                w.poll()
            if on_poll:
                on_poll(procs)
            if done(procs):
                return
            for w in procs:
                rc = w.p.poll()
                if rc is not None and rc != 0:
                    raise RuntimeError(f"{what}: {w.log.name} exited with {rc}; last lines of {w.log}:\n{w.tail()}")
            if all(w.p.poll() is not None for w in procs):
                for w in procs:
                    w.poll()
                if done(procs):
                    return
                raise RuntimeError(f"{what}: every process ended before it was done; {procs[0].log}:\n{procs[0].tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: no result after {timeout_s} s; {procs[0].log}:\n{procs[0].tail()}")
            time.sleep(POLL_S)
    finally:
        for w in procs:
            if w.p.poll() is None:
                w.p.send_signal(signal.SIGKILL)
        for w in procs:
            w.p.wait()
            w.fh.close()


def start_zrun(config, nproc, sets, log_dir, threads, env_extra):
    """Starts `nproc` zrun ranks with torchrun's topology variables (rank 0 hosts the store)."""
    port = common.free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(common.ZRUN_BIN), str(config)]
    for kv in sets:
        argv += ["--set", kv]
    procs = []
    for rank in range(nproc):
        env = base_env(threads)
        env.update(env_extra)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZRUN_JOB_TOKEN=f"hf-speed-{os.getpid()}-{port}")
        procs.append(Watched(argv, env, log_dir / f"rank-{rank}.log"))
    return procs


# ----------------------------------------------------------------------------------------------
# Speed.


def zrun_speed(work, model_dir, precision, batch, seq_len, warmup, steps, threads, mode, tag):
    """One zrun run: per-step figures of the steps after the warmup, from metrics.jsonl.
    The run asks for one step more than it measures and is stopped once the last measured
    step is logged (zrun evaluates after its last step: not part of a training step)."""
    run = work / tag
    run.mkdir(parents=True, exist_ok=True)
    config = run / "train.toml"
    config.write_text(
        f'[model]\ninit_from = "{model_dir}"\nseq_len = {seq_len}\n\n'
        '[data]\nsource = "synthetic"\nseed = 0\n\n'
        f"[train]\nsteps = {warmup + steps + 1}\nmicro_batch = {batch}\nlr = 3e-4\nweight_decay = 0.1\n"
        f"beta1 = 0.9\nbeta2 = 0.95\neps = 1e-8\ngrad_clip = 1.0\neval_batches = 1\nthreads = {threads}\n\n"
        f'[zero]\nstage = 0\nprecision = "{precision}"\n\n[dist]\ndevice = "cpu"\n\n'
        f'[log]\ndir = "{run}"\nevery = 1\n'
    )
    metrics = run / "metrics.jsonl"
    want = warmup + steps
    cpu_at = {}  # metrics lines seen -> the process's CPU seconds then

    def lines():
        try:
            return [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        except (OSError, json.JSONDecodeError):
            return []

    def on_poll(procs):
        n = len(lines())
        if n not in cpu_at:
            c = proc_cpu_s(procs[0].p.pid)
            if c:
                cpu_at[n] = c

    load = Load()
    procs = start_zrun(config, 1, [], run, threads, malloc_env(mode, "zrun"))
    watch(procs, lambda _p: len(lines()) >= want, f"zrun {tag}", on_poll=on_poll)
    rows = []
    for d in lines()[:want]:
        r = d["ranks"][0]
        s = d["step"]
        cpu = (cpu_at[s][0] - cpu_at[s - 1][0]) if s in cpu_at and s - 1 in cpu_at else float("nan")
        rows.append({k: r[k] for k in ("forward_s", "backward_s", "optimizer_s", "step_time_s", "comm_wait_s", "other_s")}
                    | {"cpu_s": cpu, "loss": d["loss"]})
    return {"steps": rows[warmup:], "warmup_steps": rows[:warmup], "other_cores": load.other_cores(),
            "peak_rss_bytes": procs[0].peak("VmHWM")}


def hf_speed(work, model_dir, precision, batch, seq_len, warmup, steps, threads, mode, tag):
    """One transformers run (see worker_train)."""
    out = work / f"{tag}.json"
    arg = {"dir": str(model_dir), "precision": precision, "batch": batch, "seq_len": seq_len, "warmup": warmup,
           "steps": steps, "threads": threads, "seed": 1000, "out": str(out)}
    load = Load()
    run_worker("train", arg, threads, malloc_env(mode, "hf"), work / f"{tag}.log")
    res = json.loads(out.read_text())
    return {"steps": res["steps"][warmup:], "warmup_steps": res["steps"][:warmup], "other_cores": load.other_cores(),
            "params": res["params"]}


def summarize(runs, tokens):
    """Median over rounds of each run's median per step; best = the fastest single step."""
    def med(key):
        return statistics.median(statistics.median(s[key] for s in r["steps"]) for r in runs)

    fb = [statistics.median(s["forward_s"] + s["backward_s"] for s in r["steps"]) for r in runs]
    best = min(s["forward_s"] + s["backward_s"] for r in runs for s in r["steps"])
    fwd_bwd = statistics.median(fb)
    return {
        "forward_backward_s": fwd_bwd,
        "tokens_per_s": tokens / fwd_bwd,
        "best_tokens_per_s": tokens / best,
        "forward_s": med("forward_s"),
        "backward_s": med("backward_s"),
        "optimizer_s": med("optimizer_s"),
        "step_time_s": med("step_time_s"),
        "cpu_s_per_step": med("cpu_s"),
        "forward_backward_s_per_round": fb,
        "other_cores_per_round": [r["other_cores"] for r in runs],
    }


def speed(args, work, results):
    model_dir = work / "llama"
    t = time.perf_counter()
    made = json.loads(run_worker("make", {"kind": "llama", "dir": str(model_dir), "config": LLAMA, "seed": 0},
                                 args.threads, {}, work / "make-llama.log").splitlines()[-1])
    print(f"# Llama {made['params'] / 1e6:.1f}M params saved by transformers in {time.perf_counter() - t:.0f} s", flush=True)
    results["speed"] = {"model": LLAMA, "params": made["params"], "rows": []}
    for mode in args.malloc:
        for precision in args.precisions:
            b, tl, warm, n, rounds = (
                (args.batch, args.seq_len, args.warmup, args.steps, args.rounds) if precision == "fp32"
                else (args.bf16_batch, args.bf16_seq_len, args.warmup, args.bf16_steps, args.bf16_rounds))
            runs = {"zrun": [], "transformers": []}
            for r in range(rounds):
                order = ["zrun", "transformers"] if r % 2 == 0 else ["transformers", "zrun"]
                for side in order:
                    tag = f"{mode}-{precision}-{side}-{r}"
                    f = zrun_speed if side == "zrun" else hf_speed
                    res = f(work, model_dir, precision, b, tl, warm, n, args.threads, mode, tag)
                    runs[side].append(res)
                    fb = statistics.median(s["forward_s"] + s["backward_s"] for s in res["steps"])
                    print(f"#   {tag}: forward+backward {fb:.2f} s/step (other load {res['other_cores']:.2f} cores)", flush=True)
            z, h = summarize(runs["zrun"], b * tl), summarize(runs["transformers"], b * tl)
            results["speed"]["rows"].append({
                "malloc": mode, "precision": precision, "batch": b, "seq_len": tl, "warmup": warm, "steps": n,
                "rounds": rounds, "zrun": z, "transformers": h, "ratio": z["tokens_per_s"] / h["tokens_per_s"],
                "best_ratio": z["best_tokens_per_s"] / h["best_tokens_per_s"], "runs": runs,
            })


# ----------------------------------------------------------------------------------------------
# Import.


def evict(path):
    """Drops `path`'s pages from the page cache (they are clean: the file was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


READY = r"rank (\d+)/(\d+): training steps .* params=(\d+) model_state_mib=(\d+)"
INIT = r"initialised from .* in ([0-9.]+) s"


def zrun_import(work, model_dir, nproc, stage, threads, mode, tag):
    """zrun ranks until each says it is ready to train; timings and memory per rank."""
    run = work / tag
    config = work / "import.toml"
    config.write_text(
        f'[model]\ninit_from = "{model_dir}"\n\n[data]\nsource = "synthetic"\n\n'
        f"[train]\nsteps = 1\nmicro_batch = 1\neval_batches = 1\n\n[zero]\nprecision = \"fp32\"\n\n"
        '[dist]\ndevice = "cpu"\n\n[log]\nevery = 1\n'
    )
    load = Load()
    procs = start_zrun(config, nproc, [f"zero.stage={stage}", f'log.dir="{run}"'], run, threads,
                       malloc_env(mode, "zrun"))
    watch(procs, lambda ps: all(w.first(READY) for w in ps), f"zrun import {tag}")
    t_init, m_init = procs[0].first(INIT)
    load_s = float(m_init.group(1))
    start = t_init - load_s  # rank 0's; the ranks started within milliseconds of each other
    ranks = []
    for w in procs:
        t_ready, m = w.first(READY)
        file0 = w.at("RssFile", start)
        ranks.append({
            "rank": int(m.group(1)),
            "ready_s": t_ready,
            "peak_rss_bytes": w.peak("VmHWM", t_ready),
            "peak_anon_bytes": w.peak("RssAnon", t_ready),
            "peak_file_bytes": w.peak("RssFile", t_ready),
            "file_before_load_bytes": file0,
            "model_state_bytes": int(m.group(4)) << 20,
        })
    return {"system": "zrun", "nproc": nproc, "stage": stage, "load_s": load_s, "before_load_s": t_init - load_s,
            "ready_s": max(r["ready_s"] for r in ranks), "params": int(procs[0].first(READY)[1].group(3)),
            "ranks": ranks, "other_cores": load.other_cores()}


def hf_import(work, model_dir, threads, mode, tag):
    """AutoModelForCausalLM.from_pretrained in a fresh process (see worker_load)."""
    env = base_env(threads)
    env.update(malloc_env(mode, "hf"))
    load = Load()
    arg = json.dumps({"dir": str(model_dir), "threads": threads})
    w = Watched([sys.executable, __file__, "--worker", "load", arg], env, work / f"{tag}.log")
    watch([w], lambda ps: ps[0].first(r"^READY ") is not None, f"transformers import {tag}")
    t_ready, _ = w.first(r"^READY ")
    res = json.loads(w.first(r"^READY (.*)")[1].group(1))
    start = t_ready - res["load_s"]
    return {"system": "transformers", "nproc": 1, "load_s": res["load_s"], "import_s": res["import_s"],
            "from_pretrained_s": res["from_pretrained_s"], "read_s": res["read_s"],
            "ready_s": t_ready, "before_load_s": start, "params": res["params"], "other_cores": load.other_cores(),
            "ranks": [{"rank": 0, "ready_s": t_ready, "peak_rss_bytes": w.peak("VmHWM"),
                       "peak_anon_bytes": w.peak("RssAnon"), "peak_file_bytes": w.peak("RssFile"),
                       "rss_before_load_bytes": w.at("VmRSS", start), "file_before_load_bytes": w.at("RssFile", start)}]}


def import_bench(args, work, results):
    model_dir = work / "gpt2-medium"
    cfg = dict(GPT2_MEDIUM, n_positions=args.gpt2_positions)
    t = time.perf_counter()
    made = json.loads(run_worker("make", {"kind": "gpt2", "dir": str(model_dir), "config": cfg, "seed": 0},
                                 args.threads, {}, work / "make-gpt2.log").splitlines()[-1])
    st = model_dir / "model.safetensors"
    print(f"# GPT-2 {made['params'] / 1e6:.1f}M params, {st.stat().st_size / common.MIB:.0f} MiB saved in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    mode = args.malloc[0]
    runs = []
    for r in range(args.import_rounds):
        order = ["zrun", "transformers"] if r % 2 == 0 else ["transformers", "zrun"]
        for side in order:
            for cache in ("cold", "warm"):
                if cache == "cold":
                    evict(st)
                tag = f"import-{side}-{cache}-{r}"
                if side == "zrun":
                    res = zrun_import(work, model_dir, 1, 0, args.threads, mode, tag)
                else:
                    res = hf_import(work, model_dir, args.threads, mode, tag)
                res["cache"] = cache
                runs.append(res)
                split = (f" (from_pretrained {res['from_pretrained_s']:.2f} s + reading the weights {res['read_s']:.2f} s)"
                         if side == "transformers" else "")
                print(f"#   {tag}: load {res['load_s']:.2f} s{split}, ready {res['ready_s']:.1f} s", flush=True)
        for cache in ("cold", "warm"):
            if cache == "cold":
                evict(st)
            # Each of the 2 ranks gets half the threads, as the launcher splits the cores.
            res = zrun_import(work, model_dir, 2, 3, max(1, args.threads // 2), mode, f"import-zrun-stage3-{cache}-{r}")
            res["cache"] = cache
            runs.append(res)
            print(f"#   zrun 2 ranks stage 3 {cache}: load {res['load_s']:.2f} s, ready {res['ready_s']:.1f} s", flush=True)
    results["import"] = {"model": cfg, "params": made["params"], "file_bytes": st.stat().st_size, "malloc": mode,
                         "runs": runs}


# ----------------------------------------------------------------------------------------------
# Report.


def mib(b):
    return "-" if b is None else f"{b / common.MIB:.0f}"


def print_speed(s):
    print(f"\n## Training speed: Llama {s['params'] / 1e6:.1f}M (vocab {LLAMA['vocab_size']}, hidden {LLAMA['hidden_size']}, "
          f"{LLAMA['num_hidden_layers']} layers, {LLAMA['num_attention_heads']} heads / {LLAMA['num_key_value_heads']} kv, "
          f"intermediate {LLAMA['intermediate_size']}, untied), 1 process, stage 0")
    print(f"{'malloc':<6} {'prec':<5} {'B x T':>8} {'system':<12} {'fwd s':>7} {'bwd s':>7} {'fwd+bwd':>8} "
          f"{'tok/s':>7} {'best':>7} {'optim s':>8} {'CPU s/step':>10} {'ratio':>6} {'best':>6} {'other load':>14}")
    for row in s["rows"]:
        for side in ("zrun", "transformers"):
            x = row[side]
            ratio = f"{row['ratio']:.2f}x" if side == "zrun" else ""
            best = f"{row['best_ratio']:.2f}x" if side == "zrun" else ""
            other = "/".join(f"{c:.1f}" for c in x["other_cores_per_round"])
            print(f"{row['malloc']:<6} {row['precision']:<5} {row['batch']:>3} x {row['seq_len']:<4} {side:<12} "
                  f"{x['forward_s']:>7.2f} {x['backward_s']:>7.2f} {x['forward_backward_s']:>8.2f} {x['tokens_per_s']:>7.0f} "
                  f"{x['best_tokens_per_s']:>7.0f} {x['optimizer_s']:>8.2f} {x['cpu_s_per_step']:>10.1f} {ratio:>6} {best:>6} "
                  f"{other:>14}")
    print("# medians over rounds of each run's median step after the warmup; tok/s = B*T / (forward+backward);")
    print("# ratio = zrun / transformers tokens/s; 'best' = fastest single step; CPU s/step = the process's CPU time")
    print("# per whole step (all threads, optimizer included); other load = cores busy with other work, per round.")


def print_import(imp):
    print(f"\n## Import: GPT-2 {imp['params'] / 1e6:.1f}M (gpt2-medium shapes, n_positions {imp['model']['n_positions']}), "
          f"{imp['file_bytes'] / common.MIB:.0f} MiB model.safetensors, fp32")
    print(f"{'system':<13} {'ranks':>5} {'cache':<5} {'load s':>7} {'before':>7} {'ready s':>8} {'peak RSS MiB/rank':>18} "
          f"{'peak anon':>11} {'peak file':>11} {'file growth':>12} {'model states':>13} {'other load':>10}")
    for r in imp["runs"]:
        rk = r["ranks"]
        name = r["system"] + (f" st{r['stage']}" if r["system"] == "zrun" else "")
        growth = " / ".join(mib(x["peak_file_bytes"] - x["file_before_load_bytes"])
                            if x.get("file_before_load_bytes") is not None else "-" for x in rk)
        states = " / ".join(mib(x.get("model_state_bytes")) for x in rk)
        print(f"{name:<13} {r['nproc']:>5} {r['cache']:<5} {r['load_s']:>7.2f} {r['before_load_s']:>7.1f} {r['ready_s']:>8.1f} "
              f"{' / '.join(mib(x['peak_rss_bytes']) for x in rk):>18} {' / '.join(mib(x['peak_anon_bytes']) for x in rk):>11} "
              f"{' / '.join(mib(x['peak_file_bytes']) for x in rk):>11} {growth:>12} {states:>13} {r['other_cores']:>10.2f}")
    for cache in ("cold", "warm"):
        z = [r["load_s"] for r in imp["runs"] if r["system"] == "zrun" and r["nproc"] == 1 and r["cache"] == cache]
        h = [r["load_s"] for r in imp["runs"] if r["system"] == "transformers" and r["cache"] == cache]
        zr = [r["ready_s"] for r in imp["runs"] if r["system"] == "zrun" and r["nproc"] == 1 and r["cache"] == cache]
        hr = [r["ready_s"] for r in imp["runs"] if r["system"] == "transformers" and r["cache"] == cache]
        if z and h:
            print(f"# {cache}: load zrun {statistics.median(z):.2f} s / transformers {statistics.median(h):.2f} s = "
                  f"{statistics.median(z) / statistics.median(h):.2f}x; process start to ready "
                  f"{statistics.median(zr):.1f} s / {statistics.median(hr):.1f} s = {statistics.median(zr) / statistics.median(hr):.2f}x")
    print("# load: zrun's 'initialised from' line (0.1 s steps) / from_pretrained's call plus one read of every weight")
    print("# (its fp32 weights stay views of the mapped file until read). before: from the process's start to the load")
    print("# (zrun: libtorch, engine allocation and its random init; transformers: interpreter and imports); ready: to the")
    print("# end of the load (zrun: its 'training steps' line). peak anon/file: largest RssAnon/RssFile sampled every 20 ms;")
    print("# file growth: RssFile peak less before loading (mapped model pages). model states: the engine's bytes.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["speed", "import"], help="one part only")
    ap.add_argument("--threads", type=int, default=2, help="libtorch threads on both sides")
    ap.add_argument("--malloc", default="glibc", help="comma-separated: glibc, mmap64 (see malloc_env)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=3, help="fp32 rounds (each: one zrun and one transformers run)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out at the start of every run")
    ap.add_argument("--steps", type=int, default=2, help="fp32 steps measured per run")
    ap.add_argument("--bf16-batch", type=int, default=1)
    ap.add_argument("--bf16-seq-len", type=int, default=32)
    ap.add_argument("--bf16-steps", type=int, default=1)
    ap.add_argument("--bf16-rounds", type=int, default=1)
    ap.add_argument("--gpt2-positions", type=int, default=128,
                    help="n_positions of the GPT-2 (zrun trains at that sequence length)")
    ap.add_argument("--import-rounds", type=int, default=1)
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each run wait up to this many seconds for other work to use < 0.25 cores")
    ap.add_argument("--out", help="JSON results (default benches/results/DATE-hf-speed-cpu.json)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (models, logs)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("worker_arg", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return {"make": worker_make, "train": worker_train, "load": worker_load}[args.worker](json.loads(args.worker_arg))
    Load.quiet_wait_s = args.quiet_wait
    args.malloc = args.malloc.split(",")
    args.precisions = args.precisions.split(",")
    for m in args.malloc:
        if m not in ("glibc", "mmap64"):
            raise SystemExit(f"--malloc {m}: allowed glibc, mmap64")

    work = Path(tempfile.mkdtemp(prefix="zrun-hf-speed-"))
    common.ensure_zrun(work)
    flags = open("/proc/cpuinfo").read().split("\nflags", 1)[1].split("\n", 1)[0].split()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "simd": sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))},
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_arg")},
        "load_average_before": common.load_average(),
    }
    print(f"# {cpu}, {os.cpu_count()} cores, {' '.join(results['machine']['simd'])}; {args.threads} threads per side; "
          f"malloc {','.join(args.malloc)}; load average {results['load_average_before']:.2f}", flush=True)
    t0 = time.perf_counter()
    try:
        if args.only in (None, "speed"):
            speed(args, work, results)
        if args.only in (None, "import"):
            import_bench(args, work, results)
    finally:
        results["elapsed_s"] = time.perf_counter() - t0
        results["load_average_after"] = common.load_average()
        out = Path(args.out) if args.out else common.ROOT / "benches" / "results" / f"{time.strftime('%Y-%m-%d')}-hf-speed-cpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    if "speed" in results:
        print_speed(results["speed"])
    if "import" in results:
        print_import(results["import"])
    print(f"# {results['elapsed_s']:.0f} s; load average before {results['load_average_before']:.2f}, after "
          f"{results['load_average_after']:.2f}; results in {out}")
    common.clean_up(work, args.keep)


if __name__ == "__main__":
    main()
