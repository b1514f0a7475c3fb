#!/usr/bin/env python3
"""zrun against PyTorch FSDP2 on CPU ranks: same GPT, batch, sequence, steps and AdamW.

    python benches/fsdp2_compare.py                       # configs/bench-cpu.toml, 2 ranks
    python benches/fsdp2_compare.py --steps 10 --json     # shorter; one JSON line per row too
    python benches/fsdp2_compare.py --set model.n_layer=6 --set model.d_model=384 ...  # another shape

Runs, one after another, each on `--nproc` processes with one libtorch thread per rank:
  FSDP2 `fully_shard` (gloo) with reshard_after_forward=True and False (every block sharded,
  then the root), then zrun at ZeRO stages 2 and 3 (OMP_NUM_THREADS=1).
Reports the median tokens/s over the steps after the first (the global batch's tokens over
one optimizer step's wall time, as zrun's summary.json does) and each rank's peak RSS
(ru_maxrss for PyTorch, VmHWM for zrun: the same kernel counter). zrun stage 3 is paired
with reshard_after_forward=True (parameters freed after forward) and stage 2 with False
(parameters kept gathered from forward to backward), and the ratio column is zrun/FSDP2.
The config's model/train keys drive both sides; FSDP2 trains on uniformly random tokens.
"""
import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


# ----------------------------------------------------------------------------------------------
# PyTorch side (runs inside each worker process; torch is imported there only).


def build_gpt(nn, F, torch, cfg):
    """zrun's GPT in PyTorch: token + learned position embeddings, pre-LN blocks with a fused
    qkv Linear and causal SDPA, GELU(tanh) MLP, final LayerNorm, untied lm_head without bias.
    Init: Normal(0.02); residual projections 0.02/sqrt(2L); zero biases; LayerNorm (1, 0)."""
    V, T, L, H, C = cfg["vocab"], cfg["seq_len"], cfg["n_layer"], cfg["n_head"], cfg["d_model"]
    std = cfg["init_std"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=1e-5)
            self.qkv = nn.Linear(C, 3 * C)
            self.attn_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C, eps=1e-5)
            self.fc = nn.Linear(C, 4 * C)
            self.mlp_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            B, Tn, _ = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)  # (B, T, C) each
            q = q.view(B, Tn, H, C // H).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, Tn, H, C // H).transpose(1, 2)
            v = v.view(B, Tn, H, C // H).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
            y = y.transpose(1, 2).reshape(B, Tn, C)  # (B, T, C)
            x = x + self.attn_proj(y)
            h = F.gelu(self.fc(self.ln_2(x)), approximate="tanh")  # (B, T, 4C)
            return x + self.mlp_proj(h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            self.lm_head = nn.Linear(C, V, bias=False)

        def forward(self, idx):
            Tn = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(Tn, device=idx.device))  # (B, T, C)
            for b in self.h:
                x = b(x)
            return self.lm_head(self.ln_f(x))  # (B, T, V)

    model = GPT()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif "ln_" in name:
            nn.init.ones_(p)
        elif name.endswith("attn_proj.weight") or name.endswith("mlp_proj.weight"):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * L))
        else:
            nn.init.normal_(p, 0.0, std)
    return model


