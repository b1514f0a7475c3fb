"""The NCCL checks of the GPU validation (see checks.py): W=1, several ranks sharing the one
GPU (ZRUN_NCCL_SHARE_GPU=1), hybrid sharding on split communicators, and a rank killed
mid-run."""
import json
import os
import signal
import subprocess
import time

from runs import compare, rank_pairs

SHARE = {"ZRUN_NCCL_SHARE_GPU": "1"}


def check_nccl(c):
    rows, ok = [], True
    for dtype in ["fp32", "bf16"]:
        rc, out, _ = c.cmd(
            ["bench", "comm", "--nproc", "1", "--backend", "nccl", "--sizes", "1M,64M",
             "--dtype", dtype, "--json"], 120)
        got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        ok &= rc == 0 and len(got) == 6 and all(r["wrong"] == 0 for r in got)
        rows += got
        if rc != 0:
            return {"pass": False, "rc": rc, "output": out[-2000:]}
    return {"pass": ok, "rows": rows}


def check_nccl_ranks(c):
    pairs = rank_pairs("nw", ['dist.backend="nccl"'], SHARE)
    r = compare(c, pairs, lambda k: 1e-5 if k.startswith("fp32") else 3e-2)
    r["what"] = "W=2 over NCCL sharing one GPU against W=1, same global batch, per-step loss"
    rows = []
    for dtype in ["fp32", "bf16"]:
        rc, out, _ = c.cmd(
            ["bench", "comm", "--nproc", "2", "--backend", "nccl", "--sizes", "1M,16M",
             "--dtype", dtype, "--json"], 300, env=SHARE)
        got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        r["pass"] &= rc == 0 and len(got) == 6 and all(x["wrong"] == 0 for x in got)
        rows += got
        if rc != 0:
            r["comm_output"] = out[-2000:]
    r["comm_rows"] = rows
    return r


def check_nccl_hybrid(c):
    """Hybrid sharding on NCCL sub-communicators (ncclCommSplit): W=4 sharing the GPU as 2
    shard groups of 2 over NCCL, stages 1-3, against W=4 sharding over all 4 over tcp (the
    path check b holds to W=1), same batch."""
    pairs = []
    for stage in (1, 2, 3):
        common = [f"zero.stage={stage}", 'zero.precision="fp32"', "train.micro_batch=3"]
        key = f"fp32-stage{stage}-g2"
        # auto: the 4 ranks share the one GPU over tcp, CUDA tensors staged through the host.
        pairs.append((key, (f"hw4tcp-{key}", "small", 4, common),
                      (f"hw4-{key}", "small", 4,
                       common + ["zero.shard_group=2", 'dist.backend="nccl"'], SHARE)))
    r = compare(c, pairs, lambda k: 1e-5)
    r["what"] = "W=4 as 2 shard groups of 2 over NCCL sharing one GPU against W=4 over tcp, per-step loss"
    return r


def check_nccl_kill(c, timeout_s=30):
    """Two ranks as mpirun would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT; rank 0 hosts
    the store), NCCL sharing the GPU; rank 1 is killed 20 s in (past init, mid-steps)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = c.work / "nccl-kill"
    procs = []
    for r in range(2):
        env = {**os.environ, **SHARE, "ZRUN_QUIET": "1", "RANK": str(r), "LOCAL_RANK": str(r),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "ZRUN_JOB_TOKEN": "gpu-check"}
        procs.append(subprocess.Popen(
            [str(c.zrun), str(c.configs["small"]), "--set", f'log.dir="{d}"',
             "--set", "train.steps=1000000", "--set", 'dist.backend="nccl"',
             "--set", f"dist.timeout_s={timeout_s}", "--set", "train.micro_batch=6"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True))
    time.sleep(20)
    alive_before = procs[1].poll() is None and procs[0].poll() is None
    procs[1].kill()
    t0 = time.time()
    try:
        out, _ = procs[0].communicate(timeout=timeout_s + 60)
        rc, took = procs[0].returncode, round(time.time() - t0, 1)
    except subprocess.TimeoutExpired:
        os.killpg(procs[0].pid, signal.SIGKILL)
        out, _ = procs[0].communicate()
        rc, took = None, None
    procs[1].communicate()
    # this check's processes only (other checks may run beside it)
    leftover = subprocess.run(["pgrep", "-f", str(d)], capture_output=True, text=True).stdout
    text = out.lower()
    # the watchdog's timeout, or NCCL's own report of the peer's death (with sockets it sees
    # the connection close at once: ncclRemoteError, measured 1.5 s after the kill)
    named = any(n in text for n in ["timed out", "timeout", "did not complete", "aborted",
                                    "peer rank failed"])
    return {
        "pass": alive_before and rc not in (0, None) and took is not None
        and took <= timeout_s + 15 and named and not leftover.strip(),
        "rc": rc, "exit_after_kill_s": took, "timeout_s": timeout_s, "named": named,
        "processes_left": leftover.split(), "output": out[-2500:],
    }
