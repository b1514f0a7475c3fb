#!/usr/bin/env python3
"""Greedy generation with transformers from a Hugging Face directory (here zrun's export):

    .venv/bin/python examples/finetune-hf/generate.py MODEL_DIR PROMPT [MAX_NEW_TOKENS]

Prints the prompt with its continuation, then a line `ids: 1,2,3` of the new token ids.
Nothing is downloaded.
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging  # noqa: E402

logging.disable_progress_bar()


def main():
    model_dir, prompt = sys.argv[1], sys.argv[2]
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
        )
    gen = out[0, ids.shape[1]:].tolist()
    print(prompt + tok.decode(gen, skip_special_tokens=True))
    print("ids: " + ",".join(str(i) for i in gen))


if __name__ == "__main__":
    main()