def rss_now():
    """Resident bytes of this process now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fsdp2_worker(args):
    """One FSDP2 rank: trains `steps` steps, writes its timings and RSS as JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = json.loads(args.worker_cfg)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    base_rss = rss_now()

    torch.manual_seed(cfg["seed"])  # the same full model on every rank before sharding
    model = build_gpt(nn, F, torch, cfg)
    params = sum(p.numel() for p in model.parameters())
    reshard = cfg["reshard"]
    for block in model.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["lr"],
        betas=(cfg["beta1"], cfg["beta2"]),
        eps=cfg["eps"],
    )
    steps, B, T, V = cfg["steps"], cfg["micro_batch"], cfg["seq_len"], cfg["vocab"]
    lr, min_lr = cfg["lr"], cfg["lr"] / 10
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens_per_step = B * T * world
    times, losses = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        # cosine decay from lr to lr/10 over the run, no warmup (zrun's schedule with these keys)
        cur = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * step / max(1, steps)))
        for g in opt.param_groups:
            g["lr"] = cur
        x = torch.randint(0, V, (B, T), generator=gen)
        y = torch.randint(0, V, (B, T), generator=gen)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, V), y.view(-1))  # (B*T, V) against (B*T)
        loss.backward()
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        lt = loss.detach().clone()
        dist.all_reduce(lt)  # the global batch's loss, as zrun reports it each step
        losses.append(lt.item() / world)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out = {
        "rank": rank,
        "params": params,
        "step_times": times,
        "tokens_per_step": tokens_per_step,
        "losses": losses,
        "peak_rss_bytes": peak,
        "base_rss_bytes": base_rss,
    }
    Path(args.worker_out).joinpath(f"rank-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Driver.


def median(xs):
    """Median of a list (NaN when empty), as zrun's summary computes it."""
    v = sorted(xs)
    n = len(v)
    if n == 0:
        return float("nan")
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def bench_config(path, steps, sets=()):
    """The keys both systems share, read from the zrun config (zrun's defaults where absent)
    with `sets` (`section.key=value`, TOML values, as zrun's --set) applied."""
    t = tomllib.loads(Path(path).read_text())
    for kv in sets:
        key, _, value = kv.partition("=")
        section, _, name = key.strip().partition(".")
        if not name or not value:
            raise SystemExit(f"--set {kv!r}: write section.key=value, e.g. model.n_layer=6")
        t.setdefault(section, {})[name] = tomllib.loads(f"v = {value}")["v"]
    m, tr = t.get("model", {}), t.get("train", {})
    for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
        if k not in m:
            raise SystemExit(f"{path}: [model] {k} must be set explicitly for the comparison")
    if t.get("zero", {}).get("precision", "fp32") != "fp32" or tr.get("grad_accum", 1) != 1:
        raise SystemExit(f"{path}: the comparison supports precision fp32 and grad_accum 1 only")
    lr = tr.get("lr", 3e-4)
    return {
        "vocab": m["vocab_size"],
        "seq_len": m["seq_len"],
        "n_layer": m["n_layer"],
        "n_head": m["n_head"],
        "d_model": m["d_model"],
        "init_std": m.get("init_std", 0.02),
        "steps": steps or tr.get("steps", 100),
        "micro_batch": tr.get("micro_batch", 8),
        "lr": lr,
        "weight_decay": tr.get("weight_decay", 0.1),
        "beta1": tr.get("beta1", 0.9),
        "beta2": tr.get("beta2", 0.95),
        "eps": tr.get("eps", 1e-8),
        "grad_clip": tr.get("grad_clip", 1.0),
        "seed": tr.get("seed", 1234),
    }


def run_fsdp2(cfg, nproc, reshard, work):
    """One FSDP2 run on `nproc` worker processes; rank 0's median tokens/s after the first step."""
    out = Path(work) / f"fsdp2-reshard-{reshard}"
    out.mkdir(parents=True, exist_ok=True)
    wcfg = json.dumps(dict(cfg, reshard=reshard))
    argv = [sys.executable, __file__, "--worker-cfg", wcfg, "--worker-out", str(out)]
    common.run_ranks(lambda _r: argv, nproc, env_extra={"OMP_NUM_THREADS": "1"}, log_dir=out, what=f"FSDP2 reshard_after_forward={reshard}")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]
    r0 = ranks[0]
    rates = [r0["tokens_per_step"] / dt for dt in r0["step_times"][1:]] or [r0["tokens_per_step"] / r0["step_times"][0]]
    return {
        "system": "FSDP2",
        "config": f"reshard_after_forward={reshard}",
        "tokens_per_s": median(rates),
        "best_tokens_per_s": max(rates),
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "base_rss_bytes": [r["base_rss_bytes"] for r in ranks],
        "params": r0["params"],
        "final_loss": r0["losses"][-1],
    }


def run_zrun(config, cfg, nproc, stage, work, sets=()):
    """One zrun run at `stage`, read from its summary.json."""
    s = common.run_zrun(
        config,
        list(sets) + [f"zero.stage={stage}", f"train.steps={cfg['steps']}", "log.every=1"],
        nproc,
        Path(work) / f"zrun-stage-{stage}",
        threads=1,
    )
    lines = (Path(work) / f"zrun-stage-{stage}" / "metrics.jsonl").read_text().splitlines()
    rates = [json.loads(line)["tokens_per_s"] for line in lines][1:]  # log.every = 1
    return {
        "system": "zrun",
        "config": f"zero.stage={stage}",
        "tokens_per_s": s["tokens_per_s"],
        "best_tokens_per_s": max(rates) if rates else s["tokens_per_s"],
        "peak_rss_bytes": s["peak_rss_bytes"],
        "base_rss_bytes": s.get("base_rss_bytes"),
        "params": s["params"],
        "final_loss": s["final_loss"],
    }


ORDER = [("FSDP2", True), ("FSDP2", False), ("zrun", 2), ("zrun", 3)]
PAIRS = {("zrun", 2): ("FSDP2", False), ("zrun", 3): ("FSDP2", True)}


