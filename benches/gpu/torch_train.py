"""The PyTorch side of the GPU speed checks: the model zrun trains, in plain PyTorch on one GPU,
as a PyTorch user would write it: fp32 parameters (the master weights), bf16 autocast, SDPA
attention, the loss on fp32 logits, gradient clipping at 1.0 and torch.optim.AdamW(fused=True
on CUDA); eager, or the model under `torch.compile` (default mode). Prints one JSON line: the
median step time after warm-up (which includes compilation), tokens/s and the caching
allocator's peaks, or `"oom": true` when a step ran out of memory.

    python3 benches/gpu/torch_train.py --micro-batch 8                       # gpt2-medium, eager
    python3 benches/gpu/torch_train.py --arch llama --micro-batch 4 --compile  # llama3.2-1b
    python3 benches/gpu/torch_train.py --device cpu --layers 2 --d-model 64 --heads 4 --vocab 256 \\
        --seq-len 32 --micro-batch 2 --steps 3 --warmup 1                     # the script itself

GPT: zrun's GPT (benches/fsdp2_compare.py's mirror of it). Llama: zrun's Llama (RMSNorm, RoPE,
grouped-query SDPA, SwiGLU), by default the `llama3.2-1b` preset's shapes (1,235,814,400
parameters, tied head); the RoPE frequencies are Llama 3's without its long-context scaling,
which changes no FLOP.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fsdp2_compare import build_gpt  # noqa: E402

# `llama3.2-1b` (crates/zrun-models/src/llama/config.rs)
LLAMA_1B = {"vocab": 128256, "seq_len": 2048, "n_layer": 16, "n_head": 32, "n_kv_head": 8,
            "d_model": 2048, "head_dim": 64, "ffn": 8192, "theta": 500000.0, "tied": True}


def build_llama(nn, F, torch, c):
    """zrun's Llama in PyTorch: embedding, pre-norm blocks (RMSNorm, q/k/v/o projections
    without bias, RoPE, causal grouped-query SDPA, SwiGLU MLP), final RMSNorm, a head tied to
    the embedding or not. Init: Normal(0.02), RMSNorm weights 1."""
    V, C, L, H, KV, D = c["vocab"], c["d_model"], c["n_layer"], c["n_head"], c["n_kv_head"], c["head_dim"]

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
            return self.weight * h.to(x.dtype)

    def rope(x, cos, sin):  # x: (B, heads, T, D), rotate-half pairing as Hugging Face's
        a, b = x[..., : D // 2], x[..., D // 2:]
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = RMSNorm()
            self.q = nn.Linear(C, H * D, bias=False)
            self.k = nn.Linear(C, KV * D, bias=False)
            self.v = nn.Linear(C, KV * D, bias=False)
            self.o = nn.Linear(H * D, C, bias=False)
            self.mlp_norm = RMSNorm()
            self.gate = nn.Linear(C, c["ffn"], bias=False)
            self.up = nn.Linear(C, c["ffn"], bias=False)
            self.down = nn.Linear(c["ffn"], C, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = self.q(h).view(B, T, H, D).transpose(1, 2)
            k = self.k(h).view(B, T, KV, D).transpose(1, 2)
            v = self.v(h).view(B, T, KV, D).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(y.transpose(1, 2).reshape(B, T, H * D))
            h = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, C)
            self.layers = nn.ModuleList([Block() for _ in range(L)])
            self.norm = RMSNorm()
            self.head = nn.Linear(C, V, bias=False)
            if c["tied"]:
                self.head.weight = self.embed.weight
            inv = 1.0 / c["theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
            ang = torch.outer(torch.arange(c["seq_len"], dtype=torch.float32), inv)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, idx):
            T = idx.shape[1]
            x = self.embed(idx)
            cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
            for b in self.layers:
                x = b(x, cos, sin)
            return self.head(self.norm(x))

    model = Llama()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, 0.0, 0.02)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--vocab", type=int, help="default: 50304 (gpt), 128256 (llama)")
    ap.add_argument("--seq-len", type=int, help="default: 1024 (gpt), 2048 (llama)")
    ap.add_argument("--layers", type=int, help="default: 24 (gpt), 16 (llama)")
    ap.add_argument("--heads", type=int, help="default: 16 (gpt), 32 (llama)")
    ap.add_argument("--d-model", type=int, help="default: 1024 (gpt), 2048 (llama)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (default mode)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(1234)
    dev = torch.device(args.device)
    pick = lambda v, gpt, llama: v if v is not None else (gpt if args.arch == "gpt" else llama)  # noqa: E731
    V = pick(args.vocab, 50304, LLAMA_1B["vocab"])
    T = pick(args.seq_len, 1024, LLAMA_1B["seq_len"])
    L = pick(args.layers, 24, LLAMA_1B["n_layer"])
    H = pick(args.heads, 16, LLAMA_1B["n_head"])
    C = pick(args.d_model, 1024, LLAMA_1B["d_model"])
    if args.arch == "gpt":
        cfg = {"vocab": V, "seq_len": T, "n_layer": L, "n_head": H, "d_model": C, "init_std": 0.02}
        model = build_gpt(nn, F, torch, cfg)
    else:
        # Other shapes keep the preset's proportions: head 64, 4 heads a kv head, F = 4C.
        custom = (V, T, L, H, C) != tuple(LLAMA_1B[k] for k in ["vocab", "seq_len", "n_layer", "n_head", "d_model"])
        cfg = {**LLAMA_1B, "vocab": V, "seq_len": T, "n_layer": L, "n_head": H, "d_model": C}
        if custom:
            cfg.update(head_dim=C // H, n_kv_head=max(1, H // 4), ffn=4 * C)
        model = build_llama(nn, F, torch, cfg)
    model = model.to(dev)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda",
    )
    forward = torch.compile(model) if args.compile else model
    B = args.micro_batch
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    side = f"pytorch-{'compile' if args.compile else 'eager'}"
    row = {"side": side, "arch": args.arch, "precision": args.precision, "params": params,
           "micro_batch": B, "seq_len": T}
    try:
        for _ in range(args.steps):
            idx = torch.randint(0, V, (B, T + 1), device=dev, generator=gen)
            sync()
            t0 = time.perf_counter()
            with amp:
                logits = forward(idx[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, V), idx[:, 1:].reshape(-1))
            loss.backward()
            del logits
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            sync()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        print(json.dumps({**row, "oom": True}))
        return
    step = statistics.median(times[args.warmup:])
    row.update({
        "step_time_s": step,
        "tokens_per_s": B * T / step,
        "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "first_step_s": times[0],
    })
    print(json.dumps(row))


if __name__ == "__main__":
    main()
