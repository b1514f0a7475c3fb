"""The PyTorch side of the GPU speed check: zrun's GPT (the same module benches/fsdp2_compare.py
mirrors it with) trained in plain PyTorch eager on one GPU, as a PyTorch user would write it:
fp32 parameters (the master weights), bf16 autocast, SDPA attention, gradient clipping at 1.0
and torch.optim.AdamW(fused=True). Prints one JSON line: the median step time after warm-up,
tokens/s and the CUDA caching allocator's peaks.

    python3 benches/gpu/torch_gpt.py --layers 24 --heads 16 --d-model 1024 --micro-batch 8
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fsdp2_compare import build_gpt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args()

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(1234)
    dev = torch.device("cuda")
    cfg = {
        "vocab": args.vocab,
        "seq_len": args.seq_len,
        "n_layer": args.layers,
        "n_head": args.heads,
        "d_model": args.d_model,
        "init_std": 0.02,
    }
    model = build_gpt(nn, F, torch, cfg).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    B, T, V = args.micro_batch, args.seq_len, args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        idx = torch.randint(0, V, (B, T + 1), device=dev, generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with amp:
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, V), idx[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[args.warmup:])
    print(
        json.dumps(
            {
                "side": "pytorch-eager",
                "precision": args.precision,
                "params": sum(p.numel() for p in model.parameters()),
                "step_time_s": step,
                "tokens_per_s": B * T / step,
                "max_memory_allocated": torch.cuda.max_memory_allocated(),
                "max_memory_reserved": torch.cuda.max_memory_reserved(),
                "first_loss": losses[0],
                "last_loss": losses[-1],
            }
        )
    )


if __name__ == "__main__":
    main()