def combine(runs):
    """One row from the repeats of one configuration: median tokens/s, largest peak RSS."""
    row = dict(runs[0])
    row["tokens_per_s"] = median([r["tokens_per_s"] for r in runs])
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    row["best_tokens_per_s"] = max(r["best_tokens_per_s"] for r in runs)
    row["peak_rss_bytes"] = [max(col) for col in zip(*[r["peak_rss_bytes"] for r in runs])]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(common.ROOT / "configs" / "bench-cpu.toml"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="override train.steps (0: the config's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over the four configurations, interleaved; tokens/s is the median over rounds")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for both sides, as zrun's --set (model.*, train.micro_batch, ...)")
    ap.add_argument("--json", action="store_true", help="also print one JSON object per row")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (rank logs, summaries)")
    ap.add_argument("--worker-cfg", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_cfg:
        return fsdp2_worker(args)

    cfg = bench_config(args.config, args.steps, args.set)
    work = Path(tempfile.mkdtemp(prefix="zrun-fsdp2-"))
    common.ensure_zrun(work)
    load0 = common.load_average()
    runs = {k: [] for k in ORDER}
    t0 = time.perf_counter()
    for i in range(args.repeat):
        rw = work / f"round-{i}"
        for reshard in (True, False):
            runs[("FSDP2", reshard)].append(run_fsdp2(cfg, args.nproc, reshard, rw))
        for stage in (2, 3):
            runs[("zrun", stage)].append(run_zrun(args.config, cfg, args.nproc, stage, rw, args.set))
    elapsed = time.perf_counter() - t0
    rows = {k: combine(v) for k, v in runs.items()}
    for k, ref in PAIRS.items():
        z, f = rows[k], rows[ref]
        z["vs"] = f"FSDP2 {f['config']}"
        z["tokens_ratio"] = z["tokens_per_s"] / f["tokens_per_s"]
        z["best_ratio"] = z["best_tokens_per_s"] / f["best_tokens_per_s"]
        z["rss_ratio"] = max(z["peak_rss_bytes"]) / max(f["peak_rss_bytes"])

    print(
        f"# {args.nproc} CPU ranks x 1 thread; GPT L={cfg['n_layer']} H={cfg['n_head']} C={cfg['d_model']} "
        f"V={cfg['vocab']} T={cfg['seq_len']}, micro_batch {cfg['micro_batch']}/rank, fp32, AdamW, "
        f"{cfg['steps']} steps x {args.repeat} round(s); params zrun {rows[('zrun', 2)]['params']}, "
        f"FSDP2 {rows[('FSDP2', True)]['params']}"
    )
    print(f"# load average before {load0:.2f}, after {common.load_average():.2f} "
          f"(machine has {os.cpu_count()} cores); {elapsed:.0f} s")
    print(f"{'system':<6} {'config':<28} {'tokens/s':>9} {'best':>6} {'peak RSS/rank (MiB)':>20} "
          f"{'peak-base (MiB)':>16} {'tok/s ratio':>12} {'best ratio':>11} {'RSS ratio':>10}")
    for k in ORDER:
        r = rows[k]
        rss = " / ".join(f"{b / common.MIB:.0f}" for b in r["peak_rss_bytes"])
        base = r.get("base_rss_bytes")
        grow = " / ".join(f"{(p - b) / common.MIB:.0f}" for p, b in zip(r["peak_rss_bytes"], base)) if base else "n/a"
        tr = f"{r['tokens_ratio']:.2f}x" if "tokens_ratio" in r else "-"
        br = f"{r['best_ratio']:.2f}x" if "best_ratio" in r else "-"
        rr = f"{r['rss_ratio']:.2f}x" if "rss_ratio" in r else "-"
        print(f"{r['system']:<6} {r['config']:<28} {r['tokens_per_s']:>9.0f} {r['best_tokens_per_s']:>6.0f} {rss:>20} "
              f"{grow:>16} {tr:>12} {br:>11} {rr:>10}")
    print("# ratio = zrun / FSDP2: stage 2 vs reshard_after_forward=False, stage 3 vs True; the RSS ratio")
    print("# compares the largest rank's peak RSS (whole process: FSDP2's includes the Python interpreter and")
    print("# torch's import, see peak-base). 'best' is the fastest single step after the first (least")
    print("# disturbed by other load). Target at stage 3: tok/s ratio >= 1.15x with RSS ratio <= 0.45x.")
    if args.repeat > 1:
        for k in ORDER:
            print(f"# {k[0]} {rows[k]['config']}: tokens/s per round " +
                  ", ".join(f"{x:.0f}" for x in rows[k]["tokens_per_s_runs"]))
    if args.json:
        for k in ORDER:
            print(json.dumps(rows[k]))
    common.clean_up(work, args.keep)


if __name__ == "__main__":
    main()
