"""Shared helpers of the benchmark scripts: start zrun ranks without its launcher, read their
summary, and describe zrun's GPT (parameter count, padding, activation bytes).

Each zrun rank is one `target/release/zrun CONFIG --set k=v ...` process with torchrun's
topology variables set; rank 0 hosts the rendezvous store and writes `log.dir/summary.json`.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZRUN_BIN = Path(os.environ.get("ZRUN_BIN", ROOT / "target" / "release" / "zrun"))

MIB = 1 << 20


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_zrun(work=None):
    """Path of the zrun binary; builds it (`cargo build --release -p zrun`) when missing.
    With `work`, copies it there first and uses the copy from then on, so a rebuild of
    target/ during the benchmark cannot swap binaries between its runs."""
    global ZRUN_BIN
    if not ZRUN_BIN.exists():
        print(f"# {ZRUN_BIN} missing: cargo build --release -p zrun", file=sys.stderr)
        subprocess.run(["cargo", "build", "--release", "-p", "zrun"], cwd=ROOT, check=True)
    if work is not None:
        copy = Path(work) / "zrun"
        shutil.copy2(ZRUN_BIN, copy)
        ZRUN_BIN = copy
    return ZRUN_BIN


def clean_up(work, keep):
    """Removes the work directory (rank logs, summaries), or with `keep` says where it is."""
    if keep:
        print(f"# logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def torch_env():
    """LD_LIBRARY_PATH with the .venv's libtorch first (what scripts/env.sh sets), so the
    scripts also run when env.sh was not sourced."""
    libs = sorted(ROOT.glob(".venv/lib/python3*/site-packages/torch/lib"))
    old = os.environ.get("LD_LIBRARY_PATH", "")
    if not libs or str(libs[0]) in old.split(":"):
        return {}
    return {"LD_LIBRARY_PATH": f"{libs[0]}:{old}" if old else str(libs[0])}


def load_average():
    """The 1-minute load average (other work on the machine skews every figure here)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_ranks(argv_of_rank, nproc, env_extra=None, log_dir=None, timeout_s=900, what="job"):
    """Starts `nproc` processes (`argv_of_rank(rank)` each) with torchrun's topology variables,
    waits for all of them and raises if any exits non-zero, naming the rank and printing the
    tail of its output. Each rank's stdout+stderr goes to `log_dir/rank-N.log`.
    Returns the wall time in seconds."""
    port = free_port()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    token = f"bench-{os.getpid()}-{port}"
    procs, logs = [], []
    t0 = time.perf_counter()
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            ZRUN_JOB_TOKEN=token,
        )
        env.update(env_extra or {})
        log = open(log_dir / f"rank-{rank}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen(argv_of_rank(rank), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    failed = []
    deadline = time.monotonic() + timeout_s
    try:
        for rank, p in enumerate(procs):
            left = max(1.0, deadline - time.monotonic())
            try:
                rc = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                failed.append((rank, rc))
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    # A rank that ended first with an error makes the others fail too; report every non-zero.
    failed += [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (0, None) and r not in dict(failed)]
    if failed:
        msgs = []
        for rank, rc in failed:
            tail = (log_dir / f"rank-{rank}.log").read_text(errors="replace").splitlines()[-20:]
            msgs.append(f"--- {what}: rank {rank} exited with {rc}; last lines of {log_dir}/rank-{rank}.log:\n" + "\n".join(tail))
        raise RuntimeError("\n".join(msgs))
    return time.perf_counter() - t0


def run_zrun(config, overrides, nproc, log_dir, threads=1, timeout_s=900):
    """Runs zrun on `nproc` CPU ranks (`threads` libtorch threads each) and returns its
    summary.json as a dict (with `launch_wall_s` added)."""
    zrun = ensure_zrun()
    log_dir = Path(log_dir).resolve()
    sets = []
    for kv in list(overrides) + [f'log.dir="{log_dir}"']:
        sets += ["--set", kv]
    argv = [str(zrun), str(config)] + sets
    wall = run_ranks(
        lambda _r: argv,
        nproc,
        env_extra={"OMP_NUM_THREADS": str(threads), **torch_env()},
        log_dir=log_dir / "ranks",
        timeout_s=timeout_s,
        what=f"zrun {' '.join(overrides)}",
    )
    summary = json.loads((log_dir / "summary.json").read_text())
    summary["launch_wall_s"] = wall
    return summary


def gpt_unit_numels(vocab, seq_len, n_layer, d_model):
    """Parameter count of each of zrun's GPT units: embed (wte, wpe), every block, head
    (ln_f, untied lm_head), counted from the architecture."""
    c = d_model
    embed = vocab * c + seq_len * c
    block = 2 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * c + (4 * c * c + 4 * c) + (4 * c * c + c)
    head = 2 * c + vocab * c
    return [embed] + [block] * n_layer + [head]


def padded_params(vocab, seq_len, n_layer, d_model, world):
    """Ψ as the engine lays it out: each unit's flat buffer padded to a multiple of `world`."""
    return sum((n + world - 1) // world * world for n in gpt_unit_numels(vocab, seq_len, n_layer, d_model))


def activation_bytes(batch, seq_len, n_layer, d_model, n_head, vocab, elem=4):
    """Bytes autograd holds for one micro-batch between forward and backward, without
    activation checkpointing, for zrun's GPT in a dtype of `elem` bytes.

    Per block, tensors saved for backward, in elements per token (B*T tokens):
      ln_1 input C, ln_1 output C (qkv input), qkv 3C (q, k, v are views of it), attention
      output C (the CPU flash kernel lays it out as (B, T, nh, hs), so merging the heads is a
      view and the proj input is the same storage), residual x C (ln_2 input), ln_2 output C
      (fc input), fc output 4C (GELU input), GELU output 4C (proj input) = 16C; plus the
      attention logsumexp (nh) and LayerNorm mean/rstd (2 per LN). This is Korthikanti et al.
      2022's 34sbh bytes at 2 bytes/element less the dropout masks; flash-style SDPA keeps no
      T x T matrix. (Checked against torch.autograd.graph.saved_tensors_hooks on the PyTorch
      twin in fsdp2_compare.py: within 0.1%.)
    Head: ln_f input and output 2C, logits V (held as the last unit's output), log-softmax
      output V (saved by cross-entropy), plus the logits' gradient V while the head's backward
      runs = 2C + 3V (+ 2 for ln_f's mean/rstd).
    Embedding: the int64 token ids (8 bytes per token).
    """
    tokens = batch * seq_len
    c, v = d_model, vocab
    per_block = 16 * c + n_head + 2 * 2
    head = 2 * c + 3 * v + 2
    return tokens * elem * (n_layer * per_block + head) + tokens * 8


def fmt_mib(b):
    return f"{b / MIB:.1f}"
