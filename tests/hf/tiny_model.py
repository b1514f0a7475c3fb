#!/usr/bin/env python3
"""Tiny transformers models for zrun-models' Hugging Face test
(crates/zrun-models/tests/transformers.rs), all in one process:

    .venv/bin/python tests/hf/tiny_model.py SPEC.json

SPEC.json is {"cases": [case, ...]}. Each case names a directory "dir" and does one of:

- "build": {"config": {...}, "seed": s, "std": x}: a GPT2LMHeadModel or LlamaForCausalLM
  (by the config's model_type) with random weights, matrices and embeddings drawn from
  Normal(0, x), norm weights from 1 + Normal(0, 0.1), biases from Normal(0, 0.1), saved to
  "dir" with save_pretrained(safe_serialization=True); then as "load".
- "load": true: AutoModelForCausalLM.from_pretrained("dir") (config.json and
  model.safetensors written by zrun).
- "inspect": true: only config.json, read with AutoConfig; the model is built on the meta
  device to count its parameters, and for Llama the rotary inverse frequencies are computed.

"build" and "load" run the model in fp32 and write "dir"/expected.safetensors with "logits"
(fp32, of the case's "tokens", B x T) and "generated" (int64, greedy generate(do_sample=False)
from "prompt" with "new_tokens" more tokens, prompt included). "inspect" writes
"param_count" (int64, one element) and for Llama "inv_freq" (fp32). Nothing is downloaded:
the Hub is switched off before transformers is imported.
"""
import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402

logging.disable_progress_bar()


def randomize(model, seed, std):
    """Overwrite every parameter (a tied matrix once) with seeded random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(noise * std)
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:
                p.copy_(1.0 + noise * 0.1)


def no_special_tokens(model):
    """Greedy generation runs for exactly new_tokens: no end-of-text or padding token."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, None)


def run(case):
    out = case["dir"]
    if "inspect" in case:
        cfg = AutoConfig.from_pretrained(out)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        count = sum(p.numel() for p in model.parameters())
        result = {"param_count": torch.tensor([count], dtype=torch.int64)}
        if cfg.model_type == "llama":
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            rope = LlamaRotaryEmbedding(config=cfg)
            result["inv_freq"] = rope.inv_freq.detach().float().contiguous()
        save_file(result, os.path.join(out, "expected.safetensors"))
        return
    if "build" in case:
        b = case["build"]
        cfg = AutoConfig.for_model(**b["config"])
        model = AutoModelForCausalLM.from_config(cfg).float()
        randomize(model, b["seed"], b["std"])
        model.save_pretrained(out, safe_serialization=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(out).float()
    model.eval()
    no_special_tokens(model)
    tokens = torch.tensor(case["tokens"], dtype=torch.int64)
    prompt = torch.tensor(case["prompt"], dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float().contiguous()
        generated = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=case["new_tokens"],
            min_new_tokens=case["new_tokens"],
            do_sample=False,
        )
    save_file(
        {"logits": logits, "generated": generated.contiguous()},
        os.path.join(out, "expected.safetensors"),
    )


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for case in spec["cases"]:
        run(case)


if __name__ == "__main__":
    main()
