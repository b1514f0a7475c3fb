#!/usr/bin/env python3
"""One AdamW step of a transformers model on a fixed batch, as zrun takes it, for
crates/zrun-train/tests/hf.rs:

    .venv/bin/python tests/hf/train_step.py SPEC.json

SPEC.json: {"cases": [case, ...]}, each case {"dir": model directory, "inputs": [[...]], "targets": [[...]], "lr": x,
"betas": [b1, b2], "eps": e, "weight_decay": w}. The loss is the mean cross-entropy of the
logits of "inputs" against "targets" (B x T, already shifted); AdamW decays matrices and
embeddings only (zrun's rule), no clipping. Writes "dir"/step.safetensors: "loss" (fp32, one
element) and every parameter after the step under its transformers name (a tied matrix once,
under the name save_pretrained keeps).
"""
import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def step(spec):
    d = spec["dir"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(d).float()
    model.eval()  # no dropout (GPT-2 configs default to 0.1); gradients still flow
    inputs = torch.tensor(spec["inputs"], dtype=torch.int64)
    targets = torch.tensor(spec["targets"], dtype=torch.int64)
    logits = model(input_ids=inputs).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec["weight_decay"]},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=spec["lr"],
        betas=tuple(spec["betas"]),
        eps=spec["eps"],
    )
    opt.step()
    saved = set(load_file(os.path.join(d, "model.safetensors")).keys())
    out = {"loss": loss.detach().reshape(1)}
    for name, p in model.state_dict().items():
        if name in saved:
            out[name] = p.detach().float().contiguous()
    save_file(out, os.path.join(d, "step.safetensors"))


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for case in spec["cases"]:
        step(case)


if __name__ == "__main__":
    main()
