#!/usr/bin/env python3
"""A small Llama with random weights and a byte-level BPE tokenizer trained on TEXT, saved as
a Hugging Face model directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) that `model.init_from` reads:

    .venv/bin/python examples/finetune-hf/make_model.py TEXT OUT_DIR

Nothing is downloaded.
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import logging  # noqa: E402

logging.disable_progress_bar()

EOS = "<|endoftext|>"


def train_tokenizer(text_path, vocab_size):
    """Byte-level BPE (as GPT-2's): every byte is a token, merges learned from the text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([text_path], trainer)
    return tok


def main():
    text_path, out = sys.argv[1], sys.argv[2]
    tok = train_tokenizer(text_path, vocab_size=512)
    # tokenizer.json and tokenizer_config.json, so that AutoTokenizer loads it.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(out)

    eos = tok.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),  # every token id of the tokenizer, no more
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per kv head
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # safe_serialization: transformers 4.x's switch to safetensors (5.x always writes them).
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: Llama, {n:,} parameters, vocabulary {config.vocab_size}")


if __name__ == "__main__":
    main()
